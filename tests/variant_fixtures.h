// The DeepSeek-V2 family variant fixtures under tests/data/variants (issue 13; made by
// scripts/make_variant_fixtures.py, see docs/fidelity.md): the manifest, each variant's reference
// logits and greedy tokens, and its weights by checkpoint name. Used by the engine's golden test
// (test_model_variants.cpp) and by the naive reference's own check (test_model_reference.cpp).
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "safetensors_io.h"
#include "test_util.h"

namespace minids::test {

// Every variant the committed fixtures must hold. A manifest without one of these fails the tests
// rather than shrinking the coverage silently.
inline const std::vector<std::string>& expected_variants() {
    static const std::vector<std::string> names = {"q_lora",
                                                   "group_limited",
                                                   "routed_scaling",
                                                   "v_head_dim",
                                                   "first_k_dense_2",
                                                   "moe_layer_freq_2",
                                                   "rms_norm_eps",
                                                   "mscale",
                                                   "rope_type_and_type",
                                                   "no_shared",
                                                   "tied",
                                                   "norm_topk",
                                                   "plain_rope",
                                                   "v2_like",
                                                   "kitchen_sink",
                                                   "deep_dense"};
    return names;
}

struct VariantEntry {
    std::string name;
    std::string reference_source;  // "transformers" or "deepseek_definition"
    std::string status;            // "ok", or "transformers_failed" (then DeepSeek's definition)
    std::vector<std::string> features, patches;
    std::filesystem::path dir;
    // The (patched) transformers logits' worst relative distance from DeepSeek's definition in
    // float64, as the generator measured it; 0 for a DeepSeek-definition reference.
    double transformers_vs_deepseek = 0.0;

    // Which reference the variant's logits come from, for reports: transformers (with the number
    // of patches that made it follow DeepSeek's modeling_deepseek.py) or DeepSeek's definition
    // (scripts/deepseek_reference.py, float64) where transformers could not run the config.
    std::string reference_label() const {
        if (reference_source == "transformers")
            return patches.empty() ? "transformers"
                                   : "transformers+" + std::to_string(patches.size()) + " patches";
        if (reference_source == "deepseek_definition")
            return status == "transformers_failed" ? "DeepSeek def. (transformers failed)"
                                                   : "DeepSeek def.";
        return reference_source;
    }
};

struct VariantManifest {
    nlohmann::json raw;
    std::vector<VariantEntry> variants;
    std::vector<std::string> problems;  // each a reason the fixture tree is incomplete
};

inline std::filesystem::path variants_root() { return data_dir() / "variants"; }

// Reads tests/data/variants/manifest.json and checks the tree against it: every listed variant
// has a directory, every directory is listed, every expected variant is listed and every issue-13
// feature the manifest names is covered. Throws when the manifest itself is unreadable.
inline VariantManifest load_variant_manifest(const std::filesystem::path& root = variants_root()) {
    namespace fs = std::filesystem;
    VariantManifest m;
    if (!fs::exists(root / "manifest.json"))
        throw std::runtime_error("no " + (root / "manifest.json").string());
    m.raw = nlohmann::json::parse(std::ifstream(root / "manifest.json"));
    std::set<std::string> dirs, listed, covered;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory()) dirs.insert(e.path().filename().string());
    for (const auto& v : m.raw.at("variants")) {
        VariantEntry e;
        e.name = v.at("name").get<std::string>();
        e.reference_source = v.at("reference_source").get<std::string>();
        e.status = v.value("status", std::string());
        e.features = v.value("features", std::vector<std::string>());
        e.patches = v.value("patches", std::vector<std::string>());
        e.dir = root / e.name;
        if (auto it = v.find("transformers_vs_deepseek");
            it != v.end() && e.reference_source == "transformers")
            for (double r : it->at("worst_rel").get<std::vector<double>>())
                e.transformers_vs_deepseek = std::max(e.transformers_vs_deepseek, r);
        covered.insert(e.features.begin(), e.features.end());
        if (!listed.insert(e.name).second)
            m.problems.push_back("manifest lists " + e.name + " twice");
        if (!dirs.count(e.name))
            m.problems.push_back("manifest lists " + e.name + ", no such directory");
        if (e.reference_source != "transformers" && e.reference_source != "deepseek_definition")
            m.problems.push_back(e.name + ": unknown reference_source \"" + e.reference_source +
                                 "\"");
        m.variants.push_back(std::move(e));
    }
    for (const auto& d : dirs)
        if (!listed.count(d)) m.problems.push_back("directory " + d + " is not in the manifest");
    for (const auto& n : expected_variants())
        if (!listed.count(n))
            m.problems.push_back("variant " + n + " is missing from the manifest");
    for (const auto& f : m.raw.value("issue13_features", std::vector<std::string>()))
        if (!covered.count(f)) m.problems.push_back("no variant covers \"" + f + "\"");
    if (m.raw.value("provenance", nlohmann::json::object()).value("self_test", false))
        m.problems.push_back(
            "made with --self-test (DeepSeek-definition references only, not transformers)");
    return m;
}

