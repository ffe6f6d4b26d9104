// Writing a float32 array as a NumPy .npy file (format version 1.0), for --dump-logits.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace minids {

// Writes `values` (row-major, product of `shape` elements) to `path`, through PATH.tmp and a
// rename (util/output_file.h). Throws OutputError with the path and the reason when the file
// cannot be written (nothing is left behind), std::runtime_error when the shape is wrong.
void write_npy_f32(const std::string& path, std::span<const float> values,
                   const std::vector<int64_t>& shape);

}  // namespace minids
