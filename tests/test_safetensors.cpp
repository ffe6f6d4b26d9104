// The safetensors reader: well-formed files and checkpoints parse; hostile ones are refused with
// one message naming the file and the problem.
#include <sys/mman.h>
#include <unistd.h>

#include <random>

#include <doctest/doctest.h>
#include <nlohmann/json.hpp>

#include "convert/safetensors.h"
#include "test_convert_util.h"
#include "test_util.h"

using nlohmann::json;
using namespace minids;
using namespace minids::convert;
namespace fs = std::filesystem;

namespace {

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
    std::vector<uint8_t> v(n);
    uint64_t x = seed;
    for (auto& b : v) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        b = uint8_t(x >> 56);
    }
    return v;
}

std::string header_error(const fs::path& p) {
    try {
        read_safetensors_header(p);
    } catch (const InputError& e) {
        return e.what();
    }
    return "";
}

// Writes `header` (a JSON text) with `data_size` random bytes after it and returns the error.
std::string raw_error(const test::TempDir& dir, const std::string& header, size_t data_size) {
    fs::path p = dir.path / "hostile.safetensors";
    test::write_safetensors_raw(p, header, random_bytes(data_size, 77));
    return header_error(p);
}

}  // namespace

TEST_CASE("safetensors: a well-formed file parses, tensors sorted by offset") {
    test::TempDir dir;
    fs::path p = dir.path / "model.safetensors";
    test::write_safetensors(p, {{"b", "BF16", {3, 5}, random_bytes(30, 1)},
                                {"a", "F32", {7}, random_bytes(28, 2)},
                                {"c", "F16", {2, 1, 3}, random_bytes(12, 3)}});
    StHeader h = read_safetensors_header(p);
    REQUIRE(h.tensors.size() == 3);
    CHECK(h.tensors[0].name == "b");
    CHECK(h.tensors[0].dtype == StDtype::bf16);
    CHECK(h.tensors[0].shape == std::vector<int64_t>{3, 5});
    CHECK(h.tensors[1].name == "a");
    CHECK(h.tensors[1].begin == 30);
    CHECK(h.tensors[1].nbytes() == 28);
    CHECK(h.tensors[2].nelements() == 6);
    CHECK(h.data_start + 70 == h.file_size);

    MappedFile m(p);
    CHECK(m.size() == h.file_size);
    auto want = random_bytes(28, 2);
    CHECK(std::equal(want.begin(), want.end(), m.data() + h.data_start + h.tensors[1].begin));
}

TEST_CASE("safetensors: the tiny-v2-lite checkpoint opens through its index") {
    Checkpoint ck = open_checkpoint(test::data_dir() / "tiny-v2-lite");
    REQUIRE(ck.shards.size() == 2);
    size_t n = ck.shards[0].tensors.size() + ck.shards[1].tensors.size();
    // 4 layers: embed, lm_head, norm; per layer 7 attention/norm tensors; layer 0 dense MLP (3),
    // layers 1..3: gate + 3 shared + 16 experts × 3.
    CHECK(n == 3 + 4 * 7 + 3 + 3 * (1 + 3 + 48));
}

