// The expert cache's engine side (runtime/expert_offload.h) on the CPU backend, with the demo
// model (5 MoE layers x 32 experts, top-4): a pool far smaller than the experts a run uses gives
// the same logits, bit for bit, as the model without a cache; after every step each table
// entry points either home or at a slot holding exactly that expert's bytes; and the hit counts
// equal the offline simulator's on the trace of the same run, for every policy and both pool
// layouts. (On the CPU a slot is host memory, so this checks the bookkeeping, the table
// rewriting and the policy replay; the GPU test in test_expert_offload_cuda.cpp runs the same
// with slots in device memory and the experts read in place from the registered mapping.)
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "expert_offload_test_util.h"
#include "model/weight_store.h"
#include "model_test_util.h"
#include "routing/simulator.h"

using namespace minids;
using namespace minids::test;

TEST_CASE("expert offload: a small cache changes nothing in the logits and matches the simulator") {
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const int64_t n_decode = 24;
    // Without a cache: the prompt's logits and a greedy continuation.
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, n_decode);
    const auto& [ref_prompt, tokens, ref_steps] = ref;

    using routing::Admission;
    struct Case {
        routing::Policy policy;
        bool per_layer;
        int64_t slots;
        Admission admit = Admission::all;
    };
    for (const Case c :
         {Case{routing::Policy::lru, false, 24}, Case{routing::Policy::lfu, false, 8},
          Case{routing::Policy::decay, false, 12}, Case{routing::Policy::lru, true, 20},
          Case{routing::Policy::decay, true, 25},
          Case{routing::Policy::decay, false, 16, Admission::frequency},
          Case{routing::Policy::lfu, true, 25, Admission::frequency}}) {
        CAPTURE(std::string(routing::policy_name(c.policy)));
        CAPTURE(c.per_layer);
        CAPTURE(c.slots);
        CAPTURE(std::string(routing::admission_name(c.admit)));
        routing::CacheConfig cfg;
        cfg.policy = c.policy;
        cfg.per_layer = c.per_layer;
        cfg.n_slots = c.slots;
        cfg.admit = c.admit;
        ExpertOffload offload(*cached.model, *cached.backend, cfg);
        Session s(*cached.model, *cached.backend, SessionParams{});
        routing::RoutingTrace trace = empty_trace(*cached.model);
        record_routing(s, trace);
        // Reads in place, counted here from the tables as the step saw them: the distinct
        // experts of each layer whose entry pointed home.
        int64_t expected_reads = 0;
        bool reads_match = true;
        s.set_expert_cache_hook([&](const RoutingRecord& r) {
            std::set<std::pair<int32_t, int32_t>> home_reads;
            const int64_t per_layer = r.n_tokens * r.k;
            for (size_t i = 0; i < r.ids.size(); ++i) {
                const auto l = int32_t(int64_t(i) / per_layer);
                if (offload.table_entry(l, r.ids[i]) == offload.home(l, r.ids[i]))
                    home_reads.insert({l, r.ids[i]});
            }
            expected_reads += int64_t(home_reads.size());
            offload.after_step(r);
            reads_match = reads_match && offload.stats().reads_in_place == expected_reads;
            check_tables(offload, *cached.model);
        });

        CHECK(s.eval(prompt, true) == ref_prompt);
        bool all_equal = true;
        for (int64_t i = 0; i < n_decode; ++i) {
            const int32_t one[1] = {tokens[size_t(i)]};
            all_equal = all_equal && s.eval(one) == ref_steps[size_t(i)];
        }
        CHECK(all_equal);

        const OffloadStats& st = offload.stats();
        CHECK(st.steps == 1 + n_decode);
        if (c.admit == Admission::all)
            CHECK(st.fills > c.slots);  // experts were evicted and slots refilled
        CHECK(st.hits > 0);
        CHECK(reads_match);
        CHECK(st.reads_in_place > 0);
        // A decode step reads in place at most its misses (a miss whose slot the replay
        // evicted earlier in the same step was still read from the slot).
        CHECK(st.reads_in_place <= st.accesses - st.hits);
        CHECK(st.bytes_read_in_place ==
              uint64_t(st.reads_in_place) * cached.model->weights().expert_tables()[0].blob_bytes);
        const routing::SimResult sim = routing::simulate(trace, cfg);
        CHECK(st.accesses == sim.accesses);
        CHECK(st.hits == sim.hits);
        // Fills are counted per slot and step (a slot refilled twice in a step is one copy),
        // the simulator's per access: never more.
        CHECK(st.fills <= sim.fills);
        MESSAGE(std::string(routing::policy_name(c.policy))
                << std::string(c.per_layer ? " per-layer " : " global ") << c.slots
                << " of 160 slots: " << st.hits << " hits of " << st.accesses << " (simulator "
                << sim.hits << "), " << st.fills << " fills");
    }
}

