// Would a prefetch for the layer after next fill the link where the next layer's prediction has
// nothing to copy? (issue 10; docs/expert-cache.md, "Where the two missed targets stand".)
//
// Replays a routing trace and its routers' predictions (record_routing_text --predict
// --predict-depth 2; `random:N` for the tokens bench decodes) through one pool of S slots shared
// by every layer (routing::ExpertCache, the engine's own bookkeeping, with LRU standing in for
// the engine's decay policy; pins keep what must stay), under the engine's prefetch rules:
// after layer l's own experts, up to F of the best-ranked of layer l+1's top N predictions that
// are not in slots are loaded (`--expert-prefetch N --expert-prefetch-fills F`); with the
// fallback, when all of those N are in slots, the best-ranked missing one of layer l+2's top N is
// loaded instead. A demand miss never evicts its own layer's experts; a prefetch never evicts
// layer l's experts nor the experts it ranks for the layers it looks at. Every token is treated
// as a decoded one.
//
// Background copies (seventeenth session): the same loads, but their copies wait behind
// everything else. The link moves them in chunks (--chunk-us each, --chunk-gap-us between) only
// while nothing else is posted; when their layer comes, the rest of one it reads is moved before
// its own misses and waited for, and one it does not read is dropped. Rules: the fallback to the
// layer after next as a background copy, and background copies of more of the next layer's
// missing top N.
//
// Each rule's steps are then timed by a model of the link trace's picture (Timing below,
// calibrated on the H200's 12 GiB decode; perf.md, fourteenth session, compares it with the seven
// rules measured there). Printed per token and rule: hit rate, waited-for misses, prefetches for
// the next layer and for the layer after next with the share of each read by its layer before
// eviction, copies, the share of layers whose next-layer top N were all in slots, and the modeled
// step time.
//
//   prefetch_fallback_probe TRACE.npz PRED.npy [--slots 1008] [--skip 32] [--copy-us 164] ...
//
// --skip: tokens replayed before counting (the pool fills up); the timing options override the
// model's parameters (Timing).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "routing/expert_cache.h"
#include "routing/prefetch.h"
#include "routing/trace.h"

