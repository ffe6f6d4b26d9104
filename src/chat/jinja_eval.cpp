// The Jinja interpreter: walks the nodes of jinja_ast.h with Python's value semantics and
// Jinja's scoping (a for loop's body is a scope of its own; `set` inside it does not leak out,
// which is why templates use namespace()).
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <optional>
#include <unordered_map>

#include "chat/jinja.h"
#include "chat/jinja_ast.h"
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

namespace {

enum class Flow { normal, loop_break, loop_continue };

[[noreturn]] void fail(int line, const std::string& msg) {
    throw ChatTemplateError("chat template line " + std::to_string(line) + ": " + msg);
}

const char* kWhitespace = " \t\n\r\f\v";

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
    const std::string set = chars.is_string() ? chars.s : kWhitespace;
    size_t b = 0, e = s.size();
    if (left) {
        b = s.find_first_not_of(set);
        if (b == std::string::npos) return "";
    }
    if (right) {
        const size_t last = s.find_last_not_of(set);
        if (last == std::string::npos) return "";
        e = last + 1;
    }
    return s.substr(b, e - b);
}

// The code points of a UTF-8 string, each as its own string.
std::vector<std::string> utf8_chars(const std::string& s) {
    std::vector<std::string> out;
    for (size_t i = 0; i < s.size();) {
        size_t n = 1;
        while (i + n < s.size() && (static_cast<unsigned char>(s[i + n]) & 0xC0) == 0x80) ++n;
        out.push_back(s.substr(i, n));
        i += n;
    }
    return out;
}

std::string ascii_map(std::string s, int (*fn)(int)) {
    for (char& c : s) c = static_cast<char>(fn(static_cast<unsigned char>(c)));
    return s;
}

std::string capitalize(const std::string& s) {
    std::string out = ascii_map(s, [](int c) { return std::tolower(c); });
    if (!out.empty()) out[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(out[0])));
    return out;
}

std::string title(const std::string& s) {
    std::string out = s;
    bool start = true;
    for (char& c : out) {
        const auto u = static_cast<unsigned char>(c);
        c = static_cast<char>(start ? std::toupper(u) : std::tolower(u));
        start = !std::isalnum(u);
    }
    return out;
}

std::string replace_all(const std::string& s, const std::string& from, const std::string& to,
                        int64_t count) {
    if (from.empty()) return s;  // Python inserts `to` between characters; not needed by templates
    std::string out;
    size_t pos = 0;
    for (int64_t n = 0; count < 0 || n < count; ++n) {
        const size_t hit = s.find(from, pos);
        if (hit == std::string::npos) break;
        out.append(s, pos, hit - pos);
        out += to;
        pos = hit + from.size();
    }
    out.append(s, pos, std::string::npos);
    return out;
}

Value python_split(const std::string& s, const Value& sep, int64_t maxsplit) {
    List parts;
    if (!sep.is_string()) {
        size_t i = s.find_first_not_of(kWhitespace);
        while (i != std::string::npos) {
            if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
                parts.push_back(
                    Value::string(strip_chars(s.substr(i), Value::undefined(), false, true)));
                break;
            }
            const size_t end = s.find_first_of(kWhitespace, i);
            parts.push_back(
                Value::string(s.substr(i, end == std::string::npos ? std::string::npos : end - i)));
            i = end == std::string::npos ? end : s.find_first_not_of(kWhitespace, end);
        }
        return Value::make_list(std::move(parts));
    }
    if (sep.s.empty()) throw ChatTemplateError("chat template: split() separator is empty");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t hit = s.find(sep.s, pos);
        if (hit == std::string::npos) break;
        parts.push_back(Value::string(s.substr(pos, hit - pos)));
        pos = hit + sep.s.size();
    }
    parts.push_back(Value::string(s.substr(pos)));
    return Value::make_list(std::move(parts));
}

// Python sequence index with negative indices; nullopt when out of range.
std::optional<size_t> python_index(int64_t i, size_t size) {
    if (i < 0) i += static_cast<int64_t>(size);
    if (i < 0 || i >= static_cast<int64_t>(size)) return std::nullopt;
    return static_cast<size_t>(i);
}

