// How fast can a kernel copy experts from pinned host memory into device memory, against the copy
// engines? The device fetch's copy kernel (kernels/expert_fetch.cu: 16-byte loads by SM threads)
// measured ~47 GB/s inside the decode step where cudaMemcpyAsync reaches 52-55 (docs/perf.md), and
// the copy's time is most of a 12 GiB step. Cases, each over 1 and over 6 V2-Lite FP8 experts
// (8.67 MB each, one pinned host buffer -> one device buffer):
//   dma         cudaMemcpyAsync per expert (the copy engines);
//   dma2        the same, the experts alternating between two streams (two copies in flight, so
//               one's start overlaps the other's end);
//   dmahalf     each expert as two copies of half its bytes, one on each of two streams;
//   dmaall      one cudaMemcpyAsync for all the experts' bytes (the rate without per-copy cost);
//   sm B        the fetch's copy kernel: B blocks per expert x 256 threads, 8 16-byte loads in
//               flight per thread, 128 KiB chunks (B = 22 is the fetch's);
//   tma B C S   the Hopper bulk-copy unit (cp.async.bulk): B blocks per expert, each moving
//               chunks of C KiB host -> shared memory -> device memory through S shared buffers
//               (S - 1 loads in flight per block), issued by one thread.
// Every case is checked: the device buffer must equal the host bytes (a case that cannot read
// host memory reports the mismatch or its error, in a process of its own with --case).
// Printed per case: median over replays of the CUDA-event time and GB/s.
//
// Usage: bench_h2d_copy_cuda [--reps N] [--case NAME]   (NAME: dma, sm22, sm66, tma22_32_4, ...)
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "cuda_check.h"
#include "dma_probe.cuh"

namespace {

using namespace dma_probe;

// The fetch's copy: block (b, j) moves chunks b, b + gridDim.x, ... of expert j.
__global__ void __launch_bounds__(copy_threads) sm_copy(const uint8_t* src, uint8_t* dst) {
    const size_t base = size_t(blockIdx.y) * expert_bytes;
    copy_chunks(src + base, dst + base, expert_bytes, blockIdx.x, gridDim.x);
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Block (b, j): chunks b, b + gridDim.x, ... of expert j, each host -> shared (a bulk load
// completing on its stage's mbarrier) -> device (a bulk store), `stages` buffers of `chunk`
// bytes in dynamic shared memory. Thread 0 issues everything.
__global__ void tma_copy(const uint8_t* src, uint8_t* dst, uint32_t chunk, int stages) {
    extern __shared__ __align__(128) uint8_t buf[];
    __shared__ __align__(8) uint64_t bar[8];
    if (threadIdx.x != 0) return;
    const size_t base = size_t(blockIdx.y) * expert_bytes;
    for (int s = 0; s < stages; ++s)
        asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bar[s])));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    // This block's chunks: k-th at (blockIdx.x + k * gridDim.x) * chunk.
    const size_t stride = size_t(gridDim.x) * chunk;
    const size_t first = size_t(blockIdx.x) * chunk;
    const int n = first >= expert_bytes ? 0 : int((expert_bytes - first + stride - 1) / stride);
    auto bytes_of = [&](int k) {
        const size_t at = first + size_t(k) * stride;
        return uint32_t(expert_bytes - at < chunk ? expert_bytes - at : chunk);
    };
    auto load = [&](int k) {
        const int s = k % stages;
        const uint32_t nb = bytes_of(k);
        asm volatile(
            "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(&bar[s])),
            "r"(nb)
            : "memory");
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
            "[%3];" ::"r"(smem_addr(buf + size_t(s) * chunk)),
            "l"(src + base + first + size_t(k) * stride), "r"(nb), "r"(smem_addr(&bar[s]))
            : "memory");
    };
    for (int k = 0; k < n && k < stages; ++k) load(k);
    for (int k = 0; k < n; ++k) {
        const int s = k % stages;
        const uint32_t parity = uint32_t(k / stages) & 1u;
        uint32_t done = 0;
        while (!done)
            asm volatile(
                "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
                "selp.u32 %0, 1, 0, p; }"
                : "=r"(done)
                : "r"(smem_addr(&bar[s])), "r"(parity)
                : "memory");
        asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(
                         dst + base + first + size_t(k) * stride),
                     "r"(smem_addr(buf + size_t(s) * chunk)), "r"(bytes_of(k))
                     : "memory");
        asm volatile("cp.async.bulk.commit_group;" ::: "memory");
        if (k + stages < n) {
            // The stage is reused: its store must have read it.
            asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
            load(k + stages);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Case {
    std::string name;
    int blocks = 0, chunk_kib = 0, stages = 0;  // sm: blocks; tma: all three
};

Case parse_case(const std::string& s) {
    Case c{s};
    if (s == "dma" || s == "dma2" || s == "dmahalf" || s == "dmaall") return c;
    if (s.rfind("sm", 0) == 0) {
        c.blocks = std::stoi(s.substr(2));
        return c;
    }
    if (s.rfind("tma", 0) == 0 &&
        std::sscanf(s.c_str() + 3, "%d_%d_%d", &c.blocks, &c.chunk_kib, &c.stages) == 3)
        return c;
    throw std::runtime_error("unknown case " + s);
}

void run_case(const Case& c, const uint8_t* host, uint8_t* dev, int n_experts, int reps,
              cudaStream_t stream) {
    const size_t bytes = expert_bytes * size_t(n_experts);
    if (c.stages > 0) {
        const size_t smem = size_t(c.chunk_kib) * 1024 * size_t(c.stages);
        CUDA_CHECK(
            cudaFuncSetAttribute(tma_copy, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
    }
    // Two-stream cases: the second stream joins the first at the start and end of a launch.
    static cudaStream_t second = nullptr;
    static cudaEvent_t fork = nullptr, join = nullptr;
    if (!second) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&second, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&fork, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&join, cudaEventDisableTiming));
    }
    auto launch = [&] {
        if (c.name == "dma2" || c.name == "dmahalf") {
            CUDA_CHECK(cudaEventRecord(fork, stream));
            CUDA_CHECK(cudaStreamWaitEvent(second, fork, 0));
            for (int j = 0; j < n_experts; ++j) {
                const size_t at = size_t(j) * expert_bytes;
                if (c.name == "dma2") {
                    CUDA_CHECK(cudaMemcpyAsync(dev + at, host + at, expert_bytes,
                                               cudaMemcpyHostToDevice, j % 2 ? second : stream));
                } else {
                    const size_t half = (expert_bytes / 2 + 4095) / 4096 * 4096;
                    CUDA_CHECK(
                        cudaMemcpyAsync(dev + at, host + at, half, cudaMemcpyHostToDevice, stream));
                    CUDA_CHECK(cudaMemcpyAsync(dev + at + half, host + at + half,
                                               expert_bytes - half, cudaMemcpyHostToDevice,
                                               second));
                }
            }
            CUDA_CHECK(cudaEventRecord(join, second));
            CUDA_CHECK(cudaStreamWaitEvent(stream, join, 0));
        } else if (c.name == "dmaall") {
            CUDA_CHECK(cudaMemcpyAsync(dev, host, expert_bytes * size_t(n_experts),
                                       cudaMemcpyHostToDevice, stream));
        } else if (c.name == "dma") {
            for (int j = 0; j < n_experts; ++j)
                CUDA_CHECK(cudaMemcpyAsync(dev + size_t(j) * expert_bytes,
                                           host + size_t(j) * expert_bytes, expert_bytes,
                                           cudaMemcpyHostToDevice, stream));
        } else if (c.stages == 0) {
            sm_copy<<<dim3(unsigned(c.blocks), unsigned(n_experts)), copy_threads, 0, stream>>>(
                host, dev);
        } else {
            const uint32_t chunk = uint32_t(c.chunk_kib) * 1024;
            tma_copy<<<dim3(unsigned(c.blocks), unsigned(n_experts)), 32,
                       size_t(chunk) * size_t(c.stages), stream>>>(host, dev, chunk, c.stages);
        }
        CUDA_CHECK(cudaGetLastError());
    };
    CUDA_CHECK(cudaMemsetAsync(dev, 0, bytes, stream));
    launch();
    CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> back(bytes);
    CUDA_CHECK(cudaMemcpy(back.data(), dev, bytes, cudaMemcpyDeviceToHost));
    const bool same = std::memcmp(back.data(), host, bytes) == 0;
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    std::vector<float> ms;
    for (int r = 0; r < reps + 3; ++r) {
        CUDA_CHECK(cudaEventRecord(a, stream));
        launch();
        CUDA_CHECK(cudaEventRecord(b, stream));
        CUDA_CHECK(cudaEventSynchronize(b));
        float t = 0;
        CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
        if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const float med = ms[ms.size() / 2];
    std::printf("%-14s %d expert(s)  %8.1f us  %6.2f GB/s  (min %.1f, max %.1f us)  data %s\n",
                c.name.c_str(), n_experts, med * 1e3, double(bytes) / (med * 1e-3) / 1e9,
                ms.front() * 1e3, ms.back() * 1e3, same ? "ok" : "WRONG");
    CUDA_CHECK(cudaEventDestroy(a));
    CUDA_CHECK(cudaEventDestroy(b));
}

}  // namespace

