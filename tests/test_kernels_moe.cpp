// CUDA MoE routing kernels (moe_topk, moe_weights, moe_route) against mgl's CPU ops, parameter
// checks of every MoE launcher, a routing + experts step replayed as a CUDA graph, and the fused
// router (moe_router_route) against the unfused matmul + moe_route.
// The expert kernels themselves are tested in test_kernels_moe_experts.cpp.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "matmul.h"
#include "moe.h"
#include "moe_cuda_fixture.h"
#include "test_mgl_util.h"

using namespace minids;
using moe_test::DeviceBuffer;
using moe_test::Rng;

namespace {

const bool no_gpu = !test::cuda_device_available();

std::vector<int32_t> cpu_topk(const std::vector<float>& probs, int64_t T, int64_t E,
                              const mgl::moe_route_params& p) {
    mgl_test::harness h;
    const auto got = h.run(mgl::moe_topk(h.ctx, h.f32({T, E}, probs, "probs"), p));
    return std::vector<int32_t>(got.begin(), got.end());
}

std::vector<float> cpu_weights(const std::vector<float>& probs, const std::vector<int32_t>& ids,
                               int64_t T, int64_t E, const mgl::moe_route_params& p) {
    mgl_test::harness h;
    return h.run(
        mgl::moe_weights(h.ctx, h.f32({T, E}, probs, "probs"), h.i32({T, int64_t(p.k)}, ids), p));
}

std::vector<float> cpu_softmax(const std::vector<float>& logits, int64_t T, int64_t E) {
    mgl_test::harness h;
    return h.run(mgl::softmax(h.ctx, h.f32({T, E}, logits, "logits")));
}

// Random probabilities, or (ties) values from a handful of levels so most rows hold ties.
std::vector<float> random_probs(int64_t T, int64_t E, bool ties, uint64_t seed) {
    Rng rng(seed);
    std::vector<float> p(size_t(T * E));
    for (auto& v : p) v = ties ? float(1 + rng.below(4)) / 64.0f : rng.uniform(0.0f, 1.0f);
    return p;
}

// Element-wise equality, every mismatch counted and the first few reported.
template <typename T>
void check_equal(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
    REQUIRE(got.size() == want.size());
    int bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
            if (bad < 4) {
                INFO(what << "[" << i << "]: got " << got[i] << ", want " << want[i]);
                CHECK(false);
            }
            ++bad;
        }
    }
    INFO(what << ": " << bad << " of " << got.size() << " differ");
    CHECK(bad == 0);
}

struct GpuRoute {
    std::vector<int32_t> ids;
    std::vector<float> weights, probs;
};

