// Fusion decisions of the CUDA backend (see fusion.h).
#include "fusion.h"

#include <algorithm>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>

#include "matmul.h"
#include "moe.h"

namespace mgl::cuda {

namespace {

// Each name of the comma list s, in order.
std::vector<std::string> names_of(const std::string& s) {
    std::vector<std::string> names;
    std::stringstream list(s);
    for (std::string name; std::getline(list, name, ',');) names.push_back(name);
    return names;
}

}  // namespace

fusion_switches fusion_switches_from_env(fusion_switches on) {
    const char* v = std::getenv("MINIDS_CUDA_FUSE");
    if (!v || !*v) return on;
    const std::string s = v;
    if (s == "all" || s == "1") return on;
    fusion_switches keep{false, false, false, false, false, false,
                         false, false, false, false, false};
    if (s != "0" && s != "none") {
        for (const std::string& name : names_of(s)) {
            if (name == "norm") {
                keep.norm = true;
            } else if (name == "residual") {
                keep.residual = true;
            } else if (name == "route") {
                keep.route = true;
            } else if (name == "mla_prep") {
                keep.mla_prep = true;
            } else if (name == "norm_moe") {
                keep.norm_moe = true;
            } else if (name == "norm_out") {
                keep.norm_out = true;
            } else if (name == "router_route") {
                keep.router_route = true;
            } else if (name == "route_fetch") {
                keep.route_fetch = true;
            } else if (name == "side_stream") {
                keep.side_stream = true;
            } else if (name == "prefetch_behind_misses") {
                keep.prefetch_behind_misses = true;
            } else if (name == "shared_beside") {
                keep.shared_beside = true;
            } else {
                throw error("MINIDS_CUDA_FUSE: unknown fusion '" + name +
                            "' (expected 0, all, or a comma list of norm, norm_moe, norm_out, "
                            "residual, route, mla_prep, router_route, route_fetch, side_stream, "
                            "prefetch_behind_misses, shared_beside)");
            }
        }
    }
    return keep;
}

precise_switches precise_switches_from_env() {
    precise_switches on;
    const char* v = std::getenv("MINIDS_CUDA_PRECISE");
    if (!v || !*v) return on;
    for (const std::string& name : names_of(v)) {
        if (name == "all") {
            on = precise_switches{true, true, true};
        } else if (name == "gemm") {
            on.gemm = true;
        } else if (name == "moe") {
            on.moe = true;
        } else if (name == "mla") {
            on.mla = true;
        } else {
            throw error("MINIDS_CUDA_PRECISE: unknown product '" + name +
                        "' (expected a comma list of gemm, moe, mla, or all)");
        }
    }
    return on;
}

void moe_decode_config_from_env(minids::kernels::MoeDecodeConfig& c) {
    const char* v = std::getenv("MINIDS_MOE_DECODE");
    if (!v || !*v) return;
    for (const std::string& item : names_of(v)) {
        const size_t eq = item.find('=');
        const std::string key = item.substr(0, eq);
        int value = 0;
        try {
            size_t used = 0;
            value = std::stoi(eq == std::string::npos ? "" : item.substr(eq + 1), &used);
            if (used != item.size() - eq - 1) throw std::invalid_argument(item);
        } catch (const std::exception&) {
            throw error("MINIDS_MOE_DECODE: '" + item + "' is not key=integer");
        }
        if (key == "gate_up_warps") {
            c.gate_up_warps = value;
        } else if (key == "gate_up_rows") {
            c.gate_up_rows_per_warp = value;
        } else if (key == "gate_up_compact") {
            c.gate_up_compact_grid = value != 0;
        } else if (key == "down_warps") {
            c.down_warps = value;
        } else if (key == "down_warps_per_row") {
            c.down_warps_per_row = value;
        } else if (key == "down_rows") {
            c.down_rows_per_warp = value;
        } else if (key == "down_act_in_shared") {
            c.down_act_in_shared = value != 0;
        } else if (key == "unroll") {
            c.unroll = value;
        } else {
            throw error("MINIDS_MOE_DECODE: unknown key '" + key +
                        "' (gate_up_warps, gate_up_rows, gate_up_compact, down_warps, "
                        "down_warps_per_row, down_rows, down_act_in_shared, unroll)");
        }
    }
}

namespace {

// The position of environment variable `name`'s value in `values`, or -1 when it is unset or
// empty; any other value is an error naming the expected ones.
int choice_from_env(const char* name, const std::vector<std::string>& values) {
    const char* v = std::getenv(name);
    if (!v || !*v) return -1;
    for (size_t i = 0; i < values.size(); ++i)
        if (values[i] == v) return int(i);
    std::string expected;
    for (size_t i = 0; i < values.size(); ++i)
        expected += (i == 0 ? "" : i + 1 == values.size() ? " or " : ", ") + values[i];
    throw error(std::string(name) + ": unknown value '" + v + "' (expected " + expected + ")");
}

}  // namespace

bool gemm_split_x_from_env() {
    return choice_from_env("MINIDS_CUDA_GEMM_X", {"split", "bf16"}) != 1;
}

bool moe_hits_early_from_env() {
    return choice_from_env("MINIDS_MOE_HITS", {"early", "after-fetch"}) != 1;
}

int stream_plan_from_env() {
    return choice_from_env("MINIDS_STREAM_PLAN", {"1", "2"}) == 0 ? 1 : 2;
}

minids::kernels::MoeGroupedKernel moe_grouped_kernel_from_env() {
    using minids::kernels::MoeGroupedKernel;
    switch (choice_from_env("MINIDS_MOE_GROUPED", {"staged", "pipelined"})) {
        case 0:
            return MoeGroupedKernel::staged;
        case 1:
            return MoeGroupedKernel::pipelined;
        default:
            return minids::kernels::moe_grouped_default_kernel();
    }
}

namespace {

bool inner_contiguous_f32(const tensor& t) {
    return t.type == dtype::f32 && t.n_dims >= 1 && t.stride[size_t(t.n_dims - 1)] == 4;
}

bool same_shape(const tensor& a, const tensor& b) {
    if (a.n_dims != b.n_dims) return false;
    for (int i = 0; i < a.n_dims; ++i)
        if (a.shape[size_t(i)] != b.shape[size_t(i)]) return false;
    return true;
}

bool norm_weight_ok(const tensor* w) {
    return !w || ((w->type == dtype::f32 || w->type == dtype::bf16) && w->is_contiguous());
}

class planner {
public:
    planner(const graph& g, const fusion_switches& on) : g_(g), on_(on) {
        for (size_t i = 0; i < g.nodes.size(); ++i) step_[g.nodes[i]] = i;
        for (tensor* n : g.nodes) {
            for (tensor* s : n->src) {
                if (s) consumers_[s].push_back(n);
            }
        }
        outputs_.insert(g.outputs.begin(), g.outputs.end());
    }

