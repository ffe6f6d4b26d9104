// The expert cache on the GPU (runtime/expert_offload.h): the demo model loaded with its experts
// left in the registered mapping (WeightOptions::experts_resident = false), a slot pool in device
// memory far smaller than the experts, decode replayed through the captured graph while the
// tables change between steps. The logits must equal those of the fully resident model (the
// same kernels read the same bytes, from a slot or over the bus), the tables on the device must
// hold what the cache says, and the hit counts must equal the simulator's on the run's trace;
// also with the fills on a copy stream beside the steps.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "expert_offload_test_util.h"
#include "mgl-cuda.h"
#include "model_test_util.h"
#include "routing/simulator.h"

using namespace minids;
using namespace minids::test;

namespace {

const bool no_gpu = !cuda_device_available();

// `staged`: the staging store whatever the system registers (else the store MINIDS_EXPERT_STORE
// picks, which may be the staging store too).
TestModel open_cuda(const std::string& path, bool experts_resident,
                    const mgl::cuda_fusions& fuse = {}, bool staged = false) {
    TestModel m;
    m.file = mds::MdsFile::open(path);
    mgl::cuda_options options;
    options.fuse = fuse;
    m.backend = mgl::make_cuda_backend(options);
    WeightOptions o;
    o.experts_resident = experts_resident;
    o.stage_experts = staged;
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend, o);
    return m;
}

// max|a - b| / max|b| of one row of logits (sizes must agree).
double worst_diff(const std::vector<float>& a, const std::vector<float>& b) {
    REQUIRE(a.size() == b.size());
    return worst_position_error(a, 1, a.size(), [&](size_t, size_t v) { return double(b[v]); });
}

}  // namespace

TEST_CASE("cuda expert offload: experts read in place or from slots give the resident logits" *
          doctest::skip(no_gpu)) {
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel resident = open_cuda(path, true);
    TestModel offloaded = open_cuda(path, false);
    REQUIRE(offloaded.model->weights().placement().experts_in_place);
    if (offloaded.model->weights().placement().experts_staged) {
        MESSAGE(
            "CUDA expert offload, host fetch: skipped, the staging store (it refuses the "
            "host fetch, which reads misses in place)");
        return;
    }
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const int64_t n_decode = 32;
    SessionParams sp;
    sp.kv_type = mgl::dtype::bf16;
    const ReferenceRun ref = greedy_reference(*resident.model, *resident.backend, sp, n_decode);
    const auto& [ref_prompt, tokens, ref_steps] = ref;

    // The third case fills the slots on a copy stream (mgl::transfer_queue) beside the steps.
    for (const auto& [policy, slots, copy_stream] :
         {std::tuple{routing::Policy::lru, int64_t(24), false},
          {routing::Policy::decay, int64_t(12), false},
          {routing::Policy::decay, int64_t(24), true}}) {
        CAPTURE(std::string(routing::policy_name(policy)));
        CAPTURE(copy_stream);
        routing::CacheConfig cfg;
        cfg.policy = policy;
        cfg.n_slots = slots;
        ExpertOffload offload(*offloaded.model, *offloaded.backend, cfg,
                              copy_stream ? offloaded.backend->make_transfer_queue() : nullptr);
        Session s(*offloaded.model, *offloaded.backend, sp);
        routing::RoutingTrace trace = empty_trace(*offloaded.model);
        size_t bad_tables = 0;
        record_routing(s, trace);
        s.set_expert_cache_hook([&](const RoutingRecord& r) {
            offload.after_step(r);
            offloaded.backend->synchronize();
            // The tables on the device hold what the cache says.
            const int32_t E = int32_t(offloaded.model->config().n_routed_experts);
            for (size_t l = 0; l < offloaded.model->moe_layers().size(); ++l) {
                std::vector<int64_t> entries(static_cast<size_t>(E));
                const auto& t = *offloaded.model->weights().expert_tables()[l].t;
                offloaded.backend->download(t, entries.data(), 0, entries.size() * 8);
                for (int32_t e = 0; e < E; ++e)
                    bad_tables += entries[size_t(e)] != offload.table_entry(int32_t(l), e);
            }
        });
        double worst = worst_diff(s.eval(prompt, true), ref_prompt);
        for (int64_t i = 0; i < n_decode; ++i) {
            const int32_t one[1] = {tokens[size_t(i)]};
            worst = std::max(worst, worst_diff(s.eval(one), ref_steps[size_t(i)]));
        }
        const OffloadStats& st = offload.stats();
        const routing::SimResult sim = routing::simulate(trace, cfg);
        MESSAGE("CUDA expert offload, " << std::string(routing::policy_name(policy))
                                        << std::string(copy_stream ? " (copy stream)" : "") << " "
                                        << slots << " of 160 slots: worst max|diff|/max|logit| "
                                        << worst << " against the resident model; " << st.hits
                                        << " hits of " << st.accesses << " (simulator " << sim.hits
                                        << "), " << st.fills << " fills");
        CHECK(worst <= 1e-6);
        CHECK(bad_tables == 0);
        CHECK(st.fills > slots);
        CHECK(st.hits == sim.hits);
    }
}

