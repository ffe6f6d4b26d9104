// Row kernels for y = x · Wᵀ on the CPU: one function per (instruction set, weight dtype), picked
// at run time so the build stays portable (no -march=native needed for the fast paths).
#pragma once

#include <cstdint>
#include <vector>

#include "mgl.h"

namespace mgl::cpu {

// One [M, K] block of x against rows of a weight whose K elements are contiguous.
struct matmul_job {
    const float* x = nullptr;  // [M, K], rows x_stride floats apart, K contiguous
    int64_t x_stride = 0;
    int64_t M = 0;
    int64_t K = 0;
    const uint8_t* w = nullptr;  // row n at w + n·w_row_stride, K contiguous elements of `type`
    int64_t w_row_stride = 0;    // bytes
    dtype type = dtype::f32;
    const float* scale = nullptr;  // per output row (f8), or null for 1
    float* y = nullptr;            // y[m·y_stride + n]
    int64_t y_stride = 0;
};

// Computes y[m, n] for all m and n in [n0, n1).
using matmul_rows_fn = void (*)(const matmul_job& job, int64_t n0, int64_t n1);

// The same for a transposed weight view (N contiguous, e.g. W_uk taken from W_kv_b): element
// (n, k) at w + k·w_row_stride + n·element size, so job.w_row_stride is the stride between k.
// Accumulates axpy-style over k, so the weight still streams once.
using matmul_cols_fn = void (*)(const matmul_job& job, int64_t n0, int64_t n1);

struct matmul_kernels {
    const char* isa = "scalar";
    matmul_rows_fn f32 = nullptr;
    matmul_rows_fn bf16 = nullptr;
    matmul_rows_fn f8_e4m3 = nullptr;
    matmul_cols_fn cols_f32 = nullptr;
    matmul_cols_fn cols_bf16 = nullptr;
    matmul_cols_fn cols_f8_e4m3 = nullptr;

    matmul_rows_fn for_type(dtype t) const;
    matmul_cols_fn cols_for_type(dtype t) const;
};

matmul_kernels scalar_matmul_kernels();
// Every kernel set this CPU can run, slowest (scalar) first. Tests check each one.
std::vector<matmul_kernels> available_matmul_kernels();
// The fastest kernel set this CPU can run.
matmul_kernels best_matmul_kernels();

}  // namespace mgl::cpu

namespace mgl::cpu {
// A CPU backend that uses the given kernel set (tests run every set the CPU supports).
std::unique_ptr<backend> make_cpu_backend_with(int n_threads, const matmul_kernels& kernels);
}  // namespace mgl::cpu
