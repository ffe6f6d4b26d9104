// GPT-2's byte-level mapping (`bytes_to_unicode` in openai/gpt-2 encoder.py, used by HF's
// ByteLevel pre-tokenizer and decoder): every byte 0..255 is mapped to one printable Unicode
// character, so that BPE works on strings with no control characters or spaces. Printable
// Latin-1 bytes map to themselves; the 68 others map to U+0100.. in byte order.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace minids {

class ByteLevelMap {
public:
    ByteLevelMap();
    // The UTF-8 encoding of the character that stands for byte `b`.
    const std::string& encode_byte(uint8_t b) const { return byte_to_utf8_[b]; }
    // Appends the byte-level form of raw bytes `text` to `out`.
    void encode(std::string_view text, std::string& out) const;
    // Appends the raw bytes that a byte-level token string stands for. Returns false when the
    // string holds a character outside the mapping (the bytes decoded so far stay in `out`).
    bool decode(std::string_view token, std::string& out) const;

private:
    std::array<std::string, 256> byte_to_utf8_;
    // Code points of the mapping are all below U+0144; index by code point, -1 where unmapped.
    std::array<int16_t, 0x144> codepoint_to_byte_{};
};

// Appends the UTF-8 encoding of code point `cp` (must be a valid scalar value).
void append_utf8(uint32_t cp, std::string& out);
// Length of the UTF-8 sequence that starts with byte `lead`, or 0 for a continuation/invalid byte.
int utf8_sequence_length(uint8_t lead);
// Position of the first byte of `s` that starts an invalid UTF-8 sequence, or nullopt when `s`
// is valid UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
std::optional<size_t> find_invalid_utf8(std::string_view s);

// Converts bytes to valid UTF-8 the way Rust's String::from_utf8_lossy does (what HF's ByteLevel
// decoder applies): each maximal invalid subpart becomes one U+FFFD. Appends to `out` and returns
// how many bytes of `bytes` were consumed; with `final_chunk` false, an incomplete but so far
// valid sequence at the end is left unconsumed (it may be completed by later bytes).
size_t append_utf8_lossy(std::string_view bytes, bool final_chunk, std::string& out);
// Whether `cp` is Unicode White_Space (what Rust's char::is_whitespace tests).
bool is_unicode_whitespace(uint32_t cp);
// Decodes the code point at `s[i]`, which must start a valid UTF-8 sequence; advances `i`.
uint32_t next_codepoint(std::string_view s, size_t& i);
// Decodes the code point that ends at `s[end - 1]` (valid UTF-8); sets `begin` to its start.
uint32_t previous_codepoint(std::string_view s, size_t end, size_t& begin);

}  // namespace minids
