// CUDA-vs-CPU parity of the model's heavy ops: moe_experts (every expert dtype, decode and
// grouped paths, shared expert, scrambled expert table, imposed ids, the residual epilogue) and
// kv_store + mla_attn (f32, bf16 and f16 pages, scrambled page table, jumping positions, decode
// and prefill kernels). Bounds as in test_backend_cuda_ops.cpp: FP32 paths 1e-5 (1e-4 for MLA
// decode's split merge), paths that round activations to BF16 on tensor cores 2e-2 (to F16:
// 2e-3), the cache rows written by kv_store exactly.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include "cuda_parity_util.h"

using namespace minids::test;
using mgl::dtype;

namespace {

const bool no_gpu = !cuda_device_available();

std::vector<int32_t> random_ids(size_t n, int32_t E, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> v(n);
    for (auto& id : v) id = int32_t(rng() % uint64_t(E));
    return v;
}

}  // namespace

TEST_CASE("cuda moe_experts: every expert dtype, decode and grouped paths, shared expert" *
          doctest::skip(no_gpu)) {
    auto be = mgl::make_cuda_backend();
    worst_errors log;
    const int64_t E = 16, k = 4;
    // (D, F): tensor-core friendly, and one the grouped path runs on its FP32 SIMT kernels.
    for (auto [D, F] : {std::pair<int64_t, int64_t>{96, 48}, {40, 24}}) {
        for (dtype type : {dtype::f32, dtype::bf16, dtype::f8_e4m3}) {
            for (int64_t T : {1, 5, 8, 40}) {
                for (bool with_shared : {false, true}) {
                    CAPTURE(D);
                    CAPTURE(std::string(mgl::dtype_name(type)));
                    CAPTURE(T);
                    CAPTURE(with_shared);
                    const bool tensor_cores = T > 8 && D % 16 == 0 && F % 16 == 0;
                    const double bound = tensor_cores ? 2e-2 : 1e-5;
                    const expert_blobs ex(type, E, D, F, 500);
                    check_parity(
                        "moe_experts", *be,
                        [&](side& s) -> std::vector<mgl::tensor*> {
                            mgl::tensor* x = s.random(dtype::f32, {T, D}, 501, -2.0f, 2.0f);
                            mgl::tensor* ids =
                                s.i32({T, k}, random_ids(size_t(T * k), int32_t(E), 502));
                            mgl::tensor* w = s.random(dtype::f32, {T, k}, 503, 0.1f, 1.0f);
                            mgl::shared_expert shared;
                            if (with_shared) {
                                shared.gate = s.random(dtype::bf16, {2 * F, D}, 504, -0.5f, 0.5f);
                                shared.up = s.random(dtype::bf16, {2 * F, D}, 505, -0.5f, 0.5f);
                                shared.down = s.random(dtype::bf16, {D, 2 * F}, 506, -0.5f, 0.5f);
                            }
                            mgl::tensor* y = mgl::moe_experts(s.ctx, x, ids, w, s.expert_table(ex),
                                                              ex.layout, shared);
                            // The residual add is fused into the experts' output on the GPU.
                            mgl::tensor* h = s.random(dtype::f32, {T, D}, 507);
                            return {mgl::add(s.ctx, h, y)};
                        },
                        {bound}, &log);
                }
            }
        }
    }
    MESSAGE(log.str());
}

namespace {

struct mla_case {
    dtype pages_type;
    int64_t H;
    std::vector<int32_t> positions;  // one per query token
};

// A cache of 12 pages of 16 rows filled with random rows, a 10-entry page table mapping logical
// pages to scrambled physical pages, then kv_store of T new rows and attention over the cache.
std::vector<mgl::tensor*> mla_graph(side& s, const mla_case& c) {
    const int64_t r = 64, rope = 16, page_size = 16, n_pages = 12, max_pages = 10;
    const int64_t T = int64_t(c.positions.size());
    mgl::tensor* pages =
        s.random(c.pages_type, {n_pages, page_size, r + rope}, 601, -1.0f, 1.0f, "pages");
    std::vector<int32_t> table(static_cast<size_t>(max_pages));
    for (int64_t p = 0; p < max_pages; ++p) table[size_t(p)] = int32_t((p * 5 + 7) % n_pages);
    mgl::tensor* page_table = s.i32({max_pages}, table, "page_table");
    mgl::tensor* positions = s.i32({T}, c.positions, "positions");
    // c and k_pe as column slices of one [T, r + rope] row tensor, as the model has them.
    mgl::tensor* kv = s.random(dtype::f32, {T, r + rope}, 602, -1.0f, 1.0f, "kv");
    mgl::tensor* stored = mgl::kv_store(s.ctx, pages, page_table, mgl::slice(s.ctx, kv, 1, 0, r),
                                        mgl::slice(s.ctx, kv, 1, r, rope), positions);
    // q_lat as the model makes it: a permuted [T, H, r] view.
    mgl::tensor* q_lat = mgl::permute(
        s.ctx, s.random(dtype::f32, {c.H, T, r}, 603, -1.0f, 1.0f, "q_lat_h"), {1, 0, 2});
    mgl::tensor* q_pe = s.random(dtype::f32, {T, c.H, rope}, 604, -1.0f, 1.0f, "q_pe");
    mgl::tensor* o = mgl::mla_attn(s.ctx, q_lat, q_pe, stored, page_table, positions, 0.125f);
    return {o, stored};
}

}  // namespace

TEST_CASE("cuda kv_store + mla_attn: page dtypes, scrambled page table, jumping positions" *
          doctest::skip(no_gpu)) {
    auto be = mgl::make_cuda_backend();
    worst_errors log;
    std::vector<int32_t> prefill(40);
    for (int32_t i = 0; i < 40; ++i) prefill[size_t(i)] = 60 + i;
    for (dtype pages_type : {dtype::f32, dtype::bf16, dtype::f16}) {
        const std::vector<mla_case> cases = {
            {pages_type, 16, {100}},          // one decode token deep in the cache
            {pages_type, 16, {0}},            // the very first position
            {pages_type, 4, {37, 5, 99}},     // positions out of order, crossing pages
            {pages_type, 16, {159, 64, 63}},  // the last row of the table; page boundaries
            {pages_type, 4, prefill},         // prefill tiles (T·H > 64)
        };
        for (const mla_case& c : cases) {
            CAPTURE(std::string(mgl::dtype_name(pages_type)));
            CAPTURE(c.H);
            CAPTURE(c.positions.size());
            CAPTURE(c.positions[0]);
            // FP32 math only for decode over f32 pages; bf16 pages and prefill tiles run on
            // tensor cores (q and probabilities rounded to BF16: measured 1.6-1.7e-3), f16 pages
            // on f16 tensor cores (8x less rounding than BF16; not yet measured).
            const bool decode = int64_t(c.positions.size()) * c.H <= 64;
            const bool exact = decode && pages_type == dtype::f32;
            const double bound = exact ? 1e-4 : pages_type == dtype::f16 ? 2e-3 : 2e-2;
            check_parity(
                "mla", *be, [&](side& s) { return mla_graph(s, c); }, {bound, 1e-7}, &log);
        }
    }
    MESSAGE(log.str());
}

#endif  // MINIDS_HAVE_CUDA
