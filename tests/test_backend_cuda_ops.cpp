// Op-by-op parity of the CUDA backend with the CPU backend (ggml's test-backend-ops is the model):
// the same graph on random data runs on both, outputs compared by relative L2 with a bound stated
// per case. Odd sizes, strided and permuted views, every weight dtype, both page dtypes, jumping
// positions, scrambled page tables and expert tables, imposed expert ids.
// Bounds: exact conversions and copies 1e-7 (identical rounding); FP32 paths 1e-5 (summation
// order, expf); paths that round activations to BF16 (cuBLAS GEMM for M > 16, grouped MoE on
// tensor cores, MLA prefill on tensor cores) 2e-2.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>

#include "cuda_parity_util.h"

using namespace minids::test;
using mgl::dtype;

namespace {

const bool no_gpu = !cuda_device_available();

constexpr double exact = 1e-7, fp32 = 1e-5, bf16_math = 2e-2;

std::unique_ptr<mgl::backend> cuda_backend() { return mgl::make_cuda_backend(); }

std::vector<int32_t> ints(std::initializer_list<int32_t> v) { return v; }

}  // namespace

TEST_CASE("cuda get_rows: f32, f16, bf16 and scaled f8 tables, a strided table view" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    const int64_t V = 37, D = 53;
    for (dtype type : {dtype::f32, dtype::f16, dtype::bf16, dtype::f8_e4m3}) {
        CAPTURE(std::string(mgl::dtype_name(type)));
        check_parity(
            "get_rows", *be,
            [&](side& s) -> std::vector<mgl::tensor*> {
                mgl::tensor* table = s.random(type, {V, D}, 11, -2.0f, 2.0f);
                mgl::tensor* scale =
                    type == dtype::f8_e4m3 ? s.random(dtype::f32, {V}, 12, 0.5f, 2.0f) : nullptr;
                mgl::tensor* ids = s.i32({7}, ints({5, 0, 36, 5, 17, 2, 9}));
                return {mgl::get_rows(s.ctx, table, ids, scale)};
            },
            {exact}, &log);
    }
    check_parity(
        "get_rows of a column slice", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* wide = s.random(dtype::bf16, {V, 2 * D}, 13);
            mgl::tensor* table = mgl::slice(s.ctx, wide, 1, 7, D);
            return {mgl::get_rows(s.ctx, table, s.i32({4}, ints({36, 1, 1, 20})))};
        },
        {exact}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda get_rows: an id outside the table is reported at synchronize" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    side s(*be);
    mgl::tensor* table = s.random(dtype::f32, {10, 16}, 14);
    mgl::tensor* out = mgl::get_rows(s.ctx, table, s.i32({3}, ints({1, 12, 2})));
    CHECK_THROWS_WITH_AS(s.run({out}), doctest::Contains("id 12 at position 1"), mgl::error);
    // The backend stays usable.
    side ok(*be);
    mgl::tensor* table2 = ok.random(dtype::f32, {10, 16}, 14);
    CHECK_NOTHROW(ok.run({mgl::get_rows(ok.ctx, table2, ok.i32({2}, ints({9, 0})))}));
}

