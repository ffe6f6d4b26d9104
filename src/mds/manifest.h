// Internal to src/mds: the two parsing stages of an .mds file, separated from the mapping so the
// fuzzer (tests/fuzz/) and the tests can drive them on bytes in memory.
//
//   parse_preamble:  the 48-byte preamble against the file's size (magic, version, flags,
//                    checksums of the preamble and manifest, manifest length, data offset).
//   parse_manifest:  the manifest JSON (duplicate keys, types, unknown keys), the tensor and expert
//                    tables against the data region, and the tensors the config requires.
//
// Neither reads the data region; verify.cpp does. Both throw FileError with one message naming
// the file, the field, what was expected and what was found.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "mds/format.h"
#include "mds/reader.h"

namespace minids::mds {

// Where the data region lies; every tensor and blob must fall inside [data_offset, file_size).
struct FileExtent {
    uint64_t data_offset = 0;
    uint64_t file_size = 0;
};

struct ParsedManifest {
    nlohmann::json manifest;
    ModelConfig config;
    TokenizerData tokenizer;
    std::vector<TensorEntry> tensors;  // in manifest order; data pointers left null
    ExpertTable experts;               // blob data pointers left null
};

// `bytes` holds at least min(size, 48) readable bytes; `size` is the whole file's size.
mds_preamble parse_preamble(const uint8_t* bytes, uint64_t size, const std::string& file);

// `text` is exactly the manifest bytes (checksum already checked by parse_preamble).
ParsedManifest parse_manifest(std::string_view text, const FileExtent& extent,
                              const std::string& file);

// Throws FileError "<file>: <field>: expected <expected>, found <found>".
[[noreturn]] void fail(const std::string& file, const std::string& field,
                       const std::string& expected, const std::string& found);

// The manifest's names for dtypes ("f32", "f16", "bf16", "f8_e4m3", "i32"); false if unknown.
bool dtype_from_manifest_name(std::string_view name, mgl::dtype& out);
const char* manifest_dtype_name(mgl::dtype t);
uint64_t manifest_dtype_size(mgl::dtype t);

// 16 lower-case hex digits, as the manifest writes checksums.
std::string hex_u64(uint64_t v);

}  // namespace minids::mds
