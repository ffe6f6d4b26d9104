// The expert cache's device fetch (docs/expert-cache.md, "Device fetch"): the state the graph's
// mgl::expert_fetch nodes share with the host, the victims offered before each step, and the
// replay of the device's fill log after it. The host fetch is in expert_offload.cpp.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>

#include "routing/prompt_chunk.h"
#include "runtime/expert_offload.h"
#include "runtime/host_time.h"

namespace minids {

namespace {

constexpr size_t kHeaderWords = sizeof(mgl::expert_fetch_header) / sizeof(int64_t);
static_assert(sizeof(mgl::expert_fetch_header) % sizeof(int64_t) == 0);

}  // namespace

// Where the device fetch's arrays sit in its state buffer, in i64 words: the header, the id log
// and the fill log first (after a step the host downloads the three in one copy), then what the
// host uploads before each step, back to back (victims, their ranks, the keys' arrival ranks:
// one copy), then the rest. A step fills each key at most once, so the fill log and the
// arrivals hold n_layers · n_experts entries; the id log holds a decoded token's ids
// (n_layers · k); the victims (and their ranks) `n_victims` (ExpertOffload::layout).
struct ExpertOffload::StateLayout {
    size_t id_log, fill_log, arrivals, victims, victim_ranks, key_ranks, tables, homes, slot_keys,
        words;
    StateLayout(int64_t n_layers, int64_t n_experts, int64_t n_slots, int64_t n_victims,
                int64_t top_k) {
        const auto keys = size_t(n_layers * n_experts), slots = size_t(n_slots);
        const auto offered = size_t(n_victims);
        id_log = kHeaderWords;                                 // i32
        fill_log = id_log + size_t(n_layers * top_k + 1) / 2;  // a (key, slot) pair of i32 per word
        arrivals = fill_log + keys;                            // i32
        victims = arrivals + (keys + 1) / 2;                   // i32
        victim_ranks = victims + (offered + 1) / 2;            // two words per expert_fetch_rank
        key_ranks = victim_ranks + 2 * offered;
        tables = key_ranks + 2 * keys;
        homes = tables + size_t(n_layers);
        slot_keys = homes + keys;
        words = slot_keys + (slots + 1) / 2;
    }
};

namespace {

constexpr size_t kCounterWords = mgl::expert_fetch_counter_words;
static_assert(sizeof(mgl::expert_fetch_rank) == 2 * sizeof(int64_t));

// The most arrivals a step may rank against its victims: the CUDA plan kernel keeps them in
// shared memory. A step that could fill more (a long chunk of a few tokens) does not recycle.
constexpr int64_t kMostRecycledArrivals = 512;

}  // namespace

// The victims the state has room for: every slot once, or with the staging store the most a step
// may take (n_layers · n_experts: the policy's order repeated, see before_step).
ExpertOffload::StateLayout ExpertOffload::layout() const {
    const int64_t victims =
        staging_ ? int64_t(config_.n_layers) * config_.n_experts : config_.n_slots;
    return StateLayout(config_.n_layers, config_.n_experts, config_.n_slots, victims, top_k_);
}

void ExpertOffload::setup_stage() {
    // Capacity: the most fills one layer's fetch may post, one per distinct expert it uses. The
    // chunk size is the session's, not known here, so n_experts (64 x 8.6 MB for V2-Lite FP8).
    const mgl::expert_stage_header h =
        mgl::expert_stage_layout(config_.n_experts, int64_t(blob_bytes_));
    if (!stage_) {  // once: recorded graphs keep the stage's address
        const size_t bytes = mgl::expert_stage_bytes(h);
        try {
            stage_buf_ = backend_.alloc_host_buffer(bytes);
        } catch (const mgl::error& e) {
            throw std::system_error(
                std::make_error_code(std::errc::not_enough_memory),
                "expert cache: the staging store's " + std::to_string(bytes >> 20) +
                    " MiB of pinned host memory for " + std::to_string(h.capacity) +
                    " experts could not be allocated (" + e.what() + ")");
        }
        // No bind: the stage is host memory, and the CUDA backend reads such a leaf through its
        // device-mapped address (the same address with unified addressing), not as a buffer.
        stage_ = state_ctx_.new_tensor(mgl::dtype::i64, {int64_t(bytes / sizeof(int64_t))},
                                       "expert_fetch_stage");
        stage_->data = stage_buf_->base();
    }
    std::memcpy(stage_buf_->base(), &h, sizeof h);
}

void ExpertOffload::setup_device_fetch() {
    const int64_t L = config_.n_layers, E = config_.n_experts, S = config_.n_slots;
    const StateLayout at = layout();
    if (!state_) {  // once: recorded graphs keep the state's address
        state_buf_ = backend_.alloc_buffer(at.words * sizeof(int64_t));
        state_ = state_ctx_.new_tensor(mgl::dtype::i64, {int64_t(at.words)}, "expert_fetch_state");
        mgl::bind(*state_, *state_buf_, 0);
    }
    victims_.clear();
    most_fills_ = 0;
    // The header starts over (victims_copied too; write_victims_words below sets the ready
    // word): no step is owed or pending, the numbering restarts.
    victims_seq_ = 0;
    step_deferred_ = victims_owed_ = false;
    log_queued_ = -1;
    pending_replay_.reset();
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
    h.arrivals = reinterpret_cast<int64_t>(base + at.arrivals);
    h.victim_ranks = reinterpret_cast<int64_t>(base + at.victim_ranks);
    h.key_ranks = reinterpret_cast<int64_t>(base + at.key_ranks);
    h.id_log = reinterpret_cast<int64_t>(base + at.id_log);
    h.id_log_stride = top_k_;
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
    if (proxy_) write_proxy_words();
    if (staging_) setup_stage();
    // The host staging at its largest now (the counters and victims up, every key's fill down),
    // so that nothing is allocated while a step runs (victims after the launch: an allocation
    // may wait for the device, which may be waiting for this host).
    backend_.host_staging(upload_host_,
                          (kCounterWords + (at.tables - at.victims)) * sizeof(int64_t));
    for (auto& log : log_host_)
        backend_.host_staging(log, (at.fill_log + size_t(L * E)) * sizeof(int64_t));
    write_victims_words();
}

void ExpertOffload::write_victims_words() {
    if (victims_after_launch_ && !late_host_) {
        const StateLayout at = layout();
        late_host_ = backend_.alloc_host_buffer((1 + at.tables - at.victims) * sizeof(int64_t));
        std::memset(late_host_->base(), 0, late_host_->size());
    }
    // Pinned host memory: with unified addressing its host address is its device address.
    auto* late = victims_after_launch_ ? static_cast<int64_t*>(late_host_->base()) : nullptr;
    if (late) *late = victims_seq_;  // the ready word: every step numbered so far is written
    auto* state = static_cast<mgl::expert_fetch_header*>(state_buf_->base());
    const int64_t words[2] = {reinterpret_cast<int64_t>(late), victims_seq_};
    static_assert(offsetof(mgl::expert_fetch_header, victims_copied) ==
                  offsetof(mgl::expert_fetch_header, victims_ready) + sizeof(int64_t));
    backend_.copy_to_backend(&state->victims_ready, words, sizeof words);
}

int64_t* ExpertOffload::victims_at() {
    // A deferred step's victims go to the host block its plans copy them from; any other step's
    // into the staging uploaded before its launch.
    if (step_deferred_) return static_cast<int64_t*>(late_host_->base()) + 1;
    return static_cast<int64_t*>(upload_host_->base()) + kCounterWords;
}

void ExpertOffload::before_step(int64_t n_tokens, bool launched_whole) {
    if (!state_) return;
    const int64_t L = config_.n_layers, E = config_.n_experts;
    // At most one fill per distinct expert a layer uses, and in a decoded token's step (the
    // only one with prefetch: Deepseek2Model::build_forward) the prefetches of every MoE layer
    // but the first; never more than one per key (a prefetched expert is its layer's hit).
    const int64_t most = std::min<int64_t>(L * E, L * std::min<int64_t>(E, n_tokens * top_k_) +
                                                      (n_tokens == 1 ? (L - 1) * prefetch_ : 0));
    const bool prompt = routing::is_prompt_chunk(n_tokens, top_k_, E);
    restore_lent_slots();  // a step that never reached after_step (it failed midway)
    if (prompt && prompt_stage_capacity_ > 0) lend_slots();
    // Outside a prompt a miss may instead evict this step's earlier arrival when the policy
    // ranks it lower, as the host rules would (docs/expert-cache-policies.md): the ranks are
    // uploaded with the victims. Not with the staging store: its victims repeat, and the CUDA
    // plan reads a layer's candidates before it decides, so a slot it re-took as an arrival
    // could come up again as a candidate the plan thinks holds another layer's expert.
    const bool recycle = !staging_ && !prompt && most <= kMostRecycledArrivals;
    // Victims after the launch: a decoded token's step that the backend queues whole. What the
    // device needs before it runs is known now (how many victims: every slot once, at most
    // `most`; whether to recycle); which ones needs the previous step's replay, which then runs
    // beside this step (queue_fill_log). Any other step settles that replay first.
    step_deferred_ = victims_after_launch_ && launched_whole && !staging_ && !prompt;
    if (!step_deferred_) settle();
    const StateLayout at = layout();
    auto* base = static_cast<int64_t*>(state_buf_->base());
    const size_t span = at.tables - at.victims;  // victims .. the end of key_ranks, in words
    auto* counters = static_cast<int64_t*>(
        backend_.host_staging(upload_host_, (kCounterWords + span) * sizeof(int64_t)));
    int64_t n_victims = 0;
    if (step_deferred_) {
        n_victims = std::min<int64_t>(config_.n_slots, most);
        most_fills_ = most;
        victims_owed_ = true;
        owed_victims_ = n_victims;
        owed_recycle_ = recycle;
        ++victims_seq_;
    } else {
        // Everything goes up from pinned memory (a pageable source makes the driver stage each
        // copy while the GPU idles between steps) in two copies: the counters, and the victims
        // with the ranks, laid out there as in the state.
        const size_t words = stage_victims(most, prompt, recycle);
        n_victims = int64_t(victims_.size());
        if (words)
            backend_.copy_to_backend_async(base + at.victims, counters + kCounterWords,
                                           words * sizeof(int64_t));
    }
    // n_victims, next_victim, n_fills, layer_fills, recycle, n_arrivals, fetch_ns, fetch_t0,
    // fetch_t1, victims_wanted
    const int64_t c[kCounterWords] = {n_victims, 0, 0, 0, recycle ? 1 : 0,
                                      0,         0, 0, 0, step_deferred_ ? victims_seq_ : 0};
    std::copy(c, c + kCounterWords, counters);
    backend_.copy_to_backend_async(base, counters, kCounterWords * sizeof(int64_t));
}

size_t ExpertOffload::stage_victims(int64_t most, bool prompt, bool recycle) {
    const int64_t L = config_.n_layers, E = config_.n_experts;
    if (staging_) {
        // No miss may stay home (the device cannot read it there), so `most` victims, the
        // policy's order repeated. Enough: a layer's plan passes over a victim only when it
        // holds an expert the layer uses (H of its U experts are in slots) and takes one per
        // miss (U - H), so each layer uses at most U <= min(E, T·k) entries; and n_slots >= E
        // consecutive entries hold every slot once, at most H of them passed over, so at least
        // n_slots - H >= U - H can be taken before a layer would run short. Prompts too: here
        // an eviction a later layer regrets is still cheaper than no fill at all.
        victims_ = cache_->victims_repeated(most);
        most_fills_ = most;
    } else {
        victims_ = cache_->victims(int32_t(std::min<int64_t>(config_.n_slots, most)));
        // A prompt chunk uses nearly every expert of every layer once: an eviction would only
        // make a later layer of the same chunk miss what it evicted, so only free slots are
        // offered and the other misses are read in place (each crosses the link once either
        // way).
        // (A prompt stage's lent slots are never among them: it lends only from a full pool.)
        if (prompt) std::erase_if(victims_, [&](int32_t v) { return slot_key_[size_t(v)] >= 0; });
        most_fills_ = prompt ? int64_t(victims_.size()) : most;
    }
    const StateLayout at = layout();
    const size_t span = at.tables - at.victims;
    // Rewritten only once the steps that read it are done: the host has waited for the last one
    // (and for its upload, which was queued before it).
    int64_t* staged = victims_at();  // the state's word at.victims
    std::copy(victims_.begin(), victims_.end(), reinterpret_cast<int32_t*>(staged));
    auto* victim_ranks =
        reinterpret_cast<mgl::expert_fetch_rank*>(staged + (at.victim_ranks - at.victims));
    for (size_t i = 0; i < victims_.size(); ++i) {
        const int32_t v = victims_[i];
        const routing::Rank r = slot_key_[size_t(v)] < 0
                                    ? routing::Rank{-std::numeric_limits<double>::infinity(), 0}
                                    : cache_->rank(v);
        victim_ranks[i] = {r.first, r.second};
    }
    size_t words = victims_.empty() ? 0 : at.victim_ranks - at.victims + 2 * victims_.size();
    if (recycle) {
        arrival_ranks_.resize(size_t(L * E));
        cache_->arrival_ranks(arrival_ranks_);
        auto* key_ranks =
            reinterpret_cast<mgl::expert_fetch_rank*>(staged + (at.key_ranks - at.victims));
        for (size_t i = 0; i < arrival_ranks_.size(); ++i)
            key_ranks[i] = {arrival_ranks_[i].first, arrival_ranks_[i].second};
        words = span;
    }
    return words;
}

// The prompt stage's loan: from a full pool, the policy's lowest-ranked slots up to the capacity
// (and up to what a layer of the chunk can miss), their addresses uploaded for
// mgl::expert_prompt_stage (none lent: a count of 0).
// Each lent slot's expert has its entry pointed home for the chunk, so no kernel reads the slot
// while the stage overwrites it; the policy still counts it resident, and restore_lent_slots
// copies its bytes back after the chunk. A prompt chunk is offered only free slots, and a full
// pool has none: the chunk fills nothing, so no fill can place an expert the policy thinks is
// in a lent slot.
void ExpertOffload::lend_slots() {
    const int32_t E = config_.n_experts;
    const int64_t C = prompt_stage_capacity_;
    const auto& tables = store_.expert_tables();
    lent_slots_ = cache_->victims(int32_t(C));
    // Only from a full pool: a chunk with free slots fills them (from the copy kernel, as fast as
    // the stage) and lending them would leave fewer experts cached for the decode after it.
    const bool full = std::none_of(lent_slots_.begin(), lent_slots_.end(),
                                   [&](int32_t v) { return slot_key_[size_t(v)] < 0; });
    if (!full) lent_slots_.clear();
    // No more than a layer of the chunk can miss: its experts not in slots (one layer's stage
    // uses the slots at a time). None when every expert is in a slot: a lent slot would only
    // cost its copies there and back. (An expert the loan itself sends home is a miss beyond
    // that count, read in place when its layer's stage is full: counting it would let a loan
    // taken from the layer with the most misses grow itself.)
    std::vector<int64_t> not_in_slots(size_t(config_.n_layers), E);
    for (const int32_t key : slot_key_)
        if (key >= 0) --not_in_slots[size_t(key / E)];
    const int64_t most_misses =
        not_in_slots.empty() ? 0 : *std::max_element(not_in_slots.begin(), not_in_slots.end());
    const size_t n = size_t(std::min<int64_t>(int64_t(lent_slots_.size()), most_misses));
    lent_slots_.resize(n);
    // Pinned: the count and addresses, then the entries pointed home (restore_lent_slots has
    // its own third, since its uploads may still be queued when the next chunk lends).
    auto* words = static_cast<int64_t*>(
        backend_.host_staging(lend_host_, size_t(1 + 3 * C) * sizeof(int64_t)));
    int64_t* entries = words + 1 + C;
    words[0] = int64_t(lent_slots_.size());
    for (size_t i = 0; i < lent_slots_.size(); ++i) {
        const int32_t slot = lent_slots_[i], key = slot_key_[size_t(slot)];  // full: key >= 0
        words[1 + i] = slot_address(slot);
        const int32_t l = key / E, e = key % E;
        int64_t& entry = entries[i];
        entry = shadow_[size_t(l)][size_t(e)] = home(l, e);
        backend_.copy_to_backend_async(static_cast<int64_t*>(tables[size_t(l)].t->data) + e, &entry,
                                       sizeof entry);
    }
    backend_.copy_to_backend_async(lend_buf_->base(), words,
                                   (1 + lent_slots_.size()) * sizeof(int64_t));
}

// After the chunk (its kernels are done: the host has its logits): each lent slot gets its
// expert's bytes back (slot_key_ still names it: the policy never saw the loan) and the
// expert's entry points at it again, queued on the backend's stream before the next step.
void ExpertOffload::restore_lent_slots() {
    const int32_t E = config_.n_experts;
    const int64_t C = prompt_stage_capacity_;
    const auto& tables = store_.expert_tables();
    int64_t* entries =
        lent_slots_.empty() ? nullptr : static_cast<int64_t*>(lend_host_->base()) + 1 + 2 * C;
    for (size_t i = 0; i < lent_slots_.size(); ++i) {
        const int32_t slot = lent_slots_[i], key = slot_key_[size_t(slot)];
        const int32_t l = key / E, e = key % E;
        backend_.copy_to_backend_async(reinterpret_cast<void*>(slot_address(slot)), blob(l, e),
                                       size_t(blob_bytes_));
        entries[i] = shadow_[size_t(l)][size_t(e)] = slot_address(slot);
        backend_.copy_to_backend_async(static_cast<int64_t*>(tables[size_t(l)].t->data) + e,
                                       &entries[i], sizeof(int64_t));
        ++stats_.stage_restores;
        stats_.bytes_restored += blob_bytes_;
    }
    lent_slots_.clear();
}

void ExpertOffload::write_victims_after_launch() {
    victims_owed_ = false;
    // The launched step's fetches that miss wait for the ready word: it is set whatever happens
    // here (the device keeps its tables true with any victims it is offered; an error here
    // reaches the caller).
    struct Ready {
        ExpertOffload& o;
        ~Ready() {
            std::atomic_ref<int64_t>(*static_cast<int64_t*>(o.late_host_->base()))
                .store(o.victims_seq_, std::memory_order_release);
        }
    } ready{*this};
    settle();
    stage_victims(most_fills_, false, owed_recycle_);
    if (int64_t(victims_.size()) != owed_victims_)
        throw std::logic_error("expert cache: " + std::to_string(victims_.size()) +
                               " victims for the " + std::to_string(owed_victims_) +
                               " promised to the step");
}

const int32_t* ExpertOffload::queue_fill_log(int64_t n_tokens) {
    // The header's counters, the id log and the fill log, in one download, into the log buffer
    // the last replay no longer reads.
    const StateLayout at = layout();
    const size_t bytes = (at.fill_log + size_t(most_fills_)) * sizeof(int64_t);
    const int b = log_next_;
    log_next_ ^= 1;
    auto* staged = static_cast<int64_t*>(backend_.host_staging(log_host_[b], bytes));
    backend_.download_async(*state_, staged, 0, bytes);
    log_queued_ = b;
    if (victims_owed_) {
        HostTime t(stats_.host_beside_ns);
        write_victims_after_launch();
    }
    // The fetch logs ids that fit the id log's stride (mgl::expert_fetch_header::id_log).
    return n_tokens * top_k_ <= top_k_ ? reinterpret_cast<const int32_t*>(staged + at.id_log)
                                       : nullptr;
}

void ExpertOffload::settle() {
    if (!pending_replay_) return;
    const PendingReplay p = std::move(*pending_replay_);
    pending_replay_.reset();
    replay_device_fills(p);
}

void ExpertOffload::stash_replay(const RoutingRecord& r) {
    if (log_queued_ < 0) {  // a caller that did not queue it with the step (tests driving the hook)
        if (victims_owed_)
            throw std::logic_error("expert cache: a deferred step's log was not queued");
        queue_fill_log(r.n_tokens);
        backend_.synchronize();
    }
    settle();  // (a step whose victims came before its launch settled it already)
    pending_replay_ = PendingReplay{r, log_queued_, most_fills_, int64_t(victims_.size())};
    log_queued_ = -1;
    if (!step_deferred_) settle();
}

void ExpertOffload::replay_device_fills(const PendingReplay& p) {
    const RoutingRecord& r = p.record;
    const int32_t L = config_.n_layers, E = config_.n_experts;
    const int64_t per_layer = r.n_tokens * r.k;
    const StateLayout at = layout();
    const auto* words = static_cast<const int64_t*>(log_host_[p.log]->base());
    mgl::expert_fetch_header h;
    std::memcpy(static_cast<void*>(&h), words, sizeof h);
    if (proxy_) proxy_->check();
    if (h.proxy_error)
        throw std::runtime_error(
            "expert cache: a fetch gave up waiting for the prefetch proxy's copies (" +
            std::to_string(h.proxy_posted) + " posted, " + std::to_string(h.proxy_done) +
            " landed, " + std::to_string(proxy_ ? proxy_->served() : 0) + " issued" +
            (proxy_ ? proxy_->slowest_issue() : std::string()) + ")");
    if (h.victims_late)
        throw std::runtime_error(
            "expert cache: a fetch gave up waiting for its victims, written after the launch "
            "(the host did not write them within 2 s)");
    if (h.n_fills < 0 || h.n_fills > p.most_fills || h.next_victim < 0 ||
        h.next_victim > p.n_victims)
        throw std::logic_error("expert cache: the device fetch's counters are out of range");
    const auto* log = reinterpret_cast<const int32_t*>(words + at.fill_log);
    int64_t f = 0;
    std::vector<int64_t> uses(static_cast<size_t>(E));
    std::vector<char> prefetched(static_cast<size_t>(E));
    for (int32_t l = 0; l < L; ++l) {
        // The layer's prefetch ran before its fetch (after the previous layer's): its fills come
        // first, marked, in increasing expert order. Loaded without a use; the layer's own
        // reads below find them in their slots.
        std::fill(prefetched.begin(), prefetched.end(), 0);
        while (f < h.n_fills && (log[2 * f] & mgl::expert_fetch_prefetched) &&
               (log[2 * f] & ~mgl::expert_fetch_prefetched) / E == l) {
            const int32_t key = log[2 * f] & ~mgl::expert_fetch_prefetched, slot = log[2 * f + 1];
            ++f;
            if (slot < 0 || slot >= config_.n_slots || slot_key_[size_t(slot)] == key)
                throw std::logic_error("expert cache: the device's prefetch log is out of range");
            occupy(slot, key);
            cache_->place(l, key % E, slot);
            prefetched[size_t(key % E)] = 1;
            ++stats_.fills;
            ++stats_.prefetches;
            stats_.bytes_filled += blob_bytes_;
        }
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
                if (staging_)  // on a GPU the kernels would have read memory they cannot read
                    throw std::logic_error(
                        "expert cache: the staging store's step left a miss in host memory "
                        "(layer " +
                        std::to_string(l) + ", expert " + std::to_string(e) + ")");
                ++stats_.reads_in_place;
                stats_.bytes_read_in_place += blob_bytes_;
                for (int64_t i = 0; i < u; ++i) cache_->bypass(l, e);
                continue;
            } else {
                stats_.hits += u;
                if (prefetched[size_t(e)]) ++stats_.prefetch_used;
            }
            for (int64_t i = 0; i < hits; ++i) {
                if (cache_->access(l, e, {}, false).outcome != routing::AccessResult::hit)
                    throw std::logic_error("expert cache: the policy lost a resident expert");
            }
        }
    }
    if (f != h.n_fills)
        throw std::logic_error("expert cache: the device's fill log does not follow the routing");
    // The stage holds what the last MoE layer's fetch posted: its fills.
    if (const mgl::expert_stage_header* stage = stage_header();
        stage && stage->n != h.n_fills - h.layer_fills)
        throw std::logic_error("expert cache: the stage holds " + std::to_string(stage->n) +
                               " fills of the last layer's " +
                               std::to_string(h.n_fills - h.layer_fills));
    // The step's wait on its fetches (0 where the backend does not time them: the CPU's).
    const int64_t last = h.fetch_t1 > h.fetch_t0 ? h.fetch_t1 - h.fetch_t0 : 0;
    if (h.fetch_ns >= 0) stats_.fetch_ns += uint64_t(h.fetch_ns + last);
    ++stats_.steps;
}

}  // namespace minids
