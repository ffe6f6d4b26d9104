// The CUDA backend's fusion planner and the memory plan it feeds, checked on the host (no GPU
// needed): on a model-shaped decoder layer every fusion is found, and executing the steps in the
// order the backend launches them (a fused group at its last member, reading what its members
// read) never reads memory that another step overwrote, nor writes over what the same step reads.
#ifdef MINIDS_HAVE_CUDA
#include <doctest/doctest.h>

#include <map>

#include "../ggml-like/cuda/fusion.h"
#include "../ggml-like/cuda/launches.h"
#include "../kernels/moe.h"
#include "cuda_layer_fixture.h"
#include "model_test_util.h"

using namespace minids::test;
using mgl::dtype;

namespace {

struct step {
    std::vector<const mgl::tensor*> reads, writes;
};

void add_srcs(std::vector<const mgl::tensor*>& v, const mgl::tensor& n) {
    for (const mgl::tensor* s : n.src)
        if (s) v.push_back(s);
}

// The steps in the backend's launch order (launches.cpp: build_launches).
std::vector<step> fused_steps(const mgl::graph& g, const mgl::cuda::fusion_plan& f) {
    std::vector<step> out;
    for (const mgl::tensor* n : g.nodes) {
        if (f.skipped.count(n) || n->op_kind == mgl::op::view) continue;
        step s;
        if (auto it = f.route_at.find(n); it != f.route_at.end()) {
            const auto& r = it->second;
            if (const mgl::tensor* mm = r.router) {
                // router_route: the router matmul (and its folded norm) run here, the logits and
                // with norm_out the norm's rows written here.
                add_srcs(s.reads, *mm);
                if (auto nt = f.norm_of.find(mm); nt != f.norm_of.end())
                    add_srcs(s.reads, *nt->second);
                s.writes = {mm, r.softmax, r.topk, r.weights};
                if (auto wn = f.writes_norm.find(mm); wn != f.writes_norm.end())
                    s.writes.push_back(wn->second);
            } else {
                s.reads = {r.softmax->src[0]};
                s.writes = {r.softmax, r.topk, r.weights};
            }
            // route_fetch: the plan reads and writes the fetch's table and state here.
            if (r.fetch) add_srcs(s.reads, *r.fetch);
        } else if (auto pt = f.prep_at.find(n); pt != f.prep_at.end()) {
            const auto& p = pt->second;
            for (const mgl::tensor* m : {p.kv_norm, p.k_rope, p.store, p.q_rope})
                add_srcs(s.reads, *m);
            s.writes = {p.store, p.q_rope};
            if (p.write_kv_norm) s.writes.push_back(p.kv_norm);
            if (p.write_k_rope) s.writes.push_back(p.k_rope);
        } else if (auto at = f.producer_of.find(n); at != f.producer_of.end()) {
            const mgl::tensor* product = at->second;
            add_srcs(s.reads, *n);
            add_srcs(s.reads, *product);
            if (auto nt = f.norm_of.find(product); nt != f.norm_of.end())
                add_srcs(s.reads, *nt->second);
            s.writes = {n};
            if (auto wn = f.writes_norm.find(product); wn != f.writes_norm.end())
                s.writes.push_back(wn->second);
        } else {
            add_srcs(s.reads, *n);
            if (auto nt = f.norm_of.find(n); nt != f.norm_of.end()) add_srcs(s.reads, *nt->second);
            s.writes = {n};
            // norm_out: the matmul also writes the norm's rows for its later readers.
            if (auto wn = f.writes_norm.find(n); wn != f.writes_norm.end())
                s.writes.push_back(wn->second);
        }
        // A group's own members are not inputs.
        std::erase_if(s.reads, [&](const mgl::tensor* t) {
            return std::find(s.writes.begin(), s.writes.end(), t) != s.writes.end() ||
                   f.skipped.count(t);
        });
        out.push_back(s);
    }
    return out;
}

const mgl::tensor* root(const mgl::tensor* t) {
    while (const mgl::tensor* s = mgl::alias_source(*t)) t = s;
    return t;
}

// Runs the steps over 256-byte granules of the arena, tracking which tensor last wrote each.
// Returns the number of violations (reading a granule another tensor overwrote, or a step writing
// a granule it reads).
int simulate(const mgl::graph& g, const std::vector<step>& steps, const mgl::alloc_plan& plan) {
    std::map<const mgl::tensor*, std::pair<size_t, size_t>> range;  // root -> granules [a, b)
    for (auto [t, offset] : plan.offsets)
        range[t] = {offset / 256, (offset + mgl::nbytes(*t) + 255) / 256};
    std::vector<const mgl::tensor*> owner(plan.arena_bytes / 256 + 1, nullptr);
    int violations = 0;
    auto granules_of = [&](const mgl::tensor* t) -> const std::pair<size_t, size_t>* {
        auto it = range.find(root(t));
        return it == range.end() ? nullptr : &it->second;
    };
    for (const step& s : steps) {
        for (const mgl::tensor* rd : s.reads) {
            const auto* rr = granules_of(rd);
            if (!rr) continue;  // a leaf
            for (size_t i = rr->first; i < rr->second; ++i) {
                if (owner[i] != root(rd)) ++violations;
            }
            for (const mgl::tensor* w : s.writes) {
                const auto* wr = granules_of(w);
                if (wr && root(w) != root(rd) && wr->first < rr->second && rr->first < wr->second)
                    ++violations;
            }
        }
        for (const mgl::tensor* w : s.writes) {
            if (const auto* wr = granules_of(w))
                for (size_t i = wr->first; i < wr->second; ++i) owner[i] = root(w);
        }
    }
    for (const mgl::tensor* out : g.outputs) {
        if (const auto* rr = granules_of(out))
            for (size_t i = rr->first; i < rr->second; ++i)
                if (owner[i] != root(out)) ++violations;
    }
    return violations;
}

}  // namespace

