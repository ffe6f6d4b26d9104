// ModelConfig: Hugging Face config.json variants, defaults, refusals, and the strict manifest form.
#include <cmath>
#include <fstream>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "model/config.h"
#include "test_util.h"

using nlohmann::json;
using namespace minids;

namespace {

json fixture_config() {
    std::ifstream in(test::data_dir() / "tiny-v2-lite" / "config.json");
    return json::parse(in);
}

std::string config_error(const json& j) {
    try {
        config_from_hf_json(j);
    } catch (const ConfigError& e) {
        return e.what();
    }
    return "";
}

}  // namespace

TEST_CASE("config: the tiny-v2-lite fixture parses with every field as written") {
    ModelConfig c = config_from_hf_json(fixture_config());
    CHECK(c.architecture == "DeepseekV2ForCausalLM");
    CHECK(c.vocab_size == 1024);
    CHECK(c.hidden_size == 64);
    CHECK(c.intermediate_size == 160);
    CHECK(c.moe_intermediate_size == 32);
    CHECK(c.num_hidden_layers == 4);
    CHECK(c.num_attention_heads == 4);
    CHECK(!c.q_lora_rank.has_value());
    CHECK(c.kv_lora_rank == 32);
    CHECK(c.qk_nope_head_dim == 16);
    CHECK(c.qk_rope_head_dim == 8);
    CHECK(c.v_head_dim == 16);
    CHECK(c.n_routed_experts == 16);
    CHECK(c.n_shared_experts == 2);
    CHECK(c.num_experts_per_tok == 4);
    CHECK(c.first_k_dense_replace == 1);
    CHECK(c.topk_method == "greedy");
    CHECK(c.max_position_embeddings == 163840);
    REQUIRE(c.rope_scaling.has_value());
    CHECK(c.rope_scaling->factor == 40.0);
    CHECK(c.rope_scaling->original_max_position_embeddings == 4096);
    CHECK(c.rope_scaling->mscale == doctest::Approx(0.707));
    CHECK(c.rope_scaling->mscale_all_dim == doctest::Approx(0.707));
    CHECK(!c.is_moe_layer(0));
    CHECK(c.is_moe_layer(1));
    CHECK(c.kv_cache_width() == 40);
    // scale = (nope+rope)^-0.5 · (0.1·0.707·ln 40 + 1)²
    double m = 0.1 * 0.707 * std::log(40.0) + 1.0;
    CHECK(c.attention_scale() == doctest::Approx(m * m / std::sqrt(24.0)).epsilon(1e-12));
}

