// GPU MoE benchmark, V2-Lite shapes (E 64, top-6, D 2048, n_ff 1408, shared expert 2816 BF16):
//   routing: moe_route for 1 and 512 tokens, greedy (V2-Lite) and group-limited 8/3;
//   decode (T = 1, also 2/4/8): moe_experts' fused decode path, FP8 and BF16 experts, sweeping the
//     kernel configurations; µs per call eager (CUDA events around each call) and inside a CUDA
//     graph (20 calls per graph, as a decode step replays them), GB/s of weight bytes against the
//     measured device copy bandwidth. Consecutive calls route to disjoint expert sets and rotate
//     over four shared-expert copies, so the weights come from HBM, not the 50 MB L2;
//   prefill (T = 512, also 128 and 2048): the grouped path, tensor cores with each tile size and
//     both GEMM kernels (staged, pipelined), and the FP32 reference kernels; ms per call and
//     TFLOP/s; then each launch of the grouped path alone (moe_grouped_stage) for both kernels at
//     tile_m 64: µs per launch, TB/s of weight bytes, TFLOP/s.
// Median of repeats after warm-up. A compact summary closes the output.
#include <cstdio>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "cuda_check.h"
#include "moe.h"

using namespace minids::kernels;

namespace {

constexpr int64_t E = 64, K = 6, D = 2048, F = 1408, SH_F = 2816;

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

struct Events {
    cudaEvent_t a, b;
    Events() {
        CUDA_CHECK(cudaEventCreate(&a));
        CUDA_CHECK(cudaEventCreate(&b));
    }
    ~Events() {
        cudaEventDestroy(a);
        cudaEventDestroy(b);
    }
};

void* dmalloc(size_t bytes, int fill) {
    void* p;
    CUDA_CHECK(cudaMalloc(&p, bytes));
    CUDA_CHECK(cudaMemset(p, fill, bytes));
    return p;
}

// Device-to-device copy bandwidth (bytes read + written) over 1 GiB: the ceiling.
double copy_bandwidth_gbs() {
    const size_t bytes = size_t(1) << 30;
    void* a = dmalloc(bytes, 1);
    void* b = dmalloc(bytes, 0);
    Events ev;
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
        CUDA_CHECK(cudaEventRecord(ev.a));
        CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaEventRecord(ev.b));
        CUDA_CHECK(cudaEventSynchronize(ev.b));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, ev.a, ev.b));
        if (i >= 2) ms.push_back(t);
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
}

// 64 expert blobs in the .mds layout (parts 256-aligned, blobs 4096-aligned), values finite in
// every dtype (bytes 0x3c), and the device table of their addresses.
struct Experts {
    ExpertLayout layout;
    int64_t weight_bytes = 0;  // gate + up + down (+ scales) of one expert
    void* storage = nullptr;
    int64_t* table = nullptr;
    explicit Experts(mgl::dtype type) {
        const int64_t eb = int64_t(mgl::dtype_size(type));
        int64_t off = 0;
        auto part = [&](int64_t bytes) {
            const int64_t at = off;
            off = (off + bytes + 255) / 256 * 256;
            return at;
        };
        layout.type = type;
        layout.n_embd = D;
        layout.n_ff = F;
        layout.gate_offset = part(F * D * eb);
        layout.up_offset = part(F * D * eb);
        layout.down_offset = part(D * F * eb);
        weight_bytes = 3 * F * D * eb;
        if (type == mgl::dtype::f8_e4m3) {
            layout.gate_scale_offset = part(F * 4);
            layout.up_scale_offset = part(F * 4);
            layout.down_scale_offset = part(D * 4);
            weight_bytes += (2 * F + D) * 4;
        }
        const int64_t slot = (off + 4095) / 4096 * 4096;
        storage = dmalloc(size_t(slot * E), 0x3c);
        std::vector<int64_t> addr(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e)
            addr[size_t(e)] = int64_t(reinterpret_cast<uintptr_t>(storage)) + e * slot;
        table = static_cast<int64_t*>(dmalloc(size_t(E) * 8, 0));
        CUDA_CHECK(cudaMemcpy(table, addr.data(), addr.size() * 8, cudaMemcpyHostToDevice));
    }
    ~Experts() {
        cudaFree(storage);
        cudaFree(table);
    }
};

