// Jinja's built-in filters, tests and the Python methods templates call on values, plus the
// value operations they share with the interpreter (iteration, attribute and item access,
// comparison). Stateless: everything here depends only on its arguments.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>

#include "chat/jinja.h"
#include "chat/jinja_builtins.h"

namespace minids::jinja {

[[noreturn]] void fail(int line, const std::string& msg) {
    throw ChatTemplateError("chat template line " + std::to_string(line) + ": " + msg);
}

std::string in_quotes(std::string_view text) {
    std::string out(1, '\'');
    out.append(text);
    out += '\'';
    return out;
}

namespace {

const char* kWhitespace = " \t\n\r\f\v";

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
    const std::string set = chars.is_string() ? chars.s() : kWhitespace;
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

std::string ascii_map(std::string s, int (*fn)(int)) {
    charge_bytes(s.size());
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
        append_bounded(out, std::string_view(s).substr(pos, hit - pos));
        append_bounded(out, to);
        pos = hit + from.size();
    }
    append_bounded(out, std::string_view(s).substr(pos));
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
    if (sep.s().empty()) throw ChatTemplateError("chat template: split() separator is empty");
    size_t pos = 0;
    while (maxsplit < 0 || static_cast<int64_t>(parts.size()) < maxsplit) {
        const size_t hit = s.find(sep.s(), pos);
        if (hit == std::string::npos) break;
        parts.push_back(Value::string(s.substr(pos, hit - pos)));
        pos = hit + sep.s().size();
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

}  // namespace

// The code points of a UTF-8 string, each as its own string.
std::vector<std::string> utf8_chars(const std::string& s) {
    charge_bytes(s.size());
    std::vector<std::string> out;
    for (size_t i = 0; i < s.size();) {
        size_t n = 1;
        while (i + n < s.size() && (static_cast<unsigned char>(s[i + n]) & 0xC0) == 0x80) ++n;
        out.push_back(s.substr(i, n));
        i += n;
    }
    return out;
}

size_t utf8_length(const std::string& s) {
    charge_bytes(s.size());
    // As utf8_chars splits: a character starts at the first byte and at every later byte that is
    // not a continuation byte.
    size_t n = s.empty() ? 0 : 1;
    for (size_t i = 1; i < s.size(); ++i) n += (static_cast<unsigned char>(s[i]) & 0xC0) != 0x80;
    return n;
}

List iterate(const Value& v, int line) {
    switch (v.kind) {
        case Value::Kind::undefined:
            return {};
        case Value::Kind::list:
            charge(v.list->size());
            return *v.list;
        case Value::Kind::dict: {
            List keys;
            for (const auto& [k, val] : *v.dict) keys.push_back(Value::string(k));
            return keys;
        }
        case Value::Kind::string: {
            List chars;
            for (auto& c : utf8_chars(v.s())) chars.push_back(Value::string(std::move(c)));
            return chars;
        }
        default:
            fail(line, in_quotes(v.type_name()) + " object is not iterable");
    }
}

Value get_attr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined())
        fail(line, in_quotes(obj.s().empty() ? "value" : obj.s()) + " is undefined");
    if (const Value* v = obj.find(name)) return *v;
    return Value::undefined(name);
}

Value get_item(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined())
        fail(line, in_quotes(obj.s().empty() ? "value" : obj.s()) + " is undefined");
    if (obj.is_dict() && key.is_string()) {
        if (const Value* v = obj.find(key.s())) return *v;
        return Value::undefined(key.s());
    }
    if ((obj.is_list() || obj.is_string()) && key.kind == Value::Kind::integer) {
        if (obj.is_list()) {
            auto idx = python_index(key.i, obj.list->size());
            return idx ? (*obj.list)[*idx] : Value::undefined();
        }
        const std::vector<std::string> chars = utf8_chars(obj.s());
        auto idx = python_index(key.i, chars.size());
        return idx ? Value::string(chars[*idx]) : Value::undefined();
    }
    return Value::undefined();
}

Value call_method(const Value& obj, const std::string& name, const CallArgs& a) {
    if (obj.is_string()) {
        const std::string& s = obj.s();
        if (name == "strip") return Value::string(strip_chars(s, a.get(0, "chars"), true, true));
        if (name == "lstrip") return Value::string(strip_chars(s, a.get(0, "chars"), true, false));
        if (name == "rstrip") return Value::string(strip_chars(s, a.get(0, "chars"), false, true));
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
            return Value::string(replace_all(s, to_str(a.get(0, "old")), to_str(a.get(1, "new")),
                                             count.kind == Value::Kind::integer ? count.i : -1));
        }
        if (name == "startswith" || name == "endswith") {
            const Value arg = a.get(0, "prefix");
            const List options = arg.is_list() ? *arg.list : List{arg};
            charge(options.size());
            for (const auto& o : options) {
                if (!o.is_string()) fail(a.line, name + "() takes strings");
                const bool hit = name == "startswith" ? s.rfind(o.s(), 0) == 0
                                                      : s.size() >= o.s().size() &&
                                                            s.compare(s.size() - o.s().size(),
                                                                      o.s().size(), o.s()) == 0;
                if (hit) return Value::boolean(true);
            }
            return Value::boolean(false);
        }
    } else if (obj.is_dict()) {
        if (name == "items" || name == "keys" || name == "values") {
            List l;
            for (const auto& [k, v] : *obj.dict) {
                if (name == "items") {
                    l.push_back(Value::make_tuple({Value::string(k), v}));
                } else {
                    l.push_back(name == "keys" ? Value::string(k) : v);
                }
            }
            return Value::make_list(std::move(l));
        }
        if (name == "get") {
            const Value key = a.get(0, "key");
            if (const Value* v = key.is_string() ? obj.find(key.s()) : nullptr) return *v;
            return a.get(1, "default", Value::none());
        }
    } else if (obj.is_undefined()) {
        fail(a.line, in_quotes(obj.s().empty() ? "value" : obj.s()) + " is undefined");
    }
    fail(a.line,
         in_quotes(obj.type_name()) + " has no method " + in_quotes(name) + " in this renderer");
}

