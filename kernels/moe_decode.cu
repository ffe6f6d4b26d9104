// Fused MoE decode: every selected expert of every token, the shared expert and the residual in
// two launches, reading ids, weights and the expert table from device memory.
//
// Launch 1 (gate/up): block = (token, job, rows); job j < k is the token's j-th routed expert,
// j == k the shared expert. The token's x is staged in shared memory (cp.async; with the folded
// RMSNorm each block also sums x² and multiplies x by the norm weight, and the dot products are
// scaled by 1 / rms); each warp computes one row pair g = gate[f]·x, u = up[f]·x with U
// independent 16-byte loads per lane in flight and writes silu(g)·u to the workspace, laid out
// for launch 2's reads.
// Launch 2 (down): block = (token, output rows); the token's activations (k routed segments and
// the shared one) are staged in shared memory; P warps share an output row d, each summing a
// contiguous part of the concatenated row [down_0[d,:] | ... | down_{k-1}[d,:] | shared[d,:]]
// with each routed segment weighted by w_j · scale_j[d]; the P partials are added in order, then
// the residual. Fixed orders everywhere: the result does not depend on timing.
//
// Weight rows that are whole 16-byte chunks (every real model) take the vectorized kernels
// (VEC); other shapes take the same kernels reading one element at a time.
#include <algorithm>
#include <string>

#include "dependent_launch.cuh"
#include "moe_common.cuh"

namespace minids::kernels::moe_detail {
namespace {

constexpr int max_decode_k = 32;  // launch 2 hands the per-expert coefficients around by shuffle
constexpr int max_decode_threads = 16 * 32;

struct DecodeArgs {
    const int64_t* table;
    int64_t n_experts;
    mgl::dtype rtype;
    int64_t D, n_ff;
    int64_t off_gate, off_up, off_down, off_gate_scale, off_up_scale, off_down_scale;
    const int32_t* ids;
    const float* weights;
    int k;
    const float* x;
    int64_t x_stride;
    float* out;
    int64_t out_stride;
    const float* residual;
    int64_t residual_stride;
    int64_t T;
    bool has_shared;
    mgl::dtype stype;
    const uint8_t* sh_gate;
    const uint8_t* sh_up;
    const uint8_t* sh_down;
    int64_t sh_n_ff;
    float* act;          // workspace [T, act_row]
    int64_t act_row;     // floats per token: k · seg_r + seg_s
    int64_t seg_r;       // floats per routed segment
    int jobs_per_token;  // k (+1 with a shared expert); launch 1 of one part: its jobs
    // Launch 1 of one part (MoeDecodePart, 2-D grid): the first job it runs, 0 for the routed
    // experts, k for the shared expert alone.
    int job_base;
    // Launch 1's grid without blocks that have no rows (MoeDecodeConfig::gate_up_compact_grid):
    // per token, `both_blocks` row blocks of every job interleaved job by job (as the 2-D grid
    // orders them), then the row blocks only the wider side has (the shared expert's when it
    // is wider than the routed ones, else the routed jobs'), from row block `both_row_blocks`.
    bool compact;
    int both_row_blocks;  // row blocks every job has
    int blocks_per_token;
    int warps_per_row;  // launch 2: P
    bool norm;          // launch 1 applies RMSNorm to x (norm_w may be null)
    const void* norm_w;
    bool norm_w_bf16;
    float norm_eps;
    // MoeExpertsParams::fetch_state: launch 1's blocks wait for the previous launch only when
    // their expert's slot was filled in this step.
    const mgl::expert_fetch_header* fetch;
};

__device__ __forceinline__ float norm_weight(const DecodeArgs& a, int64_t i) {
    if (!a.norm_w) return 1.0f;
    if (a.norm_w_bf16) {
        const unsigned short h = __ldg(static_cast<const unsigned short*>(a.norm_w) + i);
        return __uint_as_float(uint32_t(h) << 16);
    }
    return __ldg(static_cast<const float*>(a.norm_w) + i);
}

__host__ __device__ constexpr int chunk_elems(mgl::dtype t) {
    return t == mgl::dtype::f32 ? 4 : t == mgl::dtype::bf16 ? 8 : 16;
}

// ---- launch 1 ----

// The activations of one 16-byte weight chunk (DT elements), from the chunk-major staging
// (see stage_index): element e of the chunk at float4 e / 4, chunk_stride float4s apart.
template <mgl::dtype DT>
constexpr int chunk_elems_of() {
    return 16 / elem_bytes<DT>();
}
template <mgl::dtype DT>
__device__ __forceinline__ void load_chunk_x(const float4* xs, int64_t chunk_stride, float* x) {
#pragma unroll
    for (int s = 0; s < chunk_elems_of<DT>() / 4; ++s) {
        const float4 v = xs[s * chunk_stride];
        x[4 * s] = v.x;
        x[4 * s + 1] = v.y;
        x[4 * s + 2] = v.z;
        x[4 * s + 3] = v.w;
    }
}
// acc + w · x for one chunk whose activations are already in registers (the form of dot_chunk
// for several rows sharing one read of x).
template <mgl::dtype DT, Fp8Convert CVT = Fp8Convert::hardware>
__device__ __forceinline__ float dot_chunk_x(uint4 w, const float* x, float acc) {
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
    if constexpr (DT == mgl::dtype::f32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) acc = fmaf(__uint_as_float(ws[i]), x[i], acc);
    } else if constexpr (DT == mgl::dtype::bf16) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = bf16x2_to_float2(ws[i]);
            acc = fmaf(f.x, x[2 * i], acc);
            acc = fmaf(f.y, x[2 * i + 1], acc);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float4 f = CVT == Fp8Convert::hardware ? fp8x4_to_float4(ws[i])
                                                         : fp8x4_to_float4_scaled(ws[i]);
            acc = fmaf(f.x, x[4 * i], acc);
            acc = fmaf(f.y, x[4 * i + 1], acc);
            acc = fmaf(f.z, x[4 * i + 2], acc);
            acc = fmaf(f.w, x[4 * i + 3], acc);
        }
    }
    return acc;
}

