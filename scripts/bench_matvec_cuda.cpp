// GPU matrix products (kernels/matmul.h) on DeepSeek-V2-Lite shapes: decode GEMV (M = 1) for BF16
// and FP8 + row scale against the measured memory bandwidth, the kernel configurations swept,
// the GEMV/GEMM crossover in M, prefill GEMM (M = 512) in TFLOP/s, MLA's batched head products
// and the RMSNorm / residual fusions. Ends with a summary table.
//
// Timing: CUDA events, median of repeats, after warm-up. Every launch reads a different copy of
// W (rotating over >= 256 MB, five times the 50 MB L2), so the figures are HBM, not cache.
//   stream: back-to-back launches queued behind a spinning kernel, one event between each pair,
//           so host launch latency is hidden (a kernel's own ramp-up and tail are not);
//   graph:  20 launches captured in one CUDA graph, replayed: time per launch as decode sees it.
// Bandwidth: device-to-device copy (bytes read + written) and a read-only kernel (16-byte loads).
// Every kernel variant's output is compared with the FP32 generic kernel ("check" column).
//
// Usage: bench_matvec_cuda [--quick] [--stream-sweep]   (--quick: fewer repeats, no
// configuration sweep; --stream-sweep: only the stream GEMV's shapes on the decode products,
// chained by PDL in a graph, about a minute)
#include <cstdio>
#include <cstring>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>

#include "cuda_check.h"
#include "matmul.h"

using namespace minids::kernels;

namespace {

constexpr size_t rotate_bytes = size_t(256) << 20;
constexpr int graph_launches = 20;
int repeats = 15;

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

__global__ void spin_kernel(long long ns) {
    long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while (now - start < ns);
}

__global__ void empty_kernel() {}

__device__ uint32_t hash32(uint64_t i, uint32_t seed) {
    uint64_t h = i * 0x9e3779b97f4a7c15ull + seed;
    h ^= h >> 31;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return uint32_t(h);
}

// Random finite weights: bf16 magnitudes in [2^-7, 2), e4m3 bytes with the top exponent bit
// clear (never NaN), f32 x in [-1, 1).
__global__ void fill_kernel(void* p, size_t n, uint32_t seed, int kind) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint32_t h = hash32(i, seed);
        if (kind == 0) static_cast<uint16_t*>(p)[i] = uint16_t(0x3c00u | (h & 0x83ffu));
        if (kind == 1) static_cast<uint8_t*>(p)[i] = uint8_t(h & 0xbfu);
        if (kind == 2) static_cast<float*>(p)[i] = float(h) / 2147483648.0f - 1.0f;
        if (kind == 3) static_cast<float*>(p)[i] = 0.01f + float(h & 0xffff) * 1e-7f;
    }
}

__global__ void read_kernel(const uint4* p, size_t n, unsigned* sink) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}

void fill(void* p, size_t n, uint32_t seed, int kind) {
    fill_kernel<<<1024, 256>>>(p, n, seed, kind);
    CUDA_CHECK_LAUNCH();
}

struct Events {
    std::vector<cudaEvent_t> e;
    explicit Events(size_t n) : e(n) {
        for (auto& x : e) CUDA_CHECK(cudaEventCreate(&x));
    }
    ~Events() {
        for (auto& x : e) cudaEventDestroy(x);
    }
    double us(size_t a, size_t b) const {
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e[a], e[b]));
        return double(ms) * 1000.0;
    }
};

// Median microseconds per launch of `launch(i)`, queued back to back behind a spinning kernel.
double time_stream(const std::function<void(int)>& launch, cudaStream_t s) {
    for (int i = 0; i < 3; ++i) launch(i);
    const int n = 2 * repeats;
    Events ev(size_t(n) + 1);
    spin_kernel<<<1, 1, 0, s>>>(1000000);  // 1 ms: the host queues everything meanwhile
    CUDA_CHECK(cudaEventRecord(ev.e[0], s));
    for (int i = 0; i < n; ++i) {
        launch(i);
        CUDA_CHECK(cudaEventRecord(ev.e[size_t(i) + 1], s));
    }
    CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<double> t;
    for (int i = 0; i < n; ++i) t.push_back(ev.us(size_t(i), size_t(i) + 1));
    return median(t);
}