// Runs moe_topk + moe_weights (logits == false) or moe_route (true) on [T, E] rows stored with
// row stride `stride`.
GpuRoute run_gpu(const std::vector<float>& rows, int64_t T, int64_t E, int64_t stride,
                 const mgl::moe_route_params& p, bool from_logits) {
    std::vector<float> strided(size_t(T * stride), -7.0f);
    for (int64_t t = 0; t < T; ++t)
        std::memcpy(&strided[size_t(t * stride)], &rows[size_t(t * E)], size_t(E) * 4);
    DeviceBuffer in(strided), ids(size_t(T * p.k) * 4), w(size_t(T * p.k) * 4),
        probs(size_t(T * E) * 4);
    kernels::MoeRoutingParams r;
    r.in_stride = stride;
    r.ids = ids.as<int32_t>();
    r.weights = w.as<float>();
    r.n_tokens = T;
    r.n_experts = E;
    r.route = p;
    if (from_logits) {
        r.logits = in.as<float>();
        r.probs_out = probs.as<float>();
        kernels::moe_route(r, nullptr);
    } else {
        r.probs = in.as<float>();
        kernels::moe_topk(r, nullptr);
        kernels::moe_weights(r, nullptr);
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    return {ids.download<int32_t>(), w.download<float>(),
            from_logits ? probs.download<float>() : std::vector<float>{}};
}

mgl::moe_route_params greedy(int k, bool norm = false) {
    mgl::moe_route_params p;
    p.k = k;
    p.norm_topk_prob = norm;
    p.routed_scaling_factor = 16.0f;
    return p;
}

mgl::moe_route_params grouped(int k, int n_group, int topk_group, bool norm = false) {
    mgl::moe_route_params p = greedy(k, norm);
    p.method = mgl::topk_method::group_limited_greedy;
    p.n_group = n_group;
    p.topk_group = topk_group;
    return p;
}

// GPU ids and weights (moe_topk, moe_weights) from probs against the CPU ops on the same probs,
// bit for bit.
void check_rows(const std::vector<float>& probs, int64_t T, int64_t E,
                const mgl::moe_route_params& p, int64_t stride = 0) {
    const auto gpu = run_gpu(probs, T, E, stride ? stride : E, p, false);
    check_equal(gpu.ids, cpu_topk(probs, T, E, p), "ids");
    check_equal(gpu.weights, cpu_weights(probs, gpu.ids, T, E, p), "weights");
}

// moe_route from logits: its probs near the CPU softmax, its ids and weights equal, bit for bit,
// to the CPU ops applied to the probs it wrote.
void check_route_rows(const std::vector<float>& logits, int64_t T, int64_t E,
                      const mgl::moe_route_params& p, int64_t stride = 0) {
    const auto gpu = run_gpu(logits, T, E, stride ? stride : E, p, true);
    const auto want = cpu_softmax(logits, T, E);
    std::vector<double> want_d(want.begin(), want.end());
    CHECK(test::relative_l2(gpu.probs, want_d) < 1e-6);
    check_equal(gpu.ids, cpu_topk(gpu.probs, T, E, p), "ids");
    check_equal(gpu.weights, cpu_weights(gpu.probs, gpu.ids, T, E, p), "weights");
}

// GPU ids and weights from probs against the CPU ops on the same probs (bit for bit).
void check_topk_and_weights(int64_t T, int64_t E, const mgl::moe_route_params& p, bool ties,
                            uint64_t seed, int64_t stride = 0) {
    CAPTURE(E);
    CAPTURE(p.k);
    CAPTURE(ties);
    CAPTURE(p.n_group);
    CAPTURE(p.topk_group);
    CAPTURE(p.norm_topk_prob);
    check_rows(random_probs(T, E, ties, seed), T, E, p, stride);
}

// Rows meant to catch a selection that is right only for distinct values.
enum class RowKind { random, levels, all_equal, straddle, specials, by_lane };

// [T, E] values of one kind (probabilities for moe_topk, logits for moe_route): random, a few
// levels (ties everywhere), all equal (all-zero logits), random with the k-th and (k+1)-th best
// of each row made equal (a tie straddling the last place), random with special values mixed
// in (probabilities: -0 and +0, which tie, denormals, negatives; logits: -inf, -0, +0), or
// ordered by lane (expert e is held by lane e % 32), so that the best lanes' experts all rank
// high: the most candidates the rank selection's second stage can have, (k - 1) x E/32 + 1.
std::vector<float> rows_of(RowKind kind, int64_t T, int64_t E, int k, bool logits, uint64_t seed) {
    Rng rng(seed);
    std::vector<float> v(size_t(T * E));
    for (int64_t t = 0; t < T; ++t) {
        float* row = &v[size_t(t * E)];
        for (int64_t e = 0; e < E; ++e) {
            const float u = logits ? rng.uniform(-4.0f, 4.0f) : rng.uniform(0.0f, 1.0f);
            switch (kind) {
                case RowKind::levels:
                    row[e] = float(1 + rng.below(4)) / (logits ? 1.0f : 64.0f);
                    break;
                case RowKind::all_equal:
                    row[e] = logits ? 0.0f : 0.25f;
                    break;
                case RowKind::specials: {
                    // On even places only, so that every row keeps enough ordinary values for
                    // a positive weight sum (a 0 / 0 NaN's bits differ between CPU and GPU).
                    const float prob[] = {0.0f, -0.0f, 0x1p-140f, 0x1p-149f, -0x1p-149f, -0.5f};
                    const float logit[] = {-INFINITY, 0.0f, -0.0f};
                    const bool special = e % 2 == 0 && rng.below(2);
                    row[e] = !special ? u : logits ? logit[rng.below(3)] : prob[rng.below(6)];
                    break;
                }
                case RowKind::by_lane:  // distinct, decreasing with the lane, then the chunk
                    row[e] = float((32 - e % 32) * 8 - e / 32) / (logits ? 64.0f : 512.0f);
                    break;
                default:
                    row[e] = u;
            }
        }
        if (kind == RowKind::straddle && k < E) {
            std::vector<int32_t> order(static_cast<size_t>(E));
            for (int64_t e = 0; e < E; ++e) order[size_t(e)] = int32_t(e);
            std::sort(order.begin(), order.end(),
                      [&](int32_t a, int32_t b) { return row[a] > row[b]; });
            row[order[size_t(k)]] = row[order[size_t(k - 1)]];
        }
    }
    return v;
}

}  // namespace

TEST_CASE("cuda moe_topk and moe_weights: greedy, identical to the CPU, ties included" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 100;
    for (int64_t E : {16, 64, 160, 256})
        for (int k : {1, 2, 4, 6, 8})
            for (bool ties : {false, true})
                check_topk_and_weights(37, E, greedy(k, (k + int(ties)) % 2 == 0), ties, ++seed);
    check_topk_and_weights(5, 1024, greedy(8, true), true, 7);  // the largest E supported
    check_topk_and_weights(3, 64, greedy(64), false, 8);        // k == E: a full sort
    check_topk_and_weights(9, 64, greedy(6), true, 9, 67);      // strided rows
}

