// The .mds loader on valid files written from scratch by tests/mds_test_file.*: what it binds,
// where its pointers point, and verify() on intact files.
#include <doctest/doctest.h>

#include <cstring>

#include "mds/reader.h"
#include "mds_test_file.h"
#include "test_util.h"

using minids::mds::FileError;
using minids::mds::MdsFile;
using namespace minids::test;

namespace {

// The payload bytes the helper placed at `offset`.
const std::vector<uint8_t>& payload_at(const MdsTestFile& f, uint64_t offset) {
    for (const auto& p : f.payloads)
        if (p.offset == offset) return p.bytes;
    throw std::runtime_error("no payload at offset " + std::to_string(offset));
}

}  // namespace

TEST_CASE("mds reader: a valid file opens and binds every tensor and expert blob") {
    for (bool fp8 : {true, false}) {
        for (bool q_lora : {false, true}) {
            CAPTURE(fp8);
            CAPTURE(q_lora);
            TempDir dir;
            MdsTestFile f = make_test_mds({.seed = 11, .fp8_experts = fp8, .q_lora = q_lora});
            const auto path = dir.path / "model.mds";
            f.write(path);
            auto m = MdsFile::open(path.string());

            CHECK(m->path() == path.string());
            CHECK(m->file_size() % 4096 == 0);
            CHECK(m->config().hidden_size == 24);
            CHECK(m->config().num_hidden_layers == 3);
            CHECK(m->config().q_lora_rank.has_value() == q_lora);
            CHECK(m->config().rope_scaling.has_value());
            CHECK(m->tokenizer().vocab.size() == 34);
            CHECK(m->tokenizer().merges.size() == 3);
            CHECK(m->tokenizer().added_tokens.size() == 2);
            CHECK(!m->tokenizer().chat_template.empty());
            CHECK(m->provenance().at("tool") == "minids test helper");

            REQUIRE(m->tensors().size() == f.manifest["tensors"].size());
            for (const auto& t : m->tensors()) {
                CAPTURE(t.name);
                const auto& bytes = payload_at(f, t.offset);
                REQUIRE(t.nbytes == bytes.size());
                CHECK(t.data == m->map_base() + t.offset);
                CHECK(std::memcmp(t.data, bytes.data(), bytes.size()) == 0);
                CHECK(m->find(t.name) == &t);
            }
            CHECK(m->find("model.layers.9.no_such.weight") == nullptr);
            const auto& embed = m->require("model.embed_tokens.weight", {40, 24});
            CHECK(embed.dtype == mgl::dtype::bf16);
            CHECK_THROWS_AS(m->require("model.embed_tokens.weight", {24, 40}), FileError);
            CHECK_THROWS_AS(m->require("model.no_such.weight", {1}), FileError);

            const auto& ex = m->experts();
            REQUIRE(ex.present);
            CHECK(ex.dtype == (fp8 ? mgl::dtype::f8_e4m3 : mgl::dtype::bf16));
            CHECK(ex.n_embd == 24);
            CHECK(ex.n_ff == 12);
            CHECK(ex.gate.shape == std::vector<int64_t>{12, 24});
            CHECK(ex.down.shape == std::vector<int64_t>{24, 12});
            if (fp8) CHECK(ex.down_scale.shape == std::vector<int64_t>{24});
            REQUIRE(ex.blobs.size() == 6);  // layers 1 and 2, 3 experts each
            for (size_t i = 0; i < ex.blobs.size(); ++i) {
                const auto& b = ex.blobs[i];
                CHECK(b.layer == 1 + static_cast<int64_t>(i) / 3);
                CHECK(b.expert == static_cast<int64_t>(i) % 3);
                const auto& bytes = payload_at(f, b.offset);
                REQUIRE(bytes.size() == ex.blob_nbytes);
                CHECK(std::memcmp(b.data, bytes.data(), bytes.size()) == 0);
            }
            CHECK(ex.first_blob_of_layer(0) == -1);
            CHECK(ex.first_blob_of_layer(1) == 0);
            CHECK(ex.first_blob_of_layer(2) == 3);
            CHECK(ex.first_blob_of_layer(3) == -1);

            for (int threads : {1, 3, 0}) {
                CAPTURE(threads);
                uint64_t last_done = 0, last_total = 0;
                int calls = 0;
                auto r = m->verify(threads, [&](uint64_t done, uint64_t total) {
                    CHECK(done >= last_done);
                    last_done = done;
                    last_total = total;
                    ++calls;
                });
                CHECK(r.ok);
                CHECK(r.problems.empty());
                CHECK(calls >= 1);
                CHECK(last_total == m->file_size());
                CHECK(last_done == last_total);
            }
        }
    }
}

