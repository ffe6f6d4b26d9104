// CUDA-vs-CPU parity harness (ggml's test-backend-ops is the model): a test describes a graph once
// as a function of a `side`, which is run once on the CPU backend (leaves in host buffers) and
// once on the CUDA backend (leaves uploaded to device buffers), and the outputs are compared.
// Leaves hold the same random bytes on both sides (fixed seeds); the CUDA arena is poisoned with
// NaN before each compute so an element a kernel forgets to write shows up.
#pragma once

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda_check.h"
#include "mgl-cuda.h"
#include "mgl.h"
#include "test_util.h"

namespace minids::test {

// Random values of `type` as raw bytes (f32, bf16, f16, f8_e4m3).
inline std::vector<uint8_t> random_bytes(mgl::dtype type, size_t n, uint64_t seed, float lo = -1.0f,
                                         float hi = 1.0f) {
    const auto v = random_floats(n, seed, lo, hi);
    std::vector<uint8_t> bytes(n * mgl::dtype_size(type));
    for (size_t i = 0; i < n; ++i) {
        switch (type) {
            case mgl::dtype::f32:
                std::memcpy(&bytes[i * 4], &v[i], 4);
                break;
            case mgl::dtype::bf16: {
                const uint16_t h = mgl::f32_to_bf16(v[i]);
                std::memcpy(&bytes[i * 2], &h, 2);
                break;
            }
            case mgl::dtype::f16: {
                const uint16_t h = mgl::f32_to_f16(v[i]);
                std::memcpy(&bytes[i * 2], &h, 2);
                break;
            }
            case mgl::dtype::f8_e4m3:
                bytes[i] = mgl::f32_to_e4m3(v[i]);
                break;
            default:
                FAIL("random_bytes: not a float dtype");
        }
    }
    return bytes;
}

// Routed experts as .mds-style blobs (gate, up, down and, for f8, their row scales at fixed
// offsets), stored in scrambled slot order: expert e lives in slot slot_of[e].
struct expert_blobs {
    std::shared_ptr<mgl::expert_layout> layout = std::make_shared<mgl::expert_layout>();
    int64_t n_experts = 0;
    std::vector<int64_t> slot_of;
    std::vector<uint8_t> bytes;  // n_experts blobs back to back, by slot

    expert_blobs(mgl::dtype type, int64_t E, int64_t D, int64_t F, uint64_t seed) : n_experts(E) {
        auto align = [](uint64_t n) { return (n + 255) / 256 * 256; };
        mgl::expert_layout& L = *layout;
        L.type = type;
        L.n_embd = D;
        L.n_ff = F;
        const uint64_t mat = uint64_t(D * F) * mgl::dtype_size(type);
        L.gate = 0;
        L.up = align(mat);
        L.down = L.up + align(mat);
        uint64_t end = L.down + mat;
        if (type == mgl::dtype::f8_e4m3) {
            L.gate_scale = align(end);
            L.up_scale = L.gate_scale + align(uint64_t(F) * 4);
            L.down_scale = L.up_scale + align(uint64_t(F) * 4);
            end = L.down_scale + uint64_t(D) * 4;
        }
        L.blob_bytes = align(end);
        slot_of.resize(size_t(E));
        for (int64_t e = 0; e < E; ++e) slot_of[size_t(e)] = (e * 7 + 3) % E;  // E odd or 7 ∤ E
        bytes.assign(size_t(E) * L.blob_bytes, 0);
        const float range = type == mgl::dtype::f8_e4m3 ? 4.0f : 0.5f;
        for (int64_t e = 0; e < E; ++e) {
            uint8_t* blob = bytes.data() + size_t(slot_of[size_t(e)]) * L.blob_bytes;
            const uint64_t s = seed + uint64_t(e) * 16;
            for (auto [off, n, k] :
                 {std::tuple{L.gate, F * D, 0}, {L.up, F * D, 1}, {L.down, D * F, 2}}) {
                auto w = random_bytes(type, size_t(n), s + uint64_t(k), -range, range);
                std::memcpy(blob + off, w.data(), w.size());
            }
            if (type == mgl::dtype::f8_e4m3) {
                for (auto [off, n, k] :
                     {std::tuple{L.gate_scale, F, 3}, {L.up_scale, F, 4}, {L.down_scale, D, 5}}) {
                    auto sc = random_floats(size_t(n), s + uint64_t(k), 0.02f, 0.15f);
                    std::memcpy(blob + off, sc.data(), sc.size() * 4);
                }
            }
        }
    }
};

// One backend's copy of a test graph.
class side {
public:
    explicit side(mgl::backend& be) : be_(be) {}
    mgl::context ctx;
    mgl::backend& backend() { return be_; }
    bool on_device() const { return be_.compute_memory() == mgl::memory_kind::device; }

