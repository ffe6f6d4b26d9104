// The expert cache's engine side (docs/expert-cache.md): a pool of expert slots in backend
// memory and the policy (routing/expert_cache.h) that decides which experts occupy them.
//
// Every entry of a MoE layer's expert table always holds a valid address: the expert's slot
// when it is resident, else its home (where place() left it for a model loaded with
// WeightOptions::experts_resident = false: the registered host copy, or the registered
// mapping). The forward reads whatever the table says, so a step never waits for the cache.
// After each step, after_step() replays the step's routing through the policy in the
// simulator's order (token by token, layer by layer, a token's k experts of a layer pinned
// together), so its hit counts are the simulator's on the same trace; then the slots whose
// occupant changed are filled from host memory and the changed table entries uploaded, both
// queued on the backend's stream before the next step.
//
// With the device fetch (`device_fetch`), the step itself fills slots: before each MoE layer's
// experts run, mgl::expert_fetch copies the layer's missing experts into victim slots offered by
// before_step() and rewrites the tables on the device, so a miss crosses the host link once
// (into its slot) and is read from HBM. after_step() then replays the device's fill log
// through the policy and the host's copy of the tables.
//
// With the staging store (WeightPlacement::experts_staged: the experts in host memory nothing
// registered, which the device cannot read), the device fetch copies every miss through a pinned
// stage this object owns (mgl::expert_stage_header): before_step() offers enough victims that no
// miss is left home, and a read in place after a step is an internal error.
//
// Invariant (checked by the tests): an entry points at a slot only when that slot holds that
// expert's bytes. A slot is refilled only after the step that read it has finished (after_step
// runs once the host has the step's logits), and the entry of the expert it held has been
// pointed home in the same upload, which the stream orders before the next step.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "mgl.h"
#include "model/deepseek2.h"
#include "routing/expert_cache.h"
#include "runtime/prefetch_proxy.h"
#include "runtime/session.h"

namespace minids {

struct OffloadStats {
    int64_t steps = 0;
    int64_t accesses = 0;  // expert uses replayed through the policy
    int64_t hits = 0;      // uses that found the expert in a slot
    int64_t fills = 0;     // slots filled from host memory
    uint64_t bytes_filled = 0;
    // Experts a step's kernels read in place from host memory (their table entry pointed home
    // when the step began), counted once per step and expert: exact for decode, a lower bound
    // for a prompt chunk, whose grouped kernels may read an expert once per tile of tokens.
    int64_t reads_in_place = 0;
    uint64_t bytes_read_in_place = 0;
    // Device fetch on a GPU: time the MoE layers waited on their fetch (each layer's plan start to
    // its last copy's end, the device's timer). 0 for the host fetch, which is not timed.
    uint64_t fetch_ns = 0;
    // Host time of the cache's own work around the steps (the policy's victims and ranks before
    // a step, the replay of its routing after it, the table uploads): on the path between the
    // step's wait and the next launch, where the GPU idles.
    uint64_t host_ns = 0;
    // The same work done while a step runs (victims after the launch: the previous step's
    // replay and this step's victims), or outside the steps (stats() settling the last replay).
    uint64_t host_beside_ns = 0;
    // Prefetch (device fetch): experts a layer's prefetch filled for the next MoE layer, and of
    // those, the ones that layer then read in the same step (the rest were wasted). Their
    // bytes are in fills and bytes_filled too.
    int64_t prefetches = 0;
    int64_t prefetch_used = 0;
    // Prompt stage: experts copied back into the slots lent to a prompt chunk (their bytes
    // crossed the link again; not fills: the policy never saw them leave).
    int64_t stage_restores = 0;
    uint64_t bytes_restored = 0;
    int64_t prefetch_wasted() const { return prefetches - prefetch_used; }
    double hit_rate() const { return accesses ? double(hits) / double(accesses) : 0.0; }
    // Bytes over the host link: fills, reads in place (the prompt stage's copies among them)
    // and the lent slots' experts copied back.
    uint64_t bytes_over_link() const { return bytes_filled + bytes_read_in_place + bytes_restored; }
    // What happened between `earlier` and these counters.
    OffloadStats since(const OffloadStats& earlier) const {
        return {steps - earlier.steps,
                accesses - earlier.accesses,
                hits - earlier.hits,
                fills - earlier.fills,
                bytes_filled - earlier.bytes_filled,
                reads_in_place - earlier.reads_in_place,
                bytes_read_in_place - earlier.bytes_read_in_place,
                fetch_ns - earlier.fetch_ns,
                host_ns - earlier.host_ns,
                host_beside_ns - earlier.host_beside_ns,
                prefetches - earlier.prefetches,
                prefetch_used - earlier.prefetch_used,
                stage_restores - earlier.stage_restores,
                bytes_restored - earlier.bytes_restored};
    }
};

class ExpertOffload {
public:
    // `config.n_layers` and `n_experts` are taken from the model; n_slots, policy, per_layer and
    // decay_half_life from `config`. Allocates the slot pool in backend memory.
    // `transfers`: fill the slots on this queue (backend.make_transfer_queue(): a copy stream)
    // so the next step does not wait for them; a filled slot's entries point at it only once
    // its fence has passed, checked at each later step. Null: fills are queued on the
    // backend's stream before the next step, which waits for them.
    // `device_fetch`: fill slots inside the step (see above); needs one global pool, admission
    // `all` and no transfer queue. The staging store needs the device fetch and a slot for
    // every expert of a layer (n_slots >= n_experts).
    ExpertOffload(const Deepseek2Model& model, mgl::backend& backend, routing::CacheConfig config,
                  std::unique_ptr<mgl::transfer_queue> transfers = nullptr,
                  bool device_fetch = false);
    // Points the tables home again: the model runs on without the cache.
    ~ExpertOffload();
    ExpertOffload(const ExpertOffload&) = delete;
    ExpertOffload& operator=(const ExpertOffload&) = delete;

