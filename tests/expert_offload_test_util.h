// Helpers for the expert cache tests (CPU and CUDA): an empty routing trace shaped like a model
// and a session's routing recorded into it, the table invariant, argmax, and the model's own
// greedy run to compare a cached run against.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <concepts>
#include <cstring>
#include <functional>
#include <span>
#include <vector>

#include "mgl.h"
#include "model/deepseek2.h"
#include "routing/trace.h"
#include "runtime/expert_offload.h"
#include "runtime/session.h"

namespace minids::test {

inline routing::RoutingTrace empty_trace(const Deepseek2Model& m) {
    routing::RoutingTrace tr;
    tr.shape.n_experts = int32_t(m.config().n_routed_experts);
    tr.shape.top_k = int32_t(m.config().num_experts_per_tok);
    tr.shape.expert_bytes = m.weights().expert_tables().at(0).blob_bytes;
    for (int64_t l : m.moe_layers()) tr.shape.moe_layers.push_back(int32_t(l));
    tr.source = "test";
    return tr;
}

// Appends every eval's routing of `s` to `trace`, which must outlive the session's evals.
inline void record_routing(Session& s, routing::RoutingTrace& trace) {
    s.set_routing_observer([&trace](const RoutingRecord& r) {
        trace.append_step(r.n_tokens, r.prefill, r.ids.data(), r.weights.data());
    });
}

inline int32_t argmax(std::span<const float> v) {
    return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// The prompt every expert cache test evaluates, and the run a cached model must reproduce.
inline const std::vector<int32_t> offload_test_prompt = {1,    1561, 305, 4200, 53,   99,
                                                         2047, 12,   640, 7,    3001, 88};

struct ReferenceRun {
    std::vector<float> prompt_logits;             // every prompt position
    std::vector<int32_t> tokens;                  // the greedy continuation
    std::vector<std::vector<float>> step_logits;  // after each continuation token
};

// The prompt's logits and `n_decode` greedy steps of `model` as loaded (no cache).
inline ReferenceRun greedy_reference(const Deepseek2Model& model, mgl::backend& backend,
                                     const SessionParams& params, int64_t n_decode) {
    ReferenceRun r;
    Session s(model, backend, params);
    r.prompt_logits = s.eval(offload_test_prompt, /*all_logits=*/true);
    const auto V = std::ptrdiff_t(model.config().vocab_size);
    std::vector<float> last(r.prompt_logits.end() - V, r.prompt_logits.end());
    for (int64_t i = 0; i < n_decode; ++i) {
        r.tokens.push_back(argmax(last));
        const int32_t one[1] = {r.tokens.back()};
        last = s.eval(one);
        r.step_logits.push_back(last);
    }
    return r;
}

// Decodes the reference's continuation one token at a time; whether every step's logits equal the
// reference's bit for bit.
inline bool decode_matches(Session& s, const ReferenceRun& ref) {
    bool all_equal = true;
    for (size_t i = 0; i < ref.tokens.size(); ++i) {
        const int32_t one[1] = {ref.tokens[i]};
        all_equal = all_equal && s.eval(one) == ref.step_logits[i];
    }
    return all_equal;
}

// Every table entry, as the backend holds it, is the expert's home or a slot whose bytes are
// exactly the expert's, and what the host's replay says it is (settled first: with victims
// after the launch a decode step's replay waits for the next launch). `read` copies backend
// memory to the host (a download for a device).
template <class Read>
void check_tables(ExpertOffload& o, const Deepseek2Model& m, Read read) {
    o.settle();
    const auto& tables = m.weights().expert_tables();
    const uint64_t n = tables.at(0).blob_bytes;
    const int32_t E = int32_t(tables[0].blobs.size());
    std::vector<uint8_t> bytes(n);
    size_t in_slots = 0, bad = 0;
    for (int32_t l = 0; l < int32_t(tables.size()); ++l) {
        std::vector<int64_t> entries(static_cast<size_t>(E));
        read(entries.data(), reinterpret_cast<const void*>(tables[size_t(l)].t->data),
             entries.size() * sizeof(int64_t));
        for (int32_t e = 0; e < E; ++e) {
            const int64_t a = entries[size_t(e)];
            if (a != o.table_entry(l, e)) ++bad;
            if (a == o.home(l, e)) continue;
            ++in_slots;
            read(bytes.data(), reinterpret_cast<const void*>(a), n);
            if (std::memcmp(bytes.data(), o.blob(l, e), n) != 0) ++bad;
        }
    }
    REQUIRE_MESSAGE(bad == 0, bad << " table entries point at the wrong bytes");
    REQUIRE(in_slots <= size_t(o.config().n_slots));
}

// On the CPU backend table entries and slots are host addresses.
inline void check_tables(ExpertOffload& o, const Deepseek2Model& m) {
    check_tables(o, m, [](void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); });
}

// Makes `s`'s expert cache hook replay every step into `o` and then, once `backend` is done,
// check the tables (check_tables with `read`), so an error names the step that made it.
// `before_replay`, if given, runs first: what the step left before its bookkeeping (the slots a
// prompt chunk was lent).
template <class Read>
requires std::invocable<Read, void*, const void*, size_t>
void check_tables_after_each_step(Session& s, ExpertOffload& o, const Deepseek2Model& m,
                                  mgl::backend& backend, Read read,
                                  std::function<void()> before_replay = {}) {
    s.set_expert_cache_hook([&o, &m, &backend, read, before_replay](const RoutingRecord& r) {
        if (before_replay) before_replay();
        o.after_step(r);
        backend.synchronize();
        check_tables(o, m, read);
    });
}
inline void check_tables_after_each_step(Session& s, ExpertOffload& o, const Deepseek2Model& m,
                                         mgl::backend& backend,
                                         std::function<void()> before_replay = {}) {
    check_tables_after_each_step(
        s, o, m, backend, [](void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); },
        std::move(before_replay));
}

}  // namespace minids::test
