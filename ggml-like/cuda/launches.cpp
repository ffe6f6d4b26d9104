// The CUDA backend's launches per op (see launches.h). Heavy ops go to kernels/ (matmul, rms_norm,
// rope, MLA, MoE); the small ones to elementwise.h. Layouts a kernel cannot read directly are
// first copied into contiguous memory (the node's own output, or scratch).
#include "launches.h"

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>

#include "cuda_check.h"
#include "expert_fetch.h"
#include "matmul.h"
#include "mla.h"
#include "moe.h"
#include "rms_norm.h"
#include "rope.h"

namespace mgl::cuda {

namespace kn = minids::kernels;

namespace {

constexpr size_t scratch_align = 256;
size_t align_up(size_t n) { return (n + scratch_align - 1) / scratch_align * scratch_align; }

float* f32_data(const tensor* t) { return static_cast<float*>(t->data); }

// Innermost dim contiguous f32 and every stride a whole number of floats.
bool f32_rows(const tensor& t) {
    if (t.type != dtype::f32 || t.n_dims < 1 || t.stride[size_t(t.n_dims - 1)] != 4) return false;
    for (int i = 0; i < t.n_dims; ++i)
        if (t.stride[size_t(i)] % 4 != 0) return false;
    return true;
}

// Rows of t (all dims but the innermost) one stride apart: that stride in floats, or -1.
int64_t uniform_row_stride(const tensor& t) {
    if (!f32_rows(t)) return -1;
    if (t.n_dims == 1) return t.shape[0];
    int64_t stride = t.stride[size_t(t.n_dims - 2)] / 4;
    for (int i = t.n_dims - 3; i >= 0; --i) {
        const int64_t want = t.shape[size_t(i + 1)] * t.stride[size_t(i + 1)];
        if (t.shape[size_t(i)] != 1 && t.stride[size_t(i)] != want) return -1;
    }
    return stride;
}

bool contiguous_vector(const tensor* t, dtype type) {
    return t && t->type == type && t->n_dims == 1 && t->stride[0] == int64_t(dtype_size(type));
}

bool contiguous_matrix(const tensor* t, dtype type) {
    return t && t->type == type && t->n_dims == 2 && t->is_contiguous();
}

std::string describe(const tensor& t) {
    return std::string(op_name(t.op_kind)) + " node '" + t.name + "' " + shape_str(t);
}

// A kernel launcher's params with the backend's programmatic-dependent-launch switch.
template <class Params>
Params with_pdl(Params p, const exec_env& env) {
    p.pdl = env.pdl;
    return p;
}

// MINIDS_CUDA_PRECISE (fusion.h), read once.
const precise_switches& precise() {
    static const precise_switches s = precise_switches_from_env();
    return s;
}

// The MoE decode kernels' tuning: the defaults of kernels/moe.h, or MINIDS_MOE_DECODE's.
const kn::MoeDecodeConfig& moe_decode_config() {
    static const kn::MoeDecodeConfig c = [] {
        kn::MoeDecodeConfig d;
        moe_decode_config_from_env(d);
        return d;
    }();
    return c;
}

// MINIDS_CUDA_GEMM_X (fusion.h), read once.
bool gemm_split_x() {
    static const bool split = gemm_split_x_from_env();
    return split;
}

// MINIDS_STREAM_PLAN (fusion.h), read once.
int stream_plan() {
    static const int plan = stream_plan_from_env();
    return plan;
}

// MINIDS_MOE_HITS (fusion.h), read once.
bool hits_before_fetch() {
    static const bool early = moe_hits_early_from_env();
    return early;
}

// MINIDS_MOE_GROUPED (fusion.h), read once.
kn::MoeGroupedKernel moe_grouped_kernel() {
    static const kn::MoeGroupedKernel k = moe_grouped_kernel_from_env();
    return k;
}

// The tensor beneath t's views (t itself when it is no view; null stays null).
const tensor* beneath_views(const tensor* t) {
    while (t && t->op_kind == op::view) t = t->src[0];
    return t;
}

// The residual of a residual epilogue: the add's operand that is not the product (null: no add).
const tensor* residual_of(const tensor* add, const tensor& product) {
    if (!add) return nullptr;
    return add->src[0] == &product ? add->src[1] : add->src[0];
}

// Whether t (null: no tensor) is caller data, a leaf or a view of one, rather than the output of
// a node. rms_norm and mla_prep read their norm weight before their PDL wait, so they launch
// dependent only when the weight is such data (a weight a node computes could still be in flight).
bool caller_data(const tensor* t) {
    t = beneath_views(t);
    return !t || t->op_kind == op::none;
}

// ---------------------------------------------------------------------------------------------
// matmul (+ rms_norm prologue, + residual epilogue)
// ---------------------------------------------------------------------------------------------
struct matmul_launch {
    std::vector<kn::MatmulParams> calls;
    std::vector<int64_t> x_offsets;      // of each call's x, in floats from x's first element
    const tensor* stage_from = nullptr;  // x copied into scratch first (odd x layouts)
    size_t stage_bytes = 0;
    size_t matmul_workspace = 0;

