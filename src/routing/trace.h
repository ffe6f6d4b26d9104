// A routing trace: for every token and MoE layer, the experts the router chose and their
// weights. Recorded by `minids run/chat --record-routing`, made by `minids routing gen`, read
// by `minids routing stats/sim/fit` and `--replay-routing`.
//
// File format (version 1): a NumPy .npz archive (uncompressed zip), so
//     t = numpy.load("trace.npz"); ids = t["ids"]; header = json.loads(bytes(t["header"]))
// works with nothing but numpy. Members:
//   header.npy   |u1 [n]       UTF-8 JSON object:
//                              {"format": "minids-routing-trace", "version": 1,
//                               "n_experts": E, "top_k": k, "expert_bytes": bytes of one routed
//                               expert (gate+up+down, with scales) as the model stores it,
//                               "moe_layers": [model layer index of each MoE layer, ascending],
//                               "n_tokens": T, "source": "...", plus free-form fields such as
//                               "model" or "generator" that readers ignore}
//   ids.npy      |u1, <u2 or <i4 [T, L, k]   expert ids in [0, E), distinct within a [t, l] row,
//                              in the router's order (highest weight first for greedy top-k)
//   weights.npy  <f4 [T, L, k] the routing weights the MoE output was scaled by (finite)
//   prefill.npy  |b1 [T]       true for prompt tokens, false for generated (decoded) ones
//   step.npy     <i4 [T]       index of the forward pass (eval call) the token was part of,
//                              non-decreasing from 0: the batches of a prefill share a step
// L = len(moe_layers). Tokens are in the order they were evaluated; a chat's turns follow each
// other. Other members are ignored, so tools may add their own arrays.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "routing/npz.h"

namespace minids::routing {

struct TraceShape {
    int32_t n_experts = 0;            // routed experts per MoE layer (E)
    int32_t top_k = 0;                // experts per token (k)
    uint64_t expert_bytes = 0;        // bytes of one routed expert as stored
    std::vector<int32_t> moe_layers;  // model layer index of each MoE layer, ascending
    int32_t n_moe_layers() const { return int32_t(moe_layers.size()); }
};

struct RoutingTrace {
    TraceShape shape;
    std::string source;    // what made it: "minids run", "minids routing gen", ...
    nlohmann::json extra;  // free-form header fields kept across read/write (model, generator)
    int64_t n_tokens = 0;
    std::vector<uint16_t> ids;     // [T][L][k]
    std::vector<float> weights;    // [T][L][k]
    std::vector<uint8_t> prefill;  // [T] 0/1
    std::vector<int32_t> step;     // [T]

    int64_t row_size() const { return int64_t(shape.n_moe_layers()) * shape.top_k; }
    const uint16_t* ids_at(int64_t t, int32_t layer) const {
        return ids.data() + t * row_size() + int64_t(layer) * shape.top_k;
    }
    const float* weights_at(int64_t t, int32_t layer) const {
        return weights.data() + t * row_size() + int64_t(layer) * shape.top_k;
    }
    // Appends one forward pass of n tokens with ids/weights laid out [L][n][k] (the engine's
    // per-layer order) and checks them like the reader does.
    void append_step(int64_t n, bool is_prefill, const int32_t* ids_lnk, const float* w_lnk);
};

// Checks the shape (E in [1, 65536], 1 <= k <= E, layers ascending and non-negative).
void validate_shape(const TraceShape& s, const std::string& where);

// Reads and validates a trace; every problem is a TraceError naming the file.
RoutingTrace read_trace(const std::string& path);
RoutingTrace parse_trace(NpzArchive archive);
// Writes the trace (std::runtime_error when the file cannot be written).
void write_trace(const RoutingTrace& trace, const std::string& path);
// The archive image write_trace would write, for tests that corrupt it.
std::vector<std::byte> trace_bytes(const RoutingTrace& trace);

// Keeps only the tokens selected: "all", "prefill" or "decode".
RoutingTrace select_tokens(const RoutingTrace& trace, const std::string& which);

}  // namespace minids::routing
