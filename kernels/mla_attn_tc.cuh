// The tensor-core MLA attention kernel (mla.h), a template over its block shape; instantiated by
// mla_attn_tc_decode.cu and mla_attn_tc_prefill.cu.
//
// One block = one tile of ROWS query rows (row = t·H + h) and one split of the keys. Per key tile
// of KT cache rows (cp.async, STAGES deep; f32 pages are converted to bf16 on the way):
//   S = Q·Kᵀ    warps (wm, wn): rows of row group wm, keys slice wn      (mma m16n8k16)
//   online softmax in base 2: row max across the WN warps through shared memory, P (16-bit) to
//               shared memory, each warp keeps its own partial row sums
//   O += P·V    warps (wm, wn): rows of wm, output dims slice wn (V = the first r columns)
// The products take 16-bit inputs of one type E (TcElem): f16 over f16 pages, bf16 otherwise;
// Q and P are rounded to E, the accumulators are f32.
// Q and K rows are zero-padded to a multiple of 16 columns; rows in shared memory are an odd
// number of 16-byte units apart, so ldmatrix reads are free of bank conflicts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "cp_async.cuh"
#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "mla_internal.cuh"

namespace minids::kernels::mla_detail {

// MT m16-tiles per warp, WM x WN warps, KT keys per tile, STAGES tiles in flight, O columns
// padded to R_PAD (512 for V2 shapes, 64 for small test models).
template <int MT_, int WM_, int WN_, int KT_, int STAGES_, int R_PAD_>
struct TcShape {
    static constexpr int MT = MT_, WM = WM_, WN = WN_, KT = KT_, STAGES = STAGES_, R_PAD = R_PAD_;
    static constexpr int rows = 16 * MT * WM;
    static constexpr int warps = WM * WN;
    static constexpr int threads = 32 * warps;
    static constexpr int keys_per_warp = KT / WN;
    static constexpr int s_ntiles = keys_per_warp / 8;
    static constexpr int dims_per_warp = R_PAD / WN;
    static constexpr int o_ntiles = dims_per_warp / 8;
    static constexpr int p_stride = KT + 8;  // 16-bit elements; an odd number of 16-byte units
    static_assert(keys_per_warp % 8 == 0 && KT % 16 == 0, "key tile must split into n8 tiles");
    static_assert(dims_per_warp % 16 == 0, "output slice must be a multiple of 16 columns");
    static_assert(STAGES >= 2, "at least double buffering");
};

// 16-bit elements between rows of Q and K in shared memory: >= the padded width and >= R_PAD
// (P·V reads R_PAD columns), and an odd multiple of 8 elements (16 bytes).
__host__ __device__ inline int tc_row_stride(int r, int rope, int r_pad) {
    const int wpad = (r + rope + 15) / 16 * 16;
    return (wpad > r_pad ? wpad : r_pad) + 8;
}

template <class S>
size_t tc_smem_bytes(int r, int rope) {
    const size_t ks = size_t(tc_row_stride(r, rope, S::R_PAD));
    return 2 * (size_t(S::rows) * ks + size_t(S::STAGES) * S::KT * ks +
                size_t(S::rows) * S::p_stride) +
           4 * (2 * size_t(S::WN) * S::rows + S::rows);
}

__device__ inline void ldsm_x4(uint32_t (&d)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
__device__ inline void ldsm_x2(uint32_t (&d)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(d[0]), "=r"(d[1])
                 : "r"(smem_u32(p))
                 : "memory");
}
__device__ inline void ldsm_x4_trans(uint32_t (&d)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(smem_u32(p))
                 : "memory");
}
// The 16-bit type the tensor cores multiply over pages of PageT: f16 pages keep their values
// (10 mantissa bits; q and P rounded to f16 too), f32 and bf16 pages go through bf16.
template <typename PageT>
struct TcElem {
    using type = __nv_bfloat16;
};
template <>
struct TcElem<__half> {
    using type = __half;
};

