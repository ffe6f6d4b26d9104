// MLA attention launchers (mla.h), the f32 CUDA-core kernel and the split merge. The tensor-core
// kernel lives in mla_attn_tc.cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <algorithm>

#include <string>

#include "cp_async.cuh"
#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "mla_internal.cuh"

namespace minids::kernels {
namespace mla_detail {
namespace {

// ---- CUDA-core kernel: 16 rows x 32 keys per tile, f32 math throughout ----------------------
// Cache rows are copied raw (cp.async, double buffered) and converted when read.
constexpr int simt_rows = 16;
constexpr int simt_keys = 32;
constexpr int simt_threads = 256;

// Elements between cache rows in shared memory: >= width, rows 16-byte aligned, and the rows of
// consecutive keys (lanes) spread over the banks: 16 bytes mod 128 (f32), 16 mod 128 (bf16 and
// f16, 8-byte reads: a 2-way conflict, acceptable for the reference path).
template <typename PageT>
__host__ __device__ inline int simt_row_stride(int width) {
    return sizeof(PageT) == 4 ? (width + 31) / 32 * 32 + 4 : (width + 63) / 64 * 64 + 8;
}

template <typename PageT>
size_t simt_smem_bytes(int width) {
    return size_t(simt_rows) * width * 4 +
           2 * size_t(simt_keys) * size_t(simt_row_stride<PageT>(width)) * sizeof(PageT) +
           4 * (size_t(simt_rows) * simt_keys + 4 * simt_rows);
}

__device__ inline float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ inline float4 load4(const __nv_bfloat16* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&v.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ inline float4 load4(const __half* p) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&v.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&v.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}
__device__ inline float to_f32(float v) { return v; }
__device__ inline float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_f32(__half v) { return __half2float(v); }
__device__ inline float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// simt_keys cache rows from key k0 into dst (raw, row stride ks); keys >= k_end read as zeros.
template <typename PageT>
__device__ void simt_load_tile(const AttnArgs& a, PageT* dst, int ks, int k0, int k_end) {
    const int width = a.r + a.rope;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int per_chunk = 16 / int(sizeof(PageT));
    const PageT* pages = static_cast<const PageT*>(a.pages);
    for (int kr = warp; kr < simt_keys; kr += simt_threads / 32) {
        const int key = k0 + kr;
        const int64_t row =
            key < k_end ? cache_row(a.page_table, a.max_pages, a.n_pages, a.page_size, key) : -1;
        const PageT* src = pages + (row < 0 ? 0 : row * width);
        for (int ch = lane; ch < width / per_chunk; ch += 32)
            cp_async_16(dst + kr * ks + ch * per_chunk, src + ch * per_chunk, row < 0 ? 0 : 16);
    }
}

// Warp w owns rows w and w + 8 for Q·Kᵀ and the softmax (lane = key); thread i owns output
// columns i and i + 256 of all 16 rows for P·V.
template <typename PageT>
__global__ void __launch_bounds__(simt_threads) mla_attn_simt_kernel(const AttnArgs a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int n_keys_slot, block_max_limit;
    const int width = a.r + a.rope, ks = simt_row_stride<PageT>(width);
    float* q_s = reinterpret_cast<float*>(smem);                       // [16][width]
    PageT* kv_s = reinterpret_cast<PageT*>(q_s + simt_rows * width);   // [2][32][ks]
    float* p_s = reinterpret_cast<float*>(kv_s + 2 * simt_keys * ks);  // [16][32]
    float* alpha_s = p_s + simt_rows * simt_keys;                      // [16]
    float* m_s = alpha_s + simt_rows;                                  // [16]
    float* l_s = m_s + simt_rows;                                      // [16]
    int* lim_s = reinterpret_cast<int*>(l_s + simt_rows);              // [16]

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int64_t rows_total = int64_t(a.T) * a.H;
    const int64_t row0 = int64_t(blockIdx.x) * simt_rows;
    const int split = blockIdx.y;
    const int n_keys = block_n_keys(a, &n_keys_slot);
    const SplitPlan plan = plan_splits(n_keys, gridDim.y, a.min_keys, simt_keys);
    if (blockIdx.x == 0 && split == 0 && tid == 0 && a.ws_n_split) *a.ws_n_split = plan.n_split;
    if (split >= plan.n_split) return;
    const bool direct = plan.n_split == 1;

    if (tid == 0) block_max_limit = -1;
    __syncthreads();
    if (tid < simt_rows) {
        lim_s[tid] = row_limit(a, row0 + tid, n_keys);
        atomicMax(&block_max_limit, lim_s[tid]);
    }
    __syncthreads();
    const int s_begin = split * plan.chunk, s_hi = s_begin + plan.chunk;
    const int s_end = min(s_hi, block_max_limit + 1);
    const int n_tiles = s_end > s_begin ? (s_end - s_begin + simt_keys - 1) / simt_keys : 0;
    if (n_tiles > 0) simt_load_tile<PageT>(a, kv_s, ks, s_begin, s_end);
    cp_async_commit();
    for (int idx = tid; idx < simt_rows * width; idx += simt_threads) {
        const int i = idx / width, col = idx % width;
        const int64_t row = row0 + i;
        float v = 0.f;
        if (row < rows_total) {
            const int64_t t = row / a.H, h = row % a.H;
            v = col < a.r ? a.q_lat[t * a.q_lat_st + h * a.q_lat_sh + col]
                          : a.q_pe[t * a.q_pe_st + h * a.q_pe_sh + (col - a.r)];
        }
        q_s[idx] = v;
    }
    const int lim0 = lim_s[warp], lim1 = lim_s[warp + 8];

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float o[simt_rows][2];
#pragma unroll
    for (int i = 0; i < simt_rows; ++i) o[i][0] = o[i][1] = 0.f;
    const int d0 = tid, d1 = tid + simt_threads;

    for (int tile = 0; tile < n_tiles; ++tile) {
        cp_async_wait<0>();
        __syncthreads();  // this tile (and Q) visible; the other stage and p_s are free
        if (tile + 1 < n_tiles)
            simt_load_tile<PageT>(a, kv_s + ((tile + 1) % 2) * simt_keys * ks, ks,
                                  s_begin + (tile + 1) * simt_keys, s_end);
        cp_async_commit();
        const PageT* kv = kv_s + (tile % 2) * simt_keys * ks;
        const int k0 = s_begin + tile * simt_keys;
        // Scores for rows (warp, warp + 8) x key lane.
        float acc0 = 0.f, acc1 = 0.f;
        const float* qa = q_s + warp * width;
        const float* qb = q_s + (warp + 8) * width;
        const PageT* kr = kv + lane * ks;
        for (int f = 0; f < width; f += 4) {
            const float4 k4 = load4(kr + f);
            acc0 += dot4(load4(qa + f), k4);
            acc1 += dot4(load4(qb + f), k4);
        }
        // Online softmax of the two rows, whole warp.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int key = k0 + lane;
            const float s = (key <= (hh ? lim1 : lim0) && key < s_hi)
                                ? (hh ? acc1 : acc0) * a.scale_log2
                                : -INFINITY;
            float mx = s;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m_run[hh], mx);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = exp2f(m_run[hh] - m_use);
            const float p = exp2f(s - m_use);
            float sum = p;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            m_run[hh] = m_new;
            l_run[hh] = l_run[hh] * alpha + sum;
            const int lr = warp + 8 * hh;
            p_s[lr * simt_keys + lane] = p;
            if (lane == 0) alpha_s[lr] = alpha;
        }
        __syncthreads();
        // O = O·alpha + P·V for this thread's two columns.
#pragma unroll
        for (int i = 0; i < simt_rows; ++i) {
            o[i][0] *= alpha_s[i];
            o[i][1] *= alpha_s[i];
        }
        if (d0 < a.r) {
            for (int kk = 0; kk < simt_keys; kk += 4) {
                float v0[4], v1[4];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    v0[j] = to_f32(kv[(kk + j) * ks + d0]);
                    v1[j] = d1 < a.r ? to_f32(kv[(kk + j) * ks + d1]) : 0.f;
                }
#pragma unroll
                for (int i = 0; i < simt_rows; ++i) {
                    const float4 p = *reinterpret_cast<const float4*>(p_s + i * simt_keys + kk);
                    o[i][0] += p.x * v0[0] + p.y * v0[1] + p.z * v0[2] + p.w * v0[3];
                    o[i][1] += p.x * v1[0] + p.y * v1[1] + p.z * v1[2] + p.w * v1[3];
                }
            }
        }
    }
    cp_async_wait<0>();
    if (lane == 0) {
        m_s[warp] = m_run[0];
        m_s[warp + 8] = m_run[1];
        l_s[warp] = l_run[0];
        l_s[warp + 8] = l_run[1];
    }
    __syncthreads();
    for (int i = 0; i < simt_rows; ++i) {
        const int64_t row = row0 + i;
        if (row >= rows_total) break;
        const float l = l_s[i], inv = l > 0.f ? 1.f / l : 0.f;
        float* dst = out_ptr(a, direct, split, row);
        if (d0 < a.r) dst[d0] = o[i][0] * inv;
        if (d1 < a.r) dst[d1] = o[i][1] * inv;
        if (!direct && tid == 0)
            a.ws_lse[int64_t(split) * rows_total + row] = l > 0.f ? m_s[i] + log2f(l) : -INFINITY;
    }
}