class Renderer {
public:
    explicit Renderer(const nlohmann::json& context) {
        scopes_.emplace_back();
        auto& globals = scopes_.back();
        globals["raise_exception"] = Value::function([](CallArgs& a) -> Value {
            throw ChatTemplateError("chat template raised an exception: " +
                                    to_str(a.get(0, "message")));
        });
        globals["namespace"] = Value::function([](CallArgs& a) {
            Dict d;
            if (!a.positional.empty() && a.positional[0].is_dict()) d = *a.positional[0].dict;
            for (auto& [k, v] : a.keyword) d.emplace_back(k, v);
            Value ns = Value::make_dict(std::move(d));
            ns.is_namespace = true;
            return ns;
        });
        globals["range"] = Value::function([](CallArgs& a) {
            int64_t start = 0, stop = 0, step = 1;
            auto num = [&](size_t k) {
                if (!a.positional[k].is_number()) fail(a.line, "range() takes integers");
                return static_cast<int64_t>(a.positional[k].as_double());
            };
            if (a.positional.size() == 1) {
                stop = num(0);
            } else if (a.positional.size() >= 2) {
                start = num(0);
                stop = num(1);
                if (a.positional.size() >= 3) step = num(2);
            }
            if (step == 0) fail(a.line, "range() step is zero");
            List l;
            for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
                if (l.size() > 1000000) fail(a.line, "range() is too long");
                l.push_back(Value::integer(i));
            }
            return Value::make_list(std::move(l));
        });
        scopes_.emplace_back();
        if (!context.is_object())
            throw ChatTemplateError("chat template: the context should be a JSON object");
        for (const auto& [k, v] : context.items()) scopes_.back()[k] = Value::from_json(v);
    }

    Flow render(const Node& n, std::string& out) {
        switch (n.kind) {
            case Node::Kind::block:
                for (const Node& c : n.children) {
                    const Flow f = render(c, out);
                    if (f != Flow::normal) return f;
                }
                return Flow::normal;
            case Node::Kind::text:
                out += n.text;
                return Flow::normal;
            case Node::Kind::output:
                out += to_str(eval(*n.expr));
                return Flow::normal;
            case Node::Kind::if_chain:
                for (size_t k = 0; k < n.conditions.size(); ++k) {
                    if (eval(*n.conditions[k]).truthy()) return render(n.children[k], out);
                }
                if (n.children.size() > n.conditions.size()) return render(n.children.back(), out);
                return Flow::normal;
            case Node::Kind::for_loop:
                render_for(n, out);
                return Flow::normal;
            case Node::Kind::set:
                assign_set(n, eval(*n.expr));
                return Flow::normal;
            case Node::Kind::set_block: {
                std::string captured;
                render(n.children[0], captured);
                scopes_.back()[n.targets[0]] = Value::string(std::move(captured));
                return Flow::normal;
            }
            case Node::Kind::loop_break:
                if (loop_depth_ == 0) fail(n.line, "break outside a loop");
                return Flow::loop_break;
            case Node::Kind::loop_continue:
                if (loop_depth_ == 0) fail(n.line, "continue outside a loop");
                return Flow::loop_continue;
        }
        return Flow::normal;
    }