TEST_CASE("cuda expert offload: the device fetch gives the resident logits" *
          doctest::skip(no_gpu)) {
    // Misses copied into slots inside the replayed graph (mgl::expert_fetch: a plan kernel and
    // a copy kernel reading the registered host store); after every step the device's tables,
    // read back, must match the host's replay of the fill log, and every slot they point at must
    // hold exactly its expert's bytes. Twice: as is, and with the route_fetch fusion (the routing
    // launch plans the fetch, and waits there for victims uploaded after the launch), which must
    // give the same logits bit for bit and the same fills.
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel resident = open_cuda(path, true);
    mgl::cuda_fusions with_route_fetch;
    with_route_fetch.route_fetch = true;
    TestModel offloaded = open_cuda(path, false);
    if (offloaded.model->weights().placement().experts_staged) {
        MESSAGE(
            "CUDA expert offload, device fetch from a registered store: skipped, the staging "
            "store (its pools here are below n_experts; the staging store's own case runs)");
        return;
    }
    TestModel offloaded_fused = open_cuda(path, false, with_route_fetch);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const int64_t n_decode = 32;
    auto read = [](void* dst, const void* src, size_t n) {
        REQUIRE(cudaMemcpy(dst, src, n, cudaMemcpyDefault) == cudaSuccess);
    };
    // The prompt in one chunk (free slots only), and in chunks of 3 tokens (a miss may re-evict
    // an earlier arrival of the same pass), each against the resident model chunked alike.
    for (const int64_t ubatch : {512, 3})
        for (const auto& [policy, slots] : {std::pair{routing::Policy::decay, int64_t(12)},
                                            {routing::Policy::lru, int64_t(24)},
                                            {routing::Policy::lfu, int64_t(8)}}) {
            CAPTURE(ubatch);
            CAPTURE(std::string(routing::policy_name(policy)));
            CAPTURE(slots);
            SessionParams sp;
            sp.kv_type = mgl::dtype::bf16;
            sp.n_ubatch = ubatch;
            const ReferenceRun ref =
                greedy_reference(*resident.model, *resident.backend, sp, n_decode);
            const auto& [ref_prompt, tokens, ref_steps] = ref;
            routing::CacheConfig cfg;
            cfg.policy = policy;
            cfg.n_slots = slots;
            // Variants: 0 as is, 1 the route_fetch fusion, 2 and 3 the prompt stage lending the
            // whole pool (up to a layer's 32 experts) and 3 slots (the other misses read in
            // place). Each runs the prompt, the decode, and the prompt again: the second finds
            // the pool full, so with the stage it is lent slots whose experts come back after.
            std::vector<std::vector<float>> logits_of[4];
            OffloadStats stats_of[4];
            for (const int variant : {0, 1, 2, 3}) {
                CAPTURE(variant);
                const bool fused = variant == 1;
                const int64_t stage = variant == 2   ? std::min<int64_t>(slots, 32)
                                      : variant == 3 ? 3
                                                     : 0;
                TestModel& m = fused ? offloaded_fused : offloaded;
                ExpertOffload offload(*m.model, *m.backend, cfg, nullptr, true);
                offload.set_victims_after_launch(fused);
                offload.set_prompt_stage(stage);
                Session s(*m.model, *m.backend, sp);
                offload.attach(s);
                routing::RoutingTrace trace = empty_trace(*m.model);
                record_routing(s, trace);
                // Before the replay of a chunk that was lent slots: the first holds one of the
                // last MoE layer's experts (its stage's copy).
                const uint64_t blob_bytes = m.model->weights().expert_tables().at(0).blob_bytes;
                const int32_t last = int32_t(m.model->moe_layers().size()) - 1;
                int lent_chunks = 0, lent_found = 0;
                check_tables_after_each_step(s, offload, *m.model, *m.backend, read, [&] {
                    if (offload.lent_slots().empty()) return;
                    REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
                    std::vector<uint8_t> bytes(blob_bytes);
                    read(bytes.data(),
                         reinterpret_cast<const void*>(
                             offload.slot_address(offload.lent_slots().front())),
                         blob_bytes);
                    int found = 0;
                    for (int32_t e = 0; e < 32; ++e)
                        found += std::memcmp(bytes.data(), offload.blob(last, e), blob_bytes) == 0;
                    ++lent_chunks;
                    lent_found += found == 1;
                });
                std::vector<std::vector<float>>& logits = logits_of[variant];
                logits.push_back(s.eval(prompt, true));
                double worst = worst_diff(logits.back(), ref_prompt);
                for (int64_t i = 0; i < n_decode; ++i) {
                    const int32_t one[1] = {tokens[size_t(i)]};
                    logits.push_back(s.eval(one));
                    worst = std::max(worst, worst_diff(logits.back(), ref_steps[size_t(i)]));
                }
                s.truncate(0);
                logits.push_back(s.eval(prompt, true));
                worst = std::max(worst, worst_diff(logits.back(), ref_prompt));
                const bool lends = stage > 0 && ubatch == 512;
                CHECK(lent_chunks == (lends ? 1 : 0));
                CHECK(lent_found == lent_chunks);
                CHECK(offload.stats().stage_restores <= stage);
                CHECK((offload.stats().stage_restores > 0) == lends);
                const OffloadStats& st = offload.stats();
                stats_of[variant] = st;
                // The plan kernel made the decisions the simulator's model of the rules makes.
                const routing::SimResult sim = routing::simulate_device_fetch(trace, cfg);
                CHECK(st.hits == sim.hits);
                CHECK(st.fills == sim.fills);
                MESSAGE("CUDA expert offload, device fetch"
                        << std::string(fused ? " (route_fetch)" : "")
                        << (stage ? ", prompt stage " + std::to_string(stage) : std::string())
                        << ", prompt chunks of " << ubatch << ", "
                        << std::string(routing::policy_name(policy)) << " " << slots
                        << " of 160 slots: worst "
                        << "max|diff|/max|logit| " << worst << "; " << st.hits << " hits of "
                        << st.accesses << ", " << st.fills << " fills, " << st.reads_in_place
                        << " reads in place, " << double(st.fetch_ns) / 1e6
                        << " ms waiting on the fetch");
                CHECK(worst <= 1e-6);
                CHECK(st.fills > slots);
                CHECK(st.hits > 0);
                // The device timed its fetches: some time passed, and less than the whole run.
                CHECK(st.fetch_ns > 0);
                CHECK(st.fetch_ns < uint64_t(60e9));
            }
            // route_fetch changes where the plan runs, not what it decides; the prompt stage
            // where the prompt's kernels read their misses, not the bytes they read.
            CHECK(logits_of[2] == logits_of[0]);
            CHECK(logits_of[3] == logits_of[0]);
            for (const int v : {2, 3}) {
                CHECK(stats_of[v].fills == stats_of[0].fills);
                CHECK(stats_of[v].reads_in_place == stats_of[0].reads_in_place);
            }
            CHECK(logits_of[1] == logits_of[0]);
            CHECK(stats_of[1].hits == stats_of[0].hits);
            CHECK(stats_of[1].fills == stats_of[0].fills);
            CHECK(stats_of[1].reads_in_place == stats_of[0].reads_in_place);
            CHECK(stats_of[1].accesses == stats_of[0].accesses);
        }
}

