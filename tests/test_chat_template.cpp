// Chat templates: the Jinja subset (against what jinja2 with trim_blocks/lstrip_blocks renders,
// worked out by hand) and the real DeepSeek-V2 / V3 templates on whole conversations.
#include <doctest/doctest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "chat/builtin_templates.h"
#include "chat/chat_template.h"
#include "chat/jinja.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using nlohmann::json;

namespace {

std::string render(const std::string& src, const nlohmann::ordered_json& ctx = json::object()) {
    return minids::JinjaTemplate::parse(src).render(ctx);
}

std::string model_template(const char* dir) {
    std::ifstream f(minids::test::data_dir() / dir / "tokenizer_config.json");
    REQUIRE(f.good());
    return json::parse(f)["chat_template"].get<std::string>();
}

const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEos = "<｜end▁of▁sentence｜>";

}  // namespace

TEST_CASE("jinja: whitespace control, trim_blocks and lstrip_blocks") {
    CHECK(render("{% for x in xs %}\n  {{ x }}\n{% endfor %}\n", {{"xs", {1, 2}}}) == "  1\n  2\n");
    CHECK(render("  {% if true %}yes{% endif %}  \nend") == "yes  \nend");
    CHECK(render("a  {{- 'b' -}}  c") == "abc");
    CHECK(render("a\n{%- if true -%}\n b \n{%- endif %}\nc") == "abc");
    CHECK(render("x {# note #}\ny") == "x y");
    CHECK(render("x\n    {%+ if true %}y{% endif %}") == "x\n    y");
    CHECK(render("{% if true +%}\nz{% endif %}") == "\nz");
}

TEST_CASE("jinja: values print like Python") {
    CHECK(render("{{ none }} {{ true }} {{ false }} {{ 1.5 }} {{ 2.0 }} {{ 10 }}") ==
          "None True False 1.5 2.0 10");
    CHECK(render("{{ 7 // 2 }} {{ 7 / 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }}") ==
          "3 3.5 2 1024 7");
    CHECK(render("{{ [1, 'a', none] }} {{ {'k': 'v'} }}") == "[1, 'a', None] {'k': 'v'}");
    CHECK(render("{{ 'a' ~ 1 ~ none }} {{ 'x' * 3 }}") == "a1None xxx");
}

TEST_CASE("jinja: loops, loop variables, scoping and namespace") {
    CHECK(render("{% for x in xs %}{{ loop.index }}/{{ loop.length }}{% if not loop.last %},{% "
                 "endif %}{% endfor %}",
                 {{"xs", {"a", "b", "c"}}}) == "1/3,2/3,3/3");
    CHECK(
        render("{% for x in xs %}{{ loop.index0 }}{{ loop.revindex }}{{ loop.first }}{% endfor %}",
               {{"xs", {5, 6}}}) == "02True11False");
    CHECK(render("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}{% endfor %}{{ x }}") ==
          "1");
    CHECK(render("{% set ns = namespace(x=1) %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% "
                 "endfor %}{{ ns.x }}") == "4");
    CHECK(render("{% for x in [] %}x{% else %}empty{% endfor %}") == "empty");
    CHECK(render("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 "
                 "%}{% break %}{% endif %}{{ x }}{% endfor %}") == "13");
    CHECK(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}") ==
          "2242");
    CHECK(render("{% for k, v in {'a': 1, 'b': 2}.items() %}{{ k }}={{ v }};{% endfor %}") ==
          "a=1;b=2;");
    CHECK(render("{% for c in 'h\u00e9' %}[{{ c }}]{% endfor %}") == "[h][\u00e9]");
    CHECK(render("{% for i in range(3) %}{{ i }}{% endfor %}") == "012");
    CHECK(render("{% set a, b = [1, 2] %}{{ b }}{{ a }}") == "21");
    CHECK(render("{% set block %}in {{ 1 + 1 }}{% endset %}[{{ block }}]") == "[in 2]");
}

