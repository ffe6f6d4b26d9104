// The matmul launchers (kernels/matmul.h) against a naive double-precision reference: every path
// (tensor-core gemv with each configuration and split-K, gemv_column, generic, cuBLAS gemm), every
// weight dtype, odd shapes, batched and strided operands, the transposed (column) weight layout,
// the residual epilogue and the RMSNorm prologue. Outputs are poisoned (NaN) so unwritten
// elements and stray writes into padding are caught.
//
// Error bounds (relative L2 of y − residual against the exact product):
//   gemv / gemv_column / generic, and gemm with f32 weights: FP32 accumulate of exact products
//   (the gemv splits x into three 16-bit terms, 24 significant bits): 1e-5.
//   gemm with bf16 / f8 weights: x rounded to BF16 (and f8 weights dequantized to BF16 with the
//   scale folded in): 1e-2 (measured ~2-4e-3 on random data).
//   gemm with split x (a BF16 hi + lo pair, ~16 significant bits) and bf16 weights: 1e-4 (the
//   pair's rounding is ~2^-17 per element); with f8 weights the BF16 dequantization stays: 1e-2.
#ifdef MINIDS_HAVE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "cuda_test_util.h"
#include "matmul.h"
#include "mgl.h"
#include "test_util.h"

using namespace minids;
using kernels::MatmulPath;
using test::DeviceArray;

namespace {

const bool no_gpu = !test::cuda_device_available();

enum class Layout { rows, columns, strided };

struct Case {
    mgl::dtype type = mgl::dtype::bf16;
    int64_t batch = 1, m = 1, n = 37, k = 64;
    Layout layout = Layout::rows;
    int64_t w_pad = 0;       // extra elements per stored weight row
    int64_t w_misalign = 0;  // bytes added to W's base address
    bool w_shared = false;   // one W for every batch (batch stride 0)
    int64_t x_pad = 0;       // extra floats per x row
    int64_t y_pad = 0;       // extra floats per y row (must stay NaN)
    bool residual = false;   // y = x·Wᵀ + residual
    bool in_place = false;   // residual == y
    bool norm = false;       // RMSNorm prologue
    mgl::dtype norm_type = mgl::dtype::bf16;
    bool norm_weight = true;
    bool norm_out = false;  // with norm: also write the normalized rows (MatmulParams::norm_out)
    MatmulPath path = MatmulPath::automatic;
    int config = -1, split = 0;
    int stream_config = -1;  // the stream path's benchmark shapes (M = 1)
    bool split_x = false;    // MatmulParams::split_x
    uint64_t seed = 1;       // W, scales, norm weight
    uint64_t x_seed = 0;     // x and residual (0: derived from seed)

