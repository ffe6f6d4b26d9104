// minids run: the .npy writer behind --dump-logits, and (below) the built binary on the
// converted fixture.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "cli_test_util.h"
#include "npy_test_util.h"
#include "runtime/npy.h"
#include "safetensors_io.h"
#include "test_util.h"

using namespace minids::test;

TEST_CASE("run: .npy writer produces a NumPy 1.0 float32 array") {
    TempDir dir;
    const auto path = (dir.path / "x.npy").string();
    std::vector<float> v = random_floats(3 * 7, 11);
    minids::write_npy_f32(path, v, {3, 7});
    NpyF32 npy;
    REQUIRE(read_npy_f32(path, npy));
    CHECK(npy.header.find("'descr': '<f4'") != std::string::npos);
    CHECK(npy.header.find("'fortran_order': False") != std::string::npos);
    CHECK(npy.header.find("'shape': (3, 7)") != std::string::npos);
    CHECK(npy.values == v);
    minids::write_npy_f32(path, std::span(v).first(5), {5});
    REQUIRE(read_npy_f32(path, npy));
    CHECK(npy.header.find("'shape': (5,)") != std::string::npos);
    CHECK_THROWS(minids::write_npy_f32(path, v, {4, 7}));
    CHECK_THROWS(minids::write_npy_f32((dir.path / "no" / "such" / "dir.npy").string(), v, {21}));
}

// ---- the binary on the converted fixture ----

namespace {

struct Reference {
    std::vector<std::vector<int32_t>> prompts, greedy;
};
Reference load_reference() {
    auto j = nlohmann::json::parse(std::ifstream(data_dir() / "tiny-v2-lite" / "reference.json"));
    return {j.at("prompts").get<std::vector<std::vector<int32_t>>>(),
            j.at("greedy").get<std::vector<std::vector<int32_t>>>()};
}

// The run failed as a user error: exit 2, exactly one error line, no crash trace.
void check_user_error(const CliResult& r, const std::string& expect_in_message) {
    INFO("stderr: " << r.err);
    CHECK(r.status == 2);
    CHECK(count_lines_containing(r.err, "error") == 1);
    CHECK(r.err.find(expect_in_message) != std::string::npos);
    CHECK(r.err.find("internal error") == std::string::npos);
    CHECK(r.out.empty());
}

}  // namespace

TEST_CASE("run cli: --ids with --temp 0 --print-ids reproduces the reference greedy tokens") {
    const auto model = cli_converted_fixture().string();
    Reference ref = load_reference();
    for (size_t i = 0; i < 2; ++i) {
        CliResult r = run_minids({"run", "-m", model, "--ids", join_ids(ref.prompts[i], ","), "-n",
                                  "24", "--temp", "0", "--print-ids", "-t", "2"});
        INFO("stderr: " << r.err);
        REQUIRE(r.status == 0);
        CHECK(r.out == join_ids(ref.greedy[i], " ") + "\n");
        CHECK(r.err.find("tok/s") != std::string::npos);
    }
}

TEST_CASE("run cli: --dump-logits writes the prompt logits, matching the reference") {
    const auto model = cli_converted_fixture().string();
    Reference ref = load_reference();
    StTensors logits;
    read_safetensors((data_dir() / "tiny-v2-lite" / "reference.safetensors").string(), logits);
    TempDir dir;
    const auto npy = (dir.path / "logits.npy").string();
    CliResult r = run_minids({"run", "-m", model, "--ids", join_ids(ref.prompts[1], ","), "-n", "0",
                              "--dump-logits", npy});
    INFO("stderr: " << r.err);
    REQUIRE(r.status == 0);
    CHECK(r.out.empty());
    NpyF32 dumped;
    REQUIRE(read_npy_f32(npy, dumped));
    CHECK(dumped.header.find("'shape': (41, 1024)") != std::string::npos);
    const std::vector<float>& got = dumped.values;
    const auto& want = logits.at("logits_1").values;
    REQUIRE(got.size() == want.size());
    for (size_t t = 0; t < 41; ++t) {
        double max_diff = 0.0, max_ref = 0.0;
        for (size_t v = 0; v < 1024; ++v) {
            max_diff =
                std::max(max_diff, std::fabs(double(got[t * 1024 + v]) - want[t * 1024 + v]));
            max_ref = std::max(max_ref, std::fabs(want[t * 1024 + v]));
        }
        CHECK(max_diff / max_ref <= 1e-4);
    }
}

