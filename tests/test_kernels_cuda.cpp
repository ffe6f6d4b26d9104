// Kernel parity: each CUDA launcher against a naive double-precision reference on random data.
// These run where a CUDA device is present and are reported as skipped where none is.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_check.h"
#include "matvec.h"
#include "mgl.h"
#include "rms_norm.h"
#include "test_util.h"

using namespace minids;

namespace {

const bool no_gpu = !test::cuda_device_available();

// Device buffer owned for the test's duration.
template <typename T>
struct DeviceArray {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceArray(const std::vector<T>& host) : n(host.size()) {
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), n * sizeof(T)));
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    ~DeviceArray() { cudaFree(ptr); }
    std::vector<T> download() const {
        std::vector<T> host(n);
        CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

void check_matvec(mgl::dtype type, int64_t n, int64_t k, int64_t m, uint64_t seed) {
    auto wf = test::random_floats(size_t(n * k), seed);
    auto x = test::random_floats(size_t(m * k), seed + 1);
    auto scale = test::random_floats(size_t(n), seed + 2, 0.5f, 2.0f);
    std::vector<double> wdec(size_t(n * k));
    std::vector<uint8_t> wbytes;
    if (type == mgl::dtype::bf16) {
        wbytes.resize(size_t(n * k) * 2);
        auto* w16 = reinterpret_cast<uint16_t*>(wbytes.data());
        for (size_t i = 0; i < wf.size(); ++i) {
            w16[i] = mgl::f32_to_bf16(wf[i]);
            wdec[i] = mgl::bf16_to_f32(w16[i]);
        }
    } else {
        wbytes.resize(size_t(n * k));
        for (size_t i = 0; i < wf.size(); ++i) {
            wbytes[i] = mgl::f32_to_e4m3(wf[i] * 400.0f);
            wdec[i] = double(mgl::e4m3_to_f32(wbytes[i])) * scale[i / size_t(k)];
        }
    }
    std::vector<double> ref(size_t(m * n));
    for (int64_t t = 0; t < m; ++t)
        for (int64_t r = 0; r < n; ++r) {
            double acc = 0;
            for (int64_t c = 0; c < k; ++c) acc += wdec[size_t(r * k + c)] * x[size_t(t * k + c)];
            ref[size_t(t * n + r)] = acc;
        }
    DeviceArray<uint8_t> dw(wbytes);
    DeviceArray<float> dscale(scale), dx(x);
    DeviceArray<float> dy(std::vector<float>(size_t(m * n), NAN));  // poisoned: every y written
    kernels::MatvecParams p;
    p.type = type;
    p.w = dw.ptr;
    p.w_scale = type == mgl::dtype::f8_e4m3 ? dscale.ptr : nullptr;
    p.x = dx.ptr;
    p.y = dy.ptr;
    p.n = n;
    p.k = k;
    p.m = m;
    kernels::matvec(p, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    auto y = dy.download();
    for (float v : y) REQUIRE(std::isfinite(v));
    CHECK(test::relative_l2(y, ref) < 1e-5);
}

}  // namespace

TEST_CASE("cuda matvec bf16 matches double reference" * doctest::skip(no_gpu)) {
    check_matvec(mgl::dtype::bf16, 37, 64, 1, 11);
    check_matvec(mgl::dtype::bf16, 1408, 2048, 1, 12);
    check_matvec(mgl::dtype::bf16, 2048, 1408, 3, 13);
}

TEST_CASE("cuda matvec fp8 with row scales matches double reference" * doctest::skip(no_gpu)) {
    check_matvec(mgl::dtype::f8_e4m3, 45, 48, 1, 21);
    check_matvec(mgl::dtype::f8_e4m3, 2048, 1408, 2, 22);
}

TEST_CASE("cuda rms_norm matches double reference" * doctest::skip(no_gpu)) {
    const int64_t rows = 5, dim = 2048 + 13;
    auto x = test::random_floats(size_t(rows * dim), 31, -3.0f, 3.0f);
    auto wf = test::random_floats(size_t(dim), 32);
    std::vector<uint16_t> w(static_cast<size_t>(dim));
    for (size_t i = 0; i < w.size(); ++i) w[i] = mgl::f32_to_bf16(wf[i]);
    std::vector<double> ref(x.size());
    for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t i = 0; i < dim; ++i)
            ss += double(x[size_t(r * dim + i)]) * x[size_t(r * dim + i)];
        double inv = 1.0 / std::sqrt(ss / double(dim) + 1e-6);
        for (int64_t i = 0; i < dim; ++i)
            ref[size_t(r * dim + i)] =
                mgl::bf16_to_f32(w[size_t(i)]) * x[size_t(r * dim + i)] * inv;
    }
    DeviceArray<float> dx(x), dy(std::vector<float>(x.size(), NAN));
    DeviceArray<uint16_t> dw(w);
    kernels::rms_norm({dx.ptr, dw.ptr, dy.ptr, rows, dim, 1e-6f}, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK(test::relative_l2(dy.download(), ref) < 1e-6);
}

TEST_CASE("cuda kernels reject unsupported shapes with a clear error") {
    kernels::MatvecParams p;
    p.n = 4;
    p.k = 7;  // 14 bytes per bf16 row: not a multiple of 16
    CHECK_THROWS_AS(kernels::matvec(p, nullptr), mgl::error);
}
#endif  // MINIDS_HAVE_CUDA
