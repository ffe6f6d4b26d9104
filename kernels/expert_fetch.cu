// The expert cache's device fetch: plan (one block) and copy (one block per chunk of a fill).
// The plan follows ggml-like/cpu/ops_expert_fetch.cpp exactly (same order, same skips, the same
// ranks compared) so the host's replay of the fill log, the CPU tests and the simulator
// (routing::simulate_device_fetch) describe what the GPU did.
#include "cuda_check.h"
#include "dependent_launch.cuh"
#include "expert_fetch.h"

namespace minids::kernels {
namespace {

constexpr int max_experts = 1024;
// This step's arrivals a miss may re-evict (the host recycles only when a step cannot fill more:
// kMostRecycledArrivals in src/runtime/expert_offload_device.cpp).
constexpr int max_arrivals = 512;
constexpr int plan_threads = 256;
constexpr int copy_threads = 256;
constexpr int64_t copy_chunk = 128 << 10;  // bytes a copy block moves per pass
constexpr int copy_unroll = 8;             // 16-byte loads in flight per thread
// Copy blocks per fill: a decode step's six fills make one wave over an H200's 132 SMs, each
// block looping over its chunks; plenty of loads in flight for the link, and a step whose
// experts are all in slots pays for few blocks that read the fill count and exit.
constexpr int64_t copy_blocks_per_fill = 22;

struct PlanShared {
    uint32_t used[max_experts / 32];
    uint8_t at_home[max_experts];  // per expert: used and its entry points home
    int32_t misses[max_experts];   // experts to fetch, increasing
    int32_t cand_slot[2 * max_experts];
    int32_t cand_key[2 * max_experts];  // each candidate slot's expert, or -1
    int32_t fill_slot[max_experts];     // per miss: its slot, or -1
    int32_t fill_evicted[max_experts];  // per miss: the key it evicted, or -1
    int32_t fill_took[max_experts];     // per miss: the arrival it re-evicted, or -1
    // This step's arrivals from earlier layers (slot, its key and that key's arrival rank).
    int32_t arr_slot[max_arrivals];
    int32_t arr_key[max_arrivals];
    double arr_priority[max_arrivals];
    unsigned long long arr_stamp[max_arrivals];
    int32_t n_misses, n_cands, n_fills, n_arr;
    int64_t next_victim, first_fill, first_arrival;
    bool recycle;
};

__device__ __forceinline__ bool ranks_lower(double pa, unsigned long long sa, double pb,
                                            unsigned long long sb) {
    return pa < pb || (pa == pb && sa < sb);
}

__device__ __forceinline__ bool is_used(const PlanShared& s, int32_t e) {
    return (s.used[e >> 5] >> (e & 31)) & 1u;
}

// The device's global timer, ns (the stall counter: expert_fetch_header::fetch_ns).
__device__ __forceinline__ int64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return int64_t(t);
}

__global__ void __launch_bounds__(plan_threads) fetch_plan_kernel(ExpertFetchParams p) {
    __shared__ PlanShared s;
    mgl::expert_fetch_header* h = p.state;
    const int tid = int(threadIdx.x);
    const int E = p.n_experts;
    const int64_t layer = p.layer;
    const auto* homes = reinterpret_cast<const int64_t*>(h->homes);
    // The copy kernel may be scheduled now: it waits for this grid to complete (and its
    // writes to be visible) before it reads anything. Launched dependent itself (on the routing
    // kernel, which wrote the ids), the plan waits for its predecessor before reading.
    pdl_launch_dependents();
    pdl_wait();
    const int64_t started = global_ns();  // the routing is done: from here the layer waits
    for (int i = tid; i < max_experts / 32; i += plan_threads) s.used[i] = 0;
    __syncthreads();
    for (int64_t i = tid; i < p.n_ids; i += plan_threads) {
        const int32_t e = p.ids[i];
        if (e >= 0 && e < E) atomicOr(&s.used[e >> 5], 1u << (e & 31));
    }
    __syncthreads();
    // Which used experts are home (to fetch): their table entry against their home address.
    for (int e = tid; e < E; e += plan_threads)
        s.at_home[e] = is_used(s, e) && p.table[e] == homes[layer * E + e] ? 1 : 0;
    __syncthreads();
    if (tid == 0) {
        int m = 0, n_used = 0;
        for (int e = 0; e < E; ++e) {
            n_used += is_used(s, e);
            if (s.at_home[e]) s.misses[m++] = e;
        }
        s.n_misses = m;
        s.next_victim = h->next_victim;
        s.first_fill = h->n_fills;
        s.first_arrival = h->n_arrivals;
        s.recycle = h->recycle != 0 && m > 0;
        const int64_t n_arr = h->n_arrivals;
        s.n_arr = int32_t(n_arr < max_arrivals ? n_arr : max_arrivals);
        // Each skipped victim holds a distinct used expert, so m + n_used candidates suffice.
        // With every used expert in a slot (the usual decode step) no candidate is read.
        const int64_t left = h->n_victims - s.next_victim, enough = m == 0 ? 0 : m + n_used;
        s.n_cands = int32_t(left <= 0 ? 0 : left < enough ? left : enough);
    }
    __syncthreads();
    const auto* victims = reinterpret_cast<const int32_t*>(h->victims);
    auto* slot_keys = reinterpret_cast<int32_t*>(h->slot_keys);
    for (int i = tid; i < s.n_cands; i += plan_threads) {
        const int32_t v = victims[s.next_victim + i];
        s.cand_slot[i] = v;
        s.cand_key[i] = slot_keys[v];
    }
    const auto* arrivals = reinterpret_cast<const int32_t*>(h->arrivals);
    const auto* key_ranks = reinterpret_cast<const mgl::expert_fetch_rank*>(h->key_ranks);
    for (int i = tid; s.recycle && i < s.n_arr; i += plan_threads) {
        const int32_t slot = arrivals[i];
        s.arr_slot[i] = slot;
        s.arr_key[i] = slot < 0 ? -1 : slot_keys[slot];
        if (slot >= 0) {
            s.arr_priority[i] = key_ranks[s.arr_key[i]].priority;
            s.arr_stamp[i] = key_ranks[s.arr_key[i]].stamp;
        }
    }
    __syncthreads();
    if (tid == 0) {
        // Each miss takes the next candidate this layer does not read (those it reads are passed
        // over for good), or this step's lowest-ranked arrival from another layer when that ranks
        // lower; with neither, this and every later miss are read in place.
        const auto* victim_ranks = reinterpret_cast<const mgl::expert_fetch_rank*>(h->victim_ranks);
        int c = 0, f = 0;
        for (; f < s.n_misses; ++f) {
            while (c < s.n_cands) {
                const int32_t k = s.cand_key[c];
                if (!(k >= 0 && k / E == layer && is_used(s, k % E))) break;
                ++c;
            }
            int best = -1;
            for (int i = 0; s.recycle && i < s.n_arr; ++i) {
                if (s.arr_slot[i] < 0 || s.arr_key[i] / E == layer) continue;
                if (best < 0 || ranks_lower(s.arr_priority[i], s.arr_stamp[i], s.arr_priority[best],
                                            s.arr_stamp[best]))
                    best = i;
            }
            bool take_arrival = best >= 0;
            if (take_arrival && c < s.n_cands) {
                const mgl::expert_fetch_rank r = victim_ranks[s.next_victim + c];
                take_arrival =
                    ranks_lower(s.arr_priority[best], s.arr_stamp[best], r.priority, r.stamp);
            }
            if (take_arrival) {
                s.fill_slot[f] = s.arr_slot[best];
                s.fill_evicted[f] = s.arr_key[best];
                s.fill_took[f] = best;
                s.arr_slot[best] = -1;
            } else if (c < s.n_cands) {
                s.fill_slot[f] = s.cand_slot[c];
                s.fill_evicted[f] = s.cand_key[c];
                s.fill_took[f] = -1;
                ++c;
            } else {
                break;
            }
        }
        s.n_fills = f;
        h->next_victim = s.next_victim + c;
        h->layer_fills = s.first_fill;
        h->n_fills = s.first_fill + f;
        h->n_arrivals = s.first_arrival + f;
        // The previous layer's fetch is over (its copies finished before this layer's routing
        // ran): add its interval and open this layer's, which its copy blocks extend.
        if (h->fetch_t1 > h->fetch_t0) h->fetch_ns += h->fetch_t1 - h->fetch_t0;
        h->fetch_t0 = started;
        h->fetch_t1 = global_ns();
    }
    __syncthreads();
    const auto* tables = reinterpret_cast<const int64_t*>(h->tables);
    auto* fill_log = reinterpret_cast<int32_t*>(h->fill_log);
    for (int f = tid; f < s.n_fills; f += plan_threads) {
        const int32_t e = s.misses[f], slot = s.fill_slot[f], evicted = s.fill_evicted[f];
        const int32_t key = int32_t(layer * E + e);
        if (evicted >= 0)
            reinterpret_cast<int64_t*>(tables[evicted / E])[evicted % E] = homes[evicted];
        slot_keys[slot] = key;
        p.table[e] = h->slot_base + int64_t(slot) * h->slot_stride;
        fill_log[2 * (s.first_fill + f)] = key;
        fill_log[2 * (s.first_fill + f) + 1] = slot;
        auto* arrivals_out = reinterpret_cast<int32_t*>(h->arrivals);
        if (s.fill_took[f] >= 0) arrivals_out[s.fill_took[f]] = -1;
        arrivals_out[s.first_arrival + f] = slot;
    }
}

// Copies n bytes (16 at a time when both ends allow), many loads in flight per thread: the source
// is host memory across PCIe, whose latency only parallelism hides.
__device__ void copy_bytes(const uint8_t* src, uint8_t* dst, int64_t n) {
    const bool vec =
        ((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15) == 0;
    const int64_t n16 = vec ? n / 16 : 0;
    const auto* s4 = reinterpret_cast<const uint4*>(src);
    auto* d4 = reinterpret_cast<uint4*>(dst);
    for (int64_t i = threadIdx.x; i < n16; i += int64_t(copy_threads) * copy_unroll) {
        uint4 r[copy_unroll];
#pragma unroll
        for (int u = 0; u < copy_unroll; ++u) {
            const int64_t j = i + int64_t(u) * copy_threads;
            if (j < n16) r[u] = s4[j];
        }
#pragma unroll
        for (int u = 0; u < copy_unroll; ++u) {
            const int64_t j = i + int64_t(u) * copy_threads;
            if (j < n16) d4[j] = r[u];
        }
    }
    for (int64_t i = n16 * 16 + threadIdx.x; i < n; i += copy_threads) dst[i] = src[i];
}

// Block (b, j): chunks b, b + gridDim.x, ... of the layer's j-th fill, if the plan made one.
__global__ void __launch_bounds__(copy_threads) fetch_copy_kernel(ExpertFetchParams p) {
    // Launched dependent on the plan (ExpertFetchParams::pdl): nothing is read before it is
    // done. A no-op in an ordinary launch.
    pdl_wait();
    // The expert kernels after it may be scheduled now (they wait for this grid in turn).
    pdl_launch_dependents();
    const mgl::expert_fetch_header* h = p.state;
    const int64_t f = h->layer_fills + blockIdx.y;
    if (f >= h->n_fills) return;
    const auto* fill_log = reinterpret_cast<const int32_t*>(h->fill_log);
    const int32_t key = fill_log[2 * f], slot = fill_log[2 * f + 1];
    const auto* src =
        reinterpret_cast<const uint8_t*>(reinterpret_cast<const int64_t*>(h->homes)[key]);
    auto* dst = reinterpret_cast<uint8_t*>(h->slot_base + int64_t(slot) * h->slot_stride);
    for (int64_t begin = int64_t(blockIdx.x) * copy_chunk; begin < h->blob_bytes;
         begin += int64_t(gridDim.x) * copy_chunk)
        copy_bytes(src + begin, dst + begin, min(copy_chunk, h->blob_bytes - begin));
    __syncthreads();
    if (threadIdx.x == 0) {  // the layer's fetch ends with its last copy block
        auto* t1 = reinterpret_cast<unsigned long long*>(
            &const_cast<mgl::expert_fetch_header*>(h)->fetch_t1);
        atomicMax(t1, static_cast<unsigned long long>(global_ns()));
    }
}

}  // namespace

void expert_fetch(const ExpertFetchParams& p, cudaStream_t stream) {
    if (!p.state || !p.table || !p.ids || p.n_ids < 1 || p.n_experts < 1 ||
        p.n_experts > max_experts || p.blob_bytes < 1 || p.layer < 0)
        ::mgl::fail(__FILE__, __LINE__, "expert_fetch: parameters out of range");
    launch_maybe_dependent(fetch_plan_kernel, dim3(1), dim3(plan_threads), 0, stream, p.pdl, p);
    const int64_t most_fills = p.n_ids < p.n_experts ? p.n_ids : p.n_experts;
    const int64_t chunks = (p.blob_bytes + copy_chunk - 1) / copy_chunk;
    const dim3 grid(unsigned(chunks < copy_blocks_per_fill ? chunks : copy_blocks_per_fill),
                    unsigned(most_fills));
    launch_maybe_dependent(fetch_copy_kernel, grid, dim3(copy_threads), 0, stream, p.pdl, p);
}

}  // namespace minids::kernels
