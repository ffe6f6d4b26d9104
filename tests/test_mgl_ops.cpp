// Row-wise and elementwise ops against naive double-precision references: get_rows, add, mul,
// scale, rms_norm, rope (and the YaRN table), softmax, swiglu, cpy, contiguous, concat.
#include <numbers>

#include "test_mgl_util.h"

using mgl::dtype;
using mgl_test::check_close;
using mgl_test::harness;

TEST_CASE("mgl get_rows: f32, f16, bf16 tables and an f8 table with per-row scales") {
    const int64_t V = 11, D = 13;
    std::vector<int32_t> ids = {3, 0, 10, 3, 7};
    for (dtype t : {dtype::f32, dtype::f16, dtype::bf16, dtype::f8_e4m3}) {
        CAPTURE(mgl::dtype_name(t));
        harness h;
        mgl::tensor* table = h.random(t, {V, D}, 51, -3.0f, 3.0f, "embed");
        mgl::tensor* scale =
            t == dtype::f8_e4m3 ? h.random(dtype::f32, {V}, 52, 0.5f, 2.0f, "s") : nullptr;
        auto got = h.run(mgl::get_rows(h.ctx, table, h.i32({5}, ids), scale));
        auto tv = harness::read_all(*table);
        auto sv = scale ? harness::read_all(*scale) : std::vector<double>(size_t(V), 1.0);
        std::vector<double> want;
        for (int32_t id : ids)
            for (int64_t d = 0; d < D; ++d) want.push_back(tv[size_t(id * D + d)] * sv[size_t(id)]);
        check_close(got, want, 1e-6, 1e-6);
    }
}

TEST_CASE("mgl get_rows: a strided table view (columns sliced out)") {
    harness h;
    mgl::tensor* full = h.random(dtype::bf16, {9, 20}, 53);
    mgl::tensor* table = mgl::slice(h.ctx, full, 1, 5, 7);  // [9, 7], row stride 20 elements
    std::vector<int32_t> ids = {8, 1, 1};
    auto got = h.run(mgl::get_rows(h.ctx, table, h.i32({3}, ids)));
    auto fv = harness::read_all(*full);
    std::vector<double> want;
    for (int32_t id : ids)
        for (int64_t d = 0; d < 7; ++d) want.push_back(fv[size_t(id * 20 + 5 + d)]);
    check_close(got, want, 0.0);
}

TEST_CASE("mgl add and mul: broadcasting over outer dims, permuted inputs") {
    harness h;
    const int64_t A = 3, B = 5, C = 7;
    mgl::tensor* a = h.random(dtype::f32, {A, B, C}, 61);
    auto av = harness::read_all(*a);
    for (int variant = 0; variant < 4; ++variant) {
        mgl::tensor* b = nullptr;
        switch (variant) {
            case 0:
                b = h.random(dtype::f32, {A, B, C}, 62);
                break;
            case 1:
                b = h.random(dtype::f32, {C}, 63);
                break;
            case 2:
                b = h.random(dtype::f32, {B, 1}, 64);
                break;
            default:
                b = h.random(dtype::f32, {A, 1, C}, 65);
                break;
        }
        auto bv = harness::read_all(*b);
        auto b_at = [&](int64_t i, int64_t j, int64_t k) {
            switch (variant) {
                case 0:
                    return bv[size_t((i * B + j) * C + k)];
                case 1:
                    return bv[size_t(k)];
                case 2:
                    return bv[size_t(j)];
                default:
                    return bv[size_t(i * C + k)];
            }
        };
        auto sum = h.run(mgl::add(h.ctx, a, b));
        auto prod = h.run(mgl::mul(h.ctx, a, b));
        std::vector<double> want_sum, want_prod;
        for (int64_t i = 0; i < A; ++i)
            for (int64_t j = 0; j < B; ++j)
                for (int64_t k = 0; k < C; ++k) {
                    double x = av[size_t((i * B + j) * C + k)];
                    want_sum.push_back(x + b_at(i, j, k));
                    want_prod.push_back(x * b_at(i, j, k));
                }
        CAPTURE(variant);
        check_close(sum, want_sum, 1e-6);
        check_close(prod, want_prod, 1e-6);
    }
    // Permuted a: [C, B, A] view of a contiguous [A, B, C]; b broadcast along the last dim.
    mgl::tensor* ap = mgl::permute(h.ctx, a, {2, 1, 0});
    mgl::tensor* b = h.random(dtype::f32, {A}, 66);
    auto got = h.run(mgl::add(h.ctx, ap, b));
    auto bv = harness::read_all(*b);
    std::vector<double> want;
    for (int64_t k = 0; k < C; ++k)
        for (int64_t j = 0; j < B; ++j)
            for (int64_t i = 0; i < A; ++i)
                want.push_back(av[size_t((i * B + j) * C + k)] + bv[size_t(i)]);
    check_close(got, want, 1e-6);
    mgl::context ctx;
    CHECK_THROWS_AS(
        mgl::add(ctx, ctx.new_tensor(dtype::f32, {3, 4}), ctx.new_tensor(dtype::f32, {3})),
        mgl::error);
}