    fusion_plan run() {
        if (on_.route) find_routes();
        if (on_.mla_prep) find_mla_preps();
        if (on_.norm) find_norms();
        // After the norms: a router matmul keeps the norm folded into it (norm_of), and the
        // fused step does that normalization too.
        if (on_.router_route) find_router_routes();
        if (on_.route_fetch) find_route_fetches();
        if (on_.residual) find_residuals();
        add_also_reads();
        // Last: which steps run where depends on what runs in which step.
        if (on_.side_stream) find_side_branches();
        if (on_.prefetch_behind_misses) find_deferred_waits();
        if (on_.shared_beside && !on_.side_stream) find_shared_beside();
        return std::move(p_);
    }

private:
    const std::vector<tensor*>& consumers(const tensor* t) const {
        static const std::vector<tensor*> none;
        auto it = consumers_.find(t);
        return it == consumers_.end() ? none : it->second;
    }
    bool is_output(const tensor* t) const { return outputs_.count(t) != 0; }
    size_t step(const tensor* t) const { return step_.at(t); }
    bool taken(const tensor* t) const {
        return p_.skipped.count(t) || p_.route_at.count(t) || p_.prep_at.count(t);
    }

    // Every reader of a member outside the group runs after the group's step.
    bool outside_readers_after(const std::vector<tensor*>& members, const tensor* run_at) const {
        for (const tensor* m : members) {
            for (const tensor* c : consumers(m)) {
                if (std::find(members.begin(), members.end(), c) != members.end()) continue;
                if (step(c) <= step(run_at)) return false;
            }
        }
        return true;
    }
    bool read_outside(const tensor* t, const std::vector<tensor*>& members) const {
        if (is_output(t)) return true;
        for (const tensor* c : consumers(t))
            if (std::find(members.begin(), members.end(), c) == members.end()) return true;
        return false;
    }

