// MoE routing (moe_topk, moe_weights) and the routed experts (moe_experts) for every expert dtype.
#include <algorithm>
#include <numeric>

#include "test_mgl_util.h"

using mgl::dtype;
using mgl_test::check_close;
using mgl_test::harness;

namespace {

std::vector<int32_t> as_ints(const std::vector<float>& v) {
    std::vector<int32_t> out;
    for (float f : v) out.push_back(int32_t(f));
    return out;
}

}  // namespace

TEST_CASE("mgl moe_topk greedy: descending by probability, ties go to the lower id") {
    harness h;
    // Row 0 has a three-way tie at 0.2 (ids 1, 4, 6); row 1 is random.
    std::vector<float> probs = {0.05f, 0.2f, 0.1f,  0.05f, 0.2f,  0.15f, 0.2f, 0.05f,
                                0.01f, 0.3f, 0.02f, 0.25f, 0.12f, 0.1f,  0.1f, 0.1f};
    mgl::moe_route_params p;
    p.k = 3;
    auto ids = as_ints(h.run(mgl::moe_topk(h.ctx, h.f32({2, 8}, probs, "probs"), p)));
    CHECK(ids == std::vector<int32_t>{1, 4, 6, 1, 3, 4});
    p.k = 5;  // ties at 0.1 among 5, 6, 7 in row 1: the lower ids win
    ids = as_ints(h.run(mgl::moe_topk(h.ctx, h.f32({2, 8}, probs, "probs"), p)));
    CHECK(ids == std::vector<int32_t>{1, 4, 6, 5, 2, 1, 3, 4, 5, 6});
}

TEST_CASE("mgl moe_topk group_limited_greedy: only experts of the best groups") {
    harness h;
    const int64_t T = 6, E = 16;
    mgl::tensor* probs = h.random(dtype::f32, {T, E}, 201, 0.0f, 1.0f, "probs");
    auto pv = harness::read_all(*probs);
    mgl::moe_route_params p;
    p.k = 3;
    p.method = mgl::topk_method::group_limited_greedy;
    p.n_group = 4;
    p.topk_group = 2;
    auto ids = as_ints(h.run(mgl::moe_topk(h.ctx, probs, p)));
    for (int64_t t = 0; t < T; ++t) {
        // Reference: group max, best two groups, then top-3 of their experts.
        std::vector<std::pair<double, int>> groups;
        for (int g = 0; g < 4; ++g) {
            double m = 0;
            for (int e = 0; e < 4; ++e) m = std::max(m, pv[size_t(t * E + g * 4 + e)]);
            groups.emplace_back(-m, g);
        }
        std::sort(groups.begin(), groups.end());
        std::vector<std::pair<double, int>> cand;
        for (int gi = 0; gi < 2; ++gi)
            for (int e = 0; e < 4; ++e) {
                int id = groups[size_t(gi)].second * 4 + e;
                cand.emplace_back(-pv[size_t(t * E + id)], id);
            }
        std::sort(cand.begin(), cand.end());
        for (int i = 0; i < 3; ++i) CHECK(ids[size_t(t * 3 + i)] == cand[size_t(i)].second);
    }
    // Cases where the global top-k differs. Groups of two with maxima 0.30, 0.29, 0.12; with
    // topk_group 1 only g0 survives, so k = 2 gives 0, 1 where the global top-2 is 0, 2.
    std::vector<float> row = {0.30f, 0.01f, 0.29f, 0.28f, 0.0f, 0.12f};
    mgl::moe_route_params q;
    q.method = mgl::topk_method::group_limited_greedy;
    q.n_group = 3;
    q.topk_group = 1;
    q.k = 2;
    CHECK(as_ints(h.run(mgl::moe_topk(h.ctx, h.f32({1, 6}, row, "probs"), q))) ==
          std::vector<int32_t>{0, 1});
    std::vector<float> row2 = {0.05f, 0.06f, 0.40f, 0.0f, 0.10f, 0.39f};
    // Group maxima 0.06, 0.40, 0.39: keep g1 and g2, so expert 4 (0.10) is chosen over
    // expert 1 (0.06) and the order is 2, 5, 4.
    q.topk_group = 2;
    q.k = 3;
    CHECK(as_ints(h.run(mgl::moe_topk(h.ctx, h.f32({1, 6}, row2, "probs"), q))) ==
          std::vector<int32_t>{2, 5, 4});
    mgl::context ctx;
    q.k = 5;  // more than two groups of two can hold
    CHECK_THROWS_AS(mgl::moe_topk(ctx, ctx.new_tensor(dtype::f32, {1, 6}), q), mgl::error);
}

