// The malformed .mds corpus (tests/mds_malformed_cases.cpp): each file is refused by open() with
// one FileError naming the file and the broken field, or, for data and padding, by verify().
#include <doctest/doctest.h>

#include <cstdlib>
#include <fstream>
#include <set>

#include "mds/reader.h"
#include "mds_malformed_cases.h"
#include "test_util.h"

using minids::mds::FileError;
using minids::mds::MdsFile;
using namespace minids::test;

TEST_CASE("mds malformed corpus: every case is refused with a message naming the field") {
    const auto cases = malformed_cases();
    CHECK(cases.size() >= 40);
    TempDir dir;
    for (const auto& mc : cases) {
        CAPTURE(mc.name);
        MdsTestFile f = make_test_mds({.seed = 5});
        const auto path = dir.path / (mc.name + ".mds");
        write_file(path, mc.make(f));
        if (!mc.open_ok) {
            try {
                auto m = MdsFile::open(path.string());
                FAIL("open() accepted the malformed file");
            } catch (const FileError& e) {
                const std::string msg = e.what();
                CAPTURE(msg);
                CHECK(msg.find(mc.expect) != std::string::npos);
                CHECK(msg.rfind(path.string() + ": ", 0) == 0);  // starts with the file
                // The config and tokenizer parsers (src/model, src/tokenizer) word some messages
                // without "expected" ('unknown field "x"', 'bos id 99 is outside the
                // vocabulary'); for those the file and the field are what is checked.
                if (mc.name.rfind("config_", 0) != 0 && mc.name.rfind("tokenizer_", 0) != 0)
                    CHECK(msg.find("expected") != std::string::npos);
                CHECK(msg.find('\n') == std::string::npos);
                CHECK(msg.size() < 1000);
            }
        } else {
            auto m = MdsFile::open(path.string());
            auto r = m->verify(2);
            CHECK(!r.ok);
            REQUIRE(!r.problems.empty());
            bool named = false;
            for (const auto& p : r.problems) named |= p.find(mc.expect) != std::string::npos;
            CAPTURE(r.problems.front());
            CHECK(named);
        }
    }
}

// Writes the fuzzer's seed corpus (tests/fuzz/corpus/): two small valid files whole, and the
// manifest text of every malformed case (the fuzz target reads bare JSON as a manifest). Run
// with --no-skip and MINIDS_WRITE_FUZZ_CORPUS=<dir>.
TEST_CASE("mds malformed corpus: write fuzzer seeds" * doctest::skip()) {
    const char* out = std::getenv("MINIDS_WRITE_FUZZ_CORPUS");
    REQUIRE(out != nullptr);
    const std::filesystem::path dir = out;
    std::filesystem::create_directories(dir);
    write_file(dir / "valid_fp8.mds",
               make_test_mds({.seed = 1, .n_layers = 2, .n_experts = 2}).bytes());
    write_file(dir / "valid_bf16_qlora.mds",
               make_test_mds(
                   {.seed = 2, .fp8_experts = false, .q_lora = true, .n_layers = 2, .n_experts = 2})
                   .bytes());
    std::set<std::string> written;
    for (const auto& mc : malformed_cases()) {
        MdsTestFile f = make_test_mds({.seed = 5});
        auto bytes = mc.make(f);
        if (bytes.size() < 48) continue;
        const uint64_t len = get_u64(bytes, 16);
        if (len > bytes.size() - 48) continue;
        std::string text(bytes.begin() + 48, bytes.begin() + 48 + static_cast<std::ptrdiff_t>(len));
        if (written.insert(text).second) {
            std::ofstream(dir / (mc.name + ".json"), std::ios::binary) << text;
        }
    }
}
