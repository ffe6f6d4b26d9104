// Synthetic routing traces shaped like a real model's, and fitting their parameters to a
// recorded trace.
//
// The generator picks each token's k experts of MoE layer l one at a time, with
// probability `stickiness[l]`: one of the previous token's experts in this layer (not yet
// picked), with probability `cross_layer[l]`: the partner (a fixed random permutation of the
// experts) of one of this token's experts in the previous MoE layer, otherwise: an expert
// drawn from the layer's popularity, Zipf with exponent `zipf[l]` over a random order of the
// experts (0: uniform). Duplicates are redrawn. Weights are a sorted softmax of k normal
// draws scaled to `weight_sum`.
#pragma once

#include <cstdint>
#include <vector>

#include "routing/prefetch.h"
#include "routing/trace.h"
#include "routing/trace_stats.h"

namespace minids::routing {

struct SynthParams {
    TraceShape shape;
    int64_t n_tokens = 1000;
    uint64_t seed = 1;
    // Per MoE layer, or one value for every layer.
    std::vector<double> zipf = {0.0}, stickiness = {0.0}, cross_layer = {0.0};
    double weight_sum = 1.0;
};

// Shapes of known models: "v2-lite" (64 experts, top-6, MoE layers 1..26, FP8 experts),
// "v2" (160 experts, top-6, MoE layers 1..59), "demo" (models/demo.mds: 32 experts, top-4,
// MoE layers 1..5). Throws std::invalid_argument for another name.
TraceShape preset_shape(const std::string& name);

// Throws std::invalid_argument when a parameter is out of range or a per-layer list has the
// wrong length.
RoutingTrace generate_trace(const SynthParams& p);

// Predictions for a trace (prefetch.h), as a router of known accuracy would make them: every
// real expert of layer l+1+d is kept with probability accuracy[d] and otherwise replaced by a
// random expert of that layer outside its real set and the replacements so far (so the row
// stays distinct and a miss is a real miss); -1 past the last MoE layer. One value A means
// A^(d+1) for d+1 layers ahead. Deterministic for a seed. Throws std::invalid_argument when the
// depth is not in [1, L-1] or an accuracy is outside [0, 1].
Predictions generate_predictions(const RoutingTrace& trace, const std::vector<double>& accuracy,
                                 int32_t depth, uint64_t seed);

struct FitResult {
    SynthParams params;           // per-layer fitted values, the recorded shape and length
    TraceStats target, achieved;  // the recorded trace's statistics and the generated one's
};

// Finds, per layer, the Zipf exponent that matches the recorded entropy of popularity, the
// stickiness that matches the next-token overlap and the cross-layer probability that
// matches the cross-layer statistic: each parameter bisected in turn (`rounds` steps, all
// layers at once) with the others held, three passes, each step generating a trace as long
// as the recorded one (at most `max_tokens`).
FitResult fit_trace(const RoutingTrace& recorded, int rounds = 10, uint64_t seed = 1,
                    int64_t max_tokens = 50000);

}  // namespace minids::routing