TEST_CASE("config: rope scaling variants give the same YaRN parameters") {
    json base = fixture_config();
    ModelConfig want = config_from_hf_json(base);

    json by_rope_type = base;
    by_rope_type["rope_scaling"].erase("type");
    by_rope_type["rope_scaling"]["rope_type"] = "yarn";
    ModelConfig a = config_from_hf_json(by_rope_type);

    // transformers >= 5: rope_parameters, with rope_theta inside.
    json by_params = base;
    json rp = base["rope_scaling"];
    rp.erase("type");
    rp["rope_type"] = "yarn";
    rp["rope_theta"] = 50000.0;
    by_params.erase("rope_scaling");
    by_params.erase("rope_theta");
    by_params["rope_parameters"] = rp;
    ModelConfig b = config_from_hf_json(by_params);

    for (const ModelConfig* c : {&a, &b}) {
        REQUIRE(c->rope_scaling.has_value());
        CHECK(c->rope_scaling->factor == want.rope_scaling->factor);
        CHECK(c->rope_scaling->beta_fast == want.rope_scaling->beta_fast);
        CHECK(c->rope_scaling->mscale_all_dim == want.rope_scaling->mscale_all_dim);
    }
    CHECK(a.rope_theta == 10000.0);
    CHECK(b.rope_theta == 50000.0);

    json null_scaling = base;
    null_scaling["rope_scaling"] = nullptr;
    ModelConfig n = config_from_hf_json(null_scaling);
    CHECK(!n.rope_scaling.has_value());
    CHECK(n.attention_scale() == doctest::Approx(1.0 / std::sqrt(24.0)));

    json dflt = base;
    dflt["rope_scaling"] = {{"rope_type", "default"}};
    CHECK(!config_from_hf_json(dflt).rope_scaling.has_value());

    json linear = base;
    linear["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
    CHECK(config_error(linear).find("\"linear\" is not supported") != std::string::npos);

    json no_type = base;
    no_type["rope_scaling"].erase("type");
    CHECK(config_error(no_type).find("neither \"type\" nor \"rope_type\"") != std::string::npos);
}

TEST_CASE("config: q_lora_rank, moe_layer_freq and missing optional fields") {
    json base = fixture_config();
    json q = base;
    q["q_lora_rank"] = 48;
    CHECK(config_from_hf_json(q).q_lora_rank == 48);
    json q_absent = base;
    q_absent.erase("q_lora_rank");
    CHECK(config_from_hf_json(q_absent).q_lora_rank == 1536);  // transformers' default

    json freq = base;
    freq["moe_layer_freq"] = 2;
    ModelConfig f = config_from_hf_json(freq);
    CHECK(!f.is_moe_layer(0));
    CHECK(!f.is_moe_layer(1));
    CHECK(f.is_moe_layer(2));
    CHECK(!f.is_moe_layer(3));

    // A minimal config: only the required fields (and routing's k). Everything else takes
    // transformers' DeepseekV2Config defaults.
    json minimal = {{"architectures", {"DeepseekV2ForCausalLM"}},
                    {"vocab_size", 1000},
                    {"hidden_size", 256},
                    {"intermediate_size", 512},
                    {"num_hidden_layers", 3},
                    {"num_attention_heads", 4},
                    {"num_experts_per_tok", 6}};
    ModelConfig m = config_from_hf_json(minimal);
    CHECK(m.q_lora_rank == 1536);
    CHECK(m.kv_lora_rank == 512);
    CHECK(m.qk_nope_head_dim == 128);
    CHECK(m.qk_rope_head_dim == 64);
    CHECK(m.v_head_dim == 128);
    CHECK(m.n_routed_experts == 64);
    CHECK(m.n_shared_experts == 2);
    CHECK(m.moe_intermediate_size == 1407);
    CHECK(m.first_k_dense_replace == 0);
    CHECK(m.moe_layer_freq == 1);
    CHECK(m.n_group == 1);
    CHECK(m.topk_group == 1);
    CHECK(m.topk_method == "greedy");
    CHECK(!m.norm_topk_prob);
    CHECK(m.routed_scaling_factor == 1.0);
    CHECK(m.scoring_func == "softmax");
    CHECK(m.rms_norm_eps == 1e-6);
    CHECK(m.rope_theta == 10000.0);
    CHECK(!m.rope_scaling.has_value());
    CHECK(m.max_position_embeddings == 2048);
    CHECK(m.bos_token_id == 1);
    CHECK(m.eos_token_id == 2);
    CHECK(!m.tie_word_embeddings);

    // null n_routed_experts: a dense model, no k needed.
    json dense = minimal;
    dense.erase("num_experts_per_tok");
    dense["n_routed_experts"] = nullptr;
    dense["n_shared_experts"] = nullptr;
    ModelConfig d = config_from_hf_json(dense);
    CHECK(d.n_routed_experts == 0);
    CHECK(!d.n_shared_experts.has_value());
    CHECK(!d.is_moe_layer(2));

    json model_type_only = minimal;
    model_type_only.erase("architectures");
    model_type_only["model_type"] = "deepseek_v2";
    CHECK(config_from_hf_json(model_type_only).architecture == "DeepseekV2ForCausalLM");

    json eos_list = minimal;
    eos_list["eos_token_id"] = {7, 9};
    CHECK(config_from_hf_json(eos_list).eos_token_id == 7);
}

TEST_CASE("config: refusals name the field") {
    json base = fixture_config();
    json arch = base;
    arch["architectures"] = {"LlamaForCausalLM"};
    CHECK(config_error(arch).find("unsupported architecture \"LlamaForCausalLM\"") !=
          std::string::npos);
    json no_arch = base;
    no_arch.erase("architectures");
    no_arch.erase("model_type");
    CHECK(config_error(no_arch).find("\"architectures\" is missing") != std::string::npos);
    for (const char* field : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                              "num_attention_heads", "num_experts_per_tok"}) {
        CAPTURE(field);
        json j = base;
        j.erase(field);
        CHECK(config_error(j).find(std::string("\"") + field + "\" is missing") !=
              std::string::npos);
    }
    json wrong_type = base;
    wrong_type["hidden_size"] = "64";
    CHECK(config_error(wrong_type).find("\"hidden_size\": expected an integer, found string") !=
          std::string::npos);
    json fractional = base;
    fractional["hidden_size"] = 64.5;
    CHECK(config_error(fractional).find("\"hidden_size\"") != std::string::npos);
    json integral_float = base;
    integral_float["hidden_size"] = 64.0;
    CHECK(config_from_hf_json(integral_float).hidden_size == 64);
    json k_too_big = base;
    k_too_big["num_experts_per_tok"] = 17;
    CHECK(config_error(k_too_big).find("\"num_experts_per_tok\": expected 1..16, found 17") !=
          std::string::npos);
    json bad_group = base;
    bad_group["n_group"] = 3;
    CHECK(config_error(bad_group).find("\"n_group\": expected a divisor") != std::string::npos);
    json odd_rope = base;
    odd_rope["qk_rope_head_dim"] = 7;
    CHECK(config_error(odd_rope).find("\"qk_rope_head_dim\"") != std::string::npos);
    json v3 = base;
    v3["topk_method"] = "noaux_tc";
    CHECK(config_error(v3).find("\"topk_method\"") != std::string::npos);
    json sigmoid = base;
    sigmoid["scoring_func"] = "sigmoid";
    CHECK(config_error(sigmoid).find("\"scoring_func\"") != std::string::npos);
    json huge = base;
    huge["hidden_size"] = int64_t(1) << 40;
    CHECK(config_error(huge).find("\"hidden_size\": expected 1..") != std::string::npos);
    CHECK(config_error(json::array()).find("top level") != std::string::npos);
}

