// The GPU memory plan (issue 10, docs/expert-cache.md): within a budget, the dense weights, the
// KV cache for the context and the work memory (workspaces, arenas, graphs) come first; what is
// left holds expert slots. When every expert fits the model runs fully resident. A plan that
// cannot hold the fixed part plus the fewest slots a step needs is refused with one sentence
// saying the smallest budget that would do, and the largest context that fits this budget.
#pragma once

#include <cstdint>
#include <string>

namespace minids {

struct MemoryPlanInput {
    uint64_t budget = 0;       // bytes of GPU memory the run may use
    uint64_t dense_bytes = 0;  // every weight but the routed experts (merged copies included)
    uint64_t slot_bytes = 0;   // one routed expert in a slot (aligned)
    int64_t n_experts = 0;     // routed experts of all MoE layers
    int64_t min_slots = 1;     // the fewest slots a step needs (top-k, or L x k per layer)
    // What min_slots counts, for the refusal of a smaller --expert-cache-slots.
    std::string min_slots_are = "experts one step reads at once";
    uint64_t kv_bytes_per_token = 0;
    int64_t n_ctx = 0;
    uint64_t work_bytes = 0;    // workspaces, arenas, graphs, cuBLAS
    int64_t forced_slots = -1;  // --expert-cache-slots (-1: as many as fit)
};

struct MemoryPlan {
    bool fits = false;
    bool resident = false;  // every expert in GPU memory (no cache needed)
    int64_t slots = 0;      // expert slots (n_experts when resident)
    uint64_t dense = 0, kv = 0, work = 0, experts = 0;
    uint64_t total() const { return dense + kv + work + experts; }
    std::string refusal;  // why it does not fit (when !fits), one sentence
    // The plan as a small table in MiB, for stderr.
    std::string table(uint64_t budget) const;
};

MemoryPlan plan_memory(const MemoryPlanInput& in);

// "12GiB", "11000MiB", "512M", "1.5G", "3000000000" (bytes): binary units K/M/G/T with or without
// "iB", decimal kB/MB/GB/TB. Throws std::invalid_argument with a sentence for anything else
// (negative, not finite, no number, unknown unit, over 2^60 bytes).
uint64_t parse_byte_size(const std::string& text);

}  // namespace minids