TEST_CASE("cuda moe_topk group-limited greedy: identical to the CPU, ties included" *
          doctest::skip(no_gpu)) {
    uint64_t seed = 200;
    for (bool ties : {false, true}) {
        check_topk_and_weights(41, 64, grouped(6, 8, 3), ties, ++seed);         // V2-Lite-like
        check_topk_and_weights(41, 160, grouped(6, 8, 3, true), ties, ++seed);  // V2
        check_topk_and_weights(41, 256, grouped(8, 8, 4, true), ties, ++seed);  // V3
        check_topk_and_weights(41, 16, grouped(3, 4, 2), ties, ++seed);
        check_topk_and_weights(41, 16, grouped(4, 4, 1), ties, ++seed);   // k == one group
        check_topk_and_weights(41, 96, grouped(2, 32, 5), ties, ++seed);  // 32 groups of 3
    }
    // The hand-made rows of the CPU test: the global top-k differs from the group-limited one.
    const std::vector<float> row = {0.30f, 0.01f, 0.29f, 0.28f, 0.0f, 0.12f};
    CHECK(run_gpu(row, 1, 6, 6, grouped(2, 3, 1), false).ids == std::vector<int32_t>{0, 1});
    const std::vector<float> row2 = {0.05f, 0.06f, 0.40f, 0.0f, 0.10f, 0.39f};
    CHECK(run_gpu(row2, 1, 6, 6, grouped(3, 3, 2), false).ids == std::vector<int32_t>{2, 5, 4});
}

TEST_CASE("cuda moe_route: softmax, top-k and weights in one launch" * doctest::skip(no_gpu)) {
    struct Cfg {
        int64_t E;
        mgl::moe_route_params p;
    };
    const Cfg cfgs[] = {
        {64, greedy(6)},         {64, greedy(6, true)},         {16, greedy(1, true)},
        {160, grouped(6, 8, 3)}, {256, grouped(8, 8, 4, true)}, {64, grouped(6, 8, 3, true)}};
    uint64_t seed = 300;
    for (const Cfg& c : cfgs)
        for (bool ties : {false, true}) {
            CAPTURE(c.E);
            CAPTURE(c.p.k);
            CAPTURE(int(c.p.method));
            CAPTURE(ties);
            const int64_t T = 23;
            Rng rng(++seed);
            std::vector<float> logits(size_t(T * c.E));
            for (auto& v : logits) v = ties ? float(rng.below(3)) : rng.uniform(-4.0f, 4.0f);
            check_route_rows(logits, T, c.E, c.p, c.E + 3);
        }
}

TEST_CASE("cuda routing: decode and prefill shapes, ties at the last place, odd expert counts" *
          doctest::skip(no_gpu)) {
    // Up to 256 experts the selection ranks each expert directly (route_rank_kernel), with one to
    // eight experts per lane and a second stage whose size depends on k; beyond, or when that
    // stage would exceed 64 candidates, the greedy rounds (route_kernel). Both must equal the CPU.
    struct Cfg {
        int64_t E;
        mgl::moe_route_params p;
    };
    const Cfg cfgs[] = {
        {64, greedy(6)},                 // V2-Lite
        {64, grouped(6, 8, 3)},          // V2-Lite shapes, group-limited
        {160, grouped(6, 8, 3)},         // V2
        {256, grouped(8, 8, 4, true)},   // V3 shapes (softmax scoring)
        {256, greedy(8, true)},          //
        {64, grouped(6, 8, 3, true)},    //
        {7, greedy(3, true)},            // fewer experts than lanes
        {32, greedy(32, true)},          // k == E, one expert per lane
        {33, greedy(6)},                 // E not a multiple of 32
        {40, grouped(6, 8, 3)},          // groups of 5
        {72, grouped(4, 9, 2, true)},    // 9 groups of 8
        {100, greedy(6, true)},          //
        {200, grouped(6, 8, 3, true)},   // groups of 25
        {255, greedy(8)},                //
        {64, greedy(32)},                // the second stage at its 64 candidates
        {64, greedy(64, true)},          // k == E
        {96, greedy(12)},                // by_lane: 34 candidates, two for some lanes
        {160, greedy(12, true)},         // by_lane: 56 candidates
        {160, greedy(13)},               // 13 x 5 > 64 candidates: the greedy rounds
        {256, greedy(16)},               // the greedy rounds
        {300, greedy(6, true)},          // the greedy rounds, E not a multiple of 32
        {1024, grouped(8, 32, 4, true)}  // the greedy rounds at the largest E
    };
    const RowKind kinds[] = {RowKind::random,   RowKind::levels,   RowKind::all_equal,
                             RowKind::straddle, RowKind::specials, RowKind::by_lane};
    uint64_t seed = 900;
    for (const Cfg& c : cfgs) {
        for (const int64_t T : {int64_t(1), int64_t(512)}) {
            if (c.E == 1024 && T == 512) continue;  // the CPU reference's time, nothing new
            for (const RowKind kind : kinds) {
                CAPTURE(c.E);
                CAPTURE(c.p.k);
                CAPTURE(int(c.p.method));
                CAPTURE(c.p.norm_topk_prob);
                CAPTURE(T);
                CAPTURE(int(kind));
                check_rows(rows_of(kind, T, c.E, c.p.k, false, ++seed), T, c.E, c.p);
                check_route_rows(rows_of(kind, T, c.E, c.p.k, true, ++seed), T, c.E, c.p);
            }
        }
    }
}

