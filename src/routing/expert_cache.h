// The expert cache's bookkeeping, the same objects for the offline simulator and the GPU expert
// cache: which expert of which MoE layer sits in which slot, which slots are pinned, and which
// slot to evict (a policy from policies.h).
//
// A pool has n_slots slots. access(key) answers hit (the expert's slot), miss (a free slot to
// load it into) or miss_evicted (a slot whose previous expert was dropped; `evicted` names it).
// A pinned slot (an expert the current step still reads) is never chosen for eviction; pins
// are counted and released by unpin / unpin_all. The cache is either one pool shared by all
// MoE layers (global) or one fixed pool per layer (slots split as evenly as possible); slot
// numbers are global either way (per-layer pools are laid out layer after layer).
//
//     auto cache = make_expert_cache({.policy = Policy::lru, .n_layers = 26, .n_experts = 64,
//                                     .n_slots = 980});
//     for (int e : experts_of_this_token_and_layer) {
//         AccessResult r = cache->access(layer, e);  // pinned until unpin_all()
//         if (r.outcome != AccessResult::hit) copy_expert(layer, e, r.slot);
//     }
//     ... once the step's kernels are done with the slots: cache->unpin_all();
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "routing/policies.h"

namespace minids::routing {

enum class Policy { lru, lfu, decay, belady };
const char* policy_name(Policy p);
// "lru", "lfu", "decay", "belady"; throws std::invalid_argument otherwise.
Policy parse_policy(const std::string& name);
// The online policies (the ones an engine can run): every policy but belady.
bool policy_is_online(Policy p);

struct AccessResult {
    // bypass: a miss the admission rule kept out of the pool (used in place, not loaded).
    enum Outcome : uint8_t { hit, miss, miss_evicted, bypass };
    Outcome outcome = hit;
    int32_t slot = -1;     // where the expert is (hit) or must be loaded (a miss); -1: bypass
    int32_t evicted = -1;  // the key that was in `slot` (miss_evicted), else -1
};

// One pool of slots driven by policy P.
template <class P>
class SlotPool {
public:
    // `admission`: a miss with a full pool replaces the victim only when the policy ranks it
    // higher (P::admits); otherwise the access is a bypass.
    SlotPool(int32_t n_slots, int32_t n_keys, P policy = P(), bool admission = false)
        : policy_(std::move(policy)), admission_(admission) {
        if (n_slots < 1) throw std::invalid_argument("expert cache: a pool needs at least 1 slot");
        slot_of_key_.assign(size_t(n_keys), -1);
        key_of_slot_.assign(size_t(n_slots), -1);
        pins_.assign(size_t(n_slots), 0);
        policy_.init(n_slots, n_keys);
    }

