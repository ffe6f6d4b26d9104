#include "routing/synthetic.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

namespace minids::routing {

namespace {

// xoshiro256**, seeded by splitmix64: fast and reproducible on every platform.
class Rng {
public:
    explicit Rng(uint64_t seed) {
        for (uint64_t& s : s_) {
            seed += 0x9E3779B97F4A7C15ull;
            uint64_t z = seed;
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            s = z ^ (z >> 31);
        }
    }
    uint64_t next() {
        const uint64_t r = rotl(s_[1] * 5, 7) * 9, t = s_[1] << 17;
        s_[2] ^= s_[0];
        s_[3] ^= s_[1];
        s_[1] ^= s_[2];
        s_[0] ^= s_[3];
        s_[2] ^= t;
        s_[3] = rotl(s_[3], 45);
        return r;
    }
    double uniform() { return double(next() >> 11) * 0x1.0p-53; }
    uint32_t below(uint32_t n) { return uint32_t((next() >> 32) * n >> 32); }
    double normal() {  // Box-Muller
        const double u = std::max(uniform(), 1e-300), v = uniform();
        return std::sqrt(-2 * std::log(u)) * std::cos(6.283185307179586 * v);
    }

private:
    static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
    uint64_t s_[4];
};

// Walker's alias table: O(1) draws from a discrete distribution.
class AliasTable {
public:
    explicit AliasTable(const std::vector<double>& w) {
        const size_t n = w.size();
        prob_.assign(n, 0);
        alias_.assign(n, 0);
        const double sum = std::accumulate(w.begin(), w.end(), 0.0);
        std::vector<double> p(n);
        std::vector<uint32_t> small, large;
        for (size_t i = 0; i < n; ++i) {
            p[i] = w[i] * double(n) / sum;
            (p[i] < 1 ? small : large).push_back(uint32_t(i));
        }
        while (!small.empty() && !large.empty()) {
            const uint32_t s = small.back(), l = large.back();
            small.pop_back();
            prob_[s] = p[s];
            alias_[s] = l;
            p[l] -= 1 - p[s];
            if (p[l] < 1) {
                large.pop_back();
                small.push_back(l);
            }
        }
        for (uint32_t i : small) prob_[i] = 1;
        for (uint32_t i : large) prob_[i] = 1;
    }
    uint32_t draw(Rng& rng) const {
        const uint32_t i = rng.below(uint32_t(prob_.size()));
        return rng.uniform() < prob_[i] ? i : alias_[i];
    }

private:
    std::vector<double> prob_;
    std::vector<uint32_t> alias_;
};

double per_layer(const std::vector<double>& v, int32_t l) {
    return v.size() == 1 ? v[0] : v[size_t(l)];
}

void check_list(const std::vector<double>& v, int32_t L, const char* name, double hi) {
    if (v.size() != 1 && v.size() != size_t(L)) {
        throw std::invalid_argument(std::string(name) + ": expected 1 or " + std::to_string(L) +
                                    " values (one per MoE layer), found " +
                                    std::to_string(v.size()));
    }
    for (double x : v) {
        if (!(x >= 0 && x <= hi)) {
            throw std::invalid_argument(std::string(name) + ": values must be in [0, " +
                                        std::to_string(hi).substr(0, 4) + "]");
        }
    }
}

}  // namespace

TraceShape preset_shape(const std::string& name) {
    TraceShape s;
    auto layers = [](int32_t first, int32_t last) {
        std::vector<int32_t> v;
        for (int32_t l = first; l <= last; ++l) v.push_back(l);
        return v;
    };
    // FP8 expert blob as the .mds writer lays it out: gate, up [n_ff, D], down [D, n_ff] in one
    // byte per weight, then an F32 scale per output row, each part on a 256-byte boundary.
    auto fp8_expert = [](uint64_t d, uint64_t ff) {
        uint64_t pos = 0;
        for (uint64_t part : {ff * d, ff * d, d * ff, 4 * ff, 4 * ff, 4 * d})
            pos = (pos + 255) / 256 * 256 + part;
        return pos;
    };
    if (name == "v2-lite") {
        s = {64, 6, fp8_expert(2048, 1408), layers(1, 26)};
    } else if (name == "v2") {
        s = {160, 6, fp8_expert(5120, 1536), layers(1, 59)};
    } else if (name == "demo") {
        s = {32, 4, fp8_expert(256, 80), layers(1, 5)};
    } else {
        throw std::invalid_argument("unknown preset \"" + name + "\" (expected v2-lite, v2, demo)");
    }
    return s;
}

RoutingTrace generate_trace(const SynthParams& p) {
    validate_shape(p.shape, "gen");
    const int32_t L = p.shape.n_moe_layers(), k = p.shape.top_k, E = p.shape.n_experts;
    if (p.n_tokens < 1) throw std::invalid_argument("gen: needs at least one token");
    check_list(p.zipf, L, "--zipf", 8.0);
    check_list(p.stickiness, L, "--stickiness", 1.0);
    check_list(p.cross_layer, L, "--cross-layer", 1.0);
    for (int32_t l = 0; l < L; ++l) {
        if (per_layer(p.stickiness, l) + per_layer(p.cross_layer, l) > 1.0 + 1e-9) {
            throw std::invalid_argument("gen: stickiness + cross-layer must be at most 1");
        }
    }
    Rng rng(p.seed);
    std::vector<AliasTable> popularity;
    std::vector<std::vector<uint32_t>> order(static_cast<size_t>(L)),
        partner(static_cast<size_t>(L));
    for (int32_t l = 0; l < L; ++l) {
        std::vector<double> w(static_cast<size_t>(E));
        for (int32_t r = 0; r < E; ++r)
            w[size_t(r)] = std::pow(double(r + 1), -per_layer(p.zipf, l));
        popularity.emplace_back(w);
        for (auto* perm : {&order[size_t(l)], &partner[size_t(l)]}) {
            perm->resize(size_t(E));
            std::iota(perm->begin(), perm->end(), 0u);
            for (int32_t i = E - 1; i > 0; --i)
                std::swap((*perm)[size_t(i)], (*perm)[rng.below(uint32_t(i + 1))]);
        }
    }

    RoutingTrace tr;
    tr.shape = p.shape;
    tr.source = "minids routing gen";
    tr.n_tokens = p.n_tokens;
    const int64_t row = tr.row_size();
    tr.ids.resize(size_t(p.n_tokens * row));
    tr.weights.resize(tr.ids.size());
    tr.prefill.assign(size_t(p.n_tokens), 0);
    tr.step.resize(size_t(p.n_tokens));
    std::iota(tr.step.begin(), tr.step.end(), 0);
    std::vector<uint8_t> taken(size_t(E), 0);
    std::vector<uint16_t> candidates;
    std::vector<double> w(static_cast<size_t>(k));
    for (int64_t t = 0; t < p.n_tokens; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            uint16_t* ids = tr.ids.data() + t * row + int64_t(l) * k;
            const double stick = per_layer(p.stickiness, l), cross = per_layer(p.cross_layer, l);
            for (int32_t j = 0; j < k; ++j) {
                int32_t e = -1;
                const double u = rng.uniform();
                candidates.clear();
                if (t > 0 && u < stick) {
                    const uint16_t* prev = ids - row;
                    for (int32_t i = 0; i < k; ++i)
                        if (!taken[prev[i]]) candidates.push_back(prev[i]);
                } else if (l > 0 && u < stick + cross) {
                    const uint16_t* below = ids - k;
                    for (int32_t i = 0; i < k; ++i) {
                        const uint32_t q = partner[size_t(l)][below[i]];
                        if (!taken[q]) candidates.push_back(uint16_t(q));
                    }
                }
                if (!candidates.empty()) e = candidates[rng.below(uint32_t(candidates.size()))];
                for (int tries = 0; e < 0 && tries < 1000; ++tries) {
                    const uint32_t q = order[size_t(l)][popularity[size_t(l)].draw(rng)];
                    if (!taken[q]) e = int32_t(q);
                }
                for (int32_t q = 0; e < 0 && q < E; ++q)
                    if (!taken[size_t(q)]) e = q;
                taken[size_t(e)] = 1;
                ids[j] = uint16_t(e);
            }
            for (int32_t j = 0; j < k; ++j) taken[ids[j]] = 0;
            double sum = 0;
            for (double& x : w) sum += (x = std::exp(0.5 * rng.normal()));
            std::sort(w.begin(), w.end(), std::greater<>());
            float* out = tr.weights.data() + t * row + int64_t(l) * k;
            for (int32_t j = 0; j < k; ++j) out[j] = float(w[size_t(j)] / sum * p.weight_sum);
        }
    }
    nlohmann::json g;
    g["seed"] = p.seed;
    g["zipf"] = p.zipf;
    g["stickiness"] = p.stickiness;
    g["cross_layer"] = p.cross_layer;
    tr.extra["generator"] = g;
    return tr;
}

