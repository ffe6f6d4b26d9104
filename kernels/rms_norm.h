// RMSNorm over the innermost dim: y = w * x / sqrt(mean(x²) + eps), FP32 math (DESIGN.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mgl.h"

namespace minids::kernels {

struct RmsNormParams {
    const float* x = nullptr;  // [rows, dim], row stride x_stride
    const void* w = nullptr;   // [dim] weight of type w_type (null: no weight)
    float* y = nullptr;        // [rows, dim], row stride y_stride; may alias x (same stride)
    int64_t rows = 0;
    int64_t dim = 0;
    float eps = 1e-6f;
    mgl::dtype w_type = mgl::dtype::bf16;  // bf16 or f32
    int64_t x_stride = 0;                  // elements; 0: dim (contiguous rows)
    int64_t y_stride = 0;                  // elements; 0: dim
    // Launched dependent on the previous kernel (dependent_launch.cuh). x is read and y written
    // only after that kernel has completed, but w may be read before: set it only when no kernel
    // still running writes w (model weights: none does).
    bool pdl = false;
};

void rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace minids::kernels