// c += a·b, 16x16 (row) x 16x8 (col) of E (bf16 or f16), f32 accumulate.
template <typename E>
__device__ inline void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (std::is_same_v<E, __half>) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        static_assert(std::is_same_v<E, __nv_bfloat16>, "bf16 or f16 inputs");
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}
// A row's 16-byte chunks c = 0 .. N-1 (those with lane + 32·c < chunks): this lane's chunk c
// sits 512·c bytes (32 lanes x 16) after dst_smem and after src.
template <int C, int N>
__device__ inline void cp_async_row(uint32_t dst_smem, const void* src, int src_bytes, int lane,
                                    int chunks) {
    if constexpr (C < N) {
        if (lane + 32 * C < chunks) cp_async_16<512 * C, 512 * C>(dst_smem, src, src_bytes);
        cp_async_row<C + 1, N>(dst_smem, src, src_bytes, lane, chunks);
    }
}
// (lo, hi) rounded to nearest even as two E in one register, lo in the low half.
template <typename E>
__device__ inline uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same_v<E, __half>) {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

// Loads KT cache rows starting at key k0 into `dst` (E, row stride ks); keys >= k_end or
// unmapped read as zeros. Warp w takes rows w, w + warps, ...; lane j first looks up the cache
// row of the warp's j-th key, so a tile's page-table reads go out together (cp.async's memory
// clobber would otherwise order each lookup behind the previous row's copies). Lanes then copy
// 16-byte chunks of each row (coalesced); width <= R_PAD + 128 bounds the chunks per lane.
template <class S, typename PageT, typename E = typename TcElem<PageT>::type>
__device__ inline void load_kv_tile(const AttnArgs& a, E* dst, int ks, int k0, int k_end) {
    constexpr int rows_per_warp = S::KT / S::warps;
    static_assert(S::KT % S::warps == 0 && rows_per_warp <= 32, "one lookup per lane");
    constexpr int per_chunk = 16 / int(sizeof(PageT));  // elements per 16-byte global load
    constexpr int chunk_iters = ((S::R_PAD + 128) / per_chunk + 31) / 32;
    const int width = a.r + a.rope;
    const int chunks = width / per_chunk;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int lane_row = -1;
    if (lane < rows_per_warp) {
        const int key = k0 + warp + lane * S::warps;
        if (key < k_end) lane_row = attn_cache_row(a, key);
    }
    const PageT* pages = static_cast<const PageT*>(a.pages) + lane * per_chunk;
    if constexpr (sizeof(PageT) == 2) {
        static_assert(std::is_same_v<PageT, E>, "16-bit pages are copied as they are");
        uint32_t d = smem_u32(dst + warp * ks + lane * per_chunk);
        // Fully unrolled, 16 rows or 64 columns per warp held more registers than before.
        constexpr int row_unroll = rows_per_warp <= 8 && S::R_PAD == 512 ? rows_per_warp : 2;
#pragma unroll row_unroll
        for (int j = 0; j < rows_per_warp; ++j, d += 2 * S::warps * ks) {
            const int row = __shfl_sync(0xffffffffu, lane_row, j);
            const PageT* src = pages + uint64_t(uint32_t(max(row, 0))) * uint32_t(width);
            const int bytes = row < 0 ? 0 : 16;
            cp_async_row<0, chunk_iters>(d, src, bytes, lane, chunks);
        }
    } else {
        // f32 pages pass through registers: one row at a time keeps the loads in flight (and
        // the registers) to chunk_iters per lane.
        E* d = dst + warp * ks + lane * per_chunk;
#pragma unroll 1
        for (int j = 0; j < rows_per_warp; ++j, d += S::warps * ks) {
            const int row = __shfl_sync(0xffffffffu, lane_row, j);
            const PageT* src = pages + uint64_t(uint32_t(max(row, 0))) * uint32_t(width);
            float4 v[chunk_iters];
#pragma unroll
            for (int c = 0; c < chunk_iters; ++c)
                v[c] = row >= 0 && lane + 32 * c < chunks
                           ? __ldg(reinterpret_cast<const float4*>(src + 32 * c * per_chunk))
                           : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int c = 0; c < chunk_iters; ++c)
                if (lane + 32 * c < chunks)
                    *reinterpret_cast<uint2*>(d + 32 * c * per_chunk) =
                        uint2{pack2<E>(v[c].x, v[c].y), pack2<E>(v[c].z, v[c].w)};
        }
    }
}

