// The RMSNorm arithmetic shared by the rms_norm kernel and the fused router of decode
// (moe_router.cu): both must produce the same bits, so that moe_experts reads the same normed x
// whichever of them wrote it, and the router's logits equal the unfused GEMV's.
#pragma once

#include <cstdint>

namespace minids::kernels::rms_detail {

constexpr int block_threads = 256;

// 1 / sqrt(mean(x[0, dim)²) + eps) over a block of block_threads threads: each thread sums its
// strided elements, then the warps and their partials are summed in a fixed order. Every thread
// of the block must call it and gets the result; `partial` is block_threads / 32 floats of
// shared memory that no other call uses concurrently.
__device__ __forceinline__ float block_inv_rms(const float* x, int64_t dim, float eps,
                                               float* partial) {
    float ss = 0.0f;
    for (int64_t i = threadIdx.x; i < dim; i += block_threads) ss += x[i] * x[i];
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
    return 1.0f / sqrtf(partial[0] / float(dim) + eps);
}

// One normed element: weight times (x times 1 / rms), in this order.
__device__ __forceinline__ float rms_scaled(float x, float inv, float w) { return w * (x * inv); }

}  // namespace minids::kernels::rms_detail