TEST_CASE("mgl scale: contiguous and sliced input") {
    harness h;
    mgl::tensor* a = h.random(dtype::f32, {6, 9}, 71);
    mgl::tensor* s = mgl::slice(h.ctx, a, 1, 2, 5);
    auto got = h.run(mgl::scale(h.ctx, s, -0.37f));
    auto av = harness::read_all(*a);
    std::vector<double> want;
    for (int64_t i = 0; i < 6; ++i)
        for (int64_t j = 2; j < 7; ++j) want.push_back(av[size_t(i * 9 + j)] * double(-0.37f));
    check_close(got, want, 1e-7, 1e-6);
}

TEST_CASE("mgl rms_norm: f32, bf16 or no weight; sliced input") {
    const int64_t T = 5, D = 67;
    const float eps = 1e-6f;
    for (int wkind = 0; wkind < 3; ++wkind) {
        harness h;
        mgl::tensor* full = h.random(dtype::f32, {T, D + 4}, 81, -2.0f, 2.0f);
        mgl::tensor* x = mgl::slice(h.ctx, full, 1, 3, D);  // rows not contiguous with each other
        mgl::tensor* w = wkind == 0   ? h.random(dtype::f32, {D}, 82, 0.5f, 1.5f)
                         : wkind == 1 ? h.random(dtype::bf16, {D}, 83, 0.5f, 1.5f)
                                      : nullptr;
        auto got = h.run(mgl::rms_norm(h.ctx, x, w, eps));
        auto xv = harness::read_all(*x);
        auto wv = w ? harness::read_all(*w) : std::vector<double>(size_t(D), 1.0);
        std::vector<double> want;
        for (int64_t t = 0; t < T; ++t) {
            double ss = 0;
            for (int64_t d = 0; d < D; ++d) ss += xv[size_t(t * D + d)] * xv[size_t(t * D + d)];
            double inv = 1.0 / std::sqrt(ss / double(D) + double(eps));
            for (int64_t d = 0; d < D; ++d)
                want.push_back(wv[size_t(d)] * xv[size_t(t * D + d)] * inv);
        }
        CAPTURE(wkind);
        check_close(got, want, 1e-6, 1e-5);
    }
}

namespace {

std::vector<double> ref_rope(const std::vector<double>& x, const std::vector<int32_t>& pos,
                             int64_t H, int64_t d, const mgl::rope_params& p) {
    std::vector<double> out(x.size());
    for (size_t t = 0; t < pos.size(); ++t)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t i = 0; i < d / 2; ++i) {
                double ang = double(pos[t]) * double(p.inv_freq[size_t(i)]);
                double c = std::cos(ang) * p.attn_factor, s = std::sin(ang) * p.attn_factor;
                size_t base = (t * size_t(H) + size_t(h)) * size_t(d) + size_t(2 * i);
                double a = x[base], b = x[base + 1];
                out[base] = a * c - b * s;
                out[base + 1] = a * s + b * c;
            }
    return out;
}

}  // namespace

TEST_CASE("mgl rope: interleaved pairs on [T, H, d] and a sliced [T, d] view, YaRN attn_factor") {
    harness h;
    const int64_t T = 4, H = 3, d = 8;
    std::vector<int32_t> pos = {0, 5, 6, 130};
    auto plain = std::make_shared<const mgl::rope_params>(mgl::rope_params_plain(int(d), 10000.0f));
    mgl::tensor* x = h.random(dtype::f32, {T, H, d}, 91, -2.0f, 2.0f);
    auto got = h.run(mgl::rope(h.ctx, x, h.i32({T}, pos, "pos"), plain));
    check_close(got, ref_rope(harness::read_all(*x), pos, H, d, *plain), 2e-5, 1e-5);

    // k_pe is the tail of the kv_a output: a [T, rope] slice of [T, r + rope].
    auto yarn = std::make_shared<const mgl::rope_params>(
        mgl::rope_params_yarn(int(d), 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 0.707f, 0.707f * 1.3f));
    CHECK(yarn->attn_factor != 1.0f);
    mgl::tensor* kv = h.random(dtype::f32, {T, 11 + d}, 92, -2.0f, 2.0f);
    mgl::tensor* k_pe = mgl::slice(h.ctx, kv, 1, 11, d);
    auto got2 = h.run(mgl::rope(h.ctx, k_pe, h.i32({T}, pos, "pos"), yarn));
    check_close(got2, ref_rope(harness::read_all(*k_pe), pos, 1, d, *yarn), 2e-5, 1e-5);
}

