// Helpers for the CUDA kernel tests (built only with MINIDS_HAVE_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "cuda_check.h"

namespace minids::test {

// Device copy of a host vector, freed when the object goes out of scope.
template <typename T>
struct DeviceArray {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceArray(const std::vector<T>& host) : n(host.size()) {
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(T)));
        if (n) CUDA_CHECK(cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    ~DeviceArray() { cudaFree(ptr); }
    DeviceArray(const DeviceArray&) = delete;
    DeviceArray& operator=(const DeviceArray&) = delete;
    std::vector<T> download() const {
        std::vector<T> host(n);
        if (n) CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
    void upload(const std::vector<T>& host) {
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), std::min(n, host.size()) * sizeof(T),
                              cudaMemcpyHostToDevice));
    }
};

}  // namespace minids::test