    mgl::tensor* leaf(mgl::dtype type, std::initializer_list<int64_t> shape, const void* bytes,
                      const char* name = "leaf") {
        mgl::tensor* t = ctx.new_tensor(type, shape, name);
        buffers_.push_back(be_.alloc_buffer(mgl::nbytes(*t)));
        mgl::bind(*t, *buffers_.back(), 0);
        be_.upload(*t, bytes, 0, mgl::nbytes(*t));
        return t;
    }
    mgl::tensor* random(mgl::dtype type, std::initializer_list<int64_t> shape, uint64_t seed,
                        float lo = -1.0f, float hi = 1.0f, const char* name = "w") {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        const auto bytes = random_bytes(type, size_t(n), seed, lo, hi);
        return leaf(type, shape, bytes.data(), name);
    }
    mgl::tensor* f32(std::initializer_list<int64_t> shape, const std::vector<float>& v,
                     const char* name = "x") {
        return leaf(mgl::dtype::f32, shape, v.data(), name);
    }
    mgl::tensor* i32(std::initializer_list<int64_t> shape, const std::vector<int32_t>& v,
                     const char* name = "ids") {
        return leaf(mgl::dtype::i32, shape, v.data(), name);
    }
    mgl::tensor* i64(std::initializer_list<int64_t> shape, const std::vector<int64_t>& v,
                     const char* name = "table") {
        return leaf(mgl::dtype::i64, shape, v.data(), name);
    }
    // The blobs as one leaf, and the expert table [E] i64 of their addresses on this side.
    mgl::tensor* expert_table(const expert_blobs& ex) {
        mgl::tensor* blobs =
            leaf(mgl::dtype::f8_e4m3, {int64_t(ex.bytes.size())}, ex.bytes.data(), "expert_blobs");
        std::vector<int64_t> addresses;
        for (int64_t slot : ex.slot_of)
            addresses.push_back(int64_t(static_cast<uint8_t*>(blobs->data) +
                                        uint64_t(slot) * ex.layout->blob_bytes));
        return i64({ex.n_experts}, addresses, "expert_table");
    }
    // Rewrites a leaf's contents (a new step's inputs).
    void set(mgl::tensor* t, const void* bytes) { be_.upload(*t, bytes, 0, mgl::nbytes(*t)); }

    // Every element of t (through its strides and dtype) as double, row-major.
    std::vector<double> read(const mgl::tensor& t) {
        const size_t es = mgl::dtype_size(t.type);
        size_t extent = es;
        for (int i = 0; i < t.n_dims; ++i)
            extent += size_t(t.shape[size_t(i)] - 1) * size_t(t.stride[size_t(i)]);
        // A 1-D tensor over the bytes t spans, so download's bounds check sees the whole extent.
        mgl::tensor span;
        span.type = t.type;
        span.n_dims = 1;
        span.shape[0] = int64_t(extent / es);
        span.stride[0] = int64_t(es);
        span.data = t.data;
        std::vector<uint8_t> raw(extent);
        be_.download(span, raw.data(), 0, extent);
        std::vector<double> out;
        out.reserve(size_t(t.nelements()));
        for (int64_t i = 0; i < t.nelements(); ++i) {
            int64_t rem = i, off = 0;
            for (int d = t.n_dims - 1; d >= 0; --d) {
                off += (rem % t.shape[size_t(d)]) * t.stride[size_t(d)];
                rem /= t.shape[size_t(d)];
            }
            const uint8_t* p = raw.data() + off;
            if (t.type == mgl::dtype::i32) {
                int32_t v;
                std::memcpy(&v, p, 4);
                out.push_back(double(v));
            } else if (t.type == mgl::dtype::i64) {
                int64_t v;
                std::memcpy(&v, p, 8);
                out.push_back(double(v));
            } else {
                float v;
                mgl::to_f32(t.type, p, &v, 1);
                out.push_back(double(v));
            }
        }
        return out;
    }

