// The routing trace file: round trip, statistics on a hand-made trace, and truncated,
// mis-shaped or hostile files refused with one TraceError (exit code 2 from the CLI).
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "cli_test_util.h"
#include "routing/trace.h"
#include "routing/trace_stats.h"
#include "routing_test_util.h"

using namespace minids::routing;
using namespace minids::test;

namespace {

void write_bytes(const std::filesystem::path& p, const std::vector<std::byte>& b) {
    std::ofstream(p, std::ios::binary)
        .write(reinterpret_cast<const char*>(b.data()), std::streamsize(b.size()));
}

RoutingTrace parse_bytes(std::vector<std::byte> b) {
    return parse_trace(NpzArchive::from_bytes(std::move(b), "t.npz"));
}

// An archive like trace_bytes(tr) but with one member replaced (or added, or removed when
// `bytes` is empty).
std::vector<std::byte> with_member(const RoutingTrace& tr, const std::string& name,
                                   std::vector<std::byte> bytes) {
    const NpzArchive a = NpzArchive::from_bytes(trace_bytes(tr), "t.npz");
    NpzWriter w;
    for (const char* m : {"header.npy", "ids.npy", "weights.npy", "prefill.npy", "step.npy"}) {
        if (m == name) continue;
        auto s = a.member(m);
        w.add(m, std::vector<std::byte>(s.begin(), s.end()));
    }
    if (!bytes.empty()) w.add(name, std::move(bytes));
    return w.to_bytes();
}

std::vector<std::byte> npy_i32(const std::vector<int64_t>& shape, const std::vector<int32_t>& v) {
    std::vector<std::byte> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return make_npy("<i4", shape, b);
}

std::vector<std::byte> header_npy(const std::string& json) {
    std::vector<std::byte> b(json.size());
    std::memcpy(b.data(), json.data(), json.size());
    return make_npy("|u1", {int64_t(b.size())}, b);
}

std::string error_of(const std::vector<std::byte>& b) {
    try {
        parse_bytes(b);
    } catch (const TraceError& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("routing trace: write and read back, header fields kept, numpy-style dtypes read") {
    TempDir dir;
    RoutingTrace tr = random_trace(3, 40, 4, 25, 3);
    tr.prefill[0] = tr.prefill[1] = 1;
    tr.step[1] = 0;
    for (size_t t = 2; t < tr.step.size(); ++t) tr.step[t] = int32_t(t - 1);
    tr.extra["model"] = "m.mds";
    const auto path = (dir.path / "t.npz").string();
    write_trace(tr, path);
    const RoutingTrace back = read_trace(path);
    CHECK(back.shape.n_experts == 40);
    CHECK(back.shape.top_k == 4);
    CHECK(back.shape.moe_layers == tr.shape.moe_layers);
    CHECK(back.shape.expert_bytes == 1000);
    CHECK(back.n_tokens == 25);
    CHECK(back.ids == tr.ids);
    CHECK(back.weights == tr.weights);
    CHECK(back.prefill == tr.prefill);
    CHECK(back.step == tr.step);
    CHECK(back.extra.value("model", "") == "m.mds");
    CHECK(back.source == "test");

    // ids saved by numpy as int32 (and without the optional step/prefill members) read the same.
    std::vector<int32_t> wide(tr.ids.begin(), tr.ids.end());
    auto b = with_member(tr, "ids.npy", npy_i32({25, 3, 4}, wide));
    b = with_member(parse_bytes(b), "step.npy", {});
    const RoutingTrace t2 = parse_bytes(b);
    CHECK(t2.ids == tr.ids);
    CHECK(t2.step[24] == 24);

    // More than 256 experts: ids are stored as <u2.
    RoutingTrace big = random_trace(1, 300, 2, 10, 4);
    big.ids[0] = 299;
    big.ids[1] = 3;
    CHECK(parse_bytes(trace_bytes(big)).ids == big.ids);
}

TEST_CASE("routing trace: append_step takes the engine's [layer][token][k] layout") {
    RoutingTrace tr;
    tr.shape = {8, 2, 100, {1, 2}};
    // 2 tokens, 2 layers, k = 2: layer 0 rows (t0: 1 2, t1: 3 4), layer 1 rows (t0: 5 6, t1: 7 0)
    const int32_t ids[] = {1, 2, 3, 4, 5, 6, 7, 0};
    const float w[] = {.1f, .2f, .3f, .4f, .5f, .6f, .7f, .8f};
    tr.append_step(2, true, ids, w);
    tr.append_step(1, false, ids, w);  // 1 token: layer 0 = (1 2), layer 1 = (3 4)
    CHECK(tr.n_tokens == 3);
    CHECK(std::vector<uint16_t>(tr.ids.begin(), tr.ids.end()) ==
          std::vector<uint16_t>{1, 2, 5, 6, 3, 4, 7, 0, 1, 2, 3, 4});
    CHECK(tr.weights[4] == .3f);
    CHECK(tr.prefill == std::vector<uint8_t>{1, 1, 0});
    CHECK(tr.step == std::vector<int32_t>{0, 0, 1});
    const int32_t bad[] = {1, 9};
    CHECK_THROWS_AS(tr.append_step(1, false, bad, w), TraceError);
    CHECK(select_tokens(tr, "decode").n_tokens == 1);
    CHECK(select_tokens(tr, "prefill").ids.size() == 8);
}

TEST_CASE("routing stats: hand-made trace") {
    // One layer, 4 experts, top-2: (0 1) (0 2) (0 1) (3 2).
    const RoutingTrace tr = make_trace(1, 4, 2, {0, 1, 0, 2, 0, 1, 3, 2});
    const TraceStats st = compute_stats(tr);
    const LayerStats& l = st.layers[0];
    CHECK(l.share == std::vector<double>{3.0 / 8, 2.0 / 8, 2.0 / 8, 1.0 / 8});
    CHECK(l.overlap_next == doctest::Approx(2.0 / 6));  // 0 at t1, 0 at t2, none at t3
    // reuse distances: t1: 0 (1); t2: 0 (1), 1 (2); t3: 2 (2) -> within 4: 4 of 8 accesses.
    CHECK(l.reuse_within[0] == doctest::Approx(0.5));
    CHECK(l.reuse_hist[0] == doctest::Approx(2.0 / 8));
    CHECK(l.reuse_hist[1] == doctest::Approx(2.0 / 8));
    CHECK(l.reuse_hist[8] == doctest::Approx(4.0 / 8));  // first uses
    CHECK(l.experts_50 == 2);
    CHECK(l.entropy_ratio < 1.0);
}

TEST_CASE("routing trace: hostile files are refused with one TraceError") {
    const RoutingTrace tr = random_trace(2, 16, 3, 20, 5);
    const std::vector<std::byte> good = trace_bytes(tr);
    CHECK_NOTHROW(parse_bytes(good));

    SUBCASE("every truncation") {
        for (size_t n = 0; n < good.size(); n += (n < 200 ? 1 : 7)) {
            CAPTURE(n);
            CHECK_THROWS_AS(parse_bytes(std::vector<std::byte>(good.begin(), good.begin() + n)),
                            TraceError);
        }
    }
    SUBCASE("random byte flips never crash and never pass unnoticed (CRC)") {
        std::mt19937 rng(9);
        for (int i = 0; i < 2000; ++i) {
            auto b = good;
            b[rng() % b.size()] ^= std::byte(1 + rng() % 255);
            try {
                const RoutingTrace t = parse_bytes(b);
                // A flip may hit the zip's own unused fields (times, attributes): then the
                // contents must be intact.
                REQUIRE(t.ids == tr.ids);
                REQUIRE(t.weights == tr.weights);
            } catch (const TraceError&) {
            }
        }
    }
    SUBCASE("mis-shaped and out-of-range contents") {
        CHECK(error_of(with_member(tr, "ids.npy", npy_i32({20, 2, 2}, std::vector<int32_t>(80, 1))))
                  .find("expected shape [20, 2, 3]") != std::string::npos);
        std::vector<int32_t> ids(tr.ids.begin(), tr.ids.end());
        ids[7] = 16;
        CHECK(error_of(with_member(tr, "ids.npy", npy_i32({20, 2, 3}, ids))).find("outside") !=
              std::string::npos);
        ids[7] = -1;
        CHECK(error_of(with_member(tr, "ids.npy", npy_i32({20, 2, 3}, ids))).find("outside") !=
              std::string::npos);
        ids.assign(tr.ids.begin(), tr.ids.end());
        ids[4] = ids[3];
        CHECK(error_of(with_member(tr, "ids.npy", npy_i32({20, 2, 3}, ids))).find("twice") !=
              std::string::npos);
        std::vector<float> w = tr.weights;
        w[5] = std::nanf("");
        std::vector<std::byte> wb(w.size() * 4);
        std::memcpy(wb.data(), w.data(), wb.size());
        CHECK(error_of(with_member(tr, "weights.npy", make_npy("<f4", {20, 2, 3}, wb)))
                  .find("not finite") != std::string::npos);
        CHECK(error_of(with_member(tr, "weights.npy", make_npy("<f8", {20, 2, 3}, wb)))
                  .find("expected 960 bytes") != std::string::npos);
        CHECK(error_of(with_member(tr, "weights.npy", {})).find("missing member weights.npy") !=
              std::string::npos);
        std::vector<int32_t> steps(20, 3);
        steps[10] = 2;
        CHECK(error_of(with_member(tr, "step.npy", npy_i32({20}, steps))).find("non-decreasing") !=
              std::string::npos);
        CHECK(error_of(with_member(tr, "prefill.npy", npy_i32({20}, std::vector<int32_t>(20, 2))))
                  .find("booleans") != std::string::npos);
    }
    SUBCASE("bad headers") {
        const std::string ok =
            R"("format": "minids-routing-trace", "version": 1, "n_experts": 16, "top_k": 3,)"
            R"( "expert_bytes": 1000, "moe_layers": [1, 2])";
        CHECK(error_of(with_member(tr, "header.npy", header_npy("{" + ok + R"(, "n_tokens": 20})")))
                  .empty());
        for (const auto& [json, expect] : std::vector<std::pair<std::string, std::string>>{
                 {"not json", "not valid JSON"},
                 {"[1, 2]", "JSON object"},
                 {"{" + ok + R"(, "n_tokens": 21})", "expected shape [21, 2, 3]"},
                 {"{" + ok + R"(, "n_tokens": 0})", "no tokens"},
                 {"{" + ok + R"(, "n_tokens": -5})", "no tokens"},
                 {"{" + ok + R"(, "n_tokens": "20"})", "\"n_tokens\""},
                 {R"({"format": "x", "version": 1})", "not a minids routing trace"},
                 {R"({"format": "minids-routing-trace", "version": 2})", "version 2"},
                 {R"({"format": "minids-routing-trace", "version": 1, "n_experts": 16, )"
                  R"("top_k": 17, "expert_bytes": 1, "moe_layers": [1, 2], "n_tokens": 20})",
                  "top_k"},
                 {R"({"format": "minids-routing-trace", "version": 1, "n_experts": 16, )"
                  R"("top_k": 3, "expert_bytes": 1, "moe_layers": [2, 1], "n_tokens": 20})",
                  "ascending"},
                 {R"({"format": "minids-routing-trace", "version": 1, "n_experts": 1e30, )"
                  R"("top_k": 3, "expert_bytes": 1, "moe_layers": [1], "n_tokens": 20})",
                  "n_experts"},
             }) {
            CAPTURE(json);
            const std::string e = error_of(with_member(tr, "header.npy", header_npy(json)));
            CHECK(e.find(expect) != std::string::npos);
        }
    }
    SUBCASE("bad .npy headers") {
        auto npy = make_npy("<i4", {20, 2, 3}, std::vector<std::byte>(480));
        const std::string hdr = "{'descr': '<i4', 'fortran_order': True, 'shape': (20, 2, 3),  }";
        std::memcpy(npy.data() + 10, hdr.data(), hdr.size());
        CHECK(error_of(with_member(tr, "ids.npy", npy)).find("Fortran") != std::string::npos);
        npy = make_npy("<i4", {20, 2, 3}, std::vector<std::byte>(480));
        npy[9] = std::byte(0xFF);  // header length past the end
        CHECK(error_of(with_member(tr, "ids.npy", npy)).find("truncated") != std::string::npos);
        CHECK(error_of(with_member(tr, "ids.npy",
                                   make_npy(">i4", {20, 2, 3}, std::vector<std::byte>(480))))
                  .find("unsupported dtype") != std::string::npos);
        CHECK(error_of(with_member(tr, "ids.npy",
                                   make_npy("<i4", {999999999999999, 99999999999, 3},
                                            std::vector<std::byte>(480))))
                  .find("ids.npy") != std::string::npos);
    }
}

TEST_CASE("routing CLI: a bad trace is one line on stderr and exit code 2") {
    TempDir dir;
    const RoutingTrace tr = random_trace(2, 16, 3, 20, 5);
    auto b = trace_bytes(tr);
    write_bytes(dir.path / "cut.npz", std::vector<std::byte>(b.begin(), b.end() - 30));
    write_bytes(dir.path / "good.npz", b);
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"routing", "stats", (dir.path / "cut.npz").string()},
             {"routing", "sim", (dir.path / "cut.npz").string()},
             {"routing", "sim", (dir.path / "missing.npz").string()},
             {"routing", "fit", (dir.path / "cut.npz").string()},
             {"routing", "sim", (dir.path / "good.npz").string(), "--slots", "97"},
             {"routing", "sim", (dir.path / "good.npz").string(), "--policy", "fifo"},
             {"routing", "sim", (dir.path / "good.npz").string(), "--slots", "12x"},
             {"routing", "sim", (dir.path / "good.npz").string(), "-o", "xml"},
             {"routing", "sim", (dir.path / "good.npz").string(), "--admit", "never"},
             {"routing", "gen", (dir.path / "g.npz").string(), "--stickiness", "0.7",
              "--cross-layer", "0.6"},
         }) {
        const CliResult r = run_minids(args);
        CAPTURE(args.back());
        INFO("stderr: " << r.err);
        CHECK(r.status == 2);
        CHECK(lines_of(r.err).size() == 1);
        CHECK(r.err.find("internal error") == std::string::npos);
        CHECK(r.out.empty());
    }
}