    void find_routes() {
        for (tensor* w : g_.nodes) {
            if (w->op_kind != op::moe_weights) continue;
            tensor* s = w->src[0];
            tensor* k = w->src[1];
            if (s->op_kind != op::softmax || k->op_kind != op::moe_topk || k->src[0] != s) continue;
            if (s->iparams[0] != 0 || s->fparams[0] != 1.0f || s->n_dims != 2) continue;
            if (!inner_contiguous_f32(*s->src[0]) || s->src[0]->stride[0] % 4 != 0) continue;
            const int64_t E = s->shape[1];
            if (E > 1024 || w->iparams[0] != k->iparams[0]) continue;
            if (topk_method(k->iparams[1]) == topk_method::group_limited_greedy &&
                k->iparams[2] > 32)
                continue;
            if (taken(s) || taken(k) || taken(w)) continue;
            if (!outside_readers_after({s, k, w}, w)) continue;
            p_.route_at[w] = route_group{s, k, w};
            p_.skipped.insert(s);
            p_.skipped.insert(k);
            ++p_.n_route;
        }
    }

    void find_mla_preps() {
        for (tensor* kv_store : g_.nodes) {
            if (kv_store->op_kind != op::kv_store) continue;
            tensor* c_norm = kv_store->src[2];
            tensor* k_rope = kv_store->src[3];
            tensor* positions = kv_store->src[4];
            if (c_norm->op_kind != op::rms_norm || k_rope->op_kind != op::rope) continue;
            if (k_rope->src[1] != positions || !norm_weight_ok(c_norm->src[1])) continue;
            const tensor* c_view = c_norm->src[0];
            const tensor* k_view = k_rope->src[0];
            if (c_view->op_kind != op::view || k_view->op_kind != op::view ||
                c_view->src[0] != k_view->src[0])
                continue;
            tensor* kv = c_view->src[0];
            const int64_t r = c_view->n_dims == 2 ? c_view->shape[1] : 0;
            const int64_t rope = k_rope->rope->n_dims;
            if (kv->n_dims != 2 || !inner_contiguous_f32(*kv) || kv->shape[1] != r + rope ||
                kv->stride[0] % 4 != 0 || r == 0 || rope > 128)
                continue;
            if (c_view->stride != kv->stride || k_view->stride != kv->stride ||
                c_view->view_offset != 0 || k_view->view_offset != size_t(r) * 4 ||
                k_view->n_dims != 2 || k_view->shape[1] != rope)
                continue;
            const tensor* pages = kv_store->src[0];
            if (!pages->is_contiguous() || !kv_store->src[1]->is_contiguous()) continue;
            // The attention that reads this cache takes the rope'd q_pe.
            tensor* q_rope = nullptr;
            for (tensor* c : consumers(kv_store)) {
                if (c->op_kind == op::mla_attn && c->src[2] == kv_store) q_rope = c->src[1];
            }
            if (!q_rope || q_rope->op_kind != op::rope || q_rope->src[1] != positions) continue;
            if (!(q_rope->rope == k_rope->rope ||
                  (q_rope->rope->inv_freq == k_rope->rope->inv_freq &&
                   q_rope->rope->attn_factor == k_rope->rope->attn_factor)))
                continue;
            const tensor* q_in = q_rope->src[0];
            if (q_in->n_dims != 3 || !inner_contiguous_f32(*q_in) || q_in->stride[0] % 4 != 0 ||
                q_in->stride[1] % 4 != 0)
                continue;
            std::vector<tensor*> members{c_norm, k_rope, kv_store, q_rope};
            bool free = true;
            for (tensor* m : members) free = free && !taken(m);
            if (!free) continue;
            tensor* run_at = *std::max_element(
                members.begin(), members.end(),
                [&](const tensor* a, const tensor* b) { return step(a) < step(b); });
            if (!outside_readers_after(members, run_at)) continue;
            p_.prep_at[run_at] = mla_prep_group{c_norm,
                                                k_rope,
                                                kv_store,
                                                q_rope,
                                                run_at,
                                                kv,
                                                read_outside(c_norm, members),
                                                read_outside(k_rope, members)};
            for (tensor* m : members)
                if (m != run_at) p_.skipped.insert(m);
            ++p_.n_mla_prep;
        }
    }

