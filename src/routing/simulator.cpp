#include "routing/simulator.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

#include "routing/prompt_chunk.h"

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

namespace {

constexpr Rank free_rank{-std::numeric_limits<double>::infinity(), 0};

// The device fetch's choice for one miss of layer l (ggml-like/cpu/ops_expert_fetch.cpp and the
// CUDA plan kernel make the same): the next offered victim the layer does not read (those it
// reads are passed over for good), unless one of this pass's arrivals from another layer ranks
// lower, which is what the host rules would evict at this point. -1: nothing to evict.
int32_t device_fetch_victim(const std::vector<int32_t>& victims,
                            const std::vector<Rank>& victim_rank, size_t& next,
                            std::vector<int32_t>& arrivals, const std::vector<Rank>& key_rank,
                            const std::vector<int32_t>& slot_key, const std::vector<int64_t>& uses,
                            int32_t l, int32_t E, bool recycle) {
    while (next < victims.size()) {
        const int32_t occ = slot_key[size_t(victims[next])];
        if (occ >= 0 && occ / E == l && uses[size_t(occ % E)] > 0) {
            ++next;
            continue;
        }
        break;
    }
    int best = -1;
    for (size_t i = 0; recycle && i < arrivals.size(); ++i) {
        if (arrivals[i] < 0 || slot_key[size_t(arrivals[i])] / E == l) continue;
        if (best < 0 || key_rank[size_t(slot_key[size_t(arrivals[i])])] <
                            key_rank[size_t(slot_key[size_t(arrivals[size_t(best)])])])
            best = int(i);
    }
    if (best >= 0 &&
        (next >= victims.size() ||
         key_rank[size_t(slot_key[size_t(arrivals[size_t(best)])])] < victim_rank[next])) {
        const int32_t slot = arrivals[size_t(best)];
        arrivals[size_t(best)] = -1;
        return slot;
    }
    if (next < victims.size()) return victims[next++];
    return -1;
}

}  // namespace

SimResult simulate_device_fetch(const RoutingTrace& tr, CacheConfig c, bool token_steps,
                                bool staging) {
    c.n_layers = tr.shape.n_moe_layers();
    c.n_experts = tr.shape.n_experts;
    check_config(c, tr.shape.top_k);
    if (c.per_layer || c.policy == Policy::belady)
        throw std::invalid_argument("device fetch: one global pool and an online policy only");
    if (staging && c.n_slots < c.n_experts)
        throw std::invalid_argument("the staging store needs a slot for every expert of a layer (" +
                                    std::to_string(c.n_experts) + ")");
    const int32_t L = c.n_layers, E = c.n_experts, k = tr.shape.top_k;
    SimResult r;
    r.config = c;
    r.device_fetch = true;
    r.staging = staging;
    r.n_tokens = tr.n_tokens;
    r.expert_bytes = tr.shape.expert_bytes;
    r.layer_hits.assign(size_t(L), 0);
    r.layer_accesses.assign(size_t(L), tr.n_tokens * k);
    auto cache = make_expert_cache(c);
    std::vector<int32_t> slot_key(size_t(c.n_slots), -1);
    std::vector<int64_t> uses(static_cast<size_t>(E));
    std::vector<Rank> key_rank(size_t(L) * size_t(E));
    for (int64_t t0 = 0; t0 < tr.n_tokens;) {
        int64_t t1 = t0 + 1;  // one forward pass: the tokens of one step
        while (!token_steps && t1 < tr.n_tokens && !tr.step.empty() &&
               tr.step[size_t(t1)] == tr.step[size_t(t0)])
            ++t1;
        const int64_t T = t1 - t0;
        const int64_t most = int64_t(L) * std::min<int64_t>(E, T * k);
        // A prompt chunk (every layer uses nearly all its experts) takes free slots only and
        // never evicts what it brought in; a decode pass may re-evict its own earlier arrivals.
        // The staging store offers victims for every miss instead (ExpertOffload::before_step).
        const bool prompt = is_prompt_chunk(T, k, E);
        std::vector<int32_t> victims =
            staging ? cache->victims_repeated(most)
                    : cache->victims(int32_t(std::min<int64_t>(c.n_slots, most)));
        if (!staging && prompt)
            std::erase_if(victims, [&](int32_t v) { return slot_key[size_t(v)] >= 0; });
        const bool recycle = !staging && !prompt;
        // The ranks as the engine uploads them before the pass.
        std::vector<Rank> victim_rank(victims.size());
        for (size_t i = 0; i < victims.size(); ++i)
            victim_rank[i] = slot_key[size_t(victims[i])] < 0 ? free_rank : cache->rank(victims[i]);
        if (recycle) cache->arrival_ranks(key_rank);
        size_t next = 0;
        std::vector<int32_t> arrivals;
        for (int32_t l = 0; l < L; ++l) {
            std::fill(uses.begin(), uses.end(), 0);
            for (int64_t t = t0; t < t1; ++t)
                for (int32_t j = 0; j < k; ++j) ++uses[tr.ids_at(t, l)[j]];
            for (int32_t e = 0; e < E; ++e) {
                const int64_t u = uses[size_t(e)];
                if (u == 0) continue;
                if (cache->slot_of(l, e) >= 0) {
                    r.layer_hits[size_t(l)] += u;
                    for (int64_t i = 0; i < u; ++i) cache->access(l, e, {}, false);
                    continue;
                }
                const int32_t slot = device_fetch_victim(victims, victim_rank, next, arrivals,
                                                         key_rank, slot_key, uses, l, E, recycle);
                if (slot < 0 && staging)
                    throw std::logic_error("staging store: a miss found no victim");
                if (slot < 0) {
                    for (int64_t i = 0; i < u; ++i) cache->bypass(l, e);
                    continue;
                }
                cache->place(l, e, slot);
                slot_key[size_t(slot)] = l * E + e;
                arrivals.push_back(slot);
                ++r.fills;
                for (int64_t i = 1; i < u; ++i) cache->access(l, e, {}, false);
            }
        }
        t0 = t1;
    }
    r.accesses = tr.n_tokens * tr.row_size();
    for (int64_t h : r.layer_hits) r.hits += h;
    return r;
}

}  // namespace minids::routing
