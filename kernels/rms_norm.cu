#include <cuda_bf16.h>

#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "rms_norm.h"

namespace minids::kernels {
namespace {

constexpr int block_threads = 256;

// One block per row: a block-wide sum of squares, then a scaled write.
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
    auto kernel =
        p.w_type == mgl::dtype::f32 ? rms_norm_kernel<float> : rms_norm_kernel<__nv_bfloat16>;
    launch_maybe_dependent(kernel, dim3(unsigned(p.rows)), dim3(block_threads), 0, stream, p.pdl, p,
                           xs, ys);
}

}  // namespace minids::kernels
