// Internal to src/mds: strict JSON reading for the manifest. Parsing rejects duplicate keys at any
// level and absurd nesting; the accessors check each field's type and report the failing field by
// its full path ("tensors[3].shape[1]") so every message names exactly what was wrong.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace minids::mds {

// Deepest nesting the manifest may use (its real depth is 4); deeper input is refused while
// parsing, before anything recursive walks it.
inline constexpr int manifest_max_depth = 16;

// Parses `text` as one JSON value; throws FileError naming `field` on syntax errors, duplicate
// keys or nesting beyond manifest_max_depth.
nlohmann::json parse_json_strict(std::string_view text, const std::string& file,
                                 const std::string& field);

// A short, printable description of a value for "found ...": its type and a truncated dump.
std::string describe_json(const nlohmann::json& v);

// Typed access to the fields of one JSON object, each failure one FileError naming
// "<file>: <path>.<key>".
class FieldReader {
public:
    FieldReader(const std::string& file, std::string path) : file_(file), path_(std::move(path)) {}

    const std::string& path() const { return path_; }
    const std::string& file_name() const { return file_; }
    std::string field(std::string_view key) const;

    [[noreturn]] void fail(const std::string& field, const std::string& expected,
                           const std::string& found) const;

    // `v` must be an object whose keys are all in `allowed`.
    void expect_object(const nlohmann::json& v,
                       std::initializer_list<std::string_view> allowed) const;
    // Member access on an object already checked with expect_object.
    const nlohmann::json& required(const nlohmann::json& obj, std::string_view key) const;
    // Null when absent.
    const nlohmann::json* optional(const nlohmann::json& obj, std::string_view key) const;

    uint64_t u64(const nlohmann::json& obj, std::string_view key) const;
    // An integer in [lo, hi].
    int64_t i64(const nlohmann::json& obj, std::string_view key, int64_t lo, int64_t hi) const;
    const std::string& string(const nlohmann::json& obj, std::string_view key) const;
    const nlohmann::json& array(const nlohmann::json& obj, std::string_view key) const;
    const nlohmann::json& object(const nlohmann::json& obj, std::string_view key) const;
    // 16 lower-case hex digits.
    uint64_t hex64(const nlohmann::json& obj, std::string_view key) const;

    // Same checks on a bare value named `name` (an array element).
    uint64_t as_u64(const nlohmann::json& v, const std::string& name) const;
    int64_t as_i64(const nlohmann::json& v, const std::string& name, int64_t lo, int64_t hi) const;

private:
    const std::string& file_;
    std::string path_;
};

}  // namespace minids::mds