TEST_CASE("expert offload: refuses a pool that cannot hold one token's experts") {
    TestModel m = open_test_model((models_dir() / "demo.mds").string());
    routing::CacheConfig cfg;
    cfg.n_slots = 3;  // top-4
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg), std::invalid_argument);
    cfg.n_slots = 12;
    cfg.per_layer = true;  // 2-3 per layer
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg), std::invalid_argument);
}

namespace {

// A transfer queue whose fences pass `delay` ticks after they are made (the test ticks once
// per step): the copies land at once (CPU memory), but the cache must not point at a slot
// before its fence has passed, as with a copy stream that has not finished.
class DelayedQueue final : public mgl::transfer_queue {
public:
    explicit DelayedQueue(int64_t delay) : delay_(delay) {}
    void copy(void* dst, const void* src, size_t n) override { std::memcpy(dst, src, n); }
    uint64_t fence() override {
        ready_at_.push_back(ticks_ + delay_);
        return ready_at_.size();
    }
    bool done(uint64_t f) override { return ticks_ >= ready_at_.at(size_t(f - 1)); }
    void drain() override { ticks_ = INT64_MAX / 2; }
    void signal(int64_t* word, int64_t value) override { *word = value; }  // (CPU memory)
    void tick() { ++ticks_; }

private:
    int64_t delay_, ticks_ = 0;
    std::vector<int64_t> ready_at_;
};

}  // namespace

TEST_CASE("expert offload: fills on a transfer queue are pointed at only once they have landed") {
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, 24);
    const auto& [ref_prompt, tokens, ref_steps] = ref;
    for (int64_t delay : {1, 3}) {
        CAPTURE(delay);
        routing::CacheConfig cfg;
        cfg.policy = routing::Policy::decay;
        cfg.n_slots = 24;
        auto queue = std::make_unique<DelayedQueue>(delay);
        DelayedQueue* q = queue.get();
        ExpertOffload offload(*cached.model, *cached.backend, cfg, std::move(queue));
        REQUIRE(offload.uses_copy_stream());
        Session s(*cached.model, *cached.backend, SessionParams{});
        routing::RoutingTrace trace = empty_trace(*cached.model);
        record_routing(s, trace);
        int64_t most_pending = 0, pointed_at_pending = 0;
        s.set_expert_cache_hook([&](const RoutingRecord& r) {
            q->tick();
            offload.after_step(r);
            check_tables(offload, *cached.model);
            most_pending = std::max(most_pending, offload.pending_fills());
            // No entry may point at a slot whose fill has not landed: every slot an entry
            // points at is one the cache has settled.
            for (int32_t l = 0; l < int32_t(cached.model->moe_layers().size()); ++l)
                for (int32_t e = 0; e < int32_t(cached.model->config().n_routed_experts); ++e)
                    pointed_at_pending += offload.table_entry(l, e) != offload.home(l, e) &&
                                          offload.slot_pending(offload.table_entry(l, e));
        });
        CHECK(s.eval(prompt, true) == ref_prompt);
        CHECK(decode_matches(s, ref));
        CHECK(most_pending > 0);
        CHECK(pointed_at_pending == 0);
        const OffloadStats& st = offload.stats();
        CHECK(st.hits == routing::simulate(trace, cfg).hits);  // the policy is unchanged
        // The fills were used once landed: entries point at slots by the end.
        int64_t at_slots = 0;
        for (int32_t l = 0; l < int32_t(cached.model->moe_layers().size()); ++l)
            for (int32_t e = 0; e < int32_t(cached.model->config().n_routed_experts); ++e)
                at_slots += offload.table_entry(l, e) != offload.home(l, e);
        CHECK(at_slots > 0);
        // Until then those experts were read in place although the policy counted hits.
        CHECK(st.reads_in_place > 0);
        offload.reset();  // drains the queue
        CHECK(offload.pending_fills() == 0);
    }
}