    void run(const exec_env& env) const {
        kn::MatmulResources res{env.cublas, env.matmul_workspace, env.matmul_workspace_bytes};
        if (stage_from) {
            const strided src = strided_of(*stage_from);
            copy_convert(src, contiguous_f32(src, env.scratch), env.stream);
        }
        for (size_t i = 0; i < calls.size(); ++i) {
            kn::MatmulParams p = with_pdl(calls[i], env);
            if (stage_from) p.x = static_cast<const float*>(env.scratch) + x_offsets[i];
            kn::matmul(p, res, env.stream);
        }
    }
};

matmul_launch plan_matmul(const tensor& mm, const tensor* norm, const tensor* add,
                          const tensor* residual, const tensor* norm_out) {
    matmul_launch L;
    const tensor* x = norm ? norm->src[0] : mm.src[0];
    const tensor* w = mm.src[1];
    const tensor* w_scale = mm.src[2];
    const int xd = x->n_dims, wd = w->n_dims;
    const int64_t M = x->shape[size_t(xd - 2)], K = x->shape[size_t(xd - 1)];
    const int64_t N = w->shape[size_t(wd - 2)];
    float* y = f32_data(add ? add : &mm);
    const float* res = residual ? f32_data(residual) : nullptr;

    // x's strides in floats; an x the kernels cannot stride through is staged contiguously into
    // scratch (its address is then patched in at run time).
    std::array<int64_t, max_dims> xs{};
    if (f32_rows(*x)) {
        for (int i = 0; i < xd; ++i) xs[size_t(i)] = x->stride[size_t(i)] / 4;
    } else {
        L.stage_from = x;
        L.stage_bytes = align_up(size_t(x->nelements()) * 4);
        int64_t step = 1;
        for (int i = xd - 1; i >= 0; --i) {
            xs[size_t(i)] = step;
            step *= x->shape[size_t(i)];
        }
    }
    // Where x is for the workspace query (which looks at its alignment): staged x starts at the
    // scratch base, 256-byte aligned.
    const float* x_probe =
        L.stage_from ? reinterpret_cast<const float*>(scratch_align) : f32_data(x);

    kn::MatmulParams base;
    base.m = M;
    base.n = N;
    base.k = K;
    base.x_row_stride = M > 1 ? xs[size_t(xd - 2)] : K;
    base.w_type = w->type;
    base.w = w->data;
    base.w_row_stride = w->stride[size_t(wd - 2)];
    base.w_col_stride = w->stride[size_t(wd - 1)];
    base.w_scale = w_scale ? f32_data(w_scale) : nullptr;
    base.y_row_stride = N;
    base.y_batch_stride = M * N;
    base.residual = res;
    if (norm) {
        base.rms_norm = true;
        base.norm_w = norm->src[1] ? norm->src[1]->data : nullptr;
        base.norm_w_type = norm->src[1] ? norm->src[1]->type : dtype::f32;
        base.norm_eps = norm->fparams[0];
        if (norm_out) {  // the norm's other readers take its rows from this matmul
            base.norm_out = f32_data(norm_out);
            base.norm_out_row_stride = norm_out->stride[0] / 4;
        }
    }

    // (x offset, y offset, batch, x batch stride) for each call.
    struct part {
        int64_t x_off, y_off, batch, x_batch_stride;
    };
    std::vector<part> parts;
    const int64_t MN = M * N;
    if (wd == 3) {
        const int64_t B = w->shape[0];
        base.w_batch_stride = w->stride[0];
        base.w_scale_batch_stride = N;
        const int64_t outer = xd == 4 ? x->shape[0] : 1;
        for (int64_t a = 0; a < outer; ++a)
            parts.push_back({a * (xd == 4 ? xs[0] : 0), a * B * MN, B, xs[size_t(xd - 3)]});
    } else if (xd == 2) {
        parts.push_back({0, 0, 1, 0});
    } else if (xd == 3) {
        parts.push_back({0, 0, x->shape[0], xs[0]});
    } else if (x->shape[0] == 1) {
        parts.push_back({0, 0, x->shape[1], xs[1]});
    } else if (x->shape[1] == 1) {
        parts.push_back({0, 0, x->shape[0], xs[0]});
    } else if (xs[0] == x->shape[1] * xs[1]) {
        parts.push_back({0, 0, x->shape[0] * x->shape[1], xs[1]});
    } else {
        for (int64_t a = 0; a < x->shape[0]; ++a)
            parts.push_back({a * xs[0], a * x->shape[1] * MN, x->shape[1], xs[1]});
    }
    for (const part& pt : parts) {
        kn::MatmulParams p = base;
        p.batch = pt.batch;
        p.x_batch_stride = pt.x_batch_stride;
        p.x = x_probe + pt.x_off;
        p.y = y + pt.y_off;
        if (res) p.residual = res + pt.y_off;
        if (precise().gemm && kn::matmul_choose_path(p) == kn::MatmulPath::gemm)
            p.path = kn::MatmulPath::gemm_f32;
        p.split_x = gemm_split_x();
        p.stream_plan = stream_plan();
        L.matmul_workspace = std::max(L.matmul_workspace, kn::matmul_workspace_bytes(p));
        L.calls.push_back(p);
        L.x_offsets.push_back(pt.x_off);
    }
    return L;
}

// ---------------------------------------------------------------------------------------------
// MLA
// ---------------------------------------------------------------------------------------------
kn::MlaCache cache_of(const tensor& pages, const tensor& page_table, int64_t r, int64_t rope) {
    kn::MlaCache c;
    c.pages = pages.data;
    c.type = pages.type;
    c.n_pages = pages.shape[0];
    c.page_size = pages.shape[1];
    c.page_table = static_cast<const int32_t*>(page_table.data);
    c.max_pages = page_table.shape[0];
    c.kv_lora_rank = r;
    c.rope_dim = rope;
    return c;
}

launch_step mla_attn_step(const tensor& n, size_t& scratch) {
    const tensor& q_lat = *n.src[0];
    const tensor& q_pe = *n.src[1];
    kn::MlaAttnParams p;
    const int64_t T = q_lat.shape[0], H = q_lat.shape[1], r = q_lat.shape[2];
    p.cache = cache_of(*n.src[2], *n.src[3], r, q_pe.shape[2]);
    p.q_lat = f32_data(&q_lat);
    p.q_lat_stride_t = q_lat.stride[0] / 4;
    p.q_lat_stride_h = q_lat.stride[1] / 4;
    p.q_pe = f32_data(&q_pe);
    p.q_pe_stride_t = q_pe.stride[0] / 4;
    p.q_pe_stride_h = q_pe.stride[1] / 4;
    p.out = f32_data(&n);
    p.out_stride_t = H * r;
    p.out_stride_h = r;
    p.positions = static_cast<const int32_t*>(n.src[4]->data);
    p.T = T;
    p.H = H;
    p.scale = n.fparams[0];
    // Decode tiles hold 16 rows; a few of them still beat the 64-row prefill tiles.
    const bool decode = T * H <= 64;
    const auto kernel = decode ? kn::MlaKernel::decode : kn::MlaKernel::prefill;
    p.max_splits = kn::mla_attn_default_max_splits(kernel, T, H);
    if (precise().mla) p.impl = kn::MlaImpl::cuda_core;
    const size_t need = kn::mla_attn_workspace_bytes(T, H, r, p.max_splits);
    scratch = std::max(scratch, need);
    return {decode ? "mla_decode" : "mla_prefill", &n, [p, decode](const exec_env& env) {
                kn::MlaAttnParams q = with_pdl(p, env);
                q.workspace = env.scratch;
                q.workspace_bytes = env.scratch_bytes;
                if (decode) {
                    kn::mla_decode(q, env.stream);
                } else {
                    kn::mla_prefill(q, env.stream);
                }
            }};
}

kn::ExpertFetchParams expert_fetch_params(const tensor& n) {
    kn::ExpertFetchParams p;
    p.state = static_cast<expert_fetch_header*>(n.src[2]->data);
    p.table = static_cast<int64_t*>(n.src[0]->data);
    p.ids = static_cast<const int32_t*>(n.src[1]->data);
    p.n_ids = n.src[1]->nelements();
    p.layer = n.iparams[0];
    p.n_experts = int32_t(n.src[0]->shape[0]);
    p.blob_bytes = int64_t(n.experts->blob_bytes);
    if (n.src[3]) p.stage = static_cast<expert_stage_header*>(n.src[3]->data);
    if (is_expert_prefetch(n)) {
        p.prefetch = true;
        p.protect = static_cast<const int32_t*>(n.src[4]->data);
        p.n_protect = n.src[4]->nelements();
        p.protect_layer = n.iparams[2];
        p.max_fills = n.iparams[3];
    }
    return p;
}

// The host node of a staged fetch: copies the fills the plan posted into the stage's buffers. A
// host function may make no CUDA call and must not throw (nothing could catch it): a fault in
// the stage, an internal error, ends the process with its message.
void CUDART_CB serve_expert_stage(void* stage) {
    try {
        expert_stage_serve(*static_cast<expert_stage_header*>(stage));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "minids: internal error in the expert cache's staging: %s\n",
                     e.what());
        std::abort();
    }
}

// The prompt stage: one launch that finds the layer's misses, copies them into the lent buffers
// and writes the table that points at them.
launch_step expert_prompt_stage_step(const tensor& n) {
    kn::ExpertPromptStageParams p;
    p.state = static_cast<const expert_fetch_header*>(n.src[2]->data);
    p.table = static_cast<const int64_t*>(n.src[0]->data);
    p.out = static_cast<int64_t*>(n.data);
    p.ids = static_cast<const int32_t*>(n.src[1]->data);
    p.n_ids = n.src[1]->nelements();
    p.n_experts = int32_t(n.src[0]->shape[0]);
    p.buffers = static_cast<const int64_t*>(n.src[3]->data);
    p.capacity = n.iparams[0];
    p.blob_bytes = int64_t(n.experts->blob_bytes);
    return {"expert_prompt_stage", &n,
            [p](const exec_env& env) { kn::expert_prompt_stage(with_pdl(p, env), env.stream); }};
}

// A fetch being captured into a graph may post its copies to the host's proxy (a prefetch's, or
// any with the header's proxy_demand: kernels::ExpertFetchParams::proxy); run eagerly, it copies
// them itself.
kn::ExpertFetchParams with_proxy(kn::ExpertFetchParams p, const exec_env& env) {
    p.proxy = env.captured;
    return p;
}

// The fetch's plan and copy; with route_fetch (`planned`: its route step made the plan) the copy
// alone. With a stage (the staging store): the plan, the host's copies into the stage (a host
// node when captured), then the copy from the stage, launched after the host node as an ordinary
// dependent (not PDL: the host's copies must be complete before it reads a byte).
launch_step expert_fetch_step(const tensor& n, bool planned, const fusion_plan& f) {
    kn::ExpertFetchParams p = expert_fetch_params(n);
    p.defer_wait = f.defers_wait.count(&n) != 0;
    p.wait_for_layer = f.waits_for_layer.count(&n) != 0;
    if (p.stage) {
        MGL_CHECK(!planned, "expert_fetch: a staged fetch cannot be planned by its routing");
        return {"expert_fetch(staged)", &n, [p](const exec_env& env) {
                    kn::expert_fetch_plan(with_pdl(p, env), env.stream);
                    CUDA_CHECK(cudaLaunchHostFunc(env.stream, serve_expert_stage, p.stage));
                    kn::ExpertFetchParams copy = p;
                    copy.pdl = false;
                    kn::expert_fetch_copy(copy, env.stream);
                }};
    }
    if (planned)
        return {"expert_fetch(copy)", &n, [p](const exec_env& env) {
                    kn::expert_fetch_copy(with_proxy(with_pdl(p, env), env), env.stream);
                }};
    launch_step step{"expert_fetch", &n, [p](const exec_env& env) {
                         kn::expert_fetch(with_proxy(with_pdl(p, env), env), env.stream);
                     }};
    step.plans_and_copies = true;
    return step;
}

launch_step kv_store_step(const tensor& n) {
    const tensor& c = *n.src[2];
    const tensor& k_pe = *n.src[3];
    kn::KvStoreParams p;
    p.cache = cache_of(n, *n.src[1], c.shape[1], k_pe.shape[1]);
    p.c = f32_data(&c);
    p.c_stride = c.stride[0] / 4;
    p.k_pe = f32_data(&k_pe);
    p.k_pe_stride = k_pe.stride[0] / 4;
    p.positions = static_cast<const int32_t*>(n.src[4]->data);
    p.T = c.shape[0];
    return {"kv_store", &n,
            [p](const exec_env& env) { kn::kv_store(with_pdl(p, env), env.stream); }};
}

launch_step mla_prep_step(const mla_prep_group& g, const launch_context& ctx) {
    const tensor& store = *g.store;
    const tensor& q_in = *g.q_rope->src[0];
    const int64_t r = g.kv_norm->shape[1], rope = g.k_rope->shape[1];
    kn::MlaPrepParams p;
    p.cache = cache_of(store, *store.src[1], r, rope);
    p.positions = static_cast<const int32_t*>(store.src[4]->data);
    p.T = g.kv->shape[0];
    p.H = q_in.shape[1];
    p.kv = f32_data(g.kv_norm->src[0]);
    p.kv_stride = g.kv->stride[0] / 4;
    if (const tensor* w = g.kv_norm->src[1]) {
        p.kv_norm_w = w->data;
        p.kv_norm_w_type = w->type;
    }
    p.eps = g.kv_norm->fparams[0];
    p.inv_freq = ctx.inv_freq(g.k_rope->rope);
    p.attn_factor = g.k_rope->rope->attn_factor;
    p.q_pe_in = f32_data(&q_in);
    p.q_pe_in_stride_t = q_in.stride[0] / 4;
    p.q_pe_in_stride_h = q_in.stride[1] / 4;
    p.q_pe_out = f32_data(g.q_rope);
    p.q_pe_out_stride_t = p.H * rope;
    p.q_pe_out_stride_h = rope;
    if (g.write_kv_norm) {
        p.c_out = f32_data(g.kv_norm);
        p.c_out_stride = r;
    }
    if (g.write_k_rope) {
        p.k_pe_out = f32_data(g.k_rope);
        p.k_pe_out_stride = rope;
    }
    const bool pdl_ok = caller_data(g.kv_norm->src[1]);
    return {"mla_prep", g.run_at, [p, pdl_ok](const exec_env& env) {
                kn::MlaPrepParams q = with_pdl(p, env);
                q.pdl = q.pdl && pdl_ok;
                kn::mla_prep(q, env.stream);
            }};
}

// ---------------------------------------------------------------------------------------------
// MoE
// ---------------------------------------------------------------------------------------------
kn::MoeRoutingParams routing_params(const tensor& probs_in, int64_t T) {
    kn::MoeRoutingParams p;
    p.in_stride = probs_in.stride[0] / 4;
    p.n_tokens = T;
    p.n_experts = probs_in.shape[1];
    return p;
}

void set_topk(kn::MoeRoutingParams& p, const tensor& topk) {
    p.route.k = topk.iparams[0];
    p.route.method = topk_method(topk.iparams[1]);
    p.route.n_group = topk.iparams[2];
    p.route.topk_group = topk.iparams[3];
}

void set_weighting(kn::MoeRoutingParams& p, const tensor& weights) {
    p.route.k = weights.iparams[0];
    p.route.norm_topk_prob = weights.iparams[1] != 0;
    p.route.routed_scaling_factor = weights.fparams[0];
}

// The route group's softmax -> top-k -> weights over `logits` as one moe_route (route_fetch: and
// the plan of the expert fetch reading its ids).
kn::MoeRoutingParams route_group_params(const route_group& g, const tensor& logits) {
    kn::MoeRoutingParams p = routing_params(logits, logits.shape[0]);
    p.logits = f32_data(&logits);
    p.probs_out = f32_data(g.softmax);
    p.ids = static_cast<int32_t*>(g.topk->data);
    p.weights = f32_data(g.weights);
    set_topk(p, *g.topk);
    set_weighting(p, *g.weights);
    if (g.fetch) p.fetch = expert_fetch_params(*g.fetch);
    return p;
}

launch_step route_step(const route_group& g) {
    const kn::MoeRoutingParams p = route_group_params(g, *g.softmax->src[0]);
    return {g.fetch ? "moe_route+fetch_plan" : "moe_route", g.weights,
            [p](const exec_env& env) { kn::moe_route(with_pdl(p, env), env.stream); }};
}

// router_route: the router matmul (with its folded norm, and norm_out) and the routing in one
// moe_router_route launch, the logits still written to the matmul's output. Where the kernel
// cannot take the addresses (alignment, known only now), the same step runs the matmul and then
// moe_route, so the plan holds either way.
launch_step router_route_step(const route_group& g, const tensor* norm, const tensor* norm_out,
                              size_t ticket, launch_list& out, size_t& scratch) {
    const tensor& mm = *g.router;
    const tensor& w = *mm.src[1];
    const tensor& x = norm ? *norm->src[0] : *mm.src[0];
    const kn::MoeRoutingParams r = route_group_params(g, mm);
    kn::MoeRouterRouteParams p;
    p.x = f32_data(&x);
    p.x_stride = x.stride[0] / 4;
    p.n_embd = w.shape[1];
    p.w = w.data;
    p.w_type = w.type;
    p.w_row_stride = w.stride[0];
    if (norm) {
        p.rms_norm = true;
        p.norm_w = norm->src[1] ? norm->src[1]->data : nullptr;
        p.norm_w_type = norm->src[1] ? norm->src[1]->type : dtype::f32;
        p.norm_eps = norm->fparams[0];
        if (norm_out) {
            p.norm_out = f32_data(norm_out);
            p.norm_out_stride = norm_out->stride[0] / 4;
        }
    }
    p.logits = f32_data(&mm);
    p.probs_out = r.probs_out;
    p.ids = r.ids;
    p.weights = r.weights;
    p.n_tokens = mm.shape[0];
    p.n_experts = mm.shape[1];
    p.route = r.route;
    p.fetch = r.fetch;
    std::string what = "moe_router_route";
    if (norm) what += norm_out ? "+norm(out)" : "+norm";
    if (g.fetch) what += "+fetch_plan";
    if (kn::moe_router_route_unsupported(p).empty()) {
        return {what, g.weights, [p, ticket](const exec_env& env) {
                    kn::MoeRouterRouteParams q = with_pdl(p, env);
                    q.ticket = env.tickets + ticket;
                    kn::moe_router_route(q, env.stream);
                }};
    }
    auto L = std::make_shared<matmul_launch>(plan_matmul(mm, norm, nullptr, nullptr, norm_out));
    out.matmul_workspace_bytes = std::max(out.matmul_workspace_bytes, L->matmul_workspace);
    scratch = std::max(scratch, L->stage_bytes);
    return {what + " (matmul, moe_route)", g.weights, [L, r](const exec_env& env) {
                L->run(env);
                kn::moe_route(with_pdl(r, env), env.stream);
            }};
}

kn::MoeExpertsParams moe_experts_params(const tensor& n, const tensor* add, const tensor* residual,
                                        const tensor* norm) {
    // With a folded rms_norm, x is the norm's input (its output is never computed).
    const tensor& x = norm ? *norm->src[0] : *n.src[0];
    const tensor& ids = *n.src[1];
    const expert_layout& L = *n.experts;
    kn::MoeExpertsParams p;
    p.expert_table = static_cast<const int64_t*>(n.src[3]->data);
    p.n_experts = n.src[3]->shape[0];
    p.layout.type = L.type;
    p.layout.n_embd = L.n_embd;
    p.layout.n_ff = L.n_ff;
    p.layout.gate_offset = int64_t(L.gate);
    p.layout.up_offset = int64_t(L.up);
    p.layout.down_offset = int64_t(L.down);
    const bool fp8 = L.type == dtype::f8_e4m3;
    p.layout.gate_scale_offset = fp8 ? int64_t(L.gate_scale) : -1;
    p.layout.up_scale_offset = fp8 ? int64_t(L.up_scale) : -1;
    p.layout.down_scale_offset = fp8 ? int64_t(L.down_scale) : -1;
    p.ids = static_cast<const int32_t*>(ids.data);
    p.weights = f32_data(n.src[2]);
    p.k = int(ids.shape[1]);
    p.x = f32_data(&x);
    p.x_stride = x.stride[0] / 4;
    p.out = f32_data(add ? add : &n);
    p.residual = residual ? f32_data(residual) : nullptr;
    p.n_tokens = x.shape[0];
    if (const tensor* gate = n.src[4]) {
        p.shared.type = gate->type;
        p.shared.gate = gate->data;
        p.shared.up = n.src[5]->data;
        p.shared.down = n.src[6]->data;
        p.shared.n_ff = gate->shape[0];
    }
    if (norm) {
        p.rms_norm = true;
        p.norm_w = norm->src[1] ? norm->src[1]->data : nullptr;
        p.norm_w_type = norm->src[1] ? norm->src[1]->type : dtype::f32;
        p.norm_eps = norm->fparams[0];
    }
    if (precise().moe) p.grouped.tensor_cores = false;
    p.decode = moe_decode_config();
    p.grouped.kernel = moe_grouped_kernel();
    return p;
}

// The cache's state, when the experts' table is an expert fetch's (its alias).
const expert_fetch_header* fetch_state_of(const tensor& moe) {
    const tensor* fetched = beneath_views(moe.src[3]);
    return fetched && fetched->op_kind == op::expert_fetch
               ? static_cast<const expert_fetch_header*>(fetched->src[2]->data)
               : nullptr;
}

std::string moe_experts_what(const tensor* add, const tensor* norm) {
    std::string what = norm ? "moe_experts+norm" : "moe_experts";
    return add ? what + "+add" : what;
}

// The parameters of the launch that starts the experts: right after a fetch's launch, its blocks
// may start on the experts no fill of the step wrote (MINIDS_MOE_HITS).
kn::MoeExpertsParams experts_launch_params(const kn::MoeExpertsParams& p,
                                           const expert_fetch_header* fetch_state,
                                           const exec_env& env) {
    kn::MoeExpertsParams q = with_pdl(p, env);
    if (env.after_fetch && hits_before_fetch()) q.fetch_state = fetch_state;
    return q;
}

launch_step moe_experts_step(const tensor& n, const tensor* add, const tensor* norm,
                             size_t& scratch) {
    const kn::MoeExpertsParams p = moe_experts_params(n, add, residual_of(add, n), norm);
    scratch = std::max(scratch, kn::moe_experts_workspace_bytes(p));
    return {moe_experts_what(add, norm), add ? add : &n,
            [p, fetch_state = fetch_state_of(n)](const exec_env& env) {
                kn::moe_experts(experts_launch_params(p, fetch_state, env), env.scratch,
                                env.scratch_bytes, env.stream);
            }};
}

// shared_beside (fusion.h): the decode path in its three parts, all in the plan's region for
// them (exec_env::moe_act), which no other step writes. The shared expert's gate/up, a side
// step emitted right after the step that writes x; then, at the moe_experts' place, the routed
// experts' gate/up (after a fetch as moe_experts_step's launch 1) and the down launch, which
// joins the side stream and keeps PDL: its kernels wait before they read anything (pdl_enter).
// Without PDL there, every expert a hit at 12 GiB measured 1.5 % slower (perf.md).
launch_step moe_shared_gate_up_step(const tensor& n, const tensor* add, const tensor* norm,
                                    size_t& act_bytes) {
    const kn::MoeExpertsParams p = moe_experts_params(n, add, residual_of(add, n), norm);
    act_bytes = std::max(act_bytes, kn::moe_experts_workspace_bytes(p));
    launch_step st{"moe_experts(shared gate/up)", &n, [p](const exec_env& env) {
                       kn::moe_decode_part(with_pdl(p, env), kn::MoeDecodePart::shared_gate_up,
                                           env.moe_act, env.moe_act_bytes, env.stream);
                   }};
    st.side = true;
    return st;
}

void push_moe_experts_beside(std::vector<launch_step>& out, const tensor& n, const tensor* add,
                             const tensor* norm, size_t& act_bytes) {
    const kn::MoeExpertsParams p = moe_experts_params(n, add, residual_of(add, n), norm);
    act_bytes = std::max(act_bytes, kn::moe_experts_workspace_bytes(p));
    const std::string what = moe_experts_what(add, norm);
    const tensor* at = add ? add : &n;
    out.push_back(
        {what + "(routed gate/up)", at, [p, fetch_state = fetch_state_of(n)](const exec_env& env) {
             kn::moe_decode_part(experts_launch_params(p, fetch_state, env),
                                 kn::MoeDecodePart::routed_gate_up, env.moe_act, env.moe_act_bytes,
                                 env.stream);
         }});
    launch_step down{what + "(down)", at, [p](const exec_env& env) {
                         kn::moe_decode_part(with_pdl(p, env), kn::MoeDecodePart::down, env.moe_act,
                                             env.moe_act_bytes, env.stream);
                     }};
    down.join = true;
    down.join_keeps_pdl = true;
    out.push_back(down);
}

// ---------------------------------------------------------------------------------------------
// rms_norm, rope (kernels/), and the simple ops (elementwise.h)
// ---------------------------------------------------------------------------------------------
launch_step rms_norm_step(const tensor& n) {
    const tensor& x = *n.src[0];
    const tensor* w = n.src[1];
    kn::RmsNormParams p;
    p.w = w ? w->data : nullptr;
    p.w_type = w ? w->type : dtype::f32;
    p.y = f32_data(&n);
    p.dim = x.shape[size_t(x.n_dims - 1)];
    p.rows = p.dim ? x.nelements() / p.dim : 0;
    p.eps = n.fparams[0];
    p.y_stride = p.dim;
    const int64_t row_stride = uniform_row_stride(x);
    if (row_stride >= 0) {
        p.x = f32_data(&x);
        p.x_stride = row_stride;
        const bool pdl_ok = caller_data(w);
        return {"rms_norm", &n, [p, pdl_ok](const exec_env& env) {
                    kn::RmsNormParams q = with_pdl(p, env);
                    q.pdl = q.pdl && pdl_ok;
                    if (q.rows) kn::rms_norm(q, env.stream);
                }};
    }
    // Any other layout: gather x into the output, then normalize in place.
    p.x = p.y;
    p.x_stride = p.dim;
    const strided src = strided_of(x), dst = contiguous_f32(src, n.data);
    return {"rms_norm (staged)", &n, [p, src, dst](const exec_env& env) {
                copy_convert(src, dst, env.stream);
                if (p.rows) kn::rms_norm(p, env.stream);
            }};
}

launch_step rope_step(const tensor& n, const launch_context& ctx) {
    const tensor& x = *n.src[0];
    kn::RopeParams p;
    p.T = x.shape[0];
    p.H = x.n_dims == 3 ? x.shape[1] : 1;
    p.n_dims = x.shape[size_t(x.n_dims - 1)];
    p.positions = static_cast<const int32_t*>(n.src[1]->data);
    p.inv_freq = ctx.inv_freq(n.rope);
    p.attn_factor = n.rope->attn_factor;
    p.y = f32_data(&n);
    p.y_stride_t = p.H * p.n_dims;
    p.y_stride_h = p.n_dims;
    const bool direct = f32_rows(x) && reinterpret_cast<uintptr_t>(x.data) % 8 == 0 &&
                        x.stride[0] % 8 == 0 && (x.n_dims == 2 || x.stride[1] % 8 == 0);
    if (direct) {
        p.x = f32_data(&x);
        p.x_stride_t = x.stride[0] / 4;
        p.x_stride_h = x.n_dims == 3 ? x.stride[1] / 4 : 0;
        return {"rope", &n, [p](const exec_env& env) {
                    if (p.T) kn::rope(p, env.stream);
                }};
    }
    p.x = p.y;
    p.x_stride_t = p.y_stride_t;
    p.x_stride_h = p.y_stride_h;
    const strided src = strided_of(x), dst = contiguous_f32(src, n.data);
    return {"rope (staged)", &n, [p, src, dst](const exec_env& env) {
                copy_convert(src, dst, env.stream);
                if (p.T) kn::rope(p, env.stream);
            }};
}

launch_step concat_step(const tensor& n) {
    const tensor& a = *n.src[0];
    const tensor& b = *n.src[1];
    const int dim = n.iparams[0];
    const strided sa = strided_of(a), sb = strided_of(b);
    strided out = contiguous_f32(strided_of(n), n.data);
    strided out_a = out, out_b = out;
    const int d4 = dim + (4 - n.n_dims);  // the dim in 4-D terms
    out_a.shape[d4] = a.shape[size_t(dim)];
    out_b.shape[d4] = b.shape[size_t(dim)];
    out_b.data = static_cast<char*>(n.data) + a.shape[size_t(dim)] * out.stride[d4];
    return {"concat", &n, [sa, sb, out_a, out_b](const exec_env& env) {
                copy_convert(sa, out_a, env.stream);
                copy_convert(sb, out_b, env.stream);
            }};
}

launch_step simple_step(const tensor& n) {
    const tensor* a = n.src[0];
    const tensor* b = n.src[1];
    float* out = f32_data(&n);
    switch (n.op_kind) {
        case op::get_rows: {
            const strided table = strided_of(*a), ids = strided_of(*b);
            const float* row_scale = n.src[2] ? f32_data(n.src[2]) : nullptr;
            return {"get_rows", &n, [table, ids, row_scale, out](const exec_env& env) {
                        get_rows(table, ids, row_scale, out, env.error, env.stream);
                    }};
        }
        case op::add:
        case op::mul: {
            const strided sa = strided_of(*a), sb = strided_of(*b);
            const op o = n.op_kind;
            return {op_name(o), &n,
                    [o, sa, sb, out](const exec_env& env) { binary(o, sa, sb, out, env.stream); }};
        }
        case op::scale: {
            const strided sa = strided_of(*a);
            const float s = n.fparams[0];
            return {"scale", &n,
                    [sa, s, out](const exec_env& env) { scale(sa, s, out, env.stream); }};
        }
        case op::swiglu: {
            const strided sa = strided_of(*a), sb = strided_of(*b);
            return {"swiglu", &n,
                    [sa, sb, out](const exec_env& env) { swiglu(sa, sb, out, env.stream); }};
        }
        case op::softmax: {
            const strided sx = strided_of(*a);
            const float s = n.fparams[0];
            const bool causal = n.iparams[0] != 0;
            const int64_t n_past = n.iparams[1];
            return {"softmax", &n, [sx, s, causal, n_past, out](const exec_env& env) {
                        softmax(sx, out, s, causal, n_past, env.stream);
                    }};
        }
        case op::cpy: {
            const strided src = strided_of(*a), dst = strided_of(n);
            return {"cpy", &n,
                    [src, dst](const exec_env& env) { copy_convert(src, dst, env.stream); }};
        }
        case op::contiguous: {
            const strided src = strided_of(*a), dst = contiguous_f32(src, n.data);
            return {"contiguous", &n,
                    [src, dst](const exec_env& env) { copy_convert(src, dst, env.stream); }};
        }
        case op::moe_topk: {
            kn::MoeRoutingParams p = routing_params(*a, a->shape[0]);
            p.probs = f32_data(a);
            p.ids = static_cast<int32_t*>(n.data);
            set_topk(p, n);
            return {"moe_topk", &n, [p](const exec_env& env) { kn::moe_topk(p, env.stream); }};
        }
        case op::moe_weights: {
            kn::MoeRoutingParams p = routing_params(*a, a->shape[0]);
            p.probs = f32_data(a);
            p.ids = static_cast<int32_t*>(b->data);
            p.weights = out;
            set_weighting(p, n);
            return {"moe_weights", &n,
                    [p](const exec_env& env) { kn::moe_weights(p, env.stream); }};
        }
        default:
            break;
    }
    fail(__FILE__, __LINE__, "cuda backend: no launch for " + describe(n));
}

}  // namespace

