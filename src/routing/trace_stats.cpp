#include "routing/trace_stats.h"

#include <algorithm>
#include <cmath>

namespace minids::routing {

const char* reuse_bucket_name(int b) {
    static const char* names[n_reuse_buckets] = {"1",     "2",     "3-4", "5-8",  "9-16",
                                                 "17-32", "33-64", "65+", "first"};
    return b >= 0 && b < n_reuse_buckets ? names[b] : "?";
}

namespace {

int reuse_bucket(int64_t distance) {  // distance >= 1 in tokens; < 0: first use
    if (distance < 0) return 8;
    if (distance <= 2) return int(distance) - 1;
    int b = 2;
    for (int64_t lim = 4; lim < 65 && distance > lim; lim *= 2) ++b;
    return std::min(b, 7);
}

}  // namespace

TraceStats compute_stats(const RoutingTrace& tr) {
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k, E = tr.shape.n_experts;
    const int64_t T = tr.n_tokens;
    TraceStats st;
    st.n_tokens = T;
    for (int64_t t = 0; t < T; ++t) {
        st.n_prefill += tr.prefill[size_t(t)];
        st.n_steps += t == 0 || tr.step[size_t(t)] != tr.step[size_t(t - 1)];
    }
    st.n_decode = T - st.n_prefill;
    st.layers.resize(size_t(L));

    std::vector<int64_t> count(static_cast<size_t>(E)), last(static_cast<size_t>(E));
    std::vector<int64_t> pair(size_t(E) * size_t(E));
    std::vector<int32_t> best_partner(static_cast<size_t>(E));
    std::vector<uint8_t> mark(static_cast<size_t>(E));
    for (int32_t l = 0; l < L; ++l) {
        LayerStats& ls = st.layers[size_t(l)];
        std::fill(count.begin(), count.end(), 0);
        std::fill(last.begin(), last.end(), -1);
        int64_t overlap = 0, within[3] = {0, 0, 0};
        int64_t hist[n_reuse_buckets] = {};
        for (int64_t t = 0; t < T; ++t) {
            const uint16_t* ids = tr.ids_at(t, l);
            for (int32_t j = 0; j < k; ++j) {
                const int64_t prev = last[ids[j]];
                const int64_t d = prev < 0 ? -1 : t - prev;
                ++hist[reuse_bucket(d)];
                if (d == 1 && t > 0) ++overlap;
                if (d >= 1 && d <= 4) ++within[0];
                if (d >= 1 && d <= 16) ++within[1];
                if (d >= 1 && d <= 64) ++within[2];
                ++count[ids[j]];
            }
            for (int32_t j = 0; j < k; ++j) last[ids[j]] = t;
        }
        const double assignments = double(T) * k;
        std::vector<double> share(static_cast<size_t>(E));
        double entropy = 0;
        for (int32_t e = 0; e < E; ++e) {
            share[size_t(e)] = double(count[size_t(e)]) / assignments;
            if (share[size_t(e)] > 0) entropy -= share[size_t(e)] * std::log(share[size_t(e)]);
        }
        std::sort(share.begin(), share.end(), std::greater<>());
        ls.entropy_ratio = E > 1 ? entropy / std::log(double(E)) : 1.0;
        double acc = 0;
        for (int32_t e = 0; e < E; ++e) {
            acc += share[size_t(e)];
            if (ls.experts_50 == 0 && acc >= 0.5 - 1e-12) ls.experts_50 = e + 1;
            if (ls.experts_90 == 0 && acc >= 0.9 - 1e-12) ls.experts_90 = e + 1;
        }
        ls.share = std::move(share);
        ls.overlap_next = T > 1 ? double(overlap) / (double(T - 1) * k) : 0;
        for (int w = 0; w < 3; ++w) ls.reuse_within[w] = double(within[w]) / assignments;
        for (int b = 0; b < n_reuse_buckets; ++b) ls.reuse_hist[b] = double(hist[b]) / assignments;

        int64_t windows = 0, distinct = 0;
        for (int64_t t0 = 0; t0 + 32 <= T; t0 += 32, ++windows) {
            std::fill(mark.begin(), mark.end(), 0);
            for (int64_t t = t0; t < t0 + 32; ++t)
                for (int32_t j = 0; j < k; ++j) distinct += !mark[tr.ids_at(t, l)[j]]++;
        }
        ls.distinct_32 = windows ? double(distinct) / double(windows) : 0;

        if (l > 0 &&
            E <= 1024) {  // the previous layer's experts -> this layer's experts, same token
            std::fill(pair.begin(), pair.end(), 0);
            for (int64_t t = 0; t < T; ++t) {
                const uint16_t* a = tr.ids_at(t, l - 1);
                const uint16_t* b = tr.ids_at(t, l);
                for (int32_t i = 0; i < k; ++i)
                    for (int32_t j = 0; j < k; ++j) ++pair[size_t(a[i]) * size_t(E) + b[j]];
            }
            for (int32_t e = 0; e < E; ++e) {
                const int64_t* row = pair.data() + size_t(e) * size_t(E);
                best_partner[size_t(e)] = int32_t(std::max_element(row, row + E) - row);
            }
            int64_t predicted = 0;
            for (int64_t t = 0; t < T; ++t) {
                const uint16_t* a = tr.ids_at(t, l - 1);
                const uint16_t* b = tr.ids_at(t, l);
                std::fill(mark.begin(), mark.end(), 0);
                for (int32_t i = 0; i < k; ++i) mark[size_t(best_partner[a[i]])] = 1;
                for (int32_t j = 0; j < k; ++j) predicted += mark[b[j]];
            }
            ls.cross_layer = double(predicted) / assignments;
        }
    }
    return st;
}

}  // namespace minids::routing
