// Grouped expert GEMMs with a multi-stage cp.async pipeline (MoeGroupedKernel::pipelined), for
// the MoE prefill path (moe_grouped.cu). Same product, tiles and epilogues as moe_gemm.cuh:
//
//   C[p, n] = Σ_k A[p, k] · B_e[n, k] over the rows p of one M tile (one expert's sorted rows, or
//   rows of the dense shared expert); gate_up (NB = 2) ends in act = silu(g · s_g) · (u · s_u)
//   stored as BF16, down (NB = 1) in y = acc · s_d stored as f32.
//
// What differs is how the operands reach the tensor cores. The staged kernel holds the next K
// tile in registers while it multiplies the current one, converting f32 x and FP8 weights to BF16
// on the way into shared memory: two tiles in flight at most, and the conversion sits between the
// loads and the barrier. Here:
//   - A is already BF16 in global memory (x rounded once per call by the caller, or the gate/up
//     activations), so it is copied, not converted;
//   - A and B tiles go straight from global to shared memory with cp.async, 3 or 4 K tiles in
//     flight (no registers held by the loads), one barrier per K tile;
//   - FP8 weights land raw (64 bytes per row and K tile, half the shared memory and half the
//     copies of BF16) and are widened to BF16 when loaded into mma fragments; BF16 weights are
//     read with ldmatrix.
// Rows are XOR-swizzled in 16-byte units instead of padded, so a stage is exactly 20-32 KiB and
// two blocks fit on an SM.
//
// Bit-identical to moe_gemm.cuh: the BF16 operands are the same values (x rounded with the same
// round-to-nearest; e4m3 -> bf16 exact in both), every accumulator receives one m16n8k16 per 16
// K values in increasing K order starting from +0 (K tiles past the end, zero-filled, add exact
// zeros in both), and the epilogues are the same expressions. One exception: an e4m3 NaN weight
// (0x7f / 0xff) widens to ±480 here (the bit conversion has no NaN case), to NaN there.
#pragma once

#include "moe_gemm.cuh"