    void find_norms() {
        for (tensor* norm : g_.nodes) {
            if (norm->op_kind != op::rms_norm || is_output(norm) || taken(norm)) continue;
            const tensor* x = norm->src[0];
            if (norm->n_dims < 2 || !inner_contiguous_f32(*x) || !norm_weight_ok(norm->src[1]))
                continue;
            const auto& users = consumers(norm);
            const int64_t rows = norm->shape[size_t(norm->n_dims - 2)];
            // The MoE's decode path folds the norm into its gate/up launch (kernels/moe.h); the
            // grouped (prompt) path does not.
            const int64_t moe_rows = minids::kernels::MoeExpertsParams{}.decode_max_tokens;
            bool all_fold = !users.empty() && rows <= minids::kernels::matmul_gemv_max_m();
            for (const tensor* u : users) {
                bool ok = u->src[0] == norm && !taken(u);
                for (size_t i = 1; i < u->src.size(); ++i) ok = ok && u->src[i] != norm;
                if (u->op_kind == op::matmul) {
                    all_fold = all_fold && ok;
                } else {
                    all_fold = all_fold && ok && on_.norm_moe && u->op_kind == op::moe_experts &&
                               rows <= moe_rows;
                }
            }
            if (all_fold) {
                for (tensor* u : users) p_.norm_of[u] = norm;
                p_.skipped.insert(norm);
                ++p_.n_norm;
            } else if (on_.norm_out && rows == 1 && norm->n_dims == 2) {
                find_norm_out(norm);
            }
        }
    }

    // The first reader of a one-row norm, when it is a matmul taking it as x and every other
    // reader runs after it, normalizes x itself and writes the norm's row for the others.
    void find_norm_out(tensor* norm) {
        const auto& users = consumers(norm);
        tensor* first = nullptr;
        for (tensor* u : users)
            if (!first || step(u) < step(first)) first = u;
        if (!first || first->op_kind != op::matmul || first->src[0] != norm || taken(first) ||
            p_.norm_of.count(first) || first->src[1]->n_dims != 2)
            return;
        for (size_t i = 1; i < first->src.size(); ++i)
            if (first->src[i] == norm) return;
        for (tensor* u : users)
            if (u != first && step(u) <= step(first)) return;
        p_.norm_of[first] = norm;
        p_.writes_norm[first] = norm;
        p_.skipped.insert(norm);
        ++p_.n_norm_out;
    }

    // A route group whose logits come from a decode-sized router matmul read by its softmax alone
    // and not a graph output (the model's routers): the matmul runs in the group's step
    // (kernels::moe_router_route, or matmul + moe_route where the addresses do not suit it).
    // What the fused kernel cannot take is left to the plain route: more than 8 rows (the
    // grouped prompt path), more than 256 experts, weights other than 2-D BF16 rows.
    void find_router_routes() {
        for (auto& [at, r] : p_.route_at) {
            tensor* mm = r.softmax->src[0];
            if (mm->op_kind != op::matmul || is_output(mm) || taken(mm)) continue;
            if (consumers(mm).size() != 1 || p_.residual_add.count(mm)) continue;
            const tensor* w = mm->src[1];
            auto nt = p_.norm_of.find(mm);
            const tensor* x = nt != p_.norm_of.end() ? nt->second->src[0] : mm->src[0];
            if (mm->n_dims != 2 || x->n_dims != 2 || w->n_dims != 2 || mm->src[2]) continue;
            const int64_t T = mm->shape[0], E = mm->shape[1], D = w->shape[1];
            if (T > minids::kernels::moe_router_route_max_tokens ||
                E > minids::kernels::moe_router_route_max_experts)
                continue;
            // The fused kernel streams BF16 rows 16 bytes at a time and reads x as float4.
            if (w->type != dtype::bf16 || w->stride[1] != 2 || w->stride[0] % 16 != 0 ||
                D % 8 != 0 || !inner_contiguous_f32(*x) || (T > 1 && x->stride[0] % 16 != 0))
                continue;
            r.router = mm;
            p_.skipped.insert(mm);
            ++p_.n_router_route;
        }
    }

