// Tokenizer rules the reference texts do not reach: added-token flags, Split behaviours,
// Oniguruma's \s, invalid UTF-8, lossy decoding, BPE merge order.
#include <doctest/doctest.h>

#include <random>

#include "tokenizer/byte_level.h"
#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/unicode_regex.h"

namespace {

std::vector<std::string> split_pieces(const std::string& regex, const std::string& behavior,
                                      bool invert, std::string_view text) {
    const minids::PreTokenizer pt({{regex, behavior, invert}});
    std::vector<minids::ByteSpan> spans;
    pt.split(text, spans);
    std::vector<std::string> out;
    for (auto s : spans) out.emplace_back(text.substr(s.begin, s.end - s.begin));
    return out;
}

using Pieces = std::vector<std::string>;

// A byte tokenizer plus a few merges and added tokens, small enough to reason about by hand.
minids::TokenizerData toy_data() {
    auto d = minids::synthetic_byte_tokenizer(300);
    // Merges (by rank): "a b" -> "ab", "ab c" -> "abc", "b c" -> "bc".
    d.vocab[259] = "ab";
    d.vocab[260] = "abc";
    d.vocab[261] = "bc";
    d.merges = {"a b", "ab c", "b c"};
    auto add = [&](int32_t id, std::string content, bool lstrip, bool rstrip, bool single_word) {
        d.vocab[id] = content;
        minids::AddedToken t;
        t.id = id;
        t.content = std::move(content);
        t.special = false;
        t.lstrip = lstrip;
        t.rstrip = rstrip;
        t.single_word = single_word;
        d.added_tokens.push_back(t);
    };
    add(270, "<L>", true, false, false);
    add(271, "<R>", false, true, false);
    add(272, "word", false, false, true);
    add(273, "<x>", false, false, false);
    add(274, "<x>y", false, false, false);  // longer match wins at the same start
    return d;
}

}  // namespace

TEST_CASE("tokenizer rules: Split behaviours follow HF") {
    // HF docs' example: pattern "-" on "the-final--countdown".
    const std::string t = "the-final--countdown";
    CHECK(split_pieces("-", "removed", false, t) == Pieces{"the", "final", "countdown"});
    CHECK(split_pieces("-", "isolated", false, t) ==
          Pieces{"the", "-", "final", "-", "-", "countdown"});
    CHECK(split_pieces("-", "merged_with_previous", false, t) ==
          Pieces{"the-", "final-", "-", "countdown"});
    CHECK(split_pieces("-", "merged_with_next", false, t) ==
          Pieces{"the", "-final", "-", "-countdown"});
    CHECK(split_pieces("-", "contiguous", false, t) ==
          Pieces{"the", "-", "final", "--", "countdown"});
    CHECK(split_pieces("-", "removed", true, t) == Pieces{"-", "-", "-"});
    CHECK(split_pieces("-", "isolated", false, "") == Pieces{});
}

TEST_CASE("tokenizer rules: \\s also matches U+0085 as in Oniguruma") {
    CHECK(minids::onig_to_pcre2("a\\s+b") == "a[\\s\\x{85}]+b");
    CHECK(minids::onig_to_pcre2("\\s+(?!\\S)") == "[\\s\\x{85}]+(?![^\\s\\x{85}])");
    CHECK(minids::onig_to_pcre2("[^\\s\\p{L}]") == "[^\\s\\x{85}\\p{L}]");
    CHECK(minids::onig_to_pcre2("[\\]\\s]") == "[\\]\\s\\x{85}]");
    CHECK(minids::onig_to_pcre2("[]\\s]") == "[]\\s\\x{85}]");
    CHECK(split_pieces("\\s+", "isolated", false, "a\u0085\u3000b") ==
          Pieces{"a", "\u0085\u3000", "b"});
}

