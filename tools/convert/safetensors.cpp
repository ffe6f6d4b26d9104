#include "convert/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "util/json_fields.h"
#include "util/strict_json.h"

namespace minids::convert {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

[[noreturn]] void fail(const fs::path& file, const std::string& msg) {
    throw InputError(file.string() + ": " + msg);
}

struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

bool parse_dtype(const std::string& s, StDtype& out) {
    if (s == "BF16")
        out = StDtype::bf16;
    else if (s == "F16")
        out = StDtype::f16;
    else if (s == "F32")
        out = StDtype::f32;
    else
        return false;
    return true;
}

uint64_t json_u64(const fs::path& file, const std::string& field, const json& v) {
    if (!v.is_number_unsigned() && !(v.is_number_integer() && v.get<int64_t>() >= 0))
        fail(file,
             "field \"" + field + "\": expected a non-negative integer, found " + describe_json(v));
    return v.get<uint64_t>();
}

}  // namespace

size_t st_dtype_size(StDtype t) { return t == StDtype::f32 ? 4 : 2; }

const char* st_dtype_name(StDtype t) {
    switch (t) {
        case StDtype::bf16:
            return "BF16";
        case StDtype::f16:
            return "F16";
        case StDtype::f32:
            return "F32";
    }
    return "?";
}

int64_t StTensor::nelements() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;  // bounded: nbytes was checked against the file size
    return n;
}

json parse_json_strict(const std::string& text, const std::string& what) {
    try {
        return minids::parse_json_strict(text);
    } catch (const JsonSyntaxError& e) {
        throw InputError(what + ": " + e.what());
    }
}

json read_json_file(const fs::path& path) {
    try {
        return read_json_file_strict(path);
    } catch (const FileReadError& e) {
        throw InputError(e.what());
    }
}