TEST_CASE("expert offload, device fetch: misses fetched into slots by the step change nothing") {
    // The CPU backend runs mgl::expert_fetch with host memory as "device" memory: the same
    // plan as the CUDA kernels, the tables rewritten inside the graph, the host's replay of the
    // fill log checked against the tables and slots after every step. With victims after the
    // launch switched on too (ExpertOffload::set_victims_after_launch): the CPU backend runs
    // every step as it is queued, so none may be deferred, and the switch must change nothing.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, 24);
    const auto& [ref_prompt, tokens, ref_steps] = ref;
    // 8 slots: fewer than a step's misses, so some are read in place (the victims run out).
    for (const bool host_block : {false, true})
        for (const auto& [policy, slots] : {std::pair{routing::Policy::decay, int64_t(12)},
                                            {routing::Policy::lru, int64_t(24)},
                                            {routing::Policy::lfu, int64_t(8)}}) {
            CAPTURE(host_block);
            CAPTURE(std::string(routing::policy_name(policy)));
            CAPTURE(slots);
            routing::CacheConfig cfg;
            cfg.policy = policy;
            cfg.n_slots = slots;
            ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
            offload.set_victims_after_launch(host_block);
            CHECK(offload.victims_after_launch() == host_block);
            REQUIRE(offload.uses_device_fetch());
            REQUIRE(!offload.uses_staging());  // the registered store: misses read from home
            Session s(*cached.model, *cached.backend, SessionParams{});
            offload.attach(s);
            routing::RoutingTrace trace = empty_trace(*cached.model);
            record_routing(s, trace);
            check_tables_after_each_step(s, offload, *cached.model, *cached.backend);
            CHECK(s.eval(prompt, true) == ref_prompt);
            CHECK(decode_matches(s, ref));
            const OffloadStats& st = offload.stats();
            CHECK(st.steps == 1 + int64_t(tokens.size()));
            CHECK(st.accesses == routing::simulate(trace, cfg).accesses);
            // The simulator's model of the device fetch predicts the engine exactly.
            const routing::SimResult sim = routing::simulate_device_fetch(trace, cfg);
            CHECK(st.hits == sim.hits);
            CHECK(st.fills == sim.fills);
            CHECK(st.fills > slots);  // slots were refilled
            CHECK(st.hits > 0);
            if (slots == 8) CHECK(st.reads_in_place > 0);
            CHECK(st.host_ns > 0);  // before_step's time, through attach's prepare
            MESSAGE("device fetch, " << std::string(routing::policy_name(policy)) << " " << slots
                                     << " slots: " << st.hits << " hits of " << st.accesses << ", "
                                     << st.fills << " fills, " << st.reads_in_place
                                     << " reads in place");
            // A cold cache again: every entry home, and the run repeats with the same logits.
            offload.reset();
            check_tables(offload, *cached.model);
            s.truncate(0);
            CHECK(s.eval(prompt, true) == ref_prompt);
        }
}

