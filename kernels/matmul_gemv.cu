// Tensor-core matrix-vector products for small M (decode): y = x · Wᵀ with W [N, K] bf16 or
// f8_e4m3 rows contiguous in K, streamed from HBM exactly once.
//
// Why tensor cores for a memory-bound product: converting each weight to FP32 on CUDA cores is
// what limits FP8 (e4m3 -> f16 -> f32 is three conversion-pipe instructions per pair, and the
// conversion pipe is 16 lanes per clock on an SM), and x must be re-read for every weight.
// mma.m16n8k16 takes the weights as they are (bf16 bits, or f16 from one `cvt.rn.f16x2.e4m3x2`
// per pair, which is exact) and all M <= 16 tokens of x in one instruction.
//
// Layout: a warp owns RW tiles of 8 weight rows. In the mma, W is the B operand (16 k x 8 rows)
// and x the A operand (16 tokens x 16 k). Lane (g = lane/4, t = lane%4) loads 16 contiguous bytes
// of weight row g at chunk 4·q + t, which is exactly its B fragment for two (bf16) or four (f8)
// mma k-steps once k is relabelled inside each step; x's A fragment is read from shared memory
// at the same physical positions, so the relabelling cancels. Four lanes read 64 contiguous bytes
// of each row per step.
//
// Accuracy: x is split into three 16-bit terms (x = hi + mid + lo, each rounded from the
// remainder), which carry 24 significant bits, and each term is one more mma into the FP32
// accumulator. For f16 terms (f8 weights) each token's x is first scaled by a power of two so
// its largest magnitude is in [2^13, 2^14): nothing overflows and the result is unscaled exactly.
// The tensor cores' FP32 accumulation truncates, so accumulator chains are kept short (one batch
// of U steps) and summed on the CUDA cores.
//
// Work split: a block owns RB = WN·RW·8 rows and a K range (split-K across blocks, grid.y);
// its WK warp columns take interleaved 64-byte steps of that range and are reduced in shared
// memory. With split > 1 every block writes its partial to the workspace and the last block of
// a row block (counter) adds the partials in split order, so results are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "load_stream.cuh"
#include "matmul_internal.h"

namespace minids::kernels::detail {
namespace {

struct GemvConfig {
    int rw;  // 8-row tiles per warp (the x fragment is reused across them)
    int wn;  // warps across rows
    int wk;  // warps across K
    int u;   // 64-byte steps per warp in flight (double-buffered)
};

constexpr GemvConfig gemv_configs[] = {
    {1, 1, 8, 4},  // 0: 8 rows per block
    {2, 1, 8, 2},  // 1: 16 rows
    {1, 2, 4, 4},  // 2: 16 rows
    {2, 2, 4, 2},  // 3: 32 rows
    {4, 1, 8, 1},  // 4: 32 rows
    {4, 2, 4, 1},  // 5: 64 rows
    {2, 4, 2, 2},  // 6: 64 rows
    {1, 1, 4, 8},  // 7: 8 rows, 128 threads
};
constexpr int n_configs = int(sizeof(gemv_configs) / sizeof(gemv_configs[0]));

struct GemvArgs {
    const uint8_t* w;
    int64_t w_row_stride, w_batch_stride;  // bytes
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
    int m, n, k, batch;
    int chunks;  // 16-byte chunks per row
    int quads;   // 64-byte steps per row (4 chunks, one per lane of a quad)
    int split;
    int x_stride;  // elements between token rows of one staged x term
    float* partial;
    int* counters;
};

template <bool FP8>
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
    if constexpr (FP8) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// Two e4m3 bytes (low byte first) -> f16x2, exact (hardware cvt.rn.f16x2.e4m3x2).
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
    const __half2_raw h =
        __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_bytes & 0xffffu), __NV_E4M3);
    return uint32_t(h.x) | (uint32_t(h.y) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// 2^e as a float, exact for e in [-126, 127].
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }

__device__ __forceinline__ uint16_t round16(float v, bool f16, float& rounded) {
    if (f16) {
        const __half h = __float2half_rn(v);
        rounded = __half2float(h);
        return __half_as_ushort(h);
    }
    const __nv_bfloat16 h = __float2bfloat16_rn(v);
    rounded = __bfloat162float(h);
    return __bfloat16_as_ushort(h);
}

__device__ __forceinline__ float norm_weight(const GemvArgs& a, int k) {
    if (!a.norm_w) return 1.0f;
    return a.norm_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(a.norm_w)[k])
                       : static_cast<const float*>(a.norm_w)[k];
}

__device__ __forceinline__ void write_output(const GemvArgs& a, int b, int m, int n, float v) {
    const float s = a.scale ? a.scale[b * a.scale_batch_stride + n] : 1.0f;
    const int64_t at = b * a.y_batch_stride + m * a.y_row_stride + n;
    a.y[at] = v * s + (a.residual ? a.residual[at] : 0.0f);
}

template <int U, int RW>
__device__ __forceinline__ void load_steps(uint4 (&dst)[U][RW], const uint8_t* const (&wrow)[RW],
                                           const bool (&row_ok)[RW], int batch, int q_first,
                                           int wk_stride, int nq, int t, int c_end) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int i = batch * U + u;
        const int c = (q_first + i * wk_stride) * 4 + t;
        const bool ok = i < nq && c < c_end;
#pragma unroll
        for (int r = 0; r < RW; ++r)
            dst[u][r] = (ok && row_ok[r]) ? load_weights16(wrow[r] + int64_t(c) * 16)
                                          : make_uint4(0u, 0u, 0u, 0u);
    }
}

