// The DeepSeek-V2 forward on the CUDA backend (tiny-v2-lite, weights copied to the device):
// logits against transformers' float64 reference, greedy tokens, incremental decode through the
// recorded (replayed) decode graph against one prompt pass and against the CPU, and replay
// against eager decoding on an independent backend, with BF16 and FP8 experts.
//
// Where the error comes from: prompts of more than 16 tokens take cuBLAS GEMMs with x rounded to
// BF16, the grouped MoE kernels with BF16 activations and MLA prefill on tensor cores (bound
// 2e-2 relative L2 against the reference, as for the CPU's BF16 weights). Decode steps and short
// chunks (<= 16 tokens) run FP32 kernels only except attention over a bf16 or f16 cache (tensor
// cores), so incremental decoding with an f32 cache matches the CPU's to ~1e-5 (bound 1e-4), with
// a bf16 cache within the BF16 bound, and with an f16 cache (q and probabilities rounded to F16,
// 8x less than BF16; not yet measured) within half of it. The DeepSeek-V2 family variant fixtures
// (issue 13) are held to the same BF16 bounds here that the CPU meets at 1e-5
// (test_model_variants.cpp).
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "mgl-cuda.h"
#include "model_test_util.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "variant_fixtures.h"

using namespace minids;
using namespace minids::test;

namespace {

const bool no_gpu = !cuda_device_available();

TestModel open_cuda_model(const std::filesystem::path& path, const mgl::cuda_options& o = {}) {
    TestModel m;
    m.file = mds::MdsFile::open(path.string());
    m.backend = mgl::make_cuda_backend(o);
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend);
    return m;
}

SessionParams session_params(mgl::dtype kv, int64_t n_ctx = 512, int64_t page_size = 64) {
    SessionParams p;
    p.n_ctx = n_ctx;
    p.page_size = page_size;
    p.kv_type = kv;
    return p;
}

// Teacher-forced greedy: feeds the reference's tokens and, per step, compares our arg-max with
// the reference's next token. A disagreement is acceptable when the two logits are within `tol`
// of the row's largest magnitude (a near tie that BF16 rounding may flip). Returns the number of
// agreeing steps; `worst_gap` is the largest relative gap of a disagreement.
size_t teacher_forced(Session& s, std::span<const int32_t> prompt, std::span<const int32_t> ref,
                      double& worst_gap) {
    std::vector<float> logits = s.eval(prompt);
    size_t agree = 0;
    for (size_t k = 0; k < ref.size(); ++k) {
        const auto best = size_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
        if (int32_t(best) == ref[k]) {
            ++agree;
        } else {
            double scale = 0;
            for (float v : logits) scale = std::max(scale, std::fabs(double(v)));
            worst_gap = std::max(worst_gap,
                                 (double(logits[best]) - double(logits[size_t(ref[k])])) / scale);
        }
        const int32_t next[1] = {ref[k]};
        if (k + 1 < ref.size()) logits = s.eval(next);
    }
    return agree;
}

}  // namespace

TEST_CASE(
    "cuda model: tiny-v2-lite logits vs the float64 reference (BF16 experts, F32, BF16, F16 KV)" *
    doctest::skip(no_gpu)) {
    TestModel m = open_cuda_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    for (mgl::dtype kv : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f16}) {
        double worst = 0;
        std::string each;
        for (size_t i = 0; i < ref.prompts.size(); ++i) {
            Session s(*m.model, *m.backend, session_params(kv));
            std::vector<float> logits = s.eval(ref.prompts[i], /*all_logits=*/true);
            REQUIRE(logits.size() == ref.logits[i].values.size());
            const double l2 = relative_l2(logits, ref.logits[i].values);
            INFO(std::string(mgl::dtype_name(kv))
                 << " KV, prompt " << i << " (" << ref.prompts[i].size() << " tokens): relative L2 "
                 << l2);
            CHECK(l2 <= 2e-2);
            worst = std::max(worst, l2);
            each += ' ';
            each += std::to_string(l2);
        }
        MESSAGE("CUDA, BF16 experts, " << std::string(mgl::dtype_name(kv))
                                       << " KV: relative L2 of logits per prompt:" << each
                                       << " (worst " << worst << ", bound 2e-2)");
    }
}

