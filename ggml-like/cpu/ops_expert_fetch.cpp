// expert_fetch on the CPU: the expert cache's device fetch with host memory for "device" memory,
// so the CPU tests run the same bookkeeping the CUDA kernels do (kernels/expert_fetch.cu) and
// routing::simulate_device_fetch predicts.
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_ops.h"

namespace mgl::cpu {

namespace {

// The layer's fills [layer_fills, n_fills) posted to the stage (the CUDA plan's part) and
// copied home -> buffer by the host's serve (the CUDA host node's part).
void post_fills(const expert_fetch_header& h, expert_stage_header& stage) {
    const int64_t n = h.n_fills - h.layer_fills;
    MGL_CHECK(n <= stage.capacity && stage.blob_bytes == h.blob_bytes,
              "expert_fetch: " + std::to_string(n) + " fills for a stage of " +
                  std::to_string(stage.capacity) + " buffers of " +
                  std::to_string(stage.blob_bytes) + " bytes");
    const auto* fill_log = reinterpret_cast<const int32_t*>(h.fill_log);
    const auto* homes = reinterpret_cast<const int64_t*>(h.homes);
    int64_t* src = expert_stage_sources(&stage);
    for (int64_t i = 0; i < n; ++i) src[i] = homes[fill_log[2 * (h.layer_fills + i)]];
    stage.n = n;
    expert_stage_serve(stage);
}

}  // namespace

void run_expert_fetch(exec_context&, tensor& node) {
    auto* h = static_cast<expert_fetch_header*>(node.src[2]->data);
    auto* table = static_cast<int64_t*>(node.src[0]->data);
    const auto* ids = static_cast<const int32_t*>(node.src[1]->data);
    const int64_t n_ids = node.src[1]->nelements();
    const int64_t E = h->n_experts, layer = node.iparams[0];
    MGL_CHECK(layer < h->n_layers && node.src[0]->shape[0] == E,
              "expert_fetch: layer " + std::to_string(layer) + " or table " +
                  std::to_string(node.src[0]->shape[0]) + " does not match the fetch state");
    // This backend runs the step as the host queues it: victims promised for after the launch
    // (expert_fetch_header::victims_wanted) could never arrive.
    MGL_CHECK(h->victims_wanted == 0,
              "expert_fetch: the victims were not written before the step (a host backend "
              "cannot wait for them)");
    std::vector<char> used(size_t(E), 0);
    for (int64_t i = 0; i < n_ids; ++i) {
        MGL_CHECK(ids[i] >= 0 && ids[i] < E, "expert_fetch: expert id " + std::to_string(ids[i]) +
                                                 " outside [0, " + std::to_string(E) + ")");
        used[size_t(ids[i])] = 1;
    }
    // A prefetch also passes over the experts of the layer whose kernels may run beside it.
    const bool prefetch = is_expert_prefetch(node);
    const int64_t protect_layer = prefetch ? node.iparams[2] : -1;
    std::vector<char> protect(size_t(E), 0);
    if (prefetch) {
        MGL_CHECK(!node.src[3], "expert_fetch: a prefetch has no stage");
        const auto* p = static_cast<const int32_t*>(node.src[4]->data);
        for (int64_t i = 0; i < node.src[4]->nelements(); ++i)
            if (p[i] >= 0 && p[i] < E) protect[size_t(p[i])] = 1;
    }
    auto passed_over = [&](int32_t occupant) {
        return occupant >= 0 && ((occupant / E == layer && used[size_t(occupant % E)]) ||
                                 (occupant / E == protect_layer && protect[size_t(occupant % E)]));
    };
    if (!prefetch && h->id_log && n_ids <= h->id_log_stride)  // the host's copy of the routing
        std::memcpy(reinterpret_cast<int32_t*>(h->id_log) + layer * h->id_log_stride, ids,
                    size_t(n_ids) * sizeof(int32_t));
    const auto* homes = reinterpret_cast<const int64_t*>(h->homes);
    // A capped prefetch fills only its first max_fills misses in the order of the ids (the
    // prediction's ranks), in increasing expert order like any other.
    const int64_t max_fills = prefetch ? node.iparams[3] : 0;
    std::vector<char> chosen;
    if (max_fills > 0) {
        chosen.assign(size_t(E), 0);
        for (int64_t i = 0, n = 0; i < n_ids && n < max_fills; ++i) {
            const int32_t e = ids[i];
            if (chosen[size_t(e)] || table[e] != homes[layer * E + e]) continue;
            chosen[size_t(e)] = 1;
            ++n;
        }
    }
    const auto* tables = reinterpret_cast<const int64_t*>(h->tables);
    const auto* victims = reinterpret_cast<const int32_t*>(h->victims);
    const auto* victim_ranks = reinterpret_cast<const expert_fetch_rank*>(h->victim_ranks);
    const auto* key_ranks = reinterpret_cast<const expert_fetch_rank*>(h->key_ranks);
    auto* slot_keys = reinterpret_cast<int32_t*>(h->slot_keys);
    auto* fill_log = reinterpret_cast<int32_t*>(h->fill_log);
    auto* arrivals = reinterpret_cast<int32_t*>(h->arrivals);
    h->layer_fills = h->n_fills;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t key = layer * E + e;
        if (!used[size_t(e)] || table[e] != homes[key]) continue;  // unused, or in a slot
        if (!chosen.empty() && !chosen[size_t(e)]) continue;       // past a prefetch's cap
        // The next offered victim this layer does not read (its kernels run after this fetch).
        while (h->next_victim < h->n_victims && passed_over(slot_keys[victims[h->next_victim]]))
            ++h->next_victim;
        // This step's lowest-ranked arrival from another layer (not for a prefetch).
        int64_t best = -1;
        for (int64_t i = 0; !prefetch && h->recycle && i < h->n_arrivals; ++i) {
            if (arrivals[i] < 0 || slot_keys[arrivals[i]] / E == layer) continue;
            if (best < 0 || ranks_lower(key_ranks[slot_keys[arrivals[i]]],
                                        key_ranks[slot_keys[arrivals[best]]]))
                best = i;
        }
        int32_t slot = -1;
        if (best >= 0 &&
            (h->next_victim >= h->n_victims ||
             ranks_lower(key_ranks[slot_keys[arrivals[best]]], victim_ranks[h->next_victim]))) {
            slot = arrivals[best];
            arrivals[best] = -1;
        } else if (h->next_victim < h->n_victims) {
            slot = victims[h->next_victim++];
        } else {
            continue;  // nothing to evict: read in place
        }
        if (const int32_t occupant = slot_keys[slot]; occupant >= 0)
            reinterpret_cast<int64_t*>(tables[occupant / E])[occupant % E] = homes[occupant];
        slot_keys[slot] = int32_t(key);
        table[e] = h->slot_base + int64_t(slot) * h->slot_stride;
        fill_log[2 * h->n_fills] = int32_t(key) | (prefetch ? expert_fetch_prefetched : 0);
        fill_log[2 * h->n_fills + 1] = slot;
        ++h->n_fills;
        arrivals[h->n_arrivals++] = slot;
    }
    // The copies, as the CUDA backend makes them: with a stage through it (home -> buffer i by
    // the host's serve, buffer i -> slot as the copy kernel), else home -> slot.
    auto* stage = node.src[3] ? static_cast<expert_stage_header*>(node.src[3]->data) : nullptr;
    if (stage) post_fills(*h, *stage);
    for (int64_t f = h->layer_fills; f < h->n_fills; ++f) {
        const int32_t key = fill_log[2 * f] & ~expert_fetch_prefetched, slot = fill_log[2 * f + 1];
        auto* dst = reinterpret_cast<uint8_t*>(h->slot_base + int64_t(slot) * h->slot_stride);
        const void* src = stage ? expert_stage_buffer(stage, f - h->layer_fills)
                                : reinterpret_cast<const void*>(homes[key]);
        std::memcpy(dst, src, size_t(h->blob_bytes));
    }
}

