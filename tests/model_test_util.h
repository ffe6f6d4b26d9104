// Helpers for the model tests: converting checkpoints to .mds once per test run, opening them
// on the CPU backend, reading the fixture's reference, and comparing logits.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "convert/convert.h"
#include "mds/reader.h"
#include "mgl.h"
#include "model/deepseek2.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "runtime/session.h"
#include "safetensors_io.h"
#include "test_util.h"

namespace minids::test {

// Converts `hf_dir` with the given expert dtype into `out` (library API, quiet).
inline void convert_quiet(const std::filesystem::path& hf_dir, const std::filesystem::path& out,
                          mgl::dtype experts) {
    convert::ConvertOptions o;
    o.hf_dir = hf_dir;
    o.out = out;
    o.expert_dtype = experts;
    o.threads = 2;
    o.force = true;
    o.progress = false;
    convert::convert_checkpoint(o);
}

// tiny-v2-lite converted once per test binary run (BF16 or FP8 experts); the files live in a
// temporary directory removed at exit.
inline std::filesystem::path converted_fixture(mgl::dtype experts) {
    static TempDir dir;  // test-run cache: converting is the slow part of the model tests
    const auto out = dir.path / (std::string("tiny-v2-lite-") + mgl::dtype_name(experts) + ".mds");
    if (!std::filesystem::exists(out)) convert_quiet(data_dir() / "tiny-v2-lite", out, experts);
    return out;
}

struct TestModel {
    std::unique_ptr<mds::MdsFile> file;
    std::unique_ptr<mgl::backend> backend;  // before the model, which places weights for it
    std::unique_ptr<Deepseek2Model> model;
};

inline TestModel open_test_model(const std::filesystem::path& path, int threads = 2) {
    TestModel m;
    m.file = mds::MdsFile::open(path.string());
    m.backend = mgl::make_cpu_backend(threads);
    m.model = std::make_unique<Deepseek2Model>(*m.file, *m.backend);
    return m;
}

struct FixtureReference {
    std::vector<std::vector<int32_t>> prompts;
    std::vector<std::vector<int32_t>> greedy;
    std::vector<StTensor> logits;  // logits_i [len(prompt_i), vocab]
};

inline FixtureReference load_fixture_reference() {
    const auto dir = data_dir() / "tiny-v2-lite";
    FixtureReference r;
    auto j = nlohmann::json::parse(std::ifstream(dir / "reference.json"));
    r.prompts = j.at("prompts").get<std::vector<std::vector<int32_t>>>();
    r.greedy = j.at("greedy").get<std::vector<std::vector<int32_t>>>();
    StTensors t;
    read_safetensors((dir / "reference.safetensors").string(), t);
    for (size_t i = 0; i < r.prompts.size(); ++i)
        r.logits.push_back(t.at("logits_" + std::to_string(i)));
    return r;
}

// The worst, over positions, of max|got - ref| / max|ref| within one position's row.
template <typename RefRow>
double worst_position_error(std::span<const float> got, size_t n_pos, size_t vocab, RefRow ref_at) {
    double worst = 0.0;
    for (size_t t = 0; t < n_pos; ++t) {
        double max_diff = 0.0, max_ref = 0.0;
        for (size_t v = 0; v < vocab; ++v) {
            double r = ref_at(t, v);
            max_diff = std::max(max_diff, std::fabs(double(got[t * vocab + v]) - r));
            max_ref = std::max(max_ref, std::fabs(r));
        }
        worst = std::max(worst, max_diff / max_ref);
    }
    return worst;
}

// Plain argmax continuation of `prompt` for n tokens (EOS not special, as in the references).
inline std::vector<int32_t> greedy_tokens(Session& s, std::span<const int32_t> prompt, int64_t n) {
    SamplerParams sp;
    sp.temp = 0.0f;
    Sampler sampler(sp, s.n_ctx());
    GenerateParams gp;
    gp.n_predict = n;
    std::vector<int32_t> out;
    generate(s, sampler, prompt, gp, [&](int32_t id) {
        out.push_back(id);
        return true;
    });
    return out;
}

}  // namespace minids::test