TEST_CASE("safetensors: hostile headers are refused by name") {
    test::TempDir dir;
    SUBCASE("header length over 100 MB") {
        fs::path p = dir.path / "x.safetensors";
        std::vector<uint8_t> bytes(16, 0);
        uint64_t n = (100ull << 20) + 1;
        for (int i = 0; i < 8; ++i) bytes[size_t(i)] = uint8_t(n >> (8 * i));
        test::write_bytes(p, bytes.data(), bytes.size());
        CHECK(header_error(p).find(
                  "header length: expected at most 104857600 bytes, found 104857601") !=
              std::string::npos);
    }
    SUBCASE("header length past the end") {
        fs::path p = dir.path / "x.safetensors";
        std::vector<uint8_t> bytes(16, 0);
        bytes[0] = 200;
        test::write_bytes(p, bytes.data(), bytes.size());
        CHECK(header_error(p).find("runs past the end of the file") != std::string::npos);
    }
    SUBCASE("file shorter than the length field") {
        fs::path p = dir.path / "x.safetensors";
        test::write_bytes(p, "abc", 3);
        CHECK(header_error(p).find("file too short") != std::string::npos);
    }
    SUBCASE("not JSON") {
        CHECK(raw_error(dir, "{\"a\": {\"dtype\": ", 0).find("expected valid JSON") !=
              std::string::npos);
    }
    SUBCASE("not an object") {
        CHECK(raw_error(dir, "[1, 2]", 0).find("expected a JSON object") != std::string::npos);
    }
    SUBCASE("duplicate tensor names") {
        std::string h = R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                            "w": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 8]}})";
        CHECK(raw_error(dir, h, 8).find("the key \"w\" twice") != std::string::npos);
    }
    SUBCASE("duplicate keys inside a tensor entry") {
        std::string h =
            R"({"w": {"dtype": "BF16", "dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})";
        CHECK(raw_error(dir, h, 4).find("the key \"dtype\" twice") != std::string::npos);
    }
    SUBCASE("offsets past the end") {
        std::string h = R"({"w": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}})";
        CHECK(raw_error(dir, h, 6).find("past the end of the data area (6 bytes)") !=
              std::string::npos);
    }
    SUBCASE("overlapping tensors") {
        std::string h = R"({"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]},
                            "b": {"dtype": "BF16", "shape": [4], "data_offsets": [6, 14]}})";
        CHECK(raw_error(dir, h, 14).find("overlap the previous tensor") != std::string::npos);
    }
    SUBCASE("a gap between tensors") {
        std::string h = R"({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
                            "b": {"dtype": "BF16", "shape": [2], "data_offsets": [6, 10]}})";
        CHECK(raw_error(dir, h, 10).find("a gap of unclaimed bytes") != std::string::npos);
    }
    SUBCASE("trailing bytes not covered") {
        std::string h = R"({"a": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}})";
        CHECK(raw_error(dir, h, 9).find("cover all 9 bytes, found 4 covered") != std::string::npos);
    }
    SUBCASE("dtype × shape disagrees with the byte range") {
        std::string h = R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})";
        CHECK(raw_error(dir, h, 8).find(
                  "expected F32 × [3] = 12 bytes, found data_offsets spanning 8") !=
              std::string::npos);
    }
    SUBCASE("shape whose element count overflows") {
        std::string h =
            R"({"w": {"dtype": "BF16", "shape": [4294967296, 4294967296, 16], "data_offsets": [0, 8]}})";
        CHECK(raw_error(dir, h, 8).find("needs more bytes than the file holds") !=
              std::string::npos);
    }
    SUBCASE("unknown dtype") {
        std::string h = R"({"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 2]}})";
        CHECK(raw_error(dir, h, 2).find("expected BF16, F16 or F32, found \"Q4_K\"") !=
              std::string::npos);
    }
    SUBCASE("negative and non-integer fields") {
        CHECK(
            raw_error(dir, R"({"w": {"dtype": "BF16", "shape": [-2], "data_offsets": [0, 4]}})", 4)
                .find("expected a non-negative integer") != std::string::npos);
        CHECK(
            raw_error(dir, R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, "4"]}})", 4)
                .find("expected a non-negative integer, found string") != std::string::npos);
        CHECK(raw_error(dir, R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [4, 0]}})", 4)
                  .find("expected begin <= end") != std::string::npos);
        CHECK(raw_error(dir,
                        R"({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4], "x": 1}})",
                        4)
                  .find("unknown field \"x\"") != std::string::npos);
        CHECK(raw_error(dir, R"({"__metadata__": {"format": 1}})", 0).find("__metadata__.format") !=
              std::string::npos);
    }
    SUBCASE("the message names the file") {
        CHECK(raw_error(dir, "[]", 0).find("hostile.safetensors") != std::string::npos);
    }
}