TEST_CASE(
    "cuda expert offload: prefetch, on a side stream or behind the misses, gives the "
    "resident logits" *
    doctest::skip(no_gpu)) {
    // The device fetch with prefetch (mgl::expert_prefetch): each decode step's MoE layers but
    // the last fill up to N of the next layer's predicted experts, plan and copy on the side
    // stream beside the layer's expert kernels, joined before the next layer's fetch (side_stream
    // on; the default is one stream, the last two variants below). The
    // logits must equal the resident model's, the device's tables the host's replay, and the
    // decisions (fills, prefetches, hits) those of the same graph on one stream (side_stream
    // off: node order), of graphs run eagerly instead of replayed, and of prefetch copies made
    // by the copy engines through the host's proxy thread (MINIDS_PREFETCH_COPY=engines), and of
    // every fill made so, the layers' own too (MINIDS_FETCH_COPY=engines); and of that with the
    // victims uploaded after each replayed step's launch (MINIDS_VICTIMS=after-launch), once with
    // the tables checked after every step (so each replay runs before the next launch, and only
    // the victims come late) and once checked only at the end (each replay beside the next
    // step, as the CLI runs it); and of the last two on one stream (the default), where each
    // layer's fetch leaves its wait to the prefetch after it, which posts its copies behind the
    // layer's misses (cuda_fusions::prefetch_behind_misses).
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel resident = open_cuda(path, true);
    TestModel offloaded = open_cuda(path, false);  // one stream (the default schedule)
    if (offloaded.model->weights().placement().experts_staged) {
        MESSAGE("CUDA expert offload, prefetch: skipped, the staging store (no prefetch there)");
        return;
    }
    mgl::cuda_fusions side;
    side.side_stream = true;
    TestModel offloaded_side = open_cuda(path, false, side);
    const std::vector<int32_t>& prompt = offload_test_prompt;
    const int64_t n_decode = 32;
    auto read = [](void* dst, const void* src, size_t n) {
        REQUIRE(cudaMemcpy(dst, src, n, cudaMemcpyDefault) == cudaSuccess);
    };
    SessionParams sp;
    sp.kv_type = mgl::dtype::bf16;
    const ReferenceRun ref = greedy_reference(*resident.model, *resident.backend, sp, n_decode);
    const auto& [ref_prompt, tokens, ref_steps] = ref;
    for (const auto& [policy, slots, prefetch] :
         {std::tuple{routing::Policy::decay, int64_t(12), 2},
          {routing::Policy::lru, int64_t(24), 4},
          {routing::Policy::lfu, int64_t(8), 1}}) {
        CAPTURE(std::string(routing::policy_name(policy)));
        CAPTURE(slots);
        CAPTURE(prefetch);
        routing::CacheConfig cfg;
        cfg.policy = policy;
        cfg.n_slots = slots;
        constexpr int n_variants = 10;
        const char* names[n_variants] = {"side stream, replayed",
                                         "one stream, replayed",
                                         "side stream, eager",
                                         "copy engines, replayed",
                                         "copy engines for every fill, replayed",
                                         "every fill by the engines, victims after the launch",
                                         "the same, replays beside the next step",
                                         "one stream, prefetch behind the misses",
                                         "the same, replays beside the next step",
                                         "behind the misses, one fill per prefetch"};
        std::vector<std::vector<float>> logits_of[n_variants];
        OffloadStats stats_of[n_variants];
        for (int v = 0; v < n_variants; ++v) {
            CAPTURE(std::string(names[v]));
            TestModel& m = v == 1 || v >= 7 ? offloaded : offloaded_side;
            ExpertOffload offload(*m.model, *m.backend, cfg, nullptr, true);
            // The copy engines: the prefetch's copies issued by the host's proxy thread, each
            // layer's fetch waiting for them (the fetch's copy kernel otherwise).
            offload.set_prefetch(prefetch, v >= 3, v >= 4);
            // The last variant caps each prefetch at its best-ranked prediction not in a slot
            // (mgl::expert_prefetch's max_fills): other decisions, the same logits.
            offload.set_prefetch_fills(v == 9 ? 1 : 0);
            offload.set_victims_after_launch(v >= 5);
            CHECK(offload.uses_copy_engines() == (v >= 3));
            Session s(*m.model, *m.backend, sp);
            s.set_decode_graph(v != 2);
            offload.attach(s);
            if (v != 6 && v != 8)
                check_tables_after_each_step(s, offload, *m.model, *m.backend, read);
            std::vector<std::vector<float>>& logits = logits_of[v];
            logits.push_back(s.eval(prompt, true));
            double worst = worst_diff(logits.back(), ref_prompt);
            for (int64_t i = 0; i < n_decode; ++i) {
                const int32_t one[1] = {tokens[size_t(i)]};
                logits.push_back(s.eval(one));
                worst = std::max(worst, worst_diff(logits.back(), ref_steps[size_t(i)]));
            }
            const OffloadStats& st = offload.stats();
            stats_of[v] = st;
            check_tables(offload, *m.model, read);
            // Victims after the launch: every replayed decode step's (all but the first, eager,
            // decode step); each run beside a step when not settled by the hook.
            if (v >= 5) CHECK(st.host_beside_ns > 0);
            MESSAGE("CUDA expert offload, prefetch "
                    << prefetch << " (" << std::string(names[v]) << "), "
                    << std::string(routing::policy_name(policy)) << " " << slots
                    << " of 160 slots: worst "
                    << "max|diff|/max|logit| " << worst << "; " << st.hits << " hits of "
                    << st.accesses << ", " << st.fills << " fills, " << st.prefetches
                    << " prefetched, " << st.prefetch_used << " used");
            CHECK(worst <= 1e-6);
            CHECK(st.prefetches > 0);
            CHECK(st.prefetch_used > 0);
            CHECK(st.prefetch_used <= st.prefetches);
            // The copy engines made the replayed steps' prefetch copies (the first decode step
            // runs eagerly, where the copy kernel makes them).
            if (v >= 3) CHECK(offload.engine_copies() > 0);
            if (v == 3) CHECK(offload.engine_copies() <= int64_t(st.prefetches));
            // With every fill: more copies than prefetches (the layers' own misses too).
            if (v >= 4) CHECK(offload.engine_copies() > int64_t(st.prefetches));
            if (v >= 3)
                MESSAGE("  copies by the engines: " << offload.engine_copies() << " of " << st.fills
                                                    << " fills");
        }
        CHECK(logits_of[9] == logits_of[0]);
        if (prefetch > 1) CHECK(stats_of[9].prefetches < stats_of[7].prefetches);
        for (int v = 1; v < 9; ++v) {
            CAPTURE(std::string(names[v]));
            CHECK(logits_of[v] == logits_of[0]);
            CHECK(stats_of[v].hits == stats_of[0].hits);
            CHECK(stats_of[v].fills == stats_of[0].fills);
            CHECK(stats_of[v].prefetches == stats_of[0].prefetches);
            CHECK(stats_of[v].prefetch_used == stats_of[0].prefetch_used);
            CHECK(stats_of[v].reads_in_place == stats_of[0].reads_in_place);
        }
    }
}