bool contains(const Value& container, const Value& item, int line) {
    if (container.is_string()) {
        if (!item.is_string()) fail(line, "'in <string>' requires a string on the left");
        charge_bytes(container.s().size());
        return container.s().find(item.s()) != std::string::npos;
    }
    if (container.is_list()) {
        return std::any_of(container.list->begin(), container.list->end(),
                           [&](const Value& v) { return equals(v, item); });
    }
    if (container.is_dict()) return item.is_string() && container.find(item.s()) != nullptr;
    if (container.is_undefined()) return false;
    fail(line, "argument of type '" + container.type_name() + "' is not a container");
}

bool compare(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return equals(a, b);
    if (op == "!=") return !equals(a, b);
    if (op == "in") return contains(b, a, line);
    if (op == "not in") return !contains(b, a, line);
    int cmp = 0;
    if (a.is_number() && b.is_number()) {
        cmp = a.as_double() < b.as_double() ? -1 : a.as_double() > b.as_double() ? 1 : 0;
    } else if (a.is_string() && b.is_string()) {
        charge_bytes(std::min(a.s().size(), b.s().size()));
        cmp = a.s().compare(b.s());
    } else {
        fail(line, "'" + op + "' is not supported between '" + a.type_name() + "' and '" +
                       b.type_name() + "'");
    }
    if (op == "<") return cmp < 0;
    if (op == ">") return cmp > 0;
    if (op == "<=") return cmp <= 0;
    return cmp >= 0;
}

bool apply_test(const std::string& name, const Value& v, const CallArgs& a) {
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
        return v.is_string() && v.s() == ascii_map(v.s(), [](int c) { return std::tolower(c); });
    if (name == "upper")
        return v.is_string() && v.s() == ascii_map(v.s(), [](int c) { return std::toupper(c); });
    if (name == "even" || name == "odd") {
        if (v.kind != Value::Kind::integer) return false;
        return (v.i % 2 == 0) == (name == "even");
    }
    const Value other = a.get(0, "value");
    if (name == "divisibleby")
        return v.kind == Value::Kind::integer && other.kind == Value::Kind::integer &&
               other.i != 0 && (other.i == -1 || v.i % other.i == 0);
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
        const bool use_default =
            a.get(1, "boolean", Value::boolean(false)).truthy() ? !v.truthy() : v.is_undefined();
        return use_default ? a.get(0, "default_value", Value::string("")) : v;
    }
    if (name == "length" || name == "count") {
        if (v.is_string()) return Value::integer(static_cast<int64_t>(utf8_length(v.s())));
        if (v.is_list()) return Value::integer(static_cast<int64_t>(v.list->size()));
        if (v.is_dict()) return Value::integer(static_cast<int64_t>(v.dict->size()));
        if (v.is_undefined()) return Value::integer(0);
        fail(a.line, "object of type '" + v.type_name() + "' has no length");
    }
    if (name == "safe") return v;
    if (name == "string") return Value::string(to_str(v));
    if (name == "trim") return Value::string(strip_chars(to_str(v), a.get(0, "chars"), true, true));
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
        if (indent.kind == Value::Kind::integer && (indent.i < -1 || indent.i > 1024))
            fail(a.line, "tojson indent " + std::to_string(indent.i) + " is outside [0, 1024]");
        return Value::string(
            to_json(v, indent.kind == Value::Kind::integer ? static_cast<int>(indent.i) : -1,
                    a.get(1, "sort_keys", Value::boolean(false)).truthy()));
    }
    if (name == "int") {
        if (v.kind == Value::Kind::integer) return v;
        if (v.kind == Value::Kind::floating) {
            // int64 holds what a float truncates to only inside (-2^63, 2^63).
            if (!(std::fabs(v.f) < 9.2e18))
                fail(a.line, "int() of " + to_str(v) + " does not fit in 64 bits");
            return Value::integer(static_cast<int64_t>(v.f));
        }
        if (v.kind == Value::Kind::boolean) return Value::integer(v.b);
        if (v.is_string()) {
            try {
                size_t used = 0;
                const long long n =
                    std::stoll(strip_chars(v.s(), Value::undefined(), true, true), &used);
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
                return Value::floating(std::stod(v.s()));
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
        for (const auto& c : items) s += c.s();
        return Value::string(std::move(s));
    }
    if (name == "join") {
        const Value attribute = a.get(1, "attribute");
        std::string out;
        bool first = true;
        const std::string separator = to_str(a.get(0, "d", Value::string("")));
        for (const auto& item : iterate(v, a.line)) {
            if (!first) append_bounded(out, separator);
            first = false;
            append_bounded(
                out, to_str(attribute.is_undefined() ? item
                                                     : get_attr(item, to_str(attribute), a.line)));
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
            charge(1);
            if (!attribute.is_undefined()) {
                const Value got = get_attr(item, to_str(attribute), a.line);
                out.push_back(got.is_undefined() ? a.keyword_or("default") : got);
            } else {
                CallArgs rest;
                rest.line = a.line;
                rest.positional.assign(a.positional.begin() + (a.positional.empty() ? 0 : 1),
                                       a.positional.end());
                if (a.positional.empty()) fail(a.line, "map() needs a filter name or attribute=");
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
            charge(1);
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

}  // namespace minids::jinja