    // Looks the key up, loads it on a miss (evicting the policy's victim when the pool is
    // full) and, with `pin`, pins its slot. Throws when every slot is pinned.
    AccessResult access(int32_t key, AccessHint hint = {}, bool pin = true) {
        // A prefetch (no use) does not advance the clock: decay's half-life and the recency
        // order stay counted in real uses, so prefetching changes no policy's sense of time.
        hint.now = hint.use ? now_++ : now_;
        AccessResult r;
        int32_t s = slot_of_key_[size_t(key)];
        if (s >= 0) {
            policy_.on_hit(s, key, hint);
            r.slot = s;
        } else {
            if (n_filled_ < int32_t(key_of_slot_.size())) {
                s = n_filled_++;
                r.outcome = AccessResult::miss;
            } else {
                s = policy_.victim([this](int32_t slot) { return pins_[size_t(slot)] != 0; });
                if (s < 0) {
                    throw std::runtime_error(
                        "expert cache: every slot is pinned; release pins or add slots");
                }
                if (admission_ && !policy_.admits(key, s, key_of_slot_[size_t(s)], hint)) {
                    r.outcome = AccessResult::bypass;
                    return r;
                }
                r.outcome = AccessResult::miss_evicted;
                r.evicted = key_of_slot_[size_t(s)];
                slot_of_key_[size_t(r.evicted)] = -1;
            }
            slot_of_key_[size_t(key)] = s;
            key_of_slot_[size_t(s)] = key;
            policy_.on_fill(s, key, hint);
            r.slot = s;
        }
        if (pin) pin_slot(s);
        return r;
    }
    // Pins a resident key without counting a use (nothing in the policy moves); false when
    // the key is not resident.
    bool pin(int32_t key) {
        const int32_t s = slot_of_key_[size_t(key)];
        if (s < 0) return false;
        pin_slot(s);
        return true;
    }
    void unpin(int32_t key) {
        const int32_t s = slot_of_key_[size_t(key)];
        if (s < 0 || pins_[size_t(s)] == 0) throw std::logic_error("expert cache: not pinned");
        // pinned_ may keep the slot listed; unpin_all skips it harmlessly
        if (--pins_[size_t(s)] == 0) --n_pinned_;
    }
    void unpin_all() {
        for (int32_t s : pinned_) pins_[size_t(s)] = 0;
        pinned_.clear();
        n_pinned_ = 0;
    }
    // Slots with at least one pin: when it equals n_slots() a miss has no victim.
    int32_t n_pinned() const { return n_pinned_; }
    // For an engine that fills slots on the device (the expert cache's device fetch): the next
    // `n` slots this pool would fill, in that order: the free slots, then the policy's victims
    // from the lowest ranked up. Pins are not consulted (such an engine pins nothing between
    // steps; the device skips a victim whose expert the current layer uses).
    std::vector<int32_t> victims(int32_t n) const {
        std::vector<int32_t> out;
        for (int32_t s = n_filled_; s < n_slots() && int32_t(out.size()) < n; ++s) out.push_back(s);
        if (int32_t(out.size()) < n) policy_.ranked(n - int32_t(out.size()), out);
        return out;
    }
    // Records that the engine put `key` into `slot` (one of victims()' slots; a free one in
    // their order), evicting its occupant: a miss, as access() would count it.
    AccessResult place(int32_t key, int32_t slot, AccessHint hint = {}) {
        if (slot_of_key_[size_t(key)] >= 0)
            throw std::logic_error("expert cache: placing an expert that is resident");
        AccessResult r;
        if (key_of_slot_[size_t(slot)] < 0) {
            if (slot != n_filled_)
                throw std::logic_error("expert cache: free slots must be filled in order");
            ++n_filled_;
            r.outcome = AccessResult::miss;
        } else {
            r.outcome = AccessResult::miss_evicted;
            r.evicted = key_of_slot_[size_t(slot)];
            slot_of_key_[size_t(r.evicted)] = -1;
        }
        hint.now = now_++;
        slot_of_key_[size_t(key)] = slot;
        key_of_slot_[size_t(slot)] = key;
        policy_.on_fill(slot, key, hint);
        r.slot = slot;
        return r;
    }
    // The slot's place in the eviction order, and the place every key (out: one per key) would
    // take if filled at the next access (the device fetch ranks a step's arrivals against its
    // victims with them).
    Rank rank(int32_t slot) const { return policy_.rank(slot); }
    void arrival_ranks(std::span<Rank> out) const { policy_.arrival_ranks(now_, out); }
    // A use of a key that the engine kept out of the pool (read in place): counted by the
    // policies that count uses, nothing moves.
    void bypass(int32_t key, AccessHint hint = {}) {
        hint.now = now_++;
        policy_.on_bypass(key, hint);
    }
    int32_t slot_of(int32_t key) const { return slot_of_key_[size_t(key)]; }
    int32_t key_in(int32_t slot) const { return key_of_slot_[size_t(slot)]; }
    bool pinned(int32_t slot) const { return pins_[size_t(slot)] != 0; }
    int32_t n_slots() const { return int32_t(key_of_slot_.size()); }
    P& policy() { return policy_; }

private:
    void pin_slot(int32_t s) {
        if (pins_[size_t(s)]++ == 0) {
            pinned_.push_back(s);
            ++n_pinned_;
        }
    }
    P policy_;
    bool admission_ = false;
    int32_t n_pinned_ = 0;
    std::vector<int32_t> slot_of_key_, key_of_slot_;
    std::vector<uint32_t> pins_;
    std::vector<int32_t> pinned_;
    int32_t n_filled_ = 0;
    uint64_t now_ = 0;
};

// Which misses take a slot: every one (each miss evicts the victim), or only those the policy
// ranks above the victim (`frequency`: a higher LFU count or decayed count; belady: an earlier
// next use, which makes it the optimum with bypass). A refused miss is a bypass: in the engine
// it is read in place and costs no copy.
enum class Admission { all, frequency };
const char* admission_name(Admission a);
// "all", "frequency"; throws std::invalid_argument otherwise.
Admission parse_admission(const std::string& name);

struct CacheConfig {
    Policy policy = Policy::lru;
    int32_t n_layers = 1;   // MoE layers
    int32_t n_experts = 1;  // routed experts per layer
    int64_t n_slots = 1;    // total, over all layers
    bool per_layer = false;
    Admission admit = Admission::all;
    // decay: counts halve every this many accesses to one layer's experts (k per token), for
    // global and per-layer pools alike.
    double decay_half_life = 128;
};

// Slots of the per-layer pools: n_slots split as evenly as possible, the first layers taking
// one more when it does not divide.
std::vector<int64_t> per_layer_slots(int64_t n_slots, int32_t n_layers);
// Throws std::invalid_argument with a sentence when the configuration cannot work (fewer slots
// than `min_slots_per_pool` in some pool, more slots than experts, ...).
void check_config(const CacheConfig& c, int32_t min_slots_per_pool = 1);

// A policy object for one pool serving `layers_in_pool` layers.
template <class P>
P make_policy(const CacheConfig& c, int32_t layers_in_pool);

template <>
inline LruPolicy make_policy<LruPolicy>(const CacheConfig&, int32_t) {
    return {};
}
template <>
inline LfuPolicy make_policy<LfuPolicy>(const CacheConfig&, int32_t) {
    return {};
}
template <>
inline DecayPolicy make_policy<DecayPolicy>(const CacheConfig& c, int32_t layers_in_pool) {
    return DecayPolicy(c.decay_half_life, 1.0 / layers_in_pool);
}
template <>
inline BeladyPolicy make_policy<BeladyPolicy>(const CacheConfig&, int32_t) {
    return {};
}

// One global pool, or one pool per layer, behind (layer, expert) addressing.
template <class P>
class LayeredPools {
public:
    explicit LayeredPools(const CacheConfig& c) : n_experts_(c.n_experts) {
        const bool admission = c.admit == Admission::frequency;
        if (!c.per_layer) {
            pools_.emplace_back(int32_t(c.n_slots), c.n_layers * c.n_experts,
                                make_policy<P>(c, c.n_layers), admission);
            offset_.push_back(0);
        } else {
            int64_t at = 0;
            for (int64_t n : per_layer_slots(c.n_slots, c.n_layers)) {
                pools_.emplace_back(int32_t(n), c.n_experts, make_policy<P>(c, 1), admission);
                offset_.push_back(int32_t(at));
                at += n;
            }
        }
    }
    AccessResult access(int32_t layer, int32_t expert, const AccessHint& h, bool pin) {
        if (pools_.size() == 1) return pools_[0].access(layer * n_experts_ + expert, h, pin);
        AccessResult r = pools_[size_t(layer)].access(expert, h, pin);
        if (r.slot >= 0) r.slot += offset_[size_t(layer)];
        if (r.evicted >= 0) r.evicted += layer * n_experts_;
        return r;
    }
    void unpin(int32_t layer, int32_t expert) {
        if (pools_.size() == 1) return pools_[0].unpin(layer * n_experts_ + expert);
        pools_[size_t(layer)].unpin(expert);
    }
    void unpin_all() {
        for (auto& p : pools_) p.unpin_all();
    }
    bool pin(int32_t layer, int32_t expert) {
        if (pools_.size() == 1) return pools_[0].pin(layer * n_experts_ + expert);
        return pools_[size_t(layer)].pin(expert);
    }
    // Whether every slot of the pool serving `layer` is pinned (a miss there has no victim).
    bool full_of_pins(int32_t layer) const {
        const SlotPool<P>& p = pools_[pools_.size() == 1 ? 0 : size_t(layer)];
        return p.n_pinned() >= p.n_slots();
    }
    // Device fetch (SlotPool::victims / place / bypass): a global pool only.
    std::vector<int32_t> victims(int32_t n) const { return global().victims(n); }
    AccessResult place(int32_t layer, int32_t expert, int32_t slot, const AccessHint& h) {
        return global().place(layer * n_experts_ + expert, slot, h);
    }
    void bypass(int32_t layer, int32_t expert, const AccessHint& h) {
        global().bypass(layer * n_experts_ + expert, h);
    }
    Rank rank(int32_t slot) const { return global().rank(slot); }
    void arrival_ranks(std::span<Rank> out) const { global().arrival_ranks(out); }
    // Releases the pins of the pool that serves `layer` (all pins, for a global pool).
    void unpin_layer(int32_t layer) { pools_[pools_.size() == 1 ? 0 : size_t(layer)].unpin_all(); }
    int32_t slot_of(int32_t layer, int32_t expert) const {
        if (pools_.size() == 1) return pools_[0].slot_of(layer * n_experts_ + expert);
        const int32_t s = pools_[size_t(layer)].slot_of(expert);
        return s < 0 ? -1 : s + offset_[size_t(layer)];
    }

private:
    const SlotPool<P>& global() const {
        if (pools_.size() != 1)
            throw std::logic_error("expert cache: the device fetch needs one global pool");
        return pools_[0];
    }
    SlotPool<P>& global() { return const_cast<SlotPool<P>&>(std::as_const(*this).global()); }
    int32_t n_experts_;
    std::vector<SlotPool<P>> pools_;
    std::vector<int32_t> offset_;
};

// The engine's view: a type-erased cache over (layer, expert). Layer is the MoE layer's index
// among MoE layers (0 = the first MoE layer).
class ExpertCache {
public:
    virtual ~ExpertCache() = default;
    virtual AccessResult access(int32_t layer, int32_t expert, const AccessHint& hint = {},
                                bool pin = true) = 0;
    // Loads the expert if absent without counting a use (hit: it was already resident).
    AccessResult prefetch(int32_t layer, int32_t expert, bool pin = false) {
        AccessHint h;
        h.use = false;
        return access(layer, expert, h, pin);
    }
    virtual void unpin(int32_t layer, int32_t expert) = 0;
    virtual void unpin_all() = 0;
    // The expert's slot, or -1 when it is not resident.
    virtual int32_t slot_of(int32_t layer, int32_t expert) const = 0;
    // For an engine that fills slots on the device (one global pool only; see SlotPool): the
    // next n slots to fill, in order; the record of a fill the engine made; a use it read in
    // place without a slot.
    virtual std::vector<int32_t> victims(int32_t n) const = 0;
    // The staging store's victims, where every miss of a step must get one (a slot filled for
    // an earlier layer of the step may be taken again): victims() of all slots, or of n when
    // fewer, repeated in that order to n entries.
    std::vector<int32_t> victims_repeated(int64_t n) const;
    virtual AccessResult place(int32_t layer, int32_t expert, int32_t slot,
                               const AccessHint& hint = {}) = 0;
    virtual void bypass(int32_t layer, int32_t expert, const AccessHint& hint = {}) = 0;
    // A filled slot's place in the eviction order, and the place an expert would take if it
    // were filled at the next access (one global pool).
    virtual Rank rank(int32_t slot) const = 0;
    // out: one rank per key (layer · n_experts + expert).
    virtual void arrival_ranks(std::span<Rank> out) const = 0;
    const CacheConfig& config() const { return config_; }

protected:
    explicit ExpertCache(const CacheConfig& c) : config_(c) {}
    CacheConfig config_;
};

std::unique_ptr<ExpertCache> make_expert_cache(const CacheConfig& c);

}  // namespace minids::routing
