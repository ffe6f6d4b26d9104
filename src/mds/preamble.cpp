// The preamble: the only part of the file read before its own checksum is known to be good, so
// every field is checked against the file's size before anything else is touched.
#include <cstring>
#include <string>

#include <xxhash.h>

#include "mds/manifest.h"

namespace minids::mds {

namespace {

std::string printable_bytes(const uint8_t* p, size_t n) {
    std::string s = "\"";
    for (size_t i = 0; i < n; ++i) {
        uint8_t c = p[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\') {
            s += static_cast<char>(c);
        } else {
            static const char hex[] = "0123456789abcdef";
            s += "\\x";
            s += hex[c >> 4];
            s += hex[c & 15];
        }
    }
    return s + "\"";
}

}  // namespace

void fail(const std::string& file, const std::string& field, const std::string& expected,
          const std::string& found) {
    std::string msg = file + ": " + field + ": expected " + expected + ", found " + found;
    // Names and keys come from the file: keep control bytes out of the terminal.
    for (char& ch : msg)
        if (static_cast<unsigned char>(ch) < 0x20 || ch == 0x7f) ch = '?';
    throw FileError(msg);
}

std::string hex_u64(uint64_t v) {
    static const char digits[] = "0123456789abcdef";
    std::string s(16, '0');
    for (int i = 15; i >= 0; --i, v >>= 4) s[static_cast<size_t>(i)] = digits[v & 15];
    return s;
}

bool dtype_from_manifest_name(std::string_view name, mgl::dtype& out) {
    static constexpr struct {
        std::string_view name;
        mgl::dtype type;
    } names[] = {{"f32", mgl::dtype::f32},
                 {"f16", mgl::dtype::f16},
                 {"bf16", mgl::dtype::bf16},
                 {"f8_e4m3", mgl::dtype::f8_e4m3},
                 {"i32", mgl::dtype::i32}};
    for (const auto& n : names) {
        if (n.name == name) {
            out = n.type;
            return true;
        }
    }
    return false;
}

const char* manifest_dtype_name(mgl::dtype t) {
    switch (t) {
        case mgl::dtype::f32:
            return "f32";
        case mgl::dtype::f16:
            return "f16";
        case mgl::dtype::bf16:
            return "bf16";
        case mgl::dtype::f8_e4m3:
            return "f8_e4m3";
        case mgl::dtype::i32:
            return "i32";
        case mgl::dtype::i64:  // addresses in memory, never stored in a file
            break;
    }
    return "unknown";
}

uint64_t manifest_dtype_size(mgl::dtype t) {
    switch (t) {
        case mgl::dtype::f32:
            return 4;
        case mgl::dtype::f16:
            return 2;
        case mgl::dtype::bf16:
            return 2;
        case mgl::dtype::f8_e4m3:
            return 1;
        case mgl::dtype::i32:
            return 4;
        case mgl::dtype::i64:  // never stored in a file
            break;
    }
    return 0;
}

mds_preamble parse_preamble(const uint8_t* bytes, uint64_t size, const std::string& file) {
    if (size < sizeof(mds_preamble))
        fail(file, "preamble", "at least " + std::to_string(sizeof(mds_preamble)) + " bytes",
             "a file of " + std::to_string(size) + " bytes (truncated or not an .mds file)");
    mds_preamble p;
    std::memcpy(&p, bytes, sizeof p);

    if (std::memcmp(p.magic, mds_magic, sizeof mds_magic) != 0)
        fail(file, "magic",
             printable_bytes(reinterpret_cast<const uint8_t*>(mds_magic), 8) + " (an .mds file)",
             printable_bytes(bytes, 8));
    // The version comes before the checksum: a newer format may lay its preamble out differently.
    if (p.version > mds_version)
        fail(file, "version", "format version " + std::to_string(mds_version) + " or older",
             "version " + std::to_string(p.version) +
                 ": the file was written by a newer minids; update minids to read it");
    if (p.version != mds_version)
        fail(file, "version", std::to_string(mds_version), std::to_string(p.version));
    uint64_t preamble_hash = XXH3_64bits(bytes, offsetof(mds_preamble, preamble_xxh3));
    if (preamble_hash != p.preamble_xxh3)
        fail(file, "preamble_xxh3", hex_u64(preamble_hash) + " (the preamble's checksum)",
             hex_u64(p.preamble_xxh3) + " (the preamble is corrupt)");
    if (p.flags != 0) fail(file, "flags", "0", std::to_string(p.flags));

    const uint64_t header = sizeof(mds_preamble);
    if (p.manifest_len == 0 || p.manifest_len > mds_max_manifest_bytes)
        fail(file, "manifest_len",
             "between 1 and " + std::to_string(mds_max_manifest_bytes) + " bytes",
             std::to_string(p.manifest_len));
    if (p.manifest_len > size - header)
        fail(file, "manifest_len",
             "at most the " + std::to_string(size - header) + " bytes after the preamble",
             std::to_string(p.manifest_len) + " (the file is truncated inside the manifest)");
    if (p.data_offset % mds_alignment != 0)
        fail(file, "data_offset", "a multiple of " + std::to_string(mds_alignment),
             std::to_string(p.data_offset));
    if (p.data_offset < header + p.manifest_len)
        fail(file, "data_offset",
             "at least " + std::to_string(header + p.manifest_len) + " (the end of the manifest)",
             std::to_string(p.data_offset));
    if (p.data_offset > size)
        fail(file, "data_offset", "at most the file size " + std::to_string(size),
             std::to_string(p.data_offset) + " (the file is truncated)");
    if (size % mds_alignment != 0)
        fail(file, "file size", "a multiple of " + std::to_string(mds_alignment),
             std::to_string(size) + " bytes (the file is truncated or has trailing bytes)");

    uint64_t manifest_hash = XXH3_64bits(bytes + header, p.manifest_len);
    if (manifest_hash != p.manifest_xxh3)
        fail(file, "manifest_xxh3", hex_u64(manifest_hash) + " (the manifest's checksum)",
             hex_u64(p.manifest_xxh3) + " (the manifest is corrupt)");
    return p;
}

}  // namespace minids::mds
