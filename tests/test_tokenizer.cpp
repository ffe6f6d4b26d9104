// Tokenizer against Hugging Face `tokenizers` on the reference texts of both fixtures.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer.h"

using nlohmann::json;

namespace {

struct Reference {
    std::string text;
    std::vector<int32_t> ids;
    std::string decoded;
};

std::vector<Reference> read_references(const std::filesystem::path& path) {
    std::ifstream f(path);
    REQUIRE(f.good());
    std::vector<Reference> refs;
    for (const auto& r : json::parse(f)) {
        refs.push_back({r["text"].get<std::string>(), r["ids"].get<std::vector<int32_t>>(),
                        r["decoded"].get<std::string>()});
    }
    return refs;
}

const minids::Tokenizer& tiny_tokenizer() {
    static const minids::Tokenizer tok(
        minids::load_hf_tokenizer(minids::test::data_dir() / "tiny-v2-lite/tokenizer.json"));
    return tok;
}

const minids::Tokenizer& v3_tokenizer() {
    static const minids::Tokenizer tok(minids::load_hf_tokenizer(
        minids::test::data_dir() / "tokenizers/deepseek-v3/tokenizer.json"));
    return tok;
}

void check_against_references(const minids::Tokenizer& tok,
                              const std::filesystem::path& refs_path) {
    const auto refs = read_references(refs_path);
    CHECK(refs.size() == 215);
    int mismatches = 0;
    for (size_t i = 0; i < refs.size(); ++i) {
        const auto& r = refs[i];
        const auto ids = tok.encode(r.text, /*add_special=*/false);
        if (ids != r.ids && mismatches++ < 10) {
            CAPTURE(i);
            CAPTURE(r.text);
            CHECK(ids == r.ids);
        }
        CHECK(tok.decode(r.ids) == r.decoded);
        CHECK(tok.decode(ids) == r.text);
    }
    CHECK(mismatches == 0);
}

// Streams `ids` one at a time; every chunk must be valid UTF-8 and the chunks must add up to
// the full decode.
void check_streaming(const minids::Tokenizer& tok, const std::vector<int32_t>& ids) {
    minids::StreamingDetokenizer stream(tok);
    std::string joined;
    for (int32_t id : ids) {
        const std::string chunk = stream.push(id);
        REQUIRE_FALSE(minids::find_invalid_utf8(chunk).has_value());
        joined += chunk;
    }
    const std::string rest = stream.flush();
    REQUIRE_FALSE(minids::find_invalid_utf8(rest).has_value());
    joined += rest;
    CHECK(joined == tok.decode(ids));
}

}  // namespace

TEST_CASE("tokenizer: tiny-v2-lite matches HF on all reference texts") {
    check_against_references(tiny_tokenizer(),
                             minids::test::data_dir() / "tiny-v2-lite/tokenizer.reference.json");
}

TEST_CASE("tokenizer: deepseek-v3 (128k) matches HF on all reference texts") {
    check_against_references(v3_tokenizer(), minids::test::data_dir() /
                                                 "tokenizers/deepseek-v3/tokenizer.reference.json");
}

TEST_CASE("tokenizer: streaming detokenizer never emits partial UTF-8") {
    for (const auto* tok : {&tiny_tokenizer(), &v3_tokenizer()}) {
        const auto dir = tok == &tiny_tokenizer() ? "tiny-v2-lite" : "tokenizers/deepseek-v3";
        for (const auto& r :
             read_references(minids::test::data_dir() / dir / "tokenizer.reference.json")) {
            check_streaming(*tok, r.ids);
        }
    }
}

TEST_CASE("tokenizer: random Unicode text round-trips through both tokenizers") {
    // Code points from the ranges the pre-tokenizer treats differently: ASCII, Latin-1,
    // whitespace of every kind (NEL, NBSP, ideographic space), digits of other scripts, CJK,
    // kana, Hangul, combining marks, emoji, and the added tokens' own brackets.
    const std::vector<std::pair<uint32_t, uint32_t>> ranges = {
        {0x20, 0x7E},     {0x09, 0x0D},     {0x80, 0xFF},     {0x0300, 0x036F},
        {0x0660, 0x0669}, {0x2000, 0x200D}, {0x3000, 0x3003}, {0x3040, 0x30FF},
        {0x4E00, 0x9FFF}, {0xAC00, 0xAC40}, {0xFF01, 0xFF5E}, {0x1F300, 0x1F64F}};
    std::mt19937 rng(20261129);
    for (const auto* tok : {&tiny_tokenizer(), &v3_tokenizer()}) {
        for (int round = 0; round < 200; ++round) {
            std::string text;
            const int n = 1 + static_cast<int>(rng() % 40);
            for (int i = 0; i < n; ++i) {
                const auto& [lo, hi] = ranges[rng() % ranges.size()];
                minids::append_utf8(lo + rng() % (hi - lo + 1), text);
                if (rng() % 17 == 0) text += "<｜User｜>";
            }
            const auto ids = tok->encode(text, false);
            CAPTURE(text);
            CHECK(tok->decode(ids) == text);
            check_streaming(*tok, ids);
        }
    }
}
