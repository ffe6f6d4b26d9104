#include "mds/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <set>

#include <xxhash.h>

#include "mds/manifest.h"

namespace minids::mds {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

#define WRITER_FAULT(msg)                                                      \
    throw WriterError(std::string(__FILE__) + ":" + std::to_string(__LINE__) + \
                      ": internal: " + (msg))

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

// Elements × element size, refusing shapes whose byte count would overflow.
uint64_t shape_bytes(mgl::dtype t, const std::vector<int64_t>& shape, const std::string& what) {
    if (shape.empty() || shape.size() > size_t(mds_max_dims))
        WRITER_FAULT(what + ": expected 1.." + std::to_string(mds_max_dims) + " dims, found " +
                     std::to_string(shape.size()));
    uint64_t n = manifest_dtype_size(t);
    for (int64_t d : shape) {
        if (d < 0) WRITER_FAULT(what + ": negative dimension");
        if (d != 0 && n > (uint64_t(1) << 62) / uint64_t(d))
            WRITER_FAULT(what + ": shape too large");
        n *= uint64_t(d);
    }
    return n;
}

}  // namespace

std::string xxh3_hex(uint64_t h) {
    static const char digits[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 15; i >= 0; --i, h >>= 4) s[size_t(i)] = digits[h & 15];
    return s;
}

ExpertLayout ExpertLayout::make(mgl::dtype dtype, int64_t n_embd, int64_t n_ff) {
    if (dtype != mgl::dtype::bf16 && dtype != mgl::dtype::f8_e4m3)
        WRITER_FAULT(std::string("expert dtype must be bf16 or f8_e4m3, got ") +
                     manifest_dtype_name(dtype));
    if (n_embd <= 0 || n_ff <= 0) WRITER_FAULT("expert sizes must be positive");
    ExpertLayout l;
    l.dtype = dtype;
    l.n_embd = n_embd;
    l.n_ff = n_ff;
    uint64_t pos = 0;
    auto add = [&](const char* name, mgl::dtype t, std::vector<int64_t> shape) {
        Part p;
        p.name = name;
        p.dtype = t;
        p.nbytes = shape_bytes(t, shape, name);
        p.shape = std::move(shape);
        p.offset = align_up(pos, mds_expert_part_alignment);
        pos = p.offset + p.nbytes;
        l.parts.push_back(std::move(p));
    };
    add("gate", dtype, {n_ff, n_embd});
    add("up", dtype, {n_ff, n_embd});
    add("down", dtype, {n_embd, n_ff});
    if (dtype == mgl::dtype::f8_e4m3) {
        add("gate_scale", mgl::dtype::f32, {n_ff});
        add("up_scale", mgl::dtype::f32, {n_ff});
        add("down_scale", mgl::dtype::f32, {n_embd});
    }
    l.blob_nbytes = pos;
    return l;
}

const ExpertLayout::Part& ExpertLayout::part(const char* name) const {
    for (const Part& p : parts)
        if (std::strcmp(p.name, name) == 0) return p;
    WRITER_FAULT(std::string("no expert part named ") + name);
}

json ExpertLayout::to_json() const {
    json j = json::object();
    for (const Part& p : parts)
        j[p.name] = {
            {"offset", p.offset}, {"dtype", manifest_dtype_name(p.dtype)}, {"shape", p.shape}};
    return j;
}

void AlignedBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

void AlignedBuffer::resize(size_t n) {
    const size_t padded = (n + mds_alignment - 1) / mds_alignment * mds_alignment;
    if (padded > capacity_ || !mem_) {
        const size_t cap = std::max<size_t>(padded, mds_alignment);
        auto* p = static_cast<uint8_t*>(std::aligned_alloc(mds_alignment, cap));
        if (!p)
            throw WriterError("out of memory allocating a " + std::to_string(cap) + "-byte buffer");
        if (mem_)
            std::memcpy(p, mem_.get(), std::min(size_, n));
        else
            size_ = 0;
        mem_.reset(p);
        capacity_ = cap;
    }
    const size_t keep = std::min(size_, n);
    std::memset(mem_.get() + keep, 0, padded - keep);
    size_ = n;
}

MdsWriter::MdsWriter(fs::path out_path, bool overwrite)
    : out_path_(std::move(out_path)), overwrite_(overwrite) {}