    std::string name() const {
        std::string s = std::string(mgl::dtype_name(type)) + " B" + std::to_string(batch) + " M" +
                        std::to_string(m) + " N" + std::to_string(n) + " K" + std::to_string(k);
        s += layout == Layout::rows ? " rows" : layout == Layout::columns ? " columns" : " strided";
        if (w_pad) s += " w_pad" + std::to_string(w_pad);
        if (w_misalign) s += " w+" + std::to_string(w_misalign) + "B";
        if (w_shared) s += " w_shared";
        if (x_pad) s += " x_pad" + std::to_string(x_pad);
        if (y_pad) s += " y_pad" + std::to_string(y_pad);
        if (residual) s += in_place ? " residual(in place)" : " residual";
        if (norm)
            s += std::string(" norm(") + (norm_weight ? mgl::dtype_name(norm_type) : "-") + ")";
        if (norm_out) s += " norm_out";
        s += std::string(" path ") + kernels::matmul_path_name(path);
        if (config >= 0) s += " cfg " + std::to_string(config);
        if (split_x) s += " split_x";
        if (split) s += " split " + std::to_string(split);
        if (stream_config >= 0) s += " stream " + kernels::matmul_stream_config_name(stream_config);
        return s;
    }
};

// Owns a cuBLAS handle for the test's duration.
struct Cublas {
    cublasHandle_t h = nullptr;
    Cublas() { REQUIRE(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS); }
    ~Cublas() { cublasDestroy(h); }
};

// A zeroed workspace of at least `bytes`.
struct Workspace {
    void* ptr = nullptr;
    size_t bytes = 0;
    explicit Workspace(size_t b) : bytes(b) {
        if (b) {
            CUDA_CHECK(cudaMalloc(&ptr, b));
            CUDA_CHECK(cudaMemset(ptr, 0, b));
        }
    }
    ~Workspace() { cudaFree(ptr); }
    bool counters_zero() const {
        if (!ptr) return true;
        std::vector<int> c(std::min<size_t>(bytes, 64 * 1024) / sizeof(int));
        CUDA_CHECK(cudaMemcpy(c.data(), ptr, c.size() * sizeof(int), cudaMemcpyDeviceToHost));
        for (int v : c)
            if (v != 0) return false;
        return true;
    }
};

// Everything one case needs on the host and the device, and the reference.
struct Problem {
    Case c;
    kernels::MatmulParams p;
    std::vector<uint8_t> w_bytes;
    std::vector<float> x, scale, y0, norm_f32;
    std::vector<uint16_t> norm_bf16;
    std::vector<double> product;      // exact x̂ · W_realᵀ per valid output
    std::vector<size_t> y_index;      // where each valid output lives in y
    std::vector<double> residual_at;  // residual per valid output
    std::vector<float> residual;      // y's layout, NaN in the padding
    std::vector<uint8_t> y_valid;     // 1 where y holds an output
    std::vector<double> w_dec;        // W_real [B or 1, N, K]
    std::vector<double> normed;       // with norm: x̂ [M, K] of batch 0 (for norm_out)
};

Problem make_problem(const Case& c) {
    Problem pr;
    pr.c = c;
    const int64_t e = int64_t(mgl::dtype_size(c.type));
    const int64_t wb = c.w_shared ? 1 : c.batch;
    // W storage
    int64_t rs = 0, cs = 0, bs = 0;
    if (c.layout == Layout::rows) {
        cs = e;
        rs = (c.k + c.w_pad) * e;
        bs = c.n * rs + 16;
    } else if (c.layout == Layout::columns) {
        rs = e;
        cs = (c.n + c.w_pad) * e;
        bs = c.k * cs + 16;
    } else {  // every other element of a [N, K, 2] buffer
        cs = 2 * e;
        rs = (2 * c.k + c.w_pad) * e;
        bs = c.n * rs + 16;
    }
    pr.w_bytes.assign(size_t(c.w_misalign + bs * wb + 64), 0x7f);  // 0x7f: NaN in e4m3
    auto wf = test::random_floats(size_t(wb * c.n * c.k), c.seed);
    pr.scale = test::random_floats(size_t(wb * c.n), c.seed + 1, 0.5f, 2.0f);
    std::vector<double> wdec(wf.size());
    for (int64_t b = 0; b < wb; ++b)
        for (int64_t n = 0; n < c.n; ++n)
            for (int64_t k = 0; k < c.k; ++k) {
                const size_t i = size_t((b * c.n + n) * c.k + k);
                uint8_t* dst = pr.w_bytes.data() + c.w_misalign + b * bs + n * rs + k * cs;
                if (c.type == mgl::dtype::f32) {
                    std::memcpy(dst, &wf[i], 4);
                    wdec[i] = wf[i];
                } else if (c.type == mgl::dtype::bf16) {
                    const uint16_t h = mgl::f32_to_bf16(wf[i]);
                    std::memcpy(dst, &h, 2);
                    wdec[i] = mgl::bf16_to_f32(h);
                } else {
                    *dst = mgl::f32_to_e4m3(wf[i] * 400.0f);
                    wdec[i] = double(mgl::e4m3_to_f32(*dst)) * pr.scale[size_t(b * c.n + n)];
                }
            }
    // x, norm weight, y
    const int64_t xrs = c.k + c.x_pad, xbs = c.m * xrs + 3;
    const uint64_t xs = c.x_seed ? c.x_seed : c.seed + 2;
    pr.x = test::random_floats(size_t(c.batch * xbs), xs, -2.0f, 2.0f);
    auto nwf = test::random_floats(size_t(c.k), c.seed + 3, 0.5f, 1.5f);
    pr.norm_f32 = nwf;
    pr.norm_bf16.resize(nwf.size());
    for (size_t i = 0; i < nwf.size(); ++i) pr.norm_bf16[i] = mgl::f32_to_bf16(nwf[i]);
    const int64_t yrs = c.n + c.y_pad, ybs = c.m * yrs + 5;
    const size_t y_size = size_t(c.batch * ybs);
    pr.y0.assign(y_size, NAN);
    pr.y_valid.assign(y_size, 0);
    pr.residual.assign(y_size, NAN);
    const auto res = test::random_floats(y_size, xs + 1, -3.0f, 3.0f);
    for (int64_t b = 0; b < c.batch; ++b)
        for (int64_t m = 0; m < c.m; ++m) {
            const float* xr = pr.x.data() + b * xbs + m * xrs;
            double inv = 1.0;
            if (c.norm) {
                double ss = 0;
                for (int64_t k = 0; k < c.k; ++k) ss += double(xr[k]) * xr[k];
                inv = 1.0 / std::sqrt(ss / double(c.k) + 1e-6);
            }
            for (int64_t n = 0; n < c.n; ++n) {
                const double* wr = wdec.data() + ((c.w_shared ? 0 : b) * c.n + n) * c.k;
                double acc = 0;
                for (int64_t k = 0; k < c.k; ++k) {
                    double xv = xr[k];
                    if (c.norm) {
                        const double g = !c.norm_weight ? 1.0
                                         : c.norm_type == mgl::dtype::f32
                                             ? double(nwf[size_t(k)])
                                             : mgl::bf16_to_f32(pr.norm_bf16[size_t(k)]);
                        xv *= inv * g;
                    }
                    if (c.norm && b == 0 && n == 0) pr.normed.push_back(xv);
                    acc += xv * wr[k];
                }
                const size_t at = size_t(b * ybs + m * yrs + n);
                pr.product.push_back(acc);
                pr.y_index.push_back(at);
                pr.residual_at.push_back(c.residual ? res[at] : 0.0);
                pr.y_valid[at] = 1;
                if (c.residual && c.in_place) pr.y0[at] = res[at];
                if (c.residual) pr.residual[at] = res[at];
            }
        }
    pr.w_dec = wdec;
    pr.p.batch = c.batch;
    pr.p.m = c.m;
    pr.p.n = c.n;
    pr.p.k = c.k;
    pr.p.x_row_stride = xrs;
    pr.p.x_batch_stride = xbs;
    pr.p.w_type = c.type;
    pr.p.w_row_stride = rs;
    pr.p.w_col_stride = cs;
    pr.p.w_batch_stride = c.w_shared ? 0 : bs;
    pr.p.w_scale_batch_stride = c.w_shared ? 0 : c.n;
    pr.p.y_row_stride = yrs;
    pr.p.y_batch_stride = ybs;
    pr.p.rms_norm = c.norm;
    pr.p.norm_w_type = c.norm_type;
    pr.p.norm_eps = 1e-6f;
    pr.p.path = c.path;
    pr.p.gemv_config = c.config;
    pr.p.gemv_split = c.split;
    pr.p.stream_config = c.stream_config;
    pr.p.split_x = c.split_x;
    return pr;
}

bool gemm_bf16(const kernels::MatmulParams& p) {
    const bool gemm =
        p.path == MatmulPath::gemm ||
        (p.path == MatmulPath::automatic && kernels::matmul_choose_path(p) == MatmulPath::gemm);
    return gemm && p.w_type != mgl::dtype::f32;
}

// Runs the case (twice, so split-K counters are seen to reset) and checks it. Returns the error.
double run_case(const Case& c, const Cublas& blas) {
    Problem pr = make_problem(c);
    INFO(c.name());
    DeviceArray<uint8_t> dw(pr.w_bytes);
    DeviceArray<float> dx(pr.x), dscale(pr.scale), dy(pr.y0), dnorm(pr.norm_f32);
    DeviceArray<uint16_t> dnorm16(pr.norm_bf16);
    DeviceArray<float> dres(pr.residual);
    kernels::MatmulParams p = pr.p;
    p.w = dw.ptr + c.w_misalign;
    p.x = dx.ptr;
    p.y = dy.ptr;
    p.w_scale = c.type == mgl::dtype::f8_e4m3 ? dscale.ptr : nullptr;
    if (c.residual) p.residual = c.in_place ? dy.ptr : dres.ptr;
    if (c.norm && c.norm_weight)
        p.norm_w = c.norm_type == mgl::dtype::f32 ? static_cast<const void*>(dnorm.ptr)
                                                  : static_cast<const void*>(dnorm16.ptr);
    // norm_out: M rows of K, a pad of 3 floats that must stay NaN.
    DeviceArray<float> dnorm_out(std::vector<float>(size_t(c.m * (c.k + 3)), NAN));
    if (c.norm_out) {
        p.norm_out = dnorm_out.ptr;
        p.norm_out_row_stride = c.k + 3;
    }
    INFO(kernels::matmul_describe(p));
    Workspace ws(kernels::matmul_workspace_bytes(p));
    const kernels::MatmulResources r{blas.h, ws.ptr, ws.bytes};
    double err = 0;
    for (int rep = 0; rep < 2; ++rep) {
        if (rep == 1) dy.upload(pr.y0);
        kernels::matmul(p, r, nullptr);
        CUDA_CHECK(cudaDeviceSynchronize());
        const auto y = dy.download();
        size_t non_finite = 0, stray = 0;
        std::vector<float> got(pr.product.size());
        for (size_t i = 0; i < pr.product.size(); ++i) {
            const float v = y[pr.y_index[i]];
            if (!std::isfinite(v)) ++non_finite;
            got[i] = float(double(v) - pr.residual_at[i]);
        }
        for (size_t i = 0; i < y.size(); ++i)
            if (!pr.y_valid[i] && !std::isnan(y[i])) ++stray;
        CHECK(non_finite == 0);
        CHECK(stray == 0);
        err = test::relative_l2(got, pr.product);
        const double bound = !gemm_bf16(p)                               ? 1e-5
                             : p.split_x && p.w_type == mgl::dtype::bf16 ? 1e-4
                                                                         : 1e-2;
        INFO("relative L2 " << err << " bound " << bound);
        CHECK(err < bound);
        CHECK(ws.counters_zero());
        if (c.norm_out) {
            const auto no = dnorm_out.download();
            std::vector<float> got_n;
            size_t pad_touched = 0;
            for (int64_t m = 0; m < c.m; ++m) {
                for (int64_t k = 0; k < c.k; ++k) got_n.push_back(no[size_t(m * (c.k + 3) + k)]);
                for (int64_t k = c.k; k < c.k + 3; ++k)
                    if (!std::isnan(no[size_t(m * (c.k + 3) + k)])) ++pad_touched;
            }
            const double en = test::relative_l2(got_n, pr.normed);
            INFO("norm_out relative L2 " << en);
            CHECK(en < 1e-6);
            CHECK(pad_touched == 0);
        }
    }
    return err;
}

}  // namespace

