// kv_store and the fused decode prep (mla.h): per-token writes into the paged latent cache.
#include <cuda_bf16.h>

#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "mla_internal.cuh"

namespace minids::kernels {
namespace {

using mla_detail::cache_row;

__device__ inline void store_elem(float* dst, float v) { *dst = v; }
__device__ inline void store_elem(__nv_bfloat16* dst, float v) { *dst = __float2bfloat16_rn(v); }

struct StoreArgs {
    void* pages;
    const int32_t* page_table;
    int32_t n_pages, page_size, max_pages, r, rope;
};

StoreArgs store_args(const MlaCache& c, const char* who) {
    if (!c.pages || !c.page_table)
        ::mgl::fail(__FILE__, __LINE__, std::string(who) + ": pages or page_table is null");
    if (c.type != mgl::dtype::f32 && c.type != mgl::dtype::bf16)
        ::mgl::fail(
            __FILE__, __LINE__,
            std::string(who) + ": pages must be f32 or bf16, got " + mgl::dtype_name(c.type));
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
};

// One block per token: rms_norm(c), rope(k_pe), both into the cache row, rope(q_pe) per head.
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

}  // namespace

void kv_store(const KvStoreParams& p, cudaStream_t stream) {
    const StoreArgs s = store_args(p.cache, "kv_store");
    if (p.T < 0 || p.T > INT32_MAX || !p.positions || (p.T > 0 && (!p.c || !p.k_pe)))
        ::mgl::fail(__FILE__, __LINE__,
                    "kv_store: T = " + std::to_string(p.T) + " or a null c / k_pe / positions");
    if (p.T == 0) return;
    auto kernel =
        p.cache.type == mgl::dtype::bf16 ? kv_store_kernel<__nv_bfloat16> : kv_store_kernel<float>;
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
    const PrepArgs args{s, p};
    const bool page_bf16 = p.cache.type == mgl::dtype::bf16;
    const bool w_f32 = p.kv_norm_w_type == mgl::dtype::f32;
    auto kernel =
        page_bf16 ? (w_f32 ? mla_prep_kernel<__nv_bfloat16, float>
                           : mla_prep_kernel<__nv_bfloat16, __nv_bfloat16>)
                  : (w_f32 ? mla_prep_kernel<float, float> : mla_prep_kernel<float, __nv_bfloat16>);
    launch_maybe_dependent(kernel, dim3(unsigned(p.T)), dim3(prep_threads), 0, stream, p.pdl, args);
}

}  // namespace minids::kernels
