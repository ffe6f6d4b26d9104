#include "routing/expert_cache.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace minids::routing {

const char* policy_name(Policy p) {
    switch (p) {
        case Policy::lru:
            return "lru";
        case Policy::lfu:
            return "lfu";
        case Policy::decay:
            return "decay";
        case Policy::belady:
            return "belady";
    }
    return "?";
}

Policy parse_policy(const std::string& name) {
    for (Policy p : {Policy::lru, Policy::lfu, Policy::decay, Policy::belady}) {
        if (name == policy_name(p)) return p;
    }
    throw std::invalid_argument("unknown policy \"" + name +
                                "\" (expected lru, lfu, decay or belady)");
}

bool policy_is_online(Policy p) { return p != Policy::belady; }

const char* admission_name(Admission a) { return a == Admission::all ? "all" : "frequency"; }

Admission parse_admission(const std::string& name) {
    for (Admission a : {Admission::all, Admission::frequency})
        if (name == admission_name(a)) return a;
    throw std::invalid_argument("unknown admission \"" + name + "\" (expected all or frequency)");
}

std::vector<int64_t> per_layer_slots(int64_t n_slots, int32_t n_layers) {
    std::vector<int64_t> s(size_t(n_layers), n_slots / n_layers);
    for (int64_t l = 0; l < n_slots % n_layers; ++l) ++s[size_t(l)];
    return s;
}

void check_config(const CacheConfig& c, int32_t min_slots_per_pool) {
    if (c.n_layers < 1 || c.n_experts < 1) {
        throw std::invalid_argument("expert cache: needs at least one layer and one expert");
    }
    const int64_t n_keys = int64_t(c.n_layers) * c.n_experts;
    if (c.n_slots > n_keys) {
        throw std::invalid_argument("expert cache: " + std::to_string(c.n_slots) +
                                    " slots are more than the " + std::to_string(n_keys) +
                                    " experts");
    }
    const int64_t smallest = c.per_layer ? c.n_slots / c.n_layers : c.n_slots;
    if (smallest < min_slots_per_pool) {
        throw std::invalid_argument(
            "expert cache: " + std::to_string(c.n_slots) + " slots " +
            (c.per_layer ? "split over " + std::to_string(c.n_layers) + " layers give " +
                               std::to_string(smallest) + " per layer, fewer"
                         : std::string("are fewer")) +
            " than the " + std::to_string(min_slots_per_pool) + " a step pins (top-k)");
    }
    if (c.admit == Admission::frequency && c.policy == Policy::lru) {
        throw std::invalid_argument(
            "expert cache: lru keeps no counts to admit by; frequency admission needs lfu, "
            "decay or belady");
    }
    if (!(c.decay_half_life > 0)) {
        throw std::invalid_argument("expert cache: the decay half-life must be positive");
    }
}

namespace {

template <class P>
class CacheImpl final : public ExpertCache {
public:
    explicit CacheImpl(const CacheConfig& c) : ExpertCache(c), pools_(c) {}
    AccessResult access(int32_t layer, int32_t expert, const AccessHint& hint, bool pin) override {
        check(layer, expert);
        return pools_.access(layer, expert, hint, pin);
    }
    void unpin(int32_t layer, int32_t expert) override {
        check(layer, expert);
        pools_.unpin(layer, expert);
    }
    void unpin_all() override { pools_.unpin_all(); }
    int32_t slot_of(int32_t layer, int32_t expert) const override {
        check(layer, expert);
        return pools_.slot_of(layer, expert);
    }
    std::vector<int32_t> victims(int32_t n) const override { return pools_.victims(n); }
    AccessResult place(int32_t layer, int32_t expert, int32_t slot,
                       const AccessHint& hint) override {
        check(layer, expert);
        if (slot < 0 || slot >= config_.n_slots)
            throw std::out_of_range("expert cache: slot " + std::to_string(slot) + " out of range");
        return pools_.place(layer, expert, slot, hint);
    }
    void bypass(int32_t layer, int32_t expert, const AccessHint& hint) override {
        check(layer, expert);
        pools_.bypass(layer, expert, hint);
    }
    Rank rank(int32_t slot) const override { return pools_.rank(slot); }
    void arrival_ranks(std::span<Rank> out) const override {
        if (int64_t(out.size()) != int64_t(config_.n_layers) * config_.n_experts)
            throw std::invalid_argument("expert cache: arrival_ranks needs one rank per expert");
        pools_.arrival_ranks(out);
    }

private:
    void check(int32_t layer, int32_t expert) const {
        if (layer < 0 || layer >= config_.n_layers || expert < 0 || expert >= config_.n_experts) {
            throw std::out_of_range("expert cache: layer " + std::to_string(layer) + ", expert " +
                                    std::to_string(expert) + " out of range");
        }
    }
    LayeredPools<P> pools_;
};

}  // namespace

std::vector<int32_t> ExpertCache::victims_repeated(int64_t n) const {
    const auto first = int32_t(std::min<int64_t>(config_.n_slots, n));
    const std::vector<int32_t> order = victims(first);
    if (int32_t(order.size()) != first)
        throw std::logic_error("expert cache: the policy offered " + std::to_string(order.size()) +
                               " of " + std::to_string(first) + " victims");
    std::vector<int32_t> out(static_cast<size_t>(n));
    for (size_t i = 0; i < out.size(); ++i) out[i] = order[i % order.size()];
    return out;
}

std::unique_ptr<ExpertCache> make_expert_cache(const CacheConfig& c) {
    check_config(c);
    switch (c.policy) {
        case Policy::lru:
            return std::make_unique<CacheImpl<LruPolicy>>(c);
        case Policy::lfu:
            return std::make_unique<CacheImpl<LfuPolicy>>(c);
        case Policy::decay:
            return std::make_unique<CacheImpl<DecayPolicy>>(c);
        case Policy::belady:
            return std::make_unique<CacheImpl<BeladyPolicy>>(c);
    }
    throw std::invalid_argument("expert cache: unknown policy");
}

}  // namespace minids::routing