TEST_CASE("expert offload, prompt stage: a prompt's misses staged in lent slots change nothing") {
    // mgl::expert_prompt_stage after each MoE layer's fetch in a prompt chunk (12 tokens x top-4
    // >= 32 experts): the misses the fetch left home are copied into slots the cache lends the
    // chunk, and the experts read them there. The logits must stay the model's without a cache,
    // bit for bit; the cache's decisions must be those without the stage (the policy never
    // sees the loan); and after every step each entry must point home or at a slot holding its
    // expert's bytes (lent slots get theirs back). The prompt runs cold (free slots: nothing is
    // lent, the chunk fills them) and again warm (the pool full: the policy's lowest-ranked
    // slots lent, their experts copied back after the chunk). Before that chunk's replay, the
    // first lent slot must hold one of the last MoE layer's experts.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, 8);
    const auto& [ref_prompt, tokens, ref_steps] = ref;
    const uint64_t blob_bytes = cached.model->weights().expert_tables().at(0).blob_bytes;
    const int32_t last = int32_t(cached.model->moe_layers().size()) - 1;
    for (const auto& [slots, capacity] : {std::pair{int64_t(8), int64_t(3)},
                                          {int64_t(12), int64_t(12)},
                                          {int64_t(40), int64_t(32)}}) {
        CAPTURE(slots);
        CAPTURE(capacity);
        routing::CacheConfig cfg;
        cfg.n_slots = slots;
        OffloadStats without;
        for (const bool staged : {false, true}) {
            CAPTURE(staged);
            ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
            offload.set_prompt_stage(staged ? capacity : 0);
            CHECK(offload.prompt_stage() == (staged ? capacity : 0));
            Session s(*cached.model, *cached.backend, SessionParams{});
            offload.attach(s);
            int prompts_seen = 0, found_in_lent = 0;
            check_tables_after_each_step(s, offload, *cached.model, *cached.backend, [&] {
                if (offload.lent_slots().empty()) return;
                ++prompts_seen;
                const auto* lent = reinterpret_cast<const uint8_t*>(
                    offload.slot_address(offload.lent_slots().front()));
                int found = 0;
                for (int32_t e = 0; e < 32; ++e)
                    found += std::memcmp(lent, offload.blob(last, e), blob_bytes) == 0;
                found_in_lent += found == 1;
            });
            for (int round = 0; round < 2; ++round) {
                CAPTURE(round);
                s.truncate(0);
                CHECK(s.eval(offload_test_prompt, true) == ref_prompt);
                CHECK(offload.lent_slots().empty());  // taken back by the chunk's replay
                CHECK(decode_matches(s, ref));
            }
            const OffloadStats& st = offload.stats();
            if (!staged) {
                without = st;
                CHECK(st.reads_in_place > 0);  // the prompts left misses home for the stage
                CHECK(st.stage_restores == 0);
            } else {
                CHECK(prompts_seen == 1);
                CHECK(found_in_lent == 1);
                CHECK(st.hits == without.hits);
                CHECK(st.fills == without.fills);
                CHECK(st.reads_in_place == without.reads_in_place);
                // The second prompt found the pool full: the lent slots' experts came back.
                CHECK(st.stage_restores > 0);
                CHECK(st.stage_restores <= capacity);
                CHECK(st.bytes_restored == uint64_t(st.stage_restores) * blob_bytes);
            }
        }
    }
}

TEST_CASE("expert offload, prompt stage: lends no more slots than a layer can miss") {
    // A pool of 150 of the demo's 160 experts: once it is full at most 10 experts are out of
    // slots, so no layer of a chunk can miss more than 10, and no more slots are lent whatever
    // the capacity (each lent one costs a copy there and back). Random prompts until it is.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    routing::CacheConfig cfg;
    cfg.n_slots = 150;
    ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
    offload.set_prompt_stage(32);
    Session s(*cached.model, *cached.backend, SessionParams{});
    Session reference(*plain.model, *plain.backend, SessionParams{});
    offload.attach(s);
    size_t loans = 0, most_lent = 0;
    check_tables_after_each_step(s, offload, *cached.model, *cached.backend, [&] {
        if (offload.lent_slots().empty()) return;
        ++loans;
        most_lent = std::max(most_lent, offload.lent_slots().size());
    });
    std::mt19937 rng(3);
    const int32_t vocab = int32_t(cached.model->config().vocab_size);
    bool same = true;
    for (int i = 0; i < 200 && loans < 3; ++i) {
        std::vector<int32_t> prompt(12);
        for (auto& t : prompt) t = int32_t(rng() % uint32_t(vocab));
        s.truncate(0);
        reference.truncate(0);
        same = same && s.eval(prompt, true) == reference.eval(prompt, true);
    }
    CHECK(same);
    CHECK(loans == 3);
    CHECK(most_lent >= 1);
    CHECK(most_lent <= 10);
    MESSAGE("prompt stage with 150 of 160 slots: at most " << most_lent << " lent");
}