TEST_CASE("cuda moe_topk: up to 256 experts a NaN probability ranks after every number" *
          doctest::skip(no_gpu)) {
    // The CPU's compares cannot place a NaN; the GPU puts NaNs last, among themselves by id, so
    // the ids are still k distinct experts.
    for (const auto& p : {greedy(6), grouped(6, 8, 3)}) {
        CAPTURE(int(p.method));
        const int64_t T = 64, E = 64;
        Rng rng(77);
        std::vector<float> probs(size_t(T * E)), as_low(probs.size());
        for (int64_t t = 0; t < T; ++t) {
            const int n_nan = int(t);  // 0 .. 63 NaNs in row t
            for (int64_t e = 0; e < E; ++e) {
                const size_t i = size_t(t * E + e);
                const bool nan = rng.below(int(E)) < n_nan;
                probs[i] = nan ? NAN : rng.uniform(0.0f, 1.0f);
                as_low[i] = nan ? -1.0f : probs[i];  // below every probability
            }
        }
        const auto gpu = run_gpu(probs, T, E, E, p, false);
        check_equal(gpu.ids, cpu_topk(as_low, T, E, p), "ids");
    }
}

TEST_CASE("cuda moe launchers reject bad parameters before touching the device") {
    kernels::MoeRoutingParams r;
    r.n_tokens = 1;
    r.n_experts = 8;
    r.route.k = 9;  // k > E
    CHECK_THROWS_AS(kernels::moe_topk(r, nullptr), mgl::error);
    r.route.k = 2;
    r.n_experts = 2000;  // more than one warp's shared row can hold
    CHECK_THROWS_AS(kernels::moe_route(r, nullptr), mgl::error);
    r.n_experts = 8;
    r.route = grouped(4, 3, 1);  // 8 experts do not split into 3 groups
    CHECK_THROWS_AS(kernels::moe_topk(r, nullptr), mgl::error);
    r.route = greedy(2);
    CHECK_THROWS_AS(kernels::moe_topk(r, nullptr), mgl::error);  // no probs / ids

    static int64_t fake_table[1];
    static int32_t fake_ids[4];
    static float fake_w[4], fake_x[64];
    kernels::MoeExpertsParams e;
    e.expert_table = fake_table;
    e.n_experts = 1;
    e.layout = {mgl::dtype::bf16, 16, 16, 0, 512, 1024};
    e.ids = fake_ids;
    e.weights = fake_w;
    e.k = 1;
    e.x = fake_x;
    e.out = fake_x;
    e.n_tokens = 1;
    CHECK_NOTHROW(kernels::moe_experts_workspace_bytes(e));
    auto bad = e;
    bad.layout.type = mgl::dtype::f16;
    CHECK_THROWS_AS(kernels::moe_experts_workspace_bytes(bad), mgl::error);
    bad = e;
    bad.layout.type = mgl::dtype::f8_e4m3;  // no scale offsets
    CHECK_THROWS_AS(kernels::moe_experts_workspace_bytes(bad), mgl::error);
    bad = e;
    bad.k = 0;
    CHECK_THROWS_AS(kernels::moe_experts_workspace_bytes(bad), mgl::error);
    bad = e;
    bad.shared = {mgl::dtype::f8_e4m3, fake_x, fake_x, fake_x, 16};
    CHECK_THROWS_AS(kernels::moe_experts_workspace_bytes(bad), mgl::error);
    bad = e;
    bad.x_stride = 8;  // < n_embd
    CHECK_THROWS_AS(kernels::moe_experts_workspace_bytes(bad), mgl::error);
    alignas(256) static uint8_t ws[256];
    bad = e;
    bad.ids = nullptr;  // a workspace query needs no data, a launch does
    CHECK_NOTHROW(kernels::moe_experts_workspace_bytes(bad));
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws, sizeof ws, nullptr), mgl::error);
    bad = e;
    bad.decode.unroll = 3;
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws, sizeof ws, nullptr), mgl::error);
    bad = e;
    bad.decode.down_warps_per_row = 3;  // does not divide 8 warps
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws, sizeof ws, nullptr), mgl::error);
    bad = e;
    bad.n_tokens = 100;  // decode workspace of 100 tokens does not fit 256 bytes
    bad.path = kernels::MoePath::decode;
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws, sizeof ws, nullptr), mgl::error);
    bad = e;
    bad.path = kernels::MoePath::grouped;
    bad.grouped.tile_m = 48;
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws, sizeof ws, nullptr), mgl::error);
    bad = e;
    CHECK_THROWS_AS(kernels::moe_experts(bad, ws + 16, sizeof ws - 16, nullptr), mgl::error);
    CHECK(kernels::moe_resolved_path(e) == kernels::MoePath::decode);
    e.n_tokens = 9;
    CHECK(kernels::moe_resolved_path(e) == kernels::MoePath::grouped);
}

