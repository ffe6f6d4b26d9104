// Shared helpers for the test suite.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace minids::test {

// Compiled-in paths of this checkout, overridable from the environment so a build can be carried
// to another machine (the GPU machine) and run against that machine's copy of the tree.
inline std::filesystem::path env_or(const char* name, const char* fallback) {
    const char* v = std::getenv(name);
    return (v && *v) ? std::filesystem::path(v) : std::filesystem::path(fallback);
}
inline std::filesystem::path data_dir() { return env_or("MINIDS_TEST_DATA", MINIDS_TEST_DATA); }
inline std::filesystem::path minids_binary() { return env_or("MINIDS_BINARY", MINIDS_BINARY); }
// models/ of the checkout (the demo model and its reference), beside tests/data.
inline std::filesystem::path models_dir() {
    return data_dir().parent_path().parent_path() / "models";
}

// A fresh temporary directory, removed when the object goes out of scope.
struct TempDir {
    std::filesystem::path path;
    TempDir() {
        std::string tmpl = (std::filesystem::temp_directory_path() / "minids-test-XXXXXX").string();
        char* p = mkdtemp(tmpl.data());
        if (!p) throw std::runtime_error("mkdtemp failed");
        path = p;
    }
    ~TempDir() {
        std::error_code ec;
        std::filesystem::remove_all(path, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
};

// Uniform random floats in [lo, hi) from a fixed seed (tests are reproducible; vary the seed
// between cases, never use zeros as test data).
inline std::vector<float> random_floats(size_t n, uint64_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

// ‖got − ref‖₂ / ‖ref‖₂ over ref.size() elements (got must have at least as many).
inline double relative_l2(std::span<const float> got, std::span<const double> ref) {
    double num = 0.0, den = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        num += (double(got[i]) - ref[i]) * (double(got[i]) - ref[i]);
        den += ref[i] * ref[i];
    }
    return std::sqrt(num / den);
}

// True when the CUDA runtime reports at least one device (always false without CUDA).
bool cuda_device_available();

}  // namespace minids::test