TEST_CASE("expert offload, prompt stage: a chunk that fails before its replay loses nothing") {
    // A warm prompt chunk is lent slots; its replay never runs (the hook throws, as an error or
    // an interrupt between the step and its bookkeeping would). The next step must give the lent
    // slots their experts back first: every entry home or at its bytes, and the logits of the
    // model without a cache. A reset() with a loan outstanding forgets it.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, 4);
    for (const bool reset_after : {false, true}) {
        CAPTURE(reset_after);
        routing::CacheConfig cfg;
        cfg.n_slots = 12;
        ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
        offload.set_prompt_stage(8);
        Session s(*cached.model, *cached.backend, SessionParams{});
        offload.attach(s);
        check_tables_after_each_step(s, offload, *cached.model, *cached.backend);
        CHECK(s.eval(offload_test_prompt, true) == ref.prompt_logits);  // cold: fills the pool
        CHECK(decode_matches(s, ref));
        bool failed = false;
        s.set_expert_cache_hook([&](const RoutingRecord&) {
            failed = !offload.lent_slots().empty();
            throw std::runtime_error("the step's bookkeeping failed");
        });
        s.truncate(0);
        CHECK_THROWS_AS(s.eval(offload_test_prompt, true), std::runtime_error);
        CHECK(failed);  // it had been lent slots
        CHECK(!offload.lent_slots().empty());
        if (reset_after) offload.reset();
        check_tables_after_each_step(s, offload, *cached.model, *cached.backend);
        s.truncate(0);
        CHECK(s.eval(offload_test_prompt, true) == ref.prompt_logits);
        CHECK(decode_matches(s, ref));
        check_tables(offload, *cached.model);
    }
}

TEST_CASE("expert offload, prompt stage: refused where it cannot run") {
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel m = open_test_model(path);
    routing::CacheConfig cfg;
    cfg.n_slots = 8;
    ExpertOffload host_fetch(*m.model, *m.backend, cfg);  // no device fetch
    CHECK_THROWS_AS(host_fetch.set_prompt_stage(4), std::invalid_argument);
    host_fetch.set_prompt_stage(0);  // off is always fine
    ExpertOffload device(*m.model, *m.backend, cfg, nullptr, true);
    CHECK_THROWS_AS(device.set_prompt_stage(9), std::invalid_argument);  // past the pool's 8
    CHECK_THROWS_AS(device.set_prompt_stage(-1), std::invalid_argument);
}

TEST_CASE("expert offload, prefetch: predicted experts filled a layer early change nothing") {
    // Each decode step's MoE layers but the last also fill up to N of the next layer's experts
    // as its router predicts them from this layer's input (mgl::expert_prefetch); the logits
    // must not change, the tables must hold what the host's replay says, and the counters must
    // add up: a prompt prefetches nothing, every prefetch is a fill, its layer reads some.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, {}, 24);
    const auto& [ref_prompt, tokens, ref_steps] = ref;
    // The last two fill at most 1 of their 4 predictions per layer (the best-ranked not in a
    // slot, mgl::expert_prefetch's max_fills): fewer prefetches than the same run uncapped.
    std::vector<int64_t> prefetched;
    for (const auto& [policy, slots, prefetch, fills] :
         {std::tuple{routing::Policy::decay, int64_t(12), 2, 0},
          {routing::Policy::lru, int64_t(24), 1, 0},
          {routing::Policy::decay, int64_t(40), 4, 0},
          {routing::Policy::lfu, int64_t(8), 2, 0},
          {routing::Policy::decay, int64_t(12), 4, 0},
          {routing::Policy::decay, int64_t(12), 4, 1}}) {
        CAPTURE(std::string(routing::policy_name(policy)));
        CAPTURE(slots);
        CAPTURE(prefetch);
        CAPTURE(fills);
        routing::CacheConfig cfg;
        cfg.policy = policy;
        cfg.n_slots = slots;
        ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
        offload.set_prefetch(prefetch);
        offload.set_prefetch_fills(fills);
        Session s(*cached.model, *cached.backend, SessionParams{});
        offload.attach(s);
        check_tables_after_each_step(s, offload, *cached.model, *cached.backend);
        CHECK(s.eval(prompt, true) == ref_prompt);
        CHECK(offload.stats().prefetches == 0);  // prompts do not prefetch
        const OffloadStats after_prompt = offload.stats();
        CHECK(decode_matches(s, ref));
        const OffloadStats st = offload.stats().since(after_prompt);
        const int64_t n_moe = int64_t(cached.model->moe_layers().size());
        CHECK(st.prefetches > 0);
        CHECK(st.prefetches <= int64_t(tokens.size()) * (n_moe - 1) * (fills ? fills : prefetch));
        prefetched.push_back(st.prefetches);
        CHECK(st.prefetch_used > 0);
        CHECK(st.prefetch_used <= st.prefetches);
        CHECK(st.fills >= st.prefetches);
        CHECK(st.hits >= st.prefetch_used);
        MESSAGE("prefetch " << prefetch << ", " << std::string(routing::policy_name(policy)) << " "
                            << slots << " slots, decode: " << st.hits << " hits of " << st.accesses
                            << ", " << st.fills << " fills, " << st.prefetches << " prefetched, "
                            << st.prefetch_used << " used");
    }
    REQUIRE(prefetched.size() == 6);
    CHECK(prefetched[5] < prefetched[4]);
}

