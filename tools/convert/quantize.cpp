#include "convert/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
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
            // Inline form of mgl::bf16_to_f32 (the top half of an f32; tests compare the two).
            for (size_t i = 0; i < n; ++i) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                uint32_t bits = uint32_t(h) << 16;
                std::memcpy(&out[i], &bits, 4);
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

E4m3Encoder::E4m3Encoder() : table_(size_t(1) << 17) {
    for (uint32_t key = 0; key < (1u << 16); ++key) {
        for (uint32_t sticky = 0; sticky < 2; ++sticky) {
            uint32_t bits = (key << 16) | sticky;
            float f;
            std::memcpy(&f, &bits, 4);
            table_[(key << 1) | sticky] = mgl::f32_to_e4m3(f);
        }
    }
}

const E4m3Encoder& E4m3Encoder::get() {
    static const E4m3Encoder encoder;  // immutable after construction (thread-safe init)
    return encoder;
}

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

int64_t quantize_rows_e4m3(StDtype src_type, const uint8_t* src, int64_t rows, int64_t cols,
                           uint8_t* codes, uint8_t* scales) {
    const E4m3Encoder& enc = E4m3Encoder::get();
    std::vector<float> row(static_cast<size_t>(cols));
    const size_t row_bytes = size_t(cols) * st_dtype_size(src_type);
    for (int64_t r = 0; r < rows; ++r) {
        load_row_f32(src_type, src + size_t(r) * row_bytes, size_t(cols), row.data());
        // |x| orders like the integer (bits & 0x7FFFFFFF) for finite floats, and every NaN or
        // infinity has those bits >= 0x7F800000: one integer max (which vectorizes, unlike a
        // float max chain) gives both the absmax and the finiteness check.
        uint32_t max_bits = 0;
        for (size_t k = 0; k < row.size(); ++k) {
            uint32_t bits;
            std::memcpy(&bits, &row[k], 4);
            max_bits = std::max(max_bits, bits & 0x7FFFFFFFu);
        }
        if (max_bits >= 0x7F800000u) return r;
        float absmax;
        std::memcpy(&absmax, &max_bits, 4);
        float scale = absmax > 0.0f ? absmax / mgl::e4m3_max : 1.0f;
        // A row of tiny subnormals can underflow absmax / 448 to zero; the smallest positive
        // scale still maps every element into range.
        if (scale == 0.0f) scale = std::numeric_limits<float>::denorm_min();
        // Division, not multiplication by 1/scale: the format defines code = e4m3(W / scale).
        uint8_t* out = codes + size_t(r) * size_t(cols);
        for (int64_t k = 0; k < cols; ++k) out[k] = enc(row[size_t(k)] / scale);
        std::memcpy(scales + size_t(r) * 4, &scale, 4);
    }
    return -1;
}

}  // namespace minids::convert
