// ModelConfig from a Hugging Face config.json (lenient about the variants in the wild, never
// guessing a shape) and to/from the .mds manifest's canonical "config" object (strict). Both
// readers, the writer and validate_config walk the field table of config.h.
#include "model/config.h"

#include <cmath>
#include <limits>

#include <nlohmann/json.hpp>

#include "util/json_fields.h"

namespace minids {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& what) { throw ConfigError(what); }

// The table's `hf` column: a default, or `required`.
struct Required {};
constexpr Required required;
template <class T>
std::optional<T> hf_default(T value) {
    return value;
}
template <class T>
std::optional<T> hf_default(Required) {
    return std::nullopt;
}

// The table's REAL rules.
enum class Rule { positive, finite };
constexpr Rule positive = Rule::positive;
constexpr Rule finite = Rule::finite;

// ---- Hugging Face config.json: present-or-default readers ----

std::string hf_field(const char* key) { return std::string("config.json: field \"") + key + "\""; }

[[noreturn]] void hf_missing(const char* key) {
    fail(std::string("config.json: required field \"") + key + "\" is missing");
}

// Integer field; `null` and absence both give the default (or fail when it is required). A float
// with an integral value (some exporters write 2048.0) is accepted; anything else is refused.
int64_t hf_int(const json& j, const char* key, std::optional<int64_t> def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
        if (!def) hf_missing(key);
        return *def;
    }
    if (it->is_number_integer()) return it->get<int64_t>();
    if (it->is_number_float()) {
        double d = it->get<double>();
        if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.0e15) return int64_t(d);
    }
    fail(hf_field(key) + ": expected an integer, found " + describe_json(*it));
}

// Absent: the default; null: none.
std::optional<int64_t> hf_opt_int(const json& j, const char* key, std::optional<int64_t> def) {
    auto it = j.find(key);
    if (it == j.end()) return def;
    if (it->is_null()) return std::nullopt;
    return hf_int(j, key, 0);
}

double hf_double(const json& j, const char* key, std::optional<double> def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
        if (!def) hf_missing(key);
        return *def;
    }
    if (!it->is_number()) fail(hf_field(key) + ": expected a number, found " + describe_json(*it));
    return it->get<double>();
}

bool hf_bool(const json& j, const char* key, std::optional<bool> def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
        if (!def) hf_missing(key);
        return *def;
    }
    if (!it->is_boolean())
        fail(hf_field(key) + ": expected true or false, found " + describe_json(*it));
    return it->get<bool>();
}

std::string hf_string(const json& j, const char* key, std::optional<std::string> def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) {
        if (!def) hf_missing(key);
        return *def;
    }
    if (!it->is_string()) fail(hf_field(key) + ": expected a string, found " + describe_json(*it));
    return it->get<std::string>();
}

// eos_token_id is an int in DeepSeek's configs, a list in some re-exports: the first one is the
// model's end-of-sequence token.
int64_t hf_token_id(const json& j, const char* key, int64_t def) {
    auto it = j.find(key);
    if (it != j.end() && it->is_array()) {
        if (it->empty() || !(*it)[0].is_number_integer())
            fail(hf_field(key) + ": expected an integer or a non-empty list of integers");
        return (*it)[0].get<int64_t>();
    }
    return hf_int(j, key, def);
}

// The fields config_from_hf_json reads with code of its own rather than from the table.
bool hf_special(std::string_view name) {
    return name == "architecture" || name == "n_routed_experts" || name == "num_experts_per_tok" ||
           name == "bos_token_id" || name == "eos_token_id";
}

