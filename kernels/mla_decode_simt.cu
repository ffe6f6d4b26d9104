// MLA decode attention for a few query rows (decode: T·H rows, tiles of 4), on CUDA cores,
// built for latency: a block issues its query rows and its first chunk of cache rows in one go
// (one memory round trip), keeps the next chunk's loads in flight while it computes the current
// one, and the split partials are merged by a second, wide kernel.
//
//   kernel 1, grid (max_splits, row tiles of 4): block (s, tile) takes keys [s·chunk, (s+1)·chunk)
//   of
//            every row of the tile; chunk and the number of splits used are computed on the device
//            from positions[] (few splits for a short context, all of them for a long one), so
//            one captured graph serves every step. Scores in FP32 from the bf16/f16/f32 rows,
//            online softmax (base 2), o += p·c. One split: the output is written directly.
//   kernel 2, grid (rows, r / 64): out = Σ_s 2^(m_s − m)·o_s / Σ_s 2^(m_s − m)·l_s.
//
// Tiles of 4 rows keep each block's arithmetic short (latency is what matters at batch 1); the
// price is that every row tile reads the cache rows again (from L2 for the later ones), and FP32
// CUDA-core math (~1088 FMA per cached token and head) that exceeds the bandwidth floor at long
// contexts: a tensor-core version is what 32K contexts would want (docs/perf.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <type_traits>

#include "cuda_check.h"
#include "mla.h"

namespace minids::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kRows = 4;   // query rows (t, h) per block: few, so a split's work is short
constexpr int kKeys = 16;  // cache rows per chunk
constexpr int kMinKeysPerSplit = 32;
constexpr int kMergeCols = 64;

struct Args {
    const uint8_t* pages;
    mgl::dtype type;  // of the pages: f32, bf16 or f16 (host side)
    int page_size, max_pages, n_pages;
    int page_shift;  // log2(page_size) when it is a power of two, else -1
    const int32_t* page_table;
    int r, rope, width;
    const float* q_lat;
    int64_t q_lat_st, q_lat_sh;
    const float* q_pe;
    int64_t q_pe_st, q_pe_sh;
    float* out;
    int64_t out_st, out_sh;
    const int32_t* positions;
    int T, H;
    float scale_log2;  // softmax scale · log2(e): scores are exponentiated base 2
    int max_splits;
    float* ws_m;  // [max_splits][rows]
    float* ws_l;  // [max_splits][rows]
    float* ws_o;  // [max_splits][rows][r]
};

// Keys the tile's rows need (max position + 1, capped by the page table), and the split plan.
struct Plan {
    int n_keys, n_split, chunk;
};

__device__ inline Plan plan_of(const Args& a, int tile) {
    int mx = -1;
    for (int i = 0; i < kRows; ++i) {
        const int row = tile * kRows + i;
        if (row < a.T * a.H) mx = max(mx, a.positions[row / a.H]);
    }
    const int64_t cap = int64_t(a.max_pages) * a.page_size;
    Plan p;
    const int64_t want_keys = int64_t(mx) + 1;
    p.n_keys = int(want_keys < cap ? want_keys : cap);
    const int want = max(1, (p.n_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
    const int splits = min(a.max_splits, want);
    p.chunk = ((p.n_keys + splits - 1) / splits + kKeys - 1) / kKeys * kKeys;
    p.n_split = max(1, (p.n_keys + p.chunk - 1) / p.chunk);
    return p;
}

// Shared memory: q [kRows][W] f32 (pre-scaled), k [kKeys][kw] (pairs of 16-bit values or f32
// words; kw odd, so the 8 keys x 4 quarters a warp reads in one step hit 32 banks), p, row
// statistics.
__host__ __device__ inline int k_stride_words(bool pairs, int width) {
    return (pairs ? (width + 1) / 2 : width) | 1;
}

// The two cache values in one 32-bit word of 16-bit pages: lo at the lower address, hi after it.
template <typename PageT>
__device__ inline float pair_lo(uint32_t u) {
    if constexpr (std::is_same_v<PageT, __half>) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xffffu)));
    } else {
        return __uint_as_float(u << 16);
    }
}
template <typename PageT>
__device__ inline float pair_hi(uint32_t u) {
    if constexpr (std::is_same_v<PageT, __half>) {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
    } else {
        return __uint_as_float(u & 0xffff0000u);
    }
}

