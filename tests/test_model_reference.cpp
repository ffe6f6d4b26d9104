// The naive double-precision reference forward (model_reference.h) against transformers' logits:
// the oracle the engine's family-variant tests rely on must itself be right.
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>

#include "model_reference.h"
#include "test_util.h"

using namespace minids::test;

TEST_CASE("model reference: naive forward reproduces the tiny-v2-lite fixture logits") {
    const std::string dir = (data_dir() / "tiny-v2-lite").string();
    StTensors w, ref;
    read_safetensors(dir + "/model-00001-of-00002.safetensors", w);
    read_safetensors(dir + "/model-00002-of-00002.safetensors", w);
    read_safetensors(dir + "/reference.safetensors", ref);
    RefConfig cfg = ref_config_from_hf(nlohmann::json::parse(std::ifstream(dir + "/config.json")));
    auto rj = nlohmann::json::parse(std::ifstream(dir + "/reference.json"));
    RefModel model(cfg, w);
    for (size_t i = 0; i < 3; ++i) {
        auto tokens = rj["prompts"][i].get<std::vector<int32_t>>();
        auto logits = model.forward(tokens);
        const StTensor& r = ref.at("logits_" + std::to_string(i));
        REQUIRE(r.shape == std::vector<int64_t>{int64_t(tokens.size()), cfg.vocab_size});
        double max_diff = 0.0, max_ref = 0.0;
        for (size_t t = 0; t < tokens.size(); ++t) {
            for (size_t v = 0; v < size_t(cfg.vocab_size); ++v) {
                double rv = r.values[t * size_t(cfg.vocab_size) + v];
                max_diff = std::max(max_diff, std::fabs(logits[t][v] - rv));
                max_ref = std::max(max_ref, std::fabs(rv));
            }
        }
        INFO("prompt " << i << ": max|diff| " << max_diff << ", max|ref| " << max_ref);
        CHECK(max_diff / max_ref < 1e-6);
    }
}