TEST_CASE("routing CLI: gen, stats, sim and fit end to end") {
    TempDir dir;
    const auto trace = (dir.path / "v2.npz").string();
    CliResult r = run_minids({"routing", "gen", trace, "--preset", "v2-lite", "-n", "300", "--zipf",
                              "0.8", "--stickiness", "0.3", "--cross-layer", "0.2"});
    REQUIRE(r.status == 0);
    r = run_minids({"routing", "stats", trace, "-o", "json"});
    REQUIRE(r.status == 0);
    const auto st = nlohmann::json::parse(r.out);
    CHECK(st["layers"].size() == 26);
    CHECK(st["trace"]["top_k"] == 6);
    r = run_minids({"routing", "sim", trace, "--slots", "59%,8/layer", "--pools", "both",
                    "--policy", "lru,belady", "-o", "json"});
    REQUIRE(r.status == 0);
    const auto sim = nlohmann::json::parse(r.out);
    REQUIRE(sim["results"].size() == 8);
    CHECK(sim["results"][0]["slots"] == 982);  // 59 % of 26 x 64
    CHECK(sim["results"][2]["slots"] == 208);  // 8 per layer
    for (const auto& row : sim["results"]) {
        CHECK(row["hit_rate"].get<double>() > 0.0);
        CHECK(row["layer_hit_rate"].size() == 26);
    }
    CHECK(sim["results"][1]["hit_rate"].get<double>() >=
          sim["results"][0]["hit_rate"].get<double>());
    // Frequency admission: fewer fills than misses, and belady+admit bounds decay+admit.
    r = run_minids({"routing", "sim", trace, "--slots", "25%", "--policy", "decay,belady",
                    "--admit", "all,frequency", "-o", "json"});
    REQUIRE(r.status == 0);
    const auto adm = nlohmann::json::parse(r.out)["results"];
    REQUIRE(adm.size() == 4);
    CHECK(adm[0]["admit"] == "all");
    CHECK(adm[2]["admit"] == "frequency");
    CHECK(adm[0]["fills_per_token"].get<double>() == doctest::Approx(adm[0]["misses_per_token"]));
    CHECK(adm[2]["fills_per_token"].get<double>() < adm[2]["misses_per_token"].get<double>());
    CHECK(adm[3]["hit_rate"].get<double>() >= adm[2]["hit_rate"].get<double>());
    CHECK(adm[3]["hit_rate"].get<double>() >= adm[1]["hit_rate"].get<double>());
    // The engine's device fetch next to the host rules: decay and decay@device (belady has no
    // device row); a gen trace's tokens are one pass each, so --decode changes nothing.
    r = run_minids({"routing", "sim", trace, "--slots", "8/layer", "--policy", "decay,belady",
                    "--fetch", "both", "-o", "json"});
    REQUIRE(r.status == 0);
    const auto dev = nlohmann::json::parse(r.out)["results"];
    REQUIRE(dev.size() == 3);
    CHECK(dev[0]["fetch"] == "host");
    CHECK(dev[1]["fetch"] == "device");
    CHECK(dev[1]["policy"] == "decay");
    CHECK(dev[2]["policy"] == "belady");
    CHECK(dev[2]["hit_rate"].get<double>() >= dev[1]["hit_rate"].get<double>());
    r = run_minids({"routing", "sim", trace, "--slots", "8/layer", "--policy", "decay", "--fetch",
                    "device", "--decode", "-o", "json"});
    REQUIRE(r.status == 0);
    CHECK(nlohmann::json::parse(r.out)["results"][0]["hit_rate"] == dev[1]["hit_rate"]);
    r = run_minids({"routing", "sim", trace, "--slots", "8/layer", "-o", "csv"});
    REQUIRE(r.status == 0);
    CHECK(lines_of(r.out).size() == 5);  // header + 4 policies
    r = run_minids({"routing", "sim", trace, "--slots", "100", "--per-layer"});
    REQUIRE(r.status == 0);
    CHECK(r.out.find("n/a") != std::string::npos);  // 3-4 slots per layer < top-6
    r = run_minids({"routing", "fit", trace, "--rounds", "6", "--slots", "25%", "--pools", "global",
                    "--policy", "lru", "-o", "json"});
    REQUIRE(r.status == 0);
    const auto fit = nlohmann::json::parse(r.out);
    CHECK(fit["params"]["zipf"].size() == 26);
    CHECK(fit["hit_rate_mean_abs_diff"].get<double>() < 0.1);
    for (const char* help : {"stats", "sim", "gen", "fit"}) {
        r = run_minids({"routing", help, "--help"});
        CHECK(r.status == 0);
    }
}
