// Division by a run-time divisor fixed for a whole launch, without the ~25-instruction integer
// division sequence: n / d = (mulhi(n, mul) + n) >> shift for 0 <= n < 2^31, 1 <= d < 2^31
// (Granlund & Montgomery, "Division by invariant integers using multiplication", 1994, fig. 4.1
// with l = ceil(log2 d); the add cannot overflow 32 bits because n < 2^31). Powers of two get
// mul = 1, shift = log2 d. The host computes (mul, shift) once; kernels take it by value.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace minids::kernels {

struct FastDivisor {
    uint32_t mul = 1;
    int32_t shift = 0;
    int32_t d = 1;

    FastDivisor() = default;
    explicit FastDivisor(int32_t divisor) : d(divisor) {
        while ((int64_t(1) << shift) < divisor) ++shift;  // l = ceil(log2 d), d <= 2^31 - 1
        // mul = floor(2^32 (2^l - d) / d) + 1 < 2^32, as 2^l - d < d.
        mul =
            uint32_t((((uint64_t(1) << shift) - uint64_t(divisor)) << 32) / uint64_t(divisor) + 1);
    }

    __host__ __device__ int32_t div(int32_t n) const {
#ifdef __CUDA_ARCH__
        const uint32_t hi = __umulhi(uint32_t(n), mul);
#else
        const uint32_t hi = uint32_t((uint64_t(uint32_t(n)) * mul) >> 32);
#endif
        return int32_t((hi + uint32_t(n)) >> shift);
    }
    // n / d and n % d.
    __host__ __device__ void divmod(int32_t n, int32_t& q, int32_t& r) const {
        q = div(n);
        r = n - q * d;
    }
};

}  // namespace minids::kernels