constexpr int n_shared_copies = 4;

struct Shared {
    void* w[n_shared_copies][3];
    Shared() {
        for (auto& c : w)
            for (auto& m : c) m = dmalloc(size_t(SH_F * D * 2), 0x3c);
    }
    ~Shared() {
        for (auto& c : w)
            for (auto* m : c) cudaFree(m);
    }
    SharedExpertWeights copy(int i) const {
        const auto& c = w[i % n_shared_copies];
        return {mgl::dtype::bf16, c[0], c[1], c[2], SH_F};
    }
    static int64_t bytes() { return 3 * SH_F * D * 2; }
};

// `sets` routings of T tokens; consecutive sets use disjoint experts when T · K <= E / 2.
struct RoutingSets {
    int32_t* ids = nullptr;
    float* weights = nullptr;
    int sets;
    int64_t T;
    int64_t active = 0;  // experts chosen by at least one token of the first set
    RoutingSets(int n_sets, int64_t tokens, uint64_t seed) : sets(n_sets), T(tokens) {
        std::mt19937_64 rng(seed);
        std::vector<int32_t> order(static_cast<size_t>(E)), ids_h;
        std::iota(order.begin(), order.end(), 0);
        std::shuffle(order.begin(), order.end(), rng);
        int64_t cursor = 0;
        for (int s = 0; s < sets; ++s)
            for (int64_t t = 0; t < T; ++t) {
                if (T * K <= E / 2) {
                    for (int64_t j = 0; j < K; ++j) ids_h.push_back(order[size_t(cursor++ % E)]);
                } else {  // prefill: k distinct random experts per token
                    std::shuffle(order.begin(), order.end(), rng);
                    ids_h.insert(ids_h.end(), order.begin(), order.begin() + K);
                }
            }
        std::vector<bool> used(static_cast<size_t>(E), false);
        for (int64_t i = 0; i < T * K; ++i) used[size_t(ids_h[size_t(i)])] = true;
        active = std::count(used.begin(), used.end(), true);
        std::vector<float> w_h(ids_h.size(), 1.0f / K);
        ids = static_cast<int32_t*>(dmalloc(ids_h.size() * 4, 0));
        weights = static_cast<float*>(dmalloc(w_h.size() * 4, 0));
        CUDA_CHECK(cudaMemcpy(ids, ids_h.data(), ids_h.size() * 4, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(weights, w_h.data(), w_h.size() * 4, cudaMemcpyHostToDevice));
    }
    ~RoutingSets() {
        cudaFree(ids);
        cudaFree(weights);
    }
};

// moe_experts' parameters over `ex` for T tokens of `x` into `out`, with the shared expert's
// first copy and the first routing of `sets`; the callers set the path, the residual and
// whatever they vary per call.
MoeExpertsParams params_for(const Experts& ex, const RoutingSets& sets, int64_t T, float* x,
                            float* out, const Shared& shared) {
    MoeExpertsParams p;
    p.expert_table = ex.table;
    p.n_experts = E;
    p.layout = ex.layout;
    p.ids = sets.ids;
    p.weights = sets.weights;
    p.k = int(K);
    p.x = x;
    p.out = out;
    p.n_tokens = T;
    p.shared = shared.copy(0);
    return p;
}

struct Timing {
    float eager_us = 0, graph_us = 0;
};

// Times `call(i)` (i = call index: each call may use different inputs) eagerly and in a graph.
template <typename Call>
Timing time_calls(Call call, cudaStream_t stream, int eager_reps, bool graph) {
    Events ev;
    std::vector<float> us;
    for (int i = 0; i < eager_reps + 5; ++i) {
        CUDA_CHECK(cudaEventRecord(ev.a, stream));
        call(i);
        CUDA_CHECK(cudaEventRecord(ev.b, stream));
        CUDA_CHECK(cudaEventSynchronize(ev.b));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev.a, ev.b));
        if (i >= 5) us.push_back(ms * 1000.0f);
    }
    Timing t;
    t.eager_us = median(us);
    if (!graph) return t;
    constexpr int per_graph = 20;
    cudaGraph_t g;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < per_graph; ++i) call(i);
    CUDA_CHECK(cudaStreamEndCapture(stream, &g));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    us.clear();
    for (int r = 0; r < 12; ++r) {
        CUDA_CHECK(cudaEventRecord(ev.a, stream));
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaEventRecord(ev.b, stream));
        CUDA_CHECK(cudaEventSynchronize(ev.b));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev.a, ev.b));
        if (r >= 2) us.push_back(ms * 1000.0f / per_graph);
    }
    t.graph_us = median(us);
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(g));
    return t;
}

