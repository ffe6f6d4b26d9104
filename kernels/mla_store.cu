// kv_store and the fused decode prep (mla.h): per-token writes into the paged latent cache.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "fast_divisor.h"
#include "mla_internal.cuh"

namespace minids::kernels {
namespace {

using mla_detail::cache_row;

__device__ inline void store_elem(float* dst, float v) { *dst = v; }
__device__ inline void store_elem(__nv_bfloat16* dst, float v) { *dst = __float2bfloat16_rn(v); }
__device__ inline void store_elem(__half* dst, float v) { *dst = __float2half_rn(v); }

struct StoreArgs {
    void* pages;
    const int32_t* page_table;
    int32_t n_pages, page_size, max_pages, r, rope;
};

StoreArgs store_args(const MlaCache& c, const char* who) {
    if (!c.pages || !c.page_table)
        ::mgl::fail(__FILE__, __LINE__, std::string(who) + ": pages or page_table is null");
    if (c.type != mgl::dtype::f32 && c.type != mgl::dtype::bf16 && c.type != mgl::dtype::f16)
        ::mgl::fail(
            __FILE__, __LINE__,
            std::string(who) + ": pages must be f32, bf16 or f16, got " + mgl::dtype_name(c.type));
    if (c.kv_lora_rank < 1 || c.rope_dim < 0 || c.rope_dim % 2 != 0 || c.n_pages < 1 ||
        c.page_size < 1 || c.max_pages < 1 || c.n_pages > INT32_MAX ||
        c.max_pages * c.page_size > INT32_MAX || c.kv_lora_rank + c.rope_dim > 65536)
        ::mgl::fail(__FILE__, __LINE__,
                    std::string(who) +
                        ": cache shape out of range (r = " + std::to_string(c.kv_lora_rank) +
                        ", rope = " + std::to_string(c.rope_dim) + ", " +
                        std::to_string(c.n_pages) + " pages of " + std::to_string(c.page_size) +
                        ", page table " + std::to_string(c.max_pages) + "; rope must be even)");
    return {c.pages,
            c.page_table,
            int32_t(c.n_pages),
            int32_t(c.page_size),
            int32_t(c.max_pages),
            int32_t(c.kv_lora_rank),
            int32_t(c.rope_dim)};
}

template <typename PageT>
__global__ void kv_store_kernel(const StoreArgs s, const float* c, int64_t c_stride,
                                const float* k_pe, int64_t k_pe_stride, const int32_t* positions) {
    pdl_enter();
    const int64_t t = blockIdx.x;
    const int64_t row = cache_row(s.page_table, s.max_pages, s.n_pages, s.page_size, positions[t]);
    if (row < 0) return;
    const int width = s.r + s.rope;
    PageT* dst = static_cast<PageT*>(s.pages) + row * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        store_elem(dst + i, i < s.r ? c[t * c_stride + i] : k_pe[t * k_pe_stride + (i - s.r)]);
}

constexpr int prep_threads = 256;

struct PrepArgs {
    StoreArgs s;
    MlaPrepParams p;
    // Fast kernel only: divisors by page_size (pos -> page) and by rope / 2 (thread -> head
    // group and pair), and the number of head groups, prep_threads / (rope / 2).
    FastDivisor page_div, half_div;
    int32_t head_groups;
};

// The fast kernel's fixed work per thread: latent values c (up to prep_fast_r_per_thread, so
// r <= 1024), and QN (head, pair) items of q_pe.
constexpr int prep_fast_r_per_thread = 4;
constexpr int prep_fast_max_qn = 16;

// Fused prep at decode, for latency: at batch 1 it moves ~12 KiB (V2-Lite) and its time is the
// chain of dependent memory round trips and barriers. Thread k owns fixed work, known before the
// PDL wait: c[k + 256·j] (j < 4), rope pair i = k % half of heads g, g + G, ... (QN of them; g = k
// / half, G = 256 / half head groups) and, when g = 0, pair i of k_pe. The constants (norm weight,
// inv_freq) are loaded before the wait; after it every load of the thread (position, kv, q_pe,
// and the page-table entry once the position is in) goes out at once, each thread computes the
// cos/sin of its own pair (no shared table, no barrier for it), and the one barrier of the
// kernel is the sum of squares of c. All loads precede that barrier and all stores follow it, so
// outputs may alias inputs (q_pe in place). Unused slots load an in-bounds element and drop it:
// the loads are unconditional and none waits behind a branch.
template <typename PageT, int QN>
__global__ void __launch_bounds__(prep_threads) mla_prep_fast_kernel(const PrepArgs args) {
    constexpr int RN = prep_fast_r_per_thread;
    const StoreArgs& s = args.s;
    const MlaPrepParams& p = args.p;
    const int tid = int(threadIdx.x);
    const int64_t t = blockIdx.x;
    const int r = s.r, H = int(p.H);
    int g, i;  // head group and rope pair of this thread
    args.half_div.divmod(tid, g, i);
    const int G = args.head_groups;
    const bool rotates = g < G && g < H;  // has a q_pe pair (g = 0: also the k_pe pair)

    pdl_launch_dependents();
    // Model constants, written by no kernel of a step (MlaPrepParams::pdl): read before the wait.
    float wv[RN];
#pragma unroll
    for (int j = 0; j < RN; ++j) wv[j] = 1.f;
    if (p.kv_norm_w) {
        const bool w_f32 = p.kv_norm_w_type == mgl::dtype::f32;
#pragma unroll
        for (int j = 0; j < RN; ++j) {
            const int c = tid + j * prep_threads, cc = c < r ? c : 0;
            const float l =
                w_f32 ? __ldg(static_cast<const float*>(p.kv_norm_w) + cc)
                      : __bfloat162float(static_cast<const __nv_bfloat16*>(p.kv_norm_w)[cc]);
            if (c < r) wv[j] = l;
        }
    }
    const float freq = __ldg(p.inv_freq + i);  // i < rope / 2 for every thread

    pdl_wait();
    const int32_t pos = p.positions[t];
    const float* kv = p.kv + t * p.kv_stride;
    float x[RN];
#pragma unroll
    for (int j = 0; j < RN; ++j) {
        const int c = tid + j * prep_threads;
        const float l = kv[c < r ? c : 0];
        x[j] = c < r ? l : 0.f;
    }
    const float ka = kv[r + 2 * i], kb = kv[r + 2 * i + 1];
    float qa[QN], qb[QN];
#pragma unroll
    for (int k = 0; k < QN; ++k) {
        const int h = g + k * G;
        const float* q = p.q_pe_in + t * p.q_pe_in_stride_t +
                         int64_t(rotates && h < H ? h : 0) * p.q_pe_in_stride_h + 2 * i;
        qa[k] = q[0];
        qb[k] = q[1];
    }
    // The cache row: cache_row's checks, with pos / page_size by multiplication.
    int64_t row = -1;
    if (pos >= 0) {
        int32_t logical, offset;
        args.page_div.divmod(pos, logical, offset);
        if (logical < s.max_pages) {
            const int32_t phys = s.page_table[logical];
            if (phys >= 0 && phys < s.n_pages) row = int64_t(phys) * s.page_size + offset;
        }
    }
    // cos and sin of this thread's pair, double precision as in rope.h (same numbers).
    float cs = 0.f, sn = 0.f;
    if (rotates) {
        double sd, cd;
        sincos(double(float(pos) * freq), &sd, &cd);
        cs = float(cd) * p.attn_factor;
        sn = float(sd) * p.attn_factor;
    }

    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < RN; ++j) ss += x[j] * x[j];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    __shared__ __align__(16) float partial[prep_threads / 32];
    if (tid % 32 == 0) partial[tid / 32] = ss;
    __syncthreads();
    const float4 pa = reinterpret_cast<const float4*>(partial)[0];
    const float4 pb = reinterpret_cast<const float4*>(partial)[1];
    const float total = ((pa.x + pa.y) + (pa.z + pa.w)) + ((pb.x + pb.y) + (pb.z + pb.w));
    const float inv = 1.0f / sqrtf(total / float(r) + p.eps);

