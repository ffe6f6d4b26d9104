#include "chat/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "chat/jinja.h"

namespace minids::jinja {

Value Value::undefined(std::string name) {
    Value v;
    v.s = std::move(name);
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
    Value v;
    v.kind = Kind::string;
    v.s = std::move(s);
    return v;
}
Value Value::make_list(List l) {
    Value v;
    v.kind = Kind::list;
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
    v.dict = std::make_shared<Dict>(std::move(d));
    return v;
}
Value Value::function(Function f) {
    Value v;
    v.kind = Kind::function;
    v.fn = std::make_shared<Function>(std::move(f));
    return v;
}

Value Value::from_json(const nlohmann::ordered_json& j) {
    switch (j.type()) {
        case nlohmann::ordered_json::value_t::null:
            return none();
        case nlohmann::ordered_json::value_t::boolean:
            return boolean(j.get<bool>());
        case nlohmann::ordered_json::value_t::number_integer:
            return integer(j.get<int64_t>());
        case nlohmann::ordered_json::value_t::number_unsigned:
            return integer(static_cast<int64_t>(j.get<uint64_t>()));
        case nlohmann::ordered_json::value_t::number_float:
            return floating(j.get<double>());
        case nlohmann::ordered_json::value_t::string:
            return string(j.get<std::string>());
        case nlohmann::ordered_json::value_t::array: {
            List l;
            for (const auto& e : j) l.push_back(from_json(e));
            return make_list(std::move(l));
        }
        case nlohmann::ordered_json::value_t::object: {
            Dict d;
            for (const auto& [k, e] : j.items()) d.emplace_back(k, from_json(e));
            return make_dict(std::move(d));
        }
        default:
            throw ChatTemplateError("chat template: unsupported JSON value in the context");
    }
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
            return !s.empty();
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
    auto newline = [&](int d) {
        if (indent < 0) return;
        out += '\n';
        out.append(static_cast<size_t>(indent * d), ' ');
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
            json_string(v.s, out);
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
    switch (v.kind) {
        case Value::Kind::string:
            return string_repr(v.s);
        case Value::Kind::list: {
            std::string out = v.is_tuple ? "(" : "[";
            for (size_t k = 0; k < v.list->size(); ++k) {
                if (k) out += ", ";
                out += to_repr((*v.list)[k]);
            }
            if (v.is_tuple && v.list->size() == 1) out += ",";
            return out + (v.is_tuple ? ")" : "]");
        }
        case Value::Kind::dict: {
            std::string out = v.is_namespace ? "<Namespace {" : "{";
            for (size_t k = 0; k < v.dict->size(); ++k) {
                if (k) out += ", ";
                out += string_repr((*v.dict)[k].first) + ": " + to_repr((*v.dict)[k].second);
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
            return v.s;
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
            return a.s == b.s;
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
