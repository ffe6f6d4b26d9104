// A PCRE2 regex (UTF + Unicode properties, JIT-compiled) that behaves like the Oniguruma regexes
// Hugging Face tokenizers compile its Split patterns with.
//
// The one difference that matters for tokenizer patterns: Oniguruma's \s also matches U+0085
// (NEL), PCRE2's does not, so \s and \S are rewritten before compiling (see onig_to_pcre2).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace minids {

// Half-open byte range [begin, end) into a piece of text.
struct ByteSpan {
    size_t begin = 0;
    size_t end = 0;
};

// Rewrites an Oniguruma (Ruby syntax) pattern into an equivalent PCRE2 pattern.
std::string onig_to_pcre2(std::string_view pattern);

class UnicodeRegex {
public:
    // Throws TokenizerError naming the pattern and the position of a syntax error.
    explicit UnicodeRegex(std::string_view onig_pattern);
    ~UnicodeRegex();
    UnicodeRegex(UnicodeRegex&&) noexcept;
    UnicodeRegex& operator=(UnicodeRegex&&) noexcept;

    // Every match in `text` (valid UTF-8, not re-checked), in order, as the onig crate's
    // find_iter yields them (an empty match right after the previous match is skipped).
    // Not thread-safe: the match data lives in the object.
    void find_all(std::string_view text, std::vector<ByteSpan>& matches) const;
    // Whether the regex matches a prefix of `text` (anchored at its start).
    bool matches_at_start(std::string_view text) const;

    const std::string& pattern() const { return pattern_; }

private:
    struct Impl;
    std::string pattern_;
    std::unique_ptr<Impl> impl_;
};

}  // namespace minids
