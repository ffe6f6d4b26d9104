// An independent, naive DeepSeek-V2 forward in double precision for the tests.
//
// Deliberately NOT the engine's absorbed form: every head's full K and V are expanded from
// kv_b_proj, attention is an explicit causal softmax, the rotary embedding is written out pair by
// pair, routing is a plain sort. It reads the weights by checkpoint name from a safetensors
// dictionary, so it can check the engine on any configuration of the family. It follows
// DeepSeek's modeling_deepseek.py and is itself checked against every variant fixture under
// tests/data/variants (test_model_reference.cpp; docs/fidelity.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "safetensors_io.h"

namespace minids::test {

struct RefYarn {
    double factor, beta_fast, beta_slow, mscale, mscale_all_dim;
    int64_t original_max_position_embeddings;
};

struct RefConfig {
    int64_t vocab_size, hidden_size, intermediate_size, moe_intermediate_size, num_hidden_layers,
        num_attention_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
        n_routed_experts, num_experts_per_tok, first_k_dense_replace, moe_layer_freq, n_group,
        topk_group;
    std::optional<int64_t> q_lora_rank, n_shared_experts;
    std::string topk_method;
    bool norm_topk_prob, tie_word_embeddings;
    double routed_scaling_factor, rms_norm_eps, rope_theta;
    std::optional<RefYarn> yarn;
};

inline RefConfig ref_config_from_hf(const nlohmann::json& j) {
    auto opt_int = [&](const char* k) -> std::optional<int64_t> {
        if (!j.contains(k) || j[k].is_null()) return std::nullopt;
        return j[k].get<int64_t>();
    };
    RefConfig c{};
    c.vocab_size = j.at("vocab_size");
    c.hidden_size = j.at("hidden_size");
    c.intermediate_size = j.at("intermediate_size");
    c.moe_intermediate_size = j.at("moe_intermediate_size");
    c.num_hidden_layers = j.at("num_hidden_layers");
    c.num_attention_heads = j.at("num_attention_heads");
    c.kv_lora_rank = j.at("kv_lora_rank");
    c.qk_nope_head_dim = j.at("qk_nope_head_dim");
    c.qk_rope_head_dim = j.at("qk_rope_head_dim");
    c.v_head_dim = j.at("v_head_dim");
    c.n_routed_experts = j.value("n_routed_experts", int64_t(0));
    c.num_experts_per_tok = j.value("num_experts_per_tok", int64_t(0));
    c.first_k_dense_replace = j.value("first_k_dense_replace", int64_t(0));
    c.moe_layer_freq = j.value("moe_layer_freq", int64_t(1));
    c.n_group = j.value("n_group", int64_t(1));
    c.topk_group = j.value("topk_group", int64_t(1));
    c.q_lora_rank = opt_int("q_lora_rank");
    c.n_shared_experts = opt_int("n_shared_experts");
    c.topk_method = j.value("topk_method", std::string("greedy"));
    c.norm_topk_prob = j.value("norm_topk_prob", false);
    c.routed_scaling_factor = j.value("routed_scaling_factor", 1.0);
    c.rms_norm_eps = j.value("rms_norm_eps", 1e-6);
    c.tie_word_embeddings = j.value("tie_word_embeddings", false);
    if (j.value("scoring_func", std::string("softmax")) != "softmax")
        throw std::runtime_error("reference: only scoring_func softmax (DeepSeek-V2)");
    // DeepSeek's files carry rope_theta and rope_scaling {type: yarn, ...}; transformers 5 re-saves
    // them as rope_parameters {rope_type, type, rope_theta, ...} (and may write rope_theta null).
    c.rope_theta = j.contains("rope_theta") && !j["rope_theta"].is_null()
                       ? j["rope_theta"].get<double>()
                       : 10000.0;
    const nlohmann::json* r = nullptr;
    for (const char* key : {"rope_parameters", "rope_scaling"})
        if (!r && j.contains(key) && !j[key].is_null()) r = &j[key];
    if (r) {
        if (r->contains("rope_theta")) c.rope_theta = r->at("rope_theta").get<double>();
        const std::string type = r->value("type", r->value("rope_type", std::string("default")));
        if (type == "yarn") {
            c.yarn = RefYarn{r->at("factor").get<double>(),
                             r->value("beta_fast", 32.0),
                             r->value("beta_slow", 1.0),
                             r->value("mscale", 1.0),
                             r->value("mscale_all_dim", 0.0),
                             r->value("original_max_position_embeddings", int64_t(4096))};
        } else if (type != "default") {
            throw std::runtime_error("reference: rope type " + type + " is not covered");
        }
    }
    return c;
}

using Vec = std::vector<double>;

class RefModel {
public:
    RefModel(RefConfig cfg, const StTensors& w) : c_(std::move(cfg)), w_(w) {}