namespace {

using namespace minids::routing;

struct Counts {
    int64_t tokens = 0, accesses = 0, misses = 0, layers = 0, next_empty = 0;
    int64_t loads[2] = {0, 0}, used[2] = {0, 0};  // [0]: next layer, [1]: the layer after next
    // Per counted token and MoE layer: the layer's own copies, then its prefetch's.
    std::vector<uint8_t> demand, prefetched;
    // Per counted token and MoE layer: the layer's background copies (lowest priority, in
    // chunks, only while the link would idle), each the MoE layer it is for.
    struct Background {
        int32_t layer;
        bool used;  // read by its layer before eviction
    };
    std::vector<std::vector<Background>> background;
};

// `fills`: the most copies a layer's prefetch makes from the next layer's top `top` (0: all the
// missing ones); the fallback, when on, is tried only where none is missing.
// `bg_fills`: after those, at most this many more of the next layer's missing top `top` as
// background copies; `fallback` copies are background ones too when `bg_fallback`.
Counts replay(const RoutingTrace& trace, const Predictions& pred, int64_t slots, int top, int fills,
              bool fallback, int64_t skip, int bg_fills = 0, bool bg_fallback = false) {
    const int32_t L = trace.shape.n_moe_layers(), E = trace.shape.n_experts, k = trace.shape.top_k;
    // The engine's bookkeeping objects (routing/expert_cache.h): a slot is pinned while the
    // current layer's kernels or the experts a prefetch ranks must stay, as in the engine.
    CacheConfig config;
    config.policy = Policy::lru;
    config.n_layers = L;
    config.n_experts = E;
    config.n_slots = slots;
    const std::unique_ptr<ExpertCache> cache = make_expert_cache(config);
    // Per key: the kind (0 / 1) of a prefetched copy its layer has not read yet, or -1.
    std::vector<int> unread(size_t(L) * size_t(E), -1);
    // Per key: where its unread background copy is recorded (index into c.background, item).
    std::vector<std::pair<int64_t, int64_t>> bg_at(size_t(L) * size_t(E), {-1, -1});
    auto note_load = [&](const AccessResult& r, int kind, int32_t layer, int32_t e) {
        if (r.evicted >= 0) {
            unread[size_t(r.evicted)] = -1;
            bg_at[size_t(r.evicted)] = {-1, -1};  // evicted unread: not used
        }
        unread[size_t(layer) * size_t(E) + size_t(e)] = kind;
    };
    auto resident = [&](int32_t layer, int32_t e) { return cache->slot_of(layer, e) >= 0; };
    // Pins `ids`' first `top` experts of `layer` that are in slots, without counting a use.
    auto pin_resident = [&](const int16_t* ids, int32_t layer) {
        for (int i = 0; i < top && i < pred.top_k; ++i)
            if (ids[i] >= 0 && resident(layer, ids[i])) cache->prefetch(layer, ids[i], true);
    };
    // The best-ranked of `ids`' first `top` (layer `layer`) not in a slot, or -1.
    auto first_missing = [&](const int16_t* ids, int32_t layer) -> int32_t {
        for (int i = 0; i < top && i < pred.top_k; ++i)
            if (ids[i] >= 0 && !resident(layer, ids[i])) return ids[i];
        return -1;
    };
    Counts c;
    for (int64_t t = 0; t < trace.n_tokens; ++t) {
        const bool counted = t >= skip;
        if (counted) ++c.tokens;
        for (int32_t l = 0; l < L; ++l) {
            if (counted) {
                c.demand.push_back(0);
                c.prefetched.push_back(0);
                c.background.emplace_back();
            }
            // The layer's experts in slots are pinned first, so that none of its misses evicts
            // another of its experts; then every expert is read in the trace's order.
            const uint16_t* ids = trace.ids_at(t, l);
            for (int i = 0; i < k; ++i)
                if (resident(l, ids[i])) cache->prefetch(l, ids[i], true);
            for (int i = 0; i < k; ++i) {
                const int32_t e = ids[i];
                const AccessResult r = cache->access(l, e);
                if (counted) ++c.accesses;
                if (r.outcome == AccessResult::hit) {
                    int& kind = unread[size_t(l) * size_t(E) + size_t(e)];
                    if (counted && kind >= 0) ++c.used[kind];
                    kind = -1;
                    auto& at = bg_at[size_t(l) * size_t(E) + size_t(e)];
                    if (at.first >= 0)
                        c.background[size_t(at.first)][size_t(at.second)].used = true;
                    at = {-1, -1};
                } else {
                    note_load(r, -1, l, e);
                    if (counted) {
                        ++c.misses;
                        ++c.demand.back();
                    }
                }
            }
            if (l + 1 < L && top > 0) {
                if (counted) ++c.layers;
                const int16_t* next = pred.at(t, l, 0);
                pin_resident(next, l + 1);
                auto prefetch = [&](int32_t layer, int32_t e, int kind, bool background) {
                    note_load(cache->prefetch(layer, e, true), kind, layer, e);
                    if (counted) {
                        ++c.loads[kind];
                        if (background) {
                            c.background.back().push_back({layer, false});
                            bg_at[size_t(layer) * size_t(E) + size_t(e)] = {
                                int64_t(c.background.size() - 1),
                                int64_t(c.background.back().size() - 1)};
                        } else
                            ++c.prefetched.back();
                    }
                };
                int made = 0;
                for (int32_t e;
                     (fills == 0 || made < fills) && (e = first_missing(next, l + 1)) >= 0; ++made)
                    prefetch(l + 1, e, 0, false);
                const int fg = made;
                for (int32_t e; made < fg + bg_fills && (e = first_missing(next, l + 1)) >= 0;
                     ++made)
                    prefetch(l + 1, e, 0, true);
                if (fg == 0) {
                    if (counted) ++c.next_empty;
                    if (fallback && l + 2 < L && pred.depth >= 2) {
                        const int16_t* after = pred.at(t, l, 1);
                        pin_resident(after, l + 2);
                        if (const int32_t e = first_missing(after, l + 2); e >= 0)
                            prefetch(l + 2, e, 1, bg_fallback);
                    }
                }
            }
            cache->unpin_all();
        }
    }
    return c;
}

// The time of one decode step, from its copies (the link trace's picture, fourteenth session):
// one link, copies in posting order; each MoE layer posts its own copies `attn_us` after the
// previous layer's experts are done, its prefetch's `predict_us` later behind them, and runs its
// experts once everything posted up to its own copies has landed (the engine's count-based
// wait): `moe_tail_us` after that landing, or `moe_us` after the prediction when nothing was
// pending. Calibrated against the H200's 12 GiB decode (see main).
struct Timing {
    double copy_us = 164;    // one 8.67 MB expert at ~53 GB/s, with its turnaround
    double trip_us = 7;      // from the device's post to the copy's start (the proxy's trip)
    double attn_us = 40;     // a layer's attention, routing and plan, from the last experts
    double predict_us = 15;  // the next layer's prediction and the prefetch's plan
    double moe_us = 37, moe_tail_us = 20;   // the MoE launches whole / after its misses landed
    double before_us = 60, after_us = 125;  // dense layer 0 / final norm, head, host
    // Background copies: moved in chunks of this many us each (plus chunk_gap_us between
    // chunks), started only while nothing else is posted; a layer whose background copy has not
    // landed when it posts its own has the rest moved first.
    double chunk_us = 41, chunk_gap_us = 2.4;
};

double step_ms(const Counts& c, int32_t L, const Timing& m, bool predicting) {
    double total = 0;
    const double predict = predicting ? m.predict_us : 0.0;
    struct Background {
        int32_t layer;
        bool used;
        double posted, left;
    };
    for (int64_t t = 0; t < c.tokens; ++t) {
        double done = m.before_us, link_free = 0, posted_land = 0;
        std::vector<Background> queue;  // background copies, oldest first
        for (int32_t l = 0; l < L; ++l) {
            const size_t i = size_t(t * L + l);
            const double post = done + m.attn_us;
            // The idle link moves background chunks until this layer's posts arrive.
            while (!queue.empty()) {
                Background& b = queue.front();
                const double start = std::max(link_free, b.posted);
                if (start >= post + m.trip_us) break;
                const double step = std::min(m.chunk_us, b.left);
                link_free = start + step + m.chunk_gap_us;
                b.left -= step;
                if (b.left <= 0) queue.erase(queue.begin());
            }
            // This layer's background copies not yet landed: the rest first, waited for if the
            // layer reads it, else dropped (the engine would point it home again).
            for (size_t q = 0; q < queue.size();) {
                if (queue[q].layer == l) {
                    if (queue[q].used)
                        posted_land = link_free =
                            std::max(post + m.trip_us, link_free) + queue[q].left;
                    queue.erase(queue.begin() + std::ptrdiff_t(q));
                } else {
                    ++q;
                }
            }
            for (int j = 0; j < c.demand[i]; ++j)
                posted_land = link_free = std::max(post + m.trip_us, link_free) + m.copy_us;
            const double landed = posted_land, ready = post + predict;
            for (int j = 0; j < c.prefetched[i]; ++j)
                posted_land = link_free =
                    std::max(post + predict + m.trip_us, link_free) + m.copy_us;
            for (const Counts::Background& b : c.background[i])
                queue.push_back({b.layer, b.used, post + predict + m.trip_us, m.copy_us});
            done = landed > ready ? landed + m.moe_tail_us : ready + m.moe_us;
        }
        total += done + m.after_us;
    }
    return c.tokens ? total / double(c.tokens) / 1000.0 : 0.0;
}

void print(const char* name, const Counts& c, double ms) {
    const double T = double(c.tokens > 0 ? c.tokens : 1);
    auto share = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * double(a) / double(b) : 0.0; };
    std::printf(
        "%-44s hit %.3f, waited-for misses %5.2f, prefetches %5.2f (%3.0f %% used) + after next "
        "%4.2f (%3.0f %% used), copies %5.2f, next layer all in slots %3.0f %%; model %.2f ms = "
        "%.1f tok/s\n",
        name, 1.0 - double(c.misses) / double(c.accesses > 0 ? c.accesses : 1),
        double(c.misses) / T, double(c.loads[0]) / T, share(c.used[0], c.loads[0]),
        double(c.loads[1]) / T, share(c.used[1], c.loads[1]),
        double(c.misses + c.loads[0] + c.loads[1]) / T, share(c.next_empty, c.layers), ms,
        ms > 0 ? 1000.0 / ms : 0.0);
}

}  // namespace

