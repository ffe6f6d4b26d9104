// Helpers for the converter tests: build safetensors files (well-formed or hostile) and read an
// .mds file back with a minimal, independent parser (not the production reader), so the tests
// check the writer against the format rather than against itself.
#pragma once

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "mds/format.h"

namespace minids::test {

inline std::vector<uint8_t> read_bytes(const std::filesystem::path& p) {
    std::ifstream in(p, std::ios::binary);
    if (!in) throw std::runtime_error("cannot open " + p.string());
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

inline void write_bytes(const std::filesystem::path& p, const void* data, size_t n) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), std::streamsize(n));
    if (!out) throw std::runtime_error("cannot write " + p.string());
}

inline nlohmann::json read_json_file_for_test(const std::filesystem::path& p) {
    auto b = read_bytes(p);
    return nlohmann::json::parse(b.begin(), b.end());
}

inline void write_text(const std::filesystem::path& p, const std::string& s) {
    write_bytes(p, s.data(), s.size());
}

// A safetensors file from a header JSON text and a data area, verbatim (so tests can make it
// hostile in any way).
inline void write_safetensors_raw(const std::filesystem::path& p, const std::string& header,
                                  const std::vector<uint8_t>& data) {
    std::vector<uint8_t> out(8);
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out[size_t(i)] = uint8_t(n >> (8 * i));
    out.insert(out.end(), header.begin(), header.end());
    out.insert(out.end(), data.begin(), data.end());
    write_bytes(p, out.data(), out.size());
}

struct StEntry {
    std::string name;
    std::string dtype;  // "BF16", "F32", ...
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
};

// A well-formed safetensors file holding `entries` back to back.
inline void write_safetensors(const std::filesystem::path& p, const std::vector<StEntry>& entries) {
    nlohmann::json h = nlohmann::json::object();
    std::vector<uint8_t> data;
    for (const StEntry& e : entries) {
        h[e.name] = {{"dtype", e.dtype},
                     {"shape", e.shape},
                     {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
        data.insert(data.end(), e.bytes.begin(), e.bytes.end());
    }
    h["__metadata__"] = {{"format", "pt"}};
    write_safetensors_raw(p, h.dump(), data);
}

// Reads a safetensors file into entries (for comparing converted output with its input).
struct StFileContents {
    nlohmann::json header;
    std::vector<uint8_t> bytes;
    uint64_t data_start = 0;
    const uint8_t* tensor(const std::string& name) const {
        const auto& off = header.at(name).at("data_offsets");
        return bytes.data() + data_start + off[0].get<uint64_t>();
    }
};
inline StFileContents read_safetensors(const std::filesystem::path& p) {
    StFileContents c;
    c.bytes = read_bytes(p);
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | c.bytes[size_t(i)];
    c.header = nlohmann::json::parse(c.bytes.begin() + 8, c.bytes.begin() + 8 + long(n));
    c.data_start = 8 + n;
    return c;
}

// The parts of an .mds file the tests need, parsed independently of src/mds/reader.
struct MdsContents {
    std::vector<uint8_t> bytes;
    mds::mds_preamble preamble{};
    nlohmann::json manifest;
    const nlohmann::json* find_tensor(const std::string& name) const {
        for (const auto& t : manifest.at("tensors"))
            if (t.at("name") == name) return &t;
        return nullptr;
    }
};
inline MdsContents read_mds(const std::filesystem::path& p) {
    MdsContents c;
    c.bytes = read_bytes(p);
    if (c.bytes.size() < sizeof(mds::mds_preamble)) throw std::runtime_error("mds too short");
    std::memcpy(&c.preamble, c.bytes.data(), sizeof(c.preamble));
    const char* m = reinterpret_cast<const char*>(c.bytes.data()) + sizeof(c.preamble);
    c.manifest = nlohmann::json::parse(m, m + c.preamble.manifest_len);
    return c;
}

}  // namespace minids::test
