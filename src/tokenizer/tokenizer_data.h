// Everything the tokenizer needs, in one plain struct, independent of where it came from:
// a Hugging Face tokenizer.json (+ tokenizer_config.json) at conversion time, or the "tokenizer"
// object of an .mds manifest at run time.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace minids {

// The most tokens a vocabulary may have (a model's vocab_size is bounded by the same number).
// Every id read from a file is checked against it before it sizes or indexes anything.
inline constexpr int64_t max_vocab_size = int64_t{1} << 24;

struct AddedToken {
    int32_t id = 0;
    std::string content;
    bool special = true;
    bool lstrip = false;
    bool rstrip = false;
    bool normalized = false;
    bool single_word = false;
};

struct TokenizerData {
    std::string model = "bpe";        // only byte-level BPE is supported
    std::vector<std::string> vocab;   // token string by id ("" where an id is unused)
    std::vector<std::string> merges;  // "left right", by rank (index = rank)
    std::vector<AddedToken> added_tokens;
    // Pre-tokenizer: a sequence of Split(regex, behavior) steps, applied in order, then the
    // ByteLevel mapping. Patterns come from the file; nothing is hard-coded per model.
    struct Split {
        std::string regex;
        std::string behavior = "isolated";  // isolated | removed | merged_with_previous |
                                            // merged_with_next | contiguous
        bool invert = false;
    };
    std::vector<Split> pre_splits;
    bool byte_level = true;
    bool byte_level_add_prefix_space = false;
    std::optional<int32_t> bos_id;
    std::optional<int32_t> eos_id;
    bool add_bos = true;
    bool add_eos = false;
    std::string chat_template;  // Jinja source from tokenizer_config.json ("" if none)
};

struct TokenizerError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// tokenizer.json (+ optional tokenizer_config.json, may be null) -> data. Throws TokenizerError.
TokenizerData tokenizer_data_from_hf(const nlohmann::json& tokenizer_json,
                                     const nlohmann::json& tokenizer_config);
// Canonical manifest form and back (strict).
nlohmann::json tokenizer_data_to_json(const TokenizerData& d);
TokenizerData tokenizer_data_from_json(const nlohmann::json& j);
// A byte-level tokenizer with no merges (256 byte tokens + BOS/EOS/pad specials), for synthetic
// models, with DeepSeek's pre-tokenizer and a DeepSeek-V2 chat template.
TokenizerData synthetic_byte_tokenizer(int64_t vocab_size);

}  // namespace minids
