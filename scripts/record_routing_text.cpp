// Records a routing trace of a model reading a text (teacher-forced): every token's experts and
// weights as the router computes them on the text. Routing is causal, so this is what decoding
// that text token by token would route, without sampling. Used for docs/expert-cache-policies.md
// before `run --record-routing` could record generated tokens; it reads the routing through
// Session::eval's tensor observer (expert_ids-L, expert_weights-L).
//
//   record_routing_text MODEL.mds TEXT_FILE|random:N[:SEED] OUT.npz [--chat] [--max-tokens N]
//                       [--chunk N] [--probs PROBS.npy] [--predict PRED.npy] [--predict-depth D]
//                       [--predict-from ffn_inp|l_out]
//
// --probs also writes every router's whole probability vector, <f4 [T, L, E] (what the trace
// lacks: the experts just outside the top-k), for scripts/policy_probe.cpp.
// --predict writes, <i2 [T, L, D, k], the experts the router of MoE layer l + 1 + d would choose
// for token t applied to the hidden state at MoE layer l (Deepseek2Model::
// build_routing_prediction: layer l+1+d's post_attention_layernorm, router, softmax, top-k), -1
// past the last MoE layer. The state is layer l's FFN input h = x + MLA(norm(x)) (ffn_inp: known
// before layer l's experts run, so an engine can fetch the predicted experts while they run) or,
// with --predict-from l_out, layer l's output (after its experts: later, closer to what layer
// l+1 routes). D = --predict-depth (default 1). It also prints how many of the real top-k
// experts each prediction contains, per layer and in all, next to the share the same layer's
// experts of the previous token contain (what recency knows); from ffn_inp it also checks that
// each layer's router on its own state gives the recorded routing.
// --chat: the text's paragraphs (blank-line separated) become alternating user / assistant
// messages rendered with the model's chat template.
// TEXT `random:N` or `random:N:SEED` reads N token ids drawn uniformly from the vocabulary
// instead (std::mt19937_64, seed 37 by default: the tokens `minids bench` decodes), for
// random-weight models whose benchmarks decode such tokens.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "chat/chat_template.h"
#include "mds/reader.h"
#include "model/deepseek2.h"
#include "routing/npz.h"
#include "routing/trace.h"
#include "runtime/session.h"
#include "tokenizer/tokenizer.h"

using namespace minids;

