// The DeepSeek-V2 forward on the CUDA backend (tiny-v2-lite, weights copied to the device):
// logits against transformers' float64 reference, greedy tokens, incremental decode through the
// recorded (replayed) decode graph against one prompt pass and against the CPU, and replay
// against eager decoding on an independent backend, with BF16 and FP8 experts.
//
// Where the error comes from: prompts of more than 16 tokens take cuBLAS GEMMs with x rounded to
// BF16, the grouped MoE kernels with BF16 activations and MLA prefill on tensor cores (bound
// 2e-2 relative L2 against the reference, as for the CPU's BF16 weights). Decode steps and short
// chunks (<= 16 tokens) run FP32 kernels only except attention over a bf16 cache (tensor cores),
// so incremental decoding with an f32 cache matches the CPU's to ~1e-5 (bound 1e-4) and with a
// bf16 cache within the BF16 bound.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "mgl-cuda.h"
#include "model_test_util.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/session.h"

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
    "cuda model: tiny-v2-lite logits vs the float64 reference (BF16 experts, F32 and BF16 KV)" *
    doctest::skip(no_gpu)) {
    TestModel m = open_cuda_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    for (mgl::dtype kv : {mgl::dtype::f32, mgl::dtype::bf16}) {
        double worst = 0;
        std::string each;
        for (size_t i = 0; i < ref.prompts.size(); ++i) {
            Session s(*m.model, *m.backend, session_params(kv));
            std::vector<float> logits = s.eval(ref.prompts[i], /*all_logits=*/true);
            REQUIRE(logits.size() == ref.logits[i].values.size());
            const double l2 = relative_l2(logits, ref.logits[i].values);
            INFO(mgl::dtype_name(kv) << " KV, prompt " << i << " (" << ref.prompts[i].size()
                                     << " tokens): relative L2 " << l2);
            CHECK(l2 <= 2e-2);
            worst = std::max(worst, l2);
            each += ' ';
            each += std::to_string(l2);
        }
        MESSAGE("CUDA, BF16 experts, " << mgl::dtype_name(kv)
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
        for (mgl::dtype kv : {mgl::dtype::f32, mgl::dtype::bf16}) {
            CAPTURE(mgl::dtype_name(experts));
            CAPTURE(mgl::dtype_name(kv));
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
            // runs on tensor cores (q and the probabilities rounded to BF16): the BF16 bound.
            const double cpu_bound = kv == mgl::dtype::f32 ? 1e-4 : 2e-2;
            MESSAGE("CUDA incremental decode, "
                    << mgl::dtype_name(experts) << " experts, " << mgl::dtype_name(kv)
                    << " KV: worst max|diff|/max|row| vs the CPU " << vs_cpu << " (bound "
                    << cpu_bound << "), relative L2 vs one CUDA prompt "
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
        for (mgl::dtype kv : {mgl::dtype::bf16, mgl::dtype::f32}) {
            CAPTURE(mgl::dtype_name(experts));
            CAPTURE(mgl::dtype_name(kv));
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
                    << mgl::dtype_name(experts) << " experts, " << mgl::dtype_name(kv)
                    << " KV, 40 steps: worst max|diff|/"
                    << "max|logit| " << worst << (bitwise ? " (bitwise equal)" : ""));
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

#endif  // MINIDS_HAVE_CUDA