TEST_CASE("cuda moe route + experts captured as a CUDA graph: replays equal eager runs" *
          doctest::skip(no_gpu)) {
    // One graph per path: decode (T = 1, fp8, shared expert, in-place residual) and grouped
    // (T = 40, bf16, tensor cores). New logits and x are written into the same device buffers
    // before each replay; every replay must equal, bit for bit, the same launches run eagerly.
    for (const bool prefill : {false, true}) {
        CAPTURE(prefill);
        const int64_t T = prefill ? 40 : 1, E = 64, D = 128, F = 96;
        const int k = 6;
        moe_test::ExpertBank bank(prefill ? mgl::dtype::bf16 : mgl::dtype::f8_e4m3, E, D, F, 41);
        moe_test::SharedExpert shared(mgl::dtype::bf16, D, 2 * F, 42);
        DeviceBuffer logits(size_t(T * E) * 4), ids(size_t(T * k) * 4), w(size_t(T * k) * 4),
            x(size_t(T * D) * 4), h(size_t(T * D) * 4);
        kernels::MoeRoutingParams r;
        r.logits = logits.as<float>();
        r.ids = ids.as<int32_t>();
        r.weights = w.as<float>();
        r.n_tokens = T;
        r.n_experts = E;
        r.route = grouped(k, 8, 3, true);
        kernels::MoeExpertsParams p;
        p.expert_table = bank.table.as<int64_t>();
        p.n_experts = E;
        p.layout = bank.layout;
        p.ids = ids.as<int32_t>();
        p.weights = w.as<float>();
        p.k = k;
        p.x = x.as<float>();
        p.out = h.as<float>();
        p.residual = h.as<float>();
        p.n_tokens = T;
        p.shared = shared.weights();
        CHECK(kernels::moe_resolved_path(p) ==
              (prefill ? kernels::MoePath::grouped : kernels::MoePath::decode));
        DeviceBuffer ws(kernels::moe_experts_workspace_bytes(p));
        cudaStream_t stream;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        auto step = [&] {
            kernels::moe_route(r, stream);
            kernels::moe_experts(p, ws.ptr, ws.bytes, stream);
        };
        cudaGraph_t graph;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        step();
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int rep = 0; rep < 3; ++rep) {
            CAPTURE(rep);
            const auto l = test::random_floats(size_t(T * E), 500 + rep, -3.0f, 3.0f);
            const auto xv = test::random_floats(size_t(T * D), 600 + rep);
            const auto hv = test::random_floats(size_t(T * D), 700 + rep);
            logits.upload(l);
            x.upload(xv);
            h.upload(hv);
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto replayed = h.download<float>();
            const auto replayed_ids = ids.download<int32_t>();
            h.upload(hv);
            step();
            CUDA_CHECK(cudaStreamSynchronize(stream));
            check_equal(replayed_ids, ids.download<int32_t>(), "ids");
            check_equal(replayed, h.download<float>(), "out");
            // And the step is right: the reference from the ids the router chose.
            moe_test::Routing routing(0, E, k, 0);
            routing.ids = ids.download<int32_t>();
            routing.weights = w.download<float>();
            const auto want = moe_test::reference_moe(bank, routing, k, xv, D, T, &shared.mlp, &hv);
            CHECK(test::relative_l2(replayed, want) < (prefill ? 1e-2 : 1e-5));
        }
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
        CUDA_CHECK(cudaStreamDestroy(stream));
    }
}

