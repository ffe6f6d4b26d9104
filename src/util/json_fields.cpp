#include "util/json_fields.h"

#include <algorithm>
#include <stdexcept>

namespace minids {

using nlohmann::json;

std::string describe_json(const json& v) {
    switch (v.type()) {
        case json::value_t::null:
            return "null";
        case json::value_t::object:
            return "object";
        case json::value_t::array:
            return "array";
        case json::value_t::discarded:
            return "nothing";
        default:
            break;
    }
    const char* type = v.is_string()           ? "string"
                       : v.is_boolean()        ? "boolean"
                       : v.is_number_integer() ? "integer"
                                               : "number";
    std::string d = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
    if (d.size() > 48) d = d.substr(0, 45) + "...";
    return std::string(type) + " " + d;
}

FieldReader FieldReader::nested(std::string_view key) const {
    const std::string k(key);
    return FieldReader(source_, path_.empty() ? k : path_ + "." + k, fail_, naming_);
}

FieldReader FieldReader::nested(std::string_view key, size_t index) const {
    return FieldReader(source_, nested(key).path_ + "[" + std::to_string(index) + "]", fail_,
                       naming_);
}

std::string FieldReader::field(std::string_view key) const {
    const std::string k(key.substr(0, 64));
    if (naming_ == Naming::quoted) return (path_.empty() ? "" : path_ + ".") + "\"" + k + "\"";
    return path_.empty() ? k : path_ + "." + k;
}

void FieldReader::fail(const std::string& field, const std::string& expected,
                       const std::string& found) const {
    std::string msg = source_ + ": " + field + ": expected " + expected + ", found " + found;
    // Names and keys come from the file: keep control bytes out of the terminal.
    for (char& ch : msg)
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
    fail_(msg);
    throw std::logic_error(msg);  // a FailFn that returned
}

void FieldReader::expect_object(const json& v,
                                std::initializer_list<std::string_view> allowed) const {
    const std::string where = path_.empty() ? "the top level" : path_;
    if (!v.is_object()) fail(where, "an object", describe_json(v));
    for (auto it = v.begin(); it != v.end(); ++it) {
        if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
            std::string keys;
            for (auto k : allowed) keys += (keys.empty() ? "" : ", ") + std::string(k);
            fail(field(it.key()), "only the fields " + keys,
                 "unknown field \"" + it.key().substr(0, 64) + "\"");
        }
    }
}

const json& FieldReader::required(const json& obj, std::string_view key) const {
    auto it = obj.find(key);
    if (it == obj.end()) {
        std::string msg = source_ + ": " + field(key) + " is missing: expected a value, found none";
        fail_(msg);
        throw std::logic_error(msg);
    }
    return *it;
}

const json* FieldReader::optional(const json& obj, std::string_view key) const {
    auto it = obj.find(key);
    return it == obj.end() ? nullptr : &*it;
}

uint64_t FieldReader::as_u64(const json& v, const std::string& name) const {
    if (v.is_number_unsigned()) return v.get<uint64_t>();
    fail(name, "a non-negative integer", describe_json(v));
}

int64_t FieldReader::as_i64(const json& v, const std::string& name, int64_t lo, int64_t hi) const {
    const std::string range =
        lo == INT64_MIN && hi == INT64_MAX
            ? "an integer"
            : "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]";
    int64_t x = 0;
    if (v.is_number_unsigned()) {
        const uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(hi)) fail(name, range, std::to_string(u));
        x = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
        x = v.get<int64_t>();
    } else {
        fail(name, "an integer", describe_json(v));
    }
    if (x < lo || x > hi) fail(name, range, std::to_string(x));
    return x;
}

const std::string& FieldReader::as_string(const json& v, const std::string& name) const {
    if (!v.is_string()) fail(name, "a string", describe_json(v));
    return v.get_ref<const std::string&>();
}

uint64_t FieldReader::u64(const json& obj, std::string_view key) const {
    return as_u64(required(obj, key), field(key));
}

int64_t FieldReader::i64(const json& obj, std::string_view key, int64_t lo, int64_t hi) const {
    return as_i64(required(obj, key), field(key), lo, hi);
}

std::optional<int64_t> FieldReader::i64_or_null(const json& obj, std::string_view key, int64_t lo,
                                                int64_t hi) const {
    const json& v = required(obj, key);
    if (v.is_null()) return std::nullopt;
    return as_i64(v, field(key), lo, hi);
}

double FieldReader::number(const json& obj, std::string_view key) const {
    const json& v = required(obj, key);
    if (!v.is_number()) fail(field(key), "a number", describe_json(v));
    return v.get<double>();
}

bool FieldReader::boolean(const json& obj, std::string_view key) const {
    const json& v = required(obj, key);
    if (!v.is_boolean()) fail(field(key), "true or false", describe_json(v));
    return v.get<bool>();
}

const std::string& FieldReader::string(const json& obj, std::string_view key) const {
    return as_string(required(obj, key), field(key));
}

const json& FieldReader::array(const json& obj, std::string_view key) const {
    const json& v = required(obj, key);
    if (!v.is_array()) fail(field(key), "an array", describe_json(v));
    return v;
}

const json& FieldReader::object(const json& obj, std::string_view key) const {
    const json& v = required(obj, key);
    if (!v.is_object()) fail(field(key), "an object", describe_json(v));
    return v;
}

uint64_t FieldReader::hex64(const json& obj, std::string_view key) const {
    const std::string& s = string(obj, key);
    uint64_t x = 0;
    bool ok = s.size() == 16;
    for (char c : s) {
        if (!ok) break;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) ok = false;
        x = (x << 4) | static_cast<uint64_t>(d < 0 ? 0 : d);
    }
    if (!ok) fail(field(key), "16 lower-case hex digits", describe_json(required(obj, key)));
    return x;
}

}  // namespace minids
