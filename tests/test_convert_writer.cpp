// The .mds writer on its own: planned offsets, alignment, fixed manifest length, misuse refused,
// OUT.tmp removed when a writer is abandoned.
#include <doctest/doctest.h>
#include <xxhash.h>
#include <nlohmann/json.hpp>

#include "mds/writer.h"
#include "test_convert_util.h"
#include "test_util.h"

using nlohmann::json;
using namespace minids;
namespace fs = std::filesystem;

TEST_CASE("writer: expert layout parts are 256-aligned, blob_nbytes is the last part's end") {
    auto l = mds::ExpertLayout::make(mgl::dtype::f8_e4m3, 2048, 1408);
    CHECK(l.part("gate").offset == 0);
    CHECK(l.part("up").offset == 1408 * 2048);
    CHECK(l.part("down").offset == 2 * 1408 * 2048);
    CHECK(l.part("gate_scale").offset == 3 * 1408 * 2048);
    CHECK(l.part("up_scale").offset == 3 * 1408 * 2048 + 5632);
    CHECK(l.part("down_scale").offset == 3 * 1408 * 2048 + 2 * 5632);
    CHECK(l.blob_nbytes == 3 * 1408 * 2048 + 2 * 5632 + 2048 * 4);
    // Odd sizes: every part still starts on a 256-byte boundary.
    auto odd = mds::ExpertLayout::make(mgl::dtype::f8_e4m3, 67, 37);
    for (const auto& p : odd.parts) CHECK(p.offset % 256 == 0);
    CHECK(odd.part("up").offset == 2560);  // 37 × 67 = 2479 -> 2560
    CHECK(odd.blob_nbytes == odd.part("down_scale").offset + 67 * 4);
    auto bf = mds::ExpertLayout::make(mgl::dtype::bf16, 67, 37);
    CHECK(bf.parts.size() == 3);
    CHECK(bf.blob_nbytes == bf.part("down").offset + 67 * 37 * 2);
}

TEST_CASE("writer: offsets, checksums, zero padding, and the manifest as planned") {
    test::TempDir tmp;
    const fs::path out = tmp.path / "w.mds";
    std::vector<std::vector<uint8_t>> data;
    {
        mds::MdsWriter w(out, false);
        size_t a = w.add_tensor("a", mgl::dtype::bf16, {3, 5});
        size_t b = w.add_tensor("b", mgl::dtype::f32, {4097});
        w.set_experts(mds::ExpertLayout::make(mgl::dtype::f8_e4m3, 67, 37));
        size_t e0 = w.add_expert_blob(1, 0);
        size_t e1 = w.add_expert_blob(1, 1);
        CHECK_THROWS_AS(w.add_expert_blob(1, 1), mds::WriterError);  // order
        w.set_config({{"k", 1}});
        w.set_tokenizer({{"t", "x"}});
        w.set_provenance({{"tool", "test"}});
        CHECK_THROWS_AS(w.open(), mds::WriterError);  // before plan
        w.plan();
        CHECK(w.data_offset() == 4096);
        CHECK(w.tensor_offset(a) == 4096);
        CHECK(w.tensor_offset(b) == 8192);
        CHECK(w.blob_offset(e0) == 8192 + 20480);  // 4097 × 4 bytes round up to 5 pages
        CHECK(w.blob_offset(e1) == w.blob_offset(e0) + 12288);
        w.open();
        CHECK(fs::exists(tmp.path / "w.mds.tmp"));
        for (size_t i = 0; i < 4; ++i) {
            uint64_t n = i == 0 ? 30 : i == 1 ? 4097 * 4 : w.expert_layout().blob_nbytes;
            data.push_back(
                test::read_bytes(test::data_dir() / "tiny-v2-lite" / "reference.safetensors"));
            data.back().resize(n);
            for (size_t k = 0; k < n; ++k) data.back()[k] = uint8_t(data.back()[k] ^ (k * 131 + i));
        }
        CHECK_THROWS_AS(w.write_tensor(a, data[0].data(), 29), mds::WriterError);  // wrong size
        w.write_tensor(b, data[1].data(), data[1].size());                         // any order
        w.write_blob(e1, data[3].data(), data[3].size());
        w.write_tensor(a, data[0].data(), data[0].size());
        CHECK_THROWS_AS(w.write_tensor(a, data[0].data(), data[0].size()),
                        mds::WriterError);              // twice
        CHECK_THROWS_AS(w.commit(), mds::WriterError);  // e0 missing
        w.write_blob(e0, data[2].data(), data[2].size());
        w.commit();
    }
    CHECK(!fs::exists(tmp.path / "w.mds.tmp"));
    test::MdsContents m = test::read_mds(out);
    CHECK(m.bytes.size() ==
          size_t(test::read_mds(out).manifest["experts"]["blobs"][1]["offset"].get<uint64_t>() +
                 12288));
    CHECK(m.manifest["version"] == 1);
    CHECK(m.manifest["config"] == json{{"k", 1}});
    const json& t = m.manifest["tensors"];
    REQUIRE(t.size() == 2);
    CHECK(t[0]["name"] == "a");
    CHECK(t[0]["shape"] == json{3, 5});
    CHECK(t[1]["dtype"] == "f32");
    CHECK(t[1]["nbytes"] == 4097 * 4);
    CHECK(std::memcmp(m.bytes.data() + 8192, data[1].data(), data[1].size()) == 0);
    CHECK(t[0]["xxh3"] == mds::xxh3_hex(XXH3_64bits(data[0].data(), 30)));
    CHECK(m.manifest["experts"]["blobs"][0]["xxh3"] ==
          mds::xxh3_hex(XXH3_64bits(data[2].data(), data[2].size())));
    CHECK(m.preamble.manifest_xxh3 == XXH3_64bits(m.bytes.data() + 48, m.preamble.manifest_len));
    // Padding after tensor a is zero.
    for (size_t i = 4096 + 30; i < 8192; ++i) REQUIRE(m.bytes[i] == 0);
    CHECK(mds::xxh3_hex(0x00ab) == "00000000000000ab");
}

