// The streaming GEMV for decode (M <= 8): CUDA cores, FP32 accumulate, one warp per row (or two
// short rows), every lane issuing eight 16-byte weight loads before it touches x, so each warp
// keeps 4 KiB of W in flight. x is read through L1 (every warp of the SM reads the same x), the
// optional RMSNorm of x is folded into each warp's pass over x (no barrier), and
// the optional residual is added when y is written. At batch 1 the cost of a small product is
// launch and first-load latency, so nothing here waits for anything it does not need.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdio>
#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "matmul_internal.h"
#include "stream_gemv.cuh"

namespace minids::kernels::detail {

namespace {

using namespace stream_detail;

constexpr int kWarps = 8;   // warps per block (default configuration)
constexpr int kUnroll = 8;  // 16-byte loads per lane per row in flight (default configuration)

struct StreamArgs {
    const uint8_t* w;
    int64_t w_row_stride, w_batch_stride;
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
    float* norm_out;  // with norm: the normalized rows, written by the first block
    int64_t norm_out_stride;
    int m, n, k;
    int chunks;  // 16-byte chunks per row
};

template <bool FP8, int R, int M, int WARPS = kWarps, int UNROLL = kUnroll>
__global__ void __launch_bounds__(WARPS * 32) gemv_stream_kernel(StreamArgs a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int b = blockIdx.y;
    const int row0 = (blockIdx.x * WARPS + warp) * R;
    float acc[R][M], inv[M];
    stream_rows<FP8, R, M, WARPS, UNROLL>(a, a.w + b * a.w_batch_stride, a.x + b * a.x_batch_stride,
                                          row0, acc, inv);
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int row = row0 + r;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float s = warp_sum(acc[r][m]);
            if (lane == 0 && row < a.n && m < a.m) {
                float v = s * inv[m];
                if (FP8 && a.scale) v *= a.scale[b * a.scale_batch_stride + row];
                const int64_t at = b * a.y_batch_stride + m * a.y_row_stride + row;
                if (a.residual) v += a.residual[at];
                a.y[at] = v;
            }
        }
    }
}

template <bool FP8, int R>
void launch_r(const StreamArgs& a, int batch, bool pdl, cudaStream_t stream) {
    const dim3 grid(unsigned((a.n + kWarps * R - 1) / (kWarps * R)), unsigned(batch));
    const dim3 block(kWarps * 32);
    auto kernel = a.m <= 1   ? gemv_stream_kernel<FP8, R, 1>
                  : a.m <= 2 ? gemv_stream_kernel<FP8, R, 2>
                  : a.m <= 4 ? gemv_stream_kernel<FP8, R, 4>
                             : gemv_stream_kernel<FP8, R, 8>;
    launch_maybe_dependent(kernel, grid, block, 0, stream, pdl, a);
}

// Benchmark configurations (MatmulParams::stream_config, M = 1 only): warps per block, 16-byte
// loads per lane and row in flight, rows per warp. Index 0 is the default plan (launch_r with
// the rows chosen by stream_rows_per_warp). The rest exist so that bench_matvec_cuda can find
// a better shape for the model's small products on the GPU in one run.
struct StreamConfig {
    int warps, unroll, rows;
    void (*launch_bf16)(const StreamArgs&, int, bool, cudaStream_t);
    void (*launch_f8)(const StreamArgs&, int, bool, cudaStream_t);
};

template <bool FP8, int W, int U, int R>
void launch_config(const StreamArgs& a, int batch, bool pdl, cudaStream_t stream) {
    const dim3 grid(unsigned((a.n + W * R - 1) / (W * R)), unsigned(batch));
    launch_maybe_dependent(gemv_stream_kernel<FP8, R, 1, W, U>, grid, dim3(W * 32), 0, stream, pdl,
                           a);
}

#define MINIDS_STREAM_CONFIG(W, U, R) \
    { W, U, R, launch_config<false, W, U, R>, launch_config<true, W, U, R> }
const StreamConfig stream_configs[] = {
    {8, 8, 0, nullptr, nullptr},  // the default plan
    MINIDS_STREAM_CONFIG(4, 8, 1),  MINIDS_STREAM_CONFIG(16, 8, 1), MINIDS_STREAM_CONFIG(8, 4, 1),
    MINIDS_STREAM_CONFIG(8, 16, 1), MINIDS_STREAM_CONFIG(4, 16, 1), MINIDS_STREAM_CONFIG(4, 4, 1),
    MINIDS_STREAM_CONFIG(8, 8, 2),  MINIDS_STREAM_CONFIG(4, 8, 2),  MINIDS_STREAM_CONFIG(8, 4, 2),
    MINIDS_STREAM_CONFIG(4, 4, 2),  MINIDS_STREAM_CONFIG(4, 4, 4),  MINIDS_STREAM_CONFIG(8, 4, 4),
};
#undef MINIDS_STREAM_CONFIG
constexpr int n_stream_configs = int(sizeof(stream_configs) / sizeof(stream_configs[0]));

}  // namespace

