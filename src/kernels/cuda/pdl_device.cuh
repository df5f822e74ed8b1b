// Grid-dependency control (programmatic dependent launch, detail::launch_pdl in
// gemv_launch.h); both are no-ops when the kernel was launched without the attribute.
#pragma once
#include <cuda_runtime.h>

namespace dsx::cuda::dev {

// Waits until the previous kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
// Lets the next kernel of the stream start launching (it still waits in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace dsx::cuda::dev