MdsWriter::~MdsWriter() {
    if (direct_fd_ >= 0) ::close(direct_fd_);
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && fd_ != -1) {
        std::error_code ec;
        fs::remove(tmp_path(), ec);
    }
}

fs::path MdsWriter::tmp_path() const { return temp_path_for(out_path_); }

size_t MdsWriter::add_tensor(const std::string& name, mgl::dtype dtype,
                             std::vector<int64_t> shape) {
    if (planned_) WRITER_FAULT("add_tensor after plan()");
    Item it;
    it.name = name;
    it.dtype = dtype;
    it.nbytes = shape_bytes(dtype, shape, name);
    it.shape = std::move(shape);
    tensors_.push_back(std::move(it));
    return tensors_.size() - 1;
}

void MdsWriter::set_experts(const ExpertLayout& layout) {
    if (planned_) WRITER_FAULT("set_experts after plan()");
    layout_ = layout;
    has_experts_ = true;
}

size_t MdsWriter::add_expert_blob(int64_t layer, int64_t expert) {
    if (planned_) WRITER_FAULT("add_expert_blob after plan()");
    if (!has_experts_) WRITER_FAULT("add_expert_blob before set_experts()");
    if (!blobs_.empty()) {
        const Item& last = blobs_.back();
        if (layer < last.layer || (layer == last.layer && expert <= last.expert))
            WRITER_FAULT("expert blobs must be added in increasing (layer, expert) order");
    }
    Item it;
    it.layer = layer;
    it.expert = expert;
    it.nbytes = layout_.blob_nbytes;
    blobs_.push_back(std::move(it));
    return blobs_.size() - 1;
}

uint64_t MdsWriter::dense_bytes() const {
    uint64_t n = 0;
    for (const Item& t : tensors_) n += t.nbytes;
    return n;
}

json MdsWriter::manifest(bool with_checksums) const {
    auto sum = [with_checksums](const Item& it) { return xxh3_hex(with_checksums ? it.xxh3 : 0); };
    json tensors = json::array();
    for (const Item& t : tensors_)
        tensors.push_back({{"name", t.name},
                           {"dtype", manifest_dtype_name(t.dtype)},
                           {"shape", t.shape},
                           {"offset", t.offset},
                           {"nbytes", t.nbytes},
                           {"xxh3", sum(t)}});
    json experts = nullptr;
    if (has_experts_) {
        json blobs = json::array();
        for (const Item& b : blobs_)
            blobs.push_back(
                {{"layer", b.layer}, {"expert", b.expert}, {"offset", b.offset}, {"xxh3", sum(b)}});
        experts = {{"dtype", manifest_dtype_name(layout_.dtype)},
                   {"n_embd", layout_.n_embd},
                   {"n_ff", layout_.n_ff},
                   {"layout", layout_.to_json()},
                   {"blob_nbytes", layout_.blob_nbytes},
                   {"blobs", blobs}};
    }
    return {{"format", "minids"},       {"version", mds_version}, {"config", config_},
            {"tokenizer", tokenizer_},  {"tensors", tensors},     {"experts", experts},
            {"provenance", provenance_}};
}

void MdsWriter::plan() {
    if (planned_) WRITER_FAULT("plan() called twice");
    std::set<std::string> names;
    for (const Item& t : tensors_)
        if (!names.insert(t.name).second) WRITER_FAULT("duplicate tensor name " + t.name);
    // The manifest's length does not depend on offsets' digits only if we fix them first; offsets
    // depend on the manifest's length. Iterate: start from a guess, place, measure, repeat until
    // the data offset is stable (it changes at most a few times; each round can only grow it).
    data_offset_ = align_up(sizeof(mds_preamble), mds_alignment);
    for (int round = 0;; ++round) {
        if (round > 16) WRITER_FAULT("manifest layout did not converge");
        uint64_t pos = data_offset_;
        for (Item& t : tensors_) {
            t.offset = pos;
            pos = align_up(pos + t.nbytes, mds_alignment);
        }
        for (Item& b : blobs_) {
            b.offset = pos;
            pos = align_up(pos + b.nbytes, mds_alignment);
        }
        file_size_ = pos;
        manifest_len_ = manifest(false).dump().size();
        uint64_t need = align_up(sizeof(mds_preamble) + manifest_len_, mds_alignment);
        if (need <= data_offset_) break;
        data_offset_ = need;
    }
    if (manifest_len_ > mds_max_manifest_bytes)
        WRITER_FAULT("manifest of " + std::to_string(manifest_len_) +
                     " bytes exceeds the format's limit");
    planned_ = true;
}