TEST_CASE("mgl moe_weights: normalized top-k, or scaled by routed_scaling_factor") {
    harness h;
    const int64_t T = 3, E = 9;
    mgl::tensor* probs = h.random(dtype::f32, {T, E}, 211, 0.01f, 1.0f, "probs");
    auto pv = harness::read_all(*probs);
    std::vector<int32_t> idv = {8, 0, 3, 1, 1, 2, 7, 6, 5};  // [T, 3]
    for (int variant = 0; variant < 3; ++variant) {
        mgl::moe_route_params p;
        p.k = variant == 2 ? 1 : 3;
        p.norm_topk_prob = variant != 1;
        p.routed_scaling_factor = 16.0f;
        int64_t k = p.k;
        std::vector<int32_t> ids;
        for (int64_t t = 0; t < T; ++t)
            for (int64_t i = 0; i < k; ++i) ids.push_back(idv[size_t(t * 3 + i)]);
        mgl::tensor* id_t = h.leaf(dtype::i32, {T, k}, ids.data(), ids.size() * 4, "ids");
        auto got = h.run(mgl::moe_weights(h.ctx, probs, id_t, p));
        std::vector<double> want;
        for (int64_t t = 0; t < T; ++t) {
            double sum = 0;
            for (int64_t i = 0; i < k; ++i) sum += pv[size_t(t * E + ids[size_t(t * k + i)])];
            for (int64_t i = 0; i < k; ++i) {
                double s = pv[size_t(t * E + ids[size_t(t * k + i)])];
                // norm_topk_prob applies only with k > 1; k == 1 falls back to the scaling factor.
                want.push_back(p.norm_topk_prob && k > 1 ? s / sum : s * 16.0);
            }
        }
        CAPTURE(variant);
        check_close(got, want, 1e-7, 1e-6);
    }
}

namespace {

// Experts stored as `type` with random values, one blob per expert laid out like the .mds blob
// (gate, up, down, then the f8 row scales); scales random for f8. Keeps the bytes alive.
struct expert_fixture {
    std::vector<std::vector<uint8_t>> blobs;
    std::shared_ptr<mgl::expert_layout> layout = std::make_shared<mgl::expert_layout>();
    std::vector<int64_t> table;  // blob addresses, the moe_experts table
    // Decoded (dequantized, scaled) weights for the reference: [expert][gate|up|down] row-major.
    std::vector<std::array<std::vector<double>, 3>> real;

    expert_fixture(dtype type, int n_experts, int64_t D, int64_t F, uint64_t seed) {
        auto& L = *layout;
        L.type = type;
        L.n_embd = D;
        L.n_ff = F;
        const uint64_t mat = uint64_t(D * F) * mgl::dtype_size(type);
        auto up16 = [](uint64_t n) { return (n + 15) / 16 * 16; };
        L.gate = 0;
        L.up = up16(mat);
        L.down = 2 * up16(mat);
        L.gate_scale = 3 * up16(mat);
        L.up_scale = L.gate_scale + up16(uint64_t(F) * 4);
        L.down_scale = L.up_scale + up16(uint64_t(F) * 4);
        L.blob_bytes = L.down_scale + uint64_t(D) * 4;
        const uint64_t offsets[3] = {L.gate, L.up, L.down};
        const uint64_t scale_offsets[3] = {L.gate_scale, L.up_scale, L.down_scale};
        for (int e = 0; e < n_experts; ++e) {
            auto& blob = blobs.emplace_back(L.blob_bytes, uint8_t(0));
            std::array<std::vector<double>, 3> r;
            for (int which = 0; which < 3; ++which) {
                int64_t rows = which == 2 ? D : F, cols = which == 2 ? F : D;
                auto v = minids::test::random_floats(size_t(rows * cols), seed++, -0.5f, 0.5f);
                auto sc = minids::test::random_floats(size_t(rows), seed++, 0.02f, 0.2f);
                uint8_t* w = blob.data() + offsets[which];
                for (size_t i = 0; i < v.size(); ++i) {
                    float q = v[i];
                    if (type == dtype::f32) {
                        std::memcpy(&w[i * 4], &q, 4);
                    } else if (type == dtype::bf16) {
                        uint16_t b = mgl::f32_to_bf16(v[i]);
                        std::memcpy(&w[i * 2], &b, 2);
                        q = mgl::bf16_to_f32(b);
                    } else {
                        // Stored as e4m3(v / scale): the scale brings rows into FP8's range.
                        float s = sc[size_t(i) / size_t(cols)];
                        w[i] = mgl::f32_to_e4m3(v[i] / s);
                        q = mgl::e4m3_to_f32(w[i]) * s;
                    }
                    r[size_t(which)].push_back(double(q));
                }
                if (type == dtype::f8_e4m3)
                    std::memcpy(blob.data() + scale_offsets[which], sc.data(), sc.size() * 4);
            }
            table.push_back(int64_t(blob.data()));
            real.push_back(std::move(r));
        }
    }

    mgl::tensor* table_leaf(harness& h) {
        return h.leaf(dtype::i64, {int64_t(table.size())}, table.data(), table.size() * 8,
                      "expert_table");
    }

    std::vector<double> expert_out(int e, const double* x) const {
        return swiglu_ref(real[size_t(e)], layout->n_embd, layout->n_ff, x);
    }