TEST_CASE("cuda matmul stream plan 2 (the default): the sweep's shapes (host only)") {
    std::vector<uint8_t> dummy(64);
    uint8_t* aligned = dummy.data() + 16 - reinterpret_cast<uintptr_t>(dummy.data()) % 16;
    float* f = reinterpret_cast<float*>(aligned);
    // Plan 2 decides these two classes without asking the device (so: no GPU needed here).
    auto down = kernels::matmul_params_contiguous(mgl::dtype::bf16, aligned, nullptr, f, f, 1, 1,
                                                  2048, 10944);
    down.stream_plan = 2;
    CHECK(kernels::matmul_describe(down) == "stream w4 u4 r2");
    auto w_uv = kernels::matmul_params_contiguous(mgl::dtype::bf16, aligned, nullptr, f, f, 16, 1,
                                                  128, 512);
    w_uv.stream_plan = 2;
    CHECK(kernels::matmul_describe(w_uv) == "stream w8 u4 r1");
    CHECK(kernels::matmul_params_contiguous(mgl::dtype::bf16, aligned, nullptr, f, f, 1, 1, 2048,
                                            10944)
              .stream_plan == 2);  // what production gets
    down.stream_plan = 1;          // MINIDS_STREAM_PLAN=1: the rules before the sweep
    CHECK(kernels::matmul_describe(down) == "stream w4 u4 r4");
}

