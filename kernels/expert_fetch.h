// The expert cache's device fetch (mgl::expert_fetch, docs/expert-cache.md): before a MoE layer's
// experts run, the layer's selected experts that are not in a slot are copied from host memory
// (registered, read by the GPU over PCIe) into victim slots the host offered, and the tables are
// rewritten to match, all inside the step's CUDA graph: the host never waits on the routing.
//
// Two launches: a one-block plan (which expert goes to which victim, the table entries, the fill
// log; the rules are mgl.h's expert_fetch and ggml-like/cpu/ops_expert_fetch.cpp, the CPU
// reference) and a wide copy whose blocks each move one chunk of one planned fill. With the
// route_fetch fusion the routing kernel plans (moe.h: MoeRoutingParams::fetch, the same device
// code, expert_fetch_plan.cuh) and only the copy is launched here (expert_fetch_copy). State lives
// in device memory (mgl::expert_fetch_header and the arrays it points at); nothing here reads a
// device value on the host, so both launches can be captured once and replayed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mgl.h"

namespace minids::kernels {

struct ExpertFetchParams {
    mgl::expert_fetch_header* state = nullptr;  // device memory
    int64_t* table = nullptr;                   // this MoE layer's table [n_experts]
    const int32_t* ids = nullptr;               // [n_ids] (T · k)
    int64_t n_ids = 0;
    int32_t layer = 0;
    int32_t n_experts = 0;   // at most 1024
    int64_t blob_bytes = 0;  // equals state->blob_bytes; sizes the copy grid
    // The staging store (mgl::expert_fetch with a stage): pinned, mapped host memory. The plan
    // posts the layer's fills there (n and each fill's home), the host copies them into the
    // stage's buffers (a host node between the plan and the copy: expert_fetch_step in
    // ggml-like/cuda/launches.cpp), and the copy reads buffer i instead of the home. Null: the
    // copy reads the homes (registered host memory) itself.
    mgl::expert_stage_header* stage = nullptr;
    // A prefetch (mgl::expert_prefetch): `ids` are predictions; the victims it passes over also
    // hold the experts `protect` [n_protect] of MoE layer protect_layer (whose kernels may run
    // beside it); no arrival is taken again; the id log and the fetch's timer are left alone
    // (the copy included); fill-log keys carry mgl::expert_fetch_prefetched.
    bool prefetch = false;
    const int32_t* protect = nullptr;
    int64_t n_protect = 0;
    int32_t protect_layer = -1;
    // A prefetch: at most this many fills (0: every miss), the first misses in the order of `ids`.
    int32_t max_fills = 0;
    // Programmatic dependent launch (Hopper): the plan is scheduled while the routing kernel
    // runs, the copy while the plan runs, each waiting in griddepcontrol.wait for its
    // predecessor, so their launch gaps leave the step's path.
    bool pdl = false;
    // A prefetch (and with the header's proxy_demand any fetch) may post its fills to the host's
    // proxy (mgl::expert_fetch_header::proxy_ring) instead of copying them: only in a captured
    // graph, launched whole by one call. In an eager run the host is still queuing the step's
    // launches while the step would wait for the proxy, and a full launch queue blocks the host
    // in the driver, the proxy's calls behind it (seen on the H200: a fetch waited 2 s for a
    // request the proxy could not issue).
    bool proxy = false;
    // Prefetch issued behind the layer's misses (the CUDA backend's one-stream schedule, when a
    // prefetch follows the layer's fetch before the layer's experts): with the proxy, the layer's
    // fetch (defer_wait) posts its fills and returns, and the prefetch after it (wait_for_layer)
    // posts its own, then waits for the layer's. So the prefetch's copies queue on the link right
    // behind the misses instead of after they landed, and its prediction and plan run while the
    // misses cross. Without the proxy (an eager run, the copy kernel) both are ignored.
    bool defer_wait = false;
    bool wait_for_layer = false;
};

// Plans and copies; throws mgl::error on parameters out of range or with a stage (whose host
// copies must run between the two: expert_fetch_plan, then the host, then expert_fetch_copy).
// mgl::expert_prompt_stage (kernels/expert_prompt_stage.cu): a prompt chunk's misses copied into
// lent buffers and a table that points at them.
struct ExpertPromptStageParams {
    const mgl::expert_fetch_header* state = nullptr;  // device memory: the slots' range
    const int64_t* table = nullptr;                   // [n_experts]
    int64_t* out = nullptr;                           // [n_experts]
    const int32_t* ids = nullptr;                     // [n_ids] (T · k)
    int64_t n_ids = 0;
    int32_t n_experts = 0;             // at most 1024
    const int64_t* buffers = nullptr;  // [1 + capacity]: how many are lent, then their addresses
    int64_t capacity = 0, blob_bytes = 0;
    bool pdl = false;
};
void expert_prompt_stage(const ExpertPromptStageParams& p, cudaStream_t stream);

void expert_fetch(const ExpertFetchParams& p, cudaStream_t stream);
// The plan alone (the routing's fallback when it cannot plan in its own launch).
void expert_fetch_plan(const ExpertFetchParams& p, cudaStream_t stream);
// The copy alone, after a plan made by the routing kernel (or expert_fetch_plan). Its dependents
// (the expert kernels) are let in before it waits for the plan: they are scheduled early and
// still read nothing the fetch writes before the copy has completed. With a stage it reads the
// stage's buffers, which the host must have filled before it starts (launch it after the host's
// copies, not as a dependent of the plan: p.pdl = false).
void expert_fetch_copy(const ExpertFetchParams& p, cudaStream_t stream);

}  // namespace minids::kernels
