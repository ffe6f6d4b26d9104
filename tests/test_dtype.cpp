// Scalar dtype conversions against references computed independently in double precision.
#include <doctest/doctest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "mgl.h"

namespace {

// E4M3 value straight from the OCP spec's definition (bias 7, 0x7F/0xFF NaN).
double e4m3_reference(uint8_t v) {
    int exp = (v >> 3) & 0xF, man = v & 7;
    if (exp == 15 && man == 7) return std::nan("");
    double mag = exp == 0 ? std::ldexp(man / 8.0, -6) : std::ldexp(1.0 + man / 8.0, exp - 7);
    return (v & 0x80) ? -mag : mag;
}

// Nearest representable value with ties to the even code, by search over the sorted positive
// finite codes of a format. `codes` holds (value, code) pairs, ascending.
struct code_table {
    std::vector<std::pair<double, uint32_t>> codes;
    uint32_t nearest(double a) const {  // a >= 0 and not above the largest value
        auto it = std::lower_bound(codes.begin(), codes.end(), std::make_pair(a, 0u));
        if (it == codes.end()) return codes.back().second;
        if (it == codes.begin() || it->first == a) return it->second;
        auto lo = std::prev(it);
        double dlo = a - lo->first, dhi = it->first - a;
        if (dlo < dhi) return lo->second;
        if (dhi < dlo) return it->second;
        return (lo->second & 1u) == 0 ? lo->second : it->second;
    }
};

code_table e4m3_table() {
    code_table t;
    for (uint32_t c = 0; c < 0x7F; ++c) t.codes.emplace_back(e4m3_reference(uint8_t(c)), c);
    return t;
}

template <class Decode>
code_table table_16(Decode decode, uint32_t first_inf) {
    code_table t;
    for (uint32_t c = 0; c < first_inf; ++c) t.codes.emplace_back(double(decode(uint16_t(c))), c);
    return t;
}

// Random floats spread over many binades, including exact ties between neighbours.
std::vector<float> spread_floats(size_t n, uint64_t seed, int min_exp, int max_exp) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> mant(1.0, 2.0);
    std::uniform_int_distribution<int> ex(min_exp, max_exp);
    std::vector<float> v(n);
    for (auto& x : v) x = float(std::ldexp(mant(rng), ex(rng)));
    return v;
}

}  // namespace

TEST_CASE("dtype: sizes and names round-trip") {
    using mgl::dtype;
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::f8_e4m3, dtype::i32}) {
        dtype back{};
        REQUIRE(mgl::dtype_from_name(mgl::dtype_name(t), back));
        CHECK(back == t);
    }
    CHECK(mgl::dtype_size(dtype::f32) == 4);
    CHECK(mgl::dtype_size(dtype::f16) == 2);
    CHECK(mgl::dtype_size(dtype::bf16) == 2);
    CHECK(mgl::dtype_size(dtype::f8_e4m3) == 1);
    CHECK(mgl::dtype_size(dtype::i32) == 4);
    dtype out = dtype::i32;
    CHECK_FALSE(mgl::dtype_from_name("float8", out));
    CHECK(out == dtype::i32);
}

TEST_CASE("dtype: all 256 E4M3 codes decode per the OCP spec and re-encode to themselves") {
    int n_nan = 0;
    for (uint32_t c = 0; c < 256; ++c) {
        auto code = uint8_t(c);
        double want = e4m3_reference(code);
        float got = mgl::e4m3_to_f32(code);
        if (std::isnan(want)) {
            CHECK(std::isnan(got));
            CHECK(std::isnan(mgl::e4m3_to_f32(mgl::f32_to_e4m3(got))));
            ++n_nan;
            continue;
        }
        CHECK(double(got) == want);
        if (code == 0x80) {
            CHECK(mgl::f32_to_e4m3(got) == 0x80);  // -0 keeps its sign
        } else {
            CHECK(int(mgl::f32_to_e4m3(got)) == int(code));
        }
    }
    CHECK(n_nan == 2);
    CHECK(mgl::e4m3_to_f32(0x7E) == 448.0f);
    CHECK(mgl::e4m3_to_f32(0x01) == std::ldexp(1.0f, -9));
}

