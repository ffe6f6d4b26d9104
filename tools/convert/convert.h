// Hugging Face checkpoint -> .mds (DESIGN.md "The .mds file", src/mds/format.h).
//
// The whole layout is planned from config.json and the safetensors headers before a byte of
// data is read; then each shard is mapped in turn and its tensors are converted and written at
// their planned offsets (dense tensors as BF16, routed experts packed per expert into one blob,
// FP8 E4M3 + row scales or BF16). An expert whose gate/up/down sit in different shards waits in a
// small staging buffer until its last part arrives. Peak memory: one mapped shard plus about
// 2 × threads expert blobs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "mgl.h"

namespace minids::mds {
class MdsWriter;
}

namespace minids::convert {

struct ConvertOptions {
    std::filesystem::path hf_dir;
    std::filesystem::path out;
    mgl::dtype expert_dtype = mgl::dtype::f8_e4m3;  // or bf16
    int threads = 0;                                // 0: twice the hardware threads
    bool force = false;                             // overwrite an existing OUT
    bool progress = true;                           // progress line on stderr
};

struct ConvertStats {
    uint64_t file_size = 0;
    uint64_t dense_bytes = 0;
    uint64_t expert_bytes = 0;
    size_t n_tensors = 0;
    size_t n_blobs = 0;
    double seconds = 0.0;

    // The sizes of a planned file (seconds left 0), for convert and synthetic alike.
    static ConvertStats of_plan(const mds::MdsWriter& planned);
};

// Throws InputError (bad checkpoint/config/tokenizer: exit 2), Interrupted (exit 130),
// mds::WriterError (I/O failure or refusal to overwrite).
ConvertStats convert_checkpoint(const ConvertOptions& opt);

// Refuses an existing OUT (unless force), a directory, or a missing parent directory: InputError.
void check_output_path(const std::filesystem::path& out, bool force);

// "f8_e4m3"-style name for the provenance and messages; "fp8" and "bf16" on the command line.
bool parse_expert_dtype(const std::string& s, mgl::dtype& out);

}  // namespace minids::convert
