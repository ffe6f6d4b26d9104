// DeepSeek-V2 family model configuration (DESIGN.md "Config fields to read").
//
// Two JSON forms:
//   * Hugging Face config.json: many variants in the wild (rope_scaling with "type" or
//     "rope_type", or "rope_parameters"; null rope_scaling; missing optional fields take
//     DeepSeek's defaults). Parsed leniently but never guessed: config_from_hf_json.
//   * The .mds manifest "config" object: one canonical form with every field present, written by
//     config_to_json and parsed strictly (missing field, wrong type, unknown key -> error) by
//     config_from_manifest_json.
//
// Every field is declared once, in MINIDS_MODEL_CONFIG_FIELDS below: the struct, both readers,
// the writer and the bounds validate_config checks all come from that table, so a new field is
// one line there (plus code only if it needs a check across fields or a Hugging Face oddity).
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "tokenizer/tokenizer_data.h"  // max_vocab_size

namespace minids {

// Bounds shared by several fields. Caps keep every product of sizes that the loader and
// converter compute far below 2^63 (vocab × hidden × 2 bytes, experts × 3 × n_ff × n_embd).
inline constexpr int64_t config_dim_max = int64_t{1} << 20;
inline constexpr int64_t config_positions_max = int64_t{1} << 30;

// The fields, one line each, in the order of the manifest:
//   INT(name, initial, hf, lo, hi)      int64_t in [lo, hi]
//   OPT_INT(name, hf, lo, hi)           std::optional<int64_t> (null allowed), in [lo, hi] when set
//   REAL(name, initial, hf, rule)       double; rule: positive (finite, > 0) or finite
//   FLAG(name, initial, hf)             bool
//   TEXT(name, initial, hf)             std::string (allowed values: validate_config)
// `initial` is a default-constructed ModelConfig's value; `hf` what a config.json that leaves the
// field out (or gives null) means: transformers' DeepseekV2Config defaults
// (configuration_deepseek_v2.py) and, where it lacks one, DeepSeek's configuration_deepseek.py;
// `required` when the field fixes the model's size and has no sensible default. A few fields
// need more than the table in config_from_hf_json (the architecture, the expert counts, token
// ids given as lists, rope_scaling) and validate_config (bounds that depend on other fields).
#define MINIDS_MODEL_CONFIG_FIELDS(INT, OPT_INT, REAL, FLAG, TEXT)                 \
    TEXT(architecture, "DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM")           \
    INT(vocab_size, 0, required, 1, max_vocab_size)                                \
    INT(hidden_size, 0, required, 1, config_dim_max)       /* n_embd */            \
    INT(intermediate_size, 0, required, 1, config_dim_max) /* dense MLP */         \
    INT(moe_intermediate_size, 0, 1407, 0, config_dim_max) /* one routed expert */ \
    INT(num_hidden_layers, 0, required, 1, 4096)                                   \
    INT(num_attention_heads, 0, required, 1, 4096) /* H */                         \
    OPT_INT(q_lora_rank, 1536, 1, config_dim_max)  /* null: q = x·W_qᵀ */       \
    INT(kv_lora_rank, 0, 512, 1, config_dim_max)   /* r */                         \
    INT(qk_nope_head_dim, 0, 128, 1, 65536)                                        \
    INT(qk_rope_head_dim, 0, 64, 2, 65536) /* even: RoPE rotates pairs */          \
    INT(v_head_dim, 0, 128, 1, 65536)                                              \
    INT(n_routed_experts, 0, 64, 0, 65536)          /* 0: no MoE layers */         \
    OPT_INT(n_shared_experts, 2, 0, 4096)           /* null: no shared expert */   \
    INT(num_experts_per_tok, 0, required, 0, 65536) /* <= n_routed_experts */      \
    INT(first_k_dense_replace, 0, 0, 0, 4096)       /* <= num_hidden_layers */     \
    INT(moe_layer_freq, 1, 1, 1, 4096)                                             \
    INT(n_group, 1, 1, 1, 65536)          /* divides n_routed_experts */           \
    INT(topk_group, 1, 1, 1, 65536)       /* <= n_group */                         \
    TEXT(topk_method, "greedy", "greedy") /* greedy | group_limited_greedy */      \
    FLAG(norm_topk_prob, false, false)                                             \
    REAL(routed_scaling_factor, 1.0, 1.0, positive)                                \
    TEXT(scoring_func, "softmax", "softmax")                                       \
    REAL(rms_norm_eps, 1e-6, 1e-6, positive)                                       \
    REAL(rope_theta, 10000.0, 10000.0, positive)                                   \
    INT(max_position_embeddings, 4096, 2048, 1, config_positions_max)              \
    INT(bos_token_id, 0, 1, 0, max_vocab_size) /* < vocab_size */                  \
    INT(eos_token_id, 1, 2, 0, max_vocab_size) /* < vocab_size */                  \
    FLAG(tie_word_embeddings, false, false)

// YaRN rope scaling, the same way (DeepseekV2YarnRotaryEmbedding's defaults; factor required).
#define MINIDS_YARN_FIELDS(INT, REAL)                                          \
    REAL(factor, 1.0, required, positive)                                      \
    INT(original_max_position_embeddings, 4096, 4096, 1, config_positions_max) \
    REAL(beta_fast, 32.0, 32.0, positive)                                      \
    REAL(beta_slow, 1.0, 1.0, positive)                                        \
    REAL(mscale, 1.0, 1.0, finite)                                             \
    REAL(mscale_all_dim, 0.0, 0.0, finite)

#define MINIDS_CONFIG_DECLARE_INT(name, initial, hf, lo, hi) int64_t name = initial;
#define MINIDS_CONFIG_DECLARE_OPT_INT(name, hf, lo, hi) std::optional<int64_t> name;
#define MINIDS_CONFIG_DECLARE_REAL(name, initial, hf, rule) double name = initial;
#define MINIDS_CONFIG_DECLARE_FLAG(name, initial, hf) bool name = initial;
#define MINIDS_CONFIG_DECLARE_TEXT(name, initial, hf) std::string name = initial;

struct YarnScaling {
    MINIDS_YARN_FIELDS(MINIDS_CONFIG_DECLARE_INT, MINIDS_CONFIG_DECLARE_REAL)
};

struct ModelConfig {
    MINIDS_MODEL_CONFIG_FIELDS(MINIDS_CONFIG_DECLARE_INT, MINIDS_CONFIG_DECLARE_OPT_INT,
                               MINIDS_CONFIG_DECLARE_REAL, MINIDS_CONFIG_DECLARE_FLAG,
                               MINIDS_CONFIG_DECLARE_TEXT)
    std::optional<YarnScaling> rope_scaling;  // null: plain RoPE (MINIDS_YARN_FIELDS)

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
// Every bound: the table's, and those across fields (k <= n_experts, n_group divides
// n_routed_experts, ids below vocab_size, ...).
void validate_config(const ModelConfig& c);  // throws ConfigError

}  // namespace minids
