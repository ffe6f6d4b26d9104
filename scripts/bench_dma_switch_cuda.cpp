// Can the copy engines carry a prefetch that the device decides, inside a CUDA graph, without
// slowing the decode kernels beside it? (docs/expert-cache.md, "Prefetch as built": the copy
// kernel the prefetch uses now measured as costly to them as what it hid.)
//
// One graph per case, replayed: a chain of small memory-bound kernels (the decode's shape: 26 x
// 10 launches of a read-and-reduce over 8 MB, 3-4 us each) and, beside it on a branch of the
// same graph, the transfer of one 8.7 MB expert from pinned host memory into device memory:
//   none    the chain alone;
//   switch  a kernel picks an expert (cudaGraphSetConditional) and a SWITCH conditional node
//           with one body per expert, each a memcpy node from that expert's host copy (the copy
//           engines), copies it;
//   kernel  the fetch's way: a copy kernel (22 blocks x 256 threads, 8 16-byte loads in flight
//           per thread) reading the pinned host memory;
//   memcpy  a plain memcpy node of a fixed expert (the copy engines, no conditional node);
//   alone, memcpy alone   the switch's copy and the plain one without the chain (bandwidth).
// The chain's kernels stamp the device's global timer, so the chain's own time is known apart
// from the copy's. Printed: median over replays of the chain's time and of the whole graph.
//
// Usage: bench_dma_switch_cuda [--experts N] [--reps N]
#include <cstdio>
#include <cstring>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda_check.h"
#include "dma_probe.cuh"

