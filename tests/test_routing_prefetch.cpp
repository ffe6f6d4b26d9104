// Prefetch in the expert-cache simulator (routing/prefetch.h): hand-made sequences with their
// used / wasted counts and modeled times, protection of the running and next layer's experts,
// depth 0 against the plain simulator, the predictions file and the synthetic predictions.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "routing/prefetch.h"
#include "routing/simulator.h"
#include "routing/synthetic.h"
#include "routing_test_util.h"

using namespace minids::routing;
using minids::test::make_trace;
using minids::test::random_trace;

namespace {

Predictions make_predictions(const RoutingTrace& tr, int32_t depth,
                             const std::vector<int16_t>& ids) {
    Predictions p;
    p.n_tokens = tr.n_tokens;
    p.n_layers = tr.shape.n_moe_layers();
    p.depth = depth;
    p.top_k = tr.shape.top_k;
    p.ids = ids;
    REQUIRE(int64_t(ids.size()) == p.n_tokens * p.n_layers * depth * p.top_k);
    return p;
}

}  // namespace

TEST_CASE("routing prefetch: depth 0 is the plain simulator, hit for hit") {
    minids::test::for_each_small_cache_config([](const RoutingTrace& tr, const CacheConfig& c) {
        const SimResult s = simulate(tr, c);
        TimingModel tm;
        tm.link_gbs = 2;  // 1000-byte experts: 0.5 us each
        tm.attn_us = 3;
        tm.moe_us = 2;
        tm.fetch_us = 1;
        const PrefetchResult r = simulate_prefetch(tr, c, nullptr, 0, tm);
        CHECK(r.sim.hits == s.hits);
        CHECK(r.sim.fills == s.fills);
        CHECK(r.sim.layer_hits == s.layer_hits);
        CHECK(r.demand_misses == s.accesses - s.hits);
        CHECK(r.prefetches == 0);
        // Without prefetch every miss stalls its layer: one dense layer (model layer 0) and 3
        // MoE layers per token, plus 0.5 us per miss.
        const double expect = 300.0 * (5 + 3 * 6) + 0.5 * double(s.accesses - s.hits);
        CHECK(r.time_us == doctest::Approx(expect));
        CHECK(r.stall_us == doctest::Approx(0.5 * double(s.accesses - s.hits)));
        CHECK(r.busy_us == doctest::Approx(r.stall_us));
    });
}

TEST_CASE("routing prefetch: a hand-made sequence, used and wasted, and its modeled time") {
    // 2 MoE layers (model layers 1, 2; layer 0 dense), 4 experts, top-1, 2 slots, LRU.
    // Token 0: (0, 1); token 1: (0, 3). Layer 0 predicts layer 1's expert: 1 (right), 2 (wrong).
    const RoutingTrace tr = make_trace(2, 4, 1, {0, 1, 0, 3});
    const Predictions pred = make_predictions(tr, 1, {1, -1, 2, -1});
    CacheConfig c;
    c.n_slots = 2;
    TimingModel tm;
    tm.link_gbs = 1;  // 1000-byte experts: 1 us each
    tm.attn_us = 10;
    tm.moe_us = 5;
    tm.fetch_us = 0;
    // t0 l0: miss 0 (lands at 26), prefetch 1 into the free slot (queued at 25, lands 27);
    // t0 l1: 1 hits (used); t1 l0: 0 hits, prefetch 2 evicts 1 (the only unpinned slot);
    // t1 l1: 3 misses, evicting 0 (2 is protected as layer 1's prediction); 2 is never read.
    for (bool demand_first : {true, false}) {
        tm.demand_first = demand_first;
        const PrefetchResult r = simulate_prefetch(tr, c, &pred, 1, tm);
        CHECK(r.sim.hits == 2);
        CHECK(r.demand_misses == 2);
        CHECK(r.prefetches == 2);
        CHECK(r.prefetch_used == 1);
        CHECK(r.prefetch_wasted == 1);
        CHECK(r.prefetch_transfers == 2);
        // 15 (dense) + 10 + 1 (miss) + 5 | 10 + 5 | 15 | 10 + 5 | 10 + 1 (miss) + 5 = 92 us.
        CHECK(r.time_us == doctest::Approx(92));
        CHECK(r.stall_us == doctest::Approx(2));
        CHECK(r.busy_us == doctest::Approx(4));
        CHECK(r.hidden_share() == doctest::Approx(0.5));
        CHECK(r.link_bytes_per_token() == doctest::Approx(2000));
    }
    // Without prefetch: 1 misses at t0 too, and 3 at t1 evicts 1 (LRU): 93 us.
    const PrefetchResult off = simulate_prefetch(tr, c, &pred, 0, tm);
    CHECK(off.sim.hits == 1);
    CHECK(off.time_us == doctest::Approx(93));
    // A slow link: the prefetch of 1 starts when the miss of 0 has landed (45) and lands at
    // 65, 5 us after layer 1's plan is done (60): the layer waits 5 us, not 20.
    tm.link_gbs = 0.05;  // 20 us per expert
    const PrefetchResult slow = simulate_prefetch(tr, c, &pred, 1, tm);
    // t0: 15 + 10 + 20 + 5 = 50 | 60 -> 65 + 5 = 70; t1: 85 | 95, 0 hits, + 5 = 100, prefetch of
    // 2 queued at 95, runs 95-115; | 110: the miss of 3 waits for the link: 115-135, + 5 = 140.
    CHECK(slow.time_us == doctest::Approx(140));
    CHECK(slow.stall_us == doctest::Approx(20 + 5 + 25));
}