    PageT* dst = row < 0 ? nullptr : static_cast<PageT*>(s.pages) + row * (r + s.rope);
#pragma unroll
    for (int j = 0; j < RN; ++j) {
        const int c = tid + j * prep_threads;
        if (c < r) {
            const float v = wv[j] * (x[j] * inv);
            if (dst) store_elem(dst + c, v);
            if (p.c_out) p.c_out[t * p.c_out_stride + c] = v;
        }
    }
    if (g == 0) {
        const float a = ka * cs - kb * sn, b = ka * sn + kb * cs;
        if (dst) {
            store_elem(dst + r + 2 * i, a);
            store_elem(dst + r + 2 * i + 1, b);
        }
        if (p.k_pe_out) {
            p.k_pe_out[t * p.k_pe_out_stride + 2 * i] = a;
            p.k_pe_out[t * p.k_pe_out_stride + 2 * i + 1] = b;
        }
    }
#pragma unroll
    for (int k = 0; k < QN; ++k) {
        const int h = g + k * G;
        if (rotates && h < H) {
            float* o =
                p.q_pe_out + t * p.q_pe_out_stride_t + int64_t(h) * p.q_pe_out_stride_h + 2 * i;
            o[0] = qa[k] * cs - qb[k] * sn;
            o[1] = qa[k] * sn + qb[k] * cs;
        }
    }
}

// Any shape (r > 1024, rope = 0, or more heads than the fast kernel holds): one block per token,
// rms_norm(c), rope(k_pe), both into the cache row, rope(q_pe) per head.
template <typename PageT, typename W>
__global__ void __launch_bounds__(prep_threads) mla_prep_kernel(const PrepArgs args) {
    pdl_enter();
    const StoreArgs& s = args.s;
    const MlaPrepParams& p = args.p;
    __shared__ float cos_t[64], sin_t[64], partial[prep_threads / 32];
    const int64_t t = blockIdx.x;
    const int half = s.rope / 2, width = s.r + s.rope;
    const int32_t pos = p.positions[t];
    for (int i = threadIdx.x; i < half; i += prep_threads) {
        double sn, cs;
        sincos(double(float(pos) * p.inv_freq[i]), &sn, &cs);
        cos_t[i] = float(cs) * p.attn_factor;
        sin_t[i] = float(sn) * p.attn_factor;
    }
    const float* kv = p.kv + t * p.kv_stride;
    float ss = 0.f;
    for (int i = threadIdx.x; i < s.r; i += prep_threads) ss += kv[i] * kv[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < prep_threads / 32; ++w) total += partial[w];
    const float inv = 1.0f / sqrtf(total / float(s.r) + p.eps);

    const int64_t row = cache_row(s.page_table, s.max_pages, s.n_pages, s.page_size, pos);
    PageT* dst = row < 0 ? nullptr : static_cast<PageT*>(s.pages) + row * width;
    const W* w = static_cast<const W*>(p.kv_norm_w);
    for (int i = threadIdx.x; i < s.r; i += prep_threads) {
        float wi = 1.f;
        if (w) {
            if constexpr (sizeof(W) == 2) {
                wi = __bfloat162float(w[i]);
            } else {
                wi = w[i];
            }
        }
        const float v = wi * (kv[i] * inv);
        if (dst) store_elem(dst + i, v);
        if (p.c_out) p.c_out[t * p.c_out_stride + i] = v;
    }
    for (int i = threadIdx.x; i < half; i += prep_threads) {
        const float a = kv[s.r + 2 * i], b = kv[s.r + 2 * i + 1];
        const float ka = a * cos_t[i] - b * sin_t[i], kb = a * sin_t[i] + b * cos_t[i];
        if (dst) {
            store_elem(dst + s.r + 2 * i, ka);
            store_elem(dst + s.r + 2 * i + 1, kb);
        }
        if (p.k_pe_out) {
            p.k_pe_out[t * p.k_pe_out_stride + 2 * i] = ka;
            p.k_pe_out[t * p.k_pe_out_stride + 2 * i + 1] = kb;
        }
    }
    for (int64_t idx = threadIdx.x; idx < p.H * half; idx += prep_threads) {
        const int64_t h = idx / half;
        const int i = int(idx % half);
        const float* q = p.q_pe_in + t * p.q_pe_in_stride_t + h * p.q_pe_in_stride_h + 2 * i;
        const float a = q[0], b = q[1];
        float* o = p.q_pe_out + t * p.q_pe_out_stride_t + h * p.q_pe_out_stride_h + 2 * i;
        o[0] = a * cos_t[i] - b * sin_t[i];
        o[1] = a * sin_t[i] + b * cos_t[i];
    }
}

// The prep kernel for pages of PageT: the fast one with QN rounded up to a power of two
// (qn items of q_pe per thread), or the general one when qn is 0.
template <typename PageT>
void (*prep_kernel_for(int64_t qn, bool w_f32))(PrepArgs) {
    if (qn == 0)
        return w_f32 ? mla_prep_kernel<PageT, float> : mla_prep_kernel<PageT, __nv_bfloat16>;
    return qn <= 2   ? mla_prep_fast_kernel<PageT, 2>
           : qn <= 4 ? mla_prep_fast_kernel<PageT, 4>
           : qn <= 8 ? mla_prep_fast_kernel<PageT, 8>
                     : mla_prep_fast_kernel<PageT, 16>;
}

}  // namespace

