// The expert fetch's copy loop, shared by the fetch's copy kernel (expert_fetch.cu) and the DMA
// probes (scripts/dma_probe.cuh), so that the probes measure exactly the loads the fetch makes.
// The source is host memory across PCIe, whose latency only many loads in flight hide.
#pragma once

#include <cstdint>

namespace minids::kernels::expert_copy {

constexpr int threads = 256;          // per block: every loop below assumes blockDim.x == threads
constexpr int64_t chunk = 128 << 10;  // bytes a block moves per pass
constexpr int unroll = 8;             // 16-byte loads in flight per thread
// Blocks per fill: a decode step's six fills make one wave over an H200's 132 SMs, each block
// looping over its chunks; plenty of loads in flight for the link, and a step whose experts are
// all in slots pays for few blocks that read the fill count and exit.
constexpr int64_t blocks_per_fill = 22;

// Copies n bytes (16 at a time when both ends allow) with the block's threads.
__device__ inline void copy_bytes(const uint8_t* src, uint8_t* dst, int64_t n) {
    const bool vec =
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    const int64_t n16 = vec ? n / 16 : 0;
    const auto* s4 = reinterpret_cast<const uint4*>(src);
    auto* d4 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < n16; i += int64_t(threads) * unroll) {
        uint4 r[unroll];
#pragma unroll
        for (int u = 0; u < unroll; ++u) {
            const int64_t j = i + int64_t(u) * threads;
            if (j < n16) r[u] = s4[j];
        }
#pragma unroll
        for (int u = 0; u < unroll; ++u) {
            const int64_t j = i + int64_t(u) * threads;
            if (j < n16) d4[j] = r[u];
        }
    }
    for (int64_t i = n16 * 16 + threadIdx.x; i < n; i += threads) dst[i] = src[i];
}

// Block `part` of `parts` moves chunks part, part + parts, ... of `bytes`.
__device__ inline void copy_part(const uint8_t* src, uint8_t* dst, int64_t bytes, int64_t part,
                                 int64_t parts) {
    for (int64_t begin = part * chunk; begin < bytes; begin += parts * chunk)
        copy_bytes(src + begin, dst + begin, bytes - begin < chunk ? bytes - begin : chunk);
}

}  // namespace minids::kernels::expert_copy
