// The embedded demo model (models/demo.mds) against the transformers reference stored beside it
// (models/demo.reference.json, made by scripts/train_demo.py): the tokenizer gives the reference
// prompt ids, `minids run` on the CPU backend reproduces the 32 greedy tokens of every prompt, and
// the logits at the last prompt position agree with transformers' float64 logits.
#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mds/reader.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"

using namespace minids;

namespace {

std::filesystem::path demo_dir() { return test::data_dir().parent_path().parent_path() / "models"; }

nlohmann::json load_reference() {
    std::ifstream f(demo_dir() / "demo.reference.json");
    REQUIRE(f.good());
    return nlohmann::json::parse(f);
}

// Runs a command, returns its exit status and standard output.
int run_capture(const std::string& cmd, std::string& out) {
    out.clear();
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p != nullptr);
    std::array<char, 4096> buf;
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
    return pclose(p);
}

std::string join_ids(const std::vector<int>& ids) {
    std::string s;
    for (size_t i = 0; i < ids.size(); ++i) {
        if (i) s += ',';
        s += std::to_string(ids[i]);
    }
    return s;
}

// Float32 values of a version-1.0 .npy file (shape checked by the caller through the count).
std::vector<float> read_npy_values(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::vector<char> b((std::istreambuf_iterator<char>(f)), {});
    REQUIRE(b.size() >= 10);
    const size_t len = size_t(uint8_t(b[8])) | size_t(uint8_t(b[9])) << 8;
    REQUIRE(b.size() >= 10 + len);
    std::vector<float> v((b.size() - 10 - len) / 4);
    std::memcpy(v.data(), b.data() + 10 + len, v.size() * 4);
    return v;
}

}  // namespace

TEST_CASE("demo model: tokenizer reproduces the reference prompt ids") {
    auto ref = load_reference();
    auto file = mds::MdsFile::open((demo_dir() / "demo.mds").string());
    Tokenizer tok(file->tokenizer());
    for (const auto& p : ref["prompts"]) {
        std::vector<int> expected = p["ids"].get<std::vector<int>>();
        std::vector<int> ids;
        for (auto id : tok.encode(p["text"].get<std::string>(), /*add_special=*/true))
            ids.push_back(int(id));
        CHECK_MESSAGE(ids == expected, p["text"].get<std::string>());
    }
}

TEST_CASE("demo model: minids run reproduces transformers' greedy tokens and logits") {
    auto ref = load_reference();
    test::TempDir dir;
    const std::string model = (demo_dir() / "demo.mds").string();
    double worst_logit_err = 0;
    for (const auto& p : ref["prompts"]) {
        const auto ids = p["ids"].get<std::vector<int>>();
        const auto greedy = p["greedy"].get<std::vector<int>>();
        const std::string npy = (dir.path / "logits.npy").string();
        std::string out;
        const std::string cmd = test::minids_binary().string() + " run -m '" + model + "' --ids " +
                                join_ids(ids) + " -n " + std::to_string(greedy.size()) +
                                " --temp 0 --print-ids -t 2 --dump-logits '" + npy +
                                "' 2>/dev/null";
        REQUIRE(run_capture(cmd, out) == 0);
        std::istringstream is(out);
        std::vector<int> got;
        for (int id; is >> id;) got.push_back(id);
        CHECK_MESSAGE(got == greedy, p["text"].get<std::string>());

        const auto last = p["last_logits"].get<std::vector<double>>();
        const auto logits = read_npy_values(npy);
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