// ---- moe_router_route: the router matmul and moe_route in one launch ----
namespace {

// Whether a token's selection from these logits (softmax keeps their order) has a near-tie at a
// place that decides it: its k-th and (k+1)-th candidates, or, group-limited, the topk_group-th
// and the next group's scores, closer than `tol`. Only there may a last-bit difference of the
// logits change the ids; everywhere else they must be identical.
bool near_tie(const float* l, int64_t E, const mgl::moe_route_params& p, double tol = 1e-5) {
    auto close = [&](float a, float b) { return std::abs(double(a) - double(b)) <= tol; };
    std::vector<char> alive(size_t(E), 1);
    if (p.method == mgl::topk_method::group_limited_greedy) {
        const int64_t gs = E / p.n_group;
        std::vector<std::pair<float, int>> score;
        for (int g = 0; g < p.n_group; ++g) {
            float mx = -INFINITY;
            for (int64_t e = g * gs; e < (g + 1) * gs; ++e) mx = std::max(mx, l[e]);
            score.push_back({mx, g});
        }
        std::sort(score.begin(), score.end(), [](auto a, auto b) {
            return a.first > b.first || (a.first == b.first && a.second < b.second);
        });
        if (p.topk_group < p.n_group &&
            close(score[size_t(p.topk_group - 1)].first, score[size_t(p.topk_group)].first))
            return true;
        for (size_t g = size_t(p.topk_group); g < score.size(); ++g)
            for (int64_t e = score[g].second * gs; e < (score[g].second + 1) * gs; ++e)
                alive[size_t(e)] = 0;
    }
    std::vector<float> v;
    for (int64_t e = 0; e < E; ++e)
        if (alive[size_t(e)]) v.push_back(l[e]);
    std::sort(v.begin(), v.end(), std::greater<float>());
    return int64_t(v.size()) > p.k && close(v[size_t(p.k - 1)], v[size_t(p.k)]);
}

enum class RouterNorm { none, bf16, bf16_out, f32_out, no_weight_out };

// One router problem on the device: x [T, D], BF16 router weights [E, D], an optional norm, and
// the outputs of either path (logits, probs, ids, weights, the norm's rows).
struct RouterProblem {
    int64_t T, E, D;
    mgl::moe_route_params route;
    RouterNorm norm;
    DeviceBuffer x, w, g, logits, probs, ids, weights, rows, ticket;

    RouterProblem(int64_t T_, int64_t E_, int64_t D_, const mgl::moe_route_params& r, RouterNorm n,
                  uint64_t seed)
        : T(T_),
          E(E_),
          D(D_),
          route(r),
          norm(n),
          x(size_t(T * D) * 4),
          w(size_t(E * D) * 2),
          g(size_t(D) * 4),
          logits(size_t(T * E) * 4),
          probs(size_t(T * E) * 4),
          ids(size_t(T * r.k) * 4),
          weights(size_t(T * r.k) * 4),
          rows(size_t(T * D) * 4),
          ticket(4, 0) {
        x.upload(test::random_floats(size_t(T * D), seed, -1.0f, 1.0f));
        // Logits of order 1 (softmax neither flat nor one-hot): |w| ~ 1 / sqrt(D).
        const float a = 2.0f / std::sqrt(float(D));
        const auto wf = test::random_floats(size_t(E * D), seed + 1, -a, a);
        std::vector<uint16_t> wb(wf.size());
        for (size_t i = 0; i < wf.size(); ++i) wb[i] = mgl::f32_to_bf16(wf[i]);
        w.upload(wb);
        const auto gf = test::random_floats(size_t(D), seed + 2, 0.5f, 1.5f);
        if (norm == RouterNorm::f32_out) {
            g.upload(gf);
        } else {
            std::vector<uint16_t> gb(gf.size());
            for (size_t i = 0; i < gf.size(); ++i) gb[i] = mgl::f32_to_bf16(gf[i]);
            g.upload(gb);
        }
    }
    bool normed() const { return norm != RouterNorm::none; }
    bool writes_rows() const {
        return norm == RouterNorm::bf16_out || norm == RouterNorm::f32_out ||
               norm == RouterNorm::no_weight_out;
    }
    const void* norm_w() const { return norm == RouterNorm::no_weight_out ? nullptr : g.ptr; }
    mgl::dtype norm_w_type() const {
        return norm == RouterNorm::f32_out ? mgl::dtype::f32 : mgl::dtype::bf16;
    }

    // The unfused path: the stream GEMV (with its norm prologue and norm_out), then moe_route.
    void unfused(cudaStream_t stream) const {
        kernels::MatmulParams m = kernels::matmul_params_contiguous(
            mgl::dtype::bf16, w.ptr, nullptr, x.as<float>(), logits.as<float>(), 1, T, E, D);
        m.path = kernels::MatmulPath::stream;
        if (normed()) {
            m.rms_norm = true;
            m.norm_w = norm_w();
            m.norm_w_type = norm_w_type();
            m.norm_eps = 1e-6f;
            if (writes_rows()) {
                m.norm_out = rows.as<float>();
                m.norm_out_row_stride = D;
            }
        }
        REQUIRE(kernels::matmul_workspace_bytes(m) == 0);
        kernels::matmul(m, {}, stream);
        kernels::MoeRoutingParams r;
        r.logits = logits.as<float>();
        r.probs_out = probs.as<float>();
        r.ids = ids.as<int32_t>();
        r.weights = weights.as<float>();
        r.n_tokens = T;
        r.n_experts = E;
        r.route = route;
        kernels::moe_route(r, stream);
    }
    kernels::MoeRouterRouteParams fused_params() const {
        kernels::MoeRouterRouteParams p;
        p.x = x.as<float>();
        p.n_embd = D;
        p.w = w.ptr;
        if (normed()) {
            p.rms_norm = true;
            p.norm_w = norm_w();
            p.norm_w_type = norm_w_type();
            p.norm_eps = 1e-6f;
            if (writes_rows()) p.norm_out = rows.as<float>();
        }
        p.logits = logits.as<float>();
        p.ticket = ticket.as<unsigned int>();
        p.probs_out = probs.as<float>();
        p.ids = ids.as<int32_t>();
        p.weights = weights.as<float>();
        p.n_tokens = T;
        p.n_experts = E;
        p.route = route;
        return p;
    }
    void fused(cudaStream_t stream) const { kernels::moe_router_route(fused_params(), stream); }

