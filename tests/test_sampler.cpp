// Sampler: each filter on hand-made logits against probabilities worked out by hand or in double.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <random>
#include <vector>

#include "runtime/sampler.h"

using minids::Sampler;
using minids::SamplerParams;

namespace {

SamplerParams no_filters(float temp) {
    SamplerParams p;
    p.temp = temp;
    p.top_k = 0;
    p.top_p = 1.0f;
    p.min_p = 0.0f;
    p.seed = 1234;
    return p;
}

// Logits whose softmax at temperature 1 is exactly `probs` (up to rounding).
std::vector<float> logits_of(const std::vector<double>& probs) {
    std::vector<float> l;
    for (double p : probs) l.push_back(float(std::log(p) + 3.0));  // shift must not matter
    return l;
}

}  // namespace

TEST_CASE("sampler: defaults are llama.cpp's") {
    SamplerParams p;
    CHECK(p.temp == doctest::Approx(0.8f));
    CHECK(p.top_k == 40);
    CHECK(p.top_p == doctest::Approx(0.95f));
    CHECK(p.min_p == doctest::Approx(0.05f));
    CHECK(p.repeat_penalty == 1.0f);
    CHECK(p.repeat_last_n == 64);
}

TEST_CASE("sampler: greedy takes the arg-max, lower id on ties") {
    Sampler s(no_filters(0.0f), 100);
    std::vector<float> logits = {0.3f, 2.5f, -1.0f, 2.5f, 1.0f};
    CHECK(s.sample(logits) == 1);
    auto c = s.candidates(logits);
    REQUIRE(c.size() == 1);
    CHECK(c[0].p == 1.0f);
    logits[4] = 7.0f;
    CHECK(s.sample(logits) == 4);
}

TEST_CASE("sampler: top-k keeps the k best with renormalized probabilities") {
    SamplerParams p = no_filters(1.0f);
    p.top_k = 3;
    Sampler s(p, 100);
    std::vector<float> logits = {0.1f, 1.7f, -0.4f, 1.2f, 0.9f, -2.0f, 1.3f};
    auto c = s.candidates(logits);
    REQUIRE(c.size() == 3);
    CHECK(c[0].id == 1);
    CHECK(c[1].id == 6);
    CHECK(c[2].id == 3);
    double z = std::exp(1.7) + std::exp(1.3) + std::exp(1.2);
    CHECK(c[0].p == doctest::Approx(std::exp(1.7) / z).epsilon(1e-6));
    CHECK(c[1].p == doctest::Approx(std::exp(1.3) / z).epsilon(1e-6));
    CHECK(c[2].p == doctest::Approx(std::exp(1.2) / z).epsilon(1e-6));
}

TEST_CASE("sampler: top-p keeps the smallest prefix reaching p") {
    std::vector<float> logits = logits_of({0.05, 0.5, 0.15, 0.3});
    SamplerParams p = no_filters(1.0f);
    p.top_p = 0.75f;
    auto c = Sampler(p, 100).candidates(logits);
    REQUIRE(c.size() == 2);
    CHECK(c[0].id == 1);
    CHECK(c[1].id == 3);
    CHECK(c[0].p == doctest::Approx(0.5 / 0.8).epsilon(1e-5));
    p.top_p = 0.85f;
    CHECK(Sampler(p, 100).candidates(logits).size() == 3);
    p.top_p = 0.01f;  // never fewer than one
    CHECK(Sampler(p, 100).candidates(logits).size() == 1);
}

TEST_CASE("sampler: min-p drops tokens below min_p times the best") {
    std::vector<float> logits = logits_of({0.05, 0.5, 0.15, 0.3});
    SamplerParams p = no_filters(1.0f);
    p.min_p = 0.2f;  // cut at 0.1: 0.05 goes
    auto c = Sampler(p, 100).candidates(logits);
    REQUIRE(c.size() == 3);
    CHECK(c[2].id == 2);
    CHECK(c[2].p == doctest::Approx(0.15 / 0.95).epsilon(1e-5));
    p.min_p = 0.5f;  // cut at 0.25
    CHECK(Sampler(p, 100).candidates(logits).size() == 2);
}

TEST_CASE("sampler: temperature sharpens after the filters") {
    std::vector<float> logits = logits_of({0.2, 0.6, 0.2});
    SamplerParams p = no_filters(0.5f);
    auto c = Sampler(p, 100).candidates(logits);
    REQUIRE(c.size() == 3);
    // p_i^(1/T) renormalized: 0.36, 0.04, 0.04
    CHECK(c[0].id == 1);
    CHECK(c[0].p == doctest::Approx(0.36 / 0.44).epsilon(1e-5));
    CHECK(c[1].id == 0);  // tie between 0 and 2: lower id first
    CHECK(c[1].p == doctest::Approx(0.04 / 0.44).epsilon(1e-5));
}