TEST_CASE("cuda add, mul, scale, swiglu: broadcasting, permuted and sliced operands" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    check_parity(
        "add/mul broadcasting", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* a = s.random(dtype::f32, {3, 5, 37}, 21);
            mgl::tensor* a_perm =
                mgl::permute(s.ctx, s.random(dtype::f32, {5, 3, 37}, 22), {1, 0, 2});  // [3, 5, 37]
            return {mgl::add(s.ctx, a, s.random(dtype::f32, {37}, 23)),
                    mgl::mul(s.ctx, a, s.random(dtype::f32, {5, 37}, 24)),
                    mgl::add(s.ctx, a_perm, s.random(dtype::f32, {3, 1, 37}, 25)),
                    mgl::mul(s.ctx, a_perm, s.random(dtype::f32, {1}, 26)),
                    mgl::add(s.ctx, a, a_perm)};
        },
        {fp32}, &log);
    check_parity(
        "scale and swiglu of slices", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* m = s.random(dtype::f32, {9, 41}, 27, -4.0f, 4.0f);
            mgl::tensor* gate = mgl::slice(s.ctx, m, 1, 0, 20);
            mgl::tensor* up = mgl::slice(s.ctx, m, 1, 21, 20);
            return {mgl::scale(s.ctx, gate, -0.37f), mgl::swiglu(s.ctx, gate, up),
                    mgl::swiglu(s.ctx, mgl::transpose(s.ctx, gate, 0, 1),
                                mgl::transpose(s.ctx, up, 0, 1))};
        },
        {fp32}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda softmax: scaled, causal with n_past, permuted, long rows" * doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    check_parity(
        "softmax", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* x = s.random(dtype::f32, {2, 3, 7, 19}, 31, -5.0f, 5.0f);
            mgl::tensor* xp = mgl::permute(
                s.ctx, s.random(dtype::f32, {3, 2, 7, 19}, 32, -5.0f, 5.0f), {1, 0, 2, 3});
            mgl::tensor* row = s.random(dtype::f32, {2, 1000}, 33, -9.0f, 9.0f);
            return {mgl::softmax(s.ctx, x, 0.7f), mgl::softmax(s.ctx, x, 1.0f, true, 4),
                    mgl::softmax(s.ctx, xp, 0.3f, true, 0), mgl::softmax(s.ctx, row),
                    mgl::softmax(s.ctx, mgl::transpose(s.ctx, row, 0, 1))};
        },
        {fp32}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda cpy, contiguous, concat: dtype conversions, strided destinations, every dim" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    check_parity(
        "cpy", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* src = s.random(dtype::f32, {7, 33}, 41, -3.0f, 3.0f);
            std::vector<uint8_t> zero(7 * 33 * 4, 0);
            mgl::tensor* d_bf16 = s.leaf(dtype::bf16, {7, 33}, zero.data(), "d_bf16");
            mgl::tensor* d_f16 = s.leaf(dtype::f16, {7, 33}, zero.data(), "d_f16");
            mgl::tensor* d_t = s.leaf(dtype::f32, {33, 7}, zero.data(), "d_t");
            mgl::tensor* src_bf16 = s.random(dtype::bf16, {7, 33}, 42);
            mgl::tensor* d_f32 = s.leaf(dtype::f32, {7, 33}, zero.data(), "d_f32");
            return {mgl::cpy(s.ctx, src, d_bf16), mgl::cpy(s.ctx, src, d_f16),
                    mgl::cpy(s.ctx, src, mgl::transpose(s.ctx, d_t, 0, 1)),
                    mgl::cpy(s.ctx, src_bf16, d_f32)};
        },
        {exact}, &log);
    check_parity(
        "contiguous", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            std::vector<mgl::tensor*> out;
            uint64_t seed = 43;
            for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f8_e4m3}) {
                mgl::tensor* x = s.random(t, {2, 3, 4, 5}, seed++);
                out.push_back(mgl::contiguous(s.ctx, mgl::permute(s.ctx, x, {3, 1, 0, 2})));
            }
            return out;
        },
        {exact}, &log);
    check_parity(
        "concat", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            std::vector<mgl::tensor*> out;
            for (int dim = 0; dim < 3; ++dim) {
                mgl::tensor* a = s.random(dtype::f32, {3, 4, 5}, uint64_t(50 + dim));
                std::array<int64_t, 3> bs = {3, 4, 5};
                bs[size_t(dim)] = 2;
                // b built permuted: stored [bs1, bs0, bs2].
                mgl::tensor* b_store =
                    s.random(dtype::bf16, {bs[1], bs[0], bs[2]}, uint64_t(60 + dim));
                mgl::tensor* b = mgl::permute(s.ctx, b_store, {1, 0, 2});
                out.push_back(mgl::concat(s.ctx, a, b, dim));
            }
            return out;
        },
        {exact}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda rms_norm: f32, bf16 or no weight; sliced and permuted (staged) input" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    check_parity(
        "rms_norm", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* x = s.random(dtype::f32, {6, 97}, 71, -3.0f, 3.0f);
            mgl::tensor* w32 = s.random(dtype::f32, {97}, 72);
            mgl::tensor* w16 = s.random(dtype::bf16, {50}, 73);
            mgl::tensor* x3 =
                mgl::permute(s.ctx, s.random(dtype::f32, {3, 4, 40}, 74, -2.0f, 2.0f), {1, 0, 2});
            // Rows the kernel's fast path takes (dim % 4 == 0, 16-byte aligned rows): V2-Lite's
            // hidden size, and 128 of 132 columns from column 4.
            mgl::tensor* wide = s.random(dtype::f32, {3, 2048}, 75, -3.0f, 3.0f);
            mgl::tensor* w2048 = s.random(dtype::bf16, {2048}, 76);
            mgl::tensor* x132 = s.random(dtype::f32, {5, 132}, 77, -3.0f, 3.0f);
            mgl::tensor* w128 = s.random(dtype::f32, {128}, 78);
            return {mgl::rms_norm(s.ctx, x, w32, 1e-6f),
                    mgl::rms_norm(s.ctx, mgl::slice(s.ctx, x, 1, 47, 50), w16, 1e-5f),
                    mgl::rms_norm(s.ctx, x3, nullptr, 1e-6f),
                    mgl::rms_norm(s.ctx, wide, w2048, 1e-6f),
                    mgl::rms_norm(s.ctx, mgl::slice(s.ctx, x132, 1, 4, 128), w128, 1e-6f)};
        },
        {fp32}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda rope: [T, d] and [T, H, d], plain and YaRN tables, jumping positions, slices" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    auto plain = std::make_shared<const mgl::rope_params>(mgl::rope_params_plain(16, 10000.0f));
    auto yarn = std::make_shared<const mgl::rope_params>(
        mgl::rope_params_yarn(64, 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 0.707f, 0.707f));
    check_parity(
        "rope", *be,
        [&](side& s) -> std::vector<mgl::tensor*> {
            mgl::tensor* pos = s.i32({5}, ints({0, 7, 3, 1000, 4095}));
            mgl::tensor* x3 = s.random(dtype::f32, {5, 3, 64}, 81, -2.0f, 2.0f);
            mgl::tensor* x2 = s.random(dtype::f32, {5, 16}, 82, -2.0f, 2.0f);
            mgl::tensor* wide = s.random(dtype::f32, {5, 3, 82}, 83, -2.0f, 2.0f);
            return {mgl::rope(s.ctx, x3, pos, yarn), mgl::rope(s.ctx, x2, pos, plain),
                    // 8-byte aligned slice (read in place) and an odd one (staged)
                    mgl::rope(s.ctx, mgl::slice(s.ctx, wide, 2, 16, 64), pos, yarn),
                    mgl::rope(s.ctx, mgl::slice(s.ctx, wide, 2, 1, 64), pos, yarn)};
        },
        {fp32}, &log);
    MESSAGE(log.str());
}