private:
    Value lookup(const std::string& name) const {
        for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
            auto f = it->find(name);
            if (f != it->end()) return f->second;
        }
        return Value::undefined(name);
    }

    void assign_set(const Node& n, const Value& v) {
        if (!n.attr.empty()) {
            Value target = lookup(n.targets[0]);
            if (!target.is_dict() || !target.is_namespace) {
                fail(n.line, "cannot set an attribute of '" + n.targets[0] +
                                 "', which is not a namespace()");
            }
            for (auto& [k, existing] : *target.dict) {
                if (k == n.attr) {
                    existing = v;
                    return;
                }
            }
            target.dict->emplace_back(n.attr, v);
            return;
        }
        assign_targets(n.targets, v, n.line);
    }

    void assign_targets(const std::vector<std::string>& targets, const Value& v, int line) {
        if (targets.size() == 1) {
            scopes_.back()[targets[0]] = v;
            return;
        }
        if (!v.is_list() || v.list->size() != targets.size()) {
            fail(line, "cannot unpack " + v.type_name() + " into " +
                           std::to_string(targets.size()) + " names");
        }
        for (size_t k = 0; k < targets.size(); ++k) scopes_.back()[targets[k]] = (*v.list)[k];
    }

    List iterate(const Value& v, int line) const {
        switch (v.kind) {
            case Value::Kind::undefined:
                return {};
            case Value::Kind::list:
                return *v.list;
            case Value::Kind::dict: {
                List keys;
                for (const auto& [k, val] : *v.dict) keys.push_back(Value::string(k));
                return keys;
            }
            case Value::Kind::string: {
                List chars;
                for (auto& c : utf8_chars(v.s)) chars.push_back(Value::string(std::move(c)));
                return chars;
            }
            default:
                fail(line, "'" + v.type_name() + "' object is not iterable");
        }
    }

    void render_for(const Node& n, std::string& out) {
        List items = iterate(eval(*n.expr), n.line);
        scopes_.emplace_back();
        ++loop_depth_;
        if (n.filter) {
            List kept;
            for (auto& item : items) {
                assign_targets(n.targets, item, n.line);
                if (eval(*n.filter).truthy()) kept.push_back(std::move(item));
            }
            items = std::move(kept);
        }
        const auto len = static_cast<int64_t>(items.size());
        for (int64_t k = 0; k < len; ++k) {
            assign_targets(n.targets, items[k], n.line);
            Dict loop{{"index", Value::integer(k + 1)},
                      {"index0", Value::integer(k)},
                      {"revindex", Value::integer(len - k)},
                      {"revindex0", Value::integer(len - k - 1)},
                      {"first", Value::boolean(k == 0)},
                      {"last", Value::boolean(k == len - 1)},
                      {"length", Value::integer(len)},
                      {"previtem", k > 0 ? items[k - 1] : Value::undefined("previtem")},
                      {"nextitem", k + 1 < len ? items[k + 1] : Value::undefined("nextitem")}};
            scopes_.back()["loop"] = Value::make_dict(std::move(loop));
            if (render(n.children[0], out) == Flow::loop_break) break;
        }
        --loop_depth_;
        scopes_.pop_back();
        if (items.empty() && n.children.size() > 1) render(n.children[1], out);
    }

    Value eval(const Expr& e) {
        switch (e.kind) {
            case Expr::Kind::literal:
                return e.literal;
            case Expr::Kind::name:
                return lookup(e.name);
            case Expr::Kind::list:
            case Expr::Kind::tuple: {
                List l;
                for (const auto& a : e.args) l.push_back(eval(*a));
                return Value::make_list(std::move(l));
            }
            case Expr::Kind::dict: {
                Dict d;
                for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
                    const Value key = eval(*e.args[k]);
                    if (!key.is_string()) fail(e.line, "dict keys must be strings");
                    d.emplace_back(key.s, eval(*e.args[k + 1]));
                }
                return Value::make_dict(std::move(d));
            }
            case Expr::Kind::getattr:
                return get_attr(eval(*e.args[0]), e.name, e.line);
            case Expr::Kind::getitem:
                return get_item(eval(*e.args[0]), eval(*e.args[1]), e.line);
            case Expr::Kind::slice:
                return slice(e);
            case Expr::Kind::call:
                return call(e);
            case Expr::Kind::filter: {
                CallArgs args = eval_args(e, 1);
                return apply_filter(e.name, eval(*e.args[0]), args);
            }
            case Expr::Kind::test: {
                CallArgs args = eval_args(e, 1);
                return Value::boolean(apply_test(e.name, eval(*e.args[0]), args) != e.negated);
            }
            case Expr::Kind::neg: {
                const Value v = eval(*e.args[0]);
                if (v.kind == Value::Kind::integer) return Value::integer(-v.i);
                if (v.kind == Value::Kind::floating) return Value::floating(-v.f);
                fail(e.line, "bad operand type for unary -: " + v.type_name());
            }
            case Expr::Kind::logical_not:
                return Value::boolean(!eval(*e.args[0]).truthy());
            case Expr::Kind::logical_and: {
                Value a = eval(*e.args[0]);
                return a.truthy() ? eval(*e.args[1]) : a;
            }
            case Expr::Kind::logical_or: {
                Value a = eval(*e.args[0]);
                return a.truthy() ? a : eval(*e.args[1]);
            }
            case Expr::Kind::binary:
                return binary(e.name, eval(*e.args[0]), eval(*e.args[1]), e.line);
            case Expr::Kind::compare: {
                Value left = eval(*e.args[0]);
                for (size_t k = 0; k < e.ops.size(); ++k) {
                    Value right = eval(*e.args[k + 1]);
                    if (!compare(e.ops[k], left, right, e.line)) return Value::boolean(false);
                    left = std::move(right);
                }
                return Value::boolean(true);
            }
            case Expr::Kind::conditional:
                if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
                return e.args[2] ? eval(*e.args[2]) : Value::undefined();
        }
        fail(e.line, "unknown expression");
    }

    CallArgs eval_args(const Expr& e, size_t first) {
        CallArgs a;
        a.line = e.line;
        for (size_t k = first; k < e.args.size(); ++k) a.positional.push_back(eval(*e.args[k]));
        for (const auto& [name, ex] : e.kwargs) a.keyword.emplace_back(name, eval(*ex));
        return a;
    }

    static Value get_attr(const Value& obj, const std::string& name, int line) {
        if (obj.is_undefined())
            fail(line, "'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined");
        if (const Value* v = obj.find(name)) return *v;
        return Value::undefined(name);
    }

    static Value get_item(const Value& obj, const Value& key, int line) {
        if (obj.is_undefined())
            fail(line, "'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined");
        if (obj.is_dict() && key.is_string()) {
            if (const Value* v = obj.find(key.s)) return *v;
            return Value::undefined(key.s);
        }
        if ((obj.is_list() || obj.is_string()) && key.kind == Value::Kind::integer) {
            if (obj.is_list()) {
                auto idx = python_index(key.i, obj.list->size());
                return idx ? (*obj.list)[*idx] : Value::undefined();
            }
            const auto chars = utf8_chars(obj.s);
            auto idx = python_index(key.i, chars.size());
            return idx ? Value::string(chars[*idx]) : Value::undefined();
        }
        return Value::undefined();
    }

    Value slice(const Expr& e) {
        const Value obj = eval(*e.args[0]);
        List items;
        if (obj.is_list()) {
            items = *obj.list;
        } else if (obj.is_string()) {
            for (auto& c : utf8_chars(obj.s)) items.push_back(Value::string(std::move(c)));
        } else {
            fail(e.line, "cannot slice " + obj.type_name());
        }
        const auto n = static_cast<int64_t>(items.size());
        auto part = [&](int k, int64_t fallback) {
            if (!e.args[k]) return fallback;
            const Value v = eval(*e.args[k]);
            if (v.is_none()) return fallback;
            if (v.kind != Value::Kind::integer) fail(e.line, "slice indices must be integers");
            return v.i;
        };
        const int64_t step = part(3, 1);
        if (step == 0) fail(e.line, "slice step cannot be zero");
        // Python's slice.indices().
        auto clamp = [&](int64_t v) {
            if (v < 0) v += n;
            return step > 0 ? std::clamp<int64_t>(v, 0, n) : std::clamp<int64_t>(v, -1, n - 1);
        };
        const int64_t start = e.args[1] ? clamp(part(1, 0)) : (step > 0 ? 0 : n - 1);
        const int64_t stop = e.args[2] ? clamp(part(2, 0)) : (step > 0 ? n : -1);
        List out;
        for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) out.push_back(items[k]);
        if (!obj.is_string()) return Value::make_list(std::move(out));
        std::string s;
        for (const auto& c : out) s += c.s;
        return Value::string(std::move(s));
    }

    Value call(const Expr& e) {
        const Expr& callee = *e.args[0];
        CallArgs args = eval_args(e, 1);
        if (callee.kind == Expr::Kind::getattr) {
            const Value obj = eval(*callee.args[0]);
            if (const Value* member = obj.find(callee.name);
                member && member->kind == Value::Kind::function) {
                return (*member->fn)(args);
            }
            return call_method(obj, callee.name, args);
        }
        const Value fn = eval(callee);
        if (fn.kind != Value::Kind::function) {
            const std::string what =
                callee.kind == Expr::Kind::name ? "'" + callee.name + "'" : "the value";
            fail(e.line, what + " is not a function (or not one this renderer provides)");
        }
        return (*fn.fn)(args);
    }

    static Value call_method(const Value& obj, const std::string& name, const CallArgs& a) {
        if (obj.is_string()) {
            const std::string& s = obj.s;
            if (name == "strip")
                return Value::string(strip_chars(s, a.get(0, "chars"), true, true));
            if (name == "lstrip")
                return Value::string(strip_chars(s, a.get(0, "chars"), true, false));
            if (name == "rstrip")
                return Value::string(strip_chars(s, a.get(0, "chars"), false, true));
            if (name == "upper")
                return Value::string(ascii_map(s, [](int c) { return std::toupper(c); }));
            if (name == "lower")
                return Value::string(ascii_map(s, [](int c) { return std::tolower(c); }));
            if (name == "title") return Value::string(title(s));
            if (name == "capitalize") return Value::string(capitalize(s));
            if (name == "split") {
                const Value maxsplit = a.get(1, "maxsplit", Value::integer(-1));
                return python_split(s, a.get(0, "sep"),
                                    maxsplit.kind == Value::Kind::integer ? maxsplit.i : -1);
            }
            if (name == "replace") {
                const Value count = a.get(2, "count", Value::integer(-1));
                return Value::string(
                    replace_all(s, to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                count.kind == Value::Kind::integer ? count.i : -1));
            }
            if (name == "startswith" || name == "endswith") {
                const Value arg = a.get(0, "prefix");
                List options = arg.is_list() ? *arg.list : List{arg};
                for (const auto& o : options) {
                    if (!o.is_string()) fail(a.line, name + "() takes strings");
                    const bool hit = name == "startswith" ? s.rfind(o.s, 0) == 0
                                                          : s.size() >= o.s.size() &&
                                                                s.compare(s.size() - o.s.size(),
                                                                          o.s.size(), o.s) == 0;
                    if (hit) return Value::boolean(true);
                }
                return Value::boolean(false);
            }
        } else if (obj.is_dict()) {
            if (name == "items" || name == "keys" || name == "values") {
                List l;
                for (const auto& [k, v] : *obj.dict) {
                    if (name == "items") {
                        l.push_back(Value::make_list({Value::string(k), v}));
                    } else {
                        l.push_back(name == "keys" ? Value::string(k) : v);
                    }
                }
                return Value::make_list(std::move(l));
            }
            if (name == "get") {
                const Value key = a.get(0, "key");
                if (const Value* v = key.is_string() ? obj.find(key.s) : nullptr) return *v;
                return a.get(1, "default", Value::none());
            }
        } else if (obj.is_undefined()) {
            fail(a.line, "'" + (obj.s.empty() ? std::string("value") : obj.s) + "' is undefined");
        }
        fail(a.line, "'" + obj.type_name() + "' has no method '" + name + "' in this renderer");
    }

    Value binary(const std::string& op, const Value& a, const Value& b, int line) const {
        if (op == "~") return Value::string(to_str(a) + to_str(b));
        if (a.is_undefined() || b.is_undefined()) {
            const Value& u = a.is_undefined() ? a : b;
            fail(line, "'" + (u.s.empty() ? std::string("value") : u.s) + "' is undefined");
        }
        if (op == "+") {
            if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
            if (a.is_list() && b.is_list()) {
                List l = *a.list;
                l.insert(l.end(), b.list->begin(), b.list->end());
                return Value::make_list(std::move(l));
            }
        }
        if (op == "*" && ((a.is_string() && b.kind == Value::Kind::integer) ||
                          (b.is_string() && a.kind == Value::Kind::integer))) {
            const std::string& s = a.is_string() ? a.s : b.s;
            const int64_t n = a.is_string() ? b.i : a.i;
            std::string out;
            for (int64_t k = 0; k < n && out.size() < (size_t{1} << 26); ++k) out += s;
            return Value::string(std::move(out));
        }
        if (!a.is_number() || !b.is_number()) {
            fail(line, "unsupported operand types for " + op + ": '" + a.type_name() + "' and '" +
                           b.type_name() + "'");
        }
        const bool ints = a.kind == Value::Kind::integer && b.kind == Value::Kind::integer;
        const double x = a.as_double(), y = b.as_double();
        if (op == "+") return ints ? Value::integer(a.i + b.i) : Value::floating(x + y);
        if (op == "-") return ints ? Value::integer(a.i - b.i) : Value::floating(x - y);
        if (op == "*") return ints ? Value::integer(a.i * b.i) : Value::floating(x * y);
        if (op == "**")
            return ints && b.i >= 0 ? Value::integer(static_cast<int64_t>(std::pow(x, y)))
                                    : Value::floating(std::pow(x, y));
        if (y == 0) fail(line, "division by zero");
        if (op == "/") return Value::floating(x / y);
        if (op == "//")
            return ints ? Value::integer(static_cast<int64_t>(std::floor(x / y)))
                        : Value::floating(std::floor(x / y));
        if (op == "%") {
            if (ints) return Value::integer(((a.i % b.i) + b.i) % b.i);
            return Value::floating(x - y * std::floor(x / y));
        }
        fail(line, "unknown operator " + op);
    }

    static bool contains(const Value& container, const Value& item, int line) {
        if (container.is_string()) {
            if (!item.is_string()) fail(line, "'in <string>' requires a string on the left");
            return container.s.find(item.s) != std::string::npos;
        }
        if (container.is_list()) {
            return std::any_of(container.list->begin(), container.list->end(),
                               [&](const Value& v) { return equals(v, item); });
        }
        if (container.is_dict()) return item.is_string() && container.find(item.s) != nullptr;
        if (container.is_undefined()) return false;
        fail(line, "argument of type '" + container.type_name() + "' is not a container");
    }

    static bool compare(const std::string& op, const Value& a, const Value& b, int line) {
        if (op == "==") return equals(a, b);
        if (op == "!=") return !equals(a, b);
        if (op == "in") return contains(b, a, line);
        if (op == "not in") return !contains(b, a, line);
        int cmp = 0;
        if (a.is_number() && b.is_number()) {
            cmp = a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double() ? 1 : 0;
        } else if (a.is_string() && b.is_string()) {
            cmp = a.s.compare(b.s);
        } else {
            fail(line, "'" + op + "' is not supported between '" + a.type_name() + "' and '" +
                           b.type_name() + "'");
        }
        if (op == "<") return cmp < 0;
        if (op == ">") return cmp > 0;
        if (op == "<=") return cmp <= 0;
        return cmp >= 0;
    }

    bool apply_test(const std::string& name, const Value& v, const CallArgs& a) const {
        if (name == "defined") return !v.is_undefined();
        if (name == "undefined") return v.is_undefined();
        if (name == "none") return v.is_none();
        if (name == "boolean") return v.kind == Value::Kind::boolean;
        if (name == "true") return v.kind == Value::Kind::boolean && v.b;
        if (name == "false") return v.kind == Value::Kind::boolean && !v.b;
        if (name == "integer") return v.kind == Value::Kind::integer;
        if (name == "float") return v.kind == Value::Kind::floating;
        if (name == "number") return v.is_number();
        if (name == "string") return v.is_string();
        if (name == "mapping") return v.is_dict();
        if (name == "iterable") return v.is_list() || v.is_dict() || v.is_string();
        if (name == "sequence") return v.is_list() || v.is_dict() || v.is_string();
        if (name == "callable") return v.kind == Value::Kind::function;
        if (name == "lower")
            return v.is_string() && v.s == ascii_map(v.s, [](int c) { return std::tolower(c); });
        if (name == "upper")
            return v.is_string() && v.s == ascii_map(v.s, [](int c) { return std::toupper(c); });
        if (name == "even" || name == "odd") {
            if (v.kind != Value::Kind::integer) return false;
            return (v.i % 2 == 0) == (name == "even");
        }
        const Value other = a.get(0, "value");
        if (name == "divisibleby")
            return v.kind == Value::Kind::integer && other.kind == Value::Kind::integer &&
                   other.i != 0 && v.i % other.i == 0;
        if (name == "eq" || name == "equalto" || name == "==") return equals(v, other);
        if (name == "ne" || name == "!=") return !equals(v, other);
        if (name == "lt" || name == "lessthan") return compare("<", v, other, a.line);
        if (name == "gt" || name == "greaterthan") return compare(">", v, other, a.line);
        if (name == "le") return compare("<=", v, other, a.line);
        if (name == "ge") return compare(">=", v, other, a.line);
        if (name == "in") return contains(other, v, a.line);
        if (name == "sameas") return v.kind == other.kind && equals(v, other);
        fail(a.line, "the test '" + name + "' is not supported");
    }

    Value apply_filter(const std::string& name, const Value& v, const CallArgs& a) {
        if (name == "default" || name == "d") {
            const bool use_default = a.get(1, "boolean", Value::boolean(false)).truthy()
                                         ? !v.truthy()
                                         : v.is_undefined();
            return use_default ? a.get(0, "default_value", Value::string("")) : v;
        }
        if (name == "length" || name == "count") {
            if (v.is_string()) return Value::integer(static_cast<int64_t>(utf8_chars(v.s).size()));
            if (v.is_list()) return Value::integer(static_cast<int64_t>(v.list->size()));
            if (v.is_dict()) return Value::integer(static_cast<int64_t>(v.dict->size()));
            if (v.is_undefined()) return Value::integer(0);
            fail(a.line, "object of type '" + v.type_name() + "' has no length");
        }
        if (name == "safe") return v;
        if (name == "string") return Value::string(to_str(v));
        if (name == "trim")
            return Value::string(strip_chars(to_str(v), a.get(0, "chars"), true, true));
        if (name == "upper")
            return Value::string(ascii_map(to_str(v), [](int c) { return std::toupper(c); }));
        if (name == "lower")
            return Value::string(ascii_map(to_str(v), [](int c) { return std::tolower(c); }));
        if (name == "capitalize") return Value::string(capitalize(to_str(v)));
        if (name == "title") return Value::string(title(to_str(v)));
        if (name == "replace") {
            const Value count = a.get(2, "count", Value::integer(-1));
            return Value::string(replace_all(to_str(v), to_str(a.get(0, "old")),
                                             to_str(a.get(1, "new")),
                                             count.kind == Value::Kind::integer ? count.i : -1));
        }
        if (name == "tojson") {
            const Value indent = a.get(0, "indent", Value::none());
            return Value::string(
                to_json(v, indent.kind == Value::Kind::integer ? static_cast<int>(indent.i) : -1,
                        a.get(1, "sort_keys", Value::boolean(false)).truthy()));
        }
        if (name == "int") {
            if (v.kind == Value::Kind::integer) return v;
            if (v.kind == Value::Kind::floating) return Value::integer(static_cast<int64_t>(v.f));
            if (v.kind == Value::Kind::boolean) return Value::integer(v.b);
            if (v.is_string()) {
                try {
                    size_t used = 0;
                    const long long n =
                        std::stoll(strip_chars(v.s, Value::undefined(), true, true), &used);
                    return Value::integer(n);
                } catch (const std::exception&) {
                }
            }
            return a.get(0, "default", Value::integer(0));
        }
        if (name == "float") {
            if (v.is_number()) return Value::floating(v.as_double());
            if (v.is_string()) {
                try {
                    return Value::floating(std::stod(v.s));
                } catch (const std::exception&) {
                }
            }
            return a.get(0, "default", Value::floating(0));
        }
        if (name == "list") return Value::make_list(iterate(v, a.line));
        if (name == "first" || name == "last") {
            const List items = iterate(v, a.line);
            if (items.empty()) return Value::undefined();
            return name == "first" ? items.front() : items.back();
        }
        if (name == "reverse") {
            List items = iterate(v, a.line);
            std::reverse(items.begin(), items.end());
            if (!v.is_string()) return Value::make_list(std::move(items));
            std::string s;
            for (const auto& c : items) s += c.s;
            return Value::string(std::move(s));
        }
        if (name == "join") {
            const Value attribute = a.get(1, "attribute");
            std::string out;
            bool first = true;
            for (const auto& item : iterate(v, a.line)) {
                if (!first) out += to_str(a.get(0, "d", Value::string("")));
                first = false;
                out += to_str(attribute.is_undefined() ? item
                                                       : get_attr(item, to_str(attribute), a.line));
            }
            return Value::string(std::move(out));
        }
        if (name == "items") {
            if (!v.is_dict()) fail(a.line, "items filter needs a mapping");
            return call_method(v, "items", a);
        }
        if (name == "map") {
            const Value attribute = a.keyword_or("attribute");
            List out;
            for (const auto& item : iterate(v, a.line)) {
                if (!attribute.is_undefined()) {
                    const Value got = get_attr(item, to_str(attribute), a.line);
                    out.push_back(got.is_undefined() ? a.keyword_or("default") : got);
                } else {
                    CallArgs rest;
                    rest.line = a.line;
                    rest.positional.assign(a.positional.begin() + (a.positional.empty() ? 0 : 1),
                                           a.positional.end());
                    if (a.positional.empty())
                        fail(a.line, "map() needs a filter name or attribute=");
                    out.push_back(apply_filter(to_str(a.positional[0]), item, rest));
                }
            }
            return Value::make_list(std::move(out));
        }
        if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
            const bool by_attr = name == "selectattr" || name == "rejectattr";
            const bool keep_when = name == "selectattr" || name == "select";
            const size_t test_pos = by_attr ? 1 : 0;
            List out;
            for (const auto& item : iterate(v, a.line)) {
                const Value subject =
                    by_attr ? get_attr(item, to_str(a.get(0, "attribute")), a.line) : item;
                bool pass;
                if (a.positional.size() <= test_pos) {
                    pass = subject.truthy();
                } else {
                    CallArgs test_args;
                    test_args.line = a.line;
                    test_args.positional.assign(a.positional.begin() + test_pos + 1,
                                                a.positional.end());
                    pass = apply_test(to_str(a.positional[test_pos]), subject, test_args);
                }
                if (pass == keep_when) out.push_back(item);
            }
            return Value::make_list(std::move(out));
        }
        fail(a.line, "the filter '" + name + "' is not supported");
    }

    std::vector<std::unordered_map<std::string, Value>> scopes_;
    int loop_depth_ = 0;
};

}  // namespace

}  // namespace minids::jinja

namespace minids {

JinjaTemplate::JinjaTemplate() = default;
JinjaTemplate::~JinjaTemplate() = default;
JinjaTemplate::JinjaTemplate(JinjaTemplate&&) noexcept = default;
JinjaTemplate& JinjaTemplate::operator=(JinjaTemplate&&) noexcept = default;

JinjaTemplate JinjaTemplate::parse(std::string_view source) {
    JinjaTemplate t;
    t.root_ = std::make_unique<jinja::Node>(jinja::parse_template(source));
    return t;
}

std::string JinjaTemplate::render(const nlohmann::json& context) const {
    jinja::Renderer renderer(context);
    std::string out;
    renderer.render(*root_, out);
    return out;
}

}  // namespace minids
