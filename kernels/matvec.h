// Batch-1 (decode) matrix-vector products y = x · Wᵀ with W stored [n, k] row-major, as in the
// checkpoint. This is the kernel batch-1 decode lives on: every weight byte is read exactly once,
// with 16-byte loads, one warp per output row.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mgl.h"

namespace minids::kernels {

struct MatvecParams {
    mgl::dtype type = mgl::dtype::bf16;  // bf16 or f8_e4m3
    const void* w = nullptr;             // [n, k]; rows 16-byte aligned (k·size % 16 == 0)
    const float* w_scale = nullptr;      // [n] per-row scale (f8_e4m3 only; null = 1)
    const float* x = nullptr;            // [m, k]
    float* y = nullptr;                  // [m, n]
    int64_t n = 0;
    int64_t k = 0;
    int64_t m = 1;  // rows of x (small: decode is 1)
};

// Launches on `stream`; throws mgl::error on a bad launch. k must be a multiple of 16 / elem size.
void matvec(const MatvecParams& p, cudaStream_t stream);

}  // namespace minids::kernels