    // Called for every layer and position with the latent KV the absorbed form caches:
    // c after kv_a_layernorm and k_pe after RoPE.
    using LatentHook =
        std::function<void(int64_t layer, int64_t pos, const Vec& c, const Vec& k_pe)>;

    // Logits [T][vocab] for every position of `tokens` (positions 0 .. T-1).
    std::vector<Vec> forward(const std::vector<int32_t>& tokens,
                             const LatentHook& on_latent = {}) const {
        const int64_t T = int64_t(tokens.size()), D = c_.hidden_size;
        std::vector<Vec> x(static_cast<size_t>(T));
        const Vec& emb = get("model.embed_tokens.weight");
        for (int64_t t = 0; t < T; ++t)
            x[size_t(t)].assign(emb.begin() + tokens[size_t(t)] * D,
                                emb.begin() + (tokens[size_t(t)] + 1) * D);
        for (int64_t l = 0; l < c_.num_hidden_layers; ++l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            std::vector<Vec> xn(static_cast<size_t>(T));
            for (int64_t t = 0; t < T; ++t)
                xn[size_t(t)] = rms_norm(x[size_t(t)], get(p + "input_layernorm.weight"));
            std::vector<Vec> a = attention(p + "self_attn.", xn, l, on_latent);
            for (int64_t t = 0; t < T; ++t) {
                for (int64_t i = 0; i < D; ++i) x[size_t(t)][size_t(i)] += a[size_t(t)][size_t(i)];
                Vec hn = rms_norm(x[size_t(t)], get(p + "post_attention_layernorm.weight"));
                bool moe = c_.n_routed_experts > 0 && l >= c_.first_k_dense_replace &&
                           l % c_.moe_layer_freq == 0;
                Vec f = moe ? moe_ffn(p + "mlp.", hn) : mlp(p + "mlp.", hn);
                for (int64_t i = 0; i < D; ++i) x[size_t(t)][size_t(i)] += f[size_t(i)];
            }
        }
        std::vector<Vec> logits(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t)
            logits[size_t(t)] =
                linear(rms_norm(x[size_t(t)], get("model.norm.weight")),
                       get(c_.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"),
                       c_.vocab_size);
        return logits;
    }

private:
    const Vec& get(const std::string& name) const {
        auto it = w_.find(name);
        if (it == w_.end()) throw std::runtime_error("reference: missing weight " + name);
        return it->second.values;
    }

    // eps: rms_norm_eps for the layer norms; the latent norms (q_a, kv_a) use DeepSeek's fixed
    // default 1e-6 (see src/model/deepseek2.cpp).
    Vec rms_norm(const Vec& x, const Vec& w, double eps = -1.0) const {
        double ss = 0.0;
        for (double v : x) ss += v * v;
        double inv = 1.0 / std::sqrt(ss / double(x.size()) + (eps < 0 ? c_.rms_norm_eps : eps));
        Vec y(x.size());
        for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] * inv;
        return y;
    }

    // y = x · Wᵀ with W [n_out, x.size()] row-major.
    static Vec linear(const Vec& x, const Vec& W, int64_t n_out) {
        Vec y(size_t(n_out), 0.0);
        for (int64_t o = 0; o < n_out; ++o) {
            double s = 0.0;
            for (size_t i = 0; i < x.size(); ++i) s += W[size_t(o) * x.size() + i] * x[i];
            y[size_t(o)] = s;
        }
        return y;
    }

    static double silu(double v) { return v / (1.0 + std::exp(-v)); }

    Vec swiglu_mlp(const std::string& p, const Vec& x, int64_t n_ff) const {
        Vec g = linear(x, get(p + "gate_proj.weight"), n_ff);
        Vec u = linear(x, get(p + "up_proj.weight"), n_ff);
        for (int64_t i = 0; i < n_ff; ++i) g[size_t(i)] = silu(g[size_t(i)]) * u[size_t(i)];
        return linear(g, get(p + "down_proj.weight"), c_.hidden_size);
    }
    Vec mlp(const std::string& p, const Vec& x) const {
        return swiglu_mlp(p, x, c_.intermediate_size);
    }

    static double yarn_mscale(double s, double m) {
        return s <= 1.0 ? 1.0 : 0.1 * m * std::log(s) + 1.0;
    }

