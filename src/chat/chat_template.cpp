#include "chat/chat_template.h"

#include <nlohmann/json.hpp>

#include "chat/builtin_templates.h"

namespace minids {

std::string render_chat(const std::string& template_src, const std::vector<ChatMessage>& messages,
                        bool add_generation_prompt, const std::string& bos_token,
                        const std::string& eos_token) {
    nlohmann::ordered_json msgs = nlohmann::ordered_json::array();
    for (const auto& m : messages) msgs.push_back({{"role", m.role}, {"content", m.content}});
    return render_chat_json(template_src, msgs, add_generation_prompt, bos_token, eos_token,
                            nullptr);
}

std::string render_chat_json(const std::string& template_src,
                             const nlohmann::ordered_json& messages, bool add_generation_prompt,
                             const std::string& bos_token, const std::string& eos_token,
                             const nlohmann::ordered_json& extra) {
    if (!messages.is_array())
        throw ChatTemplateError("chat template: messages should be a JSON array");
    nlohmann::ordered_json context = extra.is_object() ? extra : nlohmann::ordered_json::object();
    context["messages"] = messages;
    context["add_generation_prompt"] = add_generation_prompt;
    context["bos_token"] = bos_token;
    context["eos_token"] = eos_token;
    return JinjaTemplate::parse(template_src).render(context);
}

void check_chat_template(std::string_view template_src, const std::string& bos_token,
                         const std::string& eos_token) {
    const JinjaTemplate t = JinjaTemplate::parse(template_src);
    // Two renders cover both values of add_generation_prompt and all three roles; a template
    // that runs out of its work budget costs them twice.
    const std::pair<std::vector<ChatMessage>, bool> trials[] = {
        {{{"user", "Hello"}}, true},
        {{{"system", "Be brief."}, {"user", "Hello"}, {"assistant", "Hi."}, {"user", "Bye"}},
         false},
    };
    for (const auto& [conversation, add_generation_prompt] : trials) {
        nlohmann::ordered_json context = nlohmann::ordered_json::object();
        context["messages"] = nlohmann::ordered_json::array();
        for (const auto& m : conversation)
            context["messages"].push_back({{"role", m.role}, {"content", m.content}});
        context["add_generation_prompt"] = add_generation_prompt;
        context["bos_token"] = bos_token;
        context["eos_token"] = eos_token;
        try {
            t.render(context);
        } catch (const ChatTemplateRaised&) {
            // The template's own refusal of this conversation: allowed.
        }
    }
}

std::string resolve_chat_template(std::string_view choice, std::string_view model_template) {
    if (choice.empty()) {
        if (model_template.empty()) {
            throw ChatTemplateError(
                "the model has no chat template; choose one with --chat-template (deepseek2, "
                "deepseek3, chatml, or Jinja source)");
        }
        return std::string(model_template);
    }
    if (auto builtin = builtin_chat_template(choice)) return std::string(*builtin);
    if (choice.find("{%") != std::string_view::npos ||
        choice.find("{{") != std::string_view::npos) {
        return std::string(choice);
    }
    std::string names;
    for (auto n : builtin_chat_template_names())
        names += (names.empty() ? "" : ", ") + std::string(n);
    throw ChatTemplateError("unknown chat template \"" + std::string(choice) +
                            "\" (expected one of " + names + ", or Jinja source)");
}

}  // namespace minids