// One warp's R row pairs f0 .. f0 + R - 1 of gate/up (those below `rows`), for a block of one
// job: each lane's read of x serves 2R rows. The first U chunks of every row are requested
// before the block stages x and waits at the barrier, so the x staging hides behind the
// weights' latency. silu(g)·u of row f goes to act at stage_index(f) (launch 2's order).
template <mgl::dtype DT, bool VEC, int U, Fp8Convert CVT, int R>
__device__ void gate_up_block(const DecodeArgs& a, int64_t t, const uint8_t* gate,
                              const uint8_t* up, const float* gate_scale, const float* up_scale,
                              int64_t f0, int64_t rows, float* act, int down_epc, int64_t down_nch,
                              float* xs) {
    const int lane = threadIdx.x % 32;
    constexpr int64_t eb = elem_bytes<DT>();
    constexpr int epc = 16 / int(eb);
    const int64_t D = a.D;
    const int64_t nch = VEC ? D / epc : D;
    const int64_t row_bytes = D * eb;
    const uint8_t* rg = gate + f0 * row_bytes;
    const uint8_t* ru = up + f0 * row_bytes;
    const bool active = f0 < rows;
    uint4 wg[U][R], wu[U][R];
    auto load_one = [&](int u, int64_t c0) {
        const int64_t c = c0 + lane + 32 * u;
#pragma unroll
        for (int r = 0; r < R; ++r) {
            wg[u][r] = wu[u][r] = make_uint4(0, 0, 0, 0);
            if (c < nch && f0 + r < rows) {
                wg[u][r] = load_weights16(rg + r * row_bytes + c * 16);
                wu[u][r] = load_weights16(ru + r * row_bytes + c * 16);
            }
        }
    };
    auto load = [&](int64_t c0) {
#pragma unroll
        for (int u = 0; u < U; ++u) load_one(u, c0);
    };
    if constexpr (VEC) {
        if (active) load(0);
    }
    // x comes from the previous kernel (a no-op when it was waited for already); after a fetch
    // launch it was written before that launch started (DecodeArgs::fetch).
    if (!a.fetch) pdl_wait();
    constexpr bool bits = VEC && CVT == Fp8Convert::bit_ops && DT == mgl::dtype::f8_e4m3;
    const float pre = bits ? fp8_bits_x_scale : 1.0f;
    const float* x = a.x + t * a.x_stride;
    float ss = 0.0f;  // Σx² of this thread's elements (folded RMSNorm)
    if constexpr (bits) {
        for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
            const float v = x[i];
            ss += v * v;
            xs[stage_index(i, epc, nch, VEC)] = v * (a.norm ? norm_weight(a, i) : 1.0f) * pre;
        }
    } else {
        // cp.async: every element of the thread in flight at once and no registers held (a loop
        // of load -> store pairs pays one L2 round trip per element).
        for (int64_t i = threadIdx.x; i < D; i += blockDim.x)
            cp_async_4(xs + stage_index(i, epc, nch, VEC), x + i);
        cp_async_wait_all();
        if (a.norm) {  // the thread's own elements: visible to it without a barrier
            for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
                float& v = xs[stage_index(i, epc, nch, VEC)];
                ss += v * v;
                v *= norm_weight(a, i);
            }
        }
    }
    // The norm's 1 / rms over the whole row: the same per-thread order and reduction tree as
    // kernels/rms_norm.cu for a 256-thread block. Uniform over the block (a.norm).
    __shared__ float norm_partial[max_decode_threads / 32];
    if (a.norm) {
        ss = warp_sum(ss);
        if (threadIdx.x % 32 == 0) norm_partial[threadIdx.x / 32] = ss;
    }
    __syncthreads();
    float inv_rms = 1.0f;
    if (a.norm) {  // every warp reduces the partials itself (no second barrier)
        const float total = warp_sum(lane < int(blockDim.x / 32) ? norm_partial[lane] : 0.0f);
        inv_rms = 1.0f / sqrtf(total / float(D) + a.norm_eps);
    }
    if (!active) return;

    float ag[R], au[R];
#pragma unroll
    for (int r = 0; r < R; ++r) ag[r] = au[r] = 0.0f;
    if constexpr (VEC) {
        const float4* xs4 = reinterpret_cast<const float4*>(xs);
        // Rows longer than one round (bf16 shared experts): each register set is refilled with
        // the next round's chunk as soon as it is consumed, so those loads fly while the rest of
        // this round computes (same summation order).
        for (int64_t c0 = 0; c0 < nch;) {
            const int64_t next = c0 + 32 * U;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t c = c0 + lane + 32 * u;
                if (c < nch) {
                    float xv[epc];
                    load_chunk_x<DT>(xs4 + c, nch, xv);
#pragma unroll
                    for (int r = 0; r < R; ++r) {
                        ag[r] = dot_chunk_x<DT, CVT>(wg[u][r], xv, ag[r]);
                        au[r] = dot_chunk_x<DT, CVT>(wu[u][r], xv, au[r]);
                    }
                }
                if (next < nch) load_one(u, next);
            }
            c0 = next;
        }
    } else {
        for (int64_t i = lane; i < D; i += 32) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (f0 + r >= rows) break;
                ag[r] = fmaf(load_weight<DT>(rg + r * row_bytes, i), xs[i], ag[r]);
                au[r] = fmaf(load_weight<DT>(ru + r * row_bytes, i), xs[i], au[r]);
            }
        }
    }
    const float post = bits ? fp8_bits_x_scale : 1.0f;
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float sg = warp_sum(ag[r]) * inv_rms, su = warp_sum(au[r]) * inv_rms;
        const int64_t f = f0 + r;
        if (lane == 0 && f < rows) {
            const float g = sg * post * (gate_scale ? gate_scale[f] : 1.0f);
            const float u = su * post * (up_scale ? up_scale[f] : 1.0f);
            act[stage_index(f, down_epc, down_nch, VEC)] = silu_mul(g, u);
        }
    }
}

