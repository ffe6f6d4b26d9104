#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "cuda_check.h"
#include "matvec.h"

namespace minids::kernels {
namespace {

constexpr int warps_per_block = 8;

__device__ inline float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 16 bytes of weights -> 8 bf16 or 16 fp8 products accumulated against x.
__device__ inline float dot16_bf16(const uint4 wv, const float* x) {
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(&wv);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(w2[i]);
        acc += f.x * x[2 * i] + f.y * x[2 * i + 1];
    }
    return acc;
}

__device__ inline float dot16_fp8(const uint4 wv, const float* x) {
    const __nv_fp8x2_storage_t* w2 = reinterpret_cast<const __nv_fp8x2_storage_t*>(&wv);
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(w2[i], __NV_E4M3);
        float2 f = __half22float2(*reinterpret_cast<__half2*>(&h));
        acc += f.x * x[2 * i] + f.y * x[2 * i + 1];
    }
    return acc;
}

// One warp per output row; each lane reads 16 contiguous bytes per step (coalesced 512 B/warp).
template <mgl::dtype T>
__global__ void matvec_kernel(MatvecParams p) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int64_t row = int64_t(blockIdx.x) * warps_per_block + warp;
    const int64_t tok = blockIdx.y;
    if (row >= p.n) return;
    constexpr int elems = (T == mgl::dtype::bf16) ? 8 : 16;  // per 16-byte load
    const int64_t row_bytes = p.k * (T == mgl::dtype::bf16 ? 2 : 1);
    const uint4* wrow =
        reinterpret_cast<const uint4*>(static_cast<const uint8_t*>(p.w) + row * row_bytes);
    const float* x = p.x + tok * p.k;
    float acc = 0.0f;
    for (int64_t v = lane; v < row_bytes / 16; v += 32) {
        const uint4 wv = __ldg(wrow + v);
        if constexpr (T == mgl::dtype::bf16) {
            acc += dot16_bf16(wv, x + v * elems);
        } else {
            acc += dot16_fp8(wv, x + v * elems);
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        const float s = (T == mgl::dtype::f8_e4m3 && p.w_scale) ? p.w_scale[row] : 1.0f;
        p.y[tok * p.n + row] = acc * s;
    }
}

}  // namespace

void matvec(const MatvecParams& p, cudaStream_t stream) {
    const int64_t elem = p.type == mgl::dtype::bf16 ? 2 : 1;
    if (p.n <= 0 || p.k <= 0 || p.m <= 0 || (p.k * elem) % 16 != 0 || p.m > 65535) {
        ::mgl::fail(__FILE__, __LINE__,
                    "matvec: unsupported shape (n, k, m) = (" + std::to_string(p.n) + ", " +
                        std::to_string(p.k) + ", " + std::to_string(p.m) +
                        "): k·elem must be a multiple of 16 and m <= 65535");
    }
    dim3 grid(unsigned((p.n + warps_per_block - 1) / warps_per_block), unsigned(p.m));
    dim3 block(32 * warps_per_block);
    if (p.type == mgl::dtype::bf16) {
        matvec_kernel<mgl::dtype::bf16><<<grid, block, 0, stream>>>(p);
    } else {
        matvec_kernel<mgl::dtype::f8_e4m3><<<grid, block, 0, stream>>>(p);
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace minids::kernels
