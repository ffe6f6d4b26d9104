// minids::Tokenizer: byte-level BPE encoding and decoding, identical to Hugging Face
// `tokenizers` for the DeepSeek family.
//
// encode(text):
//   1. added tokens are cut out first (leftmost-longest match; HF's lstrip / rstrip /
//      single_word rules; tokens with normalized=false before those with normalized=true),
//   2. the rest goes through the pre-tokenizer's Split regexes (pre_tokenizer.h),
//   3. each piece is byte-level BPE encoded (bpe.h), with a cache of recently seen pieces.
// decode(ids): tokens' byte-level characters back to bytes (HF's ByteLevel decoder), invalid
// UTF-8 replaced by U+FFFD. StreamingDetokenizer decodes one id at a time and never returns half
// a character.
//
//     minids::Tokenizer tok(minids::load_hf_tokenizer("tokenizer.json"));
//     std::vector<int32_t> ids = tok.encode("Hello world", /*add_special=*/true);
//     std::string text = tok.decode(ids);
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tokenizer/tokenizer_data.h"

namespace minids {

// Reads a tokenizer.json and the tokenizer_config.json beside it (when present). Throws
// TokenizerError for a missing or malformed file.
TokenizerData load_hf_tokenizer(const std::filesystem::path& tokenizer_json);

class Tokenizer {
public:
    // Builds the matcher, regexes and merge table. Throws TokenizerError on bad data.
    explicit Tokenizer(TokenizerData data);
    ~Tokenizer();
    Tokenizer(const Tokenizer&) = delete;
    Tokenizer& operator=(const Tokenizer&) = delete;

    // `add_special`: prepend BOS / append EOS as the tokenizer_config asks (add_bos_token,
    // add_eos_token). `parse_special`: match special tokens in the text (HF's default); when
    // false their text is encoded as plain text (HF's split_special_tokens; non-special added
    // tokens are still matched). Throws TokenizerError for text that is not valid UTF-8.
    // Safe to call from several threads (calls are serialised).
    std::vector<int32_t> encode(std::string_view text, bool add_special = true,
                                bool parse_special = true) const;

    // Text of `ids`; ids of special tokens are left out with `skip_special`. Ids outside the
    // vocabulary decode to nothing, as in HF (a model's embedding table is often larger than
    // its tokenizer: DeepSeek-V2 has 102400 rows for 100015 tokens).
    std::string decode(std::span<const int32_t> ids, bool skip_special = false) const;
    // Raw bytes of one token (may be part of a UTF-8 character); "" outside the vocabulary.
    const std::string& token_bytes(int32_t id) const;
    // The token string as stored in the vocabulary (byte-level characters, or an added token's
    // content); "" outside the vocabulary.
    const std::string& token_text(int32_t id) const;
    // Id of an added token or vocabulary entry with exactly this text.
    std::optional<int32_t> find_token(std::string_view text) const;

    int32_t n_vocab() const { return static_cast<int32_t>(data_.vocab.size()); }
    std::optional<int32_t> bos_id() const { return data_.bos_id; }
    std::optional<int32_t> eos_id() const { return data_.eos_id; }
    bool is_special(int32_t id) const;
    const TokenizerData& data() const { return data_; }

private:
    struct Impl;
    TokenizerData data_;
    std::unique_ptr<Impl> impl_;
};

// Decodes ids one at a time for streaming output: push() returns only complete UTF-8
// characters and holds back an incomplete trailing sequence; flush() returns what is left (an
// unfinished sequence becomes U+FFFD). The concatenation of all returns equals
// Tokenizer::decode of all the ids.
class StreamingDetokenizer {
public:
    explicit StreamingDetokenizer(const Tokenizer& tokenizer, bool skip_special = false)
        : tokenizer_(tokenizer), skip_special_(skip_special) {}
    std::string push(int32_t id);
    std::string flush();
    // Forgets any held-back bytes (e.g. when a chat turn is abandoned).
    void reset() { pending_.clear(); }

private:
    const Tokenizer& tokenizer_;
    bool skip_special_;
    std::string pending_;
};

}  // namespace minids
