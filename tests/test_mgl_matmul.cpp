// matmul y = x · Wᵀ against a double-precision reference: every weight dtype, every kernel set
// this CPU runs, odd sizes, batched weights, permuted x, and strided weight views.
#include "../ggml-like/cpu/matmul_kernels.h"
#include "test_mgl_util.h"

using mgl::dtype;
using mgl_test::harness;

namespace {

// Logical x [G, M, K] and w [B, N, K] (dense doubles), scale [B·N] or empty; y [G, M, N] with
// batch b = g % B. Also returns Σ|x||w| per output as the rounding-error budget.
struct reference {
    std::vector<double> y, budget;
};
reference ref_matmul(const std::vector<double>& x, const std::vector<double>& w,
                     const std::vector<double>& scale, int64_t G, int64_t M, int64_t K, int64_t B,
                     int64_t N) {
    reference r;
    for (int64_t g = 0; g < G; ++g) {
        int64_t b = g % B;
        for (int64_t m = 0; m < M; ++m) {
            for (int64_t n = 0; n < N; ++n) {
                double s = 0, a = 0;
                for (int64_t k = 0; k < K; ++k) {
                    double p = x[size_t((g * M + m) * K + k)] * w[size_t((b * N + n) * K + k)];
                    s += p;
                    a += std::fabs(p);
                }
                double sc = scale.empty() ? 1.0 : scale[size_t(b * N + n)];
                r.y.push_back(s * sc);
                r.budget.push_back(a * std::fabs(sc));
            }
        }
    }
    return r;
}

void check_matmul(const std::vector<float>& got, const reference& want) {
    REQUIRE(got.size() == want.y.size());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        double tol = 2e-6 * want.budget[i] + 1e-6;
        if (std::fabs(double(got[i]) - want.y[i]) > tol && bad++ == 0) {
            CAPTURE(i);
            CAPTURE(got[i]);
            CAPTURE(want.y[i]);
            CHECK(std::fabs(double(got[i]) - want.y[i]) <= tol);
        }
    }
    CHECK(bad == 0);
}

std::vector<double> scales_of(mgl::tensor* s) {
    return s ? harness::read_all(*s) : std::vector<double>{};
}

}  // namespace

TEST_CASE("mgl matmul: f32, bf16 and f8_e4m3 weights, odd sizes, every kernel set") {
    struct dims {
        int64_t M, N, K;
    };
    for (const auto& ks : mgl::cpu::available_matmul_kernels()) {
        CAPTURE(ks.isa);
        uint64_t seed = 100;
        for (dtype wt : {dtype::f32, dtype::bf16, dtype::f8_e4m3}) {
            CAPTURE(mgl::dtype_name(wt));
            for (dims d : {dims{1, 7, 5}, dims{1, 19, 96}, dims{3, 33, 67}, dims{5, 17, 129},
                           dims{37, 9, 80}, dims{6, 5, 300}}) {
                CAPTURE(d.M);
                CAPTURE(d.K);
                harness h(mgl::cpu::make_cpu_backend_with(2, ks));
                mgl::tensor* x = h.random(dtype::f32, {d.M, d.K}, ++seed, -1.0f, 1.0f, "x");
                mgl::tensor* w = h.random(wt, {d.N, d.K}, ++seed, -2.0f, 2.0f);
                mgl::tensor* s = wt == dtype::f8_e4m3
                                     ? h.random(dtype::f32, {d.N}, ++seed, 0.01f, 0.1f, "s")
                                     : nullptr;
                mgl::tensor* y = mgl::matmul(h.ctx, x, w, s);
                CHECK(y->shape[0] == d.M);
                CHECK(y->shape[1] == d.N);
                auto got = h.run(y);
                check_matmul(got, ref_matmul(harness::read_all(*x), harness::read_all(*w),
                                             scales_of(s), 1, d.M, d.K, 1, d.N));
            }
        }
    }
}

TEST_CASE("mgl matmul: y = x · Wᵀ orientation on a hand example") {
    harness h;
    // x [1, 2] = (1, 2); W [3, 2] rows (1, 0), (0, 1), (1, 1) -> y = (1, 2, 3).
    mgl::tensor* x = h.f32({1, 2}, {1, 2});
    mgl::tensor* w = h.f32({3, 2}, {1, 0, 0, 1, 1, 1}, "w");
    auto y = h.run(mgl::matmul(h.ctx, x, w));
    CHECK(y == std::vector<float>{1, 2, 3});
}

