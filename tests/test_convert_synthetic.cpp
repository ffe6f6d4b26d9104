// Synthetic presets: exact shapes, sensible value scales, bytes independent of the thread count,
// and the full-size presets checked by their planned layout only (v2 would be ~249 GB).
#include <cmath>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "convert/safetensors.h"
#include "convert/synthetic.h"
#include "convert/tensor_plan.h"
#include "mds/reader.h"
#include "test_convert_util.h"
#include "test_util.h"

using nlohmann::json;
using namespace minids;
namespace fs = std::filesystem;

namespace {

convert::ConvertStats synth(const std::string& preset, const fs::path& out, int threads,
                            uint64_t seed = 7, mgl::dtype expert_dtype = mgl::dtype::f8_e4m3,
                            bool dry_run = false) {
    convert::SyntheticOptions o;
    o.preset = preset;
    o.seed = seed;
    o.out = out;
    o.expert_dtype = expert_dtype;
    o.threads = threads;
    o.progress = false;
    o.dry_run = dry_run;
    return convert::write_synthetic(o);
}

float bf16_at(const uint8_t* p) {
    uint32_t bits = uint32_t(p[0] | (p[1] << 8)) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

}  // namespace

TEST_CASE(
    "synthetic: tiny is deterministic across thread counts, differs across seeds, and loads") {
    test::TempDir tmp;
    synth("tiny", tmp.path / "a.mds", 1);
    synth("tiny", tmp.path / "b.mds", 3);
    synth("tiny", tmp.path / "c.mds", 2, /*seed=*/8);
    auto a = test::read_bytes(tmp.path / "a.mds");
    CHECK(a == test::read_bytes(tmp.path / "b.mds"));
    auto c = test::read_bytes(tmp.path / "c.mds");
    REQUIRE(a.size() == c.size());
    CHECK(a != c);

    auto f = mds::MdsFile::open((tmp.path / "a.mds").string());
    CHECK(f->verify(2).ok);
    const ModelConfig& cfg = f->config();
    CHECK(cfg.q_lora_rank == 48);
    CHECK(cfg.topk_method == "group_limited_greedy");
    CHECK(f->provenance()["synthetic"] == true);
    CHECK(f->provenance()["preset"] == "tiny");
    CHECK(f->provenance()["seed"] == 7);
    REQUIRE(f->tokenizer().bos_id.has_value());
    CHECK(cfg.bos_token_id == *f->tokenizer().bos_id);
    CHECK(f->tokenizer().vocab.size() == size_t(cfg.vocab_size));

    // Every expected dense tensor is present with its shape.
    for (const auto& t : convert::expected_tensors(cfg)) {
        if (t.role == convert::TensorRole::expert) continue;
        const mds::TensorEntry* e = f->find(t.name);
        REQUIRE_MESSAGE(e != nullptr, t.name);
        CHECK(e->shape == t.shape);
        CHECK(e->dtype == mgl::dtype::bf16);
        if (t.role == convert::TensorRole::norm) {
            for (int64_t i = 0; i < t.shape[0]; ++i) CHECK(bf16_at(e->data + 2 * i) == 1.0f);
        } else {
            // Linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1): sample standard deviation within 10%.
            int64_t n = t.shape[0] * t.shape[1];
            double sum = 0, sum2 = 0;
            for (int64_t i = 0; i < n; ++i) {
                double v = bf16_at(e->data + 2 * i);
                sum += v;
                sum2 += v * v;
            }
            double mean = sum / double(n), sd = std::sqrt(sum2 / double(n) - mean * mean);
            double want = t.role == convert::TensorRole::embedding
                              ? 1.0
                              : 1.0 / std::sqrt(double(t.shape[1]));
            CAPTURE(t.name);
            CHECK(sd == doctest::Approx(want).epsilon(0.1));
            CHECK(std::fabs(mean) < 0.1 * want);
        }
    }

    // FP8 experts: no NaN codes; row scales positive and near σ·z_max/448 · U(0.75, 1.25);
    // dequantized values have standard deviation ≈ 1/sqrt(fan_in).
    const mds::ExpertTable& ex = f->experts();
    CHECK(ex.dtype == mgl::dtype::f8_e4m3);
    CHECK(ex.blobs.size() == 3 * 16);
    for (const auto& b : ex.blobs) {
        const uint8_t* codes = b.data + ex.gate.offset;
        float scales[32];
        std::memcpy(scales, b.data + ex.gate_scale.offset, sizeof(scales));
        double sum2 = 0;
        for (int r = 0; r < 32; ++r) {
            CHECK(scales[r] > 0.0f);
            for (int k = 0; k < 64; ++k) {
                uint8_t v = codes[r * 64 + k];
                CHECK((v & 0x7F) != 0x7F);
                double d = double(mgl::e4m3_to_f32(v)) * scales[r];
                sum2 += d * d;
            }
        }
        CHECK(std::sqrt(sum2 / (32 * 64)) == doctest::Approx(1.0 / 8.0).epsilon(0.2));
    }
}

TEST_CASE("synthetic: BF16 experts") {
    test::TempDir tmp;
    synth("tiny", tmp.path / "a.mds", 2, 1, mgl::dtype::bf16);
    auto f = mds::MdsFile::open((tmp.path / "a.mds").string());
    CHECK(f->verify(2).ok);
    CHECK(f->experts().dtype == mgl::dtype::bf16);
    CHECK(f->experts().blob_nbytes == 3 * 32 * 64 * 2);
}

TEST_CASE("synthetic: v2-lite and v2 have the real models' shapes (planned layout only)") {
    test::TempDir tmp;
    SUBCASE("v2-lite") {
        ModelConfig c = convert::synthetic_config("v2-lite");
        CHECK(c.hidden_size == 2048);
        CHECK(c.num_hidden_layers == 27);
        CHECK(c.n_routed_experts == 64);
        CHECK(c.num_experts_per_tok == 6);
        CHECK(!c.q_lora_rank.has_value());
        CHECK(c.kv_cache_width() == 576);
        convert::ConvertStats st =
            synth("v2-lite", tmp.path / "x.mds", 2, 0, mgl::dtype::f8_e4m3, /*dry_run=*/true);
        CHECK(!fs::exists(tmp.path / "x.mds"));
        CHECK(!fs::exists(tmp.path / "x.mds.tmp"));
        CHECK(st.n_blobs == 26 * 64);
        // One FP8 expert: 3 × 1408 × 2048 codes + (1408 + 1408 + 2048) × 4 scale bytes.
        CHECK(st.expert_bytes == st.n_blobs * (3ull * 1408 * 2048 + (1408 + 1408 + 2048) * 4));
        // Dense parameters of DeepSeek-V2-Lite (15.7B total, 14.4B of it in routed experts).
        const uint64_t D = 2048, V = 102400;
        uint64_t attn = 16 * 192 * D + 576 * D + 512 + 16 * 256 * 512 + D * 16 * 128;
        uint64_t params =
            2 * V * D + D + 27 * (attn + 2 * D) + 3 * 10944 * D + 26 * (64 * D + 3 * 2816 * D);
        CHECK(st.dense_bytes == 2 * params);
        CHECK(st.file_size > st.dense_bytes + st.expert_bytes);
        CHECK(st.file_size <
              st.dense_bytes + st.expert_bytes + 400 * 4096 + 1664 * 4096 + (64 << 20));
        CHECK(st.file_size % 4096 == 0);
    }
    SUBCASE("v2") {
        ModelConfig c = convert::synthetic_config("v2");
        CHECK(c.hidden_size == 5120);
        CHECK(c.num_attention_heads == 128);
        CHECK(c.q_lora_rank == 1536);
        CHECK(c.n_group == 8);
        CHECK(c.topk_group == 3);
        CHECK(c.routed_scaling_factor == 16.0);
        convert::ConvertStats st =
            synth("v2", tmp.path / "x.mds", 2, 0, mgl::dtype::f8_e4m3, /*dry_run=*/true);
        CHECK(!fs::exists(tmp.path / "x.mds"));
        CHECK(st.n_blobs == 59 * 160);
        // 236B parameters in total: ~222.6B in routed experts (59 × 160 × 3 × 1536 × 5120).
        CHECK(st.expert_bytes == st.n_blobs * (3ull * 1536 * 5120 + (1536 + 1536 + 5120) * 4));
        double params = double(st.dense_bytes) / 2 + double(st.n_blobs) * 3 * 1536 * 5120;
        CHECK(params == doctest::Approx(235.7e9).epsilon(0.01));
        convert::ConvertStats bf = synth("v2", tmp.path / "x.mds", 2, 0, mgl::dtype::bf16, true);
        CHECK(bf.expert_bytes == bf.n_blobs * 2 * (3ull * 1536 * 5120));
    }
    CHECK_THROWS_AS(convert::synthetic_config("v3"), convert::InputError);
}
