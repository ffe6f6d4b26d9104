// Reading an .mds file: map it read-only, validate everything before use (DESIGN.md "The loader
// trusts nothing"), and hand out pointers into the mapping. Nothing is copied to the heap to be
// used except the parsed manifest itself.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json.hpp>

#include "mgl.h"
#include "model/config.h"
#include "tokenizer/tokenizer_data.h"

namespace minids::mds {

// Every malformed-file failure: one message naming the file, the field, what was expected and
// what was found. CLI maps this to exit code 2.
struct FileError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct TensorEntry {
    std::string name;
    mgl::dtype dtype = mgl::dtype::bf16;
    std::vector<int64_t> shape;  // outermost first
    uint64_t offset = 0;         // absolute file offset
    uint64_t nbytes = 0;
    uint64_t xxh3 = 0;
    const uint8_t* data = nullptr;  // into the mapping
};

struct ExpertPart {
    uint64_t offset = 0;  // within the blob
    mgl::dtype dtype = mgl::dtype::f8_e4m3;
    std::vector<int64_t> shape;
};

struct ExpertBlob {
    int64_t layer = 0;
    int64_t expert = 0;
    uint64_t offset = 0;  // absolute file offset
    uint64_t xxh3 = 0;
    const uint8_t* data = nullptr;
};

struct ExpertTable {
    bool present = false;
    mgl::dtype dtype = mgl::dtype::f8_e4m3;
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    uint64_t blob_nbytes = 0;
    ExpertPart gate, up, down;
    ExpertPart gate_scale, up_scale, down_scale;  // only when dtype == f8_e4m3
    std::vector<ExpertBlob> blobs;                // ordered by (layer, expert)
    // Index of the first blob of `layer`, or -1 when the layer has no experts.
    int64_t first_blob_of_layer(int64_t layer) const;
};

class MdsFile {
public:
    // Maps and validates. Throws FileError on any problem. Does not verify checksums of the data
    // (that reads every byte); verify() does.
    static std::unique_ptr<MdsFile> open(const std::string& path);
    ~MdsFile();
    MdsFile(const MdsFile&) = delete;
    MdsFile& operator=(const MdsFile&) = delete;

    const std::string& path() const { return path_; }
    const ModelConfig& config() const { return config_; }
    const TokenizerData& tokenizer() const { return tokenizer_; }
    const nlohmann::json& manifest() const { return manifest_; }
    const nlohmann::json& provenance() const;
    const std::vector<TensorEntry>& tensors() const { return tensors_; }
    const ExpertTable& experts() const { return experts_; }
    // Null if absent.
    const TensorEntry* find(std::string_view name) const;
    // Throws FileError naming the tensor, the expected shape/dtype and what was found.
    const TensorEntry& require(std::string_view name, std::vector<int64_t> shape) const;

    const uint8_t* map_base() const { return base_; }
    uint64_t file_size() const { return size_; }

    // Checksums of the preamble, manifest, every tensor and expert blob, and zero padding.
    // Uses n_threads (0 = all cores); progress(done_bytes, total_bytes) is called from one thread.
    struct VerifyResult {
        bool ok = true;
        std::vector<std::string> problems;  // one line each
    };
    VerifyResult verify(int n_threads = 0,
                        const std::function<void(uint64_t, uint64_t)>& progress = {}) const;

private:
    MdsFile() = default;
    std::string path_;
    const uint8_t* base_ = nullptr;
    uint64_t size_ = 0;
    int fd_ = -1;
    nlohmann::json manifest_;
    ModelConfig config_;
    TokenizerData tokenizer_;
    std::vector<TensorEntry> tensors_;
    std::unordered_map<std::string, size_t> tensor_index_;
    ExpertTable experts_;
};

}  // namespace minids::mds
