// MoE on the GPU: routing (softmax, top-k, weights) and the routed experts (+ shared expert,
// + residual), for decode (a few tokens) and prefill (hundreds of tokens).
//
// The math (DESIGN.md "MoE", mgl.h, ggml-like/cpu/ops_moe.cpp are the reference):
//   probs = softmax(logits)                                    [T, E] f32
//   ids   = top-k of probs: higher probability first, ties -> lower id. group_limited_greedy:
//           experts split into n_group equal groups scored by their max; the topk_group best
//           groups (ties -> lower group id) are kept and the top-k is taken among their experts.
//   w     = s / Σ s           when norm_topk_prob and k > 1   (s = probs of the chosen ids)
//         = s · routed_scaling_factor otherwise
//   out[t] = residual[t] + Σ_j w[t,j] · Expert_{ids[t,j]}(x[t]) + Shared(x[t])
//   Expert(x) = down · (silu(gate · x) ⊙ (up · x)), gate/up [n_ff, n_embd], down [n_embd, n_ff]
//   (linear weights stored [out, in] as in the checkpoint; f8_e4m3 rows carry one f32 scale each:
//   W_real[n, :] = e4m3(W[n, :]) · scale[n]).
//
// Where the experts are: the .mds file stores each expert as one blob (gate, up, down and the
// three scales at fixed byte offsets, the same for every expert; src/mds/format.h). The kernels
// take a device-resident table of blob base addresses, `expert_table[E]` (int64 device
// addresses: GPU memory, a GPU expert-cache slot, or a registered host mapping read zero-copy),
// plus an ExpertLayout with the offsets. The host never learns the routing: ids and weights are
// read by the kernels from device memory, and nothing here allocates, synchronizes or reads
// device values on the host, so every launcher can be captured into a CUDA graph. Workspaces are
// caller-provided (the *_workspace_bytes functions say how much).
//
// Worked example (one decode step of one MoE layer, everything already on the device):
//
//     using namespace minids::kernels;
//     MoeRoutingParams r;                       // logits [1, 64] from the router matvec
//     r.logits = d_logits;  r.ids = d_ids;  r.weights = d_w;
//     r.n_tokens = 1;  r.n_experts = 64;  r.route.k = 6;
//     moe_route(r, stream);                     // softmax + top-6 + weights, one launch
//     MoeExpertsParams e;
//     e.expert_table = d_table;  e.n_experts = 64;  e.layout = layout;   // from the .mds
//     e.ids = d_ids;  e.weights = d_w;  e.k = 6;
//     e.x = d_x;  e.out = d_h;  e.residual = d_h;  e.n_tokens = 1;      // in-place residual add
//     e.shared = {mgl::dtype::bf16, d_sh_gate, d_sh_up, d_sh_down, 2816};
//     size_t ws = moe_experts_workspace_bytes(e);                        // once, at plan time
//     moe_experts(e, d_workspace, ws, stream);  // decode path: two launches
//
// Errors: every launcher checks its parameters on the host and throws mgl::error with a clear
// message; launch failures are CUDA_CHECKed. What cannot be checked on the host (the ids are
// device data): an expert id outside [0, E) contributes nothing (its weights are never read).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "expert_fetch.h"
#include "mgl.h"

