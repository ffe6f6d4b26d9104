// Router: softmax, top-k (greedy / group-limited greedy) and routing weights. One warp per token;
// the token's probabilities live in shared memory while the warp selects.
#include <string>

#include "moe_common.cuh"

namespace minids::kernels {
namespace {

using namespace moe_detail;

constexpr int route_warps = 4;  // tokens per block
constexpr int max_experts = 1024;
constexpr int max_groups = 32;  // group-limited routing: one group per lane

struct RouteArgs {
    const float* logits;
    const float* probs;
    int64_t in_stride;
    float* probs_out;
    int32_t* ids;
    float* weights;
    int64_t n_tokens;
    int n_experts;
    int k;
    bool group_limited;
    int n_group;
    int topk_group;
    bool normalize;  // norm_topk_prob && k > 1
    float routed_scaling_factor;
};

// (value, id) ordered as the CPU ranks: higher value first, then the lower id; id < 0 is "none".
__device__ __forceinline__ bool ranks_before(float va, int ia, float vb, int ib) {
    return ia >= 0 && (ib < 0 || va > vb || (va == vb && ia < ib));
}

// The best (value, id) over the warp, known to every lane.
__device__ __forceinline__ void warp_best(float& v, int& id) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(full_mask, v, o);
        const int oi = __shfl_xor_sync(full_mask, id, o);
        if (ranks_before(ov, oi, v, id)) {
            v = ov;
            id = oi;
        }
    }
}

// Top-k of p[0, E) (shared memory, this warp's row) into ids_out[0, k). Lane l owns experts
// l, l + 32, ...; bit b of `alive` says whether expert l + 32·b is still a candidate.
__device__ void select_topk(const float* p, const RouteArgs& a, int32_t* ids_out) {
    const int lane = threadIdx.x % 32;
    const int E = a.n_experts;
    uint32_t alive = 0;
    for (int b = 0; lane + 32 * b < E; ++b) alive |= 1u << b;
    if (a.group_limited) {
        // Lane g scores group g by its best expert; keep the topk_group best groups.
        const int group_size = E / a.n_group;
        float score = -INFINITY;
        int gid = -1;
        if (lane < a.n_group) {
            gid = lane;
            for (int e = lane * group_size; e < (lane + 1) * group_size; ++e)
                score = fmaxf(score, p[e]);
        }
        uint32_t kept = 0;
        for (int r = 0; r < a.topk_group; ++r) {
            float v = score;
            int id = gid;
            warp_best(v, id);
            kept |= 1u << id;
            if (lane == id) gid = -1;  // taken
        }
        for (int b = 0; lane + 32 * b < E; ++b)
            if (!((kept >> ((lane + 32 * b) / group_size)) & 1u)) alive &= ~(1u << b);
    }
    for (int r = 0; r < a.k; ++r) {
        float v = 0.0f;
        int id = -1;
        for (uint32_t m = alive; m; m &= m - 1) {
            const int e = lane + 32 * (__ffs(m) - 1);
            if (ranks_before(p[e], e, v, id)) {
                v = p[e];
                id = e;
            }
        }
        warp_best(v, id);
        if (id >= 0 && id % 32 == lane) alive &= ~(1u << (id / 32));
        if (lane == 0) ids_out[r] = id;
    }
}

// Routing weights of one token from its probabilities (row p, any memory) and chosen ids: the
// CPU's arithmetic exactly (f32 values, f64 sum in j order, f64 division rounded to f32).
__device__ void token_weights(const float* p, const int32_t* ids, const RouteArgs& a, float* w) {
    double sum = 0.0;
    for (int j = 0; j < a.k; ++j) {
        const int id = ids[j];
        w[j] = (id >= 0 && id < a.n_experts) ? p[id] : 0.0f;
        sum += w[j];
    }
    for (int j = 0; j < a.k; ++j)
        w[j] = a.normalize ? float(double(w[j]) / sum) : w[j] * a.routed_scaling_factor;
}

__global__ void __launch_bounds__(route_warps * 32) route_kernel(RouteArgs a, bool softmax) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t t = int64_t(blockIdx.x) * route_warps + warp;
    if (t >= a.n_tokens) return;
    const int E = a.n_experts;
    float* p = smem + warp * E;
    const float* in = (softmax ? a.logits : a.probs) + t * a.in_stride;
    if (softmax) {
        // As the CPU softmax: max, exp(l - max) in f32, f64 sum, one f32 reciprocal.
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) {
            p[e] = in[e];
            mx = fmaxf(mx, p[e]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(full_mask, mx, o));
        double sum = 0.0;
        for (int e = lane; e < E; e += 32) {
            p[e] = expf(p[e] - mx);
            sum += double(p[e]);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(full_mask, sum, o);
        const float inv = float(1.0 / sum);
        for (int e = lane; e < E; e += 32) {
            p[e] *= inv;
            if (a.probs_out) a.probs_out[t * E + e] = p[e];
        }
    } else {
        for (int e = lane; e < E; e += 32) p[e] = in[e];
    }
    __syncwarp();
    int32_t* ids = a.ids + t * a.k;
    select_topk(p, a, ids);
    if (softmax && a.weights) {
        __syncwarp();  // lane 0 wrote the ids
        if (lane == 0) token_weights(p, ids, a, a.weights + t * a.k);
    }
}

__global__ void weights_kernel(RouteArgs a) {
    const int64_t t = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (t >= a.n_tokens) return;
    token_weights(a.probs + t * a.in_stride, a.ids + t * a.k, a, a.weights + t * a.k);
}

RouteArgs make_args(const MoeRoutingParams& p, const char* who) {
    const auto& r = p.route;
    const int64_t E = p.n_experts;
    const std::string name = who;
    if (p.n_tokens < 0 || E < 1 || E > max_experts)
        moe_fail(name + ": n_tokens = " + std::to_string(p.n_tokens) + ", n_experts = " +
                 std::to_string(E) + " (supported: n_tokens >= 0, 1 <= n_experts <= 1024)");
    if (r.k < 1 || r.k > E)
        moe_fail(name + ": k = " + std::to_string(r.k) + " for " + std::to_string(E) + " experts");
    const bool grouped = r.method == mgl::topk_method::group_limited_greedy;
    if (grouped &&
        !(r.n_group >= 1 && r.n_group <= max_groups && E % r.n_group == 0 && r.topk_group >= 1 &&
          r.topk_group <= r.n_group && r.k <= r.topk_group * (E / r.n_group)))
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

void launch_route(const RouteArgs& a, bool softmax, cudaStream_t stream) {
    if (a.n_tokens == 0) return;
    const size_t smem = size_t(route_warps) * size_t(a.n_experts) * sizeof(float);
    const unsigned blocks = unsigned((a.n_tokens + route_warps - 1) / route_warps);
    route_kernel<<<blocks, route_warps * 32, smem, stream>>>(a, softmax);
    CUDA_CHECK_LAUNCH();
}

}  // namespace

void moe_topk(const MoeRoutingParams& p, cudaStream_t stream) {
    const RouteArgs a = make_args(p, "moe_topk");
    if (!p.probs || !p.ids) moe_fail("moe_topk: probs and ids are required");
    launch_route(a, false, stream);
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
    launch_route(a, true, stream);
}

}  // namespace minids::kernels
