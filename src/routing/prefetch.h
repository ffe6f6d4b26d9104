// Prefetch in the expert-cache simulator (issue 10, item 5), and a timing model of one decode
// step with it: what streaming the next layers' predicted experts while this layer computes
// would buy, before it is built on the GPU (docs/expert-cache.md, "Prefetch").
//
// Predictions: for every token t and MoE layer l, the experts the routers of layers l+1 … l+D
// choose for layer l's state (record_routing_text --predict, or routing gen --predictions-out),
// a NumPy array <i2 [T, L, D, k]; -1 where l+1+d is past the last MoE layer.
//
// Prefetch at depth D, at token t, once layer l's router has run (host rules of the simulator,
// simulator.h, for the demand accesses):
//  1. demand: layer l's experts are accessed in the trace's order and pinned (a miss loads the
//     expert, evicting the policy's victim, or is read in place when admission refuses it);
//     the experts predicted for layer l by layer l-1 stay pinned meanwhile (released first if
//     the pool has no other victim), so a miss of layer l never evicts a correct prefetch of
//     the same layer;
//  2. prefetch: the predicted experts of layers l+1 … l+D that are resident are pinned, then
//     those absent are loaded without counting a use (same policy object, same admission),
//     skipped when the pool has no unpinned slot; victims are never layer l's experts or the
//     predicted ones;
//  3. the predicted experts of layer l+1 stay pinned until layer l+1's demand is done.
// A prefetched expert is *used* when its layer reads it before it is evicted, *wasted* when it
// is evicted unread (or still unread when the trace ends). Depth 0 is the plain simulator.
//
// Timing (one link, transfers in issue order, never preempted): each model layer takes
// attn_us (attention, router and the dense part) then moe_us (the expert kernels at full
// hit); a dense layer takes both with no fetch. At a MoE layer the router's result is known
// after attn_us, the fetch's plan takes fetch_us, then the layer's misses are issued and the
// expert kernels start when the plan is done and every expert they read has landed. Prefetches
// are issued at the same moment, behind that layer's misses; with demand_first a later layer's
// misses (and a needed expert whose prefetch has not started) go ahead of queued prefetches
// that have not started, otherwise they wait behind them (FIFO).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "routing/simulator.h"

namespace minids::routing {

struct Predictions {
    int64_t n_tokens = 0;
    int32_t n_layers = 0, depth = 0, top_k = 0;
    std::vector<int16_t> ids;  // [T][L][D][k]
    // The k experts predicted at token t from layer l's state for layer l + 1 + d.
    const int16_t* at(int64_t t, int32_t l, int32_t d) const {
        return ids.data() + ((t * n_layers + l) * depth + d) * top_k;
    }
};

// Parses a predictions .npy (<i2 [T, L, D, k]) and checks it against the trace: T, L and k
// equal, D >= 1, every id in [0, E) or -1. Problems are one TraceError sentence naming `name`.
Predictions parse_predictions(std::span<const std::byte> npy, const std::string& name,
                              const RoutingTrace& trace);
Predictions read_predictions(const std::string& path, const RoutingTrace& trace);
std::vector<std::byte> predictions_bytes(const Predictions& p);
void write_predictions(const Predictions& p, const std::string& path);
// The rows of the tokens select_tokens(trace, which) keeps.
Predictions select_predictions(const Predictions& p, const RoutingTrace& trace,
                               const std::string& which);

struct TimingModel {
    // Calibrated against the engine (docs/expert-cache.md, "Prefetch"): 55 GB/s is the pinned
    // copy peak; the device fetch's copy kernel, reading the registered host store, measured
    // 47-49 GB/s end to end.
    double link_gbs = 49;
    double attn_us = 50, moe_us = 26;  // per model layer; 27 x 76 us = H200 resident decode
    double fetch_us = 8;  // per MoE layer, the fetch's plan and copy launches (every-hit gap)
    bool demand_first = true;
};

struct PrefetchResult {
    SimResult sim;  // hits, fills (loaded demand misses), per-layer counts
    int32_t depth = 0;
    TimingModel timing;
    int64_t demand_misses = 0;  // accesses - hits: loaded or read in place, all cross the link
    int64_t prefetches = 0;     // experts loaded by a prefetch
    int64_t prefetch_used = 0, prefetch_wasted = 0;
    int64_t prefetch_transfers = 0;  // prefetches whose transfer started (the rest were evicted
                                     // while queued and cost nothing)
    double time_us = 0;              // modeled decode time of the whole trace
    double busy_us = 0;              // time the link carried transfers
    double stall_us = 0;             // time expert kernels waited for their experts after the plan

    double per_token(double x) const { return sim.n_tokens ? x / double(sim.n_tokens) : 0.0; }
    double ms_per_token() const { return per_token(time_us) / 1000.0; }
    double tok_per_s() const { return time_us > 0 ? 1e6 * double(sim.n_tokens) / time_us : 0.0; }
    double link_bytes_per_token() const {
        return per_token(double(demand_misses + prefetch_transfers) * double(sim.expert_bytes));
    }
    double busy_share() const { return time_us > 0 ? std::min(1.0, busy_us / time_us) : 0.0; }
    // The share of the link's time that compute hid (0 without prefetch: every transfer stalls).
    double hidden_share() const {
        return busy_us > 0 ? std::max(0.0, 1.0 - stall_us / busy_us) : 0.0;  // no -0 from rounding
    }
};

// Simulates one cache configuration with prefetch at `depth` (0: off; then `pred` may be null
// and the counts equal simulate()'s). Belady only at depth 0. Throws std::invalid_argument when
// the depth exceeds the predictions' or the configuration cannot work.
PrefetchResult simulate_prefetch(const RoutingTrace& trace, CacheConfig config,
                                 const Predictions* pred, int32_t depth,
                                 const TimingModel& timing = {},
                                 const std::vector<int32_t>* next = nullptr);

}  // namespace minids::routing