void read_hf_fields(const json& j, ModelConfig& c) {
#define HF_INT(name, initial, hf, lo, hi) \
    if (!hf_special(#name)) c.name = hf_int(j, #name, hf_default<int64_t>(hf));
#define HF_OPT_INT(name, hf, lo, hi) c.name = hf_opt_int(j, #name, hf_default<int64_t>(hf));
#define HF_REAL(name, initial, hf, rule) c.name = hf_double(j, #name, hf_default<double>(hf));
#define HF_FLAG(name, initial, hf) c.name = hf_bool(j, #name, hf_default<bool>(hf));
#define HF_TEXT(name, initial, hf) \
    if (!hf_special(#name)) c.name = hf_string(j, #name, hf_default<std::string>(hf));
    MINIDS_MODEL_CONFIG_FIELDS(HF_INT, HF_OPT_INT, HF_REAL, HF_FLAG, HF_TEXT)
#undef HF_INT
#undef HF_OPT_INT
#undef HF_REAL
#undef HF_FLAG
#undef HF_TEXT
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
        fail(hf_field(where) + ": expected an object or null, found " + describe_json(*rs));
    if (rs->contains("rope_theta")) c.rope_theta = hf_double(*rs, "rope_theta", c.rope_theta);
    std::string type = hf_string(*rs, "type", "");
    if (type.empty()) type = hf_string(*rs, "rope_type", "");
    if (type.empty()) fail(hf_field(where) + ": has neither \"type\" nor \"rope_type\"");
    if (type == "default") return;  // plain RoPE, written explicitly
    if (type != "yarn")
        fail(hf_field(where) + ": rope type \"" + type +
             "\" is not supported (expected \"yarn\" or \"default\")");
    if (!rs->contains("factor"))
        fail(std::string("config.json: field \"") + where + ".factor\" is missing");
    YarnScaling y;
#define HF_YARN_INT(name, initial, hf, lo, hi) y.name = hf_int(*rs, #name, hf_default<int64_t>(hf));
#define HF_YARN_REAL(name, initial, hf, rule) \
    y.name = hf_double(*rs, #name, hf_default<double>(hf));
    MINIDS_YARN_FIELDS(HF_YARN_INT, HF_YARN_REAL)
#undef HF_YARN_INT
#undef HF_YARN_REAL
    c.rope_scaling = y;
}

// ---- bounds ----

void check_range(const std::string& field, int64_t v, int64_t lo, int64_t hi) {
    if (v < lo || v > hi)
        fail("config: field \"" + field + "\": expected " + std::to_string(lo) + ".." +
             std::to_string(hi) + ", found " + std::to_string(v));
}

void check_real(const std::string& field, double v, Rule rule) {
    if (rule == Rule::positive && !(std::isfinite(v) && v > 0.0))
        fail("config: field \"" + field + "\": expected a positive finite number, found " +
             std::to_string(v));
    if (rule == Rule::finite && !std::isfinite(v))
        fail("config: field \"" + field + "\": expected a finite number, found " +
             std::to_string(v));
}

void check_one_of(const char* field, const std::string& v,
                  std::initializer_list<std::string_view> allowed) {
    for (auto a : allowed)
        if (v == a) return;
    std::string names;
    for (auto a : allowed) names += (names.empty() ? "\"" : " or \"") + std::string(a) + "\"";
    fail(std::string("config: field \"") + field + "\": expected " + names + ", found \"" + v +
         "\"");
}

#define NAME_OF(name, ...) #name,

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

ModelConfig config_from_hf_json(const json& j) {
    if (!j.is_object())
        fail("config.json: expected a JSON object at the top level, found " + describe_json(j));
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

    read_hf_fields(j, c);
    // null n_routed_experts means no MoE layers; a model with routed experts must say how many a
    // token uses (transformers' default is None), and one without has no use for the number.
    c.n_routed_experts = hf_opt_int(j, "n_routed_experts", 64).value_or(0);
    c.num_experts_per_tok = c.n_routed_experts > 0 ? hf_int(j, "num_experts_per_tok", {}) : 0;
    // DeepSeek's configuration_deepseek.py defaults to the misspelling "gready"; same method.
    if (c.topk_method == "gready") c.topk_method = "greedy";
    parse_rope(j, c);
    c.bos_token_id = hf_token_id(j, "bos_token_id", 1);
    c.eos_token_id = hf_token_id(j, "eos_token_id", 2);
    validate_config(c);
    return c;
}

json config_to_json(const ModelConfig& c) {
    json j = json::object();
#define OUT_VALUE(name, ...) j[#name] = c.name;
#define OUT_OPTIONAL(name, ...) j[#name] = c.name ? json(*c.name) : json(nullptr);
    MINIDS_MODEL_CONFIG_FIELDS(OUT_VALUE, OUT_OPTIONAL, OUT_VALUE, OUT_VALUE, OUT_VALUE)
    if (c.rope_scaling) {
        // Always YaRN (the only scaling supported), so the canonical form carries no "type".
        const YarnScaling& y = *c.rope_scaling;
        json& rs = j["rope_scaling"] = json::object();
#define OUT_YARN(name, ...) rs[#name] = y.name;
        MINIDS_YARN_FIELDS(OUT_YARN, OUT_YARN)
#undef OUT_YARN
    } else {
        j["rope_scaling"] = nullptr;
    }
#undef OUT_VALUE
#undef OUT_OPTIONAL
    return j;
}

ModelConfig config_from_manifest_json(const json& j) {
    const FieldReader r("manifest config", "", throw_as<ConfigError>, FieldReader::Naming::quoted);
    if (!j.is_object()) r.fail("config", "an object", describe_json(j));
    r.expect_object(j, {MINIDS_MODEL_CONFIG_FIELDS(NAME_OF, NAME_OF, NAME_OF, NAME_OF,
                                                   NAME_OF) "rope_scaling"});
    ModelConfig c;
#define IN_INT(name, ...) c.name = r.i64(j, #name);
#define IN_OPT_INT(name, ...) c.name = r.i64_or_null(j, #name);
#define IN_REAL(name, ...) c.name = r.number(j, #name);
#define IN_FLAG(name, ...) c.name = r.boolean(j, #name);
#define IN_TEXT(name, ...) c.name = r.string(j, #name);
    MINIDS_MODEL_CONFIG_FIELDS(IN_INT, IN_OPT_INT, IN_REAL, IN_FLAG, IN_TEXT)
    const json& rs = r.required(j, "rope_scaling");
    if (!rs.is_null()) {
        const FieldReader yr = r.nested("rope_scaling");
        if (!rs.is_object())
            r.fail(r.field("rope_scaling"), "an object or null", describe_json(rs));
        yr.expect_object(rs, {MINIDS_YARN_FIELDS(NAME_OF, NAME_OF)});
        YarnScaling y;
#define IN_YARN_INT(name, ...) y.name = yr.i64(rs, #name);
#define IN_YARN_REAL(name, ...) y.name = yr.number(rs, #name);
        MINIDS_YARN_FIELDS(IN_YARN_INT, IN_YARN_REAL)
#undef IN_YARN_INT
#undef IN_YARN_REAL
        c.rope_scaling = y;
    }
#undef IN_INT
#undef IN_OPT_INT
#undef IN_REAL
#undef IN_FLAG
#undef IN_TEXT
    validate_config(c);
    return c;
}

void validate_config(const ModelConfig& c) {
    // The table's own bounds, field by field.
#define CHECK_INT(name, initial, hf, lo, hi) check_range(#name, c.name, lo, hi);
#define CHECK_OPT_INT(name, hf, lo, hi) \
    if (c.name) check_range(#name, *c.name, lo, hi);
#define CHECK_REAL(name, initial, hf, rule) check_real(#name, c.name, rule);
#define CHECK_NOTHING(...)
    MINIDS_MODEL_CONFIG_FIELDS(CHECK_INT, CHECK_OPT_INT, CHECK_REAL, CHECK_NOTHING, CHECK_NOTHING)
    if (c.rope_scaling) {
        const YarnScaling& y = *c.rope_scaling;
#define CHECK_YARN_INT(name, initial, hf, lo, hi) \
    check_range("rope_scaling." #name, y.name, lo, hi);
#define CHECK_YARN_REAL(name, initial, hf, rule) check_real("rope_scaling." #name, y.name, rule);
        MINIDS_YARN_FIELDS(CHECK_YARN_INT, CHECK_YARN_REAL)
#undef CHECK_YARN_INT
#undef CHECK_YARN_REAL
    }
#undef CHECK_INT
#undef CHECK_OPT_INT
#undef CHECK_REAL
#undef CHECK_NOTHING

    // Bounds across fields.
    check_one_of("architecture", c.architecture, {"DeepseekV2ForCausalLM"});
    check_one_of("topk_method", c.topk_method, {"greedy", "group_limited_greedy"});
    check_one_of("scoring_func", c.scoring_func, {"softmax"});
    if (c.qk_rope_head_dim % 2 != 0)
        fail(
            "config: field \"qk_rope_head_dim\": expected an even number (RoPE rotates pairs), "
            "found " +
            std::to_string(c.qk_rope_head_dim));
    // Without routed experts a token uses none (num_experts_per_tok 0); with them, 1 to all.
    const bool moe = c.n_routed_experts > 0;
    check_range("num_experts_per_tok", c.num_experts_per_tok, moe ? 1 : 0, c.n_routed_experts);
    check_range("first_k_dense_replace", c.first_k_dense_replace, 0, c.num_hidden_layers);
    if (moe) {
        check_range("moe_intermediate_size", c.moe_intermediate_size, 1, config_dim_max);
        check_range("n_group", c.n_group, 1, c.n_routed_experts);
        if (c.n_routed_experts % c.n_group != 0)
            fail("config: field \"n_group\": expected a divisor of n_routed_experts (" +
                 std::to_string(c.n_routed_experts) + "), found " + std::to_string(c.n_group));
        check_range("topk_group", c.topk_group, 1, c.n_group);
    }
    check_range("bos_token_id", c.bos_token_id, 0, c.vocab_size - 1);
    check_range("eos_token_id", c.eos_token_id, 0, c.vocab_size - 1);
}

}  // namespace minids
