// Reading the float32 .npy files minids writes (--dump-logits, --dump-tensors) back in tests.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace minids::test {

struct NpyF32 {
    std::string header;          // the header dictionary, e.g. "{'descr': '<f4', ...}"
    std::vector<int64_t> shape;  // from the header's 'shape' tuple
    std::vector<float> values;   // C order
};

// Parses a version 1.0 .npy of float32; false when the file is not one (bad magic, header not
// padded to 64 bytes or not ending in a newline, no shape).
inline bool read_npy_f32(const std::string& path, NpyF32& out) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(f)), {});
    if (b.size() < 10 || std::memcmp(b.data(), "\x93NUMPY\x01\x00", 8) != 0) return false;
    const size_t len = size_t(uint8_t(b[8])) | size_t(uint8_t(b[9])) << 8;
    if ((10 + len) % 64 != 0 || b.size() < 10 + len || b[10 + len - 1] != '\n') return false;
    out.header.assign(b.data() + 10, len);
    const size_t open = out.header.find("'shape': (");
    const size_t close = out.header.find(')', open);
    if (open == std::string::npos || close == std::string::npos) return false;
    out.shape.clear();
    const std::string dims = out.header.substr(open + 10, close - open - 10);
    for (size_t p = 0; p < dims.size();) {
        size_t q = dims.find(',', p);
        if (q == std::string::npos) q = dims.size();
        if (dims.find_first_not_of(' ', p) < q)
            out.shape.push_back(std::stoll(dims.substr(p, q - p)));
        p = q + 1;
    }
    out.values.resize((b.size() - 10 - len) / 4);
    std::memcpy(out.values.data(), b.data() + 10 + len, out.values.size() * 4);
    return true;
}

}  // namespace minids::test
