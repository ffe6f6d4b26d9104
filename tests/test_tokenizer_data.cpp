// TokenizerData: loading HF files, the canonical manifest form, the synthetic byte tokenizer.
#include <doctest/doctest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "test_util.h"
#include "tokenizer/byte_level.h"
#include "tokenizer/tokenizer_data.h"

using nlohmann::json;

namespace {

json read_json(const std::filesystem::path& p) {
    std::ifstream f(p);
    REQUIRE(f.good());
    return json::parse(f);
}

json tiny_tokenizer_json() {
    return read_json(minids::test::data_dir() / "tiny-v2-lite/tokenizer.json");
}
json tiny_config_json() {
    return read_json(minids::test::data_dir() / "tiny-v2-lite/tokenizer_config.json");
}

}  // namespace

TEST_CASE("tokenizer_data: byte-level map is GPT-2's bytes_to_unicode") {
    const minids::ByteLevelMap m;
    CHECK(m.encode_byte(' ') == "\u0120");   // Ġ
    CHECK(m.encode_byte('\n') == "\u010a");  // Ċ
    CHECK(m.encode_byte('A') == "A");
    CHECK(m.encode_byte(0xAD) == "\u0143");  // the last of the 68 remapped bytes
    CHECK(m.encode_byte(0xE9) == "\u00e9");
    std::string all;
    for (int b = 0; b < 256; ++b) all.push_back(static_cast<char>(b));
    std::string encoded, decoded;
    m.encode(all, encoded);
    REQUIRE(m.decode(encoded, decoded));
    CHECK(decoded == all);
    std::string junk;
    CHECK_FALSE(m.decode("\u4e00", junk));
}

TEST_CASE("tokenizer_data: utf-8 validation") {
    CHECK_FALSE(minids::find_invalid_utf8("abc \u00e9\u4e00\U0001F600").has_value());
    CHECK(minids::find_invalid_utf8("ab\xC3").value() == 2);             // truncated
    CHECK(minids::find_invalid_utf8("a\xC0\x80").value() == 1);          // overlong
    CHECK(minids::find_invalid_utf8("\xED\xA0\x80").value() == 0);       // surrogate
    CHECK(minids::find_invalid_utf8("x\xF4\x90\x80\x80").value() == 1);  // > U+10FFFF
    CHECK(minids::find_invalid_utf8("\x80").value() == 0);
}

TEST_CASE("tokenizer_data: from HF tiny-v2-lite") {
    const auto d = minids::tokenizer_data_from_hf(tiny_tokenizer_json(), tiny_config_json());
    CHECK(d.vocab.size() == 1024);
    CHECK(d.merges.size() == 765);
    CHECK(d.merges[0] == "\u0120 \u0120");  // array form ["Ġ", "Ġ"] joined
    REQUIRE(d.added_tokens.size() == 3);
    CHECK(d.added_tokens[1].content == "<｜end▁of▁sentence｜>");
    CHECK(d.added_tokens[1].special);
    REQUIRE(d.pre_splits.size() == 3);
    CHECK(d.pre_splits[0].regex == "\\p{N}{1,3}");
    CHECK(d.pre_splits[2].behavior == "isolated");
    CHECK(d.byte_level);
    CHECK_FALSE(d.byte_level_add_prefix_space);
    CHECK(d.bos_id == 0);
    CHECK(d.eos_id == 1);
    CHECK(d.add_bos);
    CHECK_FALSE(d.add_eos);
    CHECK(d.chat_template.rfind("{% if not add_generation_prompt", 0) == 0);
}

TEST_CASE(
    "tokenizer_data: from HF deepseek-v3 (string merges, object bos/eos, added ids past vocab)") {
    const auto dir = minids::test::data_dir() / "tokenizers/deepseek-v3";
    const auto d = minids::tokenizer_data_from_hf(read_json(dir / "tokenizer.json"),
                                                  read_json(dir / "tokenizer_config.json"));
    CHECK(d.vocab.size() == 128815);
    CHECK(d.merges[0] == "\u0120 t");
    CHECK(d.added_tokens.size() == 818);
    CHECK(d.bos_id == 0);
    CHECK(d.eos_id == 1);
    CHECK(d.vocab[d.added_tokens.back().id] == d.added_tokens.back().content);
}

