// Would a prefetch for the layer after next fill the link where the next layer's prediction has
// nothing to copy? (issue 10; docs/expert-cache.md, "Where the two missed targets stand".)
//
// Replays a routing trace and its routers' predictions (record_routing_text --predict
// --predict-depth 2; `random:N` for the tokens bench decodes) through one pool of S slots shared
// by every layer, with LRU standing in for the engine's policy, under the engine's prefetch rules:
// after layer l's own experts, up to F of the best-ranked of layer l+1's top N predictions that
// are not in slots are loaded (`--expert-prefetch N --expert-prefetch-fills F`); with the
// fallback, when all of those N are in slots, the best-ranked missing one of layer l+2's top N is
// loaded instead. A demand miss never evicts its own layer's experts; a prefetch never evicts
// layer l's experts nor the experts it ranks for the layers it looks at. Every token is treated
// as a decoded one.
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
#include <string>
#include <vector>

#include "routing/prefetch.h"
#include "routing/trace.h"

namespace {

using namespace minids::routing;

struct Counts {
    int64_t tokens = 0, accesses = 0, misses = 0, layers = 0, next_empty = 0;
    int64_t loads[2] = {0, 0}, used[2] = {0, 0};  // [0]: next layer, [1]: the layer after next
    // Per counted token and MoE layer: the layer's own copies, then its prefetch's.
    std::vector<uint8_t> demand, prefetched;
};

class Pool {
public:
    Pool(int64_t slots, int64_t keys) : stamp_(size_t(keys), -1), kind_(size_t(keys), -1) {
        slots_.reserve(size_t(slots));
        capacity_ = slots;
    }
    bool has(int64_t key) const { return stamp_[size_t(key)] >= 0; }
    // A hit: its prefetch kind (0 / 1) when this is the prefetched copy's first read, else -1.
    int touch(int64_t key) {
        stamp_[size_t(key)] = ++clock_;
        const int k = kind_[size_t(key)];
        kind_[size_t(key)] = -1;
        return k;
    }
    // Loads `key`, evicting the least recently used key `keep` does not hold; false when every
    // slot is kept.
    template <class Keep>
    bool load(int64_t key, int kind, Keep keep) {
        if (int64_t(slots_.size()) < capacity_) {
            slots_.push_back(key);
        } else {
            int64_t victim = -1;
            for (size_t i = 0; i < slots_.size(); ++i) {
                const int64_t k = slots_[i];
                if (keep(k)) continue;
                if (victim < 0 || stamp_[size_t(k)] < stamp_[size_t(slots_[size_t(victim)])])
                    victim = int64_t(i);
            }
            if (victim < 0) return false;
            const int64_t old = slots_[size_t(victim)];
            stamp_[size_t(old)] = -1;
            kind_[size_t(old)] = -1;
            slots_[size_t(victim)] = key;
        }
        stamp_[size_t(key)] = ++clock_;
        kind_[size_t(key)] = kind;
        return true;
    }

private:
    int64_t capacity_ = 0, clock_ = 0;
    std::vector<int64_t> slots_;
    std::vector<int64_t> stamp_;  // per key: last use, -1 when not in a slot
    std::vector<int> kind_;       // per key: prefetch kind of an unread prefetched copy, or -1
};

// `fills`: the most copies a layer's prefetch makes from the next layer's top `top` (0: all the
// missing ones); the fallback, when on, is tried only where none is missing.
Counts replay(const RoutingTrace& trace, const Predictions& pred, int64_t slots, int top, int fills,
              bool fallback, int64_t skip) {
    const int32_t L = trace.shape.n_moe_layers(), E = trace.shape.n_experts, k = trace.shape.top_k;
    Pool pool(slots, int64_t(L) * E);
    Counts c;
    std::vector<int64_t> kept;
    auto kept_has = [&](int64_t key) {
        for (int64_t x : kept)
            if (x == key) return true;
        return false;
    };
    // The best-ranked of `ids`' first `top` (layer `layer`) not in a slot, or -1.
    auto first_missing = [&](const int16_t* ids, int32_t layer) -> int64_t {
        for (int i = 0; i < top && i < pred.top_k; ++i)
            if (ids[i] >= 0 && !pool.has(int64_t(layer) * E + ids[i]))
                return int64_t(layer) * E + ids[i];
        return -1;
    };
    for (int64_t t = 0; t < trace.n_tokens; ++t) {
        const bool counted = t >= skip;
        if (counted) ++c.tokens;
        for (int32_t l = 0; l < L; ++l) {
            if (counted) {
                c.demand.push_back(0);
                c.prefetched.push_back(0);
            }
            const uint16_t* ids = trace.ids_at(t, l);
            kept.clear();
            for (int i = 0; i < k; ++i) kept.push_back(int64_t(l) * E + ids[i]);
            for (int i = 0; i < k; ++i) {
                const int64_t key = int64_t(l) * E + ids[i];
                if (counted) ++c.accesses;
                if (pool.has(key)) {
                    const int kind = pool.touch(key);
                    if (counted && kind >= 0) ++c.used[kind];
                } else {
                    if (counted) ++c.misses;
                    if (pool.load(key, -1, kept_has) && counted) ++c.demand.back();
                }
            }
            if (l + 1 >= L || top == 0) continue;
            if (counted) ++c.layers;
            const int16_t* next = pred.at(t, l, 0);
            for (int i = 0; i < top && i < pred.top_k; ++i)
                if (next[i] >= 0) kept.push_back(int64_t(l + 1) * E + next[i]);
            auto prefetch = [&](int64_t key, int kind) {
                if (!pool.load(key, kind, kept_has)) return false;
                if (counted) {
                    ++c.loads[kind];
                    ++c.prefetched.back();
                }
                return true;
            };
            int made = 0;
            while (fills == 0 || made < fills) {
                const int64_t key = first_missing(next, l + 1);
                if (key < 0 || !prefetch(key, 0)) break;
                ++made;
            }
            if (made > 0) continue;
            if (counted) ++c.next_empty;
            if (!fallback || l + 2 >= L || pred.depth < 2) continue;
            const int16_t* after = pred.at(t, l, 1);
            for (int i = 0; i < top && i < pred.top_k; ++i)
                if (after[i] >= 0) kept.push_back(int64_t(l + 2) * E + after[i]);
            if (const int64_t key = first_missing(after, l + 2); key >= 0) prefetch(key, 1);
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
};

double step_ms(const Counts& c, int32_t L, const Timing& m, bool predicting) {
    double total = 0;
    const double predict = predicting ? m.predict_us : 0.0;
    for (int64_t t = 0; t < c.tokens; ++t) {
        double done = m.before_us, link_free = 0, posted_land = 0;
        for (int32_t l = 0; l < L; ++l) {
            const size_t i = size_t(t * L + l);
            const double post = done + m.attn_us;
            for (int j = 0; j < c.demand[i]; ++j)
                posted_land = link_free = std::max(post + m.trip_us, link_free) + m.copy_us;
            const double landed = posted_land, ready = post + predict;
            for (int j = 0; j < c.prefetched[i]; ++j)
                posted_land = link_free =
                    std::max(post + predict + m.trip_us, link_free) + m.copy_us;
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
    if (argc < 3) {
        std::fprintf(stderr,
                     "usage: prefetch_fallback_probe TRACE.npz PRED.npy [--slots 1008] [--skip 32] "
                     "[--copy-us 164] [--trip-us 7] [--attn-us 40] [--predict-us 15] [--moe-us 37] "
                     "[--moe-tail-us 20] [--before-us 60] [--after-us 125]\n");
        return 2;
    }
    int64_t slots = 1008, skip = 32;
    Timing m;
    for (int i = 3; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        const double v = std::atof(argv[i + 1]);
        if (a == "--slots")
            slots = int64_t(v);
        else if (a == "--skip")
            skip = int64_t(v);
        else if (a == "--copy-us")
            m.copy_us = v;
        else if (a == "--trip-us")
            m.trip_us = v;
        else if (a == "--attn-us")
            m.attn_us = v;
        else if (a == "--predict-us")
            m.predict_us = v;
        else if (a == "--moe-us")
            m.moe_us = v;
        else if (a == "--moe-tail-us")
            m.moe_tail_us = v;
        else if (a == "--before-us")
            m.before_us = v;
        else if (a == "--after-us")
            m.after_us = v;
        else {
            std::fprintf(stderr, "prefetch_fallback_probe: unknown option %s\n", a.c_str());
            return 2;
        }
    }
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
                              {"top 6, one fill, else the layer after next", 6, 1, true}};
        for (const Rule& r : rules) {
            const Counts c = replay(trace, pred, slots, r.top, r.fills, r.fallback, skip);
            print(r.name, c, step_ms(c, L, m, r.top > 0));
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "prefetch_fallback_probe: %s\n", e.what());
        return 1;
    }
    return 0;
}
