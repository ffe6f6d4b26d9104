// mgl::expert_prompt_stage on the GPU (docs/expert-cache.md, "Prefill"): the experts a prompt
// chunk's layer uses whose table entry is not a slot are copied from host memory into buffers the
// expert cache lends (slots), and the layer's moe_experts reads a copy of the table that points
// at them. The grouped
// prompt kernels read a host blob in place at ~22-29 GB/s, this copy loop (the fetch's) moves it
// at ~50 (docs/perf.md, sixteenth session).
//
// One launch: blocks (part, i) for buffer i. Every block finds the staged experts itself (the
// ids are a few KiB, read from L2), so nothing waits between a plan and the copies; block (0, 0)
// also writes the output table. A block whose buffer gets no expert returns at once.
#include <cuda_runtime_api.h>

#include <string>

#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "expert_copy.cuh"
#include "expert_fetch.h"

namespace minids::kernels {

namespace {

constexpr int max_experts = 1024;

__global__ void __launch_bounds__(expert_copy::threads)
    prompt_stage_kernel(ExpertPromptStageParams p) {
    __shared__ uint32_t used[max_experts / 32];
    __shared__ int32_t rank[max_experts];  // per expert: its buffer, or -1
    __shared__ int32_t warp_counts[expert_copy::threads / 32];
    pdl_enter();
    const int E = p.n_experts;
    for (int i = threadIdx.x; i < max_experts / 32; i += blockDim.x) used[i] = 0;
    __syncthreads();
    for (int64_t i = threadIdx.x; i < p.n_ids; i += blockDim.x) {
        const int32_t e = p.ids[i];
        if (e >= 0 && e < E) atomicOr(&used[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    // Buffers lent for this step (the caller's count, at most the capacity).
    const int64_t asked = p.buffers[0];
    const int64_t lent = asked < 0 ? 0 : asked < p.capacity ? asked : p.capacity;
    const int64_t slots_begin = p.state->slot_base;
    const int64_t slots_end = slots_begin + p.state->n_slots * p.state->slot_stride;
    // Ranks in increasing expert order, blockDim experts at a time (a ballot per warp).
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int32_t base = 0;
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        bool staged = false;
        if (e < E && ((used[e >> 5] >> (e & 31)) & 1u)) {
            const int64_t a = p.table[e];
            staged = a < slots_begin || a >= slots_end;
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, staged);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int32_t before = base;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        if (e < E) {
            const int32_t r = before + __popc(ballot & ((1u << lane) - 1u));
            rank[e] = staged && r < lent ? r : -1;
        }
        for (int w = 0; w < int(blockDim.x >> 5); ++w) base += warp_counts[w];
        __syncthreads();
    }
    const int64_t buffer = blockIdx.y;
    if (blockIdx.x == 0 && blockIdx.y == 0)
        for (int e = threadIdx.x; e < E; e += blockDim.x)
            p.out[e] = rank[e] >= 0 ? p.buffers[1 + rank[e]] : p.table[e];
    if (buffer >= base) return;
    int source = -1;
    for (int e = 0; e < E; ++e)
        if (rank[e] == buffer) source = e;
    if (source < 0) return;
    expert_copy::copy_part(reinterpret_cast<const uint8_t*>(p.table[source]),
                           reinterpret_cast<uint8_t*>(p.buffers[1 + buffer]), p.blob_bytes,
                           blockIdx.x, gridDim.x);
}

}  // namespace

void expert_prompt_stage(const ExpertPromptStageParams& p, cudaStream_t stream) {
    MGL_CHECK(p.n_experts > 0 && p.n_experts <= max_experts,
              "expert_prompt_stage: " + std::to_string(p.n_experts) + " experts (at most " +
                  std::to_string(max_experts) + ")");
    MGL_CHECK(p.capacity > 0 && p.capacity <= 65535,
              "expert_prompt_stage: capacity " + std::to_string(p.capacity));
    const dim3 grid(unsigned(expert_copy::blocks_per_fill), unsigned(p.capacity));
    launch_maybe_dependent(prompt_stage_kernel, grid, dim3(expert_copy::threads), 0, stream, p.pdl,
                           p);
    CUDA_CHECK(cudaGetLastError());
}

}  // namespace minids::kernels