int stream_config_count() { return n_stream_configs; }

std::string stream_config_name(int config) {
    if (config < 0 || config >= n_stream_configs) return "?";
    const StreamConfig& c = stream_configs[config];
    if (c.rows == 0) return "default";
    char buf[32];
    std::snprintf(buf, sizeof buf, "w%d u%d r%d", c.warps, c.unroll, c.rows);
    return buf;
}

bool stream_gemv_ok(const MatmulParams& p) {
    if (p.w_type != mgl::dtype::bf16 && p.w_type != mgl::dtype::f8_e4m3) return false;
    const int64_t e = int64_t(mgl::dtype_size(p.w_type));
    const auto w = reinterpret_cast<uintptr_t>(p.w), x = reinterpret_cast<uintptr_t>(p.x);
    // x is read as float4: its rows must start 16-byte aligned too.
    // Batch strides matter only when there is more than one batch.
    const bool batches_ok =
        p.batch == 1 || (p.w_batch_stride % 16 == 0 && p.x_batch_stride % 4 == 0);
    // The norm weight is read 16 bytes at a time.
    const bool norm_ok = !p.rms_norm || reinterpret_cast<uintptr_t>(p.norm_w) % 16 == 0;
    return p.m <= stream_gemv_max_m && p.w_col_stride == e && (p.k * e) % 16 == 0 && w % 16 == 0 &&
           p.w_row_stride % 16 == 0 && x % 16 == 0 && (p.m == 1 || p.x_row_stride % 4 == 0) &&
           batches_ok && norm_ok;
}

namespace {
// Blocks of gemv_stream_kernel<FP8, R, 1> the device holds at once (all SMs), asked once.
template <bool FP8, int R>
int64_t resident_blocks() {
    static const int64_t blocks = [] {
        int per_sm = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, gemv_stream_kernel<FP8, R, 1>, kWarps * 32, 0));
        return int64_t(per_sm) * sm_count_of_current_device();
    }();
    return blocks;
}
}  // namespace

int stream_rows_per_warp(const MatmulParams& p) {
    // Short rows (<= 2 KiB, four loads per lane) pair up so a lane still has eight in flight.
    if (p.k * int64_t(mgl::dtype_size(p.w_type)) <= 2048) return 2;
    // A product whose one-row warps need slightly more blocks than the device holds at once
    // runs in two waves, each paying the full load latency (V2-Lite's [q | kv_a], 3648 rows:
    // 456 blocks against 396 resident, 1.0 TB/s). Two rows per warp then fit in one wave with
    // twice the loads in flight per lane. Products of many waves (lm_head) keep one row.
    const bool fp8 = p.w_type == mgl::dtype::f8_e4m3;
    const int64_t slots1 = fp8 ? resident_blocks<true, 1>() : resident_blocks<false, 1>();
    const int64_t slots2 = fp8 ? resident_blocks<true, 2>() : resident_blocks<false, 2>();
    const int64_t blocks1 = (p.n + kWarps - 1) / kWarps,
                  blocks2 = (p.n + 2 * kWarps - 1) / (2 * kWarps);
    return blocks1 > slots1 && blocks2 <= slots2 ? 2 : 1;
}