int main(int argc, char** argv) {
    int reps = 30;
    std::vector<std::string> cases = {"dma",        "dma2",       "dmahalf",    "dmaall",
                                      "sm22",       "sm44",       "sm132",      "tma22_32_4",
                                      "tma22_64_3", "tma44_32_4", "tma66_16_6", "tma132_16_4",
                                      "tma132_32_3"};
    for (int i = 1; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--reps" && i + 1 < argc) {
            reps = std::atoi(argv[++i]);
        } else if (a == "--case" && i + 1 < argc) {
            cases = {argv[++i]};
        } else {
            std::fprintf(stderr, "usage: bench_h2d_copy_cuda [--reps N] [--case NAME]\n");
            return 2;
        }
    }
    try {
        const int most = 6;
        const size_t bytes = expert_bytes * most;
        uint8_t* host = nullptr;
        uint8_t* dev = nullptr;
        CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host), bytes, cudaHostAllocDefault));
        CUDA_CHECK(cudaMalloc(&dev, bytes));
        uint64_t x = 88172645463325252ull;
        for (size_t i = 0; i + 8 <= bytes; i += 8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            std::memcpy(host + i, &x, 8);
        }
        cudaStream_t stream;
        CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        for (const std::string& name : cases)
            for (const int n : {1, most}) run_case(parse_case(name), host, dev, n, reps, stream);
        CUDA_CHECK(cudaStreamDestroy(stream));
        CUDA_CHECK(cudaFree(dev));
        CUDA_CHECK(cudaFreeHost(host));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_h2d_copy_cuda: %s\n", e.what());
        return 1;
    }
    return 0;
}

#else
int main() {
    std::printf("bench_h2d_copy_cuda: built without CUDA\n");
    return 0;
}
#endif
