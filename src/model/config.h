// DeepSeek-V2 family model configuration (DESIGN.md "Config fields to read").
//
// Two JSON forms:
//   * Hugging Face config.json: many variants in the wild (rope_scaling with "type" or
//     "rope_type", or "rope_parameters"; null rope_scaling; missing optional fields take
//     DeepSeek's defaults). Parsed leniently but never guessed: config_from_hf_json.
//   * The .mds manifest "config" object: one canonical form with every field present, written by
//     config_to_json and parsed strictly (missing field, wrong type, unknown key -> error) by
//     config_from_manifest_json.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace minids {

struct YarnScaling {
    double factor = 1.0;
    int64_t original_max_position_embeddings = 4096;
    double beta_fast = 32.0;
    double beta_slow = 1.0;
    double mscale = 1.0;
    double mscale_all_dim = 0.0;
};

struct ModelConfig {
    std::string architecture = "DeepseekV2ForCausalLM";
    int64_t vocab_size = 0;
    int64_t hidden_size = 0;            // n_embd
    int64_t intermediate_size = 0;      // dense MLP
    int64_t moe_intermediate_size = 0;  // one routed expert
    int64_t num_hidden_layers = 0;
    int64_t num_attention_heads = 0;     // H
    std::optional<int64_t> q_lora_rank;  // null: q = x·W_qᵀ
    int64_t kv_lora_rank = 0;            // r
    int64_t qk_nope_head_dim = 0;
    int64_t qk_rope_head_dim = 0;
    int64_t v_head_dim = 0;
    int64_t n_routed_experts = 0;             // 0: no MoE layers
    std::optional<int64_t> n_shared_experts;  // null: no shared expert
    int64_t num_experts_per_tok = 0;
    int64_t first_k_dense_replace = 0;
    int64_t moe_layer_freq = 1;
    int64_t n_group = 1;
    int64_t topk_group = 1;
    std::string topk_method = "greedy";  // "greedy" | "group_limited_greedy"
    bool norm_topk_prob = false;
    double routed_scaling_factor = 1.0;
    std::string scoring_func = "softmax";
    double rms_norm_eps = 1e-6;
    double rope_theta = 10000.0;
    std::optional<YarnScaling> rope_scaling;  // null: plain RoPE
    int64_t max_position_embeddings = 4096;
    int64_t bos_token_id = 0;
    int64_t eos_token_id = 1;
    bool tie_word_embeddings = false;

    // Derived helpers.
    bool is_moe_layer(int64_t l) const {
        return n_routed_experts > 0 && l >= first_k_dense_replace && l % moe_layer_freq == 0;
    }
    int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
    int64_t kv_cache_width() const { return kv_lora_rank + qk_rope_head_dim; }  // 576 for V2
    // (nope+rope)^-0.5 · m², m = mscale(factor, mscale_all_dim) under YaRN with mscale_all_dim != 0
    double attention_scale() const;
};

// Thrown for any config problem, with a message naming the field, expected and found.
struct ConfigError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

ModelConfig config_from_hf_json(const nlohmann::json& j);        // throws ConfigError
ModelConfig config_from_manifest_json(const nlohmann::json& j);  // strict; throws ConfigError
nlohmann::json config_to_json(const ModelConfig& c);
// Cross-field sanity (positive sizes, k <= n_experts, n_group divides n_routed_experts, ...).
void validate_config(const ModelConfig& c);  // throws ConfigError

}  // namespace minids
