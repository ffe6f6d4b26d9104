// The manifest's "config" and "tokenizer" objects.
//
// TEMPORARY local parsers: config_from_manifest_json (src/model/config.h) and
// tokenizer_data_from_json (src/tokenizer/tokenizer_data.h) belong to other parts of the project;
// until they land, the reader parses the canonical forms itself, strictly, here. Whatever parses
// them, check_config_bounds always runs: it bounds every size the reader multiplies, so shape
// arithmetic on a hostile config cannot overflow.
#include "mds/manifest_config.h"

#include <string>

#include "mds/json_fields.h"
#include "mds/manifest.h"

namespace minids::mds {

using nlohmann::json;

namespace {

// Sizes the reader multiplies are at most 2^24 each, so a product of three stays far below 2^63.
constexpr int64_t max_dim = int64_t{1} << 24;

}  // namespace

ModelConfig parse_manifest_config(const json& j, const std::string& file) {
    FieldReader r(file, "config");
    r.expect_object(j, {"architecture", "vocab_size", "hidden_size", "intermediate_size",
                        "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                        "v_head_dim", "n_routed_experts", "n_shared_experts",
                        "num_experts_per_tok", "first_k_dense_replace", "moe_layer_freq", "n_group",
                        "topk_group", "topk_method", "norm_topk_prob", "routed_scaling_factor",
                        "scoring_func", "rms_norm_eps", "rope_theta", "rope_scaling",
                        "max_position_embeddings", "bos_token_id", "eos_token_id",
                        "tie_word_embeddings"});
    ModelConfig c;
    c.architecture = r.string(j, "architecture");
    c.vocab_size = r.i64(j, "vocab_size", 1, max_dim);
    c.hidden_size = r.i64(j, "hidden_size", 1, max_dim);
    c.intermediate_size = r.i64(j, "intermediate_size", 0, max_dim);
    c.moe_intermediate_size = r.i64(j, "moe_intermediate_size", 0, max_dim);
    c.num_hidden_layers = r.i64(j, "num_hidden_layers", 1, max_dim);
    c.num_attention_heads = r.i64(j, "num_attention_heads", 1, max_dim);
    const json& q_lora = r.required(j, "q_lora_rank");
    if (!q_lora.is_null()) c.q_lora_rank = r.as_i64(q_lora, r.field("q_lora_rank"), 1, max_dim);
    c.kv_lora_rank = r.i64(j, "kv_lora_rank", 1, max_dim);
    c.qk_nope_head_dim = r.i64(j, "qk_nope_head_dim", 0, max_dim);
    c.qk_rope_head_dim = r.i64(j, "qk_rope_head_dim", 0, max_dim);
    c.v_head_dim = r.i64(j, "v_head_dim", 1, max_dim);
    c.n_routed_experts = r.i64(j, "n_routed_experts", 0, max_dim);
    const json& shared = r.required(j, "n_shared_experts");
    if (!shared.is_null())
        c.n_shared_experts = r.as_i64(shared, r.field("n_shared_experts"), 0, max_dim);
    c.num_experts_per_tok = r.i64(j, "num_experts_per_tok", 0, max_dim);
    c.first_k_dense_replace = r.i64(j, "first_k_dense_replace", 0, max_dim);
    c.moe_layer_freq = r.i64(j, "moe_layer_freq", 1, max_dim);
    c.n_group = r.i64(j, "n_group", 1, max_dim);
    c.topk_group = r.i64(j, "topk_group", 1, max_dim);
    c.topk_method = r.string(j, "topk_method");
    c.norm_topk_prob = r.boolean(j, "norm_topk_prob");
    c.routed_scaling_factor = r.number(j, "routed_scaling_factor");
    c.scoring_func = r.string(j, "scoring_func");
    c.rms_norm_eps = r.number(j, "rms_norm_eps");
    c.rope_theta = r.number(j, "rope_theta");
    const json& rope = r.required(j, "rope_scaling");
    if (!rope.is_null()) {
        FieldReader rr(file, "config.rope_scaling");
        rr.expect_object(rope, {"factor", "original_max_position_embeddings", "beta_fast",
                                "beta_slow", "mscale", "mscale_all_dim"});
        YarnScaling y;
        y.factor = rr.number(rope, "factor");
        y.original_max_position_embeddings =
            rr.i64(rope, "original_max_position_embeddings", 1, INT64_MAX);
        y.beta_fast = rr.number(rope, "beta_fast");
        y.beta_slow = rr.number(rope, "beta_slow");
        y.mscale = rr.number(rope, "mscale");
        y.mscale_all_dim = rr.number(rope, "mscale_all_dim");
        c.rope_scaling = y;
    }
    c.max_position_embeddings = r.i64(j, "max_position_embeddings", 1, INT64_MAX);
    c.bos_token_id = r.i64(j, "bos_token_id", 0, INT64_MAX);
    c.eos_token_id = r.i64(j, "eos_token_id", 0, INT64_MAX);
    c.tie_word_embeddings = r.boolean(j, "tie_word_embeddings");
    return c;
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

TokenizerData parse_manifest_tokenizer(const json& j, const std::string& file) {
    FieldReader r(file, "tokenizer");
    r.expect_object(j, {"model", "vocab", "merges", "added_tokens", "pre_splits", "byte_level",
                        "byte_level_add_prefix_space", "bos_id", "eos_id", "add_bos", "add_eos",
                        "chat_template"});
    TokenizerData t;
    t.model = r.string(j, "model");
    if (t.model != "bpe") fail(file, r.field("model"), "\"bpe\"", describe_json(j["model"]));
    const json& vocab = r.array(j, "vocab");
    t.vocab.reserve(vocab.size());
    for (size_t i = 0; i < vocab.size(); ++i) {
        if (!vocab[i].is_string())
            fail(file, r.field("vocab") + "[" + std::to_string(i) + "]", "a string",
                 describe_json(vocab[i]));
        t.vocab.push_back(vocab[i].get<std::string>());
    }
    const json& merges = r.array(j, "merges");
    t.merges.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
        if (!merges[i].is_string())
            fail(file, r.field("merges") + "[" + std::to_string(i) + "]", "a string",
                 describe_json(merges[i]));
        t.merges.push_back(merges[i].get<std::string>());
    }
    const json& added = r.array(j, "added_tokens");
    for (size_t i = 0; i < added.size(); ++i) {
        FieldReader ar(file, r.field("added_tokens") + "[" + std::to_string(i) + "]");
        ar.expect_object(added[i], {"id", "content", "special", "lstrip", "rstrip", "normalized",
                                    "single_word"});
        AddedToken a;
        a.id = static_cast<int32_t>(ar.i64(added[i], "id", 0, INT32_MAX));
        a.content = ar.string(added[i], "content");
        a.special = ar.boolean(added[i], "special");
        a.lstrip = ar.boolean(added[i], "lstrip");
        a.rstrip = ar.boolean(added[i], "rstrip");
        a.normalized = ar.boolean(added[i], "normalized");
        a.single_word = ar.boolean(added[i], "single_word");
        t.added_tokens.push_back(std::move(a));
    }
    const json& splits = r.array(j, "pre_splits");
    for (size_t i = 0; i < splits.size(); ++i) {
        FieldReader sr(file, r.field("pre_splits") + "[" + std::to_string(i) + "]");
        sr.expect_object(splits[i], {"regex", "behavior", "invert"});
        TokenizerData::Split s;
        s.regex = sr.string(splits[i], "regex");
        s.behavior = sr.string(splits[i], "behavior");
        s.invert = sr.boolean(splits[i], "invert");
        t.pre_splits.push_back(std::move(s));
    }
    t.byte_level = r.boolean(j, "byte_level");
    t.byte_level_add_prefix_space = r.boolean(j, "byte_level_add_prefix_space");
    for (const char* key : {"bos_id", "eos_id"}) {
        const json& v = r.required(j, key);
        if (v.is_null()) continue;
        auto id = static_cast<int32_t>(r.as_i64(v, r.field(key), 0, INT32_MAX));
        (std::string_view(key) == "bos_id" ? t.bos_id : t.eos_id) = id;
    }
    t.add_bos = r.boolean(j, "add_bos");
    t.add_eos = r.boolean(j, "add_eos");
    t.chat_template = r.string(j, "chat_template");
    return t;
}

}  // namespace minids::mds
