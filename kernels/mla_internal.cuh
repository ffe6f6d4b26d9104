// Shared device code of the MLA kernels (mla_*.cu): cache addressing, the run-time split plan,
// the arguments the attention kernels take, and the launch entry points between the files.
// Not part of the public API (mla.h is).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fast_divisor.h"
#include "mla.h"

namespace minids::kernels::mla_detail {

// Physical row (page · page_size + offset) of position `pos`, or -1 when the position or its
// page-table entry is out of range (such rows are skipped / read as zeros).
__device__ inline int64_t cache_row(const int32_t* page_table, int32_t max_pages, int32_t n_pages,
                                    int32_t page_size, int32_t pos) {
    if (pos < 0) return -1;
    const int32_t logical = pos / page_size;
    if (logical >= max_pages) return -1;
    const int32_t phys = page_table[logical];
    if (phys < 0 || phys >= n_pages) return -1;
    return int64_t(phys) * page_size + (pos - logical * page_size);
}

// The split plan every block (and the merge) derives from the same inputs: keys [0, n_keys) are
// cut into n_split chunks of `chunk` keys (a multiple of the kernel's key tile).
struct SplitPlan {
    int n_split;
    int chunk;
};
__device__ inline SplitPlan plan_splits(int n_keys, int max_splits, int min_keys, int tile) {
    if (n_keys <= 0) return {1, tile};
    int n = (n_keys + min_keys - 1) / min_keys;
    n = n < 1 ? 1 : (n > max_splits ? max_splits : n);
    int chunk = (n_keys + n - 1) / n;
    chunk = (chunk + tile - 1) / tile * tile;
    return {(n_keys + chunk - 1) / chunk, chunk};
}

// Everything an attention kernel reads, 32-bit sizes (positions are i32). make_args guarantees
// T·H <= INT32_MAX / 2 and n_pages · page_size <= INT32_MAX, so row indices (of queries and of
// cache rows) are 32-bit.
struct AttnArgs {
    const void* pages;
    const int32_t* page_table;
    int32_t n_pages, page_size, max_pages;
    FastDivisor page_div;  // by page_size
    int32_t r, rope;
    int32_t q_vec4;  // q_lat and q_pe: 16-byte aligned base and strides (float4 loads)
    const float* q_lat;
    int64_t q_lat_st, q_lat_sh;
    const float* q_pe;
    int64_t q_pe_st, q_pe_sh;
    float* out;
    int64_t out_st, out_sh;
    const int32_t* positions;
    int32_t T, H;
    FastDivisor head_div;  // by H: row = t·H + h
    float scale_log2;      // scale · log2(e): softmax runs in base 2
    int32_t min_keys;
    // Workspace (null when max_splits == 1): the split count used, then per split and row the
    // log2-sum-exp and the normalized partial output.
    int32_t* ws_n_split;
    float* ws_lse;  // [max_splits][T·H]
    float* ws_o;    // [max_splits][T·H][r]
    bool pdl;       // host side: launch the attention kernel dependent (dependent_launch.cuh)
};

// cache_row for the attention kernels: 32-bit (a cache row index is < n_pages · page_size <=
// INT32_MAX) and no division instruction sequence (page_div).
__device__ inline int attn_cache_row(const AttnArgs& a, int pos) {
    if (pos < 0) return -1;
    int logical, offset;
    a.page_div.divmod(pos, logical, offset);
    if (logical >= a.max_pages) return -1;
    const int phys = a.page_table[logical];
    if (phys < 0 || phys >= a.n_pages) return -1;
    return phys * a.page_size + offset;
}

// Largest position + 1 over the T tokens, clamped to the keys the page table can address (the
// number of keys any row may see). Block-wide; every thread gets the result.
__device__ inline int block_n_keys(const AttnArgs& a, int* smem_slot) {
    if (threadIdx.x == 0) *smem_slot = -1;
    __syncthreads();
    int local = -1;
    for (int t = threadIdx.x; t < a.T; t += blockDim.x) local = max(local, a.positions[t]);
    if (local >= 0) atomicMax(smem_slot, local);
    __syncthreads();
    const int64_t limit = int64_t(a.max_pages) * a.page_size;
    const int64_t n = int64_t(*smem_slot) + 1;
    return int(n < limit ? n : limit);
}

// The causal limit (last key, inclusive) of row `row` = t·H + h; -1 for rows past the end.
__device__ inline int row_limit(const AttnArgs& a, int64_t row, int n_keys) {
    if (row >= int64_t(a.T) * a.H) return -1;
    const int pos = a.positions[a.head_div.div(int(row))];  // row < T·H < 2^31
    return pos < n_keys - 1 ? pos : n_keys - 1;
}

// Where (t, h, d) of the output goes: `out` directly, or the split's partial in the workspace.
__device__ inline float* out_ptr(const AttnArgs& a, bool direct, int split, int64_t row) {
    if (direct) {
        int t, h;
        a.head_div.divmod(int(row), t, h);  // row < T·H < 2^31
        return a.out + t * a.out_st + h * a.out_sh;
    }
    return a.ws_o + (int64_t(split) * a.T * a.H + row) * a.r;
}

// Host side, across files: the tensor-core kernel's block shapes ("variants"), each with its
// instances per page dtype and O padding (R_PAD 512, or 64 for r <= 64); null where not built.
using TcLaunchFn = void (*)(const AttnArgs& a, int max_splits, cudaStream_t stream);
struct TcInstances {
    TcLaunchFn r512, r64;
};
struct TcVariant {
    const char* name;
    TcInstances bf16, f32, f16;
};
struct TcVariantList {
    const TcVariant* items;
    int count;
};
TcVariantList tc_decode_variants();   // mla_attn_tc_decode.cu; item 0 is the default
TcVariantList tc_prefill_variants();  // mla_attn_tc_prefill.cu; item 0 is the default

}  // namespace minids::kernels::mla_detail