TEST_CASE("cuda matmul chooses the path by M, dtype and layout") {
    std::vector<uint8_t> dummy(64);
    uint8_t* aligned = dummy.data() + 16 - reinterpret_cast<uintptr_t>(dummy.data()) % 16;
    float* f = reinterpret_cast<float*>(aligned);
    auto p = kernels::matmul_params_contiguous(mgl::dtype::bf16, aligned, nullptr, f, f, 1, 1, 2048,
                                               2048);
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::stream);
    p.m = 8;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::stream);
    p.m = 9;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemv);
    p.m = kernels::matmul_gemv_max_m();
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemv);
    p.m = kernels::matmul_gemv_max_m() + 1;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemm);
    p.n = 64;  // a router: narrow products stay FP32 (cuBLAS's FP32 GEMM) however many rows
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemm_f32);
    p.batch = 16;  // MLA's per-head W_uv for a prompt: a batched GEMM
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemm);
    p.batch = 1;
    p.n = 2048;
    p.m = 1;
    p.k = 2047;  // rows are no whole number of 16-byte chunks
    p.w_row_stride = 2047 * 2;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::generic);
    p.k = 128;  // MLA's W_uk: stored [K, N], viewed [N, K]
    p.w_row_stride = 2;
    p.w_col_stride = 2048 * 2;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::gemv_column);
    p.w_type = mgl::dtype::f32;
    p.w_row_stride = 128 * 4;
    p.w_col_stride = 4;
    CHECK(kernels::matmul_choose_path(p) == MatmulPath::generic);
}