    static std::vector<double> swiglu_ref(const std::array<std::vector<double>, 3>& m, int64_t D,
                                          int64_t F, const double* x) {
        std::vector<double> hmid(static_cast<size_t>(F)), y(static_cast<size_t>(D), 0.0);
        for (int64_t f = 0; f < F; ++f) {
            double g = 0, u = 0;
            for (int64_t d = 0; d < D; ++d) {
                g += m[0][size_t(f * D + d)] * x[d];
                u += m[1][size_t(f * D + d)] * x[d];
            }
            hmid[size_t(f)] = g / (1 + std::exp(-g)) * u;
        }
        for (int64_t d = 0; d < D; ++d)
            for (int64_t f = 0; f < F; ++f)
                y[size_t(d)] += m[2][size_t(d * F + f)] * hmid[size_t(f)];
        return y;
    }
};

}  // namespace

TEST_CASE("mgl moe_experts: weighted sum of SwiGLU experts for f32, bf16 and f8_e4m3") {
    const int64_t T = 5, D = 24, F = 13, k = 3, SF = 10;
    const int n_experts = 7;
    for (dtype type : {dtype::f32, dtype::bf16, dtype::f8_e4m3}) {
        for (bool with_shared : {false, true}) {
            CAPTURE(mgl::dtype_name(type));
            CAPTURE(with_shared);
            harness h;
            expert_fixture ex(type, n_experts, D, F, 300);
            mgl::tensor* x = h.random(dtype::f32, {T, D}, 221, -2.0f, 2.0f);
            // Expert 2 is picked by several tokens (batched), expert 5 by none.
            std::vector<int32_t> ids = {2, 0, 6, 2, 4, 1, 3, 2, 0, 6, 2, 1, 2, 4, 3};
            mgl::tensor* id_t = h.leaf(dtype::i32, {T, k}, ids.data(), ids.size() * 4, "ids");
            mgl::tensor* w = h.random(dtype::f32, {T, k}, 222, 0.1f, 1.0f, "w");
            mgl::shared_expert shared;
            if (with_shared) {
                shared.gate = h.random(dtype::bf16, {SF, D}, 223, -0.5f, 0.5f, "sh_gate");
                shared.up = h.random(dtype::bf16, {SF, D}, 224, -0.5f, 0.5f, "sh_up");
                shared.down = h.random(dtype::bf16, {D, SF}, 225, -0.5f, 0.5f, "sh_down");
            }
            auto got =
                h.run(mgl::moe_experts(h.ctx, x, id_t, w, ex.table_leaf(h), ex.layout, shared));
            auto xv = harness::read_all(*x), wv = harness::read_all(*w);
            std::vector<double> want(size_t(T * D), 0.0);
            for (int64_t t = 0; t < T; ++t) {
                for (int64_t i = 0; i < k; ++i) {
                    auto y = ex.expert_out(ids[size_t(t * k + i)], xv.data() + t * D);
                    for (int64_t d = 0; d < D; ++d)
                        want[size_t(t * D + d)] += wv[size_t(t * k + i)] * y[size_t(d)];
                }
                if (with_shared) {
                    std::array<std::vector<double>, 3> m = {harness::read_all(*shared.gate),
                                                            harness::read_all(*shared.up),
                                                            harness::read_all(*shared.down)};
                    auto y = expert_fixture::swiglu_ref(m, D, SF, xv.data() + t * D);
                    for (int64_t d = 0; d < D; ++d) want[size_t(t * D + d)] += y[size_t(d)];
                }
            }
            check_close(got, want, 1e-5, 1e-4);
        }
    }
}

TEST_CASE("mgl moe_experts: a missing expert or an out-of-range id is an error") {
    harness h;
    expert_fixture ex(dtype::bf16, 3, 8, 4, 400);
    ex.table[1] = 0;  // no blob
    mgl::tensor* x = h.random(dtype::f32, {1, 8}, 231);
    mgl::tensor* w = h.f32({1, 1}, {1.0f}, "w");
    auto run_id = [&](int32_t id) {
        return h.run(mgl::moe_experts(
            h.ctx, x, h.leaf(dtype::i32, {1, 1}, std::vector<int32_t>{id}.data(), 4), w,
            ex.table_leaf(h), ex.layout));
    };
    CHECK_THROWS_AS(run_id(1), mgl::error);
    CHECK_THROWS_AS(run_id(3), mgl::error);
    auto ok = run_id(2);
    auto xv = harness::read_all(*x);
    auto want = ex.expert_out(2, xv.data());
    check_close(ok, want, 1e-5, 1e-4);
    // A part outside the blob is refused when the op is recorded.
    auto bad = std::make_shared<mgl::expert_layout>(*ex.layout);
    bad->down_scale = bad->blob_bytes;
    bad->type = dtype::f8_e4m3;
    CHECK_THROWS_AS(
        mgl::moe_experts(h.ctx, x, h.leaf(dtype::i32, {1, 1}, std::vector<int32_t>{0}.data(), 4), w,
                         ex.table_leaf(h), bad),
        mgl::error);
}