namespace {

// DESIGN.md's YaRN formula, written out again in double.
std::vector<double> yarn_by_hand(int d, double base, double factor, double orig, double beta_fast,
                                 double beta_slow) {
    auto corr = [&](double n) {
        return d * std::log(orig / (2 * std::numbers::pi * n)) / (2 * std::log(base));
    };
    double low = std::max(std::floor(corr(beta_fast)), 0.0);
    double high = std::min(std::ceil(corr(beta_slow)), double(d - 1));
    if (low == high) high += 0.001;
    std::vector<double> inv;
    for (int i = 0; i < d / 2; ++i) {
        double extra = std::pow(base, -2.0 * i / d), inter = extra / factor;
        double ramp = std::min(1.0, std::max(0.0, (i - low) / (high - low)));
        inv.push_back(inter * ramp + extra * (1 - ramp));
    }
    return inv;
}

}  // namespace

TEST_CASE("mgl rope_params_yarn: DeepSeek-V2-Lite's table against a hand computation") {
    // V2-Lite: d = 64, base 10000, factor 40, orig 4096, beta_fast 32, beta_slow 1,
    // mscale = mscale_all_dim = 0.707 -> attn_factor exactly 1.
    mgl::rope_params p =
        mgl::rope_params_yarn(64, 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 0.707f, 0.707f);
    auto want = yarn_by_hand(64, 10000.0, 40.0, 4096.0, 32.0, 1.0);
    REQUIRE(p.inv_freq.size() == 32);
    CHECK(p.n_dims == 64);
    for (size_t i = 0; i < want.size(); ++i)
        CHECK(double(p.inv_freq[i]) == doctest::Approx(want[i]).epsilon(1e-6));
    CHECK(p.attn_factor == doctest::Approx(1.0));
    // The two ends: i = 0 keeps the original frequency, the last is fully interpolated.
    CHECK(double(p.inv_freq[0]) == doctest::Approx(1.0).epsilon(1e-7));
    CHECK(double(p.inv_freq[31]) ==
          doctest::Approx(std::pow(10000.0, -62.0 / 64) / 40).epsilon(1e-6));
    // Different mscales: attn_factor = mscale(40, 1) / mscale(40, 0.5).
    mgl::rope_params q = mgl::rope_params_yarn(64, 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 1.0f, 0.5f);
    CHECK(double(q.attn_factor) ==
          doctest::Approx((0.1 * std::log(40.0) + 1) / (0.05 * std::log(40.0) + 1)).epsilon(1e-6));
}

TEST_CASE("mgl rope_params_yarn: low == high takes the +0.001 branch") {
    // d = 16, base 10000, orig 4096: corr(n) = 16·ln(4096/(2πn)) / (2 ln 10000).
    // beta_fast = beta_slow = 8 gives floor(c) == ceil(c) only when c is an integer, so pick
    // beta values whose floor/ceil meet: c(9) = 3.53.. -> floor 3; c(12) = 3.28.. -> ceil 4. Use
    // beta_slow with c in (2, 3] so ceil = 3 == floor(c(beta_fast)).
    auto corr = [](double n) {
        return 16 * std::log(4096.0 / (2 * std::numbers::pi * n)) / (2 * std::log(10000.0));
    };
    double beta_fast = 9.0, beta_slow = 30.0;  // c(9) ≈ 3.53 -> low 3; c(30) ≈ 2.93 -> high 3
    REQUIRE(std::floor(corr(beta_fast)) == 3.0);
    REQUIRE(std::ceil(corr(beta_slow)) == 3.0);
    mgl::rope_params p = mgl::rope_params_yarn(16, 10000.0f, 4.0f, 4096, float(beta_fast),
                                               float(beta_slow), 1.0f, 0.0f);
    auto want = yarn_by_hand(16, 10000.0, 4.0, 4096.0, beta_fast, beta_slow);
    for (size_t i = 0; i < want.size(); ++i)
        CHECK(double(p.inv_freq[i]) == doctest::Approx(want[i]).epsilon(1e-6));
    // i <= 3 extrapolated (original), i >= 4 interpolated (divided by the factor).
    CHECK(double(p.inv_freq[3]) == doctest::Approx(std::pow(10000.0, -6.0 / 16)).epsilon(1e-6));
    CHECK(double(p.inv_freq[4]) == doctest::Approx(std::pow(10000.0, -8.0 / 16) / 4).epsilon(1e-6));
    CHECK(p.attn_factor ==
          doctest::Approx(0.1 * std::log(4.0) + 1).epsilon(1e-6));  // mscale_all_dim 0 -> 1
    mgl::rope_params plain = mgl::rope_params_plain(16, 500.0f);
    CHECK(double(plain.inv_freq[5]) == doctest::Approx(std::pow(500.0, -10.0 / 16)).epsilon(1e-6));
    CHECK(mgl::yarn_mscale(1.0f, 0.707f) == 1.0f);
    CHECK(double(mgl::yarn_mscale(40.0f, 0.707f)) ==
          doctest::Approx(0.0707 * std::log(40.0) + 1).epsilon(1e-6));
}