// After a fetch launch (DecodeArgs::fetch): whether routed job j of token t reads a slot that a
// fill of this step wrote, so that its copy may still be in flight. Uniform over the block (each
// warp scans the fill log itself). Conservative: a slot filled earlier in the step for another
// expert counts too. An id outside [0, E) or an expert read in place (its home) never waits.
// The fill count is loaded beside the id, not after the table entry: in a step that has filled
// nothing so far (every decode step whose experts all hit) the check then costs the block no
// memory round trip of its own; with the count after the entry, every expert a hit ran ~1.3 %
// slower than waiting for the fetch launch (perf.md, fifteenth session).
__device__ bool reads_new_fill(const DecodeArgs& a, unsigned t, int j) {
    const mgl::expert_fetch_header* h = a.fetch;
    const int64_t n = h->n_fills;
    const int32_t id = a.ids[t * a.k + j];
    if (n == 0 || id < 0 || id >= a.n_experts) return false;
    const int64_t off = a.table[id] - h->slot_base;
    if (off < 0 || off >= h->n_slots * h->slot_stride) return false;
    const int32_t slot = int32_t(off / h->slot_stride);
    const auto* fills = reinterpret_cast<const int32_t*>(h->fill_log);
    bool hit = false;
    for (int64_t f = threadIdx.x % 32; f < n; f += 32) hit = hit || fills[2 * f + 1] == slot;
    return __any_sync(0xffffffffu, hit);
}

// Block = (token, job, rows): job j < k is the token's j-th routed expert, j == k the shared
// expert; each warp computes R row pairs.
template <bool VEC, int U, Fp8Convert CVT, int R>
__global__ void __launch_bounds__(max_decode_threads) decode_gate_up_kernel(DecodeArgs a) {
    extern __shared__ float4 smem4[];
    float* xs = reinterpret_cast<float*>(smem4);
    // Block indices in 32 bits: 64-bit divisions here took the kernel from 40 registers to 64
    // and a stack frame (4 blocks per SM instead of 6), costing more than the empty blocks.
    unsigned t, row_block;
    int j;
    const unsigned jobs = unsigned(a.jobs_per_token);
    if (a.compact) {  // grid (blocks_per_token, T); see DecodeArgs::compact
        t = blockIdx.y;
        const unsigned b = blockIdx.x, both = unsigned(a.both_row_blocks) * jobs;
        const bool shared_wider = a.sh_n_ff > a.n_ff && a.has_shared;
        const unsigned rest = b - both, k = unsigned(a.k);
        j = b < both ? int(b % jobs) : shared_wider ? a.k : int(rest % k);
        row_block = b < both       ? b / jobs
                    : shared_wider ? unsigned(a.both_row_blocks) + rest
                                   : unsigned(a.both_row_blocks) + rest / k;
    } else {  // grid (T · jobs, row blocks of the widest job)
        t = blockIdx.x / jobs;
        j = int(blockIdx.x % jobs) + a.job_base;
        row_block = blockIdx.y;
    }
    const bool shared = j == a.k;
    // Under PDL, a routed job waits before it reads its expert id; the shared expert's weights
    // never change, so its first loads go out before the wait (in gate_up_block). After a fetch
    // launch only a job whose expert may still be crossing waits (DecodeArgs::fetch).
    pdl_launch_dependents();
    if (!shared && (!a.fetch || reads_new_fill(a, t, j))) pdl_wait();
    const int64_t rows = shared ? a.sh_n_ff : a.n_ff;
    const int warps = int(blockDim.x / 32), warp = int(threadIdx.x / 32);
    const int64_t row0 = int64_t(row_block) * warps * R;
    if (row0 >= rows) return;

    const mgl::dtype dt = shared ? a.stype : a.rtype;
    const uint8_t *gate = a.sh_gate, *up = a.sh_up;
    const float *gate_scale = nullptr, *up_scale = nullptr;
    bool skip = false;
    if (!shared) {
        const int32_t id = a.ids[t * a.k + j];
        skip = id < 0 || id >= a.n_experts;
        if (!skip) {
            const uint8_t* base = reinterpret_cast<const uint8_t*>(a.table[id]);
            gate = base + a.off_gate;
            up = base + a.off_up;
            if (dt == mgl::dtype::f8_e4m3) {
                gate_scale = reinterpret_cast<const float*>(base + a.off_gate_scale);
                up_scale = reinterpret_cast<const float*>(base + a.off_up_scale);
            }
        }
    }
    // The activations are written where launch 2 reads them: in the chunk order of the down
    // projection, whose rows are n_ff long.
    float* act = a.act + t * a.act_row + (shared ? int64_t(a.k) * a.seg_r : j * a.seg_r);
    const int down_epc = chunk_elems(dt);
    const int64_t down_nch = rows / down_epc;
    const int64_t f0 = row0 + int64_t(warp) * R;
    if (skip) {  // an id outside [0, E): contributes nothing
        if (threadIdx.x % 32 == 0)
            for (int r = 0; r < R; ++r)
                if (f0 + r < rows) act[stage_index(f0 + r, down_epc, down_nch, VEC)] = 0.0f;
        return;
    }
    switch (dt) {
        case mgl::dtype::f32:
            gate_up_block<mgl::dtype::f32, VEC, U, CVT, R>(a, t, gate, up, gate_scale, up_scale, f0,
                                                           rows, act, down_epc, down_nch, xs);
            break;
        case mgl::dtype::bf16:
            gate_up_block<mgl::dtype::bf16, VEC, U, CVT, R>(a, t, gate, up, gate_scale, up_scale,
                                                            f0, rows, act, down_epc, down_nch, xs);
            break;
        default:
            gate_up_block<mgl::dtype::f8_e4m3, VEC, U, CVT, R>(
                a, t, gate, up, gate_scale, up_scale, f0, rows, act, down_epc, down_nch, xs);
            break;
    }
}

// ---- launch 2 ----

