// The device copy bandwidth benchmarks measure their floors against (mgl-cuda.h).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "cuda_check.h"
#include "mgl-cuda.h"

namespace mgl {

double cuda_copy_bandwidth_gbs() {
    if (!cuda_available()) return 0.0;
    const size_t bytes = size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    std::vector<float> ms;
    try {
        CUDA_CHECK(cudaMalloc(&a, bytes));
        CUDA_CHECK(cudaMalloc(&b, bytes));
        CUDA_CHECK(cudaMemset(a, 1, bytes));
        CUDA_CHECK(cudaEventCreate(&e0));
        CUDA_CHECK(cudaEventCreate(&e1));
        for (int i = 0; i < 12; ++i) {
            CUDA_CHECK(cudaEventRecord(e0));
            CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice));
            CUDA_CHECK(cudaEventRecord(e1));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float t = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
            if (i >= 2) ms.push_back(t);  // the first copies warm the clocks up
        }
    } catch (...) {
        cudaFree(a);
        cudaFree(b);
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
        throw;
    }
    cudaFree(a);
    cudaFree(b);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    std::sort(ms.begin(), ms.end());
    return 2.0 * double(bytes) / (double(ms[ms.size() / 2]) * 1e-3) / 1e9;
}

double cuda_host_to_device_bandwidth_gbs() {
    if (!cuda_available()) return 0.0;
    const size_t bytes = size_t(256) << 20;
    void *host = nullptr, *dev = nullptr;
    cudaEvent_t e0 = nullptr, e1 = nullptr;
    std::vector<float> ms;
    auto release = [&] {
        if (host) cudaFreeHost(host);
        if (dev) cudaFree(dev);
        if (e0) cudaEventDestroy(e0);
        if (e1) cudaEventDestroy(e1);
    };
    try {
        CUDA_CHECK(cudaHostAlloc(&host, bytes, cudaHostAllocDefault));
        CUDA_CHECK(cudaMalloc(&dev, bytes));
        std::fill_n(static_cast<char*>(host), bytes, char(1));
        CUDA_CHECK(cudaEventCreate(&e0));
        CUDA_CHECK(cudaEventCreate(&e1));
        for (int i = 0; i < 10; ++i) {
            CUDA_CHECK(cudaEventRecord(e0));
            CUDA_CHECK(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice));
            CUDA_CHECK(cudaEventRecord(e1));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float t = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
            if (i >= 2) ms.push_back(t);
        }
    } catch (...) {
        release();
        throw;
    }
    release();
    std::sort(ms.begin(), ms.end());
    return double(bytes) / (double(ms[ms.size() / 2]) * 1e-3) / 1e9;
}

}  // namespace mgl
