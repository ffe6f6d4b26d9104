#include "convert/quantize.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <algorithm>
#include <vector>

#include "mgl.h"

namespace minids::convert {
namespace {

void load_row_f32(StDtype t, const uint8_t* src, size_t n, float* out) {
    switch (t) {
        case StDtype::f32:
            std::memcpy(out, src, n * 4);
            return;
        case StDtype::bf16:
            for (size_t i = 0; i < n; ++i) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                out[i] = mgl::bf16_to_f32(h);
            }
            return;
        case StDtype::f16:
            for (size_t i = 0; i < n; ++i) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                out[i] = mgl::f16_to_f32(h);
            }
            return;
    }
}

}  // namespace

void convert_to_bf16(StDtype src_type, const uint8_t* src, size_t n, uint8_t* dst) {
    if (src_type == StDtype::bf16) {
        std::memcpy(dst, src, n * 2);
        return;
    }
    constexpr size_t chunk = 4096;
    float buf[chunk];
    for (size_t i = 0; i < n; i += chunk) {
        size_t m = std::min(chunk, n - i);
        load_row_f32(src_type, src + i * st_dtype_size(src_type), m, buf);
        for (size_t k = 0; k < m; ++k) {
            uint16_t h = mgl::f32_to_bf16(buf[k]);
            std::memcpy(dst + 2 * (i + k), &h, 2);
        }
    }
}

int64_t quantize_rows_e4m3(StDtype src_type, const uint8_t* src, int64_t rows, int64_t cols, uint8_t* codes,
                           uint8_t* scales) {
    std::vector<float> row(static_cast<size_t>(cols));
    const size_t row_bytes = size_t(cols) * st_dtype_size(src_type);
    for (int64_t r = 0; r < rows; ++r) {
        load_row_f32(src_type, src + size_t(r) * row_bytes, size_t(cols), row.data());
        float absmax = 0.0f;
        for (float v : row) absmax = std::max(absmax, std::fabs(v));  // NaN compares false: caught below
        for (float v : row)
            if (!std::isfinite(v)) return r;
        float scale = absmax > 0.0f ? absmax / mgl::e4m3_max : 1.0f;
        // A row of tiny subnormals can underflow absmax / 448 to zero; the smallest positive
        // scale still maps every element into range.
        if (scale == 0.0f) scale = std::numeric_limits<float>::denorm_min();
        // Division, not multiplication by 1/scale: the format defines code = e4m3(W / scale).
        uint8_t* out = codes + size_t(r) * size_t(cols);
        for (int64_t k = 0; k < cols; ++k) out[k] = mgl::f32_to_e4m3(row[size_t(k)] / scale);
        std::memcpy(scales + size_t(r) * 4, &scale, 4);
    }
    return -1;
}

}  // namespace minids::convert
