// Named chat templates built into the binary (Jinja sources, rendered by chat/template.h).
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace minids {

// The Jinja source of a built-in template: "deepseek2", "deepseek3" or "chatml"; nullopt for
// any other name.
std::optional<std::string_view> builtin_chat_template(std::string_view name);
std::vector<std::string_view> builtin_chat_template_names();

}  // namespace minids