TEST_CASE("sampler: repeat penalty divides positive and multiplies negative logits once") {
    SamplerParams p = no_filters(0.0f);
    p.repeat_penalty = 2.0f;
    p.repeat_last_n = 2;
    Sampler s(p, 100);
    std::vector<float> logits = {3.0f, 2.0f, -1.0f, 1.9f};
    CHECK(s.sample(logits) == 0);
    s.accept(0);
    s.accept(0);  // twice in the window: still one division, 3 -> 1.5
    CHECK(s.sample(logits) == 1);
    s.accept(1);  // window now {0, 1}: 0 -> 1.5, 1 -> 1.0, so 3 (1.9) wins
    CHECK(s.sample(logits) == 3);
    s.accept(2);  // window {1, 2}: 0 is forgotten and wins again
    CHECK(s.sample(logits) == 0);

    SamplerParams q = no_filters(1.0f);
    q.repeat_penalty = 2.0f;
    Sampler t(q, 100);
    t.accept(2);  // -1 -> -2
    auto c = t.candidates(logits);
    double z = std::exp(3.0) + std::exp(2.0) + std::exp(-2.0) + std::exp(1.9);
    for (const auto& tp : c) {
        if (tp.id == 2) CHECK(tp.p == doctest::Approx(std::exp(-2.0) / z).epsilon(1e-5));
    }
    SamplerParams off = q;
    off.repeat_last_n = 0;
    Sampler u(off, 100);
    u.accept(0);
    CHECK(u.candidates(logits)[0].p ==
          doctest::Approx(std::exp(3.0) / (z - std::exp(-2.0) + std::exp(-1.0))).epsilon(1e-5));
}

TEST_CASE("sampler: the same seed gives the same tokens, the draws follow the probabilities") {
    std::vector<float> logits(97);
    for (size_t i = 0; i < logits.size(); ++i) logits[i] = float(std::sin(double(i) * 1.3)) * 0.5f;
    SamplerParams p = no_filters(1.0f);
    p.seed = 42;
    Sampler a(p, 100), b(p, 100);
    p.seed = 43;
    Sampler c(p, 100);
    int differ = 0;
    for (int i = 0; i < 64; ++i) {
        int32_t ta = a.sample(logits);
        CHECK(ta == b.sample(logits));
        differ += ta != c.sample(logits);
    }
    CHECK(differ > 32);

    std::vector<float> small = logits_of({0.1, 0.6, 0.3});
    Sampler d(no_filters(1.0f), 100);
    std::map<int32_t, int> counts;
    const int n = 20000;
    for (int i = 0; i < n; ++i) counts[d.sample(small)]++;
    CHECK(double(counts[0]) / n == doctest::Approx(0.1).epsilon(0.1));
    CHECK(double(counts[1]) / n == doctest::Approx(0.6).epsilon(0.03));
    CHECK(double(counts[2]) / n == doctest::Approx(0.3).epsilon(0.05));
}

TEST_CASE("sampler: the one-pass top-k and the greedy scan equal sorting everything") {
    // Random vocabularies with many ties (few distinct values), -0 and +0, and sizes around the
    // scan's 8-wide blocks; greedy also with NaNs, which max_element never picks (unless first).
    std::mt19937 rng(7);
    for (int trial = 0; trial < 400; ++trial) {
        const size_t n = 1 + rng() % 300;
        std::vector<float> logits(n);
        for (float& x : logits) {
            const int k = int(rng() % 12);
            x = k == 0 ? -0.0f : k == 1 ? 0.0f : float(int(rng() % 9) - 4) * 0.5f;
        }
        SamplerParams p = no_filters(1.0f);
        p.top_k = 1 + int(rng() % 50);
        const auto got = Sampler(p, 100).candidates(logits);
        std::vector<int32_t> order(n);
        for (size_t i = 0; i < n; ++i) order[i] = int32_t(i);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
            return logits[size_t(a)] > logits[size_t(b)];
        });
        const size_t k = std::min(n, size_t(p.top_k));
        REQUIRE(got.size() == k);
        for (size_t i = 0; i < k; ++i) CHECK(got[i].id == order[i]);

        if (trial % 2) logits[rng() % n] = std::nanf("");
        const auto greedy = Sampler(no_filters(0.0f), 100).candidates(logits);
        REQUIRE(greedy.size() == 1);
        CHECK(greedy[0].id ==
              int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    }
}
