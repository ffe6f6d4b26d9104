// Grouped expert GEMMs on tensor cores for the MoE prefill path (moe_grouped.cu).
//
// C[p, n] = Σ_k A[p, k] · B_e[n, k] over the rows p of one M tile, all of which belong to one
// expert e (grouped: tiles come from the device-side sort) or to the one dense matrix (the shared
// expert). Block tile TM × TN × 64, 8 warps as 2 (M) × 4 (N), mma.sync m16n8k16 BF16 with FP32
// accumulation; A and B are converted to BF16 on their way into shared memory (x from f32, FP8
// weights widened exactly, f32 weights rounded), the next K tile is loaded into registers while
// the current one is multiplied (two shared-memory buffers, one barrier per K tile).
//   gate_up (NB = 2): A = x rows of the tile's tokens, B = gate and up; epilogue
//                     act = silu(g · s_g) · (u · s_u) stored as BF16 rows by sorted position.
//   down    (NB = 1): A = those BF16 activation rows, B = down; epilogue y = acc · s_d, f32.
#pragma once

#include <type_traits>

#include "moe_common.cuh"

namespace minids::kernels::moe_detail::tc {

constexpr int threads = 256;
constexpr int tile_k = 64;
constexpr int lds = tile_k + 8;  // bf16 per shared row: +16 bytes keeps ldmatrix conflict-free

struct GemmArgs {
    // Rows: grouped when tile_offset is set (tile -> expert, positions from the sort), else dense
    // (rows 0 .. n_rows, expert 0).
    const int32_t* tile_offset;    // [E + 1]
    const int32_t* expert_offset;  // [E + 1]
    int n_experts;
    int64_t n_rows;
    const int32_t* sorted_entry;  // gate_up, grouped: position -> entry t · k + j
    int k;
    const float* x;  // gate_up A: [T, K] rows, stride x_stride
    int64_t x_stride;
    const __nv_bfloat16* a;  // down A: [positions, K] rows, stride a_stride
    int64_t a_stride;
    // Matrix m of expert e is at (table ? table[e] : 0) + off[m] (dense: off holds the address);
    // its row scale at the same base + scale_off[m] (none when < 0).
    const int64_t* table;
    int64_t off[2];
    int64_t scale_off[2];
    int64_t N, K;
    __nv_bfloat16* act_out;  // gate_up output [positions, N]
    int64_t act_stride;
    float* y_out;  // down output [positions, N]
    int64_t y_stride;
};

// The tile this block multiplies: rows [m0, m_end) of expert e; false when the block has none.
__device__ __forceinline__ bool find_tile(const GemmArgs& g, int tile_m, int64_t tile, int& e,
                                          int64_t& m0, int64_t& m_end) {
    if (!g.tile_offset) {
        e = 0;
        m0 = tile * tile_m;
        m_end = g.n_rows;
        return m0 < m_end;
    }
    if (tile >= g.tile_offset[g.n_experts]) return false;
    int lo = 0, hi = g.n_experts;  // tile_offset[lo] <= tile < tile_offset[hi]
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (g.tile_offset[mid] <= tile) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    e = lo;
    m0 = g.expert_offset[e] + (tile - g.tile_offset[e]) * tile_m;
    m_end = g.expert_offset[e + 1];
    return true;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// One pair of output columns (n, n + 1) of sorted row p, as both grouped GEMM kernels write it
// (the same code, so they give the same bits): gate/up -> silu(gate · s_g) · (up · s_u) as two
// BF16 activations; down -> y = acc · s in f32. c0, c1 are the first matrix's accumulators (gate,
// or down), u0, u1 the second's (up; unused for down).
template <bool GATE_UP>
__device__ __forceinline__ void store_pair(const GemmArgs& g, const float* const* bscale, int64_t p,
                                           int64_t n, float c0, float c1, float u0, float u1) {
    if constexpr (GATE_UP) {
        const float sg0 = bscale[0] ? bscale[0][n] : 1.0f;
        const float sg1 = bscale[0] ? bscale[0][n + 1] : 1.0f;
        const float su0 = bscale[1] ? bscale[1][n] : 1.0f;
        const float su1 = bscale[1] ? bscale[1][n + 1] : 1.0f;
        const float a0 = silu_mul(c0 * sg0, u0 * su0);
        const float a1 = silu_mul(c1 * sg1, u1 * su1);
        *reinterpret_cast<uint32_t*>(g.act_out + p * g.act_stride + n) = pack_bf16(a0, a1);
    } else {
        const float s0 = bscale[0] ? bscale[0][n] : 1.0f;
        const float s1 = bscale[0] ? bscale[0][n + 1] : 1.0f;
        *reinterpret_cast<float2*>(g.y_out + p * g.y_stride + n) = make_float2(c0 * s0, c1 * s1);
    }
}

// e4m3 pair -> bf16 pair, exactly (every e4m3 value is a bf16 value).
__device__ __forceinline__ uint32_t fp8x2_to_bf16x2(uint32_t two) {
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two), __NV_E4M3);
    const float2 f = __half22float2(__half2(h));
    return pack_bf16(f.x, f.y);
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
    const uint32_t addr = uint32_t(__cvta_generic_to_shared(p));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int TM, int TN, bool GATE_UP>
constexpr size_t smem_bytes() {
    return size_t(2) * size_t(TM + (GATE_UP ? 2 : 1) * TN) * lds * sizeof(__nv_bfloat16);
}

template <int TM, int TN, bool GATE_UP, mgl::dtype BT>
__global__ void __launch_bounds__(threads) gemm_kernel(GemmArgs g) {
    constexpr int NB = GATE_UP ? 2 : 1;
    constexpr int MI = TM / 32;  // m16 tiles per warp (warp covers TM / 2 rows)
    constexpr int NI = TN / 32;  // n8 tiles per warp (warp covers TN / 4 columns)
    constexpr int eb = elem_bytes<BT>();
    constexpr int b_epc = 16 / eb;         // B elements per 16-byte chunk
    constexpr int b_cpr = tile_k / b_epc;  // B chunks per tile row
    constexpr int b_iters = TN * b_cpr / threads;
    constexpr int a_epc = GATE_UP ? 4 : 8;  // f32 x: float4; bf16 act: 8 per uint4
    constexpr int a_cpr = tile_k / a_epc;
    constexpr int a_iters = TM * a_cpr / threads;
    static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && a_iters >= 1 && b_iters >= 1);

