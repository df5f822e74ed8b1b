// Grid-dependency control (programmatic dependent launch, detail::launch_pdl in
// gemv_launch.h); both are no-ops when the kernel was launched without the attribute.
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_util.h"

namespace dsx::cuda::dev {

// The device's global timer (ns; coarse steps): trace records, signal wait timeouts.
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#if defined(DSX_KERNEL_TRACE)
// Kernel timeline (trace_enable in cuda_util.h): one ring per translation unit's symbols,
// all pointing to the same device buffer.
static __constant__ TraceRec* g_trace_buf;
static __constant__ unsigned* g_trace_n;

__device__ __forceinline__ void trace_put(const TraceRec& r) {
  const unsigned i = atomicAdd(g_trace_n, 1u) & (kTraceCap - 1);
  g_trace_buf[i] = r;
}
#endif

// Waits until the previous kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#if defined(DSX_KERNEL_TRACE)
  const bool rec = g_trace_buf && (blockIdx.x | blockIdx.y | blockIdx.z | threadIdx.x | threadIdx.y) == 0;
  const unsigned long long t0 = rec ? global_ns() : 0ull;
#endif
  asm volatile("griddepcontrol.wait;" ::: "memory");
#if defined(DSX_KERNEL_TRACE)
  if (rec) trace_put(TraceRec{t0, global_ns(), gridDim.x | (gridDim.y << 16), blockDim.x});
#endif
#endif
}
// Kernel timeline marks (DSX_KERNEL_TRACE builds only; no code otherwise): thread 0 of a
// block for which `here` holds (by default block 0) records the time it passed this point,
// tagged (block field 0x80000000 | tag; trace_timeline.py prints it as "mark tag").
__device__ __forceinline__ void trace_mark([[maybe_unused]] unsigned tag, [[maybe_unused]] bool here) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(DSX_KERNEL_TRACE)
  if (g_trace_buf && here && (threadIdx.x | threadIdx.y) == 0) {
    const unsigned long long t = global_ns();
    trace_put(TraceRec{t, t, gridDim.x | (gridDim.y << 16), 0x80000000u | tag});
  }
#endif
}
__device__ __forceinline__ void trace_mark(unsigned tag) {
  trace_mark(tag, (blockIdx.x | blockIdx.y | blockIdx.z) == 0);
}

// Per-block timeline marks (DSX_KERNEL_TRACE builds only): thread 0 of every block records
// the time it passed this point with its block index and SM (t_wait = blockIdx.x << 32 |
// smid; block field 0xC0000000 | tag); trace_timeline.py --blocks summarizes them.
__device__ __forceinline__ void trace_block([[maybe_unused]] unsigned tag) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(DSX_KERNEL_TRACE)
  if (g_trace_buf && (threadIdx.x | threadIdx.y) == 0) {
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    trace_put(TraceRec{(static_cast<unsigned long long>(blockIdx.x) << 32) | smid, global_ns(),
                       gridDim.x | (gridDim.y << 16), 0xC0000000u | tag});
  }
#endif
}

// Lets the next kernel of the stream start launching (it still waits in pdl_wait).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

}  // namespace dsx::cuda::dev

#if defined(DSX_KERNEL_TRACE)
namespace {
// Points this translation unit's trace symbols at the shared buffer (registered once).
[[maybe_unused]] void dsx_trace_set_tu(dsx::cuda::TraceRec* buf, unsigned* n) {
  cudaMemcpyToSymbol(dsx::cuda::dev::g_trace_buf, &buf, sizeof buf);
  cudaMemcpyToSymbol(dsx::cuda::dev::g_trace_n, &n, sizeof n);
}
[[maybe_unused]] const int dsx_trace_registered = (dsx::cuda::trace_add_setter(&dsx_trace_set_tu), 0);
}  // namespace
#endif