// ---- merge: out[row] = Σ_s w_s · o_s[row], w_s = 2^(lse_s − lse) over the used splits ---------
// Grid (rows, r / 128): many small blocks, so the few rows of a decode step still spread over
// the SMs (each block reads n_split x 512 bytes).
constexpr int merge_threads = 64;
constexpr int merge_cols = 2 * merge_threads;

__global__ void __launch_bounds__(merge_threads) mla_merge_kernel(const AttnArgs a) {
    pdl_enter();
    extern __shared__ float weight[];  // [max_splits]
    __shared__ float total_max, total_inv;
    const int n_split = *a.ws_n_split;
    if (n_split <= 1) return;  // the attention kernel wrote out directly
    const int64_t rows_total = int64_t(a.T) * a.H;
    const int64_t row = blockIdx.x;
    for (int s = threadIdx.x; s < n_split; s += merge_threads)
        weight[s] = a.ws_lse[int64_t(s) * rows_total + row];
    __syncthreads();
    if (threadIdx.x < 32) {
        float mx = -INFINITY;
        for (int s = threadIdx.x; s < n_split; s += 32) mx = fmaxf(mx, weight[s]);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1)
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_use = mx == -INFINITY ? 0.f : mx;
        float sum = 0.f;
        for (int s = threadIdx.x; s < n_split; s += 32) sum += exp2f(weight[s] - m_use);
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (threadIdx.x == 0) {
            total_max = m_use;
            total_inv = sum > 0.f ? 1.f / sum : 0.f;
        }
    }
    __syncthreads();
    for (int s = threadIdx.x; s < n_split; s += merge_threads)
        weight[s] = exp2f(weight[s] - total_max) * total_inv;
    __syncthreads();
    const int d = blockIdx.y * merge_cols + 2 * threadIdx.x;
    if (d >= a.r) return;
    const float* src = a.ws_o + row * a.r + d;
    const int64_t split_stride = rows_total * a.r;
    float2 acc = make_float2(0.f, 0.f);
    int s = 0;
    for (; s + 4 <= n_split; s += 4) {  // four loads in flight
        float2 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            v[j] = *reinterpret_cast<const float2*>(src + int64_t(s + j) * split_stride);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            acc.x += weight[s + j] * v[j].x;
            acc.y += weight[s + j] * v[j].y;
        }
    }
    for (; s < n_split; ++s) {
        const float2 v = *reinterpret_cast<const float2*>(src + int64_t(s) * split_stride);
        acc.x += weight[s] * v.x;
        acc.y += weight[s] * v.y;
    }
    float* dst = a.out + (row / a.H) * a.out_st + (row % a.H) * a.out_sh + d;
    dst[0] = acc.x;
    dst[1] = acc.y;
}