TEST_CASE("mgl matmul: batched weights [B, N, K] with x [B, M, K] and [2, B, M, K]") {
    for (const auto& ks : mgl::cpu::available_matmul_kernels()) {
        CAPTURE(ks.isa);
        for (dtype wt : {dtype::f32, dtype::bf16, dtype::f8_e4m3}) {
            harness h(mgl::cpu::make_cpu_backend_with(2, ks));
            const int64_t B = 3, M = 2, N = 11, K = 41;
            mgl::tensor* w = h.random(wt, {B, N, K}, 7);
            mgl::tensor* s =
                wt == dtype::f8_e4m3 ? h.random(dtype::f32, {B, N}, 8, 0.5f, 2.0f, "s") : nullptr;
            mgl::tensor* x3 = h.random(dtype::f32, {B, M, K}, 9);
            mgl::tensor* x4 = h.random(dtype::f32, {2, B, M, K}, 10);
            auto wd = harness::read_all(*w);
            check_matmul(h.run(mgl::matmul(h.ctx, x3, w, s)),
                         ref_matmul(harness::read_all(*x3), wd, scales_of(s), B, M, K, B, N));
            check_matmul(h.run(mgl::matmul(h.ctx, x4, w, s)),
                         ref_matmul(harness::read_all(*x4), wd, scales_of(s), 2 * B, M, K, B, N));
        }
    }
}

TEST_CASE("mgl matmul: permuted and inner-strided x") {
    harness h;
    const int64_t T = 5, H = 4, K = 23, N = 13;
    // q [T, H, K] viewed as [H, T, K] (rows of one head are not adjacent).
    mgl::tensor* q = h.random(dtype::f32, {T, H, K}, 21);
    mgl::tensor* qh = mgl::permute(h.ctx, q, {1, 0, 2});
    mgl::tensor* w = h.random(dtype::bf16, {H, N, K}, 22);
    mgl::tensor* y = mgl::matmul(h.ctx, qh, w);
    auto got = h.run(y);
    check_matmul(got, ref_matmul(harness::read_all(*qh), harness::read_all(*w), {}, H, T, K, H, N));
    // x given transposed: its K elements are not contiguous, so the op gathers them.
    mgl::tensor* xt = h.random(dtype::f32, {K, T}, 23);
    mgl::tensor* x = mgl::transpose(h.ctx, xt, 0, 1);  // [T, K], K stride = T floats
    mgl::tensor* w2 = h.random(dtype::f8_e4m3, {N, K}, 24);
    mgl::tensor* s2 = h.random(dtype::f32, {N}, 25, 0.1f, 1.0f, "s");
    auto got2 =
        h.run(mgl::matmul(h.ctx, x, w2, s2));  // runs first: it resolves the views' addresses
    check_matmul(got2, ref_matmul(harness::read_all(*x), harness::read_all(*w2), scales_of(s2), 1,
                                  T, K, 1, N));
}

TEST_CASE(
    "mgl matmul: W_uk and W_uv taken as strided views of W_kv_b, every dtype and kernel set") {
    // DeepSeek-V2's absorbed MLA: W_kv_b [H·(nope+v), r] -> [H, nope+v, r]; W_uk = rows [0, nope)
    // used transposed ([H, r, nope], K stride r elements), W_uv = rows [nope, nope+v) used as is.
    // r = 291 spans a full 256-output block of the transposed kernels plus an odd tail.
    const int64_t H = 3, nope = 10, v = 7, r = 291, T = 4;
    for (const auto& ks : mgl::cpu::available_matmul_kernels()) {
        CAPTURE(ks.isa);
        for (dtype wt : {dtype::bf16, dtype::f32, dtype::f8_e4m3}) {
            CAPTURE(mgl::dtype_name(wt));
            harness h(mgl::cpu::make_cpu_backend_with(2, ks));
            mgl::tensor* kv_b =
                h.random(wt, {H * (nope + v), r}, 31, -1.0f, 1.0f, "kv_b_proj.weight");
            mgl::tensor* per_head = mgl::reshape(h.ctx, kv_b, {H, nope + v, r});
            mgl::tensor* w_uk = mgl::transpose(h.ctx, mgl::slice(h.ctx, per_head, 1, 0, nope), 1,
                                               2);                        // [H, r, nope]
            mgl::tensor* w_uv = mgl::slice(h.ctx, per_head, 1, nope, v);  // [H, v, r]
            CHECK_FALSE(w_uk->is_contiguous());
            // An f8 weight's scale is per output row of the view ([H, r] for W_uk).
            mgl::tensor* s_uk =
                wt == dtype::f8_e4m3 ? h.random(dtype::f32, {H, r}, 34, 0.5f, 2.0f, "s") : nullptr;
            mgl::tensor* q_nope = h.random(dtype::f32, {H, T, nope}, 32);
            mgl::tensor* q_lat = mgl::matmul(h.ctx, q_nope, w_uk, s_uk);  // [H, T, r]
            auto got_lat = h.run(q_lat);
            check_matmul(got_lat, ref_matmul(harness::read_all(*q_nope), harness::read_all(*w_uk),
                                             scales_of(s_uk), H, T, nope, H, r));
            mgl::tensor* o_lat = h.random(dtype::f32, {H, T, r}, 33);
            mgl::tensor* o = mgl::matmul(h.ctx, o_lat, w_uv);  // [H, T, v]
            auto got_o = h.run(o);
            check_matmul(got_o, ref_matmul(harness::read_all(*o_lat), harness::read_all(*w_uv), {},
                                           H, T, r, H, v));
        }
    }
}

