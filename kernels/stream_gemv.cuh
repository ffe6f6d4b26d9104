// The streaming GEMV's pass over K for one warp (matmul_stream.cu's gemv_stream_kernel, and the
// router GEMV inside moe_router_route.cu, which must compute its logits exactly as the unfused
// router matmul does): every lane issues UNROLL 16-byte weight loads per row before it touches
// x, the first ones before the PDL wait; x is read through L1; the optional RMSNorm of x is
// folded in (each warp sums x² over all of K itself, no barrier) and, with norm_out, the first
// block writes the normalized rows for the norm's other readers.
//
// Args is the kernel's argument struct; the pass reads its w_row_stride, x_row_stride, norm,
// norm_w, norm_bf16, eps, norm_out, norm_out_stride, m, n, k and chunks.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "dependent_launch.cuh"
#include "load_stream.cuh"

namespace minids::kernels::stream_detail {

// The E weights of one 16-byte chunk as floats.
template <bool FP8>
__device__ __forceinline__ void decode_chunk(const uint4& v, float* f) {
    const uint32_t u[4] = {v.x, v.y, v.z, v.w};
    if constexpr (FP8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const __half2_raw r = __nv_cvt_fp8x2_to_halfraw2(
                    __nv_fp8x2_storage_t((u[i] >> (16 * h)) & 0xffffu), __NV_E4M3);
                const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&r));
                f[4 * i + 2 * h] = p.x;
                f[4 * i + 2 * h + 1] = p.y;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// E norm weights starting at k0 as floats: vector loads (the weight is 16-byte aligned).
template <int E, class Args>
__device__ __forceinline__ void load_norm_w(const Args& a, int k0, float* g) {
    if (a.norm_bf16) {
        const uint4* p =
            reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.norm_w) + k0);
#pragma unroll
        for (int q = 0; q < E / 8; ++q) {
            const uint4 v = __ldg(p + q);
            const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                g[8 * q + 2 * i] = __uint_as_float(u[i] << 16);
                g[8 * q + 2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
            }
        }
    } else {
        const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(a.norm_w) + k0);
#pragma unroll
        for (int q = 0; q < E / 4; ++q) {
            const float4 v = __ldg(p + q);
            g[4 * q] = v.x;
            g[4 * q + 1] = v.y;
            g[4 * q + 2] = v.z;
            g[4 * q + 3] = v.w;
        }
    }
}

// acc[r][m] = row (row0 + r) of W (at wb) · normalized x row m (at xb), not yet scaled by
// 1 / rms; inv[m] = that 1 / rms (1 without the norm). Rows past a.n read zeros.
template <bool FP8, int R, int M, int WARPS, int UNROLL, class Args>
__device__ __forceinline__ void stream_rows(const Args& a, const uint8_t* wb, const float* xb,
                                            int row0, float (&acc)[R][M], float (&inv)[M]) {
    constexpr int E = FP8 ? 16 : 8;  // weights per chunk
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // RMSNorm without a block barrier: every warp walks all of K, so it sums x² itself while it
    // multiplies, and scales its dot products by 1 / rms at the end (W (x g / rms) = (W (x g)) /
    // rms).
    float ss[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        ss[m] = 0.0f;
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = 0.0f;
    }

    uint4 wv[R][UNROLL];
    auto load = [&](int c0) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            const int row = row0 + r;
            const uint8_t* wr = wb + int64_t(row) * a.w_row_stride;
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int c = c0 + u * 32 + lane;
                wv[r][u] = (row < a.n && c < a.chunks) ? load_weights16(wr + int64_t(c) * 16)
                                                       : make_uint4(0, 0, 0, 0);
            }
        }
    };
    // The weights never change during a step: the first loads go out before the wait for the
    // previous kernel (PDL), which wrote x and may still read y.
    pdl_launch_dependents();
    load(0);
    pdl_wait();
    for (int c0 = 0; c0 < a.chunks; c0 += 32 * UNROLL) {
        if (c0 > 0) load(c0);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int c = c0 + u * 32 + lane;
            if (c >= a.chunks) break;
            float nw[E];
            if (a.norm && a.norm_w) load_norm_w<E>(a, c * E, nw);
            float wf[R][E];
#pragma unroll
            for (int r = 0; r < R; ++r) decode_chunk<FP8>(wv[r][u], wf[r]);
#pragma unroll
            for (int m = 0; m < M; ++m) {
                if (m >= a.m) break;
                const float4* xp =
                    reinterpret_cast<const float4*>(xb + m * a.x_row_stride + int64_t(c) * E);
                float xf[E];
#pragma unroll
                for (int q = 0; q < E / 4; ++q) {
                    const float4 v = __ldg(xp + q);
                    xf[4 * q] = v.x;
                    xf[4 * q + 1] = v.y;
                    xf[4 * q + 2] = v.z;
                    xf[4 * q + 3] = v.w;
                }
                if (a.norm) {
#pragma unroll
                    for (int e = 0; e < E; ++e) ss[m] = fmaf(xf[e], xf[e], ss[m]);
                    if (a.norm_w) {
#pragma unroll
                        for (int e = 0; e < E; ++e) xf[e] *= nw[e];
                    }
                }
#pragma unroll
                for (int r = 0; r < R; ++r)
#pragma unroll
                    for (int e = 0; e < E; ++e) acc[r][m] = fmaf(wf[r][e], xf[e], acc[r][m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < M; ++m)
        inv[m] = a.norm ? rsqrtf(warp_sum(ss[m]) / float(a.k) + a.eps) : 1.0f;
    // The norm's other readers get the normalized rows from the first block (every warp has the
    // whole 1 / rms; x and the weight are in L1 by now), as kernels/rms_norm.cu computes them.
    if (a.norm_out && blockIdx.x == 0 && blockIdx.y == 0) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
            if (m >= a.m) break;
            const float* xr = xb + m * a.x_row_stride;
            float* out = a.norm_out + m * a.norm_out_stride;
            for (int i = warp * 32 + lane; i < a.k; i += WARPS * 32) {
                float g = 1.0f;
                if (a.norm_w)
                    g = a.norm_bf16
                            ? __uint_as_float(
                                  uint32_t(__ldg(static_cast<const unsigned short*>(a.norm_w) + i))
                                  << 16)
                            : __ldg(static_cast<const float*>(a.norm_w) + i);
                out[i] = g * (xr[i] * inv[m]);
            }
        }
    }
}

}  // namespace minids::kernels::stream_detail