// PageT: float, __nv_bfloat16 or __half. WC: the row width (r + rope) as a compile-time constant
// for the common shape (576: index arithmetic becomes multiplies), or 0 for any width read from
// the arguments.
template <typename PageT, int WC>
__global__ void __launch_bounds__(kThreads) mla_decode_simt_kernel(const Args a) {
    constexpr bool kPairs = sizeof(PageT) == 2;  // 16-bit values, two per 32-bit word
    extern __shared__ __align__(16) float smem[];
    const int tile = blockIdx.y, split = blockIdx.x, tid = threadIdx.x;
    const int warp = tid / 32, lane = tid % 32;
    const Plan plan = plan_of(a, tile);
    if (split >= plan.n_split) return;  // uniform over the block
    const int rows_total = a.T * a.H;
    const int key0 = split * plan.chunk;
    const int key_end = min(plan.n_keys, key0 + plan.chunk);
    const int n_chunks = (key_end - key0 + kKeys - 1) / kKeys;

    const int W = WC ? WC : a.width, r = a.r;
    const int kw = k_stride_words(kPairs, W);
    float* q_s = smem;                                             // [kRows][W]
    uint32_t* k_s = reinterpret_cast<uint32_t*>(q_s + kRows * W);  // [kKeys][kw]
    float* p_s = reinterpret_cast<float*>(k_s + kKeys * kw);       // [kRows][kKeys]
    float* alpha_s = p_s + kRows * kKeys;                          // [kRows]
    float* m_s = alpha_s + kRows;                                  // [kRows]
    float* l_s = m_s + kRows;                                      // [kRows]
    int* lim_s = reinterpret_cast<int*>(l_s + kRows);              // [kRows]

    // Cache rows are fetched as 16-byte pieces: `pieces` per row, spread over the threads.
    const int pieces = W * (kPairs ? 2 : 4) / 16;
    const int total = kKeys * pieces;
    constexpr int kMaxLoads = (kKeys * 1152 / 16 + kThreads - 1) / kThreads * (kPairs ? 1 : 2);
    uint4 buf[kMaxLoads];
    auto page_of = [&](int pos) {
        return a.page_shift >= 0 ? pos >> a.page_shift : pos / a.page_size;
    };
    auto slot_of = [&](int pos) {
        return a.page_shift >= 0 ? pos & (a.page_size - 1) : pos % a.page_size;
    };
    // Branch-free: every address is clamped to a valid one, so all the page-table loads and then
    // all the row loads of a thread go out together (two round trips per chunk); values past the
    // chunk's end are zeroed afterwards. A page-table entry outside the pool is clamped into it
    // (memory-safe; such a table is a caller bug the CPU backend reports).
    auto load_chunk = [&](int c) {
        const int base = key0 + c * kKeys;
        int key[kMaxLoads], piece[kMaxLoads], page[kMaxLoads];
#pragma unroll
        for (int j = 0; j < kMaxLoads; ++j) {
            const int idx = min(tid + j * kThreads, total - 1);
            key[j] = min(base + idx / pieces, key_end - 1);
            piece[j] = idx % pieces;
            page[j] = a.page_table[page_of(key[j])];
        }
#pragma unroll
        for (int j = 0; j < kMaxLoads; ++j) {
            const int pg = min(max(page[j], 0), a.n_pages - 1);
            const int64_t row = int64_t(pg) * a.page_size + slot_of(key[j]);
            buf[j] = __ldg(
                reinterpret_cast<const uint4*>(a.pages + row * int64_t(W) * (kPairs ? 2 : 4)) +
                piece[j]);
        }
#pragma unroll
        for (int j = 0; j < kMaxLoads; ++j) {
            const int idx = tid + j * kThreads;
            if (idx >= total || base + idx / pieces >= key_end) buf[j] = make_uint4(0, 0, 0, 0);
        }
    };
    auto store_chunk = [&]() {
#pragma unroll
        for (int j = 0; j < kMaxLoads; ++j) {
            const int idx = tid + j * kThreads;
            if (idx < total) {
                uint32_t* d = k_s + (idx / pieces) * kw + (idx % pieces) * 4;
                d[0] = buf[j].x;
                d[1] = buf[j].y;
                d[2] = buf[j].z;
                d[3] = buf[j].w;
            }
        }
    };

    load_chunk(0);  // in flight while q is fetched
    {
        // Every q load in flight at once (one round trip), then stored scaled for exp2.
        constexpr int kQLoads = (kRows * 640 + kThreads - 1) / kThreads;
        float qv[kQLoads];
#pragma unroll
        for (int j = 0; j < kQLoads; ++j) {  // clamped addresses, no branches: loads batch up
            const int i = min(tid + j * kThreads, kRows * W - 1);
            const int lr = i / W, col = i % W, row = min(tile * kRows + lr, rows_total - 1);
            const int t = row / a.H, h = row % a.H;
            const float* src = col < r ? a.q_lat + t * a.q_lat_st + h * a.q_lat_sh + col
                                       : a.q_pe + t * a.q_pe_st + h * a.q_pe_sh + (col - r);
            qv[j] = __ldg(src);
        }
#pragma unroll
        for (int j = 0; j < kQLoads; ++j) {
            const int i = tid + j * kThreads;
            if (i >= kRows * W || tile * kRows + i / W >= rows_total) qv[j] = 0.0f;
        }
#pragma unroll
        for (int j = 0; j < kQLoads; ++j) {
            const int i = tid + j * kThreads;
            if (i < kRows * W) q_s[i] = qv[j] * a.scale_log2;
        }
    }
    if (tid < kRows) {
        const int row = tile * kRows + tid;
        lim_s[tid] = row < rows_total ? min(a.positions[row / a.H], plan.n_keys - 1) : -1;
    }

    // Scores: thread -> (row, key, quarter of the dims); the 4 quarters are adjacent lanes.
    const int s_quarter = tid % 4, s_key = (tid / 4) % kKeys, s_row = tid / (4 * kKeys);
    const int n_words = kPairs ? W / 2 : W, q_words = (n_words + 3) / 4;
    const int w_begin = s_quarter * q_words, w_end = min(n_words, w_begin + q_words);
    // Values: thread -> 2 columns, all rows.
    const int col = 2 * tid;
    float acc[kRows][2];
#pragma unroll
    for (int i = 0; i < kRows; ++i) acc[i][0] = acc[i][1] = 0.0f;
    float m_run = -INFINITY, l_run = 0.0f;  // row `warp` (warps < kRows), uniform in the warp

    for (int c = 0; c < n_chunks; ++c) {
        __syncthreads();  // the previous chunk's k_s and p_s are no longer read
        store_chunk();
        if (c + 1 < n_chunks) load_chunk(c + 1);
        __syncthreads();
        const int kbase = key0 + c * kKeys;

        // 1) scores over a quarter of the dims each, summed across the quarter lanes.
        {
            const float* qr = q_s + s_row * W;
            const uint32_t* kr = k_s + s_key * kw;
            float sa = 0.0f, sb = 0.0f;
            if constexpr (kPairs) {
#pragma unroll 4
                for (int w = w_begin; w < w_end; ++w) {
                    const uint32_t u = kr[w];
                    sa = fmaf(qr[2 * w], pair_lo<PageT>(u), sa);
                    sb = fmaf(qr[2 * w + 1], pair_hi<PageT>(u), sb);
                }
            } else {
#pragma unroll 4
                for (int w = w_begin; w < w_end; w += 2) {
                    sa = fmaf(qr[w], __uint_as_float(kr[w]), sa);
                    if (w + 1 < w_end) sb = fmaf(qr[w + 1], __uint_as_float(kr[w + 1]), sb);
                }
            }
            float sc = sa + sb;
            sc += __shfl_xor_sync(0xffffffffu, sc, 1);
            sc += __shfl_xor_sync(0xffffffffu, sc, 2);
            if (s_quarter == 0) p_s[s_row * kKeys + s_key] = sc;
        }
        __syncthreads();

        // 2) online softmax (base 2): warp `row`, keys on lanes 0..kKeys-1.
        if (warp < kRows) {
            const int row = warp;
            float sc = lane < kKeys ? p_s[row * kKeys + lane] : -INFINITY;
            if (kbase + lane > lim_s[row]) sc = -INFINITY;
            float mx = sc;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m_run, mx);
            const float corr = m_new == -INFINITY ? 1.0f : exp2f(m_run - m_new);
            const float pr = sc == -INFINITY ? 0.0f : exp2f(sc - m_new);
            float sum = pr;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            l_run = l_run * corr + sum;
            m_run = m_new;
            if (lane < kKeys) p_s[row * kKeys + lane] = pr;
            if (lane == 0) alpha_s[row] = corr;
        }
        __syncthreads();

        // 3) o[row][col] = o·alpha + Σ_k p[row][k] · c_k[col]
        if (col < r) {
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const float al = alpha_s[i];
                acc[i][0] *= al;
                acc[i][1] *= al;
            }
#pragma unroll
            for (int k = 0; k < kKeys; ++k) {
                float v0, v1;
                if constexpr (kPairs) {
                    const uint32_t u = k_s[k * kw + col / 2];
                    v0 = pair_lo<PageT>(u);
                    v1 = pair_hi<PageT>(u);
                } else {
                    v0 = __uint_as_float(k_s[k * kw + col]);
                    v1 = __uint_as_float(k_s[k * kw + col + 1]);
                }
#pragma unroll
                for (int i = 0; i < kRows; ++i) {
                    const float pr = p_s[i * kKeys + k];
                    acc[i][0] = fmaf(pr, v0, acc[i][0]);
                    acc[i][1] = fmaf(pr, v1, acc[i][1]);
                }
            }
        }
    }

    // Row statistics to shared memory for every thread.
    if (warp < kRows && lane == 0) {
        m_s[warp] = m_run;
        l_s[warp] = l_run;
    }
    __syncthreads();
    const bool direct = plan.n_split == 1;
    if (col < r) {
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const int row = tile * kRows + i;
            if (row >= rows_total) break;
            float v0 = acc[i][0], v1 = acc[i][1];
            float* dst;
            if (direct) {
                const float l = l_s[i];
                const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                v0 *= inv;
                v1 *= inv;
                dst = a.out + (row / a.H) * a.out_st + (row % a.H) * a.out_sh + col;
            } else {
                dst = a.ws_o + (int64_t(split) * rows_total + row) * r + col;
            }
            *reinterpret_cast<float2*>(dst) = make_float2(v0, v1);
        }
    }
    if (!direct && tid < kRows) {
        const int row = tile * kRows + tid;
        if (row < rows_total) {
            a.ws_m[int64_t(split) * rows_total + row] = m_s[tid];
            a.ws_l[int64_t(split) * rows_total + row] = l_s[tid];
        }
    }
}