template <bool FP8, int RW, int WN, int WK, int U>
__global__ void __launch_bounds__(WN* WK * 32) gemv_tc_kernel(const GemvArgs a) {
    constexpr int NW = WN * WK, NT = NW * 32, RB = WN * RW * 8;
    constexpr int E = FP8 ? 16 : 8;  // weights per 16-byte chunk
    constexpr int X16 = E / 8;       // 16-byte x fragments per term and token per chunk
    extern __shared__ __align__(16) unsigned char smem[];
    const int M = a.m;
    uint16_t* xs = reinterpret_cast<uint16_t*>(smem);  // [3][M][x_stride]
    float* red = reinterpret_cast<float*>(smem + size_t(3) * M * a.x_stride * 2);  // [WK][RB][16]
    float* tok_sum = red + WK * RB * 16;  // [NW][16] per-warp Σx² per token
    float* tok_max = tok_sum + NW * 16;   // [NW][16] per-warp max|x·norm_w| per token
    float* tok_inv = tok_max + NW * 16;   // [16] 1/rms per token
    int* tok_exp = reinterpret_cast<int*>(tok_inv + 16);  // [16] f16 scaling exponent per token
    int* last_flag = tok_exp + 16;

    // Let the next kernel on the stream start its own weight loads (PDL; no-op otherwise).
    asm volatile("griddepcontrol.launch_dependents;");
    const int tid = int(threadIdx.x), lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wn = warp % WN, wk = warp / WN;
    const int b = int(blockIdx.z), sp = int(blockIdx.y), row_block = int(blockIdx.x);
    const int q0 = int(int64_t(a.quads) * sp / a.split);
    const int q1 = int(int64_t(a.quads) * (sp + 1) / a.split);
    const int c0 = 4 * q0, c_end = min(a.chunks, 4 * q1);
    const int k0 = c0 * E, k1 = c_end * E;

    // Issue the first weight loads now so their latency overlaps the staging of x.
    const uint8_t* wb = a.w + b * a.w_batch_stride;
    const int n_base = row_block * RB + wn * RW * 8;
    const uint8_t* wrow[RW];
    bool row_ok[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int n = n_base + r * 8 + g;
        row_ok[r] = n < a.n;
        wrow[r] = wb + int64_t(row_ok[r] ? n : 0) * a.w_row_stride;
    }
    const int span = q1 - q0;
    const int nq = span > wk ? (span - wk + WK - 1) / WK : 0;  // 64-byte steps of this warp
    const int n_batches = (nq + U - 1) / U;
    uint4 next[U][RW];
    if (n_batches > 0) load_steps<U, RW>(next, wrow, row_ok, 0, q0 + wk, WK, nq, t, c_end);

    // Everything below may read what the previous kernel on the stream wrote (x, residual) or
    // write what it may still read (y, workspace): wait for it (a no-op without PDL).
    asm volatile("griddepcontrol.wait;" ::: "memory");

    // ---- stage x̂ (normalized, scaled) as three 16-bit terms ----
    // One pass for the statistics: Σx² over all of K (the norm) and max|x·norm_w| over this
    // block's K range (the f16 scale: max|x̂| = inv_rms · max|x·norm_w|).
    const float* xb = a.x + b * a.x_batch_stride;
    if (a.norm || FP8) {
        for (int m = 0; m < M; ++m) {
            const float* xr = xb + m * a.x_row_stride;
            float s = 0.0f, mx = 0.0f;
            if (a.norm)
                for (int k = tid; k < a.k; k += NT) s += xr[k] * xr[k];
            if constexpr (FP8)
                for (int k = k0 + tid; k < k1; k += NT)
                    mx = fmaxf(mx, fabsf(a.norm ? xr[k] * norm_weight(a, k) : xr[k]));
            s = warp_sum(s);
            mx = warp_max(mx);
            if (lane == 0) {
                tok_sum[warp * 16 + m] = s;
                tok_max[warp * 16 + m] = mx;
            }
        }
        __syncthreads();
        if (tid < M) {
            float s = 0.0f, mx = 0.0f;
            for (int w = 0; w < NW; ++w) {
                s += tok_sum[w * 16 + tid];
                mx = fmaxf(mx, tok_max[w * 16 + tid]);
            }
            const float inv = a.norm ? rsqrtf(s / float(a.k) + a.eps) : 1.0f;
            tok_inv[tid] = inv;
            mx *= inv;
            int e = 0;
            if (mx > 0.0f && mx <= 3.0e38f) {
                frexpf(mx, &e);  // mx in [2^(e-1), 2^e): scaled max in [2^13, 2^14)
                e = min(100, max(-100, 14 - e));
            } else {
                e = 0;
            }
            tok_exp[tid] = e;
        }
        __syncthreads();
    }
    auto x_hat = [&](int m, int k) {
        float v = xb[m * a.x_row_stride + k];
        if (a.norm) v *= tok_inv[m] * norm_weight(a, k);
        return v;
    };
    for (int m = 0; m < M; ++m) {
        const float up = FP8 ? pow2(tok_exp[m]) : 1.0f;
        for (int k = k0 + tid; k < k1; k += NT) {
            const float v = x_hat(m, k) * up;
            float r0, r1, r2;
            const uint16_t hi = round16(v, FP8, r0);
            const uint16_t mid = round16(v - r0, FP8, r1);
            const uint16_t lo = round16((v - r0) - r1, FP8, r2);
            const int64_t at = int64_t(m) * a.x_stride + (k - k0);
            xs[at] = hi;
            xs[int64_t(M) * a.x_stride + at] = mid;
            xs[int64_t(2 * M) * a.x_stride + at] = lo;
        }
    }
    __syncthreads();

    // ---- stream W: mma per 16-byte chunk, three x terms ----
    // Tensor-core accumulation truncates; each batch's short chain is added to `sum` in FP32.
    float sum[RW][4];
#pragma unroll
    for (int r = 0; r < RW; ++r) sum[r][0] = sum[r][1] = sum[r][2] = sum[r][3] = 0.0f;
    const bool g_ok = g < M, g8_ok = g + 8 < M;
    const int64_t term_stride = int64_t(M) * a.x_stride;
    for (int batch = 0; batch < n_batches; ++batch) {
        uint4 cur[U][RW];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < RW; ++r) cur[u][r] = next[u][r];
        if (batch + 1 < n_batches)
            load_steps<U, RW>(next, wrow, row_ok, batch + 1, q0 + wk, WK, nq, t, c_end);
        float acc[RW][4];
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[r][0] = acc[r][1] = acc[r][2] = acc[r][3] = 0.0f;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int i = batch * U + u;
            if (i >= nq) break;  // warp-uniform
            const int c = (q0 + wk + i * WK) * 4 + t;
            const bool c_ok = c < c_end;
            // B operand: bf16 bits as loaded, or f16 pairs from the e4m3 bytes.
            uint32_t bw[RW][E / 2];
#pragma unroll
            for (int r = 0; r < RW; ++r) {
                const uint32_t words[4] = {cur[u][r].x, cur[u][r].y, cur[u][r].z, cur[u][r].w};
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    if constexpr (FP8) {
                        bw[r][2 * j] = e4m3x2_to_f16x2(words[j]);
                        bw[r][2 * j + 1] = e4m3x2_to_f16x2(words[j] >> 16);
                    } else {
                        bw[r][j] = words[j];
                    }
                }
            }
            const uint16_t* xg = xs + int64_t(g) * a.x_stride + (c - c0) * E;