    // A route group whose ids one expert_fetch reads (the model's decode and prompt graphs with
    // the device fetch, unless the routing is imposed): the plan moves from the fetch's step into
    // the group's. It then writes this layer's table, other layers' table entries (evictions) and
    // the fetch state earlier than before, so no node between the two steps may read a table or
    // that state (in the model the fetch is the node right after the group's step).
    void find_route_fetches() {
        for (auto& [at, r] : p_.route_at) {
            tensor* fetch = nullptr;
            int n_fetches = 0;
            for (tensor* c : consumers(r.topk)) {
                // (A prefetch reads these ids as the ones to protect: it does not fetch them.)
                if (c->op_kind != op::expert_fetch || is_expert_prefetch(*c)) continue;
                ++n_fetches;
                fetch = c;
            }
            // A staged fetch (src[3]) keeps its own plan: the host copies between its plan and
            // copy, which the routing kernel would have to be taught as a host node.
            if (n_fetches != 1 || fetch->src[1] != r.topk || fetch->src[3] ||
                p_.fetch_planned.count(fetch))
                continue;
            if (fetch->src[0]->shape[0] != r.softmax->shape[1]) continue;  // a table of E experts
            if (step(fetch) <= step(r.weights) || !quiet_between(r.weights, fetch)) continue;
            r.fetch = fetch;
            p_.fetch_planned.insert(fetch);
            ++p_.n_route_fetch;
        }
    }

    // No node after `from` and before `fetch` reads an expert table or the fetch state of `fetch`
    // (nor is a MoE expert node or another fetch, which read or write any layer's table).
    bool quiet_between(const tensor* from, const tensor* fetch) const {
        const tensor* table = storage_root(fetch->src[0]);
        const tensor* state = storage_root(fetch->src[2]);
        for (size_t i = step(from) + 1; i < step(fetch); ++i) {
            const tensor* n = g_.nodes[i];
            if (n->op_kind == op::expert_fetch || n->op_kind == op::moe_experts) return false;
            for (const tensor* s : n->src)
                if (s && (storage_root(s) == table || storage_root(s) == state)) return false;
        }
        return true;
    }

    static const tensor* storage_root(const tensor* t) {
        while (const tensor* s = alias_source(*t)) t = s;
        return t;
    }

    void find_residuals() {
        for (tensor* add : g_.nodes) {
            if (add->op_kind != op::add || taken(add)) continue;
            for (int i = 0; i < 2; ++i) {
                tensor* product = add->src[size_t(i)];
                tensor* other = add->src[size_t(1 - i)];
                if (product->op_kind != op::matmul && product->op_kind != op::moe_experts) continue;
                if (is_output(product) || taken(product) || p_.residual_add.count(product))
                    continue;
                const auto& users = consumers(product);
                if (users.size() != 1 || users[0] != add || other == product) continue;
                if (other->type != dtype::f32 || !same_shape(*other, *add) ||
                    !other->is_contiguous())
                    continue;
                p_.residual_add[product] = add;
                p_.producer_of[add] = product;
                p_.skipped.insert(product);
                ++p_.n_residual;
                break;
            }
        }
    }