// ---- host side ------------------------------------------------------------------------------
constexpr size_t ws_align = 256;
size_t align_up(size_t n) { return (n + ws_align - 1) / ws_align * ws_align; }

[[noreturn]] void bad(const std::string& what) {
    ::mgl::fail(__FILE__, __LINE__, "mla attention: " + what);
}

AttnArgs make_args(MlaKernel kernel, const MlaAttnParams& p) {
    const MlaCache& c = p.cache;
    const int64_t r = c.kv_lora_rank, rope = c.rope_dim;
    if (!c.pages || !c.page_table || !p.positions || !p.q_lat || !p.q_pe || !p.out)
        bad("a device pointer (pages, page_table, positions, q_lat, q_pe, out) is null");
    if (c.type != mgl::dtype::f32 && c.type != mgl::dtype::bf16 && c.type != mgl::dtype::f16)
        bad("pages must be f32, bf16 or f16, got " + std::string(mgl::dtype_name(c.type)));
    if (r < 8 || r > 512 || r % 8 != 0 || rope < 8 || rope > 128 || rope % 8 != 0)
        bad("r = " + std::to_string(r) + ", rope = " + std::to_string(rope) +
            ": need multiples of 8 with 8 <= r <= 512 and 8 <= rope <= 128");
    if (reinterpret_cast<uintptr_t>(c.pages) % 16 != 0) bad("pages must be 16-byte aligned");
    if (c.n_pages < 1 || c.page_size < 1 || c.max_pages < 1 || c.n_pages > INT32_MAX ||
        c.page_size > INT32_MAX || c.n_pages * c.page_size > INT32_MAX ||
        c.max_pages * c.page_size > INT32_MAX)
        bad("cache of " + std::to_string(c.n_pages) + " pages x " + std::to_string(c.page_size) +
            " rows, page table of " + std::to_string(c.max_pages) + ": sizes out of range");
    if (p.T < 1 || p.H < 1 || p.T * p.H > INT32_MAX / 2)
        bad("T = " + std::to_string(p.T) + ", H = " + std::to_string(p.H) + " out of range");
    if (p.max_splits < 1 || p.max_splits > 4096)
        bad("max_splits = " + std::to_string(p.max_splits) + ", need 1 .. 4096");
    const size_t need = mla_attn_workspace_bytes(p.T, p.H, r, p.max_splits);
    if (need > 0 && (!p.workspace || p.workspace_bytes < need))
        bad("workspace of " + std::to_string(p.workspace_bytes) + " bytes, need " +
            std::to_string(need) + " for max_splits = " + std::to_string(p.max_splits));
    AttnArgs a{};
    a.pages = c.pages;
    a.page_table = c.page_table;
    a.n_pages = int32_t(c.n_pages);
    a.page_size = int32_t(c.page_size);
    a.max_pages = int32_t(c.max_pages);
    a.page_div = FastDivisor(int32_t(c.page_size));
    a.r = int32_t(r);
    a.rope = int32_t(rope);
    // float4 loads of Q need every row start 16-byte aligned (the views the model passes are).
    auto vec4 = [](const float* q, int64_t st, int64_t sh) {
        return reinterpret_cast<uintptr_t>(q) % 16 == 0 && st % 4 == 0 && sh % 4 == 0;
    };
    a.q_vec4 = vec4(p.q_lat, p.q_lat_stride_t, p.q_lat_stride_h) &&
               vec4(p.q_pe, p.q_pe_stride_t, p.q_pe_stride_h);
    a.q_lat = p.q_lat;
    a.q_lat_st = p.q_lat_stride_t;
    a.q_lat_sh = p.q_lat_stride_h;
    a.q_pe = p.q_pe;
    a.q_pe_st = p.q_pe_stride_t;
    a.q_pe_sh = p.q_pe_stride_h;
    a.out = p.out;
    a.out_st = p.out_stride_t;
    a.out_sh = p.out_stride_h;
    a.positions = p.positions;
    a.T = int32_t(p.T);
    a.H = int32_t(p.H);
    a.head_div = FastDivisor(a.H);
    a.scale_log2 = p.scale * 1.4426950408889634f;
    a.pdl = p.pdl;
    a.min_keys =
        p.min_keys_per_split > 0 ? p.min_keys_per_split : (kernel == MlaKernel::decode ? 64 : 512);
    if (need > 0) {
        auto* base = static_cast<unsigned char*>(p.workspace);
        const size_t lse_bytes = align_up(size_t(p.max_splits) * size_t(p.T * p.H) * 4);
        a.ws_n_split = reinterpret_cast<int32_t*>(base);
        a.ws_lse = reinterpret_cast<float*>(base + ws_align);
        a.ws_o = reinterpret_cast<float*>(base + ws_align + lse_bytes);
    }
    return a;
}

