// mgl's CUDA backend: the same ops as the CPU backend, run on one CUDA device (ggml-like/cuda/).
//
// Tensors live in device memory (alloc_buffer) or in host memory registered with the device
// (register_host: kernels read it over PCIe); allocate() refuses a leaf the device cannot read,
// naming it. allocate() also decides which nodes run fused (cuda_fusions), builds every kernel's
// parameters once and sizes one workspace for the largest need. compute() enqueues the launches
// on the backend's stream and returns. A graph marked `reusable` runs eagerly on its first
// compute (a warm-up: lazy module loading, cuBLAS setup), is captured as a CUDA graph on the
// second and replayed afterwards, so a decode step costs one graph launch; it is captured again
// after allocate() or when the workspace had to grow. Everything a step changes (token,
// positions, page table, expert table) is a tensor the caller rewrites between replays.
//
// What it cannot run (supports_op says so, allocate() names the node and the reason): integer
// get_rows tables, strided norm weights, positions or page tables; moe_* with more than 1024
// experts, more than 32 per token, n_embd above 12288 or non-contiguous ids / weights; kv_store
// and mla_attn over non-contiguous pages, kv_lora_rank not a multiple of 8 in [8, 512] or a rope
// dim not a multiple of 8 in [8, 128].
//
// In a build without CUDA the functions below exist: cuda_available() is false and
// make_cuda_backend() throws mgl::error.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "mgl.h"

