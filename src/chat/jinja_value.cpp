#include "chat/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "chat/jinja.h"

namespace minids::jinja {

Value Value::undefined(std::string name) {
    Value v;
    if (!name.empty()) v.text = std::make_shared<const std::string>(std::move(name));
    return v;
}
Value Value::none() {
    Value v;
    v.kind = Kind::none;
    return v;
}
Value Value::boolean(bool b) {
    Value v;
    v.kind = Kind::boolean;
    v.b = b;
    return v;
}
Value Value::integer(int64_t i) {
    Value v;
    v.kind = Kind::integer;
    v.i = i;
    return v;
}
Value Value::floating(double f) {
    Value v;
    v.kind = Kind::floating;
    v.f = f;
    return v;
}
Value Value::string(std::string s) {
    if (s.size() > jinja_max_string_bytes)
        throw ChatTemplateError("chat template: a string of " + std::to_string(s.size()) +
                                " bytes is longer than the limit of " +
                                std::to_string(jinja_max_string_bytes));
    charge_bytes(s.size());
    Value v;
    v.kind = Kind::string;
    v.text = std::make_shared<const std::string>(std::move(s));
    return v;
}

namespace {

// Depth of a container holding `items`; refuses namespaces inside it and nesting past the limit.
template <class Items, class Get>
int container_depth(const Items& items, Get value_of) {
    charge(items.size() + 1);
    int depth = 0;
    for (const auto& item : items) {
        const Value& v = value_of(item);
        if (v.is_namespace)
            throw ChatTemplateError(
                "chat template: a namespace() cannot be put in a list, dict or namespace");
        depth = std::max(depth, v.depth);
    }
    if (depth + 1 > jinja_max_value_depth)
        throw ChatTemplateError("chat template: lists and dicts nested deeper than " +
                                std::to_string(jinja_max_value_depth) + " levels");
    return depth + 1;
}

}  // namespace

Value Value::make_list(List l) {
    Value v;
    v.kind = Kind::list;
    v.depth = container_depth(l, [](const Value& x) -> const Value& { return x; });
    v.list = std::make_shared<List>(std::move(l));
    return v;
}
Value Value::make_tuple(List l) {
    Value v = make_list(std::move(l));
    v.is_tuple = true;
    return v;
}
Value Value::make_dict(Dict d) {
    Value v;
    v.kind = Kind::dict;
    v.depth = container_depth(d, [](const auto& kv) -> const Value& { return kv.second; });
    v.dict = std::make_shared<Dict>(std::move(d));
    return v;
}
const std::string& Value::s() const {
    static const std::string empty;
    return text ? *text : empty;
}

Value Value::function(Function f) {
    Value v;
    v.kind = Kind::function;
    v.fn = std::make_shared<Function>(std::move(f));
    return v;
}

namespace {

Value from_json_at(const nlohmann::ordered_json& j, int depth) {
    if (depth > jinja_max_value_depth)
        throw ChatTemplateError("chat template: the context nests deeper than " +
                                std::to_string(jinja_max_value_depth) + " levels");
    switch (j.type()) {
        case nlohmann::ordered_json::value_t::null:
            return Value::none();
        case nlohmann::ordered_json::value_t::boolean:
            return Value::boolean(j.get<bool>());
        case nlohmann::ordered_json::value_t::number_integer:
            return Value::integer(j.get<int64_t>());
        case nlohmann::ordered_json::value_t::number_unsigned:
            return Value::integer(static_cast<int64_t>(j.get<uint64_t>()));
        case nlohmann::ordered_json::value_t::number_float:
            return Value::floating(j.get<double>());
        case nlohmann::ordered_json::value_t::string:
            return Value::string(j.get<std::string>());
        case nlohmann::ordered_json::value_t::array: {
            List l;
            for (const auto& e : j) l.push_back(from_json_at(e, depth + 1));
            return Value::make_list(std::move(l));
        }
        case nlohmann::ordered_json::value_t::object: {
            Dict d;
            for (const auto& [k, e] : j.items()) d.emplace_back(k, from_json_at(e, depth + 1));
            return Value::make_dict(std::move(d));
        }
        default:
            throw ChatTemplateError("chat template: unsupported JSON value in the context");
    }
}

}  // namespace

Value Value::from_json(const nlohmann::ordered_json& j) { return from_json_at(j, 0); }

// ---- the work budget ----

namespace {
// The budget of the render running on this thread (RenderBudget's constructor installs it).
thread_local RenderBudget* current_budget = nullptr;
}  // namespace

RenderBudget::RenderBudget(uint64_t units) : left_(units), limit_(units), outer_(current_budget) {
    current_budget = this;
}

RenderBudget::~RenderBudget() { current_budget = outer_; }

void RenderBudget::spend(uint64_t units) {
    if (units > left_)
        throw ChatTemplateError("chat template line " + std::to_string(line_) +
                                ": rendering needs more than its work limit of " +
                                std::to_string(limit_) +
                                " steps (a loop that runs too long, or values that grow too "
                                "large)");
    left_ -= units;
}

void charge(uint64_t units) {
    if (current_budget) current_budget->spend(units);
}

void charge_bytes(size_t n) { charge(n / 64 + 1); }

void append_bounded(std::string& out, std::string_view piece) {
    if (piece.size() > jinja_max_string_bytes - std::min(out.size(), jinja_max_string_bytes))
        throw ChatTemplateError("chat template: the text grows past the limit of " +
                                std::to_string(jinja_max_string_bytes) + " bytes");
    charge_bytes(piece.size());
    out.append(piece);
}

bool Value::truthy() const {
    switch (kind) {
        case Kind::undefined:
        case Kind::none:
            return false;
        case Kind::boolean:
            return b;
        case Kind::integer:
            return i != 0;
        case Kind::floating:
            return f != 0;
        case Kind::string:
            return !s().empty();
        case Kind::list:
            return !list->empty();
        case Kind::dict:
            return !dict->empty();
        case Kind::function:
            return true;
    }
    return false;
}

const Value* Value::find(std::string_view key) const {
    if (kind != Kind::dict) return nullptr;
    for (const auto& [k, v] : *dict) {
        if (k == key) return &v;
    }
    return nullptr;
}

std::string Value::type_name() const {
    switch (kind) {
        case Kind::undefined:
            return "undefined";
        case Kind::none:
            return "NoneType";
        case Kind::boolean:
            return "bool";
        case Kind::integer:
            return "int";
        case Kind::floating:
            return "float";
        case Kind::string:
            return "str";
        case Kind::list:
            return "list";
        case Kind::dict:
            return is_namespace ? "Namespace" : "dict";
        case Kind::function:
            return "function";
    }
    return "?";
}

namespace {

// Python's repr(float): the shortest digits that read back to the same double.
std::string float_repr(double f) {
    if (std::isnan(f)) return "nan";
    if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
    char buf[32];
    for (int prec = 1; prec <= 17; ++prec) {
        std::snprintf(buf, sizeof buf, "%.*g", prec, f);
        if (std::strtod(buf, nullptr) == f) break;
    }
    std::string s = buf;
    if (s.find_first_of(".en") == std::string::npos) s += ".0";
    return s;
}

std::string string_repr(const std::string& s) {
    const char quote =
        s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, quote);
    for (char c : s) {
        switch (c) {
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            default:
                if (c == quote) out += '\\';
                out += c;
        }
    }
    out += quote;
    return out;
}

void json_string(const std::string& s, std::string& out) {
    out += '"';
    for (char c : s) {
        switch (c) {
            case '"':
                out += "\\\"";
                break;
            case '\\':
                out += "\\\\";
                break;
            case '\n':
                out += "\\n";
                break;
            case '\r':
                out += "\\r";
                break;
            case '\t':
                out += "\\t";
                break;
            case '\b':
                out += "\\b";
                break;
            case '\f':
                out += "\\f";
                break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned char>(c));
                    out += buf;
                } else {
                    out += c;
                }
        }
    }
    out += '"';
}

