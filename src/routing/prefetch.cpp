#include "routing/prefetch.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <iterator>
#include <limits>
#include <stdexcept>

#include "routing/npz.h"

namespace minids::routing {

Predictions parse_predictions(std::span<const std::byte> npy, const std::string& name,
                              const RoutingTrace& tr) {
    const NpyView v = parse_npy(npy, name);
    if (v.descr != "<i2")
        throw TraceError(name + ": predictions must be <i2 (int16), found dtype '" + v.descr + "'");
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    auto dims = [](const std::vector<int64_t>& s) {
        std::string out = "[";
        for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
        return out + "]";
    };
    if (v.shape.size() != 4 || v.shape[0] != tr.n_tokens || v.shape[1] != L || v.shape[2] < 1 ||
        v.shape[3] != k) {
        throw TraceError(name + ": predictions of shape " + dims(v.shape) +
                         " do not fit the trace: expected [" + std::to_string(tr.n_tokens) + ", " +
                         std::to_string(L) + ", D >= 1, " + std::to_string(k) +
                         "] (tokens, MoE layers, depth, top-k)");
    }
    if (v.shape[2] > 4096) throw TraceError(name + ": prediction depth above 4096");
    Predictions p;
    p.n_tokens = tr.n_tokens;
    p.n_layers = L;
    p.depth = int32_t(v.shape[2]);
    p.top_k = k;
    p.ids.resize(size_t(v.n_elements()));
    std::memcpy(p.ids.data(), v.data.data(), p.ids.size() * 2);  // little-endian hosts only
    for (size_t i = 0; i < p.ids.size(); ++i) {
        if (p.ids[i] < -1 || p.ids[i] >= E) {
            throw TraceError(name + ": predicted expert id " + std::to_string(p.ids[i]) +
                             " at element " + std::to_string(i) + " is outside [0, " +
                             std::to_string(E) + ") and not -1");
        }
    }
    return p;
}

Predictions read_predictions(const std::string& path, const RoutingTrace& tr) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw TraceError(path + ": cannot open: " + std::strerror(errno));
    std::vector<char> raw((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    const auto* b = reinterpret_cast<const std::byte*>(raw.data());
    return parse_predictions({b, raw.size()}, path, tr);
}

std::vector<std::byte> predictions_bytes(const Predictions& p) {
    const auto* b = reinterpret_cast<const std::byte*>(p.ids.data());
    return make_npy("<i2", {p.n_tokens, p.n_layers, p.depth, p.top_k}, {b, p.ids.size() * 2});
}

void write_predictions(const Predictions& p, const std::string& path) {
    const std::vector<std::byte> bytes = predictions_bytes(p);
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    f.write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
    f.close();
    if (!f) throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
}

Predictions select_predictions(const Predictions& p, const RoutingTrace& tr,
                               const std::string& which) {
    if (which == "all") return p;
    const uint8_t want = which == "prefill" ? 1 : 0;
    Predictions out = p;
    out.ids.clear();
    out.n_tokens = 0;
    const size_t row = size_t(p.n_layers) * size_t(p.depth) * size_t(p.top_k);
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        if (tr.prefill[size_t(t)] != want) continue;
        out.ids.insert(out.ids.end(), p.ids.begin() + ptrdiff_t(size_t(t) * row),
                       p.ids.begin() + ptrdiff_t(size_t(t + 1) * row));
        ++out.n_tokens;
    }
    return out;
}

namespace {

constexpr double never = std::numeric_limits<double>::infinity();

// The link: transfers of one expert each, started in order and never preempted. Prefetches
// wait in a queue until the link takes them (lazily, when time is advanced); a queued prefetch
// whose key's generation changed (evicted, or promoted to a demand transfer) is dropped.
struct Link {
    struct Queued {
        int32_t key;
        uint32_t gen;
        double issued;
    };
    double dur = 0;      // one expert's transfer, us
    double free_at = 0;  // when the last started transfer ends
    double busy = 0;
    int64_t prefetch_started = 0;
    std::deque<Queued> queue;
    std::vector<uint32_t> gen;  // per key: bumped when its queued prefetch is cancelled
    std::vector<uint8_t> queued;
    std::vector<double>& ready;  // per key: when its bytes have landed (never: queued)

    explicit Link(std::vector<double>& r) : ready(r) {}

