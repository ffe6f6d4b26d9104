// The pre-tokenizer: a sequence of Split steps (HF `pre_tokenizers.Split`), each cutting every
// piece produced so far by its regex, with HF's behaviours (isolated, removed,
// merged_with_previous, merged_with_next, contiguous) and `invert`. Empty pieces are dropped,
// as HF's PreTokenizedString does. The ByteLevel step is left to the BPE model.
#pragma once

#include <string_view>
#include <vector>

#include "tokenizer/tokenizer_data.h"
#include "tokenizer/unicode_regex.h"

namespace minids {

class PreTokenizer {
public:
    explicit PreTokenizer(const std::vector<TokenizerData::Split>& splits);

    // Cuts `text` (valid UTF-8) into pieces, returned as spans of `text`. Reuses `pieces`.
    // Not thread-safe (the regexes keep their match buffers).
    void split(std::string_view text, std::vector<ByteSpan>& pieces) const;

private:
    enum class Behavior { isolated, removed, merged_with_previous, merged_with_next, contiguous };
    struct Step {
        UnicodeRegex regex;
        Behavior behavior;
        bool invert;
    };
    std::vector<Step> steps_;
    // Scratch buffers, kept to avoid allocating per call.
    mutable std::vector<ByteSpan> matches_, next_pieces_;
    mutable std::vector<std::pair<ByteSpan, bool>> marked_;
};

}  // namespace minids
