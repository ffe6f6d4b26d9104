// What the expert cache treats as a prompt chunk: a forward pass whose T tokens route T·k ids
// to a layer of E experts with T·k >= E, so each layer uses nearly all of its experts. Such a
// pass is offered free slots only (a fill could only evict what a later layer of the same pass
// reads), never recycles its own arrivals, and copies the misses it leaves home into slots lent
// from a full pool (the prompt stage). The engine's cache (runtime/expert_offload_device.cpp),
// the model's graph (model/deepseek2.cpp) and the simulator (routing/simulator.cpp) must agree
// on it: the engine's hits equal the simulator's only if they do.
#pragma once

#include <cstdint>

namespace minids::routing {

inline bool is_prompt_chunk(int64_t n_tokens, int64_t top_k, int64_t n_experts) {
    return n_tokens * top_k >= n_experts;
}

}  // namespace minids::routing
