// Probes eviction signals beyond lru / lfu / decay on a recorded trace, for
// docs/expert-cache-policies.md: can an online policy come within 10 points of Belady (issue 9)?
// One global pool, the simulator's rules (tokens, then MoE layers in order; a token's k experts
// of a layer pinned together), victims chosen by a scan of every slot (slow, exact). Variants,
// each adding to the one before:
//   decay     evict the lowest decayed use count (half-life in visits of the expert's layer);
//             the same ordering as routing::DecayPolicy, as a check of this harness
//   distance  evict the largest expected distance to the next use: layers until the expert's
//             layer comes round again, plus (1 - p) / p token cycles, p = the decayed count read
//             as a per-visit probability
//   xlayer    for the experts of the next layer, p mixed half and half with the probability
//             learned online that the current layer's choice leads to them (cross-layer)
//   soft      every visit also adds beta x the router's probability of each expert of the layer
//             (the experts just outside the top-k), from record_routing_text --probs
// and, apart from that chain:
//   admit     decay, but a missed expert takes a slot only when its decayed count (this use
//             included) is above the victim's; otherwise it is used once without being cached
//             (the engine reads a miss in place anyway, so a refused admission saves its copy)
//   belady+bypass  the offline optimum when admission may be refused: on a miss, of the cached
//             experts and the missed one, the one used again farthest in the future is left out
// and, with --predict PRED.npy (record_routing_text --predict: for each token and MoE layer l,
// the experts the routers of layers l+1 … l+D choose for layer l's hidden state), decay order
// plus the experts predicted for the next `ahead` layers of the current token, known when layer
// l's misses are served (the prediction from layer l's state; with --union also those made at
// the token's earlier layers):
//   protect   a predicted expert is evicted only when every unpinned slot holds one
//   bonus     a predicted expert's decayed count is raised by --bonus before ranking
//   oracle    protect, with the real experts of the next `ahead` layer steps in place of the
//             predictions (what a perfect predictor would give this rule: its upper bound):
//             the next step, the rest of the token (-token: the bound of any prediction made
//             from the token's own states), and 1, 2, 4, 8 tokens' worth of steps (L each)
// each also with admission (decay's rule, the victim's rank as the policy sees it).
//
//   policy_probe TRACE.npz [--probs PROBS.npy] [--slots 25%] [--half-life 32] [--beta 1]
//                [--predict PRED.npy] [--bonus 2] [--union 1]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "routing/npz.h"
#include "routing/simulator.h"
#include "routing/trace.h"

using namespace minids::routing;

