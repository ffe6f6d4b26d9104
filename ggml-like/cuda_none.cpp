// The CUDA backend's entry points in a build without CUDA (see mgl-cuda.h).
#ifndef MINIDS_HAVE_CUDA
#include "mgl-cuda.h"

namespace mgl {

bool cuda_available() { return false; }
cuda_device_info cuda_info(int) { return {}; }
double cuda_copy_bandwidth_gbs() { return 0.0; }
double cuda_host_to_device_bandwidth_gbs() { return 0.0; }
std::unique_ptr<backend> make_cuda_backend(const cuda_options&) {
    fail(__FILE__, __LINE__, "this build of minids has no CUDA support");
}
cuda_graph_info cuda_graph_info_of(backend&, const graph&) {
    fail(__FILE__, __LINE__, "this build of minids has no CUDA support");
}

}  // namespace mgl
#endif