    extern __shared__ uint4 smem_raw[];
    __nv_bfloat16* smem = reinterpret_cast<__nv_bfloat16*>(smem_raw);
    constexpr int stage_elems = (TM + NB * TN) * lds;
    __shared__ int64_t row_src[TM];

    int e;
    int64_t m0, m_end;
    if (!find_tile(g, TM, blockIdx.x, e, m0, m_end)) return;
    const int64_t n0 = int64_t(blockIdx.y) * TN;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / 4, warp_n = warp % 4;

    const uintptr_t base = g.table ? uintptr_t(g.table[e]) : 0;
    const uint8_t* bmat[NB];
    const float* bscale[NB];
#pragma unroll
    for (int m = 0; m < NB; ++m) {
        bmat[m] = reinterpret_cast<const uint8_t*>(base + uintptr_t(g.off[m]));
        bscale[m] = g.scale_off[m] >= 0
                        ? reinterpret_cast<const float*>(base + uintptr_t(g.scale_off[m]))
                        : nullptr;
    }
    for (int r = tid; r < TM; r += threads) {
        const int64_t p = m0 + r;
        int64_t src = -1;
        if (p < m_end) src = (GATE_UP && g.sorted_entry) ? g.sorted_entry[p] / g.k : p;
        row_src[r] = src;
    }
    __syncthreads();

    using AReg = std::conditional_t<GATE_UP, float4, uint4>;
    AReg ra[a_iters];
    uint4 rb[NB][b_iters];
    const int64_t row_bytes = g.K * eb;