struct VariantReference {
    std::vector<std::vector<int32_t>> prompts, greedy, positions;
    std::vector<std::vector<double>> gaps;  // reference top-1/top-2 gap over max|logit| per step
    std::vector<StTensor> logits;           // logits_i [positions_i, vocab]
    std::string source;                     // "transformers" or "deepseek_definition"
};

// The rows of `all` ([positions, vocab] logits of a whole prompt) at the positions a reference
// stores, in its order.
inline std::vector<float> rows_at(const std::vector<float>& all,
                                  const std::vector<int32_t>& positions, size_t vocab) {
    std::vector<float> rows;
    rows.reserve(positions.size() * vocab);
    for (int32_t pos : positions)
        rows.insert(rows.end(), all.begin() + std::ptrdiff_t(size_t(pos) * vocab),
                    all.begin() + std::ptrdiff_t(size_t(pos + 1) * vocab));
    return rows;
}

inline VariantReference load_variant_reference(const std::filesystem::path& dir) {
    for (const char* f :
         {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
          "reference.json", "reference.safetensors"}) {
        if (!std::filesystem::exists(dir / f))
            throw std::runtime_error(std::string("malformed: no ") + f + " in " + dir.string());
    }
    VariantReference r;
    const auto j = nlohmann::json::parse(std::ifstream(dir / "reference.json"));
    r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    r.gaps = j.at("greedy_gap_rel").get<std::vector<std::vector<double>>>();
    r.source = j.at("reference_source").get<std::string>();
    if (j.contains("logit_positions")) {
        r.positions = j.at("logit_positions").get<std::vector<std::vector<int32_t>>>();
    } else {
        for (const auto& p : r.prompts) {
            r.positions.emplace_back(p.size());
            for (size_t t = 0; t < p.size(); ++t) r.positions.back()[t] = int32_t(t);
        }
    }
    const size_t n = r.prompts.size();
    if (n == 0 || r.greedy.size() != n || r.gaps.size() != n || r.positions.size() != n)
        throw std::runtime_error(
            "reference.json: prompts, greedy, greedy_gap_rel and "
            "logit_positions must be non-empty lists of the same length");
    StTensors t;
    read_safetensors((dir / "reference.safetensors").string(), t);
    for (size_t i = 0; i < n; ++i) {
        if (r.gaps[i].size() != r.greedy[i].size())
            throw std::runtime_error("reference.json: greedy_gap_rel " + std::to_string(i) +
                                     " does not match greedy");
        for (int32_t pos : r.positions[i])
            if (pos < 0 || size_t(pos) >= r.prompts[i].size())
                throw std::runtime_error("reference.json: logit position outside prompt " +
                                         std::to_string(i));
        auto it = t.find("logits_" + std::to_string(i));
        if (it == t.end())
            throw std::runtime_error("reference.safetensors: no logits_" + std::to_string(i));
        r.logits.push_back(it->second);
    }
    return r;
}

// Every tensor of the variant's checkpoint, from the shards model.safetensors.index.json names.
inline StTensors load_variant_weights(const std::filesystem::path& dir) {
    const auto index = nlohmann::json::parse(std::ifstream(dir / "model.safetensors.index.json"));
    std::set<std::string> shards;
    for (const auto& [name, shard] : index.at("weight_map").items())
        shards.insert(shard.get<std::string>());
    StTensors w;
    for (const auto& s : shards) read_safetensors((dir / s).string(), w);
    for (const auto& [name, shard] : index.at("weight_map").items())
        if (!w.count(name)) throw std::runtime_error("index names " + name + ", no shard holds it");
    return w;
}

}  // namespace minids::test