namespace minids::kernels::moe_detail::pipe {

constexpr int threads = 256;
constexpr int tile_k = 64;  // one BF16 A row per K tile is 128 bytes: eight 16-byte chunks

// The tile shape of one instantiation. B is 16 KiB per stage (FP8: 256 rows of 64 bytes; BF16:
// 128 rows of 128 bytes; 128 FP8 rows at TM 128, whose A alone is 16 KiB), split between gate
// and up for gate_up. Every shape keeps NB·MI·NI·4 <= 64 accumulators per thread, so two blocks
// of 256 threads fit in the register file (128 registers each).
//
// Warps: FP8 fragments cost a conversion per B element and warp, so FP8 puts all 8 warps side
// by side along N (each B element widened once per block; TM 128: 2 x 4); BF16 fragments come
// from ldmatrix at no conversion cost, and 2 x 4 halves the A reads per mma.
template <int TM, bool GATE_UP, mgl::dtype BT>
struct Shape {
    static_assert(BT == mgl::dtype::f8_e4m3 || BT == mgl::dtype::bf16);
    static_assert(TM == 32 || TM == 64 || TM == 128);
    static constexpr bool fp8 = BT == mgl::dtype::f8_e4m3;
    static constexpr int NB = GATE_UP ? 2 : 1;  // B matrices: gate and up, or down
    static constexpr int eb = fp8 ? 1 : 2;
    static constexpr int b_row_bytes = tile_k * eb;  // 64 or 128
    static constexpr int b_rows = fp8 && TM <= 64 ? 256 : 128;
    static constexpr int TN = b_rows / NB;  // output columns per block (each matrix)
    static constexpr int warps_m = fp8 ? (TM >= 128 ? 2 : 1) : 2;
    static constexpr int warps_n = 8 / warps_m;
    static constexpr int WM = TM / warps_m;  // rows per warp
    static constexpr int WN = TN / warps_n;  // columns per warp, each matrix
    static constexpr int MI = WM / 16;       // m16 tiles per warp
    static constexpr int NI = WN / 8;        // n8 tiles per warp and matrix
    static constexpr int a_bytes = TM * 128;
    static constexpr int b_bytes = b_rows * b_row_bytes;
    static constexpr int stage_bytes = a_bytes + b_bytes;
    static constexpr int stages = stage_bytes <= 24 * 1024 ? 4 : 3;  // <= 96 KiB: 2 blocks/SM
    static constexpr size_t smem = size_t(stages) * size_t(stage_bytes);
    static constexpr int a_copies = TM * 8 / threads;  // 16-byte copies per thread and stage
    static constexpr int b_chunks_per_row = b_row_bytes / 16;
    static constexpr int b_copies = b_rows * b_chunks_per_row / threads;
    static_assert(MI >= 1 && NI >= 2 && NI % 2 == 0 && a_copies >= 1 && b_copies >= 1);
    static_assert(NB * MI * NI * 4 <= 64);
};

// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of 128-byte rows: the chunk index
// XOR the row's low 3 bits, so the 8 rows an ldmatrix phase reads hit 8 different bank groups.
__device__ __forceinline__ uint32_t swizzle128(int row, int chunk) {
    return uint32_t(row * 128 + ((chunk ^ (row & 7)) << 4));
}
// The same for 64-byte FP8 rows: two rows share a 128-byte bank line, so the XOR takes bits 1-2
// of the row, and the 32-bit fragment reads of 8 consecutive rows (same chunk) hit 16 different
// banks.
__device__ __forceinline__ uint32_t swizzle64(int row, int chunk) {
    return uint32_t(row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// Two e4m3 values of `word` (the byte pair `sel` picks) as a BF16 pair, exactly. The byte
// s.eeee.mmm becomes the bf16 pattern s.0000eeee.mmm0000, whose value is 2^-120 times the e4m3
// value for normals and subnormals alike (both formats scale the mantissa the same way below
// their smallest normal); the BF16 multiply by 2^120 is exact (BF16 keeps subnormal inputs).
// sel = 0x4140 takes bytes 0-1, 0x4342 bytes 2-3, each into the low byte of a 16-bit half; then
// (r + sign · 15) << 4 moves the sign from bit 7 to bit 15 and the rest 4 bits up, integer
// multiply-adds and shifts instead of three mask operations.
__device__ __forceinline__ uint32_t e4m3x2_to_bf16x2(uint32_t word, uint32_t sel) {
    const uint32_t r = __byte_perm(word, 0u, sel);
    const uint32_t sign = r & 0x00800080u;
    const uint32_t bits = (r + sign * 15u) << 4;
    const __nv_bfloat162 scaled = *reinterpret_cast<const __nv_bfloat162*>(&bits);
    const __nv_bfloat162 out =
        __hmul2(scaled, __nv_bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80)));
    return *reinterpret_cast<const uint32_t*>(&out);
}

template <int TM, bool GATE_UP, mgl::dtype BT>
__global__ void __launch_bounds__(threads, 2) gemm_kernel(tc::GemmArgs g) {
    using S = Shape<TM, GATE_UP, BT>;
    constexpr int NB = S::NB, MI = S::MI, NI = S::NI, TN = S::TN;
    extern __shared__ uint4 smem_raw[];
    __shared__ int64_t row_src[TM];  // offset of each tile row's A row in g.a; -1 past the rows

    int e;
    int64_t m0, m_end;
    if (!tc::find_tile(g, TM, blockIdx.x, e, m0, m_end)) return;
    const int64_t n0 = int64_t(blockIdx.y) * TN;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int warp_m = warp / S::warps_n, warp_n = warp % S::warps_n;

    for (int r = tid; r < TM; r += threads) {
        const int64_t p = m0 + r;
        int64_t src = -1;
        if (p < m_end) src = (GATE_UP && g.sorted_entry) ? g.sorted_entry[p] / g.k : p;
        row_src[r] = src >= 0 ? src * g.a_stride : -1;
    }
    __syncthreads();

    // What each thread copies per stage: A copy i is row tid / 8 + 32 i, chunk tid % 8 (its
    // offset read from row_src each time: kept in registers, 4 pointers at TM 128 made ptxas
    // spill).
    const int a_chunk = tid % 8;
    // B: copy i is row tid / b_chunks_per_row + rows_per_copy · i of the B tile (matrix m = that
    // row / TN, known at compile time), chunk tid % b_chunks_per_row.
    constexpr int rows_per_copy = threads / S::b_chunks_per_row;
    static_assert(TN % rows_per_copy == 0);
    const uintptr_t base = g.table ? uintptr_t(g.table[e]) : 0;
    const int64_t b_row_stride = g.K * S::eb;  // bytes between weight rows
    const int b_chunk = tid % S::b_chunks_per_row;
    const int64_t b_row0 = n0 + tid / S::b_chunks_per_row;
    const uint8_t* b_src[NB];
#pragma unroll
    for (int m = 0; m < NB; ++m)
        b_src[m] = reinterpret_cast<const uint8_t*>(base + uintptr_t(g.off[m])) +
                   b_row0 * b_row_stride + b_chunk * 16;
    uint32_t b_row_ok = 0;  // bit i: copy i's row is below N
#pragma unroll
    for (int i = 0; i < S::b_copies; ++i)
        if (b_row0 + (i * rows_per_copy) % TN < g.N) b_row_ok |= 1u << i;

    const uint32_t smem = smem_u32(smem_raw);
    // Copies K tile kt into stage `slot`; chunks past K, past the tile's rows or past N are
    // zero-filled (cp.async with 0 source bytes reads nothing; the address is then g.a, valid).
    auto load_stage = [&](int slot, int kt) {
        const uint32_t a_s = smem + uint32_t(slot * S::stage_bytes);
        const uint32_t b_s = a_s + S::a_bytes;
        const int64_t k0 = int64_t(kt) * tile_k;
        const bool a_k_ok = k0 + a_chunk * 8 < g.K;
#pragma unroll
        for (int i = 0; i < S::a_copies; ++i) {
            const int r = tid / 8 + 32 * i;
            const int64_t row = row_src[r];
            const bool ok = a_k_ok && row >= 0;
            cp_async_16<0, 0>(a_s + swizzle128(r, a_chunk), ok ? g.a + row + k0 + a_chunk * 8 : g.a,
                              ok ? 16 : 0);
        }
        const bool b_k_ok = k0 + b_chunk * (16 / S::eb) < g.K;
#pragma unroll
        for (int i = 0; i < S::b_copies; ++i) {
            const int m = (i * rows_per_copy) / TN;
            const int r = tid / S::b_chunks_per_row + i * rows_per_copy;
            const bool ok = b_k_ok && (b_row_ok >> i & 1u);
            const uint8_t* src =
                b_src[m] + int64_t((i * rows_per_copy) % TN) * b_row_stride + k0 * S::eb;
            const uint32_t dst = S::fp8 ? swizzle64(r, b_chunk) : swizzle128(r, b_chunk);
            cp_async_16<0, 0>(b_s + dst, ok ? src : reinterpret_cast<const uint8_t*>(g.a),
                              ok ? 16 : 0);
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

    // FP8 fragments: lane (g, q) = (lane / 4, lane % 4) needs the byte pairs at 2q and 2q + 8 of
    // its row's 16-byte chunk: the low or high half of words q / 2 and q / 2 + 2.
    const uint32_t fp8_sel = (lane % 4) % 2 ? 0x4342u : 0x4140u;
    const uint32_t fp8_word = uint32_t((lane % 4) / 2) * 4;

    auto compute_stage = [&](int slot) {
        const uint32_t a_s = smem + uint32_t(slot * S::stage_bytes);
        const uint32_t b_s = a_s + S::a_bytes;
        // Unrolled by 2, not 4: fully unrolled, ptxas hoisted the next k16's fragment reads and
        // spilled at 128 registers in the FP8 shapes.
#pragma unroll 2
        for (int ks = 0; ks < tile_k / 16; ++ks) {
            if constexpr (S::fp8) {
                // Every B fragment of this k16 first (NB · NI · 2 registers), then one m16 row of
                // A at a time.
                uint32_t bfr[NB][NI][2];
#pragma unroll
                for (int m = 0; m < NB; ++m)
#pragma unroll
                    for (int ni = 0; ni < NI; ++ni) {
                        const int row = m * TN + warp_n * S::WN + ni * 8 + lane / 4;
                        const uint32_t at = b_s + swizzle64(row, ks) + fp8_word;
                        bfr[m][ni][0] = e4m3x2_to_bf16x2(lds32(at), fp8_sel);
                        bfr[m][ni][1] = e4m3x2_to_bf16x2(lds32(at + 8), fp8_sel);
                    }
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    uint32_t af[4];
                    const int row = warp_m * S::WM + mi * 16 + lane % 16;
                    ldmatrix_x4(af, a_s + swizzle128(row, ks * 2 + lane / 16));
#pragma unroll
                    for (int m = 0; m < NB; ++m)
#pragma unroll
                        for (int ni = 0; ni < NI; ++ni)
                            tc::mma_bf16(acc[m][mi][ni], af, bfr[m][ni][0], bfr[m][ni][1]);
                }
            } else {
                uint32_t af[MI][4];
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    const int row = warp_m * S::WM + mi * 16 + lane % 16;
                    ldmatrix_x4(af[mi], a_s + swizzle128(row, ks * 2 + lane / 16));
                }
#pragma unroll
                for (int m = 0; m < NB; ++m)
#pragma unroll
                    for (int nj = 0; nj < NI / 2; ++nj) {
                        // x4: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15)
                        const int row =
                            m * TN + warp_n * S::WN + nj * 16 + lane % 8 + (lane / 16) * 8;
                        uint32_t bf[4];
                        ldmatrix_x4(bf, b_s + swizzle128(row, ks * 2 + (lane / 8) % 2));
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi) {
                            tc::mma_bf16(acc[m][mi][2 * nj], af[mi], bf[0], bf[1]);
                            tc::mma_bf16(acc[m][mi][2 * nj + 1], af[mi], bf[2], bf[3]);
                        }
                    }
            }
        }
    };

