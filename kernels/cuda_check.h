// Error checking for CUDA runtime calls: every call is checked, failures throw mgl::error with
// file:line (internal faults; the one error type of the tensor library and its kernels).
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "mgl.h"

namespace minids::kernels {

inline void cuda_check(cudaError_t err, const char* expr, const char* file, int line) {
    if (err != cudaSuccess) {
        ::mgl::fail(file, line, std::string(expr) + ": " + cudaGetErrorString(err));
    }
}

}  // namespace minids::kernels

#define CUDA_CHECK(expr) ::minids::kernels::cuda_check((expr), #expr, __FILE__, __LINE__)

namespace minids::kernels {

// Streaming multiprocessors of the current device (launch plans size their grids by it).
inline int sm_count_of_current_device() {
    int dev = 0, sms = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return sms;
}

}  // namespace minids::kernels
// After a kernel launch: catches bad launch configurations immediately.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