const char* name(mgl::dtype t) { return mgl::dtype_name(t); }

std::string describe(const MoeDecodeConfig& c) {
    char buf[192];
    std::snprintf(buf, sizeof buf,
                  "unroll %d, %s, gate_up %d warps x %d rows%s, down %d x %d/row, %d rows/warp%s",
                  c.unroll, c.fp8_convert == Fp8Convert::hardware ? "cvt hw" : "cvt bits",
                  c.gate_up_warps, c.gate_up_rows_per_warp,
                  c.gate_up_compact_grid ? "" : " (full grid)", c.down_warps, c.down_warps_per_row,
                  c.down_rows_per_warp, c.down_act_in_shared ? "" : ", act via L1");
    return buf;
}

// Median µs of one call(i) over batches of back-to-back calls (no host wait between the calls
// of a batch, so launch gaps hide behind the previous kernel as in a prompt pass).
template <typename Call>
float batch_us(Call call, cudaStream_t stream) {
    constexpr int per_batch = 10, batches = 7;
    Events ev;
    for (int i = 0; i < 3; ++i) call(i);  // warm-up
    std::vector<float> us;
    for (int b = 0; b < batches; ++b) {
        CUDA_CHECK(cudaEventRecord(ev.a, stream));
        for (int i = 0; i < per_batch; ++i) call(b * per_batch + i);
        CUDA_CHECK(cudaEventRecord(ev.b, stream));
        CUDA_CHECK(cudaEventSynchronize(ev.b));
        float ms;
        CUDA_CHECK(cudaEventElapsedTime(&ms, ev.a, ev.b));
        us.push_back(ms * 1000.0f / per_batch);
    }
    return median(us);
}

const char* kernel_name(MoeGroupedKernel k) {
    return k == MoeGroupedKernel::pipelined ? "pipelined" : "staged";
}

struct Best {
    double gbs = 0;
    float us = 0;
    std::string config;
};

}  // namespace

