// MLA on the GPU: the paged latent KV cache (store), absorbed attention over it (decode and
// prefill), and a fused per-token "prep" kernel for decode. Model math: DESIGN.md "MLA".
//
// The cache of one layer is a pool of pages, each page `page_size` rows of `width = r + rope`
// values (r = kv_lora_rank, rope = qk_rope_head_dim; 512 + 64 for V2/V2-Lite), rows contiguous,
// f32, bf16 or f16 (16-bit types stored rounded to nearest even, like mgl::f32_to_bf16 and
// mgl::f32_to_f16):
//
//     pages       [n_pages, page_size, r + rope]     a row = [ c (r) | k_pe (rope) ]
//     page_table  [max_pages] i32                    logical page p -> physical page
//
// Position `pos` lives in physical page page_table[pos / page_size], row pos % page_size.
//
// Positions come from device memory, never from the host: `positions` [T] i32 says where token t
// is stored (kv_store) and which keys it sees (attention: keys 0 .. positions[t], inclusive).
// Grid sizes depend only on shapes (T, H, r, rope, max_splits), so one captured CUDA graph serves
// every decode step while the host rewrites positions and the page table between replays.
//
// A decode step of one layer, with the workspace sized once:
//
//     MlaCache cache{pages, mgl::dtype::bf16, n_pages, 64, page_table, max_pages, 512, 64};
//     MlaPrepParams prep;  ...                    // rms_norm(c), rope(k_pe), store, rope(q_pe)
//     mla_prep(prep, stream);
//     MlaAttnParams at;  at.cache = cache;  at.q_lat = ...;  at.T = 1;  at.H = 16;
//     at.max_splits = mla_attn_default_max_splits(MlaKernel::decode, 1, 16);
//     at.workspace = ws;  at.workspace_bytes = mla_attn_workspace_bytes(1, 16, 512, at.max_splits);
//     mla_decode(at, stream);                     // attention + merge: two kernels
//
// Memory safety: kernels never touch memory outside the pages, the page table or the tensors
// given. A position < 0, or one whose logical page is past max_pages or maps to a physical page
// outside [0, n_pages), is skipped by kv_store and reads as a row of zeros in attention (such
// inputs are caller bugs; they do not corrupt memory).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "mgl.h"

