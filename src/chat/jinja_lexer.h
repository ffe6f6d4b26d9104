// The Jinja lexer: template text and the tokens inside {{ }} and {% %} tags, with jinja2's
// whitespace handling as transformers configures it (trim_blocks, lstrip_blocks) and the
// explicit controls {%- -%} {%+ +%} {{- -}}.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace minids::jinja {

struct Token {
    enum class Kind {
        text,
        var_begin,
        var_end,
        block_begin,
        block_end,
        name,
        string,
        integer,
        floating,
        op,
        eof
    };
    Kind kind;
    std::string text;
    int line;
};

// Throws ChatTemplateError("chat template line N: msg").
[[noreturn]] void syntax_error(int line, const std::string& msg);

// The whole template as tokens, ending with an eof token. Throws ChatTemplateError.
std::vector<Token> lex_template(std::string_view source);

}  // namespace minids::jinja