TEST_CASE("writer: an abandoned writer removes OUT.tmp and leaves an existing OUT alone") {
    test::TempDir tmp;
    const fs::path out = tmp.path / "w.mds";
    test::write_text(out, "old");
    {
        mds::MdsWriter w(out, false);
        w.add_tensor("a", mgl::dtype::bf16, {2});
        w.plan();
        CHECK_THROWS_AS(w.open(), mds::WriterError);  // exists, no overwrite
    }
    {
        mds::MdsWriter w(out, true);
        w.add_tensor("a", mgl::dtype::bf16, {2});
        w.plan();
        w.open();
        uint16_t v[2] = {1, 2};
        w.write_tensor(0, v, 4);
        CHECK(fs::exists(tmp.path / "w.mds.tmp"));
    }  // no commit
    CHECK(!fs::exists(tmp.path / "w.mds.tmp"));
    CHECK(test::read_bytes(out).size() == 3);
}

TEST_CASE("writer: a manifest that outgrows the first page moves the data") {
    test::TempDir tmp;
    mds::MdsWriter w(tmp.path / "big.mds", false);
    for (int i = 0; i < 300; ++i)
        w.add_tensor("model.layers." + std::to_string(i) + ".some_long_tensor_name.weight",
                     mgl::dtype::bf16, {7});
    w.set_config(json::object());
    w.plan();
    CHECK(w.data_offset() % 4096 == 0);
    CHECK(w.data_offset() > 4096);
    w.open();
    uint16_t v[7] = {1, 2, 3, 4, 5, 6, 7};
    for (size_t i = 0; i < 300; ++i) w.write_tensor(i, v, sizeof(v));
    w.commit();
    test::MdsContents m = test::read_mds(tmp.path / "big.mds");
    CHECK(m.preamble.data_offset == w.data_offset());
    CHECK(48 + m.preamble.manifest_len <= m.preamble.data_offset);
    CHECK(m.manifest["tensors"][299]["offset"] == w.data_offset() + 299 * 4096);
}

TEST_CASE(
    "writer: AlignedBuffer keeps its prefix, zeroes up to the padded size, stays 4096-aligned") {
    mds::AlignedBuffer b(5000);
    CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0);
    CHECK(b.padded_size() == 8192);
    for (size_t i = 0; i < 8192; ++i) REQUIRE(b.data()[i] == 0);
    for (size_t i = 0; i < 5000; ++i) b.data()[i] = uint8_t(i * 7 + 1);
    b.resize(3001);  // shrink: prefix kept, the rest of the last page zeroed
    CHECK(b.padded_size() == 4096);
    for (size_t i = 0; i < 3001; ++i) REQUIRE(b.data()[i] == uint8_t(i * 7 + 1));
    for (size_t i = 3001; i < 4096; ++i) REQUIRE(b.data()[i] == 0);
    b.resize(6000);  // grow within capacity: the bytes beyond the old size are zero, not stale
    for (size_t i = 3001; i < 8192; ++i) REQUIRE(b.data()[i] == 0);
    b.resize(20000);  // grow past capacity: new allocation, prefix copied
    CHECK(reinterpret_cast<uintptr_t>(b.data()) % 4096 == 0);
    for (size_t i = 0; i < 3001; ++i) REQUIRE(b.data()[i] == uint8_t(i * 7 + 1));
    for (size_t i = 3001; i < 20480; ++i) REQUIRE(b.data()[i] == 0);
}