TEST_CASE("mgl cuda fusion planner (host only): every fusion found, no memory hazard") {
    auto cpu_be = mgl::make_cpu_backend(1);
    for (int64_t T : {1, 3, 20}) {
        CAPTURE(T);
        side s(*cpu_be);
        layer_io io;
        const auto outs = decoder_layer(s, T, dtype::bf16, dtype::f8_e4m3, io);
        mgl::graph g = mgl::build_graph(s.ctx, std::span<mgl::tensor* const>(outs));
        const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, mgl::cuda_fusions{});
        // Two norms read by matmuls only, up to 16 rows.
        CHECK(f.n_norm == (T <= 16 ? 2 : 0));
        CHECK(f.n_residual == 2);
        CHECK(f.n_route == 1);
        CHECK(f.n_mla_prep == 1);
        const auto steps = fused_steps(g, f);
        CHECK(steps.size() < g.nodes.size());
        CHECK(simulate(g, steps, mgl::plan_allocation(g, 256, f.also_reads)) == 0);
        // The same steps planned without also_reads: the planner would hand memory a fused step
        // still reads to a later node (reported, not required: it depends on the graph).
        const int unsafe = simulate(g, steps, mgl::plan_allocation(g, 256));
        MESSAGE("T = " << T << ": " << g.nodes.size() << " nodes, " << steps.size()
                       << " fused steps; hazards without also_reads: " << unsafe);
        // Nothing fused when every switch is off, and the plain steps are hazard free too.
        const mgl::cuda::fusion_plan none =
            mgl::cuda::plan_fusions(g, mgl::cuda_fusions{false, false, false, false, false, false});
        CHECK(none.skipped.empty());
        // With norm_moe (off by default) the FFN norm (router and experts) is folded too while
        // the experts take the decode path (up to 8 rows); still no memory hazard.
        mgl::cuda_fusions moe_norm;
        moe_norm.norm_moe = true;
        const mgl::cuda::fusion_plan fm = mgl::cuda::plan_fusions(g, moe_norm);
        CHECK(fm.n_norm == (T <= 16 ? 2 : 0) + (T <= 8 ? 1 : 0));
        CHECK(simulate(g, fused_steps(g, fm), mgl::plan_allocation(g, 256, fm.also_reads)) == 0);
        CHECK(simulate(g, fused_steps(g, none), mgl::plan_allocation(g, 256)) == 0);
        // With norm_out (off by default) the one-row FFN norm is written by the router matmul,
        // which runs before the experts read it; still no memory hazard.
        mgl::cuda_fusions out_norm;
        out_norm.norm_out = true;
        const mgl::cuda::fusion_plan fo = mgl::cuda::plan_fusions(g, out_norm);
        CHECK(fo.n_norm == f.n_norm);
        CHECK(fo.n_norm_out == (T == 1 ? 1 : 0));
        CHECK(fo.writes_norm.size() == size_t(fo.n_norm_out));
        for (const auto& [mm, norm] : fo.writes_norm) {
            CHECK(mm->op_kind == mgl::op::matmul);
            CHECK(fo.norm_of.at(mm) == norm);
            CHECK(fo.skipped.count(norm) == 1);
        }
        CHECK(simulate(g, fused_steps(g, fo), mgl::plan_allocation(g, 256, fo.also_reads)) == 0);
        // With router_route (off by default) the router matmul runs in the route step at decode
        // sizes (up to 8 rows), alone, with the norm folded (norm_moe: the FFN norm is folded
        // into the router) or written (norm_out, one row); never for the grouped path (T = 20).
        CHECK(f.n_router_route == 0);
        for (int variant = 0; variant < 3; ++variant) {
            CAPTURE(variant);
            mgl::cuda_fusions on;
            on.router_route = true;
            on.norm_moe = variant == 1;
            on.norm_out = variant == 2;
            const mgl::cuda::fusion_plan fr = mgl::cuda::plan_fusions(g, on);
            CHECK(fr.n_route == 1);
            CHECK(fr.n_router_route == (T <= 8 ? 1 : 0));
            CHECK(fr.n_norm_out == (variant == 2 && T == 1 ? 1 : 0));
            for (const auto& [w, r] : fr.route_at) {
                if (!r.router) continue;
                CHECK(r.router == r.softmax->src[0]);
                CHECK(r.router->op_kind == mgl::op::matmul);
                CHECK(fr.skipped.count(r.router) == 1);
                // The norm is folded into the router (and so into the fused step) when norm_moe
                // or norm_out fold it; plain norm leaves it (the experts read it too).
                CHECK(fr.norm_of.count(r.router) ==
                      size_t(variant == 1 || (variant == 2 && T == 1)));
            }
            const auto fr_steps = fused_steps(g, fr);
            CHECK(fr_steps.size() == fused_steps(g, on.norm_out   ? fo
                                                    : on.norm_moe ? fm
                                                                  : f)
                                             .size() -
                                         size_t(fr.n_router_route));
            CHECK(simulate(g, fr_steps, mgl::plan_allocation(g, 256, fr.also_reads)) == 0);
        }
    }
}

