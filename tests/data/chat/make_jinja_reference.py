#!/usr/bin/env python3
"""Writes jinja_reference.json: templates rendered by jinja2 in the environment transformers'
apply_chat_template uses (ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks,
loopcontrols, raise_exception, json.dumps-based tojson). Run from this directory:
    python3 make_jinja_reference.py
The C++ test (tests/test_chat_template.cpp) renders the same cases and compares."""
import json
import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception

v2 = json.load(open("../tiny-v2-lite/tokenizer_config.json"))["chat_template"]
v3 = json.load(open("../tokenizers/deepseek-v3/tokenizer_config.json"))["chat_template"]
chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A multi-line template in the style of many hub models (indentation, trim/lstrip, loop vars).
pretty = """{%- set sys = namespace(text='') %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- set sys.text = sys.text ~ m.content | trim %}
    {%- endif %}
{%- endfor %}
{{- bos_token }}
{% if sys.text %}
[SYS] {{ sys.text }}
{% endif %}
{% for m in messages if m.role != 'system' %}
  {% if m.role == 'user' %}
<user #{{ loop.index }}/{{ loop.length }}>{{ m.content }}</user>
  {% elif m.role == 'assistant' %}
<bot>{{ m.content | trim }}</bot>{{ eos_token }}
  {% else %}
    {{ raise_exception('Unknown role: ' + m.role) }}
  {% endif %}
{% endfor %}
{% if add_generation_prompt %}<bot>{% endif %}"""
# DeepSeek-R1-style: strip the reasoning from earlier answers.
r1ish = ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
         "{% elif message['role'] == 'assistant' %}{% set content = message['content'] %}{% if '</think>' in content %}"
         "{% set content = content.split('</think>')[-1] %}{% endif %}{{ '<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>' }}"
         "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜><think>\\n' }}{% endif %}")

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
conv_a = [{"role": "user", "content": "Hi"}]
conv_b = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]
conv_c = [{"role": "system", "content": "S1"}, {"role": "system", "content": "  S2 "}, {"role": "user", "content": "héllo 你好\n  indented"},
          {"role": "assistant", "content": "<think>hmm</think> ok "}, {"role": "user", "content": "again"}]