TEST_CASE("cuda model: greedy tokens match the reference, or differ only at near ties" *
          doctest::skip(no_gpu)) {
    TestModel m = open_cuda_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    size_t identical = 0, agree = 0, total = 0;
    double worst_gap = 0;
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        Session s(*m.model, *m.backend, session_params(mgl::dtype::bf16));
        const std::vector<int32_t> g = greedy_tokens(s, ref.prompts[i], 24);
        size_t same = 0;
        while (same < g.size() && g[same] == ref.greedy[i][same]) ++same;
        identical += same;
        s.truncate(0);
        agree += teacher_forced(s, ref.prompts[i], ref.greedy[i], worst_gap);
        total += ref.greedy[i].size();
    }
    MESSAGE("CUDA greedy: identical free-running prefixes "
            << identical << "/" << total << ", teacher-forced agreement " << agree << "/" << total
            << ", worst top-1 vs reference gap " << worst_gap << " of max |logit|");
    CHECK(worst_gap <= 1e-2);  // any disagreement is a near tie
    CHECK(agree * 10 >= total * 9);
}

TEST_CASE(
    "cuda model: incremental decode through the replayed graph vs one prompt pass and the CPU" *
    doctest::skip(no_gpu)) {
    FixtureReference ref = load_fixture_reference();
    const auto& prompt = ref.prompts[1];  // 41 tokens
    for (mgl::dtype experts : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
        TestModel gpu = open_cuda_model(converted_fixture(experts));
        TestModel cpu = open_test_model(converted_fixture(experts));
        const size_t T = prompt.size(), V = size_t(gpu.model->config().vocab_size);
        for (mgl::dtype kv : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f16}) {
            CAPTURE(std::string(mgl::dtype_name(experts)));
            CAPTURE(std::string(mgl::dtype_name(kv)));
            // Page size 8: the 41 positions span six pages, so the page table changes between
            // replays of the decode graph.
            auto incremental = [&](TestModel& m) {
                Session s(*m.model, *m.backend, session_params(kv, 64, 8));
                std::vector<float> rows = s.eval(std::span(prompt).first(5), true);
                for (size_t t = 5; t < T; ++t) {
                    std::vector<float> l = s.eval(std::span(prompt).subspan(t, 1), true);
                    rows.insert(rows.end(), l.begin(), l.end());
                }
                return rows;
            };
            const std::vector<float> gpu_rows = incremental(gpu), cpu_rows = incremental(cpu);
            Session one_shot(*gpu.model, *gpu.backend, session_params(kv, 64, 8));
            const std::vector<float> full = one_shot.eval(prompt, true);
            const double vs_cpu = worst_position_error(
                gpu_rows, T, V, [&](size_t t, size_t v) { return double(cpu_rows[t * V + v]); });
            // The prompt pass computes its big matmuls with BF16 inputs (cuBLAS, tensor-core MoE
            // and MLA) and the decode steps in FP32: compared as the issue bounds BF16 compute,
            // by the relative L2 of all the logits.
            const std::vector<double> full_d(full.begin(), full.end());
            const double vs_full = relative_l2(gpu_rows, full_d);
            // With f32 pages decode attention is FP32 (the CUDA-core kernel); with bf16 pages it
            // runs on tensor cores (q and the probabilities rounded to BF16): the BF16 bound;
            // with f16 pages on tensor cores in F16 (8x less rounding): half the BF16 bound
            // until measured.
            const double cpu_bound = kv == mgl::dtype::f32   ? 1e-4
                                     : kv == mgl::dtype::f16 ? 1e-2
                                                             : 2e-2;
            MESSAGE("CUDA incremental decode, " << std::string(mgl::dtype_name(experts))
                                                << " experts, " << std::string(mgl::dtype_name(kv))
                                                << " KV: worst max|diff|/max|row| vs the CPU "
                                                << vs_cpu << " (bound " << cpu_bound
                                                << "), relative L2 vs one CUDA prompt "
                                                << "pass " << vs_full << " (bound 2e-2)");
            CHECK(vs_cpu <= cpu_bound);
            CHECK(vs_full <= 2e-2);
        }
    }
}

