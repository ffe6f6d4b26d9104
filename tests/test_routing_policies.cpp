// The expert-cache policies on hand-made access sequences (expected evictions), pinning, and
// the engine-facing ExpertCache (per-layer slot numbering, prefetch).
#include <doctest/doctest.h>

#include <algorithm>
#include <random>

#include "routing/expert_cache.h"

using namespace minids::routing;

namespace {

// Accesses `keys` one by one without pinning; returns the evicted key of each access (-1:
// none).
template <class P>
std::vector<int32_t> evictions(SlotPool<P>& pool, const std::vector<int32_t>& keys) {
    std::vector<int32_t> out;
    for (int32_t k : keys) out.push_back(pool.access(k, {}, false).evicted);
    return out;
}

}  // namespace

TEST_CASE("routing policy lru: evicts the least recently used") {
    SlotPool<LruPolicy> pool(3, 10);
    // 1 2 3 fill; 1 hit; 4 evicts 2; 5 evicts 3; 2 evicts 1 (4, 5 newer).
    CHECK(evictions(pool, {1, 2, 3, 1, 4, 5, 2}) == std::vector<int32_t>{-1, -1, -1, -1, 2, 3, 1});
    AccessResult r = pool.access(5, {}, false);
    CHECK(r.outcome == AccessResult::hit);
    CHECK(pool.key_in(r.slot) == 5);
}

TEST_CASE("routing policy lfu: counts survive eviction, ties broken by recency") {
    SlotPool<LfuPolicy> pool(3, 10);
    // 1 1 2 3 fill (counts 1:2 2:1 3:1); 4: tie 2/3, 2 is older -> evict 2.
    // 2 again: its count 1 survived -> 2; residents 1(2) 3(1) 4(1): evict 3 (older than 4).
    // 5: residents 1(2) 4(1) 2(2): evict 4. 3: residents 1(2) 2(2) 5(1): evict 5.
    CHECK(evictions(pool, {1, 1, 2, 3, 4, 2, 5, 3}) ==
          std::vector<int32_t>{-1, -1, -1, -1, 2, 3, 4, 5});
    CHECK(pool.policy().count(3) == 2);
    CHECK(pool.policy().count(2) == 2);
}

TEST_CASE("routing policy lfu with frequency admission: a miss must outrank the victim") {
    SlotPool<LfuPolicy> pool(2, 10, LfuPolicy(), /*admission=*/true);
    // 1 1 2 2 fill (counts 2, 2). 3 (count 1) does not outrank the victim (2): bypass, twice
    // (count 2: a tie keeps the victim); the third 3 (count 3) takes 1's slot (1 is older).
    std::vector<AccessResult::Outcome> outcomes;
    for (int32_t k : {1, 1, 2, 2, 3, 3, 3}) outcomes.push_back(pool.access(k, {}, false).outcome);
    using O = AccessResult;
    CHECK(outcomes == std::vector<AccessResult::Outcome>{O::miss, O::hit, O::miss, O::hit,
                                                         O::bypass, O::bypass, O::miss_evicted});
    CHECK(pool.slot_of(3) >= 0);
    CHECK(pool.slot_of(1) < 0);
    CHECK(pool.policy().count(3) == 3);
    // A bypass leaves no pin behind and no slot.
    const AccessResult r = pool.access(7, {}, true);
    CHECK(r.outcome == AccessResult::bypass);
    CHECK(r.slot == -1);
    CHECK_FALSE(pool.pinned(0));
    CHECK_FALSE(pool.pinned(1));
}

TEST_CASE("routing policy decay: a short half-life acts on recency, a long one on frequency") {
    // 1 1 1 2 3 then 4 with 3 slots. Half-life 1 access: 1's decayed count (2^-5 + 2^-4 +
    // 2^-3 = 0.22) is below 2's (0.25), so 1 goes. Half-life 1000: counts 3, 1, 1 -> 2 goes.
    SlotPool<DecayPolicy> short_memory(3, 10, DecayPolicy(1.0));
    CHECK(evictions(short_memory, {1, 1, 1, 2, 3, 4}).back() == 1);
    CHECK(short_memory.policy().count(3, 5) == doctest::Approx(0.5));
    SlotPool<DecayPolicy> long_memory(3, 10, DecayPolicy(1000.0));
    CHECK(evictions(long_memory, {1, 1, 1, 2, 3, 4}).back() == 2);
}