#pragma unroll
            for (int term = 0; term < 3; ++term) {
                uint32_t xa[E / 2], xh[E / 2];  // A fragments of tokens g and g + 8
                const uint4* frag_g = reinterpret_cast<const uint4*>(xg + term * term_stride);
                const uint4* frag_g8 =
                    reinterpret_cast<const uint4*>(xg + term * term_stride + 8 * a.x_stride);
#pragma unroll
                for (int v = 0; v < X16; ++v) {
                    const uint4 lo = (c_ok && g_ok) ? frag_g[v] : make_uint4(0u, 0u, 0u, 0u);
                    const uint4 hi = (c_ok && g8_ok) ? frag_g8[v] : make_uint4(0u, 0u, 0u, 0u);
                    const uint32_t lo_words[4] = {lo.x, lo.y, lo.z, lo.w};
                    const uint32_t hi_words[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        xa[4 * v + j] = lo_words[j];
                        xh[4 * v + j] = hi_words[j];
                    }
                }
#pragma unroll
                for (int r = 0; r < RW; ++r)
#pragma unroll
                    for (int s = 0; s < E / 4; ++s)
                        mma16816<FP8>(acc[r], xa[2 * s], xh[2 * s], xa[2 * s + 1], xh[2 * s + 1],
                                      bw[r][2 * s], bw[r][2 * s + 1]);
            }
        }
#pragma unroll
        for (int r = 0; r < RW; ++r)
#pragma unroll
            for (int j = 0; j < 4; ++j) sum[r][j] += acc[r][j];
    }

    // ---- reduce the WK warp columns; D[token][row]: d0 (g, 2t), d1 (g, 2t+1), d2/d3 token g+8
#pragma unroll
    for (int r = 0; r < RW; ++r) {
        const int rl = wn * RW * 8 + r * 8 + 2 * t;
        float* base = red + (wk * RB + rl) * 16;
        base[g] = sum[r][0];
        base[16 + g] = sum[r][1];
        base[g + 8] = sum[r][2];
        base[16 + g + 8] = sum[r][3];
    }
    __syncthreads();
    const int N = a.n;
    for (int idx = tid; idx < M * RB; idx += NT) {
        const int m = idx / RB, rl = idx % RB, n = row_block * RB + rl;
        if (n >= N) continue;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WK; ++w) v += red[(w * RB + rl) * 16 + m];
        if constexpr (FP8) v *= pow2(-tok_exp[m]);
        if (a.split == 1) {
            write_output(a, b, m, n, v);
        } else {
            a.partial[((int64_t(sp) * a.batch + b) * M + m) * N + n] = v;
        }
    }
    if (a.split == 1) return;

    // ---- split-K: the last block of this row block adds the partials in split order ----
    __threadfence();
    __syncthreads();
    int* counter = a.counters + int64_t(b) * gridDim.x + row_block;
    if (tid == 0) *last_flag = atomicAdd(counter, 1) == a.split - 1;
    __syncthreads();
    if (!*last_flag) return;
    __threadfence();
    for (int idx = tid; idx < M * RB; idx += NT) {
        const int m = idx / RB, n = row_block * RB + idx % RB;
        if (n >= N) continue;
        float v = 0.0f;
        for (int s = 0; s < a.split; ++s)
            v += __ldcg(&a.partial[((int64_t(s) * a.batch + b) * M + m) * N + n]);
        write_output(a, b, m, n, v);
    }
    if (tid == 0) *counter = 0;  // ready for the next launch
}

