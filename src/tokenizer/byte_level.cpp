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

namespace minids {

namespace {

// The bytes allowed right after lead byte `lead` in a well-formed sequence (Unicode Table 3-7).
bool valid_second_byte(uint8_t lead, uint8_t b) {
    switch (lead) {
        case 0xE0:
            return b >= 0xA0 && b <= 0xBF;
        case 0xED:
            return b >= 0x80 && b <= 0x9F;
        case 0xF0:
            return b >= 0x90 && b <= 0xBF;
        case 0xF4:
            return b >= 0x80 && b <= 0x8F;
        default:
            return b >= 0x80 && b <= 0xBF;
    }
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

size_t append_utf8_lossy(std::string_view bytes, bool final_chunk, std::string& out) {
    size_t i = 0;
    const size_t n = bytes.size();
    while (i < n) {
        const auto lead = static_cast<uint8_t>(bytes[i]);
        const int len = utf8_sequence_length(lead);
        if (len == 0) {
            out += kReplacement;
            i += 1;
            continue;
        }
        int good = 1;  // bytes of the sequence that are well-formed so far
        while (good < len && i + good < n) {
            const auto b = static_cast<uint8_t>(bytes[i + good]);
            const bool ok = good == 1 ? valid_second_byte(lead, b) : (b >= 0x80 && b <= 0xBF);
            if (!ok) break;
            ++good;
        }
        if (good == len) {
            out.append(bytes.substr(i, len));
            i += len;
        } else if (i + good == n && !final_chunk) {
            return i;  // a prefix that later bytes may complete
        } else {
            out += kReplacement;
            i += good;
        }
    }
    return i;
}

bool is_unicode_whitespace(uint32_t cp) {
    return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
           (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
           cp == 0x205F || cp == 0x3000;
}

uint32_t next_codepoint(std::string_view s, size_t& i) {
    const auto lead = static_cast<uint8_t>(s[i]);
    const int len = utf8_sequence_length(lead);
    if (len <= 1) {
        ++i;
        return lead;
    }
    uint32_t cp = lead & (0x7Fu >> len);
    for (int k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[i + k]) & 0x3Fu);
    i += len;
    return cp;
}

uint32_t previous_codepoint(std::string_view s, size_t end, size_t& begin) {
    begin = end - 1;
    while (begin > 0 && (static_cast<uint8_t>(s[begin]) & 0xC0) == 0x80) --begin;
    size_t i = begin;
    return next_codepoint(s, i);
}

}  // namespace minids