// Segment (routed expert slot) of flattened chunk i, for i in [0, k · nch): i / nch without an
// integer division (exact for i < 2^22 after the correction).
__device__ __forceinline__ int segment_of(int64_t i, int64_t nch, float inv_nch, int k) {
    int j = int(float(i) * inv_nch);
    if (int64_t(j) * nch > i) --j;
    if (int64_t(j + 1) * nch <= i) ++j;
    return min(max(j, 0), k - 1);
}

// Output row d (when valid) for one warp: chunks [b, e) of the concatenated row
// [down_0[d,:] | ... | down_{k-1}[d,:] | shared_down[d,:]] (routed chunks first, `routed` of
// them, RDT; then the shared ones, SDT). Lane j < k holds expert slot j's down matrix (`seg_ptr`,
// null for a skipped id) and coefficient (w_j · scale_j[d]); chunks get them by shuffle. The first
// U chunks are requested before the block stages the activations and waits at the barrier.
template <mgl::dtype RDT, mgl::dtype SDT, bool VEC, int U, Fp8Convert CVT>
__device__ float down_block(const DecodeArgs& a, const uint8_t* seg_ptr, float coef, int64_t d,
                            bool valid, int64_t routed, int64_t b, int64_t e, float* act_s) {
    const int lane = threadIdx.x % 32;
    constexpr int64_t reb = elem_bytes<RDT>(), seb = elem_bytes<SDT>();
    const int64_t r_row_bytes = a.n_ff * reb;
    const int64_t nch_r = VEC ? r_row_bytes / 16 : a.n_ff;
    const int64_t nch_s = VEC ? a.sh_n_ff * seb / 16 : a.sh_n_ff;
    const float inv_nch = 1.0f / float(nch_r);
    const uint8_t* sh_row = a.has_shared ? a.sh_down + d * a.sh_n_ff * seb : nullptr;
    uint4 w[U];
    float ws[U];
    int seg[U];
    int64_t ch[U];
    auto load_one = [&](int u, int64_t base) {  // warp-uniform (shuffles)
        const int64_t i = base + lane + 32 * u;
        seg[u] = segment_of(i, nch_r, inv_nch, a.k);
        const uint8_t* p = reinterpret_cast<const uint8_t*>(
            __shfl_sync(full_mask, reinterpret_cast<unsigned long long>(seg_ptr), seg[u]));
        const bool is_routed = i < routed;
        ch[u] = is_routed ? i - int64_t(seg[u]) * nch_r : i - routed;
        w[u] = make_uint4(0, 0, 0, 0);
        ws[u] = 0.0f;
        if (i < e && (!is_routed || p)) {
            if constexpr (VEC) {
                w[u] = load_weights16(is_routed ? p + d * r_row_bytes + ch[u] * 16
                                                : sh_row + ch[u] * 16);
            } else {
                ws[u] = is_routed ? load_weight<RDT>(p + d * r_row_bytes, ch[u])
                                  : load_weight<SDT>(sh_row, ch[u]);
            }
        }
    };
    auto load = [&](int64_t base) {
#pragma unroll
        for (int u = 0; u < U; ++u) load_one(u, base);
    };
    if (valid && b < e) load(b);

    const float4* act4 = reinterpret_cast<const float4*>(a.act + blockIdx.x * a.act_row);
    const int64_t routed4 = int64_t(a.k) * a.seg_r / 4;
    constexpr bool bits = VEC && CVT == Fp8Convert::bit_ops && RDT == mgl::dtype::f8_e4m3;
    float4* act_s4 = reinterpret_cast<float4*>(act_s);
    if constexpr (bits) {
        for (int64_t i = threadIdx.x; i < a.act_row / 4; i += blockDim.x) {
            float4 v = act4[i];
            if (i < routed4) {
                v.x *= fp8_bits_x_scale;
                v.y *= fp8_bits_x_scale;
                v.z *= fp8_bits_x_scale;
                v.w *= fp8_bits_x_scale;
            }
            act_s4[i] = v;
        }
    } else {
        // cp.async, as launch 1 stages x: the ~11 float4s of each thread in flight at once.
        for (int64_t i = threadIdx.x; i < a.act_row / 4; i += blockDim.x)
            cp_async_16(act_s4 + i, act4 + i);
        cp_async_wait_all();
    }
    __syncthreads();
    float acc = 0.0f;
    if (!valid) return acc;
    const float* act_sh = act_s + int64_t(a.k) * a.seg_r;
    // Each register slot is refilled with the next round's chunk as soon as it is consumed, so
    // those loads fly while the rest of this round computes (same summation order).
    for (int64_t base = b; base < e;) {
        const int64_t next = base + 32 * U;
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t i = base + lane + 32 * u;
            const float c = __shfl_sync(full_mask, coef, seg[u]);
            if (i < e) {
                if (i < routed) {
                    const float* xs = act_s + seg[u] * a.seg_r;
                    if constexpr (VEC) {
                        const float dot = dot_chunk<RDT, CVT>(
                            w[u], reinterpret_cast<const float4*>(xs) + ch[u], nch_r, 0.0f);
                        acc = fmaf(c, dot, acc);
                    } else {
                        acc = fmaf(c, ws[u] * xs[ch[u]], acc);
                    }
                } else {
                    if constexpr (VEC) {
                        acc = dot_chunk<SDT, Fp8Convert::hardware>(
                            w[u], reinterpret_cast<const float4*>(act_sh) + ch[u], nch_s, acc);
                    } else {
                        acc = fmaf(ws[u], act_sh[ch[u]], acc);
                    }
                }
            }
            if (next < e) load_one(u, next);  // warp-uniform
        }
        base = next;
    }
    return acc;
}

template <mgl::dtype RDT, bool VEC, int U, Fp8Convert CVT>
__device__ float down_block_shared_dtype(const DecodeArgs& a, const uint8_t* seg_ptr, float coef,
                                         int64_t d, bool valid, int64_t routed, int64_t b,
                                         int64_t e, float* act_s) {
    if (a.stype == mgl::dtype::f32)
        return down_block<RDT, mgl::dtype::f32, VEC, U, CVT>(a, seg_ptr, coef, d, valid, routed, b,
                                                             e, act_s);
    return down_block<RDT, mgl::dtype::bf16, VEC, U, CVT>(a, seg_ptr, coef, d, valid, routed, b, e,
                                                          act_s);
}