TEST_CASE("mgl matmul: weight view with no contiguous dim runs the general path") {
    harness h;
    const int64_t N = 6, K = 9, M = 3;
    // Interleaved storage [N, K, 2]: element stride 2 along K, rows 2K apart.
    mgl::tensor* base = h.random(dtype::bf16, {N, K, 2}, 41);
    int64_t shape[2] = {N, K}, stride[2] = {K * 2 * 2, 2 * 2};
    mgl::tensor* w = mgl::view(h.ctx, base, shape, stride, 2);  // the odd elements
    mgl::tensor* x = h.random(dtype::f32, {M, K}, 42);
    auto got = h.run(mgl::matmul(h.ctx, x, w));
    check_matmul(got, ref_matmul(harness::read_all(*x), harness::read_all(*w), {}, 1, M, K, 1, N));
}

TEST_CASE("mgl matmul: shape and dtype mismatches are refused when recorded") {
    mgl::context ctx;
    mgl::tensor* x = ctx.new_tensor(dtype::f32, {2, 8});
    CHECK_THROWS_AS(mgl::matmul(ctx, x, ctx.new_tensor(dtype::bf16, {4, 9})), mgl::error);
    CHECK_THROWS_AS(mgl::matmul(ctx, x, ctx.new_tensor(dtype::f16, {4, 8})), mgl::error);
    CHECK_THROWS_AS(mgl::matmul(ctx, x, ctx.new_tensor(dtype::bf16, {3, 4, 8})),
                    mgl::error);  // no batch dim in x
    CHECK_THROWS_AS(mgl::matmul(ctx, x, ctx.new_tensor(dtype::f8_e4m3, {4, 8}),
                                ctx.new_tensor(dtype::f32, {5})),
                    mgl::error);
    CHECK_THROWS_AS(
        mgl::matmul(ctx, ctx.new_tensor(dtype::bf16, {2, 8}), ctx.new_tensor(dtype::f32, {4, 8})),
        mgl::error);
}

TEST_CASE("mgl matmul: every finite E4M3 code decodes correctly inside each SIMD kernel") {
    // Each row holds all 254 finite codes (rotated per row), so every code meets every lane and
    // the tail loop; x is one-hot per output, so y reads back single decoded weights exactly.
    std::vector<uint8_t> codes;
    for (int c = 0; c < 256; ++c)
        if ((c & 0x7F) != 0x7F) codes.push_back(uint8_t(c));
    const int64_t K = int64_t(codes.size()), N = 5;
    std::vector<uint8_t> w(size_t(N * K));
    for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) w[size_t(n * K + k)] = codes[size_t((k + 37 * n) % K)];
    for (const auto& ks : mgl::cpu::available_matmul_kernels()) {
        CAPTURE(ks.isa);
        harness h(mgl::cpu::make_cpu_backend_with(1, ks));
        mgl::tensor* wt = h.leaf(dtype::f8_e4m3, {N, K}, w.data(), w.size(), "w");
        std::vector<float> x(size_t(K * K), 0.0f);
        for (int64_t m = 0; m < K; ++m) x[size_t(m * K + m)] = 1.0f;  // identity: y[m, n] = w[n, m]
        auto got = h.run(mgl::matmul(h.ctx, h.f32({K, K}, x), wt));
        size_t bad = 0;
        for (int64_t m = 0; m < K; ++m)
            for (int64_t n = 0; n < N; ++n) {
                float want = mgl::e4m3_to_f32(w[size_t(n * K + m)]);
                if (got[size_t(m * N + n)] != want && bad++ == 0) {
                    CAPTURE(int(w[size_t(n * K + m)]));
                    CHECK(got[size_t(m * N + n)] == want);
                }
            }
        CHECK(bad == 0);
    }
}
