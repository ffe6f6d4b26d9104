// GPU MLA benchmark (kernels/mla.h) on V2-Lite shapes (H = 16, r = 512, rope = 64, pages of 64):
//   decode attention (T = 1) at context 512, 4K, 32K with bf16, f16 and f32 pages: us per call
//     (attention + merge, replayed from a CUDA graph so launch overhead is the graph's), GB/s of
//     cache read and the share of the measured device copy bandwidth. Every call reads a
//     different copy of the cache (rotating over > 256 MB), so the figure is HBM, not L2.
//     Sweeps the tensor-core block shapes, the CUDA-core kernel and the split settings.
//   prefill attention (T = 512) at depth 0, 4K, 32K: TFLOP/s of causal attention math
//     (2·(r + rope + r) flops per query row and visible key).
//   the per-token kernels (kv_store, rope, rms_norm, mla_prep) at decode and prefill shapes.
// Each configuration's output is compared with the f32 CUDA-core kernel's on the same data
// ("vs f32" column: relative L2; ~1e-3 expected for tensor cores over bf16 and f32 pages, about
// 8x less over f16). Ends with a summary.
#include <cstdio>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>

#include "cuda_check.h"
#include "mla.h"
#include "rms_norm.h"
#include "rope.h"

using namespace minids::kernels;

namespace {

constexpr int64_t H = 16, R = 512, ROPE = 64, WIDTH = R + ROPE, PAGE = 64;

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

template <typename T>
T* dev_alloc(size_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    return static_cast<T*>(p);
}
template <typename T>
T* dev_upload(const std::vector<T>& host) {
    T* p = dev_alloc<T>(host.size());
    CUDA_CHECK(cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
std::vector<float> random_floats(size_t n, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> d(-1.f, 1.f);
    std::vector<float> v(n);
    for (auto& x : v) x = d(rng);
    return v;
}
double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    return std::sqrt(num / den);
}

// Device-to-device copy bandwidth (bytes read + written) over a 1 GiB buffer: the ceiling.
double copy_bandwidth_gbs() {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CUDA_CHECK(cudaMalloc(&a, bytes));
    CUDA_CHECK(cudaMalloc(&b, bytes));
    CUDA_CHECK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
        CUDA_CHECK(cudaEventRecord(e0));
        CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 2) ms.push_back(t);
    }
    cudaFree(a);
    cudaFree(b);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
}

// Median time of one call of `body(i)` (i = 0 .. n_calls-1), replayed as one CUDA graph.
template <class Fn>
double graph_us_per_call(cudaStream_t stream, int n_calls, Fn body) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < n_calls; ++i) body(i);
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int rep = 0; rep < 13; ++rep) {
        CUDA_CHECK(cudaEventRecord(e0, stream));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaEventRecord(e1, stream));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (rep >= 3) ms.push_back(t);
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    return double(median(ms)) * 1000.0 / n_calls;
}

// `copies` caches of n_ctx rows in one pool, each with its own scrambled page table, all holding
// the same random rows (so every copy gives the same output).
struct CachePool {
    mgl::dtype type;
    int64_t n_ctx, pages_per_copy;
    int copies;
    void* pages = nullptr;
    std::vector<int32_t*> tables;
    size_t elem() const { return type == mgl::dtype::f32 ? 4 : 2; }

