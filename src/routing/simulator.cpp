#include "routing/simulator.h"

#include <limits>
#include <stdexcept>

namespace minids::routing {

std::vector<int32_t> next_uses(const RoutingTrace& tr) {
    const int64_t n = tr.n_tokens * tr.row_size();
    if (n >= int64_t(std::numeric_limits<int32_t>::max())) {
        throw std::invalid_argument(
            "belady: the trace has 2^31 accesses or more; use fewer tokens");
    }
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    std::vector<int32_t> next(static_cast<size_t>(n));
    std::vector<int32_t> last(size_t(L) * size_t(E), std::numeric_limits<int32_t>::max());
    for (int64_t i = n - 1; i >= 0; --i) {
        const int32_t layer = int32_t((i / k) % L);
        const size_t key = size_t(layer) * size_t(E) + tr.ids[size_t(i)];
        next[size_t(i)] = last[key];
        last[key] = int32_t(i);
    }
    return next;
}

namespace {

template <class P>
void run(const RoutingTrace& tr, const CacheConfig& c, const std::vector<int32_t>* next,
         SimResult& r) {
    LayeredPools<P> pools(c);
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k;
    AccessHint hint;
    int64_t i = 0;
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            const uint16_t* ids = tr.ids.data() + i;
            int64_t hits = 0;
            for (int32_t j = 0; j < k; ++j, ++i) {
                if (next) hint.next_use = (*next)[size_t(i)];
                const AccessResult::Outcome o = pools.access(l, ids[j], hint, true).outcome;
                hits += o == AccessResult::hit;
                r.fills += o == AccessResult::miss || o == AccessResult::miss_evicted;
            }
            pools.unpin_layer(l);
            r.layer_hits[size_t(l)] += hits;
        }
    }
}

}  // namespace

SimResult simulate(const RoutingTrace& tr, CacheConfig c, const std::vector<int32_t>* next) {
    c.n_layers = tr.shape.n_moe_layers();
    c.n_experts = tr.shape.n_experts;
    check_config(c, tr.shape.top_k);
    SimResult r;
    r.config = c;
    r.n_tokens = tr.n_tokens;
    r.expert_bytes = tr.shape.expert_bytes;
    r.layer_hits.assign(size_t(c.n_layers), 0);
    r.layer_accesses.assign(size_t(c.n_layers), tr.n_tokens * tr.shape.top_k);
    std::vector<int32_t> own_next;
    switch (c.policy) {
        case Policy::lru:
            run<LruPolicy>(tr, c, nullptr, r);
            break;
        case Policy::lfu:
            run<LfuPolicy>(tr, c, nullptr, r);
            break;
        case Policy::decay:
            run<DecayPolicy>(tr, c, nullptr, r);
            break;
        case Policy::belady:
            if (!next) {
                own_next = next_uses(tr);
                next = &own_next;
            }
            run<BeladyPolicy>(tr, c, next, r);
            break;
    }
    r.accesses = tr.n_tokens * tr.row_size();
    for (int64_t h : r.layer_hits) r.hits += h;
    return r;
}

}  // namespace minids::routing
