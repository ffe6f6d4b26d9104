// RoPE on the GPU (DESIGN.md "MLA", "YaRN"): interleaved pairs (2i, 2i+1) of the innermost dim,
//   (a, b) -> (a·cos − b·sin, a·sin + b·cos),  angle = positions[t] · inv_freq[i]
// with cos and sin multiplied by attn_factor (YaRN's mscale ratio). As in the CPU backend the
// angle is a float product and cos/sin are evaluated in double, then rounded to float.
// inv_freq is a device array the caller uploads once (mgl::rope_params::inv_freq).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace minids::kernels {

struct RopeParams {
    const float* x = nullptr;  // [T, H, n_dims] (H = 1 for [T, n_dims]); innermost contiguous
    int64_t x_stride_t = 0;    // elements
    int64_t x_stride_h = 0;
    float* y = nullptr;  // [T, H, n_dims]; may equal x (in place, same strides)
    int64_t y_stride_t = 0;
    int64_t y_stride_h = 0;
    const int32_t* positions = nullptr;  // [T] device
    const float* inv_freq = nullptr;     // [n_dims / 2] device
    float attn_factor = 1.0f;
    int64_t T = 0;
    int64_t H = 1;
    int64_t n_dims = 0;  // even
};

void rope(const RopeParams& p, cudaStream_t stream);

}  // namespace minids::kernels