using GemvKernel = void (*)(GemvArgs);

template <bool FP8>
GemvKernel kernel_for(int config) {
    switch (config) {
#define MINIDS_GEMV_CASE(i)                                                                    \
    case i:                                                                                    \
        return gemv_tc_kernel<FP8, gemv_configs[i].rw, gemv_configs[i].wn, gemv_configs[i].wk, \
                              gemv_configs[i].u>;
        MINIDS_GEMV_CASE(0)
        MINIDS_GEMV_CASE(1)
        MINIDS_GEMV_CASE(2)
        MINIDS_GEMV_CASE(3)
        MINIDS_GEMV_CASE(4)
        MINIDS_GEMV_CASE(5)
        MINIDS_GEMV_CASE(6)
        MINIDS_GEMV_CASE(7)
#undef MINIDS_GEMV_CASE
    }
    return nullptr;
}
static_assert(n_configs == 8, "kernel_for lists every configuration");

int rows_per_block(const GemvConfig& c) { return c.wn * c.rw * 8; }
int warps_per_block(const GemvConfig& c) { return c.wn * c.wk; }

size_t gemv_smem(const MatmulParams& p, const GemvConfig& c, int quads, int split, int* x_stride) {
    const bool fp8 = p.w_type == mgl::dtype::f8_e4m3;
    const int e = fp8 ? 16 : 8;
    const size_t max_elems = size_t((quads + split - 1) / split) * 4 * size_t(e);
    // Token rows 64 (bf16) / 16 (f16) bytes apart modulo 128: conflict-free fragment reads.
    const size_t row_bytes = align_up(max_elems * 2, 128) + (fp8 ? 16 : 64);
    if (x_stride) *x_stride = int(row_bytes / 2);
    const size_t terms = 3 * size_t(p.m) * row_bytes;
    const size_t red = size_t(c.wk) * rows_per_block(c) * 16 * 4;
    const size_t tok = 2 * size_t(warps_per_block(c)) * 16 * 4 + 16 * 4 + 16 * 4 + 16;
    return terms + red + tok;
}

}  // namespace