TEST_CASE("run cli: a text prompt streams text, sampling with a seed is reproducible") {
    const auto model = cli_converted_fixture().string();
    std::vector<std::string> args = {"run", "-m", model,    "-p", "The quick brown fox", "-n", "12",
                                     "-s",  "7",  "--temp", "0.9"};
    CliResult a = run_minids(args), b = run_minids(args);
    INFO("stderr: " << a.err);
    REQUIRE(a.status == 0);
    CHECK(!a.out.empty());
    CHECK(a.out == b.out);
    CHECK(a.err.find("prompt") != std::string::npos);
}

TEST_CASE("run cli: user errors exit 2 with one message") {
    const auto model = cli_converted_fixture().string();
    Reference ref = load_reference();
    TempDir dir;
    check_user_error(run_minids({"run", "-m", (dir.path / "missing.mds").string(), "-p", "hi"}),
                     "missing.mds");
    check_user_error(
        run_minids({"run", "-m", model, "--ids", join_ids(ref.prompts[1], ","), "-c", "16"}),
        "context");
    // -n beyond the room left is not an error (as in llama.cpp): it runs until the context is full.
    const CliResult to_full = run_minids(
        {"run", "-m", model, "--ids", join_ids(ref.prompts[1], ","), "-c", "50", "-n", "20"});
    CHECK(to_full.status == 0);
    CHECK(to_full.err.find("stopped: context full") != std::string::npos);
    check_user_error(run_minids({"run", "-m", model, "--ids", "0,5,99999"}), "99999");
    check_user_error(run_minids({"run", "-m", model, "--ids", "0,x"}), "--ids");
    check_user_error(run_minids({"run", "-m", model}), "prompt");
    check_user_error(run_minids({"run", "-m", model, "-p", "a", "--ids", "0"}), "prompt");
    std::ofstream(dir.path / "bad.mds") << "not a model";
    check_user_error(run_minids({"run", "-m", (dir.path / "bad.mds").string(), "-p", "hi"}),
                     "bad.mds");
    CliResult wrong_flag = run_minids({"run", "-m", model, "--no-such-flag"});
    CHECK(wrong_flag.status == 2);
    CHECK(!wrong_flag.err.empty());
}

TEST_CASE("run cli: without -m the demo model is used, or one clear error") {
    CliResult r = run_minids({"run", "-p", "Hello", "-n", "4", "--temp", "0"});
    INFO("stderr: " << r.err);
    if (std::filesystem::exists(MINIDS_DEMO_MODEL_DEFAULT)) {
        CHECK(r.status == 0);
        CHECK(r.err.find("demo model") != std::string::npos);
    } else {
        check_user_error(r, "demo model");
    }
}

TEST_CASE(
    "run cli: -f reads the prompt, --no-bos drops BOS, --chat-template wraps it as a user turn") {
    const auto model = cli_converted_fixture().string();
    TempDir dir;
    const auto prompt_file = (dir.path / "prompt.txt").string();
    std::ofstream(prompt_file) << "Hello there, general purpose text.";
    auto prompt_tokens = [&](std::vector<std::string> extra) {
        std::vector<std::string> args = {
            "run", "-m", model, "-n", "0", "--dump-logits", (dir.path / "l.npy").string()};
        args.insert(args.end(), extra.begin(), extra.end());
        CliResult r = run_minids(args);
        INFO("stderr: " << r.err);
        REQUIRE(r.status == 0);
        NpyF32 npy;
        REQUIRE(read_npy_f32((dir.path / "l.npy").string(), npy));
        return npy.values.size() / 1024;
    };
    const size_t from_file = prompt_tokens({"-f", prompt_file});
    CHECK(from_file == prompt_tokens({"-p", "Hello there, general purpose text."}));
    CHECK(prompt_tokens({"-f", prompt_file, "--no-bos"}) == from_file - 1);
    // DeepSeek-V2's template adds "User: ", "\n\nAssistant:" around the text (BOS once).
    CHECK(prompt_tokens({"-f", prompt_file, "--chat-template", "deepseek2"}) > from_file + 2);
    check_user_error(
        run_minids({"run", "-m", model, "-p", "x", "--chat-template", "no-such-template"}),
        "no-such-template");
    check_user_error(run_minids({"run", "-m", model, "-f", (dir.path / "missing.txt").string()}),
                     "missing.txt");
}

TEST_CASE("run cli: generation without -n stops when the context is full") {
    CliResult r = run_minids({"run", "-m", cli_converted_fixture().string(), "--ids", "0,5,9", "-c",
                              "12", "--temp", "0", "--print-ids"});
    INFO("stderr: " << r.err);
    CHECK(r.status == 0);
    CHECK(r.err.find("context full") != std::string::npos);
    CHECK(lines_of(r.out).size() == 1);
    CHECK(count_lines_containing(r.out, " ") == 1);
}
