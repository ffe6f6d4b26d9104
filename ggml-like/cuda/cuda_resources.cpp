// RAII owners of CUDA objects (see cuda_resources.h).
#include "cuda_resources.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>

namespace mgl::cuda {

namespace detail {
// Release functions run in destructors: errors are ignored (there is nobody to tell, and a
// failing release during unwinding must not terminate the process).
void free_device(void* p) { (void)cudaFree(p); }
void free_pinned(void* p) { (void)cudaFreeHost(p); }
void destroy_stream(cudaStream_t s) { (void)cudaStreamDestroy(s); }
void destroy_event(cudaEvent_t e) { (void)cudaEventDestroy(e); }
void destroy_graph_exec(cudaGraphExec_t g) { (void)cudaGraphExecDestroy(g); }
void destroy_graph(cudaGraph_t g) { (void)cudaGraphDestroy(g); }
void destroy_cublas(cublasHandle_t h) { (void)cublasDestroy(h); }
}  // namespace detail

device_memory::device_memory(size_t bytes) : n_(bytes) {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, std::max<size_t>(bytes, 1));
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        size_t free_bytes = 0, total = 0;
        (void)cudaMemGetInfo(&free_bytes, &total);
        throw error("cuda backend: cannot allocate " + std::to_string(bytes) +
                    " bytes of device memory (" + std::to_string(free_bytes) + " of " +
                    std::to_string(total) + " free): " + cudaGetErrorString(err));
    }
    p_ = unique_handle<void*, detail::free_device>(p);
}

pinned_memory::pinned_memory(size_t bytes) : n_(bytes) {
    void* p = nullptr;
    const cudaError_t err =
        cudaHostAlloc(&p, std::max<size_t>(bytes, 1), cudaHostAllocMapped | cudaHostAllocPortable);
    if (err != cudaSuccess) {
        (void)cudaGetLastError();
        throw error("cuda backend: cannot allocate " + std::to_string(bytes) +
                    " bytes of pinned host memory: " + cudaGetErrorString(err));
    }
    p_ = unique_handle<void*, detail::free_pinned>(p);
}

void* pinned_memory::device_pointer() const {
    void* d = nullptr;
    CUDA_CHECK(cudaHostGetDevicePointer(&d, p_.get(), 0));
    return d;
}

std::unique_ptr<host_registration> host_registration::try_register(const void* p, size_t n,
                                                                   bool read_only) {
    if (!p || n == 0) return nullptr;
    // Register whole pages: the pages holding [p, p + n) are all mapped when the range is.
    const auto page = uintptr_t(sysconf(_SC_PAGESIZE));
    const uintptr_t begin = uintptr_t(p) / page * page;
    const uintptr_t end = (uintptr_t(p) + n + page - 1) / page * page;
    void* base = reinterpret_cast<void*>(begin);
    unsigned flags = cudaHostRegisterMapped | cudaHostRegisterPortable;
    if (read_only) flags |= cudaHostRegisterReadOnly;
    if (cudaHostRegister(base, end - begin, flags) != cudaSuccess) {
        (void)cudaGetLastError();  // refused: the caller copies through staging instead
        return nullptr;
    }
    void* device = nullptr;
    if (cudaHostGetDevicePointer(&device, base, 0) != cudaSuccess) {
        (void)cudaGetLastError();
        (void)cudaHostUnregister(base);
        return nullptr;
    }
    return std::unique_ptr<host_registration>(
        new host_registration(base, end - begin, static_cast<const char*>(device)));
}

host_registration::host_registration(void* base, size_t bytes, const char* device_base)
    : base_(base), bytes_(bytes), device_base_(device_base) {}

host_registration::~host_registration() { (void)cudaHostUnregister(base_); }

const void* host_registration::device_address(const void* p) const {
    const auto offset = uintptr_t(p) - uintptr_t(base_);
    MGL_CHECK(uintptr_t(p) >= uintptr_t(base_) && offset < bytes_,
              "device_address: the pointer is outside the registered range");
    return device_base_ + offset;
}

stream::stream() {
    cudaStream_t s = nullptr;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    s_ = unique_handle<cudaStream_t, detail::destroy_stream>(s);
}

event::event(bool timing) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    e_ = unique_handle<cudaEvent_t, detail::destroy_event>(e);
}

float event::elapsed_since(const event& start) const {
    float ms = 0.0f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), e_.get()));
    return ms;
}

cublas_handle::cublas_handle(cudaStream_t s, size_t workspace_bytes) : workspace_(workspace_bytes) {
    cublasHandle_t h = nullptr;
    MGL_CUBLAS_CHECK(cublasCreate(&h));
    h_ = unique_handle<cublasHandle_t, detail::destroy_cublas>(h);
    // Stream first: cublasSetStream resets the workspace to cuBLAS's own pool.
    MGL_CUBLAS_CHECK(cublasSetStream(h, s));
    MGL_CUBLAS_CHECK(cublasSetWorkspace(h, workspace_.get(), workspace_.size()));
    MGL_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
}

graph_exec::graph_exec(cudaGraph_t g) {
    cudaGraphExec_t e = nullptr;
    CUDA_CHECK(cudaGraphInstantiate(&e, g, 0));
    e_ = unique_handle<cudaGraphExec_t, detail::destroy_graph_exec>(e);
}

}  // namespace mgl::cuda
