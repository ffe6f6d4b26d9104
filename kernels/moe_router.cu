// The fused router of a decode step (moe.h, MoeRouterParams): RMSNorm of x, the router GEMV and
// softmax / top-k / weights in one launch.
//
// Why one launch: at batch 1 each of the three unfused launches costs its launch and first-load
// latency, not its bytes (the router weight is 256 KB in BF16). Streaming those bytes still wants
// several SMs, so the launch is a grid: one warp per router row, 8 rows per block, every lane
// issuing its first weight loads before it waits for the norm statistics. Each block recomputes
// the norm of the T tokens (T · D floats, L2-resident) rather than waiting for another block.
// The blocks hand their logits to the last block to finish through global memory and a device
// counter; that block routes (the same route_row as moe_route) and zeroes the counter, so the
// launch replays inside a CUDA graph without the host.
//
// Bit-identical to the unfused path by construction: the norm statistics and the normed values
// come from rms_norm.cuh (what the rms_norm kernel runs, 256 threads), and each lane accumulates
// its logit over the chunks lane, lane + 32, ... with one fmaf per weight in chunk order, then a
// xor-shuffle warp sum: the order of the stream GEMV for bf16 (matmul_stream.cu, 16-byte
// chunks) and of the generic GEMV for f32 (matmul.cu, one element per chunk).
#include <climits>
#include <string>

#include "moe_route.cuh"
#include "rms_norm.cuh"

