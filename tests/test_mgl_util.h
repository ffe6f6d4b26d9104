// Helpers for the mgl op tests: a harness that owns leaf memory and runs one graph on the CPU
// backend, a strided reader (double precision) for references, and a tolerance check.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "mgl.h"
#include "test_util.h"

namespace mgl_test {

struct harness {
    mgl::context ctx;
    std::unique_ptr<mgl::backend> be;
    std::vector<std::vector<uint8_t>> storage;  // leaf memory, owned here (caller memory to mgl)

    explicit harness(int n_threads = 2) : be(mgl::make_cpu_backend(n_threads)) {}
    explicit harness(std::unique_ptr<mgl::backend> backend) : be(std::move(backend)) {}

    mgl::tensor* leaf(mgl::dtype type, std::initializer_list<int64_t> shape, const void* bytes,
                      size_t n, const char* name = "leaf") {
        mgl::tensor* t = ctx.new_tensor(type, shape, name);
        REQUIRE(n == mgl::nbytes(*t));
        auto& mem = storage.emplace_back(n + 64);  // slack so views past the end would be caught by
        std::memcpy(mem.data(), bytes, n);         // the library's checks, not by the allocator
        t->data = mem.data();
        return t;
    }
    mgl::tensor* f32(std::initializer_list<int64_t> shape, const std::vector<float>& v,
                     const char* name = "x") {
        return leaf(mgl::dtype::f32, shape, v.data(), v.size() * 4, name);
    }
    mgl::tensor* i32(std::initializer_list<int64_t> shape, const std::vector<int32_t>& v,
                     const char* name = "ids") {
        return leaf(mgl::dtype::i32, shape, v.data(), v.size() * 4, name);
    }
    // Random f32 values, stored as `type` (f32, bf16, f16 or f8_e4m3).
    mgl::tensor* random(mgl::dtype type, std::initializer_list<int64_t> shape, uint64_t seed,
                        float lo = -1.0f, float hi = 1.0f, const char* name = "w") {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        auto v = minids::test::random_floats(size_t(n), seed, lo, hi);
        std::vector<uint8_t> bytes(size_t(n) * mgl::dtype_size(type));
        for (size_t i = 0; i < v.size(); ++i) {
            switch (type) {
                case mgl::dtype::f32:
                    std::memcpy(&bytes[i * 4], &v[i], 4);
                    break;
                case mgl::dtype::bf16: {
                    uint16_t h = mgl::f32_to_bf16(v[i]);
                    std::memcpy(&bytes[i * 2], &h, 2);
                    break;
                }
                case mgl::dtype::f16: {
                    uint16_t h = mgl::f32_to_f16(v[i]);
                    std::memcpy(&bytes[i * 2], &h, 2);
                    break;
                }
                case mgl::dtype::f8_e4m3:
                    bytes[i] = mgl::f32_to_e4m3(v[i]);
                    break;
                case mgl::dtype::i32:
                case mgl::dtype::i64:
                    FAIL("random integers not supported");
            }
        }
        return leaf(type, shape, bytes.data(), bytes.size(), name);
    }

    std::vector<float> run(mgl::tensor* out) {
        mgl::graph g = mgl::build_graph(ctx, {out});
        be->allocate(g);
        be->compute(g);
        be->synchronize();
        std::vector<float> host(size_t(out->nelements()));
        if (out->type == mgl::dtype::f32 && out->is_contiguous()) {
            be->download(*out, host.data(), 0, host.size() * 4);
        } else {
            auto d = read_all(*out);
            for (size_t i = 0; i < d.size(); ++i) host[i] = float(d[i]);
        }
        return host;
    }

    // Every element of t (through its strides and dtype; data must be resolved), row-major.
    static std::vector<double> read_all(const mgl::tensor& t) {
        std::vector<double> out;
        out.reserve(size_t(t.nelements()));
        std::array<int64_t, mgl::max_dims> idx{};
        for (int64_t i = 0; i < t.nelements(); ++i) {
            int64_t rem = i, off = 0;
            for (int d = t.n_dims - 1; d >= 0; --d) {
                idx[size_t(d)] = rem % t.shape[size_t(d)];
                rem /= t.shape[size_t(d)];
                off += idx[size_t(d)] * t.stride[size_t(d)];
            }
            const char* p = static_cast<const char*>(t.data) + off;
            float v = 0.0f;
            if (t.type == mgl::dtype::i32) {
                int32_t iv;
                std::memcpy(&iv, p, 4);
                v = float(iv);
            } else {
                mgl::to_f32(t.type, p, &v, 1);
            }
            out.push_back(double(v));
        }
        return out;
    }
};

// Element-wise |got - want| <= atol + rtol·|want|; reports the first mismatch with its index.
inline void check_close(const std::vector<float>& got, const std::vector<double>& want, double atol,
                        double rtol = 0.0) {
    REQUIRE(got.size() == want.size());
    size_t bad = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        double err = std::fabs(double(got[i]) - want[i]);
        if (!(err <= atol + rtol * std::fabs(want[i]))) {
            if (bad++ == 0) {
                CAPTURE(i);
                CAPTURE(got[i]);
                CAPTURE(want[i]);
                CHECK(err <= atol + rtol * std::fabs(want[i]));
            }
        }
    }
    CHECK(bad == 0);
}

}  // namespace mgl_test