template <bool VEC, int U, Fp8Convert CVT>
__global__ void __launch_bounds__(max_decode_threads) decode_down_kernel(DecodeArgs a) {
    pdl_enter();
    extern __shared__ float4 smem4[];
    float* act_s = reinterpret_cast<float*>(smem4);
    const int64_t t = blockIdx.x;
    const int warps = int(blockDim.x / 32), warp = int(threadIdx.x / 32), lane = threadIdx.x % 32;
    const int P = a.warps_per_row, rows_per_block = warps / P;
    float* partial = act_s + a.act_row;  // [rows_per_block, P]
    const int64_t row0 = int64_t(blockIdx.y) * rows_per_block;
    const int r = warp % rows_per_block, part = warp / rows_per_block;
    const int64_t d = row0 + r;
    const bool valid = d < a.D;
    const bool fp8 = a.rtype == mgl::dtype::f8_e4m3;

    // Lane j < k: expert slot j's down matrix and coefficient for row d.
    const uint8_t* seg_ptr = nullptr;
    float coef = 0.0f;
    if (lane < a.k && valid) {
        const int32_t id = a.ids[t * a.k + lane];
        if (id >= 0 && id < a.n_experts) {
            const uint8_t* base = reinterpret_cast<const uint8_t*>(a.table[id]);
            seg_ptr = base + a.off_down;
            const float scale =
                fp8 ? reinterpret_cast<const float*>(base + a.off_down_scale)[d] : 1.0f;
            const bool bits = VEC && CVT == Fp8Convert::bit_ops && fp8;
            coef = a.weights[t * a.k + lane] * scale * (bits ? fp8_bits_x_scale : 1.0f);
        }
    }
    const int64_t nch_r = VEC ? a.n_ff / chunk_elems(a.rtype) : a.n_ff;
    const int64_t nch_s = a.has_shared ? (VEC ? a.sh_n_ff / chunk_elems(a.stype) : a.sh_n_ff) : 0;
    const int64_t routed = int64_t(a.k) * nch_r, total = routed + nch_s;
    const int64_t b = total * part / P, e = total * (part + 1) / P;
    float acc;
    switch (a.rtype) {
        case mgl::dtype::f32:
            acc = down_block_shared_dtype<mgl::dtype::f32, VEC, U, CVT>(a, seg_ptr, coef, d, valid,
                                                                        routed, b, e, act_s);
            break;
        case mgl::dtype::bf16:
            acc = down_block_shared_dtype<mgl::dtype::bf16, VEC, U, CVT>(a, seg_ptr, coef, d, valid,
                                                                         routed, b, e, act_s);
            break;
        default:
            acc = down_block_shared_dtype<mgl::dtype::f8_e4m3, VEC, U, CVT>(
                a, seg_ptr, coef, d, valid, routed, b, e, act_s);
            break;
    }
    if (valid) {
        acc = warp_sum(acc);
        if (lane == 0) partial[r * P + part] = acc;
    }
    __syncthreads();
    if (threadIdx.x < rows_per_block) {
        const int64_t dd = row0 + threadIdx.x;
        if (dd < a.D) {
            float s = 0.0f;
            for (int q = 0; q < P; ++q) s += partial[threadIdx.x * P + q];
            const float res = a.residual ? a.residual[t * a.residual_stride + dd] : 0.0f;
            a.out[t * a.out_stride + dd] = res + s;
        }
    }
}

// ---- launch 2, tiled (MoeDecodeConfig::down_rows_per_warp R > 1) ----
//
// Each warp owns R consecutive output rows and a contiguous share (1/P) of the row's tiles. A tile
// is 32 consecutive 16-byte chunks of ONE segment (routed slot j, or the shared expert), so its
// weight pointer and coefficients are warp-uniform (no per-chunk segment search, one shuffle per
// row and tile), and each lane's activations, read once from shared memory, serve all R rows.
// U tiles are in flight per lane (U · R loads); a tile's registers are refilled as soon as they
// are consumed. ncu on the H200 counted ~170 warp instructions per 32 chunks in launch 2's
// one-row kernel, with the schedulers busy 58 % of the time: it was instruction-bound.

