#include "tokenizer/unicode_regex.h"

#include <cstdint>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tokenizer/tokenizer_data.h"

namespace minids {

namespace {

std::string pcre2_message(int code) {
    PCRE2_UCHAR buf[256];
    if (pcre2_get_error_message(code, buf, sizeof buf) < 0) return "error " + std::to_string(code);
    return reinterpret_cast<const char*>(buf);
}

struct CodeDeleter {
    void operator()(pcre2_code* p) const { pcre2_code_free(p); }
};
struct MatchDataDeleter {
    void operator()(pcre2_match_data* p) const { pcre2_match_data_free(p); }
};
struct MatchContextDeleter {
    void operator()(pcre2_match_context* p) const { pcre2_match_context_free(p); }
};
struct JitStackDeleter {
    void operator()(pcre2_jit_stack* p) const { pcre2_jit_stack_free(p); }
};

// Large enough for a long whitespace run under `\s+(?!\S)`; the default 32 KiB is not.
constexpr size_t kJitStackMax = size_t{8} << 20;

}  // namespace

std::string onig_to_pcre2(std::string_view pattern) {
    std::string out;
    out.reserve(pattern.size() + 16);
    bool in_class = false;
    size_t class_start = 0;  // position in `pattern` just after '[' or '[^'
    for (size_t i = 0; i < pattern.size(); ++i) {
        const char c = pattern[i];
        if (c == '\\' && i + 1 < pattern.size()) {
            const char e = pattern[i + 1];
            ++i;
            if (e == 's') {
                out += in_class ? "\\s\\x{85}" : "[\\s\\x{85}]";
            } else if (e == 'S' && !in_class) {
                out += "[^\\s\\x{85}]";
            } else {
                // \S inside a class has no PCRE2 equivalent with NEL removed; the difference is
                // one control character and no known tokenizer pattern has it.
                out += c;
                out += e;
            }
            continue;
        }
        if (!in_class && c == '[') {
            in_class = true;
            class_start = i + 1;
            if (class_start < pattern.size() && pattern[class_start] == '^') ++class_start;
        } else if (in_class && c == ']' && i != class_start) {
            in_class = false;
        }
        out += c;
    }
    return out;
}

struct UnicodeRegex::Impl {
    std::unique_ptr<pcre2_code, CodeDeleter> code;
    std::unique_ptr<pcre2_match_data, MatchDataDeleter> match;
    std::unique_ptr<pcre2_match_context, MatchContextDeleter> context;
    std::unique_ptr<pcre2_jit_stack, JitStackDeleter> jit_stack;

    // One pcre2_match call; returns false on no match, throws on an engine failure.
    bool run(std::string_view text, size_t start, uint32_t options, const std::string& pattern,
             ByteSpan& found) const {
        const int rc =
            pcre2_match(code.get(), reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start,
                        options | PCRE2_NO_UTF_CHECK, match.get(), context.get());
        if (rc == PCRE2_ERROR_NOMATCH) return false;
        if (rc < 0) {
            throw TokenizerError("tokenizer: regex \"" + pattern +
                                 "\" failed: " + pcre2_message(rc));
        }
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match.get());
        found = {ov[0], ov[1]};
        return true;
    }
};

UnicodeRegex::UnicodeRegex(std::string_view onig_pattern)
    : pattern_(onig_pattern), impl_(std::make_unique<Impl>()) {
    const std::string translated = onig_to_pcre2(onig_pattern);
    int error = 0;
    PCRE2_SIZE offset = 0;
    impl_->code.reset(pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()),
                                    translated.size(), PCRE2_UTF | PCRE2_UCP, &error, &offset,
                                    nullptr));
    if (!impl_->code) {
        throw TokenizerError("tokenizer: pre-tokenizer regex \"" + pattern_ +
                             "\" does not compile: " + pcre2_message(error) + " at offset " +
                             std::to_string(offset));
    }
    // JIT is an optimisation: when it is unavailable pcre2_match interprets the pattern.
    const bool jit = pcre2_jit_compile(impl_->code.get(), PCRE2_JIT_COMPLETE) == 0;
    impl_->match.reset(pcre2_match_data_create_from_pattern(impl_->code.get(), nullptr));
    impl_->context.reset(pcre2_match_context_create(nullptr));
    if (!impl_->match || !impl_->context) throw std::bad_alloc();
    // PCRE2's default match limit (10 million steps per search) fails on a long whitespace run:
    // DeepSeek's `\s*[\r\n]+` backtracks over all of it before `\s+(?!\S)` matches (20 MB of
    // spaces did). That work is linear in the run, not catastrophic: lift the limit.
    pcre2_set_match_limit(impl_->context.get(), UINT32_MAX);
    if (jit) {
        impl_->jit_stack.reset(pcre2_jit_stack_create(32 * 1024, kJitStackMax, nullptr));
        if (!impl_->jit_stack) throw std::bad_alloc();
        pcre2_jit_stack_assign(impl_->context.get(), nullptr, impl_->jit_stack.get());
    }
}

UnicodeRegex::~UnicodeRegex() = default;
UnicodeRegex::UnicodeRegex(UnicodeRegex&&) noexcept = default;
UnicodeRegex& UnicodeRegex::operator=(UnicodeRegex&&) noexcept = default;

void UnicodeRegex::find_all(std::string_view text, std::vector<ByteSpan>& matches) const {
    matches.clear();
    size_t search_from = 0;
    bool have_last_end = false;
    size_t last_match_end = 0;
    ByteSpan m;
    while (search_from <= text.size() && impl_->run(text, search_from, 0, pattern_, m)) {
        if (m.begin == m.end && have_last_end && last_match_end == m.end) {
            // An empty match where the previous one ended: step one character and retry.
            if (search_from >= text.size()) break;
            size_t step = 1;
            while (search_from + step < text.size() &&
                   (static_cast<uint8_t>(text[search_from + step]) & 0xC0) == 0x80) {
                ++step;
            }
            search_from += step;
            continue;
        }
        matches.push_back(m);
        search_from = m.end;
        have_last_end = true;
        last_match_end = m.end;
    }
}

bool UnicodeRegex::matches_at_start(std::string_view text) const {
    ByteSpan m;
    return impl_->run(text, 0, PCRE2_ANCHORED, pattern_, m);
}

}  // namespace minids