TEST_CASE("cuda expert offload: the staging store gives the resident logits" *
          doctest::skip(no_gpu)) {
    // Nothing registered: the homes are pageable addresses in the file mapping, which the device
    // cannot read. Each fetch is the plan kernel, a host node copying the posted fills into the
    // pinned stage, then the copy kernel reading the stage; no miss may stay home. After every
    // step the device's tables and slots are checked as in the device fetch case. Also with the
    // route_fetch fusion requested, which a staged fetch must decline (same logits bit for bit).
    const std::string path = (models_dir() / "demo.mds").string();
    TestModel resident = open_cuda(path, true);
    mgl::cuda_fusions with_route_fetch;
    with_route_fetch.route_fetch = true;
    TestModel staged = open_cuda(path, false, {}, true);
    TestModel staged_fused = open_cuda(path, false, with_route_fetch, true);
    REQUIRE(staged.model->weights().placement().experts_staged);
    const int64_t n_decode = 32;
    auto read = [](void* dst, const void* src, size_t n) {
        REQUIRE(cudaMemcpy(dst, src, n, cudaMemcpyDefault) == cudaSuccess);
    };
    // 32 slots (n_experts, the fewest allowed): most of the 160 experts miss.
    for (const int64_t ubatch : {512, 3})
        for (const auto& [policy, slots] : {std::pair{routing::Policy::decay, int64_t(32)},
                                            {routing::Policy::lru, int64_t(48)},
                                            {routing::Policy::lfu, int64_t(96)}}) {
            CAPTURE(ubatch);
            CAPTURE(std::string(routing::policy_name(policy)));
            CAPTURE(slots);
            SessionParams sp;
            sp.kv_type = mgl::dtype::bf16;
            sp.n_ubatch = ubatch;
            const ReferenceRun ref =
                greedy_reference(*resident.model, *resident.backend, sp, n_decode);
            routing::CacheConfig cfg;
            cfg.policy = policy;
            cfg.n_slots = slots;
            std::vector<std::vector<float>> logits_of[2];
            for (const bool fused : {false, true}) {
                CAPTURE(fused);
                TestModel& m = fused ? staged_fused : staged;
                ExpertOffload offload(*m.model, *m.backend, cfg, nullptr, true);
                REQUIRE(offload.uses_staging());
                Session s(*m.model, *m.backend, sp);
                offload.attach(s);
                routing::RoutingTrace trace = empty_trace(*m.model);
                record_routing(s, trace);
                // (after_step throws on a read in place or a wrong stage count)
                check_tables_after_each_step(s, offload, *m.model, *m.backend, read);
                std::vector<std::vector<float>>& logits = logits_of[fused ? 1 : 0];
                logits.push_back(s.eval(offload_test_prompt, true));
                double worst = worst_diff(logits.back(), ref.prompt_logits);
                for (int64_t i = 0; i < n_decode; ++i) {
                    const int32_t one[1] = {ref.tokens[size_t(i)]};
                    logits.push_back(s.eval(one));
                    worst = std::max(worst, worst_diff(logits.back(), ref.step_logits[size_t(i)]));
                }
                const OffloadStats& st = offload.stats();
                MESSAGE("CUDA expert offload, staging store"
                        << std::string(fused ? " (route_fetch asked)" : "") << ", prompt chunks of "
                        << ubatch << ", " << std::string(routing::policy_name(policy)) << " "
                        << slots << " of 160 slots: worst max|diff|/max|logit| " << worst << "; "
                        << st.hits << " hits of " << st.accesses << ", " << st.fills << " fills, "
                        << double(st.fetch_ns) / 1e6 << " ms waiting on the fetch");
                CHECK(worst <= 1e-6);
                CHECK(st.reads_in_place == 0);
                CHECK(st.fills > slots);
                CHECK(st.hits > 0);
                // The simulator's model of the staging store's rules predicts the engine.
                const routing::SimResult sim =
                    routing::simulate_device_fetch(trace, cfg, false, true);
                CHECK(st.hits == sim.hits);
                CHECK(st.fills == sim.fills);
            }
            CHECK(logits_of[1] == logits_of[0]);
        }
}

