// `minids info` run as a process: output on a valid file, --verify and --json, and exit code 2
// with one message for malformed and corrupt files.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "mds_malformed_cases.h"
#include "test_util.h"

using namespace minids::test;

namespace {

struct RunResult {
    int exit_code = -1;
    std::string out, err;
};

std::string slurp(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

// Single-quoted for the shell (test paths hold no quotes). Appended piecewise: GCC 12 warns
// falsely (-Wrestrict) on "'" + std::string.
std::string quoted(const std::filesystem::path& p) {
    std::string s;
    s += '\'';
    s += p.string();
    s += '\'';
    return s;
}

RunResult run_info(const TempDir& dir, const std::string& args) {
    const auto out = dir.path / "stdout.txt", err = dir.path / "stderr.txt";
    std::string cmd = quoted(minids_binary());
    cmd += " info ";
    cmd += args;
    cmd += " >";
    cmd += quoted(out);
    cmd += " 2>";
    cmd += quoted(err);
    int status = std::system(cmd.c_str());
    RunResult r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(out);
    r.err = slurp(err);
    return r;
}

}  // namespace

TEST_CASE("minids info: prints config, sizes, tokenizer and provenance of a valid file") {
    TempDir dir;
    const auto path = dir.path / "model.mds";
    make_test_mds({.seed = 21}).write(path);
    auto r = run_info(dir, quoted(path));
    CAPTURE(r.err);
    CHECK(r.exit_code == 0);
    CHECK(r.out.find("3 layers (1 dense, 2 MoE)") != std::string::npos);
    // 3 layers x (kv_lora_rank 8 + rope 4) x 2 bytes, and x 4 bytes.
    CHECK(r.out.find("72 bytes/token in BF16, 144 in F32") != std::string::npos);
    CHECK(r.out.find("6 blobs") != std::string::npos);
    CHECK(r.out.find("34 tokens, 3 merges, 2 added (2 special), chat template yes") !=
          std::string::npos);
    CHECK(r.out.find("tool=minids test helper") != std::string::npos);
    CHECK(r.out.find("verify") == std::string::npos);

    auto v = run_info(dir, "--verify --threads 2 " + quoted(path));
    CHECK(v.exit_code == 0);
    CHECK(v.out.find("verify:      OK") != std::string::npos);

    auto j = run_info(dir, "--verify --json " + quoted(path));
    REQUIRE(j.exit_code == 0);
    auto doc = nlohmann::json::parse(j.out);
    CHECK(doc["verify"]["ok"] == true);
    CHECK(doc["config"]["hidden_size"] == 24);
    CHECK(doc["sizes"]["n_experts"] == 6);
    CHECK(doc["sizes"]["kv_bytes_per_token_bf16"] == 72);
    CHECK(doc["sizes"]["expert_bytes"] == 6 * doc["sizes"]["bytes_per_expert"].get<uint64_t>());
    CHECK(doc["tokenizer"]["merges"] == 3);
}

TEST_CASE("minids info: malformed and corrupt files exit 2 with one message") {
    TempDir dir;
    int n = 0;
    for (const auto& mc : malformed_cases()) {
        // Every fifth case plus all the verify ones keeps this quick; the in-process test covers
        // the whole corpus.
        if (!mc.open_ok && n++ % 5 != 0) continue;
        CAPTURE(mc.name);
        MdsTestFile f = make_test_mds({.seed = 5});
        const auto path = dir.path / (mc.name + ".mds");
        write_file(path, mc.make(f));
        auto plain = run_info(dir, quoted(path));
        auto checked = run_info(dir, "--verify " + quoted(path));
        CAPTURE(checked.err);
        CHECK(checked.exit_code == 2);
        CHECK(checked.err.find(mc.expect) != std::string::npos);
        CHECK(checked.err.find(path.string()) != std::string::npos);
        if (mc.open_ok) {
            CHECK(plain.exit_code == 0);  // without --verify the data is not read
            CHECK(checked.out.find("FAILED") != std::string::npos);
        } else {
            CHECK(plain.exit_code == 2);
            CHECK(plain.out.empty());
            // One line: "minids info: <file>: <field>: expected ..., found ..."
            CHECK(std::count(plain.err.begin(), plain.err.end(), '\n') == 1);
        }
    }
    auto missing = run_info(dir, quoted(dir.path / "nope.mds"));
    CHECK(missing.exit_code == 2);
    CHECK(missing.err.find("cannot open") != std::string::npos);
}

TEST_CASE("minids info: files written by minids convert open and verify") {
    TempDir dir;
    for (const char* dtype : {"fp8", "bf16"}) {
        CAPTURE(dtype);
        const auto path = dir.path / (std::string("tiny-") + dtype + ".mds");
        std::string cmd = quoted(minids_binary());
        cmd += " convert -q --expert-dtype ";
        cmd += dtype;
        cmd += " -o ";
        cmd += quoted(path);
        cmd += " ";
        cmd += quoted(data_dir() / "tiny-v2-lite");
        cmd += " >/dev/null 2>&1";
        REQUIRE(std::system(cmd.c_str()) == 0);
        auto r = run_info(dir, "--verify --json " + quoted(path));
        CAPTURE(r.err);
        REQUIRE(r.exit_code == 0);
        auto doc = nlohmann::json::parse(r.out);
        CHECK(doc["verify"]["ok"] == true);
        CHECK(doc["config"]["num_hidden_layers"] == 4);
        CHECK(doc["sizes"]["n_experts"] == 3 * 16);  // layers 1..3, 16 experts each
        CHECK(doc["sizes"]["expert_dtype"] == (std::string(dtype) == "fp8" ? "f8_e4m3" : "bf16"));
        CHECK(doc["tokenizer"]["vocab_size"] == 1024);
        CHECK(doc["tokenizer"]["has_chat_template"] == true);
    }
}
