// The offline expert-cache simulator: replays a routing trace through the same pools and
// policies the engine uses and counts hits and misses.
//
// Order of accesses: token by token, MoE layer by layer, and within a layer the token's k
// experts in the trace's order. The k experts of one token and layer are pinned together (one
// expert kernel reads them all) and released before the next layer, so a pool needs at least k
// slots. Compulsory (first-use) misses count as misses.
#pragma once

#include <cstdint>
#include <vector>

#include "routing/expert_cache.h"
#include "routing/trace.h"

namespace minids::routing {

struct SimResult {
    CacheConfig config;
    int64_t n_tokens = 0;
    int64_t accesses = 0, hits = 0;
    int64_t fills = 0;  // misses loaded into a slot (all of them unless admission refused some)
    std::vector<int64_t> layer_accesses, layer_hits;  // per MoE layer
    uint64_t expert_bytes = 0;
    bool device_fetch = false;  // simulate_device_fetch: the engine's device fetch
    bool staging = false;       // ... with the staging store's rules

    double hit_rate() const { return accesses ? double(hits) / double(accesses) : 0.0; }
    double layer_hit_rate(size_t l) const {
        return layer_accesses[l] ? double(layer_hits[l]) / double(layer_accesses[l]) : 0.0;
    }
    double misses_per_token() const {
        return n_tokens ? double(accesses - hits) / double(n_tokens) : 0.0;
    }
    double bytes_per_token() const { return misses_per_token() * double(expert_bytes); }
    double fills_per_token() const { return n_tokens ? double(fills) / double(n_tokens) : 0.0; }
};

// For every access (index (t·L + l)·k + j) the index of the next access to the same expert of
// the same layer, or INT32_MAX when there is none. Throws when the trace has 2^31 accesses or more.
std::vector<int32_t> next_uses(const RoutingTrace& trace);

// Simulates one cache configuration (its n_layers and n_experts are taken from the trace).
// `next` is next_uses(trace), needed for belady only (computed when null).
SimResult simulate(const RoutingTrace& trace, CacheConfig config,
                   const std::vector<int32_t>* next = nullptr);

// The engine's device fetch (docs/expert-cache.md): each forward pass of the trace (its `step`;
// with `token_steps` every token, as if the text were decoded token by token) is offered the
// policy's victims before it with their ranks, and every key's rank were it to arrive (free slots
// only for a prompt chunk, T·k >= E). Every layer's distinct experts, in increasing id, hit, or
// take the next offered victim the layer does not read, or the pass's own earlier arrival from
// another layer when that ranks lower (not in a prompt chunk), or are read in place (bypass).
// Hits count the uses of experts in a slot when their layer began. One global pool.
// `staging`: the rules of the staging store (docs/expert-cache.md), where no miss may be read in
// place: every pass, prompt chunks included, is offered L · min(E, T·k) victims (the policy's
// order, repeated when that is more than the slots), and no arrival is re-evicted by rank. Needs
// n_slots >= n_experts (throws std::invalid_argument otherwise, like the engine).
SimResult simulate_device_fetch(const RoutingTrace& trace, CacheConfig config,
                                bool token_steps = false, bool staging = false);

}  // namespace minids::routing