    CachePool(mgl::dtype t, int64_t ctx, size_t min_total_bytes, int max_copies)
        : type(t), n_ctx(ctx) {
        pages_per_copy = (ctx + PAGE - 1) / PAGE;
        const size_t copy_bytes = size_t(pages_per_copy * PAGE * WIDTH) * elem();
        copies = int(std::min<size_t>(size_t(max_copies), min_total_bytes / copy_bytes + 1));
        CUDA_CHECK(cudaMalloc(&pages, copy_bytes * size_t(copies)));
        const auto rows = random_floats(size_t(pages_per_copy * PAGE * WIDTH), 7);
        std::vector<uint8_t> bytes(copy_bytes);
        for (size_t i = 0; i < rows.size(); ++i) {
            if (type != mgl::dtype::f32) {
                const uint16_t h =
                    type == mgl::dtype::f16 ? mgl::f32_to_f16(rows[i]) : mgl::f32_to_bf16(rows[i]);
                std::memcpy(&bytes[2 * i], &h, 2);
            } else {
                std::memcpy(&bytes[4 * i], &rows[i], 4);
            }
        }
        std::mt19937_64 rng(11);
        for (int c = 0; c < copies; ++c) {
            if (c == 0)
                CUDA_CHECK(cudaMemcpy(pages, bytes.data(), copy_bytes, cudaMemcpyHostToDevice));
            // Physical pages of copy c, scrambled within the copy; the same logical content:
            // logical page p holds rows p·PAGE.. of `rows`, so move the data to match the table.
            std::vector<int32_t> perm(static_cast<size_t>(pages_per_copy));
            std::iota(perm.begin(), perm.end(), 0);
            if (c > 0) std::shuffle(perm.begin(), perm.end(), rng);
            std::vector<int32_t> table(static_cast<size_t>(pages_per_copy));
            const size_t page_bytes = size_t(PAGE * WIDTH) * elem();
            for (int64_t p = 0; p < pages_per_copy; ++p) {
                table[size_t(p)] = int32_t(int64_t(c) * pages_per_copy + perm[size_t(p)]);
                if (c > 0)
                    CUDA_CHECK(cudaMemcpy(
                        static_cast<uint8_t*>(pages) + size_t(table[size_t(p)]) * page_bytes,
                        bytes.data() + size_t(p) * page_bytes, page_bytes, cudaMemcpyHostToDevice));
            }
            tables.push_back(dev_upload(table));
        }
    }
    ~CachePool() {
        cudaFree(pages);
        for (auto* t : tables) cudaFree(t);
    }
    MlaCache cache(int c) const {
        return {pages, type, pages_per_copy * copies, PAGE, tables[size_t(c)], pages_per_copy,
                R,     ROPE};
    }
};

struct DecodeConfig {
    std::string name;
    MlaImpl impl;
    int variant;
    int max_splits;  // 0: default
    int min_keys;    // 0: default
};

struct Best {
    double us = 1e30, gbs = 0, pct = 0;
    std::string name;
};

}  // namespace

