// Chat templates are code from a model file or the command line: every construct has a depth
// limit, every render a work budget and a size limit, and integer arithmetic never overflows
// silently (jinja.h, "Limits"). Each case here hung, crashed or was undefined behaviour once.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "chat/builtin_templates.h"
#include "chat/chat_template.h"
#include "chat/jinja.h"

namespace {

std::string render(const std::string& src, const nlohmann::ordered_json& ctx = {}) {
    return minids::JinjaTemplate::parse(src).render(ctx.is_null() ? nlohmann::ordered_json::object()
                                                                  : ctx);
}

std::string repeat(const std::string& s, int n) {
    std::string out;
    for (int i = 0; i < n; ++i) out += s;
    return out;
}

}  // namespace

TEST_CASE("jinja limits: every construct counts toward the nesting limit") {
    const char* too_deep = "nest";  // "nesting deeper" or "nested deeper"
    // Unary operators recurse in the parser (15,000 `not` overflowed the stack once).
    CHECK_THROWS_WITH_AS(render("{{ " + repeat("not ", 15000) + "true }}"),
                         doctest::Contains(too_deep), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ " + repeat("-", 15000) + "1 }}"), doctest::Contains(too_deep),
                         minids::ChatTemplateError);
    // Chains built in a loop make deep trees without recursing while parsing; evaluating and
    // destroying such a tree recurses, so its depth is limited too.
    CHECK_THROWS_WITH_AS(render("{{ " + repeat("1 + ", 100000) + "1 }}"),
                         doctest::Contains(too_deep), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ x" + repeat(".a", 100000) + " }}"), doctest::Contains(too_deep),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ x" + repeat("|trim", 100000) + " }}"),
                         doctest::Contains(too_deep), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ " + repeat("[", 5000) + repeat("]", 5000) + " }}"),
                         doctest::Contains(too_deep), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render(repeat("{% for x in y %}", 1000)), doctest::Contains(too_deep),
                         minids::ChatTemplateError);
    // What real templates do stays well inside.
    CHECK(render("{{ " + repeat("not ", 150) + "true }}") == "True");
    CHECK(render("{{ " + repeat("1 + ", 150) + "1 }}") == "151");
}

TEST_CASE("jinja limits: the work budget stops runaway loops and growing values") {
    const char* budget = "work limit";
    CHECK_THROWS_WITH_AS(render("{% for i in range(100000) %}{% for j in range(100000) %}"
                                "{% endfor %}{% endfor %}"),
                         doctest::Contains(budget), minids::ChatTemplateError);
    // Doubling a string or a list: the size is charged, not just the steps.
    CHECK_THROWS_AS(render("{% set ns = namespace(x='ab') %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x ~ ns.x %}{% endfor %}"),
                    minids::ChatTemplateError);
    CHECK_THROWS_AS(render("{% set ns = namespace(x=[1]) %}{% for i in range(64) %}"
                           "{% set ns.x = ns.x + ns.x %}{% endfor %}"),
                    minids::ChatTemplateError);
    // Quadratic work through a built-in: `in` over a big list, many times.
    CHECK_THROWS_WITH_AS(render("{% set big = range(1000000) | list %}{% for i in range(100000) %}"
                                "{% if -1 in big %}{% endif %}{% endfor %}"),
                         doctest::Contains(budget), minids::ChatTemplateError);
    CHECK_THROWS_AS(render("{{ 'x' * 1000000000000 }}"), minids::ChatTemplateError);
    CHECK_THROWS_AS(render("{{ range(10000000) }}"), minids::ChatTemplateError);
    CHECK_THROWS_AS(render("{{ [1] | tojson(indent=1000000000) }}"), minids::ChatTemplateError);
    // The message names the line.
    CHECK_THROWS_WITH_AS(render("\n\n{% for i in range(1000000) %}{{ i }}{% endfor %}"),
                         doctest::Contains("line 3"), minids::ChatTemplateError);
    // A long conversation gets proportionally more work: 20,000 messages render.
    nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
    for (int i = 0; i < 20000; ++i)
        msgs.push_back({{"role", i % 2 ? "assistant" : "user"}, {"content", "turn text"}});
    const std::string out =
        minids::render_chat_json(std::string(*minids::builtin_chat_template("deepseek2")), msgs,
                                 true, "<s>", "</s>", nullptr);
    CHECK(out.size() > 20000 * 9);
}