std::string cuda_unsupported_reason(const tensor& n) {
    auto positions_ok = [](const tensor* p) { return contiguous_vector(p, dtype::i32); };
    // The MLA kernels' page types (kernels/mla.h).
    auto cache_type_ok = [](dtype t) {
        return t == dtype::f32 || t == dtype::bf16 || t == dtype::f16;
    };
    switch (n.op_kind) {
        case op::none:
        case op::view:
        case op::add:
        case op::mul:
        case op::scale:
        case op::swiglu:
        case op::softmax:
        case op::cpy:
        case op::contiguous:
        case op::concat:
            return n.n_dims <= 4 ? "" : "more than 4 dims";
        case op::get_rows:
            if (n.src[0]->type == dtype::i32 || n.src[0]->type == dtype::i64)
                return "integer tables are not supported";
            return "";
        case op::matmul: {
            const dtype t = n.src[1]->type;
            if (t != dtype::f32 && t != dtype::bf16 && t != dtype::f8_e4m3)
                return std::string("weight dtype ") + dtype_name(t);
            if (n.src[2] && !n.src[2]->is_contiguous()) return "strided weight scales";
            return "";
        }
        case op::rms_norm:
            if (n.src[1] && !n.src[1]->is_contiguous()) return "a strided norm weight";
            return "";
        case op::rope:
            if (!positions_ok(n.src[1])) return "strided positions";
            return "";
        case op::moe_topk:
        case op::moe_weights: {
            const tensor& probs = *n.src[0];
            if (!f32_rows(probs)) return "probs rows must be contiguous f32";
            if (probs.shape[1] > 1024) return "more than 1024 experts";
            if (n.op_kind == op::moe_topk &&
                topk_method(n.iparams[1]) == topk_method::group_limited_greedy && n.iparams[2] > 32)
                return "more than 32 expert groups";
            if (n.op_kind == op::moe_weights && !contiguous_matrix(n.src[1], dtype::i32))
                return "ids must be contiguous";
            return "";
        }
        case op::moe_experts: {
            if (!contiguous_matrix(n.src[1], dtype::i32) ||
                !contiguous_matrix(n.src[2], dtype::f32))
                return "ids and weights must be contiguous [T, k]";
            if (!f32_rows(*n.src[0])) return "x rows must be contiguous f32";
            if (n.src[1]->shape[1] > 32) return "more than 32 experts per token";
            if (n.src[3]->shape[0] > 1024) return "more than 1024 experts";
            if (n.experts->n_embd > 12288) return "n_embd above 12288";
            if (const tensor* g = n.src[4]) {
                const tensor* u = n.src[5];
                const tensor* d = n.src[6];
                if (!g->is_contiguous() || !u->is_contiguous() || !d->is_contiguous() ||
                    u->type != g->type || d->type != g->type)
                    return "shared expert weights must be contiguous and of one dtype";
            }
            return "";
        }
        case op::expert_fetch:
            if (!contiguous_matrix(n.src[1], dtype::i32)) return "ids must be contiguous [T, k]";
            if (is_expert_prefetch(n) && !contiguous_matrix(n.src[4], dtype::i32))
                return "protected ids must be contiguous [T, k]";
            if (n.src[0]->shape[0] > 1024) return "more than 1024 experts";
            return "";
        case op::expert_prompt_stage:
            if (!contiguous_matrix(n.src[1], dtype::i32)) return "ids must be contiguous [T, k]";
            if (n.src[0]->shape[0] > 1024) return "more than 1024 experts";
            if (n.iparams[0] > 65535) return "more than 65535 buffers";
            return "";
        case op::kv_store:
            if (!cache_type_ok(n.src[0]->type)) return "pages must be f32, bf16 or f16";
            if (!n.src[0]->is_contiguous() || !positions_ok(n.src[1]) || !positions_ok(n.src[4]))
                return "pages, page table and positions must be contiguous";
            if (!f32_rows(*n.src[2]) || !f32_rows(*n.src[3]))
                return "kv_c and k_pe rows must be contiguous f32";
            return "";
        case op::mla_attn: {
            if (!cache_type_ok(n.src[2]->type)) return "pages must be f32, bf16 or f16";
            if (!n.src[2]->is_contiguous() || !positions_ok(n.src[3]) || !positions_ok(n.src[4]))
                return "pages, page table and positions must be contiguous";
            if (!f32_rows(*n.src[0]) || !f32_rows(*n.src[1]))
                return "q_lat and q_pe rows must be contiguous f32";
            const int64_t r = n.src[0]->shape[2], rope = n.src[1]->shape[2];
            if (r % 8 || r < 8 || r > 512 || rope % 8 || rope < 8 || rope > 128)
                return "kv_lora_rank must be a multiple of 8 in [8, 512] and the rope dim a "
                       "multiple of 8 in [8, 128]";
            return "";
        }
        case op::count:
            break;
    }
    return "unknown op";
}