TEST_CASE("routing prefetch: demand first or behind the queued prefetches") {
    // 3 MoE layers, top-1, every slot free; depth 2, every prediction wrong, so each layer's
    // expert misses. Layer 0 queues two prefetches (layers 1 and 2) behind its own miss.
    const RoutingTrace tr = make_trace(3, 8, 1, {0, 0, 0});
    const Predictions pred = make_predictions(tr, 2, {5, 6, 7, -1, -1, -1});
    CacheConfig c;
    c.n_slots = 8;
    TimingModel tm;
    tm.link_gbs = 0.1;  // 10 us per expert
    tm.attn_us = 2;
    tm.moe_us = 1;
    tm.fetch_us = 0;
    // Dense 3. l0: plan at 5, miss 5-15, MoE 15-16; prefetches of 5 (l1) and 6 (l2) queued at 5.
    // l1: plan at 18; the link took the first prefetch at 15 (15-25).
    //   demand first: the miss runs 25-35, ahead of the second prefetch; MoE 35-36; 7 (l2)
    //   queued at 18. l2: plan at 38; the link took 6 at 35 (35-45); the miss runs 45-55,
    //   ahead of 7; MoE 55-56.
    //   fifo: l1's miss waits for both prefetches (to 35), runs 35-45, MoE 45-46; l2: plan at
    //   48, 7 (queued at 18) runs 45-55, then the miss 55-65, MoE 65-66.
    tm.demand_first = true;
    const PrefetchResult first = simulate_prefetch(tr, c, &pred, 2, tm);
    CHECK(first.prefetches == 3);
    CHECK(first.prefetch_wasted == 3);
    CHECK(first.sim.hits == 0);
    CHECK(first.time_us == doctest::Approx(56));
    tm.demand_first = false;
    const PrefetchResult fifo = simulate_prefetch(tr, c, &pred, 2, tm);
    CHECK(fifo.time_us == doctest::Approx(66));
    CHECK(fifo.busy_us == doctest::Approx(60));
}

TEST_CASE("routing prefetch: the running layer's and the next layer's experts are never evicted") {
    // 3 MoE layers, top-1, 3 slots, LFU; depth 2. Token 0 loads (0,0), (1,3), (2,2), each used
    // once, (0,0) at token 1 twice. At token 1, layer 0 predicts 3 for layer 1 (resident, the
    // lowest ranked: count 1, older than (2,2)) and 3 for layer 2 (absent). The prefetch must
    // take (2,2), not the predicted (1,3) nor the running (0,0).
    const RoutingTrace tr = make_trace(3, 4, 1, {0, 3, 2, 0, 3, 3});
    const Predictions pred = make_predictions(tr, 2,
                                              {3, 2,    //
                                               2, -1,   //
                                               -1, -1,  //
                                               3, 3,    //
                                               3, -1,   //
                                               -1, -1});
    CacheConfig c;
    c.policy = Policy::lfu;
    c.n_slots = 3;
    const PrefetchResult r = simulate_prefetch(tr, c, &pred, 2);
    CHECK(r.sim.hits == 5);  // all but token 0's first expert
    CHECK(r.demand_misses == 1);
    CHECK(r.prefetches == 3);
    CHECK(r.prefetch_used == 3);
    CHECK(r.prefetch_wasted == 0);
    CHECK(r.sim.layer_hits == std::vector<int64_t>{1, 2, 2});

    // Randomized: with protection a prefetch never costs the next layer a correctly
    // predicted expert, so with perfect predictions one layer ahead every layer but the first
    // hits, at any pool size that holds two layers' experts.
    const RoutingTrace rt = random_trace(4, 16, 2, 400, 5);
    const Predictions perfect = generate_predictions(rt, {1.0}, 1, 3);
    for (Policy p : {Policy::lru, Policy::lfu, Policy::decay}) {
        for (int64_t slots : {4, 7, 20}) {
            CacheConfig cc;
            cc.policy = p;
            cc.n_slots = slots;
            const PrefetchResult pr = simulate_prefetch(rt, cc, &perfect, 1);
            CAPTURE(policy_name(p));
            CAPTURE(slots);
            CHECK(pr.sim.layer_hits[1] == 400 * 2);
            CHECK(pr.sim.layer_hits[2] == 400 * 2);
            CHECK(pr.sim.layer_hits[3] == 400 * 2);
            CHECK(pr.prefetch_wasted == 0);
        }
    }
}

