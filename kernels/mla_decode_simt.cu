// MLA decode attention for a few query rows (decode: T·H rows, tiles of 16), on CUDA cores,
// built for latency: a block issues its query rows and its first chunk of cache rows in one go
// (one memory round trip), keeps the next chunk's loads in flight while it computes the current
// one, and the split partials are merged by a second, wide kernel.
//
//   kernel 1, grid (max_splits, row tiles): block (s, tile) takes keys [s·chunk, (s+1)·chunk) of
//            every row of the tile; chunk and the number of splits used are computed on the device
//            from positions[] (few splits for a short context, all of them for a long one), so
//            one captured graph serves every step. Scores in FP32 from the bf16/f32 cache rows,
//            online softmax (base 2), o += p·c. One split: the output is written directly.
//   kernel 2, grid (rows, r / 64): out = Σ_s 2^(m_s − m)·o_s / Σ_s 2^(m_s − m)·l_s.
//
// FP32 CUDA-core math costs ~16·1088 FMA per cached token for 16 heads, which stays under the
// bandwidth floor up to a few thousand tokens and is ~2x over it at 32K (docs/perf.md); long
// contexts are where a tensor-core version would pay.
#include <cuda_bf16.h>

#include <cmath>

#include "cuda_check.h"
#include "mla.h"

namespace minids::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kRows = 16;  // query rows (t, h) per block
constexpr int kKeys = 32;  // cache rows per chunk
constexpr int kMinKeysPerSplit = 64;
constexpr int kMergeCols = 64;

struct Args {
    const uint8_t* pages;
    bool bf16;
    int64_t page_size, max_pages, n_pages;
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
    const int64_t cap = a.max_pages * a.page_size;
    Plan p;
    const int64_t want_keys = int64_t(mx) + 1;
    p.n_keys = int(want_keys < cap ? want_keys : cap);
    const int want = max(1, (p.n_keys + kMinKeysPerSplit - 1) / kMinKeysPerSplit);
    const int splits = min(a.max_splits, want);
    p.chunk = ((p.n_keys + splits - 1) / splits + kKeys - 1) / kKeys * kKeys;
    p.n_split = max(1, (p.n_keys + p.chunk - 1) / p.chunk);
    return p;
}

__device__ inline const uint8_t* cache_row(const Args& a, int pos) {
    const int64_t page = a.page_table[pos / a.page_size];
    if (page < 0 || page >= a.n_pages) return nullptr;
    const int64_t row = page * a.page_size + pos % a.page_size;
    return a.pages + row * int64_t(a.width) * (a.bf16 ? 2 : 4);
}

// Shared memory: q [kRows][wq] f32 (pre-scaled), k [kKeys][wk] (bf16 pairs or f32), p
// [kRows][kKeys].
template <bool BF16>
__device__ inline int k_stride_words(int width) {
    // In 4-byte words, odd so that 16 lanes reading the same column of 16 rows hit 16 banks.
    const int words = BF16 ? (width + 1) / 2 : width;
    return words | 1;
}