    // The pipeline: stages - 1 K tiles requested ahead. Each iteration waits for its tile (every
    // older group complete), and the barrier both publishes it and tells every thread that the
    // slot computed in the previous iteration is free; that slot takes the tile stages - 1 ahead.
    const int n_k_tiles = int((g.K + tile_k - 1) / tile_k);
#pragma unroll
    for (int s = 0; s < S::stages - 1; ++s) {
        if (s < n_k_tiles) load_stage(s, s);
        cp_async_commit();  // empty groups keep the count uniform
    }
    int read_slot = 0, write_slot = S::stages - 1;
    for (int kt = 0; kt < n_k_tiles; ++kt) {
        cp_async_wait<S::stages - 2>();
        __syncthreads();
        if (kt + S::stages - 1 < n_k_tiles) load_stage(write_slot, kt + S::stages - 1);
        cp_async_commit();
        compute_stage(read_slot);
        read_slot = read_slot + 1 == S::stages ? 0 : read_slot + 1;
        write_slot = write_slot + 1 == S::stages ? 0 : write_slot + 1;
    }
    cp_async_wait_all();  // only empty groups remain, but leave nothing in flight

    // The tile and the row scales found again rather than kept: held through the K loop, their
    // registers made ptxas spill at 128 (2 blocks per SM).
    tc::find_tile(g, TM, blockIdx.x, e, m0, m_end);
    const uintptr_t ebase = g.table ? uintptr_t(g.table[e]) : 0;
    const float* bscale[NB];
#pragma unroll
    for (int m = 0; m < NB; ++m)
        bscale[m] = g.scale_off[m] >= 0
                        ? reinterpret_cast<const float*>(ebase + uintptr_t(g.scale_off[m]))
                        : nullptr;

        // Epilogue (as moe_gemm.cuh): c0, c1 at (row g, cols 2q, 2q + 1), c2, c3 at row g + 8.
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < NI; ++ni)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int r = warp_m * S::WM + mi * 16 + lane / 4 + 8 * h;
                const int64_t p = m0 + r;
                const int64_t n = n0 + warp_n * S::WN + ni * 8 + 2 * (lane % 4);
                if (p >= m_end || n >= g.N) continue;
                tc::store_pair<GATE_UP>(
                    g, bscale, p, n, acc[0][mi][ni][2 * h], acc[0][mi][ni][2 * h + 1],
                    acc[GATE_UP ? 1 : 0][mi][ni][2 * h], acc[GATE_UP ? 1 : 0][mi][ni][2 * h + 1]);
            }
}

}  // namespace minids::kernels::moe_detail::pipe