TEST_CASE("mgl cuda fusion planner (host only): router_route refuses what its kernel cannot take") {
    // A router whose logits are a graph output (or read elsewhere), more than 8 rows, f8 or f32
    // weights, more than 256 experts: the route group stays, its matmul runs on its own.
    auto cpu_be = mgl::make_cpu_backend(1);
    struct Case {
        const char* what;
        int64_t T, E;
        dtype w;
        int logits_use;  // 0: the softmax only, 1: also a graph output, 2: also read by an add
        bool fused;
    };
    const Case cases[] = {{"decode", 1, 64, dtype::bf16, 0, true},
                          {"8 rows", 8, 160, dtype::bf16, 0, true},
                          {"256 experts", 2, 256, dtype::bf16, 0, true},
                          {"9 rows", 9, 64, dtype::bf16, 0, false},
                          {"logits an output", 1, 64, dtype::bf16, 1, false},
                          {"logits read twice", 1, 64, dtype::bf16, 2, false},
                          {"f32 weights", 1, 64, dtype::f32, 0, false},
                          {"300 experts", 1, 300, dtype::bf16, 0, false}};
    for (const Case& c : cases) {
        CAPTURE(c.what);
        side s(*cpu_be);
        const int64_t D = 64;
        mgl::tensor* x = s.random(dtype::f32, {c.T, D}, 1);
        mgl::tensor* n = mgl::rms_norm(s.ctx, x, s.random(dtype::bf16, {D}, 2), 1e-6f);
        mgl::tensor* logits = mgl::matmul(s.ctx, n, s.random(c.w, {c.E, D}, 3));
        mgl::moe_route_params route;
        route.k = 6;
        mgl::tensor* probs = mgl::softmax(s.ctx, logits);
        mgl::tensor* ids = mgl::moe_topk(s.ctx, probs, route);
        mgl::tensor* w = mgl::moe_weights(s.ctx, probs, ids, route);
        std::vector<mgl::tensor*> outs{ids, w};
        if (c.logits_use == 1) outs.push_back(logits);
        if (c.logits_use == 2) outs.push_back(mgl::add(s.ctx, logits, logits));
        mgl::graph g = mgl::build_graph(s.ctx, std::span<mgl::tensor* const>(outs));
        mgl::cuda_fusions on;
        on.router_route = true;
        const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, on);
        CHECK(f.n_route == 1);
        CHECK(f.n_router_route == (c.fused ? 1 : 0));
        CHECK(f.skipped.count(logits) == (c.fused ? 1u : 0u));
        CHECK(simulate(g, fused_steps(g, f), mgl::plan_allocation(g, 256, f.also_reads)) == 0);
    }
}

TEST_CASE("mgl cuda fusion switches from MINIDS_CUDA_FUSE (host only)") {
    const char* old = std::getenv("MINIDS_CUDA_FUSE");
    const std::string saved = old ? old : "";
    setenv("MINIDS_CUDA_FUSE", "norm,route,router_route", 1);
    const mgl::cuda_fusions on = mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{});
    CHECK(on.norm);
    CHECK(on.route);
    CHECK(on.router_route);
    CHECK(!on.residual);
    CHECK(!on.norm_out);
    setenv("MINIDS_CUDA_FUSE", "all", 1);
    CHECK(
        !mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{}).router_route);  // off by default
    setenv("MINIDS_CUDA_FUSE", "norm,residual,route,mla_prep,route_fetch", 1);
    const mgl::cuda_fusions rf = mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{});
    CHECK((rf.route && rf.route_fetch && !rf.router_route));
    setenv("MINIDS_CUDA_FUSE", "all", 1);
    CHECK(!mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{}).route_fetch);  // off by default
    setenv("MINIDS_CUDA_FUSE", "norm,residual,route,mla_prep,prefetch_behind_misses,shared_beside",
           1);
    const mgl::cuda_fusions sb = mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{});
    CHECK((sb.shared_beside && sb.prefetch_behind_misses && !sb.side_stream));
    setenv("MINIDS_CUDA_FUSE", "router", 1);
    CHECK_THROWS_AS(mgl::cuda::fusion_switches_from_env(mgl::cuda_fusions{}), mgl::error);
    if (old)
        setenv("MINIDS_CUDA_FUSE", saved.c_str(), 1);
    else
        unsetenv("MINIDS_CUDA_FUSE");
}

TEST_CASE("mgl cuda precise switches from MINIDS_CUDA_PRECISE (host only)") {
    const char* old = std::getenv("MINIDS_CUDA_PRECISE");
    const std::string saved = old ? old : "";
    unsetenv("MINIDS_CUDA_PRECISE");
    auto off = mgl::cuda::precise_switches_from_env();
    CHECK((!off.gemm && !off.moe && !off.mla));
    setenv("MINIDS_CUDA_PRECISE", "gemm,mla", 1);
    auto some = mgl::cuda::precise_switches_from_env();
    CHECK((some.gemm && !some.moe && some.mla));
    setenv("MINIDS_CUDA_PRECISE", "all", 1);
    auto all = mgl::cuda::precise_switches_from_env();
    CHECK((all.gemm && all.moe && all.mla));
    setenv("MINIDS_CUDA_PRECISE", "gem", 1);  // a typo is an error, not a silent no-op
    CHECK_THROWS_AS(mgl::cuda::precise_switches_from_env(), mgl::error);
    if (old)
        setenv("MINIDS_CUDA_PRECISE", saved.c_str(), 1);
    else
        unsetenv("MINIDS_CUDA_PRECISE");
}

TEST_CASE("mgl cuda MoE decode tuning from MINIDS_MOE_DECODE (host only)") {
    const char* old = std::getenv("MINIDS_MOE_DECODE");
    const std::string saved = old ? old : "";
    unsetenv("MINIDS_MOE_DECODE");
    minids::kernels::MoeDecodeConfig c;
    mgl::cuda::moe_decode_config_from_env(c);  // unset: the defaults stay
    CHECK(c.down_warps == minids::kernels::MoeDecodeConfig{}.down_warps);
    setenv("MINIDS_MOE_DECODE", "down_warps=8,unroll=4,gate_up_compact=0", 1);
    mgl::cuda::moe_decode_config_from_env(c);
    CHECK(c.down_warps == 8);
    CHECK(c.unroll == 4);
    CHECK(!c.gate_up_compact_grid);
    CHECK(c.gate_up_warps == minids::kernels::MoeDecodeConfig{}.gate_up_warps);
    for (const char* bad : {"down_warp=8", "unroll=4x", "unroll", "unroll="}) {
        setenv("MINIDS_MOE_DECODE", bad, 1);
        CHECK_THROWS_AS(mgl::cuda::moe_decode_config_from_env(c), mgl::error);
    }
    if (old)
        setenv("MINIDS_MOE_DECODE", saved.c_str(), 1);
    else
        unsetenv("MINIDS_MOE_DECODE");
}

