// JSON as minids reads it from files it does not trust (model manifests, Hugging Face config and
// tokenizer files, safetensors headers): one value, no key twice in any object, and nesting at
// most `max_depth` deep. Deeper input is refused while parsing, before anything that recurses
// (dump, copy, compare) walks it: a 100,000-deep array once overflowed the stack in an error
// message's dump().
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace minids {

// Nesting allowed in the files minids reads (their real depth is below 10).
inline constexpr int json_max_depth = 64;

// What was wrong, as the two halves of "expected X, found Y" (callers add file and field).
struct JsonSyntaxError : std::runtime_error {
    JsonSyntaxError(std::string expected_, std::string found_)
        : std::runtime_error("expected " + expected_ + ", found " + found_),
          expected(std::move(expected_)),
          found(std::move(found_)) {}
    std::string expected, found;
};

// A file that cannot be read, or (read_json_file_strict) is not strict JSON: "PATH: reason".
struct FileReadError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Throws JsonSyntaxError.
nlohmann::json parse_json_strict(std::string_view text, int max_depth = json_max_depth);

// The whole of a file (a pipe or terminal too). Throws FileReadError when it is missing, a
// directory, unreadable or larger than max_bytes.
std::string read_file_bytes(const std::filesystem::path& path, uint64_t max_bytes);

// read_file_bytes + parse_json_strict. Throws FileReadError for either.
nlohmann::json read_json_file_strict(const std::filesystem::path& path,
                                     uint64_t max_bytes = uint64_t{1} << 30);

}  // namespace minids