TEST_CASE("cuda matmul rejects invalid params with a clear error") {
    kernels::MatmulParams p;
    p.n = 4;
    p.k = 8;
    CHECK_THROWS_AS(kernels::matmul(p, {}, nullptr), mgl::error);  // no x, w, y
    float f = 0;
    uint16_t w[32] = {};
    p = kernels::matmul_params_contiguous(mgl::dtype::bf16, w, &f, &f, &f, 1, 1, 4, 8);
    CHECK_THROWS_AS(kernels::matmul(p, {}, nullptr), mgl::error);  // scale on a bf16 weight
    p.w_scale = nullptr;
    p.m = 2;
    p.y_row_stride = 3;  // rows of y overlap
    CHECK_THROWS_AS(kernels::matmul(p, {}, nullptr), mgl::error);
    p.y_row_stride = 4;
    p.w_type = mgl::dtype::f16;
    CHECK_THROWS_AS(kernels::matmul(p, {}, nullptr), mgl::error);
}

TEST_CASE("cuda matmul every dtype and M on the automatic path" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 100;
    for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {1, 2, 3, 5, 8, 17, 64, 200}) {
            Case c;
            c.type = t;
            c.m = m;
            c.n = 301;  // odd, not a multiple of any row block
            c.k = 512;
            c.seed = seed++;
            run_case(c, blas);
            c.k = 77;  // odd K: no whole 16-byte chunks
            c.n = 45;
            c.seed = seed++;
            run_case(c, blas);
        }
}

TEST_CASE("cuda matmul gemv: every kernel configuration and split-K" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 200;
    for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int cfg = 0; cfg < kernels::matmul_gemv_config_count(); ++cfg)
            for (int split : {1, 3, 8})
                for (int64_t m : {1, 5, 16}) {
                    Case c;
                    c.type = t;
                    c.m = m;
                    c.n = 203;
                    c.k = 1024 + 64;  // not a multiple of every split's share
                    c.path = MatmulPath::gemv;
                    c.config = cfg;
                    c.split = split;
                    c.seed = seed++;
                    run_case(c, blas);
                }
}

TEST_CASE("cuda matmul stream gemv: dtypes, M, batches, strides, residual, norm" *
          doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 250;
    for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {1, 2, 3, 5, 8})
            for (int64_t k : {16 * 3, 1024 + 64, 2048, 10944})
                for (int variant = 0; variant < 4; ++variant) {
                    Case c;
                    c.type = t;
                    c.m = m;
                    c.n = variant == 3 ? 1 : 203;
                    c.k = k;
                    c.batch = variant == 1 ? 3 : 1;
                    c.w_shared = variant == 2;
                    c.x_pad = variant == 1 ? 4 : 0;
                    c.y_pad = variant == 2 ? 3 : 0;
                    c.residual = variant >= 2;
                    c.in_place = variant == 3;
                    c.norm = variant == 1 || variant == 3;
                    c.norm_type = variant == 1 ? mgl::dtype::f32 : mgl::dtype::bf16;
                    // x batches 3 floats apart are not 16-byte aligned: the chooser takes the
                    // tensor-core gemv there, so that variant runs automatic.
                    c.path = variant == 1 ? MatmulPath::automatic : MatmulPath::stream;
                    c.seed = seed++;
                    run_case(c, blas);
                }
}

TEST_CASE("cuda matmul stream gemv: every benchmark shape (warps, loads in flight, rows)" *
          doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 300;
    for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int cfg = 0; cfg < kernels::matmul_stream_config_count(); ++cfg)
            for (int variant = 0; variant < 3; ++variant) {
                Case c;
                c.type = t;
                c.n = variant == 2 ? 5 : 203;  // fewer rows than one block's warps
                c.k = variant == 0 ? 2048 : 16 * 3 + 1024;
                // Three batches (MLA's per-head products): the harness adds 3 floats between x
                // batches, so a 1-float row pad keeps each batch 16-byte aligned, as the stream
                // path needs (1073 + 3 = 1076 floats apart).
                c.batch = variant == 1 ? 3 : 1;
                c.x_pad = variant == 1 ? 1 : 0;
                c.residual = variant != 0;
                c.norm = variant != 2;
                c.path = MatmulPath::stream;
                c.stream_config = cfg;
                c.seed = seed++;
                run_case(c, blas);
            }
}