namespace minids::kernels {
namespace {

using namespace moe_detail;
using rms_detail::block_threads;

constexpr int router_warps = block_threads / 32;  // router rows per block
constexpr int router_unroll = 8;                  // weight loads in flight per lane
constexpr int max_tokens = int(moe_router_max_tokens);

struct RouterArgs {
    const float* x;
    int64_t x_stride;
    const void* norm_w;
    bool norm_w_bf16;
    float eps;
    float* x_norm;
    int64_t x_norm_stride;
    const uint8_t* w;
    int64_t w_row_stride;  // bytes
    int dim;
    float* logits;
    unsigned* counter;
    RouteArgs route;
};

// How a lane reads router weights: `n` elements per load, widened exactly to f32.
template <mgl::dtype W>
struct weight_load;

template <>
struct weight_load<mgl::dtype::bf16> {
    static constexpr int n = 8;
    using raw = uint4;
    __device__ static raw load(const uint8_t* row, int c) {
        return load_weights16(row + int64_t(c) * 16);
    }
    __device__ static void widen(const raw& v, float* f) {
        const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(u[i] << 16);
            f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
        }
    }
};

template <>
struct weight_load<mgl::dtype::f32> {
    static constexpr int n = 1;
    using raw = float;
    __device__ static raw load(const uint8_t* row, int c) {
        return __ldg(reinterpret_cast<const float*>(row) + c);
    }
    __device__ static void widen(const raw& v, float* f) { f[0] = v; }
};

// Loads of chunks c0 + 32·u + lane, u < router_unroll (zero past the row or for a missing row).
template <class L>
__device__ __forceinline__ void load_batch(typename L::raw (&dst)[router_unroll],
                                           const uint8_t* row, bool row_ok, int c0, int chunks,
                                           int lane) {
#pragma unroll
    for (int u = 0; u < router_unroll; ++u) {
        const int c = c0 + 32 * u + lane;
        dst[u] = (row_ok && c < chunks) ? L::load(row, c) : typename L::raw{};
    }
}

__device__ __forceinline__ float norm_weight(const RouterArgs& a, int64_t k) {
    if (!a.norm_w) return 1.0f;
    if (a.norm_w_bf16) {
        const unsigned short h = __ldg(static_cast<const unsigned short*>(a.norm_w) + k);
        return __uint_as_float(uint32_t(h) << 16);
    }
    return __ldg(static_cast<const float*>(a.norm_w) + k);
}

// x_norm[m, k] as the rms_norm kernel writes it.
__device__ __forceinline__ float x_hat(const RouterArgs& a, int m, int64_t k, float inv, float nw) {
    return rms_detail::rms_scaled(__ldg(a.x + m * a.x_stride + k), inv, nw);
}

// The last block: every block's logits are in global memory; one warp routes each token.
__device__ void route_tokens(const RouterArgs& a, float* rows) {
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const int E = a.route.n_experts;
    for (int m = warp; m < int(a.route.n_tokens); m += router_warps) {
        float* p = rows + m * E;
        // Through L2: other SMs wrote these during this launch.
        for (int e = lane; e < E; e += 32) p[e] = __ldcg(a.logits + m * E + e);
        route_row(p, a.route, m, true);
    }
}

template <mgl::dtype W>
__global__ void __launch_bounds__(block_threads) router_kernel(const RouterArgs a) {
    using L = weight_load<W>;
    extern __shared__ float rows[];  // [T, E]: the last block's logits, then probabilities
    __shared__ float partial[max_tokens][block_threads / 32];
    __shared__ bool last;
    const int warp = int(threadIdx.x) / 32, lane = int(threadIdx.x) % 32;
    const int T = int(a.route.n_tokens), E = a.route.n_experts;
    const int row = int(blockIdx.x) * router_warps + warp;
    const bool row_ok = row < E;
    const uint8_t* wr = a.w + int64_t(row_ok ? row : 0) * a.w_row_stride;
    const int chunks = a.dim / L::n;

    // The first weights are in flight while the norm statistics are summed.
    typename L::raw next[router_unroll];
    load_batch<L>(next, wr, row_ok, 0, chunks, lane);

    float inv[max_tokens];
#pragma unroll
    for (int m = 0; m < max_tokens; ++m) {
        if (m >= T) break;
        inv[m] = rms_detail::block_inv_rms(a.x + m * a.x_stride, a.dim, a.eps, partial[m]);
    }

    // This block's slice of x_norm (moe_experts reads it after this launch).
    const int64_t lo = int64_t(a.dim) * blockIdx.x / gridDim.x;
    const int64_t hi = int64_t(a.dim) * (blockIdx.x + 1) / gridDim.x;
#pragma unroll
    for (int m = 0; m < max_tokens; ++m) {
        if (m >= T) break;
        for (int64_t k = lo + threadIdx.x; k < hi; k += block_threads)
            a.x_norm[m * a.x_norm_stride + k] = x_hat(a, m, k, inv[m], norm_weight(a, k));
    }

    float acc[max_tokens];
#pragma unroll
    for (int m = 0; m < max_tokens; ++m) acc[m] = 0.0f;
    for (int c0 = 0; c0 < chunks; c0 += 32 * router_unroll) {
        typename L::raw cur[router_unroll];
#pragma unroll
        for (int u = 0; u < router_unroll; ++u) cur[u] = next[u];
        if (c0 + 32 * router_unroll < chunks)
            load_batch<L>(next, wr, row_ok, c0 + 32 * router_unroll, chunks, lane);
#pragma unroll
        for (int u = 0; u < router_unroll; ++u) {
            const int c = c0 + 32 * u + lane;
            if (c >= chunks) break;
            float wf[L::n], nw[L::n];
            L::widen(cur[u], wf);
#pragma unroll
            for (int e = 0; e < L::n; ++e) nw[e] = norm_weight(a, int64_t(c) * L::n + e);
#pragma unroll
            for (int m = 0; m < max_tokens; ++m) {
                if (m >= T) break;
#pragma unroll
                for (int e = 0; e < L::n; ++e)
                    acc[m] = fmaf(wf[e], x_hat(a, m, int64_t(c) * L::n + e, inv[m], nw[e]), acc[m]);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < max_tokens; ++m) {
        if (m >= T) break;
        const float s = warp_sum(acc[m]);
        if (lane == 0 && row_ok) a.logits[m * E + row] = s;
    }

    // Hand over: each thread's writes are made visible device-wide before the block is counted
    // (the CUDA programming guide's "last block" pattern); the block that counts last sees them
    // all after its own fence.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(a.counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    route_tokens(a, rows);
    if (threadIdx.x == 0) *a.counter = 0u;  // every block has counted: ready for the next launch
}

[[noreturn]] void router_fail(const std::string& what) { moe_fail("moe_router: " + what); }

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
    const auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
    return pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace

bool moe_router_weight_ok(mgl::dtype type, const void* w, int64_t row_stride_bytes,
                          int64_t n_embd) {
    const auto at = reinterpret_cast<uintptr_t>(w);
    if (!w || n_embd < 1 || n_embd > INT_MAX / 4) return false;
    if (type == mgl::dtype::bf16)
        return at % 16 == 0 && row_stride_bytes % 16 == 0 && n_embd % 8 == 0 &&
               row_stride_bytes >= 2 * n_embd;
    if (type == mgl::dtype::f32)
        return at % 4 == 0 && row_stride_bytes % 4 == 0 && row_stride_bytes >= 4 * n_embd;
    return false;
}

void moe_router(const MoeRouterParams& p, cudaStream_t stream) {
    const RouteArgs route = make_route_args(p.routing, "moe_router");
    const int64_t T = p.routing.n_tokens, E = p.routing.n_experts, D = p.n_embd;
    if (T < 1 || T > moe_router_max_tokens)
        router_fail("n_tokens = " + std::to_string(T) + " (supported: 1 to " +
                    std::to_string(moe_router_max_tokens) + ")");
    const int64_t w_row_stride =
        p.w_row_stride ? p.w_row_stride : D * int64_t(mgl::dtype_size(p.w_type));
    if (!moe_router_weight_ok(p.w_type, p.w, w_row_stride, D))
        router_fail(std::string("router weight ") + mgl::dtype_name(p.w_type) + " [" +
                    std::to_string(E) + ", " + std::to_string(D) + "] with row stride " +
                    std::to_string(w_row_stride) +
                    " bytes (supported: bf16 rows 16-byte aligned, D a multiple of 8; f32)");
    if (p.norm_w && p.norm_w_type != mgl::dtype::bf16 && p.norm_w_type != mgl::dtype::f32)
        router_fail(std::string("norm weight must be bf16 or f32, got ") +
                    mgl::dtype_name(p.norm_w_type));
    const int64_t xs = p.x_stride ? p.x_stride : D, ys = p.x_norm_stride ? p.x_norm_stride : D;
    if (xs < D || ys < D)
        router_fail("row strides of x and x_norm must be at least n_embd = " + std::to_string(D));
    if (!p.x || !p.x_norm || !p.logits || !p.counter || !p.routing.ids || !p.routing.weights)
        router_fail("x, x_norm, logits, counter, ids and weights are required");
    // Blocks write x_norm while others still read x.
    if (overlaps(p.x, size_t(((T - 1) * xs + D) * 4), p.x_norm, size_t(((T - 1) * ys + D) * 4)))
        router_fail("x_norm must not overlap x");

    RouterArgs a{};
    a.x = p.x;
    a.x_stride = xs;
    a.norm_w = p.norm_w;
    a.norm_w_bf16 = p.norm_w_type == mgl::dtype::bf16;
    a.eps = p.eps;
    a.x_norm = p.x_norm;
    a.x_norm_stride = ys;
    a.w = static_cast<const uint8_t*>(p.w);
    a.w_row_stride = w_row_stride;
    a.dim = int(D);
    a.logits = p.logits;
    a.counter = p.counter;
    a.route = route;
    const unsigned blocks = unsigned((E + router_warps - 1) / router_warps);
    const size_t smem = size_t(T * E) * sizeof(float);
    if (p.w_type == mgl::dtype::bf16) {
        router_kernel<mgl::dtype::bf16><<<blocks, block_threads, smem, stream>>>(a);
    } else {
        router_kernel<mgl::dtype::f32><<<blocks, block_threads, smem, stream>>>(a);
    }
    CUDA_CHECK_LAUNCH();
}

}  // namespace minids::kernels