TEST_CASE("routing prefetch: the predictions file is checked against the trace") {
    const RoutingTrace tr = random_trace(3, 12, 3, 20, 2);
    const Predictions p = generate_predictions(tr, {0.7}, 2, 9);
    const std::vector<std::byte> good = predictions_bytes(p);
    const Predictions back = parse_predictions(good, "p.npy", tr);
    CHECK(back.ids == p.ids);
    CHECK(back.depth == 2);
    // Truncated.
    std::vector<std::byte> cut(good.begin(), good.end() - 7);
    CHECK_THROWS_AS(parse_predictions(cut, "p.npy", tr), TraceError);
    CHECK_THROWS_AS(
        parse_predictions(std::vector<std::byte>(good.begin(), good.begin() + 5), "p.npy", tr),
        TraceError);
    // Wrong shape: another trace length, another layer count, top-k, or a 3-D array.
    const RoutingTrace shorter = random_trace(3, 12, 3, 19, 2);
    CHECK_THROWS_WITH_AS(parse_predictions(good, "p.npy", shorter),
                         doctest::Contains("do not fit the trace"), TraceError);
    const RoutingTrace other_l = random_trace(4, 12, 3, 20, 2);
    CHECK_THROWS_AS(parse_predictions(good, "p.npy", other_l), TraceError);
    const auto* b = reinterpret_cast<const std::byte*>(p.ids.data());
    const auto flat = make_npy("<i2", {20, 3, 6}, {b, p.ids.size() * 2});
    CHECK_THROWS_AS(parse_predictions(flat, "p.npy", tr), TraceError);
    // Wrong dtype and ids out of range.
    const auto as_u2 = make_npy("<u2", {20, 3, 2, 3}, {b, p.ids.size() * 2});
    CHECK_THROWS_WITH_AS(parse_predictions(as_u2, "p.npy", tr), doctest::Contains("<i2"),
                         TraceError);
    for (int16_t bad : {int16_t(12), int16_t(-2)}) {
        Predictions q = p;
        q.ids[17] = bad;
        CHECK_THROWS_WITH_AS(parse_predictions(predictions_bytes(q), "p.npy", tr),
                             doctest::Contains("outside [0, 12)"), TraceError);
    }
    // Depth above the predictions' is refused by the simulator.
    CacheConfig c;
    c.n_slots = 9;
    CHECK_THROWS_AS(simulate_prefetch(tr, c, &p, 3), std::invalid_argument);
    CHECK_THROWS_AS(simulate_prefetch(tr, c, nullptr, 1), std::invalid_argument);
    c.policy = Policy::belady;
    CHECK_THROWS_AS(simulate_prefetch(tr, c, &p, 1), std::invalid_argument);
}