    // The side stream (fusion_switches::side_stream): every prefetch, and every node all of whose
    // readers run there and that is no output (the prefetch's routing prediction). The main
    // stream joins it before its first later step that reads a side node or, with a prefetch
    // pending, touches the fetch state (a fetch, or a route step that plans one): those run in
    // node order. Until then the side nodes' memory and their inputs' stay live, since
    // the main steps in between run beside them (also_reads). moe_experts, which reads its
    // layer's table while a prefetch rewrites other entries of it, runs beside it: a prefetch
    // never evicts what the layer it protects reads (mgl::expert_prefetch).
    void find_side_branches() {
        for (auto it = g_.nodes.rbegin(); it != g_.nodes.rend(); ++it) {
            tensor* n = *it;
            bool side = is_expert_prefetch(*n);
            if (!side && !is_output(n)) {
                const auto& readers = consumers(n);
                side = !readers.empty() && std::all_of(readers.begin(), readers.end(),
                                                       [&](tensor* c) { return p_.side.count(c); });
            }
            if (side) p_.side.insert(n);
        }
        if (p_.side.empty()) return;
        std::vector<tensor*> live;   // side nodes and their inputs since the last join
        bool fetch_pending = false;  // a prefetch among them
        for (tensor* n : g_.nodes) {
            if (p_.side.count(n)) {
                live.push_back(n);
                for (tensor* s : n->src)
                    if (s) live.push_back(s);
                fetch_pending = fetch_pending || is_expert_prefetch(*n);
                continue;
            }
            if (live.empty() || !runs_step(n) || !needs_join(n, fetch_pending)) continue;
            p_.join_before.insert(n);
            for (tensor* t : live) also_read(n, t);
            live.clear();
            fetch_pending = false;
        }
        // The backend joins at the end of the graph too.
        for (tensor* t : live) also_read(g_.nodes.back(), t);
    }

    // shared_beside: a moe_experts of at most decode_max_tokens rows (the decode path) with a
    // shared expert, whose x (or, with the norm folded, the norm's input) a step of its own
    // writes before it. The backend emits the shared expert's gate/up on the side stream right
    // after that step and joins it before the down launch; nothing else needs to stay live,
    // since that gate/up reads only x and weights and writes a region of its own.
    void find_shared_beside() {
        // The rows below which moe_experts takes the decode path (the backend keeps the default).
        const int64_t decode_max_tokens = minids::kernels::MoeExpertsParams{}.decode_max_tokens;
        for (tensor* m : g_.nodes) {
            // (m itself may be skipped: its step is the residual add's.)
            if (m->op_kind != op::moe_experts || !m->src[4]) continue;
            auto norm = p_.norm_of.find(m);
            const tensor* x = norm == p_.norm_of.end() ? m->src[0] : norm->second->src[0];
            while (x && x->op_kind == op::view) x = x->src[0];
            if (!x || x->shape[0] > decode_max_tokens || !runs_step(x) ||
                p_.shared_after.count(x) || step(x) >= step(m))
                continue;
            p_.shared_after[x] = m;
            p_.shared_beside.insert(m);
        }
    }

    // prefetch_behind_misses: a prefetch on the main stream whose `after` (src[5]) is the fetch of
    // the layer it protects, with no step between the two that fetches or runs experts, and the
    // layer's experts after it. The fetch then posts and returns; the prefetch posts behind it and
    // waits for the layer's copies, so the layer's experts (after it in stream order) still read
    // only landed slots.
    void find_deferred_waits() {
        for (tensor* pre : g_.nodes) {
            if (!is_expert_prefetch(*pre) || p_.side.count(pre)) continue;
            tensor* fetch = pre->src[5];
            if (!fetch || fetch->op_kind != op::expert_fetch || is_expert_prefetch(*fetch) ||
                fetch->src[3] || p_.side.count(fetch) || fetch->iparams[0] != pre->iparams[2] ||
                step(fetch) >= step(pre))
                continue;
            bool quiet = true;
            for (size_t i = step(fetch) + 1; i < step(pre) && quiet; ++i) {
                const tensor* n = g_.nodes[i];
                quiet = n->op_kind != op::expert_fetch && n->op_kind != op::moe_experts &&
                        !p_.side.count(n);
            }
            bool experts_after = false;  // the layer's experts read its table after the prefetch
            for (const tensor* c : consumers(fetch)) {
                if (c->op_kind == op::moe_experts && step(c) < step(pre)) quiet = false;
                experts_after = experts_after || (c->op_kind == op::moe_experts);
            }
            if (!quiet || !experts_after) continue;
            p_.defers_wait.insert(fetch);
            p_.waits_for_layer.insert(pre);
        }
    }