    // DeepSeek's YaRN, written out from the paper's reference code.
    void rope_table(Vec& inv_freq, double& attn_factor) const {
        const int64_t d = c_.qk_rope_head_dim;
        const double base = c_.rope_theta;
        inv_freq.assign(size_t(d / 2), 0.0);
        attn_factor = 1.0;
        for (int64_t i = 0; i < d / 2; ++i)
            inv_freq[size_t(i)] = std::pow(base, -2.0 * double(i) / double(d));
        if (!c_.yarn) return;
        const RefYarn& y = *c_.yarn;
        auto corr = [&](double n) {
            return double(d) *
                   std::log(double(y.original_max_position_embeddings) / (2.0 * M_PI * n)) /
                   (2.0 * std::log(base));
        };
        double low = std::max(std::floor(corr(y.beta_fast)), 0.0);
        double high = std::min(std::ceil(corr(y.beta_slow)), double(d - 1));
        if (low == high) high += 0.001;
        for (int64_t i = 0; i < d / 2; ++i) {
            double ramp = std::clamp((double(i) - low) / (high - low), 0.0, 1.0);
            double extra = inv_freq[size_t(i)], inter = extra / y.factor;
            inv_freq[size_t(i)] = inter * ramp + extra * (1.0 - ramp);
        }
        attn_factor = yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim);
    }

    // Rotates v[off .. off+d) in adjacent pairs (2i, 2i+1) by pos · inv_freq[i]. The angle is a
    // float32 product of the float32 position and inverse frequency, as DeepSeek's
    // DeepseekV2YarnRotaryEmbedding forms it (torch.outer of float32 tensors; transformers and the
    // engine do the same): at a few hundred positions that rounding shows in the logits at ~5e-7,
    // so it is part of the definition here. The cosines and sines are then taken in double.
    void rope(Vec& v, size_t off, int64_t pos) const {
        Vec inv_freq;
        double af;
        rope_table(inv_freq, af);
        for (size_t i = 0; i < inv_freq.size(); ++i) {
            double ang = double(float(pos) * float(inv_freq[i]));
            double cs = std::cos(ang) * af, sn = std::sin(ang) * af;
            double a = v[off + 2 * i], b = v[off + 2 * i + 1];
            v[off + 2 * i] = a * cs - b * sn;
            v[off + 2 * i + 1] = a * sn + b * cs;
        }
    }