TEST_CASE("cuda matmul norm_out: the normalized rows, from the stream kernel or a norm launch" *
          doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 700;
    for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {1, 3, 12})  // 12 rows: not the stream path, so rms_norm runs first
            for (int64_t k : {2048, 1072})
                for (int w : {0, 1, 2}) {  // norm weight f32, bf16, none
                    Case c;
                    c.type = t;
                    c.m = m;
                    c.n = 64;  // the router's shape
                    c.k = k;
                    c.norm = true;
                    c.norm_out = true;
                    c.norm_weight = w != 2;
                    c.norm_type = w == 0 ? mgl::dtype::f32 : mgl::dtype::bf16;
                    c.residual = w == 1;
                    c.seed = seed++;
                    run_case(c, blas);
                }
}

TEST_CASE("cuda matmul gemv: V2-Lite shapes, automatic plan" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 300;
    const int64_t shapes[][2] = {{576, 2048},  {2048, 10944}, {64, 2048},
                                 {1408, 2048}, {2048, 1408},  {3648, 2048}};
    for (auto s : shapes)
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
            for (int64_t m : {1, 8}) {
                Case c;
                c.type = t;
                c.m = m;
                c.n = s[0];
                c.k = s[1];
                c.seed = seed++;
                run_case(c, blas);
            }
}

TEST_CASE("cuda matmul batched, strided and shared weights" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 400;
    for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {1, 3, 17, 64}) {
            Case c;
            c.type = t;
            c.batch = 5;
            c.m = m;
            c.n = 131;
            c.k = 128;
            c.x_pad = 7;  // x rows and batches strided
            c.y_pad = 3;  // y rows strided (padding must stay NaN)
            c.w_pad = 16;
            c.seed = seed++;
            run_case(c, blas);
            c.w_shared = true;
            c.seed = seed++;
            run_case(c, blas);
        }
}

TEST_CASE("cuda matmul transposed (column) and other weight layouts" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 500;
    for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {1, 2, 5, 8, 17, 64, 200}) {
            Case c;  // MLA's q_nope · W_uk: 16 heads, W stored [H, nope, r], viewed [H, r, nope]
            c.type = t;
            c.batch = 4;
            c.m = m;
            c.n = 512 + 3;
            c.k = 128 + 1;
            c.layout = Layout::columns;
            c.seed = seed++;
            run_case(c, blas);
            c.w_pad = 5;  // row of N not vector-aligned
            c.seed = seed++;
            run_case(c, blas);
            c.layout = Layout::strided;
            c.n = 67;
            c.seed = seed++;
            run_case(c, blas);
            c.layout = Layout::rows;  // misaligned base: generic / materialized gemm
            c.w_pad = 0;
            c.k = 96;
            c.w_misalign = t == mgl::dtype::f8_e4m3 ? 3 : 1;
            c.seed = seed++;
            run_case(c, blas);
        }
    // Every path on the same column-layout problem, including ones the chooser would not take.
    for (MatmulPath path :
         {MatmulPath::gemv_column, MatmulPath::generic, MatmulPath::gemm, MatmulPath::gemm_f32}) {
        Case c;
        c.type = mgl::dtype::bf16;
        c.batch = 3;
        c.m = 4;
        c.n = 300;
        c.k = 70;
        c.layout = Layout::columns;
        c.path = path;
        c.seed = seed++;
        run_case(c, blas);
    }
}

TEST_CASE("cuda matmul: a prompt's router (M > 16, N 64) is FP32-exact on cuBLAS's FP32 GEMM" *
          doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 900;
    for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {17, 512}) {
            Case c;  // the automatic path picks gemm_f32; run_case holds it to 1e-5
            c.type = t;
            c.m = m;
            c.n = 64;
            c.k = 2048;
            c.norm = m == 512;  // the folded RMSNorm of the prompt's ffn_norm
            c.seed = seed++;
            run_case(c, blas);
            c.w_misalign = t == mgl::dtype::f8_e4m3 ? 3 : 2;  // materialized from any address
            c.x_pad = 3;
            c.seed = seed++;
            run_case(c, blas);
        }
}