namespace {

enum class Variant { decay, distance, xlayer, soft, admit, protect, bonus, oracle };

struct ProbeOptions {
    Variant variant = Variant::decay;
    double half_life = 32;  // visits of the expert's layer (tokens)
    double beta = 1;
    const std::vector<float>* probs = nullptr;  // [T][L][E]
    // Predictions (Variant::protect, bonus): [T][L][depth][k], -1 past the last layer.
    const std::vector<int16_t>* pred = nullptr;
    int depth = 1;
    int ahead = 1;              // how many following layers of the token are protected
    bool admit = false;         // decay's admission with the prediction variants
    double bonus = 2;           // Variant::bonus: added to a predicted expert's decayed count
    bool union_ = false;        // also the predictions made at the token's earlier layers
    bool within_token = false;  // the oracle stops at the token's last layer
};

// Marks (mark[key] = stamp) the experts predicted, when layer l of token t is served, for the
// layers l+1 … l+ahead of the same token; the oracle marks those layers' real experts instead.
void mark_predicted(const RoutingTrace& tr, const ProbeOptions& o, int64_t t, int l,
                    std::vector<int64_t>& mark, int64_t stamp) {
    const int L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    if (o.variant == Variant::oracle) {  // the next `ahead` layer steps, across tokens too
        const int64_t end = o.within_token ? (t + 1) * L : tr.n_tokens * L;
        for (int64_t i = t * L + l + 1; i <= t * L + l + o.ahead && i < end; ++i) {
            const int m = int(i % L);
            for (int j = 0; j < k; ++j) mark[size_t(m * E + tr.ids_at(i / L, m)[j])] = stamp;
        }
        return;
    }
    for (int m = l + 1; m <= l + o.ahead && m < L; ++m) {
        // From layer l's state, and with union_ also from the earlier layers' states.
        for (int from = o.union_ ? 0 : l; from <= l; ++from) {
            const int d = m - from - 1;
            if (d >= o.depth) continue;
            const int16_t* p = o.pred->data() + ((size_t(t) * L + size_t(from)) * o.depth + d) * k;
            for (int j = 0; j < k; ++j)
                if (p[j] >= 0) mark[size_t(m * E + p[j])] = stamp;
        }
    }
}

double probe(const RoutingTrace& tr, int slots, const ProbeOptions& o) {
    const int L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    const double f = std::exp2(-1.0 / o.half_life);
    std::vector<double> score(size_t(L) * E, 0.0);
    // trans[(l * E + a) * E + b]: times expert a at layer l was followed by b at the next layer
    std::vector<double> trans(size_t(L) * E * E, 0.0), from(size_t(L) * E, 0.0);
    std::vector<int> slot_of(size_t(L) * E, -1), key_of(size_t(slots), -1);
    std::vector<char> pinned(size_t(slots), 0);
    std::vector<int> prev;
    std::vector<int64_t> mark(size_t(L) * E, -1);
    const bool predictive = o.variant == Variant::protect || o.variant == Variant::bonus ||
                            o.variant == Variant::oracle;
    const bool admit = o.variant == Variant::admit || (predictive && o.admit);
    int filled = 0;
    int64_t hits = 0, accesses = 0, refused = 0, foreseen = 0, later_misses = 0;
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        for (int l = 0; l < L; ++l) {
            const uint16_t* ids = tr.ids_at(t, l);
            const int64_t stamp = t * L + l;
            if (predictive) mark_predicted(tr, o, t, l, mark, stamp);
            for (int e = 0; e < E; ++e) score[size_t(l * E + e)] *= f;
            for (int j = 0; j < k; ++j) {
                const int key = l * E + ids[j];
                ++accesses;
                int s = slot_of[size_t(key)];
                if (s >= 0) {
                    ++hits;
                    pinned[size_t(s)] = 1;
                    continue;
                }
                later_misses += l > 0;
                if (l > 0 && !o.pred->empty()) {  // a miss the previous layer's state predicted
                    const int16_t* p =
                        o.pred->data() + (size_t(t) * L + size_t(l - 1)) * size_t(o.depth) * k;
                    foreseen += std::count(p, p + k, int16_t(ids[j])) > 0;
                }
                if (filled < slots) {
                    s = filled++;
                } else if (predictive) {
                    // Lowest decayed count (plus the bonus), predicted experts last (protect).
                    double worst = -HUGE_VAL;
                    bool worst_marked = true;
                    for (int c = 0; c < slots; ++c) {
                        if (pinned[size_t(c)]) continue;
                        const int kk = key_of[size_t(c)];
                        const bool m = mark[size_t(kk)] == stamp;
                        double rank = -score[size_t(kk)];
                        if (m && o.variant == Variant::bonus) rank -= o.bonus;
                        const bool shielded = m && o.variant != Variant::bonus;
                        if (shielded && !worst_marked) continue;
                        if ((!shielded && worst_marked) || rank > worst) {
                            worst = rank;
                            worst_marked = shielded;
                            s = c;
                        }
                    }
                    // The oracle also admits what it knows returns within its window.
                    if (admit && mark[size_t(key)] != stamp && score[size_t(key)] + 1.0 <= -worst) {
                        ++refused;
                        continue;  // used in place, not cached
                    }
                    slot_of[size_t(key_of[size_t(s)])] = -1;
                } else {
                    double worst = -HUGE_VAL;
                    for (int c = 0; c < slots; ++c) {
                        if (pinned[size_t(c)]) continue;
                        const int kk = key_of[size_t(c)], kl = kk / E, ke = kk % E;
                        double p = score[size_t(kk)] * (1 - f);
                        double rank = -score[size_t(kk)];  // decay: lowest count goes
                        if (o.variant != Variant::decay && o.variant != Variant::admit) {
                            if (o.variant != Variant::distance && kl == (l + 1) % L) {
                                double pt = 0;
                                int n = 0;
                                for (int a = 0; a < k; ++a) {
                                    const size_t row = size_t(l) * E + ids[a];
                                    if (from[row] > 0) {
                                        pt += trans[row * E + size_t(ke)] / from[row];
                                        ++n;
                                    }
                                }
                                if (n) p = 0.5 * p + 0.5 * pt / n;
                            }
                            p = std::clamp(p, 1e-6, 1.0);
                            const int d = kl > l ? kl - l : kl - l + L;
                            rank = d + (1 - p) / p * L;
                        }
                        if (rank > worst) {
                            worst = rank;
                            s = c;
                        }
                    }
                    if (o.variant == Variant::admit && score[size_t(key)] + 1.0 <= -worst) {
                        ++refused;
                        continue;  // used in place, not cached
                    }
                    slot_of[size_t(key_of[size_t(s)])] = -1;
                }
                slot_of[size_t(key)] = s;
                key_of[size_t(s)] = key;
                pinned[size_t(s)] = 1;
            }
            for (int j = 0; j < k; ++j) score[size_t(l * E + ids[j])] += 1.0;
            if (o.variant == Variant::soft)
                for (int e = 0; e < E; ++e)
                    score[size_t(l * E + e)] +=
                        o.beta * (*o.probs)[(size_t(t) * L + size_t(l)) * E + size_t(e)];
            if (!prev.empty()) {  // the previous layer step (the last layer leads to the first)
                const int pl = (l + L - 1) % L;
                for (int a : prev) {
                    const size_t row = size_t(pl) * E + size_t(a);
                    from[row] += 1;
                    for (int j = 0; j < k; ++j) trans[row * E + ids[j]] += 1;
                }
            }
            prev.assign(ids, ids + k);
            std::fill(pinned.begin(), pinned.end(), 0);
        }
    }
    if (admit)
        std::printf("  (admit: %lld of %lld misses not cached)\n", (long long)refused,
                    (long long)(accesses - hits));
    if (!o.pred->empty())
        std::printf(
            "  (%lld of %lld misses predicted one layer ahead: %.1f %%; %.1f %% of the %lld "
            "misses past the first layer)\n",
            (long long)foreseen, (long long)(accesses - hits),
            100.0 * double(foreseen) / double(accesses - hits),
            100.0 * double(foreseen) / double(later_misses), (long long)later_misses);
    return double(hits) / double(accesses);
}