TEST_CASE("mgl cuda MINIDS_CUDA_GEMM_X and MINIDS_STREAM_PLAN (host only)") {
    const char* old = std::getenv("MINIDS_CUDA_GEMM_X");
    const std::string saved = old ? old : "";
    unsetenv("MINIDS_CUDA_GEMM_X");
    CHECK(mgl::cuda::gemm_split_x_from_env());  // the default: split
    setenv("MINIDS_CUDA_GEMM_X", "bf16", 1);
    CHECK(!mgl::cuda::gemm_split_x_from_env());
    setenv("MINIDS_CUDA_GEMM_X", "split", 1);
    CHECK(mgl::cuda::gemm_split_x_from_env());
    setenv("MINIDS_CUDA_GEMM_X", "f16", 1);
    CHECK_THROWS_AS(mgl::cuda::gemm_split_x_from_env(), mgl::error);
    const char* plan = std::getenv("MINIDS_STREAM_PLAN");
    const std::string saved_plan = plan ? plan : "";
    unsetenv("MINIDS_STREAM_PLAN");
    CHECK(mgl::cuda::stream_plan_from_env() == 2);  // the default
    setenv("MINIDS_STREAM_PLAN", "1", 1);
    CHECK(mgl::cuda::stream_plan_from_env() == 1);
    setenv("MINIDS_STREAM_PLAN", "2", 1);
    CHECK(mgl::cuda::stream_plan_from_env() == 2);
    setenv("MINIDS_STREAM_PLAN", "3", 1);
    CHECK_THROWS_AS(mgl::cuda::stream_plan_from_env(), mgl::error);
    if (plan)
        setenv("MINIDS_STREAM_PLAN", saved_plan.c_str(), 1);
    else
        unsetenv("MINIDS_STREAM_PLAN");
    if (old)
        setenv("MINIDS_CUDA_GEMM_X", saved.c_str(), 1);
    else
        unsetenv("MINIDS_CUDA_GEMM_X");
}

TEST_CASE("mgl cuda grouped MoE kernel from MINIDS_MOE_GROUPED (host only)") {
    using minids::kernels::MoeGroupedKernel;
    const char* old = std::getenv("MINIDS_MOE_GROUPED");
    const std::string saved = old ? old : "";
    unsetenv("MINIDS_MOE_GROUPED");
    CHECK(mgl::cuda::moe_grouped_kernel_from_env() ==
          minids::kernels::moe_grouped_default_kernel());
    CHECK(minids::kernels::MoeGroupedConfig{}.kernel ==
          minids::kernels::moe_grouped_default_kernel());
    setenv("MINIDS_MOE_GROUPED", "", 1);
    CHECK(mgl::cuda::moe_grouped_kernel_from_env() ==
          minids::kernels::moe_grouped_default_kernel());
    setenv("MINIDS_MOE_GROUPED", "pipelined", 1);
    CHECK(mgl::cuda::moe_grouped_kernel_from_env() == MoeGroupedKernel::pipelined);
    setenv("MINIDS_MOE_GROUPED", "staged", 1);
    CHECK(mgl::cuda::moe_grouped_kernel_from_env() == MoeGroupedKernel::staged);
    setenv("MINIDS_MOE_GROUPED", "pipeline", 1);  // a typo is an error, not a silent default
    CHECK_THROWS_WITH_AS(mgl::cuda::moe_grouped_kernel_from_env(),
                         doctest::Contains("expected staged or pipelined"), mgl::error);
    if (old)
        setenv("MINIDS_MOE_GROUPED", saved.c_str(), 1);
    else
        unsetenv("MINIDS_MOE_GROUPED");
}

TEST_CASE("mgl cuda fusion planner (host only): no fusion of a graph output or a shared product") {
    auto cpu_be = mgl::make_cpu_backend(1);
    side s(*cpu_be);
    mgl::tensor* x = s.random(dtype::f32, {1, 64}, 1);
    mgl::tensor* n = mgl::rms_norm(s.ctx, x, nullptr, 1e-6f);
    mgl::tensor* y = mgl::matmul(s.ctx, n, s.random(dtype::bf16, {32, 64}, 2));
    mgl::tensor* z = mgl::add(s.ctx, y, s.random(dtype::f32, {1, 32}, 3));
    mgl::tensor* z2 = mgl::mul(s.ctx, y, z);  // y has a second reader: no residual fusion
    mgl::tensor* n_out = mgl::rms_norm(s.ctx, x, nullptr, 1e-5f);
    mgl::tensor* y2 = mgl::matmul(s.ctx, n_out, s.random(dtype::bf16, {32, 64}, 4));
    mgl::graph g = mgl::build_graph(s.ctx, {z2, y2, n_out});  // n_out is an output
    const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, mgl::cuda_fusions{});
    CHECK(f.n_residual == 0);
    CHECK(f.n_norm == 1);  // n into y; not n_out
    CHECK(f.norm_of.count(y) == 1);
    CHECK(f.norm_of.count(y2) == 0);
}