TEST_CASE("mgl softmax: scaled rows, and causal with an n_past offset") {
    harness h;
    const int64_t Hh = 2, Tq = 3, Tk = 7;
    mgl::tensor* x = h.random(dtype::f32, {Hh, Tq, Tk}, 101, -4.0f, 4.0f);
    auto xv = harness::read_all(*x);
    for (int causal = 0; causal < 2; ++causal) {
        const int n_past = 4;
        auto got = h.run(mgl::softmax(h.ctx, x, 0.6f, causal != 0, n_past));
        std::vector<double> want;
        for (int64_t hq = 0; hq < Hh * Tq; ++hq) {
            int64_t visible = causal ? std::min(Tk, hq % Tq + n_past + 1) : Tk;
            double mx = -1e300, sum = 0;
            for (int64_t j = 0; j < visible; ++j)
                mx = std::max(mx, xv[size_t(hq * Tk + j)] * double(0.6f));
            for (int64_t j = 0; j < visible; ++j)
                sum += std::exp(xv[size_t(hq * Tk + j)] * double(0.6f) - mx);
            for (int64_t j = 0; j < Tk; ++j)
                want.push_back(j < visible
                                   ? std::exp(xv[size_t(hq * Tk + j)] * double(0.6f) - mx) / sum
                                   : 0.0);
        }
        CAPTURE(causal);
        check_close(got, want, 1e-6, 1e-5);
    }
    // A permuted input (keys along a strided dim).
    mgl::tensor* xt = h.random(dtype::f32, {5, 4}, 102);
    auto got = h.run(mgl::softmax(h.ctx, mgl::transpose(h.ctx, xt, 0, 1)));
    auto tv = harness::read_all(*xt);
    std::vector<double> want;
    for (int64_t i = 0; i < 4; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < 5; ++j) sum += std::exp(tv[size_t(j * 4 + i)]);
        for (int64_t j = 0; j < 5; ++j) want.push_back(std::exp(tv[size_t(j * 4 + i)]) / sum);
    }
    check_close(got, want, 1e-6, 1e-5);
}

TEST_CASE("mgl swiglu: silu(a) * b, with a sliced gate") {
    harness h;
    mgl::tensor* gu = h.random(dtype::f32, {3, 2 * 19}, 111, -5.0f, 5.0f);
    mgl::tensor* g = mgl::slice(h.ctx, gu, 1, 0, 19);
    mgl::tensor* u = mgl::slice(h.ctx, gu, 1, 19, 19);
    auto got = h.run(mgl::swiglu(h.ctx, g, u));
    auto v = harness::read_all(*gu);
    std::vector<double> want;
    for (int64_t t = 0; t < 3; ++t)
        for (int64_t i = 0; i < 19; ++i) {
            double a = v[size_t(t * 38 + i)], b = v[size_t(t * 38 + 19 + i)];
            want.push_back(a / (1 + std::exp(-a)) * b);
        }
    check_close(got, want, 1e-6, 1e-5);
}

