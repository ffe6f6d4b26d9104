// A decoder layer built like the model's (merged [q | kv_cmpr | k_pe] projection, the MLA
// prologue, absorbed attention over a paged cache, residuals, router, routed + shared experts,
// output head), small, on a parity-test side: every fusion of the CUDA backend applies to it.
#pragma once

#ifdef MINIDS_HAVE_CUDA
#include "cuda_parity_util.h"

namespace minids::test {

using mgl::dtype;

// Shapes of the layer (V2-Lite's structure, small).
namespace layer {
constexpr int64_t V = 50, D = 96, H = 4, nope = 16, rope = 8, v_dim = 16, r = 32;
constexpr int64_t E = 16, k = 4, F = 32, page_size = 8, n_pages = 9, max_pages = 8;
}  // namespace layer

struct layer_io {
    mgl::tensor* tokens = nullptr;
    mgl::tensor* positions = nullptr;
};

// One decoder layer plus the output head; returns {logits, expert ids, expert weights, cache}.
inline std::vector<mgl::tensor*> decoder_layer(side& s, int64_t T, dtype pages_type, dtype experts,
                                               layer_io& io) {
    using namespace layer;
    auto& c = s.ctx;
    auto rp = std::make_shared<const mgl::rope_params>(
        mgl::rope_params_yarn(int(rope), 10000.0f, 40.0f, 4096, 32.0f, 1.0f, 0.707f, 0.707f));
    const float eps = 1e-6f;
    std::vector<int32_t> tok(static_cast<size_t>(T)), pos(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
        tok[size_t(t)] = int32_t((t * 13 + 5) % V);
        pos[size_t(t)] = int32_t(t);
    }
    io.tokens = s.i32({T}, tok, "tokens");
    io.positions = s.i32({T}, pos, "positions");
    mgl::tensor* x = mgl::get_rows(c, s.random(dtype::bf16, {V, D}, 1, -1.0f, 1.0f, "embd"),
                                   io.tokens);  // [T, D]

    // MLA: merged [q | kv_cmpr | k_pe] projection of the normed input.
    mgl::tensor* n = mgl::rms_norm(c, x, s.random(dtype::bf16, {D}, 2, 0.5f, 1.5f), eps);
    const int64_t nq = H * (nope + rope);
    mgl::tensor* both = mgl::matmul(c, n, s.random(dtype::bf16, {nq + r + rope, D}, 3));
    mgl::tensor* q = mgl::contiguous(c, mgl::slice(c, both, 1, 0, nq));
    q = mgl::reshape(c, q, {T, H, nope + rope});
    mgl::tensor* kvr = mgl::slice(c, both, 1, nq, r + rope);  // [T, r + rope]
    mgl::tensor* q_pe = mgl::rope(c, mgl::slice(c, q, 2, nope, rope), io.positions, rp);
    mgl::tensor* kv_cmpr = mgl::rms_norm(c, mgl::slice(c, kvr, 1, 0, r),
                                         s.random(dtype::bf16, {r}, 4, 0.5f, 1.5f), eps);
    mgl::tensor* k_pe = mgl::rope(c, mgl::slice(c, kvr, 1, r, rope), io.positions, rp);
    mgl::tensor* pages = s.random(pages_type, {n_pages, page_size, r + rope}, 5, -1.0f, 1.0f);
    std::vector<int32_t> table(static_cast<size_t>(max_pages));
    for (int64_t p = 0; p < max_pages; ++p) table[size_t(p)] = int32_t((p * 4 + 3) % n_pages);
    mgl::tensor* page_table = s.i32({max_pages}, table, "page_table");
    mgl::tensor* stored = mgl::kv_store(c, pages, page_table, kv_cmpr, k_pe, io.positions);
    const int64_t es = 2, hs = (nope + v_dim) * r * es;
    mgl::tensor* kv_b = s.random(dtype::bf16, {H * (nope + v_dim), r}, 6);
    const int64_t wk_shape[] = {H, r, nope}, wk_stride[] = {hs, es, r * es};
    const int64_t wv_shape[] = {H, v_dim, r}, wv_stride[] = {hs, r * es, es};
    mgl::tensor* wk = mgl::view(c, kv_b, wk_shape, wk_stride, 0);
    mgl::tensor* wv = mgl::view(c, kv_b, wv_shape, wv_stride, size_t(nope * r * es));
    mgl::tensor* q_nope = mgl::permute(c, mgl::slice(c, q, 2, 0, nope), {1, 0, 2});
    mgl::tensor* q_lat = mgl::permute(c, mgl::matmul(c, q_nope, wk), {1, 0, 2});  // [T, H, r]
    mgl::tensor* o_lat = mgl::mla_attn(c, q_lat, q_pe, stored, page_table, io.positions, 0.2f);
    mgl::tensor* o = mgl::matmul(c, mgl::permute(c, o_lat, {1, 0, 2}), wv);  // [H, T, v]
    o = mgl::reshape(c, mgl::contiguous(c, mgl::permute(c, o, {1, 0, 2})), {T, H * v_dim});
    mgl::tensor* h = mgl::add(c, x, mgl::matmul(c, o, s.random(dtype::bf16, {D, H * v_dim}, 7)));

    // MoE: router, softmax / top-k / weights, routed + shared experts, residual.
    mgl::tensor* n2 = mgl::rms_norm(c, h, s.random(dtype::bf16, {D}, 8, 0.5f, 1.5f), eps);
    mgl::moe_route_params route;
    route.k = int(k);
    mgl::tensor* probs = mgl::softmax(c, mgl::matmul(c, n2, s.random(dtype::bf16, {E, D}, 9)));
    mgl::tensor* ids = mgl::moe_topk(c, probs, route);
    mgl::tensor* w = mgl::moe_weights(c, probs, ids, route);
    const expert_blobs ex(experts, E, D, F, 10);
    mgl::shared_expert shared{s.random(dtype::bf16, {2 * F, D}, 11, -0.5f, 0.5f),
                              s.random(dtype::bf16, {2 * F, D}, 12, -0.5f, 0.5f),
                              s.random(dtype::bf16, {D, 2 * F}, 13, -0.5f, 0.5f)};
    mgl::tensor* y =
        mgl::add(c, h, mgl::moe_experts(c, n2, ids, w, s.expert_table(ex), ex.layout, shared));
    mgl::tensor* logits =
        mgl::matmul(c, mgl::rms_norm(c, y, s.random(dtype::bf16, {D}, 14, 0.5f, 1.5f), eps),
                    s.random(dtype::bf16, {V, D}, 15));
    return {logits, ids, w, stored};
}

}  // namespace minids::test

#endif  // MINIDS_HAVE_CUDA
