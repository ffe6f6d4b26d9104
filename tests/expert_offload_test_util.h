// Helpers for the expert cache tests (CPU and CUDA): an empty routing trace shaped like a model,
// the table invariant, and argmax.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <vector>

#include "mgl.h"
#include "model/deepseek2.h"
#include "routing/trace.h"
#include "runtime/expert_offload.h"

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

inline int32_t argmax(std::span<const float> v) {
    return int32_t(std::max_element(v.begin(), v.end()) - v.begin());
}

// Every table entry, as the backend holds it, is the expert's home or a slot whose bytes are
// exactly the expert's. `read` copies backend memory to the host (a download for a device).
template <class Read>
void check_tables(const ExpertOffload& o, const Deepseek2Model& m, Read read) {
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
inline void check_tables(const ExpertOffload& o, const Deepseek2Model& m) {
    check_tables(o, m, [](void* dst, const void* src, size_t n) { std::memcpy(dst, src, n); });
}

}  // namespace minids::test
