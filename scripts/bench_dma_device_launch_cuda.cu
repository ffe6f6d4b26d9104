// Can a kernel in the middle of a CUDA graph start a copy-engine transfer of an expert it chose,
// through device graph launch, without slowing the decode kernels beside it? (Follows
// bench_dma_switch_cuda: a SWITCH conditional node with memcpy bodies stalled the chain for the
// copy's whole duration; a plain memcpy node beside the chain cost it nothing.)
//
// Per expert e, a device graph (instantiated with cudaGraphInstantiateFlagDeviceLaunch and
// uploaded): a memcpy node from e's pinned host copy into one fixed device landing buffer, then a
// tiny kernel node that stamps the global timer and release-stores the replay's epoch into a
// ready flag. The main graph (a host graph) is the chain of bench_dma_switch_cuda (26 x 10
// launches of a read-and-reduce over 8 MB), with a picker kernel after the chain's first layer
// that reads the expert index from device memory and calls cudaGraphLaunch(exec[index],
// cudaStreamGraphFireAndForget), and a waiter kernel K layers later that spins (ld.acquire) on the
// ready flag. Cases:
//   none                        the chain alone;
//   picker, no launch           picker and waiter kernels in place, launching and waiting for
//                               nothing: their own cost to the chain;
//   device launch               picker launches, waiter K layers later (--wait-layers): what the
//                               launch and the copy cost the chain;
//   device launch, waiter right after   the waiter directly after the picker: the chain stalls
//                               for the copy, so its latency is seen alone.
// Columns (medians over --reps replays; stamps from the device's global timer): chain us (first
// chain kernel's start to the last one's end), graph us (cudaEvents around the launch), launch us
// (the device-side cudaGraphLaunch call), copy done us (picker's launch to the ready kernel
// running: launch + copy + that kernel's start), flag seen us (picker's launch to the waiter
// seeing the flag), stall us (waiter's start to seeing the flag: what the chain stood still),
// GB/s (expert bytes over copy done).
// Before each replay, outside the timed part, the host writes the expert index (replay r copies
// expert r % experts) and a new epoch, and zeroes the ready flag and the landing buffer; after it,
// a few words of the landing buffer are compared with the chosen expert's bytes.
//
// Restrictions relied on (cuda_runtime_api.h, cudaGraphInstantiate; CUDA Programming Guide,
// "Device Graph Launch"):
//   - a device graph "can only contain kernel nodes, memcpy nodes, memset nodes, and child graph
//     nodes"; its memcpy nodes: "Only copies involving device memory and/or pinned device-mapped
//     host memory are permitted" (hence cudaHostAllocMapped); its kernels may not use dynamic
//     parallelism (the ready kernel launches nothing);
//   - "Device graphs must be launched from another graph when launched from the device", into the
//     named streams only (cudaStreamGraphFireAndForget here); the launching graph may be a host
//     graph (the guide's own example instantiates it without flags);
//   - "A graph can have up to 120 total fire-and-forget graphs during the course of its execution.
//     This total resets between launches of the same parent graph." (one per replay here);
//   - "launching a device graph from the device while a previous launch of the graph is running
//     will result in an error, returning cudaErrorInvalidValue": a host-launched graph completes
//     only when its fire-and-forget children have, and replays are synchronized;
//   - which engine performs a device graph's memcpy node is not documented: the chain's cost and
//     the GB/s tell.
// Device-side launch needs relocatable device code and the device runtime (CMakeLists.txt builds
// this target alone with CUDA_SEPARABLE_COMPILATION and libcudadevrt).
//
// Usage: bench_dma_device_launch_cuda [--experts N] [--reps N] [--wait-layers K]
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "dma_probe.cuh"