TEST_CASE("config: manifest form round-trips and is strict") {
    json base = fixture_config();
    base["q_lora_rank"] = 48;
    base["topk_method"] = "group_limited_greedy";
    base["n_group"] = 4;
    base["topk_group"] = 2;
    base["routed_scaling_factor"] = 16.0;
    ModelConfig c = config_from_hf_json(base);
    json m = config_to_json(c);
    ModelConfig back = config_from_manifest_json(m);
    CHECK(config_to_json(back) == m);
    CHECK(back.q_lora_rank == 48);
    CHECK(back.rope_scaling->mscale == c.rope_scaling->mscale);
    CHECK(back.routed_scaling_factor == 16.0);
    // Through text too (doubles must survive dump/parse exactly).
    CHECK(config_to_json(config_from_manifest_json(json::parse(m.dump()))) == m);

    auto manifest_error = [](const json& j) -> std::string {
        try {
            config_from_manifest_json(j);
        } catch (const ConfigError& e) {
            return e.what();
        }
        return "";
    };
    json missing = m;
    missing.erase("kv_lora_rank");
    CHECK(manifest_error(missing).find("\"kv_lora_rank\" is missing") != std::string::npos);
    json unknown = m;
    unknown["extra"] = 1;
    CHECK(manifest_error(unknown).find("unknown field \"extra\"") != std::string::npos);
    json wrong = m;
    wrong["norm_topk_prob"] = 0;
    CHECK(manifest_error(wrong).find("\"norm_topk_prob\": expected true or false") !=
          std::string::npos);
    json float_int = m;
    float_int["hidden_size"] = 64.0;  // the manifest is canonical: integers are integers
    CHECK(manifest_error(float_int).find("\"hidden_size\": expected an integer") !=
          std::string::npos);
    json yarn_unknown = m;
    yarn_unknown["rope_scaling"]["extra"] = 1;
    CHECK(manifest_error(yarn_unknown).find("unknown field \"extra\"") != std::string::npos);
    json absurd = m;
    absurd["num_hidden_layers"] = 100000;
    CHECK(manifest_error(absurd).find("\"num_hidden_layers\"") != std::string::npos);
}

TEST_CASE("config: one field table drives the struct, both readers, the writer and the bounds") {
    const ModelConfig c = config_from_hf_json(fixture_config());
    const json m = config_to_json(c);
    // Every field the writer writes is one the strict reader requires: dropping any is refused by
    // name, and an extra one is refused too.
    for (auto it = m.begin(); it != m.end(); ++it) {
        CAPTURE(it.key());
        json missing = m;
        missing.erase(it.key());
        try {
            config_from_manifest_json(missing);
            FAIL("a manifest config without \"" << it.key() << "\" was accepted");
        } catch (const ConfigError& e) {
            CHECK(std::string(e.what()).find("\"" + it.key() + "\" is missing") !=
                  std::string::npos);
        }
    }
    CHECK(m.size() == 30);  // 29 fields + rope_scaling
    CHECK(m["rope_scaling"].size() == 6);
}

TEST_CASE("config: bounds that hold with or without routed experts (from the loader's check)") {
    auto manifest_error = [](const json& j) -> std::string {
        try {
            config_from_manifest_json(j);
        } catch (const ConfigError& e) {
            return e.what();
        }
        return "";
    };
    json dense = fixture_config();
    dense["n_routed_experts"] = nullptr;
    const ModelConfig c = config_from_hf_json(dense);
    // A dense config.json's num_experts_per_tok means nothing: read as 0, not refused.
    CHECK(c.n_routed_experts == 0);
    CHECK(c.num_experts_per_tok == 0);
    const json m = config_to_json(c);
    CHECK(manifest_error(m).empty());
    // What validate_config once checked only when the model had experts, and the reader's own
    // check_config_bounds checked always, validate_config now checks always.
    json k = m;
    k["num_experts_per_tok"] = 3;
    CHECK(manifest_error(k).find("\"num_experts_per_tok\": expected 0..0, found 3") !=
          std::string::npos);
    json ffn = m;
    ffn["moe_intermediate_size"] = int64_t{1} << 40;
    CHECK(manifest_error(ffn).find("\"moe_intermediate_size\": expected 0..") != std::string::npos);
    json shared = m;
    shared["n_shared_experts"] = 100000;
    CHECK(manifest_error(shared).find("\"n_shared_experts\": expected 0..4096") !=
          std::string::npos);
    // The converter reads config.json through the same checks.
    json hf = dense;
    hf["moe_intermediate_size"] = int64_t{1} << 40;
    CHECK(config_error(hf).find("\"moe_intermediate_size\"") != std::string::npos);
    hf = dense;
    hf["n_shared_experts"] = 100000;
    CHECK(config_error(hf).find("\"n_shared_experts\"") != std::string::npos);
}