TEST_CASE("mgl cpy: f32 into f32, bf16 and f16 destinations, including a strided one") {
    for (dtype dt : {dtype::f32, dtype::bf16, dtype::f16}) {
        CAPTURE(mgl::dtype_name(dt));
        harness h;
        mgl::tensor* src = h.random(dtype::f32, {4, 6}, 121, -3.0f, 3.0f);
        std::vector<uint8_t> zeros(4 * 10 * mgl::dtype_size(dt), 0);
        mgl::tensor* dst_full = h.leaf(dt, {4, 10}, zeros.data(), zeros.size(), "cache");
        mgl::tensor* dst = mgl::slice(h.ctx, dst_full, 1, 3, 6);
        mgl::tensor* out = mgl::cpy(h.ctx, src, dst);
        CHECK(out->type == dt);
        h.run(out);
        auto sv = harness::read_all(*src);
        auto dv = harness::read_all(*dst_full);
        for (int64_t i = 0; i < 4; ++i)
            for (int64_t j = 0; j < 10; ++j) {
                double got = dv[size_t(i * 10 + j)];
                if (j < 3 || j >= 9) {
                    CHECK(got == 0.0);  // untouched outside the view
                    continue;
                }
                float s = float(sv[size_t(i * 6 + j - 3)]);
                float want = dt == dtype::f32    ? s
                             : dt == dtype::bf16 ? mgl::bf16_to_f32(mgl::f32_to_bf16(s))
                                                 : mgl::f16_to_f32(mgl::f32_to_f16(s));
                CHECK(got == double(want));
            }
    }
}

TEST_CASE("mgl contiguous: permuted f32 and bf16 sources become dense f32") {
    for (dtype t : {dtype::f32, dtype::bf16}) {
        harness h;
        mgl::tensor* a = h.random(t, {3, 4, 5}, 131);
        mgl::tensor* p = mgl::permute(h.ctx, a, {2, 0, 1});  // [5, 3, 4]
        mgl::tensor* c = mgl::contiguous(h.ctx, p);
        CHECK(c->is_contiguous());
        auto got = h.run(c);
        auto av = harness::read_all(*a);
        std::vector<double> want;
        for (int64_t k = 0; k < 5; ++k)
            for (int64_t i = 0; i < 3; ++i)
                for (int64_t j = 0; j < 4; ++j) want.push_back(av[size_t((i * 4 + j) * 5 + k)]);
        check_close(got, want, 0.0);
    }
}

TEST_CASE("mgl concat: along each dim, with a permuted operand") {
    harness h;
    mgl::tensor* a = h.random(dtype::f32, {2, 3, 4}, 141);
    auto av = harness::read_all(*a);
    for (int dim = 0; dim < 3; ++dim) {
        std::array<int64_t, 3> bs = {2, 3, 4};
        bs[size_t(dim)] = 5;
        mgl::tensor* b = h.random(dtype::f32, {bs[0], bs[1], bs[2]}, 142 + uint64_t(dim));
        auto bv = harness::read_all(*b);
        auto got = h.run(mgl::concat(h.ctx, a, b, dim));
        std::array<int64_t, 3> os = {2, 3, 4};
        os[size_t(dim)] += 5;
        std::vector<double> want;
        for (int64_t i = 0; i < os[0]; ++i)
            for (int64_t j = 0; j < os[1]; ++j)
                for (int64_t k = 0; k < os[2]; ++k) {
                    std::array<int64_t, 3> idx = {i, j, k};
                    if (idx[size_t(dim)] < std::array<int64_t, 3>{2, 3, 4}[size_t(dim)]) {
                        want.push_back(av[size_t((i * 3 + j) * 4 + k)]);
                    } else {
                        idx[size_t(dim)] -= std::array<int64_t, 3>{2, 3, 4}[size_t(dim)];
                        want.push_back(bv[size_t((idx[0] * bs[1] + idx[1]) * bs[2] + idx[2])]);
                    }
                }
        CAPTURE(dim);
        check_close(got, want, 0.0);
    }
    // MLA's q = concat(q_nope, q_pe) style: a transposed operand along the last dim.
    mgl::tensor* bt = h.random(dtype::f32, {6, 3}, 149);
    mgl::tensor* b2 = mgl::transpose(h.ctx, bt, 0, 1);  // [3, 6]
    mgl::tensor* a2 = h.random(dtype::f32, {3, 2}, 150);
    auto got = h.run(mgl::concat(h.ctx, a2, b2, 1));
    auto a2v = harness::read_all(*a2), btv = harness::read_all(*bt);
    std::vector<double> want;
    for (int64_t i = 0; i < 3; ++i) {
        for (int64_t j = 0; j < 2; ++j) want.push_back(a2v[size_t(i * 2 + j)]);
        for (int64_t j = 0; j < 6; ++j) want.push_back(btv[size_t(j * 3 + i)]);
    }
    check_close(got, want, 0.0);
}