TEST_CASE("cuda model: the replayed decode graph equals eager decoding, a new token every step" *
          doctest::skip(no_gpu)) {
    FixtureReference ref = load_fixture_reference();
    mgl::cuda_options eager_options;
    eager_options.graphs = false;
    for (mgl::dtype experts : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
        // Independent backends, weights, caches and sessions.
        TestModel replayed = open_cuda_model(converted_fixture(experts));
        TestModel eager = open_cuda_model(converted_fixture(experts), eager_options);
        const int32_t V = int32_t(replayed.model->config().vocab_size);
        for (mgl::dtype kv : {mgl::dtype::bf16, mgl::dtype::f32, mgl::dtype::f16}) {
            CAPTURE(std::string(mgl::dtype_name(experts)));
            CAPTURE(std::string(mgl::dtype_name(kv)));
            Session a(*replayed.model, *replayed.backend, session_params(kv, 128, 8));
            Session b(*eager.model, *eager.backend, session_params(kv, 128, 8));
            b.set_decode_graph(false);  // a fresh graph per token, run eagerly
            a.eval(ref.prompts[0]);
            b.eval(ref.prompts[0]);
            double worst = 0;
            bool bitwise = true;
            for (int32_t step = 0; step < 40; ++step) {
                const int32_t token[1] = {(step * 37 + 11) % V};
                const std::vector<float> la = a.eval(token), lb = b.eval(token);
                REQUIRE(la.size() == lb.size());
                double scale = 0, diff = 0;
                for (size_t i = 0; i < la.size(); ++i) {
                    scale = std::max(scale, std::fabs(double(lb[i])));
                    diff = std::max(diff, std::fabs(double(la[i]) - double(lb[i])));
                    bitwise = bitwise && la[i] == lb[i];
                }
                worst = std::max(worst, diff / scale);
            }
            MESSAGE("CUDA decode graph replay vs eager, "
                    << std::string(mgl::dtype_name(experts)) << " experts, "
                    << std::string(mgl::dtype_name(kv)) << " KV, 40 steps: worst max|diff|/"
                    << "max|logit| " << worst << std::string(bitwise ? " (bitwise equal)" : ""));
            CHECK(worst <= 1e-6);
        }
    }
}

TEST_CASE("cuda model: FP8 experts stay close to the reference" * doctest::skip(no_gpu)) {
    TestModel m = open_cuda_model(converted_fixture(mgl::dtype::f8_e4m3));
    FixtureReference ref = load_fixture_reference();
    size_t agree = 0, total = 0;
    double worst_l2 = 0, worst_gap = 0;
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        Session s(*m.model, *m.backend, session_params(mgl::dtype::bf16));
        const std::vector<float> logits = s.eval(ref.prompts[i], true);
        const double l2 = relative_l2(logits, ref.logits[i].values);
        INFO("prompt " << i << ": relative L2 " << l2);
        CHECK(l2 <= 5e-2);
        worst_l2 = std::max(worst_l2, l2);
        s.truncate(0);
        agree += teacher_forced(s, ref.prompts[i], ref.greedy[i], worst_gap);
        total += ref.greedy[i].size();
    }
    MESSAGE("CUDA, FP8 experts, BF16 KV: worst relative L2 of logits "
            << worst_l2 << " (bound 5e-2); teacher-forced greedy agreement " << agree << "/"
            << total);
    CHECK(agree * 10 >= total * 8);
}

