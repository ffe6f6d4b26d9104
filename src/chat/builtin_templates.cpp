// Built-in chat templates, selectable by name (`--chat-template deepseek2|deepseek3|chatml`)
// when a model file carries none or the user overrides it. The DeepSeek sources are verbatim
// copies of the `chat_template` of DeepSeek-V2's and DeepSeek-V3's tokenizer_config.json;
// chatml is the common <|im_start|> format.
#include "chat/builtin_templates.h"

namespace minids {

namespace {

constexpr std::string_view kDeepSeek2 =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% end"
    "if %}{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'Use"
    "r: ' + message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistan"
    "t: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['"
    "content'] + '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' "
    "}}{% endif %}";

constexpr std::string_view kDeepSeek3 =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% end"
    "if %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_pro"
    "mpt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'syste"
    "m' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content"
    "'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt"
    " + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{bos_token}}{{ns.sy"
    "stem_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.i"
    "s_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] =="
    " 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}{%- for tool i"
    "n message['tool_calls']%}{%- if not ns.is_first "
    "%}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜to"
    "ol▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```j"
    "son' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}{%- set "
    "ns.is_first = true -%}{%- else %}{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁s"
    "ep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments']"
    " + '\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- "
    "endi"
    "f %}{%- endfor %}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] "
    "is not none %}{%- if ns.is_tool %}{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁o"
    "f▁sentence｜>'}}{%- set ns.is_tool = false -%}{%- else %}{{'<｜Assistant｜>' + message['conte"
    "nt'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}{%- if message['role'] == 'tool' %}{"
    "%- set ns.is_tool = true -%}{%- if ns.is_output_first %}{{'<｜tool▁outputs▁begin｜><｜tool▁ou"
    "tput▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- set ns.is_output_first = f"
    "alse %}{%- else %}{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'"
    "}}{%- endif %}{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% en"
    "dif %}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}";

constexpr std::string_view kChatMl =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'"
    "] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assista"
    "nt\n' }}{% endif %}";

}  // namespace

std::optional<std::string_view> builtin_chat_template(std::string_view name) {
    if (name == "deepseek2") return kDeepSeek2;
    if (name == "deepseek3") return kDeepSeek3;
    if (name == "chatml") return kChatMl;
    return std::nullopt;
}

std::vector<std::string_view> builtin_chat_template_names() {
    return {"deepseek2", "deepseek3", "chatml"};
}

}  // namespace minids
