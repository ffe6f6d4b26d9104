// The expert cache's flags on the built binary (--cpu: the cache's bookkeeping only; the GPU
// path is tested in test_expert_offload_cuda.cpp): the same greedy text with a cache far
// smaller than the experts, the counters line, and each bad value refused with one line.
#include <doctest/doctest.h>

#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"

using namespace minids::test;

namespace {

std::string demo() { return (models_dir() / "demo.mds").string(); }

}  // namespace

TEST_CASE("cli expert cache: the same text with most experts out of the cache, and its counters") {
    const std::vector<std::string> base = {
        "run", "-m", demo(), "--cpu", "-p", "Return the number of", "-n", "32", "--temp", "0"};
    const CliResult plain = run_minids(base);
    REQUIRE(plain.status == 0);
    for (const char* policy : {"lru", "lfu", "decay"}) {
        CAPTURE(policy);
        std::vector<std::string> args = base;
        args.insert(args.end(), {"--expert-cache-slots", "24", "--expert-cache-policy", policy});
        const CliResult cached = run_minids(args);
        INFO("stderr: " << cached.err);
        CHECK(cached.status == 0);
        CHECK(cached.out == plain.out);
        CHECK(cached.err.find("expert cache: 24 slots, hit rate") != std::string::npos);
    }
    // Frequency admission: the same text.
    std::vector<std::string> admit = base;
    admit.insert(admit.end(), {"--expert-cache-slots", "24", "--expert-cache-admit", "frequency"});
    const CliResult admitted = run_minids(admit);
    INFO("stderr: " << admitted.err);
    CHECK(admitted.status == 0);
    CHECK(admitted.out == plain.out);
    CHECK(admitted.err.find("admitting frequent misses") != std::string::npos);
    // The device fetch (misses copied into slots by the step itself): the same text.
    std::vector<std::string> device = base;
    device.insert(device.end(), {"--expert-cache-slots", "24", "--expert-cache-fetch", "device"});
    const CliResult fetched = run_minids(device);
    INFO("stderr: " << fetched.err);
    CHECK(fetched.status == 0);
    CHECK(fetched.out == plain.out);
    CHECK(fetched.err.find("misses fetched into slots by the step") != std::string::npos);
    CHECK(fetched.err.find("expert cache: 24 slots, hit rate") != std::string::npos);
    // --expert-prefetch auto (the default) prefetches only where the copy engines make the
    // fills: not on the CPU.
    CHECK(fetched.err.find(" prefetched (") == std::string::npos);
    // Prefetch (device fetch): the same text, and its counters after the answer.
    std::vector<std::string> prefetch = device;
    prefetch.insert(prefetch.end(), {"--expert-prefetch", "2"});
    const CliResult pre = run_minids(prefetch);
    INFO("stderr: " << pre.err);
    CHECK(pre.status == 0);
    CHECK(pre.out == plain.out);
    CHECK(pre.err.find(" prefetched (") != std::string::npos);
    std::vector<std::string> per_layer = base;
    per_layer.insert(per_layer.end(),
                     {"--expert-cache-slots", "20", "--expert-cache-pools", "per-layer"});
    const CliResult pl = run_minids(per_layer);
    CHECK(pl.status == 0);
    CHECK(pl.out == plain.out);
}

TEST_CASE("cli expert cache: bad values are refused with one line") {
    const std::vector<std::string> base = {"run", "-m", demo(), "--cpu", "-p", "hi", "-n", "2"};
    auto with = [&](std::vector<std::string> extra) {
        std::vector<std::string> a = base;
        a.insert(a.end(), extra.begin(), extra.end());
        return run_minids(a);
    };
    check_refused(with({"--expert-cache-slots", "3"}), "fewer than the 4 experts");
    check_refused(with({"--expert-cache-slots", "12", "--expert-cache-pools", "per-layer"}),
                  "fewer than the 20 experts");
    check_refused(with({"--vram-budget", "12XB"}), "--vram-budget");
    check_refused(with({"--vram-budget", "-1G"}), "--vram-budget");
    check_refused(with({"--expert-cache-policy", "belady"}), "belady");
    check_refused(with({"--expert-cache-pools", "some"}), "some");
    check_refused(with({"--expert-cache-slots", "24", "--expert-cache-policy", "lru",
                        "--expert-cache-admit", "frequency"}),
                  "lru keeps no counts");
    check_refused(with({"--expert-cache-admit", "sometimes"}), "sometimes");
    check_refused(with({"--expert-cache-slots", "24", "--expert-cache-fetch", "host",
                        "--expert-prefetch", "1"}),
                  "prefetch needs the device fetch");
    check_refused(with({"--expert-cache-slots", "24", "--expert-prefetch", "5"}),
                  "expected 0 to 4 experts per layer");
    check_refused(with({"--expert-cache-slots", "24", "--expert-prefetch", "some"}),
                  "expected auto or a number of experts");
    check_refused(with({"--expert-cache-slots", "24", "--expert-prefetch-fills", "-1"}),
                  "expected auto or a number of experts");
    check_refused(with({"--expert-cache-slots", "24", "--expert-prompt-stage", "-1"}),
                  "expected auto or a number of experts from 0 to 1024");
    check_refused(with({"--expert-cache-slots", "24", "--expert-prompt-stage", "half"}),
                  "expected auto or a number of experts from 0 to 1024");
    // On the CPU (no device fetch reading a registered store) an asked-for stage is ignored,
    // said in one line; the run goes on.
    const CliResult stage_cpu = with({"--expert-cache-slots", "24", "--expert-prompt-stage", "8"});
    INFO("stderr: " << stage_cpu.err);
    CHECK(stage_cpu.status == 0);
    CHECK(stage_cpu.err.find("--expert-prompt-stage ignored") != std::string::npos);
    // auto asks for nothing that could be refused: with the host fetch it is 0.
    const CliResult host_auto = with({"--expert-cache-slots", "24", "--expert-cache-fetch", "host",
                                      "--expert-prefetch", "auto"});
    INFO("stderr: " << host_auto.err);
    CHECK(host_auto.status == 0);
}