namespace {

// Appends the predictions of n tokens to pred ([T][L][D][k]): for every MoE layer l, the
// routers of layers l+1 … l+D applied to the observed state of layer l, in one graph. From
// ffn_inp, layer l's own router is applied too and must give the recorded routing (a check of
// the hook): returns the (token, layer) rows where it does not.
int64_t predict_chunk(const Deepseek2Model& model, mgl::backend& backend,
                      const std::map<std::string, std::vector<float>>& seen,
                      const std::string& from, int32_t depth, size_t n,
                      std::vector<int16_t>& pred) {
    const auto& moe = model.moe_layers();
    const int32_t L = int32_t(moe.size()), k = int32_t(model.config().num_experts_per_tok);
    const int64_t D = model.config().hidden_size;
    const bool check = from == "ffn_inp";
    mgl::context ctx;
    std::vector<mgl::tensor*> states, outs;
    std::vector<std::pair<int32_t, int32_t>> where;  // (l, d) of each output; d = -1: the check
    for (int32_t l = 0; l < L; ++l) {
        states.push_back(ctx.new_tensor(mgl::dtype::f32, {int64_t(n), D}, "state"));
        if (check) {
            outs.push_back(model.build_routing_prediction(ctx, moe[size_t(l)], states.back()));
            where.push_back({l, -1});
        }
        for (int32_t d = 0; d < depth && l + 1 + d < L; ++d) {
            outs.push_back(
                model.build_routing_prediction(ctx, moe[size_t(l + 1 + d)], states.back()));
            where.push_back({l, d});
        }
    }
    const size_t bytes = n * size_t(D) * sizeof(float);
    mgl::buffer_ptr in = backend.alloc_buffer(std::max<size_t>(1, states.size() * bytes));
    for (size_t i = 0; i < states.size(); ++i) {
        mgl::bind(*states[i], *in, i * bytes);
        const auto& h = seen.at(from + "-" + std::to_string(moe[i]));
        if (h.size() != n * size_t(D)) throw std::runtime_error("unexpected " + from + " size");
        backend.upload(*states[i], h.data(), 0, bytes);
    }
    mgl::graph g = mgl::build_graph(ctx, outs);
    backend.allocate(g);
    backend.compute(g);
    backend.synchronize();
    const size_t base = pred.size();
    pred.resize(base + n * size_t(L) * size_t(depth) * size_t(k), -1);
    std::vector<int32_t> ids(n * size_t(k));
    int64_t mismatched = 0;
    for (size_t o = 0; o < outs.size(); ++o) {
        backend.download(*outs[o], ids.data(), 0, ids.size() * sizeof(int32_t));
        const auto [l, d] = where[o];
        if (d < 0) {
            const auto& real = seen.at("expert_ids-" + std::to_string(moe[size_t(l)]));
            for (size_t t = 0; t < n; ++t)
                for (int32_t j = 0; j < k; ++j)
                    if (int32_t(real.at(t * size_t(k) + size_t(j))) !=
                        ids[t * size_t(k) + size_t(j)]) {
                        ++mismatched;
                        break;
                    }
            continue;
        }
        for (size_t t = 0; t < n; ++t)
            for (int32_t j = 0; j < k; ++j)
                pred[base + ((t * size_t(L) + size_t(l)) * size_t(depth) + size_t(d)) * size_t(k) +
                     size_t(j)] = int16_t(ids[t * size_t(k) + size_t(j)]);
    }
    return mismatched;
}

// Share of the real top-k experts the predictions contain, per (layer, distance), next to the
// share the previous token's experts of the same layer contain.
void report_accuracy(const routing::RoutingTrace& tr, const std::vector<int16_t>& pred,
                     int32_t depth) {
    const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k;
    auto overlap = [k](const uint16_t* real, auto&& has) {
        int c = 0;
        for (int32_t j = 0; j < k; ++j) c += has(real[j]);
        return c;
    };
    for (int32_t d = 0; d < depth; ++d) {
        int64_t all_hit = 0, all_n = 0;
        std::fprintf(stderr, "prediction %d layer%s ahead:", d + 1, d ? "s" : "");
        for (int32_t l = 0; l + 1 + d < L; ++l) {
            int64_t hit = 0;
            for (int64_t t = 0; t < tr.n_tokens; ++t) {
                const int16_t* p = pred.data() + ((t * L + l) * depth + d) * k;
                hit += overlap(tr.ids_at(t, l + 1 + d),
                               [&](uint16_t e) { return std::count(p, p + k, int16_t(e)) > 0; });
            }
            all_hit += hit;
            all_n += tr.n_tokens * k;
            std::fprintf(stderr, " %d->%d %.3f", l, l + 1 + d,
                         double(hit) / double(tr.n_tokens * k));
        }
        std::fprintf(stderr, "; all %.3f\n", double(all_hit) / double(all_n));
    }
    int64_t hit = 0, total = 0;
    std::fprintf(stderr, "previous token, same layer:");
    for (int32_t l = 1; l < L; ++l) {
        int64_t h = 0;
        for (int64_t t = 1; t < tr.n_tokens; ++t) {
            const uint16_t* prev = tr.ids_at(t - 1, l);
            h += overlap(tr.ids_at(t, l),
                         [&](uint16_t e) { return std::count(prev, prev + k, e) > 0; });
        }
        hit += h;
        total += (tr.n_tokens - 1) * k;
        std::fprintf(stderr, " %d %.3f", l, double(h) / double((tr.n_tokens - 1) * k));
    }
    std::fprintf(stderr, "; layers 1+ %.3f\n", double(hit) / double(total));
}

}  // namespace

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr,
                     "usage: record_routing_text MODEL.mds TEXT|random:N[:SEED] OUT.npz [--chat] "
                     "[--max-tokens N] "
                     "[--chunk N] [--probs PROBS.npy] [--predict PRED.npy] [--predict-depth D] "
                     "[--predict-from ffn_inp|l_out]\n");
        return 2;
    }
    bool chat = false;
    int64_t max_tokens = 4096, chunk = 512;
    std::string probs_path, predict_path, predict_from = "ffn_inp";
    int32_t depth = 1;
    for (int i = 4; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--chat") chat = true;
        if (a == "--max-tokens" && i + 1 < argc) max_tokens = std::atoll(argv[++i]);
        if (a == "--chunk" && i + 1 < argc) chunk = std::atoll(argv[++i]);
        if (a == "--probs" && i + 1 < argc) probs_path = argv[++i];
        if (a == "--predict" && i + 1 < argc) predict_path = argv[++i];
        if (a == "--predict-depth" && i + 1 < argc) depth = std::atoi(argv[++i]);
        if (a == "--predict-from" && i + 1 < argc) predict_from = argv[++i];
    }
    try {
        auto file = mds::MdsFile::open(argv[1]);
        auto backend = mgl::make_cpu_backend(0);
        Deepseek2Model model(*file, *backend);
        Tokenizer tok(file->tokenizer());
        const std::string source = argv[2];
        std::vector<int32_t> ids;
        if (source.rfind("random:", 0) == 0) {
            long long n = 0;
            unsigned long long seed = 37;
            if (std::sscanf(source.c_str() + 7, "%lld:%llu", &n, &seed) < 1 || n < 1)
                throw std::runtime_error("expected random:N or random:N:SEED, got " + source);
            std::mt19937_64 rng(seed);
            std::uniform_int_distribution<int64_t> dist(0, model.config().vocab_size - 1);
            for (long long i = 0; i < n; ++i) ids.push_back(int32_t(dist(rng)));
        } else {
            std::ifstream in(source, std::ios::binary);
            const std::string text(std::istreambuf_iterator<char>(in), {});
            if (chat) {
                std::vector<ChatMessage> msgs;
                size_t p = 0;
                while (p < text.size()) {
                    size_t q = text.find("\n\n", p);
                    if (q == std::string::npos) q = text.size();
                    if (q > p)
                        msgs.push_back(
                            {msgs.size() % 2 ? "assistant" : "user", text.substr(p, q - p)});
                    p = q + 2;
                }
                const std::string src = resolve_chat_template("", tok.data().chat_template);
                const std::string bos = tok.bos_id() ? tok.token_text(*tok.bos_id()) : "";
                const std::string eos = tok.eos_id() ? tok.token_text(*tok.eos_id()) : "";
                ids = tok.encode(render_chat(src, msgs, false, bos, eos), false, true);
            } else {
                ids = tok.encode(text, true);
            }
        }
        if (int64_t(ids.size()) > max_tokens) ids.resize(size_t(max_tokens));

        const ModelConfig& c = model.config();
        routing::RoutingTrace tr;
        tr.shape.n_experts = int32_t(c.n_routed_experts);
        tr.shape.top_k = int32_t(c.num_experts_per_tok);
        tr.shape.expert_bytes = file->experts().blob_nbytes;
        for (int64_t il = 0; il < c.num_hidden_layers; ++il)
            if (c.is_moe_layer(il)) tr.shape.moe_layers.push_back(int32_t(il));
        tr.source = "record_routing_text";
        tr.extra["model"] = argv[1];
        tr.extra["text"] = argv[2];
        const int32_t L = tr.shape.n_moe_layers(), k = tr.shape.top_k;

        const int32_t E = tr.shape.n_experts;
        std::vector<float> probs;  // [T][L][E]
        if (depth < 1 || depth >= std::max(L, 2) ||
            (predict_from != "ffn_inp" && predict_from != "l_out"))
            throw std::runtime_error(
                "--predict-depth must be in [1, L) and --predict-from "
                "ffn_inp or l_out");
        std::vector<int16_t> pred;  // [T][L][D][k]
        const bool predict = !predict_path.empty();
        int64_t mismatched = 0;
        SessionParams sp;
        sp.n_ctx = int64_t(ids.size()) + 1;
        Session session(model, *backend, sp);
        for (size_t at = 0; at < ids.size(); at += size_t(chunk)) {
            const size_t n = std::min(ids.size() - at, size_t(chunk));
            std::map<std::string, std::vector<float>> seen;
            TensorObserver obs = [&](const mgl::tensor& t, std::span<const float> v) {
                if (t.name.rfind("expert_ids-", 0) == 0 ||
                    t.name.rfind("expert_weights-", 0) == 0 ||
                    (!probs_path.empty() && t.name.rfind("router_probs-", 0) == 0) ||
                    (predict && t.name.rfind(predict_from + "-", 0) == 0))
                    seen[t.name].assign(v.begin(), v.end());
            };
            session.eval(std::span(ids).subspan(at, n), false, &obs);
            std::vector<int32_t> lnk_ids(size_t(L) * n * size_t(k));
            std::vector<float> lnk_w(lnk_ids.size());
            for (int32_t l = 0; l < L; ++l) {
                const std::string il = std::to_string(tr.shape.moe_layers[size_t(l)]);
                const auto& e = seen.at("expert_ids-" + il);
                const auto& w = seen.at("expert_weights-" + il);
                for (size_t i = 0; i < n * size_t(k); ++i) {
                    lnk_ids[size_t(l) * n * size_t(k) + i] = int32_t(e.at(i));
                    lnk_w[size_t(l) * n * size_t(k) + i] = w.at(i);
                }
            }
            tr.append_step(int64_t(n), true, lnk_ids.data(), lnk_w.data());
            if (predict)
                mismatched += predict_chunk(model, *backend, seen, predict_from, depth, n, pred);
            if (!probs_path.empty()) {
                const size_t base = probs.size();
                probs.resize(base + n * size_t(L) * size_t(E));
                for (int32_t l = 0; l < L; ++l) {
                    const std::string il = std::to_string(tr.shape.moe_layers[size_t(l)]);
                    const auto& pr = seen.at("router_probs-" + il);  // [n, E]
                    for (size_t t = 0; t < n; ++t)
                        for (int32_t e = 0; e < E; ++e)
                            probs[base + (t * size_t(L) + size_t(l)) * size_t(E) + size_t(e)] =
                                pr.at(t * size_t(E) + size_t(e));
                }
            }
        }
        if (!probs_path.empty()) {
            const auto* b = reinterpret_cast<const std::byte*>(probs.data());
            const auto npy = routing::make_npy("<f4", {int64_t(ids.size()), int64_t(L), int64_t(E)},
                                               {b, probs.size() * 4});
            std::ofstream out(probs_path, std::ios::binary);
            out.write(reinterpret_cast<const char*>(npy.data()), std::streamsize(npy.size()));
            if (!out) throw std::runtime_error("cannot write " + probs_path);
        }
        if (predict) {
            const auto* b = reinterpret_cast<const std::byte*>(pred.data());
            const auto npy = routing::make_npy(
                "<i2", {int64_t(ids.size()), int64_t(L), int64_t(depth), int64_t(k)},
                {b, pred.size() * 2});
            std::ofstream out(predict_path, std::ios::binary);
            out.write(reinterpret_cast<const char*>(npy.data()), std::streamsize(npy.size()));
            if (!out) throw std::runtime_error("cannot write " + predict_path);
            report_accuracy(tr, pred, depth);
            if (predict_from == "ffn_inp")
                std::fprintf(stderr,
                             "check: each layer's router on its own state differs from the "
                             "recorded routing in %lld of %lld rows\n",
                             (long long)mismatched, (long long)(int64_t(ids.size()) * L));
        }
        routing::write_trace(tr, argv[3]);
        std::fprintf(stderr, "record_routing_text: %zu tokens -> %s\n", ids.size(), argv[3]);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "record_routing_text: %s\n", e.what());
        return 1;
    }
    return 0;
}
