// The DeepSeek-V2 forward on the CPU backend against transformers' float64 reference logits for
// tiny-v2-lite (converted to .mds here), greedy decoding, and incremental decoding through the
// paged latent cache.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "model_reference.h"
#include "model_test_util.h"
#include "runtime/kv_cache.h"
#include "runtime/session.h"

using namespace minids;
using namespace minids::test;

namespace {

SessionParams small_session(int64_t n_ctx = 512, int64_t page_size = 64) {
    SessionParams p;
    p.n_ctx = n_ctx;
    p.page_size = page_size;
    return p;
}

}  // namespace

TEST_CASE("model: tiny-v2-lite logits match the reference at every position (BF16 experts)") {
    TestModel m = open_test_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    const size_t V = size_t(m.model->config().vocab_size);
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        Session s(*m.model, *m.backend, small_session());
        std::vector<float> logits = s.eval(ref.prompts[i], /*all_logits=*/true);
        REQUIRE(logits.size() == ref.prompts[i].size() * V);
        const auto& r = ref.logits[i].values;
        double err = worst_position_error(logits, ref.prompts[i].size(), V,
                                          [&](size_t t, size_t v) { return r[t * V + v]; });
        INFO("prompt " << i << " (" << ref.prompts[i].size()
                       << " tokens): worst max|diff|/max|ref| = " << err);
        CHECK(err <= 1e-4);
    }
}

TEST_CASE("model: tiny-v2-lite greedy tokens match the reference") {
    TestModel m = open_test_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        Session s(*m.model, *m.backend, small_session());
        INFO("prompt " << i);
        CHECK(greedy_tokens(s, ref.prompts[i], 24) == ref.greedy[i]);
    }
}

TEST_CASE(
    "model: the cache holds c after kv_a_layernorm and k_pe after RoPE, per layer and position") {
    TestModel m = open_test_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    const auto& prompt = ref.prompts[1];
    const ModelConfig& c = m.model->config();
    const std::string dir = (data_dir() / "tiny-v2-lite").string();
    StTensors w;
    read_safetensors(dir + "/model-00001-of-00002.safetensors", w);
    read_safetensors(dir + "/model-00002-of-00002.safetensors", w);
    RefModel reference(
        ref_config_from_hf(nlohmann::json::parse(std::ifstream(dir + "/config.json"))), w);

    Session s(*m.model, *m.backend, small_session(64, 16));
    s.eval(prompt);
    std::vector<float> row(size_t(c.kv_cache_width()));
    double worst = 0.0;
    size_t rows = 0;
    reference.forward(prompt, [&](int64_t layer, int64_t pos, const Vec& cn, const Vec& k_pe) {
        s.cache().read_row(s.sequence(), layer, pos, row.data());
        Vec want = cn;
        want.insert(want.end(), k_pe.begin(), k_pe.end());
        double max_diff = 0.0, max_ref = 0.0;
        for (size_t i = 0; i < want.size(); ++i) {
            max_diff = std::max(max_diff, std::fabs(double(row[i]) - want[i]));
            max_ref = std::max(max_ref, std::fabs(want[i]));
        }
        worst = std::max(worst, max_diff / max_ref);
        ++rows;
    });
    CHECK(rows == size_t(c.num_hidden_layers) * prompt.size());
    INFO("worst relative difference of a cached row " << worst);
    CHECK(worst <= 1e-5);
}

