// Router: softmax, top-k (greedy / group-limited greedy) and routing weights. One warp per token;
// the routing math is in moe_route.cuh (shared with the fused router, moe_router_route.cu).
#include <algorithm>
#include <string>

#include "dependent_launch.cuh"
#include "expert_fetch_plan.cuh"
#include "moe_route.cuh"

namespace minids::kernels {
namespace {

using namespace route_detail;

constexpr int route_warps = 4;  // tokens per block

__global__ void __launch_bounds__(route_warps * 32) route_kernel(RouteArgs a, bool softmax) {
    pdl_enter();
    extern __shared__ float smem[];
    const int warp = threadIdx.x / 32;
    const int64_t t = int64_t(blockIdx.x) * route_warps + warp;
    if (t >= a.n_tokens) return;
    route_greedy_row(smem + warp * a.n_experts, a, softmax, t, load_plain{});
}

__global__ void weights_kernel(RouteArgs a) {
    const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= a.n_tokens) return;
    token_weights(a.probs + t * a.in_stride, a.ids + t * a.k, a, a.weights + t * a.k);
}

template <int NB>
__global__ void __launch_bounds__(route_warps * 32) route_rank_kernel(RouteArgs a, bool softmax) {
    pdl_enter();
    __shared__ RankScratch<NB> scratch[route_warps];
    const int warp = threadIdx.x / 32;
    const int64_t t = int64_t(blockIdx.x) * route_warps + warp;
    if (t >= a.n_tokens) return;
    route_rank_row<NB>(scratch[warp], a, softmax, t, load_plain{});
}

// route_rank_kernel for the tokens of one block, then the layer's expert fetch plan in the same
// block (route_fetch): the ids are in this block's memory once top-k is done, so the plan needs
// no launch of its own and no wait for the routing to drain.
template <int NB>
__global__ void __launch_bounds__(route_warps * 32)
    route_rank_fetch_kernel(RouteArgs a, ExpertFetchParams f) {
    pdl_enter();
    __shared__ RankScratch<NB> scratch[route_warps];
    __shared__ fetch_detail::PlanShared<fetch_detail::fused_plan_max_experts> plan;
    const int warp = threadIdx.x / 32;
    if (warp < a.n_tokens) route_rank_row<NB>(scratch[warp], a, true, warp, load_plain{});
    __syncthreads();  // the ids are written (and visible to the block): the plan reads them
    fetch_detail::plan_fetch(f, plan, fetch_detail::global_ns());  // the layer waits from here
}

// Whether moe_route can plan the fetch in its own launch: one block of rank selection.
bool plans_in_route(const RouteArgs& a) {
    return a.n_tokens <= route_warps && rank_chunks(a) > 0 &&
           a.n_experts <= fetch_detail::fused_plan_max_experts;
}

void launch_route_fetch(const RouteArgs& a, const ExpertFetchParams& f, bool pdl,
                        cudaStream_t stream) {
    using Kernel = void (*)(RouteArgs, ExpertFetchParams);
    static constexpr Kernel kernels[rank_max_chunks] = {
        route_rank_fetch_kernel<1>, route_rank_fetch_kernel<2>, route_rank_fetch_kernel<3>,
        route_rank_fetch_kernel<4>, route_rank_fetch_kernel<5>, route_rank_fetch_kernel<6>,
        route_rank_fetch_kernel<7>, route_rank_fetch_kernel<8>};
    launch_maybe_dependent(kernels[rank_chunks(a) - 1], dim3(1), dim3(route_warps * 32), 0, stream,
                           pdl, a, f);
}

void launch_route(const RouteArgs& a, bool softmax, bool pdl, cudaStream_t stream) {
    if (a.n_tokens == 0) return;
    using Kernel = void (*)(RouteArgs, bool);
    static constexpr Kernel rank_kernels[rank_max_chunks] = {
        route_rank_kernel<1>, route_rank_kernel<2>, route_rank_kernel<3>, route_rank_kernel<4>,
        route_rank_kernel<5>, route_rank_kernel<6>, route_rank_kernel<7>, route_rank_kernel<8>};
    const unsigned blocks = unsigned((a.n_tokens + route_warps - 1) / route_warps);
    if (const int chunks = rank_chunks(a)) {
        launch_maybe_dependent(rank_kernels[chunks - 1], dim3(blocks), dim3(route_warps * 32), 0,
                               stream, pdl, a, softmax);
    } else {
        const size_t smem = size_t(route_warps) * size_t(a.n_experts) * sizeof(float);
        launch_maybe_dependent(route_kernel, dim3(blocks), dim3(route_warps * 32), smem, stream,
                               pdl, a, softmax);
    }
}

}  // namespace

void moe_topk(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_args(p, "moe_topk");
    if (!p.probs || !p.ids) moe_fail("moe_topk: probs and ids are required");
    launch_route(a, false, p.pdl, stream);
}

void moe_weights(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_args(p, "moe_weights");
    if (!p.probs || !p.ids || !p.weights)
        moe_fail("moe_weights: probs, ids and weights are required");
    if (a.n_tokens == 0) return;
    weights_kernel<<<unsigned((a.n_tokens + 127) / 128), 128, 0, stream>>>(a);
    CUDA_CHECK_LAUNCH();
}

void moe_route(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_args(p, "moe_route");
    if (!p.logits || !p.ids || !p.weights)
        moe_fail("moe_route: logits, ids and weights are required");
    if (!p.fetch.state) {
        launch_route(a, true, p.pdl, stream);
        return;
    }
    check_fetch_of_route(p.fetch, a, "moe_route");
    if (plans_in_route(a)) {
        launch_route_fetch(a, p.fetch, p.pdl, stream);
    } else {
        launch_route(a, true, p.pdl, stream);
        ExpertFetchParams f = p.fetch;
        f.pdl = p.pdl;
        expert_fetch_plan(f, stream);
    }
}

}  // namespace minids::kernels
