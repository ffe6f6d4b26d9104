#include "chat/jinja_lexer.h"

#include <algorithm>
#include <cctype>
#include <cstring>

#include "chat/jinja.h"

namespace minids::jinja {

[[noreturn]] void syntax_error(int line, const std::string& msg) {
    throw ChatTemplateError("chat template line " + std::to_string(line) + ": " + msg);
}

namespace {

class Lexer {
public:
    explicit Lexer(std::string_view src) : src_(src) {}

    std::vector<Token> run() {
        size_t text_start = 0;
        bool strip_next_text = false;    // the previous tag ended with '-'
        bool trim_next_newline = false;  // the previous block tag ended without '-' or '+'
        while (true) {
            const size_t open = find_tag_open(text_start);
            const std::string_view raw = src_.substr(text_start, open - text_start);
            std::string text(raw);
            if (strip_next_text) {
                const size_t first = text.find_first_not_of(" \t\n\r\f\v");
                text.erase(0, first == std::string::npos ? text.size() : first);
            } else if (trim_next_newline) {
                if (text.rfind("\r\n", 0) == 0) {
                    text.erase(0, 2);
                } else if (!text.empty() && text[0] == '\n') {
                    text.erase(0, 1);
                }
            }
            if (open == src_.size()) {
                push_text(std::move(text), text_start);
                break;
            }
            const char kind = src_[open + 1];  // '{', '%' or '#'
            const char modifier = open + 2 < src_.size() ? src_[open + 2] : '\0';
            if (modifier == '-') {
                const size_t keep = text.find_last_not_of(" \t\n\r\f\v");
                text.erase(keep == std::string::npos ? 0 : keep + 1);
            } else if (kind != '{' && modifier != '+') {
                // lstrip_blocks: spaces and tabs between a line start and a block tag go.
                const size_t raw_keep = raw.find_last_not_of(" \t");
                const bool line_start =
                    raw_keep == std::string_view::npos ? text_start == 0 : raw[raw_keep] == '\n';
                if (line_start) {
                    const size_t keep = text.find_last_not_of(" \t");
                    text.erase(keep == std::string::npos ? 0 : keep + 1);
                }
            }
            push_text(std::move(text), text_start);
            size_t pos = open + 2 + ((modifier == '-' || modifier == '+') ? 1 : 0);
            char end_modifier = '\0';
            if (kind == '#') {
                const size_t close = src_.find("#}", pos);
                if (close == std::string_view::npos)
                    syntax_error(line_at(open), "comment is not closed with #}");
                end_modifier = close > pos ? src_[close - 1] : '\0';
                pos = close + 2;
            } else {
                tokens_.push_back({kind == '{' ? Token::Kind::var_begin : Token::Kind::block_begin,
                                   "", line_at(open)});
                pos = lex_tag(pos, kind == '{' ? '}' : '%', end_modifier);
            }
            strip_next_text = end_modifier == '-';
            trim_next_newline = kind != '{' && end_modifier != '+' && end_modifier != '-';
            text_start = pos;
        }
        tokens_.push_back({Token::Kind::eof, "", line_at(src_.size())});
        return std::move(tokens_);
    }

private:
    size_t find_tag_open(size_t from) const {
        for (size_t i = from; i + 1 < src_.size(); ++i) {
            if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#'))
                return i;
        }
        return src_.size();
    }

    // Lines are counted from the last position asked about (positions mostly increase), so a long
    // template lexes in linear time.
    int line_at(size_t pos) {
        pos = std::min(pos, src_.size());
        if (pos < counted_pos_) {
            counted_pos_ = 0;
            counted_line_ = 1;
        }
        for (; counted_pos_ < pos; ++counted_pos_) counted_line_ += src_[counted_pos_] == '\n';
        return counted_line_;
    }

    void push_text(std::string text, size_t at) {
        if (!text.empty()) tokens_.push_back({Token::Kind::text, std::move(text), line_at(at)});
    }