// Median microseconds per launch with `graph_launches` launches captured in one graph. A launch
// that fails during capture ends the capture (so the stream stays usable) and rethrows.
double time_graph(const std::function<void(int)>& launch, cudaStream_t s) {
    cudaGraph_t graph = nullptr;
    CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    try {
        for (int i = 0; i < graph_launches; ++i) launch(i);
    } catch (...) {
        cudaStreamEndCapture(s, &graph);
        if (graph) cudaGraphDestroy(graph);
        cudaGetLastError();
        throw;
    }
    CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    Events ev(2);
    std::vector<double> t;
    for (int r = 0; r < std::max(3, repeats / 3); ++r) {
        CUDA_CHECK(cudaEventRecord(ev.e[0], s));
        CUDA_CHECK(cudaGraphLaunch(exec, s));
        CUDA_CHECK(cudaEventRecord(ev.e[1], s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        t.push_back(ev.us(0, 1) / graph_launches);
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    return median(t);
}

struct Bandwidth {
    double copy_gbs = 0, read_gbs = 0;
};

Bandwidth measure_bandwidth(cudaStream_t s) {
    const size_t bytes = size_t(2) << 30;
    void *a, *b;
    unsigned* sink;
    CUDA_CHECK(cudaMalloc(&a, bytes));
    CUDA_CHECK(cudaMalloc(&b, bytes));
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&sink), 4));
    fill(a, bytes / 4, 1, 2);
    Events ev(2);
    std::vector<double> copy, read;
    for (int i = 0; i < 12; ++i) {
        CUDA_CHECK(cudaEventRecord(ev.e[0], s));
        CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaEventRecord(ev.e[1], s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (i >= 2) copy.push_back(2.0 * double(bytes) / (ev.us(0, 1) * 1e-6) / 1e9);
        CUDA_CHECK(cudaEventRecord(ev.e[0], s));
        read_kernel<<<132 * 16, 512, 0, s>>>(static_cast<const uint4*>(a), bytes / 16, sink);
        CUDA_CHECK(cudaEventRecord(ev.e[1], s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        if (i >= 2) read.push_back(double(bytes) / (ev.us(0, 1) * 1e-6) / 1e9);
    }
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaFree(sink));
    return {median(copy), median(read)};
}

// Device memory owned for one benchmark case.
struct Buffer {
    void* p = nullptr;
    explicit Buffer(size_t bytes) { CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 256))); }
    ~Buffer() { cudaFree(p); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    float* f() const { return static_cast<float*>(p); }
};

// One weight shape in `copies` rotating copies, with x, y, scale, residual, norm weight and a
// workspace large enough for every variant run on it.
struct Setup {
    int64_t batch, n, k, max_m;
    mgl::dtype type;
    size_t w_bytes;
    int copies;
    std::vector<Buffer*> w;
    Buffer *x, *y, *ref, *scale, *residual, *norm, *ws;
    size_t ws_bytes = size_t(256) << 20;
    int64_t ref_m = 0;  // M of the reference output in `ref` (0: none yet)
    Setup(mgl::dtype t, int64_t b, int64_t n_, int64_t k_, int64_t m)
        : batch(b), n(n_), k(k_), max_m(m), type(t) {
        w_bytes = size_t(b * n * k) * mgl::dtype_size(t);
        copies = int(std::max<size_t>(2, (rotate_bytes + w_bytes - 1) / w_bytes));
        for (int i = 0; i < copies; ++i) {
            w.push_back(new Buffer(w_bytes));
            fill(w.back()->p, w_bytes / mgl::dtype_size(t), 100 + uint32_t(i),
                 t == mgl::dtype::bf16 ? 0 : 1);
        }
        x = new Buffer(size_t(b * m * k) * 4);
        y = new Buffer(size_t(b * m * n) * 4);
        ref = new Buffer(size_t(b * m * n) * 4);
        residual = new Buffer(size_t(b * m * n) * 4);
        scale = new Buffer(size_t(b * n) * 4);
        norm = new Buffer(size_t(k) * 4);
        ws = new Buffer(ws_bytes);
        fill(x->p, size_t(b * m * k), 7, 2);
        fill(residual->p, size_t(b * m * n), 8, 2);
        fill(scale->p, size_t(b * n), 9, 3);
        fill(norm->p, size_t(k), 10, 2);
        CUDA_CHECK(cudaMemset(ws->p, 0, ws_bytes));
        CUDA_CHECK(cudaDeviceSynchronize());
    }
    ~Setup() {
        for (auto* b : w) delete b;
        for (auto* b : {x, y, ref, residual, scale, norm, ws}) delete b;
    }
    MatmulParams params(int64_t m, int copy) const {
        MatmulParams p = matmul_params_contiguous(
            type, w[size_t(copy % copies)]->p, type == mgl::dtype::f8_e4m3 ? scale->f() : nullptr,
            x->f(), y->f(), batch, m, n, k);
        return p;
    }
};

