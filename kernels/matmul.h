// Matrix products for the CUDA backend: mgl's matmul op (ggml-like/include/mgl.h), y = x · Wᵀ,
// with the two fusions decode wants (an RMSNorm of x before, a residual add after).
//
//     y[b, m, n] = Σ_k x̂[b, m, k] · W_real[b, n, k]  (+ residual[b, m, n])
//     x̂[b, m, k] = x[b, m, k]                                           (no norm), or
//                = x[b, m, k] · norm_w[k] / sqrt(mean_k(x[b, m, :]²) + eps)   (rms_norm = true)
//     W_real     = W (f32, bf16) or e4m3(W) · w_scale[b, n] (f8_e4m3)
//
// One call, `matmul(params, resources, stream)`, picks the path (`matmul_choose_path`):
//   * stream       M <= 8, bf16 / f8 rows contiguous in K, 16-byte aligned, x rows 16-byte
//                  aligned: CUDA-core GEMV, one warp per row with eight 16-byte weight loads in
//                  flight per lane, FP32. Measured faster than the tensor-core gemv at batch 1
//                  (docs/perf.md), so it is decode's default.
//   * gemv         M <= matmul_gemv_max_m(), bf16 / f8 rows contiguous in K and 16-byte aligned:
//                  tensor-core matrix-vector product that streams W once at HBM speed. x is
//                  split into three bf16 (f16 for f8 weights) terms so the product keeps FP32
//                  accuracy (~1e-6 relative) although the tensor cores take 16-bit inputs.
//   * gemv_column  M small, W with N contiguous (a transposed view such as MLA's W_uk): y is
//                  accumulated across K with loads coalesced across N (CUDA cores, FP32).
//   * generic      M small, anything else (f32 weights, odd K, unaligned rows, other strides):
//                  one warp per output row, FP32. Correct for every layout, not fast.
//   * gemm         M > matmul_gemv_max_m(): cuBLAS. x is converted to BF16 in the workspace
//                  (FP32 accumulate and output); f8 weights are dequantized (scale folded in) to
//                  BF16 in the workspace, in row chunks of at most 64 MiB; f32 weights run FP32
//                  (pedantic: never TF32). Expect ~3e-3 relative error from the BF16 inputs.
//                  Not FP8 tensor cores: on Hopper both operands of an FP8 MMA are 8-bit, so x
//                  would be rounded to e4m3 (~3 % per element), and per-row weight scales would
//                  need an extra epilogue; the dequantization costs one pass over W per call.
//
// Graph capture: no path allocates, synchronizes or reads device values on the host, so every
// call may be captured into a CUDA graph. The caller owns the workspace:
//   * size it with matmul_workspace_bytes(params) (the maximum over the calls that share it),
//   * zero it once when it is allocated (split-K counters live at its start; every launch leaves
//     them at zero again),
//   * never let two calls that may run concurrently (different streams) share one workspace.
// cuBLAS: the gemm path runs on resources.cublas with its stream set to `stream` and pointer mode
// host. cuBLAS needs a workspace of its own to be capturable: the handle's owner must call
// cublasSetStream(handle, stream) and then cublasSetWorkspace(handle, ptr, bytes) once (e.g.
// 32 MiB) before capturing; cuBLAS would otherwise allocate during capture. cublasSetStream
// resets the workspace, so the launcher calls it only when the handle's stream differs.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "mgl.h"

namespace minids::kernels {

// gemm: cuBLAS with x rounded to BF16 (tensor cores); gemm_f32: cuBLAS in FP32 (x as it is, W
// widened to f32), for products whose outputs must not move by BF16 rounding (routers).
enum class MatmulPath : uint8_t { automatic, stream, gemv, gemv_column, generic, gemm, gemm_f32 };
const char* matmul_path_name(MatmulPath p);

// Strides: x, y and residual in ELEMENTS (f32), W in BYTES (mgl's tensors store byte strides; W's
// element may be 1, 2 or 4 bytes). A batch stride of 0 broadcasts (one W for every batch).
struct MatmulParams {
    int64_t batch = 1;  // B (the model batches over heads: x [H, M, K] · W [H, N, K])
    int64_t m = 1;      // rows of x (tokens)
    int64_t n = 0;      // output features (rows of W)
    int64_t k = 0;      // input features

    const float* x = nullptr;    // x[b, m, k] = x[b·x_batch_stride + m·x_row_stride + k]
    int64_t x_row_stride = 0;    // elements
    int64_t x_batch_stride = 0;  // elements

