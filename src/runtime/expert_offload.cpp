#include "runtime/expert_offload.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace minids {

namespace {

constexpr uint64_t kSlotAlign = 256;
constexpr size_t kHeaderWords = sizeof(mgl::expert_fetch_header) / sizeof(int64_t);
static_assert(sizeof(mgl::expert_fetch_header) % sizeof(int64_t) == 0);

// Where the device fetch's arrays sit in its state buffer, in i64 words: the header and the fill
// log first (after a step the host downloads both in one copy), then what the host writes.
struct StateLayout {
    size_t fill_log, tables, homes, victims, slot_keys, words;
    StateLayout(int64_t n_layers, int64_t n_experts, int64_t n_slots) {
        fill_log = kHeaderWords;
        tables = fill_log + size_t(n_slots);  // a (key, slot) pair of i32 per word
        homes = tables + size_t(n_layers);
        victims = homes + size_t(n_layers * n_experts);
        slot_keys = victims + size_t(n_slots + 1) / 2;
        words = slot_keys + size_t(n_slots + 1) / 2;
    }
};

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

void ExpertOffload::setup_device_fetch() {
    const int64_t L = config_.n_layers, E = config_.n_experts, S = config_.n_slots;
    const StateLayout at(L, E, S);
    if (!state_) {  // once: recorded graphs keep the state's address
        state_buf_ = backend_.alloc_buffer(at.words * sizeof(int64_t));
        state_ = state_ctx_.new_tensor(mgl::dtype::i64, {int64_t(at.words)}, "expert_fetch_state");
        mgl::bind(*state_, *state_buf_, 0);
    }
    victims_.clear();
    std::vector<int64_t> init(at.words, 0);
    auto* base = static_cast<int64_t*>(state_buf_->base());  // backend addresses
    mgl::expert_fetch_header h;
    h.n_layers = L;
    h.n_experts = E;
    h.n_slots = S;
    h.blob_bytes = int64_t(blob_bytes_);
    h.slot_base = slot_address(0);
    h.slot_stride = int64_t(slot_stride_);
    h.tables = reinterpret_cast<int64_t>(base + at.tables);
    h.homes = reinterpret_cast<int64_t>(base + at.homes);
    h.victims = reinterpret_cast<int64_t>(base + at.victims);
    h.slot_keys = reinterpret_cast<int64_t>(base + at.slot_keys);
    h.fill_log = reinterpret_cast<int64_t>(base + at.fill_log);
    std::memcpy(init.data(), &h, sizeof h);
    const auto& tables = store_.expert_tables();
    for (int64_t l = 0; l < L; ++l) {
        init[at.tables + size_t(l)] = reinterpret_cast<int64_t>(tables[size_t(l)].t->data);
        for (int64_t e = 0; e < E; ++e)
            init[at.homes + size_t(l * E + e)] = tables[size_t(l)].home[size_t(e)];
    }
    auto* keys = reinterpret_cast<int32_t*>(init.data() + at.slot_keys);
    std::fill(keys, keys + S, -1);
    backend_.copy_to_backend(base, init.data(), init.size() * sizeof(int64_t));
}

void ExpertOffload::attach(Session& session) {
    session.set_expert_cache_hook([this](const RoutingRecord& r) { after_step(r); });
    // Always set, so a session that had another cache's fetch forgets it.
    session.set_expert_fetch(
        state_,
        state_ ? std::function<void(int64_t)>([this](int64_t n) { before_step(n); }) : nullptr);
}

void ExpertOffload::before_step(int64_t n_tokens) {
    if (!state_) return;
    const int64_t L = config_.n_layers, E = config_.n_experts;
    // At most one fill per distinct expert a layer uses.
    const int64_t most = L * std::min<int64_t>(E, n_tokens * top_k_);
    victims_ = cache_->victims(int32_t(std::min<int64_t>(config_.n_slots, most)));
    // A prompt chunk uses nearly every expert of every layer once: an eviction would only
    // make a later layer of the same chunk miss what it evicted, so only free slots are
    // offered and the other misses are read in place (each crosses the link once either way).
    if (n_tokens * top_k_ >= E)
        std::erase_if(victims_, [&](int32_t v) { return slot_key_[size_t(v)] >= 0; });
    counters_ = {int64_t(victims_.size()), 0, 0,
                 0};  // n_victims, next_victim, n_fills, layer_fills
    const StateLayout at(L, E, config_.n_slots);
    auto* base = static_cast<int64_t*>(state_buf_->base());
    if (!victims_.empty())
        backend_.copy_to_backend_async(base + at.victims, victims_.data(),
                                       victims_.size() * sizeof(int32_t));
    backend_.copy_to_backend_async(base, counters_.data(), counters_.size() * sizeof(int64_t));
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

void ExpertOffload::reset() {
    if (transfers_) transfers_->drain();
    backend_.synchronize();
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

void ExpertOffload::replay_device_fills(const RoutingRecord& r) {
    const int32_t L = config_.n_layers, E = config_.n_experts;
    const int64_t per_layer = r.n_tokens * r.k;
    // The header's counters and the fill log, in one download.
    const size_t words = kHeaderWords + victims_.size();
    log_host_.resize(words);
    backend_.download(*state_, log_host_.data(), 0, words * sizeof(int64_t));
    mgl::expert_fetch_header h;
    std::memcpy(&h, log_host_.data(), sizeof h);
    if (h.n_fills < 0 || h.n_fills > int64_t(victims_.size()) || h.next_victim < 0 ||
        h.next_victim > int64_t(victims_.size()))
        throw std::logic_error("expert cache: the device fetch's counters are out of range");
    const auto* log = reinterpret_cast<const int32_t*>(log_host_.data() + kHeaderWords);
    int64_t f = 0;
    std::vector<int64_t> uses(static_cast<size_t>(E));
    for (int32_t l = 0; l < L; ++l) {
        std::fill(uses.begin(), uses.end(), 0);
        for (int64_t i = 0; i < per_layer; ++i) {
            const int32_t e = r.ids[size_t(int64_t(l) * per_layer + i)];
            if (e >= 0 && e < E) ++uses[size_t(e)];
        }
        // The device's order: a layer's experts by increasing id, the fills among them logged.
        for (int32_t e = 0; e < E; ++e) {
            const int64_t u = uses[size_t(e)];
            if (u == 0) continue;
            const int32_t key = l * E + e;
            stats_.accesses += u;
            int64_t hits = u;
            if (f < h.n_fills && log[2 * f] == key) {
                const int32_t slot = log[2 * f + 1];
                ++f;
                occupy(slot, key);
                cache_->place(l, e, slot);
                hits = u - 1;  // the later uses of the chunk find it in its slot
                ++stats_.fills;
                stats_.bytes_filled += blob_bytes_;
            } else if (shadow_[size_t(l)][size_t(e)] == home(l, e)) {
                ++stats_.reads_in_place;
                stats_.bytes_read_in_place += blob_bytes_;
                for (int64_t i = 0; i < u; ++i) cache_->bypass(l, e);
                continue;
            } else {
                stats_.hits += u;
            }
            for (int64_t i = 0; i < hits; ++i) {
                if (cache_->access(l, e, {}, false).outcome != routing::AccessResult::hit)
                    throw std::logic_error("expert cache: the policy lost a resident expert");
            }
        }
    }
    if (f != h.n_fills)
        throw std::logic_error("expert cache: the device's fill log does not follow the routing");
    ++stats_.steps;
}

void ExpertOffload::after_step(const RoutingRecord& r) {
    const int32_t L = config_.n_layers, E = config_.n_experts;
    const int64_t T = r.n_tokens, k = r.k;
    if (int64_t(r.ids.size()) != int64_t(L) * T * k)
        throw std::invalid_argument("expert cache: a routing record of " +
                                    std::to_string(r.ids.size()) + " ids for " + std::to_string(L) +
                                    " layers x " + std::to_string(T) + " tokens x " +
                                    std::to_string(k));
    if (state_) return replay_device_fills(r);
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
