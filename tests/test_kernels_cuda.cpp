// Kernel parity: each CUDA launcher against a naive double-precision reference on random data
// (the matmul launchers are in test_kernels_matmul.cpp).
// These run where a CUDA device is present and are reported as skipped where none is.
#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
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

// Both kernels: the fast one (dim <= 8192, dim % 4 == 0, 16-byte aligned rows, aligned weight)
// with one, two, four and eight float4s per thread, full and partly used, and the general one
// (dim % 4, dim > 8192, a weight 2 bytes off alignment). Bound: relative L2 1e-6 (FP32 math).
TEST_CASE("cuda rms_norm matches double reference" * doctest::skip(no_gpu)) {
    struct Case {
        int64_t dim;
        int wkind;  // 0 none, 1 bf16, 2 f32, 3 bf16 one element off 8-byte alignment
    };
    const Case cases[] = {
        {2048 + 13, 1},  // general: dim % 4 != 0
        {2048 + 13, 2},  // general
        {2048, 0},       // fast, two float4s per thread (V2-Lite's hidden size)
        {2048, 1},       // fast
        {2048, 2},       // fast
        {2048, 3},       // general: bf16 weight not 8-byte aligned
        {512, 1},        // fast, one float4 per thread, half the block idle
        {512, 2},        // fast
        {4096, 1},       // fast, four float4s per thread
        {3000, 2},       // fast, four, the last slots of the row unused
        {5120, 1},       // fast, eight float4s per thread, 5 of them used (V2's hidden size)
        {8192, 2},       // fast, eight, all used
        {8, 1},          // fast, two busy threads
        {8196, 1},       // general: dim > 8192
    };
    const int64_t rows = 5;
    double worst = 0;
    for (const Case& c : cases) {
        const int64_t dim = c.dim;
        INFO("dim ", dim, ", weight kind ", c.wkind);
        const auto x = test::random_floats(size_t(rows * dim), 31 + uint64_t(dim), -3.0f, 3.0f);
        const auto wf = test::random_floats(size_t(dim + 1), 32 + uint64_t(dim));
        std::vector<uint16_t> w16(wf.size());
        for (size_t i = 0; i < w16.size(); ++i) w16[i] = mgl::f32_to_bf16(wf[i]);
        const size_t woff = c.wkind == 3 ? 1 : 0;  // kind 3 reads weights [1, dim + 1)
        std::vector<double> ref(x.size());
        for (int64_t r = 0; r < rows; ++r) {
            double ss = 0;
            for (int64_t i = 0; i < dim; ++i)
                ss += double(x[size_t(r * dim + i)]) * x[size_t(r * dim + i)];
            const double inv = 1.0 / std::sqrt(ss / double(dim) + 1e-6);
            for (int64_t i = 0; i < dim; ++i) {
                const size_t wi = woff + size_t(i);
                const double w = c.wkind == 0   ? 1.0
                                 : c.wkind == 2 ? double(wf[wi])
                                                : double(mgl::bf16_to_f32(w16[wi]));
                ref[size_t(r * dim + i)] = w * x[size_t(r * dim + i)] * inv;
            }
        }
        DeviceArray<float> dx(x), dy(std::vector<float>(x.size(), NAN)), dwf(wf);
        DeviceArray<uint16_t> dw16(w16);
        kernels::RmsNormParams p{dx.ptr, nullptr, dy.ptr, rows, dim, 1e-6f};
        if (c.wkind == 2) {
            p.w = dwf.ptr;
            p.w_type = mgl::dtype::f32;
        } else if (c.wkind != 0) {
            p.w = dw16.ptr + woff;
            p.w_type = mgl::dtype::bf16;
        }
        kernels::rms_norm(p, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const double err = test::relative_l2(dy.download(), ref);
        CHECK(err < 1e-6);
        worst = std::max(worst, err);
    }
    MESSAGE("rms_norm: worst relative L2 " << worst << " (bound 1e-6)");
}

#endif  // MINIDS_HAVE_CUDA
