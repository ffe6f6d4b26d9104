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
#include "chat/jinja_builtins.h"
#include "chat/jinja_value.h"

namespace minids::jinja {

namespace {

enum class Flow { normal, loop_break, loop_continue };

// range() builds its list; longer ones are refused before the work budget would be.
constexpr size_t kMaxRange = 1000000;

// Python's int arithmetic, within int64: what Python would compute, or an error where the
// result needs a bigger integer.
void check_overflow(bool overflow, int line) {
    if (overflow) fail(line, "integer overflow (the result does not fit in 64 bits)");
}
int64_t checked_add(int64_t a, int64_t b, int line) {
    int64_t r = 0;
    check_overflow(__builtin_add_overflow(a, b, &r), line);
    return r;
}
int64_t checked_sub(int64_t a, int64_t b, int line) {
    int64_t r = 0;
    check_overflow(__builtin_sub_overflow(a, b, &r), line);
    return r;
}
int64_t checked_mul(int64_t a, int64_t b, int line) {
    int64_t r = 0;
    check_overflow(__builtin_mul_overflow(a, b, &r), line);
    return r;
}

class Renderer {
public:
    explicit Renderer(const nlohmann::ordered_json& context) {
        scopes_.emplace_back();
        auto& globals = scopes_.back();
        globals["raise_exception"] = Value::function([](CallArgs& a) -> Value {
            throw ChatTemplateRaised("chat template raised an exception: " +
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
                if (a.positional[k].kind != Value::Kind::integer)
                    fail(a.line, "range() takes integers");
                return a.positional[k].i;
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
            for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
                if (l.size() >= kMaxRange)
                    fail(a.line, "range() is longer than " + std::to_string(kMaxRange));
                l.push_back(Value::integer(i));
                if (__builtin_add_overflow(i, step, &i)) break;
            }
            return Value::make_list(std::move(l));
        });
        scopes_.emplace_back();
        if (!context.is_object())
            throw ChatTemplateError("chat template: the context should be a JSON object");
        for (const auto& [k, v] : context.items()) scopes_.back()[k] = Value::from_json(v);
    }

