// The routing math shared by the router kernels: moe_route.cu's (moe_topk, moe_route) and
// moe_router_route.cu's fused router call these same functions, so their selections are one code,
// not copies. One warp routes one token.
//
// Two selections, identical in result (the CPU's order: higher probability first, then the lower
// id): for up to 256 experts (the DeepSeek shapes), route_rank_row computes each chosen expert's
// place directly, as the number of experts ranked before it, with independent compares and no
// round per chosen expert (decode latency: it runs once per MoE layer per token); larger shapes
// (or a k too large for its second stage, see rank_chunks) keep route_greedy_row, k greedy rounds
// of warp-wide arg-max.
#pragma once

#include <algorithm>
#include <string>

#include "moe_common.cuh"

namespace minids::kernels::route_detail {

using namespace moe_detail;

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
    uint32_t group_recip;  // ceil(2^20 / group size): e / group size == (e · group_recip) >> 20
    bool normalize;        // norm_topk_prob && k > 1
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

// How a routing row is read: plainly (moe_route: the row was written by an earlier kernel), or
// from L2 (the fused router: written by other blocks of the same kernel, which this SM's L1 does
// not see).
struct load_plain {
    __device__ float operator()(const float* p) const { return *p; }
};
struct load_l2 {
    __device__ float operator()(const float* p) const { return __ldcg(p); }
};

// One token's routing, greedy rounds: its row (logits with softmax, else probs) into p[0, E)
// (this warp's shared memory), then ids (and with softmax weights, probs_out) of token t.
template <class Load>
__device__ inline void route_greedy_row(float* p, const RouteArgs& a, bool softmax, int64_t t,
                                        Load load) {
    const int lane = threadIdx.x % 32;
    const int E = a.n_experts;
    const float* in = (softmax ? a.logits : a.probs) + t * a.in_stride;
    if (softmax) {
        // As the CPU softmax: max, exp(l - max) in f32, f64 sum, one f32 reciprocal.
        float mx = -INFINITY;
        for (int e = lane; e < E; e += 32) {
            p[e] = load(in + e);
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
        for (int e = lane; e < E; e += 32) p[e] = load(in + e);
    }
    __syncwarp();
    int32_t* ids = a.ids + t * a.k;
    select_topk(p, a, ids);
    if (softmax && a.weights) {
        __syncwarp();  // lane 0 wrote the ids
        if (lane == 0) token_weights(p, ids, a, a.weights + t * a.k);
    }
}

// ---- rank-based selection (n_experts <= 256) ----
//
// The greedy rounds pick, in order, the best expert not yet picked; the expert picked in round r
// is the one with exactly r alive experts ranked before it. So each expert's round is its rank,
// and the rank is a count of independent compares. Counting all E x E pairs costs E²/32 compares
// per lane, so the count runs in two stages over 64-bit keys (value, then id, packed so that one
// unsigned compare is the CPU's order):
//   A. each lane takes its best alive expert and ranks it among the 32 lane bests. The k-th best
//      lane best bounds the top k from below: k experts rank at or before it, so no expert ranked
//      after it is in the top k. The candidates, the alive experts at or before it, all belong
//      to the k lanes ranked below k: at most min(k, 32) x n_chunks of them, usually about k.
//   B. each candidate counts the candidates ranked before it: for a top-k expert every expert
//      before it is a candidate, so the count is its rank; any other candidate has the whole
//      top k before it and counts k or more.
// With one expert per lane (E <= 32) stage A is the whole ranking.

constexpr int rank_max_chunks = 8;  // experts per lane: E <= 256
constexpr int rank_max_slots = 64;  // stage B candidates: min(k, 32) x chunks

// The CPU's order as one unsigned compare: key(a) > key(b) iff a ranks before b. The high word
// maps the value's bits to an unsigned order (-0 as +0, so equal values tie exactly as with ==),
// the low word is ~id (lower id first among equal values). A NaN, which the CPU's compares cannot
// place, ranks after every number; 0 is "none" (not alive), after everything.
__device__ __forceinline__ uint64_t rank_key(float v, int id) {
    const uint32_t b = __float_as_uint(v) == 0x80000000u ? 0u : __float_as_uint(v);
    const uint32_t order = (b & 0x7fffffffu) > 0x7f800000u ? 0u  // NaN
                           : (b & 0x80000000u)             ? ~b
                                                           : (b | 0x80000000u);
    return (uint64_t(order) << 32) | uint32_t(~id);
}

__device__ __forceinline__ int key_id(uint64_t key) { return int(~uint32_t(key)); }

// How many of the keys row[0, n) rank before each of key[0, C); n even, row 16-byte aligned.
template <int C>
__device__ __forceinline__ void count_before(const uint64_t* row, int n, const uint64_t (&key)[C],
                                             int (&before)[C]) {
#pragma unroll
    for (int c = 0; c < C; ++c) before[c] = 0;
    for (int j = 0; j < n; j += 2) {
        const ulonglong2 q = *reinterpret_cast<const ulonglong2*>(row + j);
#pragma unroll
        for (int c = 0; c < C; ++c) before[c] += int(q.x > key[c]) + int(q.y > key[c]);
    }
}

template <int NB>
struct RankScratch {   // one warp's
    float p[32 * NB];  // the probabilities (group-limited routing: group scores)
    alignas(16) uint64_t lane_best[32];
    alignas(16) uint64_t slot[rank_max_slots];  // stage B candidates
    float slot_p[rank_max_slots];               // their probabilities
    float group_score[max_groups];
    float chosen_p[rank_max_slots];  // probability of the expert chosen j-th (k <= 64 here)
};

// One token's routing by ranks (E <= 256, rank_chunks(a) == NB): ids (and with softmax weights,
// probs_out) of token t; s is this warp's scratch.
template <int NB, class Load>
__device__ inline void route_rank_row(RankScratch<NB>& s, const RouteArgs& a, bool softmax,
                                      int64_t t, Load load) {
    const int lane = threadIdx.x % 32;
    const int E = a.n_experts;
    const float* in = (softmax ? a.logits : a.probs) + t * a.in_stride;

    // Lane l holds experts l + 32·b in registers; all loads are issued before the first use.
    float v[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) v[b] = lane + 32 * b < E ? load(in + lane + 32 * b) : 0.0f;
    if (softmax) {
        // route_greedy_row's softmax operation for operation (same max, same expf, the f64 sum in
        // the same order: this lane's experts ascending, then the same shuffle tree).
        float mx = -INFINITY;
#pragma unroll
        for (int b = 0; b < NB; ++b)
            if (lane + 32 * b < E) mx = fmaxf(mx, v[b]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(full_mask, mx, o));
        double sum = 0.0;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (lane + 32 * b < E) {
                v[b] = expf(v[b] - mx);
                sum += double(v[b]);
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(full_mask, sum, o);
        const float inv = float(1.0 / sum);
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (lane + 32 * b < E) {
                v[b] *= inv;
                if (a.probs_out) a.probs_out[t * E + lane + 32 * b] = v[b];
            }
        }
    }

    // Group-limited: lane g scores group g by its best expert as route_greedy_row does, and keeps
    // it if fewer than topk_group groups rank before it (higher score, then lower group id).
    uint32_t kept_groups = ~0u;
    if (a.group_limited) {
#pragma unroll
        for (int b = 0; b < NB; ++b)
            if (lane + 32 * b < E) s.p[lane + 32 * b] = v[b];
        __syncwarp();
        const int group_size = E / a.n_group;
        float score = -INFINITY;
        if (lane < a.n_group)
            for (int e = lane * group_size; e < (lane + 1) * group_size; ++e)
                score = fmaxf(score, s.p[e]);
        s.group_score[lane] = score;
        __syncwarp();
        int before = 0;
        for (int g = 0; g < a.n_group; ++g) {
            const float o = s.group_score[g];
            before += int(o > score) + int((o == score) & (g < lane));
        }
        kept_groups = __ballot_sync(full_mask, lane < a.n_group && before < a.topk_group);
    }

    uint64_t key[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const uint32_t e = lane + 32 * b;
        const bool alive = e < uint32_t(E) && (kept_groups >> ((e * a.group_recip) >> 20)) & 1u;
        key[b] = alive ? rank_key(v[b], int(e)) : 0;
    }

    int32_t* ids_out = a.ids + t * a.k;
    float* w_out = softmax && a.weights ? a.weights + t * a.k : nullptr;
    // The chosen expert of place `rank`: its id, and its weight when it needs no sum.
    auto choose = [&](int rank, uint64_t k, float p) {
        ids_out[rank] = key_id(k);
        if (w_out) {
            if (a.normalize)
                s.chosen_p[rank] = p;
            else
                w_out[rank] = p * a.routed_scaling_factor;
        }
    };

    // Stage A.
    uint64_t best = key[0];
    float best_p = v[0];
#pragma unroll
    for (int b = 1; b < NB; ++b) {
        if (key[b] > best) {
            best = key[b];
            best_p = v[b];
        }
    }
    s.lane_best[lane] = best;
    __syncwarp();
    int lane_rank[1];
    count_before(s.lane_best, 32, {best}, lane_rank);
    const bool chosen_lane = best != 0 && lane_rank[0] < a.k;
    if constexpr (NB == 1) {
        if (chosen_lane) choose(lane_rank[0], best, best_p);
    } else {
        // Stage B. The bound is the k-th best lane best when k lanes have alive experts (else
        // every alive expert is a candidate); the candidates are packed by ballots.
        const uint32_t last_lane = __ballot_sync(full_mask, chosen_lane && lane_rank[0] == a.k - 1);
        const uint64_t kth = __shfl_sync(full_mask, best, last_lane ? __ffs(last_lane) - 1 : 0);
        const uint64_t bound = last_lane ? kth : 1;
        const uint32_t lanes_below = (1u << lane) - 1;
        int n_cand = 0;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            const bool cand = key[b] >= bound;
            const uint32_t mask = __ballot_sync(full_mask, cand);
            if (cand) {
                const int at = n_cand + __popc(mask & lanes_below);
                s.slot[at] = key[b];
                s.slot_p[at] = v[b];
            }
            n_cand += __popc(mask);
        }
        if (lane == 0 && (n_cand & 1)) s.slot[n_cand] = 0;  // pairs of keys: pad the last
        __syncwarp();
        const int n_slots = (n_cand + 1) & ~1;
        const uint64_t k0 = lane < n_cand ? s.slot[lane] : 0;
        if (n_cand <= 32) {
            int rank[1];
            count_before(s.slot, n_slots, {k0}, rank);
            if (k0 != 0 && rank[0] < a.k) choose(rank[0], k0, s.slot_p[lane]);
        } else {
            const uint64_t k1 = lane + 32 < n_cand ? s.slot[lane + 32] : 0;
            int rank[2];
            count_before(s.slot, n_slots, {k0, k1}, rank);
            if (k0 != 0 && rank[0] < a.k) choose(rank[0], k0, s.slot_p[lane]);
            if (k1 != 0 && rank[1] < a.k) choose(rank[1], k1, s.slot_p[lane + 32]);
        }
    }

    // Normalized weights: the CPU's arithmetic (f64 sum in place order, then each division
    // rounded to f32); every lane sums, lane j divides place j.
    if (w_out && a.normalize) {
        __syncwarp();
        double sum = 0.0;
        for (int j = 0; j < a.k; ++j) sum += s.chosen_p[j];
#pragma unroll 1
        for (int j = lane; j < a.k; j += 32) w_out[j] = float(double(s.chosen_p[j]) / sum);
    }
}

inline RouteArgs make_args(const MoeRoutingParams& p, const char* who) {
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
    // (e · ceil(2^20 / d)) >> 20 == e / d for every e < 2^10 and d <= 2^10 (the error of the
    // fixed-point reciprocal stays below 1/d); 0 leaves every expert in group 0.
    a.group_recip =
        grouped ? uint32_t(((1u << 20) + uint32_t(E / r.n_group) - 1) / uint32_t(E / r.n_group))
                : 0u;
    a.normalize = r.norm_topk_prob && r.k > 1;
    a.routed_scaling_factor = r.routed_scaling_factor;
    return a;
}

// The expert fetch a routing launch plans (route_fetch): it must read exactly the ids this routing
// writes, for a table of the routing's experts; the rest as expert_fetch checks it.
inline void check_fetch_of_route(const ExpertFetchParams& f, const RouteArgs& a, const char* who) {
    if (!f.state || !f.table || f.ids != a.ids || f.n_ids != a.n_tokens * a.k || f.n_ids < 1 ||
        f.n_experts != a.n_experts || f.blob_bytes < 1 || f.layer < 0)
        moe_fail(std::string(who) +
                 ": the expert fetch must read this routing's ids (T·k of them) for a table of "
                 "its experts");
}

// route_rank_row<chunks> for E <= 256 while stage B's candidates fit (min(k, 32) x chunks
// <= rank_max_slots, so at most two per lane); 0: route_greedy_row.
inline int rank_chunks(const RouteArgs& a) {
    const int chunks = (a.n_experts + 31) / 32;
    if (chunks > rank_max_chunks || std::min(a.k, 32) * chunks > rank_max_slots) return 0;
    return chunks;
}

}  // namespace minids::kernels::route_detail
