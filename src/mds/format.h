// The .mds model file: the single source of truth for its layout. Writer (tools/convert/) and
// reader (src/mds/reader.*) both follow this file; change it and bump mds_version.
//
// Layout (all integers little-endian):
//
//   offset 0   preamble (mds_preamble, 48 bytes)
//   offset 48  manifest: UTF-8 JSON, exactly preamble.manifest_len bytes
//   ...        zero padding up to preamble.data_offset (a multiple of 4096)
//   data       tensors and expert blobs, each starting on a 4096-byte boundary, zero padding
//              between them and after the last one up to the end of the file (file size is a
//              multiple of 4096).
//
// Integrity: preamble.preamble_xxh3 = XXH3_64bits(bytes [0, 40)); preamble.manifest_xxh3 =
// XXH3_64bits(manifest bytes); each tensor and expert blob has "xxh3" over its exact nbytes; all
// padding must be zero. Together these detect a change to any byte of the file.
//
// Manifest JSON (keys are unique at every level; unknown top-level keys are an error):
// {
//   "format": "minids",
//   "version": 1,
//   "config": { ModelConfig fields, exactly as written by config_to_json (src/model/config.h) },
//   "tokenizer": { TokenizerData, as written by tokenizer_data_to_json
//   (src/tokenizer/tokenizer_data.h) }, "tensors": [ { "name": "model.embed_tokens.weight",    //
//   checkpoint name, verbatim
//                  "dtype": "bf16", "shape": [1024, 64],   // outermost first
//                  "offset": 8192, "nbytes": 131072,       // absolute file offset, exact size
//                  "xxh3": "0123456789abcdef" } ... ],     // 16 lower-case hex digits
//   "experts": {                 // absent or null when the model has no routed experts
//     "dtype": "f8_e4m3",        // or "bf16"
//     "n_embd": 2048, "n_ff": 1408,
//     "layout": {                // byte offsets inside one blob; same for every expert
//       "gate":       { "offset": 0,       "dtype": "f8_e4m3", "shape": [1408, 2048] },
//       "up":         { "offset": ...,     "dtype": "f8_e4m3", "shape": [1408, 2048] },
//       "down":       { "offset": ...,     "dtype": "f8_e4m3", "shape": [2048, 1408] },
//       "gate_scale": { "offset": ...,     "dtype": "f32",     "shape": [1408] },   // fp8 only
//       "up_scale":   { "offset": ...,     "dtype": "f32",     "shape": [1408] },   // fp8 only
//       "down_scale": { "offset": ...,     "dtype": "f32",     "shape": [2048] } }, // fp8 only
//     "blob_nbytes": N,          // bytes of one blob: the end of its last part, not rounded up
//                                // (parts 256-aligned, in the order listed above); blobs start
//                                // every align_up(blob_nbytes, 4096) bytes within a layer
//     "blobs": [ { "layer": 1, "expert": 0, "offset": ..., "xxh3": "..." } ... ]
//                                // every (MoE layer, expert) exactly once, ordered by layer then
//                                // expert; the experts of a layer are adjacent in the file
//   },
//   "provenance": { "tool": "minids convert", "tool_version": "...", "source": "...",
//                   "expert_dtype": "f8_e4m3", "synthetic": false, ... free-form strings/numbers }
// }
//
// FP8 experts: E4M3 with one F32 scale per output row, scale = row absmax / 448 (a zero row gets
// scale 1; a row of tiny subnormals whose absmax / 448 underflows to 0 gets the smallest positive
// float), W_fp8[n, k] = f32_to_e4m3(W[n, k] / scale[n]). Synthetic files draw the codes
// directly, so there the scales are only near row absmax / 448 (tools/convert/synthetic.h).
// The routed experts' checkpoint names (model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight)
// do not appear in "tensors"; every other checkpoint tensor does, in BF16 (the converter rounds
// F32 and F16 checkpoint tensors to BF16, nearest-even, and copies BF16 ones bit for bit; readers
// still accept f32/f16 dense tensors). With tied embeddings lm_head.weight is not stored.
// The converter writes "experts": null for a model without MoE layers, all dense tensors before
// all expert blobs, and the config's rope_scaling without a "type" key (it is always YaRN).
// Provenance written by minids convert: tool, tool_version, source (the checkpoint directory's
// basename, or "synthetic:PRESET"), expert_dtype, synthetic, and for synthetic files preset, seed.
#pragma once

#include <cstdint>

namespace minids::mds {

inline constexpr char mds_magic[8] = {'M', 'I', 'N', 'I', 'D', 'S', '\r', '\n'};
inline constexpr uint32_t mds_version = 1;
inline constexpr uint64_t mds_alignment = 4096;
inline constexpr uint64_t mds_expert_part_alignment = 256;
// Hard limits the reader enforces before allocating anything sized by the file.
inline constexpr uint64_t mds_max_manifest_bytes = 256ull << 20;
inline constexpr int mds_max_dims = 4;

#pragma pack(push, 1)
struct mds_preamble {
    char magic[8];           // mds_magic
    uint32_t version;        // mds_version
    uint32_t flags;          // must be 0
    uint64_t manifest_len;   // bytes of JSON following the preamble
    uint64_t data_offset;    // multiple of 4096, >= 48 + manifest_len
    uint64_t manifest_xxh3;  // XXH3_64bits(manifest)
    uint64_t preamble_xxh3;  // XXH3_64bits(bytes [0, 40)) — everything above
};
#pragma pack(pop)
static_assert(sizeof(mds_preamble) == 48);

}  // namespace minids::mds
