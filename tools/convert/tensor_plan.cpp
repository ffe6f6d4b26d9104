#include "convert/tensor_plan.h"

namespace minids::convert {

std::string shape_str(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

// Sizes are bounded by validate_config (each <= 2^24), so no product below overflows.
std::vector<ExpectedTensor> expected_tensors(const ModelConfig& c) {
    const int64_t D = c.hidden_size, H = c.num_attention_heads, V = c.vocab_size;
    std::vector<ExpectedTensor> out;
    auto add = [&out](std::string name, std::vector<int64_t> shape, TensorRole role) {
        ExpectedTensor t;
        t.name = std::move(name);
        t.shape = std::move(shape);
        t.role = role;
        out.push_back(std::move(t));
    };
    add("model.embed_tokens.weight", {V, D}, TensorRole::embedding);
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        const std::string p = "model.layers." + std::to_string(l) + ".";
        add(p + "input_layernorm.weight", {D}, TensorRole::norm);
        const int64_t q_out = H * c.qk_head_dim();
        if (c.q_lora_rank) {
            add(p + "self_attn.q_a_proj.weight", {*c.q_lora_rank, D}, TensorRole::linear);
            add(p + "self_attn.q_a_layernorm.weight", {*c.q_lora_rank}, TensorRole::norm);
            add(p + "self_attn.q_b_proj.weight", {q_out, *c.q_lora_rank}, TensorRole::linear);
        } else {
            add(p + "self_attn.q_proj.weight", {q_out, D}, TensorRole::linear);
        }
        add(p + "self_attn.kv_a_proj_with_mqa.weight", {c.kv_cache_width(), D}, TensorRole::linear);
        add(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank}, TensorRole::norm);
        add(p + "self_attn.kv_b_proj.weight",
            {H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank}, TensorRole::linear);
        add(p + "self_attn.o_proj.weight", {D, H * c.v_head_dim}, TensorRole::linear);
        add(p + "post_attention_layernorm.weight", {D}, TensorRole::norm);
        if (c.is_moe_layer(l)) {
            add(p + "mlp.gate.weight", {c.n_routed_experts, D}, TensorRole::linear);
            if (c.n_shared_experts && *c.n_shared_experts > 0) {
                const int64_t F = c.moe_intermediate_size * *c.n_shared_experts;
                add(p + "mlp.shared_experts.gate_proj.weight", {F, D}, TensorRole::linear);
                add(p + "mlp.shared_experts.up_proj.weight", {F, D}, TensorRole::linear);
                add(p + "mlp.shared_experts.down_proj.weight", {D, F}, TensorRole::linear);
            }
        } else {
            const int64_t F = c.intermediate_size;
            add(p + "mlp.gate_proj.weight", {F, D}, TensorRole::linear);
            add(p + "mlp.up_proj.weight", {F, D}, TensorRole::linear);
            add(p + "mlp.down_proj.weight", {D, F}, TensorRole::linear);
        }
    }
    add("model.norm.weight", {D}, TensorRole::norm);
    add("lm_head.weight", {V, D}, TensorRole::linear);
    out.back().optional = c.tie_word_embeddings;

    const int64_t F = c.moe_intermediate_size;
    static const char* part_names[3] = {"gate_proj", "up_proj", "down_proj"};
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
        if (!c.is_moe_layer(l)) continue;
        for (int64_t e = 0; e < c.n_routed_experts; ++e) {
            for (int part = 0; part < 3; ++part) {
                ExpectedTensor t;
                t.name = "model.layers." + std::to_string(l) + ".mlp.experts." + std::to_string(e) +
                         "." + part_names[part] + ".weight";
                t.shape = part == 2 ? std::vector<int64_t>{D, F} : std::vector<int64_t>{F, D};
                t.role = TensorRole::expert;
                t.layer = l;
                t.expert = e;
                t.part = part;
                out.push_back(std::move(t));
            }
        }
    }
    return out;
}

ModelPlan plan_model(const ModelConfig& c, mgl::dtype expert_dtype, bool include_lm_head,
                     mds::MdsWriter& w) {
    ModelPlan plan;
    plan.tensors = expected_tensors(c);
    plan.writer_id.assign(plan.tensors.size(), size_t(-1));
    bool experts_set = false;
    size_t blob = 0;
    for (size_t i = 0; i < plan.tensors.size(); ++i) {
        const ExpectedTensor& t = plan.tensors[i];
        if (t.role != TensorRole::expert) {
            plan.n_dense = i + 1;
            if (t.optional && !include_lm_head) continue;
            plan.writer_id[i] = w.add_tensor(t.name, mgl::dtype::bf16, t.shape);
            continue;
        }
        if (!experts_set) {
            w.set_experts(
                mds::ExpertLayout::make(expert_dtype, c.hidden_size, c.moe_intermediate_size));
            experts_set = true;
        }
        if (t.part == 0) blob = w.add_expert_blob(t.layer, t.expert);
        plan.writer_id[i] = blob;
    }
    return plan;
}

}  // namespace minids::convert
