// Scalar dtype conversions. Everything is done on bit patterns so results do not depend on the
// floating-point rounding mode or on the compiler's support for _Float16 / __bf16.
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "mgl.h"

namespace mgl {

size_t dtype_size(dtype t) {
    switch (t) {
        case dtype::f32:
            return 4;
        case dtype::f16:
            return 2;
        case dtype::bf16:
            return 2;
        case dtype::f8_e4m3:
            return 1;
        case dtype::i32:
            return 4;
        case dtype::i64:
            return 8;
    }
    fail(__FILE__, __LINE__, "dtype_size: unknown dtype " + std::to_string(int(t)));
}

const char* dtype_name(dtype t) {
    switch (t) {
        case dtype::f32:
            return "f32";
        case dtype::f16:
            return "f16";
        case dtype::bf16:
            return "bf16";
        case dtype::f8_e4m3:
            return "f8_e4m3";
        case dtype::i32:
            return "i32";
        case dtype::i64:
            return "i64";
    }
    return "unknown";
}

bool dtype_from_name(const std::string& name, dtype& out) {
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::f8_e4m3, dtype::i32, dtype::i64}) {
        if (name == dtype_name(t)) {
            out = t;
            return true;
        }
    }
    return false;
}

namespace {

// Round a non-negative float q < 2^24 to the nearest integer, ties to even. Exact: both the
// integer part and the fraction of such a float are representable.
uint32_t round_half_even(float q) {
    auto i = uint32_t(q);
    float frac = q - float(i);
    if (frac > 0.5f || (frac == 0.5f && (i & 1u))) ++i;
    return i;
}

}  // namespace

uint16_t f32_to_bf16(float f) {
    uint32_t bits = std::bit_cast<uint32_t>(f);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x0040u);  // quiet NaN
    // Adding 0x7FFF plus the lowest kept bit rounds to nearest with ties to even; a carry into
    // the exponent is the correct result (including overflow to infinity).
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }

uint16_t f32_to_f16(float f) {
    uint32_t bits = std::bit_cast<uint32_t>(f);
    auto sign = uint16_t((bits >> 16) & 0x8000u);
    uint32_t abs = bits & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((abs >> 13) & 0x3FFu));  // NaN
    if (abs >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to infinity
    if (abs < 0x38800000u) {
        // Below 2^-14: half subnormal, in units of 2^-24. Scaling by 2^24 is exact.
        float q = std::bit_cast<float>(abs) * 16777216.0f;
        return uint16_t(sign | round_half_even(q));  // 0x400 (smallest normal) is correct too
    }
    abs += 0xFFFu + ((abs >> 13) & 1u);
    return uint16_t(sign | ((abs >> 13) - ((127u - 15u) << 10)));
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = uint32_t(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    if (exp == 0x1F) return std::bit_cast<float>(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {
        float v = float(man) * (1.0f / 16777216.0f);  // man · 2^-24, exact
        return sign ? -v : v;
    }
    return std::bit_cast<float>(sign | ((exp + 127u - 15u) << 23) | (man << 13));
}

uint8_t f32_to_e4m3(float f) {
    uint32_t bits = std::bit_cast<uint32_t>(f);
    auto sign = uint8_t((bits >> 24) & 0x80u);
    uint32_t abs = bits & 0x7FFFFFFFu;
    if (abs > 0x7F800000u) return uint8_t(sign | 0x7Fu);  // NaN stays NaN
    float a = std::bit_cast<float>(abs);
    if (a >= e4m3_max) return uint8_t(sign | 0x7Eu);  // saturate (infinity too)
    if (abs < 0x3C800000u) {
        // Below 2^-6: E4M3 subnormal, in units of 2^-9. Rounding up to 8 gives 0x08 = 2^-6.
        return uint8_t(sign | round_half_even(a * 512.0f));
    }
    abs += 0x7FFFFu + ((abs >> 20) & 1u);  // round the 20 dropped mantissa bits, ties to even
    uint32_t code = (abs >> 20) - ((127u - 7u) << 3);
    if (code > 0x7Eu) code = 0x7Eu;  // cannot happen below 448, kept as a guard
    return uint8_t(sign | code);
}

namespace {

constexpr float e4m3_decode(uint8_t v) {
    uint32_t exp = (v >> 3) & 0xFu;
    uint32_t man = v & 0x7u;
    float mag;
    if (exp == 0xF && man == 0x7) {
        mag = std::numeric_limits<float>::quiet_NaN();
    } else if (exp == 0) {
        mag = float(man) * (1.0f / 512.0f);
    } else {
        mag = std::bit_cast<float>(((exp + 127u - 7u) << 23) | (man << 20));
    }
    return (v & 0x80u) ? -mag : mag;
}

// All 256 codes decoded at compile time: the scalar paths (get_rows, reference kernels) look up
// instead of branching per element.
constexpr std::array<float, 256> e4m3_table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[size_t(i)] = e4m3_decode(uint8_t(i));
    return t;
}();

}  // namespace

float e4m3_to_f32(uint8_t v) { return e4m3_table[v]; }

void to_f32(dtype src_type, const void* src, float* dst, size_t n) {
    switch (src_type) {
        case dtype::f32:
            std::memcpy(dst, src, n * sizeof(float));
            return;
        case dtype::f16: {
            auto s = static_cast<const uint16_t*>(src);
            for (size_t i = 0; i < n; ++i) dst[i] = f16_to_f32(s[i]);
            return;
        }
        case dtype::bf16: {
            auto s = static_cast<const uint16_t*>(src);
            for (size_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(s[i]);
            return;
        }
        case dtype::f8_e4m3: {
            auto s = static_cast<const uint8_t*>(src);
            for (size_t i = 0; i < n; ++i) dst[i] = e4m3_to_f32(s[i]);
            return;
        }
        case dtype::i32: {
            auto s = static_cast<const int32_t*>(src);
            for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]);
            return;
        }
        case dtype::i64: {
            auto s = static_cast<const int64_t*>(src);
            for (size_t i = 0; i < n; ++i) dst[i] = float(s[i]);
            return;
        }
    }
    fail(__FILE__, __LINE__, "to_f32: unknown dtype " + std::to_string(int(src_type)));
}

}  // namespace mgl