TEST_CASE("mgl cuda fusion planner (host only): the model's decode and prompt graphs") {
    TestModel m = open_test_model(converted_fixture(dtype::bf16), 1);
    const minids::ModelConfig& c = m.model->config();
    const int64_t n_layer = c.num_hidden_layers, n_moe = int64_t(m.model->moe_layers().size());
    for (int64_t T : {1, 7, 30}) {
        CAPTURE(T);
        // Structure only: the leaves need no memory to be planned.
        mgl::context ctx;
        minids::ForwardBatch batch;
        batch.tokens = ctx.new_tensor(dtype::i32, {T}, "tokens");
        batch.positions = ctx.new_tensor(dtype::i32, {T}, "positions");
        for (int64_t il = 0; il < n_layer; ++il)
            batch.kv_pages.push_back(
                ctx.new_tensor(dtype::bf16, {8, 16, c.kv_cache_width()}, "pages"));
        batch.page_table = ctx.new_tensor(dtype::i32, {8}, "page_table");
        const minids::ForwardResult out = m.model->build_forward(ctx, batch);
        std::vector<mgl::tensor*> outputs{out.logits};
        outputs.insert(outputs.end(), out.router_ids.begin(), out.router_ids.end());
        outputs.insert(outputs.end(), out.router_weights.begin(), out.router_weights.end());
        mgl::graph g = mgl::build_graph(ctx, std::span<mgl::tensor* const>(outputs));
        const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, mgl::cuda_fusions{});
        // Every layer: the attention output and the FFN output are residual epilogues, the MLA
        // prologue is one mla_prep; every MoE layer routes in one launch. Norms: each layer's
        // input norm (read only by the q and kv projections), the dense layers' FFN norm (gate
        // and up), the output norm (of the last position only, so at any T); with norm_moe also
        // the MoE layers' FFN norm (router and experts) while the experts take the decode path.
        CHECK(f.n_residual == 2 * n_layer);
        CHECK(f.n_mla_prep == n_layer);
        CHECK(f.n_route == n_moe);
        CHECK(f.n_norm == (T <= 16 ? n_layer + (n_layer - n_moe) : 0) + 1);
        mgl::cuda_fusions moe_norm;
        moe_norm.norm_moe = true;
        const mgl::cuda::fusion_plan fm = mgl::cuda::plan_fusions(g, moe_norm);
        CHECK(fm.n_norm == f.n_norm + (T <= 8 ? n_moe : 0));
        CHECK(simulate(g, fused_steps(g, fm), mgl::plan_allocation(g, 256, fm.also_reads)) == 0);
        // norm_out: each MoE layer's FFN norm is written by its router at decode (one row).
        mgl::cuda_fusions out_norm;
        out_norm.norm_out = true;
        const mgl::cuda::fusion_plan fo = mgl::cuda::plan_fusions(g, out_norm);
        CHECK(fo.n_norm_out == (T == 1 ? n_moe : 0));
        CHECK(simulate(g, fused_steps(g, fo), mgl::plan_allocation(g, 256, fo.also_reads)) == 0);
        CHECK(simulate(g, fused_steps(g, f), mgl::plan_allocation(g, 256, f.also_reads)) == 0);
        // router_route: every MoE layer's router runs in its route step at decode sizes, with
        // the FFN norm written by it under norm_out (T = 1).
        for (const bool with_norm_out : {false, true}) {
            CAPTURE(with_norm_out);
            mgl::cuda_fusions rr;
            rr.router_route = true;
            rr.norm_out = with_norm_out;
            const mgl::cuda::fusion_plan fr = mgl::cuda::plan_fusions(g, rr);
            CHECK(fr.n_route == n_moe);
            CHECK(fr.n_router_route == (T <= 8 ? n_moe : 0));
            CHECK(fr.n_norm_out == (with_norm_out && T == 1 ? n_moe : 0));
            int with_norm = 0;
            for (const auto& [w, r] : fr.route_at)
                with_norm += r.router && fr.writes_norm.count(r.router) ? 1 : 0;
            CHECK(with_norm == fr.n_norm_out);
            CHECK(simulate(g, fused_steps(g, fr), mgl::plan_allocation(g, 256, fr.also_reads)) ==
                  0);
        }
        CHECK(f.n_route_fetch == 0);  // no expert fetch in this graph
        // shared_beside (on by default): every MoE layer's shared expert at decode sizes, its
        // gate/up after the FFN norm's step (with norm_moe, after the add that writes the norm's
        // input); nothing at all with side_stream.
        const bool has_shared = c.n_shared_experts && *c.n_shared_experts > 0;
        for (const bool with_norm_moe : {false, true}) {
            CAPTURE(with_norm_moe);
            mgl::cuda_fusions sb;
            sb.shared_beside = true;
            sb.norm_moe = with_norm_moe;
            const mgl::cuda::fusion_plan fs = mgl::cuda::plan_fusions(g, sb);
            const size_t want = T <= 8 && has_shared ? size_t(n_moe) : 0;
            if (!with_norm_moe) CHECK(f.shared_beside.size() == want);  // the defaults
            CHECK(fs.shared_beside.size() == want);
            CHECK(fs.shared_after.size() == want);
            for (const auto& [writer, moe] : fs.shared_after) {
                CHECK(moe->op_kind == mgl::op::moe_experts);
                CHECK(writer->op_kind == (with_norm_moe ? mgl::op::add : mgl::op::rms_norm));
            }
            CHECK(simulate(g, fused_steps(g, fs), mgl::plan_allocation(g, 256, fs.also_reads)) ==
                  0);
            sb.side_stream = true;
            CHECK(mgl::cuda::plan_fusions(g, sb).shared_beside.empty());
        }
    }
}