TEST_CASE("tokenizer rules: empty matches split like the onig crate's find_iter") {
    const minids::UnicodeRegex re("x*");
    std::vector<minids::ByteSpan> m;
    re.find_all("axxb", m);
    // Empty at 0, "xx" at 1..3, then the empty match at 3 right after it is skipped, empty at 4.
    REQUIRE(m.size() == 3);
    CHECK((m[0].begin == 0 && m[0].end == 0));
    CHECK((m[1].begin == 1 && m[1].end == 3));
    CHECK((m[2].begin == 4 && m[2].end == 4));
}

TEST_CASE("tokenizer rules: BPE merges by rank, leftmost first") {
    const minids::Tokenizer tok(toy_data());
    CHECK(tok.encode("abc", false) == std::vector<int32_t>{260});  // a b -> ab, ab c -> abc
    CHECK(tok.encode("bc", false) == std::vector<int32_t>{261});
    CHECK(tok.encode("abab", false) == std::vector<int32_t>{259, 259});
    CHECK(tok.encode("zab", false) == std::vector<int32_t>{'z', 259});
}

TEST_CASE("tokenizer rules: added tokens, longest match and lstrip/rstrip/single_word") {
    const minids::Tokenizer tok(toy_data());
    using Ids = std::vector<int32_t>;
    CHECK(tok.encode("q<x>yq", false) == Ids{'q', 274, 'q'});
    CHECK(tok.encode("q<x>q", false) == Ids{'q', 273, 'q'});
    // lstrip eats the spaces before, rstrip those after.
    CHECK(tok.encode("q  <L> q", false) == Ids{'q', 270, ' ', 'q'});
    CHECK(tok.encode("q <R>  q", false) == Ids{'q', ' ', 271, 'q'});
    // single_word: only when not inside a word.
    CHECK(tok.encode("a word.", false) == Ids{'a', ' ', 272, '.'});
    CHECK(tok.encode("swordfish", false) == Ids{'s', 'w', 'o', 'r', 'd', 'f', 'i', 's', 'h'});
    // parse_special=false encodes special tokens' text as plain text; non-special added tokens
    // (all of this toy's) are still matched, as with HF's split_special_tokens.
    CHECK(tok.encode("<x>", false, false) == Ids{273});
    CHECK(tok.encode("<｜end▁of▁sentence｜><x>", false, true) == Ids{257, 273});
    const Ids eos_as_text = tok.encode("<｜end▁of▁sentence｜>", false, false);
    CHECK(eos_as_text.size() > 5);
    CHECK(tok.decode(eos_as_text) == "<｜end▁of▁sentence｜>");
    // BOS from add_special.
    CHECK(tok.encode("q", true) == Ids{256, 'q'});
    CHECK(tok.decode(Ids{256, 'q', 273}) == "<｜begin▁of▁sentence｜>q<x>");
    CHECK(tok.decode(Ids{256, 'q', 257}, /*skip_special=*/true) == "q");
}

TEST_CASE("tokenizer rules: invalid UTF-8 input is refused with its offset") {
    const minids::Tokenizer tok(minids::synthetic_byte_tokenizer(300));
    CHECK_THROWS_WITH_AS(tok.encode("abc\xC3(", false), doctest::Contains("offset 3"),
                         minids::TokenizerError);
    CHECK(tok.encode("", true) == std::vector<int32_t>{256});
    // Ids past the tokenizer (a model's embedding rows can outnumber its tokens) decode to
    // nothing, as HF's decode skips ids it has no token for.
    CHECK(tok.decode(std::vector<int32_t>{'a', 300, -1, 'b'}) == "ab");
    minids::StreamingDetokenizer stream(tok);
    CHECK(stream.push(299) == "");
    CHECK(stream.push(100000) == "");
}

