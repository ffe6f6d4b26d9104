// `minids tokenize` run as a process, on both tokenizer fixtures.
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "mds_test_file.h"
#include "test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_data.h"

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
    CHECK(slurp(tmp.path / "err").find("valid JSON") != std::string::npos);
}

TEST_CASE("tokenizer cli: -m reads the tokenizer from an .mds file") {
    // The test model has a 40-token vocabulary: give it a byte-level BPE that fits, covering the
    // lowercase letters and the space (other bytes are dropped, as HF's BPE does without unk).
    minids::TokenizerData d;
    const minids::ByteLevelMap bytes;
    for (char c = 'a'; c <= 'z'; ++c) d.vocab.push_back(std::string(1, c));  // ids 0..25
    d.vocab.push_back(bytes.encode_byte(' '));                               // 26: "Ġ"
    d.vocab.push_back("he");                                                 // 27
    d.vocab.push_back("ll");                                                 // 28
    d.vocab.push_back("hell");                                               // 29
    d.vocab.push_back(bytes.encode_byte(' ') + "w");                         // 30: "Ġw"
    while (d.vocab.size() < 38) d.vocab.push_back("");
    d.merges = {"h e", "l l", "he ll", bytes.encode_byte(' ') + " w"};
    for (int32_t id : {38, 39}) {
        minids::AddedToken t;
        t.id = id;
        t.content = id == 38 ? "<|bos|>" : "<|eos|>";
        d.vocab.push_back(t.content);
        d.added_tokens.push_back(t);
    }
    d.pre_splits = {{" ?\\S+|\\s+", "isolated", false}};
    d.bos_id = 38;
    d.eos_id = 39;

    minids::test::TempDir tmp;
    auto f = minids::test::make_test_mds();
    f.manifest["tokenizer"] = minids::tokenizer_data_to_json(d);
    f.write(tmp.path / "m.mds");
    std::ofstream(tmp.path / "text", std::ios::binary) << "hello world<|eos|>";
    REQUIRE(run_tokenize("-m " + quoted(tmp.path / "m.mds"), tmp.path / "text", tmp.path / "out",
                         tmp.path / "err") == 0);
    // hello -> hell o; " world" -> " w" o r l d; then the added token.
    CHECK(slurp(tmp.path / "out") == "[38, 29, 14, 30, 14, 17, 11, 3, 39]\n");

    CHECK(run_tokenize("-m " + quoted(tmp.path / "text"), tmp.path / "text", tmp.path / "out",
                       tmp.path / "err") == 2);
    CHECK(run_tokenize("", tmp.path / "text", tmp.path / "out", tmp.path / "err") == 2);
    CHECK(slurp(tmp.path / "err").find("-m") != std::string::npos);
}
