// libFuzzer target for the .mds preamble and manifest parser (src/mds/manifest.h).
//
// Two kinds of input, told apart by the magic:
//   * a whole file ("MINIDS\r\n..."): the checksums in the preamble are recomputed and the size
//     padded to a multiple of 4096 before parsing, so mutations reach the checks behind them;
//   * anything else: the manifest JSON alone, placed as if after a valid preamble in a file with
//     a large data region (parse_manifest reads no data, so the region need not exist).
// A FileError is the expected outcome for bad input; any other exception, a crash, a sanitizer
// report or a leak is a bug.
#include <cstdint>
#include <cstring>
#include <vector>

#include <xxhash.h>

#include "mds/format.h"
#include "mds/manifest.h"

namespace {

using namespace minids::mds;

void parse_whole_file(const uint8_t* data, size_t size) {
    std::vector<uint8_t> file(data, data + size);
    file.resize((size + mds_alignment - 1) / mds_alignment * mds_alignment, 0);
    mds_preamble pre;
    std::memcpy(&pre, file.data(), sizeof pre);
    if (pre.manifest_len <= file.size() - sizeof pre) {
        pre.manifest_xxh3 = XXH3_64bits(file.data() + sizeof pre, pre.manifest_len);
        std::memcpy(file.data() + offsetof(mds_preamble, manifest_xxh3), &pre.manifest_xxh3, 8);
    }
    pre.preamble_xxh3 = XXH3_64bits(file.data(), offsetof(mds_preamble, preamble_xxh3));
    std::memcpy(file.data() + offsetof(mds_preamble, preamble_xxh3), &pre.preamble_xxh3, 8);

    const mds_preamble checked = parse_preamble(file.data(), file.size(), "fuzz.mds");
    std::string_view text(reinterpret_cast<const char*>(file.data()) + sizeof checked,
                          checked.manifest_len);
    parse_manifest(text, FileExtent{checked.data_offset, file.size()}, "fuzz.mds");
}

void parse_manifest_only(const uint8_t* data, size_t size) {
    const uint64_t data_offset =
        (sizeof(mds_preamble) + size + mds_alignment - 1) / mds_alignment * mds_alignment;
    std::string_view text(reinterpret_cast<const char*>(data), size);
    parse_manifest(text, FileExtent{data_offset, data_offset + (uint64_t{1} << 32)}, "fuzz.mds");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    try {
        if (size >= sizeof(mds_preamble) && std::memcmp(data, mds_magic, sizeof mds_magic) == 0)
            parse_whole_file(data, size);
        else
            parse_manifest_only(data, size);
    } catch (const FileError&) {
        // Refused with a message: the intended outcome for malformed input.
    }
    return 0;
}
