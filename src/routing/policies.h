// Eviction policies of the expert cache. A policy orders the filled slots of one pool and names
// the slot to evict; the pool (expert_cache.h) owns which expert sits in which slot and which
// slots are pinned. Every policy implements
//     void init(int32_t n_slots, int32_t n_keys);
//     void on_hit(int32_t slot, int32_t key, const AccessHint& h);   // the expert was resident
//     void on_fill(int32_t slot, int32_t key, const AccessHint& h);  // it was loaded into slot
//     template <class Pinned> int32_t victim(Pinned is_pinned);     // an unpinned slot to evict
//     // admission by rank (CacheConfig::admit == Admission::frequency): on a miss with a full
//     // pool, whether `key` should replace the victim; when it says no it has counted the use
//     bool admits(int32_t key, int32_t victim_slot, int32_t victim_key, const AccessHint& h);
//     // for an engine that evicts on the device (the expert cache's device fetch):
//     void ranked(int32_t n, std::vector<int32_t>& out);  // the n lowest-ranked slots, in order
//     void on_bypass(int32_t key, const AccessHint& h);    // a use of a key kept out of the pool
//     Rank rank(int32_t slot);                 // the slot's place in the order (lower goes first)
//     void arrival_ranks(uint64_t now, std::span<Rank> out);  // each key's rank if filled now
// with O(1) (LRU) or O(log n) (heap policies) work per call; victim also skips the pinned slots
// it meets first, so it costs O(p) or O(p log p) more when p pinned slots rank lowest. A key is
// layer · n_experts + expert; knowledge about keys (LFU counts, decayed scores) survives their
// eviction. Time is counted in accesses of the pool (`AccessHint::now`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