tools = [{"role": "user", "content": "weather?"},
         {"role": "assistant", "content": None, "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
             {"type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
         {"role": "tool", "content": "22C"}, {"role": "tool", "content": "noon"},
         {"role": "assistant", "content": "22C at noon."}]


def chat(t, msgs, gen):
    return {"messages": msgs, "add_generation_prompt": gen, "bos_token": B, "eos_token": E}


cases = []
for name, t in [("deepseek2", v2), ("deepseek3", v3), ("chatml", chatml), ("pretty", pretty), ("r1ish", r1ish)]:
    for cname, msgs in [("a", conv_a), ("b", conv_b), ("c", conv_c), ("empty", [])]:
        for gen in (False, True):
            cases.append({"name": f"{name}/{cname}/gen={gen}", "template": t, "context": chat(t, msgs, gen)})
cases.append({"name": "deepseek3/tools", "template": v3, "context": chat(v3, tools, True)})
cases.append({"name": "deepseek3/tools-open", "template": v3, "context": chat(v3, tools[:3], True)})
cases.append({"name": "pretty/bad-role", "template": pretty, "context": chat(pretty, [{"role": "robot", "content": "x"}], True)})

snippets = [
    ("{% for x in xs %}\n  {{ x }}\n{% endfor %}\n", {"xs": [1, 2]}),
    ("  {% if true %}yes{% endif %}  \nend", {}),
    ("a\n{%- if true -%}\n b \n{%- endif %}\nc", {}),
    ("x {# note #}\ny\n  {# c2 #}\nz", {}),
    ("x\n    {%+ if true %}y{% endif %}", {}),
    ("{% if true +%}\nz{% endif %}", {}),
    ("{{ none }} {{ true }} {{ 1.5 }} {{ 2.0 }} {{ 1e3 if false else 0.1 + 0.2 }} {{ 10 }}", {}),
    ("{{ 7 // 2 }} {{ 7 / 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 1 + 2 * 3 }} {{ -7 // 2 }}", {}),
    ("{{ [1, 'a', none, 'it\\'s'] }} {{ {'k': 'v', 'n': [1]} }}", {}),
    ("{{ 'a' ~ 1 ~ none }} {{ 'x' * 3 }}", {}),
    ("{% for x in xs %}{{ loop.index }}/{{ loop.length }}{{ loop.revindex0 }}{% if not loop.last %},{% endif %}{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% set x = 1 %}{% for i in [1, 2] %}{% set x = x + i %}[{{ x }}]{% endfor %}{{ x }}", {}),
    ("{% set ns = namespace(x=1, s='') %}{% for i in [1, 2] %}{% set ns.x = ns.x + i %}{% set ns.s = ns.s + i|string %}{% endfor %}{{ ns.x }} {{ ns.s }}", {}),
    ("{% for x in [] %}x{% else %}empty{% endfor %}", {}),
    ("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}", {}),
    ("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }}{% endfor %}", {}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("{{ x is none }} {{ x is not none }} {{ y is string }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ y is defined }} {{ z is defined }}", {"x": None, "y": "s"}),
    ("{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 3 not in [1] }} {{ not 1 == 2 }}", {}),
    ("{{ 'a' if 1 > 2 else 'b' }}{{ 'c' if 1 < 2 }}[{{ 'd' if false }}]", {}),
    ("{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'a' == 'a' and 'b' != 'c' }} {{ none or 'x' }} {{ 0 and 1 }}", {}),
    ("{{ m['role'] }} {{ m.role }} [{{ m.missing }}] {{ m['missing'] is defined }}", {"m": {"role": "user"}}),
    ("{{ '  hi  ' | trim }}|{{ [1, 2, 3] | length }}|{{ 'abc' | upper }}|{{ xs | join(', ') }}|{{ 'héllo' | length }}", {"xs": ["a", "b"]}),
    ("{{ nope | default('dflt') }}|{{ '' | default('e', true) }}|{{ '' | default('e') }}|{{ [3, 4] | first }}{{ [3, 4] | last }}", {}),
    ("{{ d | tojson }} {{ d | tojson(indent=2) }} {{ d | tojson(sort_keys=true) }}", {"d": {"b": [True, None, "x\"y\n", 1.5, "ü"], "a": {}}}),
    ("{{ 'a,b,,c'.split(',') }} {{ ' x  y '.split() }} {{ 'a b c'.split(' ', 1) }}", {}),
    ("{{ 'abc'[::-1] }}{{ 'abcdef'[1:3] }}{{ 'abc'[-1] }}{{ [1, 2, 3][1:] }}{{ [1, 2, 3][:-1] }}{{ [1,2,3,4,5][::2] }}", {}),
    ("{{ 'x</think>y'.split('</think>')[-1] }}{{ '  z '.strip() }}{{ 'Hello'.startswith('He') }}{{ 'Hello'.endswith(('x', 'lo')) }}", {}),
    ("{{ 'aXa'.replace('a', 'b') }} {{ 'hello world' | title }} {{ 'hELLO' | capitalize }} {{ 'ab'.upper() }}{{ 'xxAb' | lower }}", {}),
    ("{{ msgs | selectattr('role', 'equalto', 'user') | map(attribute='content') | join('|') }} {{ msgs | rejectattr('role', 'equalto', 'user') | list | length }}",
     {"msgs": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]}),
    ("{{ d.get('k') }} {{ d.get('z', 5) }} {{ d.get('z') }} {{ d | items | list }} {{ d.keys() | list }}", {"d": {"k": 1}}),
    ("{% set a, b = [1, 2] %}{{ b }}{{ a }}{% set block %}in {{ 1 + 1 }}{% endset %}[{{ block }}]", {}),
    ("{% for i in range(3) %}{{ i }}{% endfor %}{% for i in range(1, 7, 2) %}{{ i }}{% endfor %}", {}),
    ("{{ x | int + 1 }} {{ '3' | int * 2 }} {{ 2.7 | int }} {{ 'abc' | int }} {{ 3 | float }} {{ [1, 2] | reverse | list }} {{ 'abc' | reverse }}", {"x": "41"}),
    ("{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}{% for m in loop_messages %}{{ m['content'] }}{% endfor %}",
     {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]}),
    ("{{ (1, 2) }} {{ () }} {{ [] }} {{ {} }} {{ 'a' 'b' }}", {}),
    ("{{ raise_exception('bad role') }}", {}),
    ("{{ nothing.attr }}", {}),
    ("{{ nothing + 'x' }}", {}),
    ("{{ 'a' + 1 }}", {}),
    ("{{ nothing }}|{{ nothing | length }}|{% for x in nothing %}x{% endfor %}|{{ nothing ~ 'y' }}", {}),
]
for i, (t, ctx) in enumerate(snippets):
    cases.append({"name": f"snippet {i}", "template": t, "context": ctx})

for c in cases:
    try:
        c["expected"] = env.from_string(c["template"]).render(**c["context"])
    except Exception as e:  # TemplateError, UndefinedError, TypeError: all must fail in C++ too
        c["error"] = type(e).__name__ + ": " + str(e)
json.dump({"generator": "jinja2 " + jinja2.__version__ + ", transformers' chat template environment", "cases": cases},
          open("jinja_reference.json", "w"), ensure_ascii=False, indent=1)
print(len(cases), "cases,", sum("error" in c for c in cases), "errors")