TEST_CASE("expert offload, prefetch: refused where it cannot run") {
    TestModel m = open_test_model((models_dir() / "demo.mds").string());
    routing::CacheConfig cfg;
    cfg.policy = routing::Policy::decay;
    cfg.n_slots = 24;
    ExpertOffload host(*m.model, *m.backend, cfg, nullptr, false);  // the host fetch
    CHECK_THROWS_AS(host.set_prefetch(1), std::invalid_argument);
    CHECK_NOTHROW(host.set_prefetch(0));
    ExpertOffload device(*m.model, *m.backend, cfg, nullptr, true);
    CHECK_THROWS_AS(device.set_prefetch(5), std::invalid_argument);  // above the top-k of 4
    CHECK_THROWS_AS(device.set_prefetch(-1), std::invalid_argument);
    CHECK_NOTHROW(device.set_prefetch(4));
    CHECK(device.prefetch() == 4);
}

TEST_CASE("expert offload, device fetch: configurations it cannot serve are refused") {
    TestModel m = open_test_model((models_dir() / "demo.mds").string());
    routing::CacheConfig cfg;
    cfg.policy = routing::Policy::decay;
    cfg.n_slots = 24;
    cfg.per_layer = true;
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg, nullptr, true), std::invalid_argument);
    cfg.per_layer = false;
    cfg.admit = routing::Admission::frequency;
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg, nullptr, true), std::invalid_argument);
    cfg.admit = routing::Admission::all;
    CHECK_THROWS_AS(
        ExpertOffload(*m.model, *m.backend, cfg, m.backend->make_transfer_queue(), true),
        std::invalid_argument);
    CHECK_NOTHROW(ExpertOffload(*m.model, *m.backend, cfg, nullptr, true));
}

TEST_CASE("expert offload, device fetch: prompts in short chunks re-evict arrivals, same logits") {
    // Chunks of 3 tokens use 12 of 32 experts per layer: not a prompt in the device fetch's
    // sense, so victims are offered with their ranks and a miss may re-evict an earlier
    // arrival of the same pass. The run must still match the model without a cache (with the
    // same chunking) and the simulator's model of the rule.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel cached = open_test_model(path);
    SessionParams sp;
    sp.n_ubatch = 3;
    const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, sp, 8);
    for (const auto& [policy, slots] : {std::pair{routing::Policy::decay, int64_t(6)},
                                        {routing::Policy::lfu, int64_t(10)},
                                        {routing::Policy::lru, int64_t(16)}}) {
        CAPTURE(std::string(routing::policy_name(policy)));
        CAPTURE(slots);
        routing::CacheConfig cfg;
        cfg.policy = policy;
        cfg.n_slots = slots;
        ExpertOffload offload(*cached.model, *cached.backend, cfg, nullptr, true);
        // Victims after the launch switched on changes nothing where no step is launched whole.
        offload.set_victims_after_launch(policy == routing::Policy::lfu);
        Session s(*cached.model, *cached.backend, sp);
        offload.attach(s);
        routing::RoutingTrace trace = empty_trace(*cached.model);
        record_routing(s, trace);
        check_tables_after_each_step(s, offload, *cached.model, *cached.backend);
        CHECK(s.eval(offload_test_prompt, true) == ref.prompt_logits);
        bool all_equal = true;
        for (size_t i = 0; i < ref.tokens.size(); ++i) {
            const int32_t one[1] = {ref.tokens[i]};
            all_equal = all_equal && s.eval(one) == ref.step_logits[i];
        }
        CHECK(all_equal);
        const routing::SimResult sim = routing::simulate_device_fetch(trace, cfg);
        CHECK(offload.stats().hits == sim.hits);
        CHECK(offload.stats().fills == sim.fills);
        CHECK(offload.stats().fills > 2 * slots);  // slots were taken again within passes
        CHECK(offload.stats().fetch_ns == 0);      // only a GPU times its fetches
    }
}