launch_list build_launches(const graph& g, const fusion_plan& f, const launch_context& ctx) {
    launch_list out;
    size_t scratch = 0, act_bytes = 0;
    auto norm_of = [&](const tensor& consumer) -> const tensor* {
        auto it = f.norm_of.find(&consumer);
        return it == f.norm_of.end() ? nullptr : it->second;
    };
    auto add_matmul = [&](const tensor& mm, const tensor* add) {
        const tensor* norm = norm_of(mm);
        const tensor* residual = residual_of(add, mm);
        auto wn = f.writes_norm.find(&mm);
        const tensor* norm_out = wn == f.writes_norm.end() ? nullptr : wn->second;
        auto L = std::make_shared<matmul_launch>(plan_matmul(mm, norm, add, residual, norm_out));
        out.matmul_workspace_bytes = std::max(out.matmul_workspace_bytes, L->matmul_workspace);
        scratch = std::max(scratch, L->stage_bytes);
        std::string what = "matmul";
        if (norm) what += norm_out ? "+norm(out)" : "+norm";
        if (add) what += "+add";
        out.steps.push_back({what, add ? add : &mm, [L](const exec_env& env) { L->run(env); }});
    };
    // A moe_experts (with its residual add, if fused): one step, or shared_beside's two.
    auto add_moe = [&](const tensor& m, const tensor* add) {
        if (f.shared_beside.count(&m))
            push_moe_experts_beside(out.steps, m, add, norm_of(m), act_bytes);
        else
            out.steps.push_back(moe_experts_step(m, add, norm_of(m), scratch));
    };
    // The step (if any) node n runs as; `scratch` grows to what it needs.
    auto emit_step = [&](tensor* n) {
        if (auto it = f.route_at.find(n); it != f.route_at.end()) {
            if (const tensor* mm = it->second.router) {
                auto wn = f.writes_norm.find(mm);
                const tensor* norm_out = wn == f.writes_norm.end() ? nullptr : wn->second;
                out.steps.push_back(router_route_step(it->second, norm_of(*mm), norm_out,
                                                      out.tickets++, out, scratch));
            } else {
                out.steps.push_back(route_step(it->second));
            }
            return;
        }
        if (auto it = f.prep_at.find(n); it != f.prep_at.end()) {
            out.steps.push_back(mla_prep_step(it->second, ctx));
            return;
        }
        if (auto it = f.producer_of.find(n); it != f.producer_of.end()) {
            const tensor& product = *it->second;
            if (product.op_kind == op::matmul)
                add_matmul(product, n);
            else
                add_moe(product, n);
            return;
        }
        switch (n->op_kind) {
            case op::none:
            case op::view:
                break;
            case op::matmul:
                add_matmul(*n, nullptr);
                break;
            case op::rms_norm:
                out.steps.push_back(rms_norm_step(*n));
                break;
            case op::rope:
                out.steps.push_back(rope_step(*n, ctx));
                break;
            case op::kv_store:
                out.steps.push_back(kv_store_step(*n));
                break;
            case op::expert_fetch:
                out.steps.push_back(expert_fetch_step(*n, f.fetch_planned.count(n) != 0, f));
                break;
            case op::expert_prompt_stage:
                out.steps.push_back(expert_prompt_stage_step(*n));
                break;
            case op::mla_attn:
                out.steps.push_back(mla_attn_step(*n, scratch));
                break;
            case op::moe_experts:
                add_moe(*n, nullptr);
                break;
            case op::concat:
                out.steps.push_back(concat_step(*n));
                break;
            default:
                out.steps.push_back(simple_step(*n));
                break;
        }
    };
    size_t side_scratch = 0, side_workspace = 0;
    for (tensor* n : g.nodes) {
        if (f.skipped.count(n)) continue;
        // A side step's scratch and workspace needs go to the side regions (launch_list).
        const bool side = f.side.count(n) != 0;
        const size_t steps_before = out.steps.size(), main_scratch = scratch,
                     main_workspace = out.matmul_workspace_bytes;
        if (side) scratch = out.matmul_workspace_bytes = 0;
        emit_step(n);
        if (side) {
            side_scratch = std::max(side_scratch, scratch);
            side_workspace = std::max(side_workspace, out.matmul_workspace_bytes);
            scratch = main_scratch;
            out.matmul_workspace_bytes = main_workspace;
        }
        if (out.steps.size() > steps_before) {
            launch_step& st = out.steps.back();
            st.join = st.join || f.join_before.count(n) != 0;
            st.side = side;
            out.has_side = out.has_side || side;
        }
        if (auto it = f.shared_after.find(n); it != f.shared_after.end()) {
            const tensor& m = *it->second;
            auto ra = f.residual_add.find(&m);
            const tensor* add = ra == f.residual_add.end() ? nullptr : ra->second;
            out.steps.push_back(moe_shared_gate_up_step(m, add, norm_of(m), act_bytes));
            out.has_side = true;
        }
    }
    // Which launches follow an expert fetch's plan and copy on their stream (the side stream's
    // first launch after a fork follows an event, not a kernel: never).
    const launch_step* prev_main = nullptr;
    const launch_step* prev_side = nullptr;
    for (launch_step& st : out.steps) {
        const launch_step*& prev = st.side ? prev_side : prev_main;
        st.after_fetch = prev && !st.join && prev->plans_and_copies;
        prev = &st;
        if (!st.side) prev_side = nullptr;  // the next side launch follows a fork
    }
    out.scratch_bytes = align_up(scratch);
    out.moe_act_bytes = align_up(act_bytes);
    out.side_scratch_bytes = align_up(side_scratch);
    out.side_matmul_workspace_bytes = align_up(side_workspace);
    return out;
}

}  // namespace mgl::cuda
