// Tensors, views, graph order, the arena plan, and the CPU backend's plumbing.
#include <algorithm>
#include <atomic>
#include <map>
#include <set>

#include "../ggml-like/cpu/thread_pool.h"
#include "test_mgl_util.h"

using mgl::dtype;
using mgl_test::harness;

TEST_CASE("mgl tensor: contiguous strides, sizes and names") {
    mgl::context ctx;
    mgl::tensor* t = ctx.new_tensor(dtype::bf16, {3, 5, 7}, "t");
    CHECK(t->n_dims == 3);
    CHECK(t->stride[2] == 2);
    CHECK(t->stride[1] == 14);
    CHECK(t->stride[0] == 70);
    CHECK(t->nelements() == 105);
    CHECK(mgl::nbytes(*t) == 210);
    CHECK(t->is_contiguous());
    CHECK(mgl::shape_str(*t) == "[3, 5, 7]");
    CHECK(t->shape[3] == 1);  // unused dims are 1
    CHECK(std::string(mgl::op_name(mgl::op::mla_attn)) == "mla_attn");
    CHECK(ctx.size() == 1);
}

TEST_CASE("mgl views: reshape, permute, transpose and slice alias without copying") {
    mgl::context ctx;
    mgl::tensor* a = ctx.new_tensor(dtype::f32, {4, 6, 10}, "a");
    mgl::tensor* r = mgl::reshape(ctx, a, {24, 10});
    CHECK(r->op_kind == mgl::op::view);
    CHECK(r->src[0] == a);
    CHECK(r->stride[0] == 40);
    mgl::tensor* p = mgl::permute(ctx, a, {1, 0, 2});
    CHECK(p->shape[0] == 6);
    CHECK(p->shape[1] == 4);
    CHECK(p->stride[0] == 40);
    CHECK(p->stride[1] == 240);
    CHECK_FALSE(p->is_contiguous());
    mgl::tensor* tr = mgl::transpose(ctx, a, 0, 2);
    CHECK(tr->shape[0] == 10);
    CHECK(tr->stride[0] == 4);
    CHECK(tr->stride[2] == 240);
    mgl::tensor* s = mgl::slice(ctx, a, 1, 2, 3);
    CHECK(s->shape[1] == 3);
    CHECK(s->view_offset == 80);
    CHECK_FALSE(s->is_contiguous());
    mgl::tensor* s0 = mgl::slice(ctx, a, 0, 1, 2);
    CHECK(s0->is_contiguous());
    // Misuse is an internal fault with a message, not undefined behaviour.
    CHECK_THROWS_AS(mgl::reshape(ctx, p, {240}), mgl::error);
    CHECK_THROWS_AS(mgl::reshape(ctx, a, {7, 10}), mgl::error);
    CHECK_THROWS_AS(mgl::slice(ctx, a, 2, 8, 3), mgl::error);
    CHECK_THROWS_AS(mgl::permute(ctx, a, {0, 0, 1}), mgl::error);
    int64_t shape[2] = {5, 10}, stride[2] = {40, 4};
    CHECK_THROWS_AS(mgl::view(ctx, a, shape, stride, 40 * 20), mgl::error);  // past the end
}

TEST_CASE("mgl graph: topological order, each node once, leafs collected") {
    mgl::context ctx;
    mgl::tensor* x = ctx.new_tensor(dtype::f32, {2, 8}, "x");
    mgl::tensor* w = ctx.new_tensor(dtype::f32, {8}, "w");
    mgl::tensor* n = mgl::rms_norm(ctx, x, w, 1e-6f);  // used twice: a diamond
    mgl::tensor* a = mgl::scale(ctx, n, 2.0f);
    mgl::tensor* b = mgl::mul(ctx, n, w);
    mgl::tensor* y = mgl::add(ctx, a, b);
    mgl::graph g = mgl::build_graph(ctx, {y});
    REQUIRE(g.nodes.size() == 4);
    REQUIRE(g.leafs.size() == 2);
    std::map<mgl::tensor*, size_t> pos;
    for (size_t i = 0; i < g.nodes.size(); ++i) pos[g.nodes[i]] = i;
    for (mgl::tensor* node : g.nodes) {
        for (mgl::tensor* s : node->src) {
            if (s && s->op_kind != mgl::op::none) CHECK(pos.at(s) < pos.at(node));
        }
    }
    CHECK(g.nodes.front() == n);
    CHECK(g.nodes.back() == y);
    CHECK(g.outputs == std::vector<mgl::tensor*>{y});
    // Sources are visited in order: a (src[0]) before b (src[1]).
    CHECK(pos.at(a) < pos.at(b));
}