void json_dump(const Value& v, int indent, bool sort_keys, int depth, std::string& out) {
    charge(1);
    if (out.size() > jinja_max_string_bytes) append_bounded(out, "");  // refuses
    auto newline = [&](int d) {
        if (indent < 0) return;
        out += '\n';
        append_bounded(out, std::string(static_cast<size_t>(indent) * size_t(d), ' '));
    };
    // json.dumps' default separators: ", " and ": " without indent, "," and ": " with it.
    const char* item_sep = indent < 0 ? ", " : ",";
    switch (v.kind) {
        case Value::Kind::undefined:
        case Value::Kind::none:
            out += "null";
            break;
        case Value::Kind::boolean:
            out += v.b ? "true" : "false";
            break;
        case Value::Kind::integer:
            out += std::to_string(v.i);
            break;
        case Value::Kind::floating:
            out += std::isnan(v.f)   ? "NaN"
                   : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                                     : float_repr(v.f);
            break;
        case Value::Kind::string:
            charge_bytes(v.s().size());
            json_string(v.s(), out);
            break;
        case Value::Kind::list:
            if (v.list->empty()) {
                out += "[]";
                break;
            }
            out += '[';
            for (size_t k = 0; k < v.list->size(); ++k) {
                if (k) out += item_sep;
                newline(depth + 1);
                json_dump((*v.list)[k], indent, sort_keys, depth + 1, out);
            }
            newline(depth);
            out += ']';
            break;
        case Value::Kind::dict: {
            if (v.dict->empty()) {
                out += "{}";
                break;
            }
            std::vector<const std::pair<std::string, Value>*> items;
            for (const auto& kv : *v.dict) items.push_back(&kv);
            if (sort_keys) {
                std::stable_sort(items.begin(), items.end(),
                                 [](auto* a, auto* b) { return a->first < b->first; });
            }
            out += '{';
            for (size_t k = 0; k < items.size(); ++k) {
                if (k) out += item_sep;
                newline(depth + 1);
                json_string(items[k]->first, out);
                out += ": ";
                json_dump(items[k]->second, indent, sort_keys, depth + 1, out);
            }
            newline(depth);
            out += '}';
            break;
        }
        case Value::Kind::function:
            throw ChatTemplateError("chat template: a function cannot be converted to JSON");
    }
}

}  // namespace