namespace {

// The demo model with the staging store (WeightOptions::stage_experts): on the CPU the experts
// stay in the mapping either way, but the cache then fetches every miss through its stage.
TestModel open_staged_test_model(const std::string& path) {
    TestModel m;
    m.file = mds::MdsFile::open(path);
    m.backend = mgl::make_cpu_backend(2);
    WeightOptions o;
    o.stage_experts = true;
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend, o);
    return m;
}

// After a step: the stage holds what the last MoE layer's fetch posted, fill by fill in its
// fill-log order, each buffer exactly its expert's bytes. Returns the fills it held.
int64_t check_stage(const ExpertOffload& o, const Deepseek2Model& m) {
    const auto* h = static_cast<const mgl::expert_fetch_header*>(o.fetch_state()->data);
    auto* stage = const_cast<mgl::expert_stage_header*>(o.stage_header());
    const int64_t E = h->n_experts;
    REQUIRE(stage->n == h->n_fills - h->layer_fills);
    REQUIRE(stage->n <= stage->capacity);
    const auto* fill_log = reinterpret_cast<const int32_t*>(h->fill_log);
    const uint64_t bytes = m.weights().expert_tables().at(0).blob_bytes;
    int64_t bad = 0;
    for (int64_t i = 0; i < stage->n; ++i) {
        const int32_t key = fill_log[2 * (h->layer_fills + i)];
        const auto l = int32_t(key / E), e = int32_t(key % E);
        bad += mgl::expert_stage_sources(stage)[i] != o.home(l, e);
        bad += std::memcmp(mgl::expert_stage_buffer(stage, i), o.blob(l, e), bytes) != 0;
    }
    REQUIRE_MESSAGE(bad == 0, bad << " stage entries hold the wrong source or bytes");
    return stage->n;
}

}  // namespace

