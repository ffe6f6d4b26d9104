// 16 bytes of weights through the read-only path, not kept in L1: every weight byte is read once
// per launch, so L1 is left to the activations. Shared by the streaming GEMVs and the MoE kernels.
#pragma once

#include <cstdint>

namespace minids::kernels {

__device__ __forceinline__ uint4 load_weights16(const uint8_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

}  // namespace minids::kernels