namespace {

// The model's forward with the expert cache's device fetch (and optionally imposed routing):
// structure only, as above.
struct FetchGraph {
    mgl::context ctx;
    mgl::graph g;
    std::vector<const mgl::tensor*> fetches;
    FetchGraph(const TestModel& m, int64_t T, bool imposed, int prefetch = 0) {
        const minids::ModelConfig& c = m.model->config();
        minids::ForwardBatch batch;
        batch.tokens = ctx.new_tensor(dtype::i32, {T}, "tokens");
        batch.positions = ctx.new_tensor(dtype::i32, {T}, "positions");
        for (int64_t il = 0; il < c.num_hidden_layers; ++il)
            batch.kv_pages.push_back(
                ctx.new_tensor(dtype::bf16, {8, 16, c.kv_cache_width()}, "pages"));
        batch.page_table = ctx.new_tensor(dtype::i32, {8}, "page_table");
        batch.expert_fetch = ctx.new_tensor(dtype::i64, {1024}, "expert_fetch_state");
        batch.expert_prefetch = prefetch;
        if (imposed) {
            const int64_t k = c.num_experts_per_tok;
            for (size_t l = 0; l < m.model->moe_layers().size(); ++l) {
                batch.routing_ids.push_back(ctx.new_tensor(dtype::i32, {T, k}, "imposed_ids"));
                batch.routing_weights.push_back(
                    ctx.new_tensor(dtype::f32, {T, k}, "imposed_weights"));
            }
        }
        const minids::ForwardResult out = m.model->build_forward(ctx, batch);
        std::vector<mgl::tensor*> outputs{out.logits};
        outputs.insert(outputs.end(), out.router_ids.begin(), out.router_ids.end());
        outputs.insert(outputs.end(), out.router_weights.begin(), out.router_weights.end());
        g = mgl::build_graph(ctx, std::span<mgl::tensor* const>(outputs),
                             std::span<mgl::tensor* const>(out.schedule));
        for (const mgl::tensor* n : g.nodes) {
            if (mgl::is_expert_prefetch(*n))
                prefetches.push_back(n);
            else if (n->op_kind == mgl::op::expert_fetch)
                fetches.push_back(n);
        }
    }
    std::vector<const mgl::tensor*> prefetches;
};

// The nodes fused_steps' steps run at, in the same order.
std::vector<const mgl::tensor*> step_nodes(const mgl::graph& g, const mgl::cuda::fusion_plan& f) {
    std::vector<const mgl::tensor*> out;
    for (const mgl::tensor* n : g.nodes)
        if (!f.skipped.count(n) && n->op_kind != mgl::op::view) out.push_back(n);
    return out;
}

// Steps the CUDA backend may run at the same time (launches.h: a side step runs beside every
// main step after it until the main stream joins the side stream) that touch the same arena
// memory, one writing it. Returns the number of such pairs.
int concurrent_conflicts(const mgl::graph& g, const mgl::cuda::fusion_plan& f,
                         const mgl::alloc_plan& plan) {
    const std::vector<step> steps = fused_steps(g, f);
    const std::vector<const mgl::tensor*> at = step_nodes(g, f);
    REQUIRE(steps.size() == at.size());
    std::map<const mgl::tensor*, std::pair<size_t, size_t>> range;  // root -> bytes [a, b)
    for (auto [t, offset] : plan.offsets) range[t] = {offset, offset + mgl::nbytes(*t)};
    auto overlap = [&](const std::vector<const mgl::tensor*>& a,
                       const std::vector<const mgl::tensor*>& b) {
        for (const mgl::tensor* x : a)
            for (const mgl::tensor* y : b) {
                auto rx = range.find(root(x)), ry = range.find(root(y));
                if (rx == range.end() || ry == range.end()) continue;  // leaves
                if (rx->second.first < ry->second.second && ry->second.first < rx->second.second)
                    return true;
            }
        return false;
    };
    int conflicts = 0;
    std::vector<size_t> in_flight;  // side steps since the last join
    for (size_t i = 0; i < steps.size(); ++i) {
        if (f.side.count(at[i])) {
            in_flight.push_back(i);
            continue;
        }
        if (f.join_before.count(at[i])) in_flight.clear();
        for (size_t sdx : in_flight) {
            const step& side = steps[sdx];
            const step& main = steps[i];
            if (overlap(side.writes, main.reads) || overlap(side.writes, main.writes) ||
                overlap(side.reads, main.writes))
                ++conflicts;
        }
    }
    return conflicts;
}

}  // namespace

TEST_CASE(
    "mgl cuda fusion planner (host only): route_fetch plans every MoE layer's fetch in its "
    "route step") {
    TestModel m = open_test_model(converted_fixture(dtype::bf16), 1);
    const int64_t n_moe = int64_t(m.model->moe_layers().size());
    for (int64_t T : {1, 7, 30}) {
        CAPTURE(T);
        FetchGraph fg(m, T, false);
        const mgl::graph& g = fg.g;
        REQUIRE(int64_t(fg.fetches.size()) == n_moe);
        // Off by default: every fetch plans in its own step.
        const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, mgl::cuda_fusions{});
        CHECK(f.n_route_fetch == 0);
        CHECK(f.fetch_planned.empty());
        for (const bool router_route : {false, true}) {
            CAPTURE(router_route);
            mgl::cuda_fusions on;
            on.route_fetch = true;
            on.router_route = router_route;
            const mgl::cuda::fusion_plan fr = mgl::cuda::plan_fusions(g, on);
            // At any T (the launcher plans in the routing's own launch where one block routes
            // every token, else right after it), with or without the router in the step.
            CHECK(fr.n_route == n_moe);
            CHECK(fr.n_route_fetch == n_moe);
            CHECK(fr.n_router_route == (router_route && T <= 8 ? n_moe : 0));
            for (const mgl::tensor* fetch : fg.fetches) CHECK(fr.fetch_planned.count(fetch) == 1);
            for (const auto& [w, r] : fr.route_at) {
                REQUIRE(r.fetch);
                CHECK(r.fetch->src[1] == r.topk);
                // The fetch still has a step of its own (the copy), right after the route's.
                CHECK(fr.skipped.count(r.fetch) == 0);
            }
            // Nothing else changes: the same groups and skipped nodes as without it.
            mgl::cuda_fusions off = on;
            off.route_fetch = false;
            const mgl::cuda::fusion_plan fo = mgl::cuda::plan_fusions(g, off);
            CHECK(fr.skipped == fo.skipped);
            CHECK(fused_steps(g, fr).size() == fused_steps(g, fo).size());
            CHECK(simulate(g, fused_steps(g, fr), mgl::plan_allocation(g, 256, fr.also_reads)) ==
                  0);
        }
        // Imposed routing: the fetches read the imposed ids, not the routes', so nothing fuses.
        FetchGraph imposed(m, T, true);
        mgl::cuda_fusions on;
        on.route_fetch = true;
        const mgl::cuda::fusion_plan fi = mgl::cuda::plan_fusions(imposed.g, on);
        CHECK(int64_t(imposed.fetches.size()) == n_moe);
        CHECK(fi.n_route_fetch == 0);
        // Without the route fusion there is no group to plan in.
        on.route = false;
        CHECK(mgl::cuda::plan_fusions(g, on).n_route_fetch == 0);
    }
}