TEST_CASE("routing policy decay: rescaling keeps the order over long runs") {
    // Half-life 2 accesses: the internal increments pass 2^256 after ~512 accesses and are
    // rescaled; the policy must still evict what an exact decayed count says.
    SlotPool<DecayPolicy> pool(2, 4, DecayPolicy(2.0));
    std::vector<int32_t> keys;
    for (int i = 0; i < 3000; ++i) keys.push_back(i % 2);  // 0 1 0 1 ...
    evictions(pool, keys);
    // Now 2: 0 (used at 2998) ranks below 1 (used at 2999).
    CHECK(pool.access(2, {}, false).evicted == 0);
    CHECK(std::isfinite(pool.policy().count(1, 3001)));
}

TEST_CASE("routing policy belady: evicts the farthest next use") {
    SlotPool<BeladyPolicy> pool(2, 10);
    auto at = [](int64_t next) {
        AccessHint h;
        h.next_use = next;
        return h;
    };
    // Sequence 1 2 3 1 2: at 3, 1 is next used at 3 and 2 at 4 -> evict 2.
    pool.access(1, at(3), false);
    pool.access(2, at(4), false);
    CHECK(pool.access(3, at(INT64_MAX), false).evicted == 2);
    CHECK(pool.access(1, at(INT64_MAX), false).outcome == AccessResult::hit);
    // 2: residents 3 and 1 are never used again; either may go.
    const int32_t ev = pool.access(2, at(INT64_MAX), false).evicted;
    CHECK((ev == 3 || ev == 1));
}

TEST_CASE_TEMPLATE("routing policy: a pinned expert is never evicted", P, LruPolicy, LfuPolicy,
                   DecayPolicy, BeladyPolicy) {
    std::mt19937 rng(7);
    SlotPool<P> pool(6, 40);
    std::vector<int32_t> pinned;
    int64_t evicted = 0;
    for (int step = 0; step < 3000; ++step) {
        if (step % 5 == 0) {  // a new step: release the pins
            pool.unpin_all();
            pinned.clear();
        }
        const int32_t key = int32_t(rng() % 40);
        const bool pin = pinned.size() < 5 && rng() % 2 == 0;
        AccessHint h;
        h.next_use = int64_t(rng() % 10000);  // belady: any order, the pins must still hold
        const AccessResult r = pool.access(key, h, pin);
        if (r.evicted >= 0) {
            ++evicted;
            for (int32_t p : pinned) REQUIRE(p != r.evicted);
        }
        REQUIRE(pool.key_in(r.slot) == key);
        if (pin) pinned.push_back(key);
    }
    CHECK(evicted > 1000);
    // All six slots pinned: the next miss cannot be served.
    pool.unpin_all();
    for (int32_t k = 0; k < 6; ++k) pool.access(k, {}, true);
    CHECK_THROWS_AS(pool.access(7, {}, true), std::runtime_error);
    pool.unpin(3);
    CHECK(pool.access(7, {}, true).evicted == 3);
}

TEST_CASE("routing policy: the tail of LRU is skipped while pinned") {
    SlotPool<LruPolicy> pool(2, 10);
    pool.access(1, {}, true);   // least recent, pinned
    pool.access(2, {}, false);  // most recent
    CHECK(pool.access(3, {}, false).evicted == 2);
}

