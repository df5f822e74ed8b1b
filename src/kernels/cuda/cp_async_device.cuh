// cp.async copies into shared memory and shared-memory loads by 32-bit shared address
// (the weight rings of gemv.cu / moe.cu, the decode attention's row copies).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsx::cuda::dev {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}
// 16 bytes from a shared-memory address (the ring consumers keep their slot addresses as
// 32-bit shared offsets: no generic-pointer arithmetic per span)
__device__ __forceinline__ uint4 lds128_at(uint32_t addr) {
  uint4 r;
#if defined(__CUDA_ARCH__)
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "r"(addr)
               : "memory");
#else
  r = make_uint4(0, 0, 0, 0);
#endif
  return r;
}

// Unconditional copies from a generic shared-memory destination: 16 bytes through L2 only
// (.cg), 4 bytes (.ca: .cg takes 16-byte copies only).
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(dst)), "l"(src) : "memory");
}

}  // namespace dsx::cuda::dev
