// Which nodes of a graph the CUDA backend runs together, decided at allocate() from the graph's
// structure alone (ops, shapes, strides, who consumes what):
//
//   norm      rms_norm -> matmul: the matmul normalizes its rows itself (its RMSNorm prologue),
//             when every consumer of the norm is a matmul of at most 16 rows taking it as x,
//             or (norm_moe, off by default: measured slower) a moe_experts of at most 8 rows,
//             whose decode path folds it too.
//   norm_out  rms_norm (one row) -> matmul + later readers: the first matmul reader normalizes
//             its row itself and also writes the normalized row for the others (off by default).
//   residual  matmul -> add, moe_experts -> add: the product is added to the other operand as it
//             is written (the residual epilogue), when the add is the product's only consumer.
//   route     softmax -> moe_topk -> moe_weights: one moe_route launch writes probs, ids and
//             weights.
//   router_route  (off by default) route whose softmax reads a router matmul of at most 8 rows
//             (BF16 [E, D] weights, E <= 256) read by nothing else: one moe_router_route launch
//             computes the logits (and the matmul's folded norm, norm_out included) and routes.
//   route_fetch  (off by default) route whose ids one expert_fetch reads, with nothing between
//             the two steps that reads an expert table or the fetch state: the routing launch
//             plans the fetch (kernels/expert_fetch_plan.cuh) and the fetch's step only copies.
//   mla_prep  rms_norm(kv_cmpr) + rope(k_pe) + kv_store + rope(q_pe): one mla_prep launch per
//             layer, for MLA's decode prologue.
//   side_stream  (a schedule, off by default) an expert cache's prefetch and the nodes only it
//             reads (its routing prediction) run on a second stream, forked from the main one
//             where they start and joined before the first later main step that reads them, is
//             a fetch or a route step; their memory stays live until that join.
//   shared_beside  (a schedule, on by default) a decode-sized moe_experts with a shared expert:
//             the shared expert's gate/up runs on the side stream from right after the step
//             that writes x, beside the router, the routing and any expert fetch; the down
//             launch joins it.
//   prefetch_behind_misses  (a schedule) without side_stream: a MoE layer's fetch followed by a
//             prefetch before the layer's experts leaves its wait for the proxy's copies to that
//             prefetch, which posts its requests behind the layer's first.
//
// A node is fused away only when it is not a graph output and nothing outside its group reads
// it, except outputs the fused kernel writes anyway (probs and ids of route; q_pe, kv_cmpr and
// k_pe of mla_prep), whose outside readers must run after the group. A group runs at the step of
// its last member; `also_reads` tells the memory planner what that step reads, so nothing it
// needs is reused before.
#pragma once

#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "mgl-cuda.h"
#include "mgl.h"
#include "moe.h"

namespace minids::kernels {
struct MoeDecodeConfig;
}

