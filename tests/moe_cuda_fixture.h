// Fixtures for the CUDA MoE kernel tests (test_kernels_moe.cpp, test_kernels_moe_experts.cpp):
// device buffers, a bank of experts stored as .mds-style blobs scattered over device memory in
// random order, random routing, and the naive double-precision reference.
#pragma once
#ifdef MINIDS_HAVE_CUDA

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_check.h"
#include "mgl.h"
#include "moe.h"
#include "test_util.h"

namespace moe_test {

using minids::kernels::ExpertLayout;

// Device memory owned for a test's duration.
struct DeviceBuffer {
    void* ptr = nullptr;
    size_t bytes = 0;
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t n, int fill_byte = 0xff) : bytes(n) {  // 0xff: NaN in f32/bf16
        CUDA_CHECK(cudaMalloc(&ptr, n ? n : 1));
        CUDA_CHECK(cudaMemset(ptr, fill_byte, n ? n : 1));
    }
    template <typename T>
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = nullptr; }
    DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
        std::swap(ptr, o.ptr);
        std::swap(bytes, o.bytes);
        return *this;
    }
    ~DeviceBuffer() { cudaFree(ptr); }
    template <typename T>
    T* as() const {
        return static_cast<T*>(ptr);
    }
    template <typename T>
    std::vector<T> download() const {
        std::vector<T> host(bytes / sizeof(T));
        CUDA_CHECK(cudaMemcpy(host.data(), ptr, host.size() * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
    template <typename T>
    void upload(const std::vector<T>& host) {
        REQUIRE(host.size() * sizeof(T) <= bytes);
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
};

// Fast reproducible randomness (the V2-Lite-sized experts are tens of millions of values).
struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
    uint64_t next() {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    float uniform(float lo, float hi) { return lo + (hi - lo) * float(next() >> 40) * 0x1p-24f; }
    int below(int n) { return int(next() % uint64_t(n)); }
};

inline int64_t align_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// One weight matrix [rows, cols] as stored (dtype bytes) with its f32 row scale (f8 only).
struct HostMatrix {
    mgl::dtype type = mgl::dtype::bf16;
    int64_t rows = 0, cols = 0;
    std::vector<uint8_t> bytes;
    std::vector<float> scale;  // f8_e4m3 only

    HostMatrix() = default;
    HostMatrix(mgl::dtype t, int64_t r, int64_t c, Rng& rng) : type(t), rows(r), cols(c) {
        const size_t n = size_t(r * c);
        bytes.resize(n * mgl::dtype_size(t));
        if (t == mgl::dtype::f8_e4m3) {
            scale.resize(size_t(r));
            for (auto& s : scale) s = rng.uniform(0.002f, 0.02f);
        }
        for (size_t i = 0; i < n; ++i) {
            const float v = rng.uniform(-0.5f, 0.5f);
            if (t == mgl::dtype::f32) {
                std::memcpy(&bytes[i * 4], &v, 4);
            } else if (t == mgl::dtype::bf16) {
                const uint16_t h = mgl::f32_to_bf16(v);
                std::memcpy(&bytes[i * 2], &h, 2);
            } else {
                bytes[i] = mgl::f32_to_e4m3(v / scale[i / size_t(c)]);
            }
        }
    }
    // Row r decoded exactly into double.
    void row(int64_t r, double* out) const {
        for (int64_t c = 0; c < cols; ++c) {
            const size_t i = size_t(r * cols + c);
            if (type == mgl::dtype::f32) {
                float v;
                std::memcpy(&v, &bytes[i * 4], 4);
                out[c] = v;
            } else if (type == mgl::dtype::bf16) {
                uint16_t h;
                std::memcpy(&h, &bytes[i * 2], 2);
                out[c] = mgl::bf16_to_f32(h);
            } else {
                out[c] = double(mgl::e4m3_to_f32(bytes[i])) * double(scale[size_t(r)]);
            }
        }
    }
};

// SwiGLU MLP: down · (silu(gate · x) ⊙ (up · x)), in double.
struct HostMlp {
    HostMatrix gate, up, down;
    std::vector<double> apply(const std::vector<double>& x) const {
        const int64_t F = gate.rows, D = gate.cols;
        std::vector<double> row(static_cast<size_t>(std::max(F, D)));
        std::vector<double> h(static_cast<size_t>(F)), y(static_cast<size_t>(D));
        for (int64_t f = 0; f < F; ++f) {
            gate.row(f, row.data());
            double g = 0, u = 0;
            for (int64_t d = 0; d < D; ++d) g += row[size_t(d)] * x[size_t(d)];
            up.row(f, row.data());
            for (int64_t d = 0; d < D; ++d) u += row[size_t(d)] * x[size_t(d)];
            h[size_t(f)] = g / (1.0 + std::exp(-g)) * u;
        }
        for (int64_t d = 0; d < D; ++d) {
            down.row(d, row.data());
            double acc = 0;
            for (int64_t f = 0; f < F; ++f) acc += row[size_t(f)] * h[size_t(f)];
            y[size_t(d)] = acc;
        }
        return y;
    }
};

// E experts as .mds-style blobs (gate, up, down, gate_scale, up_scale, down_scale, each part
// 256-aligned), placed in one device allocation at shuffled, non-adjacent 4096-aligned slots
// (the gaps stay NaN-poisoned), with the device table of their addresses.
struct ExpertBank {
    ExpertLayout layout;
    std::vector<HostMlp> experts;
    DeviceBuffer storage;
    DeviceBuffer table;  // int64 [E]

    ExpertBank(mgl::dtype type, int64_t E, int64_t D, int64_t F, uint64_t seed) {
        Rng rng(seed);
        layout.type = type;
        layout.n_embd = D;
        layout.n_ff = F;
        const int64_t eb = int64_t(mgl::dtype_size(type));
        int64_t off = 0;
        auto part = [&](int64_t bytes) {
            const int64_t at = off;
            off = align_up(off + bytes, 256);
            return at;
        };
        layout.gate_offset = part(F * D * eb);
        layout.up_offset = part(F * D * eb);
        layout.down_offset = part(D * F * eb);
        if (type == mgl::dtype::f8_e4m3) {
            layout.gate_scale_offset = part(F * 4);
            layout.up_scale_offset = part(F * 4);
            layout.down_scale_offset = part(D * 4);
        }
        const int64_t slot = align_up(off, 4096);
        const int64_t n_slots = 2 * E + 1;
        std::vector<int64_t> slot_of(static_cast<size_t>(n_slots));
        std::iota(slot_of.begin(), slot_of.end(), 0);
        std::shuffle(slot_of.begin(), slot_of.end(), std::mt19937_64(seed));
        storage = DeviceBuffer(size_t(n_slots * slot));
        std::vector<int64_t> addr(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
            HostMlp m{HostMatrix(type, F, D, rng), HostMatrix(type, F, D, rng),
                      HostMatrix(type, D, F, rng)};
            std::vector<uint8_t> blob(static_cast<size_t>(off), 0);
            auto put = [&](int64_t at, const void* src, size_t n) {
                std::memcpy(blob.data() + at, src, n);
            };
            put(layout.gate_offset, m.gate.bytes.data(), m.gate.bytes.size());
            put(layout.up_offset, m.up.bytes.data(), m.up.bytes.size());
            put(layout.down_offset, m.down.bytes.data(), m.down.bytes.size());
            if (type == mgl::dtype::f8_e4m3) {
                put(layout.gate_scale_offset, m.gate.scale.data(), m.gate.scale.size() * 4);
                put(layout.up_scale_offset, m.up.scale.data(), m.up.scale.size() * 4);
                put(layout.down_scale_offset, m.down.scale.data(), m.down.scale.size() * 4);
            }
            uint8_t* dst = storage.as<uint8_t>() + slot_of[size_t(e)] * slot;
            CUDA_CHECK(cudaMemcpy(dst, blob.data(), blob.size(), cudaMemcpyHostToDevice));
            addr[size_t(e)] = int64_t(reinterpret_cast<uintptr_t>(dst));
            experts.push_back(std::move(m));
        }
        table = DeviceBuffer(addr);
    }
    int64_t n_experts() const { return int64_t(experts.size()); }
};

// A shared expert on the device (three separate allocations, like three checkpoint tensors).
struct SharedExpert {
    HostMlp mlp;
    DeviceBuffer gate, up, down;
    SharedExpert(mgl::dtype type, int64_t D, int64_t F, uint64_t seed) {
        Rng rng(seed);
        mlp = HostMlp{HostMatrix(type, F, D, rng), HostMatrix(type, F, D, rng),
                      HostMatrix(type, D, F, rng)};
        gate = DeviceBuffer(mlp.gate.bytes);
        up = DeviceBuffer(mlp.up.bytes);
        down = DeviceBuffer(mlp.down.bytes);
    }
    minids::kernels::SharedExpertWeights weights() const {
        return {mlp.gate.type, gate.ptr, up.ptr, down.ptr, mlp.gate.rows};
    }
};

// k distinct experts per token (skew > 0: expert 0 is every token's first choice), weights in
// [0.1, 1).
struct Routing {
    std::vector<int32_t> ids;
    std::vector<float> weights;
    Routing(int64_t T, int64_t E, int k, uint64_t seed, bool skew = false) {
        Rng rng(seed);
        std::vector<int32_t> perm(static_cast<size_t>(E));
        for (int64_t t = 0; t < T; ++t) {
            std::iota(perm.begin(), perm.end(), 0);
            for (int j = 0; j < k; ++j) {  // partial Fisher-Yates
                const int pick = j + rng.below(int(E) - j);
                std::swap(perm[size_t(j)], perm[size_t(pick)]);
            }
            if (skew) {
                const auto zero = std::find(perm.begin(), perm.end(), 0);
                std::iter_swap(perm.begin(), zero);
            }
            for (int j = 0; j < k; ++j) {
                ids.push_back(perm[size_t(j)]);
                weights.push_back(rng.uniform(0.1f, 1.0f));
            }
        }
    }
};

// out[t] = residual[t] + Σ_j w · Expert_{id}(x[t]) + Shared(x[t]) in double; ids outside [0, E)
// contribute nothing. Only tokens t % token_step == 0 are computed (the others stay 0).
inline std::vector<double> reference_moe(const ExpertBank& bank, const Routing& r, int k,
                                         const std::vector<float>& x, int64_t x_stride, int64_t T,
                                         const HostMlp* shared, const std::vector<float>* residual,
                                         int64_t token_step = 1) {
    const int64_t D = bank.layout.n_embd;
    std::vector<double> out(size_t(T * D), 0.0);
    std::vector<double> xt(static_cast<size_t>(D));
    for (int64_t t = 0; t < T; t += token_step) {
        for (int64_t d = 0; d < D; ++d) xt[size_t(d)] = x[size_t(t * x_stride + d)];
        double* o = &out[size_t(t * D)];
        for (int j = 0; j < k; ++j) {
            const int32_t id = r.ids[size_t(t * k + j)];
            if (id < 0 || id >= bank.n_experts()) continue;
            const auto y = bank.experts[size_t(id)].apply(xt);
            for (int64_t d = 0; d < D; ++d)
                o[d] += double(r.weights[size_t(t * k + j)]) * y[size_t(d)];
        }
        if (shared) {
            const auto y = shared->apply(xt);
            for (int64_t d = 0; d < D; ++d) o[d] += y[size_t(d)];
        }
        if (residual)
            for (int64_t d = 0; d < D; ++d) o[d] += (*residual)[size_t(t * D + d)];
    }
    return out;
}

// Banks reused across the cases of one test file (V2-Lite-sized ones take a while to build): the
// last seven shapes asked for; a new one is seeded seed_base + the number then cached.
class BankCache {
public:
    explicit BankCache(uint64_t seed_base) : seed_base_(seed_base) {}
    std::shared_ptr<ExpertBank> get(mgl::dtype type, int64_t E, int64_t D, int64_t F) {
        for (auto& b : cache_)
            if (b->layout.type == type && b->n_experts() == E && b->layout.n_embd == D &&
                b->layout.n_ff == F)
                return b;
        if (cache_.size() > 6) cache_.erase(cache_.begin());
        cache_.push_back(std::make_shared<ExpertBank>(type, E, D, F, seed_base_ + cache_.size()));
        return cache_.back();
    }

private:
    uint64_t seed_base_;
    std::vector<std::shared_ptr<ExpertBank>> cache_;
};

}  // namespace moe_test

#endif  // MINIDS_HAVE_CUDA
