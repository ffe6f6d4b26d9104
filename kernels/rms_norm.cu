#include <cuda_bf16.h>

#include "cuda_check.h"
#include "rms_norm.h"

namespace minids::kernels {
namespace {

constexpr int block_threads = 256;

// One block per row: a block-wide sum of squares, then a scaled write.
__global__ void rms_norm_kernel(RmsNormParams p) {
    const float* x = p.x + int64_t(blockIdx.x) * p.dim;
    float* y = p.y + int64_t(blockIdx.x) * p.dim;
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
    const float inv = rsqrtf(partial[0] / float(p.dim) + p.eps);
    const __nv_bfloat16* w = reinterpret_cast<const __nv_bfloat16*>(p.w);
    for (int64_t i = threadIdx.x; i < p.dim; i += block_threads) {
        const float wi = w ? __bfloat162float(w[i]) : 1.0f;
        y[i] = wi * (x[i] * inv);
    }
}

}  // namespace

void rms_norm(const RmsNormParams& p, cudaStream_t stream) {
    if (p.rows <= 0 || p.dim <= 0 || p.rows > 0x7fffffff) {
        ::mgl::fail(__FILE__, __LINE__,
                    "rms_norm: unsupported shape (rows, dim) = (" + std::to_string(p.rows) + ", " +
                        std::to_string(p.dim) + ")");
    }
    rms_norm_kernel<<<unsigned(p.rows), block_threads, 0, stream>>>(p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace minids::kernels
