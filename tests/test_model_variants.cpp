// The engine against the reference fixtures of every DeepSeek-V2 family variant under
// tests/data/variants/ (made with transformers' DeepseekV2ForCausalLM by
// scripts/make_variant_fixtures.py; issue 13). Each variant directory is converted to .mds (BF16
// experts) here and must reproduce its reference: relative max error <= 1e-5 of max|logit| at
// every stored prompt position, and the greedy continuation identical, or diverging only at a step
// whose reference top-1/top-2 gap is below that same 1e-5. A directory that is present but
// malformed fails the test; with no directory the test says it ran on zero variants.
#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "model_test_util.h"

using namespace minids;
using namespace minids::test;
namespace fs = std::filesystem;

namespace {

constexpr double kLogitTolerance = 1e-5;  // of max|logit| at each position (issue 13)

struct VariantReference {
    std::vector<std::vector<int32_t>> prompts, greedy, positions;
    std::vector<std::vector<double>> gaps;  // reference top-1/top-2 gap over max|logit| per step
    std::vector<StTensor> logits;           // logits_i [positions_i, vocab]
    std::string source;                     // "transformers" or "deepseek_definition"
};

VariantReference load_variant_reference(const fs::path& dir) {
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

struct VariantResult {
    std::string name, source, features;
    double worst = 0.0;
    std::string greedy_note;
};

// Checks one variant directory; a mismatch is a CHECK naming the variant, a malformed directory an
// exception (so the other variants still run).
VariantResult check_variant(const fs::path& dir, const std::string& features) {
    VariantResult res;
    res.name = dir.filename().string();
    res.features = features;
    INFO("variant " << res.name);
    for (const char* f :
         {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors.index.json",
          "reference.json", "reference.safetensors"}) {
        if (!fs::exists(dir / f))
            throw std::runtime_error(std::string("malformed: no ") + f + " in " + dir.string());
    }
    const VariantReference ref = load_variant_reference(dir);
    res.source = ref.source;
    TempDir tmp;
    const fs::path mds = tmp.path / "model.mds";
    convert_quiet(dir, mds, mgl::dtype::bf16);
    TestModel m = open_test_model(mds);
    const size_t V = size_t(m.model->config().vocab_size);
    std::ostringstream notes;
    for (size_t i = 0; i < ref.prompts.size(); ++i) {
        const auto& prompt = ref.prompts[i];
        const StTensor& want = ref.logits[i];
        INFO("prompt " << i << " (" << prompt.size() << " tokens)");
        if (want.shape != std::vector<int64_t>{int64_t(ref.positions[i].size()), int64_t(V)})
            throw std::runtime_error("malformed: logits_" + std::to_string(i) +
                                     " is not [len(logit_positions), vocab]");
        SessionParams sp;
        sp.n_ctx = int64_t(prompt.size() + ref.greedy[i].size() + 8);
        sp.page_size = 16;  // the long prompts span many pages
        Session s(*m.model, *m.backend, sp);
        const std::vector<float> got = s.eval(prompt, /*all_logits=*/true);
        if (got.size() != prompt.size() * V)
            throw std::runtime_error("the engine returned " + std::to_string(got.size()) +
                                     " logits for " + std::to_string(prompt.size()) + " positions");
        std::vector<float> picked;
        for (int32_t pos : ref.positions[i])
            picked.insert(picked.end(), got.begin() + std::ptrdiff_t(size_t(pos) * V),
                          got.begin() + std::ptrdiff_t(size_t(pos + 1) * V));
        const double err =
            worst_position_error(picked, ref.positions[i].size(), V,
                                 [&](size_t t, size_t v) { return want.values[t * V + v]; });
        res.worst = std::max(res.worst, err);
        CHECK_MESSAGE(err <= kLogitTolerance, "variant " << res.name << ", prompt " << i
                                                         << ": worst max|diff|/max|ref| " << err);

        s.truncate(0);
        const std::vector<int32_t> g = greedy_tokens(s, prompt, int64_t(ref.greedy[i].size()));
        size_t same = 0;
        while (same < g.size() && g[same] == ref.greedy[i][same]) ++same;
        if (same == g.size()) continue;
        const double gap = ref.gaps[i][same];
        notes << " prompt " << i << " diverges at step " << same << " (reference gap " << gap
              << ");";
        CHECK_MESSAGE(gap < kLogitTolerance,
                      "variant " << res.name << ", prompt " << i
                                 << ": greedy differs from the reference at step " << same
                                 << " where the reference's top-1/top-2 gap is " << gap
                                 << " of max|logit| (not a near-tie)");
    }
    res.greedy_note = notes.str().empty() ? "greedy identical" : notes.str();
    return res;
}

}  // namespace

TEST_CASE("model variants: every fixture under tests/data/variants matches its reference") {
    const fs::path root = data_dir() / "variants";
    if (!fs::exists(root)) {
        MESSAGE("variant fixtures: " << root.string()
                                     << " is absent; ran on 0 variants (issue 13: run "
                                        "scripts/make_variant_fixtures.py and commit its output)");
        return;
    }
    // The manifest lists every variant; each listed variant is a directory and each directory is
    // listed, so a half-copied tree fails instead of shrinking the coverage silently.
    nlohmann::json manifest;
    try {
        manifest = nlohmann::json::parse(std::ifstream(root / "manifest.json"));
        (void)manifest.at("variants").at(0).at("name");
    } catch (const std::exception& e) {
        FAIL("variant fixtures: " << (root / "manifest.json").string()
                                  << " is missing or malformed: " << std::string(e.what()));
    }
    if (manifest.value("provenance", nlohmann::json::object()).value("self_test", false))
        MESSAGE(
            "variant fixtures: WARNING: made with --self-test (DeepSeek-definition reference, "
            "not transformers); not fixtures to commit");
    std::set<std::string> dirs, listed;
    for (const auto& e : fs::directory_iterator(root))
        if (e.is_directory()) dirs.insert(e.path().filename().string());
    std::vector<VariantResult> results;
    std::set<std::string> features;
    for (const auto& v : manifest.at("variants")) {
        const std::string name = v.at("name").get<std::string>();
        listed.insert(name);
        std::string feats;
        for (const auto& f : v.value("features", nlohmann::json::array())) {
            features.insert(f.get<std::string>());
            feats += (feats.empty() ? "" : ", ") + f.get<std::string>();
        }
        if (!dirs.count(name)) {
            FAIL_CHECK("variant fixtures: manifest lists " << name << ", no such directory");
            continue;
        }
        try {
            results.push_back(check_variant(root / name, feats));
        } catch (const std::exception& e) {
            FAIL_CHECK("variant " << name << ": " << std::string(e.what()));
        }
    }
    for (const auto& d : dirs)
        if (!listed.count(d))
            FAIL_CHECK("variant fixtures: directory " << d << " is not in the manifest");

    std::ostringstream report;
    report << "variant fixtures: ran on " << results.size() << " of " << listed.size()
           << " variants (tolerance " << kLogitTolerance << " of max|logit| per position)";
    for (const auto& r : results)
        report << "\n  " << r.name << " [" << r.source << "]: worst " << r.worst << ", "
               << r.greedy_note << " -- " << r.features;
    report << "\n  features covered:";
    for (const auto& f : features) report << " [" << f << "]";
    MESSAGE(report.str());
}
