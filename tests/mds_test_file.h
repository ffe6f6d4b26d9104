// A test helper that writes small, valid .mds files from scratch, following src/mds/format.h
// alone (not the converter), and keeps them in parts so a test can change one thing — a manifest
// field, the raw manifest text, one byte — and get a file that is wrong in exactly that way.
//
//   auto f = minids::test::make_test_mds({.fp8_experts = false});
//   f.manifest["tensors"][0]["offset"] = 4100;   // misaligned, checksums still consistent
//   f.write(dir / "bad.mds");
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace minids::test {

struct MdsTestOptions {
    uint64_t seed = 1;
    bool fp8_experts = true;     // experts f8_e4m3 + f32 row scales, else bf16
    bool q_lora = false;         // q_lora_rank set (q_a_proj, q_a_layernorm, q_b_proj) or null
    bool shared_experts = true;  // n_shared_experts 1, else null
    int n_layers = 3;            // layer 0 dense, layers >= 1 MoE
    int n_experts = 3;           // routed experts per MoE layer; 0: a dense-only model
    int64_t vocab_size = 40;     // >= 34 (the test tokenizer's tokens)
    int64_t hidden_size = 24;    // raise both to make large files (embed + lm_head: V x D bf16)
};

struct MdsTestFile {
    struct Payload {
        uint64_t offset = 0;  // absolute file offset
        std::vector<uint8_t> bytes;
    };
    nlohmann::json manifest;
    std::string manifest_text;  // written verbatim instead of manifest.dump() when non-empty
    uint64_t data_offset = 0;
    std::vector<Payload> payloads;  // tensors and expert blobs, in file order

    // Text written as the manifest.
    std::string manifest_bytes() const;
    // The whole file: preamble with correct checksums, manifest, zero padding, payloads, zero
    // padding to a multiple of 4096. Throws std::runtime_error if the manifest outgrew
    // data_offset (an edit added more than the slack left for it).
    std::vector<uint8_t> bytes() const;
    void write(const std::filesystem::path& path) const;
};

MdsTestFile make_test_mds(const MdsTestOptions& options = {});

// The manifest "config" and "tokenizer" objects of the test model.
nlohmann::json test_config_json(const MdsTestOptions& options);
nlohmann::json test_tokenizer_json();

// Byte-level edits of a serialized file.
void write_file(const std::filesystem::path& path, const std::vector<uint8_t>& bytes);
void put_u32(std::vector<uint8_t>& bytes, size_t offset, uint32_t value);
void put_u64(std::vector<uint8_t>& bytes, size_t offset, uint64_t value);
uint64_t get_u64(const std::vector<uint8_t>& bytes, size_t offset);
// Recomputes preamble_xxh3 after a preamble edit, so the edit itself is what the reader sees.
void refresh_preamble_checksum(std::vector<uint8_t>& bytes);

}  // namespace minids::test