    // Whether the backend emits a step at n (its fused members run in it).
    bool runs_step(const tensor* n) const {
        return !p_.skipped.count(n) && n->op_kind != op::none && n->op_kind != op::view;
    }

    // What n's step reads: its sources and those of the nodes fused into it.
    std::vector<const tensor*> step_reads(const tensor* n) const {
        std::vector<const tensor*> out(n->src.begin(), n->src.end());
        auto add = [&](const tensor* m) {
            if (m) out.insert(out.end(), m->src.begin(), m->src.end());
        };
        if (auto it = p_.route_at.find(n); it != p_.route_at.end())
            for (const tensor* m : std::initializer_list<const tensor*>{
                     it->second.softmax, it->second.topk, it->second.router, it->second.fetch})
                add(m);
        if (auto it = p_.producer_of.find(n); it != p_.producer_of.end()) add(it->second);
        if (auto it = p_.prep_at.find(n); it != p_.prep_at.end())
            for (const tensor* m : std::initializer_list<const tensor*>{
                     it->second.kv_norm, it->second.k_rope, it->second.store, it->second.q_rope})
                add(m);
        if (auto it = p_.norm_of.find(n); it != p_.norm_of.end()) add(it->second);
        return out;
    }

    bool needs_join(const tensor* n, bool fetch_pending) const {
        // A fetch, or a route step that plans one, orders against a prefetch's state.
        if (fetch_pending) {
            if (n->op_kind == op::expert_fetch) return true;
            if (auto it = p_.route_at.find(n); it != p_.route_at.end() && it->second.fetch)
                return true;
        }
        for (const tensor* s : step_reads(n))
            if (s && p_.side.count(s)) return true;
        return false;
    }

    void also_read(tensor* at, tensor* t) {
        if (t) p_.also_reads.emplace_back(at, t);
    }

    void add_also_reads() {
        for (auto& [add, product] : p_.producer_of) {
            tensor* at = const_cast<tensor*>(add);
            for (tensor* s : product->src) also_read(at, s);
        }
        // A matmul run inside a route step (router_route) normalizes there.
        std::unordered_map<const tensor*, tensor*> route_of_router;
        for (auto& [w, r] : p_.route_at)
            if (r.router) route_of_router[r.router] = r.weights;
        for (auto& [matmul, norm] : p_.norm_of) {
            auto it = p_.residual_add.find(matmul);
            auto rt = route_of_router.find(matmul);
            tensor* at = it != p_.residual_add.end()   ? it->second
                         : rt != route_of_router.end() ? rt->second
                                                       : const_cast<tensor*>(matmul);
            for (tensor* s : norm->src) also_read(at, s);
            // norm_out: the norm's rows are written at that step too.
            if (p_.writes_norm.count(matmul)) also_read(at, norm);
        }
        for (auto& [w, r] : p_.route_at) {
            for (tensor* m : {r.softmax, r.topk, r.router}) {
                if (!m) continue;
                also_read(r.weights, m);  // written at the group's step
                for (tensor* s : m->src) also_read(r.weights, s);
            }
            // route_fetch: the plan reads and writes the table and the state at the group's step.
            if (r.fetch)
                for (tensor* s : r.fetch->src) also_read(r.weights, s);
        }
        for (auto& [at, grp] : p_.prep_at) {
            for (tensor* m : {grp.kv_norm, grp.k_rope, grp.store, grp.q_rope}) {
                also_read(grp.run_at, m);
                for (tensor* s : m->src) also_read(grp.run_at, s);
            }
        }
    }

    const graph& g_;
    fusion_switches on_;
    std::unordered_map<const tensor*, size_t> step_;
    std::unordered_map<const tensor*, std::vector<tensor*>> consumers_;
    std::unordered_set<const tensor*> outputs_;
    fusion_plan p_;
};

}  // namespace

fusion_plan plan_fusions(const graph& g, const fusion_switches& on) { return planner(g, on).run(); }

}  // namespace mgl::cuda
