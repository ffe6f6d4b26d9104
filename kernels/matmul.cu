// matmul: validation, path choice and workspace planning; the CUDA-core kernels for transposed
// weights (gemv_column) and any other layout (generic); the cuBLAS path for large M. The
// tensor-core gemv is in matmul_gemv.cu. See matmul.h for the contract.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "cuda_check.h"
#include "matmul.h"
#include "matmul_internal.h"
#include "rms_norm.h"

#define CUBLAS_CHECK(expr)                                                           \
    do {                                                                             \
        const cublasStatus_t status_ = (expr);                                       \
        if (status_ != CUBLAS_STATUS_SUCCESS)                                        \
            ::mgl::fail(__FILE__, __LINE__,                                          \
                        std::string(#expr) + ": " + cublasGetStatusString(status_)); \
    } while (0)

namespace minids::kernels {
namespace {

using detail::align_up;

// Bytes of dequantized weights one gemm chunk may occupy in the workspace.
constexpr size_t gemm_weight_chunk_cap = size_t(64) << 20;

// ---------------------------------------------------------------------------------------------
// device helpers
// ---------------------------------------------------------------------------------------------
struct Operands {
    const uint8_t* w;
    int64_t w_row_stride, w_col_stride, w_batch_stride;  // bytes
    mgl::dtype w_type;
    const float* scale;
    int64_t scale_batch_stride;
    const float* x;
    int64_t x_row_stride, x_batch_stride;
    float* y;
    int64_t y_row_stride, y_batch_stride;
    const float* residual;
    const void* norm_w;
    bool norm, norm_bf16;
    float eps;
    int m, n, k;
};

Operands operands_of(const MatmulParams& p) {
    Operands o{};
    o.w = static_cast<const uint8_t*>(p.w);
    o.w_row_stride = p.w_row_stride;
    o.w_col_stride = p.w_col_stride;
    o.w_batch_stride = p.w_batch_stride;
    o.w_type = p.w_type;
    o.scale = p.w_scale;
    o.scale_batch_stride = p.w_scale_batch_stride;
    o.x = p.x;
    o.x_row_stride = p.x_row_stride;
    o.x_batch_stride = p.x_batch_stride;
    o.y = p.y;
    o.y_row_stride = p.y_row_stride;
    o.y_batch_stride = p.y_batch_stride;
    o.residual = p.residual;
    o.norm_w = p.norm_w;
    o.norm = p.rms_norm;
    o.norm_bf16 = p.norm_w_type == mgl::dtype::bf16;
    o.eps = p.norm_eps;
    o.m = int(p.m);
    o.n = int(p.n);
    o.k = int(p.k);
    return o;
}

__device__ __forceinline__ float e4m3_to_float(uint8_t v) {
    const __half_raw h = __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(v), __NV_E4M3);
    return __half2float(__half(h));
}

// One weight element at any byte address (rows of a strided view need not be aligned).
__device__ __forceinline__ float load_weight(mgl::dtype t, const uint8_t* p) {
    if (t == mgl::dtype::f8_e4m3) return e4m3_to_float(*p);
    if (t == mgl::dtype::bf16) {
        const uint32_t bits = (reinterpret_cast<uintptr_t>(p) & 1)
                                  ? uint32_t(p[0]) | (uint32_t(p[1]) << 8)
                                  : *reinterpret_cast<const uint16_t*>(p);
        return __uint_as_float(bits << 16);
    }
    if (reinterpret_cast<uintptr_t>(p) & 3) {
        const uint32_t bits = uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) |
                              (uint32_t(p[3]) << 24);
        return __uint_as_float(bits);
    }
    return *reinterpret_cast<const float*>(p);
}

__device__ __forceinline__ float norm_weight(const Operands& o, int k) {
    if (!o.norm_w) return 1.0f;
    return o.norm_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(o.norm_w)[k])
                       : static_cast<const float*>(o.norm_w)[k];
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block of `v`; every thread gets the result. `scratch` holds 32 floats.
__device__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // scratch may still be read from a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int n_warps = int(blockDim.x + 31) / 32;
    float s = 0.0f;
    for (int w = 0; w < n_warps; ++w) s += scratch[w];
    return s;
}

__device__ __forceinline__ void write_output(const Operands& o, int b, int m, int n, float v) {
    const float s = o.scale ? o.scale[b * o.scale_batch_stride + n] : 1.0f;
    const int64_t at = b * o.y_batch_stride + int64_t(m) * o.y_row_stride + n;
    o.y[at] = v * s + (o.residual ? o.residual[at] : 0.0f);
}

// ---------------------------------------------------------------------------------------------
// gemv_column: W with N contiguous (W[k] is a row of N weights in memory). A lane owns VN
// adjacent outputs and one vector load per k; 8 warps split K; 4 tokens per block (grid.y).
// ---------------------------------------------------------------------------------------------
constexpr int col_warps = 8, col_tokens = 4, col_kc = 512, col_vn = 8;

template <mgl::dtype T>
__global__ void __launch_bounds__(col_warps * 32) gemv_column_kernel(const Operands o) {
    constexpr int VN = T == mgl::dtype::f32 ? 4 : col_vn;  // outputs per lane
    constexpr int ELEM = T == mgl::dtype::f32 ? 4 : T == mgl::dtype::bf16 ? 2 : 1;
    constexpr int NB = 32 * VN;
    __shared__ float xs[col_tokens][col_kc];
    __shared__ float red[col_warps][col_tokens][NB];
    __shared__ float inv[col_tokens];
    __shared__ float scratch[32];
    const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int b = int(blockIdx.z), m0 = int(blockIdx.y) * col_tokens;
    const int n0 = int(blockIdx.x) * NB + lane * VN;
    const float* xb = o.x + b * o.x_batch_stride;
    const uint8_t* wb = o.w + b * o.w_batch_stride + int64_t(n0) * ELEM;
    const bool full = n0 + VN <= o.n;
    const bool vec = full && (reinterpret_cast<uintptr_t>(wb) % (VN * ELEM)) == 0 &&
                     o.w_col_stride % (VN * ELEM) == 0;

    if (o.norm) {
        for (int j = 0; j < col_tokens; ++j) {
            float s = 0.0f;
            if (m0 + j < o.m) {
                const float* xr = xb + int64_t(m0 + j) * o.x_row_stride;
                for (int k = tid; k < o.k; k += blockDim.x) s += xr[k] * xr[k];
            }
            s = block_sum(s, scratch);
            if (tid == 0) inv[j] = rsqrtf(s / float(o.k) + o.eps);
        }
    }
    float acc[col_tokens][VN];
#pragma unroll
    for (int j = 0; j < col_tokens; ++j)
#pragma unroll
        for (int v = 0; v < VN; ++v) acc[j][v] = 0.0f;

    for (int kc0 = 0; kc0 < o.k; kc0 += col_kc) {
        const int kcn = min(col_kc, o.k - kc0);
        __syncthreads();  // previous chunk consumed, inv written
        for (int i = tid; i < col_tokens * kcn; i += blockDim.x) {
            const int j = i / kcn, kk = i % kcn, m = m0 + j;
            float v = 0.0f;
            if (m < o.m) {
                v = xb[int64_t(m) * o.x_row_stride + kc0 + kk];
                if (o.norm) v *= inv[j] * norm_weight(o, kc0 + kk);
            }
            xs[j][kk] = v;
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = warp; kk < kcn; kk += col_warps) {
            const uint8_t* wp = wb + int64_t(kc0 + kk) * o.w_col_stride;
            float wv[VN];
            if (vec) {
                if constexpr (T == mgl::dtype::f32) {
                    const float4 q = *reinterpret_cast<const float4*>(wp);
                    wv[0] = q.x, wv[1] = q.y, wv[2] = q.z, wv[3] = q.w;
                } else if constexpr (T == mgl::dtype::bf16) {
                    const uint4 q = *reinterpret_cast<const uint4*>(wp);
                    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        wv[2 * i] = __uint_as_float(words[i] << 16);
                        wv[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
                    }
                } else {
                    const uint2 q = *reinterpret_cast<const uint2*>(wp);
                    const uint32_t words[2] = {q.x, q.y};
#pragma unroll
                    for (int i = 0; i < 8; ++i)
                        wv[i] = e4m3_to_float(uint8_t(words[i / 4] >> (8 * (i % 4))));
                }
            } else {
#pragma unroll
                for (int v = 0; v < VN; ++v)
                    wv[v] = n0 + v < o.n ? load_weight(T, wp + v * ELEM) : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < col_tokens; ++j) {
                const float xv = xs[j][kk];
#pragma unroll
                for (int v = 0; v < VN; ++v) acc[j][v] += xv * wv[v];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < col_tokens; ++j)
#pragma unroll
        for (int v = 0; v < VN; ++v) red[warp][j][lane * VN + v] = acc[j][v];
    __syncthreads();
    for (int i = tid; i < col_tokens * NB; i += blockDim.x) {
        const int j = i / NB, col = i % NB;
        const int n = int(blockIdx.x) * NB + col, m = m0 + j;
        if (n >= o.n || m >= o.m) continue;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < col_warps; ++w) v += red[w][j][col];
        write_output(o, b, m, n, v);
    }
}

// ---------------------------------------------------------------------------------------------
// generic: one warp per output row n and 4 tokens; lanes stride over K. Any dtype, stride and
// alignment; FP32 throughout.
// ---------------------------------------------------------------------------------------------
constexpr int gen_warps = 8, gen_tokens = 4;

__global__ void __launch_bounds__(gen_warps * 32) gemv_generic_kernel(const Operands o) {
    const int lane = int(threadIdx.x) & 31;
    const int n = int(blockIdx.x) * gen_warps + int(threadIdx.x >> 5);
    const int b = int(blockIdx.z), m0 = int(blockIdx.y) * gen_tokens;
    if (n >= o.n) return;
    const float* xb = o.x + b * o.x_batch_stride;
    const float* xr[gen_tokens];
    float inv[gen_tokens];
#pragma unroll
    for (int j = 0; j < gen_tokens; ++j) {
        xr[j] = xb + int64_t(min(m0 + j, o.m - 1)) * o.x_row_stride;
        inv[j] = 1.0f;
        if (o.norm) {
            float s = 0.0f;
            for (int k = lane; k < o.k; k += 32) s += xr[j][k] * xr[j][k];
            inv[j] = rsqrtf(warp_sum(s) / float(o.k) + o.eps);
        }
    }
    const uint8_t* wr = o.w + b * o.w_batch_stride + int64_t(n) * o.w_row_stride;
    float acc[gen_tokens] = {};
    for (int k = lane; k < o.k; k += 32) {
        const float wv = load_weight(o.w_type, wr + int64_t(k) * o.w_col_stride);
        const float nw = o.norm ? norm_weight(o, k) : 1.0f;
#pragma unroll
        for (int j = 0; j < gen_tokens; ++j) acc[j] += xr[j][k] * inv[j] * nw * wv;
    }
#pragma unroll
    for (int j = 0; j < gen_tokens; ++j) {
        const float v = warp_sum(acc[j]);
        if (lane == 0 && m0 + j < o.m) write_output(o, b, m0 + j, n, v);
    }
}

// ---------------------------------------------------------------------------------------------
// gemm path helpers: x̂ -> contiguous bf16/f32 [B, M, K] (+ residual -> y), W -> contiguous
// [rows, K] bf16/f32 with the f8 scale folded in.
// ---------------------------------------------------------------------------------------------
// With lo_offset > 0 (split_x) the BF16 residual x - hi of each element goes lo_offset elements
// after its hi.
__global__ void prepare_x_kernel(const Operands o, void* x_out, bool out_bf16, bool copy_residual,
                                 int64_t lo_offset) {
    __shared__ float scratch[32];
    const int m = int(blockIdx.x), b = int(blockIdx.y);
    const float* xr = o.x + b * o.x_batch_stride + int64_t(m) * o.x_row_stride;
    float inv = 1.0f;
    if (o.norm) {
        float s = 0.0f;
        for (int k = int(threadIdx.x); k < o.k; k += blockDim.x) s += xr[k] * xr[k];
        inv = rsqrtf(block_sum(s, scratch) / float(o.k) + o.eps);
    }
    if (x_out) {
        const int64_t row = (int64_t(b) * o.m + m) * o.k;
        for (int k = int(threadIdx.x); k < o.k; k += blockDim.x) {
            const float v = o.norm ? xr[k] * inv * norm_weight(o, k) : xr[k];
            if (out_bf16) {
                const __nv_bfloat16 hi = __float2bfloat16_rn(v);
                static_cast<__nv_bfloat16*>(x_out)[row + k] = hi;
                if (lo_offset > 0)
                    static_cast<__nv_bfloat16*>(x_out)[row + k + lo_offset] =
                        __float2bfloat16_rn(v - __bfloat162float(hi));
            } else {
                static_cast<float*>(x_out)[row + k] = v;
            }
        }
    }
    if (copy_residual) {
        const int64_t at = b * o.y_batch_stride + int64_t(m) * o.y_row_stride;
        for (int n = int(threadIdx.x); n < o.n; n += blockDim.x) o.y[at + n] = o.residual[at + n];
    }
}

// Rows [n0, n0 + gridDim.x) of weight batch `wb` -> out[(blockIdx.y) * rows + r][k].
__global__ void materialize_w_kernel(const Operands o, int wb_first, int n0, void* out,
                                     bool out_bf16) {
    const int r = int(blockIdx.x), n = n0 + r, bw = wb_first + int(blockIdx.y);
    const uint8_t* wr = o.w + bw * o.w_batch_stride + int64_t(n) * o.w_row_stride;
    const float s = o.scale ? o.scale[bw * o.scale_batch_stride + n] : 1.0f;
    const int64_t row = (int64_t(blockIdx.y) * gridDim.x + r) * o.k;
    for (int k = int(threadIdx.x); k < o.k; k += blockDim.x) {
        const float v = load_weight(o.w_type, wr + int64_t(k) * o.w_col_stride) * s;
        if (out_bf16) {
            static_cast<__nv_bfloat16*>(out)[row + k] = __float2bfloat16_rn(v);
        } else {
            static_cast<float*>(out)[row + k] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// host side
// ---------------------------------------------------------------------------------------------
int64_t elem_of(const MatmulParams& p) { return int64_t(mgl::dtype_size(p.w_type)); }
bool row_layout(const MatmulParams& p) { return p.k == 1 || p.w_col_stride == elem_of(p); }
bool column_layout(const MatmulParams& p) {
    return !row_layout(p) && (p.n == 1 || p.w_row_stride == elem_of(p));
}

bool tensor_core_gemv_ok(const MatmulParams& p) {
    if (p.w_type != mgl::dtype::bf16 && p.w_type != mgl::dtype::f8_e4m3) return false;
    const auto addr = reinterpret_cast<uintptr_t>(p.w);
    return p.m <= 16 && p.w_col_stride == elem_of(p) && (p.k * elem_of(p)) % 16 == 0 &&
           addr % 16 == 0 && p.w_row_stride % 16 == 0 && p.w_batch_stride % 16 == 0;
}

void fail_params(const std::string& why) { ::mgl::fail(__FILE__, __LINE__, "matmul: " + why); }

void validate(const MatmulParams& p) {
    const auto dims = "(batch, m, n, k) = (" + std::to_string(p.batch) + ", " +
                      std::to_string(p.m) + ", " + std::to_string(p.n) + ", " +
                      std::to_string(p.k) + ")";
    if (p.batch < 1 || p.m < 1 || p.n < 1 || p.k < 1) fail_params("empty shape " + dims);
    if (p.batch > 65535 || p.m > 0x7fffffff || p.n > 0x7fffffff || p.k > 0x7fffffff)
        fail_params("shape too large " + dims);
    if (!p.x || !p.w || !p.y) fail_params("x, w and y must be set");
    if (p.w_type != mgl::dtype::f32 && p.w_type != mgl::dtype::bf16 &&
        p.w_type != mgl::dtype::f8_e4m3)
        fail_params(std::string("unsupported weight dtype ") + mgl::dtype_name(p.w_type));
    if (p.w_scale && p.w_type != mgl::dtype::f8_e4m3)
        fail_params("w_scale is only for f8_e4m3 weights");
    if (p.norm_w && p.norm_w_type != mgl::dtype::bf16 && p.norm_w_type != mgl::dtype::f32)
        fail_params("norm_w must be bf16 or f32");
    if (p.norm_out && (!p.rms_norm || p.batch != 1 || (p.m > 1 && p.norm_out_row_stride < p.k)))
        fail_params("norm_out needs rms_norm, one batch and rows that do not overlap " + dims);
    if (p.x_row_stride < 0 || p.x_batch_stride < 0 || p.w_row_stride < 0 || p.w_col_stride < 0 ||
        p.w_batch_stride < 0 || p.w_scale_batch_stride < 0)
        fail_params("negative strides are not supported");
    if ((p.n > 1 && p.w_row_stride == 0) || (p.k > 1 && p.w_col_stride == 0))
        fail_params("w_row_stride / w_col_stride must be set");
    if (p.m > 1 && p.y_row_stride < p.n) fail_params("y rows overlap (y_row_stride < n)");
    if (p.batch > 1 && p.y_batch_stride < (p.m - 1) * p.y_row_stride + p.n)
        fail_params("y batches overlap (y_batch_stride too small)");
}

// ----- gemm plan -----
struct GemmPlan {
    bool f32 = false;                        // FP32 operands and math (no tensor cores)
    bool convert_x = false, x_bf16 = false;  // x̂ into the workspace
    bool split = false;                      // x̂ as BF16 hi then lo (MatmulParams::split_x)
    size_t x_bytes = 0;
    bool materialize = false, w_bf16 = false;
    int64_t w_batches = 1;   // distinct weight batches (1 when shared)
    int64_t chunk_rows = 0;  // rows per dequantized chunk
    bool whole = false;      // all batches and rows in one chunk
    size_t w_bytes = 0;
};

bool cublas_direct_weights(const MatmulParams& p) {
    if (p.w_type == mgl::dtype::f8_e4m3) return false;
    const int64_t e = elem_of(p);
    if (reinterpret_cast<uintptr_t>(p.w) % e || p.w_batch_stride % e) return false;
    if (row_layout(p)) return p.w_row_stride % e == 0 && (p.n == 1 || p.w_row_stride / e >= p.k);
    if (column_layout(p)) return p.w_col_stride % e == 0 && (p.k == 1 || p.w_col_stride / e >= p.n);
    return false;
}

GemmPlan plan_gemm(const MatmulParams& p, bool f32_math) {
    GemmPlan g;
    const bool f32 = f32_math || p.w_type == mgl::dtype::f32;
    g.f32 = f32;
    g.x_bf16 = !f32;
    g.split = g.x_bf16 && p.split_x;
    g.convert_x = !f32 || p.rms_norm || (p.m > 1 && p.x_row_stride < p.k);
    g.x_bytes =
        g.convert_x ? size_t(p.batch * p.m * p.k) * (g.x_bf16 ? 2 : 4) * (g.split ? 2 : 1) : 0;
    // FP32 math on 16-bit or FP8 weights needs them widened; otherwise only layouts cuBLAS
    // cannot read directly do.
    g.materialize = (f32 && p.w_type != mgl::dtype::f32) || !cublas_direct_weights(p);
    if (g.materialize) {
        g.w_bf16 = !f32;
        const size_t row_bytes = size_t(p.k) * (g.w_bf16 ? 2 : 4);
        g.w_batches = p.w_batch_stride == 0 ? 1 : p.batch;
        const size_t all = row_bytes * size_t(p.n) * size_t(g.w_batches);
        g.whole = all <= gemm_weight_chunk_cap;
        g.chunk_rows =
            g.whole ? p.n
                    : std::max<int64_t>(
                          1, std::min<int64_t>(p.n, int64_t(gemm_weight_chunk_cap / row_bytes)));
        g.w_bytes = g.whole ? all : row_bytes * size_t(g.chunk_rows);
    }
    return g;
}

size_t gemm_workspace(const GemmPlan& g) {
    if (!g.convert_x && !g.materialize) return 0;
    return detail::counters_bytes + align_up(g.x_bytes, 256) + g.w_bytes;
}

void run_gemm(const MatmulParams& p, const MatmulResources& r, cudaStream_t stream, bool f32_math) {
    if (!r.cublas) fail_params("the gemm path (m > matmul_gemv_max_m()) needs a cuBLAS handle");
    const GemmPlan g = plan_gemm(p, f32_math);
    const Operands o = operands_of(p);
    char* scratch = static_cast<char*>(r.workspace) + detail::counters_bytes;
    void* x_conv = g.convert_x ? scratch : nullptr;
    void* w_conv = g.materialize ? scratch + align_up(g.x_bytes, 256) : nullptr;
    const bool copy_residual = p.residual && p.residual != p.y;
    if (g.convert_x || copy_residual) {
        prepare_x_kernel<<<dim3(unsigned(p.m), unsigned(p.batch)), 256, 0, stream>>>(
            o, x_conv, g.x_bf16, copy_residual, g.split ? p.batch * p.m * p.k : 0);
        CUDA_CHECK_LAUNCH();
    }
    // cublasSetStream resets the handle's workspace to cuBLAS's own pool, which allocates during
    // graph capture: change the stream only when it differs (the owner sets stream, then
    // workspace, once).
    cudaStream_t current = nullptr;
    CUBLAS_CHECK(cublasGetStream(r.cublas, &current));
    if (current != stream) CUBLAS_CHECK(cublasSetStream(r.cublas, stream));
    CUBLAS_CHECK(cublasSetPointerMode(r.cublas, CUBLAS_POINTER_MODE_HOST));
    const float alpha = 1.0f, beta = p.residual ? 1.0f : 0.0f;
    const bool f32 = g.f32;
    const cudaDataType in_type = f32 ? CUDA_R_32F : CUDA_R_16BF;
    const cublasComputeType_t compute = f32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
    // x̂ as the K x M column-major B operand.
    const void* xb = g.convert_x ? x_conv : p.x;
    const int64_t ldx = g.convert_x ? p.k : std::max(p.x_row_stride, p.k);
    const int64_t x_bstride = g.convert_x ? p.m * p.k : p.x_batch_stride;
    const int64_t ldy = std::max(p.y_row_stride, p.n);
    // One call of y[:, :, n0 : n0 + rows] for `batches` batches starting at b0.
    // With split x the second product (x's lo half, right after the hi half) is added onto the
    // first's result.
    const float add = 1.0f;
    auto gemm = [&](cublasOperation_t op_w, const void* w, int64_t ldw, int64_t w_bstride,
                    int64_t n0, int64_t rows, int64_t b0, int64_t batches) {
        MGL_CHECK(ldw <= 0x7fffffff && ldx <= 0x7fffffff && ldy <= 0x7fffffff,
                  "matmul: leading dimension too large for cuBLAS");
        const size_t xe = g.convert_x ? (g.x_bf16 ? 2 : 4) : 4;
        const void* xp = static_cast<const char*>(xb) + size_t(b0 * x_bstride) * xe;
        float* yp = p.y + b0 * p.y_batch_stride + n0;
        CUBLAS_CHECK(cublasGemmStridedBatchedEx(
            r.cublas, op_w, CUBLAS_OP_N, int(rows), int(p.m), int(p.k), &alpha, w, in_type,
            int(ldw), w_bstride, xp, in_type, int(ldx), x_bstride, &beta, yp, CUDA_R_32F, int(ldy),
            p.y_batch_stride, int(batches), compute, CUBLAS_GEMM_DEFAULT));
        if (g.split) {
            const void* lo = static_cast<const char*>(xp) + size_t(p.batch * p.m * p.k) * xe;
            CUBLAS_CHECK(cublasGemmStridedBatchedEx(
                r.cublas, op_w, CUBLAS_OP_N, int(rows), int(p.m), int(p.k), &alpha, w, in_type,
                int(ldw), w_bstride, lo, in_type, int(ldx), x_bstride, &add, yp, CUDA_R_32F,
                int(ldy), p.y_batch_stride, int(batches), compute, CUBLAS_GEMM_DEFAULT));
        }
    };
    if (!g.materialize) {
        const int64_t e = elem_of(p);
        const bool row = row_layout(p);
        const int64_t ldw =
            row ? std::max(p.w_row_stride / e, p.k) : std::max(p.w_col_stride / e, p.n);
        gemm(row ? CUBLAS_OP_T : CUBLAS_OP_N, p.w, ldw, p.w_batch_stride / e, 0, p.n, 0, p.batch);
        return;
    }
    if (g.whole) {
        materialize_w_kernel<<<dim3(unsigned(p.n), unsigned(g.w_batches)), 256, 0, stream>>>(
            o, 0, 0, w_conv, g.w_bf16);
        CUDA_CHECK_LAUNCH();
        gemm(CUBLAS_OP_T, w_conv, p.k, g.w_batches == 1 ? 0 : p.n * p.k, 0, p.n, 0, p.batch);
        return;
    }
    for (int64_t bw = 0; bw < g.w_batches; ++bw) {
        for (int64_t n0 = 0; n0 < p.n; n0 += g.chunk_rows) {
            const int64_t rows = std::min(g.chunk_rows, p.n - n0);
            materialize_w_kernel<<<dim3(unsigned(rows), 1u), 256, 0, stream>>>(o, int(bw), int(n0),
                                                                               w_conv, g.w_bf16);
            CUDA_CHECK_LAUNCH();
            // A shared weight serves every batch at once; a batched one only its own.
            if (g.w_batches == 1) {
                gemm(CUBLAS_OP_T, w_conv, p.k, 0, n0, rows, 0, p.batch);
            } else {
                gemm(CUBLAS_OP_T, w_conv, p.k, 0, n0, rows, bw, 1);
            }
        }
    }
}

void run_column(const MatmulParams& p, cudaStream_t stream) {
    const Operands o = operands_of(p);
    const int vn = p.w_type == mgl::dtype::f32 ? 4 : col_vn;
    const dim3 grid(unsigned((p.n + 32 * vn - 1) / (32 * vn)),
                    unsigned((p.m + col_tokens - 1) / col_tokens), unsigned(p.batch));
    MGL_CHECK(grid.y <= 65535, "matmul: m too large for the gemv_column path");
    switch (p.w_type) {
        case mgl::dtype::f32:
            gemv_column_kernel<mgl::dtype::f32><<<grid, col_warps * 32, 0, stream>>>(o);
            break;
        case mgl::dtype::bf16:
            gemv_column_kernel<mgl::dtype::bf16><<<grid, col_warps * 32, 0, stream>>>(o);
            break;
        default:
            gemv_column_kernel<mgl::dtype::f8_e4m3><<<grid, col_warps * 32, 0, stream>>>(o);
            break;
    }
    CUDA_CHECK_LAUNCH();
}

void run_generic(const MatmulParams& p, cudaStream_t stream) {
    const dim3 grid(unsigned((p.n + gen_warps - 1) / gen_warps),
                    unsigned((p.m + gen_tokens - 1) / gen_tokens), unsigned(p.batch));
    MGL_CHECK(grid.y <= 65535, "matmul: m too large for the generic path");
    gemv_generic_kernel<<<grid, gen_warps * 32, 0, stream>>>(operands_of(p));
    CUDA_CHECK_LAUNCH();
}

MatmulPath resolve(const MatmulParams& p) {
    if (p.path == MatmulPath::automatic) return matmul_choose_path(p);
    if (p.path == MatmulPath::stream && !detail::stream_gemv_ok(p))
        fail_params(
            "the stream path needs bf16/f8 rows contiguous in K, 16-byte aligned w and x, "
            "m <= 8");
    if (p.path == MatmulPath::gemv && !tensor_core_gemv_ok(p))
        fail_params("the gemv path needs bf16/f8 rows contiguous in K, 16-byte aligned, m <= 16");
    if (p.path == MatmulPath::gemv_column && !column_layout(p))
        fail_params("the gemv_column path needs a weight with N contiguous");
    return p.path;
}

}  // namespace

const char* matmul_path_name(MatmulPath p) {
    switch (p) {
        case MatmulPath::automatic:
            return "automatic";
        case MatmulPath::stream:
            return "stream";
        case MatmulPath::gemv:
            return "gemv";
        case MatmulPath::gemv_column:
            return "gemv_column";
        case MatmulPath::generic:
            return "generic";
        case MatmulPath::gemm:
            return "gemm";
        case MatmulPath::gemm_f32:
            return "gemm_f32";
    }
    return "?";
}

MatmulParams matmul_params_contiguous(mgl::dtype w_type, const void* w, const float* w_scale,
                                      const float* x, float* y, int64_t batch, int64_t m, int64_t n,
                                      int64_t k, bool w_shared) {
    MatmulParams p;
    p.batch = batch;
    p.m = m;
    p.n = n;
    p.k = k;
    p.x = x;
    p.x_row_stride = k;
    p.x_batch_stride = m * k;
    p.w_type = w_type;
    p.w = w;
    const int64_t e = int64_t(mgl::dtype_size(w_type));
    p.w_col_stride = e;
    p.w_row_stride = k * e;
    p.w_batch_stride = w_shared ? 0 : n * k * e;
    p.w_scale = w_scale;
    p.w_scale_batch_stride = w_shared ? 0 : n;
    p.y = y;
    p.y_row_stride = n;
    p.y_batch_stride = m * n;
    return p;
}

// Measured on the H200 (scripts/bench_matvec_cuda.cpp, "GEMV vs GEMM" table): the tensor-core
// gemv reads W once for up to 16 tokens, so it stays memory-bound and ahead of cuBLAS (plus the
// conversion of x) up to its limit of 16 rows.
int64_t matmul_gemv_max_m() { return 16; }

MatmulPath matmul_choose_path(const MatmulParams& p) {
    // Narrow products (a MoE router: 64-256 outputs) stay in FP32 even for many rows: BF16 inputs
    // would move router logits enough to flip top-k choices. They go to cuBLAS's FP32 GEMM: the
    // generic kernel took 106 µs per V2-Lite router of a 512-token prompt (ncu), a tenth of the
    // whole prompt pass. Batched narrow products (MLA's per-head W_uv, 16 heads x 128 outputs)
    // are BF16 GEMMs like the rest.
    if (p.m > matmul_gemv_max_m())
        return p.n <= 256 && p.batch == 1 ? MatmulPath::gemm_f32 : MatmulPath::gemm;
    if (detail::stream_gemv_ok(p)) return MatmulPath::stream;
    if (tensor_core_gemv_ok(p)) return MatmulPath::gemv;
    if (column_layout(p)) return MatmulPath::gemv_column;
    return MatmulPath::generic;
}

size_t matmul_workspace_bytes(const MatmulParams& p) {
    validate(p);
    switch (resolve(p)) {
        case MatmulPath::gemv: {
            const auto plan = detail::plan_gemv(p, sm_count_of_current_device());
            return plan.split > 1 ? detail::counters_bytes + plan.partial_bytes : 0;
        }
        case MatmulPath::gemm:
        case MatmulPath::gemm_f32:
            return gemm_workspace(plan_gemm(p, resolve(p) == MatmulPath::gemm_f32));
        default:
            return 0;
    }
}

void matmul(const MatmulParams& p, const MatmulResources& r, cudaStream_t stream) {
    validate(p);
    const MatmulPath path = resolve(p);
    if (p.norm_out && path != MatmulPath::stream) {
        // Only the stream kernel writes the normalized rows itself: normalize first, then
        // multiply them.
        RmsNormParams n;
        n.x = p.x;
        n.w = p.norm_w;
        n.w_type = p.norm_w_type;
        n.y = p.norm_out;
        n.rows = p.m;
        n.dim = p.k;
        n.eps = p.norm_eps;
        n.x_stride = p.x_row_stride;
        n.y_stride = p.norm_out_row_stride;
        rms_norm(n, stream);
        MatmulParams q = p;
        q.x = p.norm_out;
        q.x_row_stride = p.norm_out_row_stride;
        q.rms_norm = false;
        q.norm_out = nullptr;
        matmul(q, r, stream);
        return;
    }
    const size_t need = matmul_workspace_bytes(p);
    if (need > 0 && (!r.workspace || r.workspace_bytes < need))
        fail_params("workspace of " + std::to_string(r.workspace_bytes) + " bytes, " +
                    std::to_string(need) + " needed (" + matmul_describe(p) + ")");
    switch (path) {
        case MatmulPath::stream:
            detail::launch_stream_gemv(p, stream);
            break;
        case MatmulPath::gemv:
            detail::launch_gemv(p, detail::plan_gemv(p, sm_count_of_current_device()), r.workspace,
                                stream);
            break;
        case MatmulPath::gemv_column:
            run_column(p, stream);
            break;
        case MatmulPath::generic:
            run_generic(p, stream);
            break;
        default:
            run_gemm(p, r, stream, path == MatmulPath::gemm_f32);
            break;
    }
}

std::string matmul_describe(const MatmulParams& p) {
    validate(p);
    const MatmulPath path = resolve(p);
    switch (path) {
        case MatmulPath::gemv:
            return detail::gemv_plan_string(p, detail::plan_gemv(p, sm_count_of_current_device()));
        case MatmulPath::stream:
            return detail::stream_plan_string(p);
        case MatmulPath::gemm:
        case MatmulPath::gemm_f32: {
            const GemmPlan g = plan_gemm(p, path == MatmulPath::gemm_f32);
            std::string s = g.f32 && p.w_type != mgl::dtype::f32 ? "gemm_f32" : "gemm";
            if (g.convert_x) s += g.x_bf16 ? " x->bf16" : " x->f32";
            if (g.materialize)
                s += std::string(" w->") + (g.w_bf16 ? "bf16" : "f32") +
                     (g.whole ? "" : " in chunks of " + std::to_string(g.chunk_rows) + " rows");
            return s;
        }
        default:
            return matmul_path_name(path);
    }
}

}  // namespace minids::kernels
