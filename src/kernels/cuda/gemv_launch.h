// Internal launch helpers shared by the .cu files of the weight-streaming kernels
// (host side; not part of the public API).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "util/error.h"

namespace dsx::cuda::detail {

// Largest dynamic shared memory a block may opt into on the current device.
inline int max_smem_optin() {
  static int cache[64] = {};
  int dev = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (cache[dev] <= 0) {
    int v = 0;
    DSX_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    cache[dev] = v;
  }
  return cache[dev];
}

// Largest dynamic shared memory `kernel` can launch with (opt-in limit minus its static
// shared memory); raises the kernel's limit to that the first time. Cached.
template <typename Kernel>
size_t max_dynamic_smem(Kernel kernel) {
  static std::mutex mu;
  static std::vector<std::pair<const void*, size_t>> cache;
  std::lock_guard<std::mutex> lock(mu);
  const void* key = reinterpret_cast<const void*>(kernel);
  for (auto& e : cache)
    if (e.first == key) return e.second;
  cudaFuncAttributes attr{};
  DSX_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const size_t optin = static_cast<size_t>(max_smem_optin());
  const size_t dyn = optin > attr.sharedSizeBytes ? optin - attr.sharedSizeBytes : 0;
  DSX_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(dyn)));
  cache.push_back({key, dyn});
  return dyn;
}

// Resident blocks per SM of `kernel` with `threads` threads and `smem` dynamic shared
// memory (which must not exceed max_dynamic_smem(kernel)). Cached.
template <typename Kernel>
int occupancy(Kernel kernel, int threads, size_t smem) {
  DSX_CHECK(smem <= max_dynamic_smem(kernel), "kernel launch needs ", smem,
            " bytes of shared memory, more than a block can have");
  static std::mutex mu;
  static std::vector<std::pair<std::pair<const void*, size_t>, int>> cache;
  std::lock_guard<std::mutex> lock(mu);
  const void* key = reinterpret_cast<const void*>(kernel);
  for (auto& e : cache)
    if (e.first.first == key && e.first.second == smem) return e.second;
  int n = 0;
  DSX_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  if (n < 1) n = 1;
  cache.push_back({{key, smem}, n});
  return n;
}

// Number of blocks for `items` equal work items when `resident` blocks run at once:
// as many as fit, evened out so that every block gets the same number of items.
inline int64_t balanced_blocks(int64_t items, int64_t resident) {
  if (items <= 0) return 0;
  if (resident < 1) resident = 1;
  const int64_t waves = (items + resident - 1) / resident;
  return (items + waves - 1) / waves;
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace dsx::cuda::detail

namespace dsx::cuda {
// Runtime switches of the tensor-core paths (gemv.cu; util/switches.def, read per call):
// DSX_GEMV_MMA = 0 off (also the MoE's tensor-core kernels), 1 BF16 mode (default), 2 also
// F32 mode; DSX_MMA_CVT = 1 hardware e4m3 -> f16 conversion on the register ring too;
// DSX_PDL = 0 disables programmatic dependent launch (default on).
int gemv_mma_mode();
bool gemv_mma_hwcvt();
bool pdl_enabled();
int gemv_mma_depth();  // DSX_MMA_U: register ring's spans in flight per lane (4 or 8; 0 = per shape, default)
}  // namespace dsx::cuda

namespace dsx::cuda::detail {

// Launches kern<<<grid, block, smem, stream>>>(args...) with programmatic dependent
// launch (the kernel may start while the previous one in the stream finishes; it must
// call griddepcontrol.wait before touching that kernel's results) unless DSX_PDL=0.
template <typename... KArgs, typename... Args>
void launch_pdl(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_enabled() ? 1 : 0;
  DSX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...));
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda::detail
