// Grouped MoE (prefill): (token, expert) pairs sorted by expert on the device, grouped GEMMs over
// the active experts, the shared expert as the same GEMMs over all tokens, a deterministic combine.
//
//   1. sort (one block): histogram of the ids, exclusive scans -> expert_offset[E + 1] (rows of
//      each expert in sorted order) and tile_offset[E + 1] (M tiles of each expert), then a
//      stable scatter: sorted_entry[position] = t · k + j, entry_pos[t · k + j] = position.
//   2. gate/up GEMM: one block per (M tile, N tile); grid sized for the worst case
//      Σ_e ceil(count_e / TM) <= ceil(T · k / TM) + E, blocks past the last tile exit at once.
//   3. down GEMM over the activation rows, y[position] = f32.
//   4. combine: out[t] = residual[t] + Σ_j w[t, j] · y[entry_pos[t, j]] (j order) + shared[t].
// The GEMMs run on tensor cores (moe_gemm.cuh, or with MoeGroupedKernel::pipelined
// moe_gemm_pipelined.cuh after x is rounded to BF16 once) or, for debugging and unaligned shapes,
// as simple FP32 SIMT kernels (one warp per output row, exact weights, f32 activations).
// Each launch is one MoeGroupedStage; grouped_experts runs them all in order.
#include <algorithm>
#include <string>

#include "moe_gemm_pipelined.cuh"

