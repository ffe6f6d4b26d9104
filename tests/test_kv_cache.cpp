// The paged latent KV cache: page bookkeeping (grow, truncate, free, limits), page tables of
// interleaved sequences, and rows written by mgl::kv_store landing where read_row finds them.
#include <doctest/doctest.h>

#include <set>

#include "mgl.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

using namespace minids;

namespace {

KvCacheParams small_params() {
    KvCacheParams p;
    p.n_layer = 3;
    p.kv_lora_rank = 13;
    p.rope_dim = 6;
    p.n_ctx = 20;
    p.page_size = 4;
    p.n_pages = 8;
    p.max_sequences = 2;
    return p;
}

std::vector<int32_t> download_table(mgl::backend& be, LatentKvCache& cache, int seq) {
    mgl::context ctx;
    cache.sync(seq);
    mgl::tensor* t = cache.page_table(ctx, seq);
    std::vector<int32_t> v(size_t(t->nelements()));
    be.download(*t, v.data(), 0, v.size() * sizeof(int32_t));
    return v;
}

// Writes rows for positions [n_past, n_past + T) of `seq` in `layer` through mgl::kv_store.
void store_rows(mgl::backend& be, LatentKvCache& cache, int seq, int64_t layer, int64_t n_past,
                const std::vector<float>& c, const std::vector<float>& k_pe, int64_t T) {
    mgl::context ctx;
    const int64_t r = cache.width() - 6;
    mgl::tensor* tc = ctx.new_tensor(mgl::dtype::f32, {T, r}, "c");
    mgl::tensor* tk = ctx.new_tensor(mgl::dtype::f32, {T, 6}, "k_pe");
    mgl::tensor* tp = ctx.new_tensor(mgl::dtype::i32, {T}, "positions");
    auto inputs = be.alloc_buffer(mgl::nbytes(*tc) + mgl::nbytes(*tk) + mgl::nbytes(*tp));
    mgl::bind(*tc, *inputs, 0);
    mgl::bind(*tk, *inputs, mgl::nbytes(*tc));
    mgl::bind(*tp, *inputs, mgl::nbytes(*tc) + mgl::nbytes(*tk));
    std::vector<int32_t> pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) pos[size_t(t)] = int32_t(n_past + t);
    be.upload(*tc, c.data(), 0, mgl::nbytes(*tc));
    be.upload(*tk, k_pe.data(), 0, mgl::nbytes(*tk));
    be.upload(*tp, pos.data(), 0, mgl::nbytes(*tp));
    cache.sync(seq);
    mgl::tensor* out =
        mgl::kv_store(ctx, cache.layer_pages(ctx, layer), cache.page_table(ctx, seq), tc, tk, tp);
    mgl::graph g = mgl::build_graph(ctx, {out});
    be.allocate(g);
    be.compute(g);
    be.synchronize();
}

}  // namespace

TEST_CASE("kv cache: pages are taken as a sequence grows and given back on truncate") {
    auto be = mgl::make_cpu_backend(1);
    LatentKvCache cache(*be, small_params());
    CHECK(cache.width() == 19);
    CHECK(cache.bytes() == size_t(3 * 8 * 4 * 19 * 4));
    const int a = cache.new_sequence(), b = cache.new_sequence();
    CHECK(a != b);
    CHECK_THROWS_AS(cache.new_sequence(), mgl::error);  // two slots

    cache.reserve(a, 5);  // two pages
    CHECK(cache.free_pages() == 6);
    cache.advance(a, 5);
    CHECK(cache.length(a) == 5);
    cache.reserve(b, 3);
    cache.advance(b, 3);
    cache.reserve(a, 3);  // positions 5..7 fit the second page
    CHECK(cache.free_pages() == 5);
    cache.advance(a, 3);
    cache.reserve(a, 1);  // position 8 needs a third page
    cache.advance(a, 1);
    CHECK(cache.free_pages() == 4);

    const auto ta = download_table(*be, cache, a), tb = download_table(*be, cache, b);
    REQUIRE(ta.size() == 5);  // ceil(n_ctx / page_size)
    std::set<int32_t> used = {ta[0], ta[1], ta[2], tb[0]};
    CHECK(used.size() == 4);  // a's pages and b's page are distinct physical pages
    for (int32_t p : used) CHECK((p >= 0 && p < 8));

    cache.truncate(a, 4);  // exactly one page stays
    CHECK(cache.length(a) == 4);
    CHECK(cache.free_pages() == 6);
    CHECK(download_table(*be, cache, a)[0] == ta[0]);
    CHECK_THROWS_AS(cache.truncate(a, 5), mgl::error);
    CHECK_THROWS_AS(cache.advance(a, 1), mgl::error);   // position 4 has no page reserved
    CHECK_THROWS_AS(cache.reserve(a, 17), mgl::error);  // past n_ctx
    cache.free_sequence(b);
    CHECK(cache.free_pages() == 7);
    CHECK_THROWS_AS(cache.length(b), mgl::error);
    CHECK(cache.new_sequence() == b);
}

