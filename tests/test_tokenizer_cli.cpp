// `minids tokenize` run as a process, on both tokenizer fixtures.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The path as one single-quoted shell word.
std::string quoted(const fs::path& p) {
    std::string out(1, '\'');
    for (char c : p.string()) {
        if (c == '\'') {
            out += "'\\''";
        } else {
            out += c;
        }
    }
    out += '\'';
    return out;
}

// Runs `minids tokenize ARGS < stdin_file > out_file 2> err_file`; returns the exit status.
int run_tokenize(const std::string& args, const fs::path& stdin_file, const fs::path& out_file,
                 const fs::path& err_file) {
    const std::string cmd = quoted(minids::test::minids_binary()) + " tokenize " + args + " < " +
                            quoted(stdin_file) + " > " + quoted(out_file) + " 2> " +
                            quoted(err_file);
    const int status = std::system(cmd.c_str());
    REQUIRE(status != -1);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string slurp(const fs::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

void check_jsonl_matches_reference(const fs::path& dir) {
    minids::test::TempDir tmp;
    std::ifstream rf(dir / "tokenizer.reference.json");
    REQUIRE(rf.good());
    const json refs = json::parse(rf);
    std::ofstream(tmp.path / "empty").close();
    {
        std::ofstream in(tmp.path / "in.jsonl", std::ios::binary);
        for (const auto& r : refs) in << r["text"].dump() << "\n";
    }
    const int rc = run_tokenize("--tokenizer " + quoted(dir / "tokenizer.json") + " --jsonl -f " +
                                    quoted(tmp.path / "in.jsonl"),
                                tmp.path / "empty", tmp.path / "out", tmp.path / "err");
    REQUIRE(rc == 0);
    std::istringstream out(slurp(tmp.path / "out"));
    std::string line;
    size_t i = 0, mismatches = 0;
    while (std::getline(out, line)) {
        REQUIRE(i < refs.size());
        if (json::parse(line) != refs[i]["ids"]) ++mismatches;
        ++i;
    }
    CHECK(i == refs.size());
    CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("tokenizer cli: --jsonl reproduces both references") {
    check_jsonl_matches_reference(minids::test::data_dir() / "tiny-v2-lite");
    check_jsonl_matches_reference(minids::test::data_dir() / "tokenizers/deepseek-v3");
}

TEST_CASE("tokenizer cli: plain mode adds BOS unless --no-bos; bad input exits 2") {
    minids::test::TempDir tmp;
    const auto tj = quoted(minids::test::data_dir() / "tokenizers/deepseek-v3/tokenizer.json");
    {
        std::ofstream(tmp.path / "text", std::ios::binary) << "Hello, world! 你好";
        std::ofstream(tmp.path / "bad", std::ios::binary) << "ok\xff";
        std::ofstream(tmp.path / "notstr.jsonl", std::ios::binary) << "\"fine\"\n42\n";
    }
    CHECK(run_tokenize("--tokenizer " + tj, tmp.path / "text", tmp.path / "out",
                       tmp.path / "err") == 0);
    CHECK(slurp(tmp.path / "out") == "[0, 19923, 14, 2058, 3, 223, 30594]\n");
    CHECK(run_tokenize("--no-bos --tokenizer " + tj, tmp.path / "text", tmp.path / "out",
                       tmp.path / "err") == 0);
    CHECK(slurp(tmp.path / "out") == "[19923, 14, 2058, 3, 223, 30594]\n");

    CHECK(run_tokenize("--tokenizer " + tj, tmp.path / "bad", tmp.path / "out", tmp.path / "err") ==
          2);
    CHECK(slurp(tmp.path / "err").find("not valid UTF-8") != std::string::npos);
    CHECK(run_tokenize("--jsonl --tokenizer " + tj, tmp.path / "notstr.jsonl", tmp.path / "out",
                       tmp.path / "err") == 2);
    CHECK(slurp(tmp.path / "err").find("line 2") != std::string::npos);
    CHECK(run_tokenize("--tokenizer " + quoted(tmp.path / "missing.json"), tmp.path / "text",
                       tmp.path / "out", tmp.path / "err") == 2);
    CHECK(run_tokenize("--tokenizer " + quoted(tmp.path / "text"), tmp.path / "text",
                       tmp.path / "out", tmp.path / "err") == 2);
    CHECK(slurp(tmp.path / "err").find("not valid JSON") != std::string::npos);
}