TEST_CASE("jinja limits: values cannot nest without bound or form cycles") {
    CHECK_THROWS_WITH_AS(render("{% set ns = namespace(x=none) %}{% set ns.x = ns %}"),
                         doctest::Contains("namespace"), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{% set ns = namespace(x=1) %}{{ [ns] }}"),
                         doctest::Contains("namespace"), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{% set ns = namespace(x=[]) %}{% for i in range(1000) %}"
                                "{% set ns.x = [ns.x] %}{% endfor %}"),
                         doctest::Contains("nested deeper"), minids::ChatTemplateError);
    nlohmann::ordered_json deep = nlohmann::ordered_json::array();
    for (int i = 0; i < 1000; ++i) deep = nlohmann::ordered_json::array({deep});
    CHECK_THROWS_WITH_AS(render("{{ x }}", {{"x", deep}}), doctest::Contains("nests deeper"),
                         minids::ChatTemplateError);
    // Namespaces as templates use them still work.
    CHECK(render("{% set ns = namespace(a=[1], b='s') %}{% set ns.a = ns.a + [2] %}{{ ns.a }}") ==
          "[1, 2]");
}

TEST_CASE("jinja limits: integer arithmetic is Python's or an error, never wraps") {
    const char* overflow = "integer overflow";
    CHECK_THROWS_WITH_AS(render("{{ 9223372036854775807 + 1 }}"), doctest::Contains(overflow),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ -9223372036854775807 - 2 }}"), doctest::Contains(overflow),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ 4294967296 * 4294967296 }}"), doctest::Contains(overflow),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ 3 ** 40 }}"), doctest::Contains(overflow),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ (-9223372036854775807 - 1) // -1 }}"),
                         doctest::Contains(overflow), minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ -(-9223372036854775807 - 1) }}"), doctest::Contains(overflow),
                         minids::ChatTemplateError);
    CHECK(render("{{ (-9223372036854775807 - 1) % -1 }}") == "0");
    CHECK(render("{{ (-9223372036854775807 - 1) is divisibleby(-1) }}") == "True");
    CHECK(render("{{ 7 // -2 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ -7 % 3 }} {{ 3 ** 39 }}") ==
          "-4 -4 -2 2 4052555153018976267");
    CHECK_THROWS_AS(render("{{ 1e300 | int }}"), minids::ChatTemplateError);
    CHECK(render("{{ -2.7 | int }}") == "-2");
    CHECK_THROWS_WITH_AS(render("{{ range(1.5) }}"), doctest::Contains("integers"),
                         minids::ChatTemplateError);
    // Steps that would step past INT64_MAX end the range / slice instead of wrapping.
    CHECK(render("{{ range(0, 9223372036854775807, 4611686018427387904) | list }}") ==
          "[0, 4611686018427387904]");
    CHECK(render("{{ [1, 2, 3][::9223372036854775807] }}") == "[1]");
    CHECK(render("{{ [1, 2, 3][::-9223372036854775807] }}") == "[3]");
}

TEST_CASE("jinja limits: a long template lexes and parses in linear time") {
    // 200,000 tags on 200,000 lines (line numbers were recounted from the start per token).
    CHECK(render(repeat("{{ 1 }}\n", 200000)).size() == 400000);
}

TEST_CASE("chat template check: what loading a model runs on its template") {
    for (const char* name : {"deepseek2", "deepseek3", "chatml"})
        CHECK_NOTHROW(
            minids::check_chat_template(*minids::builtin_chat_template(name), "<s>", "</s>"));
    // A template may refuse a conversation (here: one with a system message).
    CHECK_NOTHROW(minids::check_chat_template(
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}{{ m.content }}{% endfor %}",
        "", ""));
    CHECK_THROWS_WITH_AS(
        minids::check_chat_template("{% for i in range(100000) %}{% for j in range(100000) %}"
                                    "{% endfor %}{% endfor %}",
                                    "", ""),
        doctest::Contains("work limit"), minids::ChatTemplateError);
    CHECK_THROWS_AS(minids::check_chat_template("{{ " + repeat("not ", 15000) + "x }}", "", ""),
                    minids::ChatTemplateError);
    CHECK_THROWS_AS(minids::check_chat_template("{% if %}", "", ""), minids::ChatTemplateError);
    CHECK_THROWS_AS(minids::check_chat_template("{{ messages | nosuchfilter }}", "", ""),
                    minids::ChatTemplateError);
}
