#include "tokenizer/byte_level.h"

namespace minids {

void append_utf8(uint32_t cp, std::string& out) {
    if (cp < 0x80) {
        out.push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
        out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
        out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
        out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
        out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
}

int utf8_sequence_length(uint8_t lead) {
    if (lead < 0x80) return 1;
    if (lead >= 0xC2 && lead <= 0xDF) return 2;
    if (lead >= 0xE0 && lead <= 0xEF) return 3;
    if (lead >= 0xF0 && lead <= 0xF4) return 4;
    return 0;
}

std::optional<size_t> find_invalid_utf8(std::string_view s) {
    size_t i = 0;
    while (i < s.size()) {
        const auto lead = static_cast<uint8_t>(s[i]);
        const int len = utf8_sequence_length(lead);
        if (len == 0 || i + len > s.size()) return i;
        for (int k = 1; k < len; ++k) {
            if ((static_cast<uint8_t>(s[i + k]) & 0xC0) != 0x80) return i;
        }
        if (len >= 3) {
            const auto second = static_cast<uint8_t>(s[i + 1]);
            // Overlong 3/4-byte forms, UTF-16 surrogates, and code points above U+10FFFF.
            if (lead == 0xE0 && second < 0xA0) return i;
            if (lead == 0xED && second >= 0xA0) return i;
            if (lead == 0xF0 && second < 0x90) return i;
            if (lead == 0xF4 && second >= 0x90) return i;
        }
        i += len;
    }
    return std::nullopt;
}

ByteLevelMap::ByteLevelMap() {
    codepoint_to_byte_.fill(-1);
    auto printable = [](int b) {
        return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    };
    uint32_t next_extra = 256;
    for (int b = 0; b < 256; ++b) {
        const uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : next_extra++;
        append_utf8(cp, byte_to_utf8_[b]);
        codepoint_to_byte_[cp] = static_cast<int16_t>(b);
    }
}

void ByteLevelMap::encode(std::string_view text, std::string& out) const {
    for (char c : text) out += byte_to_utf8_[static_cast<uint8_t>(c)];
}

bool ByteLevelMap::decode(std::string_view token, std::string& out) const {
    size_t i = 0;
    while (i < token.size()) {
        const auto lead = static_cast<uint8_t>(token[i]);
        uint32_t cp = 0;
        if (lead < 0x80) {
            cp = lead;
            i += 1;
        } else if ((lead & 0xE0) == 0xC0 && i + 1 < token.size()) {
            cp = ((lead & 0x1Fu) << 6) | (static_cast<uint8_t>(token[i + 1]) & 0x3Fu);
            i += 2;
        } else {
            return false;  // every mapped character is below U+0800
        }
        if (cp >= codepoint_to_byte_.size() || codepoint_to_byte_[cp] < 0) return false;
        out.push_back(static_cast<char>(codepoint_to_byte_[cp]));
    }
    return true;
}

}  // namespace minids
