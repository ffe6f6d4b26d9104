// GPU batch-1 matvec benchmark: y = x · Wᵀ for V2-Lite shapes, BF16 and FP8 (+ row scales),
// timed with CUDA events after warm-up, median of repeats. Each repeat reads a different copy of
// W (rotating through enough copies to exceed the L2), so the figure is HBM bandwidth, not cache.
// Reports GB/s of weight bytes against the floor (weight bytes ÷ measured copy bandwidth).
#include <cstdio>
#include <vector>

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime_api.h>

#include <algorithm>

#include "cuda_check.h"
#include "matvec.h"

using namespace minids::kernels;

namespace {

float median(std::vector<float> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// Device-to-device copy bandwidth (bytes read + written) over a 2 GiB buffer: the ceiling.
double copy_bandwidth_gbs() {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CUDA_CHECK(cudaMalloc(&a, bytes));
    CUDA_CHECK(cudaMalloc(&b, bytes));
    CUDA_CHECK(cudaMemset(a, 1, bytes));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    for (int i = 0; i < 12; ++i) {
        CUDA_CHECK(cudaEventRecord(e0));
        CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
        CUDA_CHECK(cudaEventRecord(e1));
        CUDA_CHECK(cudaEventSynchronize(e1));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
        if (i >= 2) ms.push_back(t);
    }
    cudaFree(a);
    cudaFree(b);
    return 2.0 * double(bytes) / (median(ms) * 1e-3) / 1e9;
}

}  // namespace

int main() {
    const double ceiling = copy_bandwidth_gbs();
    std::printf("device copy bandwidth (read+write): %.0f GB/s\n\n", ceiling);
    std::printf("| shape [N, K] | dtype | weight MB | median us | GB/s | of copy bw |\n");
    std::printf("|---|---|---|---|---|---|\n");
    const long shapes[][2] = {
        {2048, 1408}, {1408, 2048}, {2048, 3072}, {102400, 2048}, {10944, 2048}};
    for (auto s : shapes) {
        for (mgl::dtype t : {mgl::dtype::bf16, mgl::dtype::f8_e4m3}) {
            const size_t n = size_t(s[0]), k = size_t(s[1]);
            const size_t wbytes = n * k * (t == mgl::dtype::bf16 ? 2 : 1);
            const int copies = int(std::max<size_t>(1, (size_t(256) << 20) / wbytes + 1));
            std::vector<void*> w(static_cast<size_t>(copies));
            for (auto& p : w) {
                CUDA_CHECK(cudaMalloc(&p, wbytes));
                CUDA_CHECK(cudaMemset(p, 0x3c, wbytes));  // finite values in both dtypes
            }
            float *x, *y, *scale;
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&x), k * 4));
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&y), n * 4));
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&scale), n * 4));
            CUDA_CHECK(cudaMemset(x, 0x3c, k * 4));
            CUDA_CHECK(cudaMemset(scale, 0x3c, n * 4));
            MatvecParams p;
            p.type = t;
            p.w_scale = scale;
            p.x = x;
            p.y = y;
            p.n = int64_t(n);
            p.k = int64_t(k);
            cudaEvent_t e0, e1;
            CUDA_CHECK(cudaEventCreate(&e0));
            CUDA_CHECK(cudaEventCreate(&e1));
            std::vector<float> us;
            for (int i = 0; i < 60; ++i) {
                p.w = w[size_t(i % copies)];
                CUDA_CHECK(cudaEventRecord(e0));
                matvec(p, nullptr);
                CUDA_CHECK(cudaEventRecord(e1));
                CUDA_CHECK(cudaEventSynchronize(e1));
                float ms;
                CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
                if (i >= 10) us.push_back(ms * 1000.0f);
            }
            const double med = median(us);
            const double gbs = double(wbytes) / (med * 1e-6) / 1e9;
            std::printf("| %zu x %zu | %s | %.1f | %.1f | %.0f | %.0f%% |\n", n, k,
                        t == mgl::dtype::bf16 ? "bf16" : "f8_e4m3", double(wbytes) / 1e6, med, gbs,
                        100.0 * gbs / ceiling);
            for (auto q : w) cudaFree(q);
            cudaFree(x);
            cudaFree(y);
            cudaFree(scale);
            cudaEventDestroy(e0);
            cudaEventDestroy(e1);
        }
    }
    return 0;
}
#else
int main() {
    std::fprintf(stderr, "bench_matvec_cuda: built without CUDA\n");
    return 1;
}
#endif