    // Empties every slot and forgets the policy's history (the counters keep running): a cold
    // cache, for benchmarks. Waits for the backend first.
    void reset();

    // Hooks itself into the session: after_step() after every eval and, with the device fetch,
    // the fetch state and before_step() before it.
    void attach(Session& session);
    // Prefetch (device fetch, not the staging store): each MoE layer of a decode step but the
    // last fills up to `n` of the next MoE layer's predicted experts (ForwardBatch::
    // expert_prefetch); 0 turns it off. Takes effect at the next attach(). `copy_engines`: the
    // prefetched experts are copied by the backend's copy engines, issued by a host thread that
    // serves the device's requests (PrefetchProxy), instead of by the fetch's copy kernel; the
    // next MoE layer's fetch waits for them.
    // fills_by_engines (MINIDS_FETCH_COPY=engines, the CLI's default on a GPU): every fill of a
    // replayed decode step, the layers' own included, is copied by the copy engines through the
    // proxy.
    void set_prefetch(int32_t n, bool copy_engines = false, bool fills_by_engines = false);
    // Prompt stage (device fetch, a host store the GPU reads; docs/expert-cache.md, "Prefill"):
    // before each prompt chunk that finds the pool full, the policy's `capacity` lowest-ranked
    // slots are lent to it (their experts' entries point home for the chunk; their bytes are
    // copied back after it), and each MoE layer copies the experts it uses that are not in
    // slots into them (mgl::expert_prompt_stage) instead of the grouped kernels reading them in
    // place. The policy never sees the loan. 0 turns it off. For the session attach() sets up
    // next.
    void set_prompt_stage(int64_t capacity);
    int64_t prompt_stage() const { return prompt_stage_capacity_; }
    // The slots lent to the prompt chunk being run (empty between steps: after_step takes them
    // back).
    const std::vector<int32_t>& lent_slots() const { return lent_slots_; }
    // Whether the copy engines make some fills (the proxy exists: prefetches, or every fill).
    bool uses_copy_engines() const { return proxy_ != nullptr; }
    // Whether set_prefetch may have the copy engines make every fill: the device fetch reading a
    // host store the GPU reads (not the staging store).
    bool fills_by_engines_possible() const {
        return state_ != nullptr && !staging_ &&
               backend_.compute_memory() != mgl::memory_kind::host;
    }
    bool fills_by_copy_engines() const { return proxy_ != nullptr && fills_by_engines_; }
    // Copies the copy engines made so far (the proxy's; replayed decode graphs only).
    int64_t engine_copies() const { return proxy_ ? proxy_->served() : 0; }
    int32_t prefetch() const { return prefetch_; }
    // At most this many of a layer's prefetched experts are filled, the best-ranked predictions
    // not in slots (0: all of the top N). For the session attach() sets up next.
    void set_prefetch_fills(int32_t n) { prefetch_fills_ = n < 0 ? 0 : n; }
    int32_t prefetch_fills() const { return prefetch_fills_; }
    // Victims after the launch (device fetch, not the staging store; docs/expert-cache.md
    // "Victims after the launch"): a decode step the backend launches whole gets its victims
    // and ranks written into a pinned host block right after its launch, and the previous
    // step's replay runs then too, while the step runs, instead of between the two steps; the
    // step's first fetch that misses waits for them and copies them into device memory. Off
    // (and for every other step): both happen before the launch, the victims uploaded.
    void set_victims_after_launch(bool on);
    bool victims_after_launch() const { return victims_after_launch_; }
    // Device fetch: offers the victim slots for an eval of n_tokens tokens (before its graph);
    // `launched_whole`: the backend queues the graph whole (mgl::backend::launches_whole).
    void before_step(int64_t n_tokens, bool launched_whole = false);
    // The routing of one finished eval (Session's RoutingRecord: ids [n_moe][T][k]). With
    // victims after the launch, a decode step's replay waits for the next launch (or settle()).
    void after_step(const RoutingRecord& r);
    // Replays the step whose replay is still pending (victims after the launch), so the
    // counters, the policy and table_entry() describe every finished step.
    void settle();
    bool uses_device_fetch() const { return state_ != nullptr; }
    // The device fetch's state (memory starting with an mgl::expert_fetch_header), or null.
    const mgl::tensor* fetch_state() const { return state_; }
    // The staging store's stage (the header the last layer's fetch posted), or null.
    bool uses_staging() const { return stage_ != nullptr; }
    const mgl::expert_stage_header* stage_header() const {
        return stage_ ? static_cast<const mgl::expert_stage_header*>(stage_->data) : nullptr;
    }
    // Slots whose fill has been queued on the transfer queue and not yet seen done.
    int64_t pending_fills() const { return int64_t(pending_.size()); }
    // Whether the slot at backend address `address` has a fill that has not landed yet.
    bool slot_pending(int64_t address) const;
    bool uses_copy_stream() const { return transfers_ != nullptr; }