// Belady with bypass: the offline optimum when a miss need not be cached. Next uses are found
// by a backward pass over the access sequence (token, layer, j order).
double belady_bypass(const RoutingTrace& tr, int slots) {
    const int L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    const int64_t n = tr.n_tokens * L * k;
    std::vector<int> key(static_cast<size_t>(n));
    for (int64_t t = 0; t < tr.n_tokens; ++t)
        for (int l = 0; l < L; ++l)
            for (int j = 0; j < k; ++j)
                key[size_t((t * L + l) * k + j)] = l * E + tr.ids_at(t, l)[j];
    std::vector<int64_t> next(static_cast<size_t>(n)), last(size_t(L) * E, INT64_MAX);
    for (int64_t i = n - 1; i >= 0; --i) {
        next[size_t(i)] = last[size_t(key[size_t(i)])];
        last[size_t(key[size_t(i)])] = i;
    }
    // cached: next use -> key, ordered; pinned keys (this layer's) cannot be chosen.
    std::vector<int64_t> cached_next(size_t(L) * E, -1);  // -1: not cached
    std::vector<std::pair<int64_t, int>> heap;            // (next use, key), lazy max-heap
    int size = 0;
    int64_t hits = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int kk = key[size_t(i)];
        const int64_t nx = next[size_t(i)];
        if (cached_next[size_t(kk)] >= 0) {
            ++hits;
            cached_next[size_t(kk)] = nx;
            heap.push_back({nx, kk});
            std::push_heap(heap.begin(), heap.end());
            continue;
        }
        if (size < slots) {
            cached_next[size_t(kk)] = nx;
            heap.push_back({nx, kk});
            std::push_heap(heap.begin(), heap.end());
            ++size;
            continue;
        }
        // The farthest cached next use (skipping stale heap entries); pins do not matter for
        // the bound since a pinned expert is used again within this layer step... they are
        // used now, so their next use is later than i but they were just accessed: treat the
        // bound as pin-free (an upper bound either way).
        while (true) {
            const auto [hn, hk] = heap.front();
            if (cached_next[size_t(hk)] == hn) break;
            std::pop_heap(heap.begin(), heap.end());
            heap.pop_back();
        }
        const auto [far, victim] = heap.front();
        if (nx >= far) continue;  // bypass: the missed expert returns last
        std::pop_heap(heap.begin(), heap.end());
        heap.pop_back();
        cached_next[size_t(victim)] = -1;
        cached_next[size_t(kk)] = nx;
        heap.push_back({nx, kk});
        std::push_heap(heap.begin(), heap.end());
    }
    return double(hits) / double(n);
}

std::vector<float> read_probs(const std::string& path, const RoutingTrace& tr) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> raw((std::istreambuf_iterator<char>(in)), {});
    const auto* b = reinterpret_cast<const std::byte*>(raw.data());
    const NpyView v = parse_npy({b, raw.size()}, path);
    const std::vector<int64_t> want = {tr.n_tokens, tr.shape.n_moe_layers(), tr.shape.n_experts};
    if (v.descr != "<f4" || v.shape != want)
        throw TraceError(path + ": expected <f4 [T, L, E] matching the trace");
    std::vector<float> p(size_t(v.n_elements()));
    std::memcpy(p.data(), v.data.data(), p.size() * 4);
    return p;
}