namespace minids::kernels {

// One layer's paged latent cache (device pointers).
struct MlaCache {
    void* pages = nullptr;               // [n_pages, page_size, r + rope], contiguous
    mgl::dtype type = mgl::dtype::bf16;  // f32, bf16 or f16
    int64_t n_pages = 0;
    int64_t page_size = 0;
    const int32_t* page_table = nullptr;  // [max_pages]
    int64_t max_pages = 0;
    int64_t kv_lora_rank = 0;  // r
    int64_t rope_dim = 0;      // rope
};

// ---------------------------------------------------------------------------------------------
// kv_store: pages[row of positions[t]] = [c[t] | k_pe[t]] for t < T (rounded when bf16 / f16).
// ---------------------------------------------------------------------------------------------
struct KvStoreParams {
    MlaCache cache;
    const float* c = nullptr;  // [T, r], row stride c_stride (elements), rows contiguous
    int64_t c_stride = 0;
    const float* k_pe = nullptr;  // [T, rope], row stride k_pe_stride
    int64_t k_pe_stride = 0;
    const int32_t* positions = nullptr;  // [T] device
    int64_t T = 0;
    bool pdl = false;  // launched dependent on the previous kernel (dependent_launch.cuh)
};
void kv_store(const KvStoreParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Absorbed MLA attention over the cache, all heads sharing the cache rows:
//   score[t,h,s] = (q_lat[t,h]·c_s + q_pe[t,h]·k_pe_s) · scale,  s = 0 .. positions[t]
//   out[t,h]     = Σ_s softmax_s(score[t,h,:]) · c_s                        -> [T, H, r] f32
//
// The (t, h) pairs are the rows of one big attention (every row reads the same keys), tiled
// 16 rows per block for decode and 64 for prefill. The key range is split over a fixed grid of
// `max_splits` blocks per row tile (flash-decoding). At run time each block derives the split
// count it really uses from positions (about one split per `min_keys_per_split` keys, at most
// max_splits); blocks beyond it exit at once. With more than one split, blocks write partial
// results (o / l and log2-sum-exp per row) to the workspace and a second kernel merges them;
// with one split the attention kernel writes `out` directly and the merge kernel exits.
//
// Kernels:
//   tensor_core: mma.sync m16n8k16 with f32 accumulate, bf16 inputs over bf16 and f32 pages, f16
//                inputs over f16 pages. q is rounded to that type (and f32 pages are rounded to
//                bf16 when loaded), and probabilities are rounded to it for P·V: relative error
//                ~1e-3 with bf16 (tests bound 1e-2), about 8x less with f16 (tests bound 2e-3).
//                Needs r, rope multiples of 8.
//   cuda_core:   f32 math throughout on the stored values (tests bound 1e-5 with f32 and f16
//                pages); the reference, and the f32-cache decode path.
//   automatic:   decode: tensor_core for bf16 and f16 pages, the CUDA-core decode kernel
//                (mla_decode_simt) for f32 pages; prefill: tensor_core.
// Limits (both): r <= 512, rope <= 128, r and rope multiples of 8.
// ---------------------------------------------------------------------------------------------
enum class MlaImpl : uint8_t { automatic, tensor_core, cuda_core };
enum class MlaKernel : uint8_t { decode, prefill };

struct MlaAttnParams {
    MlaCache cache;
    const float* q_lat = nullptr;  // [T, H, r], strides in elements, innermost contiguous
    int64_t q_lat_stride_t = 0;
    int64_t q_lat_stride_h = 0;
    const float* q_pe = nullptr;  // [T, H, rope]
    int64_t q_pe_stride_t = 0;
    int64_t q_pe_stride_h = 0;
    float* out = nullptr;  // [T, H, r]
    int64_t out_stride_t = 0;
    int64_t out_stride_h = 0;
    const int32_t* positions = nullptr;  // [T] device; row t attends keys 0 .. positions[t]
    int64_t T = 0;
    int64_t H = 0;
    float scale = 1.0f;
    int max_splits = 1;          // grid over the keys, 1 .. 4096; fixed per captured graph
    int min_keys_per_split = 0;  // 0: default (64 decode, 512 prefill): splits used <= keys/this
    MlaImpl impl = MlaImpl::automatic;
    int variant = -1;  // tensor-core block shape (mla_attn_variant_*); -1: the default
    // Device scratch of mla_attn_workspace_bytes(T, H, r, max_splits) bytes, used only between
    // the two kernels of one call (so layers may share it; stream order keeps them apart).
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    bool pdl = false;  // both kernels launched dependent (dependent_launch.cuh)
};

// Workspace for the partial results of up to max_splits splits (0 when max_splits == 1).
size_t mla_attn_workspace_bytes(int64_t T, int64_t H, int64_t r, int max_splits);
// A max_splits that fills the current device once (its SM count) for T·H rows; for decode
// shapes (T·H <= 16) that is one block per SM at long context.
int mla_attn_default_max_splits(MlaKernel kernel, int64_t T, int64_t H);

// Decode: 16-row tiles (T·H = 16 for V2-Lite at T = 1). Correct for any T.
void mla_decode(const MlaAttnParams& p, cudaStream_t stream);

// The CUDA-core decode kernel (kernels/mla_decode_simt.cu): latency-first, for few query rows
// (tiles of 4 rows of T·H), r <= 512, cache rows <= 1152 bytes (bf16, f16) / 2304 (f32).
// mla_decode with impl automatic takes it for f32 pages; its workspace fits in
// mla_attn_workspace_bytes.
bool mla_decode_simt_supported(const MlaAttnParams& p);
size_t mla_decode_simt_workspace_bytes(int64_t rows, int64_t r, int max_splits);
void mla_decode_simt(const MlaAttnParams& p, cudaStream_t stream);
// Prefill: 64-row tiles (T up to ~512 queries per call). Correct for any T.
void mla_prefill(const MlaAttnParams& p, cudaStream_t stream);

// Tensor-core block shapes, for benchmarks sweeping them (params.variant = index).
int mla_attn_variant_count(MlaKernel kernel);
const char* mla_attn_variant_name(MlaKernel kernel, int variant);

// ---------------------------------------------------------------------------------------------
// Fused decode prep for one layer, one launch (one block per token t):
//   c      = rms_norm(kv[t, 0:r]) · kv_norm_w             (eps; f32 math)
//   k_pe   = rope(kv[t, r:r+rope], positions[t])
//   cache  = [c | k_pe] at positions[t]                     (kv_store)
//   q_pe   = rope(q_pe_in[t, h], positions[t]) for every head h   (may be in place)
// This is the pattern rms_norm(kv_cmpr) -> rope(k_pe) -> kv_store, rope(q_pe) of the model
// graph; the optional f32 copies of c and k_pe (the graph's named kv_cmpr and k_pe) are written
// when their pointers are set. RoPE as in rope.h (interleaved pairs, inv_freq, attn_factor).
// ---------------------------------------------------------------------------------------------
struct MlaPrepParams {
    MlaCache cache;
    const int32_t* positions = nullptr;  // [T] device
    int64_t T = 0;
    int64_t H = 0;
    const float* kv = nullptr;  // [T, r + rope] (kv_a_proj_with_mqa output), row stride kv_stride
    int64_t kv_stride = 0;
    const void* kv_norm_w = nullptr;               // [r] or null (no weight)
    mgl::dtype kv_norm_w_type = mgl::dtype::bf16;  // bf16 or f32
    float eps = 1e-6f;
    const float* inv_freq = nullptr;  // [rope / 2] device
    float attn_factor = 1.0f;
    const float* q_pe_in = nullptr;  // [T, H, rope], strides in elements
    int64_t q_pe_in_stride_t = 0;
    int64_t q_pe_in_stride_h = 0;
    float* q_pe_out = nullptr;  // [T, H, rope]; may equal q_pe_in (same strides then)
    int64_t q_pe_out_stride_t = 0;
    int64_t q_pe_out_stride_h = 0;
    float* c_out = nullptr;  // optional [T, r], row stride c_out_stride
    int64_t c_out_stride = 0;
    float* k_pe_out = nullptr;  // optional [T, rope], row stride k_pe_out_stride
    int64_t k_pe_out_stride = 0;
    // Launched dependent on the previous kernel (dependent_launch.cuh). kv_norm_w and inv_freq
    // may be read before that kernel has completed (everything else only after): set it only when
    // no kernel still running writes them (model weights and rope tables: none does).
    bool pdl = false;
};
void mla_prep(const MlaPrepParams& p, cudaStream_t stream);

}  // namespace minids::kernels
