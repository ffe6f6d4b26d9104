// Values of the Jinja renderer: Python's None/bool/int/float/str/list/dict plus Jinja's
// Undefined, a namespace (a dict whose attributes can be assigned) and callables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace minids::jinja {

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like Python's
struct CallArgs;
using Function = std::function<Value(CallArgs&)>;

struct Value {
    enum class Kind { undefined, none, boolean, integer, floating, string, list, dict, function };
    Kind kind = Kind::undefined;
    bool b = false;
    int64_t i = 0;
    double f = 0;
    std::string s;               // string; for undefined, the name that was missing
    std::shared_ptr<List> list;  // shared: values are references, as in Python
    std::shared_ptr<Dict> dict;
    std::shared_ptr<Function> fn;
    bool is_namespace = false;  // a dict created by namespace(): `set ns.x = ...` allowed
    bool is_tuple = false;      // a list that prints as a Python tuple: (1, 2)

    static Value undefined(std::string name = {});
    static Value none();
    static Value boolean(bool v);
    static Value integer(int64_t v);
    static Value floating(double v);
    static Value string(std::string v);
    static Value make_list(List v = {});
    static Value make_tuple(List v);
    static Value make_dict(Dict v = {});
    static Value function(Function f);
    // JSON objects keep their key order (ordered_json), as Python dicts do.
    static Value from_json(const nlohmann::ordered_json& j);

    bool is_undefined() const { return kind == Kind::undefined; }
    bool is_none() const { return kind == Kind::none; }
    bool is_string() const { return kind == Kind::string; }
    bool is_number() const { return kind == Kind::integer || kind == Kind::floating; }
    bool is_list() const { return kind == Kind::list; }
    bool is_dict() const { return kind == Kind::dict; }
    double as_double() const { return kind == Kind::integer ? static_cast<double>(i) : f; }

    bool truthy() const;
    // The value of `key` in a dict, or nullptr.
    const Value* find(std::string_view key) const;
    std::string type_name() const;
};

// Python's str(v) (what {{ v }} prints; Undefined prints as "").
std::string to_str(const Value& v);
// Python's repr(v).
std::string to_repr(const Value& v);
// json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys) (indent < 0: none).
std::string to_json(const Value& v, int indent, bool sort_keys);
// Python's ==.
bool equals(const Value& a, const Value& b);

}  // namespace minids::jinja
