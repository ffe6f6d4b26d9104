// Chat prompts: render a conversation with a model's chat template (Jinja, see jinja.h), or a
// built-in one chosen by name.
//
// The DeepSeek templates put `bos_token` at the start of the text themselves, so a rendered
// prompt must be tokenized with add_special=false (and parse_special=true, so that the
// "<｜begin▁of▁sentence｜>" text becomes the BOS id): BOS then appears exactly once.
//
//     std::string src = resolve_chat_template(flag_value, tokenizer.data().chat_template);
//     std::string prompt = render_chat(src, {{"user", "Hi"}}, true, bos_text, eos_text);
//     auto ids = tokenizer.encode(prompt, /*add_special=*/false);
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "chat/jinja.h"

namespace minids {

struct ChatMessage {
    std::string role;  // "system", "user", "assistant" (templates may know others, e.g. "tool")
    std::string content;
};

// Renders `messages` (as [{"role":..., "content":...}]) with `template_src`, the way
// transformers' apply_chat_template does: variables messages, add_generation_prompt, bos_token,
// eos_token. Throws ChatTemplateError (syntax errors, raise_exception in the template).
std::string render_chat(const std::string& template_src, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::string& bos_token,
                        const std::string& eos_token);

// The same with messages given as JSON (for content: null, tool_calls, tool messages) and extra
// top-level variables merged in (`extra` may be null, e.g. {"tools": [...]}). Key order is kept.
std::string render_chat_json(const std::string& template_src,
                             const nlohmann::ordered_json& messages, bool add_generation_prompt,
                             const std::string& bos_token, const std::string& eos_token,
                             const nlohmann::ordered_json& extra);

// Checks a model's own template the way loading the model does: it parses, and it renders a few
// short conversations within its limits (jinja.h). A template may refuse a conversation with
// raise_exception (no system role, say); any other failure is thrown as ChatTemplateError.
void check_chat_template(std::string_view template_src, const std::string& bos_token,
                         const std::string& eos_token);

// The template to use: `choice` is a built-in name (deepseek2, deepseek3, chatml), or Jinja
// source (anything containing "{%" or "{{"), or empty for the model's own `model_template`.
// Throws ChatTemplateError when `choice` is neither, or when it is empty and the model has none.
std::string resolve_chat_template(std::string_view choice, std::string_view model_template);

}  // namespace minids