    // Bytes one slot takes for experts of `blob_bytes` (the memory plan counts slots with it).
    static uint64_t slot_bytes_for(uint64_t blob_bytes);

    // Settles first (the last decode step's replay may be pending).
    const OffloadStats& stats();
    const routing::CacheConfig& config() const { return config_; }
    uint64_t slot_bytes() const { return slot_stride_; }
    // What the table of MoE layer `layer` (index among MoE layers) holds for `expert` now, and
    // where the expert's bytes live when it is not resident.
    int64_t table_entry(int32_t layer, int32_t expert) const;
    int64_t home(int32_t layer, int32_t expert) const;
    // The slot's address in backend memory.
    int64_t slot_address(int32_t slot) const;
    // The expert in `slot`, as layer · n_experts + expert, or -1.
    int32_t slot_key(int32_t slot) const { return slot_key_[size_t(slot)]; }
    // The expert's bytes in the mapping.
    const uint8_t* blob(int32_t layer, int32_t expert) const;

private:
    void point_home();
    // Allocates the device fetch's state (once) and writes its empty-cache contents.
    void setup_device_fetch();
    // The staging store: allocates the stage (once) and writes its header.
    void setup_stage();
    // Where the device fetch's arrays sit in its state (expert_offload_device.cpp).
    struct StateLayout;
    StateLayout layout() const;
    // Device fetch: queues the download of the step's counters, id log and fill log into
    // pinned memory (Session calls it after queuing the step, so it shares the step's one
    // wait). Returns where the step's ids will be once it is done (every MoE layer's
    // n_tokens · k, back to back) when the id log holds them (a decoded token), else null.
    const int32_t* queue_fill_log(int64_t n_tokens);
    // Device fetch: one finished step's record, the log buffer its counters and logs came down
    // into, and what before_step offered it; replayed by settle().
    struct PendingReplay {
        RoutingRecord record;
        int log = 0;
        int64_t most_fills = 0;
        int64_t n_victims = 0;
    };
    // Device fetch: the step's fills, from the device's log, into the policy and the shadow.
    void replay_device_fills(const PendingReplay& p);
    // Device fetch: keeps the finished step's replay for settle(), and settles it at once
    // unless its victims came after its launch.
    void stash_replay(const RoutingRecord& r);
    // Device fetch: the policy's victims and their ranks (and with `recycle` every key's arrival
    // rank), laid out as the state lays them out from its victims on, into victims_at(); returns
    // the words written.
    size_t stage_victims(int64_t most, bool prompt, bool recycle);
    // Where stage_victims writes: the host block (a deferred step: victims after the launch),
    // else the upload staging after the counters.
    int64_t* victims_at();
    // Victims after the launch: the pending replay, then the launched step's victims, written
    // into the host block, then its number into the ready word (expert_fetch_header::
    // victims_ready).
    void write_victims_after_launch();
    // The header's words of victims after the launch: the host block's address (0: off) and the
    // steps whose victims are in device memory already (every one numbered so far).
    void write_victims_words();
    // Host bookkeeping of one expert moving into `slot` (evicting its occupant).
    void occupy(int32_t slot, int32_t key);
    // Forgets the fills whose fence has passed (their slots may be pointed at now).
    void settle_fills();
    // Writes the header's proxy words: the ring (0 without a proxy) and the counts served so far.
    void write_proxy_words();

