// Device pieces of MoE routing shared by moe_route.cu (softmax / top-k / weights) and
// moe_router.cu (the fused router of decode): the selection and weighting are written once, so
// both launches choose the same experts from the same probabilities.
#pragma once

#include "moe_common.cuh"

namespace minids::kernels::moe_detail {

constexpr int route_max_experts = 1024;
constexpr int route_max_groups = 32;  // group-limited routing: one group per lane

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
__device__ inline void select_topk(const float* p, const RouteArgs& a, int32_t* ids_out) {
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
__device__ inline void token_weights(const float* p, const int32_t* ids, const RouteArgs& a,
                                     float* w) {
    double sum = 0.0;
    for (int j = 0; j < a.k; ++j) {
        const int id = ids[j];
        w[j] = (id >= 0 && id < a.n_experts) ? p[id] : 0.0f;
        sum += w[j];
    }
    for (int j = 0; j < a.k; ++j)
        w[j] = a.normalize ? float(double(w[j]) / sum) : w[j] * a.routed_scaling_factor;
}

// One token's routing by one warp. p[0, E) is this warp's row in shared memory and holds the
// token's logits (softmax: replaced by the probabilities, also written to probs_out when set) or
// its probabilities; writes ids (and, from logits, weights) of token t.
__device__ inline void route_row(float* p, const RouteArgs& a, int64_t t, bool softmax) {
    const int lane = threadIdx.x % 32;
    const int E = a.n_experts;
    if (softmax) {
        // As the CPU softmax: max, exp(l - max) in f32, f64 sum, one f32 reciprocal.
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) mx = fmaxf(mx, p[e]);
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
    }
    __syncwarp();
    int32_t* ids = a.ids + t * a.k;
    select_topk(p, a, ids);
    if (softmax && a.weights) {
        __syncwarp();  // lane 0 wrote the ids
        if (lane == 0) token_weights(p, ids, a, a.weights + t * a.k);
    }
}

// The kernel arguments of routing parameters, checked (throws mgl::error naming `who`).
RouteArgs make_route_args(const MoeRoutingParams& p, const char* who);

}  // namespace minids::kernels::moe_detail
