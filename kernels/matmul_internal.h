// Shared between matmul.cu (validation, path choice, the CUDA-core and cuBLAS paths) and
// matmul_gemv.cu (the tensor-core gemv kernels). Not part of the launcher API.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "matmul.h"

namespace minids::kernels::detail {

// Split-K counters sit at the start of the workspace (zeroed once by the owner, left at zero by
// every launch); scratch (partials, converted x, dequantized W) follows.
constexpr size_t counters_bytes = 64 * 1024;
constexpr int64_t max_counters = int64_t(counters_bytes / sizeof(int));
// Shared memory a gemv block may use without opting in to more than the default 48 KiB.
constexpr size_t gemv_smem_limit = 48 * 1024;

struct GemvPlan {
    int config = 0;
    int split = 1;           // blocks along K per row block (grid.y)
    int64_t row_blocks = 0;  // grid.x
    size_t smem_bytes = 0;   // dynamic shared memory per block
    int x_stride = 0;        // elements between token rows of a staged x term
    size_t partial_bytes = 0;
};

GemvPlan plan_gemv(const MatmulParams& p, int sm_count);
void launch_gemv(const MatmulParams& p, const GemvPlan& plan, void* workspace, cudaStream_t stream);
std::string gemv_plan_string(const MatmulParams& p, const GemvPlan& plan);

// The streaming CUDA-core gemv (matmul_stream.cu): decode's default for M <= 8.
constexpr int64_t stream_gemv_max_m = 8;
bool stream_gemv_ok(const MatmulParams& p);
int stream_rows_per_warp(const MatmulParams& p);
// The benchmark configuration the automatic plan uses for this product (0: launch_r's plan).
int stream_default_config(const MatmulParams& p);
// What the stream path runs for this product, for matmul_describe.
std::string stream_plan_string(const MatmulParams& p);
int stream_config_count();
std::string stream_config_name(int config);
void launch_stream_gemv(const MatmulParams& p, cudaStream_t stream);

inline size_t align_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

}  // namespace minids::kernels::detail