namespace {

// Property of a correct plan: two planned tensors that are alive at the same time never overlap,
// and nothing overlaps an output.
void check_plan_sound(const mgl::graph& g, const mgl::alloc_plan& plan) {
    std::map<const mgl::tensor*, size_t> step;
    for (size_t i = 0; i < g.nodes.size(); ++i) step[g.nodes[i]] = i;
    auto root = [](mgl::tensor* t) {
        while (mgl::tensor* s = mgl::alias_source(*t)) t = s;
        return t;
    };
    std::map<const mgl::tensor*, size_t> last;
    for (size_t i = 0; i < g.nodes.size(); ++i) {
        last[root(g.nodes[i])] = std::max(last[root(g.nodes[i])], i);
        for (mgl::tensor* s : g.nodes[i]->src)
            if (s) last[root(s)] = std::max(last[root(s)], i);
    }
    std::set<const mgl::tensor*> outputs;
    for (mgl::tensor* o : g.outputs) outputs.insert(root(o));
    for (auto [a, oa] : plan.offsets) {
        for (auto [b, ob] : plan.offsets) {
            if (a == b) continue;
            size_t a0 = step[a], a1 = outputs.count(a) ? g.nodes.size() : last[a];
            size_t b0 = step[b], b1 = outputs.count(b) ? g.nodes.size() : last[b];
            bool live_together = a0 <= b1 && b0 <= a1;
            bool overlap = oa < ob + mgl::nbytes(*b) && ob < oa + mgl::nbytes(*a);
            if (live_together && overlap) {
                // Copies: clang 14 cannot capture structured bindings in CAPTURE's lambda.
                const std::string name_a = a->name, name_b = b->name;
                CAPTURE(name_a);
                CAPTURE(name_b);
                CHECK_FALSE(overlap);
            }
        }
    }
}

}  // namespace

TEST_CASE("mgl plan_allocation: dead buffers are reused, outputs and viewed sources are not") {
    mgl::context ctx;
    mgl::tensor* x = ctx.new_tensor(dtype::f32, {16, 64}, "x");
    x->data = reinterpret_cast<void*>(64);  // a leaf with memory; never dereferenced here
    mgl::tensor* cur = x;
    size_t sum = 0;
    std::vector<mgl::tensor*> chain;
    for (int i = 0; i < 10; ++i) {
        cur = mgl::scale(ctx, cur, 1.5f);
        cur->name = std::to_string(i);  // (GCC 12 -Wrestrict misfires on "s" + string)
        sum += mgl::nbytes(*cur);
        chain.push_back(cur);
    }
    // A view of an early node consumed late keeps that node alive until then.
    mgl::tensor* early_view = mgl::slice(ctx, chain[1], 0, 0, 16);
    mgl::tensor* y = mgl::add(ctx, cur, early_view);
    sum += mgl::nbytes(*y);
    mgl::graph g = mgl::build_graph(ctx, {y, chain[4]});
    mgl::alloc_plan plan = mgl::plan_allocation(g);
    CHECK(plan.offsets.size() == 11);  // ten scales and y; the view gets no memory
    CHECK(plan.arena_bytes < sum / 2);
    check_plan_sound(g, plan);
    // chain[1] is read (through the view) by the last node, chain[4] is an output: both must
    // hold ranges nobody else is given after they were placed.
    std::map<const mgl::tensor*, size_t> off(plan.offsets.begin(), plan.offsets.end());
    for (auto [t, o] : plan.offsets) {
        if (t == chain[1] || t == chain[4]) continue;
        for (const mgl::tensor* keep : {chain[1], chain[4]}) {
            bool after = std::find(g.nodes.begin(), g.nodes.end(), t) >
                         std::find(g.nodes.begin(), g.nodes.end(), keep);
            bool overlap = o < off[keep] + mgl::nbytes(*keep) && off[keep] < o + mgl::nbytes(*t);
            if (after) CHECK_FALSE(overlap);
        }
    }
}

TEST_CASE("mgl plan_allocation: random graphs never overlap live tensors") {
    std::mt19937_64 rng(77);
    for (int trial = 0; trial < 20; ++trial) {
        mgl::context ctx;
        std::vector<mgl::tensor*> pool;
        for (int i = 0; i < 3; ++i) {
            mgl::tensor* leaf = ctx.new_tensor(dtype::f32, {8, 32}, "leaf");
            leaf->data = reinterpret_cast<void*>(64);
            pool.push_back(leaf);
        }
        for (int i = 0; i < 30; ++i) {
            mgl::tensor* a = pool[rng() % pool.size()];
            mgl::tensor* b = pool[rng() % pool.size()];
            mgl::tensor* t = nullptr;
            switch (rng() % 4) {
                case 0:
                    t = mgl::add(ctx, a, b);
                    break;
                case 1:
                    t = mgl::scale(ctx, a, 0.5f);
                    break;
                case 2:
                    t = mgl::reshape(ctx, mgl::contiguous(ctx, mgl::transpose(ctx, a, 0, 1)),
                                     {8, 32});
                    break;
                default:
                    t = mgl::concat(ctx, mgl::slice(ctx, a, 1, 0, 16),
                                    mgl::slice(ctx, b, 1, 16, 16), 1);
                    break;
            }
            t->name = std::to_string(i);
            pool.push_back(t);
        }
        mgl::graph g = mgl::build_graph(ctx, {pool.back(), pool[pool.size() / 2]});
        check_plan_sound(g, mgl::plan_allocation(g));
    }
}