void run_expert_prompt_stage(exec_context&, tensor& node) {
    const auto* h = static_cast<const expert_fetch_header*>(node.src[2]->data);
    const auto* table = static_cast<const int64_t*>(node.src[0]->data);
    const auto* ids = static_cast<const int32_t*>(node.src[1]->data);
    auto* out = static_cast<int64_t*>(node.data);
    const auto* buffers = static_cast<const int64_t*>(node.src[3]->data);
    const int64_t E = node.src[0]->shape[0];
    const int64_t n = std::max<int64_t>(0, std::min<int64_t>(buffers[0], node.iparams[0]));
    std::vector<char> used(size_t(E), 0);
    for (int64_t i = 0; i < node.src[1]->nelements(); ++i) {
        MGL_CHECK(ids[i] >= 0 && ids[i] < E, "expert_prompt_stage: expert id " +
                                                 std::to_string(ids[i]) + " outside [0, " +
                                                 std::to_string(E) + ")");
        used[size_t(ids[i])] = 1;
    }
    const int64_t slots_end = h->slot_base + h->n_slots * h->slot_stride;
    for (int64_t e = 0, staged = 0; e < E; ++e) {
        out[e] = table[e];
        const bool in_slot = table[e] >= h->slot_base && table[e] < slots_end;
        if (!used[size_t(e)] || in_slot || staged == n) continue;
        const int64_t dst = buffers[1 + staged++];
        std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(table[e]),
                    size_t(node.experts->blob_bytes));
        out[e] = dst;
    }
}

}  // namespace mgl::cpu