namespace {

// Pages the process has pinned (/proc/self/status VmPin: what cudaHostRegister and pinned
// allocations hold through the kernel), in KiB; -1 when the kernel does not report it.
int64_t pinned_kib() {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
        if (line.rfind("VmPin:", 0) == 0) return std::stoll(line.substr(6));
    return -1;
}

size_t free_device_bytes() {
    size_t free_b = 0, total = 0;
    REQUIRE(cudaMemGetInfo(&free_b, &total) == cudaSuccess);
    return free_b;
}

}  // namespace

TEST_CASE(
    "cuda expert offload: nothing stays allocated or pinned once the cache and model are gone" *
    doctest::skip(no_gpu)) {
    // The driver's own counters: free device memory (cudaMemGetInfo) and the pages the process
    // has pinned. Three rounds of load (experts in a registered host store), a cache fetching
    // on the device, a prompt and decoded tokens, then everything destroyed: after the first
    // round (which may load modules and libraries once) nothing may grow.
    const std::string path = (models_dir() / "demo.mds").string();
    const std::vector<int32_t>& prompt = offload_test_prompt;
    std::vector<size_t> free_after;
    std::vector<int64_t> pinned_after;
    const int64_t pinned_before = pinned_kib();
    for (int round = 0; round < 3; ++round) {
        {
            TestModel m = open_cuda(path, false);
            routing::CacheConfig cfg;
            cfg.policy = routing::Policy::decay;
            // The staging store (MINIDS_EXPERT_STORE=staging) needs a slot per expert of a layer.
            cfg.n_slots = m.model->weights().placement().experts_staged ? 32 : 24;
            ExpertOffload offload(*m.model, *m.backend, cfg, nullptr, true);
            Session s(*m.model, *m.backend, SessionParams{});
            offload.attach(s);
            std::vector<float> last = s.eval(prompt);
            for (int i = 0; i < 8; ++i) {
                const int32_t one[1] = {argmax(last)};
                last = s.eval(one);
            }
            REQUIRE(offload.stats().fills > 0);
        }
        free_after.push_back(free_device_bytes());
        pinned_after.push_back(pinned_kib());
    }
    MESSAGE("CUDA expert offload, leak check: free device memory after rounds 1-3: "
            << free_after[0] / (1 << 20) << ", " << free_after[1] / (1 << 20) << ", "
            << free_after[2] / (1 << 20) << " MiB; pinned before " << pinned_before
            << " KiB, after rounds 1-3: " << pinned_after[0] << ", " << pinned_after[1] << ", "
            << pinned_after[2] << " KiB");
    constexpr size_t slack = 4u << 20;  // allocator granularity
    CHECK(free_after[2] + slack >= free_after[0]);
    CHECK(free_after[1] + slack >= free_after[0]);
    if (pinned_before >= 0) {
        CHECK(pinned_after[0] == pinned_before);
        CHECK(pinned_after[2] == pinned_before);
    }
}

#endif  // MINIDS_HAVE_CUDA