// Q rows row0 .. row0 + ROWS - 1 (row = t·H + h) as E into q_s (row stride ks): q_lat in
// columns [0, r), q_pe in [r, r + rope), zeros up to ks, and all zeros for rows past rows_total.
// Warp w takes rows w, w + warps, ..., two at a time with all their loads issued before any
// conversion; lane l converts q_lat columns [8l, 8l + 8), [8l + 256, ...), ... and q_pe columns
// [8l, 8l + 8) (r and rope are multiples of 8, r <= R_PAD, rope <= 128). VEC: float4 loads.
template <class S, bool VEC, typename E>
__device__ inline void stage_q(const AttnArgs& a, E* q_s, int ks, int row0, int rows_total) {
    constexpr int rows_per_warp = S::rows / S::warps;
    constexpr int batch = rows_per_warp >= 2 ? 2 : 1;  // rows with loads in flight
    static_assert(S::rows % S::warps == 0 && rows_per_warp % batch == 0, "whole rows per warp");
    constexpr int lat_iters = (S::R_PAD / 8 + 31) / 32;  // 8-column units of q_lat per lane
    constexpr int units = lat_iters + 1;                 // and one of q_pe (rope <= 128)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int col = 8 * lane;
    auto load8 = [](float(&v)[8], const float* src) {
        if constexpr (VEC) {
            const float4 lo = *reinterpret_cast<const float4*>(src);
            const float4 hi = *reinterpret_cast<const float4*>(src + 4);
            v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w;
            v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) v[e] = src[e];
        }
    };
    auto store8 = [](E* dst, const float(&v)[8]) {
        *reinterpret_cast<uint4*>(dst) = uint4{pack2<E>(v[0], v[1]), pack2<E>(v[2], v[3]),
                                               pack2<E>(v[4], v[5]), pack2<E>(v[6], v[7])};
    };
#pragma unroll 1
    for (int rb = 0; rb < rows_per_warp; rb += batch) {
        float v[batch][units][8];
#pragma unroll
        for (int b = 0; b < batch; ++b) {
#pragma unroll
            for (int u = 0; u < units; ++u)
#pragma unroll
                for (int e = 0; e < 8; ++e) v[b][u][e] = 0.f;
            const int row = row0 + warp + (rb + b) * S::warps;
            if (row < rows_total) {
                int t, h;
                a.head_div.divmod(row, t, h);
                const float* lat = a.q_lat + t * a.q_lat_st + h * a.q_lat_sh + col;
                const float* pe = a.q_pe + t * a.q_pe_st + h * a.q_pe_sh + col;
#pragma unroll
                for (int u = 0; u < lat_iters; ++u)
                    if (col + 256 * u < a.r) load8(v[b][u], lat + 256 * u);
                if (col < a.rope) load8(v[b][lat_iters], pe);
            }
        }
#pragma unroll
        for (int b = 0; b < batch; ++b) {
            E* dst = q_s + (warp + (rb + b) * S::warps) * ks;
#pragma unroll
            for (int u = 0; u < lat_iters; ++u)
                if (col + 256 * u < a.r) store8(dst + col + 256 * u, v[b][u]);
            if (col < a.rope) store8(dst + a.r + col, v[b][lat_iters]);
#pragma unroll 1
            for (int c = a.r + a.rope + col; c < ks; c += 256)
                *reinterpret_cast<uint4*>(dst + c) = make_uint4(0, 0, 0, 0);
        }
    }
}

