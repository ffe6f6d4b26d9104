// Values of the Jinja renderer: Python's None/bool/int/float/str/list/dict plus Jinja's
// Undefined, a namespace (a dict whose attributes can be assigned) and callables.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
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
    // string; for undefined, the name that was missing. Shared and immutable, so copying a
    // Value never copies text (copies are everywhere and not charged to the work budget).
    std::shared_ptr<const std::string> text;
    std::shared_ptr<List> list;  // shared: values are references, as in Python
    std::shared_ptr<Dict> dict;
    std::shared_ptr<Function> fn;
    bool is_namespace = false;  // a dict created by namespace(): `set ns.x = ...` allowed
    bool is_tuple = false;      // a list that prints as a Python tuple: (1, 2)
    int depth = 0;              // list/dict nesting below this value (0 for scalars)

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

    const std::string& s() const;
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

// ---- limits of one render (jinja.h, "Limits") ----

// The work budget of the render running on this thread: every step of the interpreter and every
// element or 64 bytes a built-in produces or walks is charged, so no template runs unbounded.
// The built-ins are free functions shared with the interpreter; they reach the budget of the
// render in progress through this thread's RenderBudget (none outside a render: nothing charged).
class RenderBudget {
public:
    explicit RenderBudget(uint64_t units);
    ~RenderBudget();
    RenderBudget(const RenderBudget&) = delete;
    RenderBudget& operator=(const RenderBudget&) = delete;

    void set_limit(uint64_t units) { left_ = limit_ = units; }
    uint64_t left() const { return left_; }
    // The template line being evaluated, for the message when the budget runs out.
    void at_line(int line) { line_ = line; }
    void spend(uint64_t units);

private:
    uint64_t left_;
    uint64_t limit_;
    int line_ = 0;
    RenderBudget* outer_;
};

// Charges the current render (if any) `units` of work.
void charge(uint64_t units);
// Charges for `n` bytes of string data (one unit per 64 bytes, at least one).
void charge_bytes(size_t n);
// Appends `piece` to a string being built, refusing strings beyond max_string_bytes.
void append_bounded(std::string& out, std::string_view piece);

// Python's str(v) (what {{ v }} prints; Undefined prints as "").
std::string to_str(const Value& v);
// Python's repr(v).
std::string to_repr(const Value& v);
// json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys) (indent < 0: none).
std::string to_json(const Value& v, int indent, bool sort_keys);
// Python's ==.
bool equals(const Value& a, const Value& b);

}  // namespace minids::jinja