TEST_CASE("expert offload, staging store: every miss fetched through the stage, same logits") {
    // The store a host that cannot register (pin) the experts falls back to: the device fetch
    // copies each miss home -> stage buffer (the host) -> slot (the device), and no miss may
    // stay home (the device could not read it). On the CPU the op makes the same copies with
    // memcpy. Pools from the smallest allowed (32 = n_experts of 160: most experts miss), the
    // prompt in one chunk (a prompt: victims offered anyway) and in chunks of 3 tokens.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel plain = open_test_model(path);
    TestModel staged = open_staged_test_model(path);
    REQUIRE(staged.model->weights().placement().experts_staged);
    for (const int64_t ubatch : {512, 3}) {
        SessionParams sp;
        sp.n_ubatch = ubatch;
        const ReferenceRun ref = greedy_reference(*plain.model, *plain.backend, sp, 24);
        for (const auto& [policy, slots] : {std::pair{routing::Policy::decay, int64_t(32)},
                                            {routing::Policy::lru, int64_t(48)},
                                            {routing::Policy::lfu, int64_t(96)}}) {
            CAPTURE(ubatch);
            CAPTURE(std::string(routing::policy_name(policy)));
            CAPTURE(slots);
            routing::CacheConfig cfg;
            cfg.policy = policy;
            cfg.n_slots = slots;
            ExpertOffload offload(*staged.model, *staged.backend, cfg, nullptr, true);
            REQUIRE(offload.uses_staging());
            // Prefetch is not offered: its fills would need the host between plan and copy too.
            CHECK_THROWS_AS(offload.set_prefetch(1), std::invalid_argument);
            Session s(*staged.model, *staged.backend, sp);
            offload.attach(s);
            routing::RoutingTrace trace = empty_trace(*staged.model);
            record_routing(s, trace);
            int64_t staged_fills = 0;
            s.set_expert_cache_hook([&](const RoutingRecord& r) {
                offload.after_step(r);
                check_tables(offload, *staged.model);
                staged_fills += check_stage(offload, *staged.model);
            });
            CHECK(s.eval(offload_test_prompt, true) == ref.prompt_logits);
            bool all_equal = true;
            for (size_t i = 0; i < ref.tokens.size(); ++i) {
                const int32_t one[1] = {ref.tokens[i]};
                all_equal = all_equal && s.eval(one) == ref.step_logits[i];
            }
            CHECK(all_equal);
            const OffloadStats& st = offload.stats();
            CHECK(st.reads_in_place == 0);
            CHECK(st.accesses == routing::simulate(trace, cfg).accesses);
            // The simulator's model of the staging store's rules predicts the engine exactly.
            const routing::SimResult sim = routing::simulate_device_fetch(trace, cfg, false, true);
            CHECK(st.hits == sim.hits);
            CHECK(st.fills == sim.fills);
            CHECK(st.fills > slots);  // slots were refilled
            CHECK(st.hits > 0);
            CHECK(staged_fills > 0);  // the last layer's stage was checked with fills in it
            MESSAGE("staging store, prompt chunks of "
                    << ubatch << ", " << std::string(routing::policy_name(policy)) << " " << slots
                    << " of 160 slots: " << st.hits << " hits of " << st.accesses << ", "
                    << st.fills << " fills");
        }
    }
}

TEST_CASE("expert offload, staging store: configurations that would read in place are refused") {
    TestModel m = open_staged_test_model((models_dir() / "demo.mds").string());
    routing::CacheConfig cfg;
    cfg.policy = routing::Policy::decay;
    cfg.n_slots = 31;  // a layer may use all 32 experts in one step
    CHECK_THROWS_WITH_AS(ExpertOffload(*m.model, *m.backend, cfg, nullptr, true),
                         doctest::Contains("a slot for every expert"), std::invalid_argument);
    cfg.n_slots = 32;
    // The host fetch reads misses in place, and so do per-layer pools and frequency admission.
    CHECK_THROWS_WITH_AS(ExpertOffload(*m.model, *m.backend, cfg), doctest::Contains("staging"),
                         std::invalid_argument);
    cfg.per_layer = true;
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg), std::invalid_argument);
    cfg.per_layer = false;
    cfg.admit = routing::Admission::frequency;
    CHECK_THROWS_AS(ExpertOffload(*m.model, *m.backend, cfg), std::invalid_argument);
    cfg.admit = routing::Admission::all;
    CHECK_NOTHROW(ExpertOffload(*m.model, *m.backend, cfg, nullptr, true));
}

TEST_CASE("expert offload: MINIDS_EXPERT_STORE names a host store or is refused") {
    const char* old = std::getenv("MINIDS_EXPERT_STORE");
    const std::string saved = old ? old : "";
    unsetenv("MINIDS_EXPERT_STORE");
    CHECK(expert_store_request() == ExpertStoreRequest::copy);
    setenv("MINIDS_EXPERT_STORE", "copy", 1);
    CHECK(expert_store_request() == ExpertStoreRequest::copy);
    setenv("MINIDS_EXPERT_STORE", "mapped", 1);
    CHECK(expert_store_request() == ExpertStoreRequest::mapped);
    setenv("MINIDS_EXPERT_STORE", "staging", 1);
    CHECK(expert_store_request() == ExpertStoreRequest::staging);
    setenv("MINIDS_EXPERT_STORE", "staged", 1);  // a typo is an error, not the default store
    CHECK_THROWS_WITH_AS(expert_store_request(), doctest::Contains("MINIDS_EXPERT_STORE=staged"),
                         std::invalid_argument);
    if (old)
        setenv("MINIDS_EXPERT_STORE", saved.c_str(), 1);
    else
        unsetenv("MINIDS_EXPERT_STORE");
}
