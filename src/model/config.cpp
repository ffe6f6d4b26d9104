// ModelConfig from a Hugging Face config.json (lenient about the variants in the wild, never
// guessing a shape) and to/from the .mds manifest's canonical "config" object (strict).
#include "model/config.h"

#include <cmath>
#include <limits>
#include <set>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tokenizer/tokenizer_data.h"

namespace minids {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& what) { throw ConfigError(what); }

std::string type_name(const json& v) {
    if (v.is_number_integer()) return "an integer";
    if (v.is_number_float()) return "a number " + v.dump();
    return std::string(v.type_name());
}

// ---- Hugging Face config.json: present-or-default readers ----

// Integer field; `null` and absence both give the default. A float with an integral value
// (some exporters write 2048.0) is accepted; anything else is refused by name.
int64_t hf_int(const json& j, const char* key, int64_t def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (it->is_number_integer()) return it->get<int64_t>();
    if (it->is_number_float()) {
        double d = it->get<double>();
        if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15) return int64_t(d);
    }
    fail(std::string("config.json: field \"") + key + "\": expected an integer, found " +
         type_name(*it));
}

std::optional<int64_t> hf_opt_int(const json& j, const char* key, std::optional<int64_t> def) {
    auto it = j.find(key);
    if (it == j.end()) return def;
    if (it->is_null()) return std::nullopt;
    return hf_int(j, key, 0);
}

int64_t hf_required_int(const json& j, const char* key) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null())
        fail(std::string("config.json: required field \"") + key + "\" is missing");
    return hf_int(j, key, 0);
}

double hf_double(const json& j, const char* key, double def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_number())
        fail(std::string("config.json: field \"") + key + "\": expected a number, found " +
             type_name(*it));
    return it->get<double>();
}

bool hf_bool(const json& j, const char* key, bool def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_boolean())
        fail(std::string("config.json: field \"") + key + "\": expected true or false, found " +
             type_name(*it));
    return it->get<bool>();
}

std::string hf_string(const json& j, const char* key, const std::string& def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    if (!it->is_string())
        fail(std::string("config.json: field \"") + key + "\": expected a string, found " +
             type_name(*it));
    return it->get<std::string>();
}

// eos_token_id is an int in DeepSeek's configs, a list in some re-exports: the first one is the
// model's end-of-sequence token.
int64_t hf_token_id(const json& j, const char* key, int64_t def) {
    auto it = j.find(key);
    if (it != j.end() && it->is_array()) {
        if (it->empty() || !(*it)[0].is_number_integer())
            fail(std::string("config.json: field \"") + key +
                 "\": expected an integer or a non-empty list of integers");
        return (*it)[0].get<int64_t>();
    }
    return hf_int(j, key, def);
}

// The rope scaling object comes as "rope_scaling" (with "type" or "rope_type") in DeepSeek's own
// configs, or as "rope_parameters" (transformers >= 5, which also moves rope_theta inside).
void parse_rope(const json& j, ModelConfig& c) {
    const json* rs = nullptr;
    const char* where = "rope_scaling";
    if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
        rs = &*it;
        where = "rope_parameters";
    } else if (auto it2 = j.find("rope_scaling"); it2 != j.end() && !it2->is_null()) {
        rs = &*it2;
    }
    if (!rs) return;
    if (!rs->is_object())
        fail(std::string("config.json: field \"") + where +
             "\": expected an object or null, found " + type_name(*rs));
    if (rs->contains("rope_theta")) c.rope_theta = hf_double(*rs, "rope_theta", c.rope_theta);
    std::string type = hf_string(*rs, "type", "");
    if (type.empty()) type = hf_string(*rs, "rope_type", "");
    if (type.empty())
        fail(std::string("config.json: field \"") + where +
             "\": has neither \"type\" nor \"rope_type\"");
    if (type == "default") return;  // plain RoPE, written explicitly
    if (type != "yarn")
        fail(std::string("config.json: field \"") + where + "\": rope type \"" + type +
             "\" is not supported (expected \"yarn\" or \"default\")");
    // Defaults are DeepSeek's yarn_get_mscale / DeepseekV2YarnRotaryEmbedding defaults.
    YarnScaling y;
    if (!rs->contains("factor"))
        fail(std::string("config.json: field \"") + where + ".factor\" is missing");
    y.factor = hf_double(*rs, "factor", 1.0);
    y.original_max_position_embeddings = hf_int(*rs, "original_max_position_embeddings", 4096);
    y.beta_fast = hf_double(*rs, "beta_fast", 32.0);
    y.beta_slow = hf_double(*rs, "beta_slow", 1.0);
    y.mscale = hf_double(*rs, "mscale", 1.0);
    y.mscale_all_dim = hf_double(*rs, "mscale_all_dim", 0.0);
    c.rope_scaling = y;
}

