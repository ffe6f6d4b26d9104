// Built-ins of the Jinja renderer (jinja_builtins.cpp), shared with the interpreter.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "chat/jinja_value.h"

namespace minids::jinja {

struct CallArgs {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> keyword;
    int line = 0;

    // A keyword argument, or `fallback`.
    Value keyword_or(std::string_view name, Value fallback = Value::undefined()) const {
        for (const auto& [k, v] : keyword) {
            if (k == name) return v;
        }
        return fallback;
    }
    // Argument `index` by position, or by `name` as a keyword, or `fallback`.
    Value get(size_t index, std::string_view name, Value fallback = Value::undefined()) const {
        if (index < positional.size()) return positional[index];
        for (const auto& [k, v] : keyword) {
            if (k == name) return v;
        }
        return fallback;
    }
};

// 'text' (built by appending: GCC 12 warns falsely on "'" + std::string).
std::string in_quotes(std::string_view text);
// Throws ChatTemplateError("chat template line N: msg").
[[noreturn]] void fail(int line, const std::string& msg);

// The code points of a UTF-8 string, each as its own string.
std::vector<std::string> utf8_chars(const std::string& s);
// How many code points utf8_chars would return.
size_t utf8_length(const std::string& s);
// What a for loop walks: list items, dict keys, string characters; Undefined is empty.
List iterate(const Value& v, int line);
// obj.name (a dict key; Undefined when missing; an error on Undefined itself).
Value get_attr(const Value& obj, const std::string& name, int line);
// obj[key] for dicts, lists and strings, with Python's negative indices.
Value get_item(const Value& obj, const Value& key, int line);
// obj.name(args) for the str and dict methods templates use.
Value call_method(const Value& obj, const std::string& name, const CallArgs& a);
// Python's `item in container`.
bool contains(const Value& container, const Value& item, int line);
// Python's comparison operators: == != < > <= >= in, not in.
bool compare(const std::string& op, const Value& a, const Value& b, int line);
// `v is name(args)`.
bool apply_test(const std::string& name, const Value& v, const CallArgs& a);
// `v | name(args)`.
Value apply_filter(const std::string& name, const Value& v, const CallArgs& a);

}  // namespace minids::jinja
