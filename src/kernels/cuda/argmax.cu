#include "kernels/cuda/argmax.h"

#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_util.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 1024;

// (value, index) of a candidate; index -1: none. a is better than b when its value is
// larger, or equal with a smaller index.
__device__ __forceinline__ bool better(float va, int64_t ia, float vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

// One block per row: each thread scans its strided elements in increasing order keeping
// the first strict maximum (NaN never compares greater), then a block reduction.
__global__ void __launch_bounds__(kThreads) argmax_kernel(const float* __restrict__ x, int64_t ld, int64_t n,
                                                          int32_t* __restrict__ out) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * ld;
  float bv = -INFINITY;
  int64_t bi = -1;
  int64_t i0 = 0;  // first element of the scalar tail
  if ((reinterpret_cast<uintptr_t>(row) & 15) == 0) {
    // 16-byte loads, several in flight per thread (a scalar strided loop was bound by
    // load latency: 12 us for 129280 logits); each thread still visits its elements in
    // increasing order
    const float4* r4 = reinterpret_cast<const float4*>(row);
    const int64_t n4 = n / 4;
#pragma unroll 8
    for (int64_t j = threadIdx.x; j < n4; j += kThreads) {
      const float4 q = __ldcg(r4 + j);
      if (q.x > bv) bv = q.x, bi = 4 * j;
      if (q.y > bv) bv = q.y, bi = 4 * j + 1;
      if (q.z > bv) bv = q.z, bi = 4 * j + 2;
      if (q.w > bv) bv = q.w, bi = 4 * j + 3;
    }
    i0 = 4 * n4;
  }
  for (int64_t i = i0 + threadIdx.x; i < n; i += kThreads) {
    const float v = row[i];
    if (v > bv) bv = v, bi = i;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kThreads / 32];
  __shared__ int64_t si[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kThreads / 32; ++w)
      if (better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    // the plain scan starts from index 0: a NaN there, or nothing above -inf, gives 0
    out[blockIdx.x] = (n <= 0 || isnan(row[0]) || bi < 0) ? 0 : static_cast<int32_t>(bi);
  }
}

}  // namespace

void argmax_rows(const float* x, int64_t ld, int rows, int64_t n, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return;
  DSX_CHECK(n >= 1 && n <= (int64_t{1} << 31) - 1 && ld >= n, "argmax_rows: bad row length ", n);
  argmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, ld, n, out);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
