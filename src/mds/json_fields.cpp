#include "mds/json_fields.h"

#include <algorithm>
#include <string>
#include <vector>

#include "mds/manifest.h"
#include "util/strict_json.h"

namespace minids::mds {

using nlohmann::json;

namespace {

const char* json_type_name(const json& v) {
    switch (v.type()) {
        case json::value_t::null:
            return "null";
        case json::value_t::object:
            return "an object";
        case json::value_t::array:
            return "an array";
        case json::value_t::string:
            return "a string";
        case json::value_t::boolean:
            return "a boolean";
        case json::value_t::number_integer:
            return "an integer";
        case json::value_t::number_unsigned:
            return "an integer";
        case json::value_t::number_float:
            return "a non-integer number";
        case json::value_t::binary:
            return "binary data";
        case json::value_t::discarded:
            return "nothing";
    }
    return "an unknown value";
}

}  // namespace

json parse_json_strict(std::string_view text, const std::string& file, const std::string& field) {
    try {
        return minids::parse_json_strict(text, manifest_max_depth);
    } catch (const JsonSyntaxError& e) {
        fail(file, field, e.expected, e.found);
    }
}

std::string describe_json(const json& v) {
    std::string s = json_type_name(v);
    if (v.is_primitive() && !v.is_null()) {
        std::string d = v.dump(-1, ' ', /*ensure_ascii=*/true, json::error_handler_t::replace);
        if (d.size() > 48) d = d.substr(0, 45) + "...";
        s += " (" + d + ")";
    }
    return s;
}

std::string FieldReader::field(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

void FieldReader::fail(const std::string& field, const std::string& expected,
                       const std::string& found) const {
    mds::fail(file_, field, expected, found);
}

void FieldReader::expect_object(const json& v,
                                std::initializer_list<std::string_view> allowed) const {
    if (!v.is_object()) fail(path_.empty() ? "manifest" : path_, "an object", describe_json(v));
    for (auto it = v.begin(); it != v.end(); ++it) {
        if (std::find(allowed.begin(), allowed.end(), it.key()) == allowed.end()) {
            std::string keys;
            for (auto k : allowed) keys += (keys.empty() ? "" : ", ") + std::string(k);
            fail(field(it.key().substr(0, 64)), "only the keys " + keys, "an unknown key");
        }
    }
}

const json& FieldReader::required(const json& obj, std::string_view key) const {
    auto it = obj.find(key);
    if (it == obj.end()) fail(field(key), "a value", "the key missing");
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
    int64_t x = 0;
    if (v.is_number_unsigned()) {
        uint64_t u = v.get<uint64_t>();
        if (u > static_cast<uint64_t>(hi))
            fail(name, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
                 std::to_string(u));
        x = static_cast<int64_t>(u);
    } else if (v.is_number_integer()) {
        x = v.get<int64_t>();
    } else {
        fail(name, "an integer", describe_json(v));
    }
    if (x < lo || x > hi)
        fail(name, "an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]",
             std::to_string(x));
    return x;
}

uint64_t FieldReader::u64(const json& obj, std::string_view key) const {
    return as_u64(required(obj, key), field(key));
}

int64_t FieldReader::i64(const json& obj, std::string_view key, int64_t lo, int64_t hi) const {
    return as_i64(required(obj, key), field(key), lo, hi);
}

const std::string& FieldReader::string(const json& obj, std::string_view key) const {
    const json& v = required(obj, key);
    if (!v.is_string()) fail(field(key), "a string", describe_json(v));
    return v.get_ref<const std::string&>();
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

}  // namespace minids::mds
