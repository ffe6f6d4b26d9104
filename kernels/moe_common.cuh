// Device helpers shared by the MoE kernels (moe_route.cu, moe_decode.cu, moe_grouped.cu) and the
// host-side checks and workspace plans of the two expert paths.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <string>

#include "cp_async.cuh"
#include "cuda_check.h"
#include "load_stream.cuh"
#include "moe.h"

namespace minids::kernels::moe_detail {

constexpr unsigned full_mask = 0xffffffffu;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(full_mask, v, o);
    return v;
}

template <mgl::dtype DT>
constexpr int elem_bytes() {
    return DT == mgl::dtype::f32 ? 4 : DT == mgl::dtype::bf16 ? 2 : 1;
}

// One element of a weight row, exactly widened to f32 (the scalar path for unaligned shapes).
template <mgl::dtype DT>
__device__ __forceinline__ float load_weight(const uint8_t* row, int64_t i) {
    if constexpr (DT == mgl::dtype::f32) {
        return __ldg(reinterpret_cast<const float*>(row) + i);
    } else if constexpr (DT == mgl::dtype::bf16) {
        const unsigned short h = __ldg(reinterpret_cast<const unsigned short*>(row) + i);
        return __uint_as_float(uint32_t(h) << 16);
    } else {
        const __nv_fp8_storage_t b = __ldg(reinterpret_cast<const unsigned char*>(row) + i);
        const __half_raw h = __nv_cvt_fp8_to_halfraw(b, __NV_E4M3);
        return __half2float(__half(h));
    }
}

// Four e4m3 values (one 32-bit word, element 0 in the low byte) to f32, exactly.
__device__ __forceinline__ float4 fp8x4_to_float4(uint32_t w) {
    const __half2_raw lo = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w & 0xffffu), __NV_E4M3);
    const __half2_raw hi = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(w >> 16), __NV_E4M3);
    const float2 a = __half22float2(__half2(lo));
    const float2 b = __half22float2(__half2(hi));
    return make_float4(a.x, a.y, b.x, b.y);
}

// The same with integer operations only: each byte s.eeee.mmm becomes the bf16 pattern
// s.0000eeee.mmm0000, whose value is exactly 2^-120 times the e4m3 value (normal and subnormal
// alike, since both formats scale the mantissa the same way below their smallest normal).
// Callers fold the 2^120 back in with exact power-of-two scalings (fp8_bits_x_scale).
__device__ __forceinline__ float4 fp8x4_to_float4_scaled(uint32_t w) {
    const uint32_t a = __byte_perm(w, 0u, 0x1404u);  // bytes 0, 1 -> high bytes of each half
    const uint32_t b = __byte_perm(w, 0u, 0x3424u);  // bytes 2, 3
    const uint32_t ha = (a & 0x80008000u) | ((a >> 4) & 0x07f007f0u);
    const uint32_t hb = (b & 0x80008000u) | ((b >> 4) & 0x07f007f0u);
    return make_float4(__uint_as_float(ha << 16), __uint_as_float(ha & 0xffff0000u),
                       __uint_as_float(hb << 16), __uint_as_float(hb & 0xffff0000u));
}
// With Fp8Convert::bit_ops the activations are staged times 2^60 and the dot products multiplied
// by 2^60: together the 2^120, with every intermediate far from f32's under- and overflow for
// activations below 2^68 in magnitude.
constexpr float fp8_bits_x_scale = 0x1p60f;

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// 16 bytes of weights dotted with their activations. The activations of a row are staged in
// "chunk-major" order so that a warp reading consecutive 16-byte weight chunks reads consecutive
// float4s (no bank conflicts): element e of chunk c is at float4 index (e / 4) · n_chunks + c,
// component e % 4 (see stage_index). xs points at float4 index c; chunk_stride = n_chunks.
template <mgl::dtype DT, Fp8Convert CVT>
__device__ __forceinline__ float dot_chunk(uint4 w, const float4* xs, int64_t chunk_stride,
                                           float acc) {
    if constexpr (DT == mgl::dtype::f32) {
        const float4 x = xs[0];
        acc = fmaf(__uint_as_float(w.x), x.x, acc);
        acc = fmaf(__uint_as_float(w.y), x.y, acc);
        acc = fmaf(__uint_as_float(w.z), x.z, acc);
        acc = fmaf(__uint_as_float(w.w), x.w, acc);
    } else if constexpr (DT == mgl::dtype::bf16) {
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            const float4 x = xs[s * chunk_stride];
            const float2 a = bf16x2_to_float2(ws[2 * s]);
            const float2 b = bf16x2_to_float2(ws[2 * s + 1]);
            acc = fmaf(a.x, x.x, acc);
            acc = fmaf(a.y, x.y, acc);
            acc = fmaf(b.x, x.z, acc);
            acc = fmaf(b.y, x.w, acc);
        }
    } else {
        const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            const float4 x = xs[s * chunk_stride];
            const float4 f = CVT == Fp8Convert::hardware ? fp8x4_to_float4(ws[s])
                                                         : fp8x4_to_float4_scaled(ws[s]);
            acc = fmaf(f.x, x.x, acc);
            acc = fmaf(f.y, x.y, acc);
            acc = fmaf(f.z, x.z, acc);
            acc = fmaf(f.w, x.w, acc);
        }
    }
    return acc;
}