// out[row, cols] = Σ_s 2^(m_s − M)·o_s / Σ_s 2^(m_s − M)·l_s; warps stride over the splits.
__global__ void __launch_bounds__(kThreads) mla_decode_merge_kernel(const Args a) {
    __shared__ float part[kThreads / 32][kMergeCols];
    __shared__ float den[kThreads / 32];
    const int row = blockIdx.x, rows_total = a.T * a.H;
    const Plan plan = plan_of(a, row / kRows);
    if (plan.n_split <= 1) return;  // written directly
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float mx = -INFINITY;
    for (int s = lane; s < plan.n_split; s += 32)
        mx = fmaxf(mx, a.ws_m[int64_t(s) * rows_total + row]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const float m_use = mx == -INFINITY ? 0.0f : mx;
    const int col = blockIdx.y * kMergeCols + 2 * lane;
    float2 acc = make_float2(0.0f, 0.0f);
    float d = 0.0f;
    for (int s = warp; s < plan.n_split; s += kThreads / 32) {
        const float m = a.ws_m[int64_t(s) * rows_total + row];
        const float w = m == -INFINITY ? 0.0f : exp2f(m - m_use);
        d += w * a.ws_l[int64_t(s) * rows_total + row];
        if (col < a.r) {
            const float2 v = *reinterpret_cast<const float2*>(
                a.ws_o + (int64_t(s) * rows_total + row) * a.r + col);
            acc.x = fmaf(w, v.x, acc.x);
            acc.y = fmaf(w, v.y, acc.y);
        }
    }
    part[warp][2 * lane] = acc.x;
    part[warp][2 * lane + 1] = acc.y;
    if (lane == 0) den[warp] = d;
    __syncthreads();
    if (threadIdx.x < kMergeCols) {
        float v = 0.0f, dd = 0.0f;
        for (int w = 0; w < kThreads / 32; ++w) {
            v += part[w][threadIdx.x];
            dd += den[w];
        }
        const int c = blockIdx.y * kMergeCols + threadIdx.x;
        if (c < a.r)
            a.out[(row / a.H) * a.out_st + (row % a.H) * a.out_sh + c] = dd > 0.0f ? v / dd : 0.0f;
    }
}

size_t smem_bytes(bool pairs, int width) {
    return size_t(kRows) * width * 4 + size_t(kKeys) * k_stride_words(pairs, width) * 4 +
           size_t(kRows) * kKeys * 4 + 4 * kRows * 4;
}

[[noreturn]] void bad(const std::string& what) {
    ::mgl::fail(__FILE__, __LINE__, "mla decode (simt): " + what);
}

}  // namespace

