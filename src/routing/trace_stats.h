// Statistics of a routing trace per MoE layer: how skewed expert popularity is, how often a
// token reuses recent tokens' experts, and how predictable a layer's experts are from the
// previous layer's. `minids routing stats` prints them; `fit` matches them.
#pragma once

#include <cstdint>
#include <vector>

#include "routing/trace.h"

namespace minids::routing {

// Reuse distances are bucketed as: 1, 2, 3-4, 5-8, 9-16, 17-32, 33-64, 65+ tokens since the
// expert was last chosen in that layer, and "first use".
inline constexpr int n_reuse_buckets = 9;
const char* reuse_bucket_name(int b);

struct LayerStats {
    std::vector<double> share;  // share of the layer's assignments per expert, sorted descending
    double entropy_ratio = 0;   // entropy of `share` / ln E (1: uniform)
    int32_t experts_50 = 0, experts_90 = 0;  // fewest experts carrying 50 % / 90 % of assignments
    double overlap_next = 0;  // mean fraction of token t+1's experts that token t also chose
    double reuse_within[3] = {0, 0, 0};  // ... that some of the previous 4 / 16 / 64 tokens chose
    double distinct_32 = 0;              // mean distinct experts over windows of 32 tokens
    double cross_layer = 0;  // fraction of the layer's experts that are the most frequent
                             // partner of one of the previous MoE layer's experts (layer 0
                             // and E > 1024: 0)
    double reuse_hist[n_reuse_buckets] = {};  // fraction of accesses per reuse-distance bucket
};

struct TraceStats {
    int64_t n_tokens = 0, n_prefill = 0, n_decode = 0, n_steps = 0;
    std::vector<LayerStats> layers;
};

TraceStats compute_stats(const RoutingTrace& trace);

}  // namespace minids::routing