int main() {
    try {
        const double bw = copy_bandwidth_gbs();
        std::printf("device copy bandwidth (read+write): %.0f GB/s\n", bw);
        cudaStream_t stream;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        float* x = static_cast<float*>(dmalloc(size_t(2048 * D) * 4, 0x3c));  // 0.0115
        float* out = static_cast<float*>(dmalloc(size_t(2048 * D) * 4, 0));
        float* logits = static_cast<float*>(dmalloc(size_t(2048 * E) * 4, 0));
        int32_t* r_ids = static_cast<int32_t*>(dmalloc(size_t(2048 * K) * 4, 0));
        float* r_w = static_cast<float*>(dmalloc(size_t(2048 * K) * 4, 0));
        Shared shared;
        std::vector<std::string> summary;

        // ---- routing ----
        // Random logits (all-equal ones would time the all-ties case only). V2-Lite routes
        // greedily; group-limited 8/3 is V2's rule on V2-Lite's shapes.
        {
            std::mt19937 gen(5);
            std::uniform_real_distribution<float> dist(-4.0f, 4.0f);
            std::vector<float> l(size_t(2048 * E));
            for (auto& v : l) v = dist(gen);
            CUDA_CHECK(cudaMemcpy(logits, l.data(), l.size() * 4, cudaMemcpyHostToDevice));
        }
        std::printf("\n## routing (moe_route: softmax + top-6 of 64, random logits)\n\n");
        std::printf("| method | tokens | eager us | in graph us |\n|---|---|---|---|\n");
        for (const bool grouped : {false, true}) {
            for (int64_t T : {1, 512}) {
                MoeRoutingParams r;
                r.logits = logits;
                r.ids = r_ids;
                r.weights = r_w;
                r.n_tokens = T;
                r.n_experts = E;
                r.route.k = int(K);
                if (grouped) {
                    r.route.method = mgl::topk_method::group_limited_greedy;
                    r.route.n_group = 8;
                    r.route.topk_group = 3;
                }
                const char* method = grouped ? "group-limited 8/3" : "greedy";
                const Timing t = time_calls([&](int) { moe_route(r, stream); }, stream, 50, true);
                std::printf("| %s | %ld | %.1f | %.2f |\n", method, long(T), t.eager_us,
                            t.graph_us);
                char line[128];
                std::snprintf(line, sizeof line, "routing %s T=%ld: %.2f us in a graph", method,
                              long(T), t.graph_us);
                summary.push_back(line);
            }
        }

        // ---- decode ----
        for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
            Experts ex(type);
            const int n_sets = 20;
            RoutingSets sets(n_sets, 1, 11);
            const double bytes = double(K * ex.weight_bytes + Shared::bytes());
            std::printf(
                "\n## decode T=1, %s experts (%.1f MB read per call: 6 experts + shared "
                "bf16; floor %.1f us at the copy bandwidth)\n\n",
                name(type), bytes / 1e6, bytes / (bw * 1e3));
            std::printf("| config | eager us | in graph us | GB/s (graph) | of copy bw |\n");
            std::printf("|---|---|---|---|---|\n");
            // (with the shared expert: the workspace holds its activations too)
            MoeExpertsParams p = params_for(ex, sets, 1, x, out, shared);
            p.residual = out;
            p.path = MoePath::decode;
            const size_t ws_bytes = moe_experts_workspace_bytes(p) * 8;  // room for T = 8
            void* ws = dmalloc(ws_bytes, 0);
            std::vector<MoeDecodeConfig> configs;
            for (int unroll : {2, 4, 8})
                for (auto cvt : {Fp8Convert::hardware, Fp8Convert::bit_ops}) {
                    if (type != mgl::dtype::f8_e4m3 && cvt == Fp8Convert::bit_ops) continue;
                    // (gate_up_warps, gate/up row pairs per warp, down_warps,
                    // down_warps_per_row, down_rows_per_warp)
                    constexpr int shapes[][5] = {
                        {8, 1, 8, 2, 1},  {8, 1, 16, 2, 1}, {8, 1, 8, 4, 4},  {8, 1, 16, 4, 4},
                        {8, 1, 16, 4, 2}, {8, 2, 16, 4, 2}, {4, 2, 16, 4, 2}, {16, 2, 16, 4, 2},
                        {4, 1, 16, 4, 2}, {16, 1, 16, 4, 2}};
                    for (const auto& [gw, gr, dw, wpr, rows] : shapes) {
                        if ((rows > 1 || gr > 1) && (cvt != Fp8Convert::hardware || unroll == 8))
                            continue;
                        MoeDecodeConfig c;
                        c.gate_up_rows_per_warp = gr;
                        c.down_rows_per_warp = rows;
                        c.unroll = unroll;
                        c.fp8_convert = cvt;
                        c.gate_up_warps = gw;
                        c.down_warps = dw;
                        c.down_warps_per_row = wpr;
                        configs.push_back(c);
                    }
                }
            // The default with launch 1's full 2-D grid (empty blocks included), for comparison.
            configs.push_back(MoeDecodeConfig{});
            configs.back().gate_up_compact_grid = false;
            // The default reading launch 2's activations through L1 instead of shared memory.
            configs.push_back(MoeDecodeConfig{});
            configs.back().down_act_in_shared = false;
            Best best;
            for (const MoeDecodeConfig& c : configs) {
                p.decode = c;
                auto call = [&](int i) {
                    p.ids = sets.ids + (i % n_sets) * K;
                    p.weights = sets.weights + (i % n_sets) * K;
                    p.shared = shared.copy(i);
                    moe_experts(p, ws, ws_bytes, stream);
                };
                const Timing t = time_calls(call, stream, 40, true);
                const double gbs = bytes / (t.graph_us * 1e-6) / 1e9;
                std::printf("| %s | %.1f | %.1f | %.0f | %.0f%% |\n", describe(c).c_str(),
                            t.eager_us, t.graph_us, gbs, 100.0 * gbs / bw);
                if (gbs > best.gbs) best = {gbs, t.graph_us, describe(c)};
            }
            char line[256];
            std::snprintf(line, sizeof line,
                          "decode T=1 %s: best %.1f us in a graph = %.0f GB/s = %.0f%% of copy "
                          "bw (%s)",
                          name(type), best.us, best.gbs, 100.0 * best.gbs / bw,
                          best.config.c_str());
            summary.push_back(line);
            // Few tokens at the default configuration (routings of distinct experts per call).
            p.decode = MoeDecodeConfig{};
            for (int64_t T : {2, 4, 8}) {
                RoutingSets tsets(8, T, 12 + T);
                p.n_tokens = T;
                auto call = [&](int i) {
                    p.ids = tsets.ids + (i % 8) * T * K;
                    p.weights = tsets.weights + (i % 8) * T * K;
                    p.shared = shared.copy(i);
                    moe_experts(p, ws, ws_bytes, stream);
                };
                const Timing t = time_calls(call, stream, 40, true);
                std::printf("| default, T=%ld | %.1f | %.1f | | |\n", long(T), t.eager_us,
                            t.graph_us);
                std::snprintf(line, sizeof line, "decode T=%ld %s (default config): %.1f us",
                              long(T), name(type), t.graph_us);
                summary.push_back(line);
            }
            cudaFree(ws);
        }

        // ---- prefill ----
        for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
            Experts ex(type);
            std::printf("\n## prefill, %s experts, grouped path (+ shared expert, residual)\n\n",
                        name(type));
            std::printf("| tokens | kernels | ms | TFLOP/s |\n|---|---|---|---|\n");
            for (int64_t T : {128, 512, 2048}) {
                RoutingSets sets(1, T, 21 + T);
                MoeExpertsParams p = params_for(ex, sets, T, x, out, shared);
                p.residual = out;
                p.path = MoePath::grouped;
                const size_t ws_bytes = moe_experts_workspace_bytes(p);
                void* ws = dmalloc(ws_bytes, 0);
                const double flops = 2.0 * 3.0 * double(D) * (double(F) * T * K + double(SH_F) * T);
                struct Variant {
                    bool tc;
                    int tile_m;
                    MoeGroupedKernel kernel;
                };
                std::vector<Variant> variants;
                for (MoeGroupedKernel k : {MoeGroupedKernel::staged, MoeGroupedKernel::pipelined})
                    for (int tile_m : {32, 64, 128}) variants.push_back({true, tile_m, k});
                if (T == 512) variants.push_back({false, 64, MoeGroupedKernel::staged});
                for (const Variant& v : variants) {
                    p.grouped.tensor_cores = v.tc;
                    p.grouped.tile_m = v.tile_m;
                    p.grouped.kernel = v.kernel;
                    const Timing t = time_calls([&](int) { moe_experts(p, ws, ws_bytes, stream); },
                                                stream, v.tc ? 20 : 3, false);
                    const double tflops = flops / (t.eager_us * 1e-6) / 1e12;
                    char kernels[64];
                    std::snprintf(kernels, sizeof kernels, "%s tile_m %d",
                                  v.tc ? kernel_name(v.kernel) : "FP32 reference", v.tile_m);
                    std::printf("| %ld | %s | %.3f | %.1f |\n", long(T), kernels, t.eager_us / 1e3,
                                tflops);
                    if (T == 512) {
                        char line[160];
                        std::snprintf(line, sizeof line,
                                      "prefill T=512 %s, %s: %.3f ms, %.1f TFLOP/s", name(type),
                                      kernels, t.eager_us / 1e3, tflops);
                        summary.push_back(line);
                    }
                }
                cudaFree(ws);
            }
        }

        // ---- prefill, one launch at a time ----
        for (mgl::dtype type : {mgl::dtype::f8_e4m3, mgl::dtype::bf16}) {
            Experts ex(type);
            const double eb = double(mgl::dtype_size(type));
            std::printf(
                "\n## prefill launches, %s experts, tile_m 64 (moe_grouped_stage; weight TB/s "
                "over the experts the tokens chose; the shared expert rotates over %d copies so "
                "its weights come from HBM)\n\n",
                name(type), n_shared_copies);
            std::printf("| tokens | launch | kernel | us | weight TB/s | TFLOP/s |\n");
            std::printf("|---|---|---|---|---|---|\n");
            for (int64_t T : {128, 512, 2048}) {
                RoutingSets sets(1, T, 21 + T);
                MoeExpertsParams p = params_for(ex, sets, T, x, out, shared);
                p.path = MoePath::grouped;
                p.grouped.kernel = MoeGroupedKernel::pipelined;  // the larger workspace
                const size_t ws_bytes = moe_experts_workspace_bytes(p);
                void* ws = dmalloc(ws_bytes, 0);
                const double scale_bytes = type == mgl::dtype::f8_e4m3 ? 4.0 : 0.0;
                const double a = double(sets.active), rows = double(T * K);
                struct Launch {
                    MoeGroupedStage stage;
                    const char* name;
                    double weight_bytes, flops;
                };
                const Launch launches[] = {
                    {MoeGroupedStage::sort, "sort", 0, 0},
                    {MoeGroupedStage::x_to_bf16, "x to bf16", 0, 0},
                    {MoeGroupedStage::gate_up, "routed gate/up", a * 2 * F * (D * eb + scale_bytes),
                     2.0 * rows * 2 * F * D},
                    {MoeGroupedStage::down, "routed down", a * D * (F * eb + scale_bytes),
                     2.0 * rows * D * F},
                    {MoeGroupedStage::shared_gate_up, "shared gate/up", 2.0 * SH_F * D * 2,
                     2.0 * double(T) * 2 * SH_F * D},
                    {MoeGroupedStage::shared_down, "shared down", double(D) * SH_F * 2,
                     2.0 * double(T) * D * SH_F},
                    {MoeGroupedStage::combine, "combine", 0, 0},
                };
                for (MoeGroupedKernel k : {MoeGroupedKernel::staged, MoeGroupedKernel::pipelined}) {
                    p.grouped.kernel = k;
                    p.shared = shared.copy(0);
                    moe_experts(p, ws, ws_bytes, stream);  // the sort and activations to re-run on
                    for (const Launch& l : launches) {
                        if (l.stage == MoeGroupedStage::x_to_bf16 &&
                            k != MoeGroupedKernel::pipelined)
                            continue;
                        const float us = batch_us(
                            [&](int i) {
                                p.shared = shared.copy(i);
                                moe_grouped_stage(p, l.stage, ws, ws_bytes, stream);
                            },
                            stream);
                        const double tbs = l.weight_bytes / (us * 1e-6) / 1e12;
                        const double tflops = l.flops / (us * 1e-6) / 1e12;
                        std::printf("| %ld | %s | %s | %.1f | %.2f | %.1f |\n", long(T), l.name,
                                    kernel_name(k), us, tbs, tflops);
                        if (T == 512 && l.weight_bytes > 0) {
                            char line[160];
                            std::snprintf(line, sizeof line,
                                          "prefill T=512 %s %s, %s: %.1f us, %.2f TB/s, %.1f "
                                          "TFLOP/s",
                                          name(type), l.name, kernel_name(k), us, tbs, tflops);
                            summary.push_back(line);
                        }
                    }
                }
                cudaFree(ws);
            }
        }

        std::printf("\n## summary (copy bandwidth %.0f GB/s)\n\n", bw);
        for (const auto& s : summary) std::printf("- %s\n", s.c_str());
        cudaFree(x);
        cudaFree(out);
        cudaFree(logits);
        cudaFree(r_ids);
        cudaFree(r_w);
        CUDA_CHECK(cudaStreamDestroy(stream));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_moe_cuda: %s\n", e.what());
        return 1;
    }
    return 0;
}
#else
int main() {
    std::fprintf(stderr, "bench_moe_cuda: built without CUDA\n");
    return 1;
}
#endif
