// The converter's element conversions against mgl's scalar ones and a naive reference.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include <doctest/doctest.h>

#include "convert/quantize.h"
#include "mgl.h"
#include "test_util.h"

using namespace minids;
using namespace minids::convert;

namespace {

float from_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, 4);
    return f;
}

bool same_code(uint8_t a, uint8_t b) {
    // Both NaN codes (0x7F / 0xFF) count as equal only to themselves.
    return a == b;
}

}  // namespace

TEST_CASE("quantize: the E4M3 table encoder is bit-identical to mgl::f32_to_e4m3") {
    const E4m3Encoder& enc = E4m3Encoder::get();
    size_t mismatches = 0;
    // Every class boundary: each top-16-bit key with low bits 0, 1, 0x8000 and 0xFFFF.
    for (uint32_t key = 0; key < (1u << 16); ++key) {
        for (uint32_t low : {0u, 1u, 0x8000u, 0xFFFFu}) {
            float f = from_bits((key << 16) | low);
            mismatches += !same_code(enc(f), mgl::f32_to_e4m3(f));
        }
    }
    // Random bit patterns and random values in E4M3's range (ties and subnormals included).
    std::mt19937_64 rng(20261129);
    for (int i = 0; i < 1000000; ++i) {
        float f = from_bits(uint32_t(rng()));
        mismatches += !same_code(enc(f), mgl::f32_to_e4m3(f));
        float g =
            std::ldexp(float(int(rng() % 2000001) - 1000000) / 1000000.0f, int(rng() % 26) - 16);
        mismatches += !same_code(enc(g), mgl::f32_to_e4m3(g));
    }
    for (float f :
         {0.0f, -0.0f, 448.0f, 464.0f, 480.0f, -1e30f, std::ldexp(1.0f, -10), std::ldexp(3.0f, -10),
          std::ldexp(1.0f, -6), std::numeric_limits<float>::infinity(),
          std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::denorm_min()})
        mismatches += !same_code(enc(f), mgl::f32_to_e4m3(f));
    CHECK(mismatches == 0);
}

TEST_CASE("quantize: rows to E4M3 match the naive definition for BF16, F16 and F32 sources") {
    const int64_t rows = 7, cols = 37;  // odd sizes
    auto vals = test::random_floats(size_t(rows * cols), 99, -3.0f, 3.0f);
    for (int64_t k = 0; k < cols; ++k) vals[size_t(3 * cols + k)] = 0.0f;     // an all-zero row
    for (int64_t k = 0; k < cols; ++k) vals[size_t(5 * cols + k)] *= 1e-39f;  // subnormal row
    for (StDtype t : {StDtype::bf16, StDtype::f16, StDtype::f32}) {
        CAPTURE(st_dtype_name(t));
        const size_t es = st_dtype_size(t);
        std::vector<uint8_t> src(size_t(rows * cols) * es + 1);  // +1: feed an unaligned pointer
        std::vector<float> exact(size_t(rows * cols));
        for (size_t i = 0; i < exact.size(); ++i) {
            if (t == StDtype::f32) {
                exact[i] = vals[i];
                std::memcpy(&src[1 + 4 * i], &vals[i], 4);
            } else {
                uint16_t h =
                    t == StDtype::bf16 ? mgl::f32_to_bf16(vals[i]) : mgl::f32_to_f16(vals[i]);
                exact[i] = t == StDtype::bf16 ? mgl::bf16_to_f32(h) : mgl::f16_to_f32(h);
                std::memcpy(&src[1 + 2 * i], &h, 2);
            }
        }
        std::vector<uint8_t> codes(size_t(rows * cols)), scales(size_t(rows) * 4 + 1);
        CHECK(quantize_rows_e4m3(t, src.data() + 1, rows, cols, codes.data(), scales.data() + 1) ==
              -1);
        for (int64_t r = 0; r < rows; ++r) {
            float absmax = 0;
            for (int64_t k = 0; k < cols; ++k)
                absmax = std::max(absmax, std::fabs(exact[size_t(r * cols + k)]));
            float want_scale = absmax > 0 ? absmax / 448.0f : 1.0f;
            if (want_scale == 0.0f) want_scale = std::numeric_limits<float>::denorm_min();
            float scale;
            std::memcpy(&scale, &scales[1 + size_t(4 * r)], 4);
            CHECK(scale == want_scale);
            for (int64_t k = 0; k < cols; ++k)
                REQUIRE(codes[size_t(r * cols + k)] ==
                        mgl::f32_to_e4m3(exact[size_t(r * cols + k)] / want_scale));
        }
        CHECK(scales[1 + 4 * 3] == 0);  // the zero row's scale is 1.0f = 0x3F800000
        // The row's largest element maps to ±448 (code 0x7E / 0xFE).
        int hits = 0;
        for (int64_t k = 0; k < cols; ++k) hits += (codes[size_t(k)] & 0x7F) == 0x7E;
        CHECK(hits >= 1);
    }
    // A NaN row is reported, not quantized into garbage.
    std::vector<float> bad(size_t(rows * cols), 1.0f);
    bad[size_t(4 * cols + 9)] = std::numeric_limits<float>::quiet_NaN();
    std::vector<uint8_t> codes(size_t(rows * cols)), scales(size_t(rows) * 4);
    CHECK(quantize_rows_e4m3(StDtype::f32, reinterpret_cast<const uint8_t*>(bad.data()), rows, cols,
                             codes.data(), scales.data()) == 4);
}

TEST_CASE("quantize: F32 and F16 to BF16 round like mgl; BF16 is copied") {
    auto vals = test::random_floats(1001, 5, -100.0f, 100.0f);
    std::vector<uint8_t> out(vals.size() * 2);
    convert_to_bf16(StDtype::f32, reinterpret_cast<const uint8_t*>(vals.data()), vals.size(),
                    out.data());
    for (size_t i = 0; i < vals.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, &out[2 * i], 2);
        REQUIRE(h == mgl::f32_to_bf16(vals[i]));
    }
    std::vector<uint16_t> halves(vals.size());
    for (size_t i = 0; i < vals.size(); ++i) halves[i] = mgl::f32_to_f16(vals[i] / 64.0f);
    convert_to_bf16(StDtype::f16, reinterpret_cast<const uint8_t*>(halves.data()), halves.size(),
                    out.data());
    for (size_t i = 0; i < vals.size(); ++i) {
        uint16_t h;
        std::memcpy(&h, &out[2 * i], 2);
        REQUIRE(h == mgl::f32_to_bf16(mgl::f16_to_f32(halves[i])));
    }
    convert_to_bf16(StDtype::bf16, reinterpret_cast<const uint8_t*>(halves.data()), halves.size(),
                    out.data());
    CHECK(std::memcmp(out.data(), halves.data(), out.size()) == 0);
}
