// A small safetensors reader and writer for the tests: reads BF16/F32/F64 tensors as double,
// writes BF16/F32 tensors from double (rounded exactly as the engine will read them back).
// Test helper only; the converter has its own reader.
#pragma once

#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace minids::test {

// BF16 <-> F32 kept local so that this helper depends on nothing under test.
inline double st_bf16_to_double(uint16_t h) {
    uint32_t bits = uint32_t(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}
inline uint16_t st_float_to_bf16(float f) {  // round to nearest even (no NaN inputs here)
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    bits += 0x7FFFu + ((bits >> 16) & 1u);
    return uint16_t(bits >> 16);
}

struct StTensor {
    std::vector<int64_t> shape;
    std::vector<double> values;
};
using StTensors = std::map<std::string, StTensor>;

inline std::vector<uint8_t> read_whole_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) throw std::runtime_error("cannot open " + path);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// Reads every tensor of one safetensors file into `out` (appends; names must be new).
inline void read_safetensors(const std::string& path, StTensors& out) {
    std::vector<uint8_t> bytes = read_whole_file(path);
    if (bytes.size() < 8) throw std::runtime_error(path + ": too short");
    uint64_t header_len = 0;
    std::memcpy(&header_len, bytes.data(), 8);
    if (8 + header_len > bytes.size()) throw std::runtime_error(path + ": bad header length");
    auto header =
        nlohmann::json::parse(bytes.begin() + 8, bytes.begin() + 8 + std::ptrdiff_t(header_len));
    const uint8_t* data = bytes.data() + 8 + header_len;
    for (auto& [name, info] : header.items()) {
        if (name == "__metadata__") continue;
        StTensor t;
        t.shape = info.at("shape").get<std::vector<int64_t>>();
        auto offs = info.at("data_offsets").get<std::vector<uint64_t>>();
        const std::string dt = info.at("dtype").get<std::string>();
        const uint8_t* p = data + offs.at(0);
        size_t n = 1;
        for (int64_t d : t.shape) n *= size_t(d);
        t.values.resize(n);
        for (size_t i = 0; i < n; ++i) {
            if (dt == "BF16") {
                uint16_t h;
                std::memcpy(&h, p + 2 * i, 2);
                t.values[i] = st_bf16_to_double(h);
            } else if (dt == "F32") {
                float f;
                std::memcpy(&f, p + 4 * i, 4);
                t.values[i] = f;
            } else if (dt == "F64") {
                std::memcpy(&t.values[i], p + 8 * i, 8);
            } else {
                throw std::runtime_error(path + ": unsupported dtype " + dt);
            }
        }
        if (!out.emplace(name, std::move(t)).second) throw std::runtime_error("duplicate " + name);
    }
}

// Rounds v to BF16 and back, the values a BF16 checkpoint holds.
inline double round_bf16(double v) { return st_bf16_to_double(st_float_to_bf16(float(v))); }

// Writes the tensors as BF16 (values must already be BF16-exact for a lossless round trip).
inline void write_safetensors_bf16(const std::string& path, const StTensors& tensors) {
    nlohmann::json header = nlohmann::json::object();
    uint64_t offset = 0;
    for (const auto& [name, t] : tensors) {
        uint64_t nb = t.values.size() * 2;
        header[name] = {
            {"dtype", "BF16"}, {"shape", t.shape}, {"data_offsets", {offset, offset + nb}}};
        offset += nb;
    }
    std::string h = header.dump();
    while (h.size() % 8) h.push_back(' ');
    std::ofstream f(path, std::ios::binary);
    uint64_t len = h.size();
    f.write(reinterpret_cast<const char*>(&len), 8);
    f.write(h.data(), std::streamsize(h.size()));
    for (const auto& [name, t] : tensors) {
        for (double v : t.values) {
            uint16_t b = st_float_to_bf16(float(v));
            f.write(reinterpret_cast<const char*>(&b), 2);
        }
    }
    if (!f) throw std::runtime_error("cannot write " + path);
}

}  // namespace minids::test