namespace minids::kernels::moe_detail {
namespace {

constexpr int sort_threads = 256;
constexpr int sort_warps = sort_threads / 32;
constexpr int max_sort_experts = 1024;
constexpr int gate_up_tile_n = 64;
constexpr int down_tile_n = 128;
constexpr int simple_warps = 8;

// ---- 1. sort ----

__global__ void __launch_bounds__(sort_threads)
    sort_kernel(const int32_t* ids, int64_t n_entries, int E, int tile_m, int32_t* sorted_entry,
                int32_t* entry_pos, int32_t* expert_offset, int32_t* tile_offset) {
    extern __shared__ int sort_smem[];
    int* count = sort_smem;     // [E]
    int* next = count + E;      // [E] next free position of each expert
    int* warp_base = next + E;  // [sort_warps][E]
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    for (int e = tid; e < E; e += sort_threads) count[e] = 0;
    for (int q = tid; q < sort_warps * E; q += sort_threads) warp_base[q] = 0;
    __syncthreads();
    for (int64_t i = tid; i < n_entries; i += sort_threads) {
        const int id = ids[i];
        if (id >= 0 && id < E) atomicAdd(&count[id], 1);
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive scans of the counts and of the tiles; lane l scans a contiguous run.
        const int per = (E + 31) / 32, lo = min(lane * per, E), hi = min(lo + per, E);
        int s = 0, ts = 0;
        for (int e = lo; e < hi; ++e) {
            s += count[e];
            ts += (count[e] + tile_m - 1) / tile_m;
        }
        int inc = s, tinc = ts;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int v = __shfl_up_sync(full_mask, inc, o);
            const int tv = __shfl_up_sync(full_mask, tinc, o);
            if (lane >= o) {
                inc += v;
                tinc += tv;
            }
        }
        int pos = inc - s, tpos = tinc - ts;
        for (int e = lo; e < hi; ++e) {
            expert_offset[e] = pos;
            tile_offset[e] = tpos;
            next[e] = pos;
            pos += count[e];
            tpos += (count[e] + tile_m - 1) / tile_m;
        }
        if (lane == 31) {
            expert_offset[E] = inc;
            tile_offset[E] = tinc;
        }
    }
    __syncthreads();
    // Stable scatter, sort_threads entries at a time: an entry's position is its expert's next
    // free position + the entries of that expert in earlier warps of this round + those in
    // earlier lanes of its own warp.
    for (int64_t round = 0; round < n_entries; round += sort_threads) {
        const int64_t i = round + tid;
        const int id = i < n_entries ? ids[i] : -1;
        const bool ok = id >= 0 && id < E;
        const unsigned peers = __match_any_sync(full_mask, ok ? id : -1);
        const int rank = __popc(peers & ((1u << lane) - 1u));
        if (ok && rank == 0) warp_base[warp * E + id] = __popc(peers);
        __syncthreads();
        for (int e = tid; e < E; e += sort_threads) {
            int run = next[e];
            for (int w = 0; w < sort_warps; ++w) {
                const int c = warp_base[w * E + e];
                warp_base[w * E + e] = run;
                run += c;
            }
            next[e] = run;
        }
        __syncthreads();
        if (ok) {
            const int pos = warp_base[warp * E + id] + rank;
            sorted_entry[pos] = int32_t(i);
            entry_pos[i] = pos;
        } else if (i < n_entries) {
            entry_pos[i] = -1;  // an id outside [0, E): contributes nothing
        }
        __syncthreads();
        for (int q = tid; q < sort_warps * E; q += sort_threads) warp_base[q] = 0;
        __syncthreads();
    }
}

// ---- 2, 3. simple FP32 GEMMs (reference path) ----

// Expert of sorted position p (largest e with expert_offset[e] <= p).
__device__ int expert_of_position(const int32_t* expert_offset, int E, int64_t p) {
    int lo = 0, hi = E;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (expert_offset[mid] <= p) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return lo;
}

// Block (position p, 8 rows); one warp per output row. gate_up: act[p, n] = silu(gate[n]·x)·
// (up[n]·x) with x the row of p's token; down: y[p, n] = down[n]·act[p] (f32 activations).
template <mgl::dtype BT, bool GATE_UP>
__global__ void __launch_bounds__(simple_warps * 32)
    simple_gemm_kernel(tc::GemmArgs g, float* act) {
    const int64_t p = blockIdx.x;
    const int64_t n = int64_t(blockIdx.y) * simple_warps + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    int e = 0;
    if (g.expert_offset) {
        if (p >= g.expert_offset[g.n_experts]) return;
        e = expert_of_position(g.expert_offset, g.n_experts, p);
    } else if (p >= g.n_rows) {
        return;
    }
    if (n >= g.N) return;
    const uintptr_t base = g.table ? uintptr_t(g.table[e]) : 0;
    const int64_t row_bytes = g.K * elem_bytes<BT>();
    auto scale = [&](int m) {
        return g.scale_off[m] >= 0
                   ? reinterpret_cast<const float*>(base + uintptr_t(g.scale_off[m]))[n]
                   : 1.0f;
    };
    const uint8_t* w0 =
        reinterpret_cast<const uint8_t*>(base + uintptr_t(g.off[0])) + n * row_bytes;
    if constexpr (GATE_UP) {
        const uint8_t* w1 =
            reinterpret_cast<const uint8_t*>(base + uintptr_t(g.off[1])) + n * row_bytes;
        const int64_t t = g.sorted_entry ? g.sorted_entry[p] / g.k : p;
        const float* x = g.x + t * g.x_stride;
        float ag = 0.0f, au = 0.0f;
        for (int64_t i = lane; i < g.K; i += 32) {
            ag = fmaf(load_weight<BT>(w0, i), x[i], ag);
            au = fmaf(load_weight<BT>(w1, i), x[i], au);
        }
        ag = warp_sum(ag);
        au = warp_sum(au);
        if (lane == 0) act[p * g.N + n] = silu_mul(ag * scale(0), au * scale(1));
    } else {
        const float* a = act + p * g.K;
        float acc = 0.0f;
        for (int64_t i = lane; i < g.K; i += 32) acc = fmaf(load_weight<BT>(w0, i), a[i], acc);
        acc = warp_sum(acc);
        if (lane == 0) g.y_out[p * g.y_stride + n] = acc * scale(0);
    }
}

// ---- x -> BF16 (pipelined kernel) ----

// x [T, D] f32 (row stride x_stride, rows 16-byte aligned, D a multiple of 16) -> BF16 [T, D]
// contiguous, rounded exactly as the staged kernel rounds it on its way into shared memory. One
// block per token.
__global__ void x_to_bf16_kernel(const float* x, int64_t x_stride, int64_t D, __nv_bfloat16* out) {
    const float* row = x + int64_t(blockIdx.x) * x_stride;
    __nv_bfloat16* dst = out + int64_t(blockIdx.x) * D;
    for (int64_t c = int64_t(threadIdx.x) * 4; c < D; c += int64_t(blockDim.x) * 4) {
        const float4 v = *reinterpret_cast<const float4*>(row + c);
        *reinterpret_cast<uint2*>(dst + c) =
            make_uint2(tc::pack_bf16(v.x, v.y), tc::pack_bf16(v.z, v.w));
    }
}

// ---- 4. combine ----

struct CombineArgs {
    const int32_t* entry_pos;
    const float* weights;
    int k;
    const float* y;         // [positions, D]
    const float* shared_y;  // [T, D] or null
    const float* residual;
    int64_t residual_stride;
    float* out;
    int64_t out_stride;
    int64_t D;
};

__global__ void combine_kernel(CombineArgs c) {
    __shared__ int32_t pos[32];
    __shared__ float w[32];
    const int64_t t = blockIdx.x;
    if (threadIdx.x < c.k) {
        pos[threadIdx.x] = c.entry_pos[t * c.k + threadIdx.x];
        w[threadIdx.x] = c.weights[t * c.k + threadIdx.x];
    }
    __syncthreads();
    for (int64_t d = threadIdx.x; d < c.D; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < c.k; ++j)
            if (pos[j] >= 0) acc = fmaf(w[j], c.y[int64_t(pos[j]) * c.D + d], acc);
        if (c.shared_y) acc += c.shared_y[t * c.D + d];
        const float res = c.residual ? c.residual[t * c.residual_stride + d] : 0.0f;
        c.out[t * c.out_stride + d] = res + acc;
    }
}

