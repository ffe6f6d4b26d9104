// The manifest's "config" and "tokenizer" objects.
//
// Parsing and semantic checks belong to config_from_manifest_json / validate_config
// (src/model/config.h) and tokenizer_data_from_json (src/tokenizer/tokenizer_data.h); this file
// turns their errors into FileErrors naming the file. check_config_bounds is the reader's own
// guard: it bounds every size the reader multiplies, whatever validate_config allows, so shape
// arithmetic on a hostile config cannot overflow.
#include "mds/manifest_config.h"

#include <string>

#include "mds/manifest.h"

namespace minids::mds {

using nlohmann::json;

namespace {

// Sizes the reader multiplies are at most 2^24 each, so a product of three stays far below 2^63.
constexpr int64_t max_dim = int64_t{1} << 24;

}  // namespace

ModelConfig parse_manifest_config(const json& j, const std::string& file) {
    try {
        return config_from_manifest_json(j);  // strict, then validate_config
    } catch (const ConfigError& e) {
        // The config's own message names the field, what it expected and what it found.
        throw FileError(file + ": " + e.what());
    }
}

TokenizerData parse_manifest_tokenizer(const json& j, const std::string& file) {
    try {
        return tokenizer_data_from_json(j);
    } catch (const TokenizerError& e) {
        throw FileError(file + ": " + e.what());
    }
}

void check_config_bounds(const ModelConfig& c, const std::string& file) {
    auto in_range = [&](const char* name, int64_t v, int64_t lo) {
        if (v < lo || v > max_dim)
            fail(file, std::string("config.") + name,
                 "an integer in [" + std::to_string(lo) + ", " + std::to_string(max_dim) + "]",
                 std::to_string(v));
    };
    in_range("vocab_size", c.vocab_size, 1);
    in_range("hidden_size", c.hidden_size, 1);
    in_range("intermediate_size", c.intermediate_size, 0);
    in_range("moe_intermediate_size", c.moe_intermediate_size, 0);
    in_range("num_hidden_layers", c.num_hidden_layers, 1);
    in_range("num_attention_heads", c.num_attention_heads, 1);
    if (c.q_lora_rank) in_range("q_lora_rank", *c.q_lora_rank, 1);
    in_range("kv_lora_rank", c.kv_lora_rank, 1);
    in_range("qk_nope_head_dim", c.qk_nope_head_dim, 0);
    in_range("qk_rope_head_dim", c.qk_rope_head_dim, 0);
    in_range("v_head_dim", c.v_head_dim, 1);
    in_range("n_routed_experts", c.n_routed_experts, 0);
    if (c.n_shared_experts) in_range("n_shared_experts", *c.n_shared_experts, 0);
    in_range("num_experts_per_tok", c.num_experts_per_tok, 0);
    in_range("first_k_dense_replace", c.first_k_dense_replace, 0);
    in_range("moe_layer_freq", c.moe_layer_freq, 1);
    if (c.n_routed_experts > 0 && c.moe_intermediate_size < 1)
        fail(file, "config.moe_intermediate_size", "at least 1 when n_routed_experts > 0",
             std::to_string(c.moe_intermediate_size));
    if (c.num_experts_per_tok > c.n_routed_experts)
        fail(file, "config.num_experts_per_tok",
             "at most n_routed_experts (" + std::to_string(c.n_routed_experts) + ")",
             std::to_string(c.num_experts_per_tok));
    if (c.qk_nope_head_dim + c.qk_rope_head_dim < 1)
        fail(file, "config.qk_nope_head_dim", "qk_nope_head_dim + qk_rope_head_dim >= 1", "0");
    if (c.bos_token_id >= c.vocab_size)
        fail(file, "config.bos_token_id", "below vocab_size (" + std::to_string(c.vocab_size) + ")",
             std::to_string(c.bos_token_id));
    if (c.eos_token_id >= c.vocab_size)
        fail(file, "config.eos_token_id", "below vocab_size (" + std::to_string(c.vocab_size) + ")",
             std::to_string(c.eos_token_id));
}

}  // namespace minids::mds