TEST_CASE("cuda matmul residual epilogue and RMSNorm prologue" * doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 600;
    for (MatmulPath path :
         {MatmulPath::automatic, MatmulPath::generic, MatmulPath::gemm, MatmulPath::gemm_f32})
        for (mgl::dtype t : {mgl::dtype::f32, mgl::dtype::bf16, mgl::dtype::f8_e4m3})
            for (int64_t m : {1, 5, 17}) {
                Case c;
                c.type = t;
                c.batch = 2;
                c.m = m;
                c.n = 150;
                c.k = 2048;
                c.y_pad = 2;
                c.path = path;
                c.residual = true;
                c.seed = seed++;
                run_case(c, blas);
                c.in_place = true;
                c.seed = seed++;
                run_case(c, blas);
                c.residual = false;
                c.norm = true;
                c.seed = seed++;
                run_case(c, blas);
                c.norm_type = mgl::dtype::f32;
                c.residual = true;
                c.seed = seed++;
                run_case(c, blas);
                c.norm_weight = false;
                c.seed = seed++;
                run_case(c, blas);
                c.layout = Layout::columns;  // the fusions on the transposed layout too
                c.seed = seed++;
                run_case(c, blas);
            }
}

TEST_CASE("cuda matmul gemm with split x: batches, layouts, residual, norm, chunks" *
          doctest::skip(no_gpu)) {
    Cublas blas;
    uint64_t seed = 800;
    double worst_bf16 = 0;
    for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3})
        for (int64_t m : {17, 64, 300}) {
            Case c;
            c.type = t;
            c.batch = 2;
            c.m = m;
            c.n = 150;
            c.k = 2048;
            c.path = MatmulPath::gemm;
            c.split_x = true;
            c.residual = true;
            c.seed = seed++;
            double e = run_case(c, blas);
            c.in_place = true;
            c.norm = true;
            c.seed = seed++;
            e = std::max(e, run_case(c, blas));
            c.layout = Layout::columns;
            c.seed = seed++;
            e = std::max(e, run_case(c, blas));
            c.layout = Layout::rows;
            c.w_shared = true;
            c.seed = seed++;
            e = std::max(e, run_case(c, blas));
            if (t == mgl::dtype::bf16) worst_bf16 = std::max(worst_bf16, e);
        }
    Case big;  // dequantized in chunks, each GEMM split
    big.type = mgl::dtype::f8_e4m3;
    big.m = 20;
    big.n = 40000;
    big.k = 1024;
    big.residual = true;
    big.split_x = true;
    big.seed = seed++;
    run_case(big, blas);
    MESSAGE("gemm with split x, bf16 weights: worst relative L2 " << worst_bf16 << " (bound 1e-4)");
}

TEST_CASE("cuda matmul gemm dequantizes large f8 weights in chunks" * doctest::skip(no_gpu)) {
    Cublas blas;
    Case c;  // 40000 x 1024 bf16 = 78 MiB dequantized: more than one 64 MiB chunk
    c.type = mgl::dtype::f8_e4m3;
    c.m = 20;
    c.n = 40000;
    c.k = 1024;
    c.residual = true;
    c.seed = 700;
    run_case(c, blas);
    c.batch = 2;  // batched weights, each in chunks
    c.n = 33000;
    c.seed = 701;
    run_case(c, blas);
}