template <mgl::dtype RDT, mgl::dtype SDT, int U, int R, bool ACT_SMEM>
__device__ void down_tiles(const DecodeArgs& a, float* act_s, float* partial) {
    const int warps = int(blockDim.x / 32), warp = int(threadIdx.x / 32), lane = threadIdx.x % 32;
    const int P = a.warps_per_row, groups = warps / P;
    const int g = warp % groups, part = warp / groups;
    const int64_t t = blockIdx.x;
    const int64_t d0 = (int64_t(blockIdx.y) * groups + g) * R;
    const int64_t r_row_bytes = a.n_ff * elem_bytes<RDT>();
    const int64_t s_row_bytes = a.has_shared ? a.sh_n_ff * elem_bytes<SDT>() : 0;
    const int nch_r = int(r_row_bytes / 16), nch_s = int(s_row_bytes / 16);
    const int tiles_r = (nch_r + 31) / 32, tiles_s = (nch_s + 31) / 32;
    const int routed_tiles = a.k * tiles_r;
    const int n_tiles = routed_tiles + tiles_s;
    const int tb = n_tiles * part / P, te = n_tiles * (part + 1) / P;

    // Lane j · R + r (j < k, r < R; k · R <= 32 is checked on the host): slot j's down matrix
    // and the coefficient w_j · scale_j[d0 + r] of row d0 + r.
    const uint8_t* seg_ptr = nullptr;
    float coef = 0.0f;
    {
        const int j = lane / R, r = lane % R;
        if (j < a.k) {
            const int32_t id = a.ids[t * a.k + j];
            if (id >= 0 && id < a.n_experts) {
                const uint8_t* base = reinterpret_cast<const uint8_t*>(a.table[id]);
                seg_ptr = base + a.off_down;
                const int64_t d = d0 + r;
                const float scale = RDT == mgl::dtype::f8_e4m3 && d < a.D
                                        ? reinterpret_cast<const float*>(base + a.off_down_scale)[d]
                                        : 1.0f;
                coef = a.weights[t * a.k + j] * scale;
            }
        }
    }
    // Tile -> (segment, first chunk); warp-uniform.
    auto locate = [&](int tile, int& seg, int& c0) {
        if (tile < routed_tiles) {
            seg = tile / tiles_r;
            c0 = (tile - seg * tiles_r) * 32;
        } else {
            seg = a.k;
            c0 = (tile - routed_tiles) * 32;
        }
    };
    uint4 w[U][R];
    auto load_tile = [&](int u, int tile) {
        int seg, c0;
        locate(tile, seg, c0);
        const bool routed = seg < a.k;
        const uint8_t* p =
            routed ? reinterpret_cast<const uint8_t*>(__shfl_sync(
                         full_mask, reinterpret_cast<unsigned long long>(seg_ptr), seg * R))
                   : a.sh_down;
        const int64_t rb = routed ? r_row_bytes : s_row_bytes;
        const int c = c0 + lane;
        const bool ok = p != nullptr && c < (routed ? nch_r : nch_s);
        const uint8_t* q = ok ? p + d0 * rb + int64_t(c) * 16 : nullptr;
#pragma unroll
        for (int r = 0; r < R; ++r)
            w[u][r] = ok && d0 + r < a.D ? load_weights16(q + r * rb) : make_uint4(0, 0, 0, 0);
    };
#pragma unroll
    for (int u = 0; u < U; ++u)
        if (tb + u < te) load_tile(u, tb + u);

    // Stage the token's activations (k routed segments, then the shared one) while those loads
    // fly; or (!ACT_SMEM) read them where launch 1 wrote them, through L1, which every warp of
    // the SM shares (no staging, no barrier, and shared memory no longer limits the blocks per
    // SM).
    const float4* act4 = reinterpret_cast<const float4*>(a.act + blockIdx.x * a.act_row);
    const float4* act_s4 = act4;
    if constexpr (ACT_SMEM) {
        float4* staged = reinterpret_cast<float4*>(act_s);
        for (int64_t i = threadIdx.x; i < a.act_row / 4; i += blockDim.x)
            cp_async_16(staged + i, act4 + i);
        cp_async_wait_all();
        __syncthreads();
        act_s4 = staged;
    }

    const int64_t seg_r4 = a.seg_r / 4;
    const float4* act_sh4 = act_s4 + int64_t(a.k) * seg_r4;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    for (int t0 = tb; t0 < te; t0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int tile = t0 + u;
            if (tile >= te) break;  // warp-uniform
            int seg, c0;
            locate(tile, seg, c0);
            const int c = c0 + lane;
            if (seg < a.k) {
                float cr[R];
#pragma unroll
                for (int r = 0; r < R; ++r) cr[r] = __shfl_sync(full_mask, coef, seg * R + r);
                if (c < nch_r) {
                    float x[chunk_elems_of<RDT>()];
                    load_chunk_x<RDT>(act_s4 + seg * seg_r4 + c, nch_r, x);
#pragma unroll
                    for (int r = 0; r < R; ++r)
                        acc[r] = fmaf(cr[r], dot_chunk_x<RDT>(w[u][r], x, 0.0f), acc[r]);
                }
            } else if (c < nch_s) {
                float x[chunk_elems_of<SDT>()];
                load_chunk_x<SDT>(act_sh4 + c, nch_s, x);
#pragma unroll
                for (int r = 0; r < R; ++r) acc[r] = dot_chunk_x<SDT>(w[u][r], x, acc[r]);
            }
            if (tile + U < te) load_tile(u, tile + U);
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float s = warp_sum(acc[r]);
        if (lane == 0) partial[(g * R + r) * P + part] = s;
    }
}

template <int U, int R, bool ACT_SMEM>
__global__ void __launch_bounds__(max_decode_threads) decode_down_tiles_kernel(DecodeArgs a) {
    pdl_enter();
    extern __shared__ float4 smem4[];
    float* act_s = reinterpret_cast<float*>(smem4);
    float* partial = act_s + (ACT_SMEM ? a.act_row : 0);  // [rows_per_block, P]
    const bool shared_f32 = a.stype == mgl::dtype::f32;
    using mgl::dtype;
    switch (a.rtype) {
        case dtype::f32:
            shared_f32 ? down_tiles<dtype::f32, dtype::f32, U, R, ACT_SMEM>(a, act_s, partial)
                       : down_tiles<dtype::f32, dtype::bf16, U, R, ACT_SMEM>(a, act_s, partial);
            break;
        case dtype::bf16:
            shared_f32 ? down_tiles<dtype::bf16, dtype::f32, U, R, ACT_SMEM>(a, act_s, partial)
                       : down_tiles<dtype::bf16, dtype::bf16, U, R, ACT_SMEM>(a, act_s, partial);
            break;
        default:
            shared_f32 ? down_tiles<dtype::f8_e4m3, dtype::f32, U, R, ACT_SMEM>(a, act_s, partial)
                       : down_tiles<dtype::f8_e4m3, dtype::bf16, U, R, ACT_SMEM>(a, act_s, partial);
            break;
    }
    __syncthreads();
    const int P = a.warps_per_row, rows_per_block = int(blockDim.x / 32) / P * R;
    if (int(threadIdx.x) < rows_per_block) {
        const int64_t t = blockIdx.x, dd = int64_t(blockIdx.y) * rows_per_block + threadIdx.x;
        if (dd < a.D) {
            float s = 0.0f;
            for (int q = 0; q < P; ++q) s += partial[threadIdx.x * P + q];
            const float res = a.residual ? a.residual[t * a.residual_stride + dd] : 0.0f;
            a.out[t * a.out_stride + dd] = res + s;
        }
    }
}