// ---- manifest: every field present, exact types ----

const json& man_field(const json& j, const char* key) {
    auto it = j.find(key);
    if (it == j.end())
        fail(std::string("manifest config: required field \"") + key + "\" is missing");
    return *it;
}

int64_t man_int(const json& j, const char* key) {
    const json& v = man_field(j, key);
    if (!v.is_number_integer())
        fail(std::string("manifest config: field \"") + key + "\": expected an integer, found " +
             type_name(v));
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()))
        fail(std::string("manifest config: field \"") + key + "\": integer out of range");
    return v.get<int64_t>();
}

std::optional<int64_t> man_opt_int(const json& j, const char* key) {
    if (man_field(j, key).is_null()) return std::nullopt;
    return man_int(j, key);
}

double man_double(const json& j, const char* key) {
    const json& v = man_field(j, key);
    if (!v.is_number())
        fail(std::string("manifest config: field \"") + key + "\": expected a number, found " +
             type_name(v));
    return v.get<double>();
}

bool man_bool(const json& j, const char* key) {
    const json& v = man_field(j, key);
    if (!v.is_boolean())
        fail(std::string("manifest config: field \"") + key + "\": expected true or false, found " +
             type_name(v));
    return v.get<bool>();
}

std::string man_string(const json& j, const char* key) {
    const json& v = man_field(j, key);
    if (!v.is_string())
        fail(std::string("manifest config: field \"") + key + "\": expected a string, found " +
             type_name(v));
    return v.get<std::string>();
}

void man_no_unknown_keys(const json& j, const std::set<std::string_view>& known, const char* what) {
    for (auto it = j.begin(); it != j.end(); ++it)
        if (!known.count(it.key()))
            fail(std::string("manifest ") + what + ": unknown field \"" + it.key() + "\"");
}

const std::set<std::string_view> kManifestKeys = {"architecture",
                                                  "vocab_size",
                                                  "hidden_size",
                                                  "intermediate_size",
                                                  "moe_intermediate_size",
                                                  "num_hidden_layers",
                                                  "num_attention_heads",
                                                  "q_lora_rank",
                                                  "kv_lora_rank",
                                                  "qk_nope_head_dim",
                                                  "qk_rope_head_dim",
                                                  "v_head_dim",
                                                  "n_routed_experts",
                                                  "n_shared_experts",
                                                  "num_experts_per_tok",
                                                  "first_k_dense_replace",
                                                  "moe_layer_freq",
                                                  "n_group",
                                                  "topk_group",
                                                  "topk_method",
                                                  "norm_topk_prob",
                                                  "routed_scaling_factor",
                                                  "scoring_func",
                                                  "rms_norm_eps",
                                                  "rope_theta",
                                                  "rope_scaling",
                                                  "max_position_embeddings",
                                                  "bos_token_id",
                                                  "eos_token_id",
                                                  "tie_word_embeddings"};
const std::set<std::string_view> kYarnKeys = {"factor",    "original_max_position_embeddings",
                                              "beta_fast", "beta_slow",
                                              "mscale",    "mscale_all_dim"};

void check_range(const char* field, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
        fail(std::string("config: field \"") + field + "\": expected " + std::to_string(lo) + ".." +
             std::to_string(hi) + ", found " + std::to_string(v));
}

}  // namespace

double ModelConfig::attention_scale() const {
    double s = 1.0 / std::sqrt(double(qk_head_dim()));
    if (rope_scaling && rope_scaling->mscale_all_dim != 0.0) {
        double f = rope_scaling->factor;
        double m = f <= 1.0 ? 1.0 : 0.1 * rope_scaling->mscale_all_dim * std::log(f) + 1.0;
        s *= m * m;
    }
    return s;
}

