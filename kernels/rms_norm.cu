#include <cuda_bf16.h>

#include <cstdint>
#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "rms_norm.h"

namespace minids::kernels {
namespace {

constexpr int block_threads = 256;

// At batch 1 a row is a few KiB and the kernel's time is latency, not bandwidth: how many
// dependent memory round trips and barriers it waits for. The fast kernel below takes rows of
// dim <= 8192 floats (dim % 4 == 0, rows and y 16-byte aligned) and waits for one round trip of
// x: each thread issues all of its float4 loads at once (a compile-time count, predicated), keeps
// them in registers for the write, and the norm weight is already in registers from before the
// PDL wait. rms_norm_kernel handles every other shape.
constexpr int64_t fast_max_dim = int64_t(block_threads) * 32;

// The row's sum of squares: warp shuffles, one partial per warp, one barrier, and then every
// thread adds the eight partials itself (no second barrier to broadcast a total).
__device__ __forceinline__ float block_sum(float v) {
    static_assert(block_threads == 256, "block_sum adds eight warp partials");
    __shared__ __align__(16) float partial[block_threads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    const float4 a = reinterpret_cast<const float4*>(partial)[0];
    const float4 b = reinterpret_cast<const float4*>(partial)[1];
    return ((a.x + a.y) + (a.z + a.w)) + ((b.x + b.y) + (b.z + b.w));
}

// Four weights from 4-aligned index i4 · 4, as floats.
template <typename W>
__device__ __forceinline__ float4 load_w4(const W* w, int i4) {
    if constexpr (sizeof(W) == 2) {
        // Four bf16 in 8 bytes (the launcher checked that w is 8-byte aligned).
        const uint2 u = __ldg(reinterpret_cast<const uint2*>(w) + i4);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
        return make_float4(lo.x, lo.y, hi.x, hi.y);
    } else {
        return __ldg(reinterpret_cast<const float4*>(w) + i4);
    }
}

// One block per row, V float4s of the row per thread (V = 1, 2, 4, 8 for dim up to 1024, 2048,
// 4096, 8192; V2-Lite's hidden size is 2048, V2's 5120). Thread k holds float4s k, k + 256, ...:
// each warp's loads and stores stay coalesced. A slot past the row loads float4 0 (in bounds, dim
// >= 4) and discards it, so every load is unconditional and none waits behind a branch.
template <int V, typename W>
__global__ void __launch_bounds__(block_threads)
    rms_norm_fast_kernel(RmsNormParams p, int64_t xs, int64_t ys) {
    const int n4 = int(p.dim / 4);
    pdl_launch_dependents();
    // The weight is a model constant that no kernel of a step writes (RmsNormParams::pdl), so its
    // loads go out before the wait and overlap the end of the previous kernel.
    const W* w = static_cast<const W*>(p.w);
    float4 wv[V];
#pragma unroll
    for (int v = 0; v < V; ++v) wv[v] = make_float4(1.f, 1.f, 1.f, 1.f);
    if (w) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
            const int j = int(threadIdx.x) + v * block_threads;
            const float4 l = load_w4(w, j < n4 ? j : 0);
            if (j < n4) wv[v] = l;
        }
    }
    pdl_wait();
    const float4* x = reinterpret_cast<const float4*>(p.x + int64_t(blockIdx.x) * xs);
    float4 xv[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int j = int(threadIdx.x) + v * block_threads;
        const float4 l = x[j < n4 ? j : 0];
        xv[v] = j < n4 ? l : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float ss = 0.f;
#pragma unroll
    for (int v = 0; v < V; ++v)
        ss += (xv[v].x * xv[v].x + xv[v].y * xv[v].y) + (xv[v].z * xv[v].z + xv[v].w * xv[v].w);
    // Every load of x is done before the barrier inside block_sum, so y may alias x.
    const float inv = 1.0f / sqrtf(block_sum(ss) / float(p.dim) + p.eps);
    float4* y = reinterpret_cast<float4*>(p.y + int64_t(blockIdx.x) * ys);
#pragma unroll
    for (int v = 0; v < V; ++v) {
        const int j = int(threadIdx.x) + v * block_threads;
        if (j < n4)
            y[j] = make_float4(wv[v].x * (xv[v].x * inv), wv[v].y * (xv[v].y * inv),
                               wv[v].z * (xv[v].z * inv), wv[v].w * (xv[v].w * inv));
    }
}

// Any shape: one block per row, a block-wide sum of squares, then a scaled write.
template <typename W>
__global__ void rms_norm_kernel(RmsNormParams p, int64_t xs, int64_t ys) {
    pdl_enter();
    const float* x = p.x + int64_t(blockIdx.x) * xs;
    float* y = p.y + int64_t(blockIdx.x) * ys;
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < p.dim; i += block_threads) ss += x[i] * x[i];
    __shared__ float partial[block_threads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        float v = threadIdx.x < block_threads / 32 ? partial[threadIdx.x] : 0.0f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) partial[0] = v;
    }
    __syncthreads();
    const float inv = 1.0f / sqrtf(partial[0] / float(p.dim) + p.eps);
    const W* w = static_cast<const W*>(p.w);
    for (int64_t i = threadIdx.x; i < p.dim; i += block_threads) {
        float wi = 1.0f;
        if (w) {
            if constexpr (sizeof(W) == 2) {
                wi = __bfloat162float(w[i]);
            } else {
                wi = w[i];
            }
        }
        y[i] = wi * (x[i] * inv);
    }
}

}  // namespace

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
    if (p.rows <= 0 || p.dim <= 0 || p.rows > 0x7fffffff || !p.x || !p.y) {
        ::mgl::fail(__FILE__, __LINE__,
                    "rms_norm: unsupported shape (rows, dim) = (" + std::to_string(p.rows) + ", " +
                        std::to_string(p.dim) + ") or null x / y");
    }
    if (p.w && p.w_type != mgl::dtype::bf16 && p.w_type != mgl::dtype::f32) {
        ::mgl::fail(
            __FILE__, __LINE__,
            std::string("rms_norm: weight must be bf16 or f32, got ") + mgl::dtype_name(p.w_type));
    }
    const int64_t xs = p.x_stride ? p.x_stride : p.dim, ys = p.y_stride ? p.y_stride : p.dim;
    const bool w_f32 = p.w_type == mgl::dtype::f32;
    const auto aligned = [](const void* ptr, uintptr_t n) {
        return reinterpret_cast<uintptr_t>(ptr) % n == 0;
    };
    const bool fast = p.dim <= fast_max_dim && p.dim % 4 == 0 && xs % 4 == 0 && ys % 4 == 0 &&
                      aligned(p.x, 16) && aligned(p.y, 16) &&
                      (!p.w || aligned(p.w, w_f32 ? 16 : 8));
    void (*kernel)(RmsNormParams, int64_t, int64_t) =
        w_f32 ? rms_norm_kernel<float> : rms_norm_kernel<__nv_bfloat16>;
    if (fast) {
        const int v = p.dim <= 1024 ? 1 : p.dim <= 2048 ? 2 : p.dim <= 4096 ? 4 : 8;
        if (w_f32)
            kernel = v == 1   ? rms_norm_fast_kernel<1, float>
                     : v == 2 ? rms_norm_fast_kernel<2, float>
                     : v == 4 ? rms_norm_fast_kernel<4, float>
                              : rms_norm_fast_kernel<8, float>;
        else
            kernel = v == 1   ? rms_norm_fast_kernel<1, __nv_bfloat16>
                     : v == 2 ? rms_norm_fast_kernel<2, __nv_bfloat16>
                     : v == 4 ? rms_norm_fast_kernel<4, __nv_bfloat16>
                              : rms_norm_fast_kernel<8, __nv_bfloat16>;
    }
    launch_maybe_dependent(kernel, dim3(unsigned(p.rows)), dim3(block_threads), 0, stream, p.pdl, p,
                           xs, ys);
}

}  // namespace minids::kernels