    mgl::dtype w_type = mgl::dtype::bf16;  // f32, bf16 or f8_e4m3
    // W[b, n, k] at (const char*)w + b·w_batch_stride + n·w_row_stride + k·w_col_stride.
    // Row-major [N, K]: w_col_stride = element size. MLA's W_uk view: w_row_stride = element size.
    const void* w = nullptr;
    int64_t w_row_stride = 0;          // bytes between n
    int64_t w_col_stride = 0;          // bytes between k
    int64_t w_batch_stride = 0;        // bytes between b (0: shared by all batches)
    const float* w_scale = nullptr;    // f8_e4m3 only: scale[b·w_scale_batch_stride + n]; null = 1
    int64_t w_scale_batch_stride = 0;  // elements

    float* y = nullptr;  // y[b, m, n] = y[b·y_batch_stride + m·y_row_stride + n]
    int64_t y_row_stride = 0;
    int64_t y_batch_stride = 0;
    const float* residual = nullptr;  // optional, y's layout; may be y itself (in-place add)

    bool rms_norm = false;                      // normalize each row of x first (see above)
    const void* norm_w = nullptr;               // [K], null = no weight
    mgl::dtype norm_w_type = mgl::dtype::bf16;  // bf16 or f32
    float norm_eps = 1e-6f;
    // With rms_norm: also write the normalized rows x·g/rms here (for the norm's other readers,
    // so no separate RMSNorm launch is needed). One batch only; the stream path writes them from
    // its first block, any other path runs kernels::rms_norm first and multiplies those rows.
    float* norm_out = nullptr;
    int64_t norm_out_row_stride = 0;  // elements

    // Programmatic dependent launch (Hopper), gemv and stream paths: the kernel may start while the
    // previous kernel on the stream is finishing and stream its weights meanwhile; it reads x,
    // residual, norm_w and w_scale, and writes y and the workspace, only after that kernel has
    // completed. Set it only when the previous kernel does not write W (e.g. not right after a
    // kernel that fills an expert cache slot this product reads). Captured graphs keep it.
    bool pdl = false;

    // gemm path with 16-bit tensor cores: x goes in as a BF16 pair hi + lo (lo = bf16(x - hi)),
    // two GEMMs on the same weights summed in FP32, so x keeps ~16 significant bits instead of
    // BF16's 8 (what the decode kernels keep: they read x in FP32). Twice the tensor-core work;
    // the prompt's products then round like decode's (full-size V2-Lite: docs/fidelity.md).
    bool split_x = false;

    // Which rules pick the stream path's shape when stream_config is -1: 2 (the default: the
    // 2026-12-02 H200 sweep's shapes, BF16 products of 20 MiB or more with two rows per warp
    // instead of four, BF16 rows of 1 KiB with one; tg128 500.0 vs 497.8 on the whole model)
    // or 1 (the rules before it; matmul_stream.cu, stream_default_config).
    int stream_plan = 2;

    // Overrides for tests and benchmarks; leave as is in production code.
    MatmulPath path = MatmulPath::automatic;
    int gemv_config = -1;    // index into the gemv kernel configurations (-1: chosen by shape)
    int gemv_split = 0;      // split-K factor of the gemv path (0: chosen by shape)
    int stream_config = -1;  // stream path, M = 1: a benchmark shape (matmul_stream_config_*);
                             // -1: chosen by shape
};

// Packed strides for contiguous x [B, M, K], W [B, N, K] (or [N, K] when w_shared), y [B, M, N].
MatmulParams matmul_params_contiguous(mgl::dtype w_type, const void* w, const float* w_scale,
                                      const float* x, float* y, int64_t batch, int64_t m, int64_t n,
                                      int64_t k, bool w_shared = false);

struct MatmulResources {
    cublasHandle_t cublas = nullptr;  // required by the gemm path only
    void* workspace = nullptr;        // >= matmul_workspace_bytes(params), zeroed once
    size_t workspace_bytes = 0;
};

// Largest M the gemv kernels take (the GEMV/GEMM crossover, measured by
// scripts/bench_matvec_cuda.cpp); the backend uses this same rule.
int64_t matmul_gemv_max_m();

// The path `matmul` takes for these params (never `automatic`).
MatmulPath matmul_choose_path(const MatmulParams& p);

// Workspace bytes `matmul` needs for these params on the current device (0 for some paths).
size_t matmul_workspace_bytes(const MatmulParams& p);

// y = x · Wᵀ (+ residual), see the top of this file. Throws mgl::error on invalid params, a
// too-small workspace, or a failed launch.
void matmul(const MatmulParams& p, const MatmulResources& r, cudaStream_t stream);

// What `matmul` would launch, in one line ("gemv cfg 2 (rw2 wn2 wk4 u2) split 4 grid 64x4x1").
std::string matmul_describe(const MatmulParams& p);

// The gemv kernel configurations the benchmark sweeps.
int matmul_gemv_config_count();
std::string matmul_gemv_config_name(int config);
// The stream kernel's shapes the benchmark sweeps (0 is the default plan; the others need M = 1).
int matmul_stream_config_count();
std::string matmul_stream_config_name(int config);

}  // namespace minids::kernels