namespace minids::routing {

// A slot's place in a policy's eviction order: lower (priority, then stamp) is evicted first.
using Rank = std::pair<double, uint64_t>;
constexpr Rank never_evicted{std::numeric_limits<double>::infinity(), 0};

struct AccessHint {
    uint64_t now = 0;  // the pool's access counter (set by the pool)
    // Belady: the access index at which this key is next used (never: max).
    int64_t next_use = std::numeric_limits<int64_t>::max();
    float weight = 1.0f;  // the router's weight for this expert on this token (unused by the
                          // policies here; weighting decay by it did not help, see the docs)
    bool use = true;      // false for a prefetch: loads the expert without counting a use
};

// Doubly linked list of slots, most recently used first.
class LruPolicy {
public:
    void init(int32_t n_slots, int32_t /*n_keys*/) {
        prev_.assign(size_t(n_slots), -1);
        next_.assign(size_t(n_slots), -1);
        linked_.assign(size_t(n_slots), 0);
        stamp_.assign(size_t(n_slots), 0);
        head_ = tail_ = -1;
    }
    void on_hit(int32_t slot, int32_t, const AccessHint& h) {
        if (!h.use) return;
        move_to_front(slot);
        stamp_[size_t(slot)] = h.now;
    }
    void on_fill(int32_t slot, int32_t, const AccessHint& h) {
        move_to_front(slot);
        stamp_[size_t(slot)] = h.now;
    }
    // LRU keeps no ranking of absent keys to admit by (check_config refuses the combination).
    bool admits(int32_t, int32_t, int32_t, const AccessHint&) { return true; }
    template <class Pinned>
    int32_t victim(Pinned is_pinned) const {
        int32_t s = tail_;
        while (s >= 0 && is_pinned(s)) s = prev_[size_t(s)];
        return s;
    }
    void ranked(int32_t n, std::vector<int32_t>& out) const {
        for (int32_t s = tail_; s >= 0 && n > 0; s = prev_[size_t(s)], --n) out.push_back(s);
    }
    void on_bypass(int32_t, const AccessHint&) {}
    Rank rank(int32_t slot) const { return {double(stamp_[size_t(slot)]), 0}; }
    // An arrival is the most recent: never ranked below a resident.
    void arrival_ranks(uint64_t, std::span<Rank> out) const {
        std::fill(out.begin(), out.end(), never_evicted);
    }

private:
    void move_to_front(int32_t s) {
        if (head_ == s) return;
        if (linked_[size_t(s)]) {  // unlink
            const int32_t p = prev_[size_t(s)], n = next_[size_t(s)];
            if (p >= 0) next_[size_t(p)] = n;
            if (n >= 0) prev_[size_t(n)] = p;
            if (tail_ == s) tail_ = p;
        }
        linked_[size_t(s)] = 1;
        prev_[size_t(s)] = -1;
        next_[size_t(s)] = head_;
        if (head_ >= 0) prev_[size_t(head_)] = s;
        head_ = s;
        if (tail_ < 0) tail_ = s;
    }
    std::vector<int32_t> prev_, next_;
    std::vector<uint8_t> linked_;
    std::vector<uint64_t> stamp_;  // the access that last moved each slot to the front
    int32_t head_ = -1, tail_ = -1;
};

// Binary min-heap of slots by (priority, stamp), with each slot's position kept so a slot's
// priority can change in O(log n). Keys are stored in the heap array itself, so a sift walks
// contiguous memory.
class SlotHeap {
public:
    void init(int32_t n_slots) {
        heap_.clear();
        heap_.reserve(size_t(n_slots));
        pos_.assign(size_t(n_slots), -1);
    }
    void set(int32_t slot, double prio, uint64_t stamp) {
        int32_t i = pos_[size_t(slot)];
        const Entry e{prio, stamp, slot};
        if (i < 0) {
            i = int32_t(heap_.size());
            heap_.push_back(e);
            pos_[size_t(slot)] = i;
            sift_up(i);
            return;
        }
        const bool up = less(e, heap_[size_t(i)]);
        heap_[size_t(i)] = e;
        if (up) {
            sift_up(i);
        } else {
            sift_down(i);
        }
    }
    // Multiplies every priority by f > 0 (order is kept).
    void scale(double f) {
        for (Entry& e : heap_) e.prio *= f;
    }
    // The lowest-ranked slot for which is_pinned is false (best-first search from the root, so
    // only the pinned slots ranked below it are looked at); -1 when every slot is pinned.
    template <class Pinned>
    int32_t lowest_unpinned(Pinned is_pinned) {
        if (heap_.empty()) return -1;
        if (!is_pinned(heap_[0].slot)) return heap_[0].slot;
        frontier_.clear();
        frontier_.push_back(0);
        while (!frontier_.empty()) {
            size_t best = 0;  // the frontier stays small (pinned slots + 1), a scan is enough
            for (size_t j = 1; j < frontier_.size(); ++j)
                if (less(heap_[size_t(frontier_[j])], heap_[size_t(frontier_[best])])) best = j;
            const int32_t i = frontier_[best];
            frontier_[best] = frontier_.back();
            frontier_.pop_back();
            if (!is_pinned(heap_[size_t(i)].slot)) return heap_[size_t(i)].slot;
            for (int32_t c : {2 * i + 1, 2 * i + 2})
                if (c < int32_t(heap_.size())) frontier_.push_back(c);
        }
        return -1;
    }