template <int U, int R>
void launch_down_tiles(const DecodeArgs& a, const MoeDecodeConfig& cfg, bool pdl,
                       cudaStream_t stream) {
    const int warps = cfg.down_warps, rows = warps / cfg.down_warps_per_row * R;
    const dim3 grid(unsigned(a.T), unsigned((a.D + rows - 1) / rows));
    const bool staged = cfg.down_act_in_shared;
    const size_t smem = size_t((staged ? a.act_row : 0) + warps * R) * sizeof(float);
    auto kernel =
        staged ? decode_down_tiles_kernel<U, R, true> : decode_down_tiles_kernel<U, R, false>;
    allow_dynamic_smem(kernel, smem);
    launch_maybe_dependent(kernel, grid, dim3(unsigned(warps * 32)), smem, stream, pdl, a);
}

// Launch 2 tiled with R rows per warp and U tiles in flight (U = 2 for unroll 2, else 4).
void launch_down_tiled(const DecodeArgs& a, const MoeDecodeConfig& cfg, bool pdl,
                       cudaStream_t stream) {
    const int R = cfg.down_rows_per_warp;
    if (cfg.unroll == 2) {
        R == 2 ? launch_down_tiles<2, 2>(a, cfg, pdl, stream)
               : launch_down_tiles<2, 4>(a, cfg, pdl, stream);
    } else {
        R == 2 ? launch_down_tiles<4, 2>(a, cfg, pdl, stream)
               : launch_down_tiles<4, 4>(a, cfg, pdl, stream);
    }
}

// DecodeArgs::compact's block counts for `rows_per_block` rows per block (host side).
void set_compact_grid(DecodeArgs& a, int64_t rows_per_block) {
    if (a.T > 65535) moe_fail("moe_experts (decode): more than 65535 tokens for the compact grid");
    auto blocks = [&](int64_t rows) { return (rows + rows_per_block - 1) / rows_per_block; };
    const int64_t routed = blocks(a.n_ff);
    const int64_t shared = a.has_shared ? blocks(a.sh_n_ff) : routed;
    const int64_t both = std::min(routed, shared);
    const int64_t wider_jobs = a.has_shared && a.sh_n_ff > a.n_ff ? 1 : a.k;
    const int64_t per_token =
        both * a.jobs_per_token + (std::max(routed, shared) - both) * wider_jobs;
    if (per_token > 0x7fffffff) moe_fail("moe_experts (decode): too many blocks per token");
    a.both_row_blocks = int(both);
    a.blocks_per_token = int(per_token);
}

// Launch 1 for `part`: every job (compact grid if configured), the routed experts alone or the
// shared expert alone (2-D grids whose jobs all have the same rows, so no block is empty).
template <bool VEC, int U, Fp8Convert CVT>
void launch_gate_up(const DecodeArgs& a, const MoeDecodeConfig& cfg, MoeDecodePart part, bool pdl,
                    cudaStream_t stream) {
    DecodeArgs g = a;
    int64_t max_rows = a.has_shared && a.sh_n_ff > a.n_ff ? a.sh_n_ff : a.n_ff;
    if (part == MoeDecodePart::routed_gate_up) {
        g.jobs_per_token = a.k;
        g.compact = false;
        max_rows = a.n_ff;
    } else if (part == MoeDecodePart::shared_gate_up) {
        g.jobs_per_token = 1;
        g.job_base = a.k;
        g.compact = false;
        g.fetch = nullptr;  // reads no expert table
        max_rows = a.sh_n_ff;
    }
    {
        // Two row pairs with 8 loads in flight per row spill (the 128-register cap of 512
        // threads): unroll 8 keeps one.
        constexpr bool two_ok = VEC && U <= 4;
        const int warps = cfg.gate_up_warps, R = two_ok ? cfg.gate_up_rows_per_warp : 1;
        const int64_t rows_per_block = int64_t(warps) * R;
        dim3 grid(unsigned(a.T * g.jobs_per_token),
                  unsigned((max_rows + rows_per_block - 1) / rows_per_block));
        if (g.compact) {
            set_compact_grid(g, rows_per_block);
            grid = dim3(unsigned(g.blocks_per_token), unsigned(g.T));
        }
        const size_t smem = size_t(a.D) * sizeof(float);
        auto kernel = decode_gate_up_kernel<VEC, U, CVT, 1>;
        if constexpr (two_ok) {
            if (R == 2) kernel = decode_gate_up_kernel<VEC, U, CVT, 2>;
        }
        allow_dynamic_smem(kernel, smem);
        launch_maybe_dependent(kernel, grid, dim3(unsigned(warps * 32)), smem, stream, pdl, g);
    }
}

// Launch 2 (down): every job's activations, the shared expert's and the residual.
template <bool VEC, int U, Fp8Convert CVT>
void launch_down(const DecodeArgs& a, const MoeDecodeConfig& cfg, bool pdl, cudaStream_t stream) {
    if (VEC && cfg.down_rows_per_warp > 1 && a.k * cfg.down_rows_per_warp <= 32) {
        launch_down_tiled(a, cfg, pdl, stream);
        return;
    }
    {
        const int warps = cfg.down_warps, rows = warps / cfg.down_warps_per_row;
        const dim3 grid(unsigned(a.T), unsigned((a.D + rows - 1) / rows));
        const size_t smem = size_t(a.act_row + warps) * sizeof(float);
        auto kernel = decode_down_kernel<VEC, U, CVT>;
        allow_dynamic_smem(kernel, smem);
        launch_maybe_dependent(kernel, grid, dim3(unsigned(warps * 32)), smem, stream, pdl, a);
    }
}

template <bool VEC, int U, Fp8Convert CVT>
void launch_decode(const DecodeArgs& a, const MoeDecodeConfig& cfg, MoeDecodePart part, bool pdl,
                   cudaStream_t stream) {
    if (part != MoeDecodePart::down) launch_gate_up<VEC, U, CVT>(a, cfg, part, pdl, stream);
    if (part == MoeDecodePart::all || part == MoeDecodePart::down)
        launch_down<VEC, U, CVT>(a, cfg, pdl, stream);
}