// Every variant fixture under tests/data/variants on the GPU (BF16 experts), three ways:
//  - exact: F32 KV cache and one token at a time through the replayed decode graph, where every
//    kernel computes in FP32: each stored position's logits within 1e-4 of max|logit| of the
//    reference (the CPU meets 1e-5; the GPU sums in other orders), so every variant's math is
//    checked on the GPU as tightly as FP32 allows;
//  - BF16, same routing: the prompt pass as run and chat do it (BF16 KV cache, tensor-core GEMMs
//    and attention over BF16 inputs) with the CPU engine's expert choice imposed: relative L2 of
//    the logits within 2e-2, the bound of the tiny fixture;
//  - BF16, free: the same with the GPU's own routing. Rounding the activations to BF16 can flip
//    a near-tied expert choice (or a whole group under group-limited routing), which moves that
//    token's logits by far more than rounding does; the flips are counted against the CPU's
//    choice and reported with the error, and teacher-forced greedy must agree on >= 90 % of
//    steps, as for the tiny fixture.
TEST_CASE("cuda model: every variant fixture, exact in FP32 and within the BF16 bound" *
          doctest::skip(no_gpu)) {
    const VariantManifest manifest = load_variant_manifest();
    for (const auto& p : manifest.problems) FAIL_CHECK("variant fixtures: " << p);
    std::ostringstream table;
    size_t ran = 0;
    for (const auto& v : manifest.variants) {
        INFO("variant " << v.name);
        try {
            const VariantReference ref = load_variant_reference(v.dir);
            TempDir tmp;
            const std::filesystem::path mds = tmp.path / "model.mds";
            convert_quiet(v.dir, mds, mgl::dtype::bf16);
            TestModel gpu = open_cuda_model(mds);
            TestModel cpu = open_test_model(mds);
            const size_t V = size_t(gpu.model->config().vocab_size);
            double exact = 0, same_l2 = 0, free_l2 = 0, worst_gap = 0;
            size_t agree = 0, total = 0, flips = 0, choices = 0;
            for (size_t i = 0; i < ref.prompts.size(); ++i) {
                const auto& prompt = ref.prompts[i];
                const auto& want = ref.logits[i].values;
                const auto& positions = ref.positions[i];
                const int64_t n_ctx = int64_t(prompt.size() + ref.greedy[i].size() + 8);
                auto pick = [&](const std::vector<float>& all) {
                    REQUIRE(all.size() == prompt.size() * V);
                    return rows_at(all, positions, V);
                };

                // Exact: one token at a time, F32 cache.
                {
                    Session s(*gpu.model, *gpu.backend, session_params(mgl::dtype::f32, n_ctx, 16));
                    std::vector<float> all;
                    for (int32_t tok : prompt) {
                        const int32_t one[1] = {tok};
                        const std::vector<float> l = s.eval(one);
                        all.insert(all.end(), l.begin(), l.end());
                    }
                    const double e =
                        worst_position_error(pick(all), positions.size(), V,
                                             [&](size_t t, size_t k) { return want[t * V + k]; });
                    CHECK_MESSAGE(e <= 1e-4, "variant " << v.name << ", prompt " << i
                                                        << ": FP32 decode path, worst position "
                                                        << e);
                    exact = std::max(exact, e);
                }

                // The CPU's expert choice for the prompt.
                RoutingRecord cpu_routing;
                {
                    Session s(*cpu.model, *cpu.backend, session_params(mgl::dtype::f32, n_ctx, 16));
                    s.set_routing_observer([&](const RoutingRecord& r) { cpu_routing = r; });
                    s.eval(prompt, /*all_logits=*/true);
                }

                // BF16 with the CPU's routing imposed.
                {
                    Session s(*gpu.model, *gpu.backend,
                              session_params(mgl::dtype::bf16, n_ctx, 16));
                    s.set_routing_override([&](RoutingRecord& r) {
                        REQUIRE(r.ids.size() == cpu_routing.ids.size());
                        r.ids = cpu_routing.ids;
                        r.weights = cpu_routing.weights;
                    });
                    const double l2 = relative_l2(pick(s.eval(prompt, true)), want);
                    CHECK_MESSAGE(l2 <= 2e-2, "variant " << v.name << ", prompt " << i
                                                         << ": BF16 with the CPU's routing, "
                                                         << "relative L2 " << l2);
                    same_l2 = std::max(same_l2, l2);
                }

                // BF16, the GPU's own routing: flips counted, greedy teacher-forced.
                {
                    Session s(*gpu.model, *gpu.backend,
                              session_params(mgl::dtype::bf16, n_ctx, 16));
                    RoutingRecord own;
                    s.set_routing_observer([&](const RoutingRecord& r) {
                        if (r.prefill) own = r;
                    });
                    free_l2 = std::max(free_l2, relative_l2(pick(s.eval(prompt, true)), want));
                    REQUIRE(own.ids.size() == cpu_routing.ids.size());
                    const size_t k = size_t(own.k);
                    for (size_t c = 0; c + k <= own.ids.size(); c += k) {
                        std::vector<int32_t> a(own.ids.begin() + std::ptrdiff_t(c),
                                               own.ids.begin() + std::ptrdiff_t(c + k));
                        std::vector<int32_t> b(cpu_routing.ids.begin() + std::ptrdiff_t(c),
                                               cpu_routing.ids.begin() + std::ptrdiff_t(c + k));
                        std::sort(a.begin(), a.end());
                        std::sort(b.begin(), b.end());
                        flips += a != b;
                        ++choices;
                    }
                    s.set_routing_observer({});
                    s.truncate(0);
                    agree += teacher_forced(s, prompt, ref.greedy[i], worst_gap);
                    total += ref.greedy[i].size();
                }
            }
            CHECK(agree * 10 >= total * 9);
            char line[200];
            std::snprintf(line, sizeof line, "\n  %-19s %-10.2e %-10.2e %-10.2e %5zu/%-6zu %zu/%zu",
                          v.name.c_str(), exact, same_l2, free_l2, flips, choices, agree, total);
            table << line;
            ++ran;
        } catch (const std::exception& e) {
            FAIL_CHECK("variant " << v.name << ": " << std::string(e.what()));
        }
    }
    MESSAGE(
        "CUDA, variant fixtures, BF16 experts (bounds: exact <= 1e-4 of max|logit| per "
        "position; same routing relative L2 <= 2e-2; free: greedy >= 90 % teacher-forced): ran "
        << ran << " of " << manifest.variants.size()
        << "\n  variant             exact      same rt L2 free L2    flips/choices "
           "greedy"
        << table.str());
    CHECK(ran == manifest.variants.size());
}

#endif  // MINIDS_HAVE_CUDA
