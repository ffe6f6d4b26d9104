#include "runtime/expert_offload.h"

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <stdexcept>
#include <string>

#include "runtime/host_time.h"

namespace minids {

namespace {

constexpr uint64_t kSlotAlign = 256;
}  // namespace

ExpertOffload::ExpertOffload(const Deepseek2Model& model, mgl::backend& backend,
                             routing::CacheConfig config,
                             std::unique_ptr<mgl::transfer_queue> transfers, bool device_fetch)
    : store_(model.weights()),
      backend_(backend),
      config_(config),
      transfers_(std::move(transfers)) {
    const auto& tables = store_.expert_tables();
    if (tables.empty()) throw std::invalid_argument("expert cache: the model has no MoE layers");
    config_.n_layers = int32_t(tables.size());
    config_.n_experts = int32_t(tables[0].blobs.size());
    top_k_ = int32_t(model.config().num_experts_per_tok);
    routing::check_config(config_, top_k_);
    if (device_fetch &&
        (config_.per_layer || config_.admit != routing::Admission::all || transfers_)) {
        throw std::invalid_argument(
            "expert cache: the device fetch fills slots inside the step and needs one global "
            "pool, admission 'all' and no copy stream");
    }
    staging_ = store_.placement().experts_staged;
    if (staging_ && !device_fetch) {
        throw std::invalid_argument(
            "expert cache: the experts' host store is the staging store (nothing registered: "
            "MINIDS_EXPERT_STORE=staging, or the system refused), which the GPU cannot read in "
            "place; only the device fetch serves it (--expert-cache-fetch device: one global "
            "pool, admission 'all', no copy stream)");
    }
    if (staging_ && config_.n_slots < config_.n_experts) {
        throw std::invalid_argument(
            "expert cache: the staging store needs a slot for every expert one layer may use in "
            "a step (" +
            std::to_string(config_.n_experts) + "), found " + std::to_string(config_.n_slots) +
            " slots; a larger --vram-budget or --expert-cache-slots gives more");
    }
    cache_ = routing::make_expert_cache(config_);
    blob_bytes_ = tables[0].blob_bytes;
    slot_stride_ = slot_bytes_for(blob_bytes_);
    slots_ = backend_.alloc_buffer(size_t(slot_stride_ * uint64_t(config_.n_slots)));
    slot_key_.assign(size_t(config_.n_slots), -1);
    fill_fence_.assign(size_t(config_.n_slots), 0);
    for (const auto& t : tables) {
        if (t.home.size() != t.blobs.size() || t.blob_bytes != blob_bytes_)
            throw std::logic_error("expert cache: the weights are not placed yet");
        shadow_.push_back(t.home);
    }
    point_home();
    if (device_fetch) setup_device_fetch();
}

void ExpertOffload::attach(Session& session) {
    session.set_expert_cache_hook([this](const RoutingRecord& r) {
        HostTime t(stats_.host_ns);
        after_step(r);
    });
    // Always set, so a session that had another cache's fetch forgets it. (queue_fill_log runs
    // while the step does: only the work it does for victims after the launch is counted, as
    // host time beside the step.)
    session.set_expert_fetch(state_, stage_,
                             state_ ? std::function<void(int64_t, bool)>([this](int64_t n, bool w) {
                                 HostTime t(stats_.host_ns);
                                 before_step(n, w);
                             })
                                    : nullptr,
                             state_ ? std::function<const int32_t*(int64_t)>(
                                          [this](int64_t n) { return queue_fill_log(n); })
                                    : nullptr,
                             prefetch_, prefetch_fills_);
    session.set_expert_prompt_stage(lend_);
}

void ExpertOffload::set_prompt_stage(int64_t capacity) {
    if (capacity < 0 || capacity > config_.n_experts || capacity > config_.n_slots)
        throw std::invalid_argument(
            "--expert-prompt-stage: expected 0 to " +
            std::to_string(std::min<int64_t>(config_.n_experts, config_.n_slots)) +
            " slots (a layer's experts, at most the pool's), found " + std::to_string(capacity));
    if (capacity > 0 && (!state_ || staging_))
        throw std::invalid_argument(
            "--expert-prompt-stage: the prompt stage needs the device fetch (--expert-cache-fetch "
            "device) and a host store the GPU reads (not the staging store)");
    restore_lent_slots();
    lend_ = nullptr;
    lend_buf_.reset();
    prompt_stage_capacity_ = capacity;
    if (capacity == 0) return;
    lend_buf_ = backend_.alloc_buffer(size_t(1 + capacity) * sizeof(int64_t));
    lend_ = state_ctx_.new_tensor(mgl::dtype::i64, {1 + capacity}, "expert_prompt_stage_slots");
    mgl::bind(*lend_, *lend_buf_, 0);
    const int64_t none = 0;  // nothing lent until a prompt chunk's before_step
    backend_.copy_to_backend(lend_buf_->base(), &none, sizeof none);
}

void ExpertOffload::set_prefetch(int32_t n, bool copy_engines, bool fills_by_engines) {
    if (n < 0 || n > top_k_)
        throw std::invalid_argument("--expert-prefetch: expected 0 to " + std::to_string(top_k_) +
                                    " experts per layer (the model's top-k), found " +
                                    std::to_string(n));
    if (n > 0 && (!state_ || staging_))
        throw std::invalid_argument(
            "--expert-prefetch: prefetch needs the device fetch (--expert-cache-fetch device) "
            "and a host store the GPU reads (not the staging store)");
    if (fills_by_engines && (!state_ || staging_))
        throw std::invalid_argument(
            "expert cache: fills by the copy engines need the device fetch and a host store the "
            "GPU reads (not the staging store)");
    const bool want_proxy = (n > 0 && copy_engines) || fills_by_engines;
    const bool had_proxy = proxy_ != nullptr;
    const bool demand_changed = fills_by_engines != fills_by_engines_;
    fills_by_engines_ = fills_by_engines;
    if (want_proxy && !proxy_) {
        const int32_t E = config_.n_experts, L = config_.n_layers;
        auto* state = static_cast<mgl::expert_fetch_header*>(state_buf_->base());
        // At most three batches are unserved: with the prefetch behind the misses, layer m's
        // prefetched experts, its own fills and layer m+1's prefetch, posted before the wait for
        // the first two; otherwise each layer's fetch waits for everything posted before it
        // returns: 3 · top-k requests.
        proxy_ = std::make_unique<PrefetchProxy>(
            backend_, std::max<int64_t>({E, 64, 3 * int64_t(top_k_)}), size_t(blob_bytes_),
            &state->proxy_done, [this, E, L](int32_t key, int32_t slot) {
                if (key < 0 || key >= L * E || slot < 0 || slot >= config_.n_slots)
                    throw std::logic_error("a request for expert " + std::to_string(key) +
                                           " into slot " + std::to_string(slot) +
                                           " is out of range");
                return std::pair<const void*, void*>(blob(key / E, key % E),
                                                     reinterpret_cast<void*>(slot_address(slot)));
            });
    } else if (!want_proxy && proxy_) {
        backend_.synchronize();
        proxy_->drain();
        proxy_.reset();
    }
    prefetch_ = n;
    // The ring's address (or none) and proxy_demand, when either changed. A kept proxy first
    // serves what was posted: the words restart its counts at what it served.
    const bool rewrite = had_proxy != (proxy_ != nullptr) || (proxy_ && demand_changed);
    if (rewrite && had_proxy && proxy_) {
        backend_.synchronize();
        proxy_->drain();
    }
    if (rewrite) write_proxy_words();
}

void ExpertOffload::write_proxy_words() {
    const int64_t served = proxy_ ? proxy_->served() : 0;
    const int64_t words[5] = {proxy_ ? proxy_->ring_address() : 0, served, served, 0,
                              proxy_ && fills_by_engines_ ? 1 : 0};
    static_assert(offsetof(mgl::expert_fetch_header, proxy_demand) ==
                  offsetof(mgl::expert_fetch_header, proxy_ring) + 4 * sizeof(int64_t));
    auto* state = static_cast<mgl::expert_fetch_header*>(state_buf_->base());
    backend_.copy_to_backend(&state->proxy_ring, words, sizeof words);
}

ExpertOffload::~ExpertOffload() {
    // The model outlives the cache: its tables must not keep addresses of freed slots, and no
    // fill may still write into them.
    try {
        if (transfers_) transfers_->drain();
        backend_.synchronize();
        point_home();
    } catch (...) {
    }
}

void ExpertOffload::set_victims_after_launch(bool on) {
    if (on && (!state_ || staging_))
        throw std::invalid_argument(
            "expert cache: victims after the launch need the device fetch and a host store the "
            "GPU reads (not the staging store)");
    if (on == victims_after_launch_) return;
    backend_.synchronize();
    settle();
    victims_after_launch_ = on;
    write_victims_words();
}

const OffloadStats& ExpertOffload::stats() {
    if (pending_replay_) {
        HostTime t(stats_.host_beside_ns);
        settle();
    }
    return stats_;
}

void ExpertOffload::reset() {
    if (transfers_) transfers_->drain();
    backend_.synchronize();
    if (proxy_) proxy_->drain();
    // The last step counts (the counters keep running).
    settle();
    // A loan a failed chunk left out is forgotten, not copied back: every slot is emptied.
    lent_slots_.clear();
    cache_ = routing::make_expert_cache(config_);
    slot_key_.assign(slot_key_.size(), -1);
    fill_fence_.assign(fill_fence_.size(), 0);
    pending_.clear();
    point_home();
    if (state_) setup_device_fetch();
}

bool ExpertOffload::slot_pending(int64_t address) const {
    const int64_t base = slot_address(0);
    if (address < base || address >= base + int64_t(slot_stride_) * config_.n_slots) return false;
    return fill_fence_[size_t((address - base) / int64_t(slot_stride_))] != 0;
}

void ExpertOffload::settle_fills() {
    std::erase_if(pending_, [&](int32_t s) {
        if (!transfers_->done(fill_fence_[size_t(s)])) return false;
        fill_fence_[size_t(s)] = 0;
        return true;
    });
}

void ExpertOffload::point_home() {
    const auto& tables = store_.expert_tables();
    for (size_t l = 0; l < tables.size(); ++l) {
        shadow_[l] = tables[l].home;
        backend_.copy_to_backend(tables[l].t->data, shadow_[l].data(),
                                 shadow_[l].size() * sizeof(int64_t));
    }
}

uint64_t ExpertOffload::slot_bytes_for(uint64_t blob_bytes) {
    return (blob_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
}

int64_t ExpertOffload::table_entry(int32_t layer, int32_t expert) const {
    return shadow_[size_t(layer)][size_t(expert)];
}

int64_t ExpertOffload::home(int32_t layer, int32_t expert) const {
    return store_.expert_tables()[size_t(layer)].home[size_t(expert)];
}

int64_t ExpertOffload::slot_address(int32_t slot) const {
    return int64_t(static_cast<uint8_t*>(slots_->base()) + uint64_t(slot) * slot_stride_);
}

const uint8_t* ExpertOffload::blob(int32_t layer, int32_t expert) const {
    return store_.expert_tables()[size_t(layer)].blobs[size_t(expert)];
}

void ExpertOffload::occupy(int32_t slot, int32_t key) {
    const int32_t E = config_.n_experts;
    if (const int32_t old = slot_key_[size_t(slot)]; old >= 0)
        shadow_[size_t(old / E)][size_t(old % E)] = home(old / E, old % E);
    slot_key_[size_t(slot)] = key;
    shadow_[size_t(key / E)][size_t(key % E)] = slot_address(slot);
}

void ExpertOffload::after_step(const RoutingRecord& r) {
    const int32_t L = config_.n_layers, E = config_.n_experts;
    const int64_t T = r.n_tokens, k = r.k;
    if (int64_t(r.ids.size()) != int64_t(L) * T * k)
        throw std::invalid_argument("expert cache: a routing record of " +
                                    std::to_string(r.ids.size()) + " ids for " + std::to_string(L) +
                                    " layers x " + std::to_string(T) + " tokens x " +
                                    std::to_string(k));
    if (state_) {
        restore_lent_slots();  // the replay then finds their experts in their slots, as lent
        return stash_replay(r);
    }
    // What the kernels read in place: the experts used whose entry pointed home as the step
    // began (the shadow still holds the tables as the step saw them).
    std::vector<char> used(size_t(L) * size_t(E), 0);
    for (int32_t l = 0; l < L; ++l) {
        for (int64_t i = 0; i < T * k; ++i) {
            const int32_t e = r.ids[size_t(int64_t(l) * T * k + i)];
            if (e < 0 || e >= E) continue;  // the policy's access() below refuses it
            char& u = used[size_t(l) * size_t(E) + size_t(e)];
            if (u) continue;
            u = 1;
            if (shadow_[size_t(l)][size_t(e)] == home(l, e)) {
                ++stats_.reads_in_place;
                stats_.bytes_read_in_place += blob_bytes_;
            }
        }
    }
    std::vector<int32_t> changed;  // slots whose occupant changed in this step
    routing::AccessHint hint;
    for (int64_t t = 0; t < T; ++t) {
        for (int32_t l = 0; l < L; ++l) {
            for (int64_t j = 0; j < k; ++j) {
                const int32_t e = r.ids[size_t((int64_t(l) * T + t) * k + j)];
                const routing::AccessResult a = cache_->access(l, e, hint, true);
                ++stats_.accesses;
                if (a.outcome == routing::AccessResult::hit) {
                    ++stats_.hits;
                    continue;
                }
                if (a.outcome == routing::AccessResult::bypass) continue;  // read in place
                slot_key_[size_t(a.slot)] = l * E + e;
                changed.push_back(a.slot);
            }
            cache_->unpin_all();
        }
    }
    ++stats_.steps;
    const size_t pending_before = pending_.size();
    if (transfers_) settle_fills();
    if (changed.empty() && pending_.size() == pending_before) return;

    // Queue the fills, point every table entry at where its expert is now and upload the
    // changed tables. The step that read the old slot contents has finished (the host has its
    // logits) and the next step is launched after these on the same stream, so no kernel runs
    // while a slot and its entries disagree.
    std::sort(changed.begin(), changed.end());
    changed.erase(std::unique(changed.begin(), changed.end()), changed.end());
    // The fills: on the copy stream they start now, beside the next step, and their slots stay
    // out of the tables until their fence has passed (a later step's settle_fills); on the
    // backend's stream they run before the table uploads and the next step.
    for (int32_t s : changed) {
        const int32_t key = slot_key_[size_t(s)];
        auto* dst = reinterpret_cast<void*>(slot_address(s));
        if (transfers_) {
            transfers_->copy(dst, blob(key / E, key % E), size_t(blob_bytes_));
        } else {
            backend_.copy_to_backend_async(dst, blob(key / E, key % E), size_t(blob_bytes_));
        }
        ++stats_.fills;
        stats_.bytes_filled += blob_bytes_;
    }
    if (transfers_ && !changed.empty()) {
        const uint64_t f = transfers_->fence();
        for (int32_t s : changed) {
            if (fill_fence_[size_t(s)] == 0) pending_.push_back(s);
            fill_fence_[size_t(s)] = f;
        }
    }
    std::vector<char> layer_dirty(size_t(L), 0);
    for (int32_t l = 0; l < L; ++l) {
        for (int32_t e = 0; e < E; ++e) {
            const int32_t s = cache_->slot_of(l, e);
            const bool ready = s >= 0 && fill_fence_[size_t(s)] == 0;
            const int64_t want = ready ? slot_address(s) : home(l, e);
            int64_t& have = shadow_[size_t(l)][size_t(e)];
            if (have != want) {
                have = want;
                layer_dirty[size_t(l)] = 1;
            }
        }
    }
    for (int32_t l = 0; l < L; ++l) {
        if (!layer_dirty[size_t(l)]) continue;
        mgl::tensor* t = store_.expert_tables()[size_t(l)].t;
        backend_.copy_to_backend_async(t->data, shadow_[size_t(l)].data(),
                                       shadow_[size_t(l)].size() * sizeof(int64_t));
    }
}

}  // namespace minids
