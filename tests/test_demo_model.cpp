// The embedded demo model (models/demo.mds) against the transformers reference stored beside it
// (models/demo.reference.json, made by scripts/train_demo.py): the tokenizer gives the reference
// prompt ids, `minids run` on the CPU backend reproduces the 32 greedy tokens of every prompt, and
// the logits at the last prompt position agree with transformers' float64 logits.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "mds/reader.h"
#include "npy_test_util.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace minids;

namespace {

std::filesystem::path demo_dir() { return test::models_dir(); }

nlohmann::json load_reference() {
    std::ifstream f(demo_dir() / "demo.reference.json");
    REQUIRE(f.good());
    return nlohmann::json::parse(f);
}

}  // namespace

TEST_CASE("demo model: tokenizer reproduces the reference prompt ids") {
    auto ref = load_reference();
    auto file = mds::MdsFile::open((demo_dir() / "demo.mds").string());
    Tokenizer tok(file->tokenizer());
    for (const auto& p : ref["prompts"]) {
        std::vector<int> expected = p["ids"].get<std::vector<int32_t>>();
        std::vector<int32_t> ids;
        for (auto id : tok.encode(p["text"].get<std::string>(), /*add_special=*/true))
            ids.push_back(id);
        CHECK_MESSAGE(ids == expected, p["text"].get<std::string>());
    }
}

TEST_CASE("demo model: minids run reproduces transformers' greedy tokens and logits") {
    auto ref = load_reference();
    test::TempDir dir;
    const std::string model = (demo_dir() / "demo.mds").string();
    double worst_logit_err = 0;
    for (const auto& p : ref["prompts"]) {
        const auto ids = p["ids"].get<std::vector<int32_t>>();
        const auto greedy = p["greedy"].get<std::vector<int32_t>>();
        const std::string npy = (dir.path / "logits.npy").string();
        const test::CliResult r =
            test::run_minids({"run", "-m", model, "--ids", test::join_ids(ids, ","), "-n",
                              std::to_string(greedy.size()), "--temp", "0", "--print-ids", "-t",
                              "2", "--dump-logits", npy});
        REQUIRE_MESSAGE(r.status == 0, r.err);
        std::istringstream is(r.out);
        std::vector<int32_t> got;
        for (int32_t id; is >> id;) got.push_back(id);
        CHECK_MESSAGE(got == greedy, p["text"].get<std::string>());

        const auto last = p["last_logits"].get<std::vector<double>>();
        test::NpyF32 dumped;
        REQUIRE(test::read_npy_f32(npy, dumped));
        const std::vector<float>& logits = dumped.values;
        REQUIRE(logits.size() == ids.size() * last.size());
        const float* row = logits.data() + (ids.size() - 1) * last.size();
        double max_ref = 0, max_err = 0;
        for (size_t i = 0; i < last.size(); ++i) {
            max_ref = std::max(max_ref, std::abs(last[i]));
            max_err = std::max(max_err, std::abs(double(row[i]) - last[i]));
        }
        worst_logit_err = std::max(worst_logit_err, max_err / max_ref);
    }
    MESSAGE("demo model: worst last-position |Δlogit| / max|ref| = " << worst_logit_err);
    // transformers' float64 reference still computes RMSNorm, RoPE and the router in float32.
    CHECK(worst_logit_err < 1e-4);
}
