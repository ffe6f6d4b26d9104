// minids run: the .npy writer behind --dump-logits, and (below) the built binary on the
// converted fixture.
#include <doctest/doctest.h>

#include <cstring>
#include <fstream>

#include "runtime/npy.h"
#include "test_util.h"

using namespace minids::test;

namespace {

// Parses a version 1.0 .npy of float32: the header dictionary and the values.
bool read_npy_f32(const std::string& path, std::string& header, std::vector<float>& values) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(f)), {});
    if (b.size() < 10 || std::memcmp(b.data(), "\x93NUMPY\x01\x00", 8) != 0) return false;
    const size_t len = size_t(uint8_t(b[8])) | size_t(uint8_t(b[9])) << 8;
    if ((10 + len) % 64 != 0 || b.size() < 10 + len || b[10 + len - 1] != '\n') return false;
    header.assign(b.data() + 10, len);
    values.resize((b.size() - 10 - len) / 4);
    std::memcpy(values.data(), b.data() + 10 + len, values.size() * 4);
    return true;
}

}  // namespace

TEST_CASE("run: .npy writer produces a NumPy 1.0 float32 array") {
    TempDir dir;
    const auto path = (dir.path / "x.npy").string();
    std::vector<float> v = random_floats(3 * 7, 11);
    minids::write_npy_f32(path, v, {3, 7});
    std::string header;
    std::vector<float> back;
    REQUIRE(read_npy_f32(path, header, back));
    CHECK(header.find("'descr': '<f4'") != std::string::npos);
    CHECK(header.find("'fortran_order': False") != std::string::npos);
    CHECK(header.find("'shape': (3, 7)") != std::string::npos);
    CHECK(back == v);
    minids::write_npy_f32(path, std::span(v).first(5), {5});
    REQUIRE(read_npy_f32(path, header, back));
    CHECK(header.find("'shape': (5,)") != std::string::npos);
    CHECK_THROWS(minids::write_npy_f32(path, v, {4, 7}));
    CHECK_THROWS(minids::write_npy_f32((dir.path / "no" / "such" / "dir.npy").string(), v, {21}));
}