    double transfer(double issued) {
        const double start = std::max(free_at, issued);
        free_at = start + dur;
        busy += dur;
        return free_at;
    }
    // Starts the queued prefetches the link takes before time `until` (all of them: never).
    void advance(double until) {
        while (!queue.empty()) {
            const Queued q = queue.front();
            if (q.gen != gen[size_t(q.key)]) {
                queue.pop_front();
                continue;
            }
            if (std::max(free_at, q.issued) >= until) break;
            queue.pop_front();
            queued[size_t(q.key)] = 0;
            ready[size_t(q.key)] = transfer(q.issued);
            ++prefetch_started;
        }
    }
    void push(int32_t key, double issued) {
        queue.push_back({key, gen[size_t(key)], issued});
        queued[size_t(key)] = 1;
        ready[size_t(key)] = never;
    }
    // Drops a queued prefetch (true when there was one).
    bool cancel(int32_t key) {
        if (!queued[size_t(key)]) return false;
        queued[size_t(key)] = 0;
        ++gen[size_t(key)];
        return true;
    }
};

template <class P>
void run_prefetch(const RoutingTrace& tr, const CacheConfig& c, const Predictions* pred, int32_t D,
                  const std::vector<int32_t>* next, PrefetchResult& r) {
    LayeredPools<P> pools(c);
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    const size_t n_keys = size_t(L) * size_t(E);
    const TimingModel& tm = r.timing;
    // Model layers up to the last MoE layer; the others are dense (no experts to fetch).
    std::vector<uint8_t> is_moe(size_t(tr.shape.moe_layers.back()) + 1, 0);
    for (int32_t m : tr.shape.moe_layers) is_moe[size_t(m)] = 1;
    std::vector<double> ready(n_keys, 0.0);
    Link link(ready);
    link.dur = double(tr.shape.expert_bytes) / (tm.link_gbs * 1e3);  // bytes / (bytes per us)
    link.gen.assign(n_keys, 0);
    link.queued.assign(n_keys, 0);
    std::vector<uint8_t> unread(n_keys, 0);  // loaded by a prefetch, not yet read by its layer
    auto evicted = [&](int32_t key) {
        if (key < 0) return;
        if (unread[size_t(key)]) {
            unread[size_t(key)] = 0;
            ++r.prefetch_wasted;
        }
        link.cancel(key);
    };
    AccessHint use, no_use;
    no_use.use = false;
    double now = 0;
    int64_t i = 0;
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        int32_t l = 0;
        for (size_t m = 0; m < is_moe.size(); ++m) {
            if (!is_moe[m]) {
                now += tm.attn_us + tm.moe_us;
                continue;
            }
            const double issue = now + tm.attn_us + tm.fetch_us;
            if (tm.demand_first) {
                link.advance(issue);
            } else {
                link.advance(never);
            }
            // Demand: this layer's experts, in the trace's order (the predicted ones of this
            // layer are still pinned from the previous layer's prefetch).
            const uint16_t* ids = tr.ids_at(t, l);
            double needed = issue;
            int64_t hits = 0;
            for (int32_t j = 0; j < k; ++j, ++i) {
                const int32_t key = l * E + ids[j];
                if (D > 0 && pools.full_of_pins(l) && pools.slot_of(l, ids[j]) < 0) {
                    // No victim but the predicted experts: release them, keep this layer's.
                    pools.unpin_layer(l);
                    for (int32_t j2 = 0; j2 < j; ++j2) pools.pin(l, ids[j2]);
                }
                if (next) use.next_use = (*next)[size_t(i)];
                const AccessResult a = pools.access(l, ids[j], use, true);
                if (a.outcome == AccessResult::hit) {
                    ++hits;
                    if (unread[size_t(key)]) {
                        unread[size_t(key)] = 0;
                        ++r.prefetch_used;
                    }
                    if (link.cancel(key)) {  // still queued: fetched now, ahead of the queue
                        ready[size_t(key)] = link.transfer(issue);
                        ++link.prefetch_started;
                    }
                    needed = std::max(needed, ready[size_t(key)]);
                    continue;
                }
                evicted(a.evicted);
                ++r.demand_misses;
                r.sim.fills += a.outcome != AccessResult::bypass;
                const double landed = link.transfer(issue);
                if (a.outcome != AccessResult::bypass) ready[size_t(key)] = landed;
                needed = std::max(needed, landed);
            }
            r.sim.layer_hits[size_t(l)] += hits;
            r.stall_us += needed - issue;
            now = needed + tm.moe_us;
            if (D == 0) {
                pools.unpin_layer(l);
                ++l;
                continue;
            }
            // Prefetch, issued with this layer's misses: protect this layer's experts and the
            // predicted ones already resident, then load the predicted ones that are absent.
            pools.unpin_all();
            for (int32_t j = 0; j < k; ++j) pools.pin(l, ids[j]);
            for (int32_t d = 0; d < D && l + 1 + d < L; ++d) {
                const int16_t* p = pred->at(t, l, d);
                for (int32_t j = 0; j < k; ++j)
                    if (p[j] >= 0) pools.pin(l + 1 + d, p[j]);
            }
            for (int32_t d = 0; d < D && l + 1 + d < L; ++d) {
                const int32_t target = l + 1 + d;
                const int16_t* p = pred->at(t, l, d);
                for (int32_t j = 0; j < k; ++j) {
                    if (p[j] < 0 || pools.slot_of(target, p[j]) >= 0) continue;
                    if (pools.full_of_pins(target)) continue;  // no victim left to take
                    const AccessResult a = pools.access(target, p[j], no_use, true);
                    if (a.outcome == AccessResult::bypass) continue;  // admission refused it
                    evicted(a.evicted);
                    const int32_t key = target * E + p[j];
                    unread[size_t(key)] = 1;
                    ++r.prefetches;
                    link.push(key, issue);
                }
            }
            // Layer l+1's predicted experts stay protected until its own demand is done.
            pools.unpin_all();
            if (l + 1 < L) {
                const int16_t* p = pred->at(t, l, 0);
                for (int32_t j = 0; j < k; ++j)
                    if (p[j] >= 0) pools.pin(l + 1, p[j]);
            }
            ++l;
        }
    }
    link.advance(never);                              // queued prefetches still go over the link
    for (uint8_t u : unread) r.prefetch_wasted += u;  // never read before the trace ended
    r.prefetch_transfers = link.prefetch_started;
    r.time_us = now;
    r.busy_us = link.busy;
}

}  // namespace