void kv_store(const KvStoreParams& p, cudaStream_t stream) {
    const StoreArgs s = store_args(p.cache, "kv_store");
    if (p.T < 0 || p.T > INT32_MAX || !p.positions || (p.T > 0 && (!p.c || !p.k_pe)))
        ::mgl::fail(__FILE__, __LINE__,
                    "kv_store: T = " + std::to_string(p.T) + " or a null c / k_pe / positions");
    if (p.T == 0) return;
    auto kernel = p.cache.type == mgl::dtype::bf16  ? kv_store_kernel<__nv_bfloat16>
                  : p.cache.type == mgl::dtype::f16 ? kv_store_kernel<__half>
                                                    : kv_store_kernel<float>;
    launch_maybe_dependent(kernel, dim3(unsigned(p.T)), dim3(128), 0, stream, p.pdl, s, p.c,
                           p.c_stride, p.k_pe, p.k_pe_stride, p.positions);
}

void mla_prep(const MlaPrepParams& p, cudaStream_t stream) {
    const StoreArgs s = store_args(p.cache, "mla_prep");
    if (p.T < 0 || p.T > INT32_MAX || p.H < 1 || !p.positions || !p.kv || !p.inv_freq ||
        !p.q_pe_in || !p.q_pe_out || p.cache.rope_dim > 128)
        ::mgl::fail(__FILE__, __LINE__,
                    "mla_prep: T = " + std::to_string(p.T) + ", H = " + std::to_string(p.H) +
                        ", rope = " + std::to_string(p.cache.rope_dim) +
                        " (<= 128), or a null positions / kv / inv_freq / q_pe pointer");
    if (p.kv_norm_w && p.kv_norm_w_type != mgl::dtype::bf16 && p.kv_norm_w_type != mgl::dtype::f32)
        ::mgl::fail(__FILE__, __LINE__,
                    std::string("mla_prep: kv_norm_w must be bf16 or f32, got ") +
                        mgl::dtype_name(p.kv_norm_w_type));
    if (p.T == 0) return;
    PrepArgs args{s, p, FastDivisor(s.page_size), FastDivisor(1), 0};
    // The fast kernel: c in at most 4 values per thread, and every (head, pair) of q_pe in at most
    // 16 items per thread (QN rounded up to a power of two; unused items are predicated off).
    const int half = s.rope / 2;
    int64_t qn = 0;  // 0: the general kernel
    if (half > 0 && s.r <= prep_threads * prep_fast_r_per_thread) {
        const int groups = prep_threads / half;
        qn = (p.H + groups - 1) / groups;
        if (qn <= prep_fast_max_qn) {
            args.half_div = FastDivisor(half);
            args.head_groups = groups;
        } else {
            qn = 0;
        }
    }
    const bool w_f32 = p.kv_norm_w_type == mgl::dtype::f32;
    void (*kernel)(PrepArgs) =
        p.cache.type == mgl::dtype::bf16  ? prep_kernel_for<__nv_bfloat16>(qn, w_f32)
        : p.cache.type == mgl::dtype::f16 ? prep_kernel_for<__half>(qn, w_f32)
                                          : prep_kernel_for<float>(qn, w_f32);
    launch_maybe_dependent(kernel, dim3(unsigned(p.T)), dim3(prep_threads), 0, stream, p.pdl, args);
}

}  // namespace minids::kernels