FitResult fit_trace(const RoutingTrace& rec, int rounds, uint64_t seed, int64_t max_tokens) {
    const int32_t L = rec.shape.n_moe_layers();
    FitResult f;
    f.target = compute_stats(rec);
    SynthParams& p = f.params;
    p.shape = rec.shape;
    p.n_tokens = std::min(rec.n_tokens, max_tokens);
    p.seed = seed;
    p.zipf.assign(size_t(L), 0.5);
    p.stickiness.assign(size_t(L), 0.2);
    p.cross_layer.assign(size_t(L), 0.0);
    // The statistics depend on all three parameters (skew adds chance overlap, sticky layers
    // blur the cross-layer partners), so each parameter is bisected in turn with the others
    // held, and the whole is repeated.
    enum Which { zipf, stick, cross };
    for (int pass = 0; pass < 3; ++pass) {
        for (Which w : {zipf, stick, cross}) {
            std::vector<double> lo(size_t(L), 0.0), hi(size_t(L), w == zipf ? 3.0 : 1.0);
            std::vector<double>& v =
                w == zipf ? p.zipf : (w == stick ? p.stickiness : p.cross_layer);
            for (int r = 0; r < rounds; ++r) {
                for (int32_t l = 0; l < L; ++l) {
                    v[size_t(l)] = (lo[size_t(l)] + hi[size_t(l)]) / 2;
                    // stickiness + cross-layer <= 1; the first layer has no layer before it.
                    if (w == stick)
                        p.cross_layer[size_t(l)] =
                            std::min(p.cross_layer[size_t(l)], 1.0 - v[size_t(l)]);
                    if (w == cross)
                        v[size_t(l)] =
                            l == 0 ? 0.0 : std::min(v[size_t(l)], 1.0 - p.stickiness[size_t(l)]);
                }
                const TraceStats got = compute_stats(generate_trace(p));
                for (int32_t l = 0; l < L; ++l) {
                    const LayerStats &want = f.target.layers[size_t(l)],
                                     &have = got.layers[size_t(l)];
                    // Entropy falls as the exponent grows; overlap and the cross-layer
                    // statistic rise with their probabilities.
                    const bool raise = w == zipf    ? have.entropy_ratio > want.entropy_ratio
                                       : w == stick ? have.overlap_next < want.overlap_next
                                                    : have.cross_layer < want.cross_layer;
                    (raise ? lo : hi)[size_t(l)] = v[size_t(l)];
                }
            }
            for (int32_t l = 0; l < L; ++l) {
                v[size_t(l)] = (lo[size_t(l)] + hi[size_t(l)]) / 2;
                if (w == cross && l == 0) v[size_t(l)] = 0;
                if (w == cross)
                    v[size_t(l)] = std::min(v[size_t(l)], 1.0 - p.stickiness[size_t(l)]);
                if (w == stick)
                    p.cross_layer[size_t(l)] =
                        std::min(p.cross_layer[size_t(l)], 1.0 - v[size_t(l)]);
            }
        }
    }
    f.achieved = compute_stats(generate_trace(p));
    p.n_tokens = rec.n_tokens;
    return f;
}