TEST_CASE("model: incremental decode and chunked prefill give the one-shot logits") {
    TestModel m = open_test_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    const auto& prompt = ref.prompts[1];  // 41 tokens
    const size_t T = prompt.size(), V = size_t(m.model->config().vocab_size);
    // Page size 8, so the 41 positions span six pages and the chunks cross page boundaries.
    Session one_shot(*m.model, *m.backend, small_session(64, 8));
    const std::vector<float> full = one_shot.eval(prompt, true);
    auto compare_rows = [&](const std::vector<float>& got, size_t first_pos) {
        const size_t n = got.size() / V;
        return worst_position_error(
            got, n, V, [&](size_t t, size_t v) { return double(full[(first_pos + t) * V + v]); });
    };

    SUBCASE("prefill 5 tokens, then one at a time") {
        Session s(*m.model, *m.backend, small_session(64, 8));
        double worst = compare_rows(s.eval(std::span(prompt).first(5), true), 0);
        for (size_t t = 5; t < T; ++t)
            worst = std::max(worst, compare_rows(s.eval(std::span(prompt).subspan(t, 1), true), t));
        INFO("worst relative difference " << worst);
        CHECK(worst <= 1e-5);
        CHECK(s.cache().length(s.sequence()) == int64_t(T));
    }
    SUBCASE("prefill in chunks of 13, 9 and 19") {
        Session s(*m.model, *m.backend, small_session(64, 8));
        double worst = compare_rows(s.eval(std::span(prompt).first(13), true), 0);
        worst = std::max(worst, compare_rows(s.eval(std::span(prompt).subspan(13, 9), true), 13));
        worst = std::max(worst, compare_rows(s.eval(std::span(prompt).subspan(22), true), 22));
        INFO("worst relative difference " << worst);
        CHECK(worst <= 1e-5);
    }
    SUBCASE("eval_last: the last position's logits as a view, prompt in chunks then decode") {
        SessionParams sp = small_session(64, 8);
        sp.n_ubatch = 7;  // the 12-token prompt runs as chunks of 7 and 5
        Session s(*m.model, *m.backend, sp);
        std::span<float> view = s.eval_last(std::span(prompt).first(12));
        REQUIRE(view.size() == V);
        double worst = compare_rows(std::vector<float>(view.begin(), view.end()), 11);
        for (size_t t = 12; t < 16; ++t) {
            view = s.eval_last(std::span(prompt).subspan(t, 1));
            REQUIRE(view.size() == V);
            worst = std::max(worst, compare_rows(std::vector<float>(view.begin(), view.end()), t));
        }
        INFO("worst relative difference " << worst);
        CHECK(worst <= 1e-5);
        CHECK(s.n_past() == 16);
    }
    SUBCASE("truncate back to a prefix and continue") {
        Session s(*m.model, *m.backend, small_session(64, 8));
        std::vector<int32_t> other(prompt.begin(), prompt.begin() + 20);
        for (size_t i = 10; i < 20; ++i)
            other[i] = (other[i] * 7 + 3) % int32_t(V);  // diverges at 10
        s.eval(other);
        CHECK(s.common_prefix(prompt) == 10);
        s.truncate(10);
        CHECK(s.cache().length(s.sequence()) == 10);
        double worst = compare_rows(s.eval(std::span(prompt).subspan(10), true), 10);
        INFO("worst relative difference " << worst);
        CHECK(worst <= 1e-5);
    }
    SUBCASE("two sequences interleaving their pages in one cache") {
        KvCacheParams kp;
        kp.n_layer = m.model->config().num_hidden_layers;
        kp.kv_lora_rank = m.model->config().kv_lora_rank;
        kp.rope_dim = m.model->config().qk_rope_head_dim;
        kp.n_ctx = 64;
        kp.page_size = 4;
        kp.n_pages = 32;
        kp.max_sequences = 2;
        LatentKvCache cache(*m.backend, kp);
        Session a(*m.model, *m.backend, cache), b(*m.model, *m.backend, cache);
        const auto& other = ref.prompts[2];
        double worst = 0.0;
        for (size_t t = 0; t < T; t += 3) {
            const size_t n = std::min<size_t>(3, T - t);
            worst = std::max(worst, compare_rows(a.eval(std::span(prompt).subspan(t, n), true), t));
            b.eval(std::span(other).subspan(t, 2));
        }
        INFO("worst relative difference " << worst);
        CHECK(worst <= 1e-5);
    }
}

