// The malformed .mds corpus: each case starts from a valid file (tests/mds_test_file.h), breaks
// exactly one thing, and names the field the reader's message must mention. Used by
// tests/test_mds_malformed.cpp and to write the fuzzer's seed corpus (tests/fuzz/corpus/).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "mds_test_file.h"

namespace minids::test {

struct MalformedCase {
    std::string name;  // short, usable as a file name
    // Edits the valid file and returns the bytes to write.
    std::function<std::vector<uint8_t>(MdsTestFile&)> make;
    std::string expect;    // substring of the FileError message (or of a verify problem)
    bool open_ok = false;  // true: open() succeeds and verify() must report `expect`
};

std::vector<MalformedCase> malformed_cases();

}  // namespace minids::test