TEST_CASE(
    "mgl cuda fusion planner (host only): route_fetch refuses a fetch with a table reader "
    "between the two steps") {
    // Two layers' routes and fetches sharing one state, ordered route A, route B, fetch B,
    // fetch A: fetch B follows its route directly and fuses; between route A and fetch A runs
    // fetch B, which rewrites tables and the state, so planning A's fetch in its route's step
    // would change what B's plan sees. A's fetch keeps its own plan.
    auto cpu_be = mgl::make_cpu_backend(1);
    side s(*cpu_be);
    const int64_t E = 64, T = 1;
    mgl::moe_route_params route;
    route.k = 6;
    auto layout = std::make_shared<mgl::expert_layout>();
    layout->blob_bytes = 4096;
    mgl::tensor* state = s.ctx.new_tensor(dtype::i64, {1024}, "state");
    struct Layer {
        mgl::tensor *ids, *w, *fetch;
    };
    auto layer = [&](int index, uint64_t seed) {
        mgl::tensor* logits = s.random(dtype::f32, {T, E}, seed);
        mgl::tensor* probs = mgl::softmax(s.ctx, logits);
        Layer l;
        l.ids = mgl::moe_topk(s.ctx, probs, route);
        l.w = mgl::moe_weights(s.ctx, probs, l.ids, route);
        mgl::tensor* table = s.ctx.new_tensor(dtype::i64, {E}, "table");
        l.fetch = mgl::expert_fetch(s.ctx, table, l.ids, state, index, layout);
        return l;
    };
    const Layer a = layer(0, 1), b = layer(1, 2);
    mgl::graph g = mgl::build_graph(s.ctx, {a.w, b.w, b.fetch, a.fetch});
    REQUIRE(g.nodes.back() == a.fetch);
    mgl::cuda_fusions on;
    on.route_fetch = true;
    const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, on);
    CHECK(f.n_route == 2);
    CHECK(f.n_route_fetch == 1);
    CHECK(f.fetch_planned.count(b.fetch) == 1);
    CHECK(f.fetch_planned.count(a.fetch) == 0);
    CHECK(f.route_at.at(a.w).fetch == nullptr);
    CHECK(f.route_at.at(b.w).fetch == b.fetch);
    CHECK(simulate(g, fused_steps(g, f), mgl::plan_allocation(g, 256, f.also_reads)) == 0);
}

TEST_CASE(
    "mgl cuda fusion planner (host only): a prefetch and its prediction run on the side stream, "
    "joined before the next fetch") {
    TestModel m = open_test_model(converted_fixture(dtype::bf16), 1);
    const int64_t n_moe = int64_t(m.model->moe_layers().size());
    REQUIRE(n_moe >= 2);
    for (int64_t T : {1, 7}) {
        for (const bool route_fetch : {false, true}) {
            CAPTURE(T);
            CAPTURE(route_fetch);
            FetchGraph fg(m, T, false, 2);
            const mgl::graph& g = fg.g;
            mgl::cuda_fusions on;
            on.route_fetch = route_fetch;
            on.side_stream = true;
            const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, on);
            const mgl::alloc_plan plan = mgl::plan_allocation(g, 256, f.also_reads);
            CHECK(simulate(g, fused_steps(g, f), plan) == 0);
            CHECK(int64_t(fg.fetches.size()) == n_moe);
            if (T > 1) {  // prompts do not prefetch
                CHECK(fg.prefetches.empty());
                CHECK(f.side.empty());
                CHECK(f.defers_wait.empty());
                continue;
            }
            REQUIRE(int64_t(fg.prefetches.size()) == n_moe - 1);
            // A prefetch reads its previous layer's ids after that layer's route step (the
            // schedule places the route's weights first): every layer still routes in one step.
            CHECK(f.n_route == n_moe);
            // The prefetches and the nodes only they read (the prediction) are side nodes,
            // nothing else: every side node's readers are side nodes, and none is an output.
            std::map<const mgl::tensor*, int> readers_outside;
            for (const mgl::tensor* n : g.nodes)
                for (const mgl::tensor* s : n->src)
                    if (s && f.side.count(s) && !f.side.count(n)) ++readers_outside[s];
            CHECK(readers_outside.size() == fg.prefetches.size());  // each prefetch, by its fetch
            for (const mgl::tensor* p : fg.prefetches) {
                CHECK(f.side.count(p) == 1);
                CHECK(f.side.count(p->src[1]) == 1);  // the predicted ids
                CHECK(readers_outside[p] == 1);
            }
            for (const mgl::tensor* o : g.outputs) CHECK(f.side.count(o) == 0);
            // Each prefetch follows its previous layer's fetch (the model's schedule), and the
            // main stream joins before the next fetch: one join per prefetch.
            const std::vector<const mgl::tensor*> at = step_nodes(g, f);
            auto index_of = [&](const mgl::tensor* n) {
                return size_t(std::find(g.nodes.begin(), g.nodes.end(), n) - g.nodes.begin());
            };
            for (size_t l = 0; l + 1 < fg.fetches.size(); ++l) {
                const size_t pre = index_of(fg.prefetches[l]);
                CHECK(index_of(fg.fetches[l]) < pre);
                CHECK(pre < index_of(fg.fetches[l + 1]));
                CHECK(fg.fetches[l + 1]->src[0] == fg.prefetches[l]);  // the table it takes
            }
            CHECK(f.join_before.size() == fg.prefetches.size());
            // Main steps run beside each prefetch (its layer's experts at least): the step after
            // it is a main step that does not join.
            for (size_t i = 0; i + 1 < at.size(); ++i)
                if (mgl::is_expert_prefetch(*at[i])) {
                    CHECK(f.side.count(at[i + 1]) == 0);
                    CHECK(f.join_before.count(at[i + 1]) == 0);
                }
            // And none of them touches the side steps' memory.
            CHECK(concurrent_conflicts(g, f, plan) == 0);
            // Without the side stream every step runs in node order on one stream.
            mgl::cuda_fusions serial = on;
            serial.side_stream = false;
            const mgl::cuda::fusion_plan fs = mgl::cuda::plan_fusions(g, serial);
            CHECK(fs.side.empty());
            CHECK(fs.join_before.empty());
            // On the side stream a layer's experts run beside its prefetch: each fetch waits
            // itself. On one stream (prefetch_behind_misses) every layer's fetch but the last
            // leaves its wait to the prefetch after it, which precedes the layer's experts.
            CHECK(f.defers_wait.empty());
            CHECK(f.waits_for_layer.empty());
            CHECK(fs.defers_wait.size() == fg.prefetches.size());
            CHECK(fs.waits_for_layer.size() == fg.prefetches.size());
            for (size_t l = 0; l + 1 < fg.fetches.size(); ++l) {
                CHECK(fs.defers_wait.count(fg.fetches[l]) == 1);
                CHECK(fs.waits_for_layer.count(fg.prefetches[l]) == 1);
                for (const mgl::tensor* n : g.nodes)
                    if (n->op_kind == mgl::op::moe_experts && n->src[3] == fg.fetches[l])
                        CHECK(index_of(fg.prefetches[l]) < index_of(n));
            }
            CHECK(fs.defers_wait.count(fg.fetches.back()) == 0);
            mgl::cuda_fusions waiting = serial;
            waiting.prefetch_behind_misses = false;
            const mgl::cuda::fusion_plan fw = mgl::cuda::plan_fusions(g, waiting);
            CHECK(fw.defers_wait.empty());
            CHECK(fw.waits_for_layer.empty());
            // The check can fail: memory planned as if the steps ran in node order (without the
            // side nodes kept live until their join) is reused beside them.
            const int unsafe =
                concurrent_conflicts(g, f, mgl::plan_allocation(g, 256, fs.also_reads));
            MESSAGE("side steps beside main steps in memory planned for node order: "
                    << unsafe << " conflicts");
            CHECK(unsafe > 0);
        }
    }
}

