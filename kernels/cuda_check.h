// Error checking for CUDA runtime calls: every call is checked, failures throw with file:line.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace minids::kernels {

struct CudaError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline void cuda_check(cudaError_t err, const char* expr, const char* file, int line) {
    if (err != cudaSuccess) {
        throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + expr + ": " +
                        cudaGetErrorString(err));
    }
}

}  // namespace minids::kernels

#define CUDA_CHECK(expr) ::minids::kernels::cuda_check((expr), #expr, __FILE__, __LINE__)
// After a kernel launch: catches bad launch configurations immediately.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