    // Allocates (in this side's arena) and computes a graph over `outputs`, NaN-poisoning the
    // arena first, and returns every output's values.
    std::vector<std::vector<double>> run(const std::vector<mgl::tensor*>& outputs,
                                         bool reusable = false) {
        graph = mgl::build_graph(ctx, std::span<mgl::tensor* const>(outputs));
        graph.reusable = reusable;
        be_.allocate(graph, arena);
        poison_arena();
        return compute(outputs);
    }
    // Computes the already allocated graph again (new leaf contents) and reads the outputs.
    std::vector<std::vector<double>> compute(const std::vector<mgl::tensor*>& outputs) {
        be_.compute(graph);
        be_.synchronize();
        std::vector<std::vector<double>> values;
        for (const mgl::tensor* t : outputs) values.push_back(read(*t));
        return values;
    }
    void poison_arena() {
        if (on_device()) {
            CUDA_CHECK(cudaMemset(arena.buf->base(), 0xff, arena.buf->size()));
            CUDA_CHECK(cudaDeviceSynchronize());
        } else {
            std::memset(arena.buf->base(), 0xff, arena.buf->size());
        }
    }

    mgl::graph graph;
    mgl::arena arena;

private:
    mgl::backend& be_;
    std::vector<mgl::buffer_ptr> buffers_;
};

// A test graph: leaves and ops recorded on a side; returns the outputs to compare.
using graph_builder = std::function<std::vector<mgl::tensor*>(side&)>;

struct parity_result {
    std::vector<double> rel_l2;  // per output, CUDA against the CPU
    std::vector<size_t> nan_mismatches;
};

// ‖a − b‖ / ‖b‖ (0 when both are all zero); NaN where only one side has NaN is counted apart.
inline double rel_l2(const std::vector<double>& got, const std::vector<double>& want,
                     size_t& nan_mismatch) {
    REQUIRE(got.size() == want.size());
    double num = 0, den = 0;
    nan_mismatch = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        if (std::isnan(got[i]) != std::isnan(want[i])) {
            ++nan_mismatch;
            continue;
        }
        if (std::isnan(got[i])) continue;
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    if (den == 0) return num == 0 ? 0.0 : INFINITY;
    return std::sqrt(num / den);
}

// The worst relative L2 seen per kind of check, printed once per test case (a compact summary of
// the GPU run; failures are reported one by one with their bounds).
struct worst_errors {
    std::vector<std::pair<std::string, double>> items;
    void add(const std::string& what, double e) {
        for (auto& [w, v] : items) {
            if (w == what) {
                v = std::max(v, e);
                return;
            }
        }
        items.emplace_back(what, e);
    }
    std::string str() const {
        std::string out = "worst relative L2 vs the CPU:";
        for (const auto& [w, v] : items) {
            char buf[64];
            std::snprintf(buf, sizeof buf, " %.2e", v);
            out += " " + w + buf + ";";
        }
        return out;
    }
};

// Runs `build` on a fresh CPU backend and on `cuda`, and compares each output against its bound.
inline parity_result check_parity(const std::string& what, mgl::backend& cuda,
                                  const graph_builder& build, std::vector<double> bounds,
                                  worst_errors* log = nullptr) {
    auto cpu_be = mgl::make_cpu_backend(2);
    side cpu(*cpu_be), gpu(cuda);
    const auto cpu_out = cpu.run(build(cpu));
    const auto gpu_out = gpu.run(build(gpu));
    REQUIRE(cpu_out.size() == gpu_out.size());
    if (bounds.size() < cpu_out.size()) bounds.resize(cpu_out.size(), bounds.back());
    parity_result r;
    for (size_t i = 0; i < cpu_out.size(); ++i) {
        size_t nan = 0;
        const double e = rel_l2(gpu_out[i], cpu_out[i], nan);
        r.rel_l2.push_back(e);
        if (log) log->add(what, e);
        r.nan_mismatches.push_back(nan);
        INFO(what << ", output " << i << ": relative L2 " << e << " (bound " << bounds[i] << "), "
                  << nan << " NaN mismatches of " << cpu_out[i].size());
        CHECK(nan == 0);
        CHECK(e <= bounds[i]);
    }
    return r;
}

}  // namespace minids::test

#endif  // MINIDS_HAVE_CUDA
