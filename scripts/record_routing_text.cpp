// Records a routing trace of a model reading a text (teacher-forced): every token's experts and
// weights as the router computes them on the text. Routing is causal, so this is what decoding
// that text token by token would route, without sampling. Used for docs/expert-cache-policies.md
// before `run --record-routing` could record generated tokens; it reads the routing through
// Session::eval's tensor observer (expert_ids-L, expert_weights-L).
//
//   record_routing_text MODEL.mds TEXT_FILE OUT.npz [--chat] [--max-tokens N] [--chunk N]
//                       [--probs PROBS.npy]
//
// --probs also writes every router's whole probability vector, <f4 [T, L, E] (what the trace
// lacks: the experts just outside the top-k), for scripts/policy_probe.cpp.
// --chat: the text's paragraphs (blank-line separated) become alternating user / assistant
// messages rendered with the model's chat template.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
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

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr,
                     "usage: record_routing_text MODEL.mds TEXT OUT.npz [--chat] [--max-tokens N] "
                     "[--chunk N] [--probs PROBS.npy]\n");
        return 2;
    }
    bool chat = false;
    int64_t max_tokens = 4096, chunk = 512;
    std::string probs_path;
    for (int i = 4; i < argc; ++i) {
        const std::string a = argv[i];
        if (a == "--chat") chat = true;
        if (a == "--max-tokens" && i + 1 < argc) max_tokens = std::atoll(argv[++i]);
        if (a == "--chunk" && i + 1 < argc) chunk = std::atoll(argv[++i]);
        if (a == "--probs" && i + 1 < argc) probs_path = argv[++i];
    }
    try {
        auto file = mds::MdsFile::open(argv[1]);
        auto backend = mgl::make_cpu_backend(0);
        Deepseek2Model model(*file, *backend);
        Tokenizer tok(file->tokenizer());
        std::ifstream in(argv[2], std::ios::binary);
        const std::string text(std::istreambuf_iterator<char>(in), {});
        std::vector<int32_t> ids;
        if (chat) {
            std::vector<ChatMessage> msgs;
            size_t p = 0;
            while (p < text.size()) {
                size_t q = text.find("\n\n", p);
                if (q == std::string::npos) q = text.size();
                if (q > p)
                    msgs.push_back({msgs.size() % 2 ? "assistant" : "user", text.substr(p, q - p)});
                p = q + 2;
            }
            const std::string src = resolve_chat_template("", tok.data().chat_template);
            const std::string bos = tok.bos_id() ? tok.token_text(*tok.bos_id()) : "";
            const std::string eos = tok.eos_id() ? tok.token_text(*tok.eos_id()) : "";
            ids = tok.encode(render_chat(src, msgs, false, bos, eos), false, true);
        } else {
            ids = tok.encode(text, true);
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
        SessionParams sp;
        sp.n_ctx = int64_t(ids.size()) + 1;
        Session session(model, *backend, sp);
        for (size_t at = 0; at < ids.size(); at += size_t(chunk)) {
            const size_t n = std::min(ids.size() - at, size_t(chunk));
            std::map<std::string, std::vector<float>> seen;
            TensorObserver obs = [&](const mgl::tensor& t, std::span<const float> v) {
                if (t.name.rfind("expert_ids-", 0) == 0 ||
                    t.name.rfind("expert_weights-", 0) == 0 ||
                    (!probs_path.empty() && t.name.rfind("router_probs-", 0) == 0))
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
        routing::write_trace(tr, argv[3]);
        std::fprintf(stderr, "record_routing_text: %zu tokens -> %s\n", ids.size(), argv[3]);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "record_routing_text: %s\n", e.what());
        return 1;
    }
    return 0;
}
