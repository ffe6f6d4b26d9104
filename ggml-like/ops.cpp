// Op constructors: check shapes and dtypes, then record the op. Nothing is computed here.
// Parameter slots used by each op are listed in mgl.h next to its constructor.
#include <algorithm>
#include <cmath>
#include <numbers>

#include "mgl.h"

namespace mgl {

namespace {

std::span<const int64_t> dims_of(const tensor& t) { return {t.shape.data(), size_t(t.n_dims)}; }

std::string describe(const tensor& t) {
    return "'" + t.name + "' " + dtype_name(t.type) + " " + shape_str(t);
}

void check_f32(const tensor* t, const char* op, const char* what) {
    MGL_CHECK(t != nullptr, std::string(op) + ": " + what + " is null");
    MGL_CHECK(t->type == dtype::f32,
              std::string(op) + ": " + what + " must be f32, found " + describe(*t));
}

void check_i32_vector(const tensor* t, const char* op, const char* what) {
    MGL_CHECK(t != nullptr, std::string(op) + ": " + what + " is null");
    MGL_CHECK(t->type == dtype::i32 && t->n_dims == 1,
              std::string(op) + ": " + what + " must be an i32 vector, found " + describe(*t));
}

bool is_float_type(dtype t) { return t != dtype::i32 && t != dtype::i64; }

bool is_weight_type(dtype t) { return t == dtype::f32 || t == dtype::bf16 || t == dtype::f8_e4m3; }

// b broadcasts over a when its dims, aligned to the innermost, each equal a's or are 1.
bool broadcasts_to(const tensor& b, const tensor& a) {
    if (b.n_dims > a.n_dims) return false;
    for (int i = 1; i <= b.n_dims; ++i) {
        int64_t db = b.shape[size_t(b.n_dims - i)], da = a.shape[size_t(a.n_dims - i)];
        if (db != da && db != 1) return false;
    }
    return true;
}

tensor* elementwise(context& c, op o, tensor* a, tensor* b) {
    check_f32(a, op_name(o), "a");
    check_f32(b, op_name(o), "b");
    MGL_CHECK(broadcasts_to(*b, *a), std::string(op_name(o)) + ": " + describe(*b) +
                                         " does not broadcast to " + describe(*a));
    tensor* t = c.new_node(o, dtype::f32, dims_of(*a));
    t->src = {a, b};
    return t;
}

}  // namespace

tensor* get_rows(context& c, tensor* table, tensor* ids, tensor* table_scale) {
    MGL_CHECK(table && table->n_dims == 2 && is_float_type(table->type),
              "get_rows: table must be a 2-D float tensor");
    check_i32_vector(ids, "get_rows", "ids");
    if (table_scale) {
        check_f32(table_scale, "get_rows", "scale");
        MGL_CHECK(table_scale->nelements() == table->shape[0] && table_scale->is_contiguous(),
                  "get_rows: scale " + describe(*table_scale) + " must have one entry per row of " +
                      describe(*table));
    }
    int64_t shape[2] = {ids->shape[0], table->shape[1]};
    tensor* t = c.new_node(op::get_rows, dtype::f32, shape);
    t->src = {table, ids, table_scale};
    return t;
}

tensor* matmul(context& c, tensor* x, tensor* w, tensor* w_scale) {
    check_f32(x, "matmul", "x");
    MGL_CHECK(w && is_weight_type(w->type) && (w->n_dims == 2 || w->n_dims == 3),
              "matmul: w must be a 2-D or 3-D f32/bf16/f8_e4m3 tensor");
    MGL_CHECK(x->n_dims >= 2, "matmul: x must have at least 2 dims, found " + describe(*x));
    int64_t K = w->shape[size_t(w->n_dims - 1)], N = w->shape[size_t(w->n_dims - 2)];
    MGL_CHECK(x->shape[size_t(x->n_dims - 1)] == K,
              "matmul: inner dims differ: x " + describe(*x) + " · wᵀ " + describe(*w));
    if (w->n_dims == 3) {
        MGL_CHECK(x->n_dims >= 3 && x->shape[size_t(x->n_dims - 3)] == w->shape[0],
                  "matmul: batched w " + describe(*w) +
                      " needs x dim -3 equal to its batch, found " + describe(*x));
    }
    if (w_scale) {
        check_f32(w_scale, "matmul", "w_scale");
        MGL_CHECK(w->type == dtype::f8_e4m3,
                  "matmul: w_scale given for a non-f8 weight " + describe(*w));
        int64_t rows = w->n_dims == 3 ? w->shape[0] * N : N;
        MGL_CHECK(w_scale->nelements() == rows && w_scale->is_contiguous(),
                  "matmul: w_scale " + describe(*w_scale) + " must hold one f32 per row of " +
                      describe(*w));
    }
    std::array<int64_t, max_dims> shape = x->shape;
    shape[size_t(x->n_dims - 1)] = N;
    tensor* t = c.new_node(op::matmul, dtype::f32,
                           std::span<const int64_t>(shape.data(), size_t(x->n_dims)));
    t->src = {x, w, w_scale};
    return t;
}

tensor* add(context& c, tensor* a, tensor* b) { return elementwise(c, op::add, a, b); }
tensor* mul(context& c, tensor* a, tensor* b) { return elementwise(c, op::mul, a, b); }

tensor* scale(context& c, tensor* a, float s) {
    check_f32(a, "scale", "a");
    tensor* t = c.new_node(op::scale, dtype::f32, dims_of(*a));
    t->src[0] = a;
    t->fparams[0] = s;
    return t;
}

tensor* rms_norm(context& c, tensor* x, tensor* w, float eps) {
    check_f32(x, "rms_norm", "x");
    MGL_CHECK(x->n_dims >= 1, "rms_norm: x must have at least one dim");
    if (w) {
        MGL_CHECK((w->type == dtype::f32 || w->type == dtype::bf16) && w->n_dims == 1 &&
                      w->shape[0] == x->shape[size_t(x->n_dims - 1)],
                  "rms_norm: weight " + describe(*w) + " must be an f32/bf16 vector matching x " +
                      describe(*x));
    }
    tensor* t = c.new_node(op::rms_norm, dtype::f32, dims_of(*x));
    t->src = {x, w};
    t->fparams[0] = eps;
    return t;
}

tensor* rope(context& c, tensor* x, tensor* positions, std::shared_ptr<const rope_params> p) {
    check_f32(x, "rope", "x");
    check_i32_vector(positions, "rope", "positions");
    MGL_CHECK(p != nullptr, "rope: null parameters");
    MGL_CHECK(x->n_dims == 2 || x->n_dims == 3,
              "rope: x must be [T, d] or [T, H, d], found " + describe(*x));
    MGL_CHECK(
        x->shape[size_t(x->n_dims - 1)] == p->n_dims && p->n_dims % 2 == 0 &&
            p->inv_freq.size() == size_t(p->n_dims / 2),
        "rope: x " + describe(*x) + " does not match rope n_dims " + std::to_string(p->n_dims));
    MGL_CHECK(positions->shape[0] == x->shape[0],
              "rope: " + describe(*positions) + " positions for " + describe(*x));
    tensor* t = c.new_node(op::rope, dtype::f32, dims_of(*x));
    t->src = {x, positions};
    t->rope = std::move(p);
    return t;
}

tensor* softmax(context& c, tensor* x, float scale, bool causal, int n_past) {
    check_f32(x, "softmax", "x");
    MGL_CHECK(!causal || x->n_dims >= 2,
              "softmax: causal needs x [..., Tq, Tk], found " + describe(*x));
    MGL_CHECK(n_past >= 0, "softmax: negative n_past");
    tensor* t = c.new_node(op::softmax, dtype::f32, dims_of(*x));
    t->src[0] = x;
    t->fparams[0] = scale;
    t->iparams[0] = causal ? 1 : 0;
    t->iparams[1] = n_past;
    return t;
}

tensor* swiglu(context& c, tensor* a, tensor* b) {
    check_f32(a, "swiglu", "a");
    check_f32(b, "swiglu", "b");
    MGL_CHECK(a->n_dims == b->n_dims && a->shape == b->shape,
              "swiglu: shapes differ: " + describe(*a) + " and " + describe(*b));
    tensor* t = c.new_node(op::swiglu, dtype::f32, dims_of(*a));
    t->src = {a, b};
    return t;
}

tensor* moe_topk(context& c, tensor* probs, const moe_route_params& p) {
    check_f32(probs, "moe_topk", "probs");
    MGL_CHECK(probs->n_dims == 2, "moe_topk: probs must be [T, E], found " + describe(*probs));
    int64_t E = probs->shape[1];
    MGL_CHECK(p.k >= 1 && p.k <= E,
              "moe_topk: k = " + std::to_string(p.k) + " for " + std::to_string(E) + " experts");
    if (p.method == topk_method::group_limited_greedy) {
        MGL_CHECK(p.n_group >= 1 && E % p.n_group == 0 && p.topk_group >= 1 &&
                      p.topk_group <= p.n_group && p.k <= p.topk_group * (E / p.n_group),
                  "moe_topk: " + std::to_string(E) + " experts cannot be split into " +
                      std::to_string(p.n_group) + " groups keeping " +
                      std::to_string(p.topk_group) + " for k = " + std::to_string(p.k));
    }
    int64_t shape[2] = {probs->shape[0], p.k};
    tensor* t = c.new_node(op::moe_topk, dtype::i32, shape);
    t->src[0] = probs;
    t->iparams = {p.k, int32_t(p.method), p.n_group, p.topk_group};
    return t;
}

tensor* moe_weights(context& c, tensor* probs, tensor* ids, const moe_route_params& p) {
    check_f32(probs, "moe_weights", "probs");
    MGL_CHECK(probs->n_dims == 2, "moe_weights: probs must be [T, E], found " + describe(*probs));
    MGL_CHECK(
        ids && ids->type == dtype::i32 && ids->n_dims == 2 && ids->shape[0] == probs->shape[0],
        "moe_weights: ids must be i32 [T, k] matching probs " + describe(*probs));
    int64_t shape[2] = {ids->shape[0], ids->shape[1]};
    tensor* t = c.new_node(op::moe_weights, dtype::f32, shape);
    t->src = {probs, ids};
    t->iparams[0] = int32_t(ids->shape[1]);
    t->iparams[1] = p.norm_topk_prob ? 1 : 0;
    t->fparams[0] = p.routed_scaling_factor;
    return t;
}

tensor* moe_experts(context& c, tensor* x, tensor* ids, tensor* w, tensor* table,
                    std::shared_ptr<const expert_layout> layout, shared_expert shared) {
    check_f32(x, "moe_experts", "x");
    check_f32(w, "moe_experts", "w");
    MGL_CHECK(layout != nullptr, "moe_experts: null expert layout");
    const expert_layout& L = *layout;
    MGL_CHECK(is_weight_type(L.type), "moe_experts: expert dtype must be f32, bf16 or f8_e4m3");
    MGL_CHECK(L.n_embd > 0 && L.n_ff > 0 && L.blob_bytes > 0,
              "moe_experts: layout sizes must be positive");
    const uint64_t es = dtype_size(L.type), mat = uint64_t(L.n_embd * L.n_ff) * es;
    const bool fp8 = L.type == dtype::f8_e4m3;
    for (auto [off, n] : {std::pair{L.gate, mat},
                          {L.up, mat},
                          {L.down, mat},
                          {L.gate_scale, fp8 ? uint64_t(L.n_ff) * 4 : 0},
                          {L.up_scale, fp8 ? uint64_t(L.n_ff) * 4 : 0},
                          {L.down_scale, fp8 ? uint64_t(L.n_embd) * 4 : 0}}) {
        MGL_CHECK(off + n <= L.blob_bytes, "moe_experts: a part at offset " + std::to_string(off) +
                                               " of " + std::to_string(n) +
                                               " bytes passes the blob of " +
                                               std::to_string(L.blob_bytes));
    }
    MGL_CHECK(x->n_dims == 2 && x->shape[1] == L.n_embd,
              "moe_experts: x " + describe(*x) + " must be [T, " + std::to_string(L.n_embd) + "]");
    MGL_CHECK(ids && ids->type == dtype::i32 && ids->n_dims == 2 && ids->shape[0] == x->shape[0],
              "moe_experts: ids must be i32 [T, k] matching x " + describe(*x));
    MGL_CHECK(w->n_dims == 2 && w->shape == ids->shape,
              "moe_experts: weights " + describe(*w) + " must match ids " + describe(*ids));
    MGL_CHECK(table && table->type == dtype::i64 && table->n_dims == 1 && table->is_contiguous(),
              "moe_experts: table must be a contiguous i64 vector of blob addresses");
    const bool has_shared = shared.gate || shared.up || shared.down;
    if (has_shared) {
        MGL_CHECK(shared.gate && shared.up && shared.down,
                  "moe_experts: the shared expert needs gate, up and down");
        for (tensor* m : {shared.gate, shared.up, shared.down}) {
            MGL_CHECK(m->n_dims == 2 && (m->type == dtype::f32 || m->type == dtype::bf16),
                      "moe_experts: shared expert weight " + describe(*m) +
                          " must be a 2-D f32/bf16 matrix");
        }
        const int64_t F = shared.gate->shape[0], D = L.n_embd;
        MGL_CHECK(shared.gate->shape == shared.up->shape && shared.gate->shape[1] == D &&
                      shared.down->shape[0] == D && shared.down->shape[1] == F,
                  "moe_experts: shared expert shapes " + describe(*shared.gate) + ", " +
                      describe(*shared.up) + ", " + describe(*shared.down) +
                      " do not form gate/up [F, " + std::to_string(D) + "], down [" +
                      std::to_string(D) + ", F]");
    }
    tensor* t = c.new_node(op::moe_experts, dtype::f32, dims_of(*x));
    t->src = {x, ids, w, table, shared.gate, shared.up, shared.down};
    t->experts = std::move(layout);
    return t;
}

namespace {

void check_pages(const tensor* pages, const tensor* page_table, const char* op) {
    MGL_CHECK(
        pages && pages->n_dims == 3 &&
            (pages->type == dtype::f32 || pages->type == dtype::bf16 || pages->type == dtype::f16),
        std::string(op) + ": pages must be f32/bf16/f16 [n_pages, page_size, r + rope]");
    check_i32_vector(page_table, op, "page_table");
}

// What expert_fetch and expert_prompt_stage both read: a layer's table, its routing and the
// fetch state, for experts of `layout`.
void check_expert_inputs(const tensor* table, const tensor* ids, const tensor* state,
                         const expert_layout* layout, const char* op) {
    MGL_CHECK(table && table->type == dtype::i64 && table->n_dims == 1 && table->is_contiguous(),
              std::string(op) + ": table must be a contiguous i64 vector of blob addresses");
    MGL_CHECK(ids && ids->type == dtype::i32 && ids->n_dims == 2 && ids->is_contiguous(),
              std::string(op) + ": ids must be contiguous i32 [T, k]");
    MGL_CHECK(
        state && state->type == dtype::i64 && state->is_contiguous() &&
            nbytes(*state) >= sizeof(expert_fetch_header),
        std::string(op) + ": state must be a contiguous i64 tensor holding an expert_fetch_header");
    MGL_CHECK(layout && layout->blob_bytes > 0, std::string(op) + ": needs the experts' layout");
}

}  // namespace

tensor* expert_fetch(context& c, tensor* table, tensor* ids, tensor* state, int layer,
                     std::shared_ptr<const expert_layout> layout, tensor* stage) {
    check_expert_inputs(table, ids, state, layout.get(), "expert_fetch");
    MGL_CHECK(layer >= 0, "expert_fetch: negative layer");
    MGL_CHECK(!stage || (stage->type == dtype::i64 && stage->is_contiguous() &&
                         nbytes(*stage) >= sizeof(expert_stage_header)),
              "expert_fetch: stage must be a contiguous i64 tensor holding an expert_stage_header");
    tensor* t = c.new_node(op::expert_fetch, dtype::i64, dims_of(*table));
    t->stride = table->stride;
    t->src = {table, ids, state, stage};
    t->iparams[0] = layer;
    t->experts = std::move(layout);
    return t;
}

tensor* expert_prompt_stage(context& c, tensor* table, tensor* ids, tensor* state,
                            std::shared_ptr<const expert_layout> layout, tensor* buffers) {
    check_expert_inputs(table, ids, state, layout.get(), "expert_prompt_stage");
    MGL_CHECK(buffers && buffers->type == dtype::i64 && buffers->is_contiguous() &&
                  buffers->nelements() >= 2,
              "expert_prompt_stage: buffers must be a contiguous i64 tensor of a count and at "
              "least one address");
    tensor* t = c.new_node(op::expert_prompt_stage, dtype::i64, dims_of(*table));
    t->src = {table, ids, state, buffers};
    t->iparams[0] = int(buffers->nelements() - 1);  // the capacity, read by the backends
    t->experts = std::move(layout);
    return t;
}

tensor* expert_prefetch(context& c, tensor* table, tensor* ids, tensor* state, int layer,
                        std::shared_ptr<const expert_layout> layout, tensor* protect,
                        int protect_layer, tensor* after, int max_fills) {
    MGL_CHECK(
        protect && protect->type == dtype::i32 && protect->n_dims == 2 && protect->is_contiguous(),
        "expert_prefetch: protect must be contiguous i32 [T, k]");
    MGL_CHECK(protect_layer >= 0 && protect_layer != layer,
              "expert_prefetch: the protected layer must be another layer");
    MGL_CHECK(max_fills >= 0, "expert_prefetch: a negative number of fills");
    tensor* t = expert_fetch(c, table, ids, state, layer, std::move(layout));
    t->src[4] = protect;
    t->src[5] = after;
    t->iparams[1] = 1;
    t->iparams[2] = protect_layer;
    t->iparams[3] = max_fills;
    return t;
}

tensor* kv_store(context& c, tensor* pages, tensor* page_table, tensor* kv_c, tensor* k_pe,
                 tensor* positions) {
    check_pages(pages, page_table, "kv_store");
    check_f32(kv_c, "kv_store", "kv_c");
    check_f32(k_pe, "kv_store", "k_pe");
    MGL_CHECK(kv_c->n_dims == 2 && k_pe->n_dims == 2 && kv_c->shape[0] == k_pe->shape[0] &&
                  kv_c->shape[1] + k_pe->shape[1] == pages->shape[2],
              "kv_store: kv_c " + describe(*kv_c) + " and k_pe " + describe(*k_pe) +
                  " do not fill rows of " + describe(*pages));
    check_i32_vector(positions, "kv_store", "positions");
    MGL_CHECK(positions->shape[0] == kv_c->shape[0],
              "kv_store: " + describe(*positions) + " positions for " + describe(*kv_c));
    tensor* t = c.new_node(op::kv_store, pages->type, dims_of(*pages));
    t->stride = pages->stride;
    t->src = {pages, page_table, kv_c, k_pe, positions};
    return t;
}

tensor* mla_attn(context& c, tensor* q_lat, tensor* q_pe, tensor* pages, tensor* page_table,
                 tensor* positions, float scale) {
    check_pages(pages, page_table, "mla_attn");
    check_f32(q_lat, "mla_attn", "q_lat");
    check_f32(q_pe, "mla_attn", "q_pe");
    MGL_CHECK(q_lat->n_dims == 3 && q_pe->n_dims == 3 && q_lat->shape[0] == q_pe->shape[0] &&
                  q_lat->shape[1] == q_pe->shape[1] &&
                  q_lat->shape[2] + q_pe->shape[2] == pages->shape[2],
              "mla_attn: q_lat " + describe(*q_lat) + " and q_pe " + describe(*q_pe) +
                  " do not match rows of " + describe(*pages));
    check_i32_vector(positions, "mla_attn", "positions");
    MGL_CHECK(positions->shape[0] == q_lat->shape[0],
              "mla_attn: " + describe(*positions) + " positions for " + describe(*q_lat));
    tensor* t = c.new_node(op::mla_attn, dtype::f32, dims_of(*q_lat));
    t->src = {q_lat, q_pe, pages, page_table, positions};
    t->fparams[0] = scale;
    return t;
}

tensor* cpy(context& c, tensor* src, tensor* dst) {
    MGL_CHECK(src && dst && is_float_type(src->type), "cpy: src must be a float tensor");
    MGL_CHECK(dst->type == dtype::f32 || dst->type == dtype::bf16 || dst->type == dtype::f16,
              "cpy: dst must be f32, bf16 or f16, found " + describe(*dst));
    MGL_CHECK(src->nelements() == dst->nelements() && src->n_dims == dst->n_dims &&
                  src->shape == dst->shape,
              "cpy: shapes differ: " + describe(*src) + " into " + describe(*dst));
    tensor* t = c.new_node(op::cpy, dst->type, dims_of(*dst));
    t->stride = dst->stride;
    t->src = {src, dst};
    return t;
}

tensor* contiguous(context& c, tensor* a) {
    MGL_CHECK(a && is_float_type(a->type), "contiguous: a must be a float tensor");
    tensor* t = c.new_node(op::contiguous, dtype::f32, dims_of(*a));
    t->src[0] = a;
    return t;
}

tensor* concat(context& c, tensor* a, tensor* b, int dim) {
    MGL_CHECK(a && b && is_float_type(a->type) && is_float_type(b->type),
              "concat: inputs must be float tensors");
    MGL_CHECK(
        a->n_dims == b->n_dims && dim >= 0 && dim < a->n_dims,
        "concat: " + describe(*a) + " and " + describe(*b) + " along dim " + std::to_string(dim));
    std::array<int64_t, max_dims> shape = a->shape;
    for (int i = 0; i < a->n_dims; ++i) {
        MGL_CHECK(i == dim || a->shape[size_t(i)] == b->shape[size_t(i)],
                  "concat: " + describe(*a) + " and " + describe(*b) + " differ outside dim " +
                      std::to_string(dim));
    }
    shape[size_t(dim)] += b->shape[size_t(dim)];
    tensor* t = c.new_node(op::concat, dtype::f32,
                           std::span<const int64_t>(shape.data(), size_t(a->n_dims)));
    t->src = {a, b};
    t->iparams[0] = dim;
    return t;
}

// ----- RoPE tables -----

rope_params rope_params_plain(int n_dims, float base) {
    MGL_CHECK(n_dims > 0 && n_dims % 2 == 0, "rope: n_dims must be even and positive");
    rope_params p;
    p.n_dims = n_dims;
    for (int i = 0; i < n_dims / 2; ++i)
        p.inv_freq.push_back(float(std::pow(double(base), -2.0 * i / n_dims)));
    return p;
}

float yarn_mscale(float scale, float m) {
    if (scale <= 1.0f) return 1.0f;
    return float(0.1 * double(m) * std::log(double(scale)) + 1.0);
}

rope_params rope_params_yarn(int n_dims, float base, float factor, int original_max_pos,
                             float beta_fast, float beta_slow, float mscale, float mscale_all_dim) {
    MGL_CHECK(n_dims > 0 && n_dims % 2 == 0, "rope: n_dims must be even and positive");
    const double d = n_dims, ln_base = std::log(double(base));
    // DeepSeek's yarn_find_correction_dim: the dim whose wavelength fits n rotations in orig_max.
    auto corr = [&](double n_rot) {
        return d * std::log(double(original_max_pos) / (2.0 * std::numbers::pi * n_rot)) /
               (2.0 * ln_base);
    };
    double low = std::max(std::floor(corr(beta_fast)), 0.0);
    double high = std::min(std::ceil(corr(beta_slow)), d - 1.0);
    if (low == high) high += 0.001;  // avoid a division by zero in the ramp, as DeepSeek does
    rope_params p;
    p.n_dims = n_dims;
    for (int i = 0; i < n_dims / 2; ++i) {
        double f_extra = std::pow(double(base), -2.0 * i / d);
        double f_inter = f_extra / double(factor);
        double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
        p.inv_freq.push_back(float(f_inter * ramp + f_extra * (1.0 - ramp)));
    }
    p.attn_factor =
        float(double(yarn_mscale(factor, mscale)) / double(yarn_mscale(factor, mscale_all_dim)));
    return p;
}

}  // namespace mgl