template <bool BF16>
__global__ void __launch_bounds__(kThreads) mla_decode_simt_kernel(const Args a) {
    extern __shared__ __align__(16) float smem[];
    const int tile = blockIdx.y, split = blockIdx.x, tid = threadIdx.x;
    const Plan plan = plan_of(a, tile);
    if (split >= plan.n_split) return;  // uniform over the block
    const int rows_total = a.T * a.H;
    const int key0 = split * plan.chunk;
    const int key_end = min(plan.n_keys, key0 + plan.chunk);
    const int n_chunks = (key_end - key0 + kKeys - 1) / kKeys;

    const int W = a.width, r = a.r;
    const int wq = W | 1;  // q row stride in floats
    const int kw = k_stride_words<BF16>(W);
    float* q_s = smem;                                              // [kRows][wq]
    uint32_t* k_s = reinterpret_cast<uint32_t*>(q_s + kRows * wq);  // [kKeys][kw] words
    float* p_s = reinterpret_cast<float*>(k_s + kKeys * kw);        // [kRows][kKeys]
    float* alpha_s = p_s + kRows * kKeys;                           // [kRows]
    int* lim_s = reinterpret_cast<int*>(alpha_s + kRows);           // [kRows]

    // Cache rows are fetched as 16-byte pieces: `pieces` per row, spread over the threads.
    const int row_bytes = W * (BF16 ? 2 : 4);
    const int pieces = row_bytes / 16;
    const int total = kKeys * pieces;
    constexpr int kMaxLoads = (32 * 1152 / 16 + kThreads - 1) / kThreads * (BF16 ? 1 : 2);
    uint4 buf[kMaxLoads];
    auto load_chunk = [&](int c) {
        const int base = key0 + c * kKeys;
#pragma unroll
        for (int j = 0; j < kMaxLoads; ++j) {
            const int idx = tid + j * kThreads;
            buf[j] = make_uint4(0, 0, 0, 0);
            if (idx < total) {
                const int key = base + idx / pieces;
                if (key < key_end) {
                    const uint8_t* src = cache_row(a, key);
                    if (src) buf[j] = __ldg(reinterpret_cast<const uint4*>(src) + idx % pieces);
                }
            }
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
    for (int i = tid; i < kRows * W; i += kThreads) {
        const int lr = i / W, col = i % W, row = tile * kRows + lr;
        float v = 0.0f;
        if (row < rows_total) {
            const int t = row / a.H, h = row % a.H;
            v = col < r ? a.q_lat[t * a.q_lat_st + h * a.q_lat_sh + col]
                        : a.q_pe[t * a.q_pe_st + h * a.q_pe_sh + (col - r)];
        }
        q_s[lr * wq + col] = v * a.scale_log2;
    }
    if (tid < kRows) {
        const int row = tile * kRows + tid;
        lim_s[tid] = row < rows_total ? min(a.positions[row / a.H], plan.n_keys - 1) : -1;
    }

    // Scores: thread -> (row sr, keys sk and sk + 16).
    const int sr = tid / 16, sk = tid % 16;
    // Values: thread -> columns 2·tid + 512·j, all rows.
    constexpr int kColIters = 1;  // r <= 512
    float acc[kColIters][kRows][2];
#pragma unroll
    for (int j = 0; j < kColIters; ++j)
#pragma unroll
        for (int i = 0; i < kRows; ++i) acc[j][i][0] = acc[j][i][1] = 0.0f;
    float m_run = -INFINITY, l_run = 0.0f;  // per row, held by thread `row` (tid < kRows)

    for (int c = 0; c < n_chunks; ++c) {
        __syncthreads();  // the previous chunk's k_s and p_s are no longer read
        store_chunk();
        if (c + 1 < n_chunks) load_chunk(c + 1);
        __syncthreads();
        const int kbase = key0 + c * kKeys;

        // 1) scores s[row][key] = q_row · k_key (scaled, base 2), masked past the row's limit.
        float s0 = 0.0f, s1 = 0.0f;
        const float* qr = q_s + sr * wq;
        const uint32_t* k0 = k_s + sk * kw;
        const uint32_t* k1 = k_s + (sk + 16) * kw;
        if constexpr (BF16) {
#pragma unroll 8
            for (int w = 0; w < W / 2; ++w) {
                const float qa = qr[2 * w], qb = qr[2 * w + 1];
                const uint32_t u0 = k0[w], u1 = k1[w];
                s0 = fmaf(qa, __uint_as_float(u0 << 16), s0);
                s0 = fmaf(qb, __uint_as_float(u0 & 0xffff0000u), s0);
                s1 = fmaf(qa, __uint_as_float(u1 << 16), s1);
                s1 = fmaf(qb, __uint_as_float(u1 & 0xffff0000u), s1);
            }
        } else {
#pragma unroll 8
            for (int w = 0; w < W; ++w) {
                s0 = fmaf(qr[w], __uint_as_float(k0[w]), s0);
                s1 = fmaf(qr[w], __uint_as_float(k1[w]), s1);
            }
        }
        const int lim = lim_s[sr];
        p_s[sr * kKeys + sk] = kbase + sk <= lim ? s0 : -INFINITY;
        p_s[sr * kKeys + sk + 16] = kbase + sk + 16 <= lim ? s1 : -INFINITY;
        __syncthreads();

        // 2) online softmax per row, by thread `row`: chunk max, p = 2^(s − m), running sums.
        if (tid < kRows) {
            float m_chunk = -INFINITY;
            for (int k = 0; k < kKeys; ++k) m_chunk = fmaxf(m_chunk, p_s[tid * kKeys + k]);
            const float m_new = fmaxf(m_run, m_chunk);
            const float a_corr = m_new == -INFINITY ? 1.0f : exp2f(m_run - m_new);
            float sum = 0.0f;
            for (int k = 0; k < kKeys; ++k) {
                const float sc = p_s[tid * kKeys + k];
                const float pr = sc == -INFINITY ? 0.0f : exp2f(sc - m_new);
                p_s[tid * kKeys + k] = pr;
                sum += pr;
            }
            l_run = l_run * a_corr + sum;
            m_run = m_new;
            alpha_s[tid] = a_corr;
        }
        __syncthreads();

        // 3) o[row][col] = o·alpha + Σ_k p[row][k] · c_k[col]
#pragma unroll
        for (int j = 0; j < kColIters; ++j) {
            const int col = 2 * tid + j * 2 * kThreads;
            if (col >= r) break;
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                const float al = alpha_s[i];
                acc[j][i][0] *= al;
                acc[j][i][1] *= al;
            }
            for (int k = 0; k < kKeys; ++k) {
                float v0, v1;
                if constexpr (BF16) {
                    const uint32_t u = k_s[k * kw + col / 2];
                    v0 = __uint_as_float(u << 16);
                    v1 = __uint_as_float(u & 0xffff0000u);
                } else {
                    v0 = __uint_as_float(k_s[k * kw + col]);
                    v1 = __uint_as_float(k_s[k * kw + col + 1]);
                }
#pragma unroll
                for (int i = 0; i < kRows; ++i) {
                    const float p = p_s[i * kKeys + k];
                    acc[j][i][0] = fmaf(p, v0, acc[j][i][0]);
                    acc[j][i][1] = fmaf(p, v1, acc[j][i][1]);
                }
            }
        }
    }

    // Row statistics to shared memory for every thread.
    __syncthreads();
    if (tid < kRows) {
        alpha_s[tid] = m_run;
        p_s[tid] = l_run;
    }
    __syncthreads();
    const bool direct = plan.n_split == 1;
#pragma unroll
    for (int j = 0; j < kColIters; ++j) {
        const int col = 2 * tid + j * 2 * kThreads;
        if (col >= r) break;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const int row = tile * kRows + i;
            if (row >= rows_total) break;
            float v0 = acc[j][i][0], v1 = acc[j][i][1];
            float* dst;
            if (direct) {
                const float l = p_s[i];
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
            a.ws_m[int64_t(split) * rows_total + row] = alpha_s[tid];
            a.ws_l[int64_t(split) * rows_total + row] = p_s[tid];
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

size_t smem_bytes(bool bf16, int width) {
    const int wq = width | 1;
    const int kw = bf16 ? (((width + 1) / 2) | 1) : (width | 1);
    return size_t(kRows) * wq * 4 + size_t(kKeys) * kw * 4 + size_t(kRows) * kKeys * 4 + kRows * 4 +
           kRows * 4;
}

[[noreturn]] void bad(const std::string& what) {
    ::mgl::fail(__FILE__, __LINE__, "mla decode (simt): " + what);
}

}  // namespace

bool mla_decode_simt_supported(const MlaAttnParams& p) {
    const int64_t r = p.cache.kv_lora_rank, rope = p.cache.rope_dim, w = r + rope;
    const int64_t elem = p.cache.type == mgl::dtype::bf16 ? 2 : 4;
    return (p.cache.type == mgl::dtype::bf16 || p.cache.type == mgl::dtype::f32) && r % 2 == 0 &&
           r <= 2 * kThreads && (w * elem) % 16 == 0 && w * elem <= 1152 * (elem / 2) &&
           (p.out_stride_t % 2 == 0) && (p.out_stride_h % 2 == 0) &&
           reinterpret_cast<uintptr_t>(p.out) % 8 == 0;
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
    a.bf16 = c.type == mgl::dtype::bf16;
    a.page_size = c.page_size;
    a.max_pages = c.max_pages;
    a.n_pages = c.n_pages;
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
    const size_t smem = smem_bytes(a.bf16, a.width);
    const dim3 grid(unsigned(p.max_splits), unsigned((rows + kRows - 1) / kRows));
    if (a.bf16) {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_simt_kernel<true>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        mla_decode_simt_kernel<true><<<grid, kThreads, smem, stream>>>(a);
    } else {
        CUDA_CHECK(cudaFuncSetAttribute(mla_decode_simt_kernel<false>,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
        mla_decode_simt_kernel<false><<<grid, kThreads, smem, stream>>>(a);
    }
    CUDA_CHECK_LAUNCH();
    if (p.max_splits > 1) {
        const dim3 mgrid(unsigned(rows), unsigned((a.r + kMergeCols - 1) / kMergeCols));
        mla_decode_merge_kernel<<<mgrid, kThreads, 0, stream>>>(a);
        CUDA_CHECK_LAUNCH();
    }
}

}  // namespace minids::kernels