namespace {

using namespace dma_probe;

__global__ void pick_kernel(cudaGraphConditionalHandle h, const unsigned* which) {
    cudaGraphSetConditional(h, *which);
}

__global__ void __launch_bounds__(copy_threads)
    copy_kernel(const uint8_t* const* homes, const unsigned* which, uint8_t* dst, size_t bytes) {
    copy_chunks(homes[*which], dst, bytes, blockIdx.x, gridDim.x);
}

struct Buffers {
    std::vector<uint8_t*> homes;  // pinned host copies of the experts
    uint8_t** homes_dev = nullptr;
    uint8_t* landing = nullptr;  // device: where the copy lands
    uint8_t* chain_x = nullptr;  // device: what the chain reads
    float* sums = nullptr;
    unsigned long long* stamps = nullptr;
    unsigned* which = nullptr;
};

void add_switch_copy(cudaGraph_t g, Buffers& b, int n_experts) {
    cudaGraphConditionalHandle h;
    CUDA_CHECK(cudaGraphConditionalHandleCreate(&h, g, 0, 0));
    void* args[] = {&h, &b.which};
    cudaGraphNode_t pick =
        add_kernel(g, nullptr, 0, reinterpret_cast<void*>(pick_kernel), dim3(1), dim3(1), args);
    cudaGraphNodeParams cp{};
    cp.type = cudaGraphNodeTypeConditional;
    cp.conditional.handle = h;
    cp.conditional.type = cudaGraphCondTypeSwitch;
    cp.conditional.size = unsigned(n_experts);
    cudaGraphNode_t cond;
    CUDA_CHECK(cudaGraphAddNode(&cond, g, &pick, nullptr, 1, &cp));
    for (int e = 0; e < n_experts; ++e) {
        cudaGraphNode_t copy;
        CUDA_CHECK(cudaGraphAddMemcpyNode1D(&copy, cp.conditional.phGraph_out[e], nullptr, 0,
                                            b.landing, b.homes[size_t(e)], expert_bytes,
                                            cudaMemcpyHostToDevice));
    }
}

// A plain memcpy node (a fixed expert): the copy engines without the conditional node.
void add_plain_copy(cudaGraph_t g, Buffers& b) {
    cudaGraphNode_t copy;
    CUDA_CHECK(cudaGraphAddMemcpyNode1D(&copy, g, nullptr, 0, b.landing, b.homes[0], expert_bytes,
                                        cudaMemcpyHostToDevice));
}

void add_kernel_copy(cudaGraph_t g, Buffers& b) {
    size_t bytes = expert_bytes;
    void* args[] = {&b.homes_dev, &b.which, &b.landing, &bytes};
    add_kernel(g, nullptr, 0, reinterpret_cast<void*>(copy_kernel), dim3(copy_blocks),
               dim3(copy_threads), args);
}

struct Result {
    double chain_us = 0, graph_us = 0;
};

Result run(const std::string& mode, Buffers& b, int n_experts, int reps, cudaStream_t s) {
    cudaGraph_t g;
    CUDA_CHECK(cudaGraphCreate(&g, 0));
    const bool alone = mode == "alone" || mode == "memcpy alone";
    if (!alone) add_chain(g, b.chain_x, b.sums, b.stamps, [](int, auto&) {});
    if (mode == "switch" || mode == "alone") add_switch_copy(g, b, n_experts);
    if (mode == "kernel") add_kernel_copy(g, b);
    if (mode == "memcpy" || mode == "memcpy alone") add_plain_copy(g, b);
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> chain, whole;
    for (int r = -3; r < reps; ++r) {
        const unsigned pick = unsigned(r + 3) % unsigned(n_experts);  // a new expert each replay
        CUDA_CHECK(cudaMemcpyAsync(b.which, &pick, sizeof pick, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemsetAsync(b.stamps, 0, 2 * sizeof(unsigned long long), s));
        CUDA_CHECK(cudaEventRecord(e0, s));
        CUDA_CHECK(cudaGraphLaunch(exec, s));
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        unsigned long long st[2];
        CUDA_CHECK(cudaMemcpy(st, b.stamps, sizeof st, cudaMemcpyDeviceToHost));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (r < 0) continue;
        whole.push_back(ms * 1e3);
        if (!alone) chain.push_back(double(st[1] - st[0]) / 1e3);
    }
    auto median = [](std::vector<double> v) {
        if (v.empty()) return 0.0;
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(g));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return {median(chain), median(whole)};
}

}  // namespace

int main(int argc, char** argv) {
    int n_experts = 16, reps = 20;
    for (int i = 1; i + 1 < argc; ++i) {
        if (!std::strcmp(argv[i], "--experts")) n_experts = std::max(1, std::atoi(argv[++i]));
        if (!std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[++i]));
    }
    try {
        Buffers b;
        for (int e = 0; e < n_experts; ++e) {
            void* p = nullptr;
            CUDA_CHECK(cudaHostAlloc(&p, expert_bytes, cudaHostAllocMapped));
            std::memset(p, e + 1, expert_bytes);
            b.homes.push_back(static_cast<uint8_t*>(p));
        }
        // The copy kernel reads the host copies through their device addresses (unified
        // addressing: the same pointers).
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.homes_dev), b.homes.size() * 8));
        CUDA_CHECK(
            cudaMemcpy(b.homes_dev, b.homes.data(), b.homes.size() * 8, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.landing), expert_bytes));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.chain_x), chain_bytes));
        CUDA_CHECK(cudaMemset(b.chain_x, 0, chain_bytes));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.sums), 132 * sizeof(float)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.stamps), 2 * sizeof(unsigned long long)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.which), sizeof(unsigned)));
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        std::printf(
            "bench_dma_switch_cuda: %d experts of %zu bytes in pinned host memory; chain of "
            "%d launches reading %zu MiB each; median of %d replays\n",
            n_experts, expert_bytes, chain_layers * chain_per_layer, chain_bytes >> 20, reps);
        std::printf("| copy beside the chain | chain us | graph us | copy GB/s (alone) |\n");
        std::printf("| --- | ---: | ---: | ---: |\n");
        for (const std::string mode :
             {"none", "switch", "memcpy", "kernel", "alone", "memcpy alone"}) {
            const Result r = run(mode, b, n_experts, reps, s);
            const bool alone = mode == "alone" || mode == "memcpy alone";
            char gbs[32] = "";
            if (alone)
                std::snprintf(gbs, sizeof gbs, "%.1f", double(expert_bytes) / r.graph_us / 1e3);
            std::printf("| %s | %.1f | %.1f | %s |\n", mode.c_str(), r.chain_us, r.graph_us, gbs);
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_dma_switch_cuda: %s\n", e.what());
        return 1;
    }
    return 0;
}

#else
int main() {
    std::printf("bench_dma_switch_cuda: built without CUDA\n");
    return 0;
}
#endif