    struct Out {
        std::vector<float> logits, probs, weights, rows;
        std::vector<int32_t> ids;
    };
    Out download() const {
        return {logits.download<float>(), probs.download<float>(), weights.download<float>(),
                rows.download<float>(), ids.download<int32_t>()};
    }
    // NaN everywhere (0xff bytes): nothing a path fails to write can pass for a result. (A
    // memset of device memory may return before it is done, on the legacy stream, which the
    // tests' non-blocking streams do not wait for: synchronize.)
    void poison() const {
        for (const DeviceBuffer* b : {&logits, &probs, &weights, &rows, &ids})
            CUDA_CHECK(cudaMemset(b->ptr, 0xff, b->bytes));
        CUDA_CHECK(cudaDeviceSynchronize());
    }
};

bool close_rel(float got, float want, double rel) {
    return std::abs(double(got) - double(want)) <= rel * std::abs(double(want)) + 1e-30;
}

// The fused outputs against the unfused ones: logits and probs to 1e-6 relative (expected
// identical: the same arithmetic), the ids equal for every token without a near-tie at a deciding
// place, and those tokens' weights to 1e-6 relative; the norm's rows likewise.
void check_router_outputs(const RouterProblem& P, const RouterProblem::Out& got,
                          const RouterProblem::Out& want) {
    const int64_t T = P.T, E = P.E, k = P.route.k;
    int bad_logits = 0, bad_probs = 0, exact_logits = 0, bad_rows = 0;
    for (size_t i = 0; i < size_t(T * E); ++i) {
        bad_logits += !close_rel(got.logits[i], want.logits[i], 1e-6);
        bad_probs += !close_rel(got.probs[i], want.probs[i], 1e-6);
        exact_logits += std::memcmp(&got.logits[i], &want.logits[i], 4) == 0;
    }
    if (P.writes_rows())
        for (size_t i = 0; i < size_t(T * P.D); ++i)
            bad_rows += !close_rel(got.rows[i], want.rows[i], 1e-6);
    int ties = 0, bad_ids = 0, bad_weights = 0;
    for (int64_t t = 0; t < T; ++t) {
        if (near_tie(&want.logits[size_t(t * E)], E, P.route)) {
            ++ties;
            continue;
        }
        for (int64_t j = 0; j < k; ++j) {
            const size_t i = size_t(t * k + j);
            bad_ids += got.ids[i] != want.ids[i];
            bad_weights += !close_rel(got.weights[i], want.weights[i], 1e-6);
        }
    }
    INFO("logits bit-identical: " << exact_logits << " of " << T * E << "; tokens with a near-tie "
                                  << ties << " of " << T);
    CHECK(bad_logits == 0);
    CHECK(bad_probs == 0);
    CHECK(bad_rows == 0);
    CHECK(bad_ids == 0);
    CHECK(bad_weights == 0);
}

}  // namespace

