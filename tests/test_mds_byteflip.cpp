// "A change to any byte is detected": change bytes of a small valid file one at a time and check
// that open() + verify() never accept the result. Every byte of the preamble and manifest and
// of each tensor's and blob's first and last 64 bytes is changed, plus every 7th byte elsewhere.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <unistd.h>

#include "mds/reader.h"
#include "mds_test_file.h"
#include "test_util.h"

using minids::mds::FileError;
using minids::mds::MdsFile;
using namespace minids::test;

namespace {

void pwrite_byte(int fd, uint64_t offset, uint8_t value) {
    if (pwrite(fd, &value, 1, static_cast<off_t>(offset)) != 1)
        throw std::runtime_error("pwrite failed");
}

}  // namespace

TEST_CASE("mds byte flips: open() + verify() detect a change to any byte") {
    TempDir dir;
    MdsTestFile f = make_test_mds({.seed = 9, .n_layers = 2, .n_experts = 2});
    const auto bytes = f.bytes();
    const auto path = dir.path / "flip.mds";
    write_file(path, bytes);
    REQUIRE(MdsFile::open(path.string())->verify(1).ok);

    std::vector<bool> dense(bytes.size(), false);
    const uint64_t manifest_end = 48 + f.manifest_bytes().size();
    for (uint64_t i = 0; i < manifest_end; ++i) dense[i] = true;
    for (const auto& p : f.payloads) {
        for (uint64_t i = 0; i < 64 && i < p.bytes.size(); ++i) {
            dense[p.offset + i] = true;
            dense[p.offset + p.bytes.size() - 1 - i] = true;
        }
        dense[p.offset + p.bytes.size()] = true;  // first padding byte after it
    }
    int fd = ::open(path.c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    size_t tried = 0, refused_by_open = 0;
    for (uint64_t pos = 0; pos < bytes.size(); ++pos) {
        if (!dense[pos] && pos % 7 != 0) continue;
        // Alternate single-bit and whole-byte changes.
        const uint8_t changed =
            static_cast<uint8_t>(pos % 2 ? bytes[pos] ^ (1u << (pos % 8)) : ~bytes[pos]);
        pwrite_byte(fd, pos, changed);
        bool accepted = false;
        try {
            accepted = MdsFile::open(path.string())->verify(1).ok;
        } catch (const FileError&) {
            ++refused_by_open;
        }
        if (accepted) FAIL_CHECK("a change at offset " << pos << " was not detected");
        pwrite_byte(fd, pos, bytes[pos]);
        ++tried;
    }
    ::close(fd);
    MESSAGE("byte changes tried: " << tried << ", refused by open(): " << refused_by_open);
    CHECK(tried > 20000);
    CHECK(refused_by_open >= manifest_end);  // every preamble/manifest change fails at open()
    REQUIRE(MdsFile::open(path.string())->verify(1).ok);
}
