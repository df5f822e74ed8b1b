#include "kernels/cuda/argmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

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

// One row over many blocks (decode's greedy pick: one block alone needed ~10 us for the
// 129280 logits): block b scans its chunk [b chunk, (b + 1) chunk) as above and leaves its
// candidate in cand; the block that draws the last ticket (fence, atomic; the counter is
// reset to 0 by it, so every launch finds it zeroed) combines the candidates in block
// order with the same rule. The candidates are in chunk order, so the result is the
// single-block kernel's: the first index of the largest value.
constexpr int kMultiThreads = 256;
constexpr int kMaxMultiBlocks = 64;
struct MultiWs {
  float v[kMaxMultiBlocks];
  int64_t i[kMaxMultiBlocks];
  unsigned counter;
};
__global__ void __launch_bounds__(kMultiThreads) argmax_multi_kernel(const float* __restrict__ row, int64_t n,
                                                                     int64_t chunk, MultiWs* ws,
                                                                     int32_t* __restrict__ out) {
  const int64_t b0 = static_cast<int64_t>(blockIdx.x) * chunk;
  const int64_t b1 = b0 + chunk < n ? b0 + chunk : n;
  float bv = -INFINITY;
  int64_t bi = -1;
  // chunk % 4 == 0 and the row 16-byte aligned (argmax_rows checks): float4 loads
  const float4* r4 = reinterpret_cast<const float4*>(row + b0);
  const int64_t n4 = (b1 - b0) / 4;
#pragma unroll 4
  for (int64_t j = threadIdx.x; j < n4; j += kMultiThreads) {
    const float4 q = __ldcg(r4 + j);
    const int64_t k = b0 + 4 * j;
    if (q.x > bv) bv = q.x, bi = k;
    if (q.y > bv) bv = q.y, bi = k + 1;
    if (q.z > bv) bv = q.z, bi = k + 2;
    if (q.w > bv) bv = q.w, bi = k + 3;
  }
  for (int64_t i = b0 + 4 * n4 + threadIdx.x; i < b1; i += kMultiThreads) {
    const float v = row[i];
    if (v > bv) bv = v, bi = i;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kMultiThreads / 32];
  __shared__ int64_t si[kMultiThreads / 32];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kMultiThreads / 32; ++w)
      if (better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    ws->v[blockIdx.x] = bv;
    ws->i[blockIdx.x] = bi;
    __threadfence();
    const unsigned ticket = atomicAdd(&ws->counter, 1u);
    last = ticket == gridDim.x - 1;
    if (last) {
      ws->counter = 0u;  // every block has drawn its ticket
      __threadfence();
    }
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  bv = __ldcg(&ws->v[0]);
  bi = __ldcg(&ws->i[0]);
  for (unsigned b = 1; b < gridDim.x; ++b) {
    const float v = __ldcg(&ws->v[b]);
    const int64_t i = __ldcg(&ws->i[b]);
    if (better(v, i, bv, bi)) bv = v, bi = i;
  }
  *out = (isnan(row[0]) || bi < 0) ? 0 : static_cast<int32_t>(bi);
}

// The workspace of argmax_multi_kernel for one output (a session's pick buffer; calls
// for one output are ordered on its stream): allocated and zeroed on the first call,
// kept for the life of the process. nullptr while the stream is being captured (no
// allocation then): that call takes the single-block kernel.
MultiWs* multi_ws(const int32_t* out, cudaStream_t stream) {
  static std::mutex mu;
  static std::map<std::pair<int, const void*>, MultiWs*> pool;
  int dev = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  const std::pair<int, const void*> key{dev, out};
  std::lock_guard<std::mutex> lock(mu);
  auto it = pool.find(key);
  if (it != pool.end()) return it->second;
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &st) != cudaSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  if (st != cudaStreamCaptureStatusNone) return nullptr;
  MultiWs* w = nullptr;
  DSX_CUDA_CHECK(cudaMalloc(&w, sizeof(MultiWs)));
  DSX_CUDA_CHECK(cudaMemsetAsync(w, 0, sizeof(MultiWs), stream));  // ordered before the kernel
  pool.emplace(key, w);
  return w;
}

}  // namespace

void argmax_rows(const float* x, int64_t ld, int rows, int64_t n, int32_t* out, cudaStream_t stream) {
  if (rows <= 0) return;
  DSX_CHECK(n >= 1 && n <= (int64_t{1} << 31) - 1 && ld >= n, "argmax_rows: bad row length ", n);
  // one long aligned row: many blocks (chunks of a multiple of 4 elements, >= 4096)
  if (rows == 1 && n >= 8192 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t chunk = std::max<int64_t>(4096, ((n + kMaxMultiBlocks - 1) / kMaxMultiBlocks + 3) / 4 * 4);
    const int64_t blocks = (n + chunk - 1) / chunk;
    if (MultiWs* ws = multi_ws(out, stream)) {
      argmax_multi_kernel<<<static_cast<unsigned>(blocks), kMultiThreads, 0, stream>>>(x, n, chunk, ws, out);
      DSX_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  argmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, ld, n, out);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