// ---- workspace ----

struct GroupedWorkspace {
    int32_t* sorted_entry;
    int32_t* entry_pos;
    int32_t* expert_offset;
    int32_t* tile_offset;
    void* act;              // [N, n_ff] bf16 (tensor cores) or f32
    float* y;               // [N, D]
    void* shared_act;       // [T, shared n_ff]
    float* shared_y;        // [T, D]
    __nv_bfloat16* x_bf16;  // [T, D], pipelined kernel only
    size_t bytes;
};

// Whether an MLP of weight type `type` runs the pipelined kernel (it takes FP8 and BF16 weights;
// f32 weights keep the staged kernel).
bool runs_pipelined(const MoeExpertsParams& p, mgl::dtype type) {
    return p.grouped.kernel == MoeGroupedKernel::pipelined && type != mgl::dtype::f32 &&
           moe_grouped_uses_tensor_cores(p);
}
bool needs_x_bf16(const MoeExpertsParams& p) {
    return runs_pipelined(p, p.layout.type) || (has_shared(p) && runs_pipelined(p, p.shared.type));
}

GroupedWorkspace plan_workspace(const MoeExpertsParams& p, uint8_t* base) {
    const int64_t N = p.n_tokens * p.k, T = p.n_tokens, D = p.layout.n_embd;
    size_t off = 0;
    auto take = [&](size_t bytes) {
        void* at = base ? base + off : nullptr;
        off += size_t(round_up(int64_t(bytes), 256));
        return at;
    };
    GroupedWorkspace w{};
    w.sorted_entry = static_cast<int32_t*>(take(size_t(N) * 4));
    w.entry_pos = static_cast<int32_t*>(take(size_t(N) * 4));
    w.expert_offset = static_cast<int32_t*>(take(size_t(p.n_experts + 1) * 4));
    w.tile_offset = static_cast<int32_t*>(take(size_t(p.n_experts + 1) * 4));
    w.act = take(size_t(N) * size_t(p.layout.n_ff) * 4);
    w.y = static_cast<float*>(take(size_t(N) * size_t(D) * 4));
    if (has_shared(p)) {
        w.shared_act = take(size_t(T) * size_t(p.shared.n_ff) * 4);
        w.shared_y = static_cast<float*>(take(size_t(T) * size_t(D) * 4));
    }
    if (needs_x_bf16(p)) w.x_bf16 = static_cast<__nv_bfloat16*>(take(size_t(T) * size_t(D) * 2));
    w.bytes = off;
    return w;
}

// The two GEMMs of one SwiGLU MLP (routed: grouped by the sort; shared: dense over the tokens).
struct MlpGemms {
    tc::GemmArgs gate_up;
    tc::GemmArgs down;
    mgl::dtype type;
    int64_t tiles;   // grid.x: M tiles (tensor cores) or positions (simple kernels)
    void* act;       // the activations between the two: bf16 (tensor cores) or f32 (simple)
    bool pipelined;  // moe_gemm_pipelined.cuh instead of moe_gemm.cuh
};

template <int TM, bool GATE_UP, mgl::dtype BT>
void launch_staged(const tc::GemmArgs& g, int64_t tiles, cudaStream_t stream) {
    constexpr int TN = GATE_UP ? gate_up_tile_n : down_tile_n;
    auto kernel = tc::gemm_kernel<TM, TN, GATE_UP, BT>;
    constexpr size_t smem = tc::smem_bytes<TM, TN, GATE_UP>();
    allow_dynamic_smem(kernel, smem);
    const dim3 grid(unsigned(tiles), unsigned((g.N + TN - 1) / TN));
    kernel<<<grid, tc::threads, smem, stream>>>(g);
    CUDA_CHECK_LAUNCH();
}