// Where element i of a staged activation row goes (in floats), for rows read in 16-byte chunks
// of `epc` elements (vec) or element by element (natural order).
__host__ __device__ __forceinline__ int64_t stage_index(int64_t i, int epc, int64_t n_chunks,
                                                        bool vec) {
    if (!vec) return i;
    const int64_t c = i / epc, e = i % epc;
    return ((e / 4) * n_chunks + c) * 4 + (e % 4);
}

__host__ __device__ constexpr int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// ---- host side: checks and plans shared by both paths ----

[[noreturn]] inline void moe_fail(const std::string& msg) { ::mgl::fail(__FILE__, __LINE__, msg); }

inline int64_t dtype_bytes(mgl::dtype t) { return int64_t(mgl::dtype_size(t)); }

// Shapes and pointers every path needs; throws mgl::error naming the bad field.
void check_experts_params(const MoeExpertsParams& p);
// True when every weight row and part is a whole number of 16-byte chunks at 16-byte aligned
// addresses (the vectorized decode kernels and the tensor-core GEMMs need it).
bool weights_vec_aligned(const MoeExpertsParams& p);
inline bool has_shared(const MoeExpertsParams& p) { return p.shared.gate != nullptr; }

// Decode path (moe_decode.cu).
size_t decode_workspace_bytes(const MoeExpertsParams& p);
void decode_experts(const MoeExpertsParams& p, MoeDecodePart part, void* ws, size_t ws_bytes,
                    cudaStream_t stream);
// Grouped path (moe_grouped.cu).
size_t grouped_workspace_bytes(const MoeExpertsParams& p);
void grouped_experts(const MoeExpertsParams& p, void* ws, size_t ws_bytes, cudaStream_t stream);
void grouped_stage(const MoeExpertsParams& p, MoeGroupedStage stage, void* ws, size_t ws_bytes,
                   cudaStream_t stream);
bool grouped_tensor_cores_supported(const MoeExpertsParams& p);

// Kernels whose dynamic shared memory exceeds the default 48 KiB must opt in (a host-side
// attribute, allowed while a stream is being captured).
template <typename Kernel>
void allow_dynamic_smem(Kernel kernel, size_t bytes) {
    if (bytes > 48 * 1024) {
        CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    }
}
constexpr size_t max_smem_per_block = 227 * 1024;  // sm_90 opt-in limit

}  // namespace minids::kernels::moe_detail
