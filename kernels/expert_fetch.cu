// The expert cache's device fetch: plan (one block) and copy (one block per chunk of a fill).
// The plan is expert_fetch_plan.cuh's, shared with the routing kernels that run it themselves
// (the route_fetch fusion); it follows ggml-like/cpu/ops_expert_fetch.cpp exactly.
#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "expert_copy.cuh"
#include "expert_fetch.h"
#include "expert_fetch_plan.cuh"

namespace minids::kernels {
namespace {

using namespace fetch_detail;

constexpr int plan_threads = 256;
constexpr int copy_threads = expert_copy::threads;

__global__ void __launch_bounds__(plan_threads) fetch_plan_kernel(ExpertFetchParams p) {
    __shared__ PlanShared<plan_max_experts> s;
    // The copy kernel may be scheduled now: it waits for this grid to complete (and its
    // writes to be visible) before it reads anything. Launched dependent itself (on the routing
    // kernel, which wrote the ids), the plan waits for its predecessor before reading.
    pdl_launch_dependents();
    pdl_wait();
    plan_fetch(p, s, global_ns());  // the routing is done: from here the layer waits
}

// The prefetch's fills (this launch's plan logged them) as requests to the host's proxy: each
// request, then `posted`, made visible to the host in that order (the second fence: without
// delay, the next layer's fetch waits for these copies).
__device__ void post_prefetches(mgl::expert_fetch_header* h) {
    // Nothing to post (a layer whose experts are all in slots): no system fences either, which
    // cost the every-hit step ~2 % when every layer's fetch posted (tenth session).
    if (h->n_fills == h->layer_fills) return;
    auto* ring = reinterpret_cast<mgl::expert_prefetch_ring*>(h->proxy_ring);
    const auto* fill_log = reinterpret_cast<const int32_t*>(h->fill_log);
    int64_t posted = h->proxy_posted;
    for (int64_t f = h->layer_fills; f < h->n_fills; ++f, ++posted) {
        mgl::expert_prefetch_request& r = ring->requests[posted % ring->capacity];
        r.key = fill_log[2 * f] & ~mgl::expert_fetch_prefetched;
        r.slot = fill_log[2 * f + 1];
    }
    __threadfence_system();
    *reinterpret_cast<volatile int64_t*>(&ring->posted) = posted;
    __threadfence_system();
    h->proxy_posted = posted;
}

// Every thread of the block returns once the proxy has landed the requests up to `mark` (thread
// 0's: every one posted so far, or for a prefetch that waits for its layer's misses the layer's
// proxy_wait_mark; the host's copy stream writes `proxy_done` after each copy, in posting order),
// or after 2 s: then the proxy is gone, the error is flagged for the host (it fails the step) and
// the kernels go on with what they have.
__device__ void wait_for_prefetches(const mgl::expert_fetch_header* h, bool layer_mark = false) {
    if (threadIdx.x == 0) {
        const int64_t mark = *reinterpret_cast<const volatile int64_t*>(
            layer_mark ? &h->proxy_wait_mark : &h->proxy_posted);
        const auto* landed = reinterpret_cast<const volatile int64_t*>(&h->proxy_done);
        const int64_t give_up = global_ns() + 2'000'000'000;
        while (*landed < mark) {
            if (global_ns() > give_up) {
                const_cast<mgl::expert_fetch_header*>(h)->proxy_error = 1;
                break;
            }
            __nanosleep(200);
        }
    }
    __syncthreads();
}

// The layer's fetch ends with its last copy (its last copy block, or its wait for the proxy):
// the end of the interval the layer waited (expert_fetch_header::fetch_t1).
__device__ void stamp_fetch_end(const mgl::expert_fetch_header* h) {
    auto* t1 =
        reinterpret_cast<unsigned long long*>(&const_cast<mgl::expert_fetch_header*>(h)->fetch_t1);
    atomicMax(t1, static_cast<unsigned long long>(global_ns()));
}

// Block (b, j): chunks b, b + gridDim.x, ... of the layer's j-th fill, if the plan made one.
// EarlyDependents (the route_fetch path): the expert kernels after it are let in before this
// kernel's wait instead of after it, so they are scheduled and request their first weights
// (moe_decode.cu: the shared expert's, which no fetch writes) while the plan still runs; they
// still read nothing the fetch writes before this grid has completed. Safe: the trigger fires
// only once every copy block has started, so waiting expert blocks cannot keep one out.
// (Measured for a prefetch, which runs beside the compute kernels: blocks of 64 threads with 16
// loads in flight each, 4 to 16 per fill, left those kernels' blocks more room but slowed the
// copy more than they gained; docs/perf.md, eighth session.)
template <bool EarlyDependents>
__global__ void __launch_bounds__(copy_threads) fetch_copy_kernel(ExpertFetchParams p) {
    // Launched dependent on the plan (ExpertFetchParams::pdl): nothing is read before it is
    // done. A no-op in an ordinary launch.
    if constexpr (EarlyDependents) pdl_launch_dependents();
    pdl_wait();
    // The expert kernels after it may be scheduled now (they wait for this grid in turn).
    if constexpr (!EarlyDependents) pdl_launch_dependents();
    const mgl::expert_fetch_header* h = p.state;
    if (h->proxy_ring) {
        // The copy engines copy it: post the fills to the proxy. A layer's own fetch (with
        // proxy_demand) then waits in one block until they, and any prefetch before, landed;
        // or, deferring, leaves that wait to the prefetch after it, which waits once its own
        // fills are posted behind them (prefetch behind the misses: ExpertFetchParams).
        if (p.proxy && (p.prefetch || h->proxy_demand)) {
            if (blockIdx.x != 0 || blockIdx.y != 0) return;
            bool had_fills = false;  // thread 0's
            if (threadIdx.x == 0) {
                had_fills = h->n_fills > h->layer_fills;
                post_prefetches(p.state);
                if (!p.prefetch && p.defer_wait) {  // the prefetch after it waits instead
                    p.state->proxy_wait_mark = h->proxy_posted;
                    p.state->proxy_wait_fills = had_fills ? 1 : 0;
                }
            }
            // (The layer posted only with proxy_demand, and then left its wait to this prefetch.)
            const bool waits_for_layer = p.prefetch && p.wait_for_layer && h->proxy_demand;
            if ((p.prefetch && !waits_for_layer) || (!p.prefetch && p.defer_wait)) return;
            wait_for_prefetches(h, waits_for_layer);
            if (threadIdx.x == 0 && (waits_for_layer ? h->proxy_wait_fills != 0 : had_fills))
                stamp_fetch_end(h);
            return;
        }
        // A miss may take a slot that an earlier prefetch's copy is still writing, and this
        // layer's experts may be such copies: nothing is copied or read before they all landed.
        if (!p.prefetch) wait_for_prefetches(p.state);
    }
    const int64_t f = h->layer_fills + blockIdx.y;
    if (f >= h->n_fills) return;
    const auto* fill_log = reinterpret_cast<const int32_t*>(h->fill_log);
    const int32_t key = fill_log[2 * f] & ~mgl::expert_fetch_prefetched, slot = fill_log[2 * f + 1];
    // From the home (registered host memory), or with a stage from its buffer blockIdx.y, where
    // the host copied this fill's home (pinned host memory; the plan posted the fill there).
    const auto* src =
        p.stage ? reinterpret_cast<const uint8_t*>(p.stage) + p.stage->buffer_offset +
                      int64_t(blockIdx.y) * p.stage->stride
                : reinterpret_cast<const uint8_t*>(reinterpret_cast<const int64_t*>(h->homes)[key]);
    auto* dst = reinterpret_cast<uint8_t*>(h->slot_base + int64_t(slot) * h->slot_stride);
    expert_copy::copy_part(src, dst, h->blob_bytes, blockIdx.x, gridDim.x);
    __syncthreads();
    if (threadIdx.x == 0 && !p.prefetch) stamp_fetch_end(h);
}

void check_params(const ExpertFetchParams& p, int max_experts, const char* who) {
    if (!p.state || !p.table || !p.ids || p.n_ids < 1 || p.n_experts < 1 ||
        p.n_experts > max_experts || p.blob_bytes < 1 || p.layer < 0)
        ::mgl::fail(__FILE__, __LINE__, std::string(who) + ": parameters out of range");
}

template <bool EarlyDependents>
void launch_copy(const ExpertFetchParams& p, cudaStream_t stream) {
    const int64_t most_fills = p.n_ids < p.n_experts ? p.n_ids : p.n_experts;
    const int64_t chunks = (p.blob_bytes + expert_copy::chunk - 1) / expert_copy::chunk;
    const dim3 grid(
        unsigned(chunks < expert_copy::blocks_per_fill ? chunks : expert_copy::blocks_per_fill),
        unsigned(most_fills));
    launch_maybe_dependent(fetch_copy_kernel<EarlyDependents>, grid, dim3(copy_threads), 0, stream,
                           p.pdl, p);
}

}  // namespace

void expert_fetch(const ExpertFetchParams& p, cudaStream_t stream) {
    if (p.stage)
        ::mgl::fail(__FILE__, __LINE__,
                    "expert_fetch: a staged fetch needs the host between its plan and copy");
    expert_fetch_plan(p, stream);
    launch_copy<false>(p, stream);
}

void expert_fetch_plan(const ExpertFetchParams& p, cudaStream_t stream) {
    check_params(p, plan_max_experts, "expert_fetch");
    launch_maybe_dependent(fetch_plan_kernel, dim3(1), dim3(plan_threads), 0, stream, p.pdl, p);
}

void expert_fetch_copy(const ExpertFetchParams& p, cudaStream_t stream) {
    check_params(p, plan_max_experts, "expert_fetch_copy");
    launch_copy<true>(p, stream);
}

}  // namespace minids::kernels
