// Asynchronous global -> shared copies (cp.async, sm_80+) shared by the kernels: a copy holds no
// registers, so a thread can have all of its staging loads in flight at once. Publish with
// cp_async_wait<N>() / cp_async_wait_all() and then a barrier.
#pragma once

#include <cstdint>

namespace minids::kernels {

__device__ inline uint32_t smem_u32(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes; with src_bytes < 16 the rest is zero-filled (0: rows outside the range).
__device__ inline void cp_async_16(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ inline void cp_async_16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}
// The same at dst_smem + DST_OFF and src + SRC_OFF bytes: the offsets go into the instruction.
template <int DST_OFF, int SRC_OFF>
__device__ inline void cp_async_16(uint32_t dst_smem, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%4], 16, %2;\n" ::"r"(dst_smem), "l"(src),
                 "r"(src_bytes), "n"(DST_OFF), "n"(SRC_OFF)
                 : "memory");
}
// 4 bytes (through L1: cp.async.ca), for element-wise staging.
__device__ inline void cp_async_4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(smem_u32(dst)), "l"(src)
                 : "memory");
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ inline void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

}  // namespace minids::kernels
