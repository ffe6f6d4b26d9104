// The router matmul and the routing in one launch (moe.h: moe_router_route), for decode.
//
// At batch 1 the router's GEMV (E x D BF16, 0.3 MB on V2-Lite) and moe_route (one block) each
// cost a launch, a dependent wait and their first loads' latency, more than their work. Here
// every block streams the weight rows of 8 experts (one row per warp, the whole row of D = 2048
// requested at once, before the PDL wait, as gemv_stream_kernel does), writes those experts'
// logits, and takes a ticket; the block that takes the last ticket routes every token from the
// logits with moe_route's own device code (moe_route.cuh), so the selection is the same code.
//
// The logits come from the stream GEMV's own per-warp pass (stream_gemv.cuh, one row per warp:
// gemv_stream_kernel's plan for the router's shapes): the same chunks per lane in the same
// order, the same fmaf chains, the RMSNorm's Σx² folded into the same pass, the same shuffle
// tree, the same 1 / rms. So the fused step reproduces the unfused one (matmul + moe_route) bit
// for bit, which the GPU tests check.
#include <cuda_bf16.h>

#include <string>

#include "dependent_launch.cuh"
#include "expert_fetch_plan.cuh"
#include "moe_route.cuh"
#include "stream_gemv.cuh"

namespace minids::kernels {
namespace {

using namespace route_detail;

constexpr int rr_warps = 8;   // experts per block (one weight row per warp); tokens routed at once
constexpr int rr_unroll = 8;  // 16-byte weight loads in flight per lane (a 4 KiB row per warp)

struct RouterArgs {
    const uint8_t* w;
    int64_t w_row_stride;  // bytes
    const float* x;
    int64_t x_row_stride;
    const void* norm_w;
    bool norm, norm_bf16;
    float eps;
    float* norm_out;  // with norm: the normalized rows, written by block 0
    int64_t norm_out_stride;
    float* logits;  // [m, n] contiguous
    unsigned int* ticket;
    int m, n, k;  // tokens, experts, D
    int chunks;   // 16-byte chunks per weight row
    RouteArgs route;
    ExpertFetchParams fetch;  // Fetch: the layer's expert fetch, planned by the routing block
};

// M: token rows the accumulators hold (1, or 8 for 2..8 tokens; the arithmetic is the same).
// NB: route_rank_row's experts per lane (rank_chunks), 0 for the greedy rounds.
// Fetch (route_fetch): the routing block then plans the layer's expert fetch.
template <int M, int NB, bool Fetch>
__global__ void __launch_bounds__(rr_warps * 32, 1) router_route_kernel(RouterArgs a) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * rr_warps + warp;  // this warp's expert
    // gemv_stream_kernel<false, 1, M>'s pass (stream_gemv.cuh): the same loads, fmaf chains,
    // folded RMSNorm and norm_out write, so the logits are the unfused router matmul's.
    float acc[1][M], inv[M];
    stream_detail::stream_rows<false, 1, M, rr_warps, rr_unroll>(a, a.w, a.x, row, acc, inv);
#pragma unroll
    for (int m = 0; m < M; ++m) {
        const float s = stream_detail::warp_sum(acc[0][m]);
        if (lane == 0 && row < a.n && m < a.m) a.logits[int64_t(m) * a.n + row] = s * inv[m];
    }