void MdsWriter::open() {
    if (!planned_) WRITER_FAULT("open() before plan()");
    if (fd_ >= 0) WRITER_FAULT("open() called twice");
    std::error_code ec;
    if (!overwrite_ && fs::exists(out_path_, ec))
        throw WriterError(out_path_.string() +
                          ": the output file already exists (use --force to overwrite it)");
    tmp_registration_ = std::make_unique<TempFileRegistration>(tmp_path());
    fd_ = ::open(tmp_path().c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0)
        throw WriterError(tmp_path().string() + ": cannot create: " + std::strerror(errno));
    if (::ftruncate(fd_, off_t(file_size_)) != 0)
        throw WriterError(tmp_path().string() + ": cannot size to " + std::to_string(file_size_) +
                          " bytes: " + std::strerror(errno));
    // Not every file system supports O_DIRECT (tmpfs does not); then everything goes buffered.
    direct_fd_ = ::open(tmp_path().c_str(), O_WRONLY | O_DIRECT | O_CLOEXEC);
}

void MdsWriter::pwrite_all(int fd, const void* data, uint64_t nbytes, uint64_t offset) {
    const auto* p = static_cast<const uint8_t*>(data);
    while (nbytes > 0) {
        size_t chunk = size_t(std::min<uint64_t>(nbytes, uint64_t(1) << 30));
        ssize_t r = ::pwrite(fd, p, chunk, off_t(offset));
        if (r < 0) {
            if (errno == EINTR) continue;
            throw WriterError(tmp_path().string() + ": write failed at offset " +
                              std::to_string(offset) + ": " + std::strerror(errno));
        }
        if (r == 0)
            throw WriterError(tmp_path().string() + ": write made no progress (disk full?)");
        p += r;
        offset += uint64_t(r);
        nbytes -= uint64_t(r);
    }
}

void MdsWriter::write_item(Item& item, const void* data, uint64_t nbytes, const char* what,
                           const AlignedBuffer* direct) {
    if (fd_ < 0) WRITER_FAULT(std::string(what) + " written before open()");
    if (nbytes != item.nbytes)
        WRITER_FAULT(std::string(what) + " " + item.name + ": expected " +
                     std::to_string(item.nbytes) + " bytes, got " + std::to_string(nbytes));
    if (item.written.exchange(true))
        WRITER_FAULT(std::string(what) + " " + item.name + " written twice");
    item.xxh3 = XXH3_64bits(data, size_t(nbytes));
    // O_DIRECT writes whole 4096-byte blocks: the buffer's zero tail becomes the item's padding,
    // which must be zero anyway and which no other item shares (items start on 4096 boundaries).
    if (direct && direct_fd_ >= 0 && direct_ok_.load()) {
        ssize_t r = ::pwrite(direct_fd_, direct->data(), direct->padded_size(), off_t(item.offset));
        if (r == ssize_t(direct->padded_size())) {
            bytes_written_ += nbytes;
            return;
        }
        // Refused (EINVAL on some file systems) or short: buffered writes from now on (the
        // descriptor stays open until commit so no thread can race on a reused number). A short
        // direct write is simply rewritten in full below.
        direct_ok_ = false;
    }
    if (!direct && direct_fd_ >= 0 && direct_ok_.load() &&
        write_direct_bounced(item, static_cast<const uint8_t*>(data), nbytes)) {
        bytes_written_ += nbytes;
        return;
    }
    pwrite_all(fd_, data, nbytes, item.offset);
    bytes_written_ += nbytes;
}

std::unique_ptr<AlignedBuffer> MdsWriter::take_bounce() {
    {
        std::lock_guard<std::mutex> lock(bounce_mu_);
        if (!bounce_free_.empty()) {
            auto b = std::move(bounce_free_.back());
            bounce_free_.pop_back();
            return b;
        }
    }
    return std::make_unique<AlignedBuffer>();
}