std::string to_repr(const Value& v) {
    charge(1);
    switch (v.kind) {
        case Value::Kind::string:
            charge_bytes(v.s().size());
            return string_repr(v.s());
        case Value::Kind::list: {
            std::string out = v.is_tuple ? "(" : "[";
            for (size_t k = 0; k < v.list->size(); ++k) {
                if (k) out += ", ";
                append_bounded(out, to_repr((*v.list)[k]));
            }
            if (v.is_tuple && v.list->size() == 1) out += ",";
            return out + (v.is_tuple ? ")" : "]");
        }
        case Value::Kind::dict: {
            std::string out = v.is_namespace ? "<Namespace {" : "{";
            for (size_t k = 0; k < v.dict->size(); ++k) {
                if (k) out += ", ";
                append_bounded(
                    out, string_repr((*v.dict)[k].first) + ": " + to_repr((*v.dict)[k].second));
            }
            return out + (v.is_namespace ? "}>" : "}");
        }
        default:
            return to_str(v);
    }
}

std::string to_str(const Value& v) {
    switch (v.kind) {
        case Value::Kind::undefined:
            return "";
        case Value::Kind::none:
            return "None";
        case Value::Kind::boolean:
            return v.b ? "True" : "False";
        case Value::Kind::integer:
            return std::to_string(v.i);
        case Value::Kind::floating:
            return float_repr(v.f);
        case Value::Kind::string:
            return v.s();
        case Value::Kind::function:
            return "<function>";
        default:
            return to_repr(v);
    }
}

std::string to_json(const Value& v, int indent, bool sort_keys) {
    std::string out;
    json_dump(v, indent, sort_keys, 0, out);
    return out;
}

bool equals(const Value& a, const Value& b) {
    charge(1);
    if (a.is_number() && b.is_number()) {
        if (a.kind == Value::Kind::integer && b.kind == Value::Kind::integer) return a.i == b.i;
        return a.as_double() == b.as_double();
    }
    // Python: True == 1; keep bools apart from ints except against numbers.
    if (a.kind == Value::Kind::boolean && b.is_number()) return (a.b ? 1.0 : 0.0) == b.as_double();
    if (b.kind == Value::Kind::boolean && a.is_number()) return (b.b ? 1.0 : 0.0) == a.as_double();
    if (a.kind != b.kind) return false;
    switch (a.kind) {
        case Value::Kind::undefined:
        case Value::Kind::none:
            return true;
        case Value::Kind::boolean:
            return a.b == b.b;
        case Value::Kind::string:
            charge_bytes(std::min(a.s().size(), b.s().size()));
            return a.s() == b.s();
        case Value::Kind::list:
            return a.list->size() == b.list->size() &&
                   std::equal(a.list->begin(), a.list->end(), b.list->begin(), equals);
        case Value::Kind::dict: {
            if (a.dict->size() != b.dict->size()) return false;
            for (const auto& [k, v] : *a.dict) {
                const Value* other = b.find(k);
                if (!other || !equals(v, *other)) return false;
            }
            return true;
        }
        case Value::Kind::function:
            return a.fn == b.fn;
        default:
            return false;
    }
}

}  // namespace minids::jinja
