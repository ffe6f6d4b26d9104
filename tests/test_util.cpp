#include "test_util.h"

#ifdef MINIDS_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace minids::test {

bool cuda_device_available() {
#ifdef MINIDS_HAVE_CUDA
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
    return false;
#endif
}

}  // namespace minids::test
