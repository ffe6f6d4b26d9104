#include "runtime/npy.h"

#include <stdexcept>
#include <string_view>

#include "util/output_file.h"

namespace minids {

void write_npy_f32(const std::string& path, std::span<const float> values,
                   const std::vector<int64_t>& shape) {
    int64_t n = 1;
    std::string dims;
    for (size_t i = 0; i < shape.size(); ++i) {
        n *= shape[i];
        dims += (i ? ", " : "") + std::to_string(shape[i]);
    }
    if (shape.size() == 1) dims += ",";  // Python's one-element tuple: "(3,)"
    if (n != int64_t(values.size())) {
        throw std::runtime_error("npy: shape does not match the number of values for " + path);
    }
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (" + dims + "), }";
    // The magic (6) + version (2) + length (2) + header, padded with spaces and ended by a
    // newline, is a multiple of 64 bytes (the .npy spec's alignment).
    const size_t unpadded = 10 + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header.push_back('\n');

    const char magic[8] = {'\x93', 'N', 'U', 'M', 'P', 'Y', 1, 0};
    const uint16_t len = uint16_t(header.size());
    const char len_le[2] = {char(len & 0xFF), char(len >> 8)};
    const std::string_view pieces[] = {
        {magic, 8},
        {len_le, 2},
        header,
        {reinterpret_cast<const char*>(values.data()), values.size_bytes()}};
    write_file_atomically(path, pieces);
}

}  // namespace minids