namespace {

using namespace dma_probe;

constexpr unsigned long long spin_timeout_ns = 50'000'000;  // the waiter gives up after 50 ms

// Global-timer stamps (unsigned long long, zeroed before each replay).
enum Stamp { t_chain0, t_chain1, t_launch0, t_launch1, t_ready, t_wait0, t_seen, n_stamps };
// Device-side failures (int, zeroed before each replay): the picker's cudaGraphLaunch result and
// whether the waiter timed out.
enum Err { launch_err, wait_timeout, n_errs };

struct Control {
    unsigned which;  // the expert to copy
    unsigned epoch;  // what the ready kernel writes to the flag this replay (never 0)
};

__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// In the main graph (one thread): launches the chosen expert's device graph.
__global__ void pick_kernel(const cudaGraphExec_t* execs, const Control* ctl, int launch,
                            unsigned long long* stamps, int* errs) {
    if (!launch) return;
    const cudaGraphExec_t g = execs[ctl->which];
    stamps[t_launch0] = global_ns();
    const cudaError_t err = cudaGraphLaunch(g, cudaStreamGraphFireAndForget);
    stamps[t_launch1] = global_ns();
    if (err != cudaSuccess) errs[launch_err] = int(err);
}

// In each expert's device graph, after its memcpy node: the copy has landed.
__global__ void ready_kernel(const Control* ctl, unsigned* flag, unsigned long long* stamps) {
    stamps[t_ready] = global_ns();
    store_release(flag, ctl->epoch);
}

// In the main graph (one thread): spins until the flag holds this replay's epoch.
__global__ void wait_kernel(const Control* ctl, const unsigned* flag, int wait,
                            unsigned long long* stamps, int* errs) {
    if (!wait) return;
    const unsigned want = ctl->epoch;
    const uint64_t t0 = global_ns();
    stamps[t_wait0] = t0;
    while (load_acquire(flag) != want) {
        if (*static_cast<volatile int*>(errs + launch_err) != 0) return;  // nothing will come
        if (global_ns() - t0 > spin_timeout_ns) {
            errs[wait_timeout] = 1;
            return;
        }
    }
    stamps[t_seen] = global_ns();
}

struct Buffers {
    std::vector<uint8_t*> homes;  // pinned, mapped host copies of the experts
    std::vector<cudaGraphExec_t> execs;
    cudaGraphExec_t* execs_dev = nullptr;
    uint8_t* landing = nullptr;  // device: where the copy lands
    uint8_t* chain_x = nullptr;  // device: what the chain reads
    float* sums = nullptr;
    unsigned long long* stamps = nullptr;
    int* errs = nullptr;
    Control* ctl = nullptr;
    unsigned* flag = nullptr;
};

// Expert e's device graph: memcpy (host copy -> landing), then the ready kernel.
cudaGraphExec_t make_expert_graph(Buffers& b, int e, cudaStream_t s) {
    cudaGraph_t g;
    CUDA_CHECK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t copy;
    CUDA_CHECK(cudaGraphAddMemcpyNode1D(&copy, g, nullptr, 0, b.landing, b.homes[size_t(e)],
                                        expert_bytes, cudaMemcpyHostToDevice));
    void* args[] = {&b.ctl, &b.flag, &b.stamps};
    add_kernel(g, &copy, 1, reinterpret_cast<void*>(ready_kernel), dim3(1), dim3(1), args);
    cudaGraphInstantiateParams ip{};
    ip.flags = cudaGraphInstantiateFlagDeviceLaunch;
    cudaGraphExec_t exec;
    const cudaError_t err = cudaGraphInstantiateWithParams(&exec, g, &ip);
    if (err != cudaSuccess || ip.result_out != cudaGraphInstantiateSuccess) {
        ::mgl::fail(__FILE__, __LINE__,
                    "instantiating expert " + std::to_string(e) +
                        "'s graph for device launch: " + cudaGetErrorString(err) +
                        ", cudaGraphInstantiateResult " + std::to_string(int(ip.result_out)) +
                        " (3: a node not allowed in a device graph, 4: nodes on several devices)");
    }
    CUDA_CHECK(cudaGraphUpload(exec, s));
    CUDA_CHECK(cudaGraphDestroy(g));
    return exec;
}

// The chain, with the picker after its first layer and the waiter `wait_layers` layers after
// the picker (0: directly after it) when `with_picker`.
void add_chain(cudaGraph_t g, Buffers& b, bool with_picker, int launch, int wait_layers) {
    void* pick_args[] = {&b.execs_dev, &b.ctl, &launch, &b.stamps, &b.errs};
    void* wait_args[] = {&b.ctl, &b.flag, &launch, &b.stamps, &b.errs};
    const int pick_after = chain_per_layer - 1;
    const int wait_after = (1 + wait_layers) * chain_per_layer - 1;
    dma_probe::add_chain(g, b.chain_x, b.sums, b.stamps, [&](int i, auto& append) {
        if (with_picker && i == pick_after)
            append(reinterpret_cast<void*>(pick_kernel), dim3(1), dim3(1), pick_args);
        if (with_picker && i == wait_after)
            append(reinterpret_cast<void*>(wait_kernel), dim3(1), dim3(1), wait_args);
    });
}

// The printed columns, in order (us): chain, graph, launch, copy done, flag seen, stall.
constexpr int n_cols = 6;
struct Result {
    double us[n_cols] = {};
    std::string error;  // a device-side failure or a wrong landing buffer, when not empty
};

Result run(bool with_picker, bool launch, int wait_layers, Buffers& b, int n_experts, int reps,
           unsigned& epoch, cudaStream_t s) {
    cudaGraph_t g;
    CUDA_CHECK(cudaGraphCreate(&g, 0));
    add_chain(g, b, with_picker, launch ? 1 : 0, wait_layers);
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));  // a host graph: it launches device graphs
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<double> samples[n_cols];
    Result res;
    for (int r = -3; r < reps && res.error.empty(); ++r) {
        const Control c{unsigned(r + 3) % unsigned(n_experts), ++epoch};  // next expert
        CUDA_CHECK(cudaMemcpyAsync(b.ctl, &c, sizeof c, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemsetAsync(b.stamps, 0, n_stamps * sizeof(unsigned long long), s));
        CUDA_CHECK(cudaMemsetAsync(b.errs, 0, n_errs * sizeof(int), s));
        CUDA_CHECK(cudaMemsetAsync(b.flag, 0, sizeof(unsigned), s));
        if (launch) CUDA_CHECK(cudaMemsetAsync(b.landing, 0, expert_bytes, s));
        CUDA_CHECK(cudaEventRecord(e0, s));
        CUDA_CHECK(cudaGraphLaunch(exec, s));
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        unsigned long long st[n_stamps];
        int errs[n_errs];
        CUDA_CHECK(cudaMemcpy(st, b.stamps, sizeof st, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(errs, b.errs, sizeof errs, cudaMemcpyDeviceToHost));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        char msg[160] = "";
        if (errs[launch_err] != 0) {
            std::snprintf(msg, sizeof msg, "device cudaGraphLaunch failed: %d %s (%s)",
                          errs[launch_err], cudaGetErrorName(cudaError_t(errs[launch_err])),
                          cudaGetErrorString(cudaError_t(errs[launch_err])));
        } else if (errs[wait_timeout] != 0) {
            std::snprintf(msg, sizeof msg, "waiter saw no ready flag within %llu ms",
                          spin_timeout_ns / 1000000);
        } else if (launch) {
            // The landing buffer must hold the chosen expert (every byte of expert e is e + 1).
            const size_t at[] = {0, expert_bytes / 2, expert_bytes - 16};
            for (const size_t off : at) {
                uint8_t got[16];
                CUDA_CHECK(cudaMemcpy(got, b.landing + off, sizeof got, cudaMemcpyDeviceToHost));
                for (const uint8_t v : got)
                    if (v != uint8_t(c.which + 1) && msg[0] == 0)
                        std::snprintf(msg, sizeof msg,
                                      "landing byte at %zu is %u, expert %u's bytes are %u", off,
                                      unsigned(v), c.which, unsigned(uint8_t(c.which + 1)));
            }
        }
        res.error = msg;
        if (r < 0) continue;
        const double us[n_cols] = {
            double(st[t_chain1] - st[t_chain0]) / 1e3,   ms * 1e3,
            double(st[t_launch1] - st[t_launch0]) / 1e3, double(st[t_ready] - st[t_launch0]) / 1e3,
            double(st[t_seen] - st[t_launch0]) / 1e3,    double(st[t_seen] - st[t_wait0]) / 1e3};
        for (int k = 0; k < n_cols; ++k) samples[k].push_back(us[k]);
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
    for (int k = 0; k < n_cols; ++k) res.us[k] = median(samples[k]);
    return res;
}

}  // namespace

int main(int argc, char** argv) {
    int n_experts = 16, reps = 20, wait_layers = 4;
    for (int i = 1; i + 1 < argc; ++i) {
        if (!std::strcmp(argv[i], "--experts")) n_experts = std::max(1, std::atoi(argv[++i]));
        if (!std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[++i]));
        if (!std::strcmp(argv[i], "--wait-layers"))
            wait_layers = std::clamp(std::atoi(argv[++i]), 0, chain_layers - 2);
    }
    n_experts = std::min(n_experts, 255);  // expert e is filled with the byte e + 1
    try {
        Buffers b;
        for (int e = 0; e < n_experts; ++e) {
            void* p = nullptr;
            CUDA_CHECK(cudaHostAlloc(&p, expert_bytes, cudaHostAllocMapped));
            std::memset(p, e + 1, expert_bytes);
            b.homes.push_back(static_cast<uint8_t*>(p));
        }
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.landing), expert_bytes));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.chain_x), chain_bytes));
        CUDA_CHECK(cudaMemset(b.chain_x, 0, chain_bytes));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.sums), 132 * sizeof(float)));
        CUDA_CHECK(
            cudaMalloc(reinterpret_cast<void**>(&b.stamps), n_stamps * sizeof(unsigned long long)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.errs), n_errs * sizeof(int)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.ctl), sizeof(Control)));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.flag), sizeof(unsigned)));
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        for (int e = 0; e < n_experts; ++e) b.execs.push_back(make_expert_graph(b, e, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b.execs_dev),
                              b.execs.size() * sizeof(cudaGraphExec_t)));
        CUDA_CHECK(cudaMemcpy(b.execs_dev, b.execs.data(), b.execs.size() * sizeof(cudaGraphExec_t),
                              cudaMemcpyHostToDevice));
        std::printf(
            "bench_dma_device_launch_cuda: %d experts of %zu bytes in pinned host memory, one "
            "device graph each; chain of %d launches reading %zu MiB each; waiter %d layers "
            "after the picker; median of %d replays\n",
            n_experts, expert_bytes, chain_layers * chain_per_layer, chain_bytes >> 20, wait_layers,
            reps);
        std::printf(
            "| case | chain us | graph us | launch us | copy done us | flag seen us | stall us "
            "| copy GB/s |\n");
        std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        struct Case {
            std::string name;
            bool with_picker, launch;
            int wait_layers;
        };
        const Case cases[] = {
            {"none", false, false, 0},
            {"picker, no launch", true, false, wait_layers},
            {"device launch, waiter " + std::to_string(wait_layers) + " layers later", true, true,
             wait_layers},
            {"device launch, waiter right after", true, true, 0},
        };
        unsigned epoch = 0;
        for (const Case& c : cases) {
            const Result r =
                run(c.with_picker, c.launch, c.wait_layers, b, n_experts, reps, epoch, s);
            if (!r.error.empty()) {
                std::printf("| %s | failed: %s | | | | | | |\n", c.name.c_str(), r.error.c_str());
                continue;
            }
            std::printf("| %s | %.1f | %.1f |", c.name.c_str(), r.us[0], r.us[1]);
            if (c.launch)
                std::printf(" %.1f | %.1f | %.1f | %.1f | %.1f |\n", r.us[2], r.us[3], r.us[4],
                            r.us[5], double(expert_bytes) / r.us[3] / 1e3);
            else
                std::printf(" | | | | |\n");
        }
        for (const cudaGraphExec_t e : b.execs) CUDA_CHECK(cudaGraphExecDestroy(e));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_dma_device_launch_cuda: %s\n", e.what());
        return 1;
    }
    return 0;
}