template <class S, typename PageT>
__global__ void __launch_bounds__(S::threads, 1) mla_attn_tc_kernel(const AttnArgs a) {
    pdl_enter();
    using E = typename TcElem<PageT>::type;
    constexpr int ROWS = S::rows, KT = S::KT, WN = S::WN, MT = S::MT;
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int n_keys_slot;
    const int ks = tc_row_stride(a.r, a.rope, S::R_PAD);
    E* q_s = reinterpret_cast<E*>(smem);
    E* kv_s = q_s + ROWS * ks;
    E* p_s = kv_s + S::STAGES * KT * ks;
    float* red_max = reinterpret_cast<float*>(p_s + ROWS * S::p_stride);  // [WN][ROWS]
    float* red_sum = red_max + WN * ROWS;                                 // [WN][ROWS]
    int* lim_s = reinterpret_cast<int*>(red_sum + WN * ROWS);             // [ROWS]

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int wm = warp / WN, wn = warp % WN;
    const int g = lane / 4, c4 = lane % 4;
    const int rows_total = a.T * a.H;  // < 2^31 (make_args)
    const int row0 = blockIdx.x * ROWS;
    const int split = blockIdx.y;

    const int n_keys = block_n_keys(a, &n_keys_slot);
    const SplitPlan plan = plan_splits(n_keys, gridDim.y, a.min_keys, KT);
    if (blockIdx.x == 0 && split == 0 && tid == 0 && a.ws_n_split) *a.ws_n_split = plan.n_split;
    if (split >= plan.n_split) return;  // idle split: uniform over the block
    const bool direct = plan.n_split == 1;

    // Row limits and this block's key range; the first tiles' loads go out before Q is read,
    // so the two latencies overlap.
    const int width = a.r + a.rope;
    __shared__ int block_max_limit;
    if (tid == 0) block_max_limit = -1;
    __syncthreads();
    static_assert(ROWS <= S::threads, "one row limit per thread");
    if (tid < ROWS) {
        lim_s[tid] = row_limit(a, row0 + tid, n_keys);
        atomicMax(&block_max_limit, lim_s[tid]);
    }
    __syncthreads();
    const int s_begin = split * plan.chunk;
    const int s_hi = s_begin + plan.chunk;  // keys of this split: [s_begin, s_hi)
    const int s_end = min(s_hi, block_max_limit + 1);
    const int n_tiles = s_end > s_begin ? (s_end - s_begin + KT - 1) / KT : 0;
#pragma unroll
    for (int st = 0; st < S::STAGES - 1; ++st) {
        if (st < n_tiles)
            load_kv_tile<S, PageT>(a, kv_s + st * KT * ks, ks, s_begin + st * KT, s_end);
        cp_async_commit();
    }

    // Q as E, zero-padded to ks columns. The zero padding columns [width, ks) of every K
    // stage (never written by the loads; a multiple of 8 columns) are set here too, one row per
    // thread; the main loop's first barrier publishes both.
    if (a.q_vec4) {
        stage_q<S, true, E>(a, q_s, ks, row0, rows_total);
    } else {
        stage_q<S, false, E>(a, q_s, ks, row0, rows_total);
    }
    for (int kr = tid; kr < S::STAGES * KT; kr += S::threads)
#pragma unroll 1
        for (int col = width; col < ks; col += 8)
            *reinterpret_cast<uint4*>(kv_s + kr * ks + col) = make_uint4(0, 0, 0, 0);

    int lim[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) lim[mt][hh] = lim_s[(wm * MT + mt) * 16 + g + hh * 8];

    float m_run[MT][2], l_run[MT][2];
    float o_acc[MT][S::o_ntiles][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            m_run[mt][hh] = -INFINITY;
            l_run[mt][hh] = 0.f;
        }
#pragma unroll
        for (int n = 0; n < S::o_ntiles; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o_acc[mt][n][e] = 0.f;
    }

    const int k_steps = (width + 15) / 16;
    for (int tile = 0; tile < n_tiles; ++tile) {
        cp_async_wait<S::STAGES - 2>();
        __syncthreads();  // tile's stage is visible; the stage refilled next was read last round
        {
            const int nt = tile + S::STAGES - 1;
            if (nt < n_tiles)
                load_kv_tile<S, PageT>(a, kv_s + (nt % S::STAGES) * KT * ks, ks, s_begin + nt * KT,
                                       s_end);
            cp_async_commit();
        }
        const E* kv = kv_s + (tile % S::STAGES) * KT * ks;
        const int tile_k0 = s_begin + tile * KT;

        // S = Q·Kᵀ for this warp's rows and keys slice.
        float s_acc[MT][S::s_ntiles][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int n = 0; n < S::s_ntiles; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) s_acc[mt][n][e] = 0.f;
        const E* k_warp = kv + (wn * S::keys_per_warp) * ks;
#pragma unroll 2
        for (int kstep = 0; kstep < k_steps; ++kstep) {
            const int k0 = kstep * 16;
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(af[mt],
                        q_s + ((wm * MT + mt) * 16 + lane % 16) * ks + k0 + (lane / 16) * 8);
#pragma unroll
            for (int n = 0; n + 1 < S::s_ntiles; n += 2) {
                uint32_t bf[4];
                ldsm_x4(bf, k_warp + (n * 8 + lane % 8 + (lane / 16) * 8) * ks + k0 +
                                ((lane / 8) % 2) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<E>(s_acc[mt][n], af[mt], bf[0], bf[1]);
                    mma_16816<E>(s_acc[mt][n + 1], af[mt], bf[2], bf[3]);
                }
            }
            if constexpr (S::s_ntiles % 2 == 1) {
                constexpr int n = S::s_ntiles - 1;
                uint32_t bf[2];
                ldsm_x2(bf, k_warp + (n * 8 + lane % 8) * ks + k0 + ((lane / 8) % 2) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) mma_16816<E>(s_acc[mt][n], af[mt], bf[0], bf[1]);
            }
        }

        // Scale, mask, row max of this warp's slice.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                float mx = -INFINITY;
#pragma unroll
                for (int n = 0; n < S::s_ntiles; ++n) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const int key = tile_k0 + wn * S::keys_per_warp + n * 8 + c4 * 2 + e;
                        float v = s_acc[mt][n][hh * 2 + e] * a.scale_log2;
                        v = (key <= lim[mt][hh] && key < s_hi) ? v : -INFINITY;
                        s_acc[mt][n][hh * 2 + e] = v;
                        mx = fmaxf(mx, v);
                    }
                }
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
                mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
                if (c4 == 0) red_max[wn * ROWS + (wm * MT + mt) * 16 + g + hh * 8] = mx;
            }
        }
        __syncthreads();

        // New running max; P = 2^(s - m) to shared memory (E); rescale O and the sums.
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const int lr = (wm * MT + mt) * 16 + g + hh * 8;
                float tmax = -INFINITY;