// Missing optional fields take transformers' DeepseekV2Config defaults
// (configuration_deepseek_v2.py): kv_lora_rank 512, q_lora_rank 1536, qk_nope_head_dim 128,
// qk_rope_head_dim 64, v_head_dim 128, n_routed_experts 64, n_shared_experts 2,
// moe_intermediate_size 1407, first_k_dense_replace 0, n_group/topk_group None (-> 1), topk_method
// "greedy", norm_topk_prob false, routed_scaling_factor 1.0, rms_norm_eps 1e-6, rope_theta 10000,
// rope_scaling None, max_position_embeddings 2048, bos 1, eos 2, tie_word_embeddings false; and
// from DeepSeek's own configuration_deepseek.py, which transformers lacks: moe_layer_freq 1,
// scoring_func "softmax". The fields that fix the model's size have no sensible default and are
// required: vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, and
// num_experts_per_tok when the model has routed experts (transformers' default is None).
ModelConfig config_from_hf_json(const json& j) {
    if (!j.is_object())
        fail("config.json: expected a JSON object at the top level, found " + type_name(j));
    ModelConfig c;
    std::string arch;
    if (auto it = j.find("architectures"); it != j.end() && !it->is_null()) {
        if (!it->is_array() || it->empty() || !(*it)[0].is_string())
            fail("config.json: field \"architectures\": expected a non-empty list of strings");
        arch = (*it)[0].get<std::string>();
    } else if (auto mt = j.find("model_type"); mt != j.end() && mt->is_string()) {
        if (mt->get<std::string>() != "deepseek_v2")
            fail("config.json: field \"model_type\": expected \"deepseek_v2\", found \"" +
                 mt->get<std::string>() + "\"");
        arch = "DeepseekV2ForCausalLM";
    } else {
        fail("config.json: required field \"architectures\" is missing");
    }
    if (arch != "DeepseekV2ForCausalLM")
        fail("config.json: field \"architectures\": unsupported architecture \"" + arch +
             "\" (expected \"DeepseekV2ForCausalLM\")");
    c.architecture = arch;

    c.vocab_size = hf_required_int(j, "vocab_size");
    c.hidden_size = hf_required_int(j, "hidden_size");
    c.intermediate_size = hf_required_int(j, "intermediate_size");
    c.num_hidden_layers = hf_required_int(j, "num_hidden_layers");
    c.num_attention_heads = hf_required_int(j, "num_attention_heads");
    c.q_lora_rank = hf_opt_int(j, "q_lora_rank", 1536);
    c.kv_lora_rank = hf_int(j, "kv_lora_rank", 512);
    c.qk_nope_head_dim = hf_int(j, "qk_nope_head_dim", 128);
    c.qk_rope_head_dim = hf_int(j, "qk_rope_head_dim", 64);
    c.v_head_dim = hf_int(j, "v_head_dim", 128);
    c.n_routed_experts = hf_opt_int(j, "n_routed_experts", 64).value_or(0);
    c.n_shared_experts = hf_opt_int(j, "n_shared_experts", 2);
    c.moe_intermediate_size = hf_int(j, "moe_intermediate_size", 1407);
    if (c.n_routed_experts > 0)
        c.num_experts_per_tok = hf_required_int(j, "num_experts_per_tok");
    else
        c.num_experts_per_tok = hf_int(j, "num_experts_per_tok", 0);
    c.first_k_dense_replace = hf_int(j, "first_k_dense_replace", 0);
    c.moe_layer_freq = hf_int(j, "moe_layer_freq", 1);
    c.n_group = hf_int(j, "n_group", 1);
    c.topk_group = hf_int(j, "topk_group", 1);
    c.topk_method = hf_string(j, "topk_method", "greedy");
    // DeepSeek's configuration_deepseek.py defaults to the misspelling "gready"; same method.
    if (c.topk_method == "gready") c.topk_method = "greedy";
    c.norm_topk_prob = hf_bool(j, "norm_topk_prob", false);
    c.routed_scaling_factor = hf_double(j, "routed_scaling_factor", 1.0);
    c.scoring_func = hf_string(j, "scoring_func", "softmax");
    c.rms_norm_eps = hf_double(j, "rms_norm_eps", 1e-6);
    c.rope_theta = hf_double(j, "rope_theta", 10000.0);
    parse_rope(j, c);
    c.max_position_embeddings = hf_int(j, "max_position_embeddings", 2048);
    c.bos_token_id = hf_token_id(j, "bos_token_id", 1);
    c.eos_token_id = hf_token_id(j, "eos_token_id", 2);
    c.tie_word_embeddings = hf_bool(j, "tie_word_embeddings", false);
    validate_config(c);
    return c;
}

