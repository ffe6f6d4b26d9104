// `minids run --dump-tensors DIR`: the named intermediates of a run, checked layer by layer
// against the independent double-precision reference forward (tests/model_reference.h), and the
// observed path against the plain one (keeping intermediates alive must not change the result).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "cli_test_util.h"
#include "model_reference.h"
#include "model_test_util.h"
#include "npy_test_util.h"

using namespace minids;
using namespace minids::test;

namespace {

// The .npy at `path`, which must be a float32 array.
NpyF32 read_npy(const std::filesystem::path& path) {
    NpyF32 n;
    REQUIRE_MESSAGE(read_npy_f32(path.string(), n), path.string());
    REQUIRE(n.header.find("'<f4'") != std::string::npos);
    return n;
}

}  // namespace

TEST_CASE("run --dump-tensors: latent KV per layer matches the reference; logits unchanged") {
    const auto model = converted_fixture(mgl::dtype::bf16);
    FixtureReference ref = load_fixture_reference();
    const auto& prompt = ref.prompts[1];
    TempDir dir;
    const auto dump = dir.path / "dump";
    CliResult r = run_minids({"run", "-m", model.string(), "--ids", join_ids(prompt, ","), "-n",
                              "0", "-t", "2", "--dump-tensors", dump.string(), "--dump-logits",
                              (dir.path / "plain.npy").string()});
    REQUIRE_MESSAGE(r.status == 0, r.err);
    CHECK(r.err.find("named intermediates") != std::string::npos);

    // The observed run's logits equal the plain --dump-logits of the same process bit for bit,
    // and a second, unobserved run gives the same logits too.
    const NpyF32 observed = read_npy(dump / "result_output.npy");
    const NpyF32 plain = read_npy(dir.path / "plain.npy");
    CHECK(observed.values == plain.values);
    CliResult r2 = run_minids({"run", "-m", model.string(), "--ids", join_ids(prompt, ","), "-n",
                               "0", "-t", "1", "--dump-logits", (dir.path / "fresh.npy").string()});
    REQUIRE(r2.status == 0);
    CHECK(read_npy(dir.path / "fresh.npy").values == plain.values);

    // kv_cmpr-L [T, r] and k_pe-L [T, rope] against the reference's c and k_pe.
    const std::string hf = (data_dir() / "tiny-v2-lite").string();
    StTensors w;
    read_safetensors(hf + "/model-00001-of-00002.safetensors", w);
    read_safetensors(hf + "/model-00002-of-00002.safetensors", w);
    RefModel reference(
        ref_config_from_hf(nlohmann::json::parse(std::ifstream(hf + "/config.json"))), w);
    std::vector<NpyF32> c_dump, kpe_dump;
    for (int l = 0; l < 4; ++l) {
        c_dump.push_back(read_npy(dump / ("kv_cmpr-" + std::to_string(l) + ".npy")));
        kpe_dump.push_back(read_npy(dump / ("k_pe-" + std::to_string(l) + ".npy")));
        CHECK(c_dump.back().shape == std::vector<int64_t>{int64_t(prompt.size()), 32});
        CHECK(kpe_dump.back().shape == std::vector<int64_t>{int64_t(prompt.size()), 8});
    }
    double worst = 0.0;
    reference.forward(prompt, [&](int64_t layer, int64_t pos, const Vec& c, const Vec& k_pe) {
        auto rel = [&](const NpyF32& got, const Vec& want) {
            double max_diff = 0.0, max_ref = 0.0;
            for (size_t i = 0; i < want.size(); ++i) {
                const double g = got.values[size_t(pos) * want.size() + i];
                max_diff = std::max(max_diff, std::fabs(g - want[i]));
                max_ref = std::max(max_ref, std::fabs(want[i]));
            }
            return max_diff / max_ref;
        };
        worst =
            std::max({worst, rel(c_dump[size_t(layer)], c), rel(kpe_dump[size_t(layer)], k_pe)});
    });
    INFO("worst relative difference of a dumped c / k_pe row: " << worst);
    CHECK(worst < 1e-5);
}

TEST_CASE("run --dump-tensors: an impossible directory is one clear error") {
    TempDir dir;
    std::ofstream(dir.path / "file") << "x";
    CliResult r =
        run_minids({"run", "-m", converted_fixture(mgl::dtype::bf16).string(), "--ids", "0,5,9",
                    "-n", "0", "--dump-tensors", (dir.path / "file" / "sub").string()});
    CHECK(r.status == 2);
    CHECK(r.err.find("--dump-tensors") != std::string::npos);
}
