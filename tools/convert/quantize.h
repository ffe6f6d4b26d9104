// Element conversions for the converter: checkpoint dtypes to BF16 for dense tensors, and rows to
// FP8 E4M3 with one F32 scale per output row for routed experts (src/mds/format.h):
//   scale[n] = max_k |W[n, k]| / 448 (1 for an all-zero row),  code[n, k] = e4m3(W[n, k] /
//   scale[n]).
// Sources may be unaligned (safetensors data starts at 8 + header length): loads use memcpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "convert/safetensors.h"

namespace minids::convert {

// n elements of `src_type` -> BF16 (BF16 is copied bit for bit; F32 and F16 round to nearest even).
void convert_to_bf16(StDtype src_type, const uint8_t* src, size_t n, uint8_t* dst);

// One [rows, cols] matrix to E4M3 codes (rows × cols bytes) and F32 row scales (rows × 4 bytes,
// written with memcpy so `scales` may be unaligned). Returns -1, or the first row holding a
// non-finite value (which has no meaningful scale; the caller refuses the checkpoint).
int64_t quantize_rows_e4m3(StDtype src_type, const uint8_t* src, int64_t rows, int64_t cols,
                           uint8_t* codes, uint8_t* scales);

// mgl::f32_to_e4m3 as a table lookup, bit-identical for every float: round-to-nearest-even to
// E4M3 depends only on the top 16 bits of the f32 (sign, exponent, 7 mantissa bits: the round
// bit and the kept bits of every E4M3 rounding position lie there) and on whether any of the low
// 16 bits is set (sticky). So a table over those 2^17 classes, filled by calling mgl on one member
// of each class, reproduces mgl exactly (the tests compare them).
class E4m3Encoder {
public:
    E4m3Encoder();
    uint8_t operator()(float f) const {
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        return table_[((bits >> 16) << 1) | uint32_t((bits & 0xFFFFu) != 0)];
    }
    static const E4m3Encoder& get();  // built once, immutable

private:
    std::vector<uint8_t> table_;
};

}  // namespace minids::convert
