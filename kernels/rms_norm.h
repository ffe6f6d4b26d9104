// RMSNorm over the innermost dim: y = w * x / sqrt(mean(x²) + eps), FP32 math (DESIGN.md).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace minids::kernels {

struct RmsNormParams {
    const float* x = nullptr;     // [rows, dim]
    const uint16_t* w = nullptr;  // [dim] bf16 weight (null: no weight)
    float* y = nullptr;           // [rows, dim]; may alias x
    int64_t rows = 0;
    int64_t dim = 0;
    float eps = 1e-6f;
};

void rms_norm(const RmsNormParams& p, cudaStream_t stream);

}  // namespace minids::kernels