std::vector<int16_t> read_predictions(const std::string& path, const RoutingTrace& tr, int& depth) {
    std::ifstream in(path, std::ios::binary);
    std::vector<char> raw((std::istreambuf_iterator<char>(in)), {});
    const auto* b = reinterpret_cast<const std::byte*>(raw.data());
    const NpyView v = parse_npy({b, raw.size()}, path);
    if (v.descr != "<i2" || v.shape.size() != 4 || v.shape[0] != tr.n_tokens ||
        v.shape[1] != tr.shape.n_moe_layers() || v.shape[3] != tr.shape.top_k)
        throw TraceError(path + ": expected <i2 [T, L, D, k] matching the trace");
    depth = int(v.shape[2]);
    std::vector<int16_t> p(size_t(v.n_elements()));
    std::memcpy(p.data(), v.data.data(), p.size() * 2);
    return p;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr,
                     "usage: policy_probe TRACE.npz [--probs PROBS.npy] [--slots 25%%] "
                     "[--half-life 32] [--beta 1]\n");
        return 2;
    }
    try {
        const RoutingTrace tr = read_trace(argv[1]);
        std::string probs_path, pred_path, slots_arg = "25%";
        ProbeOptions o;
        for (int i = 2; i + 1 < argc; i += 2) {
            const std::string a = argv[i];
            if (a == "--probs") probs_path = argv[i + 1];
            if (a == "--slots") slots_arg = argv[i + 1];
            if (a == "--half-life") o.half_life = std::atof(argv[i + 1]);
            if (a == "--beta") o.beta = std::atof(argv[i + 1]);
            if (a == "--predict") pred_path = argv[i + 1];
            if (a == "--bonus") o.bonus = std::atof(argv[i + 1]);
            if (a == "--union") o.union_ = std::atoi(argv[i + 1]) != 0;
        }
        const int keys = tr.shape.n_moe_layers() * tr.shape.n_experts;
        const int slots = slots_arg.back() == '%'
                              ? int(std::lround(std::atof(slots_arg.c_str()) / 100 * keys))
                              : std::atoi(slots_arg.c_str());
        std::vector<float> probs;
        if (!probs_path.empty()) probs = read_probs(probs_path, tr);
        o.probs = &probs;
        std::vector<int16_t> pred;
        if (!pred_path.empty()) pred = read_predictions(pred_path, tr, o.depth);
        o.pred = &pred;

        CacheConfig c;
        c.n_slots = slots;
        c.policy = Policy::belady;
        const double belady = simulate(tr, c).hit_rate();
        c.policy = Policy::decay;
        c.decay_half_life = o.half_life * tr.shape.top_k;
        const double decay = simulate(tr, c).hit_rate();
        c.policy = Policy::belady;
        c.admit = Admission::frequency;
        const double belady_admit = simulate(tr, c).hit_rate();
        std::printf(
            "%s: %d of %d slots; belady %.3f, belady+admit %.3f, belady+bypass %.3f, "
            "routing::DecayPolicy %.3f\n",
            argv[1], slots, keys, belady, belady_admit, belady_bypass(tr, slots), decay);
        if (!pred.empty()) {
            // Decay with the predictions, each rule with and without admission; `ahead` up to
            // the depth recorded (the oracle to 2 whatever the depth).
            for (bool adm : {false, true}) {
                o.admit = adm;
                for (auto [v, name] : {std::pair{Variant::protect, "protect"},
                                       {Variant::bonus, "bonus"},
                                       {Variant::oracle, "oracle"}}) {
                    // The oracle: the next layer step; the rest of the token ("-token", the
                    // bound of any prediction from the token's own states); 1, 2, 4, 8 tokens.
                    const int L = tr.shape.n_moe_layers();
                    for (int ahead : {1, 2, 3, 4, -1, L, 2 * L, 4 * L, 8 * L}) {
                        if (v != Variant::oracle && (ahead > o.depth || ahead < 0)) continue;
                        if (v == Variant::oracle && ahead > 1 && ahead < L) continue;
                        o.variant = v;
                        o.within_token = ahead < 0;
                        o.ahead = ahead < 0 ? L : ahead;
                        const double h = probe(tr, slots, o);
                        const std::string a = ahead < 0 ? "token" : std::to_string(ahead);
                        std::printf("  %s-%s%s %.3f (%+.1f pt vs belady%s)\n", name, a.c_str(),
                                    adm ? "+admit" : "", h,
                                    100 * (h - (adm ? belady_admit : belady)), adm ? "+admit" : "");
                    }
                }
            }
        }
        for (auto [v, name] : {std::pair{Variant::decay, "decay"},
                               {Variant::distance, "distance"},
                               {Variant::xlayer, "xlayer"},
                               {Variant::soft, "soft"},
                               {Variant::admit, "admit"}}) {
            if (v == Variant::soft && probs.empty()) continue;
            o.variant = v;
            const double h = probe(tr, slots, o);
            std::printf("  %-9s %.3f (%+.1f pt vs belady)\n", name, h, 100 * (h - belady));
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "policy_probe: %s\n", e.what());
        return 2;
    }
    return 0;
}
