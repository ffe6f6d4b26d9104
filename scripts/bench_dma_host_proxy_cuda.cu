// Can a kernel choose an expert and have the copy engines fetch it without slowing the decode
// kernels beside it, if a HOST thread issues the copy? (Follows bench_dma_switch_cuda and
// bench_dma_device_launch_cuda: a plain host-built memcpy node beside the chain cost it ~3 us,
// but both device-side ways of issuing a device-chosen copy, a SWITCH conditional node and a
// device-launched graph, stalled the chain for about the copy's whole duration.)
//
// The main graph is the chain of bench_dma_switch_cuda (26 x 10 launches of a read-and-reduce
// over 8 MB), with a picker kernel after the chain's first layer and a waiter kernel K layers
// later (--wait-layers). The picker posts a request {expert index, epoch} into a small ring in
// pinned, device-mapped host memory (volatile stores, __threadfence_system(), then the slot's
// sequence number) and stamps the global timer. A host proxy thread (started before a case's
// replays, stopped after) busy-polls the ring and, for each request, issues on its own
// non-blocking stream: cudaMemcpyAsync of that expert's pinned host copy into a device landing
// buffer, then a write of the epoch into a ready flag in device memory: the driver's stream memory
// operation cuStreamWriteValue32 (it fences before the write), or with --flag kernel (or when the
// memory operation is refused) a 1-thread kernel that stores it. The waiter spins (ld.acquire.sys)
// on the flag and stamps the time it sees the epoch; it gives up after 50 ms (a failure). Cases:
//   none                      the chain alone (no proxy thread);
//   picker, no request        picker and waiter in place, the proxy thread polling, nothing
//                             requested: their own cost to the chain (the control);
//   host proxy, waiter K layers later   what the request and the copy cost the chain;
//   host proxy, waiter right after      the waiter directly after the picker: the chain stalls
//                             for the whole round trip, so its latency is seen alone.
// Columns (medians over --reps replays): chain us (first chain kernel's start to the last one's
// end, global timer), graph us (cudaEvents around the launch), issue us (host steady_clock, from
// the proxy seeing the request to the copy and the flag write being issued; includes two
// cudaEventRecord calls), copy us (cudaEvents on the proxy's stream around the memcpy: the copy
// engines' time), flag seen us (picker's stamp to the waiter seeing the flag: poll + issue + copy +
// flag), stall us (waiter's start to seeing the flag: what the chain stood still), copy GB/s
// (expert bytes over flag seen).
// Before each replay, outside the timed part, the host writes the expert index (replay r copies
// expert r % experts) and a new epoch, and zeroes the ready flag and the landing buffer; after it,
// the proxy's stream is synchronized and a few words of the landing buffer are compared with the
// chosen expert's bytes. Each case starts with an empty ring and a fresh proxy thread.
//
// Usage: bench_dma_host_proxy_cuda [--experts N] [--reps N] [--wait-layers K] [--flag memop|kernel]
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "cuda_check.h"
#include "dma_probe.cuh"

namespace {

using namespace dma_probe;

constexpr unsigned long long spin_timeout_ns = 50'000'000;  // the waiter gives up after 50 ms
constexpr unsigned ring_slots = 16;

// Global-timer stamps (unsigned long long, zeroed before each replay).
enum Stamp { t_chain0, t_chain1, t_pick, t_wait0, t_seen, n_stamps };

struct Control {
    unsigned which;  // the expert to copy
    unsigned epoch;  // what the proxy writes to the flag this replay (never 0)
};

// One ring slot, in mapped host memory: `seq` (request n + 1) is written last.
struct alignas(16) Request {
    unsigned seq, which, epoch, pad;
};

__device__ __forceinline__ unsigned load_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// In the main graph (one thread): posts request number *count into the ring.
__global__ void pick_kernel(Request* ring, unsigned* count, const Control* ctl, int request,
                            unsigned long long* stamps) {
    if (!request) return;
    const unsigned n = *count;
    *count = n + 1;
    volatile Request* q = ring + n % ring_slots;
    q->which = ctl->which;
    q->epoch = ctl->epoch;
    __threadfence_system();
    q->seq = n + 1;
    __threadfence_system();
    stamps[t_pick] = global_ns();
}

// On the proxy's stream after the memcpy (--flag kernel): the copy has landed.
__global__ void flag_kernel(unsigned* flag, unsigned epoch) {
    __threadfence_system();
    *static_cast<volatile unsigned*>(flag) = epoch;
    __threadfence_system();
}

// In the main graph (one thread): spins until the flag holds this replay's epoch.
__global__ void wait_kernel(const Control* ctl, const unsigned* flag, int wait,
                            unsigned long long* stamps, int* timed_out) {
    if (!wait) return;
    const unsigned want = ctl->epoch;
    const uint64_t t0 = global_ns();
    stamps[t_wait0] = t0;
    while (load_acquire_sys(flag) != want) {
        if (global_ns() - t0 > spin_timeout_ns) {
            *timed_out = 1;
            return;
        }
    }
    stamps[t_seen] = global_ns();
}

struct Buffers {
    std::vector<uint8_t*> homes;  // pinned host copies of the experts
    uint8_t* landing = nullptr;   // device: where the copy lands
    uint8_t* chain_x = nullptr;   // device: what the chain reads
    float* sums = nullptr;
    unsigned long long* stamps = nullptr;
    int* timed_out = nullptr;
    Control* ctl = nullptr;
    unsigned* flag = nullptr;      // device: the ready flag
    unsigned* count = nullptr;     // device: requests posted so far (the picker's ring head)
    Request* ring_host = nullptr;  // pinned, mapped: the request ring, as the host sees it
    Request* ring_dev = nullptr;   // the same, as the device sees it
};

// The host proxy: one thread polling the ring, one stream for its copies.
struct Proxy {
    const Buffers& b;
    int device, n_experts;
    bool memop;
    cudaStream_t ps = nullptr;
    cudaEvent_t c0 = nullptr, c1 = nullptr;  // around the last memcpy
    std::atomic<bool> stop{false}, failed{false};
    std::atomic<unsigned> served{0};  // requests issued; released after the fields below
    double issue_us = 0;              // the last request's seen-to-issued time
    std::string error{};              // set before `failed`