TEST_CASE("dtype: E4M3 rounding ties to even, saturation, NaN, subnormals") {
    // 1 + 1/16 lies halfway between 1 (code 0x38, even) and 1.125 (0x39): goes to 1.
    CHECK(mgl::f32_to_e4m3(1.0625f) == 0x38);
    // 1.1875 lies halfway between 1.125 (0x39) and 1.25 (0x3A, even): goes to 1.25.
    CHECK(mgl::f32_to_e4m3(1.1875f) == 0x3A);
    CHECK(mgl::f32_to_e4m3(1.0626f) == 0x39);
    // Subnormal ties: 1.5·2^-9 -> 2·2^-9 (even), 2.5·2^-9 -> 2·2^-9, 0.5·2^-9 -> 0.
    CHECK(mgl::f32_to_e4m3(std::ldexp(1.5f, -9)) == 0x02);
    CHECK(mgl::f32_to_e4m3(std::ldexp(2.5f, -9)) == 0x02);
    CHECK(mgl::f32_to_e4m3(std::ldexp(0.5f, -9)) == 0x00);
    CHECK(mgl::f32_to_e4m3(std::ldexp(0.51f, -9)) == 0x01);
    // 7.5·2^-9 rounds (tie, 7 odd) up to 8·2^-9 = 2^-6, the smallest normal.
    CHECK(mgl::f32_to_e4m3(std::ldexp(7.5f, -9)) == 0x08);
    CHECK(mgl::f32_to_e4m3(-std::ldexp(3.0f, -9)) == 0x83);
    // Saturation: anything at or beyond 448 in magnitude, infinities included.
    CHECK(mgl::f32_to_e4m3(448.0f) == 0x7E);
    CHECK(mgl::f32_to_e4m3(460.0f) == 0x7E);
    CHECK(mgl::f32_to_e4m3(1e9f) == 0x7E);
    CHECK(mgl::f32_to_e4m3(-1e9f) == 0xFE);
    CHECK(mgl::f32_to_e4m3(std::numeric_limits<float>::infinity()) == 0x7E);
    CHECK(mgl::f32_to_e4m3(-std::numeric_limits<float>::infinity()) == 0xFE);
    // 416 is halfway between 384 (0x7C, even) and 448 (0x7E... 0x7D = 416 exactly) -> exact.
    CHECK(mgl::f32_to_e4m3(416.0f) == 0x7D);
    CHECK(mgl::f32_to_e4m3(432.0f) == 0x7E);  // tie 416|448: 0x7E is even
    CHECK(mgl::f32_to_e4m3(400.0f) == 0x7C);  // tie 384|416: 0x7C is even
    uint8_t nan_code = mgl::f32_to_e4m3(std::numeric_limits<float>::quiet_NaN());
    CHECK((nan_code & 0x7F) == 0x7F);
    CHECK(std::isnan(mgl::e4m3_to_f32(nan_code)));
    CHECK(mgl::f32_to_e4m3(0.0f) == 0x00);
    CHECK(mgl::f32_to_e4m3(std::ldexp(1.0f, -12)) == 0x00);  // far below the smallest subnormal
}

TEST_CASE("dtype: E4M3 encoding matches a nearest-even search on random values") {
    code_table table = e4m3_table();
    auto values = spread_floats(20000, 11, -12, 8);
    // Exact midpoints between neighbouring codes are the interesting cases.
    for (size_t i = 0; i + 1 < table.codes.size(); ++i)
        values.push_back(float((table.codes[i].first + table.codes[i + 1].first) / 2));
    for (float v : values) {
        for (float s : {v, -v}) {
            double a = std::fabs(double(s));
            uint32_t want = a >= 448.0 ? 0x7Eu : table.nearest(a);
            if (s < 0) want |= 0x80u;
            uint8_t got = mgl::f32_to_e4m3(s);
            if (got != want) {
                CAPTURE(s);
                CHECK(int(got) == int(want));
            }
        }
    }
}

TEST_CASE("dtype: BF16 rounds to nearest even, keeps NaN and infinities") {
    // 1 + 2^-8 is halfway between 1 (mantissa even) and 1 + 2^-7: goes to 1.
    CHECK(mgl::f32_to_bf16(1.0f + std::ldexp(1.0f, -8)) == 0x3F80);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even): goes up.
    CHECK(mgl::f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)) == 0x3F82);
    CHECK(mgl::f32_to_bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)) == 0x3F81);
    CHECK(mgl::f32_to_bf16(-2.0f) == 0xC000);
    CHECK(mgl::f32_to_bf16(std::numeric_limits<float>::infinity()) == 0x7F80);
    CHECK(mgl::f32_to_bf16(std::numeric_limits<float>::max()) == 0x7F80);     // rounds to infinity
    uint16_t nan_bits = mgl::f32_to_bf16(std::bit_cast<float>(0x7F800001u));  // signalling, low bit
    CHECK(std::isnan(mgl::bf16_to_f32(nan_bits)));
    // Subnormal floats keep their top bits: 2^-130 is exactly representable in bf16.
    CHECK(mgl::bf16_to_f32(mgl::f32_to_bf16(std::ldexp(1.0f, -130))) == std::ldexp(1.0f, -130));

    code_table table = table_16(mgl::bf16_to_f32, 0x7F80);
    for (float v : spread_floats(20000, 12, -133, 120)) {
        for (float s : {v, -v}) {
            uint32_t want = table.nearest(std::fabs(double(s))) | (s < 0 ? 0x8000u : 0u);
            uint16_t got = mgl::f32_to_bf16(s);
            if (got != want) {
                CAPTURE(s);
                CHECK(got == want);
            }
        }
    }
    for (uint32_t c = 0; c < 0x7F80; c += 7)
        CHECK(mgl::f32_to_bf16(mgl::bf16_to_f32(uint16_t(c))) == c);
}