TEST_CASE("tokenizer_data: HF refusals name what is unsupported") {
    auto tj = tiny_tokenizer_json();
    const auto cfg = tiny_config_json();
    SUBCASE("normalizer") {
        tj["normalizer"] = {{"type", "NFKC"}};
        CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_hf(tj, cfg), doctest::Contains("NFKC"),
                             minids::TokenizerError);
    }
    SUBCASE("pre-tokenizer") {
        tj["pre_tokenizer"]["pretokenizers"][0] = {{"type", "Digits"}, {"individual_digits", true}};
        CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_hf(tj, cfg), doctest::Contains("Digits"),
                             minids::TokenizerError);
    }
    SUBCASE("model") {
        tj["model"]["type"] = "WordPiece";
        CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_hf(tj, cfg),
                             doctest::Contains("WordPiece"), minids::TokenizerError);
    }
    SUBCASE("unknown bos") {
        auto c = cfg;
        c["bos_token"] = "<nope>";
        CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_hf(tj, c), doctest::Contains("<nope>"),
                             minids::TokenizerError);
    }
}

TEST_CASE("tokenizer_data: chat_template list takes the default, null config is accepted") {
    const auto tj = tiny_tokenizer_json();
    json cfg = tiny_config_json();
    cfg["chat_template"] = json::array(
        {{{"name", "tool_use"}, {"template", "T"}}, {{"name", "default"}, {"template", "D"}}});
    CHECK(minids::tokenizer_data_from_hf(tj, cfg).chat_template == "D");
    const auto d = minids::tokenizer_data_from_hf(tj, json());
    CHECK_FALSE(d.bos_id.has_value());
    CHECK_FALSE(d.add_bos);
    CHECK(d.chat_template.empty());
}

TEST_CASE("tokenizer_data: manifest round trip and strictness") {
    const auto d = minids::tokenizer_data_from_hf(tiny_tokenizer_json(), tiny_config_json());
    const json j = minids::tokenizer_data_to_json(d);
    const auto back = minids::tokenizer_data_from_json(json::parse(j.dump()));
    CHECK(back.vocab == d.vocab);
    CHECK(back.merges == d.merges);
    REQUIRE(back.added_tokens.size() == d.added_tokens.size());
    CHECK(back.added_tokens[2].content == d.added_tokens[2].content);
    REQUIRE(back.pre_splits.size() == d.pre_splits.size());
    CHECK(back.pre_splits[2].regex == d.pre_splits[2].regex);
    CHECK(back.bos_id == d.bos_id);
    CHECK(back.eos_id == d.eos_id);
    CHECK(back.chat_template == d.chat_template);
    CHECK(minids::tokenizer_data_to_json(back) == j);

    auto broken = j;
    broken.erase("merges");
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("\"merges\""),
                         minids::TokenizerError);
    broken = j;
    broken["add_bos"] = 1;
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("\"add_bos\""),
                         minids::TokenizerError);
    broken = j;
    broken["vocab"][5] = 7;
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken),
                         doctest::Contains("\"vocab\"[5]"), minids::TokenizerError);
    broken = j;
    broken["added_tokens"][0].erase("lstrip");
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("\"lstrip\""),
                         minids::TokenizerError);
    broken = j;
    broken["pre_splits"][0]["behavior"] = "sideways";
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("sideways"),
                         minids::TokenizerError);
    broken = j;
    broken["eos_id"] = 5000;
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("eos"),
                         minids::TokenizerError);
    broken = j;
    broken["extra"] = true;
    CHECK_THROWS_WITH_AS(minids::tokenizer_data_from_json(broken), doctest::Contains("\"extra\""),
                         minids::TokenizerError);
}

TEST_CASE("tokenizer_data: synthetic byte tokenizer") {
    const auto d = minids::synthetic_byte_tokenizer(300);
    REQUIRE(d.vocab.size() == 300);
    CHECK(d.vocab[' '] == "\u0120");
    CHECK(d.vocab[256] == "<｜begin▁of▁sentence｜>");
    CHECK(d.vocab[258] == "<｜▁pad▁｜>");
    CHECK(d.vocab[299].empty());
    CHECK(d.merges.empty());
    CHECK(d.bos_id == 256);
    CHECK(d.eos_id == 257);
    CHECK(d.pre_splits.size() == 3);
    const auto tj = tiny_tokenizer_json();
    CHECK(d.pre_splits[2].regex ==
          tj["pre_tokenizer"]["pretokenizers"][2]["pattern"]["Regex"].get<std::string>());
    CHECK(d.chat_template == tiny_config_json()["chat_template"].get<std::string>());
    CHECK(minids::tokenizer_data_from_json(minids::tokenizer_data_to_json(d)).vocab == d.vocab);
    CHECK_THROWS_AS(minids::synthetic_byte_tokenizer(258), minids::TokenizerError);
}
