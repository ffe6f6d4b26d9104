// The device fetch's plan as one block-wide device function, so the standalone plan kernel
// (expert_fetch.cu) and the routing kernels that plan right after their top-k (the route_fetch
// fusion: moe_route.cu, moe_router_route.cu) run one code, not copies. The rules follow
// ggml-like/cpu/ops_expert_fetch.cpp exactly (same order, same skips, the same ranks compared), so
// the host's replay of the fill log, the CPU tests and the simulator
// (routing::simulate_device_fetch) describe what the GPU did.
#pragma once

#include <cstdint>

#include "expert_fetch.h"

namespace minids::kernels::fetch_detail {

// This step's arrivals a miss may re-evict (the host recycles only when a step cannot fill more:
// kMostRecycledArrivals in src/runtime/expert_offload_device.cpp).
constexpr int max_arrivals = 512;
// The routing kernels plan for up to 256 experts (their rank selection's and the fused router's
// limit), which keeps the plan's shared memory (~21 KiB) beside theirs under the 48 KiB of static
// shared memory; the standalone kernel takes every layer the launcher accepts.
constexpr int plan_max_experts = 1024;
constexpr int fused_plan_max_experts = 256;

template <int MaxE>
struct PlanShared {
    uint32_t used[MaxE / 32];
    uint32_t protect[MaxE / 32];  // a prefetch: the experts of protect_layer to pass over
    uint32_t chosen[MaxE / 32];   // a capped prefetch (max_fills): the misses it may fill
    uint8_t at_home[MaxE];        // per expert: used and its entry points home
    int32_t misses[MaxE];         // experts to fetch, increasing
    int32_t cand_slot[2 * MaxE];
    int32_t cand_key[2 * MaxE];  // each candidate slot's expert, or -1
    int32_t fill_slot[MaxE];     // per miss: its slot, or -1
    int32_t fill_evicted[MaxE];  // per miss: the key it evicted, or -1
    int32_t fill_took[MaxE];     // per miss: the arrival it re-evicted, or -1
    // This step's arrivals from earlier layers (slot, its key and that key's arrival rank).
    int32_t arr_slot[max_arrivals];
    int32_t arr_key[max_arrivals];
    double arr_priority[max_arrivals];
    unsigned long long arr_stamp[max_arrivals];
    int32_t n_misses, n_cands, n_fills, n_arr;
    int64_t next_victim, first_fill, first_arrival;
    bool recycle;
    // Victims after the launch: this plan copies the step's n_victims into device memory.
    bool copy_victims;
    int64_t n_victims;
};

__device__ __forceinline__ bool ranks_lower(double pa, unsigned long long sa, double pb,
                                            unsigned long long sb) {
    return pa < pb || (pa == pb && sa < sb);
}

template <int MaxE>
__device__ __forceinline__ bool is_used(const PlanShared<MaxE>& s, int32_t e) {
    return (s.used[e >> 5] >> (e & 31)) & 1u;
}

template <int MaxE>
__device__ __forceinline__ bool is_protected(const PlanShared<MaxE>& s, int32_t e) {
    return (s.protect[e >> 5] >> (e & 31)) & 1u;
}

template <int MaxE>
__device__ __forceinline__ bool is_chosen(const PlanShared<MaxE>& s, int32_t e) {
    return (s.chosen[e >> 5] >> (e & 31)) & 1u;
}

// The device's global timer, ns (the stall counter: expert_fetch_header::fetch_ns).
__device__ __forceinline__ int64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return int64_t(t);
}

// Victims after the launch (expert_fetch_header::victims_wanted): returns once the host has
// written step `wanted`'s victims (its word at victims_ready, in host memory), or after 2 s, when
// the host is gone: then the error is flagged for the host (it fails the step) and false returned
// (the layer fills nothing; its misses are read in place). One thread calls it.
__device__ __forceinline__ bool wait_for_victims(mgl::expert_fetch_header* h, int64_t wanted) {
    const auto* ready = reinterpret_cast<const volatile int64_t*>(h->victims_ready);
    if (!ready) return false;  // not set up: nothing will come
    if (*ready >= wanted) return true;
    // An earlier layer gave up already: the host is gone, do not wait 2 s per layer.
    if (*reinterpret_cast<const volatile int64_t*>(&h->victims_late)) return false;
    const int64_t give_up = global_ns() + 2'000'000'000;
    while (*ready < wanted) {
        if (global_ns() > give_up) {
            h->victims_late = 1;
            return false;
        }
        __nanosleep(200);
    }
    return true;
}