TEST_CASE("routing prefetch: synthetic predictions keep each expert with the given accuracy") {
    SynthParams sp;
    sp.shape = preset_shape("demo");  // 32 experts, top-4, 5 MoE layers
    sp.n_tokens = 3000;
    const RoutingTrace tr = generate_trace(sp);
    const Predictions p = generate_predictions(tr, {0.7}, 2, 1);
    CHECK(p.ids == generate_predictions(tr, {0.7}, 2, 1).ids);  // deterministic
    CHECK(p.ids != generate_predictions(tr, {0.7}, 2, 2).ids);
    const int32_t L = 5, k = 4;
    for (int32_t d = 0; d < 2; ++d) {
        int64_t kept = 0, total = 0;
        for (int64_t t = 0; t < tr.n_tokens; ++t) {
            for (int32_t l = 0; l < L; ++l) {
                const int16_t* row = p.at(t, l, d);
                if (l + 1 + d >= L) {
                    for (int32_t j = 0; j < k; ++j) REQUIRE(row[j] == -1);
                    continue;
                }
                const uint16_t* real = tr.ids_at(t, l + 1 + d);
                for (int32_t j = 0; j < k; ++j) {
                    REQUIRE(row[j] >= 0);
                    for (int32_t j2 = 0; j2 < j; ++j2) REQUIRE(row[j2] != row[j]);  // distinct
                    bool in_real = false;
                    for (int32_t r = 0; r < k; ++r) in_real |= real[r] == row[j];
                    // A kept expert stays in its place; a replaced one is outside the real set.
                    REQUIRE(in_real == (row[j] == real[j]));
                    kept += in_real;
                    ++total;
                }
            }
        }
        CHECK(double(kept) / double(total) == doctest::Approx(std::pow(0.7, d + 1)).epsilon(0.03));
    }
    CHECK_THROWS_AS(generate_predictions(tr, {0.7, 0.6, 0.5}, 2, 1), std::invalid_argument);
    CHECK_THROWS_AS(generate_predictions(tr, {1.2}, 1, 1), std::invalid_argument);
    CHECK_THROWS_AS(generate_predictions(tr, {0.7}, 5, 1), std::invalid_argument);
}

TEST_CASE("routing CLI: gen --predictions-out, sim --prefetch, and bad predictions files") {
    using namespace minids::test;
    TempDir dir;
    const auto trace = (dir.path / "t.npz").string(), pred = (dir.path / "p.npy").string();
    CliResult r = run_minids({"routing", "gen", trace, "--preset", "v2-lite", "-n", "200",
                              "--predict-accuracy", "0.7", "--predict-depth", "2",
                              "--predictions-out", pred});
    REQUIRE(r.status == 0);
    r = run_minids({"routing", "sim", trace, "--slots", "8/layer", "--policy", "decay,belady",
                    "--prefetch", "0,2", "--predictions", pred, "--queue", "both", "-o", "json"});
    REQUIRE(r.status == 0);
    const auto rows = nlohmann::json::parse(r.out)["results"];
    REQUIRE(rows.size() == 8);  // 2 policies x 2 depths x 2 queues
    CHECK(rows[0]["prefetch_depth"] == 0);
    CHECK(rows[0]["prefetches_per_token"] == 0.0);
    CHECK(rows[2]["prefetch_depth"] == 2);
    CHECK(rows[2]["prefetches_per_token"].get<double>() > 0);
    CHECK(rows[2]["hit_rate"].get<double>() > rows[0]["hit_rate"].get<double>());
    CHECK(rows[6]["skipped"] == "prefetch needs an online policy");
    // The plain table is unchanged without --prefetch; the same hit rate at depth 0.
    r = run_minids(
        {"routing", "sim", trace, "--slots", "8/layer", "--policy", "decay", "-o", "json"});
    REQUIRE(r.status == 0);
    CHECK(nlohmann::json::parse(r.out)["results"][0]["hit_rate"] == rows[0]["hit_rate"]);
    r = run_minids({"routing", "sim", trace, "--prefetch", "1,2", "--predictions", pred});
    CHECK(r.status == 0);
    CHECK(r.out.find("Timing model: link 49 GB/s") != std::string::npos);
    // Refusals: one line, exit code 2.
    check_refused(run_minids({"routing", "sim", trace, "--prefetch", "1"}), "needs --predictions");
    check_refused(run_minids({"routing", "sim", trace, "--prefetch", "3", "--predictions", pred}),
                  "reach only 2");
    {
        std::ifstream in(pred, std::ios::binary);
        std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        std::ofstream(pred, std::ios::binary | std::ios::trunc)
            .write(bytes.data(), std::streamsize(bytes.size() / 2));
    }
    check_refused(run_minids({"routing", "sim", trace, "--prefetch", "1", "--predictions", pred}),
                  "p.npy");
    const auto other = (dir.path / "o.npz").string();
    REQUIRE(run_minids({"routing", "gen", other, "--preset", "v2-lite", "-n", "100",
                        "--predict-accuracy", "0.5", "--predictions-out", pred})
                .status == 0);
    check_refused(run_minids({"routing", "sim", trace, "--prefetch", "1", "--predictions", pred}),
                  "do not fit the trace");
    check_refused(run_minids({"routing", "gen", other, "--predictions-out", pred}), "go together");
}
