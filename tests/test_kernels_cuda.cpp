// Kernel parity: each CUDA launcher against a naive double-precision reference on random data
// (the matmul launchers are in test_kernels_matmul.cpp).
// These run where a CUDA device is present and are reported as skipped where none is.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda_check.h"
#include "cuda_test_util.h"
#include "mgl.h"
#include "rms_norm.h"
#include "test_util.h"

using namespace minids;

namespace {

const bool no_gpu = !test::cuda_device_available();

using test::DeviceArray;

}  // namespace

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

#endif  // MINIDS_HAVE_CUDA
