// DeepSeek-V2 forward (MLA in absorbed form + fine-grained MoE), following DESIGN.md "The model,
// exactly" and the paper's names. Shapes are outermost first; T = tokens in the batch, D =
// hidden_size, H = heads, r = kv_lora_rank, nope/rope/v = the per-head dims.
#include "model/deepseek2.h"

#include <cstring>
#include <string>

#include "routing/prompt_chunk.h"

namespace minids {

namespace {

// Every intermediate carries its name and layer index ("q_pe-3"), so a run can be dumped and
// diffed against the reference layer by layer.
mgl::tensor* named(mgl::tensor* t, const char* name, int64_t il) {
    t->name = std::string(name) + "-" + std::to_string(il);
    return t;
}
mgl::tensor* named(mgl::tensor* t, const char* name) {
    t->name = name;
    return t;
}

std::string layer_prefix(int64_t il) { return "model.layers." + std::to_string(il) + "."; }

mgl::topk_method parse_topk_method(const std::string& s) {
    if (s == "greedy") return mgl::topk_method::greedy;
    if (s == "group_limited_greedy") return mgl::topk_method::group_limited_greedy;
    throw mds::FileError(
        "config topk_method: expected \"greedy\" or \"group_limited_greedy\", found \"" + s + "\"");
}

}  // namespace

Deepseek2Model::Deepseek2Model(const mds::MdsFile& file, mgl::backend& backend,
                               const WeightOptions& options)
    : file_(file),
      cfg_(file.config()),
      store_(std::make_unique<WeightStore>(file, backend, options)) {
    if (cfg_.scoring_func != "softmax") {
        throw mds::FileError(file_.path() +
                             ": config scoring_func: expected \"softmax\", found \"" +
                             cfg_.scoring_func + "\"");
    }
    const int64_t D = cfg_.hidden_size, V = cfg_.vocab_size;
    tok_embd_ = weight("model.embed_tokens.weight", {V, D});
    output_norm_ = weight("model.norm.weight", {D});
    output_ = cfg_.tie_word_embeddings ? tok_embd_ : weight("lm_head.weight", {V, D});
    layers_.resize(size_t(cfg_.num_hidden_layers));
    for (int64_t il = 0; il < cfg_.num_hidden_layers; ++il) {
        if (cfg_.is_moe_layer(il)) moe_layers_.push_back(il);
    }
    if (!moe_layers_.empty()) bind_expert_layout();
    for (int64_t il = 0; il < cfg_.num_hidden_layers; ++il) bind_layer(il);
    if (options.merge_projections && store_->copies()) merge_projections();
    if (store_->copies()) transpose_wk_b();
    store_->place(options.progress);

    const int64_t n_rot = cfg_.qk_rope_head_dim;
    if (cfg_.rope_scaling) {
        const YarnScaling& y = *cfg_.rope_scaling;
        rope_ = std::make_shared<const mgl::rope_params>(
            mgl::rope_params_yarn(int(n_rot), float(cfg_.rope_theta), float(y.factor),
                                  int(y.original_max_position_embeddings), float(y.beta_fast),
                                  float(y.beta_slow), float(y.mscale), float(y.mscale_all_dim)));
    } else {
        rope_ = std::make_shared<const mgl::rope_params>(
            mgl::rope_params_plain(int(n_rot), float(cfg_.rope_theta)));
    }
    kq_scale_ = float(cfg_.attention_scale());

    route_.k = int(cfg_.num_experts_per_tok);
    route_.method = parse_topk_method(cfg_.topk_method);
    route_.n_group = int(cfg_.n_group);
    route_.topk_group = int(cfg_.topk_group);
    route_.norm_topk_prob = cfg_.norm_topk_prob;
    route_.routed_scaling_factor = float(cfg_.routed_scaling_factor);
}

mgl::tensor* Deepseek2Model::weight(const std::string& name, std::vector<int64_t> shape) {
    const mds::TensorEntry& e = file_.require(name, shape);
    mgl::tensor* t = weights_.new_tensor(e.dtype, std::span<const int64_t>(shape), name);
    store_->add(t, e.data, e.nbytes);
    weight_bytes_ += e.nbytes;
    return t;
}

void Deepseek2Model::merge_projections() {
    // One matmul over [q (or q_a) | kv_a] instead of two: both read the normed hidden state.
    for (size_t il = 0; il < layers_.size(); ++il) {
        Deepseek2Layer& L = layers_[il];
        mgl::tensor* q = L.wq ? L.wq : L.wq_a;
        if (q->type != L.wkv_a_mqa->type) continue;
        const int64_t rows = q->dim(0) + L.wkv_a_mqa->dim(0), D = cfg_.hidden_size;
        L.wq_kv_a = weights_.new_tensor(q->type, {rows, D},
                                        layer_prefix(int64_t(il)) + "self_attn.q_kv_a_merged");
        auto bytes = [](const mgl::tensor* t) {
            return std::span<const uint8_t>(static_cast<const uint8_t*>(t->data), mgl::nbytes(*t));
        };
        store_->add_concat(L.wq_kv_a, {bytes(q), bytes(L.wkv_a_mqa)});
        // The parts are only read through the merged weight: not copied (~400 MiB for V2-Lite).
        store_->forget(q);
        store_->forget(L.wkv_a_mqa);
    }
}

void Deepseek2Model::transpose_wk_b() {
    // wk_b is W_uk viewed transposed (inner stride r): a matmul against it reads columns. Where
    // the weights are copied anyway, store it transposed ([H, r, nope], rows contiguous) so the
    // per-head products run on the row-streaming matrix-vector kernel.
    const ModelConfig& c = cfg_;
    const int64_t H = c.num_attention_heads, r = c.kv_lora_rank, nope = c.qk_nope_head_dim;
    const int64_t v = c.v_head_dim;
    for (size_t il = 0; il < layers_.size(); ++il) {
        Deepseek2Layer& L = layers_[il];
        const mgl::tensor* src = L.wk_b->src[0];  // kv_b_proj [H·(nope+v), r]
        const size_t es = mgl::dtype_size(src->type);
        const auto* in = static_cast<const uint8_t*>(src->data);
        std::vector<uint8_t> out(size_t(H * r * nope) * es);
        for (int64_t h = 0; h < H; ++h)
            for (int64_t j = 0; j < nope; ++j)
                for (int64_t i = 0; i < r; ++i)
                    std::memcpy(&out[size_t((h * r + i) * nope + j) * es],
                                &in[size_t((h * (nope + v) + j) * r + i) * es], es);
        mgl::tensor* t = weights_.new_tensor(src->type, {H, r, nope},
                                             layer_prefix(int64_t(il)) + "self_attn.wk_b");
        store_->add_owned(t, std::move(out));
        L.wk_b = t;
    }
}

void Deepseek2Model::bind_layer(int64_t il) {
    const ModelConfig& c = cfg_;
    const int64_t D = c.hidden_size, H = c.num_attention_heads, r = c.kv_lora_rank;
    const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, v = c.v_head_dim;
    const std::string p = layer_prefix(il);
    Deepseek2Layer& L = layers_[size_t(il)];

    L.attn_norm = weight(p + "input_layernorm.weight", {D});
    if (c.q_lora_rank) {
        L.wq_a = weight(p + "self_attn.q_a_proj.weight", {*c.q_lora_rank, D});
        L.q_a_norm = weight(p + "self_attn.q_a_layernorm.weight", {*c.q_lora_rank});
        L.wq_b = weight(p + "self_attn.q_b_proj.weight", {H * (nope + rope), *c.q_lora_rank});
    } else {
        L.wq = weight(p + "self_attn.q_proj.weight", {H * (nope + rope), D});
    }
    L.wkv_a_mqa = weight(p + "self_attn.kv_a_proj_with_mqa.weight", {r + rope, D});
    L.kv_a_norm = weight(p + "self_attn.kv_a_layernorm.weight", {r});

    // kv_b_proj [H·(nope+v), r] is, per head, W_uk [nope, r] stacked on W_uv [v, r]. Both are
    // used in place through strided views (absorbed MLA never forms per-head K or V):
    //   wk_b = W_ukᵀ as [H, r, nope] so that q_lat = q_nope · W_uk is a matmul against it;
    //   wv_b = W_uv  as [H, v, r]    so that o = o_lat · W_uvᵀ.
    mgl::tensor* wkv_b = weight(p + "self_attn.kv_b_proj.weight", {H * (nope + v), r});
    const int64_t es = int64_t(mgl::dtype_size(wkv_b->type));
    const int64_t head_stride = (nope + v) * r * es;
    const int64_t wk_shape[] = {H, r, nope}, wk_stride[] = {head_stride, es, r * es};
    L.wk_b = mgl::view(weights_, wkv_b, wk_shape, wk_stride, 0);
    L.wk_b->name = p + "self_attn.kv_b_proj.wk_b";
    const int64_t wv_shape[] = {H, v, r}, wv_stride[] = {head_stride, r * es, es};
    L.wv_b = mgl::view(weights_, wkv_b, wv_shape, wv_stride, size_t(nope * r * es));
    L.wv_b->name = p + "self_attn.kv_b_proj.wv_b";

    L.wo = weight(p + "self_attn.o_proj.weight", {D, H * v});
    L.ffn_norm = weight(p + "post_attention_layernorm.weight", {D});

    L.is_moe = c.is_moe_layer(il);
    if (!L.is_moe) {
        const int64_t ff = c.intermediate_size;
        L.ffn_gate = weight(p + "mlp.gate_proj.weight", {ff, D});
        L.ffn_up = weight(p + "mlp.up_proj.weight", {ff, D});
        L.ffn_down = weight(p + "mlp.down_proj.weight", {D, ff});
        return;
    }
    L.router = weight(p + "mlp.gate.weight", {c.n_routed_experts, D});
    const mds::ExpertTable& t = file_.experts();
    const int64_t first = t.first_blob_of_layer(il), E = c.n_routed_experts;
    const std::string where = file_.path() + ": experts of layer " + std::to_string(il);
    if (first < 0 || first + E > int64_t(t.blobs.size())) {
        throw mds::FileError(where + ": expected " + std::to_string(E) +
                             " expert blobs, found none or fewer");
    }
    std::vector<const uint8_t*> blobs;
    for (int64_t e = 0; e < E; ++e) {
        const mds::ExpertBlob& b = t.blobs[size_t(first + e)];
        if (b.layer != il || b.expert != e) {
            throw mds::FileError(where + ": expected blob for expert " + std::to_string(e) +
                                 ", found layer " + std::to_string(b.layer) + " expert " +
                                 std::to_string(b.expert));
        }
        blobs.push_back(b.data);
    }
    L.expert_table = store_->add_expert_table(weights_, il, std::move(blobs), t.blob_nbytes);
    weight_bytes_ += uint64_t(E) * t.blob_nbytes;
    if (c.n_shared_experts && *c.n_shared_experts > 0) {
        const int64_t ff = c.moe_intermediate_size * *c.n_shared_experts;
        L.ffn_gate = weight(p + "mlp.shared_experts.gate_proj.weight", {ff, D});
        L.ffn_up = weight(p + "mlp.shared_experts.up_proj.weight", {ff, D});
        L.ffn_down = weight(p + "mlp.shared_experts.down_proj.weight", {D, ff});
    }
}

void Deepseek2Model::bind_expert_layout() {
    const mds::ExpertTable& t = file_.experts();
    const std::string where = file_.path() + ": experts";
    if (!t.present) throw mds::FileError(where + ": expected an expert table, found none");
    if (t.n_embd != cfg_.hidden_size || t.n_ff != cfg_.moe_intermediate_size) {
        throw mds::FileError(where + ": expected n_embd " + std::to_string(cfg_.hidden_size) +
                             " and n_ff " + std::to_string(cfg_.moe_intermediate_size) +
                             ", found " + std::to_string(t.n_embd) + " and " +
                             std::to_string(t.n_ff));
    }
    auto L = std::make_shared<mgl::expert_layout>();
    L->type = t.dtype;
    L->n_embd = t.n_embd;
    L->n_ff = t.n_ff;
    L->gate = t.gate.offset;
    L->up = t.up.offset;
    L->down = t.down.offset;
    if (t.dtype == mgl::dtype::f8_e4m3) {
        L->gate_scale = t.gate_scale.offset;
        L->up_scale = t.up_scale.offset;
        L->down_scale = t.down_scale.offset;
    }
    L->blob_bytes = t.blob_nbytes;
    expert_layout_ = std::move(L);
}

// MLA, absorbed (DESIGN.md): the cache holds c and k_pe; W_uk is folded into the query and W_uv
// is applied after attention, so per-head K and V never exist.
mgl::tensor* Deepseek2Model::build_attention(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                                             mgl::tensor* x, const ForwardBatch& batch) const {
    const ModelConfig& c = cfg_;
    const int64_t T = x->dim(0), H = c.num_attention_heads, r = c.kv_lora_rank;
    const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, v = c.v_head_dim;
    // q_a_layernorm and kv_a_layernorm use DeepSeek's default eps (1e-6), not rms_norm_eps: both
    // DeepSeek's modeling_deepseek.py and transformers construct them without passing the config's
    // eps (docs/fidelity.md); only the layer norms and the final norm read rms_norm_eps.
    const float latent_eps = 1e-6f;
    mgl::tensor* pages = batch.kv_pages[size_t(il)];
    mgl::tensor* page_table = batch.page_table;

    // The first query projection (q, or q_a with q_lora_rank) and the latent projection read the
    // same input; with merged weights they are one matmul whose columns are split by views.
    mgl::tensor* q_first;     // [T, H·(nope+rope)] or [T, q_lora_rank]
    mgl::tensor* kv_cmpr_pe;  // [T, r+rope]
    const char* q_first_name = L.wq ? "q" : "q_a";
    if (L.wq_kv_a) {
        mgl::tensor* both = named(mgl::matmul(ctx, x, L.wq_kv_a), "q_kv_a", il);
        const int64_t nq = both->dim(1) - (r + rope);
        q_first = named(mgl::slice(ctx, both, 1, 0, nq), q_first_name, il);
        kv_cmpr_pe = named(mgl::slice(ctx, both, 1, nq, r + rope), "kv_cmpr_pe", il);
    } else {
        q_first = named(mgl::matmul(ctx, x, L.wq ? L.wq : L.wq_a), q_first_name, il);
        kv_cmpr_pe = named(mgl::matmul(ctx, x, L.wkv_a_mqa), "kv_cmpr_pe", il);
    }

    mgl::tensor* q = q_first;  // [T, H·(nope+rope)]
    if (!L.wq) {
        mgl::tensor* q_a =
            named(mgl::rms_norm(ctx, q_first, L.q_a_norm, latent_eps), "q_a_norm", il);
        q = named(mgl::matmul(ctx, q_a, L.wq_b), "q", il);
    }
    // A reshape needs a contiguous source; the merged matmul's slice is not.
    if (!q->is_contiguous()) q = named(mgl::contiguous(ctx, q), "q", il);
    q = mgl::reshape(ctx, q, {T, H, nope + rope});                              // [T, H, nope+rope]
    mgl::tensor* q_nope = named(mgl::slice(ctx, q, 2, 0, nope), "q_nope", il);  // [T, H, nope]
    mgl::tensor* q_pe = named(mgl::slice(ctx, q, 2, nope, rope), "q_pe_raw", il);  // [T, H, rope]
    q_pe = named(mgl::rope(ctx, q_pe, batch.positions, rope_), "q_pe", il);        // [T, H, rope]

    mgl::tensor* kv_cmpr =
        named(mgl::slice(ctx, kv_cmpr_pe, 1, 0, r), "kv_cmpr_raw", il);  // [T, r]
    mgl::tensor* k_pe =
        named(mgl::slice(ctx, kv_cmpr_pe, 1, r, rope), "k_pe_raw", il);  // [T, rope]
    kv_cmpr = named(mgl::rms_norm(ctx, kv_cmpr, L.kv_a_norm, latent_eps), "kv_cmpr", il);  // [T, r]
    k_pe = named(mgl::rope(ctx, k_pe, batch.positions, rope_), "k_pe", il);  // [T, rope]

    // q_lat[t, h] = q_nope[t, h] · W_uk[h]: one matmul batched over heads. (mgl ops read their
    // inputs through strides, so the permuted views need no copies.)
    q_nope = mgl::permute(ctx, q_nope, {1, 0, 2});                                // [H, T, nope]
    mgl::tensor* q_lat = named(mgl::matmul(ctx, q_nope, L.wk_b), "q_lat_h", il);  // [H, T, r]
    q_lat = named(mgl::permute(ctx, q_lat, {1, 0, 2}), "q_lat", il);              // [T, H, r]

    pages = named(mgl::kv_store(ctx, pages, page_table, kv_cmpr, k_pe, batch.positions), "kv_pages",
                  il);
    // o_lat[t, h] = Σ_{s <= pos_t} softmax_s((q_lat·c_s + q_pe·k_pe_s)·scale) c_s: [T, H, r]
    mgl::tensor* o_lat =
        mgl::mla_attn(ctx, q_lat, q_pe, pages, page_table, batch.positions, kq_scale_);
    o_lat = named(o_lat, "o_lat", il);

    // o[t, h] = W_uv[h] · o_lat[t, h], batched over heads.
    o_lat = mgl::permute(ctx, o_lat, {1, 0, 2});                         // [H, T, r]
    mgl::tensor* o = named(mgl::matmul(ctx, o_lat, L.wv_b), "o_h", il);  // [H, T, v]
    // [T, H, v]; a reshape needs a contiguous source: a copy for a prompt, none for one token
    // (the permuted view of [H, 1, v] is already contiguous).
    o = mgl::permute(ctx, o, {1, 0, 2});
    if (!o->is_contiguous()) o = mgl::contiguous(ctx, o);
    o = named(mgl::reshape(ctx, o, {T, H * v}), "o", il);     // [T, H·v]
    return named(mgl::matmul(ctx, o, L.wo), "attn_out", il);  // [T, D]
}

mgl::tensor* Deepseek2Model::build_router(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                                          mgl::tensor* x, mgl::tensor*& probs,
                                          const mgl::moe_route_params& route) const {
    mgl::tensor* logits = named(mgl::matmul(ctx, x, L.router), "router_logits", il);  // [T, E]
    probs = named(mgl::softmax(ctx, logits), "router_probs", il);                     // [T, E]
    return named(mgl::moe_topk(ctx, probs, route), "expert_ids", il);                 // [T, k] i32
}

mgl::tensor* Deepseek2Model::build_routing_prediction(mgl::context& ctx, int64_t il, mgl::tensor* h,
                                                      int k) const {
    MGL_CHECK(il >= 0 && il < cfg_.num_hidden_layers && layers_[size_t(il)].is_moe,
              "routing prediction: layer " + std::to_string(il) + " is not a MoE layer");
    const Deepseek2Layer& L = layers_[size_t(il)];
    mgl::tensor* x =
        named(mgl::rms_norm(ctx, h, L.ffn_norm, float(cfg_.rms_norm_eps)), "predicted_norm", il);
    mgl::moe_route_params route = route_;
    if (k > 0) route.k = std::min(k, route_.k);
    mgl::tensor* probs = nullptr;
    mgl::tensor* ids = build_router(ctx, L, il, x, probs, route);
    probs->name = "predicted_probs-" + std::to_string(il);
    return named(ids, "predicted_ids", il);
}

mgl::tensor* Deepseek2Model::build_ffn(mgl::context& ctx, const Deepseek2Layer& L, int64_t il,
                                       mgl::tensor* x, const ForwardBatch& batch, size_t moe_index,
                                       ForwardResult& result, FetchChain& fetch) const {
    if (!L.is_moe) {  // dense SwiGLU MLP: down(silu(gate(x)) * up(x))
        mgl::tensor* gate = named(mgl::matmul(ctx, x, L.ffn_gate), "ffn_gate", il);
        mgl::tensor* up = named(mgl::matmul(ctx, x, L.ffn_up), "ffn_up", il);
        mgl::tensor* act = named(mgl::swiglu(ctx, gate, up), "ffn_act", il);
        return named(mgl::matmul(ctx, act, L.ffn_down), "ffn_out", il);  // [T, D]
    }
    mgl::tensor* probs = nullptr;
    mgl::tensor* ids = build_router(ctx, L, il, x, probs, route_);  // [T, k] i32
    mgl::tensor* w =
        named(mgl::moe_weights(ctx, probs, ids, route_), "expert_weights", il);  // [T, k]
    result.router_ids.push_back(ids);
    result.router_weights.push_back(w);
    if (!batch.routing_ids.empty()) {  // imposed routing (the router above still runs)
        ids = batch.routing_ids[moe_index];
        w = batch.routing_weights[moe_index];
    }
    // Σ_k w_k · Expert_k(x) + Shared(x), the shared expert being absent when ffn_gate is null.
    const mgl::shared_expert shared{L.ffn_gate, L.ffn_up, L.ffn_down};
    mgl::tensor* table = fetch.table ? fetch.table : L.expert_table;
    fetch.table = nullptr;
    if (batch.expert_fetch) {
        table = named(mgl::expert_fetch(ctx, table, ids, batch.expert_fetch, int(moe_index),
                                        expert_layout_, batch.expert_stage),
                      "expert_fetch", il);
        fetch.last_fetch = table;
        fetch.last_ids = ids;
        fetch.last_weights = w;
        // A prompt chunk (T·k >= E: nearly every expert of the layer is used): the misses the
        // fetch left home are copied into slots the cache lent the chunk, and the experts read
        // them there (docs/expert-cache.md, "Prefill").
        if (batch.expert_prompt_stage &&
            routing::is_prompt_chunk(ids->shape[0], ids->shape[1], table->shape[0]))
            table = named(mgl::expert_prompt_stage(ctx, table, ids, batch.expert_fetch,
                                                   expert_layout_, batch.expert_prompt_stage),
                          "expert_prompt_stage", il);
    }
    return named(mgl::moe_experts(ctx, x, ids, w, table, expert_layout_, shared), "ffn_out",
                 il);  // [T, D]
}

ForwardResult Deepseek2Model::build_forward(mgl::context& ctx, const ForwardBatch& batch) const {
    const float eps = float(cfg_.rms_norm_eps);
    const int64_t T = batch.tokens->dim(0);
    MGL_CHECK(T > 0 && batch.positions->dim(0) == T,
              "forward: tokens and positions must have the same length");
    MGL_CHECK(batch.kv_pages.size() == size_t(cfg_.num_hidden_layers) && batch.page_table,
              "forward: the batch needs one cache page pool per layer and a page table");
    MGL_CHECK(batch.routing_ids.size() == batch.routing_weights.size() &&
                  (batch.routing_ids.empty() || batch.routing_ids.size() == moe_layers_.size()),
              "forward: imposed routing needs ids and weights for every MoE layer");

    ForwardResult result;
    mgl::tensor* x = named(mgl::get_rows(ctx, tok_embd_, batch.tokens), "inp_embd");  // [T, D]
    // Prefetch (decode only: a prompt chunk streams nearly every expert anyway, and imposed
    // routing is not what the routers would predict).
    const bool prefetch = batch.expert_fetch && !batch.expert_stage && batch.expert_prefetch > 0 &&
                          T == 1 && batch.routing_ids.empty();
    size_t moe_index = 0;
    FetchChain fetch;
    for (int64_t il = 0; il < cfg_.num_hidden_layers; ++il) {
        const Deepseek2Layer& L = layers_[size_t(il)];
        mgl::tensor* cur = named(mgl::rms_norm(ctx, x, L.attn_norm, eps), "attn_norm", il);
        cur = build_attention(ctx, L, il, cur, batch);
        x = named(mgl::add(ctx, x, cur), "ffn_inp", il);  // h = x + MLA(norm(x))
        cur = named(mgl::rms_norm(ctx, x, L.ffn_norm, eps), "ffn_norm", il);
        cur = build_ffn(ctx, L, il, cur, batch, moe_index, result, fetch);
        if (L.is_moe) {
            ++moe_index;
            if (prefetch && moe_index < moe_layers_.size()) {
                // The next MoE layer's likely experts, from this layer's FFN input: known before
                // this layer's experts run, so their copies can run beside them.
                const int64_t next = moe_layers_[moe_index];
                mgl::tensor* predicted =
                    build_routing_prediction(ctx, next, x, batch.expert_prefetch);
                fetch.table =
                    named(mgl::expert_prefetch(ctx, layers_[size_t(next)].expert_table, predicted,
                                               batch.expert_fetch, int(moe_index), expert_layout_,
                                               fetch.last_ids, int(moe_index - 1), fetch.last_fetch,
                                               batch.expert_prefetch_fills),
                          "expert_prefetch", next);
                // In the graph's order: the layer's routing weights and fetch (the route step
                // that writes the ids the prefetch protects runs before it), then the prediction
                // and the prefetch (on the CUDA backend beside this layer's experts). Placing the
                // prediction earlier, beside the layer's own routing, measured no faster: it
                // then queues behind the previous prefetch's copy on the side stream.
                result.schedule.push_back(fetch.last_weights);
                result.schedule.push_back(fetch.last_fetch);
                result.schedule.push_back(fetch.table);
            }
        }
        x = named(mgl::add(ctx, x, cur), "l_out", il);  // y = h + FFN(norm(h))
    }
    if (!batch.all_logits) x = mgl::slice(ctx, x, 0, T - 1, 1);  // [1, D]
    x = named(mgl::rms_norm(ctx, x, output_norm_, eps), "result_norm");
    result.logits = named(mgl::matmul(ctx, x, output_), "result_output");  // [T or 1, V]
    return result;
}

}  // namespace minids
