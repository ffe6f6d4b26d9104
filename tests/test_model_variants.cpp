// The engine against the reference fixtures of every DeepSeek-V2 family variant under
// tests/data/variants/ (scripts/make_variant_fixtures.py, issue 13; docs/fidelity.md). Each
// variant's logits come from transformers' DeepseekV2ForCausalLM (patched where it does not follow
// DeepSeek's modeling_deepseek.py, every patch listed in the manifest) or, where transformers
// cannot run the config, from DeepSeek's definition (scripts/deepseek_reference.py, float64).
// Each variant directory is converted to .mds (BF16 experts) here and must reproduce its
// reference: relative max error <= 1e-5 of max|logit| at every stored prompt position, and the
// greedy continuation identical, or diverging only at a step whose reference top-1/top-2 gap is
// below that same 1e-5. A missing, unlisted or malformed variant fails the test; so does a
// missing tests/data/variants (the fixtures are committed).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "model_test_util.h"
#include "variant_fixtures.h"

using namespace minids;
using namespace minids::test;
namespace fs = std::filesystem;

namespace {

constexpr double kLogitTolerance = 1e-5;  // of max|logit| at each position (issue 13)

struct VariantResult {
    double worst = 0.0;
    std::string greedy_note;
};

// Checks one variant; a mismatch is a CHECK naming the variant, a malformed directory an exception
// (so the other variants still run).
VariantResult check_variant(const VariantEntry& v) {
    VariantResult res;
    INFO("variant " << v.name);
    const VariantReference ref = load_variant_reference(v.dir);
    if (ref.source != v.reference_source)
        throw std::runtime_error("reference.json says " + ref.source + ", the manifest " +
                                 v.reference_source);
    TempDir tmp;
    const fs::path mds = tmp.path / "model.mds";
    convert_quiet(v.dir, mds, mgl::dtype::bf16);
    TestModel m = open_test_model(mds);
    const size_t V = size_t(m.model->config().vocab_size);
    std::ostringstream notes;
    size_t identical = 0, steps = 0;
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
        const std::vector<float> picked = rows_at(got, ref.positions[i], V);
        const double err =
            worst_position_error(picked, ref.positions[i].size(), V,
                                 [&](size_t t, size_t v) { return want.values[t * V + v]; });
        res.worst = std::max(res.worst, err);
        CHECK_MESSAGE(err <= kLogitTolerance, "variant " << v.name << ", prompt " << i
                                                         << ": worst max|diff|/max|ref| " << err);

        s.truncate(0);
        const std::vector<int32_t> g = greedy_tokens(s, prompt, int64_t(ref.greedy[i].size()));
        size_t same = 0;
        while (same < g.size() && same < ref.greedy[i].size() && g[same] == ref.greedy[i][same])
            ++same;
        steps += ref.greedy[i].size();
        identical += same;
        if (same == ref.greedy[i].size() && g.size() == same) continue;
        const double gap = same < ref.gaps[i].size() ? ref.gaps[i][same] : 1.0;
        notes << " p" << i << " diverges at step " << same << " (gap " << gap << ")";
        CHECK_MESSAGE(gap < kLogitTolerance,
                      "variant " << v.name << ", prompt " << i
                                 << ": greedy differs from the reference at step " << same
                                 << " where the reference's top-1/top-2 gap is " << gap
                                 << " of max|logit| (not a near-tie)");
    }
    res.greedy_note =
        notes.str().empty()
            ? "identical (" + std::to_string(identical) + "/" + std::to_string(steps) + ")"
            : std::to_string(identical) + "/" + std::to_string(steps) + notes.str();
    return res;
}

}  // namespace

TEST_CASE("model variants: every fixture under tests/data/variants matches its reference") {
    VariantManifest manifest;
    try {
        manifest = load_variant_manifest();
    } catch (const std::exception& e) {
        FAIL("variant fixtures: " << variants_root().string() << ": " << std::string(e.what())
                                  << " (issue 13: scripts/make_variant_fixtures.py makes them)");
    }
    for (const auto& p : manifest.problems) FAIL_CHECK("variant fixtures: " << p);

    std::ostringstream table;
    char line[256];
    std::snprintf(line, sizeof line, "  %-19s %-36s %-12s %s", "variant", "reference", "worst rel",
                  "greedy (tokens equal)");
    table << line;
    size_t ran = 0;
    double worst = 0.0;
    for (const auto& v : manifest.variants) {
        if (!fs::is_directory(v.dir)) continue;  // already reported
        try {
            const VariantResult r = check_variant(v);
            ++ran;
            worst = std::max(worst, r.worst);
            std::snprintf(line, sizeof line, "\n  %-19s %-36s %-12.2e %s", v.name.c_str(),
                          v.reference_label().c_str(), r.worst, r.greedy_note.c_str());
            table << line;
        } catch (const std::exception& e) {
            FAIL_CHECK("variant " << v.name << ": " << std::string(e.what()));
        }
    }
    std::set<std::string> features;
    for (const auto& v : manifest.variants) features.insert(v.features.begin(), v.features.end());
    std::ostringstream report;
    report << "variant fixtures: ran on " << ran << " of " << manifest.variants.size()
           << " variants, worst " << worst << " (tolerance " << kLogitTolerance
           << " of max|logit| per position; transformers = transformers' DeepseekV2ForCausalLM "
              "in float64, DeepSeek def. = scripts/deepseek_reference.py)\n"
           << table.str() << "\n  features covered:";
    for (const auto& f : features) report << " [" << f << "]";
    MESSAGE(report.str());
    CHECK(ran == manifest.variants.size());
}