// Victims after the launch, by the whole block once the host's word said they are written: the
// step's n victims, their ranks and (recycling) every key's arrival rank, from the host block (the
// ready word, then the layout the state has from its victims on) into the state, so that this
// step's later plans read them from device memory instead of across the link, which the step's
// fills keep busy. Volatile loads: no cached line may hide what the host wrote during the step.
__device__ __forceinline__ void copy_victims_in(const mgl::expert_fetch_header* h, int64_t n,
                                                bool key_ranks) {
    const auto* from = reinterpret_cast<const volatile int64_t*>(h->victims_ready) + 1;
    auto* to = reinterpret_cast<int64_t*>(h->victims);
    const int64_t ranks_at = (h->victim_ranks - h->victims) / 8,
                  keys_at = (h->key_ranks - h->victims) / 8;
    const int64_t victim_words = (n + 1) / 2, rank_words = 2 * n,
                  key_words = key_ranks ? 2 * h->n_layers * h->n_experts : 0;
    for (int64_t i = threadIdx.x; i < victim_words + rank_words + key_words; i += blockDim.x) {
        const int64_t w = i < victim_words ? i
                          : i < victim_words + rank_words
                              ? ranks_at + (i - victim_words)
                              : keys_at + (i - victim_words - rank_words);
        to[w] = from[w];
    }
}