    std::vector<Vec> attention(const std::string& p, const std::vector<Vec>& xn, int64_t layer,
                               const LatentHook& on_latent) const {
        const int64_t T = int64_t(xn.size()), H = c_.num_attention_heads,
                      nope = c_.qk_nope_head_dim, rope_d = c_.qk_rope_head_dim, dv = c_.v_head_dim,
                      r = c_.kv_lora_rank, dq = nope + rope_d;
        double scale = 1.0 / std::sqrt(double(dq));
        if (c_.yarn && c_.yarn->mscale_all_dim != 0.0) {
            double m = yarn_mscale(c_.yarn->factor, c_.yarn->mscale_all_dim);
            scale *= m * m;
        }
        // Per token: q [H, dq], k [H, dq], v [H, dv], all heads expanded.
        std::vector<Vec> q(static_cast<size_t>(T)), k(static_cast<size_t>(T)),
            v(static_cast<size_t>(T));
        const Vec& wkvb = get(p + "kv_b_proj.weight");  // [H·(nope+dv), r]
        for (int64_t t = 0; t < T; ++t) {
            if (c_.q_lora_rank) {
                Vec qa = linear(xn[size_t(t)], get(p + "q_a_proj.weight"), *c_.q_lora_rank);
                q[size_t(t)] = linear(rms_norm(qa, get(p + "q_a_layernorm.weight"), 1e-6),
                                      get(p + "q_b_proj.weight"), H * dq);
            } else {
                q[size_t(t)] = linear(xn[size_t(t)], get(p + "q_proj.weight"), H * dq);
            }
            for (int64_t h = 0; h < H; ++h) rope(q[size_t(t)], size_t(h * dq + nope), t);
            Vec kv = linear(xn[size_t(t)], get(p + "kv_a_proj_with_mqa.weight"), r + rope_d);
            Vec cn =
                rms_norm(Vec(kv.begin(), kv.begin() + r), get(p + "kv_a_layernorm.weight"), 1e-6);
            Vec kpe(kv.begin() + r, kv.end());
            rope(kpe, 0, t);
            if (on_latent) on_latent(layer, t, cn, kpe);
            Vec kvfull = linear(cn, wkvb, H * (nope + dv));  // per head: [k_nope (nope), v (dv)]
            k[size_t(t)].assign(size_t(H * dq), 0.0);
            v[size_t(t)].assign(size_t(H * dv), 0.0);
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t i = 0; i < nope; ++i)
                    k[size_t(t)][size_t(h * dq + i)] = kvfull[size_t(h * (nope + dv) + i)];
                for (int64_t i = 0; i < rope_d; ++i)
                    k[size_t(t)][size_t(h * dq + nope + i)] = kpe[size_t(i)];
                for (int64_t i = 0; i < dv; ++i)
                    v[size_t(t)][size_t(h * dv + i)] = kvfull[size_t(h * (nope + dv) + nope + i)];
            }
        }
        std::vector<Vec> out(static_cast<size_t>(T));
        for (int64_t t = 0; t < T; ++t) {
            Vec o(size_t(H * dv), 0.0);
            for (int64_t h = 0; h < H; ++h) {
                Vec s(static_cast<size_t>(t + 1));
                double mx = -1e300;
                for (int64_t j = 0; j <= t; ++j) {
                    double dot = 0.0;
                    for (int64_t i = 0; i < dq; ++i)
                        dot += q[size_t(t)][size_t(h * dq + i)] * k[size_t(j)][size_t(h * dq + i)];
                    s[size_t(j)] = dot * scale;
                    mx = std::max(mx, s[size_t(j)]);
                }
                double z = 0.0;
                for (double& e : s) z += (e = std::exp(e - mx));
                for (int64_t j = 0; j <= t; ++j)
                    for (int64_t i = 0; i < dv; ++i)
                        o[size_t(h * dv + i)] +=
                            s[size_t(j)] / z * v[size_t(j)][size_t(h * dv + i)];
            }
            out[size_t(t)] = linear(o, get(p + "o_proj.weight"), c_.hidden_size);
        }
        return out;
    }

    Vec moe_ffn(const std::string& p, const Vec& x) const {
        const int64_t E = c_.n_routed_experts, K = c_.num_experts_per_tok;
        Vec logits = linear(x, get(p + "gate.weight"), E);
        double mx = *std::max_element(logits.begin(), logits.end()), z = 0.0;
        Vec s(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) z += (s[size_t(e)] = std::exp(logits[size_t(e)] - mx));
        for (double& v : s) v /= z;
        std::vector<bool> allowed(size_t(E), true);
        if (c_.topk_method == "group_limited_greedy") {
            const int64_t G = c_.n_group, per = E / G;
            std::vector<std::pair<double, int64_t>> gs;
            for (int64_t g = 0; g < G; ++g)
                gs.push_back(
                    {*std::max_element(s.begin() + g * per, s.begin() + (g + 1) * per), g});
            std::stable_sort(gs.begin(), gs.end(),
                             [](auto& a, auto& b) { return a.first > b.first; });
            std::fill(allowed.begin(), allowed.end(), false);
            for (int64_t i = 0; i < c_.topk_group; ++i)
                for (int64_t e = 0; e < per; ++e)
                    allowed[size_t(gs[size_t(i)].second * per + e)] = true;
        }
        std::vector<int64_t> order(static_cast<size_t>(E));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            double sa = allowed[size_t(a)] ? s[size_t(a)] : -1.0,
                   sb = allowed[size_t(b)] ? s[size_t(b)] : -1.0;
            return sa > sb;
        });
        double sum_k = 1e-20;  // DeepSeek's denominator (+1e-20)
        for (int64_t i = 0; i < K; ++i)
            if (allowed[size_t(order[size_t(i)])]) sum_k += s[size_t(order[size_t(i)])];
        Vec y(size_t(c_.hidden_size), 0.0);
        for (int64_t i = 0; i < K; ++i) {
            int64_t e = order[size_t(i)];
            double w = (c_.norm_topk_prob && K > 1) ? s[size_t(e)] / sum_k
                                                    : s[size_t(e)] * c_.routed_scaling_factor;
            if (!allowed[size_t(e)]) w = 0.0;  // DeepSeek: outside the chosen groups, score 0
            Vec ye =
                swiglu_mlp(p + "experts." + std::to_string(e) + ".", x, c_.moe_intermediate_size);
            for (size_t j = 0; j < y.size(); ++j) y[j] += w * ye[j];
        }
        if (c_.n_shared_experts) {
            Vec ys = swiglu_mlp(p + "shared_experts.", x,
                                c_.moe_intermediate_size * *c_.n_shared_experts);
            for (size_t j = 0; j < y.size(); ++j) y[j] += ys[j];
        }
        return y;
    }

    RefConfig c_;
    const StTensors& w_;
};

}  // namespace minids::test
