// kv_store + mla_attn over a paged latent cache (non-identity page table, a prefill followed by
// decode steps with n_past > 0) against dense naive attention in double precision.
#include "test_mgl_util.h"

using mgl::dtype;
using mgl_test::check_close;
using mgl_test::harness;

namespace {

constexpr int64_t r = 12, rope = 6, width = r + rope, page_size = 4, n_pages = 6, H = 3;

// Dense causal attention over keys 0 .. n_past + t for each query t, head h.
std::vector<double> dense_attention(const std::vector<double>& q_lat,
                                    const std::vector<double>& q_pe,
                                    const std::vector<std::vector<double>>& keys, int64_t T,
                                    int64_t n_past, double scale) {
    std::vector<double> out;
    for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) {
            int64_t n_ctx = n_past + t + 1;
            std::vector<double> s(static_cast<size_t>(n_ctx));
            double mx = -1e300;
            for (int64_t j = 0; j < n_ctx; ++j) {
                double dot = 0;
                for (int64_t e = 0; e < r; ++e)
                    dot += q_lat[size_t((t * H + h) * r + e)] * keys[size_t(j)][size_t(e)];
                for (int64_t e = 0; e < rope; ++e)
                    dot += q_pe[size_t((t * H + h) * rope + e)] * keys[size_t(j)][size_t(r + e)];
                s[size_t(j)] = dot * scale;
                mx = std::max(mx, s[size_t(j)]);
            }
            double sum = 0;
            for (auto& v : s) sum += (v = std::exp(v - mx));
            for (int64_t e = 0; e < r; ++e) {
                double o = 0;
                for (int64_t j = 0; j < n_ctx; ++j)
                    o += s[size_t(j)] / sum * keys[size_t(j)][size_t(e)];
                out.push_back(o);
            }
        }
    return out;
}

double round_as(dtype t, double v) {
    if (t == dtype::bf16) return double(mgl::bf16_to_f32(mgl::f32_to_bf16(float(v))));
    if (t == dtype::f16) return double(mgl::f16_to_f32(mgl::f32_to_f16(float(v))));
    return double(float(v));
}

}  // namespace