TEST_CASE("mgl cpu: a long chain runs correctly in an arena smaller than its intermediates") {
    harness h;
    auto xv = minids::test::random_floats(37 * 53, 5);
    mgl::tensor* x = h.f32({37, 53}, xv);
    auto wv = minids::test::random_floats(53, 6, 0.5f, 1.5f);
    mgl::tensor* w = h.f32({53}, wv, "w");
    mgl::tensor* cur = x;
    size_t sum = 0;
    for (int i = 0; i < 12; ++i) {
        cur = (i % 2) ? mgl::mul(h.ctx, cur, w) : mgl::scale(h.ctx, cur, 0.75f);
        sum += mgl::nbytes(*cur);
    }
    mgl::graph g = mgl::build_graph(h.ctx, {cur});
    mgl::alloc_plan plan = mgl::plan_allocation(g);
    CHECK(plan.arena_bytes * 3 < sum);
    auto got = h.run(cur);
    std::vector<double> want(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        double v = xv[i];
        for (int k = 0; k < 12; ++k) v = (k % 2) ? v * wv[i % 53] : v * 0.75;
        want[i] = v;
    }
    mgl_test::check_close(got, want, 1e-6, 1e-5);
    // Allocating and computing the same graph again gives the same result.
    h.be->allocate(g);
    h.be->compute(g);
    std::vector<float> again(got.size());
    h.be->download(*cur, again.data(), 0, again.size() * 4);
    CHECK(again == got);
}

TEST_CASE("mgl cpu: bind, upload, download and buffer bounds") {
    auto be = mgl::make_cpu_backend(1);
    CHECK(std::string(be->name()) == "cpu");
    mgl::context ctx;
    mgl::tensor* x = ctx.new_tensor(dtype::f32, {3, 5}, "x");
    mgl::buffer_ptr buf = be->alloc_buffer(256);
    CHECK(buf->size() == 256);
    mgl::bind(*x, *buf, 128);
    CHECK(x->data == static_cast<char*>(buf->base()) + 128);
    CHECK(x->buf == buf.get());
    auto v = minids::test::random_floats(15, 9);
    be->upload(*x, v.data(), 0, 60);
    std::vector<float> back(15);
    be->download(*x, back.data(), 0, 60);
    CHECK(back == v);
    float part[2];
    be->download(*x, part, 8, 8);
    CHECK(part[0] == v[2]);
    CHECK_THROWS_AS(be->upload(*x, v.data(), 8, 60), mgl::error);
    mgl::tensor* big = ctx.new_tensor(dtype::f32, {100}, "big");
    CHECK_THROWS_AS(mgl::bind(*big, *buf, 0), mgl::error);
    // A graph whose leaf has no memory is refused at allocate time.
    mgl::tensor* unbound = ctx.new_tensor(dtype::f32, {4}, "unbound");
    mgl::graph g = mgl::build_graph(ctx, {mgl::scale(ctx, unbound, 2.0f)});
    CHECK_THROWS_AS(be->allocate(g), mgl::error);
    CHECK(mgl::physical_cores() >= 1);
}

TEST_CASE("mgl cpu: supports_op covers every op; an out-of-range id fails with an error") {
    harness h;
    auto be = mgl::make_cpu_backend(2);
    mgl::tensor* table = h.random(dtype::f32, {5, 3}, 1);
    mgl::tensor* ids = h.i32({2}, {1, 7});
    mgl::tensor* rows = mgl::get_rows(h.ctx, table, ids);
    CHECK(be->supports_op(*rows));
    mgl::tensor* w = h.random(dtype::bf16, {4, 3}, 2);
    CHECK(be->supports_op(*mgl::matmul(h.ctx, h.random(dtype::f32, {2, 3}, 3), w)));
    CHECK_THROWS_AS(h.run(rows), mgl::error);  // thrown inside a worker, rethrown here
}

TEST_CASE("mgl thread pool: chunks cover the range once; exceptions reach the caller") {
    for (int threads : {1, 2, 3, 5}) {
        mgl::cpu::thread_pool pool(threads);
        CHECK(pool.size() == threads);
        for (int64_t n : {1, 2, 7, 1000}) {
            std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
            pool.parallel_for(n, [&](int64_t b, int64_t e) {
                for (int64_t i = b; i < e; ++i) hits[size_t(i)]++;
            });
            for (auto& h : hits) CHECK(h.load() == 1);
        }
        CHECK_THROWS_AS(pool.parallel_for(100,
                                          [](int64_t b, int64_t) {
                                              if (b > 0) throw mgl::error("boom");
                                              if (b == 0) throw mgl::error("boom0");
                                          }),
                        mgl::error);
        // The pool is still usable after an exception.
        std::atomic<int64_t> total{0};
        pool.parallel_for(50, [&](int64_t b, int64_t e) { total += e - b; });
        CHECK(total.load() == 50);
    }
}