TEST_CASE("cuda moe_router_route: as the stream GEMV + moe_route, every shape and norm" *
          doctest::skip(no_gpu)) {
    struct Cfg {
        int64_t E, D;
        mgl::moe_route_params p;
    };
    std::vector<Cfg> cfgs;
    for (int64_t E : {64, 160, 256})
        for (int k : {6, 8}) {
            cfgs.push_back({E, 2048, greedy(k, k == 8)});
            cfgs.push_back({E, 2048, grouped(k, 8, k == 6 ? 3 : 4, k == 6)});
        }
    cfgs.push_back({256, 5120, greedy(16)});             // V2's D; the greedy rounds (NB = 0)
    cfgs.push_back({40, 1000, grouped(6, 8, 3, true)});  // a partial last block and chunk round
    cfgs.push_back({7, 64, greedy(3)});                  // fewer experts than one block's warps
    const RouterNorm norms[] = {RouterNorm::none, RouterNorm::bf16, RouterNorm::bf16_out,
                                RouterNorm::f32_out, RouterNorm::no_weight_out};
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    uint64_t seed = 4000;
    int run = 0;
    for (const Cfg& c : cfgs) {
        for (int64_t T = 1; T <= 8; ++T) {
            const RouterNorm norm = norms[size_t(run++) % 5];
            CAPTURE(c.E);
            CAPTURE(c.D);
            CAPTURE(c.p.k);
            CAPTURE(int(c.p.method));
            CAPTURE(T);
            CAPTURE(int(norm));
            RouterProblem P(T, c.E, c.D, c.p, norm, seed += 10);
            P.poison();
            P.unfused(stream);
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto want = P.download();
            for (int rep = 0; rep < 2; ++rep) {  // the ticket is back at 0 for the next launch
                P.poison();
                P.fused(stream);
                CUDA_CHECK(cudaStreamSynchronize(stream));
                CHECK(P.ticket.download<uint32_t>()[0] == 0u);
                check_router_outputs(P, P.download(), want);
            }
        }
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("cuda moe_router_route: replayed from a CUDA graph after a PDL producer of x" *
          doctest::skip(no_gpu)) {
    // The captured step: a 45 MB GEMV writes x (long enough that an early read of x would see
    // the NaN it is reset to), then the fused router, both launched dependent (PDL). Each replay
    // takes new input; its results must equal the unfused path run eagerly on the x it produced.
    for (const int64_t T : {int64_t(1), int64_t(5)}) {
        CAPTURE(T);
        const int64_t D = 2048, K0 = 10944;
        RouterProblem P(T, 64, D, grouped(6, 8, 3, true), RouterNorm::bf16_out, 7000 + T);
        DeviceBuffer x0(size_t(T * K0) * 4), w0(size_t(D * K0) * 2);
        {
            const auto wf = test::random_floats(size_t(D * K0), 7100, -0.02f, 0.02f);
            std::vector<uint16_t> wb(wf.size());
            for (size_t i = 0; i < wf.size(); ++i) wb[i] = mgl::f32_to_bf16(wf[i]);
            w0.upload(wb);
        }
        kernels::MatmulParams producer = kernels::matmul_params_contiguous(
            mgl::dtype::bf16, w0.ptr, nullptr, x0.as<float>(), P.x.as<float>(), 1, T, D, K0);
        producer.path = kernels::MatmulPath::stream;
        producer.pdl = true;
        kernels::MoeRouterRouteParams fp = P.fused_params();
        fp.pdl = true;
        cudaStream_t stream;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        cudaGraph_t graph;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        kernels::matmul(producer, {}, stream);
        kernels::moe_router_route(fp, stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (int rep = 0; rep < 3; ++rep) {
            CAPTURE(rep);
            x0.upload(test::random_floats(size_t(T * K0), 7200 + uint64_t(rep)));
            CUDA_CHECK(cudaMemset(P.x.ptr, 0xff, P.x.bytes));
            P.poison();  // and synchronizes
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            CHECK(P.ticket.download<uint32_t>()[0] == 0u);
            const auto got = P.download();
            P.poison();
            P.unfused(stream);  // on the x the replay produced
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto want = P.download();
            check_router_outputs(P, got, want);
            bool finite = true;
            for (float v : got.logits) finite = finite && std::isfinite(v);
            CHECK(finite);
        }
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
        CUDA_CHECK(cudaStreamDestroy(stream));
    }
}

TEST_CASE("cuda moe_router_route rejects what it cannot take before touching the device") {
    alignas(16) static float fx[64];
    alignas(16) static uint16_t fw[8 * 64];
    alignas(16) static float fl[8];
    static unsigned int ticket;
    static int32_t fi[8];
    static float fwt[8];
    kernels::MoeRouterRouteParams p;
    p.x = fx;
    p.n_embd = 64;
    p.w = fw;
    p.logits = fl;
    p.ticket = &ticket;
    p.ids = fi;
    p.weights = fwt;
    p.n_tokens = 1;
    p.n_experts = 8;
    p.route = greedy(2);
    CHECK(kernels::moe_router_route_unsupported(p).empty());
    auto bad = p;
    bad.n_tokens = 9;
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.n_experts = 257;
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.w_type = mgl::dtype::f8_e4m3;
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.n_embd = 60;  // not a whole number of 16-byte chunks
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.x = fx + 1;  // misaligned
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.norm_out = fx;  // norm_out without the norm
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    bad = p;
    bad.route.k = 9;  // k > E
    CHECK(!kernels::moe_router_route_unsupported(bad).empty());
    CHECK_THROWS_AS(kernels::moe_router_route(bad, nullptr), mgl::error);
    bad = p;
    bad.ticket = nullptr;
    CHECK(kernels::moe_router_route_unsupported(bad).empty());  // presence is the launcher's
    CHECK_THROWS_AS(kernels::moe_router_route(bad, nullptr), mgl::error);
}
#endif  // MINIDS_HAVE_CUDA