json config_to_json(const ModelConfig& c) {
    json j = json::object();
    j["architecture"] = c.architecture;
    j["vocab_size"] = c.vocab_size;
    j["hidden_size"] = c.hidden_size;
    j["intermediate_size"] = c.intermediate_size;
    j["moe_intermediate_size"] = c.moe_intermediate_size;
    j["num_hidden_layers"] = c.num_hidden_layers;
    j["num_attention_heads"] = c.num_attention_heads;
    j["q_lora_rank"] = c.q_lora_rank ? json(*c.q_lora_rank) : json(nullptr);
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["qk_nope_head_dim"] = c.qk_nope_head_dim;
    j["qk_rope_head_dim"] = c.qk_rope_head_dim;
    j["v_head_dim"] = c.v_head_dim;
    j["n_routed_experts"] = c.n_routed_experts;
    j["n_shared_experts"] = c.n_shared_experts ? json(*c.n_shared_experts) : json(nullptr);
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["first_k_dense_replace"] = c.first_k_dense_replace;
    j["moe_layer_freq"] = c.moe_layer_freq;
    j["n_group"] = c.n_group;
    j["topk_group"] = c.topk_group;
    j["topk_method"] = c.topk_method;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["routed_scaling_factor"] = c.routed_scaling_factor;
    j["scoring_func"] = c.scoring_func;
    j["rms_norm_eps"] = c.rms_norm_eps;
    j["rope_theta"] = c.rope_theta;
    if (c.rope_scaling) {
        const YarnScaling& y = *c.rope_scaling;
        // Always YaRN (the only scaling supported), so the canonical form carries no "type".
        j["rope_scaling"] = {
            {"factor", y.factor},
            {"original_max_position_embeddings", y.original_max_position_embeddings},
            {"beta_fast", y.beta_fast},
            {"beta_slow", y.beta_slow},
            {"mscale", y.mscale},
            {"mscale_all_dim", y.mscale_all_dim}};
    } else {
        j["rope_scaling"] = nullptr;
    }
    j["max_position_embeddings"] = c.max_position_embeddings;
    j["bos_token_id"] = c.bos_token_id;
    j["eos_token_id"] = c.eos_token_id;
    j["tie_word_embeddings"] = c.tie_word_embeddings;
    return j;
}

ModelConfig config_from_manifest_json(const json& j) {
    if (!j.is_object()) fail("manifest config: expected an object, found " + type_name(j));
    man_no_unknown_keys(j, kManifestKeys, "config");
    ModelConfig c;
    c.architecture = man_string(j, "architecture");
    if (c.architecture != "DeepseekV2ForCausalLM")
        fail(
            "manifest config: field \"architecture\": expected \"DeepseekV2ForCausalLM\", found "
            "\"" +
            c.architecture + "\"");
    c.vocab_size = man_int(j, "vocab_size");
    c.hidden_size = man_int(j, "hidden_size");
    c.intermediate_size = man_int(j, "intermediate_size");
    c.moe_intermediate_size = man_int(j, "moe_intermediate_size");
    c.num_hidden_layers = man_int(j, "num_hidden_layers");
    c.num_attention_heads = man_int(j, "num_attention_heads");
    c.q_lora_rank = man_opt_int(j, "q_lora_rank");
    c.kv_lora_rank = man_int(j, "kv_lora_rank");
    c.qk_nope_head_dim = man_int(j, "qk_nope_head_dim");
    c.qk_rope_head_dim = man_int(j, "qk_rope_head_dim");
    c.v_head_dim = man_int(j, "v_head_dim");
    c.n_routed_experts = man_int(j, "n_routed_experts");
    c.n_shared_experts = man_opt_int(j, "n_shared_experts");
    c.num_experts_per_tok = man_int(j, "num_experts_per_tok");
    c.first_k_dense_replace = man_int(j, "first_k_dense_replace");
    c.moe_layer_freq = man_int(j, "moe_layer_freq");
    c.n_group = man_int(j, "n_group");
    c.topk_group = man_int(j, "topk_group");
    c.topk_method = man_string(j, "topk_method");
    c.norm_topk_prob = man_bool(j, "norm_topk_prob");
    c.routed_scaling_factor = man_double(j, "routed_scaling_factor");
    c.scoring_func = man_string(j, "scoring_func");
    c.rms_norm_eps = man_double(j, "rms_norm_eps");
    c.rope_theta = man_double(j, "rope_theta");
    const json& rs = man_field(j, "rope_scaling");
    if (!rs.is_null()) {
        if (!rs.is_object())
            fail("manifest config: field \"rope_scaling\": expected an object or null, found " +
                 type_name(rs));
        man_no_unknown_keys(rs, kYarnKeys, "config.rope_scaling");
        YarnScaling y;
        y.factor = man_double(rs, "factor");
        y.original_max_position_embeddings = man_int(rs, "original_max_position_embeddings");
        y.beta_fast = man_double(rs, "beta_fast");
        y.beta_slow = man_double(rs, "beta_slow");
        y.mscale = man_double(rs, "mscale");
        y.mscale_all_dim = man_double(rs, "mscale_all_dim");
        c.rope_scaling = y;
    }
    c.max_position_embeddings = man_int(j, "max_position_embeddings");
    c.bos_token_id = man_int(j, "bos_token_id");
    c.eos_token_id = man_int(j, "eos_token_id");
    c.tie_word_embeddings = man_bool(j, "tie_word_embeddings");
    validate_config(c);
    return c;
}