int stream_default_config(const MatmulParams& p) {
    if (p.m != 1) return 0;
    // Chosen from bench_matvec_cuda --stream-sweep on the H200 (docs/perf.md, 2026-12-02 third
    // session), graph + PDL, µs per launch against the plan of launch_r:
    // - very short rows (MLA's per-head W_uk, 256 B) leave most lanes idle with one row per
    //   warp; four rows per warp: 3.76 -> 2.31 (bf16);
    // - many-wave products (>= 20 MiB: lm_head, the dense FFN) stream best with 16 loads in
    //   flight per lane over four rows and small blocks: lm_head 148 -> 98 (bf16), 149 -> 88
    //   (f8); dense gate/up f8 14.1 -> 12.3, bf16 unchanged;
    // - a product just above half the resident one-row blocks ([q | kv_a], 3648 x 2048): one
    //   pass over each row with two rows (bf16, 7.8 vs 9.6) or four (f8, 2 KiB rows, 7.1 vs 8.1).
    const int64_t row_bytes = p.k * int64_t(mgl::dtype_size(p.w_type));
    const bool fp8 = p.w_type == mgl::dtype::f8_e4m3;
    auto index_of = [](int w, int u, int r) {
        for (int i = 1; i < n_stream_configs; ++i)
            if (stream_configs[i].warps == w && stream_configs[i].unroll == u &&
                stream_configs[i].rows == r)
                return i;
        return 0;
    };
    if (p.stream_plan == 2) {
        // bench_matvec_cuda --stream-sweep on the H200, 2026-12-02 (fifth session), µs per launch
        // auto -> this: dense down bf16 22.16 -> 19.60, dense gate/up bf16 16.35 -> 15.28, lm_head
        // bf16 98.72 -> 98.37 (f8 keeps four rows: 85.8 against 134 with two); W_uv per head
        // (1 KiB rows) 2.54 -> 2.17. Whole model (sixth session): tg128 497.83 -> 500.02.
        if (!fp8 && p.n * row_bytes >= (int64_t(20) << 20)) return index_of(4, 4, 2);
        if (!fp8 && row_bytes > 512 && row_bytes <= 1024) return index_of(8, 4, 1);
    }
    if (row_bytes <= 512 || p.n * row_bytes >= (int64_t(20) << 20)) return index_of(4, 4, 4);
    const int64_t slots1 = fp8 ? resident_blocks<true, 1>() : resident_blocks<false, 1>();
    const int64_t blocks1 = (p.n + kWarps - 1) / kWarps;
    if (row_bytes >= 2048 && 2 * blocks1 > slots1)
        return fp8 ? index_of(8, 4, 4) : index_of(8, 8, 2);
    return 0;
}

std::string stream_plan_string(const MatmulParams& p) {
    const int c = p.stream_config > 0 ? p.stream_config : stream_default_config(p);
    if (c > 0) return "stream " + stream_config_name(c);
    return "stream w" + std::to_string(kWarps) + " u" + std::to_string(kUnroll) + " r" +
           std::to_string(stream_rows_per_warp(p));
}

void launch_stream_gemv(const MatmulParams& p, cudaStream_t stream) {
    StreamArgs a{};
    a.w = static_cast<const uint8_t*>(p.w);
    a.w_row_stride = p.w_row_stride;
    a.w_batch_stride = p.w_batch_stride;
    a.scale = p.w_scale;
    a.scale_batch_stride = p.w_scale_batch_stride;
    a.x = p.x;
    a.x_row_stride = p.x_row_stride;
    a.x_batch_stride = p.x_batch_stride;
    a.y = p.y;
    a.y_row_stride = p.y_row_stride;
    a.y_batch_stride = p.y_batch_stride;
    a.residual = p.residual;
    a.norm = p.rms_norm;
    a.norm_w = p.norm_w;
    a.norm_bf16 = p.norm_w_type == mgl::dtype::bf16;
    a.eps = p.norm_eps;
    a.norm_out = p.norm_out;
    a.norm_out_stride = p.norm_out_row_stride;
    a.m = int(p.m);
    a.n = int(p.n);
    a.k = int(p.k);
    a.chunks = int(p.k * int64_t(mgl::dtype_size(p.w_type)) / 16);
    const bool fp8 = p.w_type == mgl::dtype::f8_e4m3;
    if (p.stream_config > 0 && (p.stream_config >= n_stream_configs || p.m != 1))
        ::mgl::fail(__FILE__, __LINE__,
                    "matmul: stream_config " + std::to_string(p.stream_config) +
                        " needs M = 1 and an index below " + std::to_string(n_stream_configs));
    // stream_config 0 is the plan of launch_r below; -1 (automatic) lets the shape choose.
    const int config = p.stream_config >= 0 ? p.stream_config : stream_default_config(p);
    if (config > 0) {
        const StreamConfig& c = stream_configs[config];
        (fp8 ? c.launch_f8 : c.launch_bf16)(a, int(p.batch), p.pdl, stream);
        return;
    }
    const int r = stream_rows_per_warp(p);
    if (fp8) {
        r == 2 ? launch_r<true, 2>(a, int(p.batch), p.pdl, stream)
               : launch_r<true, 1>(a, int(p.batch), p.pdl, stream);
    } else {
        r == 2 ? launch_r<false, 2>(a, int(p.batch), p.pdl, stream)
               : launch_r<false, 1>(a, int(p.batch), p.pdl, stream);
    }
}

}  // namespace minids::kernels::detail