    void loop() {
        try {
            CUDA_CHECK(cudaSetDevice(device));
            for (unsigned head = 0; !stop.load(std::memory_order_relaxed);) {
                Request& q = b.ring_host[head % ring_slots];
                if (std::atomic_ref<unsigned>(q.seq).load(std::memory_order_acquire) != head + 1)
                    continue;
                const auto t0 = std::chrono::steady_clock::now();
                const unsigned which =
                    std::atomic_ref<unsigned>(q.which).load(std::memory_order_relaxed);
                const unsigned epoch =
                    std::atomic_ref<unsigned>(q.epoch).load(std::memory_order_relaxed);
                if (which >= unsigned(n_experts))
                    throw std::runtime_error("request for expert " + std::to_string(which));
                CUDA_CHECK(cudaEventRecord(c0, ps));
                CUDA_CHECK(cudaMemcpyAsync(b.landing, b.homes[which], expert_bytes,
                                           cudaMemcpyHostToDevice, ps));
                CUDA_CHECK(cudaEventRecord(c1, ps));
                if (memop) {
                    const CUresult r = cuStreamWriteValue32(ps, CUdeviceptr(b.flag), epoch,
                                                            CU_STREAM_WRITE_VALUE_DEFAULT);
                    if (r != CUDA_SUCCESS)
                        throw std::runtime_error("cuStreamWriteValue32: CUresult " +
                                                 std::to_string(int(r)));
                } else {
                    flag_kernel<<<1, 1, 0, ps>>>(b.flag, epoch);
                    CUDA_CHECK(cudaGetLastError());
                }
                issue_us =
                    std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                        .count();
                served.store(++head, std::memory_order_release);
            }
        } catch (const std::exception& e) {
            error = e.what();
            failed.store(true, std::memory_order_release);
        }
    }
};

// The chain, with the picker after its first layer and the waiter `wait_layers` layers after
// the picker (0: directly after it) when `with_picker`.
void add_chain(cudaGraph_t g, Buffers& b, bool with_picker, int request, int wait_layers) {
    void* pick_args[] = {&b.ring_dev, &b.count, &b.ctl, &request, &b.stamps};
    void* wait_args[] = {&b.ctl, &b.flag, &request, &b.stamps, &b.timed_out};
    const int pick_after = chain_per_layer - 1;
    const int wait_after = (1 + wait_layers) * chain_per_layer - 1;
    dma_probe::add_chain(g, b.chain_x, b.sums, b.stamps, [&](int i, auto& append) {
        if (with_picker && i == pick_after)
            append(reinterpret_cast<void*>(pick_kernel), dim3(1), dim3(1), pick_args);
        if (with_picker && i == wait_after)
            append(reinterpret_cast<void*>(wait_kernel), dim3(1), dim3(1), wait_args);
    });
}

// The printed columns, in order (us): chain, graph, issue, copy, flag seen, stall.
constexpr int n_cols = 6;
struct Result {
    double us[n_cols] = {};
    std::string error;  // a failure (waiter timeout, proxy error, wrong landing), when not empty
};

Result run(bool with_picker, bool request, int wait_layers, Buffers& b, int n_experts, int reps,
           bool memop, unsigned& epoch, cudaStream_t s) {
    cudaGraph_t g;
    CUDA_CHECK(cudaGraphCreate(&g, 0));
    add_chain(g, b, with_picker, request ? 1 : 0, wait_layers);
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, g, 0));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    int device = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    Proxy proxy{b, device, n_experts, memop};
    CUDA_CHECK(cudaStreamCreateWithFlags(&proxy.ps, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&proxy.c0));
    CUDA_CHECK(cudaEventCreate(&proxy.c1));
    // An empty ring: nothing in flight here (every stream was synchronized).
    std::memset(b.ring_host, 0, ring_slots * sizeof(Request));
    CUDA_CHECK(cudaMemset(b.count, 0, sizeof(unsigned)));
    std::thread proxy_thread;
    if (with_picker) proxy_thread = std::thread([&proxy] { proxy.loop(); });
    struct Stopper {  // stops the proxy however this function is left
        Proxy& p;
        std::thread& t;
        void now() {
            p.stop.store(true, std::memory_order_relaxed);
            if (t.joinable()) t.join();
        }
        ~Stopper() { now(); }
    } stopper{proxy, proxy_thread};
    std::vector<double> samples[n_cols];
    Result res;
    unsigned requests = 0;
    for (int r = -3; r < reps && res.error.empty(); ++r) {
        const Control c{unsigned(r + 3) % unsigned(n_experts), ++epoch};  // next expert
        CUDA_CHECK(cudaMemcpyAsync(b.ctl, &c, sizeof c, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemsetAsync(b.stamps, 0, n_stamps * sizeof(unsigned long long), s));
        CUDA_CHECK(cudaMemsetAsync(b.timed_out, 0, sizeof(int), s));
        CUDA_CHECK(cudaMemsetAsync(b.flag, 0, sizeof(unsigned), s));
        if (request) CUDA_CHECK(cudaMemsetAsync(b.landing, 0, expert_bytes, s));
        CUDA_CHECK(cudaEventRecord(e0, s));
        CUDA_CHECK(cudaGraphLaunch(exec, s));
        CUDA_CHECK(cudaEventRecord(e1, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        std::string msg;
        float copy_ms = 0;
        if (request) {  // the proxy must have issued this replay's copy: wait (1 s at most)
            ++requests;
            const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
            while (proxy.served.load(std::memory_order_acquire) < requests &&
                   !proxy.failed.load(std::memory_order_acquire) &&
                   std::chrono::steady_clock::now() < deadline)
                std::this_thread::yield();
            if (proxy.failed.load(std::memory_order_acquire))
                msg = "proxy: " + proxy.error;
            else if (proxy.served.load(std::memory_order_acquire) < requests)
                msg = "the proxy saw no request within 1 s";
            CUDA_CHECK(cudaStreamSynchronize(proxy.ps));
            if (msg.empty()) CUDA_CHECK(cudaEventElapsedTime(&copy_ms, proxy.c0, proxy.c1));
        }
        unsigned long long st[n_stamps];
        int timed_out = 0;
        CUDA_CHECK(cudaMemcpy(st, b.stamps, sizeof st, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(&timed_out, b.timed_out, sizeof timed_out, cudaMemcpyDeviceToHost));
        float ms = 0;
        CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (timed_out && msg.empty())
            msg = "waiter saw no ready flag within " + std::to_string(spin_timeout_ns / 1000000) +
                  " ms";
        if (request && msg.empty()) {
            // The landing buffer must hold the chosen expert (every byte of expert e is e + 1).
            const size_t at[] = {0, expert_bytes / 2, expert_bytes - 16};
            for (const size_t off : at) {
                uint8_t got[16];
                CUDA_CHECK(cudaMemcpy(got, b.landing + off, sizeof got, cudaMemcpyDeviceToHost));
                for (const uint8_t v : got)
                    if (v != uint8_t(c.which + 1) && msg.empty())
                        msg = "landing byte at " + std::to_string(off) + " is " +
                              std::to_string(v) + ", expert " + std::to_string(c.which) +
                              "'s bytes are " + std::to_string(uint8_t(c.which + 1));
            }
        }
        res.error = msg;
        if (r < 0) continue;
        const double us[n_cols] = {double(st[t_chain1] - st[t_chain0]) / 1e3,
                                   ms * 1e3,
                                   request ? proxy.issue_us : 0.0,
                                   copy_ms * 1e3,
                                   double(st[t_seen] - st[t_pick]) / 1e3,
                                   double(st[t_seen] - st[t_wait0]) / 1e3};
        for (int k = 0; k < n_cols; ++k) samples[k].push_back(us[k]);
    }
    stopper.now();
    CUDA_CHECK(cudaStreamSynchronize(proxy.ps));
    auto median = [](std::vector<double> v) {
        if (v.empty()) return 0.0;
        std::sort(v.begin(), v.end());
        return v[v.size() / 2];
    };
    CUDA_CHECK(cudaEventDestroy(proxy.c0));
    CUDA_CHECK(cudaEventDestroy(proxy.c1));
    CUDA_CHECK(cudaStreamDestroy(proxy.ps));
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
    bool memop = true;
    for (int i = 1; i + 1 < argc; ++i) {
        if (!std::strcmp(argv[i], "--experts")) n_experts = std::max(1, std::atoi(argv[++i]));
        if (!std::strcmp(argv[i], "--reps")) reps = std::max(1, std::atoi(argv[++i]));
        if (!std::strcmp(argv[i], "--wait-layers"))
            wait_layers = std::clamp(std::atoi(argv[++i]), 0, chain_layers - 2);
        if (!std::strcmp(argv[i], "--flag")) memop = std::strcmp(argv[++i], "kernel") != 0;
    }
    n_experts = std::min(n_experts, 255);  // expert e is filled with the byte e + 1
    try {
        Buffers b;
        for (int e = 0; e < n_experts; ++e) {
            void* p = nullptr;
            CUDA_CHECK(cudaHostAlloc(&p, expert_bytes, cudaHostAllocDefault));
            std::memset(p, e + 1, expert_bytes);
            b.homes.push_back(static_cast<uint8_t*>(p));
        }
        void* ring = nullptr;
        CUDA_CHECK(cudaHostAlloc(&ring, ring_slots * sizeof(Request), cudaHostAllocMapped));
        b.ring_host = static_cast<Request*>(ring);
        CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&b.ring_dev), ring, 0));
        auto dev_alloc = [](auto** p, size_t bytes) {
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(p), bytes));
            CUDA_CHECK(cudaMemset(*p, 0, bytes));
        };
        dev_alloc(&b.landing, expert_bytes);
        dev_alloc(&b.chain_x, chain_bytes);
        dev_alloc(&b.sums, 132 * sizeof(float));
        dev_alloc(&b.stamps, n_stamps * sizeof(unsigned long long));
        dev_alloc(&b.timed_out, sizeof(int));
        dev_alloc(&b.ctl, sizeof(Control));
        dev_alloc(&b.flag, sizeof(unsigned));
        dev_alloc(&b.count, sizeof(unsigned));
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
        // Is the stream memory operation available? One write of 0 to the flag tells.
        const char* flag_how = "1-thread kernel";
        if (memop) {
            const CUresult r = cuStreamWriteValue32(s, CUdeviceptr(b.flag), 0, 0);
            if (r == CUDA_SUCCESS && cudaStreamSynchronize(s) == cudaSuccess) {
                flag_how = "cuStreamWriteValue32";
            } else {
                std::printf(
                    "cuStreamWriteValue32 refused (CUresult %d): the flag kernel writes it\n",
                    int(r));
                memop = false;
            }
        }
        std::printf(
            "bench_dma_host_proxy_cuda: %d experts of %zu bytes in pinned host memory; chain of "
            "%d launches reading %zu MiB each; waiter %d layers after the picker; flag written by "
            "%s; median of %d replays\n",
            n_experts, expert_bytes, chain_layers * chain_per_layer, chain_bytes >> 20, wait_layers,
            flag_how, reps);
        std::printf(
            "| case | chain us | graph us | issue us | copy us | flag seen us | stall us "
            "| copy GB/s |\n");
        std::printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
        struct Case {
            std::string name;
            bool with_picker, request;
            int wait_layers;
        };
        const Case cases[] = {
            {"none", false, false, 0},
            {"picker, no request", true, false, wait_layers},
            {"host proxy, waiter " + std::to_string(wait_layers) + " layers later", true, true,
             wait_layers},
            {"host proxy, waiter right after", true, true, 0},
        };
        unsigned epoch = 0;
        for (const Case& c : cases) {
            const Result r =
                run(c.with_picker, c.request, c.wait_layers, b, n_experts, reps, memop, epoch, s);
            if (!r.error.empty()) {
                std::printf("| %s | FAILED: %s | | | | | | |\n", c.name.c_str(), r.error.c_str());
                continue;
            }
            std::printf("| %s | %.1f | %.1f |", c.name.c_str(), r.us[0], r.us[1]);
            if (c.request)
                std::printf(" %.1f | %.1f | %.1f | %.1f | %.1f |\n", r.us[2], r.us[3], r.us[4],
                            r.us[5], double(expert_bytes) / r.us[4] / 1e3);
            else
                std::printf(" | | | | |\n");
        }
    } catch (const std::exception& e) {
        std::fprintf(stderr, "bench_dma_host_proxy_cuda: %s\n", e.what());
        return 1;
    }
    return 0;
}