TEST_CASE("cuda matmul: every weight dtype, M across the GEMV/GEMM crossover, odd K and N" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    const int64_t N = 77;
    for (dtype type : {dtype::f32, dtype::bf16, dtype::f8_e4m3}) {
        for (int64_t K : {256, 131}) {
            for (int64_t M : {1, 3, 8, 9, 16, 17, 40}) {
                CAPTURE(std::string(mgl::dtype_name(type)));
                CAPTURE(K);
                CAPTURE(M);
                const double bound = (M > 16 && type != dtype::f32) ? bf16_math : fp32;
                check_parity(
                    "matmul", *be,
                    [&](side& s) -> std::vector<mgl::tensor*> {
                        mgl::tensor* x = s.random(dtype::f32, {M, K}, 91, -2.0f, 2.0f);
                        mgl::tensor* w = s.random(type, {N, K}, 92);
                        mgl::tensor* sc = type == dtype::f8_e4m3
                                              ? s.random(dtype::f32, {N}, 93, 0.01f, 0.1f)
                                              : nullptr;
                        return {mgl::matmul(s.ctx, x, w, sc)};
                    },
                    {bound}, &log);
            }
        }
    }
    MESSAGE(log.str());
}

TEST_CASE("cuda matmul: batched weights, MLA's transposed W_uk view, permuted and inner-strided x" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    for (int64_t M : {1, 5, 24}) {
        CAPTURE(M);
        const double bound = M > 16 ? bf16_math : fp32;
        check_parity(
            "batched and column-layout matmuls", *be,
            [&](side& s) -> std::vector<mgl::tensor*> {
                // kv_b_proj [H·(nope+v), r] bf16, viewed per head as W_uk [H, r, nope]
                // (N contiguous) and W_uv [H, v, r], exactly as the model does.
                const int64_t H = 4, nope = 16, v = 24, r = 48, es = 2;
                mgl::tensor* kv_b = s.random(dtype::bf16, {H * (nope + v), r}, 101);
                const int64_t hs = (nope + v) * r * es;
                const int64_t wk_shape[] = {H, r, nope}, wk_stride[] = {hs, es, r * es};
                const int64_t wv_shape[] = {H, v, r}, wv_stride[] = {hs, r * es, es};
                mgl::tensor* wk = mgl::view(s.ctx, kv_b, wk_shape, wk_stride, 0);
                mgl::tensor* wv =
                    mgl::view(s.ctx, kv_b, wv_shape, wv_stride, size_t(nope * r * es));
                mgl::tensor* q = s.random(dtype::f32, {M, H, nope}, 102);
                mgl::tensor* o = s.random(dtype::f32, {M, H, r}, 103);
                mgl::tensor* w3 = s.random(dtype::f8_e4m3, {3, 45, 64}, 104);
                mgl::tensor* w3s = s.random(dtype::f32, {3, 45}, 105, 0.01f, 0.1f);
                mgl::tensor* x4 = s.random(dtype::f32, {2, 3, M, 64}, 106);
                mgl::tensor* w2 = s.random(dtype::bf16, {29, 64}, 107);
                // [2, 3, M, 64] whose two outer dims do not collapse.
                mgl::tensor* x4p =
                    mgl::permute(s.ctx, s.random(dtype::f32, {3, 2, M, 64}, 108), {1, 0, 2, 3});
                // x [M, 64] with 64 elements apart: staged before the product.
                mgl::tensor* xt = mgl::transpose(s.ctx, s.random(dtype::f32, {64, M}, 109), 0, 1);
                return {mgl::matmul(s.ctx, mgl::permute(s.ctx, q, {1, 0, 2}), wk),
                        mgl::matmul(s.ctx, mgl::permute(s.ctx, o, {1, 0, 2}), wv),
                        mgl::matmul(s.ctx, x4, w3, w3s),
                        mgl::matmul(s.ctx, x4, w2),
                        mgl::matmul(s.ctx, x4p, w2),
                        mgl::matmul(s.ctx, xt, w2)};
            },
            {bound}, &log);
    }
    MESSAGE(log.str());
}