namespace mgl::cuda {

using fusion_switches = cuda_fusions;
// `defaults` replaced by MINIDS_CUDA_FUSE when it is set: "0" / "none" (no fusion), "all"
// (the defaults), or a comma list of exactly the fusions to use (which may name those that are
// off by default, norm_moe, norm_out, router_route and route_fetch, to measure them).
fusion_switches fusion_switches_from_env(fusion_switches defaults);

// MINIDS_CUDA_PRECISE names the products to run in FP32 instead of on BF16 tensor cores (slow; to
// measure what BF16 rounding of activations costs in accuracy): gemm (the cuBLAS GEMMs of a
// prompt), moe (the grouped expert GEMMs), mla (the attention kernels), or all.
struct precise_switches {
    bool gemm = false, moe = false, mla = false;
};
precise_switches precise_switches_from_env();

// MINIDS_MOE_DECODE overrides the MoE decode kernels' tuning for a whole-model A/B without a
// rebuild: a comma list of key=value among gate_up_warps, gate_up_rows, gate_up_compact (0/1),
// down_warps, down_warps_per_row, down_rows, down_act_in_shared (0/1), unroll (kernels/moe.h,
// MoeDecodeConfig; the launcher checks the values). An unknown key or a value that is not a
// number is an error.
void moe_decode_config_from_env(minids::kernels::MoeDecodeConfig& c);

// MINIDS_CUDA_GEMM_X: how x enters the prompt's cuBLAS GEMMs: `split` (the default: a BF16
// hi + lo pair, two GEMMs, ~16 significant bits; kernels/matmul.h, MatmulParams::split_x) or
// `bf16` (one rounding to BF16, half the tensor-core work). Anything else is an error.
bool gemm_split_x_from_env();

// MINIDS_STREAM_PLAN: the rules for the decode products' stream GEMV shapes, 2 (the default)
// or 1 (the rules before it; kernels/matmul.h, MatmulParams::stream_plan). Anything else is an
// error.
int stream_plan_from_env();

// MINIDS_MOE_HITS: when a MoE decode launch follows an expert fetch's launch, `early` (the
// default) starts the shared expert and the experts no fill of the step wrote without waiting
// for it (kernels/moe.h, MoeExpertsParams::fetch_state); `after-fetch` waits as every launch
// does. Anything else is an error.
bool moe_hits_early_from_env();

// MINIDS_MOE_GROUPED picks the tensor-core GEMM kernel of the grouped (prompt) MoE path: staged
// or pipelined (kernels/moe.h, MoeGroupedKernel); unset or empty keeps
// moe_grouped_default_kernel(). Anything else is an error.
minids::kernels::MoeGroupedKernel moe_grouped_kernel_from_env();

struct route_group {
    tensor* softmax = nullptr;
    tensor* topk = nullptr;
    tensor* weights = nullptr;  // the step it runs at
    // router_route: the matmul producing the softmax's logits, run inside this step (its norm, if
    // one is folded, in norm_of / writes_norm); it still writes its output, the logits.
    tensor* router = nullptr;
    // route_fetch: the expert_fetch reading topk, whose plan runs inside this step (its table and
    // state written here); the fetch's own step then launches only the copy.
    tensor* fetch = nullptr;
};

struct mla_prep_group {
    tensor* kv_norm = nullptr;   // rms_norm of kv_cmpr
    tensor* k_rope = nullptr;    // rope of k_pe
    tensor* store = nullptr;     // kv_store
    tensor* q_rope = nullptr;    // rope of q_pe
    tensor* run_at = nullptr;    // the last of the four in execution order
    tensor* kv = nullptr;        // the [T, r + rope] row tensor kv_cmpr and k_pe are slices of
    bool write_kv_norm = false;  // kv_norm / k_rope are read outside the group (or are outputs)
    bool write_k_rope = false;
};

struct fusion_plan {
    std::unordered_map<const tensor*, tensor*> norm_of;      // matmul / moe_experts -> its rms_norm
    std::unordered_map<const tensor*, tensor*> writes_norm;  // matmul -> the rms_norm it writes
    std::unordered_map<const tensor*, tensor*> residual_add;    // matmul / moe_experts -> the add
    std::unordered_map<const tensor*, tensor*> producer_of;     // the add -> matmul / moe_experts
    std::unordered_map<const tensor*, route_group> route_at;    // keyed by the weights node
    std::unordered_map<const tensor*, mla_prep_group> prep_at;  // keyed by run_at
    std::unordered_set<const tensor*> skipped;        // nodes whose work runs in another step
    std::unordered_set<const tensor*> fetch_planned;  // expert_fetch nodes a route step plans
    std::vector<std::pair<tensor*, tensor*>> also_reads;
    // side_stream: the nodes whose steps run on the side stream, and the main nodes before
    // whose step the main stream waits for it (the backend also joins at the end).
    std::unordered_set<const tensor*> side;
    std::unordered_set<const tensor*> join_before;
    // prefetch_behind_misses: the fetches that leave their wait to the prefetch after them, and
    // those prefetches (kernels::ExpertFetchParams::defer_wait / wait_for_layer).
    std::unordered_set<const tensor*> defers_wait;
    std::unordered_set<const tensor*> waits_for_layer;
    // shared_beside: the step after which the shared expert's gate/up of a moe_experts is
    // launched on the side stream (x's writer -> the moe_experts), and those moe_experts, whose
    // own step then launches the routed experts' gate/up and, joined, the down launch.
    std::unordered_map<const tensor*, const tensor*> shared_after;
    std::unordered_set<const tensor*> shared_beside;
    int n_norm = 0, n_residual = 0, n_route = 0, n_mla_prep = 0, n_norm_out = 0;
    int n_router_route = 0;  // of n_route
    int n_route_fetch = 0;   // of n_route
};

fusion_plan plan_fusions(const graph& g, const fusion_switches& on);

}  // namespace mgl::cuda
