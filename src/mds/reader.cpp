// MdsFile: maps an .mds file read-only and validates it (preamble.cpp, manifest.cpp) before
// handing out pointers into the mapping.
#include "mds/reader.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "mds/manifest.h"

namespace minids::mds {

int64_t ExpertTable::first_blob_of_layer(int64_t layer) const {
    auto it = std::lower_bound(blobs.begin(), blobs.end(), layer,
                               [](const ExpertBlob& b, int64_t l) { return b.layer < l; });
    if (it == blobs.end() || it->layer != layer) return -1;
    return it - blobs.begin();
}

std::unique_ptr<MdsFile> MdsFile::open(const std::string& path) {
    std::unique_ptr<MdsFile> f(new MdsFile());
    f->path_ = path;
    f->fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (f->fd_ < 0) throw FileError(path + ": cannot open: " + std::strerror(errno));
    struct stat st {};
    if (fstat(f->fd_, &st) != 0) throw FileError(path + ": cannot stat: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode)) fail(path, "file", "a regular file", "a directory or device");
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    if (size < sizeof(mds_preamble)) parse_preamble(nullptr, size, path);  // throws: truncated

    // MAP_SHARED although nothing is ever written: on the H200 machine (a VM) cudaHostRegister of
    // a private file mapping had not returned after 40 s for 1 GiB, while a shared one registered
    // 15 GiB in 10.5 s (docs/perf.md, 2026-12-01). Reading either is the same.
    void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, f->fd_, 0);
    if (p == MAP_FAILED) throw FileError(path + ": cannot map the file: " + std::strerror(errno));
    f->base_ = static_cast<const uint8_t*>(p);
    f->size_ = size;

    const mds_preamble pre = parse_preamble(f->base_, size, path);
    std::string_view text(reinterpret_cast<const char*>(f->base_ + sizeof(mds_preamble)),
                          pre.manifest_len);
    ParsedManifest m = parse_manifest(text, FileExtent{pre.data_offset, size}, path);
    f->manifest_ = std::move(m.manifest);
    f->config_ = std::move(m.config);
    f->tokenizer_ = std::move(m.tokenizer);
    f->tensors_ = std::move(m.tensors);
    f->experts_ = std::move(m.experts);
    for (size_t i = 0; i < f->tensors_.size(); ++i) {
        f->tensors_[i].data = f->base_ + f->tensors_[i].offset;
        f->tensor_index_.emplace(f->tensors_[i].name, i);
    }
    for (auto& b : f->experts_.blobs) b.data = f->base_ + b.offset;
    return f;
}

MdsFile::~MdsFile() {
    if (base_) munmap(const_cast<uint8_t*>(base_), size_);
    if (fd_ >= 0) ::close(fd_);
}

const nlohmann::json& MdsFile::provenance() const { return manifest_.at("provenance"); }

const TensorEntry* MdsFile::find(std::string_view name) const {
    auto it = tensor_index_.find(std::string(name));
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const TensorEntry& MdsFile::require(std::string_view name, std::vector<int64_t> shape) const {
    auto shape_string = [](const std::vector<int64_t>& s) {
        std::string out = "[";
        for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
        return out + "]";
    };
    const TensorEntry* t = find(name);
    if (!t) fail(path_, "tensors", "a tensor \"" + std::string(name) + "\"", "no such tensor");
    if (t->shape != shape)
        fail(path_, std::string(name) + ".shape", shape_string(shape), shape_string(t->shape));
    return *t;
}

}  // namespace minids::mds