    // The slot's rank: (priority, stamp), lower is evicted first.
    Rank rank(int32_t slot) const {
        const Entry& e = heap_[size_t(pos_[size_t(slot)])];
        return {e.prio, e.stamp};
    }
    // Appends the n lowest-ranked slots, lowest first: a best-first walk from the root with a
    // small heap of candidates, O(n log n).
    void lowest(int32_t n, std::vector<int32_t>& out) const {
        auto later = [this](int32_t a, int32_t b) {
            return less(heap_[size_t(b)], heap_[size_t(a)]);
        };
        frontier_.clear();
        if (!heap_.empty()) frontier_.push_back(0);
        while (n > 0 && !frontier_.empty()) {
            std::pop_heap(frontier_.begin(), frontier_.end(), later);
            const int32_t i = frontier_.back();
            frontier_.pop_back();
            out.push_back(heap_[size_t(i)].slot);
            --n;
            for (int32_t c : {2 * i + 1, 2 * i + 2}) {
                if (c >= int32_t(heap_.size())) continue;
                frontier_.push_back(c);
                std::push_heap(frontier_.begin(), frontier_.end(), later);
            }
        }
    }

private:
    struct Entry {
        double prio;
        uint64_t stamp;
        int32_t slot;
    };
    static bool less(const Entry& a, const Entry& b) {
        return a.prio < b.prio || (a.prio == b.prio && a.stamp < b.stamp);
    }
    void place(int32_t i, const Entry& e) {
        heap_[size_t(i)] = e;
        pos_[size_t(e.slot)] = i;
    }
    void sift_up(int32_t i) {
        const Entry e = heap_[size_t(i)];
        while (i > 0 && less(e, heap_[size_t((i - 1) / 2)])) {
            place(i, heap_[size_t((i - 1) / 2)]);
            i = (i - 1) / 2;
        }
        place(i, e);
    }
    void sift_down(int32_t i) {
        const int32_t n = int32_t(heap_.size());
        const Entry e = heap_[size_t(i)];
        for (;;) {
            int32_t c = 2 * i + 1;
            if (c >= n) break;
            if (c + 1 < n && less(heap_[size_t(c + 1)], heap_[size_t(c)])) ++c;
            if (!less(heap_[size_t(c)], e)) break;
            place(i, heap_[size_t(c)]);
            i = c;
        }
        place(i, e);
    }
    std::vector<Entry> heap_;
    std::vector<int32_t> pos_;
    mutable std::vector<int32_t> frontier_;  // scratch of the best-first walks
};

// Least frequently used. A key's use count is kept after its eviction (an expert that comes
// back keeps its history); equal counts are broken by recency (the least recent goes first).
class LfuPolicy {
public:
    void init(int32_t n_slots, int32_t n_keys) {
        heap_.init(n_slots);
        count_.assign(size_t(n_keys), 0);
    }
    void on_hit(int32_t slot, int32_t key, const AccessHint& h) {
        if (!h.use) return;
        heap_.set(slot, double(++count_[size_t(key)]), h.now);
    }
    void on_fill(int32_t slot, int32_t key, const AccessHint& h) {
        if (h.use) ++count_[size_t(key)];
        heap_.set(slot, double(count_[size_t(key)]), h.now);
    }
    template <class Pinned>
    int32_t victim(Pinned is_pinned) {
        return heap_.lowest_unpinned(is_pinned);
    }
    // Admitted only with more uses (this one included) than the victim: ties keep the victim.
    bool admits(int32_t key, int32_t, int32_t victim_key, const AccessHint& h) {
        const uint64_t c = count_[size_t(key)] + (h.use ? 1 : 0);
        if (c > count_[size_t(victim_key)]) return true;
        count_[size_t(key)] = c;
        return false;
    }
    void ranked(int32_t n, std::vector<int32_t>& out) const { heap_.lowest(n, out); }
    Rank rank(int32_t slot) const { return heap_.rank(slot); }
    void arrival_ranks(uint64_t now, std::span<Rank> out) const {
        for (size_t key = 0; key < out.size(); ++key) out[key] = {double(count_[key] + 1), now};
    }
    void on_bypass(int32_t key, const AccessHint& h) {
        if (h.use) ++count_[size_t(key)];
    }
    uint64_t count(int32_t key) const { return count_[size_t(key)]; }

private:
    SlotHeap heap_;
    std::vector<uint64_t> count_;
};

// Exponentially decayed use counts: each use adds 1 and every count halves every `half_life`
// ticks; the lowest score is evicted (ties: least recent). A tick is `ticks_per_access` of an
// access, so a pool shared by L layers (ticks_per_access = 1/L) decays at the same speed per
// token as a pool of one layer. Implemented without touching every count: a use adds
// 2^(t/half_life) instead, which orders keys the same way, and all scores are rescaled when
// that increment grows large (amortized O(1)).
class DecayPolicy {
public:
    explicit DecayPolicy(double half_life = 128, double ticks_per_access = 1.0)
        : half_life_(half_life),
          ticks_per_access_(ticks_per_access),
          step_(std::exp2(ticks_per_access / half_life)) {}
    void init(int32_t n_slots, int32_t n_keys) {
        heap_.init(n_slots);
        score_.assign(size_t(n_keys), 0.0);
        base_ = 0;
        inc_now_ = UINT64_MAX;
    }
    void on_hit(int32_t slot, int32_t key, const AccessHint& h) {
        if (!h.use) return;
        heap_.set(slot, add_use(key, h), h.now);
    }
    void on_fill(int32_t slot, int32_t key, const AccessHint& h) {
        heap_.set(slot, h.use ? add_use(key, h) : score_[size_t(key)], h.now);
    }
    template <class Pinned>
    int32_t victim(Pinned is_pinned) {
        return heap_.lowest_unpinned(is_pinned);
    }
    // Admitted only with a higher decayed count (this use included) than the victim's; scores
    // are compared in the frame they are stored in (a use adds 2^(t / half_life)).
    bool admits(int32_t key, int32_t, int32_t victim_key, const AccessHint& h) {
        const double t = double(h.now) * ticks_per_access_;
        const double use = h.use ? std::exp2((t - base_) / half_life_) : 0.0;
        if (score_[size_t(key)] + use > score_[size_t(victim_key)]) return true;
        if (h.use) add_use(key, h);
        return false;
    }
    void ranked(int32_t n, std::vector<int32_t>& out) const { heap_.lowest(n, out); }
    Rank rank(int32_t slot) const { return heap_.rank(slot); }
    // Each key's score with one more use at `now`, in the frame the heap holds (no rescale).
    void arrival_ranks(uint64_t now, std::span<Rank> out) const {
        const double t = double(now) * ticks_per_access_;
        const double use = std::exp2((t - base_) / half_life_);
        for (size_t key = 0; key < out.size(); ++key) out[key] = {score_[key] + use, now};
    }
    void on_bypass(int32_t key, const AccessHint& h) {
        if (h.use) add_use(key, h);
    }
    // The decayed count of a key at access `now` (for tests).
    double count(int32_t key, uint64_t now) const {
        return score_[size_t(key)] *
               std::exp2(-(double(now) * ticks_per_access_ - base_) / half_life_);
    }

private:
    double add_use(int32_t key, const AccessHint& h) {
        const double t = double(h.now) * ticks_per_access_;
        if ((t - base_) / half_life_ > 256) {  // rescale before 2^x overflows
            const double f = std::exp2(-(t - base_) / half_life_);
            for (double& s : score_) s *= f;
            heap_.scale(f);
            base_ = t;
            inc_now_ = UINT64_MAX;
        }
        // 2^((t - base) / half_life), by one multiplication when time moved by one access.
        if (h.now != inc_now_) {
            inc_ = inc_now_ != UINT64_MAX && h.now == inc_now_ + 1
                       ? inc_ * step_
                       : std::exp2((t - base_) / half_life_);
            inc_now_ = h.now;
        }
        double& s = score_[size_t(key)];
        s += inc_;
        return s;
    }
    double half_life_, ticks_per_access_, step_;
    double base_ = 0;
    double inc_ = 1;
    uint64_t inc_now_ = UINT64_MAX;
    SlotHeap heap_;
    std::vector<double> score_;
};

// Belady's MIN: evict the expert whose next use is farthest in the future. Offline: every
// access must carry its key's next use (AccessHint::next_use). With the current step's experts
// pinned it is still optimal among policies that load on demand (tests check it against brute
// force on small cases).
class BeladyPolicy {
public:
    void init(int32_t n_slots, int32_t) {
        heap_.init(n_slots);
        next_use_.assign(size_t(n_slots), 0);
    }
    void on_hit(int32_t slot, int32_t, const AccessHint& h) { update(slot, h); }
    void on_fill(int32_t slot, int32_t, const AccessHint& h) { update(slot, h); }
    template <class Pinned>
    int32_t victim(Pinned is_pinned) {
        return heap_.lowest_unpinned(is_pinned);
    }
    // With admission: the offline optimum when a miss may bypass the cache (the missed expert
    // stays out when it is used again no sooner than the victim).
    bool admits(int32_t, int32_t victim_slot, int32_t, const AccessHint& h) {
        return h.next_use < next_use_[size_t(victim_slot)];
    }
    void ranked(int32_t n, std::vector<int32_t>& out) const { heap_.lowest(n, out); }
    void on_bypass(int32_t, const AccessHint&) {}
    Rank rank(int32_t slot) const { return heap_.rank(slot); }
    void arrival_ranks(uint64_t, std::span<Rank> out) const {  // offline only
        std::fill(out.begin(), out.end(), never_evicted);
    }

private:
    void update(int32_t slot, const AccessHint& h) {
        heap_.set(slot, -double(h.next_use), h.now);  // min-heap: farthest next use on top
        next_use_[size_t(slot)] = h.next_use;
    }
    SlotHeap heap_;
    std::vector<int64_t> next_use_;
};

}  // namespace minids::routing