bool mla_decode_simt_supported(const MlaAttnParams& p) {
    const int64_t r = p.cache.kv_lora_rank, rope = p.cache.rope_dim, w = r + rope;
    const bool known = p.cache.type == mgl::dtype::bf16 || p.cache.type == mgl::dtype::f16 ||
                       p.cache.type == mgl::dtype::f32;
    const int64_t elem = p.cache.type == mgl::dtype::f32 ? 4 : 2;
    return known && r % 2 == 0 && r <= 2 * kThreads && (w * elem) % 16 == 0 &&
           w * elem <= 1152 * (elem / 2) && (p.out_stride_t % 2 == 0) &&
           (p.out_stride_h % 2 == 0) && reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
}

size_t mla_decode_simt_workspace_bytes(int64_t rows, int64_t r, int max_splits) {
    const size_t slots = size_t(max_splits) * size_t(rows);
    return 2 * slots * 4 + 256 + slots * size_t(r) * 4;
}

void mla_decode_simt(const MlaAttnParams& p, cudaStream_t stream) {
    if (!mla_decode_simt_supported(p)) bad("unsupported shape or layout");
    const MlaCache& c = p.cache;
    if (!c.pages || !c.page_table || !p.positions || !p.q_lat || !p.q_pe || !p.out)
        bad("pages, page table, positions, q and out are required");
    const int64_t rows = p.T * p.H;
    if (rows < 1 || p.max_splits < 1 || p.max_splits > 4096) bad("rows / max_splits out of range");
    Args a{};
    a.pages = static_cast<const uint8_t*>(c.pages);
    a.type = c.type;
    if (c.page_size < 1 || c.page_size > (1 << 20) || c.max_pages > (1 << 30) ||
        c.n_pages > (1 << 30) || c.n_pages < 1)
        bad("page size / page counts out of range");
    a.page_size = int(c.page_size);
    a.page_shift = -1;
    for (int b = 0; b < 21; ++b)
        if ((int64_t(1) << b) == c.page_size) a.page_shift = b;
    a.max_pages = int(c.max_pages);
    a.n_pages = int(c.n_pages);
    a.page_table = c.page_table;
    a.r = int(c.kv_lora_rank);
    a.rope = int(c.rope_dim);
    a.width = a.r + a.rope;
    a.q_lat = p.q_lat;
    a.q_lat_st = p.q_lat_stride_t;
    a.q_lat_sh = p.q_lat_stride_h;
    a.q_pe = p.q_pe;
    a.q_pe_st = p.q_pe_stride_t;
    a.q_pe_sh = p.q_pe_stride_h;
    a.out = p.out;
    a.out_st = p.out_stride_t;
    a.out_sh = p.out_stride_h;
    a.positions = p.positions;
    a.T = int(p.T);
    a.H = int(p.H);
    a.scale_log2 = p.scale * 1.4426950408889634f;
    a.max_splits = p.max_splits;
    if (p.max_splits > 1) {
        const size_t need = mla_decode_simt_workspace_bytes(rows, c.kv_lora_rank, p.max_splits);
        if (!p.workspace || p.workspace_bytes < need)
            bad("workspace of " + std::to_string(p.workspace_bytes) + " bytes, " +
                std::to_string(need) + " needed");
        const size_t slots = size_t(p.max_splits) * size_t(rows);
        auto* base = static_cast<uint8_t*>(p.workspace);
        a.ws_m = reinterpret_cast<float*>(base);
        a.ws_l = a.ws_m + slots;
        a.ws_o = reinterpret_cast<float*>(base + (2 * slots * 4 + 255) / 256 * 256);
    }
    const size_t smem = smem_bytes(a.type != mgl::dtype::f32, a.width);
    const dim3 grid(unsigned(p.max_splits), unsigned((rows + kRows - 1) / kRows));
    auto launch = [&](auto kernel) {
        CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        kernel<<<grid, kThreads, smem, stream>>>(a);
    };
    auto launch_for = [&](auto page_type) {
        using PageT = decltype(page_type);
        if (a.width == 576) {  // DeepSeek-V2 / V2-Lite: r 512 + rope 64
            launch(mla_decode_simt_kernel<PageT, 576>);
        } else {
            launch(mla_decode_simt_kernel<PageT, 0>);
        }
    };
    if (a.type == mgl::dtype::bf16) {
        launch_for(__nv_bfloat16{});
    } else if (a.type == mgl::dtype::f16) {
        launch_for(__half{});
    } else {
        launch_for(float{});
    }
    CUDA_CHECK_LAUNCH();
    if (p.max_splits > 1) {
        const dim3 mgrid(unsigned(rows), unsigned((a.r + kMergeCols - 1) / kMergeCols));
        mla_decode_merge_kernel<<<mgrid, kThreads, 0, stream>>>(a);
        CUDA_CHECK_LAUNCH();
    }
}

}  // namespace minids::kernels
