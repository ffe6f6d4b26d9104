// MLA attention launchers (mla.h), the f32 CUDA-core kernel and the split merge. The tensor-core
// kernel lives in mla_attn_tc.cuh.
#include <cuda_bf16.h>

#include <string>

#include "cuda_check.h"
#include "mla_internal.cuh"

namespace minids::kernels {
namespace mla_detail {
namespace {

// ---- CUDA-core kernel: 16 rows x 64 keys per tile, f32 math throughout ----------------------
constexpr int simt_rows = 16;
constexpr int simt_keys = 64;
constexpr int simt_threads = 256;

// f32 elements between rows in shared memory: >= width, = 4 mod 32 so that the float4 reads of
// 8 lanes with different keys fall in different banks.
__host__ __device__ inline int simt_row_stride(int width) { return (width + 31) / 32 * 32 + 4; }

size_t simt_smem_bytes(int width) {
    return 4 * (size_t(simt_rows + simt_keys) * size_t(simt_row_stride(width)) +
                size_t(simt_rows) * simt_keys + 4 * simt_rows);
}

template <typename PageT>
__device__ void simt_load_tile(const AttnArgs& a, float* dst, int ks, int k0, int k_end) {
    const int width = a.r + a.rope;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const PageT* pages = static_cast<const PageT*>(a.pages);
    for (int kr = warp; kr < simt_keys; kr += simt_threads / 32) {
        const int key = k0 + kr;
        const int64_t row =
            key < k_end ? cache_row(a.page_table, a.max_pages, a.n_pages, a.page_size, key) : -1;
        float* d = dst + kr * ks;
        if constexpr (sizeof(PageT) == 4) {
            const float4* src =
                reinterpret_cast<const float4*>(pages + (row < 0 ? 0 : row * width));
            for (int ch = lane; ch < width / 4; ch += 32)
                reinterpret_cast<float4*>(d)[ch] =
                    row < 0 ? make_float4(0.f, 0.f, 0.f, 0.f) : __ldg(src + ch);
        } else {
            const uint4* src = reinterpret_cast<const uint4*>(pages + (row < 0 ? 0 : row * width));
            for (int ch = lane; ch < width / 8; ch += 32) {
                uint4 v = row < 0 ? make_uint4(0, 0, 0, 0) : __ldg(src + ch);
                const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
                float2 f0 = __bfloat1622float2(h[0]), f1 = __bfloat1622float2(h[1]);
                float2 f2 = __bfloat1622float2(h[2]), f3 = __bfloat1622float2(h[3]);
                reinterpret_cast<float4*>(d)[2 * ch] = make_float4(f0.x, f0.y, f1.x, f1.y);
                reinterpret_cast<float4*>(d)[2 * ch + 1] = make_float4(f2.x, f2.y, f3.x, f3.y);
            }
        }
    }
}

__device__ inline float dot4(float4 a, float4 b) {
    return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// Warp w owns rows w and w + 8 for Q·Kᵀ and the softmax (lanes: keys lane and lane + 32);
// thread i owns output columns i and i + 256 of all 16 rows for P·V.
template <typename PageT>
__global__ void __launch_bounds__(simt_threads) mla_attn_simt_kernel(const AttnArgs a) {
    extern __shared__ __align__(16) float fsm[];
    __shared__ int n_keys_slot, block_max_limit;
    const int width = a.r + a.rope, ks = simt_row_stride(width);
    float* q_s = fsm;                                      // [16][ks]
    float* kv_s = q_s + simt_rows * ks;                    // [64][ks]
    float* p_s = kv_s + simt_keys * ks;                    // [16][64]
    float* alpha_s = p_s + simt_rows * simt_keys;          // [16]
    float* m_s = alpha_s + simt_rows;                      // [16]
    float* l_s = m_s + simt_rows;                          // [16]
    int* lim_s = reinterpret_cast<int*>(l_s + simt_rows);  // [16]

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
    for (int idx = tid; idx < simt_rows * width; idx += simt_threads) {
        const int i = idx / width, col = idx % width;
        const int64_t row = row0 + i;
        float v = 0.f;
        if (row < rows_total) {
            const int64_t t = row / a.H, h = row % a.H;
            v = col < a.r ? a.q_lat[t * a.q_lat_st + h * a.q_lat_sh + col]
                          : a.q_pe[t * a.q_pe_st + h * a.q_pe_sh + (col - a.r)];
        }
        q_s[i * ks + col] = v;
    }
    __syncthreads();
    const int s_begin = split * plan.chunk, s_hi = s_begin + plan.chunk;
    const int s_end = min(s_hi, block_max_limit + 1);
    const int lim0 = lim_s[warp], lim1 = lim_s[warp + 8];

    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    float o[simt_rows][2];
#pragma unroll
    for (int i = 0; i < simt_rows; ++i) o[i][0] = o[i][1] = 0.f;
    const int d0 = tid, d1 = tid + simt_threads;

    for (int k0 = s_begin; k0 < s_end; k0 += simt_keys) {
        __syncthreads();  // the previous tile's P·V is done with kv_s and p_s
        simt_load_tile<PageT>(a, kv_s, ks, k0, s_end);
        __syncthreads();
        // Scores for rows (warp, warp + 8) x keys (lane, lane + 32).
        float acc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
        const float* qa = q_s + warp * ks;
        const float* qb = q_s + (warp + 8) * ks;
        const float* ka = kv_s + lane * ks;
        const float* kb = kv_s + (lane + 32) * ks;
        for (int f = 0; f < width; f += 4) {
            const float4 x0 = *reinterpret_cast<const float4*>(qa + f);
            const float4 x1 = *reinterpret_cast<const float4*>(qb + f);
            const float4 y0 = *reinterpret_cast<const float4*>(ka + f);
            const float4 y1 = *reinterpret_cast<const float4*>(kb + f);
            acc[0][0] += dot4(x0, y0);
            acc[0][1] += dot4(x0, y1);
            acc[1][0] += dot4(x1, y0);
            acc[1][1] += dot4(x1, y1);
        }
        // Online softmax of the two rows, whole warp.
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int lim = hh ? lim1 : lim0;
            float s[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + lane + 32 * e;
                s[e] = (key <= lim && key < s_hi) ? acc[hh][e] * a.scale_log2 : -INFINITY;
            }
            float mx = fmaxf(s[0], s[1]);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1)
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const float m_new = fmaxf(m_run[hh], mx);
            const float m_use = m_new == -INFINITY ? 0.f : m_new;
            const float alpha = exp2f(m_run[hh] - m_use);
            const float p0 = exp2f(s[0] - m_use), p1 = exp2f(s[1] - m_use);
            float sum = p0 + p1;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            m_run[hh] = m_new;
            l_run[hh] = l_run[hh] * alpha + sum;
            const int lr = warp + 8 * hh;
            p_s[lr * simt_keys + lane] = p0;
            p_s[lr * simt_keys + lane + 32] = p1;
            if (lane == 0) alpha_s[lr] = alpha;
        }
        __syncthreads();
        // O = O·alpha + P·V for this thread's two columns.
#pragma unroll
        for (int i = 0; i < simt_rows; ++i) {
            o[i][0] *= alpha_s[i];
            o[i][1] *= alpha_s[i];
        }
        const int n_here = min(simt_keys, s_end - k0);
        for (int kk = 0; kk < n_here; kk += 4) {
            float v0[4], v1[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                v0[j] = d0 < a.r ? kv_s[(kk + j) * ks + d0] : 0.f;
                v1[j] = d1 < a.r ? kv_s[(kk + j) * ks + d1] : 0.f;
            }
#pragma unroll
            for (int i = 0; i < simt_rows; ++i) {
                const float4 p = *reinterpret_cast<const float4*>(p_s + i * simt_keys + kk);
                o[i][0] += p.x * v0[0] + p.y * v0[1] + p.z * v0[2] + p.w * v0[3];
                o[i][1] += p.x * v1[0] + p.y * v1[1] + p.z * v1[2] + p.w * v1[3];
            }
        }
    }
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
constexpr int merge_threads = 128;

__global__ void __launch_bounds__(merge_threads) mla_merge_kernel(const AttnArgs a) {
    extern __shared__ float weight[];  // [max_splits]
    const int n_split = *a.ws_n_split;
    if (n_split <= 1) return;  // the attention kernel wrote out directly
    const int64_t rows_total = int64_t(a.T) * a.H;
    const int64_t row = blockIdx.x;
    for (int s = threadIdx.x; s < n_split; s += merge_threads)
        weight[s] = a.ws_lse[int64_t(s) * rows_total + row];
    __syncthreads();
    __shared__ float total_max, total_sum;
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
            total_sum = sum;
        }
    }
    __syncthreads();
    const float inv = total_sum > 0.f ? 1.f / total_sum : 0.f;
    for (int s = threadIdx.x; s < n_split; s += merge_threads)
        weight[s] = exp2f(weight[s] - total_max) * inv;
    __syncthreads();
    float* dst = a.out + (row / a.H) * a.out_st + (row % a.H) * a.out_sh;
    for (int d = threadIdx.x * 4; d < a.r; d += merge_threads * 4) {
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        for (int s = 0; s < n_split; ++s) {
            const float w = weight[s];
            if (w == 0.f) continue;  // empty split: its partial is zeros anyway
            const float4 v = *reinterpret_cast<const float4*>(
                a.ws_o + (int64_t(s) * rows_total + row) * a.r + d);
            acc.x += w * v.x;
            acc.y += w * v.y;
            acc.z += w * v.z;
            acc.w += w * v.w;
        }
        dst[d] = acc.x;
        dst[d + 1] = acc.y;
        dst[d + 2] = acc.z;
        dst[d + 3] = acc.w;
    }
}

// ---- host side ------------------------------------------------------------------------------
constexpr size_t ws_align = 256;
size_t align_up(size_t n) { return (n + ws_align - 1) / ws_align * ws_align; }

[[noreturn]] void bad(const std::string& what) {
    ::mgl::fail(__FILE__, __LINE__, "mla attention: " + what);
}

int sm_count() {
    int dev = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
}

AttnArgs make_args(MlaKernel kernel, const MlaAttnParams& p) {
    const MlaCache& c = p.cache;
    const int64_t r = c.kv_lora_rank, rope = c.rope_dim;
    if (!c.pages || !c.page_table || !p.positions || !p.q_lat || !p.q_pe || !p.out)
        bad("a device pointer (pages, page_table, positions, q_lat, q_pe, out) is null");
    if (c.type != mgl::dtype::f32 && c.type != mgl::dtype::bf16)
        bad("pages must be f32 or bf16, got " + std::string(mgl::dtype_name(c.type)));
    if (r < 8 || r > 512 || r % 8 != 0 || rope < 8 || rope > 128 || rope % 8 != 0)
        bad("r = " + std::to_string(r) + ", rope = " + std::to_string(rope) +
            ": need multiples of 8 with 8 <= r <= 512 and 8 <= rope <= 128");
    if (reinterpret_cast<uintptr_t>(c.pages) % 16 != 0) bad("pages must be 16-byte aligned");
    if (c.n_pages < 1 || c.page_size < 1 || c.max_pages < 1 || c.n_pages > INT32_MAX ||
        c.max_pages * c.page_size > INT32_MAX)
        bad("cache of " + std::to_string(c.n_pages) + " pages x " + std::to_string(c.page_size) +
            " rows, page table of " + std::to_string(c.max_pages) + ": sizes out of range");
    if (p.T < 1 || p.H < 1 || p.T * p.H > INT32_MAX / 2)
        bad("T = " + std::to_string(p.T) + ", H = " + std::to_string(p.H) + " out of range");
    if (p.max_splits < 1 || p.max_splits > 65535)
        bad("max_splits = " + std::to_string(p.max_splits) + ", need 1 .. 65535");
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
    a.r = int32_t(r);
    a.rope = int32_t(rope);
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
    a.scale_log2 = p.scale * 1.4426950408889634f;
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

void run(MlaKernel kernel, const MlaAttnParams& p, cudaStream_t stream) {
    const AttnArgs a = make_args(kernel, p);
    MlaImpl impl = p.impl;
    if (impl == MlaImpl::automatic) {
        impl = (kernel == MlaKernel::prefill || p.cache.type == mgl::dtype::bf16)
                   ? MlaImpl::tensor_core
                   : MlaImpl::cuda_core;
    }
    if (impl == MlaImpl::tensor_core) {
        const TcVariantList list =
            kernel == MlaKernel::decode ? tc_decode_variants() : tc_prefill_variants();
        const int v = p.variant < 0 ? 0 : p.variant;
        if (v >= list.count)
            bad("variant " + std::to_string(p.variant) + " out of range (" +
                std::to_string(list.count) + " variants)");
        const TcVariant& tv = list.items[v];
        const bool bf16 = p.cache.type == mgl::dtype::bf16;
        TcLaunchFn fn = bf16 ? tv.bf16_512 : tv.f32_512;
        if (a.r <= 64 && (bf16 ? tv.bf16_64 : tv.f32_64)) fn = bf16 ? tv.bf16_64 : tv.f32_64;
        if (!fn)
            bad(std::string("tensor-core variant '") + tv.name + "' is not built for " +
                mgl::dtype_name(p.cache.type) + " pages");
        fn(a, p.max_splits, stream);
    } else {
        const size_t smem = simt_smem_bytes(a.r + a.rope);
        auto k = p.cache.type == mgl::dtype::bf16 ? mla_attn_simt_kernel<__nv_bfloat16>
                                                  : mla_attn_simt_kernel<float>;
        CUDA_CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        dim3 grid(unsigned((p.T * p.H + simt_rows - 1) / simt_rows), unsigned(p.max_splits));
        k<<<grid, simt_threads, smem, stream>>>(a);
        CUDA_CHECK_LAUNCH();
    }
    if (p.max_splits > 1) {
        mla_merge_kernel<<<unsigned(p.T * p.H), merge_threads, size_t(p.max_splits) * 4, stream>>>(
            a);
        CUDA_CHECK_LAUNCH();
    }
}

}  // namespace
}  // namespace mla_detail

size_t mla_attn_workspace_bytes(int64_t T, int64_t H, int64_t r, int max_splits) {
    if (max_splits <= 1) return 0;
    const size_t slots = size_t(max_splits) * size_t(T * H);
    return mla_detail::ws_align + mla_detail::align_up(slots * 4) + slots * size_t(r) * 4;
}

int mla_attn_default_max_splits(MlaKernel kernel, int64_t T, int64_t H) {
    const int64_t rows_per_tile = kernel == MlaKernel::decode ? 16 : 64;
    const int64_t tiles = (T * H + rows_per_tile - 1) / rows_per_tile;
    const int64_t n = mla_detail::sm_count() / (tiles > 0 ? tiles : 1);
    return int(n < 1 ? 1 : (n > 65535 ? 65535 : n));
}

void mla_decode(const MlaAttnParams& p, cudaStream_t stream) {
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