template <int TM, bool GATE_UP, mgl::dtype BT>
void launch_pipelined(const tc::GemmArgs& g, int64_t tiles, cudaStream_t stream) {
    using S = pipe::Shape<TM, GATE_UP, BT>;
    auto kernel = pipe::gemm_kernel<TM, GATE_UP, BT>;
    allow_dynamic_smem(kernel, S::smem);
    // Two blocks of up to 96 KiB per SM need the largest shared-memory carveout (a host-side
    // attribute like the one above, allowed while capturing).
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    int(cudaSharedmemCarveoutMaxShared)));
    const dim3 grid(unsigned(tiles), unsigned((g.N + S::TN - 1) / S::TN));
    kernel<<<grid, pipe::threads, S::smem, stream>>>(g);
    CUDA_CHECK_LAUNCH();
}

template <int TM, mgl::dtype BT>
void launch_tc(const MlpGemms& m, bool gate_up, cudaStream_t stream) {
    if constexpr (BT != mgl::dtype::f32) {
        if (m.pipelined) {
            if (gate_up) {
                launch_pipelined<TM, true, BT>(m.gate_up, m.tiles, stream);
            } else {
                launch_pipelined<TM, false, BT>(m.down, m.tiles, stream);
            }
            return;
        }
    }
    if (gate_up) {
        launch_staged<TM, true, BT>(m.gate_up, m.tiles, stream);
    } else {
        launch_staged<TM, false, BT>(m.down, m.tiles, stream);
    }
}

template <int TM>
void launch_tc_dtype(const MlpGemms& m, bool gate_up, cudaStream_t stream) {
    switch (m.type) {
        case mgl::dtype::f32:
            launch_tc<TM, mgl::dtype::f32>(m, gate_up, stream);
            break;
        case mgl::dtype::bf16:
            launch_tc<TM, mgl::dtype::bf16>(m, gate_up, stream);
            break;
        default:
            launch_tc<TM, mgl::dtype::f8_e4m3>(m, gate_up, stream);
            break;
    }
}

template <mgl::dtype BT>
void launch_simple(const MlpGemms& m, bool gate_up, cudaStream_t stream) {
    float* act = static_cast<float*>(m.act);
    const tc::GemmArgs& g = gate_up ? m.gate_up : m.down;
    const dim3 grid(unsigned(m.tiles), unsigned((g.N + simple_warps - 1) / simple_warps));
    if (gate_up) {
        simple_gemm_kernel<BT, true><<<grid, simple_warps * 32, 0, stream>>>(g, act);
    } else {
        simple_gemm_kernel<BT, false><<<grid, simple_warps * 32, 0, stream>>>(g, act);
    }
    CUDA_CHECK_LAUNCH();
}

// One of the two GEMMs of m (gate_up, else down).
void run_gemm(const MlpGemms& m, bool gate_up, bool tensor_cores, int tile_m, cudaStream_t stream) {
    if (m.tiles == 0) return;
    if (!tensor_cores) {
        switch (m.type) {
            case mgl::dtype::f32:
                launch_simple<mgl::dtype::f32>(m, gate_up, stream);
                break;
            case mgl::dtype::bf16:
                launch_simple<mgl::dtype::bf16>(m, gate_up, stream);
                break;
            default:
                launch_simple<mgl::dtype::f8_e4m3>(m, gate_up, stream);
                break;
        }
    } else if (tile_m == 32) {
        launch_tc_dtype<32>(m, gate_up, stream);
    } else if (tile_m == 64) {
        launch_tc_dtype<64>(m, gate_up, stream);
    } else {
        launch_tc_dtype<128>(m, gate_up, stream);
    }
}

// Every launch of one grouped call, with its arguments (built on the host from the parameters
// and the workspace; nothing here reads device memory).
struct GroupedPlan {
    GroupedWorkspace w;
    bool tensor_cores;
    int tile_m;
    int E;
    int64_t N, T, D, x_stride;
    MlpGemms routed;
    bool shared_on;
    MlpGemms shared;
    CombineArgs combine;
};