// Caps keep every product of sizes that the loader and converter compute far below 2^63
// (e.g. vocab × hidden × 2 bytes, or experts × 3 × n_ff × n_embd), so an absurd config is
// refused here instead of overflowing an allocation later.
void validate_config(const ModelConfig& c) {
    constexpr int64_t dim_max = int64_t(1) << 20;
    check_range("vocab_size", c.vocab_size, 1, max_vocab_size);
    check_range("hidden_size", c.hidden_size, 1, dim_max);
    check_range("intermediate_size", c.intermediate_size, 1, dim_max);
    check_range("num_hidden_layers", c.num_hidden_layers, 1, 4096);
    check_range("num_attention_heads", c.num_attention_heads, 1, 4096);
    if (c.q_lora_rank) check_range("q_lora_rank", *c.q_lora_rank, 1, dim_max);
    check_range("kv_lora_rank", c.kv_lora_rank, 1, dim_max);
    check_range("qk_nope_head_dim", c.qk_nope_head_dim, 1, 65536);
    check_range("qk_rope_head_dim", c.qk_rope_head_dim, 2, 65536);
    if (c.qk_rope_head_dim % 2 != 0)
        fail(
            "config: field \"qk_rope_head_dim\": expected an even number (RoPE rotates pairs), "
            "found " +
            std::to_string(c.qk_rope_head_dim));
    check_range("v_head_dim", c.v_head_dim, 1, 65536);
    check_range("n_routed_experts", c.n_routed_experts, 0, 65536);
    if (c.n_routed_experts > 0) {
        check_range("moe_intermediate_size", c.moe_intermediate_size, 1, dim_max);
        check_range("num_experts_per_tok", c.num_experts_per_tok, 1, c.n_routed_experts);
        check_range("moe_layer_freq", c.moe_layer_freq, 1, 4096);
        check_range("first_k_dense_replace", c.first_k_dense_replace, 0, c.num_hidden_layers);
        check_range("n_group", c.n_group, 1, c.n_routed_experts);
        if (c.n_routed_experts % c.n_group != 0)
            fail("config: field \"n_group\": expected a divisor of n_routed_experts (" +
                 std::to_string(c.n_routed_experts) + "), found " + std::to_string(c.n_group));
        check_range("topk_group", c.topk_group, 1, c.n_group);
        if (c.n_shared_experts) check_range("n_shared_experts", *c.n_shared_experts, 0, 4096);
    } else {
        check_range("moe_layer_freq", c.moe_layer_freq, 1, 4096);
        check_range("first_k_dense_replace", c.first_k_dense_replace, 0, c.num_hidden_layers);
    }
    if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy")
        fail(
            "config: field \"topk_method\": expected \"greedy\" or \"group_limited_greedy\", found "
            "\"" +
            c.topk_method + "\"");
    if (c.scoring_func != "softmax")
        fail("config: field \"scoring_func\": expected \"softmax\", found \"" + c.scoring_func +
             "\"");
    auto positive = [](const char* field, double v) {
        if (!(std::isfinite(v) && v > 0.0))
            fail(std::string("config: field \"") + field +
                 "\": expected a positive finite number, found " + std::to_string(v));
    };
    positive("rms_norm_eps", c.rms_norm_eps);
    positive("rope_theta", c.rope_theta);
    positive("routed_scaling_factor", c.routed_scaling_factor);
    check_range("max_position_embeddings", c.max_position_embeddings, 1, int64_t(1) << 30);
    check_range("bos_token_id", c.bos_token_id, 0, c.vocab_size - 1);
    check_range("eos_token_id", c.eos_token_id, 0, c.vocab_size - 1);
    if (c.rope_scaling) {
        const YarnScaling& y = *c.rope_scaling;
        positive("rope_scaling.factor", y.factor);
        positive("rope_scaling.beta_fast", y.beta_fast);
        positive("rope_scaling.beta_slow", y.beta_slow);
        check_range("rope_scaling.original_max_position_embeddings",
                    y.original_max_position_embeddings, 1, int64_t(1) << 30);
        if (!std::isfinite(y.mscale) || !std::isfinite(y.mscale_all_dim))
            fail("config: field \"rope_scaling.mscale\": expected finite numbers");
    }
}

}  // namespace minids