TEST_CASE("routing expert cache: per-layer pools, global slot numbers, evicted keys") {
    CacheConfig c;
    c.policy = Policy::lru;
    c.n_layers = 3;
    c.n_experts = 8;
    c.n_slots = 7;  // per layer: 3, 2, 2
    c.per_layer = true;
    CHECK(per_layer_slots(7, 3) == std::vector<int64_t>{3, 2, 2});
    auto cache = make_expert_cache(c);
    CHECK(cache->access(1, 5).slot == 3);  // layer 1's slots are 3 and 4
    CHECK(cache->access(1, 6).slot == 4);
    cache->unpin_all();
    const AccessResult r = cache->access(1, 7);
    CHECK(r.outcome == AccessResult::miss_evicted);
    CHECK(r.evicted == 1 * 8 + 5);  // key = layer * n_experts + expert
    CHECK(r.slot == 3);
    CHECK(cache->slot_of(1, 5) == -1);
    CHECK(cache->slot_of(1, 7) == 3);
    // Layer 0's pool is untouched by layer 1's misses.
    CHECK(cache->access(0, 1).outcome == AccessResult::miss);
    CHECK(cache->access(0, 1).outcome == AccessResult::hit);
    CHECK_THROWS_AS(cache->access(3, 0), std::out_of_range);
    CHECK_THROWS_AS(cache->access(0, 8), std::out_of_range);
}

TEST_CASE("routing expert cache: prefetch loads without counting a use") {
    CacheConfig c;
    c.policy = Policy::lfu;
    c.n_layers = 1;
    c.n_experts = 8;
    c.n_slots = 2;
    auto cache = make_expert_cache(c);
    cache->access(0, 1);
    cache->access(0, 1);
    cache->unpin_all();
    CHECK(cache->prefetch(0, 2).outcome == AccessResult::miss);  // count of 2 stays 0
    CHECK(cache->prefetch(0, 2).outcome == AccessResult::hit);
    CHECK(cache->access(0, 3).evicted == 2);  // 2 (never used) goes before 1 (used twice)
}

TEST_CASE("routing expert cache: configurations that cannot work are refused") {
    CacheConfig c;
    c.n_layers = 26;
    c.n_experts = 64;
    c.n_slots = 26 * 64 + 1;
    CHECK_THROWS_AS(check_config(c), std::invalid_argument);
    c.n_slots = 130;
    c.per_layer = true;
    CHECK_NOTHROW(check_config(c, 5));
    CHECK_THROWS_AS(check_config(c, 6), std::invalid_argument);  // 5 per layer < top-6
    c.per_layer = false;
    CHECK_NOTHROW(check_config(c, 6));
    CHECK(parse_policy("decay") == Policy::decay);
    CHECK_THROWS_AS(parse_policy("fifo"), std::invalid_argument);
    c.admit = Admission::frequency;  // lru has no ranking of absent experts
    c.policy = Policy::lru;
    CHECK_THROWS_AS(check_config(c, 6), std::invalid_argument);
    c.policy = Policy::decay;
    CHECK_NOTHROW(check_config(c, 6));
    CHECK(parse_admission("frequency") == Admission::frequency);
    CHECK_THROWS_AS(parse_admission("some"), std::invalid_argument);
}

TEST_CASE_TEMPLATE("routing policy: victims() lists the free slots, then the policy's ranking", P,
                   LruPolicy, LfuPolicy, DecayPolicy, BeladyPolicy) {
    std::mt19937 rng(11);
    SlotPool<P> pool(8, 30);
    for (int i = 0; i < 5; ++i) {  // 5 of 8 slots filled: 5, 6, 7 are free
        AccessHint h;
        h.next_use = int64_t(rng() % 100);
        pool.access(int32_t(i), h, false);
    }
    std::vector<int32_t> v = pool.victims(4);
    REQUIRE(v.size() == 4);
    CHECK(v[0] == 5);
    CHECK(v[1] == 6);
    CHECK(v[2] == 7);
    for (int step = 0; step < 400; ++step) {
        AccessHint h;
        h.next_use = int64_t(rng() % 1000);
        pool.access(int32_t(rng() % 30), h, false);
    }
    // Full pool: the ranking is the order in which victim() picks slots when each pick is
    // treated as pinned for the next one.
    v = pool.victims(8);
    REQUIRE(v.size() == 8);
    std::vector<int32_t> expected;
    for (int i = 0; i < 8; ++i) {
        expected.push_back(pool.policy().victim([&](int32_t s) {
            return std::find(expected.begin(), expected.end(), s) != expected.end();
        }));
    }
    CHECK(v == expected);
    CHECK(pool.victims(3) == std::vector<int32_t>(expected.begin(), expected.begin() + 3));
}