TEST_CASE("cli expert cache: bench adds the four cold/warm x new/reused phases") {
    const CliResult r = run_minids({"bench", "-m", demo(), "--cpu", "--expert-cache-slots", "24",
                                    "-p", "32", "-n", "8", "-r", "1", "-o", "json"});
    INFO("stderr: " << r.err);
    REQUIRE(r.status == 0);
    const auto rows = nlohmann::json::parse(r.out);
    std::vector<std::string> phases;
    for (const auto& row : rows) {
        const std::string test = row.at("test").get<std::string>();
        if (test.rfind("expert cache: ", 0) != 0) continue;
        phases.push_back(test.substr(14));
        CHECK(row.at("slots").get<int64_t>() == 24);
        CHECK(row.at("tg_hit_rate").get<double>() >= 0.0);
        CHECK(row.at("tg_hit_rate").get<double>() <= 1.0);
        CHECK(row.at("tg_ts").get<double>() > 0.0);
    }
    CHECK(phases == std::vector<std::string>{"cold, new prompt", "warm, new prompt",
                                             "warm, reused prefix", "cold, reused prefix"});
    // A one-token prompt has no prefix to reuse (it once evaluated an empty batch).
    const CliResult one = run_minids({"bench", "-m", demo(), "--cpu", "--expert-cache-slots", "24",
                                      "-p", "1", "-n", "4", "-r", "1", "-o", "json"});
    INFO("stderr: " << one.err);
    CHECK(one.status == 0);
}