TEST_CASE("cuda moe_topk and moe_weights: greedy and group-limited, normalized and scaled" *
          doctest::skip(no_gpu)) {
    auto be = cuda_backend();
    worst_errors log;
    for (bool grouped : {false, true}) {
        for (bool norm : {false, true}) {
            CAPTURE(grouped);
            CAPTURE(norm);
            mgl::moe_route_params p;
            p.k = 6;
            p.norm_topk_prob = norm;
            p.routed_scaling_factor = 2.5f;
            if (grouped) {
                p.method = mgl::topk_method::group_limited_greedy;
                p.n_group = 8;
                p.topk_group = 3;
            }
            // Separate kernels on the same probabilities: identical ids, bit-identical weights.
            check_parity(
                "moe_topk + moe_weights", *be,
                [&](side& s) -> std::vector<mgl::tensor*> {
                    mgl::tensor* probs = s.random(dtype::f32, {9, 64}, 111, 0.0f, 1.0f);
                    mgl::tensor* ids = mgl::moe_topk(s.ctx, probs, p);
                    return {ids, mgl::moe_weights(s.ctx, probs, ids, p)};
                },
                {0.0}, &log);
            // From logits through softmax: the fused moe_route on the GPU.
            check_parity(
                "softmax + moe_topk + moe_weights", *be,
                [&](side& s) -> std::vector<mgl::tensor*> {
                    mgl::tensor* logits = s.random(dtype::f32, {9, 64}, 112, -3.0f, 3.0f);
                    mgl::tensor* probs = mgl::softmax(s.ctx, logits);
                    mgl::tensor* ids = mgl::moe_topk(s.ctx, probs, p);
                    return {ids, mgl::moe_weights(s.ctx, probs, ids, p)};
                },
                {0.0, fp32}, &log);
        }
    }
    MESSAGE(log.str());
}

#endif  // MINIDS_HAVE_CUDA