Predictions generate_predictions(const RoutingTrace& tr, const std::vector<double>& accuracy,
                                 int32_t depth, uint64_t seed) {
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    if (depth < 1 || depth >= std::max(L, 2))
        throw std::invalid_argument("--predict-depth: must be in [1, " +
                                    std::to_string(std::max(L - 1, 1)) + "]");
    if (accuracy.size() != 1 && accuracy.size() != size_t(depth))
        throw std::invalid_argument("--predict-accuracy: expected 1 or " + std::to_string(depth) +
                                    " values (one per depth), found " +
                                    std::to_string(accuracy.size()));
    for (double a : accuracy)
        if (!(a >= 0 && a <= 1))
            throw std::invalid_argument("--predict-accuracy: values must be in [0, 1]");
    std::vector<double> keep(static_cast<size_t>(depth));
    for (int32_t d = 0; d < depth; ++d)  // one value A: A^(d+1) for d+1 layers ahead
        keep[size_t(d)] = accuracy.size() == 1 ? std::pow(accuracy[0], d + 1) : accuracy[size_t(d)];
    Predictions p;
    p.n_tokens = tr.n_tokens;
    p.n_layers = L;
    p.depth = depth;
    p.top_k = k;
    p.ids.assign(size_t(tr.n_tokens) * size_t(L) * size_t(depth) * size_t(k), -1);
    // A stream of its own (the trace's seed with a tag), so a trace and its predictions can be
    // regenerated separately.
    Rng rng(seed ^ 0x5052454449435453ull);
    std::vector<uint8_t> taken(static_cast<size_t>(E));
    for (int64_t t = 0; t < tr.n_tokens; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            for (int32_t d = 0; d < depth && l + 1 + d < L; ++d) {
                const uint16_t* real = tr.ids_at(t, l + 1 + d);
                int16_t* out = p.ids.data() + ((t * L + l) * depth + d) * k;
                std::fill(taken.begin(), taken.end(), 0);
                for (int32_t j = 0; j < k; ++j) taken[real[j]] = 1;
                int32_t n_taken = k;
                for (int32_t j = 0; j < k; ++j) {
                    out[j] = int16_t(real[j]);
                    if (rng.uniform() < keep[size_t(d)] || n_taken >= E) continue;
                    uint32_t e = rng.below(uint32_t(E));
                    while (taken[e]) e = rng.below(uint32_t(E));
                    taken[e] = 1;
                    ++n_taken;
                    out[j] = int16_t(e);
                }
            }
        }
    }
    return p;
}

}  // namespace minids::routing