// Plans one MoE layer's fetch: every thread of the block calls it (it synchronizes the block),
// once the layer's ids are in memory this block can read and every earlier layer's fetch has
// completed. `started` (thread 0's is kept) opens the layer's fetch interval: the moment its
// routing was known to be done. With n_experts <= MaxE (the launchers check) and whole warps,
// at least one (warp 0 lists the misses).
template <int MaxE>
__device__ void plan_fetch(const ExpertFetchParams& p, PlanShared<MaxE>& s, int64_t started) {
    mgl::expert_fetch_header* h = p.state;
    const int tid = int(threadIdx.x), n_threads = int(blockDim.x);
    const int E = p.n_experts;
    const int64_t layer = p.layer;
    const auto* homes = reinterpret_cast<const int64_t*>(h->homes);
    // Thread 0 reads the header's counters now, so their loads are in flight while the block
    // reads the ids and the table (one memory round trip less on the layer's critical path;
    // every earlier writer of the header has completed, see above).
    int64_t next_victim = 0, first_fill = 0, first_arrival = 0, n_victims = 0, victims_wanted = 0,
            victims_copied = 0;
    int recycle = 0;
    int64_t last_t0 = 0, last_t1 = 0;  // the previous layer's fetch interval
    if (tid == 0) {
        next_victim = h->next_victim;
        first_fill = h->n_fills;
        first_arrival = h->n_arrivals;
        n_victims = h->n_victims;
        victims_wanted = h->victims_wanted;
        victims_copied = h->victims_copied;
        recycle = p.prefetch ? 0 : h->recycle;
        last_t0 = h->fetch_t0;
        last_t1 = h->fetch_t1;
    }
    for (int i = tid; i < MaxE / 32; i += n_threads) s.used[i] = s.protect[i] = s.chosen[i] = 0;
    __syncthreads();
    // The ids also go to the id log when they fit (the host's copy of the step's routing).
    auto* id_log = reinterpret_cast<int32_t*>(h->id_log);
    const int64_t id_log_stride = h->id_log_stride;
    if (p.n_ids > id_log_stride || p.prefetch) id_log = nullptr;
    for (int64_t i = tid; i < p.n_ids; i += n_threads) {
        const int32_t e = p.ids[i];
        if (e >= 0 && e < E) atomicOr(&s.used[e >> 5], 1u << (e & 31));
        if (id_log) id_log[layer * id_log_stride + i] = e;
    }
    for (int64_t i = tid; p.prefetch && i < p.n_protect; i += n_threads) {
        const int32_t e = p.protect[i];
        if (e >= 0 && e < E) atomicOr(&s.protect[e >> 5], 1u << (e & 31));
    }
    // A capped prefetch: its first max_fills misses in the order of the ids (the prediction's
    // ranks, best first); a few ids, one thread (uniform branch: no cost to any other fetch).
    const bool capped = p.prefetch && p.max_fills > 0;
    if (capped && tid == 0) {
        for (int64_t i = 0, n = 0; i < p.n_ids && n < p.max_fills; ++i) {
            const int32_t e = p.ids[i];
            if (e < 0 || e >= E || is_chosen(s, e) || p.table[e] != homes[layer * E + e]) continue;
            s.chosen[e >> 5] |= 1u << (e & 31);
            ++n;
        }
    }
    __syncthreads();
    // Which used experts are home (to fetch): their table entry against their home address.
    for (int e = tid; e < E; e += n_threads)
        s.at_home[e] =
            is_used(s, e) && p.table[e] == homes[layer * E + e] && (!capped || is_chosen(s, e)) ? 1
                                                                                                : 0;
    __syncthreads();
    if (tid < 32) {
        // Warp 0 lists the misses in increasing order, 32 experts per ballot (a loop over every
        // expert in thread 0 alone cost the layer microseconds of its critical path), and
        // counts the used experts from the bit set (no id >= E sets a bit).
        const unsigned lanes_below = (1u << tid) - 1u;
        int m = 0, n_used = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + tid;
            const bool miss = e < E && s.at_home[e];
            const unsigned ballot = __ballot_sync(0xffffffffu, miss);
            if (miss) s.misses[m + __popc(ballot & lanes_below)] = e;
            m += __popc(ballot);
        }
        for (int i = tid; i < (E + 31) / 32; i += 32) n_used += __popc(s.used[i]);
        for (int o = 16; o > 0; o >>= 1) n_used += __shfl_xor_sync(0xffffffffu, n_used, o);
        if (tid == 0) {
            s.n_misses = m;
            s.next_victim = next_victim;
            s.first_fill = first_fill;
            s.first_arrival = first_arrival;
            s.recycle = recycle != 0 && m > 0;
            s.n_arr = int32_t(first_arrival < max_arrivals ? first_arrival : max_arrivals);
            // Each skipped victim holds a distinct used (or protected) expert, so m + n_used
            // (+ n_protect) candidates suffice. With every used expert in a slot (the usual
            // decode step) no candidate is read.
            int64_t left = n_victims - next_victim;
            const int64_t enough = m == 0 ? 0 : m + n_used + (p.prefetch ? p.n_protect : 0);
            // Only a layer with misses reads the victims (and, recycling, the key ranks): when
            // they come after the launch, the step's first such layer waits for them and copies
            // them in (below).
            s.copy_victims = false;
            s.n_victims = n_victims;
            if (m > 0 && (left > 0 || s.recycle) && victims_wanted > victims_copied) {
                if (wait_for_victims(h, victims_wanted)) {
                    s.copy_victims = true;
                } else {
                    left = 0;
                    s.recycle = false;
                }
            }
            // (At most the arrays' 2 · MaxE: a prefetch's protected experts may add more; the
            // misses left without a candidate are then read in place, which is still correct.)
            const int64_t room = enough < 2 * MaxE ? enough : 2 * MaxE;
            s.n_cands = int32_t(left <= 0 ? 0 : left < room ? left : room);
        }
    }
    __syncthreads();
    if (s.copy_victims) {
        // The host wrote the block before its word: the fence orders the block's loads after
        // thread 0 saw the word (they follow it through the barrier above).
        __threadfence_system();
        copy_victims_in(h, s.n_victims, h->recycle != 0);
        __syncthreads();
        if (tid == 0) {
            __threadfence();
            h->victims_copied = victims_wanted;
        }
    }
    const auto* victims = reinterpret_cast<const int32_t*>(h->victims);
    auto* slot_keys = reinterpret_cast<int32_t*>(h->slot_keys);
    for (int i = tid; i < s.n_cands; i += n_threads) {
        const int32_t v = victims[s.next_victim + i];
        s.cand_slot[i] = v;
        s.cand_key[i] = slot_keys[v];
    }
    const auto* arrivals = reinterpret_cast<const int32_t*>(h->arrivals);
    const auto* key_ranks = reinterpret_cast<const mgl::expert_fetch_rank*>(h->key_ranks);
    for (int i = tid; s.recycle && i < s.n_arr; i += n_threads) {
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
                const bool passed_over =
                    k >= 0 && ((k / E == layer && is_used(s, k % E)) ||
                               (k / E == p.protect_layer && p.prefetch && is_protected(s, k % E)));
                if (!passed_over) break;
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
        // ran): add its interval and open this layer's, which its copy blocks extend. Not a
        // prefetch's: nothing waits on it unless its layer's fetch does.
        if (!p.prefetch) {
            if (last_t1 > last_t0) h->fetch_ns += last_t1 - last_t0;
            h->fetch_t0 = started;
            h->fetch_t1 = global_ns();
        }
    }
    __syncthreads();
    const auto* tables = reinterpret_cast<const int64_t*>(h->tables);
    auto* fill_log = reinterpret_cast<int32_t*>(h->fill_log);
    for (int f = tid; f < s.n_fills; f += n_threads) {
        const int32_t e = s.misses[f], slot = s.fill_slot[f], evicted = s.fill_evicted[f];
        const int32_t key = int32_t(layer * E + e);
        if (evicted >= 0)
            reinterpret_cast<int64_t*>(tables[evicted / E])[evicted % E] = homes[evicted];
        slot_keys[slot] = key;
        p.table[e] = h->slot_base + int64_t(slot) * h->slot_stride;
        fill_log[2 * (s.first_fill + f)] = key | (p.prefetch ? mgl::expert_fetch_prefetched : 0);
        fill_log[2 * (s.first_fill + f) + 1] = slot;
        auto* arrivals_out = reinterpret_cast<int32_t*>(h->arrivals);
        if (s.fill_took[f] >= 0) arrivals_out[s.fill_took[f]] = -1;
        arrivals_out[s.first_arrival + f] = slot;
        // The staging store: fill f's home, for the host to copy into the stage's buffer f (the
        // host offers a layer at most capacity = n_experts fills: ExpertOffload).
        if (p.stage) reinterpret_cast<int64_t*>(p.stage + 1)[f] = homes[key];
    }
    if (p.stage) {
        if (tid == 0) p.stage->n = s.n_fills;
        // The host reads the stage once this grid has completed (a host node after it); the
        // fence makes the writes to host memory visible to it in any case.
        __threadfence_system();
    }
}

}  // namespace minids::kernels::fetch_detail
