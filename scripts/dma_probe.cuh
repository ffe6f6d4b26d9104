// What the DMA probes (scripts/bench_dma_*_cuda) share: the chain of small memory-bound kernels
// (the decode's shape) that each copy runs beside, its global-timer stamps, and building it into
// a graph. Included by one translation unit per probe.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "cuda_check.h"
#include "expert_copy.cuh"

namespace dma_probe {

constexpr size_t expert_bytes = 8670208;  // one V2-Lite FP8 expert blob
constexpr size_t chain_bytes = size_t(8) << 20;
constexpr int chain_layers = 26, chain_per_layer = 10;

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// The expert fetch's copy loop (kernels/expert_copy.cuh, the same code the fetch runs): block
// `part` of `parts` moves chunks part, part + parts, ... of `bytes`.
constexpr int copy_threads = minids::kernels::expert_copy::threads;
constexpr int copy_blocks = int(minids::kernels::expert_copy::blocks_per_fill);
constexpr size_t copy_chunk = size_t(minids::kernels::expert_copy::chunk);

__device__ inline void copy_chunks(const uint8_t* src, uint8_t* dst, size_t bytes, size_t part,
                                   size_t parts) {
    minids::kernels::expert_copy::copy_part(src, dst, int64_t(bytes), int64_t(part),
                                            int64_t(parts));
}

// Reads n bytes (16 at a time) and writes one sum per block; block 0 thread 0 stamps the time
// at `stamp` (start, when first) and `stamp + 1` (end, when last).
__global__ void reduce_kernel(const uint4* x, size_t n16, float* out, unsigned long long* stamp,
                              int first, int last) {
    if (first && blockIdx.x == 0 && threadIdx.x == 0) stamp[0] = global_ns();
    float acc = 0.f;
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16;
         i += size_t(gridDim.x) * blockDim.x) {
        const uint4 v = x[i];
        acc += __uint_as_float(v.x) + __uint_as_float(v.y) + __uint_as_float(v.z) +
               __uint_as_float(v.w);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out + blockIdx.x, acc);
    if (last) {
        __syncthreads();
        if (threadIdx.x == 0) atomicMax(stamp + 1, global_ns());
    }
}

inline cudaGraphNode_t add_kernel(cudaGraph_t g, const cudaGraphNode_t* deps, size_t n_deps,
                                  void* fn, dim3 grid, dim3 block, void** args) {
    cudaKernelNodeParams p{};
    p.func = fn;
    p.gridDim = grid;
    p.blockDim = block;
    p.kernelParams = args;
    cudaGraphNode_t node;
    CUDA_CHECK(cudaGraphAddKernelNode(&node, g, deps, n_deps, &p));
    return node;
}

// The chain: chain_layers x chain_per_layer launches of reduce_kernel over `chain_x`, one after
// the other, stamping stamps[0] at its start and stamps[1] at its end. After launch i,
// `extra(i, append)` may add kernels of its own to the sequence with
// append(fn, grid, block, args).
template <class Extra>
void add_chain(cudaGraph_t g, const uint8_t* chain_x, float* sums, unsigned long long* stamps,
               Extra extra) {
    cudaGraphNode_t prev{};
    bool have_prev = false;
    auto append = [&](void* fn, dim3 grid, dim3 block, void** args) {
        prev = add_kernel(g, have_prev ? &prev : nullptr, have_prev ? 1 : 0, fn, grid, block, args);
        have_prev = true;
    };
    const size_t n16 = chain_bytes / 16;
    const int total = chain_layers * chain_per_layer;
    const uint4* x = reinterpret_cast<const uint4*>(chain_x);
    for (int i = 0; i < total; ++i) {
        int first = i == 0, last = i == total - 1;
        void* args[] = {&x, const_cast<size_t*>(&n16), &sums, &stamps, &first, &last};
        append(reinterpret_cast<void*>(reduce_kernel), dim3(132), dim3(256), args);
        extra(i, append);
    }
}

}  // namespace dma_probe