int64_t seg_floats(int64_t n_ff) { return round_up(n_ff, 4); }

int64_t act_row_floats(const MoeExpertsParams& p) {
    return int64_t(p.k) * seg_floats(p.layout.n_ff) +
           (has_shared(p) ? seg_floats(p.shared.n_ff) : 0);
}

}  // namespace

size_t decode_workspace_bytes(const MoeExpertsParams& p) {
    return size_t(p.n_tokens) * size_t(act_row_floats(p)) * sizeof(float);
}

void decode_experts(const MoeExpertsParams& p, MoeDecodePart part, void* ws, size_t ws_bytes,
                    cudaStream_t stream) {
    const auto& c = p.decode;
    if (p.k > max_decode_k)
        moe_fail("moe_experts (decode): k = " + std::to_string(p.k) + " (at most 32)");
    if (c.gate_up_warps < 1 || c.gate_up_warps > 16 || c.down_warps < 1 || c.down_warps > 16 ||
        c.down_warps_per_row < 1 || c.down_warps % c.down_warps_per_row != 0 ||
        !(c.unroll == 2 || c.unroll == 4 || c.unroll == 8) ||
        !(c.down_rows_per_warp == 1 || c.down_rows_per_warp == 2 || c.down_rows_per_warp == 4) ||
        !(c.gate_up_rows_per_warp == 1 || c.gate_up_rows_per_warp == 2))
        moe_fail("moe_experts (decode): bad config: gate_up_warps " +
                 std::to_string(c.gate_up_warps) + ", down_warps " + std::to_string(c.down_warps) +
                 ", down_warps_per_row " + std::to_string(c.down_warps_per_row) + ", unroll " +
                 std::to_string(c.unroll) + ", down_rows_per_warp " +
                 std::to_string(c.down_rows_per_warp) + ", gate_up_rows_per_warp " +
                 std::to_string(c.gate_up_rows_per_warp) +
                 " (warps 1..16, warps_per_row dividing down_warps, unroll 2, 4 or 8, rows per "
                 "warp 1, 2 or 4 in launch 2, 1 or 2 in launch 1)");
    const size_t need = decode_workspace_bytes(p);
    if (ws_bytes < need || (need && !ws))
        moe_fail("moe_experts (decode): workspace of " + std::to_string(ws_bytes) +
                 " bytes, needs " + std::to_string(need));
    const int64_t D = p.layout.n_embd;
    const int64_t act_row = act_row_floats(p);
    if (size_t(D) * 4 > 48 * 1024 ||
        size_t(act_row + c.down_warps * c.down_rows_per_warp) * 4 > max_smem_per_block)
        moe_fail("moe_experts (decode): n_embd " + std::to_string(D) + " or k · n_ff + shared " +
                 std::to_string(act_row) + " too large for shared memory");
    if (p.n_tokens == 0 || (part == MoeDecodePart::shared_gate_up && !has_shared(p))) return;

    DecodeArgs a{};
    a.table = p.expert_table;
    a.n_experts = p.n_experts;
    a.rtype = p.layout.type;
    a.D = D;
    a.n_ff = p.layout.n_ff;
    a.off_gate = p.layout.gate_offset;
    a.off_up = p.layout.up_offset;
    a.off_down = p.layout.down_offset;
    a.off_gate_scale = p.layout.gate_scale_offset;
    a.off_up_scale = p.layout.up_scale_offset;
    a.off_down_scale = p.layout.down_scale_offset;
    a.ids = p.ids;
    a.weights = p.weights;
    a.k = p.k;
    a.x = p.x;
    a.x_stride = p.x_stride ? p.x_stride : D;
    a.out = p.out;
    a.out_stride = p.out_stride ? p.out_stride : D;
    a.residual = p.residual;
    a.residual_stride = p.residual_stride ? p.residual_stride : D;
    a.T = p.n_tokens;
    a.has_shared = has_shared(p);
    a.stype = a.has_shared ? p.shared.type : mgl::dtype::bf16;
    a.sh_gate = static_cast<const uint8_t*>(p.shared.gate);
    a.sh_up = static_cast<const uint8_t*>(p.shared.up);
    a.sh_down = static_cast<const uint8_t*>(p.shared.down);
    a.sh_n_ff = a.has_shared ? p.shared.n_ff : 0;
    a.act = static_cast<float*>(ws);
    a.act_row = act_row;
    a.seg_r = seg_floats(p.layout.n_ff);
    a.jobs_per_token = p.k + (a.has_shared ? 1 : 0);
    a.job_base = 0;
    a.warps_per_row = c.down_warps_per_row;
    a.compact = c.gate_up_compact_grid;  // its block counts: launch_decode, which knows R
    a.norm = p.rms_norm;
    a.norm_w = p.norm_w;
    a.norm_w_bf16 = p.norm_w_type == mgl::dtype::bf16;
    a.norm_eps = p.norm_eps;
    a.fetch = p.pdl ? p.fetch_state : nullptr;  // without PDL the launch waits for it anyway

    const bool bits = c.fp8_convert == Fp8Convert::bit_ops;
    if (!weights_vec_aligned(p)) {
        launch_decode<false, 4, Fp8Convert::hardware>(a, c, part, p.pdl, stream);
    } else if (c.unroll == 2) {
        bits ? launch_decode<true, 2, Fp8Convert::bit_ops>(a, c, part, p.pdl, stream)
             : launch_decode<true, 2, Fp8Convert::hardware>(a, c, part, p.pdl, stream);
    } else if (c.unroll == 4) {
        bits ? launch_decode<true, 4, Fp8Convert::bit_ops>(a, c, part, p.pdl, stream)
             : launch_decode<true, 4, Fp8Convert::hardware>(a, c, part, p.pdl, stream);
    } else {
        bits ? launch_decode<true, 8, Fp8Convert::bit_ops>(a, c, part, p.pdl, stream)
             : launch_decode<true, 8, Fp8Convert::hardware>(a, c, part, p.pdl, stream);
    }
}

}  // namespace minids::kernels::moe_detail