namespace minids::kernels {

// ---------------------------------------------------------------------------------------------
// Routing
// ---------------------------------------------------------------------------------------------

// Shared by the three routing launchers; each says which fields it reads and writes.
// Limits: 1 <= n_experts <= 1024, 1 <= k <= n_experts, group-limited: n_group <= 32 and
// mgl's rules (n_experts % n_group == 0, topk_group <= n_group, k <= topk_group · group size).
struct MoeRoutingParams {
    const float* logits = nullptr;  // moe_route input: [T, E], row stride `in_stride`
    const float* probs = nullptr;   // moe_topk / moe_weights input: [T, E], row stride `in_stride`
    int64_t in_stride = 0;          // elements between rows of logits / probs (0 = n_experts)
    float* probs_out = nullptr;     // moe_route output (optional): [T, E] contiguous
    int32_t* ids = nullptr;         // [T, k] contiguous: moe_topk / moe_route output,
                                    // moe_weights input
    float* weights = nullptr;       // [T, k] contiguous: moe_weights / moe_route output
    int64_t n_tokens = 0;           // T
    int64_t n_experts = 0;          // E
    mgl::moe_route_params route;    // k, method, n_group, topk_group, norm_topk_prob, scaling
    bool pdl = false;  // launched dependent on the previous kernel (dependent_launch.cuh)
    // moe_route only (the route_fetch fusion): with fetch.state set, the layer's expert fetch is
    // planned right after the ids (expert_fetch.h; fetch.ids and n_ids must be these ids), in the
    // routing's own launch when one block routes every token by ranks (up to 4 tokens, 256
    // experts), else by expert_fetch_plan just after. The caller then launches only the copy.
    ExpertFetchParams fetch;
};

// probs -> ids. Identical ids to mgl's CPU moe_topk on the same probs, ties included (-0 ties
// with +0). A NaN, which the CPU's compares cannot place: up to 256 experts it ranks after every
// number (NaNs among themselves by id); beyond, its place is unspecified.
void moe_topk(const MoeRoutingParams& p, cudaStream_t stream);
// probs, ids -> weights. Bit-identical to mgl's CPU moe_weights (same f32/f64 arithmetic).
void moe_weights(const MoeRoutingParams& p, cudaStream_t stream);
// logits -> softmax probs (written to probs_out when given), ids and weights, in one launch.
// The ids and weights equal moe_topk / moe_weights applied to these probs; the probs match the
// CPU softmax to rounding (expf may differ from the host's by an ulp).
void moe_route(const MoeRoutingParams& p, cudaStream_t stream);

// The router matmul and moe_route in one launch, for decode (at most 8 tokens): at batch 1 the
// router's GEMV and the routing are each pure latency (launch, first loads, one block doing a
// few µs of work), so one kernel does both. Every block computes the logits of 8 experts (one
// weight row per warp, streamed as matmul's stream GEMV does, the first loads issued before the
// PDL wait) into `logits`; the last block to finish (an atomic ticket) routes every token from
// them with moe_route's own code (moe_route.cuh). The logits are the stream GEMV's arithmetic
// operation for operation (matmul_stream.cu), so they, and then probs, ids and weights, are the
// bits that matmul + moe_route give on the same inputs.
struct MoeRouterRouteParams {
    const float* x = nullptr;  // [T, D], row stride x_stride (0 = D); rows 16-byte aligned
    int64_t x_stride = 0;
    int64_t n_embd = 0;                         // D, a multiple of 8
    const void* w = nullptr;                    // router weights [E, D], 16-byte aligned
    mgl::dtype w_type = mgl::dtype::bf16;       // bf16 only
    int64_t w_row_stride = 0;                   // bytes between rows (0 = 2·D), a multiple of 16
    bool rms_norm = false;                      // route rms_norm(x) · norm_w instead of x
    const void* norm_w = nullptr;               // [D], null = no weight; 16-byte aligned
    mgl::dtype norm_w_type = mgl::dtype::bf16;  // bf16 or f32
    float norm_eps = 1e-6f;
    float* norm_out = nullptr;    // with rms_norm, optional: the normalized rows [T, D] (as
    int64_t norm_out_stride = 0;  // matmul's norm_out), row stride in floats (0 = D)
    float* logits = nullptr;      // [T, E] contiguous, written: the scratch the routing reads
    // One device counter, 0 before the first launch; every launch leaves it at 0 (so a replayed
    // CUDA graph finds it so). Launches that may run at the same time need different counters.
    unsigned int* ticket = nullptr;
    // Routing, as moe_route: probs_out optional [T, E], ids and weights [T, k], contiguous.
    float* probs_out = nullptr;
    int32_t* ids = nullptr;
    float* weights = nullptr;
    int64_t n_tokens = 0;   // T <= moe_router_route_max_tokens
    int64_t n_experts = 0;  // E <= moe_router_route_max_experts
    mgl::moe_route_params route;
    // Launched dependent on the previous kernel: the first router weights are requested before
    // waiting for it, x and everything else read or written after.
    bool pdl = false;
    // As MoeRoutingParams::fetch: the block that routes also plans the layer's expert fetch.
    ExpertFetchParams fetch;
};
constexpr int64_t moe_router_route_max_tokens = 8;
constexpr int64_t moe_router_route_max_experts = 256;

// Why moe_router_route cannot take these parameters (shape, dtype, alignment, routing), or empty
// when it can; the pointers' alignment is checked, not their presence. Needs no device; the
// backend asks it to fall back to matmul + moe_route.
std::string moe_router_route_unsupported(const MoeRouterRouteParams& p);
// Throws mgl::error with moe_router_route_unsupported's reason, or for a missing pointer.
void moe_router_route(const MoeRouterRouteParams& p, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Routed experts (+ shared expert, + residual)
// ---------------------------------------------------------------------------------------------

// Byte offsets of the parts of one expert blob (the same for every expert), as in the .mds
// manifest's "experts.layout" (mds::ExpertTable). Build it once per model.
struct ExpertLayout {
    mgl::dtype type = mgl::dtype::f8_e4m3;  // f32, bf16 or f8_e4m3
    int64_t n_embd = 0;                     // D
    int64_t n_ff = 0;                       // moe_intermediate_size
    int64_t gate_offset = 0;                // [n_ff, D]
    int64_t up_offset = 0;                  // [n_ff, D]
    int64_t down_offset = 0;                // [D, n_ff]
    int64_t gate_scale_offset = -1;         // f32 [n_ff]; f8_e4m3 only (-1 otherwise)
    int64_t up_scale_offset = -1;           // f32 [n_ff]
    int64_t down_scale_offset = -1;         // f32 [D]
};

// A dense SwiGLU MLP applied to every token (DeepSeek's shared experts, n_shared_experts of them
// fused into one of intermediate size n_ff = moe_intermediate_size · n_shared_experts).
// Absent when gate is null.
struct SharedExpertWeights {
    mgl::dtype type = mgl::dtype::bf16;  // bf16 or f32
    const void* gate = nullptr;          // [n_ff, D]
    const void* up = nullptr;            // [n_ff, D]
    const void* down = nullptr;          // [D, n_ff]
    int64_t n_ff = 0;
};

enum class MoePath : uint8_t {
    automatic,  // decode when n_tokens <= decode_max_tokens, grouped otherwise
    decode,     // fused: two launches, each (token, expert) independently (any T; meant for few)
    grouped,    // tokens sorted by expert on the device, then grouped GEMMs
};

// How the decode kernels turn FP8 into FP32 (both exact; which is faster is measured by
// scripts/bench_moe_cuda.cpp).
enum class Fp8Convert : uint8_t {
    hardware,  // cvt.rn.f16x2.e4m3x2, then f16 -> f32
    bit_ops,   // byte permute + shifts to bf16 patterns (scaled by 2^-120, folded back exactly)
};

// Tuning of the decode path (defaults are the measured best; see docs/perf.md).
struct MoeDecodeConfig {
    int gate_up_warps = 8;  // warps per block of launch 1, 1..16
    // Launch 1: gate/up row pairs per warp (1 or 2; one read of x serves them all; unroll 8
    // keeps 1).
    int gate_up_rows_per_warp = 1;
    // Launch 1 launches only blocks that have rows. The 2-D grid (jobs x row blocks of the
    // widest job) gives each routed expert (1408 rows in V2-Lite) as many blocks as the shared
    // one (2816): 1,056 of its 2,464 blocks return at once.
    bool gate_up_compact_grid = true;
    int down_warps = 16;         // warps per block of launch 2, 1..16
    int down_warps_per_row = 4;  // launch 2: warps sharing one output row (1, 2, 4 or 8)
    int unroll = 2;              // 16-byte loads in flight per lane and row: 2, 4 or 8
    // Launch 2: output rows per warp (1, 2 or 4). Above 1 a warp walks 32-chunk tiles of one
    // expert at a time, U = 2 (unroll 2) or 4 tiles in flight, FP8 converted in hardware (the
    // tiled kernel ignores fp8_convert); used when k · rows <= 32, else one row per warp.
    int down_rows_per_warp = 2;
    // Launch 2 (tiled) stages the token's activations (k · n_ff + shared floats, 45 KB for
    // V2-Lite) in shared memory per block; false reads them through L1 instead (no staging
    // barrier, more blocks per SM). Same arithmetic and order either way.
    bool down_act_in_shared = true;
    Fp8Convert fp8_convert = Fp8Convert::hardware;
};

// Which tensor-core GEMM kernel the grouped path runs (both give the same bits: see
// moe_gemm_pipelined.cuh).
enum class MoeGroupedKernel : uint8_t {
    // Register-staged double buffer, x converted from f32 to BF16 inside the K loop
    // (moe_gemm.cuh).
    staged,
    // x rounded to BF16 once per call, a 3-4 stage cp.async pipeline, FP8 weights raw in shared
    // memory (moe_gemm_pipelined.cuh). FP8 and BF16 weights; f32 weights keep the staged kernel.
    pipelined,
};
// The kernel the grouped path runs unless told otherwise: the one place that decides it
// (MINIDS_MOE_GROUPED overrides it in the CUDA backend). Pipelined: pp512 19,792 -> 23,935 tok/s
// on the H200 (synthetic V2-Lite, FP8 experts; docs/perf.md), the same bits (GPU tests).
constexpr MoeGroupedKernel moe_grouped_default_kernel() { return MoeGroupedKernel::pipelined; }

// Tuning of the grouped (prefill) path.
struct MoeGroupedConfig {
    // Tensor cores (mma.sync m16n8k16 BF16, FP32 accumulate; x and the SwiGLU activations rounded
    // to BF16, FP8 weights widened to BF16 exactly, row scales applied on the output) where the
    // shapes allow: n_embd, n_ff and the shared n_ff multiples of 16, every part 16-byte aligned,
    // x rows 16-byte aligned. Otherwise, or when false: simple FP32 SIMT kernels (exact weights,
    // FP32 activations), slow, the reference for debugging.
    bool tensor_cores = true;
    int tile_m = 64;  // sorted rows per GEMM tile: 32, 64 or 128
    MoeGroupedKernel kernel = moe_grouped_default_kernel();
};

struct MoeExpertsParams {
    // Routed experts: expert_table[e] is the device address of expert e's blob (16-byte aligned;
    // .mds blobs are 4096-aligned). Blobs may lie anywhere, in any order.
    const int64_t* expert_table = nullptr;  // [n_experts], device memory
    int64_t n_experts = 0;
    ExpertLayout layout;

    // Routing, device memory: ids [T, k] i32 and weights [T, k] f32, contiguous.
    const int32_t* ids = nullptr;
    const float* weights = nullptr;
    int k = 0;

    // Tokens. out may alias x or residual (in-place residual add).
    const float* x = nullptr;  // [T, D], row stride x_stride (0 = D)
    int64_t x_stride = 0;
    float* out = nullptr;  // [T, D], row stride out_stride (0 = D)
    int64_t out_stride = 0;
    const float* residual = nullptr;  // optional [T, D], row stride residual_stride (0 = D)
    int64_t residual_stride = 0;
    int64_t n_tokens = 0;

    SharedExpertWeights shared;  // optional

    // Optional RMSNorm folded into the decode path: x is the norm's input and every expert (and
    // the shared one) multiplies rms_norm(x) · norm_w, with 1 / rms applied to each dot product
    // (W (x g) / rms). Decode path only (moe_experts fails on the grouped path with it).
    bool rms_norm = false;
    const void* norm_w = nullptr;               // [n_embd], null = no weight
    mgl::dtype norm_w_type = mgl::dtype::bf16;  // bf16 or f32
    float norm_eps = 1e-6f;

    MoePath path = MoePath::automatic;
    int64_t decode_max_tokens = 8;
    MoeDecodeConfig decode;
    // Decode path: both kernels launched dependent on the previous kernel (dependent_launch.cuh);
    // the shared expert's first weights are requested before waiting for it.
    bool pdl = false;
    // Decode path, launched right after an expert cache's fetch launch (the layer's own or the
    // prefetch behind it: ggml-like/cuda/launches.cpp sets it only there), whose state this is.
    // Launch 1's blocks then start without waiting for that launch: the shared expert's and
    // those of experts no fill of this step wrote (the step's fill log names the slots), so they
    // run while the misses cross the link; a block whose expert's slot is in the fill log still
    // waits for the fetch launch (its copies, or its wait for the copy engines). Safe because
    // such a launch writes neither x nor the ids, and the tables and fill log it reads were
    // written by plans that completed before it started (docs/expert-cache.md, "Hit experts
    // while the misses cross").
    const mgl::expert_fetch_header* fetch_state = nullptr;
    MoeGroupedConfig grouped;
};

// Device workspace moe_experts needs for these parameters (path resolved as moe_experts will).
// Decode: T · (k · n_ff + shared n_ff) floats. Grouped: the sort (≈ 8 · T · k bytes), the
// activations and per-(token, expert) outputs, T · k · (n_ff + D) floats, plus T · (shared n_ff
// + D) floats with a shared expert, plus T · D BF16 values for x with the pipelined kernel.
size_t moe_experts_workspace_bytes(const MoeExpertsParams& p);

// out = residual + Σ_j w_j · Expert_{id_j}(x) + Shared(x), on `stream`, without allocating or
// synchronizing. `workspace` is device memory of at least moe_experts_workspace_bytes(p),
// 256-byte aligned. Deterministic: the same inputs give the same bits (fixed summation orders,
// no atomics in any sum).
//
// Decode path (two launches): launch 1 computes silu(gate·x) ⊙ (up·x) for every (token, selected
// expert) and the shared expert into the workspace, one warp per row pair with 16-byte loads;
// launch 2 computes each output row as the weighted sum over the token's k experts (fixed order)
// plus the shared expert plus the residual. FP32 accumulation throughout.
// Grouped path: a one-block counting sort of the (token, expert) pairs by expert (stable: token
// order inside an expert), (pipelined kernel: x rounded to BF16 once,) grouped gate/up GEMM with
// the SwiGLU fused into its epilogue, grouped down GEMM, the same two GEMMs (dense) for the
// shared expert, then a combine that adds the weighted expert outputs in j order, the shared
// output and the residual.
void moe_experts(const MoeExpertsParams& p, void* workspace, size_t workspace_bytes,
                 cudaStream_t stream);

// The decode path in parts, for a caller that runs the shared expert's gate/up beside the
// routing (the CUDA backend's shared_beside fusion: on a second stream, forked once x is
// written, joined before the down launch). One workspace serves all three parts, which must run
// in this order except that shared_gate_up may run any time after x is written and before down:
// shared_gate_up (nothing without a shared expert), routed_gate_up (launch 1 without the shared
// job; fetch_state as for moe_experts), down (launch 2, reading every job's activations). The
// result is bit-identical to moe_experts: each job's arithmetic does not depend on the grid.
enum class MoeDecodePart : uint8_t { all, shared_gate_up, routed_gate_up, down };
void moe_decode_part(const MoeExpertsParams& p, MoeDecodePart part, void* workspace,
                     size_t workspace_bytes, cudaStream_t stream);

// The launches of the grouped path one at a time, for benchmarks that time each kernel alone
// (scripts/bench_moe_cuda.cpp). On the workspace a complete moe_experts call with the same
// parameters left, re-running a stage recomputes what that call computed there (the combine
// stage also rewrites out, which must not alias x or residual then). A stage these parameters
// do not have (x_to_bf16 without the pipelined kernel, the shared stages without a shared
// expert) launches nothing.
enum class MoeGroupedStage : uint8_t {
    sort,            // the (token, expert) pairs by expert
    x_to_bf16,       // x rounded to BF16 once (pipelined kernel)
    gate_up,         // routed experts: grouped gate/up GEMM + SwiGLU
    down,            // routed experts: grouped down GEMM
    shared_gate_up,  // shared expert: gate/up GEMM + SwiGLU over every token
    shared_down,     // shared expert: down GEMM
    combine,         // weighted sum + shared + residual -> out
};
void moe_grouped_stage(const MoeExpertsParams& p, MoeGroupedStage stage, void* workspace,
                       size_t workspace_bytes, cudaStream_t stream);

// Which path moe_experts takes for these parameters (for logging and tests).
MoePath moe_resolved_path(const MoeExpertsParams& p);
// Whether the grouped path would run on tensor cores for these parameters.
bool moe_grouped_uses_tensor_cores(const MoeExpertsParams& p);

}  // namespace minids::kernels
