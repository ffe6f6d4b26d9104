// The copy bandwidths benchmarks measure their floors against (mgl-cuda.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <vector>

#include "cuda_check.h"
#include "mgl-cuda.h"

namespace mgl {

namespace {

// Median milliseconds of `reps` copies of `bytes` from src to dst after `warmup` copies (the
// first ones warm the clocks up), timed with events on the legacy stream.
float median_copy_ms(void* dst, const void* src, size_t bytes, int warmup, int reps) {
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    std::vector<float> ms;
    try {
        CUDA_CHECK(cudaEventCreate(&e0));
        CUDA_CHECK(cudaEventCreate(&e1));
        for (int i = 0; i < warmup + reps; ++i) {
            CUDA_CHECK(cudaEventRecord(e0));
            CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault));
            CUDA_CHECK(cudaEventRecord(e1));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float t = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
            if (i >= warmup) ms.push_back(t);
        }
    } catch (...) {
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
        throw;
    }
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
}

// Runs `body` and then `release`, also when body throws.
template <class Body>
auto finally_release(Body body, const std::function<void()>& release) {
    try {
        auto r = body();
        release();
        return r;
    } catch (...) {
        release();
        throw;
    }
}

}  // namespace

double cuda_copy_bandwidth_gbs() {
    if (!cuda_available()) return 0.0;
    const size_t bytes = size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    return finally_release(
        [&] {
            CUDA_CHECK(cudaMalloc(&a, bytes));
            CUDA_CHECK(cudaMalloc(&b, bytes));
            CUDA_CHECK(cudaMemset(a, 1, bytes));
            const float ms = median_copy_ms(b, a, bytes, 2, 10);
            return 2.0 * double(bytes) / (double(ms) * 1e-3) / 1e9;  // read + written
        },
        [&] {
            cudaFree(a);
            cudaFree(b);
        });
}

double cuda_host_to_device_bandwidth_gbs() {
    if (!cuda_available()) return 0.0;
    const size_t bytes = size_t(256) << 20;
    void *host = nullptr, *dev = nullptr;
    return finally_release(
        [&] {
            CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
            CUDA_CHECK(cudaMalloc(&dev, bytes));
            std::fill_n(static_cast<char*>(host), bytes, char(1));
            const float ms = median_copy_ms(dev, host, bytes, 2, 8);
            return double(bytes) / (double(ms) * 1e-3) / 1e9;
        },
        [&] {
            if (host) cudaFreeHost(host);
            cudaFree(dev);
        });
}

}  // namespace mgl
