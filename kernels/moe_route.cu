// Router: softmax, top-k (greedy / group-limited greedy) and routing weights. One warp per token;
// the routing math is in moe_route.cuh (shared with the fused router, moe_router_route.cu).
#include <algorithm>
#include <string>

#include "dependent_launch.cuh"
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
    launch_route(a, true, p.pdl, stream);
}

}  // namespace minids::kernels
