// RAII owners of the CUDA objects the backend holds: device memory, pinned host memory, host
// registrations, a stream, events, the cuBLAS handle (with the workspace that makes it
// capturable) and instantiated CUDA graphs. Every CUDA call is checked (CUDA_CHECK, CUBLAS_CHECK
// throw mgl::error with file:line); destructors release without throwing.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <utility>

#include "cuda_check.h"
#include "mgl.h"

#define MGL_CUBLAS_CHECK(expr)                                                       \
    do {                                                                             \
        const cublasStatus_t status_ = (expr);                                       \
        if (status_ != CUBLAS_STATUS_SUCCESS)                                        \
            ::mgl::fail(__FILE__, __LINE__,                                          \
                        std::string(#expr) + ": " + cublasGetStatusString(status_)); \
    } while (0)

namespace mgl::cuda {

// Moves leave the source empty; a handle type only needs a "release" function.
template <typename Handle, void (*Release)(Handle)>
class unique_handle {
public:
    unique_handle() = default;
    explicit unique_handle(Handle h) : h_(h) {}
    ~unique_handle() { reset(); }
    unique_handle(unique_handle&& o) noexcept : h_(std::exchange(o.h_, Handle{})) {}
    unique_handle& operator=(unique_handle&& o) noexcept {
        if (this != &o) {
            reset();
            h_ = std::exchange(o.h_, Handle{});
        }
        return *this;
    }
    unique_handle(const unique_handle&) = delete;
    unique_handle& operator=(const unique_handle&) = delete;

    Handle get() const { return h_; }
    explicit operator bool() const { return h_ != Handle{}; }
    void reset() {
        if (h_ != Handle{}) Release(std::exchange(h_, Handle{}));
    }

private:
    Handle h_{};
};

namespace detail {
void free_device(void* p);
void free_pinned(void* p);
void destroy_stream(cudaStream_t s);
void destroy_event(cudaEvent_t e);
void destroy_graph_exec(cudaGraphExec_t g);
void destroy_graph(cudaGraph_t g);
void destroy_cublas(cublasHandle_t h);
}  // namespace detail

// cudaMalloc'd memory (at least one byte is allocated so the pointer is never null).
class device_memory {
public:
    device_memory() = default;
    explicit device_memory(size_t bytes);
    void* get() const { return p_.get(); }
    size_t size() const { return n_; }

private:
    unique_handle<void*, detail::free_device> p_;
    size_t n_ = 0;
};

// cudaHostAlloc'd memory, mapped into the device's address space (kernels may read it).
class pinned_memory {
public:
    pinned_memory() = default;
    explicit pinned_memory(size_t bytes);
    void* get() const { return p_.get(); }
    size_t size() const { return n_; }
    // The address kernels use for it.
    void* device_pointer() const;

private:
    unique_handle<void*, detail::free_pinned> p_;
    size_t n_ = 0;
};

// Existing host memory registered with cudaHostRegister (mapped; read-only when asked). Unregisters
// on destruction. `try_register` returns null when the driver refuses (the error is cleared).
class host_registration final : public mgl::host_registration {
public:
    static std::unique_ptr<host_registration> try_register(const void* p, size_t n, bool read_only);
    ~host_registration() override;
    host_registration(const host_registration&) = delete;
    host_registration& operator=(const host_registration&) = delete;
    const void* device_address(const void* p) const override;

private:
    host_registration(void* base, size_t bytes, const char* device_base);
    void* base_;  // the registered range: the pages that hold [p, p + n)
    size_t bytes_;
    const char* device_base_;
};

// A non-blocking stream (no implicit synchronization with the legacy default stream, so it can
// be captured).
class stream {
public:
    stream();
    cudaStream_t get() const { return s_.get(); }

private:
    unique_handle<cudaStream_t, detail::destroy_stream> s_;
};

class event {
public:
    explicit event(bool timing = false);
    cudaEvent_t get() const { return e_.get(); }
    void record(cudaStream_t s) { CUDA_CHECK(cudaEventRecord(e_.get(), s)); }
    void synchronize() { CUDA_CHECK(cudaEventSynchronize(e_.get())); }
    // Milliseconds from `start` to this event (both recorded with timing).
    float elapsed_since(const event& start) const;

private:
    unique_handle<cudaEvent_t, detail::destroy_event> e_;
};

// A cuBLAS handle bound to one stream with its own workspace, so its calls can be captured into
// a CUDA graph (cuBLAS would otherwise allocate during capture). cublasSetStream resets the
// workspace, which is why both are set together here and kernels::matmul only changes the stream
// when it differs.
class cublas_handle {
public:
    cublas_handle(cudaStream_t s, size_t workspace_bytes);
    cublasHandle_t get() const { return h_.get(); }

private:
    unique_handle<cublasHandle_t, detail::destroy_cublas> h_;
    device_memory workspace_;
};

// An instantiated CUDA graph.
class graph_exec {
public:
    graph_exec() = default;
    // Instantiates `g` (the caller keeps ownership of g).
    explicit graph_exec(cudaGraph_t g);
    cudaGraphExec_t get() const { return e_.get(); }
    explicit operator bool() const { return bool(e_); }
    void launch(cudaStream_t s) const { CUDA_CHECK(cudaGraphLaunch(e_.get(), s)); }

private:
    unique_handle<cudaGraphExec_t, detail::destroy_graph_exec> e_;
};

// A captured (not yet instantiated) CUDA graph.
using graph_handle = unique_handle<cudaGraph_t, detail::destroy_graph>;

}  // namespace mgl::cuda