int main(int argc, char** argv) {
    double slots_d = 1008, skip_d = 32;
    Timing m;
    // Each option and the number it sets; the usage line shows the defaults.
    const std::pair<const char*, double*> options[] = {
        {"--slots", &slots_d},         {"--skip", &skip_d},
        {"--copy-us", &m.copy_us},     {"--trip-us", &m.trip_us},
        {"--attn-us", &m.attn_us},     {"--predict-us", &m.predict_us},
        {"--moe-us", &m.moe_us},       {"--moe-tail-us", &m.moe_tail_us},
        {"--before-us", &m.before_us}, {"--after-us", &m.after_us},
        {"--chunk-us", &m.chunk_us},   {"--chunk-gap-us", &m.chunk_gap_us}};
    if (argc < 3) {
        std::fprintf(stderr, "usage: prefetch_fallback_probe TRACE.npz PRED.npy");
        for (const auto& [name, value] : options) std::fprintf(stderr, " [%s %g]", name, *value);
        std::fprintf(stderr, "\n");
        return 2;
    }
    for (int i = 3; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        double* target = nullptr;
        for (const auto& [name, value] : options)
            if (a == name) target = value;
        if (!target) {
            std::fprintf(stderr, "prefetch_fallback_probe: unknown option %s\n", a.c_str());
            return 2;
        }
        *target = std::atof(argv[i + 1]);
    }
    const int64_t slots = int64_t(slots_d), skip = int64_t(skip_d);
    try {
        const RoutingTrace trace = read_trace(argv[1]);
        const Predictions pred = read_predictions(argv[2], trace);
        const int32_t L = trace.shape.n_moe_layers();
        std::printf(
            "%lld tokens (%lld counted), %d MoE layers of %d experts, %lld slots; per token:\n",
            static_cast<long long>(trace.n_tokens), static_cast<long long>(trace.n_tokens - skip),
            L, trace.shape.n_experts, static_cast<long long>(slots));
        struct Rule {
            const char* name;
            int top, fills;
            bool fallback;
            int bg_fills = 0;
            bool bg_fallback = false;
        };
        // The rules measured on the GPU (perf.md, twelfth to fourteenth sessions), then the
        // fallback.
        const Rule rules[] = {{"no prefetch", 0, 0, false},
                              {"top 3, every missing one", 3, 0, false},
                              {"top 3, one fill", 3, 1, false},
                              {"top 4, one fill (the default)", 4, 1, false},
                              {"top 6, one fill", 6, 1, false},
                              {"top 4, two fills", 4, 2, false},
                              {"top 6, two fills", 6, 2, false},
                              {"top 4, one fill, else the layer after next", 4, 1, true},
                              {"top 6, one fill, else the layer after next", 6, 1, true},
                              {"top 4, one fill, after next in background", 4, 1, true, 0, true},
                              {"top 4, one fill, one more in background", 4, 1, false, 1},
                              {"top 6, one fill, one more in background", 6, 1, false, 1},
                              {"top 6, one fill, 5 more in background", 6, 1, false, 5},
                              {"top 4, one fill, +1 bg, after next bg", 4, 1, true, 1, true},
                              {"top 6, one fill, +1 bg, after next bg", 6, 1, true, 1, true}};
        for (const Rule& r : rules) {
            const Counts c = replay(trace, pred, slots, r.top, r.fills, r.fallback, skip,
                                    r.bg_fills, r.bg_fallback);
            print(r.name, c, step_ms(c, L, m, r.top > 0));
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "prefetch_fallback_probe: %s\n", e.what());
        return 1;
    }
    return 0;
}