TEST_CASE("dtype: F16 rounds to nearest even, subnormals, overflow to infinity") {
    CHECK(mgl::f32_to_f16(1.0f) == 0x3C00);
    CHECK(mgl::f32_to_f16(65504.0f) == 0x7BFF);
    CHECK(mgl::f32_to_f16(65519.0f) == 0x7BFF);
    CHECK(mgl::f32_to_f16(65520.0f) == 0x7C00);  // the tie above max rounds to infinity
    CHECK(mgl::f32_to_f16(-1e6f) == 0xFC00);
    CHECK(mgl::f32_to_f16(std::ldexp(1.0f, -24)) == 0x0001);
    CHECK(mgl::f32_to_f16(std::ldexp(1.0f, -25)) == 0x0000);         // tie -> even (0)
    CHECK(mgl::f32_to_f16(std::ldexp(3.0f, -25)) == 0x0002);         // tie 1|2 -> 2
    CHECK(mgl::f32_to_f16(1.0f + std::ldexp(1.0f, -11)) == 0x3C00);  // tie -> even
    CHECK(mgl::f32_to_f16(1.0f + std::ldexp(3.0f, -11)) == 0x3C02);
    CHECK(std::isnan(mgl::f16_to_f32(mgl::f32_to_f16(std::numeric_limits<float>::quiet_NaN()))));
    CHECK(mgl::f16_to_f32(0x0001) == std::ldexp(1.0f, -24));
    CHECK(mgl::f16_to_f32(0x8400) == -std::ldexp(1.0f, -14));

    code_table table = table_16(mgl::f16_to_f32, 0x7C00);
    for (float v : spread_floats(20000, 13, -26, 15)) {
        if (v >= 65504.0f) continue;
        for (float s : {v, -v}) {
            uint32_t want = table.nearest(std::fabs(double(s))) | (s < 0 ? 0x8000u : 0u);
            uint16_t got = mgl::f32_to_f16(s);
            if (got != want) {
                CAPTURE(s);
                CHECK(got == want);
            }
        }
    }
    for (uint32_t c = 0; c < 0x7C00; ++c) {
        if (mgl::f32_to_f16(mgl::f16_to_f32(uint16_t(c))) != c) {
            CAPTURE(c);
            CHECK(false);
        }
    }
}

TEST_CASE("dtype: to_f32 converts every dtype") {
    std::vector<uint16_t> bf = {mgl::f32_to_bf16(1.5f), mgl::f32_to_bf16(-0.375f)};
    std::vector<uint16_t> hf = {mgl::f32_to_f16(2.25f), mgl::f32_to_f16(-7.0f)};
    std::vector<uint8_t> f8 = {0x38, 0xC4};
    std::vector<int32_t> ints = {-3, 17};
    std::vector<float> f = {0.1f, -9.5f};
    float out[2];
    mgl::to_f32(mgl::dtype::bf16, bf.data(), out, 2);
    CHECK(out[0] == 1.5f);
    CHECK(out[1] == -0.375f);
    mgl::to_f32(mgl::dtype::f16, hf.data(), out, 2);
    CHECK(out[0] == 2.25f);
    CHECK(out[1] == -7.0f);
    mgl::to_f32(mgl::dtype::f8_e4m3, f8.data(), out, 2);
    CHECK(out[0] == 1.0f);
    CHECK(out[1] == -3.0f);  // 0xC4: sign, exp 8, man 4 -> -(1.5·2)
    mgl::to_f32(mgl::dtype::i32, ints.data(), out, 2);
    CHECK(out[0] == -3.0f);
    CHECK(out[1] == 17.0f);
    mgl::to_f32(mgl::dtype::f32, f.data(), out, 2);
    CHECK(out[0] == 0.1f);
    CHECK(out[1] == -9.5f);
}
