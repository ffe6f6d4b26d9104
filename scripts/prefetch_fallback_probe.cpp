// Would a prefetch for the layer after next fill the link where the next layer's prediction has
// nothing to copy? (issue 10; docs/expert-cache.md, "Where the two missed targets stand".)
//
// Replays a routing trace and its routers' predictions (record_routing_text --predict
// --predict-depth 2) through one pool of S slots shared by every layer, with LRU standing in for
// the engine's policy, and the engine's prefetch rule as built: after layer l's own experts,
// the best-ranked of layer l+1's top N predictions that is not in a slot is loaded (one fill per
// layer, `--expert-prefetch-fills 1`). With the fallback, when all of those N are in slots, the
// best-ranked missing one of layer l+2's top N is loaded instead. A demand miss never evicts
// its own layer's experts; a prefetch never evicts layer l's experts nor the experts it ranks
// for the layers it looks at. Every token is treated as a decoded one.
//
// Prints, per token and for each rule: demand misses (the copies a layer waits for), prefetches
// for the next layer and for the layer after next with the share of each read by its layer
// before eviction, and the share of layers whose next-layer prediction had nothing to copy (the
// ~85 us gaps of the link trace). What it cannot say: time. A used fallback copy crosses in a
// gap the link would have idled through; a wasted one stands in front of the next layer's
// misses (FIFO) when that layer has any.
//
//   prefetch_fallback_probe TRACE.npz PRED.npy [--slots 1008] [--top 4] [--skip 32]
//
// --skip: tokens replayed before counting (the pool fills up).
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

Counts replay(const RoutingTrace& trace, const Predictions& pred, int64_t slots, int top,
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
                    pool.load(key, -1, kept_has);
                }
            }
            if (l + 1 >= L || top == 0) continue;
            if (counted) ++c.layers;
            const int16_t* next = pred.at(t, l, 0);
            for (int i = 0; i < top && i < pred.top_k; ++i)
                if (next[i] >= 0) kept.push_back(int64_t(l + 1) * E + next[i]);
            int64_t key = first_missing(next, l + 1);
            int kind = 0;
            if (key < 0) {
                if (counted) ++c.next_empty;
                if (!fallback || l + 2 >= L || pred.depth < 2) continue;
                const int16_t* after = pred.at(t, l, 1);
                for (int i = 0; i < top && i < pred.top_k; ++i)
                    if (after[i] >= 0) kept.push_back(int64_t(l + 2) * E + after[i]);
                key = first_missing(after, l + 2);
                kind = 1;
                if (key < 0) continue;
            }
            if (pool.load(key, kind, kept_has) && counted) ++c.loads[kind];
        }
    }
    return c;
}

void print(const char* name, const Counts& c) {
    const double T = double(c.tokens > 0 ? c.tokens : 1);
    auto share = [](int64_t a, int64_t b) { return b > 0 ? 100.0 * double(a) / double(b) : 0.0; };
    std::printf(
        "%-34s hit rate %.3f, demand misses %.2f / token, next-layer prefetches %.2f / token "
        "(%.0f %% used), after-next prefetches %.2f / token (%.0f %% used), layers whose "
        "next-layer top N were all in slots %.0f %%\n",
        name, 1.0 - double(c.misses) / double(c.accesses > 0 ? c.accesses : 1),
        double(c.misses) / T, double(c.loads[0]) / T, share(c.used[0], c.loads[0]),
        double(c.loads[1]) / T, share(c.used[1], c.loads[1]), share(c.next_empty, c.layers));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 3) {
        std::fprintf(stderr,
                     "usage: prefetch_fallback_probe TRACE.npz PRED.npy [--slots 1008] [--top 4] "
                     "[--skip 32]\n");
        return 2;
    }
    int64_t slots = 1008, skip = 32;
    int top = 4;
    for (int i = 3; i + 1 < argc; i += 2) {
        const std::string a = argv[i];
        if (a == "--slots") {
            slots = std::atoll(argv[i + 1]);
        } else if (a == "--top") {
            top = std::atoi(argv[i + 1]);
        } else if (a == "--skip") {
            skip = std::atoll(argv[i + 1]);
        } else {
            std::fprintf(stderr, "prefetch_fallback_probe: unknown option %s\n", a.c_str());
            return 2;
        }
    }
    try {
        const RoutingTrace trace = read_trace(argv[1]);
        const Predictions pred = read_predictions(argv[2], trace);
        std::printf("%lld tokens (%lld counted), %d MoE layers of %d experts, top %d, %lld slots\n",
                    static_cast<long long>(trace.n_tokens),
                    static_cast<long long>(trace.n_tokens - skip), trace.shape.n_moe_layers(),
                    trace.shape.n_experts, top, static_cast<long long>(slots));
        print("no prefetch", replay(trace, pred, slots, 0, false, skip));
        print("one fill from the next layer", replay(trace, pred, slots, top, false, skip));
        print("... else from the layer after next", replay(trace, pred, slots, top, true, skip));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "prefetch_fallback_probe: %s\n", e.what());
        return 1;
    }
    return 0;
}