// Decode with bf16 pages and r > 64 (every real model): 8 warps over the output columns (item 2)
// was the quickest decode shape at 512, 4K and 32K keys on the H200 (bench_mla_cuda); it is built
// only for 16-bit pages (bf16, and f16 with the same shape and bytes), so everything else takes
// item 0.
int default_variant(MlaKernel kernel, const MlaAttnParams& p) {
    const bool wide_16bit = (p.cache.type == mgl::dtype::bf16 || p.cache.type == mgl::dtype::f16) &&
                            p.cache.kv_lora_rank > 64;
    return kernel == MlaKernel::decode && wide_16bit ? 2 : 0;
}

// The simt kernel (and its shared memory) for pages of PageT.
template <typename PageT>
void launch_simt(const AttnArgs& a, const MlaAttnParams& p, cudaStream_t stream) {
    const size_t smem = simt_smem_bytes<PageT>(a.r + a.rope);
    auto k = mla_attn_simt_kernel<PageT>;
    CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    dim3 grid(unsigned((p.T * p.H + simt_rows - 1) / simt_rows), unsigned(p.max_splits));
    k<<<grid, simt_threads, smem, stream>>>(a);
    CUDA_CHECK_LAUNCH();
}

void run(MlaKernel kernel, const MlaAttnParams& p, cudaStream_t stream) {
    const AttnArgs a = make_args(kernel, p);
    MlaImpl impl = p.impl;
    if (impl == MlaImpl::automatic) {
        impl = (kernel == MlaKernel::prefill || p.cache.type != mgl::dtype::f32)
                   ? MlaImpl::tensor_core
                   : MlaImpl::cuda_core;
    }
    if (impl == MlaImpl::tensor_core) {
        const TcVariantList list =
            kernel == MlaKernel::decode ? tc_decode_variants() : tc_prefill_variants();
        const int v = p.variant < 0 ? default_variant(kernel, p) : p.variant;
        if (v >= list.count)
            bad("variant " + std::to_string(p.variant) + " out of range (" +
                std::to_string(list.count) + " variants)");
        const TcVariant& tv = list.items[v];
        const TcInstances& in = p.cache.type == mgl::dtype::bf16  ? tv.bf16
                                : p.cache.type == mgl::dtype::f16 ? tv.f16
                                                                  : tv.f32;
        TcLaunchFn fn = a.r <= 64 && in.r64 ? in.r64 : in.r512;
        if (!fn)
            bad(std::string("tensor-core variant '") + tv.name + "' is not built for " +
                mgl::dtype_name(p.cache.type) + " pages");
        fn(a, p.max_splits, stream);
    } else if (p.cache.type == mgl::dtype::bf16) {
        launch_simt<__nv_bfloat16>(a, p, stream);
    } else if (p.cache.type == mgl::dtype::f16) {
        launch_simt<__half>(a, p, stream);
    } else {
        launch_simt<float>(a, p, stream);
    }
    if (p.max_splits > 1) {
        const dim3 grid(unsigned(p.T * p.H), unsigned((a.r + merge_cols - 1) / merge_cols));
        launch_maybe_dependent(mla_merge_kernel, grid, dim3(merge_threads),
                               size_t(p.max_splits) * 4, stream, p.pdl, a);
    }
}

}  // namespace
}  // namespace mla_detail