namespace mgl {

struct cuda_device_info {
    bool present = false;
    std::string name;
    int sm_count = 0;
    size_t free_bytes = 0;
    size_t total_bytes = 0;
};

// True when a CUDA device is present and usable.
bool cuda_available();
cuda_device_info cuda_info(int device = 0);

// Nodes the backend runs together, decided at allocate() from the graph's structure (see
// ggml-like/cuda/fusion.h). Each can be turned off to bisect a wrong result; the environment
// variable MINIDS_CUDA_FUSE turns them off too: "0" (none), or a comma list of those to keep.
struct cuda_fusions {
    bool norm = true;      // rms_norm -> matmul (M <= 16): the matmul's RMSNorm prologue
    bool residual = true;  // matmul -> add, moe_experts -> add: the residual epilogue
    bool route = true;     // softmax -> moe_topk -> moe_weights: one moe_route launch
    bool mla_prep = true;  // rms_norm(kv_cmpr) + rope(k_pe) + kv_store + rope(q_pe): mla_prep
    // With norm: an rms_norm read by matmuls and a decode-sized moe_experts (the FFN norm, read
    // by the router and the experts) is folded into all of them. Off: measured slower on the
    // H200 (V2-Lite tg128 377 against 414 tok/s): every one of the 2,464 gate/up blocks and
    // every router warp then redoes the norm, which costs more than the launch it saves.
    bool norm_moe = false;
    // With norm: an rms_norm of one row read by a matmul and by other nodes that all run after
    // it (the FFN norm at decode: the router, then the experts) is folded into that matmul,
    // whose first block also writes the normalized row for the others, so the norm needs no
    // launch of its own. Off: measured slower on the H200 (tg128 476.9 against 495.5 tok/s): the
    // router's 8 blocks wait for the one that writes the row.
    bool norm_out = false;
    // With route: the router matmul (at most 8 rows, BF16 weights, read only by the softmax) runs
    // inside the routing launch (kernels::moe_router_route): one kernel computes the logits and
    // its last block routes, with the norm folded into the matmul (norm or norm_out) done there
    // too. Off: measured no faster on the H200 (with norm_out 476.4 tok/s; docs/perf.md).
    bool router_route = false;
    // With route: the expert cache's device fetch of a MoE layer (expert_fetch reading the route's
    // ids) is planned by the routing launch itself, right after its top-k (moe_route, or
    // moe_router_route with router_route), so the fetch's own launch only copies: one dependent
    // link fewer per MoE layer. Exactly the same plan (one device function; GPU tests identical).
    // Off: every expert a hit gained only 0.7 % on the H200 (447.6 against 444.4 tok/s).
    bool route_fetch = false;
    // Not a fusion but a schedule: an expert cache's prefetch (mgl::expert_prefetch) and the
    // nodes only it reads (its routing prediction) run on a second stream beside the main one,
    // joined before the next node that reads what they wrote or touches the fetch state
    // (fusion.h). Off (the default): in node order on the one stream, where a prefetch made by the
    // copy engines overlaps through prefetch_behind_misses instead; measured faster on the H200
    // at every N (12 GiB, N = 2: 124.7 against 118.3 tok/s; docs/perf.md, twelfth session). On
    // pays only for prefetches copied by the fetch's copy kernel (MINIDS_FETCH_COPY=kernel).
    bool side_stream = false;
    // Without side_stream: a MoE layer's fetch followed in node order by a prefetch (before the
    // layer's experts) leaves its wait for the copies to that prefetch
    // (kernels::ExpertFetchParams::defer_wait). With the copy engines, the prefetch's requests
    // then queue on the link right behind the layer's misses, and its prediction and plan run
    // while those cross, instead of after they landed. Nothing changes without the proxy.
    bool prefetch_behind_misses = true;
    // A schedule: a decode-sized moe_experts with a shared expert runs the shared expert's
    // gate/up on a second stream, forked once x is written (the FFN norm), so it overlaps the
    // router, the routing and an expert cache's fetch; the routed experts' gate/up follows the
    // routing as before, and the down launch joins the two (kernels::moe_decode_part). Not with
    // side_stream, whose prefetches would queue the shared expert behind their waits. On: every
    // expert a hit at 12 GiB 474 -> 490 tok/s on the H200 (the plan and copy launches between
    // routing and experts now overlap the shared expert's 23 MB), resident decode the same
    // within noise (docs/perf.md, eighteenth session).
    bool shared_beside = true;
};

struct cuda_options {
    int device = 0;
    // Capture graphs marked reusable as CUDA graphs and replay them; false runs every node
    // eagerly (the independent path the replay is validated against). MINIDS_CUDA_GRAPHS=0
    // forces false.
    bool graphs = true;
    cuda_fusions fuse;
    // Programmatic dependent launch for the decode kernels that support it (GEMVs, RMSNorm, MLA
    // prep and attention, MoE experts): each may be scheduled while the previous kernel finishes
    // and waits for it on the device (kernels/dependent_launch.cuh). MINIDS_CUDA_PDL=0 forces
    // false.
    bool pdl = true;
};
std::unique_ptr<backend> make_cuda_backend(const cuda_options& options = {});

// Device-to-device copy bandwidth of device 0 in GB/s (bytes read + written, median of repeats
// over a 1 GiB buffer): the ceiling benchmarks report floors against. 0 without a device.
double cuda_copy_bandwidth_gbs();
// Pinned host-to-device copy bandwidth of device 0 in GB/s (median of repeats over 256 MiB):
// the ceiling of an expert cache's traffic over the host link. 0 without a device.
double cuda_host_to_device_bandwidth_gbs();

// Debugging aids, read from the environment when a backend is made:
//   MINIDS_CUDA_VERBOSE=1  one line per allocate() (launches, fusions, memory) and per capture;
//   MINIDS_CUDA_SYNC=1     no capture; synchronize after every launch and name the one that
//                          failed (a fault otherwise surfaces at the next synchronize()).

// What a CUDA backend decided for an allocated graph (tests and logs). Throws mgl::error when
// `be` is not a CUDA backend.
struct cuda_graph_info {
    bool known = false;  // allocated by this backend
    size_t nodes = 0;
    size_t launches = 0;  // steps compute() enqueues (a fused group is one)
    int fused_norm = 0, fused_residual = 0, fused_route = 0, fused_mla_prep = 0;
    int fused_norm_out = 0;       // of fused_norm: norms a matmul also writes (norm_out)
    int fused_router_route = 0;   // of fused_route: routes that run their router matmul too
    int fused_route_fetch = 0;    // of fused_route: routes that plan their layer's expert fetch
    bool captured = false;        // a CUDA graph is recorded for it
    uint64_t graph_launches = 0;  // computes served by launching the recorded CUDA graph
    uint64_t eager_runs = 0;      // computes run launch by launch
};
cuda_graph_info cuda_graph_info_of(backend& be, const graph& g);

}  // namespace mgl