TEST_CASE("tokenizer rules: lossy decoding replaces maximal invalid subparts like Rust") {
    auto lossy = [](std::string_view s) {
        std::string out;
        minids::append_utf8_lossy(s, true, out);
        return out;
    };
    const std::string r = "\uFFFD";
    CHECK(lossy("a\xE2\x82"
                "b") == "a" + r + "b");  // truncated 3-byte sequence: one U+FFFD
    CHECK(lossy("\x80\x80") == r + r);
    CHECK(lossy("\xF0\x9F\x98") == r);
    CHECK(lossy("\xED\xA0\x80") == r + r + r);  // surrogate: E0-style second byte check fails
    CHECK(lossy("\xC3\xA9") == "\u00e9");
    std::string out;
    CHECK(minids::append_utf8_lossy("ab\xF0\x9F", false, out) == 2);
    CHECK(out == "ab");
}

TEST_CASE("tokenizer rules: byte tokenizer round-trips random UTF-8 and streams it whole") {
    const minids::Tokenizer tok(minids::synthetic_byte_tokenizer(300));
    std::mt19937 rng(1234);
    std::uniform_int_distribution<uint32_t> cp_dist(1, 0x10FFFF);
    for (int round = 0; round < 50; ++round) {
        std::string text;
        const int n = 1 + round * 3;
        for (int i = 0; i < n; ++i) {
            uint32_t cp = cp_dist(rng) % (round % 2 ? 0x80 : 0x10FFFF);
            if (cp == 0 || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 'x';
            minids::append_utf8(cp, text);
        }
        const auto ids = tok.encode(text, false);
        CHECK(ids.size() == text.size());
        CHECK(tok.decode(ids) == text);
        minids::StreamingDetokenizer stream(tok);
        std::string joined;
        for (int32_t id : ids) {
            const std::string chunk = stream.push(id);
            CHECK_FALSE(minids::find_invalid_utf8(chunk).has_value());
            joined += chunk;
        }
        joined += stream.flush();
        CHECK(joined == text);
    }
    // An id sequence that ends mid-character flushes one U+FFFD, as decode() does.
    minids::StreamingDetokenizer stream(tok);
    CHECK(stream.push(0xE4) == "");
    CHECK(stream.push(0xB8) == "");
    CHECK(stream.flush() == "\uFFFD");
    CHECK(tok.decode(std::vector<int32_t>{0xE4, 0xB8}) == "\uFFFD");
}

TEST_CASE("tokenizer rules: random bytes are encoded or refused as invalid UTF-8, never crash") {
    const minids::Tokenizer tok(toy_data());
    std::mt19937 rng(4242);
    int encoded = 0, refused = 0;
    for (int round = 0; round < 3000; ++round) {
        std::string s(rng() % 24, '\0');
        for (char& c : s) c = static_cast<char>(round % 3 == 0 ? rng() % 256 : 0x20 + rng() % 0x60);
        if (round % 5 == 0 && !s.empty())
            s.insert(rng() % s.size(), "<x>y word <x>");  // no lstrip/rstrip: those drop spaces
        try {
            const auto ids = tok.encode(s, true);
            CHECK(tok.decode(std::vector<int32_t>(ids.begin() + 1, ids.end())) == s);
            ++encoded;
        } catch (const minids::TokenizerError&) {
            CHECK(minids::find_invalid_utf8(s).has_value());
            ++refused;
        }
    }
    CHECK(encoded > 1000);
    CHECK(refused > 100);
}

TEST_CASE("tokenizer rules: 12 MB of text encodes (no PCRE2 match limit on long searches)") {
    const minids::Tokenizer tok(minids::synthetic_byte_tokenizer(300));
    // One whitespace run: `\s*[\r\n]+` backtracks over all of it before `\s+(?!\S)` matches,
    // more than PCRE2's default limit of 10 million steps per search.
    const std::string text = "a" + std::string(12'000'000, ' ') + "b";
    const auto ids = tok.encode(text, false);
    REQUIRE(ids.size() == text.size());
    CHECK(ids.front() == 'a');
    CHECK(ids[1] == ' ');
    CHECK(ids.back() == 'b');
}