    const WeightStore& store_;
    mgl::backend& backend_;
    routing::CacheConfig config_;
    std::unique_ptr<routing::ExpertCache> cache_;
    mgl::buffer_ptr slots_;
    uint64_t blob_bytes_ = 0;
    uint64_t slot_stride_ = 0;
    std::unique_ptr<mgl::transfer_queue> transfers_;
    std::vector<uint64_t> fill_fence_;          // per slot: the fence of its pending fill, 0: none
    std::vector<int32_t> pending_;              // slots with a pending fill
    std::vector<int32_t> slot_key_;             // occupant of each slot
    std::vector<std::vector<int64_t>> shadow_;  // per MoE layer: what its table holds
    OffloadStats stats_;
    int32_t top_k_ = 1;
    int32_t prefetch_ = 0;
    int32_t prefetch_fills_ = 0;
    bool fills_by_engines_ = false;  // set_prefetch: every fill through the proxy
    // Device fetch: the state mgl::expert_fetch reads (header, fill log, tables, homes,
    // victims, slot keys; expert_offload.cpp lays them out), the victims offered to the step
    // and the host copy of the header's counters they are uploaded from.
    mgl::context state_ctx_;
    mgl::tensor* state_ = nullptr;
    mgl::buffer_ptr state_buf_;
    std::vector<int32_t> victims_;
    std::vector<routing::Rank> arrival_ranks_;  // the policy's, before they become key ranks
    int64_t most_fills_ = 0;       // the most fills the step before_step prepared can log
    mgl::buffer_ptr upload_host_;  // pinned: the counters, then the victims and ranks uploaded
    // Pinned: the header, id log and fill log queue_fill_log downloads, two buffers used in turn
    // (a step's log is replayed while the next step's comes down into the other).
    mgl::buffer_ptr log_host_[2];
    int log_next_ = 0;     // the buffer the next queue_fill_log uses
    int log_queued_ = -1;  // the buffer queue_fill_log filled for the step not yet stashed
    std::optional<PendingReplay> pending_replay_;
    // Victims after the launch: on; the host block the device reads them from (pinned: the
    // ready word, then the victims, their ranks and the key ranks as the state lays them out);
    // the step before_step deferred (its victims are owed to it by queue_fill_log), what it
    // promised the device (n_victims, recycle); the steps numbered so far (the ready word
    // follows it).
    bool victims_after_launch_ = false;
    mgl::buffer_ptr late_host_;
    bool step_deferred_ = false;
    bool victims_owed_ = false;
    int64_t owed_victims_ = 0;
    bool owed_recycle_ = false;
    int64_t victims_seq_ = 0;
    // The staging store: the stage (pinned, device-mapped host memory; the tensor's data is its
    // host address, which is also its device address), null otherwise.
    bool staging_ = false;
    mgl::buffer_ptr stage_buf_;
    mgl::tensor* stage_ = nullptr;
    // The prompt stage (set_prompt_stage): the lent slots' count and addresses the step reads
    // (backend memory, [1 + capacity] i64) and their pinned upload; the slots lent to the step
    // being run (each holds an expert, named by slot_key_, copied back after it).
    mgl::buffer_ptr lend_buf_, lend_host_;
    mgl::tensor* lend_ = nullptr;
    int64_t prompt_stage_capacity_ = 0;
    std::vector<int32_t> lent_slots_;
    void lend_slots();
    void restore_lent_slots();
    // Prefetch by the copy engines (set_prefetch): declared last so it stops, and its copies
    // land, before the state and the slots are freed.
    std::unique_ptr<PrefetchProxy> proxy_;
};

}  // namespace minids