// The launch list needs a device (the launches size themselves to it), but runs nothing.
TEST_CASE(
    "mgl cuda launches: a layer's experts start beside the fetch launch before them, and only "
    "there" *
    doctest::skip(!minids::test::cuda_device_available())) {
    TestModel m = open_test_model(converted_fixture(dtype::bf16), 1);
    const int64_t n_moe = int64_t(m.model->moe_layers().size());
    for (const bool route_fetch : {false, true}) {
        CAPTURE(route_fetch);
        FetchGraph fg(m, 1, false, 2);
        const mgl::graph& g = fg.g;
        mgl::cuda_fusions on;
        on.route_fetch = route_fetch;
        on.side_stream = true;
        const mgl::cuda::fusion_plan f = mgl::cuda::plan_fusions(g, on);
        mgl::cuda_fusions serial = on;
        serial.side_stream = false;
        const mgl::cuda::fusion_plan fs = mgl::cuda::plan_fusions(g, serial);
        // A layer's experts start beside the launch before them only when it is a fetch's plan
        // and copy on their stream: the prefetch behind the layer's misses, the layer's own
        // fetch (the last layer's, or any with the prefetch on the side stream), or with
        // route_fetch a fetch or prefetch its routing launch could not plan; never after a copy
        // planned in the routing launch, which lets the next kernel in before the plan is done,
        // nor after a join (the side stream's event).
        const mgl::cuda::launch_context no_rope{
            [](const std::shared_ptr<const mgl::rope_params>&) -> const float* { return nullptr; }};
        // The launches' parameters take addresses: host memory stands in for the device's.
        const auto host = mgl::make_cpu_backend(1);
        std::vector<mgl::buffer_ptr> leaf_memory;
        for (mgl::tensor* leaf : g.leafs)
            if (!leaf->data) {
                leaf_memory.push_back(host->alloc_buffer(mgl::nbytes(*leaf)));
                leaf->data = leaf_memory.back()->base();
            }
        for (const mgl::cuda::fusion_plan* plan : {&fs, &f}) {
            const mgl::alloc_plan placed = mgl::plan_allocation(g, 256, plan->also_reads);
            const mgl::buffer_ptr arena = host->alloc_buffer(placed.arena_bytes);
            mgl::apply_plan(fg.g, placed, *arena);
            const mgl::cuda::launch_list launches = mgl::cuda::build_launches(g, *plan, no_rope);
            int moe = 0, early = 0, shared_side = 0;
            const mgl::cuda::launch_step* prev_main = nullptr;
            for (const mgl::cuda::launch_step& s : launches.steps) {
                if (s.node && mgl::is_expert_prefetch(*s.node)) CHECK(s.side == (plan == &f));
                if (s.side && s.what == "moe_experts(shared gate/up)") ++shared_side;
                if (s.side) continue;
                // shared_beside (on without side_stream): the layer's down launch comes last,
                // joined with the shared expert's gate/up on the side stream, and keeps PDL.
                const bool down = s.what.size() > 6 && s.what.rfind("(down)") == s.what.size() - 6;
                if (down) {
                    CHECK(plan == &fs);
                    CHECK((s.join && s.join_keeps_pdl && !s.after_fetch));
                    REQUIRE(prev_main != nullptr);
                    CHECK(prev_main->what.find("(routed gate/up)") != std::string::npos);
                } else if (s.what.rfind("moe_experts", 0) == 0) {
                    ++moe;
                    early += s.after_fetch ? 1 : 0;
                    REQUIRE(prev_main != nullptr);
                    CAPTURE(prev_main->what);
                    CHECK(s.after_fetch == (!s.join && prev_main->what == "expert_fetch" &&
                                            prev_main->node->op_kind == mgl::op::expert_fetch));
                }
                prev_main = &s;
            }
            CHECK(moe == n_moe);
            CHECK(shared_side == (plan == &fs ? n_moe : 0));
            // Without route_fetch every layer's experts follow a fetch or prefetch launch.
            if (route_fetch) {
                CHECK(early < n_moe);
            } else {
                CHECK(early == n_moe);
            }
        }
    }
}

#endif  // MINIDS_HAVE_CUDA