    // The last block routes. Memory ordering: the "threadfence reduction" of the CUDA C++
    // Programming Guide (Memory Fence Functions), as matmul_gemv.cu's split-K: every thread
    // fences after its logit stores, so they are visible device-wide before the barrier lets
    // thread 0 take the block's ticket (a relaxed atomicAdd); the block that draws gridDim.x - 1
    // knows every other block's ticket, hence every logit, came before its own, fences again
    // (acquire side), and reads the logits from L2 (__ldcg: other SMs wrote them; this SM's L1
    // may still hold lines of an earlier launch).
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    if constexpr (NB > 0) {
        __shared__ RankScratch<NB> scratch[rr_warps];
        for (int64_t t = warp; t < a.route.n_tokens; t += rr_warps)
            route_rank_row<NB>(scratch[warp], a.route, true, t, load_l2{});
    } else {
        __shared__ float p[rr_warps * moe_router_route_max_experts];
        for (int64_t t = warp; t < a.route.n_tokens; t += rr_warps)
            route_greedy_row(p + warp * moe_router_route_max_experts, a.route, true, t, load_l2{});
    }
    // Every block has taken its ticket: nothing reads the counter again in this launch, and the
    // next launch (a later kernel on the stream, or the next replay) sees 0.
    if (threadIdx.x == 0) *a.ticket = 0;
    if constexpr (Fetch) {
        // The ids are in this block's memory: plan here rather than in a launch of its own.
        __shared__ fetch_detail::PlanShared<fetch_detail::fused_plan_max_experts> plan;
        __syncthreads();  // every warp's ids written and visible to the block
        fetch_detail::plan_fetch(a.fetch, plan, fetch_detail::global_ns());
    }
}

using Kernel = void (*)(RouterArgs);

template <int M, bool Fetch>
Kernel kernel_for(int nb) {
    switch (nb) {
        case 1:
            return router_route_kernel<M, 1, Fetch>;
        case 2:
            return router_route_kernel<M, 2, Fetch>;
        case 3:
            return router_route_kernel<M, 3, Fetch>;
        case 4:
            return router_route_kernel<M, 4, Fetch>;
        case 5:
            return router_route_kernel<M, 5, Fetch>;
        case 6:
            return router_route_kernel<M, 6, Fetch>;
        case 7:
            return router_route_kernel<M, 7, Fetch>;
        case 8:
            return router_route_kernel<M, 8, Fetch>;
        default:
            return router_route_kernel<M, 0, Fetch>;
    }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

MoeRoutingParams routing_of(const MoeRouterRouteParams& p) {
    MoeRoutingParams r;
    r.logits = p.logits;
    r.in_stride = p.n_experts;
    r.probs_out = p.probs_out;
    r.ids = p.ids;
    r.weights = p.weights;
    r.n_tokens = p.n_tokens;
    r.n_experts = p.n_experts;
    r.route = p.route;
    return r;
}

}  // namespace

std::string moe_router_route_unsupported(const MoeRouterRouteParams& p) {
    const int64_t T = p.n_tokens, E = p.n_experts, D = p.n_embd;
    if (T < 0 || T > moe_router_route_max_tokens)
        return "n_tokens = " + std::to_string(T) + " (at most " +
               std::to_string(moe_router_route_max_tokens) + ")";
    if (E < 1 || E > moe_router_route_max_experts)
        return "n_experts = " + std::to_string(E) + " (1 to " +
               std::to_string(moe_router_route_max_experts) + ")";
    if (p.w_type != mgl::dtype::bf16)
        return std::string("router weights of dtype ") + mgl::dtype_name(p.w_type) + " (bf16 only)";
    if (D < 8 || D % 8 != 0 || D > (int64_t(1) << 30))
        return "n_embd = " + std::to_string(D) + " (a positive multiple of 8)";
    const int64_t w_stride = p.w_row_stride ? p.w_row_stride : 2 * D;
    if (w_stride < 2 * D || w_stride % 16 != 0 || !aligned16(p.w))
        return "router weight rows must be 16-byte aligned (row stride " +
               std::to_string(w_stride) + " bytes)";
    const int64_t x_stride = p.x_stride ? p.x_stride : D;
    if (!aligned16(p.x) || (T > 1 && (x_stride < D || x_stride % 4 != 0)))
        return "x rows must be 16-byte aligned (row stride " + std::to_string(x_stride) +
               " floats)";
    if (p.rms_norm && p.norm_w &&
        (!aligned16(p.norm_w) ||
         (p.norm_w_type != mgl::dtype::bf16 && p.norm_w_type != mgl::dtype::f32)))
        return "the norm weight must be bf16 or f32, 16-byte aligned";
    if (p.norm_out && (!p.rms_norm || (p.norm_out_stride && p.norm_out_stride < D)))
        return "norm_out needs rms_norm and a row stride of at least n_embd";
    try {
        (void)make_args(routing_of(p), "routing");
    } catch (const mgl::error& e) {
        return e.what();
    }
    return "";
}

void moe_router_route(const MoeRouterRouteParams& p, cudaStream_t stream) {
    if (const std::string why = moe_router_route_unsupported(p); !why.empty())
        moe_fail("moe_router_route: " + why);
    if (!p.x || !p.w || !p.logits || !p.ticket || !p.ids || !p.weights)
        moe_fail("moe_router_route: x, w, logits, ticket, ids and weights are required");
    RouterArgs a{};
    a.w = static_cast<const uint8_t*>(p.w);
    a.w_row_stride = p.w_row_stride ? p.w_row_stride : 2 * p.n_embd;
    a.x = p.x;
    a.x_row_stride = p.x_stride ? p.x_stride : p.n_embd;
    a.norm = p.rms_norm;
    a.norm_w = p.rms_norm ? p.norm_w : nullptr;
    a.norm_bf16 = p.norm_w_type == mgl::dtype::bf16;
    a.eps = p.norm_eps;
    a.norm_out = p.norm_out;
    a.norm_out_stride = p.norm_out_stride ? p.norm_out_stride : p.n_embd;
    a.logits = p.logits;
    a.ticket = p.ticket;
    a.m = int(p.n_tokens);
    a.n = int(p.n_experts);
    a.k = int(p.n_embd);
    a.chunks = int(p.n_embd * 2 / 16);
    a.route = make_args(routing_of(p), "routing");
    const bool fetch = p.fetch.state != nullptr;
    if (fetch) check_fetch_of_route(p.fetch, a.route, "moe_router_route");
    if (p.n_tokens == 0) return;
    a.fetch = p.fetch;
    const int nb = rank_chunks(a.route);
    const Kernel kernel = fetch ? (a.m == 1 ? kernel_for<1, true>(nb) : kernel_for<8, true>(nb))
                                : (a.m == 1 ? kernel_for<1, false>(nb) : kernel_for<8, false>(nb));
    const unsigned blocks = unsigned((a.n + rr_warps - 1) / rr_warps);
    launch_maybe_dependent(kernel, dim3(blocks), dim3(rr_warps * 32), 0, stream, p.pdl, a);
}

}  // namespace minids::kernels