TEST_CASE("mds reader: a file that cannot be opened is one FileError naming it") {
    TempDir dir;
    const auto path = (dir.path / "missing.mds").string();
    try {
        MdsFile::open(path);
        FAIL("open succeeded on a missing file");
    } catch (const FileError& e) {
        CHECK(std::string(e.what()).find(path) != std::string::npos);
        CHECK(std::string(e.what()).find("cannot open") != std::string::npos);
    }
    CHECK_THROWS_AS(MdsFile::open(dir.path.string()), FileError);
}

TEST_CASE("mds reader: a dense-only model (no routed experts) has no expert table") {
    TempDir dir;
    MdsTestFile f = make_test_mds({.seed = 13, .n_experts = 0});
    const auto path = dir.path / "dense.mds";
    f.write(path);
    auto m = MdsFile::open(path.string());
    CHECK(!m->experts().present);
    CHECK(m->experts().blobs.empty());
    CHECK(m->experts().first_blob_of_layer(1) == -1);
    CHECK(m->find("model.layers.2.mlp.gate_proj.weight") != nullptr);  // every layer dense
    CHECK(m->verify(2).ok);

    // An expert table in a model without MoE layers is refused by name.
    MdsTestFile g = make_test_mds({.seed = 13});
    g.manifest["config"]["n_routed_experts"] = 0;
    g.manifest["config"]["num_experts_per_tok"] = 0;
    g.write(path);
    try {
        MdsFile::open(path.string());
        FAIL("open() accepted an expert table in a dense model");
    } catch (const FileError& e) {
        CHECK(std::string(e.what()).find("experts: expected no expert table") != std::string::npos);
    }
}

TEST_CASE("mds verify: every damaged range is reported, whatever the thread count") {
    TempDir dir;
    MdsTestFile f = make_test_mds({.seed = 17});
    auto bytes = f.bytes();
    const auto& tensors = f.manifest["tensors"];
    const uint64_t t5 = tensors[5]["offset"].get<uint64_t>();
    const uint64_t t9 = tensors[9]["offset"].get<uint64_t>();
    const uint64_t blob3 = f.manifest["experts"]["blobs"][3]["offset"].get<uint64_t>();
    bytes[t5 + 1] ^= 0x10;     // tensor 5
    bytes[t9 + 4095] = 0x01;   // padding after tensor 9
    bytes[blob3 + 7] ^= 0x01;  // expert blob of layer 2, expert 0
    const auto path = dir.path / "damaged.mds";
    write_file(path, bytes);
    auto m = MdsFile::open(path.string());
    for (int threads : {1, 2, 5}) {
        CAPTURE(threads);
        auto r = m->verify(threads, [](uint64_t, uint64_t) {});
        CHECK(!r.ok);
        REQUIRE(r.problems.size() == 3);
        const std::string all = r.problems[0] + "\n" + r.problems[1] + "\n" + r.problems[2];
        CHECK(all.find("tensor " + tensors[5]["name"].get<std::string>()) != std::string::npos);
        CHECK(all.find("padding at offset " + std::to_string(t9 + 4095)) != std::string::npos);
        CHECK(all.find("expert blob layer 2 expert 0") != std::string::npos);
    }
}