GroupedPlan plan_grouped(const MoeExpertsParams& p, void* ws, size_t ws_bytes) {
    const int tile_m = p.grouped.tile_m;
    if (tile_m != 32 && tile_m != 64 && tile_m != 128)
        moe_fail("moe_experts (grouped): tile_m " + std::to_string(tile_m) +
                 " (supported: 32, 64, 128)");
    if (p.n_experts > max_sort_experts)
        moe_fail("moe_experts (grouped): " + std::to_string(p.n_experts) +
                 " experts (at most 1024)");
    GroupedPlan plan{};
    const int64_t N = p.n_tokens * p.k, T = p.n_tokens, D = p.layout.n_embd;
    if (N > INT32_MAX / 2)
        moe_fail("moe_experts (grouped): " + std::to_string(N) + " (token, expert) pairs");
    plan.w = plan_workspace(p, static_cast<uint8_t*>(ws));
    const GroupedWorkspace& w = plan.w;
    if (ws_bytes < w.bytes || !ws)
        moe_fail("moe_experts (grouped): workspace of " + std::to_string(ws_bytes) +
                 " bytes, needs " + std::to_string(w.bytes));
    plan.tensor_cores = moe_grouped_uses_tensor_cores(p);
    plan.tile_m = tile_m;
    plan.E = int(p.n_experts);
    plan.N = N;
    plan.T = T;
    plan.D = D;
    plan.x_stride = p.x_stride ? p.x_stride : D;
    const bool tensor_cores = plan.tensor_cores;
    const int E = plan.E;
    const int64_t x_stride = plan.x_stride;

    const ExpertLayout& l = p.layout;
    const bool fp8 = l.type == mgl::dtype::f8_e4m3;
    MlpGemms& routed = plan.routed;
    routed.type = l.type;
    routed.act = w.act;
    routed.tiles = std::min<int64_t>((N + tile_m - 1) / tile_m + E, N);
    routed.pipelined = runs_pipelined(p, l.type);
    tc::GemmArgs& gu = routed.gate_up;
    gu.tile_offset = w.tile_offset;
    gu.expert_offset = w.expert_offset;
    gu.n_experts = E;
    gu.sorted_entry = w.sorted_entry;
    gu.k = p.k;
    gu.x = p.x;
    gu.x_stride = x_stride;
    gu.a = w.x_bf16;  // the pipelined kernel's A; null (unused) otherwise
    gu.a_stride = D;
    gu.table = p.expert_table;
    gu.off[0] = l.gate_offset;
    gu.off[1] = l.up_offset;
    gu.scale_off[0] = fp8 ? l.gate_scale_offset : -1;
    gu.scale_off[1] = fp8 ? l.up_scale_offset : -1;
    gu.N = l.n_ff;
    gu.K = D;
    gu.act_out = static_cast<__nv_bfloat16*>(w.act);
    gu.act_stride = l.n_ff;
    tc::GemmArgs& dn = routed.down;
    dn = gu;
    dn.sorted_entry = nullptr;
    dn.a = static_cast<const __nv_bfloat16*>(w.act);
    dn.a_stride = l.n_ff;
    dn.off[0] = l.down_offset;
    dn.off[1] = 0;
    dn.scale_off[0] = fp8 ? l.down_scale_offset : -1;
    dn.scale_off[1] = -1;
    dn.N = D;
    dn.K = l.n_ff;
    dn.act_out = nullptr;
    dn.y_out = w.y;
    dn.y_stride = D;
    if (!tensor_cores) routed.tiles = N;  // simple kernels: one block column per position

    plan.shared_on = has_shared(p);
    if (plan.shared_on) {
        const SharedExpertWeights& s = p.shared;
        MlpGemms& shared = plan.shared;
        shared.type = s.type;
        shared.act = w.shared_act;
        shared.tiles = tensor_cores ? (T + tile_m - 1) / tile_m : T;
        shared.pipelined = runs_pipelined(p, s.type);
        tc::GemmArgs& sg = shared.gate_up;
        sg.n_rows = T;
        sg.k = p.k;
        sg.x = p.x;
        sg.x_stride = x_stride;
        sg.a = w.x_bf16;
        sg.a_stride = D;
        sg.off[0] = int64_t(reinterpret_cast<uintptr_t>(s.gate));
        sg.off[1] = int64_t(reinterpret_cast<uintptr_t>(s.up));
        sg.scale_off[0] = sg.scale_off[1] = -1;
        sg.N = s.n_ff;
        sg.K = D;
        sg.act_out = static_cast<__nv_bfloat16*>(w.shared_act);
        sg.act_stride = s.n_ff;
        tc::GemmArgs& sd = shared.down;
        sd = sg;
        sd.a = static_cast<const __nv_bfloat16*>(w.shared_act);
        sd.a_stride = s.n_ff;
        sd.off[0] = int64_t(reinterpret_cast<uintptr_t>(s.down));
        sd.off[1] = 0;
        sd.N = D;
        sd.K = s.n_ff;
        sd.act_out = nullptr;
        sd.y_out = w.shared_y;
        sd.y_stride = D;
    }

    CombineArgs& c = plan.combine;
    c.entry_pos = w.entry_pos;
    c.weights = p.weights;
    c.k = p.k;
    c.y = w.y;
    c.shared_y = plan.shared_on ? w.shared_y : nullptr;
    c.residual = p.residual;
    c.residual_stride = p.residual_stride ? p.residual_stride : D;
    c.out = p.out;
    c.out_stride = p.out_stride ? p.out_stride : D;
    c.D = D;
    return plan;
}

