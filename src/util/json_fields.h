// Strict, typed reading of JSON objects from files minids does not trust: the .mds manifest
// (src/mds), the manifest's "config" (src/model/config.cpp) and "tokenizer" objects
// (src/tokenizer/tokenizer_data.cpp). Every failure is one line, "<source>: <field>: expected X,
// found Y", thrown as the caller's own error type, and every value is described the same way
// (describe_json). Parse the text with parse_json_strict (util/strict_json.h) first.
//
//     FieldReader r("model.mds", "tensors[3]", throw_as<FileError>);
//     r.expect_object(t, {"name", "shape"});
//     int64_t n = r.i64(t, "n", 1, 1 << 20);    // "model.mds: tensors[3].n: expected ..."
#pragma once

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace minids {

// A value for "found ...": its type and, for a scalar, the value (truncated): `string "64"`,
// `integer 5`, `number 24.5`, `boolean true`, `null`, `array`, `object`.
std::string describe_json(const nlohmann::json& v);

// Throws E(message): the failure function for a FieldReader whose errors are E.
template <class E>
[[noreturn]] void throw_as(const std::string& message) {
    throw E(message);
}

class FieldReader {
public:
    // How a field is named in messages: path style ("tensors[3].shape", the manifest's tables),
    // or the key in quotes ("added_tokens[0].\"lstrip\"", the config and tokenizer objects).
    enum class Naming { path, quoted };
    using FailFn = void (*)(const std::string& message);  // must throw

    FieldReader(std::string source, std::string path, FailFn fail, Naming naming = Naming::path)
        : source_(std::move(source)), path_(std::move(path)), fail_(fail), naming_(naming) {}

    const std::string& path() const { return path_; }
    const std::string& source() const { return source_; }
    // The reader of an object nested at `key` (or at `[index]` of an array field).
    FieldReader nested(std::string_view key) const;
    FieldReader nested(std::string_view key, size_t index) const;
    // How `key` of this object is named in messages.
    std::string field(std::string_view key) const;

    // "<source>: <field>: expected <expected>, found <found>", control bytes replaced.
    [[noreturn]] void fail(const std::string& field, const std::string& expected,
                           const std::string& found) const;

    // `v` must be an object whose keys are all in `allowed` ("unknown field ..." otherwise).
    void expect_object(const nlohmann::json& v,
                       std::initializer_list<std::string_view> allowed) const;
    // Member access on an object already checked with expect_object ("... is missing").
    const nlohmann::json& required(const nlohmann::json& obj, std::string_view key) const;
    // Null when absent.
    const nlohmann::json* optional(const nlohmann::json& obj, std::string_view key) const;

    uint64_t u64(const nlohmann::json& obj, std::string_view key) const;
    // An integer in [lo, hi].
    int64_t i64(const nlohmann::json& obj, std::string_view key, int64_t lo = INT64_MIN,
                int64_t hi = INT64_MAX) const;
    // An integer in [lo, hi], or null.
    std::optional<int64_t> i64_or_null(const nlohmann::json& obj, std::string_view key,
                                       int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) const;
    double number(const nlohmann::json& obj, std::string_view key) const;
    bool boolean(const nlohmann::json& obj, std::string_view key) const;
    const std::string& string(const nlohmann::json& obj, std::string_view key) const;
    const nlohmann::json& array(const nlohmann::json& obj, std::string_view key) const;
    const nlohmann::json& object(const nlohmann::json& obj, std::string_view key) const;
    // 16 lower-case hex digits.
    uint64_t hex64(const nlohmann::json& obj, std::string_view key) const;

    // Same checks on a bare value named `name` (an array element).
    uint64_t as_u64(const nlohmann::json& v, const std::string& name) const;
    int64_t as_i64(const nlohmann::json& v, const std::string& name, int64_t lo = INT64_MIN,
                   int64_t hi = INT64_MAX) const;
    const std::string& as_string(const nlohmann::json& v, const std::string& name) const;

private:
    std::string source_;
    std::string path_;
    FailFn fail_;
    Naming naming_;
};

}  // namespace minids
