// Small routing traces for the routing tests.
#pragma once

#include <doctest/doctest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "routing/expert_cache.h"
#include "routing/trace.h"

namespace minids::test {

// A trace of T tokens over L MoE layers (numbered 1..L) of E experts, top-k, with the given
// ids ([T][L][k]) and weights 1/k.
inline routing::RoutingTrace make_trace(int32_t L, int32_t E, int32_t k,
                                        const std::vector<uint16_t>& ids) {
    routing::RoutingTrace tr;
    tr.shape.n_experts = E;
    tr.shape.top_k = k;
    tr.shape.expert_bytes = 1000;
    for (int32_t l = 1; l <= L; ++l) tr.shape.moe_layers.push_back(l);
    tr.n_tokens = int64_t(ids.size()) / (int64_t(L) * k);
    tr.ids = ids;
    tr.weights.assign(ids.size(), 1.0f / float(k));
    tr.prefill.assign(size_t(tr.n_tokens), 0);
    for (int64_t t = 0; t < tr.n_tokens; ++t) tr.step.push_back(int32_t(t));
    tr.source = "test";
    return tr;
}

// Random routing: each token picks k distinct experts per layer, a skewed pick so that
// policies differ.
inline routing::RoutingTrace random_trace(int32_t L, int32_t E, int32_t k, int64_t T,
                                          uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<uint16_t> ids;
    for (int64_t t = 0; t < T; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            std::vector<uint16_t> row;
            while (int32_t(row.size()) < k) {
                // Square of a uniform: low ids more popular.
                const double u = std::uniform_real_distribution<double>(0, 1)(rng);
                const uint16_t e = uint16_t(std::min<double>(E - 1, u * u * E));
                bool dup = false;
                for (uint16_t x : row) dup |= x == e;
                if (!dup) row.push_back(e);
            }
            ids.insert(ids.end(), row.begin(), row.end());
        }
    }
    auto tr = make_trace(L, E, k, ids);
    std::uniform_real_distribution<float> w(0.05f, 1.0f);
    for (float& x : tr.weights) x = w(rng);
    return tr;
}

// The grid both simulators are checked over: f(trace, config) for random traces of 300 tokens
// over 3 MoE layers of 12 experts, top-3 (seeds 1..3), a global or per-layer pool of 9, 15 or
// 24 slots, every policy and every admission it supports (lru admits all), decay half-life 7.3.
template <class F>
void for_each_small_cache_config(F&& f) {
    using routing::Admission;
    using routing::Policy;
    for (uint64_t seed = 1; seed <= 3; ++seed) {
        const routing::RoutingTrace tr = random_trace(3, 12, 3, 300, seed);
        for (bool per_layer : {false, true})
            for (int64_t slots : {9, 15, 24})
                for (Policy p : {Policy::lru, Policy::lfu, Policy::decay, Policy::belady})
                    for (Admission a : {Admission::all, Admission::frequency}) {
                        if (p == Policy::lru && a == Admission::frequency) continue;
                        routing::CacheConfig c;
                        c.policy = p;
                        c.admit = a;
                        c.n_slots = slots;
                        c.per_layer = per_layer;
                        c.decay_half_life = 7.3;
                        CAPTURE(seed);
                        CAPTURE(per_layer);
                        CAPTURE(slots);
                        CAPTURE(routing::policy_name(p));
                        CAPTURE(routing::admission_name(a));
                        f(tr, c);
                    }
    }
}

}  // namespace minids::test