TEST_CASE("mgl kv_store + mla_attn: paged cache equals dense attention (prefill, then decode)") {
    // Variants: f32 and bf16 caches (the SIMD kernel path), an f32 cache whose elements are two
    // floats apart (a view; the generic path), and an f16 cache (the generic path: the matmul
    // kernels have no f16 weights).
    for (int variant = 0; variant < 4; ++variant) {
        const dtype cache_type = variant == 1   ? dtype::bf16
                                 : variant == 3 ? dtype::f16
                                                : dtype::f32;
        const int64_t spread = variant == 2 ? 2 : 1;
        CAPTURE(variant);
        harness h;
        std::vector<uint8_t> zeros(
            size_t(n_pages * page_size * width * spread) * mgl::dtype_size(cache_type), 0);
        mgl::tensor* storage = h.leaf(cache_type, {n_pages, page_size, width * spread},
                                      zeros.data(), zeros.size(), "kv_pages");
        mgl::tensor* pages = storage;
        if (spread > 1) {
            const int64_t shape[3] = {n_pages, page_size, width};
            const int64_t stride[3] = {page_size * width * 8, width * 8, 8};
            pages = mgl::view(h.ctx, storage, shape, stride, 0);
        }
        std::vector<int32_t> table = {3, 0, 5, 1, 4};  // logical page -> physical page
        mgl::tensor* page_table = h.i32({5}, table, "page_table");
        const float scale = 0.31f;
        std::vector<std::vector<double>> keys;  // dense cache rows as the reference sees them

        int64_t n_past = 0;
        uint64_t seed = 500;
        for (int64_t T : {5, 1, 3, 1}) {  // prefill 5, then decode steps; ends at 10 positions
            CAPTURE(n_past);
            // kv_a output [T, r + rope]: c and k_pe are column slices (strided views), as in the
            // model.
            mgl::tensor* kv_a = h.random(dtype::f32, {T, width}, seed++, -1.0f, 1.0f, "kv_a");
            mgl::tensor* kv_c = mgl::slice(h.ctx, kv_a, 1, 0, r);
            mgl::tensor* k_pe = mgl::slice(h.ctx, kv_a, 1, r, rope);
            mgl::tensor* q_lat = h.random(dtype::f32, {T, H, r}, seed++, -1.0f, 1.0f, "q_lat");
            mgl::tensor* q = h.random(dtype::f32, {T, H, 5 + rope}, seed++, -1.0f, 1.0f, "q");
            mgl::tensor* q_pe = mgl::slice(h.ctx, q, 2, 5, rope);
            std::vector<int32_t> pos(static_cast<size_t>(T));
            for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(n_past + t);
            mgl::tensor* positions = h.i32({T}, pos, "positions");
            mgl::tensor* stored = mgl::kv_store(h.ctx, pages, page_table, kv_c, k_pe, positions);
            CHECK(stored->type == cache_type);
            mgl::tensor* o =
                mgl::mla_attn(h.ctx, q_lat, q_pe, stored, page_table, positions, scale);
            CHECK(o->shape == q_lat->shape);
            auto got = h.run(o);

            auto kv = harness::read_all(*kv_a);
            for (int64_t t = 0; t < T; ++t) {
                std::vector<double> row;
                for (int64_t e = 0; e < width; ++e)
                    row.push_back(round_as(cache_type, kv[size_t(t * width + e)]));
                keys.push_back(row);
            }
            auto want = dense_attention(harness::read_all(*q_lat), harness::read_all(*q_pe), keys,
                                        T, n_past, scale);
            check_close(got, want, 2e-6, 1e-5);
            n_past += T;
        }
        // The cache holds each position at (page_table[pos / page_size], pos % page_size).
        auto pv = harness::read_all(*pages);
        for (int64_t pos = 0; pos < n_past; ++pos) {
            int64_t phys = table[size_t(pos / page_size)], slot = pos % page_size;
            for (int64_t e = 0; e < width; ++e)
                CHECK(pv[size_t((phys * page_size + slot) * width + e)] ==
                      keys[size_t(pos)][size_t(e)]);
        }
        // Physical page 2 is not in the table and page 4 (logical 4) was never reached.
        for (int64_t i = 0; i < page_size * width; ++i) {
            CHECK(pv[size_t(2 * page_size * width + i)] == 0.0);
            CHECK(pv[size_t(4 * page_size * width + i)] == 0.0);
        }
    }
}

TEST_CASE("mgl kv_store + mla_attn: capacity and page-table errors") {
    harness h;
    std::vector<float> zeros(size_t(2 * page_size * width), 0.0f);
    mgl::tensor* pages = h.f32({2, page_size, width}, zeros, "kv_pages");
    mgl::tensor* table = h.i32({2}, {1, 7}, "page_table");  // logical page 1 points nowhere
    mgl::tensor* c = h.random(dtype::f32, {2, r}, 600);
    mgl::tensor* k = h.random(dtype::f32, {2, rope}, 601);
    // 2 logical pages of 4 positions: writing positions 7 .. 8 exceeds the table (the positions
    // are data, so this is found when the graph runs).
    CHECK_THROWS_AS(h.run(mgl::kv_store(h.ctx, pages, table, c, k, h.i32({2}, {7, 8}, "p78"))),
                    mgl::error);
    // Positions 3 .. 4 reach logical page 1 -> physical 7, which does not exist.
    CHECK_THROWS_AS(h.run(mgl::kv_store(h.ctx, pages, table, c, k, h.i32({2}, {3, 4}, "p34"))),
                    mgl::error);
    // Positions and tokens must agree in count.
    CHECK_THROWS_AS(mgl::kv_store(h.ctx, pages, table, c, k, h.i32({1}, {0}, "p0")), mgl::error);
    mgl::tensor* q_lat = h.random(dtype::f32, {1, H, r + 1}, 602);
    mgl::tensor* q_pe = h.random(dtype::f32, {1, H, rope}, 603);
    CHECK_THROWS_AS(mgl::mla_attn(h.ctx, q_lat, q_pe, pages, table, h.i32({1}, {0}, "p"), 1.0f),
                    mgl::error);  // width mismatch
}