void run_stage(const GroupedPlan& plan, const MoeExpertsParams& p, MoeGroupedStage stage,
               cudaStream_t stream) {
    if (plan.T == 0) return;
    const GroupedWorkspace& w = plan.w;
    switch (stage) {
        case MoeGroupedStage::sort: {
            const size_t sort_smem = size_t(2 + sort_warps) * size_t(plan.E) * sizeof(int);
            sort_kernel<<<1, sort_threads, sort_smem, stream>>>(p.ids, plan.N, plan.E, plan.tile_m,
                                                                w.sorted_entry, w.entry_pos,
                                                                w.expert_offset, w.tile_offset);
            CUDA_CHECK_LAUNCH();
            break;
        }
        case MoeGroupedStage::x_to_bf16:
            if (w.x_bf16) {
                x_to_bf16_kernel<<<unsigned(plan.T), 256, 0, stream>>>(p.x, plan.x_stride, plan.D,
                                                                       w.x_bf16);
                CUDA_CHECK_LAUNCH();
            }
            break;
        case MoeGroupedStage::gate_up:
            run_gemm(plan.routed, true, plan.tensor_cores, plan.tile_m, stream);
            break;
        case MoeGroupedStage::down:
            run_gemm(plan.routed, false, plan.tensor_cores, plan.tile_m, stream);
            break;
        case MoeGroupedStage::shared_gate_up:
            if (plan.shared_on) run_gemm(plan.shared, true, plan.tensor_cores, plan.tile_m, stream);
            break;
        case MoeGroupedStage::shared_down:
            if (plan.shared_on)
                run_gemm(plan.shared, false, plan.tensor_cores, plan.tile_m, stream);
            break;
        case MoeGroupedStage::combine:
            combine_kernel<<<unsigned(plan.T), 256, 0, stream>>>(plan.combine);
            CUDA_CHECK_LAUNCH();
            break;
    }
}

}  // namespace

bool grouped_tensor_cores_supported(const MoeExpertsParams& p) {
    const int64_t x_stride = p.x_stride ? p.x_stride : p.layout.n_embd;
    return weights_vec_aligned(p) && p.layout.n_embd % 16 == 0 && p.layout.n_ff % 16 == 0 &&
           (!has_shared(p) || p.shared.n_ff % 16 == 0) && x_stride % 4 == 0 &&
           reinterpret_cast<uintptr_t>(p.x) % 16 == 0;
}

size_t grouped_workspace_bytes(const MoeExpertsParams& p) {
    return plan_workspace(p, nullptr).bytes;
}

void grouped_experts(const MoeExpertsParams& p, void* ws, size_t ws_bytes, cudaStream_t stream) {
    const GroupedPlan plan = plan_grouped(p, ws, ws_bytes);
    for (MoeGroupedStage s :
         {MoeGroupedStage::sort, MoeGroupedStage::x_to_bf16, MoeGroupedStage::gate_up,
          MoeGroupedStage::down, MoeGroupedStage::shared_gate_up, MoeGroupedStage::shared_down,
          MoeGroupedStage::combine})
        run_stage(plan, p, s, stream);
}

void grouped_stage(const MoeExpertsParams& p, MoeGroupedStage stage, void* ws, size_t ws_bytes,
                   cudaStream_t stream) {
    run_stage(plan_grouped(p, ws, ws_bytes), p, stage, stream);
}

}  // namespace minids::kernels::moe_detail
