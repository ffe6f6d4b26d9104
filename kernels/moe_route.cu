// Router: softmax, top-k (greedy / group-limited greedy) and routing weights. One warp per token;
// the token's probabilities live in shared memory while the warp selects.
#include <string>

#include "moe_route.cuh"

namespace minids::kernels {
namespace {

using namespace moe_detail;

constexpr int route_warps = 4;  // tokens per block

__global__ void __launch_bounds__(route_warps * 32) route_kernel(RouteArgs a, bool softmax) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = int64_t(blockIdx.x) * route_warps + warp;
    if (t >= a.n_tokens) return;
    const int E = a.n_experts;
    float* p = smem + warp * E;
    const float* in = (softmax ? a.logits : a.probs) + t * a.in_stride;
    for (int e = lane; e < E; e += 32) p[e] = in[e];
    route_row(p, a, t, softmax);
}

__global__ void weights_kernel(RouteArgs a) {
    const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= a.n_tokens) return;
    token_weights(a.probs + t * a.in_stride, a.ids + t * a.k, a, a.weights + t * a.k);
}

}  // namespace

RouteArgs moe_detail::make_route_args(const MoeRoutingParams& p, const char* who) {
    const auto& r = p.route;
    const int64_t E = p.n_experts;
    const std::string name = who;
    if (p.n_tokens < 0 || E < 1 || E > route_max_experts)
        moe_fail(name + ": n_tokens = " + std::to_string(p.n_tokens) + ", n_experts = " +
                 std::to_string(E) + " (supported: n_tokens >= 0, 1 <= n_experts <= 1024)");
    if (r.k < 1 || r.k > E)
        moe_fail(name + ": k = " + std::to_string(r.k) + " for " + std::to_string(E) + " experts");
    const bool grouped = r.method == mgl::topk_method::group_limited_greedy;
    if (grouped &&
        !(r.n_group >= 1 && r.n_group <= route_max_groups && E % r.n_group == 0 &&
          r.topk_group >= 1 && r.topk_group <= r.n_group && r.k <= r.topk_group * (E / r.n_group)))
        moe_fail(name + ": " + std::to_string(E) + " experts cannot be split into " +
                 std::to_string(r.n_group) + " groups keeping " + std::to_string(r.topk_group) +
                 " for k = " + std::to_string(r.k) + " (at most 32 groups)");
    const int64_t stride = p.in_stride ? p.in_stride : E;
    if (stride < E)
        moe_fail(name + ": row stride " + std::to_string(stride) + " < n_experts " +
                 std::to_string(E));
    RouteArgs a{};
    a.logits = p.logits;
    a.probs = p.probs;
    a.in_stride = stride;
    a.probs_out = p.probs_out;
    a.ids = p.ids;
    a.weights = p.weights;
    a.n_tokens = p.n_tokens;
    a.n_experts = int(E);
    a.k = r.k;
    a.group_limited = grouped;
    a.n_group = r.n_group;
    a.topk_group = r.topk_group;
    a.normalize = r.norm_topk_prob && r.k > 1;
    a.routed_scaling_factor = r.routed_scaling_factor;
    return a;
}

namespace {

void launch_route(const RouteArgs& a, bool softmax, cudaStream_t stream) {
    if (a.n_tokens == 0) return;
    const size_t smem = size_t(route_warps) * size_t(a.n_experts) * sizeof(float);
    const unsigned blocks = unsigned((a.n_tokens + route_warps - 1) / route_warps);
    route_kernel<<<blocks, route_warps * 32, smem, stream>>>(a, softmax);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_topk(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_route_args(p, "moe_topk");
    if (!p.probs || !p.ids) moe_fail("moe_topk: probs and ids are required");
    launch_route(a, false, stream);
}

void moe_weights(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_route_args(p, "moe_weights");
    if (!p.probs || !p.ids || !p.weights)
        moe_fail("moe_weights: probs, ids and weights are required");
    if (a.n_tokens == 0) return;
    weights_kernel<<<unsigned((a.n_tokens + 127) / 128), 128, 0, stream>>>(a);
    CUDA_CHECK_LAUNCH();
}

void moe_route(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_route_args(p, "moe_route");
    if (!p.logits || !p.ids || !p.weights)
        moe_fail("moe_route: logits, ids and weights are required");
    launch_route(a, true, stream);
}

}  // namespace minids::kernels