void MdsWriter::give_bounce(std::unique_ptr<AlignedBuffer> b) {
    std::lock_guard<std::mutex> lock(bounce_mu_);
    bounce_free_.push_back(std::move(b));
}

// Copies caller memory through an aligned buffer in 8 MiB chunks (chunk offsets stay 4096-aligned;
// the last chunk's zero tail is the item's padding). False if O_DIRECT was refused: the caller
// then rewrites the whole item buffered.
bool MdsWriter::write_direct_bounced(const Item& item, const uint8_t* data, uint64_t nbytes) {
    constexpr uint64_t chunk = uint64_t(8) << 20;
    std::unique_ptr<AlignedBuffer> buf = take_bounce();
    bool ok = true;
    for (uint64_t pos = 0; pos < nbytes; pos += chunk) {
        const size_t n = size_t(std::min(chunk, nbytes - pos));
        buf->resize(n);
        std::memcpy(buf->data(), data + pos, n);
        ssize_t r = ::pwrite(direct_fd_, buf->data(), buf->padded_size(), off_t(item.offset + pos));
        if (r != ssize_t(buf->padded_size())) {
            direct_ok_ = false;
            ok = false;
            break;
        }
    }
    give_bounce(std::move(buf));
    return ok;
}

void MdsWriter::write_tensor(size_t id, const void* data, uint64_t nbytes) {
    write_item(tensors_.at(id), data, nbytes, "tensor", nullptr);
}

void MdsWriter::write_blob(size_t id, const void* data, uint64_t nbytes) {
    write_item(blobs_.at(id), data, nbytes, "expert blob", nullptr);
}

void MdsWriter::write_tensor(size_t id, const AlignedBuffer& buf) {
    write_item(tensors_.at(id), buf.data(), buf.size(), "tensor", &buf);
}

void MdsWriter::write_blob(size_t id, const AlignedBuffer& buf) {
    write_item(blobs_.at(id), buf.data(), buf.size(), "expert blob", &buf);
}

void MdsWriter::commit() {
    if (fd_ < 0) WRITER_FAULT("commit() before open()");
    for (const Item& t : tensors_)
        if (!t.written) WRITER_FAULT("tensor " + t.name + " was never written");
    for (const Item& b : blobs_)
        if (!b.written)
            WRITER_FAULT("expert blob (layer " + std::to_string(b.layer) + ", expert " +
                         std::to_string(b.expert) + ") was never written");
    std::string text = manifest(true).dump();
    if (text.size() != manifest_len_)
        WRITER_FAULT("manifest length changed between plan and commit (" +
                     std::to_string(manifest_len_) + " -> " + std::to_string(text.size()) + ")");
    mds_preamble pre{};
    std::memcpy(pre.magic, mds_magic, sizeof(pre.magic));
    pre.version = mds_version;
    pre.flags = 0;
    pre.manifest_len = manifest_len_;
    pre.data_offset = data_offset_;
    pre.manifest_xxh3 = XXH3_64bits(text.data(), text.size());
    pre.preamble_xxh3 = XXH3_64bits(&pre, offsetof(mds_preamble, preamble_xxh3));
    pwrite_all(fd_, text.data(), text.size(), sizeof(pre));
    pwrite_all(fd_, &pre, sizeof(pre), 0);
    if (direct_fd_ >= 0) {
        ::close(direct_fd_);
        direct_fd_ = -1;
    }
    if (::fsync(fd_) != 0)
        throw WriterError(tmp_path().string() + ": fsync failed: " + std::strerror(errno));
    if (::close(fd_) != 0) {
        fd_ = -2;  // closed (or unusable); the destructor still removes the tmp file
        throw WriterError(tmp_path().string() + ": close failed: " + std::strerror(errno));
    }
    fd_ = -2;
    std::error_code ec;
    if (!overwrite_ && fs::exists(out_path_, ec))
        throw WriterError(
            out_path_.string() +
            ": the output file appeared during conversion (use --force to overwrite it)");
    fs::rename(tmp_path(), out_path_, ec);
    if (ec)
        throw WriterError(out_path_.string() +
                          ": cannot rename the temporary file into place: " + ec.message());
    committed_ = true;
}

}  // namespace minids::mds
