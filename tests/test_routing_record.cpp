// --record-routing / --replay-routing on run and chat: the recorded trace describes the model
// and every evaluated token; replaying a run's own trace reproduces its logits and tokens
// exactly; a foreign trace changes them; a trace of the wrong shape is refused.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "routing/trace.h"

using namespace minids::test;
using minids::routing::read_trace;
using minids::routing::RoutingTrace;

namespace {

void check_same_run(const std::filesystem::path& model, const std::vector<std::string>& prompt) {
    TempDir dir;
    auto p = [&](const char* f) { return (dir.path / f).string(); };
    std::vector<std::string> base = {"run",    "-m", model.string(), "-n", "6",
                                     "--temp", "0",  "--print-ids"};
    base.insert(base.end(), prompt.begin(), prompt.end());
    auto with = [&](std::vector<std::string> extra) {
        std::vector<std::string> a = base;
        a.insert(a.end(), extra.begin(), extra.end());
        return run_minids(a);
    };
    const CliResult rec = with({"--record-routing", p("a.npz"), "--dump-logits", p("a.npy")});
    INFO("stderr: " << rec.err);
    REQUIRE(rec.status == 0);
    const RoutingTrace a = read_trace(p("a.npz"));
    int64_t n_prefill = 0;
    for (uint8_t x : a.prefill) n_prefill += x;
    CHECK(n_prefill >= 1);
    CHECK(a.n_tokens == n_prefill + 5);  // the 6th generated token is never evaluated
    CHECK(a.step.back() == 5);           // one prefill eval, then five decode steps
    CHECK(a.shape.expert_bytes > 0);
    CHECK(a.source == "minids run");

    // Replaying its own trace: the same tokens, the same logits to the bit, the same routing.
    const CliResult rep = with({"--replay-routing", p("a.npz"), "--record-routing", p("b.npz"),
                                "--dump-logits", p("b.npy")});
    INFO("stderr: " << rep.err);
    REQUIRE(rep.status == 0);
    CHECK(rep.out == rec.out);
    CHECK(slurp(dir.path / "a.npy") == slurp(dir.path / "b.npy"));
    const RoutingTrace b = read_trace(p("b.npz"));
    CHECK(b.ids == a.ids);
    CHECK(b.weights == a.weights);

    // A foreign routing of the same shape changes the logits; the routers' own choice does not
    // leak through.
    const CliResult gen =
        run_minids({"routing", "gen", p("g.npz"), "--experts", std::to_string(a.shape.n_experts),
                    "--top-k", std::to_string(a.shape.top_k), "--layers",
                    std::to_string(a.shape.n_moe_layers()), "-n", "3", "--seed", "5"});
    REQUIRE(gen.status == 0);
    const CliResult foreign = with({"--replay-routing", p("g.npz"), "--record-routing", p("c.npz"),
                                    "--dump-logits", p("c.npy")});
    REQUIRE(foreign.status == 0);
    CHECK(slurp(dir.path / "c.npy") != slurp(dir.path / "a.npy"));
    const RoutingTrace g = read_trace(p("g.npz")), c = read_trace(p("c.npz"));
    const int64_t row = c.row_size();
    for (int64_t t = 0; t < c.n_tokens; ++t) {  // cycles over the 3 tokens of the trace
        for (int64_t i = 0; i < row; ++i) {
            REQUIRE(c.ids[size_t(t * row + i)] == g.ids[size_t((t % 3) * row + i)]);
            REQUIRE(c.weights[size_t(t * row + i)] == g.weights[size_t((t % 3) * row + i)]);
        }
    }

    // The wrong shape: one line, exit 2.
    const CliResult bad_gen =
        run_minids({"routing", "gen", p("w.npz"), "--experts",
                    std::to_string(a.shape.n_experts + 1), "--top-k", std::to_string(a.shape.top_k),
                    "--layers", std::to_string(a.shape.n_moe_layers()), "-n", "3"});
    REQUIRE(bad_gen.status == 0);
    const CliResult bad = with({"--replay-routing", p("w.npz")});
    CHECK(bad.status == 2);
    CHECK(lines_of(bad.err).back().find("--replay-routing") != std::string::npos);
    CHECK(count_lines_containing(bad.err, "error") == 1);
    std::ofstream(dir.path / "junk.npz") << "not a trace";
    const CliResult junk = with({"--replay-routing", p("junk.npz")});
    CHECK(junk.status == 2);
    CHECK(count_lines_containing(junk.err, "error") == 1);
}

}  // namespace

TEST_CASE("routing record/replay: run on the fixture model") {
    check_same_run(cli_converted_fixture(), {"--ids", "1,5,9,200,17,3"});
}

TEST_CASE("routing record/replay: run on the demo model") {
    const auto demo = std::filesystem::path(MINIDS_TEST_DATA) / ".." / ".." / "models" / "demo.mds";
    if (!std::filesystem::exists(demo)) return;
    check_same_run(demo, {"-p", "def parse_config(path):"});
}

TEST_CASE("routing record: chat writes the trace of every turn") {
    TempDir dir;
    const auto path = (dir.path / "chat.npz").string();
    const CliResult r = run_minids({"chat", "-m", cli_converted_fixture().string(), "-n", "4",
                                    "--temp", "0", "--record-routing", path},
                                   "hello\nand again\n");
    INFO("stderr: " << r.err);
    REQUIRE(r.status == 0);
    const RoutingTrace t = read_trace(path);
    CHECK(t.source == "minids chat");
    int64_t n_prefill = 0;
    for (uint8_t x : t.prefill) n_prefill += x;
    CHECK(n_prefill >= 2);               // each turn's prompt
    CHECK(t.n_tokens - n_prefill >= 2);  // and decoded tokens
}
