// matmul: y = x · Wᵀ with x [..., M, K] f32 and W [N, K] or [B, N, K] (f32 | bf16 | f8_e4m3 with a
// per-row scale). Weights whose rows are contiguous in K (the normal case) run the SIMD row
// kernels; a transposed weight view (N contiguous, e.g. W_uk taken from W_kv_b) runs the
// axpy-style SIMD kernels that still stream the weight once; any other stride runs a plain loop.
#include <vector>

#include "cpu_ops.h"

namespace mgl::cpu {

namespace {

// Fully general strides: one element at a time.
void rows_generic(const matmul_job& j, int64_t n_stride, int64_t k_stride, int64_t n0, int64_t n1) {
    const char* w = reinterpret_cast<const char*>(j.w);
    for (int64_t m = 0; m < j.M; ++m) {
        const float* x = j.x + m * j.x_stride;
        for (int64_t n = n0; n < n1; ++n) {
            float s = 0.0f;
            for (int64_t k = 0; k < j.K; ++k)
                s += x[k] * load_f32(j.type, w + n * n_stride + k * k_stride);
            j.y[m * j.y_stride + n] = s * (j.scale ? j.scale[n] : 1.0f);
        }
    }
}

int64_t min_rows_per_chunk(const matmul_job& j) {
    // Below ~32k multiply-adds per chunk, waking another thread costs more than it saves.
    return std::max<int64_t>(1, 32768 / std::max<int64_t>(j.M * j.K, 1));
}

}  // namespace

void matmul_parallel(exec_context& ex, const matmul_job& job, int64_t N) {
    matmul_rows_fn fn = ex.kernels.for_type(job.type);
    MGL_CHECK(fn != nullptr,
              std::string("matmul: no kernel for weight dtype ") + dtype_name(job.type));
    ex.pool.parallel_for(
        N, [&](int64_t n0, int64_t n1) { fn(job, n0, n1); }, min_rows_per_chunk(job));
}

void run_matmul(exec_context& ex, tensor& node) {
    const tensor& x = *node.src[0];
    const tensor& w = *node.src[1];
    const tensor* w_scale = node.src[2];
    const int xd = x.n_dims, wd = w.n_dims;
    const int64_t K = x.shape[size_t(xd - 1)], M = x.shape[size_t(xd - 2)];
    const int64_t N = w.shape[size_t(wd - 2)], B = wd == 3 ? w.shape[0] : 1;
    const int64_t groups = x.nelements() / std::max<int64_t>(M * K, 1);
    const int64_t elem = int64_t(dtype_size(w.type));
    const int64_t w_k_stride = w.stride[size_t(wd - 1)], w_n_stride = w.stride[size_t(wd - 2)];
    const bool x_rows_contiguous = inner_stride(x) == 4 && x.stride[size_t(xd - 2)] % 4 == 0;

    std::vector<float> x_gathered;
    for (int64_t g = 0; g < groups; ++g) {
        const int64_t b = g % B;
        matmul_job job;
        job.M = M;
        job.K = K;
        job.type = w.type;
        job.w = static_cast<const uint8_t*>(w.data) + b * (wd == 3 ? w.stride[0] : 0);
        job.w_row_stride = w_n_stride;
        job.scale = w_scale ? static_cast<const float*>(w_scale->data) + b * N : nullptr;
        job.y = static_cast<float*>(node.data) + g * M * N;
        job.y_stride = N;
        if (x_rows_contiguous) {
            job.x = reinterpret_cast<const float*>(row_ptr(x, g * M));
            job.x_stride = x.stride[size_t(xd - 2)] / 4;
        } else {
            x_gathered.resize(size_t(M * K));
            for (int64_t m = 0; m < M; ++m) read_row(x, g * M + m, x_gathered.data() + m * K);
            job.x = x_gathered.data();
            job.x_stride = K;
        }
        if (w_k_stride == elem) {
            matmul_parallel(ex, job, N);
        } else if (w_n_stride == elem) {
            matmul_cols_fn cols = ex.kernels.cols_for_type(w.type);
            MGL_CHECK(cols != nullptr, "matmul: no transposed kernel for this weight dtype");
            job.w_row_stride = w_k_stride;
            ex.pool.parallel_for(
                N, [&](int64_t n0, int64_t n1) { cols(job, n0, n1); }, min_rows_per_chunk(job));
        } else {
            ex.pool.parallel_for(
                N,
                [&](int64_t n0, int64_t n1) { rows_generic(job, w_n_stride, w_k_stride, n0, n1); },
                min_rows_per_chunk(job));
        }
    }
}

}  // namespace mgl::cpu