struct Shape {
    const char* name;
    int64_t n, k;
};
const Shape shapes[] = {
    {"q_proj", 3072, 2048},         {"kv_a_proj", 576, 2048},       {"q+kv_a merged", 3648, 2048},
    {"o_proj", 2048, 2048},         {"shared gate/up", 2816, 2048}, {"shared down", 2048, 2816},
    {"dense gate/up", 10944, 2048}, {"dense down", 2048, 10944},    {"expert gate/up", 1408, 2048},
    {"expert down", 2048, 1408},    {"lm_head", 102400, 2048},      {"router", 64, 2048},
};

const char* tname(mgl::dtype t) { return t == mgl::dtype::bf16 ? "bf16" : "f8"; }

double rel_l2(const std::vector<float>& a, const std::vector<float>& b) {
    double num = 0, den = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        den += double(b[i]) * b[i];
    }
    return std::sqrt(num / std::max(den, 1e-300));
}

// Runs `p` once on copy 0 and compares y with the generic FP32 kernel's output (computed once
// per Setup and M into s.ref). Returns the relative L2 difference, or -1 if the variant throws.
double check_against_generic(Setup& s, MatmulParams p, const MatmulResources& r) {
    const size_t count = size_t(s.batch * p.m * s.n);
    try {
        if (s.ref_m != p.m) {
            MatmulParams g = p;
            g.w = s.w[0]->p;
            g.y = s.ref->f();
            g.path = MatmulPath::generic;
            matmul(g, r, nullptr);
            s.ref_m = p.m;
        }
        p.w = s.w[0]->p;
        matmul(p, r, nullptr);
    } catch (const mgl::error& e) {
        std::printf("    (variant refused: %s)\n", e.what());
        return -1;
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got(count), want(count);
    CUDA_CHECK(cudaMemcpy(got.data(), s.y->p, count * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(want.data(), s.ref->p, count * 4, cudaMemcpyDeviceToHost));
    return rel_l2(got, want);
}

struct Row {
    std::string shape;
    double mb[2] = {}, stream_us[2] = {}, graph_us[2] = {}, pdl_us[2] = {}, best_graph_us[2] = {};
    std::string best[2];
};

}  // namespace

// The stream GEMV's shapes (warps, loads in flight, rows per warp) on the decode products, M = 1,
// each launch in a graph of launches chained by PDL as in the decode step; with the norm
// prologue where the model has one ([q | kv_a]) and the residual epilogue where it has one
// (o_proj). Each variant is checked against the generic FP32 kernel first.
// The sweep's columns: auto (-1), plan 2's auto (-2), then every forced configuration.
std::vector<int> stream_columns() {
    std::vector<int> cols{-1, -2};
    for (int c = 0; c < matmul_stream_config_count(); ++c) cols.push_back(c);
    return cols;
}

void stream_sweep(cudaStream_t s, cublasHandle_t blas, double copy_gbs) {
    struct Case {
        const char* name;
        int64_t batch, n, k;
        bool norm, residual;
    };
    const Case cases[] = {
        {"q+kv_a merged + norm", 1, 3648, 2048, true, false},
        {"o_proj + residual", 1, 2048, 2048, false, true},
        {"router", 1, 64, 2048, false, false},
        {"W_uk per head (16 x 512x128)", 16, 512, 128, false, false},
        {"W_uv per head (16 x 128x512)", 16, 128, 512, false, false},
        {"shared gate/up", 1, 2816, 2048, false, false},
        {"dense gate/up", 1, 10944, 2048, false, false},
        {"dense down + residual", 1, 2048, 10944, false, true},
        {"lm_head + norm", 1, 102400, 2048, true, false},
    };
    std::printf("## stream GEMV shapes, M = 1, graph + PDL (us per launch; GB/s of W)\n\n");
    // Column "auto" is the plan the model gets (stream_config -1), "plan 2" the one
    // MINIDS_STREAM_PLAN=2 gives it; the others are forced.
    std::printf("| product | dtype | MB | auto | plan 2 |");
    for (int c = 0; c < matmul_stream_config_count(); ++c)
        std::printf(" %s |", matmul_stream_config_name(c).c_str());
    std::printf(" best |\n|---|---|---|");
    for (int c = 0; c <= matmul_stream_config_count() + 2; ++c) std::printf("---|");
    std::printf("\n");
    for (const Case& cs : cases) {
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            if (cs.batch > 1 && t == mgl::dtype::f8_e4m3) continue;  // the model's are bf16
            Setup st(t, cs.batch, cs.n, cs.k, 1);
            const MatmulResources res{blas, st.ws->p, st.ws_bytes};
            // cfg -2: the automatic shape under stream plan 2.
            auto with = [&](int copy, int cfg) {
                MatmulParams q = st.params(1, copy);
                q.path = MatmulPath::stream;
                q.stream_config = cfg == -2 ? -1 : cfg;
                if (cfg == -2) q.stream_plan = 2;
                q.pdl = true;
                if (cs.norm) {
                    q.rms_norm = true;
                    q.norm_w = st.norm->p;
                    q.norm_w_type = mgl::dtype::f32;
                }
                if (cs.residual) q.residual = st.residual->f();
                return q;
            };
            std::printf("| %s | %s | %.1f |", cs.name, tname(t), double(st.w_bytes) / 1e6);
            double best_us = 1e30;
            std::string best = "-";
            for (int cfg : stream_columns()) {
                const double err = check_against_generic(st, with(0, cfg), res);
                if (err < 0 || err > 1e-4 || std::isnan(err)) {
                    std::printf(" %s |", err < 0 ? "refused" : "BAD");
                    continue;
                }
                const double us = time_graph([&](int i) { matmul(with(i, cfg), res, s); }, s);
                std::printf(" %.2f (%.0f) |", us, double(st.w_bytes) / (us * 1e3));
                if (cfg >= 0 && us < best_us) best_us = us, best = matmul_stream_config_name(cfg);
            }
            std::printf(" %s, %.0f%% of copy bw |\n", best.c_str(),
                        100.0 * double(st.w_bytes) / (best_us * 1e3) / copy_gbs);
            std::fflush(stdout);
        }
    }
}