PrefetchResult simulate_prefetch(const RoutingTrace& tr, CacheConfig c, const Predictions* pred,
                                 int32_t depth, const TimingModel& timing,
                                 const std::vector<int32_t>* next) {
    c.n_layers = tr.shape.n_moe_layers();
    c.n_experts = tr.shape.n_experts;
    check_config(c, tr.shape.top_k);
    if (depth < 0) throw std::invalid_argument("prefetch: the depth must be >= 0");
    if (depth > 0) {
        if (!pred || pred->depth < depth)
            throw std::invalid_argument(
                "prefetch: depth " + std::to_string(depth) + " needs predictions " +
                std::to_string(depth) +
                " layers ahead (--predictions with depth >= " + std::to_string(depth) + ")");
        if (pred->n_tokens != tr.n_tokens || pred->n_layers != c.n_layers ||
            pred->top_k != tr.shape.top_k)
            throw std::invalid_argument("prefetch: the predictions do not fit the trace");
        if (!policy_is_online(c.policy))
            throw std::invalid_argument("prefetch: needs an online policy (not belady)");
    }
    if (!(timing.link_gbs > 0) || !(timing.attn_us >= 0) || !(timing.moe_us >= 0) ||
        !(timing.fetch_us >= 0))
        throw std::invalid_argument(
            "prefetch timing: the link must be > 0 GB/s and the times >= 0 us");
    PrefetchResult r;
    r.depth = depth;
    r.timing = timing;
    r.sim.config = c;
    r.sim.n_tokens = tr.n_tokens;
    r.sim.expert_bytes = tr.shape.expert_bytes;
    r.sim.layer_hits.assign(size_t(c.n_layers), 0);
    r.sim.layer_accesses.assign(size_t(c.n_layers), tr.n_tokens * tr.shape.top_k);
    std::vector<int32_t> own_next;
    switch (c.policy) {
        case Policy::lru:
            run_prefetch<LruPolicy>(tr, c, pred, depth, nullptr, r);
            break;
        case Policy::lfu:
            run_prefetch<LfuPolicy>(tr, c, pred, depth, nullptr, r);
            break;
        case Policy::decay:
            run_prefetch<DecayPolicy>(tr, c, pred, depth, nullptr, r);
            break;
        case Policy::belady:
            if (!next) {
                own_next = next_uses(tr);
                next = &own_next;
            }
            run_prefetch<BeladyPolicy>(tr, c, pred, depth, next, r);
            break;
    }
    r.sim.accesses = tr.n_tokens * tr.row_size();
    for (int64_t h : r.sim.layer_hits) r.sim.hits += h;
    return r;
}

}  // namespace minids::routing