TEST_CASE("cuda matmul replays from a captured CUDA graph" * doctest::skip(no_gpu)) {
    // gemv with split-K and gemm (cuBLAS) captured once, replayed with new inputs: the kernels
    // must not allocate or synchronize, and the split-K counters must reset between replays.
    Cublas blas;
    void* cublas_ws = nullptr;
    CUDA_CHECK(cudaMalloc(&cublas_ws, size_t(32) << 20));
    REQUIRE(cublasSetWorkspace(blas.h, cublas_ws, size_t(32) << 20) == CUBLAS_STATUS_SUCCESS);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    for (int64_t m : {1, 40}) {
        Case c;
        c.type = mgl::dtype::bf16;
        c.m = m;
        c.n = 1000;
        c.k = 2048;
        c.residual = true;
        c.norm = true;
        c.split = m == 1 ? 4 : 0;
        c.seed = 800;
        const Problem first = make_problem(c);
        INFO(c.name());
        DeviceArray<uint8_t> dw(first.w_bytes);
        DeviceArray<float> dx(first.x), dy(first.y0), dres(first.residual);
        DeviceArray<uint16_t> dnorm(first.norm_bf16);
        kernels::MatmulParams p = first.p;
        p.w = dw.ptr;
        p.x = dx.ptr;
        p.y = dy.ptr;
        p.residual = dres.ptr;
        p.norm_w = dnorm.ptr;
        Workspace ws(kernels::matmul_workspace_bytes(p));
        INFO(kernels::matmul_describe(p));
        cudaGraph_t graph;
        CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        kernels::matmul(p, {blas.h, ws.ptr, ws.bytes}, stream);
        CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
        cudaGraphExec_t exec;
        CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
        for (uint64_t step = 0; step < 3; ++step) {
            Case next = c;  // same weights, new x and residual
            next.x_seed = 900 + step * 10 + uint64_t(m);
            const Problem pr = make_problem(next);
            dx.upload(pr.x);
            dy.upload(pr.y0);
            dres.upload(pr.residual);
            CUDA_CHECK(cudaGraphLaunch(exec, stream));
            CUDA_CHECK(cudaStreamSynchronize(stream));
            const auto y = dy.download();
            std::vector<float> got(pr.product.size());
            for (size_t i = 0; i < got.size(); ++i)
                got[i] = float(double(y[pr.y_index[i]]) - pr.residual_at[i]);
            const double err = test::relative_l2(got, pr.product);
            INFO("step " << step << " relative L2 " << err);
            CHECK(err < (m > kernels::matmul_gemv_max_m() ? 1e-2 : 1e-5));
            CHECK(ws.counters_zero());
        }
        CUDA_CHECK(cudaGraphExecDestroy(exec));
        CUDA_CHECK(cudaGraphDestroy(graph));
    }
    CUDA_CHECK(cudaStreamDestroy(stream));
    cudaFree(cublas_ws);
}
TEST_CASE("cuda matmul with PDL waits for the kernel that produces x" * doctest::skip(no_gpu)) {
    // y1 = W1 · x (45 MB of weights: long enough that an early read of y1 would see NaN), then
    // y2 = W2 · y1, both launched with programmatic dependent launch, eagerly and from a graph.
    Cublas blas;
    Case c1;
    c1.n = 2048;
    c1.k = 10944;
    c1.seed = 1000;
    Case c2;
    c2.n = 64;
    c2.k = 2048;
    c2.residual = true;
    c2.seed = 1010;
    const Problem first = make_problem(c1), second = make_problem(c2);
    DeviceArray<uint8_t> dw1(first.w_bytes), dw2(second.w_bytes);
    DeviceArray<float> dx(first.x), dy1(first.y0), dy2(second.y0), dres(second.residual);
    kernels::MatmulParams p1 = first.p, p2 = second.p;
    p1.w = dw1.ptr;
    p1.x = dx.ptr;
    p1.y = dy1.ptr;
    p2.w = dw2.ptr;
    p2.x = dy1.ptr;
    p2.y = dy2.ptr;
    p2.residual = dres.ptr;
    p1.pdl = p2.pdl = true;
    Workspace ws1(kernels::matmul_workspace_bytes(p1)), ws2(kernels::matmul_workspace_bytes(p2));
    // Reference: W2 · (W1 · x) + residual from the exact y1.
    std::vector<double> want(size_t(c2.n));
    for (int64_t n = 0; n < c2.n; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < c2.k; ++k)
            acc += second.w_dec[size_t(n * c2.k + k)] * first.product[size_t(k)];
        want[size_t(n)] = acc;
    }
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto launch_both = [&] {
        kernels::matmul(p1, {blas.h, ws1.ptr, ws1.bytes}, stream);
        kernels::matmul(p2, {blas.h, ws2.ptr, ws2.bytes}, stream);
    };
    auto check = [&](const char* how) {
        INFO(how);
        const auto y = dy2.download();
        std::vector<float> got(size_t(c2.n));
        for (size_t i = 0; i < got.size(); ++i)
            got[i] = float(double(y[second.y_index[i]]) - second.residual_at[i]);
        const double err = test::relative_l2(got, want);
        INFO("relative L2 " << err);
        CHECK(err < 2e-5);
        CHECK(ws1.counters_zero());
        CHECK(ws2.counters_zero());
    };
    for (int rep = 0; rep < 3; ++rep) {
        dy1.upload(first.y0);  // NaN
        dy2.upload(second.y0);
        launch_both();
        CUDA_CHECK(cudaStreamSynchronize(stream));
        check("eager");
    }
    cudaGraph_t graph;
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch_both();
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    cudaGraphExec_t exec;
    CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
        dy1.upload(first.y0);
        dy2.upload(second.y0);
        CUDA_CHECK(cudaGraphLaunch(exec, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));
        check("graph");
    }
    CUDA_CHECK(cudaGraphExecDestroy(exec));
    CUDA_CHECK(cudaGraphDestroy(graph));
    CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif  // MINIDS_HAVE_CUDA