static int run(int argc, char** argv) {
    bool quick = false, stream_only = false;
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "--quick") == 0) {
            quick = true;
        } else if (std::strcmp(argv[i], "--stream-sweep") == 0) {
            stream_only = true;
        } else {
            std::fprintf(stderr, "usage: bench_matvec_cuda [--quick] [--stream-sweep]\n");
            return 2;
        }
    }
    if (quick) repeats = 7;
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20);
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cublasHandle_t blas;
    if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasCreate failed\n");
        return 1;
    }
    Buffer cublas_ws(size_t(64) << 20);
    if (cublasSetWorkspace(blas, cublas_ws.p, size_t(64) << 20) != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cublasSetWorkspace failed\n");
        return 1;
    }

    const Bandwidth bw = measure_bandwidth(s);
    std::printf("bandwidth: device copy %.0f GB/s (read + write), read-only kernel %.0f GB/s\n",
                bw.copy_gbs, bw.read_gbs);
    const double empty_graph_us = time_graph([&](int) { empty_kernel<<<1, 32, 0, s>>>(); }, s);
    const double empty_stream_us = time_stream([&](int) { empty_kernel<<<1, 32, 0, s>>>(); }, s);
    std::printf("empty kernel: %.2f us per launch queued on a stream, %.2f us per graph node\n\n",
                empty_stream_us, empty_graph_us);
    auto pct = [&](double gbs) { return 100.0 * gbs / bw.copy_gbs; };
    if (stream_only) {
        stream_sweep(s, blas, bw.copy_gbs);
        return 0;
    }

    // ---- 1. decode GEMV, M = 1: automatic plan, then the configuration sweep ----
    std::printf("## GEMV, M = 1 (automatic plan)\n\n");
    std::printf(
        "| shape | N x K | dtype | MB | plan | stream us | GB/s | %% copy bw | graph us "
        "| GB/s | %% copy bw | graph+PDL us | %% copy bw | check |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::vector<Row> rows;
    for (const Shape& sh : shapes) {
        Row row;
        row.shape = std::string(sh.name) + " " + std::to_string(sh.n) + "x" + std::to_string(sh.k);
        for (int ti = 0; ti < 2; ++ti) {
            const mgl::dtype t = ti == 0 ? mgl::dtype::bf16 : mgl::dtype::f8_e4m3;
            Setup st(t, 1, sh.n, sh.k, 16);
            const MatmulResources res{blas, st.ws->p, st.ws_bytes};
            const MatmulParams p1 = st.params(1, 0);
            const double err = check_against_generic(st, p1, res);
            auto launch = [&](int i) { matmul(st.params(1, i), res, s); };
            auto launch_pdl = [&](int i) {
                MatmulParams q = st.params(1, i);
                q.pdl = true;
                matmul(q, res, s);
            };
            const double us_s = time_stream(launch, s), us_g = time_graph(launch, s);
            double us_p = NAN;  // PDL needs a driver that captures programmatic edges
            try {
                us_p = time_graph(launch_pdl, s);
            } catch (const mgl::error& e) {
                std::printf("    (graph with PDL failed: %s)\n", e.what());
            }
            const double mb = double(st.w_bytes) / 1e6;
            auto gbs = [&](double us) { return double(st.w_bytes) / (us * 1e3); };
            std::printf(
                "| %s | %lldx%lld | %s | %.1f | %s | %.2f | %.0f | %.0f%% | %.2f | %.0f | "
                "%.0f%% | %.2f | %.0f%% | %s %.1e |\n",
                sh.name, (long long)sh.n, (long long)sh.k, tname(t), mb,
                matmul_describe(p1).c_str(), us_s, gbs(us_s), pct(gbs(us_s)), us_g, gbs(us_g),
                pct(gbs(us_g)), us_p, pct(gbs(us_p)), err >= 0 && err < 1e-4 ? "ok" : "BAD", err);
            std::fflush(stdout);
            row.mb[ti] = mb;
            row.stream_us[ti] = us_s;
            row.graph_us[ti] = us_g;
            row.pdl_us[ti] = us_p;
            row.best_graph_us[ti] = us_g;
            row.best[ti] = "auto";
            if (quick) continue;
            // sweep: every configuration at a few split factors (graph timing)
            std::string line = "    sweep " + std::string(sh.name) + " " + tname(t) + ": ";
            for (int cfg = 0; cfg < matmul_gemv_config_count(); ++cfg) {
                double best_cfg = 1e30;
                int best_split = 0;
                for (int split : {1, 2, 4, 8, 16}) {
                    MatmulParams v = p1;
                    v.gemv_config = cfg;
                    v.gemv_split = split;
                    v.path = MatmulPath::gemv;
                    const double e = check_against_generic(st, v, res);
                    if (e < 0) continue;
                    const double us = time_graph(
                        [&](int i) {
                            MatmulParams q = st.params(1, i);
                            q.gemv_config = cfg;
                            q.gemv_split = split;
                            matmul(q, res, s);
                        },
                        s);
                    if (e > 1e-4 || std::isnan(e))
                        std::printf("    BAD: cfg %d split %d relative error %.2e\n", cfg, split,
                                    e);
                    if (us < best_cfg) best_cfg = us, best_split = split;
                    if (us < row.best_graph_us[ti]) {
                        row.best_graph_us[ti] = us;
                        row.best[ti] =
                            "cfg " + std::to_string(cfg) + " split " + std::to_string(split);
                    }
                }
                char buf[64];
                std::snprintf(buf, sizeof buf, "c%d/s%d %.2f  ", cfg, best_split, best_cfg);
                line += buf;
            }
            std::printf("%s(us per launch, graph)\n", line.c_str());
        }
        rows.push_back(row);
    }

    // ---- 2. GEMV vs GEMM over M: where the crossover lies ----
    std::printf("\n## GEMV vs GEMM (cuBLAS) by M, graph us per launch\n\n");
    std::printf("| shape | dtype | path | M=1 | 2 | 4 | 8 | 12 | 16 | 24 | 32 | 64 |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    const int64_t ms[] = {1, 2, 4, 8, 12, 16, 24, 32, 64};
    for (const Shape& sh : {shapes[3], shapes[6], shapes[7]}) {
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            Setup st(t, 1, sh.n, sh.k, 64);
            const MatmulResources res{blas, st.ws->p, st.ws_bytes};
            for (MatmulPath path : {MatmulPath::stream, MatmulPath::gemv, MatmulPath::gemm}) {
                std::printf("| %s %lldx%lld | %s | %s |", sh.name, (long long)sh.n, (long long)sh.k,
                            tname(t), matmul_path_name(path));
                for (int64_t m : ms) {
                    if ((path == MatmulPath::gemv && m > matmul_gemv_max_m()) ||
                        (path == MatmulPath::stream && m > 8)) {
                        std::printf(" - |");
                        continue;
                    }
                    const double us = time_graph(
                        [&](int i) {
                            MatmulParams q = st.params(m, i);
                            q.path = path;
                            matmul(q, res, s);
                        },
                        s);
                    std::printf(" %.2f |", us);
                }
                std::printf("\n");
                std::fflush(stdout);
            }
        }
    }

    // ---- 3. prefill GEMM, M = 512 ----
    std::printf("\n## Prefill GEMM, M = 512 (cuBLAS; x -> bf16, f8 dequantized to bf16)\n\n");
    std::printf("| shape | dtype | plan | graph us | TFLOP/s |\n|---|---|---|---|---|\n");
    for (const Shape& sh : shapes) {
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            Setup st(t, 1, sh.n, sh.k, 512);
            const MatmulResources res{blas, st.ws->p, st.ws_bytes};
            const MatmulParams p = st.params(512, 0);
            if (matmul_workspace_bytes(p) > st.ws_bytes) continue;
            const double us = time_graph([&](int i) { matmul(st.params(512, i), res, s); }, s);
            std::printf("| %s %lldx%lld | %s | %s | %.1f | %.0f |\n", sh.name, (long long)sh.n,
                        (long long)sh.k, tname(t), matmul_describe(p).c_str(), us,
                        2.0 * 512 * double(sh.n) * double(sh.k) / (us * 1e-6) / 1e12);
            std::fflush(stdout);
        }
    }

    // ---- 4. MLA's per-head products (batched over 16 heads, M = 1) ----
    std::printf("\n## MLA per-head products, 16 heads, M = 1, bf16\n\n");
    std::printf("| product | layout | plan | graph us | GB/s |\n|---|---|---|---|---|\n");
    {
        // q_nope · W_uk: W_uk [16, 128 (nope), 512 (r)] stored, used as [16, 512, 128] view
        Setup st(mgl::dtype::bf16, 16, 512, 128, 1);
        const MatmulResources res{blas, st.ws->p, st.ws_bytes};
        auto col = [&](int i) {
            MatmulParams p = st.params(1, i);
            p.w_row_stride = 2;        // n contiguous
            p.w_col_stride = 512 * 2;  // k: rows of the stored [nope, r] matrix
            return p;
        };
        const double err = check_against_generic(st, col(0), res);
        const double us = time_graph([&](int i) { matmul(col(i), res, s); }, s);
        std::printf(
            "| q_nope · W_uk [16, 512, 128] | column (transposed view) | %s | %.2f | %.0f "
            "| check %.1e\n",
            matmul_describe(col(0)).c_str(), us, double(st.w_bytes) / (us * 1e3), err);
        const double us_rows = time_graph([&](int i) { matmul(st.params(1, i), res, s); }, s);
        std::printf("| same bytes stored row-major [16, 512, 128] | rows | %s | %.2f | %.0f |\n",
                    matmul_describe(st.params(1, 0)).c_str(), us_rows,
                    double(st.w_bytes) / (us_rows * 1e3));
    }
    {
        Setup st(mgl::dtype::bf16, 16, 128, 512, 1);  // o_lat [16, 1, 512] · W_uv [16, 128, 512]
        const MatmulResources res{blas, st.ws->p, st.ws_bytes};
        const double us = time_graph([&](int i) { matmul(st.params(1, i), res, s); }, s);
        std::printf("| o_lat · W_uv [16, 128, 512] | rows | %s | %.2f | %.0f |\n",
                    matmul_describe(st.params(1, 0)).c_str(), us, double(st.w_bytes) / (us * 1e3));
    }

    // ---- 5. fusions on o_proj-sized and q+kv_a-sized products, M = 1 ----
    std::printf("\n## Fusions, M = 1, graph us per launch\n\n");
    std::printf(
        "| shape | dtype | plain | + residual | + rms_norm | + both |\n|---|---|---|---|---|---|"
        "\n");
    for (const Shape& sh : {shapes[2], shapes[3]}) {
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            Setup st(t, 1, sh.n, sh.k, 1);
            const MatmulResources res{blas, st.ws->p, st.ws_bytes};
            std::printf("| %s %lldx%lld | %s |", sh.name, (long long)sh.n, (long long)sh.k,
                        tname(t));
            for (int variant = 0; variant < 4; ++variant) {
                const double us = time_graph(
                    [&](int i) {
                        MatmulParams q = st.params(1, i);
                        if (variant & 1) q.residual = st.residual->f();
                        if (variant & 2) {
                            q.rms_norm = true;
                            q.norm_w = st.norm->p;
                            q.norm_w_type = mgl::dtype::f32;
                        }
                        matmul(q, res, s);
                    },
                    s);
                std::printf(" %.2f |", us);
            }
            std::printf("\n");
        }
    }

    // ---- summary ----
    std::printf(
        "\n## Summary: decode GEMV, M = 1 (copy bw %.0f GB/s, read-only %.0f GB/s; "
        "graph node %.2f us)\n\n",
        bw.copy_gbs, bw.read_gbs, empty_graph_us);
    std::printf(
        "| shape | dtype | MB | stream us | %% | graph us | %% | graph+PDL us | %% | best "
        "variant (graph) | %% |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
        for (int ti = 0; ti < 2; ++ti) {
            auto p_of = [&](double us) { return pct(r.mb[ti] * 1e6 / (us * 1e3)); };
            std::printf(
                "| %s | %s | %.1f | %.2f | %.0f%% | %.2f | %.0f%% | %.2f | %.0f%% | %s | "
                "%.0f%% |\n",
                r.shape.c_str(), ti == 0 ? "bf16" : "f8", r.mb[ti], r.stream_us[ti],
                p_of(r.stream_us[ti]), r.graph_us[ti], p_of(r.graph_us[ti]), r.pdl_us[ti],
                p_of(r.pdl_us[ti]), r.best[ti].c_str(), p_of(r.best_graph_us[ti]));
        }
    }
    cublasDestroy(blas);
    CUDA_CHECK(cudaStreamDestroy(s));
    return 0;
}
int main(int argc, char** argv) {
    try {
        return run(argc, argv);
    } catch (const std::exception& e) {
        std::fflush(stdout);
        std::fprintf(stderr, "bench_matvec_cuda: %s\n", e.what());
        return 1;
    }
}
#else
int main() {
    std::fprintf(stderr, "bench_matvec_cuda: built without CUDA\n");
    return 1;
}
#endif