TEST_CASE("routing policy: place() records the engine's fills, bypass() counts a use") {
    SlotPool<LfuPolicy> pool(3, 10);
    CHECK(pool.victims(5) == std::vector<int32_t>{0, 1, 2});
    CHECK_THROWS_AS(pool.place(4, 1), std::logic_error);  // free slots are taken in order
    CHECK(pool.place(4, 0).outcome == AccessResult::miss);
    pool.access(4, {}, false);  // count of 4: 2
    CHECK(pool.place(5, 1).outcome == AccessResult::miss);
    CHECK(pool.place(6, 2).outcome == AccessResult::miss);
    CHECK_THROWS_AS(pool.place(5, 0), std::logic_error);  // 5 is resident
    // 5 and 6 have one use each, 5 is older: evicted first, then 6, then 4.
    CHECK(pool.victims(3) == std::vector<int32_t>{1, 2, 0});
    const AccessResult r = pool.place(7, 2);  // the engine may take any listed slot
    CHECK(r.outcome == AccessResult::miss_evicted);
    CHECK(r.evicted == 6);
    CHECK(pool.slot_of(6) == -1);
    CHECK(pool.key_in(2) == 7);
    CHECK(pool.access(7, {}, false).outcome == AccessResult::hit);
    pool.bypass(9);
    pool.bypass(9);
    CHECK(pool.policy().count(9) == 2);
    CHECK(pool.slot_of(9) == -1);
}

TEST_CASE("routing expert cache: the device fetch's interface needs one global pool") {
    CacheConfig c;
    c.policy = Policy::decay;
    c.n_layers = 2;
    c.n_experts = 4;
    c.n_slots = 4;
    auto global = make_expert_cache(c);
    CHECK(global->victims(2) == std::vector<int32_t>{0, 1});
    CHECK(global->place(1, 3, 0).slot == 0);
    CHECK(global->slot_of(1, 3) == 0);
    CHECK_THROWS_AS(global->place(1, 3, 4), std::out_of_range);
    c.per_layer = true;
    auto layered = make_expert_cache(c);
    CHECK_THROWS_AS(layered->victims(2), std::logic_error);
    CHECK_THROWS_AS(layered->place(0, 0, 0), std::logic_error);
}

TEST_CASE("routing policy: ranks and arrival ranks order slots as the policy evicts them") {
    // LFU: a slot's rank is (count, last access); an arriving key ranks with one more use.
    SlotPool<LfuPolicy> lfu(2, 10);
    for (int32_t k : {1, 1, 1, 2}) lfu.access(k, {}, false);
    CHECK(lfu.rank(lfu.slot_of(1)).first == 3.0);
    CHECK(lfu.rank(lfu.slot_of(2)).first == 1.0);
    lfu.bypass(7);
    std::vector<Rank> arrival(10);
    lfu.arrival_ranks(arrival);
    CHECK(arrival[7].first == 2.0);  // one bypassed use, one more on arrival
    CHECK(arrival[7] < lfu.rank(lfu.slot_of(1)));
    CHECK(lfu.rank(lfu.slot_of(2)) < arrival[7]);
    // Decay: a key with many recent uses arrives above a resident used once long ago.
    SlotPool<DecayPolicy> decay(2, 10, DecayPolicy(4.0));
    decay.access(1, {}, false);
    decay.access(2, {}, false);
    for (int i = 0; i < 20; ++i) decay.bypass(5);
    for (int i = 0; i < 20; ++i) decay.access(2, {}, false);
    decay.arrival_ranks(arrival);
    CHECK(decay.rank(decay.slot_of(1)) < arrival[5]);
    CHECK(decay.victims(1) == std::vector<int32_t>{decay.slot_of(1)});
    // LRU: an arrival is the most recent; it never ranks below a resident.
    SlotPool<LruPolicy> lru(2, 10);
    lru.access(1, {}, false);
    lru.access(2, {}, false);
    CHECK(lru.rank(lru.slot_of(1)) < lru.rank(lru.slot_of(2)));
    lru.arrival_ranks(arrival);
    CHECK(lru.rank(lru.slot_of(2)) < arrival[3]);
}
