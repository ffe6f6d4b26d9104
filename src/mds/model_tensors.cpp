// The tensors of a DeepSeek-V2 checkpoint (DESIGN.md "The model, exactly"), derived from the
// config alone, so a file whose shapes disagree with its config is refused before any forward.
#include "mds/model_tensors.h"

#include <string>
#include <unordered_map>

#include "mds/manifest.h"

namespace minids::mds {

namespace {

std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

struct Expected {
    std::string name;
    std::vector<int64_t> shape;
    const char* why;  // which config fields give the shape
};

// Appends the tensors of layer `l`. Sizes are bounded by validate_config (each at most
// config_dim_max = 2^20), so the products below cannot overflow.
void layer_tensors(const ModelConfig& c, int64_t l, std::vector<Expected>& out) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const int64_t D = c.hidden_size, H = c.num_attention_heads;
    out.push_back({p + "input_layernorm.weight", {D}, "hidden_size"});
    out.push_back({p + "post_attention_layernorm.weight", {D}, "hidden_size"});
    const int64_t q_out = H * c.qk_head_dim();
    if (c.q_lora_rank) {
        const int64_t R = *c.q_lora_rank;
        out.push_back({p + "self_attn.q_a_proj.weight", {R, D}, "q_lora_rank, hidden_size"});
        out.push_back({p + "self_attn.q_a_layernorm.weight", {R}, "q_lora_rank"});
        out.push_back({p + "self_attn.q_b_proj.weight",
                       {q_out, R},
                       "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim), q_lora_rank"});
    } else {
        out.push_back({p + "self_attn.q_proj.weight",
                       {q_out, D},
                       "num_attention_heads x (qk_nope_head_dim + qk_rope_head_dim), hidden_size"});
    }
    out.push_back({p + "self_attn.kv_a_proj_with_mqa.weight",
                   {c.kv_cache_width(), D},
                   "kv_lora_rank + qk_rope_head_dim, hidden_size"});
    out.push_back({p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, "kv_lora_rank"});
    out.push_back({p + "self_attn.kv_b_proj.weight",
                   {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
                   "num_attention_heads x (qk_nope_head_dim + v_head_dim), kv_lora_rank"});
    out.push_back({p + "self_attn.o_proj.weight",
                   {D, H * c.v_head_dim},
                   "hidden_size, num_attention_heads x v_head_dim"});
    if (c.is_moe_layer(l)) {
        out.push_back(
            {p + "mlp.gate.weight", {c.n_routed_experts, D}, "n_routed_experts, hidden_size"});
        if (c.n_shared_experts && *c.n_shared_experts > 0) {
            const int64_t F = c.moe_intermediate_size * *c.n_shared_experts;
            const char* why = "moe_intermediate_size x n_shared_experts, hidden_size";
            out.push_back({p + "mlp.shared_experts.gate_proj.weight", {F, D}, why});
            out.push_back({p + "mlp.shared_experts.up_proj.weight", {F, D}, why});
            out.push_back({p + "mlp.shared_experts.down_proj.weight", {D, F}, why});
        }
    } else {
        const int64_t F = c.intermediate_size;
        const char* why = "intermediate_size, hidden_size";
        out.push_back({p + "mlp.gate_proj.weight", {F, D}, why});
        out.push_back({p + "mlp.up_proj.weight", {F, D}, why});
        out.push_back({p + "mlp.down_proj.weight", {D, F}, why});
    }
}

}  // namespace

void check_model_tensors(const std::vector<TensorEntry>& tensors, const ModelConfig& c,
                         const std::string& file) {
    std::unordered_map<std::string_view, size_t> index;
    for (size_t i = 0; i < tensors.size(); ++i) index.emplace(tensors[i].name, i);
    std::vector<bool> expected(tensors.size(), false);

    auto check = [&](const Expected& e, bool required) {
        auto it = index.find(e.name);
        if (it == index.end()) {
            if (required)
                fail(file, "tensors",
                     "a tensor \"" + e.name + "\" of shape " + shape_string(e.shape) +
                         " (required by the config)",
                     "no such tensor");
            return;
        }
        const TensorEntry& t = tensors[it->second];
        const std::string field = "tensors[" + std::to_string(it->second) + "] (" + t.name + ")";
        if (t.shape != e.shape)
            fail(file, field + ".shape", shape_string(e.shape) + " (config: " + e.why + ")",
                 shape_string(t.shape));
        if (t.dtype != mgl::dtype::bf16 && t.dtype != mgl::dtype::f32 && t.dtype != mgl::dtype::f16)
            fail(file, field + ".dtype", "bf16, f32 or f16", manifest_dtype_name(t.dtype));
        expected[it->second] = true;
    };

    const int64_t D = c.hidden_size, V = c.vocab_size;
    check({"model.embed_tokens.weight", {V, D}, "vocab_size, hidden_size"}, true);
    check({"model.norm.weight", {D}, "hidden_size"}, true);
    // Tied embeddings reuse embed_tokens; a checkpoint may still carry a copy of lm_head.
    check({"lm_head.weight", {V, D}, "vocab_size, hidden_size"}, !c.tie_word_embeddings);
    std::vector<Expected> layer;
    // Stops at the first missing tensor, so a hostile num_hidden_layers costs no more work than
    // the tensors actually present.
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        layer.clear();
        layer_tensors(c, l, layer);
        for (const auto& e : layer) check(e, true);
    }
    for (size_t i = 0; i < tensors.size(); ++i)
        if (!expected[i])
            fail(file, "tensors[" + std::to_string(i) + "].name",
                 "a tensor the config expects (routed experts belong in \"experts\")",
                 "\"" + tensors[i].name + "\"");
}

}  // namespace minids::mds