TEST_CASE("kv cache: the pool runs out cleanly") {
    auto be = mgl::make_cpu_backend(1);
    KvCacheParams p = small_params();
    p.n_pages = 3;
    LatentKvCache cache(*be, p);
    const int a = cache.new_sequence(), b = cache.new_sequence();
    cache.reserve(a, 8);
    CHECK_THROWS_AS(cache.reserve(b, 5), mgl::error);  // needs 2, 1 left
    cache.reserve(b, 4);
    CHECK(cache.free_pages() == 0);
}

TEST_CASE(
    "kv cache: rows written by kv_store are read back at their positions, across pages and "
    "layers") {
    auto be = mgl::make_cpu_backend(2);
    LatentKvCache cache(*be, small_params());
    const int a = cache.new_sequence(), b = cache.new_sequence();
    const int64_t r = 13, rope = 6;
    // Interleave the two sequences so that a's pages are not contiguous in the pool.
    std::vector<std::vector<float>> rows_a(11), rows_b(6);
    int64_t filled_a = 0, filled_b = 0;
    uint64_t seed = 100;
    auto write = [&](int seq, std::vector<std::vector<float>>& rows, int64_t& filled, int64_t T,
                     int64_t layer) {
        auto c = minids::test::random_floats(size_t(T * r), seed++);
        auto k = minids::test::random_floats(size_t(T * rope), seed++);
        cache.reserve(seq, T);
        store_rows(*be, cache, seq, layer, filled, c, k, T);
        for (int64_t t = 0; t < T; ++t) {
            auto& row = rows[size_t(filled + t)];
            row.assign(c.begin() + t * r, c.begin() + (t + 1) * r);
            row.insert(row.end(), k.begin() + t * rope, k.begin() + (t + 1) * rope);
        }
        cache.advance(seq, T);
        filled += T;
    };
    write(a, rows_a, filled_a, 3, 1);
    write(b, rows_b, filled_b, 5, 1);
    write(a, rows_a, filled_a, 7, 1);  // positions 3..9 cross pages 0, 1, 2
    write(b, rows_b, filled_b, 1, 1);
    write(a, rows_a, filled_a, 1, 1);
    std::vector<float> got(19);
    for (int64_t pos = 0; pos < 11; ++pos) {
        cache.read_row(a, 1, pos, got.data());
        CHECK(got == rows_a[size_t(pos)]);
    }
    for (int64_t pos = 0; pos < 6; ++pos) {
        cache.read_row(b, 1, pos, got.data());
        CHECK(got == rows_b[size_t(pos)]);
    }
    // Other layers are separate pools: writing layer 2 leaves layer 1 alone.
    cache.truncate(a, 0);
    filled_a = 0;
    write(a, rows_a, filled_a, 2, 2);
    cache.read_row(a, 2, 1, got.data());
    CHECK(got == rows_a[1]);
    cache.read_row(b, 1, 5, got.data());
    CHECK(got == rows_b[5]);
}

TEST_CASE("kv cache: an f16 cache takes bf16's bytes and reads rows back rounded to f16") {
    auto be = mgl::make_cpu_backend(1);
    KvCacheParams p = small_params();
    p.type = mgl::dtype::bf16;
    const size_t bf16_bytes = LatentKvCache(*be, p).bytes();
    p.type = mgl::dtype::f16;
    LatentKvCache cache(*be, p);
    CHECK(cache.bytes() == bf16_bytes);
    CHECK(cache.bytes() == size_t(3 * 8 * 4 * 19 * 2));
    const int a = cache.new_sequence();
    const int64_t r = 13, rope = 6, T = 6;
    // Values up to 40: f16 keeps 11 significant bits at every magnitude (bf16 would keep 8).
    const auto c = minids::test::random_floats(size_t(T * r), 7, -40.0f, 40.0f);
    const auto k = minids::test::random_floats(size_t(T * rope), 8, -40.0f, 40.0f);
    cache.reserve(a, T);
    store_rows(*be, cache, a, 0, 0, c, k, T);
    cache.advance(a, T);
    std::vector<float> got(19);
    for (int64_t pos = 0; pos < T; ++pos) {
        cache.read_row(a, 0, pos, got.data());
        for (int64_t i = 0; i < r + rope; ++i) {
            const float v = i < r ? c[size_t(pos * r + i)] : k[size_t(pos * rope + i - r)];
            CHECK(got[size_t(i)] == mgl::f16_to_f32(mgl::f32_to_f16(v)));
        }
    }
    p.type = mgl::dtype::i32;
    CHECK_THROWS_AS(LatentKvCache(*be, p), mgl::error);
}