TEST_CASE("cli expert cache: bench sweeps slot counts and policies") {
    const CliResult r =
        run_minids({"bench", "-m", demo(), "--cpu", "--sweep-slots", "24,60", "--sweep-policies",
                    "lru,decay", "-p", "16", "-n", "4", "-r", "1", "-o", "json"});
    const CliResult adm = run_minids({"bench", "-m", demo(), "--cpu", "--sweep-slots", "24",
                                      "--sweep-policies", "decay", "--sweep-admit", "all,frequency",
                                      "-p", "16", "-n", "4", "-r", "1", "-o", "json"});
    INFO("stderr: " << adm.err);
    REQUIRE(adm.status == 0);
    std::vector<std::string> admits;
    for (const auto& row : nlohmann::json::parse(adm.out))
        if (row.contains("admit")) admits.push_back(row.at("admit").get<std::string>());
    CHECK(admits == std::vector<std::string>{"all", "all", "all", "all", "frequency", "frequency",
                                             "frequency", "frequency"});
    // Fetch modes: device is skipped with frequency admission (it admits every miss).
    const CliResult fe = run_minids(
        {"bench", "-m", demo(), "--cpu", "--sweep-slots", "24", "--sweep-admit", "all,frequency",
         "--sweep-fetch", "host,device", "-p", "16", "-n", "4", "-r", "1", "-o", "json"});
    INFO("stderr: " << fe.err);
    REQUIRE(fe.status == 0);
    std::vector<std::string> fetches;
    for (const auto& row : nlohmann::json::parse(fe.out))
        if (row.contains("fetch"))
            fetches.push_back(row.at("admit").get<std::string>() + "/" +
                              row.at("fetch").get<std::string>());
    std::vector<std::string> expected_fetches;
    for (const char* f : {"all/host", "all/device", "frequency/host"})
        for (int i = 0; i < 4; ++i) expected_fetches.push_back(f);
    CHECK(fetches == expected_fetches);
    CHECK(fe.err.find("skipping it with admission frequency") != std::string::npos);
    // Prefetch counts: the four phases once per count, the used share within [0, 1].
    const CliResult pf =
        run_minids({"bench", "-m", demo(), "--cpu", "--sweep-slots", "24", "--sweep-prefetch",
                    "0,2", "-p", "16", "-n", "8", "-r", "1", "-o", "json"});
    INFO("stderr: " << pf.err);
    REQUIRE(pf.status == 0);
    std::vector<int> counts;
    double prefetched = 0.0;
    for (const auto& row : nlohmann::json::parse(pf.out)) {
        if (!row.contains("prefetch")) continue;
        counts.push_back(row.at("prefetch").get<int>());
        prefetched += row.at("tg_prefetched_per_token").get<double>();
        CHECK(row.at("tg_prefetch_used_share").get<double>() >= 0.0);
        CHECK(row.at("tg_prefetch_used_share").get<double>() <= 1.0);
    }
    CHECK(counts == std::vector<int>{0, 0, 0, 0, 2, 2, 2, 2});
    CHECK(prefetched > 0.0);
    // --expert-prefetch-fills 1: the top 4 predicted, at most one copied per MoE layer but the
    // last (the demo model has 5 MoE layers), and the rows say so.
    const CliResult cap = run_minids({"bench", "-m", demo(), "--cpu", "--sweep-slots", "24",
                                      "--sweep-prefetch", "4", "--expert-prefetch-fills", "1", "-p",
                                      "16", "-n", "8", "-r", "1", "-o", "json"});
    INFO("stderr: " << cap.err);
    REQUIRE(cap.status == 0);
    int capped_rows = 0;
    for (const auto& row : nlohmann::json::parse(cap.out)) {
        if (!row.contains("prefetch")) continue;
        ++capped_rows;
        CHECK(row.at("prefetch").get<int>() == 4);
        CHECK(row.at("prefetch_fills").get<int>() == 1);
        CHECK(row.at("tg_prefetched_per_token").get<double>() <= 4.0);
    }
    CHECK(capped_rows == 4);
    // A replayed trace is never prefetched (the routers cannot predict it): its rows say 0.
    TempDir dir;
    const std::string trace = (dir.path / "t.npz").string();
    REQUIRE(run_minids({"run", "-m", demo(), "--cpu", "-p", "hi", "-n", "12", "--temp", "0",
                        "--record-routing", trace})
                .status == 0);
    const CliResult rp = run_minids({"bench", "-m", demo(), "--cpu", "--expert-cache-slots", "24",
                                     "--expert-prefetch", "2", "--replay-routing", trace, "-p", "8",
                                     "-n", "4", "-r", "1", "-o", "json"});
    INFO("stderr: " << rp.err);
    REQUIRE(rp.status == 0);
    int replayed_rows = 0;
    for (const auto& row : nlohmann::json::parse(rp.out)) {
        if (!row.contains("prefetch")) continue;
        ++replayed_rows;
        CHECK(row.at("prefetch").get<int>() == 0);
        CHECK(row.at("tg_prefetched_per_token").get<double>() == 0.0);
    }
    CHECK(replayed_rows == 4);
    INFO("stderr: " << r.err);
    REQUIRE(r.status == 0);
    // Four phases for each of the four settings, in slot-major order, each with its counters.
    std::vector<std::pair<int64_t, std::string>> settings;
    for (const auto& row : nlohmann::json::parse(r.out)) {
        if (row.at("test").get<std::string>().rfind("expert cache: ", 0) != 0) continue;
        settings.push_back({row.at("slots").get<int64_t>(), row.at("policy").get<std::string>()});
        const double filled = row.at("tg_mib_filled_per_token").get<double>();
        const double link = row.at("tg_mib_over_link_per_token").get<double>();
        CHECK(filled >= 0.0);
        CHECK(link >= filled);  // the link carries the fills and the reads in place
        CHECK(row.at("tg_link_floor_ts").get<double>() == 0.0);  // no host link on the CPU
    }
    std::vector<std::pair<int64_t, std::string>> expected;
    for (int64_t slots : {24, 60})
        for (const char* policy : {"lru", "decay"})
            for (int i = 0; i < 4; ++i) expected.push_back({slots, policy});
    CHECK(settings == expected);

    auto refused = [&](std::vector<std::string> extra) {
        std::vector<std::string> a = {"bench", "-m", demo(), "--cpu", "-p", "8", "-n", "2"};
        a.insert(a.end(), extra.begin(), extra.end());
        return run_minids(a);
    };
    check_refused(refused({"--sweep-slots", "24", "--expert-cache-slots", "30"}),
                  "give one of them");
    check_refused(refused({"--sweep-policies", "lru"}), "need the expert cache");
    check_refused(refused({"--sweep-admit", "frequency"}), "need the expert cache");
    check_refused(refused({"--sweep-slots", "2,24"}),
                  "bench sweep: expert cache: 2 slots are fewer");
    check_refused(refused({"--sweep-policies", "belady", "--sweep-slots", "24"}), "belady");
}