size_t mla_attn_workspace_bytes(int64_t T, int64_t H, int64_t r, int max_splits) {
    if (max_splits <= 1) return 0;
    const size_t slots = size_t(max_splits) * size_t(T * H);
    const size_t tc =
        mla_detail::ws_align + mla_detail::align_up(slots * 4) + slots * size_t(r) * 4;
    return std::max(tc, mla_decode_simt_workspace_bytes(T * H, r, max_splits));
}

int mla_attn_default_max_splits(MlaKernel kernel, int64_t T, int64_t H) {
    const int64_t rows_per_tile = kernel == MlaKernel::decode ? 16 : 64;
    const int64_t tiles = (T * H + rows_per_tile - 1) / rows_per_tile;
    const int64_t n = sm_count_of_current_device() / (tiles > 0 ? tiles : 1);
    return int(n < 1 ? 1 : (n > 4096 ? 4096 : n));
}

void mla_decode(const MlaAttnParams& p, cudaStream_t stream) {
    // bf16 (and f16) pages: the tensor-core kernel at every length (measured faster than the
    // CUDA-core decode kernel from 512 to 32K keys with bf16, docs/perf.md); f32 pages keep FP32
    // math.
    if (p.impl == MlaImpl::automatic && p.cache.type == mgl::dtype::f32 &&
        mla_decode_simt_supported(p))
        return mla_decode_simt(p, stream);
    mla_detail::run(MlaKernel::decode, p, stream);
}
void mla_prefill(const MlaAttnParams& p, cudaStream_t stream) {
    mla_detail::run(MlaKernel::prefill, p, stream);
}

int mla_attn_variant_count(MlaKernel kernel) {
    return kernel == MlaKernel::decode ? mla_detail::tc_decode_variants().count
                                       : mla_detail::tc_prefill_variants().count;
}
const char* mla_attn_variant_name(MlaKernel kernel, int variant) {
    const auto list = kernel == MlaKernel::decode ? mla_detail::tc_decode_variants()
                                                  : mla_detail::tc_prefill_variants();
    return variant >= 0 && variant < list.count ? list.items[variant].name : "?";
}

}  // namespace minids::kernels
