#include <string>

#include "cuda_check.h"
#include "rope.h"

namespace minids::kernels {
namespace {

constexpr int rope_threads = 128;

// One block per token: the token's cos/sin table in shared memory, then every (head, pair).
__global__ void rope_kernel(const RopeParams p) {
    extern __shared__ float table[];  // cos [n_dims/2], then sin [n_dims/2]
    const int64_t t = blockIdx.x;
    const int half = int(p.n_dims / 2);
    const float pos = float(p.positions[t]);
    for (int i = threadIdx.x; i < half; i += rope_threads) {
        double s, c;
        sincos(double(pos * p.inv_freq[i]), &s, &c);
        table[i] = float(c) * p.attn_factor;
        table[half + i] = float(s) * p.attn_factor;
    }
    __syncthreads();
    for (int64_t idx = threadIdx.x; idx < p.H * half; idx += rope_threads) {
        const int64_t h = idx / half;
        const int i = int(idx % half);
        const float2 ab =
            *reinterpret_cast<const float2*>(p.x + t * p.x_stride_t + h * p.x_stride_h + 2 * i);
        const float cs = table[i], sn = table[half + i];
        float* dst = p.y + t * p.y_stride_t + h * p.y_stride_h + 2 * i;
        dst[0] = ab.x * cs - ab.y * sn;
        dst[1] = ab.x * sn + ab.y * cs;
    }
}

}  // namespace

void rope(const RopeParams& p, cudaStream_t stream) {
    if (p.T <= 0 || p.H <= 0 || p.n_dims <= 0 || p.n_dims % 2 != 0 || p.T > 0x7fffffff ||
        p.n_dims > 8192 || !p.x || !p.y || !p.positions || !p.inv_freq) {
        ::mgl::fail(__FILE__, __LINE__,
                    "rope: unsupported shape (T, H, n_dims) = (" + std::to_string(p.T) + ", " +
                        std::to_string(p.H) + ", " + std::to_string(p.n_dims) +
                        ") or a null pointer (n_dims must be even, <= 8192)");
    }
    if (reinterpret_cast<uintptr_t>(p.x) % 8 != 0 || p.x_stride_t % 2 != 0 || p.x_stride_h % 2 != 0)
        ::mgl::fail(__FILE__, __LINE__, "rope: x and its strides must keep pairs 8-byte aligned");
    rope_kernel<<<unsigned(p.T), rope_threads, size_t(p.n_dims) * sizeof(float), stream>>>(p);
    CUDA_CHECK_LAUNCH();
}

}  // namespace minids::kernels
