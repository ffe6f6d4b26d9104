// Programmatic dependent launch (PDL, Hopper) for the kernels of a decode step. At batch 1 most
// kernels run for a few microseconds, and without PDL each one's launch, block scheduling and
// prologue start only after the previous kernel has drained. With `dependent`, a kernel may be
// scheduled as soon as every block of the previous kernel on the stream has called
// pdl_launch_dependents() (or exited), and it must call pdl_wait() before it reads anything an
// earlier kernel writes or writes anything one may still read. pdl_wait() returns once the
// previous kernel has completed and its writes are visible; since that kernel also passed its own
// pdl_wait() first, every earlier kernel has completed too. Both are no-ops in an ordinary launch,
// so a kernel's code is the same either way; a kernel launched dependent that never calls
// pdl_wait() would race its predecessor, so every kernel that takes a `pdl` flag calls it.
#pragma once

#include <cuda_runtime_api.h>

#include "cuda_check.h"

namespace minids::kernels {

#ifdef __CUDACC__
__device__ __forceinline__ void pdl_launch_dependents() {
    asm volatile("griddepcontrol.launch_dependents;");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
// The common prologue of a kernel that reads its inputs at once: let the next kernel be scheduled
// (it will wait for this one), then wait for the previous one.
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_dependents();
    pdl_wait();
}
#endif

template <class... Params, class... Args>
void launch_maybe_dependent(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem_bytes,
                            cudaStream_t stream, bool dependent, Args... args) {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    if (dependent) {
        cfg.attrs = attr;
        cfg.numAttrs = 1;
    }
    CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace minids::kernels
