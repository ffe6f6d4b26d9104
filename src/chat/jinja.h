// A small Jinja2 renderer for chat templates (the `chat_template` of tokenizer_config.json).
//
// It implements the subset chat templates use, with the environment Hugging Face's
// apply_chat_template uses (trim_blocks and lstrip_blocks on, immutable values, Jinja's default
// lenient Undefined, `raise_exception`, loop controls):
//   statements  {% if/elif/else %}, {% for x in xs [if cond] %}...{% else %}, {% set x = e %},
//               {% set ns.attr = e %}, {% break %}, {% continue %}, {% generation %}, comments,
//               whitespace control ({%- -%} {{- -}}) and {%+ +%}
//   expressions literals (strings, numbers, lists, dicts, true/false/none), names, a.b, a[b],
//               a[i:j], calls, `not and or`, `== != < > <= >= in not-in`, `is [not] test`,
//               `+ - * / // % ~`, `x if c else y`, filters `x | f(args)`
//   globals     namespace(), raise_exception(), range(), loop.index/index0/first/last/length/
//               revindex/revindex0/previtem/nextitem
//   filters     default/d length/count trim upper lower capitalize title replace string int
//               float list first last reverse join items tojson safe map select reject
//               selectattr rejectattr
//   tests       defined undefined none boolean true false integer float number string mapping
//               iterable sequence callable even odd divisibleby eq/equalto ne lt gt le ge in
//               sameas lower upper
//   methods     str: strip lstrip rstrip split startswith endswith upper lower replace title
//               capitalize; dict: items keys values get
// upper/lower/title/capitalize change ASCII letters only.
// Anything outside the subset fails with ChatTemplateError naming the line, never silently.
//
// Limits. A template is code from a model file or the command line, so a render is bounded in
// stack, memory and time whatever the template does:
//   * nesting of statements, brackets, operators, filters and unary operators together, and the
//     depth of the expression trees they build: at most jinja_max_depth, checked while parsing;
//   * lists and dicts nested at most jinja_max_value_depth deep; a namespace() cannot be put in
//     a list, dict or namespace (so values never form a cycle);
//   * every string, the output included: at most jinja_max_string_bytes;
//   * work: jinja_base_work units plus 16 for each unit the context itself costs to convert
//     (so a long conversation gets proportionally more); a unit is one interpreter step, one
//     element a built-in makes or walks, or 64 bytes of string.
// Going past a limit is a ChatTemplateError that names the line and the limit.
//
//     auto tmpl = minids::JinjaTemplate::parse(source);
//     std::string text = tmpl.render({{"messages", msgs}, {"add_generation_prompt", true}});
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace minids {

// A template that does not parse, or fails while rendering (including raise_exception).
struct ChatTemplateError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// What raise_exception() throws: the template refusing a conversation, not a broken template.
struct ChatTemplateRaised : ChatTemplateError {
    using ChatTemplateError::ChatTemplateError;
};

inline constexpr int jinja_max_depth = 200;
inline constexpr int jinja_max_value_depth = 64;
inline constexpr size_t jinja_max_string_bytes = size_t{64} << 20;
inline constexpr uint64_t jinja_base_work = 2'000'000;

namespace jinja {
struct Node;
}

class JinjaTemplate {
public:
    // Throws ChatTemplateError with the line of the first syntax error.
    static JinjaTemplate parse(std::string_view source);
    ~JinjaTemplate();
    JinjaTemplate(JinjaTemplate&&) noexcept;
    JinjaTemplate& operator=(JinjaTemplate&&) noexcept;

    // Renders with the top-level variables of `context` (a JSON object; JSON null is None).
    // Objects keep their key order (Python dicts do; it shows in loops and tojson), so build
    // the context as ordered_json; a plain nlohmann::json converts (with its keys sorted).
    std::string render(const nlohmann::ordered_json& context) const;

private:
    JinjaTemplate();
    std::unique_ptr<jinja::Node> root_;
};

}  // namespace minids