TEST_CASE("safetensors: checkpoint index consistency") {
    test::TempDir dir;
    test::write_safetensors(dir.path / "a.safetensors", {{"x", "BF16", {2}, random_bytes(4, 5)}});
    test::write_safetensors(dir.path / "b.safetensors", {{"y", "BF16", {2}, random_bytes(4, 6)}});
    auto index_error = [&](const json& weight_map) -> std::string {
        test::write_text(dir.path / "model.safetensors.index.json",
                         json{{"weight_map", weight_map}}.dump());
        try {
            open_checkpoint(dir.path);
        } catch (const InputError& e) {
            return e.what();
        }
        return "";
    };
    CHECK(index_error({{"x", "a.safetensors"}, {"y", "b.safetensors"}}).empty());
    CHECK(index_error({{"x", "a.safetensors"}, {"y", "a.safetensors"}})
              .find("\"y\" listed in the index is missing") != std::string::npos);
    CHECK(index_error({{"x", "b.safetensors"}, {"y", "a.safetensors"}})
              .find("the index places it in") != std::string::npos);
    test::write_safetensors(dir.path / "c.safetensors", {{"w", "BF16", {2}, random_bytes(4, 7)},
                                                         {"v", "BF16", {2}, random_bytes(4, 8)}});
    CHECK(index_error({{"w", "c.safetensors"}}).find("\"v\" is not listed in") !=
          std::string::npos);
    CHECK(index_error({{"x", "a.safetensors"}, {"y", "b.safetensors"}, {"z", "b.safetensors"}})
              .find("\"z\" listed in the index is missing") != std::string::npos);
    CHECK(index_error({{"x", "../a.safetensors"}})
              .find("expected a file name in the same directory") != std::string::npos);
    CHECK(index_error({{"x", "a.safetensors"}, {"y", "missing.safetensors"}}).find("cannot open") !=
          std::string::npos);

    test::TempDir empty;
    try {
        open_checkpoint(empty.path);
        FAIL("expected an error");
    } catch (const InputError& e) {
        CHECK(std::string(e.what()).find("found neither") != std::string::npos);
    }
}

TEST_CASE("safetensors: randomly corrupted files are parsed or refused, never anything else") {
    test::TempDir dir;
    const fs::path good = dir.path / "good.safetensors";
    test::write_safetensors(good, {{"model.norm.weight", "BF16", {5}, random_bytes(10, 11)},
                                   {"lm_head.weight", "F32", {3, 2}, random_bytes(24, 12)},
                                   {"x", "F16", {2, 2}, random_bytes(8, 13)}});
    const std::vector<uint8_t> base = test::read_bytes(good);
    // The mutants live in a memfd (reached through /proc/self/fd): thousands of rewrites of a
    // disk file are slow where truncation discards blocks.
    const int mfd = memfd_create("mutant.safetensors", MFD_CLOEXEC);
    REQUIRE(mfd >= 0);
    const fs::path p = "/proc/self/fd/" + std::to_string(mfd);
    std::mt19937_64 rng(4242);
    int parsed = 0, refused = 0;
    for (int iter = 0; iter < 10000; ++iter) {
        std::vector<uint8_t> b = base;
        const int edits = 1 + int(rng() % 4);
        for (int e = 0; e < edits; ++e) {
            switch (rng() % 4) {
                case 0:
                    b[rng() % b.size()] = uint8_t(rng());
                    break;  // any byte
                case 1:     // a JSON-ish character inside the header
                    if (b.size() > 8)
                        b[8 + rng() % (b.size() - 8)] = "0123456789[]{}\",:-e."[rng() % 20];
                    break;
                case 2:
                    b.resize(rng() % b.size());
                    break;  // truncate
                case 3:
                    b.insert(b.begin() + long(rng() % b.size()), uint8_t(rng()));
                    break;
            }
            if (b.empty()) b.push_back(0);
        }
        REQUIRE(ftruncate(mfd, 0) == 0);
        REQUIRE(pwrite(mfd, b.data(), b.size(), 0) == ssize_t(b.size()));
        try {
            StHeader h = read_safetensors_header(p);
            ++parsed;
            // Whatever parsed must be self-consistent.
            uint64_t pos = 0;
            for (const StTensor& t : h.tensors) {
                REQUIRE(t.begin == pos);
                REQUIRE(uint64_t(t.nelements()) * st_dtype_size(t.dtype) == t.nbytes());
                pos = t.end;
            }
            REQUIRE(h.data_start + pos == h.file_size);
        } catch (const InputError&) {
            ++refused;
        }
    }
    close(mfd);
    CHECK(parsed > 0);
    CHECK(refused > 3000);
}