TEST_CASE("jinja: tests, operators and conditionals") {
    CHECK(render("{% if nothing is defined %}y{% else %}n{% endif %}") == "n");
    CHECK(render("{% if not add_generation_prompt is defined %}{% set add_generation_prompt = "
                 "false %}{% endif %}{{ add_generation_prompt }}") == "False");
    CHECK(render("{{ x is none }} {{ x is not none }} {{ y is string }} {{ 3 is odd }} {{ 9 is "
                 "divisibleby 3 }}",
                 {{"x", nullptr}, {"y", "s"}}) == "True False True True True");
    CHECK(render("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }}") ==
          "True True True True");
    CHECK(render("{{ 'a' if 1 > 2 else 'b' }}{{ 'c' if 1 < 2 }}") == "bc");
    CHECK(
        render(
            "{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'a' == 'a' and 'b' != 'c' }} {{ none or 'x' }}") ==
        "True False True x");
    CHECK(render("{{ m['role'] }} {{ m.role }} {{ m.missing }}|", {{"m", {{"role", "user"}}}}) ==
          "user user |");
}

TEST_CASE("jinja: filters and methods") {
    CHECK(render("{{ '  hi  ' | trim }}|{{ [1, 2, 3] | length }}|{{ 'abc' | upper }}|{{ xs | "
                 "join(', ') }}",
                 {{"xs", {"a", "b"}}}) == "hi|3|ABC|a, b");
    CHECK(render("{{ nope | default('dflt') }}|{{ '' | default('e', true) }}|{{ [3, 4] | first "
                 "}}{{ [3, 4] | last }}") == "dflt|e|34");
    CHECK(render("{{ {'a': 1, 'b': [true, none, 'x\"y\\n']} | tojson }}") ==
          "{\"a\": 1, \"b\": [true, null, \"x\\\"y\\n\"]}");
    CHECK(render("{{ {'a': [1]} | tojson(indent=2) }}") == "{\n  \"a\": [\n    1\n  ]\n}");
    CHECK(render("{{ 'a,b,,c'.split(',') }} {{ ' x  y '.split() }} {{ 'a b c'.split(' ', 1) }}") ==
          "['a', 'b', '', 'c'] ['x', 'y'] ['a', 'b c']");
    CHECK(render("{{ 'abc'[::-1] }}{{ 'abcdef'[1:3] }}{{ 'abc'[-1] }}{{ [1, 2, 3][1:] }}") ==
          "cbabcc[2, 3]");
    CHECK(render("{{ 'x</think>y'.split('</think>')[-1] }}{{ '  z '.strip() }}{{ "
                 "'Hello'.startswith('He') }}") == "yzTrue");
    CHECK(render("{{ 'aXa'.replace('a', 'b') }} {{ 'hello world' | title }} {{ 'hELLO' | "
                 "capitalize }}") == "bXb Hello World Hello");
    const json msgs = json::array({{{"role", "user"}, {"content", "a"}},
                                   {{"role", "assistant"}, {"content", "b"}},
                                   {{"role", "user"}, {"content", "c"}}});
    CHECK(render("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | "
                 "join('|') }}",
                 {{"msgs", msgs}}) == "a|c");
    CHECK(render("{{ msgs | rejectattr('role', 'equalto', 'user') | list | length }}",
                 {{"msgs", msgs}}) == "1");
    CHECK(render("{{ d.get('k') }} {{ d.get('z', 5) }} {{ d | items | list }}",
                 {{"d", {{"k", 1}}}}) == "1 5 [('k', 1)]");
}