StHeader read_safetensors_header(const fs::path& path) {
    Fd f;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st {};
    if (::fstat(f.fd, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) fail(path, "expected a regular file");
    StHeader h;
    h.path = path;
    h.file_size = uint64_t(st.st_size);
    if (h.file_size < 8)
        fail(path, "file too short: expected at least 8 bytes (header length), found " +
                       std::to_string(h.file_size));
    uint8_t len_bytes[8];
    if (::pread(f.fd, len_bytes, 8, 0) != 8) fail(path, "cannot read the header length");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
    if (header_len > safetensors_max_header_bytes)
        fail(path, "header length: expected at most " +
                       std::to_string(safetensors_max_header_bytes) + " bytes, found " +
                       std::to_string(header_len));
    if (header_len > h.file_size - 8)
        fail(path, "header length: " + std::to_string(header_len) +
                       " bytes runs past the end of the file (" + std::to_string(h.file_size) +
                       " bytes)");
    std::string text(header_len, '\0');
    size_t got = 0;
    while (got < header_len) {
        ssize_t r = ::pread(f.fd, text.data() + got, header_len - got, off_t(8 + got));
        if (r <= 0) fail(path, "cannot read the header");
        got += size_t(r);
    }
    h.data_start = 8 + header_len;
    const uint64_t data_size = h.file_size - h.data_start;

    json j = parse_json_strict(text, path.string() + " header");
    if (!j.is_object()) fail(path, "header: expected a JSON object, found " + describe_json(j));
    for (auto it = j.begin(); it != j.end(); ++it) {
        const std::string& name = it.key();
        const json& v = it.value();
        if (name == "__metadata__") {
            if (!v.is_object())
                fail(path, "field \"__metadata__\": expected an object, found " + describe_json(v));
            for (auto m = v.begin(); m != v.end(); ++m)
                if (!m.value().is_string())
                    fail(path, "field \"__metadata__." + m.key() + "\": expected a string, found " +
                                   describe_json(m.value()));
            continue;
        }
        if (name.empty()) fail(path, "header: a tensor has an empty name");
        if (!v.is_object())
            fail(path, "tensor \"" + name + "\": expected an object, found " + describe_json(v));
        for (auto k = v.begin(); k != v.end(); ++k)
            if (k.key() != "dtype" && k.key() != "shape" && k.key() != "data_offsets")
                fail(path, "tensor \"" + name + "\": unknown field \"" + k.key() + "\"");
        StTensor t;
        t.name = name;
        auto dt = v.find("dtype");
        if (dt == v.end() || !dt->is_string())
            fail(path, "tensor \"" + name + "\": field \"dtype\": expected a string");
        if (!parse_dtype(dt->get<std::string>(), t.dtype))
            fail(path, "tensor \"" + name +
                           "\": field \"dtype\": expected BF16, F16 or F32, found \"" +
                           dt->get<std::string>() + "\"");
        auto sh = v.find("shape");
        if (sh == v.end() || !sh->is_array())
            fail(path, "tensor \"" + name + "\": field \"shape\": expected a list");
        if (sh->size() > 8)
            fail(path, "tensor \"" + name +
                           "\": field \"shape\": expected at most 8 dimensions, found " +
                           std::to_string(sh->size()));
        // Element count with overflow checks: every factor and partial product stays <= data_size.
        uint64_t elems = 1;
        for (const json& d : *sh) {
            uint64_t dim = json_u64(path, name + ".shape", d);
            if (dim != 0 && elems > data_size / dim)
                fail(path, "tensor \"" + name + "\": shape " + sh->dump() +
                               " needs more bytes than the file holds (" +
                               std::to_string(data_size) + ")");
            elems *= dim;
            t.shape.push_back(int64_t(dim));
        }
        auto off = v.find("data_offsets");
        if (off == v.end() || !off->is_array() || off->size() != 2)
            fail(path, "tensor \"" + name + "\": field \"data_offsets\": expected [begin, end]");
        t.begin = json_u64(path, name + ".data_offsets", (*off)[0]);
        t.end = json_u64(path, name + ".data_offsets", (*off)[1]);
        if (t.end < t.begin)
            fail(path, "tensor \"" + name + "\": data_offsets: expected begin <= end, found [" +
                           std::to_string(t.begin) + ", " + std::to_string(t.end) + "]");
        if (t.end > data_size)
            fail(path, "tensor \"" + name + "\": data_offsets end " + std::to_string(t.end) +
                           " is past the end of the data area (" + std::to_string(data_size) +
                           " bytes)");
        if (elems > data_size / st_dtype_size(t.dtype) + 1 ||
            elems * st_dtype_size(t.dtype) != t.nbytes())
            fail(path, "tensor \"" + name + "\": expected " + std::string(st_dtype_name(t.dtype)) +
                           " × " + sh->dump() + " = " +
                           std::to_string(elems * st_dtype_size(t.dtype)) +
                           " bytes, found data_offsets spanning " + std::to_string(t.nbytes()));
        h.tensors.push_back(std::move(t));
    }
    std::sort(h.tensors.begin(), h.tensors.end(), [](const StTensor& a, const StTensor& b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    // The data area must be covered exactly: no overlap, no gap, nothing after the last tensor.
    uint64_t pos = 0;
    for (const StTensor& t : h.tensors) {
        if (t.begin < pos)
            fail(path, "tensor \"" + t.name + "\": data_offsets [" + std::to_string(t.begin) +
                           ", " + std::to_string(t.end) +
                           ") overlap the previous tensor, which ends at " + std::to_string(pos));
        if (t.begin > pos)
            fail(path, "tensor \"" + t.name + "\": data_offsets begin at " +
                           std::to_string(t.begin) + ", expected " + std::to_string(pos) +
                           " (a gap of unclaimed bytes)");
        pos = t.end;
    }
    if (pos != data_size)
        fail(path, "data area: expected the tensors to cover all " + std::to_string(data_size) +
                       " bytes, found " + std::to_string(pos) + " covered");
    return h;
}

Checkpoint open_checkpoint(const fs::path& dir) {
    Checkpoint ck;
    const fs::path index_path = dir / "model.safetensors.index.json";
    std::error_code ec;
    if (fs::exists(index_path, ec)) {
        json idx = read_json_file(index_path);
        auto wm = idx.find("weight_map");
        if (!idx.is_object() || wm == idx.end() || !wm->is_object())
            fail(index_path,
                 "field \"weight_map\": expected an object of tensor name -> shard file");
        std::map<std::string, std::string> shard_of;  // tensor -> file
        std::set<std::string> files;
        for (auto it = wm->begin(); it != wm->end(); ++it) {
            if (!it.value().is_string())
                fail(index_path, "weight_map \"" + it.key() + "\": expected a file name, found " +
                                     describe_json(it.value()));
            std::string file = it.value().get<std::string>();
            // A shard must be a plain file name inside the checkpoint directory.
            if (file.empty() || file.find('/') != std::string::npos ||
                file.find('\\') != std::string::npos || file == "." || file == "..")
                fail(index_path, "weight_map \"" + it.key() +
                                     "\": expected a file name in the same directory, found \"" +
                                     file + "\"");
            shard_of[it.key()] = file;
            files.insert(file);
        }
        if (files.empty()) fail(index_path, "weight_map: expected at least one tensor, found none");
        std::set<std::string> found;
        for (const std::string& file : files) {
            StHeader h = read_safetensors_header(dir / file);
            for (const StTensor& t : h.tensors) {
                auto s = shard_of.find(t.name);
                if (s == shard_of.end())
                    fail(h.path,
                         "tensor \"" + t.name + "\" is not listed in model.safetensors.index.json");
                if (s->second != file)
                    fail(h.path, "tensor \"" + t.name + "\": the index places it in \"" +
                                     s->second + "\", found here");
                found.insert(t.name);
            }
            ck.shards.push_back(std::move(h));
        }
        for (const auto& [name, file] : shard_of)
            if (!found.count(name))
                fail(dir / file,
                     "tensor \"" + name + "\" listed in the index is missing from this shard");
        return ck;
    }
    const fs::path single = dir / "model.safetensors";
    if (!fs::exists(single, ec))
        throw InputError(
            dir.string() +
            ": expected model.safetensors or model.safetensors.index.json, found neither");
    ck.shards.push_back(read_safetensors_header(single));
    return ck;
}

MappedFile::MappedFile(const fs::path& path) {
    Fd f;
    f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f.fd < 0) fail(path, std::string("cannot open: ") + std::strerror(errno));
    struct stat st {};
    if (::fstat(f.fd, &st) != 0) fail(path, std::string("cannot stat: ") + std::strerror(errno));
    size_ = uint64_t(st.st_size);
    if (size_ == 0) return;
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, f.fd, 0);
    if (p == MAP_FAILED) fail(path, std::string("cannot map: ") + std::strerror(errno));
    ::madvise(p, size_, MADV_SEQUENTIAL);
    data_ = static_cast<const uint8_t*>(p);
}

MappedFile::~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

}  // namespace minids::convert