int main() {
    int dev = 0, n_sm = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, dev));
    const double ceiling = copy_bandwidth_gbs();
    std::printf("device copy bandwidth (read+write): %.0f GB/s, %d SMs\n", ceiling, n_sm);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    // Shared decode inputs (T = 1).
    const auto q_host = random_floats(size_t(H * WIDTH), 3);
    std::vector<float> q_lat_h(size_t(H * R)), q_pe_h(size_t(H * ROPE));
    for (int64_t h = 0; h < H; ++h) {
        std::copy_n(&q_host[size_t(h * WIDTH)], R, &q_lat_h[size_t(h * R)]);
        std::copy_n(&q_host[size_t(h * WIDTH + R)], ROPE, &q_pe_h[size_t(h * ROPE)]);
    }
    float* q_lat = dev_upload(q_lat_h);
    float* q_pe = dev_upload(q_pe_h);
    float* out = dev_alloc<float>(size_t(H * R));
    int32_t* pos_dev = dev_alloc<int32_t>(512);
    const size_t ws_bytes = mla_attn_workspace_bytes(1, H, R, 4 * n_sm);  // prefill uses 1 split
    void* ws = dev_alloc<uint8_t>(ws_bytes);

    std::vector<DecodeConfig> configs;
    for (int v = 0; v < mla_attn_variant_count(MlaKernel::decode); ++v)
        configs.push_back({std::string("tc ") + mla_attn_variant_name(MlaKernel::decode, v),
                           MlaImpl::tensor_core, v, 0, 0});
    configs.push_back(
        {"tc rows16 warps1x4 keys32 stages2, 2/SM", MlaImpl::tensor_core, 3, 2 * n_sm, 0});
    configs.push_back({"simt decode (automatic)", MlaImpl::automatic, -1, 0, 0});
    configs.push_back({"simt decode, 2/SM", MlaImpl::automatic, -1, 2 * n_sm, 0});
    configs.push_back({"simt decode, 1/2 SM", MlaImpl::automatic, -1, n_sm / 2, 0});
    configs.push_back({"cuda_core f32 math", MlaImpl::cuda_core, -1, 0, 0});
    configs.push_back({"cuda_core f32 math, 2/SM", MlaImpl::cuda_core, -1, 2 * n_sm, 0});

    std::vector<std::pair<std::string, Best>> summary;
    std::printf("\n## decode attention, T = 1, H = %lld, r = %lld, rope = %lld, pages of %lld\n\n",
                (long long)H, (long long)R, (long long)ROPE, (long long)PAGE);
    std::printf(
        "| context | pages | kernel | max splits / min keys | us | GB/s | of copy bw | vs f32 |\n");
    std::printf("|---|---|---|---|---|---|---|---|\n");
    for (int64_t ctx : {512, 4096, 32768}) {
        for (mgl::dtype type : {mgl::dtype::bf16, mgl::dtype::f16, mgl::dtype::f32}) {
            CachePool pool(type, ctx, size_t(320) << 20, 200);
            const int32_t last = int32_t(ctx - 1);
            CUDA_CHECK(cudaMemcpy(pos_dev, &last, 4, cudaMemcpyHostToDevice));
            const double bytes = double(ctx) * WIDTH * double(pool.elem());
            auto params = [&](const DecodeConfig& c, int copy) {
                MlaAttnParams p;
                p.cache = pool.cache(copy);
                p.q_lat = q_lat;
                p.q_lat_stride_t = H * R;
                p.q_lat_stride_h = R;
                p.q_pe = q_pe;
                p.q_pe_stride_t = H * ROPE;
                p.q_pe_stride_h = ROPE;
                p.out = out;
                p.out_stride_t = H * R;
                p.out_stride_h = R;
                p.positions = pos_dev;
                p.T = 1;
                p.H = H;
                p.scale = 0.1f;
                p.max_splits = c.max_splits ? c.max_splits
                                            : mla_attn_default_max_splits(MlaKernel::decode, 1, H);
                p.min_keys_per_split = c.min_keys;
                p.impl = c.impl;
                p.variant = c.variant;
                p.workspace = ws;
                p.workspace_bytes = ws_bytes;
                return p;
            };
            // Reference output: the f32 CUDA-core kernel on copy 0.
            mla_decode(params({"", MlaImpl::cuda_core, -1, 0, 0}, 0), stream);
            CUDA_CHECK(cudaStreamSynchronize(stream));
            std::vector<float> ref(size_t(H * R)), got(size_t(H * R));
            CUDA_CHECK(cudaMemcpy(ref.data(), out, ref.size() * 4, cudaMemcpyDeviceToHost));

            std::vector<DecodeConfig> run = configs;
            if (ctx == 32768 && type == mgl::dtype::bf16) {
                for (int ms : {n_sm / 2, n_sm, 2 * n_sm, 4 * n_sm})
                    for (int mk : {32, 128, 512})
                        run.push_back({"tc default, sweep", MlaImpl::tensor_core, -1, ms, mk});
            }
            if (ctx == 512) {
                for (int mk : {16, 32, 128, 512})
                    run.push_back({"tc default, sweep", MlaImpl::tensor_core, -1, 0, mk});
            }
            Best best;
            for (const DecodeConfig& c : run) {
                try {
                    mla_decode(params(c, 0), stream);
                } catch (const mgl::error&) {
                    continue;  // variant not built for this page dtype
                }
                CUDA_CHECK(cudaStreamSynchronize(stream));
                CUDA_CHECK(cudaMemcpy(got.data(), out, got.size() * 4, cudaMemcpyDeviceToHost));
                const double diff = rel_l2(got, ref);
                const double us = graph_us_per_call(
                    stream, pool.copies, [&](int i) { mla_decode(params(c, i), stream); });
                const double gbs = bytes / (us * 1e-6) / 1e9;
                const MlaAttnParams p = params(c, 0);
                std::printf("| %lld | %s | %s | %d / %d | %.1f | %.0f | %.0f%% | %.1e |\n",
                            (long long)ctx, mgl::dtype_name(type), c.name.c_str(), p.max_splits,
                            c.min_keys ? c.min_keys : 64, us, gbs, 100.0 * gbs / ceiling, diff);
                if (us < best.us) {
                    char buf[160];
                    std::snprintf(buf, sizeof buf, "%s (max splits %d, min keys %d)",
                                  c.name.c_str(), p.max_splits, c.min_keys ? c.min_keys : 64);
                    best = {us, gbs, 100.0 * gbs / ceiling, buf};
                }
            }
            summary.push_back(
                {"decode ctx " + std::to_string(ctx) + " " + mgl::dtype_name(type), best});
        }
    }

    // ---- prefill ----
    std::printf("\n## prefill attention, T = 512, H = %lld (8192 query rows)\n\n", (long long)H);
    std::printf("| depth | pages | kernel | ms | TFLOP/s | vs f32 |\n|---|---|---|---|---|---|\n");
    const int64_t T = 512;
    const auto qp_host = random_floats(size_t(T * H * WIDTH), 5);
    float* pq = dev_upload(qp_host);  // [T, H, r + rope]: q_lat and q_pe are slices
    float* pout = dev_alloc<float>(size_t(T * H * R));
    std::vector<std::pair<std::string, double>> prefill_summary;
    for (int64_t depth : {0, 4096, 32768}) {
        for (mgl::dtype type : {mgl::dtype::bf16, mgl::dtype::f16, mgl::dtype::f32}) {
            if (type == mgl::dtype::f32 && depth == 32768) continue;
            CachePool pool(type, depth + T, 0, 1);
            std::vector<int32_t> pos(static_cast<size_t>(T));
            for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(depth + t);
            CUDA_CHECK(cudaMemcpy(pos_dev, pos.data(), size_t(T) * 4, cudaMemcpyHostToDevice));
            double flops = 0;
            for (int64_t t = 0; t < T; ++t)
                flops += double(H) * double(depth + t + 1) * 2.0 * (WIDTH + R);
            auto params = [&](MlaImpl impl, int variant) {
                MlaAttnParams p;
                p.cache = pool.cache(0);
                p.q_lat = pq;
                p.q_lat_stride_t = H * WIDTH;
                p.q_lat_stride_h = WIDTH;
                p.q_pe = pq + R;
                p.q_pe_stride_t = H * WIDTH;
                p.q_pe_stride_h = WIDTH;
                p.out = pout;
                p.out_stride_t = H * R;
                p.out_stride_h = R;
                p.positions = pos_dev;
                p.T = T;
                p.H = H;
                p.scale = 0.1f;
                p.max_splits = mla_attn_default_max_splits(MlaKernel::prefill, T, H);
                p.impl = impl;
                p.variant = variant;
                p.workspace = ws;
                p.workspace_bytes = ws_bytes;
                return p;
            };
            std::vector<float> ref(size_t(T * H * R)), got(ref.size());
            const bool have_ref = depth <= 4096;  // the f32 kernel is slow at 32K
            if (have_ref) {
                mla_prefill(params(MlaImpl::cuda_core, -1), stream);
                CUDA_CHECK(cudaStreamSynchronize(stream));
                CUDA_CHECK(cudaMemcpy(ref.data(), pout, ref.size() * 4, cudaMemcpyDeviceToHost));
            }
            std::vector<std::pair<MlaImpl, int>> runs;
            for (int v = 0; v < mla_attn_variant_count(MlaKernel::prefill); ++v)
                runs.push_back({MlaImpl::tensor_core, v});
            if (have_ref) runs.push_back({MlaImpl::cuda_core, -1});
            double best = 0;
            for (auto [impl, v] : runs) {
                std::string name =
                    impl == MlaImpl::cuda_core
                        ? "cuda_core f32 math"
                        : std::string("tc ") + mla_attn_variant_name(MlaKernel::prefill, v);
                try {
                    mla_prefill(params(impl, v), stream);
                } catch (const mgl::error&) {
                    continue;  // variant not built for this page dtype
                }
                CUDA_CHECK(cudaStreamSynchronize(stream));
                CUDA_CHECK(cudaMemcpy(got.data(), pout, got.size() * 4, cudaMemcpyDeviceToHost));
                const double diff = have_ref ? rel_l2(got, ref) : NAN;
                const double us = graph_us_per_call(
                    stream, 3, [&](int) { mla_prefill(params(impl, v), stream); });
                const double tflops = flops / (us * 1e-6) / 1e12;
                std::printf("| %lld | %s | %s | %.3f | %.1f | %.1e |\n", (long long)depth,
                            mgl::dtype_name(type), name.c_str(), us / 1000.0, tflops, diff);
                if (impl == MlaImpl::tensor_core) best = std::max(best, tflops);
            }
            prefill_summary.push_back(
                {"prefill T 512 depth " + std::to_string(depth) + " " + mgl::dtype_name(type),
                 best});
        }
    }

    // ---- per-token kernels ----
    std::printf(
        "\n## per-token kernels (graph-replayed, us per call)\n\n| kernel | T | us "
        "|\n|---|---|---|\n");
    {
        CachePool pool(mgl::dtype::bf16, 4096, 0, 1);
        const auto rp =
            mgl::rope_params_yarn(int(ROPE), 10000.f, 40.f, 4096, 32.f, 1.f, 0.707f, 0.707f);
        float* inv_freq = dev_upload(rp.inv_freq);
        float* kv = dev_upload(random_floats(size_t(T * WIDTH), 9));
        float* qbuf = dev_upload(random_floats(size_t(T * H * (128 + ROPE)), 10));
        float* normed = dev_alloc<float>(size_t(T * R));
        std::vector<uint16_t> w(size_t(R), mgl::f32_to_bf16(1.0f));
        uint16_t* wdev = dev_upload(w);
        std::vector<int32_t> pos(static_cast<size_t>(T));
        std::iota(pos.begin(), pos.end(), 100);
        CUDA_CHECK(cudaMemcpy(pos_dev, pos.data(), size_t(T) * 4, cudaMemcpyHostToDevice));
        for (int64_t t_count : {int64_t(1), T}) {
            KvStoreParams ks;
            ks.cache = pool.cache(0);
            ks.c = kv;
            ks.c_stride = WIDTH;
            ks.k_pe = kv + R;
            ks.k_pe_stride = WIDTH;
            ks.positions = pos_dev;
            ks.T = t_count;
            RopeParams rq;
            rq.x = rq.y = qbuf + 128;
            rq.x_stride_t = rq.y_stride_t = H * (128 + ROPE);
            rq.x_stride_h = rq.y_stride_h = 128 + ROPE;
            rq.positions = pos_dev;
            rq.inv_freq = inv_freq;
            rq.attn_factor = rp.attn_factor;
            rq.T = t_count;
            rq.H = H;
            rq.n_dims = ROPE;
            RmsNormParams rn;
            rn.x = kv;
            rn.x_stride = WIDTH;
            rn.y = normed;
            rn.w = wdev;
            rn.rows = t_count;
            rn.dim = R;
            MlaPrepParams mp;
            mp.cache = pool.cache(0);
            mp.positions = pos_dev;
            mp.T = t_count;
            mp.H = H;
            mp.kv = kv;
            mp.kv_stride = WIDTH;
            mp.kv_norm_w = wdev;
            mp.inv_freq = inv_freq;
            mp.attn_factor = rp.attn_factor;
            mp.q_pe_in = mp.q_pe_out = qbuf + 128;
            mp.q_pe_in_stride_t = mp.q_pe_out_stride_t = H * (128 + ROPE);
            mp.q_pe_in_stride_h = mp.q_pe_out_stride_h = 128 + ROPE;
            const double us_store =
                graph_us_per_call(stream, 100, [&](int) { kv_store(ks, stream); });
            const double us_rope = graph_us_per_call(stream, 100, [&](int) { rope(rq, stream); });
            const double us_norm =
                graph_us_per_call(stream, 100, [&](int) { rms_norm(rn, stream); });
            const double us_prep =
                graph_us_per_call(stream, 100, [&](int) { mla_prep(mp, stream); });
            std::printf(
                "| kv_store | %lld | %.2f |\n| rope q_pe (H=16) | %lld | %.2f |\n"
                "| rms_norm c (512) | %lld | %.2f |\n| mla_prep (all of the above + k_pe rope) | "
                "%lld | %.2f |\n",
                (long long)t_count, us_store, (long long)t_count, us_rope, (long long)t_count,
                us_norm, (long long)t_count, us_prep);
        }
        cudaFree(inv_freq);
        cudaFree(kv);
        cudaFree(qbuf);
        cudaFree(normed);
        cudaFree(wdev);
    }

    std::printf("\n## summary (target: decode at 32K bf16 >= 70%% of copy bandwidth)\n\n");
    for (auto& [what, b] : summary)
        std::printf("%-24s best %7.1f us  %5.0f GB/s  %3.0f%% of copy bw  %s\n", what.c_str(), b.us,
                    b.gbs, b.pct, b.name.c_str());
    for (auto& [what, tf] : prefill_summary)
        std::printf("%-32s best tensor-core %.1f TFLOP/s\n", what.c_str(), tf);
    cudaFree(q_lat);
    cudaFree(q_pe);
    cudaFree(out);
    cudaFree(pos_dev);
    cudaFree(ws);
    cudaFree(pq);
    cudaFree(pout);
    cudaStreamDestroy(stream);
    return 0;
}
#else
int main() {
    std::fprintf(stderr, "bench_mla_cuda: built without CUDA\n");
    return 1;
}
#endif