GemvPlan plan_gemv(const MatmulParams& p, int sm_count) {
    const int elem = int(mgl::dtype_size(p.w_type));
    const int chunks = int(p.k * elem / 16);
    const int quads = (chunks + 3) / 4;
    const int64_t want_warps = int64_t(sm_count) * 24;  // enough weight loads in flight
    GemvPlan plan;
    if (p.gemv_config >= 0) {
        MGL_CHECK(p.gemv_config < n_configs, "matmul: gemv_config out of range");
        plan.config = p.gemv_config;
    } else {
        // The widest row block that still gives every SM enough warps; narrow blocks otherwise.
        plan.config = 0;
        for (int cfg : {5, 3, 1}) {
            const GemvConfig& c = gemv_configs[cfg];
            const int64_t blocks = (p.n + rows_per_block(c) - 1) / rows_per_block(c) * p.batch;
            if (blocks * warps_per_block(c) >= want_warps) {
                plan.config = cfg;
                break;
            }
        }
    }
    const GemvConfig& c = gemv_configs[plan.config];
    plan.row_blocks = (p.n + rows_per_block(c) - 1) / rows_per_block(c);
    const int64_t blocks_per_split = plan.row_blocks * p.batch;
    const bool counters_fit = blocks_per_split <= max_counters;
    int split = 1;
    if (p.gemv_split > 0) {
        split = std::min(p.gemv_split, quads);
        // A forced split whose share of x does not fit in shared memory is raised until it does.
        while (split < quads && gemv_smem(p, c, quads, split, nullptr) > gemv_smem_limit) ++split;
    } else {
        // Split K while the shared x does not fit or the SMs are short of warps, keeping at
        // least one 64-byte step per warp.
        while (split < quads) {
            const bool too_big = gemv_smem(p, c, quads, split, nullptr) > gemv_smem_limit;
            const bool too_few = blocks_per_split * split * warps_per_block(c) < want_warps;
            const bool room = quads / (split + 1) >= c.wk;
            if (too_big || (too_few && room && counters_fit)) {
                ++split;
            } else {
                break;
            }
        }
    }
    MGL_CHECK(split == 1 || counters_fit,
              "matmul: gemv split-K needs more counters than the workspace holds (batch " +
                  std::to_string(p.batch) + ", " + std::to_string(plan.row_blocks) +
                  " row blocks)");
    MGL_CHECK(split <= 65535, "matmul: gemv split too large");
    plan.split = split;
    plan.smem_bytes = gemv_smem(p, c, quads, split, &plan.x_stride);
    MGL_CHECK(plan.smem_bytes <= gemv_smem_limit,
              "matmul: gemv shared memory " + std::to_string(plan.smem_bytes) +
                  " bytes exceeds the limit (m = " + std::to_string(p.m) + ")");
    plan.partial_bytes = split > 1 ? size_t(split) * p.batch * p.m * p.n * sizeof(float) : 0;
    return plan;
}

void launch_gemv(const MatmulParams& p, const GemvPlan& plan, void* workspace,
                 cudaStream_t stream) {
    const bool fp8 = p.w_type == mgl::dtype::f8_e4m3;
    const GemvConfig& c = gemv_configs[plan.config];
    GemvArgs a{};
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
    a.m = int(p.m);
    a.n = int(p.n);
    a.k = int(p.k);
    a.batch = int(p.batch);
    a.chunks = int(p.k * int64_t(mgl::dtype_size(p.w_type)) / 16);
    a.quads = (a.chunks + 3) / 4;
    a.split = plan.split;
    a.x_stride = plan.x_stride;
    if (plan.split > 1) {
        MGL_CHECK(workspace != nullptr, "matmul: gemv split-K needs a workspace");
        a.counters = static_cast<int*>(workspace);
        a.partial = reinterpret_cast<float*>(static_cast<char*>(workspace) + counters_bytes);
    }
    const dim3 grid(unsigned(plan.row_blocks), unsigned(plan.split), unsigned(p.batch));
    const dim3 block(unsigned(32 * warps_per_block(c)));
    GemvKernel k = fp8 ? kernel_for<true>(plan.config) : kernel_for<false>(plan.config);
    launch_maybe_dependent(k, grid, block, plan.smem_bytes, stream, p.pdl, a);
}

std::string gemv_plan_string(const MatmulParams& p, const GemvPlan& plan) {
    return "gemv cfg " + matmul_gemv_config_name(plan.config) + " split " +
           std::to_string(plan.split) + " grid " + std::to_string(plan.row_blocks) + "x" +
           std::to_string(plan.split) + "x" + std::to_string(p.batch) + " smem " +
           std::to_string(plan.smem_bytes);
}

}  // namespace minids::kernels::detail

namespace minids::kernels {

int matmul_gemv_config_count() { return detail::n_configs; }
int matmul_stream_config_count() { return detail::stream_config_count(); }
std::string matmul_stream_config_name(int config) { return detail::stream_config_name(config); }

std::string matmul_gemv_config_name(int config) {
    MGL_CHECK(config >= 0 && config < detail::n_configs, "matmul: gemv config out of range");
    const auto& c = detail::gemv_configs[config];
    return std::to_string(config) + " (rw" + std::to_string(c.rw) + " wn" + std::to_string(c.wn) +
           " wk" + std::to_string(c.wk) + " u" + std::to_string(c.u) + ")";
}

}  // namespace minids::kernels
