// The malformed .mds corpus (tests/mds_malformed_cases.cpp): each file is refused by open() with
// one FileError naming the file and the broken field, or, for data and padding, by verify().
#include <doctest/doctest.h>

#include <cstdlib>

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

// Writes the corpus, plus valid files, as fuzzer seeds: run with --no-skip and
// MINIDS_WRITE_FUZZ_CORPUS=<dir> (see scripts/fuzz.sh).
TEST_CASE("mds malformed corpus: write fuzzer seeds" * doctest::skip()) {
    const char* out = std::getenv("MINIDS_WRITE_FUZZ_CORPUS");
    REQUIRE(out != nullptr);
    const std::filesystem::path dir = out;
    std::filesystem::create_directories(dir);
    write_file(dir / "valid_fp8.mds", make_test_mds({.seed = 1, .n_layers = 2, .n_experts = 2}).bytes());
    write_file(dir / "valid_bf16_qlora.mds",
               make_test_mds({.seed = 2, .fp8_experts = false, .q_lora = true, .n_layers = 2,
                              .n_experts = 2}).bytes());
    for (const auto& mc : malformed_cases()) {
        MdsTestFile f = make_test_mds({.seed = 5});
        write_file(dir / (mc.name + ".mds"), mc.make(f));
    }
}
