// Reading Hugging Face safetensors checkpoints, trusting nothing.
//
// A safetensors file is: u64 little-endian header length N, N bytes of JSON
// {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__":
// {..}}, then the data area; offsets are relative to the data area. The header is read and
// validated first (length cap, JSON, duplicate keys, dtype, dtype×shape = bytes, offsets inside the
// data area, no overlap, no gap); the data is mapped read-only later, one shard at a time.
#pragma once

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace minids::convert {

// A problem with the user's input (checkpoint, config, flags): one sentence naming the file, the
// field, what was expected and what was found. The CLI maps it to exit code 2.
struct InputError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Only the floating-point dtypes a DeepSeek-V2 checkpoint uses; anything else is refused.
enum class StDtype : uint8_t { bf16, f16, f32 };
size_t st_dtype_size(StDtype t);
const char* st_dtype_name(StDtype t);

inline constexpr uint64_t safetensors_max_header_bytes = 100ull << 20;

struct StTensor {
    std::string name;
    StDtype dtype = StDtype::bf16;
    std::vector<int64_t> shape;  // outermost first
    uint64_t begin = 0;          // offsets into the data area
    uint64_t end = 0;
    uint64_t nbytes() const { return end - begin; }
    int64_t nelements() const;
};

struct StHeader {
    std::filesystem::path path;
    uint64_t file_size = 0;
    uint64_t data_start = 0;        // 8 + header length
    std::vector<StTensor> tensors;  // sorted by begin offset
};

// Reads and validates the header of one file. Throws InputError.
StHeader read_safetensors_header(const std::filesystem::path& path);

// Parses JSON, refusing duplicate object keys at any depth (nlohmann keeps the last silently).
// `what` names the source in messages. Throws InputError.
nlohmann::json parse_json_strict(const std::string& text, const std::string& what);
nlohmann::json read_json_file(const std::filesystem::path& path);

// The checkpoint's shard files: model.safetensors.index.json's weight_map when present (each
// tensor must then live in the shard the index names), else model.safetensors.
// Throws InputError.
struct Checkpoint {
    std::vector<StHeader> shards;  // in file-name order
};
Checkpoint open_checkpoint(const std::filesystem::path& dir);

// A read-only mapping of a whole file (RAII).
class MappedFile {
public:
    explicit MappedFile(const std::filesystem::path& path);  // throws InputError
    ~MappedFile();
    MappedFile(const MappedFile&) = delete;
    MappedFile& operator=(const MappedFile&) = delete;
    const uint8_t* data() const { return data_; }
    uint64_t size() const { return size_; }

private:
    const uint8_t* data_ = nullptr;
    uint64_t size_ = 0;
};

}  // namespace minids::convert