    // Lexes expression tokens up to the closing "}}" / "%}"; returns the position after it.
    size_t lex_tag(size_t pos, char closer, char& end_modifier) {
        const int line = line_at(pos);
        while (true) {
            while (pos < src_.size() && std::isspace(static_cast<unsigned char>(src_[pos]))) ++pos;
            if (pos >= src_.size())
                syntax_error(line, std::string("tag is not closed with ") + closer + "}");
            // The closer, optionally preceded by '-' or '+'.
            for (char mod : {'-', '+', '\0'}) {
                const size_t at = pos + (mod ? 1 : 0);
                if ((!mod || src_[pos] == mod) &&
                    src_.substr(std::min(at, src_.size()), 2) == std::string{closer, '}'}) {
                    end_modifier = mod;
                    tokens_.push_back(
                        {closer == '}' ? Token::Kind::var_end : Token::Kind::block_end, "", line});
                    return at + 2;
                }
            }
            const char c = src_[pos];
            if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
                size_t end = pos;
                while (end < src_.size() &&
                       (std::isalnum(static_cast<unsigned char>(src_[end])) || src_[end] == '_'))
                    ++end;
                tokens_.push_back(
                    {Token::Kind::name, std::string(src_.substr(pos, end - pos)), line});
                pos = end;
            } else if (std::isdigit(static_cast<unsigned char>(c))) {
                pos = lex_number(pos, line);
            } else if (c == '\'' || c == '"') {
                pos = lex_string(pos, line);
            } else {
                static const char* const ops[] = {"//", "**", "==", "!=", "<=", ">=", "(", ")", "[",
                                                  "]",  "{",  "}",  ",",  ".",  ":",  "|", "~", "+",
                                                  "-",  "*",  "/",  "%",  "<",  ">",  "="};
                bool found = false;
                for (const char* op : ops) {
                    const size_t n = std::strlen(op);
                    if (src_.substr(pos, n) == op) {
                        tokens_.push_back({Token::Kind::op, op, line});
                        pos += n;
                        found = true;
                        break;
                    }
                }
                if (!found) syntax_error(line, std::string("unexpected character '") + c + "'");
            }
        }
    }

    // 12, 1_000, 1.5, 1e3, 2.5E-2 (Jinja's number syntax, less hex/octal/binary).
    size_t lex_number(size_t pos, int line) {
        auto is_digit = [&](size_t p) {
            return p < src_.size() && std::isdigit(static_cast<unsigned char>(src_[p]));
        };
        std::string digits;
        bool is_float = false;
        auto take_digits = [&] {
            while (is_digit(pos) || (pos < src_.size() && src_[pos] == '_' && is_digit(pos + 1))) {
                if (src_[pos] != '_') digits += src_[pos];
                ++pos;
            }
        };
        take_digits();
        if (pos < src_.size() && src_[pos] == '.' && is_digit(pos + 1)) {
            is_float = true;
            digits += src_[pos++];
            take_digits();
        }
        if (pos < src_.size() && (src_[pos] == 'e' || src_[pos] == 'E')) {
            size_t p = pos + 1;
            if (p < src_.size() && (src_[p] == '+' || src_[p] == '-')) ++p;
            if (is_digit(p)) {
                is_float = true;
                digits += 'e';
                digits.append(src_.substr(pos + 1, p - pos - 1));
                pos = p;
                take_digits();
            }
        }
        tokens_.push_back({is_float ? Token::Kind::floating : Token::Kind::integer, digits, line});
        return pos;
    }

    size_t lex_string(size_t pos, int line) {
        const char quote = src_[pos++];
        std::string value;
        while (true) {
            if (pos >= src_.size()) syntax_error(line, "string literal is not closed");
            const char c = src_[pos++];
            if (c == quote) break;
            if (c != '\\' || pos >= src_.size()) {
                value += c;
                continue;
            }
            const char e = src_[pos++];
            switch (e) {
                case 'n':
                    value += '\n';
                    break;
                case 't':
                    value += '\t';
                    break;
                case 'r':
                    value += '\r';
                    break;
                case '\\':
                    value += '\\';
                    break;
                case '\'':
                    value += '\'';
                    break;
                case '"':
                    value += '"';
                    break;
                case '\n':
                    break;
                default:
                    value += '\\';
                    value += e;
            }
        }
        tokens_.push_back({Token::Kind::string, std::move(value), line});
        return pos;
    }

    std::string_view src_;
    std::vector<Token> tokens_;
    size_t counted_pos_ = 0;
    int counted_line_ = 1;
};

}  // namespace

std::vector<Token> lex_template(std::string_view source) { return Lexer(source).run(); }

}  // namespace minids::jinja