TEST_CASE("jinja: errors name the line and never pass silently") {
    CHECK_THROWS_WITH_AS(render("{% if x %}a"), doctest::Contains("endif"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("ok\n{{ 1 + }}"), doctest::Contains("line 2"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ raise_exception('bad role') }}"), doctest::Contains("bad role"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ nothing.attr }}"), doctest::Contains("'nothing' is undefined"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ nothing + 'x' }}"), doctest::Contains("undefined"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ 'a' + 1 }}"), doctest::Contains("unsupported operand"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ x | frobnicate }}"), doctest::Contains("frobnicate"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{% macro m() %}{% endmacro %}"), doctest::Contains("macro"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{{ 'unclosed }}"), doctest::Contains("not closed"),
                         minids::ChatTemplateError);
    CHECK_THROWS_WITH_AS(render("{% set x = 1 %}{% set x.y = 2 %}"), doctest::Contains("namespace"),
                         minids::ChatTemplateError);
}

TEST_CASE("chat template: DeepSeek-V2 from the fixture's tokenizer_config") {
    const std::string tmpl = model_template("tiny-v2-lite");
    CHECK(tmpl == *minids::builtin_chat_template("deepseek2"));
    // The tokenizer reference has this very prompt: "<bos>User: hi\n\nAssistant:".
    CHECK(minids::render_chat(tmpl, {{"user", "hi"}}, true, kBos, kEos) ==
          kBos + "User: hi\n\nAssistant:");
    const std::vector<minids::ChatMessage> conv = {
        {"system", "You are helpful."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};
    CHECK(minids::render_chat(tmpl, conv, true, kBos, kEos) ==
          kBos + "You are helpful.\n\nUser: Hi\n\nAssistant: Hello!" + kEos +
              "User: 2+2?\n\nAssistant:");
    CHECK(minids::render_chat(tmpl, conv, false, kBos, kEos) ==
          kBos + "You are helpful.\n\nUser: Hi\n\nAssistant: Hello!" + kEos + "User: 2+2?\n\n");
    // Without add_generation_prompt in the context the template defaults it to false itself.
    CHECK(minids::JinjaTemplate::parse(tmpl).render(
              {{"messages", json::array()}, {"bos_token", "B"}}) == "B");
}

TEST_CASE("chat template: DeepSeek-V3 from the fixture's tokenizer_config") {
    const std::string tmpl = model_template("tokenizers/deepseek-v3");
    CHECK(tmpl == *minids::builtin_chat_template("deepseek3"));
    const std::vector<minids::ChatMessage> conv = {{"system", "S1"},
                                                   {"system", "S2"},
                                                   {"user", "Hi"},
                                                   {"assistant", "Hello"},
                                                   {"user", "Bye"}};
    CHECK(minids::render_chat(tmpl, conv, true, kBos, kEos) ==
          kBos + "S1\n\nS2<｜User｜>Hi<｜Assistant｜>Hello" + kEos +
              "<｜User｜>Bye<｜Assistant｜>");
    CHECK(minids::render_chat(tmpl, conv, false, kBos, kEos) ==
          kBos + "S1\n\nS2<｜User｜>Hi<｜Assistant｜>Hello" + kEos + "<｜User｜>Bye");

    // A tool round trip: content null + tool_calls, a tool answer, then the assistant.
    const json msgs = json::array({
        {{"role", "user"}, {"content", "weather?"}},
        {{"role", "assistant"},
         {"content", nullptr},
         {"tool_calls",
          json::array({{{"type", "function"},
                        {"function",
                         {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}})}},
        {{"role", "tool"}, {"content", "22C"}},
        {{"role", "assistant"}, {"content", "It is 22C."}},
    });
    CHECK(minids::render_chat_json(tmpl, msgs, true, kBos, kEos, nullptr) ==
          kBos +
              "<｜User｜>weather?<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
              "function<｜tool▁sep｜>get_weather\n"
              "```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>"
              "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>22C<｜tool▁output▁end｜>"
              "<｜tool▁outputs▁end｜>It is 22C." +
              kEos + "<｜Assistant｜>");
    // Ending on a tool message closes the outputs and adds no generation prompt.
    const json open_tool = json::array({msgs[0], msgs[1], msgs[2]});
    const std::string rendered =
        minids::render_chat_json(tmpl, open_tool, true, kBos, kEos, nullptr);
    CHECK(rendered.size() > 40);
    CHECK(rendered.substr(rendered.size() -
                          std::string("<｜tool▁output▁end｜><｜tool▁outputs▁end｜>").size()) ==
          "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>");
}

TEST_CASE("chat template: chatml and template resolution") {
    const std::string chatml(*minids::builtin_chat_template("chatml"));
    CHECK(
        minids::render_chat(chatml, {{"system", "S"}, {"user", "Hi"}}, true, "", "") ==
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    CHECK(minids::resolve_chat_template("", "MODEL") == "MODEL");
    CHECK(minids::resolve_chat_template("deepseek3", "MODEL") ==
          *minids::builtin_chat_template("deepseek3"));
    CHECK(minids::resolve_chat_template("{{ 1 }}", "MODEL") == "{{ 1 }}");
    CHECK_THROWS_WITH_AS(minids::resolve_chat_template("llama9", "MODEL"),
                         doctest::Contains("deepseek2"), minids::ChatTemplateError);
    CHECK_THROWS_AS(minids::resolve_chat_template("", ""), minids::ChatTemplateError);
}

TEST_CASE("jinja: identical to jinja2 on the reference cases (transformers' environment)") {
    // tests/data/chat/jinja_reference.json is written by make_jinja_reference.py beside it.
    std::ifstream f(minids::test::data_dir() / "chat/jinja_reference.json");
    REQUIRE(f.good());
    const auto ref = nlohmann::ordered_json::parse(f);  // key order matters (dict loops, tojson)
    size_t n = 0;
    for (const auto& c : ref["cases"]) {
        ++n;
        CAPTURE(c["name"].get<std::string>());
        const auto tmpl = c["template"].get<std::string>();
        if (c.contains("error")) {
            CHECK_THROWS_AS(render(tmpl, c["context"]), minids::ChatTemplateError);
        } else {
            std::string got;
            CHECK_NOTHROW(got = render(tmpl, c["context"]));
            CHECK(got == c["expected"].get<std::string>());
        }
    }
    CHECK(n >= 80);
}

TEST_CASE("jinja: mutated templates fail cleanly or render, never crash") {
    // Random single-character edits of the real templates: every outcome must be a rendered
    // string or a ChatTemplateError, nothing else.
    const std::string sources[] = {std::string(*minids::builtin_chat_template("deepseek2")),
                                   std::string(*minids::builtin_chat_template("deepseek3"))};
    const std::string alphabet = "{}%#-+()[]'\",.|~=!<>: abcdefilnorstux0123456789\n";
    const json msgs = json::array({{{"role", "system"}, {"content", "S"}},
                                   {{"role", "user"}, {"content", "U"}},
                                   {{"role", "assistant"}, {"content", "A"}}});
    std::mt19937 rng(77);
    int rendered = 0, refused = 0;
    for (int round = 0; round < 1500; ++round) {
        std::string t = sources[round % 2];
        const int edits = 1 + static_cast<int>(rng() % 3);
        for (int k = 0; k < edits; ++k) {
            const size_t pos = rng() % t.size();
            switch (rng() % 3) {
                case 0:
                    t.erase(pos, 1);
                    break;
                case 1:
                    t.insert(pos, 1, alphabet[rng() % alphabet.size()]);
                    break;
                default:
                    t[pos] = alphabet[rng() % alphabet.size()];
            }
        }
        try {
            render(t, {{"messages", msgs},
                       {"add_generation_prompt", true},
                       {"bos_token", "B"},
                       {"eos_token", "E"}});
            ++rendered;
        } catch (const minids::ChatTemplateError&) {
            ++refused;
        }
    }
    CHECK(rendered > 100);
    CHECK(refused > 100);
    CHECK_THROWS_WITH_AS(
        render("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}"),
        doctest::Contains("nesting"), minids::ChatTemplateError);
    std::string deep;
    for (int i = 0; i < 1000; ++i) deep += "{% if true %}";
    CHECK_THROWS_WITH_AS(render(deep), doctest::Contains("nesting"), minids::ChatTemplateError);
}

TEST_CASE("chat template: a rendered prompt tokenizes with exactly one BOS") {
    const minids::Tokenizer tok(
        minids::load_hf_tokenizer(minids::test::data_dir() / "tiny-v2-lite/tokenizer.json"));
    const std::string bos = tok.token_text(*tok.bos_id());
    const std::string eos = tok.token_text(*tok.eos_id());
    const std::string prompt = minids::render_chat(
        tok.data().chat_template, {{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Again"}}, true,
        bos, eos);
    const auto ids = tok.encode(prompt, /*add_special=*/false);
    REQUIRE_FALSE(ids.empty());
    CHECK(ids.front() == *tok.bos_id());
    CHECK(std::count(ids.begin(), ids.end(), *tok.bos_id()) == 1);
    CHECK(std::count(ids.begin(), ids.end(), *tok.eos_id()) == 1);  // after the assistant turn
    CHECK(tok.decode(ids) == prompt);
}