    auto load = [&](int64_t k0) {
#pragma unroll
        for (int i = 0; i < a_iters; ++i) {
            const int c = tid + threads * i;
            const int r = c / a_cpr, col = (c % a_cpr) * a_epc;
            const int64_t src = row_src[r];
            const bool ok = src >= 0 && k0 + col < g.K;
            if constexpr (GATE_UP) {
                ra[i] = ok ? *reinterpret_cast<const float4*>(g.x + src * g.x_stride + k0 + col)
                           : make_float4(0.f, 0.f, 0.f, 0.f);
            } else {
                ra[i] = ok ? *reinterpret_cast<const uint4*>(g.a + src * g.a_stride + k0 + col)
                           : make_uint4(0, 0, 0, 0);
            }
        }
#pragma unroll
        for (int m = 0; m < NB; ++m)
#pragma unroll
            for (int i = 0; i < b_iters; ++i) {
                const int c = tid + threads * i;
                const int r = c / b_cpr, col = (c % b_cpr) * b_epc;
                const int64_t n = n0 + r;
                rb[m][i] = (n < g.N && k0 + col < g.K)
                               ? load_weights16(bmat[m] + n * row_bytes + (k0 + col) * eb)
                               : make_uint4(0, 0, 0, 0);
            }
    };
    auto store = [&](int buf) {
        __nv_bfloat16* As = smem + buf * stage_elems;
#pragma unroll
        for (int i = 0; i < a_iters; ++i) {
            const int c = tid + threads * i;
            const int r = c / a_cpr, col = (c % a_cpr) * a_epc;
            if constexpr (GATE_UP) {
                *reinterpret_cast<uint2*>(As + r * lds + col) =
                    make_uint2(pack_bf16(ra[i].x, ra[i].y), pack_bf16(ra[i].z, ra[i].w));
            } else {
                *reinterpret_cast<uint4*>(As + r * lds + col) = ra[i];
            }
        }
#pragma unroll
        for (int m = 0; m < NB; ++m) {
            __nv_bfloat16* Bs = As + TM * lds + m * TN * lds;
#pragma unroll
            for (int i = 0; i < b_iters; ++i) {
                const int c = tid + threads * i;
                const int r = c / b_cpr, col = (c % b_cpr) * b_epc;
                const uint4 w = rb[m][i];
                __nv_bfloat16* dst = Bs + r * lds + col;
                if constexpr (BT == mgl::dtype::f8_e4m3) {
                    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
                    uint32_t o[8];
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        o[2 * q] = fp8x2_to_bf16x2(ws[q] & 0xffffu);
                        o[2 * q + 1] = fp8x2_to_bf16x2(ws[q] >> 16);
                    }
                    reinterpret_cast<uint4*>(dst)[0] = make_uint4(o[0], o[1], o[2], o[3]);
                    reinterpret_cast<uint4*>(dst)[1] = make_uint4(o[4], o[5], o[6], o[7]);
                } else if constexpr (BT == mgl::dtype::bf16) {
                    *reinterpret_cast<uint4*>(dst) = w;
                } else {
                    *reinterpret_cast<uint2*>(dst) =
                        make_uint2(pack_bf16(__uint_as_float(w.x), __uint_as_float(w.y)),
                                   pack_bf16(__uint_as_float(w.z), __uint_as_float(w.w)));
                }
            }
        }
    };

    float acc[NB][MI][NI][4];
#pragma unroll
    for (int m = 0; m < NB; ++m)
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int ni = 0; ni < NI; ++ni)
#pragma unroll
                for (int q = 0; q < 4; ++q) acc[m][mi][ni][q] = 0.0f;

    const int64_t n_k_tiles = (g.K + tile_k - 1) / tile_k;
    load(0);
    store(0);
    __syncthreads();
    for (int64_t kt = 0; kt < n_k_tiles; ++kt) {
        const int buf = int(kt & 1);
        if (kt + 1 < n_k_tiles) load((kt + 1) * tile_k);
        const __nv_bfloat16* As = smem + buf * stage_elems;
#pragma unroll
        for (int ks = 0; ks < tile_k / 16; ++ks) {
            uint32_t af[MI][4];
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const int row = warp_m * (TM / 2) + mi * 16 + (lane % 16);
                const int col = ks * 16 + (lane / 16) * 8;
                ldmatrix_x4(af[mi], As + row * lds + col);
            }
#pragma unroll
            for (int m = 0; m < NB; ++m) {
                const __nv_bfloat16* Bs = As + TM * lds + m * TN * lds;
#pragma unroll
                for (int nj = 0; nj < NI / 2; ++nj) {
                    // x4: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                    const int nrow = warp_n * (TN / 4) + nj * 16 + (lane % 8) + (lane / 16) * 8;
                    const int col = ks * 16 + ((lane / 8) % 2) * 8;
                    uint32_t bf[4];
                    ldmatrix_x4(bf, Bs + nrow * lds + col);
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) {
                        mma_bf16(acc[m][mi][2 * nj], af[mi], bf[0], bf[1]);
                        mma_bf16(acc[m][mi][2 * nj + 1], af[mi], bf[2], bf[3]);
                    }
                }
            }
        }
        if (kt + 1 < n_k_tiles) store(buf ^ 1);
        __syncthreads();
    }

    // Epilogue: c0, c1 at (row g, cols 2q, 2q + 1), c2, c3 at row g + 8 (g = lane / 4, q = lane %
    // 4).
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp_m * (TM / 2) + mi * 16 + lane / 4 + 8 * h;
                const int64_t p = m0 + r;
                const int64_t n = n0 + warp_n * (TN / 4) + ni * 8 + 2 * (lane % 4);
                if (p >= m_end || n >= g.N) continue;
                store_pair<GATE_UP>(g, bscale, p, n, acc[0][mi][ni][2 * h],
                                    acc[0][mi][ni][2 * h + 1], acc[GATE_UP ? 1 : 0][mi][ni][2 * h],
                                    acc[GATE_UP ? 1 : 0][mi][ni][2 * h + 1]);
            }
}

}  // namespace minids::kernels::moe_detail::tc