#pragma unroll
                for (int j = 0; j < WN; ++j) tmax = fmaxf(tmax, red_max[j * ROWS + lr]);
                const float m_new = fmaxf(m_run[mt][hh], tmax);
                const float m_use = m_new == -INFINITY ? 0.f : m_new;
                const float alpha = exp2f(m_run[mt][hh] - m_use);  // 0 when m_run = -inf
                m_run[mt][hh] = m_new;
                float sum = 0.f;
#pragma unroll
                for (int n = 0; n < S::s_ntiles; ++n) {
                    const float p0 = exp2f(s_acc[mt][n][hh * 2] - m_use);
                    const float p1 = exp2f(s_acc[mt][n][hh * 2 + 1] - m_use);
                    sum += p0 + p1;
                    *reinterpret_cast<uint32_t*>(p_s + lr * S::p_stride + wn * S::keys_per_warp +
                                                 n * 8 + c4 * 2) = pack2<E>(p0, p1);
                }
                l_run[mt][hh] = l_run[mt][hh] * alpha + sum;
#pragma unroll
                for (int n = 0; n < S::o_ntiles; ++n) {
                    o_acc[mt][n][hh * 2] *= alpha;
                    o_acc[mt][n][hh * 2 + 1] *= alpha;
                }
            }
        }
        __syncthreads();

        // O += P·V over this warp's output columns.