    Flow render(const Node& n, std::string& out) {
        step(n.line);
        switch (n.kind) {
            case Node::Kind::block:
                for (const Node& c : n.children) {
                    const Flow f = render(c, out);
                    if (f != Flow::normal) return f;
                }
                return Flow::normal;
            case Node::Kind::text:
                append_bounded(out, n.text);
                return Flow::normal;
            case Node::Kind::output:
                append_bounded(out, to_str(eval(*n.expr)));
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
    // One step of the work budget; the line is what the budget's message names.
    void step(int line) {
        if (budget_) {
            budget_->at_line(line);
            budget_->spend(1);
        }
    }

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
            if (v.is_namespace) fail(n.line, "a namespace() cannot be put in a namespace");
            if (v.depth + 1 > jinja_max_value_depth)
                fail(n.line, "lists and dicts nested deeper than " +
                                 std::to_string(jinja_max_value_depth) + " levels");
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
            scopes_.back().clear();  // each iteration starts afresh: `set` does not carry over
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
        step(e.line);
        switch (e.kind) {
            case Expr::Kind::literal:
                return e.literal;
            case Expr::Kind::name:
                return lookup(e.name);
            case Expr::Kind::list:
            case Expr::Kind::tuple: {
                List l;
                for (const auto& a : e.args) l.push_back(eval(*a));
                return e.kind == Expr::Kind::tuple ? Value::make_tuple(std::move(l))
                                                   : Value::make_list(std::move(l));
            }
            case Expr::Kind::dict: {
                Dict d;
                for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
                    const Value key = eval(*e.args[k]);
                    if (!key.is_string()) fail(e.line, "dict keys must be strings");
                    d.emplace_back(key.s(), eval(*e.args[k + 1]));
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
                if (v.kind == Value::Kind::integer) {
                    check_overflow(v.i == INT64_MIN, e.line);
                    return Value::integer(-v.i);
                }
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

    Value slice(const Expr& e) {
        const Value obj = eval(*e.args[0]);
        List items;
        if (obj.is_list()) {
            charge(obj.list->size());
            items = *obj.list;
        } else if (obj.is_string()) {
            for (auto& c : utf8_chars(obj.s())) items.push_back(Value::string(std::move(c)));
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
        for (int64_t k = start; step > 0 ? k < stop : k > stop;) {
            out.push_back(items[size_t(k)]);
            if (__builtin_add_overflow(k, step, &k)) break;
        }
        if (!obj.is_string()) return Value::make_list(std::move(out));
        std::string s;
        for (const auto& c : out) s += c.s();
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
                callee.kind == Expr::Kind::name ? in_quotes(callee.name) : std::string("the value");
            fail(e.line, what + " is not a function (or not one this renderer provides)");
        }
        return (*fn.fn)(args);
    }

    Value binary(const std::string& op, const Value& a, const Value& b, int line) const {
        if (op == "~") {
            std::string s = to_str(a);
            append_bounded(s, to_str(b));
            return Value::string(std::move(s));
        }
        if (a.is_undefined() || b.is_undefined()) {
            const Value& u = a.is_undefined() ? a : b;
            fail(line, in_quotes(u.s().empty() ? "value" : u.s()) + " is undefined");
        }
        if (op == "+") {
            if (a.is_string() && b.is_string()) {
                std::string s = a.s();
                append_bounded(s, b.s());
                return Value::string(std::move(s));
            }
            if (a.is_list() && b.is_list()) {
                List l = *a.list;
                l.insert(l.end(), b.list->begin(), b.list->end());
                return Value::make_list(std::move(l));
            }
        }
        if (op == "*" && ((a.is_string() && b.kind == Value::Kind::integer) ||
                          (b.is_string() && a.kind == Value::Kind::integer))) {
            const std::string& s = a.is_string() ? a.s() : b.s();
            const int64_t n = a.is_string() ? b.i : a.i;
            std::string out;
            for (int64_t k = 0; k < n; ++k) append_bounded(out, s);
            return Value::string(std::move(out));
        }
        if (!a.is_number() || !b.is_number()) {
            fail(line, "unsupported operand types for " + op + ": '" + a.type_name() + "' and '" +
                           b.type_name() + "'");
        }
        const bool ints = a.kind == Value::Kind::integer && b.kind == Value::Kind::integer;
        const double x = a.as_double(), y = b.as_double();
        if (op == "+")
            return ints ? Value::integer(checked_add(a.i, b.i, line)) : Value::floating(x + y);
        if (op == "-")
            return ints ? Value::integer(checked_sub(a.i, b.i, line)) : Value::floating(x - y);
        if (op == "*")
            return ints ? Value::integer(checked_mul(a.i, b.i, line)) : Value::floating(x * y);
        if (op == "**") {
            if (!ints || b.i < 0) return Value::floating(std::pow(x, y));
            int64_t result = 1, base = a.i;
            for (int64_t e = b.i; e > 0; e >>= 1) {  // by squaring: at most 63 rounds
                if (e & 1) result = checked_mul(result, base, line);
                if (e > 1) base = checked_mul(base, base, line);
            }
            return Value::integer(result);
        }
        if (y == 0) fail(line, "division by zero");
        if (op == "/") return Value::floating(x / y);
        if (op == "//") {
            if (!ints) return Value::floating(std::floor(x / y));
            // Python floors; C++ truncates toward zero.
            check_overflow(a.i == INT64_MIN && b.i == -1, line);
            const int64_t q = a.i / b.i;
            return Value::integer(q - ((a.i % b.i != 0) && ((a.i < 0) != (b.i < 0))));
        }
        if (op == "%") {
            if (!ints) return Value::floating(x - y * std::floor(x / y));
            if (b.i == -1) return Value::integer(0);
            const int64_t m = a.i % b.i;  // Python's result takes the sign of the divisor
            return Value::integer(m != 0 && ((m < 0) != (b.i < 0)) ? m + b.i : m);
        }
        fail(line, "unknown operator " + op);
    }

    std::vector<std::unordered_map<std::string, Value>> scopes_;
    int loop_depth_ = 0;
    RenderBudget* budget_ = nullptr;

public:
    void set_budget(RenderBudget* budget) { budget_ = budget; }
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

std::string JinjaTemplate::render(const nlohmann::ordered_json& context) const {
    // Converting the context is charged too, without a limit: what it costs sets the budget of
    // the render, so a long conversation gets proportionally more work.
    constexpr uint64_t unlimited = UINT64_MAX / 32;
    jinja::RenderBudget budget(unlimited);
    jinja::Renderer renderer(context);
    budget.set_limit(jinja_base_work + 16 * (unlimited - budget.left()));
    renderer.set_budget(&budget);
    std::string out;
    renderer.render(*root_, out);
    return out;
}

}  // namespace minids