TEST_CASE("model: FP8 experts stay close to the reference") {
    TestModel m = open_test_model(converted_fixture(mgl::dtype::f8_e4m3));
    FixtureReference ref = load_fixture_reference();
    const size_t V = size_t(m.model->config().vocab_size);
    size_t prefix_total = 0, forced_agree = 0, total = 0;
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        Session s(*m.model, *m.backend, small_session());
        std::vector<float> logits = s.eval(ref.prompts[i], true);
        double l2 = relative_l2(logits, ref.logits[i].values);
        INFO("prompt " << i << ": relative L2 " << l2);
        CHECK(l2 <= 5e-2);
        // Free-running: how long the greedy continuation stays identical (after the first
        // difference the two are different texts).
        s.truncate(0);
        std::vector<int32_t> g = greedy_tokens(s, ref.prompts[i], 24);
        size_t same = 0;
        while (same < g.size() && g[same] == ref.greedy[i][same]) ++same;
        prefix_total += same;
        // Teacher-forced: feed the reference's greedy tokens and count the steps whose arg-max
        // is the reference's next token.
        s.truncate(0);
        std::vector<float> last(logits.end() - std::ptrdiff_t(V), logits.end());
        s.eval(ref.prompts[i]);
        size_t forced = 0;
        for (size_t k = 0; k < ref.greedy[i].size(); ++k) {
            forced += int32_t(std::max_element(last.begin(), last.end()) - last.begin()) ==
                      ref.greedy[i][k];
            const int32_t next[1] = {ref.greedy[i][k]};
            if (k + 1 < ref.greedy[i].size()) last = s.eval(next);
        }
        forced_agree += forced;
        total += ref.greedy[i].size();
        MESSAGE("FP8 experts, prompt " << i << ": relative L2 of logits " << l2
                                       << "; greedy: first " << same << " of 24 tokens identical, "
                                       << forced << " of 24 steps agree teacher-forced");
    }
    MESSAGE("FP8 experts: teacher-forced greedy agreement "
            << forced_agree << "/" << total << ", identical free-running prefixes " << prefix_total
            << "/" << total);
    CHECK(forced_agree * 10 >= total * 8);
}

TEST_CASE("model: a layer's router applied to its own FFN input gives the forward's routing") {
    // build_routing_prediction is the prefetch's prediction (a later layer's router on an
    // earlier state); on the layer's own state it must reproduce what the forward routed.
    TestModel m = open_test_model(converted_fixture(mgl::dtype::bf16));
    FixtureReference ref = load_fixture_reference();
    const auto& prompt = ref.prompts[1];
    const ModelConfig& c = m.model->config();
    const int64_t T = int64_t(prompt.size()), D = c.hidden_size, k = c.num_experts_per_tok;
    Session s(*m.model, *m.backend, small_session());
    std::map<std::string, std::vector<float>> seen;
    TensorObserver obs = [&](const mgl::tensor& t, std::span<const float> v) {
        if (t.name.rfind("ffn_inp-", 0) == 0 || t.name.rfind("expert_ids-", 0) == 0)
            seen[t.name].assign(v.begin(), v.end());
    };
    s.eval(prompt, false, &obs);
    REQUIRE(!m.model->moe_layers().empty());
    for (int64_t il : m.model->moe_layers()) {
        mgl::context ctx;
        mgl::tensor* h = ctx.new_tensor(mgl::dtype::f32, {T, D}, "h");
        mgl::buffer_ptr in = m.backend->alloc_buffer(mgl::nbytes(*h));
        mgl::bind(*h, *in, 0);
        const auto& state = seen.at("ffn_inp-" + std::to_string(il));
        REQUIRE(state.size() == size_t(T * D));
        m.backend->upload(*h, state.data(), 0, mgl::nbytes(*h));
        mgl::tensor* ids = m.model->build_routing_prediction(ctx, il, h);
        CHECK(ids->name == "predicted_ids-" + std::to_string(il));
        mgl::graph g = mgl::build_graph(ctx, {ids});
        m.backend->allocate(g);
        m.backend->compute(g);
        m.backend->synchronize();
        std::vector<int32_t> got(size_t(T * k));
        m.backend->download(*ids, got.data(), 0, got.size() * sizeof(int32_t));
        const auto& want = seen.at("expert_ids-" + std::to_string(il));
        INFO("layer " << il);
        CHECK(std::equal(got.begin(), got.end(), want.begin(),
                         [](int32_t a, float b) { return a == int32_t(b); }));
    }
    for (int64_t il = 0; il < c.num_hidden_layers; ++il) {
        if (c.is_moe_layer(il)) continue;
        mgl::context ctx;
        mgl::tensor* h = ctx.new_tensor(mgl::dtype::f32, {T, D}, "h");
        CHECK_THROWS_AS(m.model->build_routing_prediction(ctx, il, h), mgl::error);
    }
}