#pragma unroll
        for (int kk = 0; kk < KT; kk += 16) {
            uint32_t af[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldsm_x4(af[mt], p_s + ((wm * MT + mt) * 16 + lane % 16) * S::p_stride + kk +
                                    (lane / 16) * 8);
#pragma unroll
            for (int n = 0; n < S::o_ntiles; n += 2) {
                uint32_t bf[4];
                ldsm_x4_trans(bf, kv + (kk + lane % 8 + ((lane / 8) % 2) * 8) * ks +
                                      wn * S::dims_per_warp + n * 8 + (lane / 16) * 8);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_16816<E>(o_acc[mt][n], af[mt], bf[0], bf[1]);
                    mma_16816<E>(o_acc[mt][n + 1], af[mt], bf[2], bf[3]);
                }
            }
        }
    }
    cp_async_wait<0>();

    // Row sums across the quad and the WN warps; write o / l (and the split's log2-sum-exp).
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            float l = l_run[mt][hh];
            l += __shfl_xor_sync(0xffffffffu, l, 1);
            l += __shfl_xor_sync(0xffffffffu, l, 2);
            if (c4 == 0) red_sum[wn * ROWS + (wm * MT + mt) * 16 + g + hh * 8] = l;
        }
    }
    __syncthreads();
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int lr = (wm * MT + mt) * 16 + g + hh * 8;
            const int row = row0 + lr;
            if (row >= rows_total) continue;
            float l = 0.f;
#pragma unroll
            for (int j = 0; j < WN; ++j) l += red_sum[j * ROWS + lr];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            float* dst = out_ptr(a, direct, split, row);
#pragma unroll
            for (int n = 0; n < S::o_ntiles; ++n) {
                const int d = wn * S::dims_per_warp + n * 8 + c4 * 2;
                if (d < a.r) {
                    dst[d] = o_acc[mt][n][hh * 2] * inv;
                    dst[d + 1] = o_acc[mt][n][hh * 2 + 1] * inv;
                }
            }
            if (!direct && wn == 0 && c4 == 0)
                a.ws_lse[int64_t(split) * rows_total + row] =
                    l > 0.f ? m_run[mt][hh] + log2f(l) : -INFINITY;
        }
    }
}

// Launches one instance on grid (row tiles, max_splits).
template <class S, typename PageT>
void launch_tc_instance(const AttnArgs& a, int max_splits, cudaStream_t stream) {
    // The kernel's loops are unrolled for r <= R_PAD (and rope <= 128).
    if (a.r > S::R_PAD || a.rope > 128)
        ::mgl::fail(__FILE__, __LINE__,
                    "mla tensor-core instance for r <= " + std::to_string(S::R_PAD) +
                        " launched with r = " + std::to_string(a.r));
    const size_t smem = tc_smem_bytes<S>(a.r, a.rope);
    auto kernel = mla_attn_tc_kernel<S, PageT>;
    CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    const int64_t rows = int64_t(a.T) * a.H;
    dim3 grid(unsigned((rows + S::rows - 1) / S::rows), unsigned(max_splits));
    launch_maybe_dependent(kernel, grid, dim3(S::threads), smem, stream, a.pdl, a);
}

}  // namespace minids::kernels::mla_detail
