// The CUDA backend's one switch over ops: for an allocated graph (every address resolved) and its
// fusion plan, the list of launches compute() enqueues, each with its kernel parameters built
// once. Addresses never change under an allocated graph, so the parameters hold for every
// compute; what a launch takes from the backend at run time (stream, workspaces) is in exec_env.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "elementwise.h"
#include "fusion.h"
#include "mgl.h"

namespace mgl::cuda {

struct exec_env {
    cudaStream_t stream = nullptr;
    cublasHandle_t cublas = nullptr;
    void* matmul_workspace = nullptr;  // only matmuls use it; zeroed once (split-K counters)
    size_t matmul_workspace_bytes = 0;
    void* scratch = nullptr;  // 256-byte aligned; MLA splits, MoE activations, staged inputs
    size_t scratch_bytes = 0;
    // Counters of the router_route steps (kernels::moe_router_route), one per step at the index
    // the step was given (launch_list::tickets); zeroed once, every launch leaves its own at 0.
    unsigned int* tickets = nullptr;
    device_error* error = nullptr;  // device address of the backend's error record
    bool pdl = false;               // programmatic dependent launch of the kernels that take it
    // The launches are being captured into a graph that the host will launch whole, with one
    // call (not run eagerly, one host call per launch).
    bool captured = false;
    // This launch follows an expert fetch's launch (launch_step::after_fetch).
    bool after_fetch = false;
    // The MoE decode activations of the shared_beside steps (launch_list::moe_act_bytes), the
    // same region on both streams.
    void* moe_act = nullptr;
    size_t moe_act_bytes = 0;
};

struct launch_step {
    std::string what;  // "matmul", "matmul+norm+add", "moe_route", ... (for messages and logs)
    const tensor* node = nullptr;
    std::function<void(const exec_env&)> run;
    // fusion_plan::side / join_before: runs on the side stream (whose exec_env has its own
    // scratch and matmul workspace, and no PDL), or waits for the side stream before it runs.
    bool side = false;
    bool join = false;
    // A joined step that still launches dependent (PDL): its kernels read and write nothing
    // before their wait, which covers every kernel they depend on, programmatic or not (in a
    // captured graph the side stream's last kernel may become a programmatic dependency too).
    bool join_keeps_pdl = false;
    // The previous launch on its stream is an expert fetch's plan and copy (the layer's own or a
    // prefetch; not a staged one, nor a copy planned by its routing launch, which lets the next
    // kernel in before its plan is done): a MoE launch then starts the experts that no fill of
    // the step wrote without waiting for it (kernels::MoeExpertsParams::fetch_state).
    bool after_fetch = false;
    // This launch is an expert fetch's plan and copy, both (kernels::expert_fetch): not a staged
    // fetch, nor the copy alone after a plan made by its routing launch.
    bool plans_and_copies = false;
};

// What the launches need from the backend besides the graph.
struct launch_context {
    // Device copy of a rope table's inv_freq (uploaded once per distinct table).
    std::function<const float*(const std::shared_ptr<const rope_params>&)> inv_freq;
};

struct launch_list {
    std::vector<launch_step> steps;
    size_t matmul_workspace_bytes = 0;  // the most any one launch needs
    size_t scratch_bytes = 0;
    // The side stream's steps run beside the main ones, so they get regions of their own after
    // the main ones (each a multiple of 256 bytes).
    size_t side_matmul_workspace_bytes = 0;
    size_t side_scratch_bytes = 0;
    // shared_beside's activations: after the side regions, written by a side step and read by
    // main ones, so in neither stream's scratch (each a multiple of 256 bytes).
    size_t moe_act_bytes = 0;
    bool has_side = false;
    size_t tickets = 0;  // router_route counters the steps use (exec_env::tickets)
};

// Why the CUDA backend cannot run `node` (dtype, layout or kernel limit), or empty when it can.
std::string cuda_unsupported_reason(const tensor& node);

launch_list build_launches(const graph& g, const fusion_plan& fusions, const launch_context& ctx);

}  // namespace mgl::cuda
