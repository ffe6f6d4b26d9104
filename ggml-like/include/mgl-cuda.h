// mgl's CUDA backend: the same ops as the CPU backend, run on one CUDA device (ggml-like/cuda/).
//
// Tensors live in device memory (alloc_buffer) or in host memory registered with the device
// (register_host: kernels read it over PCIe). compute() enqueues every node on the backend's
// stream and returns; a graph marked `reusable` is captured as a CUDA graph on its first compute
// and replayed afterwards, so a decode step costs one graph launch. Everything a step changes
// (token, positions, page table, expert table) is a tensor the caller rewrites between replays.
//
// In a build without CUDA the functions below exist: cuda_available() is false and
// make_cuda_backend() throws mgl::error.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "mgl.h"

namespace mgl {

struct cuda_device_info {
    bool present = false;
    std::string name;
    int sm_count = 0;
    size_t free_bytes = 0;
    size_t total_bytes = 0;
};

// True when a CUDA device is present and usable.
bool cuda_available();
cuda_device_info cuda_info(int device = 0);

struct cuda_options {
    int device = 0;
    // Capture graphs marked reusable as CUDA graphs and replay them; false runs every node
    // eagerly (the independent path the replay is validated against).
    bool graphs = true;
};
std::unique_ptr<backend> make_cuda_backend(const cuda_options& options = {});

// Device-to-device copy bandwidth of device 0 in GB/s (bytes read + written, median of repeats
// over a 1 GiB buffer): the ceiling benchmarks report floors against. 0 without a device.
double cuda_copy_bandwidth_gbs();

}  // namespace mgl
