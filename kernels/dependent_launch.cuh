// One launch, optionally as a programmatic dependent launch (Hopper): with `dependent`, the
// kernel may be scheduled while the previous kernel on the stream still runs, and must wait in
// griddepcontrol.wait before it reads anything that kernel writes (a no-op in an ordinary
// launch, so the kernel code is the same either way).
#pragma once

#include <cuda_runtime_api.h>

#include "cuda_check.h"

namespace minids::kernels {

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
