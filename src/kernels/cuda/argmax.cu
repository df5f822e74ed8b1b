#include "kernels/cuda/argmax.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cuda/cuda_util.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

// (value, index) of a candidate; index -1: none. a is better than b when its value is
// larger, or equal with a smaller index.
__device__ __forceinline__ bool better(float va, int64_t ia, float vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

// This thread's candidate over row[lo, hi) (NT threads, strided): each thread visits its
// elements in increasing order keeping the first strict maximum (NaN never compares
// greater). vec (row + lo 16-byte aligned): 16-byte loads, U in flight per thread (a
// scalar strided loop was bound by load latency: 12 us for 129280 logits), then the
// scalar tail.
template <int NT, int U>
__device__ __forceinline__ void scan(const float* __restrict__ row, int64_t lo, int64_t hi, bool vec, float& bv,
                                     int64_t& bi) {
  bv = -INFINITY;
  bi = -1;
  int64_t i0 = lo;
  if (vec) {
    const float4* r4 = reinterpret_cast<const float4*>(row + lo);
    const int64_t n4 = (hi - lo) / 4;
#pragma unroll U
    for (int64_t j = threadIdx.x; j < n4; j += NT) {
      const float4 q = __ldcg(r4 + j);
      const int64_t k = lo + 4 * j;
      if (q.x > bv) bv = q.x, bi = k;
      if (q.y > bv) bv = q.y, bi = k + 1;
      if (q.z > bv) bv = q.z, bi = k + 2;
      if (q.w > bv) bv = q.w, bi = k + 3;
    }
    i0 = lo + 4 * n4;
  }
  for (int64_t i = i0 + threadIdx.x; i < hi; i += NT) {
    const float v = row[i];
    if (v > bv) bv = v, bi = i;
  }
}

// The block's best candidate, in thread 0 (all threads call it).
template <int NT>
__device__ __forceinline__ void block_best(float& bv, int64_t& bi) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[NT / 32];
  __shared__ int64_t si[NT / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = 1; w < NT / 32; ++w)
      if (better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
}

// The plain scan starts from index 0: a NaN there, or nothing above -inf, gives 0.
__device__ __forceinline__ int32_t pick(const float* row, int64_t bi) {
  return (isnan(row[0]) || bi < 0) ? 0 : static_cast<int32_t>(bi);
}

// One block per row.
constexpr int kThreads = 1024;
__global__ void __launch_bounds__(kThreads) argmax_kernel(const float* __restrict__ x, int64_t ld, int64_t n,
                                                          int32_t* __restrict__ out, int32_t* copy) {
  const float* row = x + static_cast<int64_t>(blockIdx.x) * ld;
  float bv;
  int64_t bi;
  scan<kThreads, 8>(row, 0, n, (reinterpret_cast<uintptr_t>(row) & 15) == 0, bv, bi);
  block_best<kThreads>(bv, bi);
  if (threadIdx.x == 0) {
    const int32_t p = pick(row, bi);
    out[blockIdx.x] = p;
    if (copy) copy[blockIdx.x] = p;
  }
}

// One row over many blocks (decode's greedy pick: one block alone needed ~10 us for the
// 129280 logits): block b scans its chunk [b chunk, (b + 1) chunk) and leaves its
// candidate in the workspace; the block that draws the last ticket (fence, atomic; it
// resets the counter to 0, so every launch finds it zeroed) combines the candidates in
// block order with the same rule: the first index of the largest value, as above.
constexpr int kMultiThreads = 256;
constexpr int kMaxMultiBlocks = 64;
struct MultiWs {
  float v[kMaxMultiBlocks];
  int64_t i[kMaxMultiBlocks];
  unsigned counter;
};
__global__ void __launch_bounds__(kMultiThreads) argmax_multi_kernel(const float* __restrict__ row, int64_t n,
                                                                     int64_t chunk, MultiWs* ws,
                                                                     int32_t* __restrict__ out, int32_t* copy) {
  const int64_t lo = static_cast<int64_t>(blockIdx.x) * chunk;
  float bv;
  int64_t bi;
  scan<kMultiThreads, 4>(row, lo, lo + chunk < n ? lo + chunk : n, true, bv, bi);  // (chunk % 4 == 0)
  block_best<kMultiThreads>(bv, bi);
  __shared__ bool last;
  if (threadIdx.x == 0) {
    ws->v[blockIdx.x] = bv;
    ws->i[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(&ws->counter, 1u) == gridDim.x - 1;
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
  const int32_t p = pick(row, bi);
  *out = p;
  if (copy) *copy = p;
}

// The many-block path's workspace of output `out` (null during a capture before it exists)
MultiWs* multi_ws_of(const int32_t* out, cudaStream_t stream) {
  return static_cast<MultiWs*>(persistent_scratch(out, 1, sizeof(MultiWs), stream));
}

}  // namespace

void argmax_reserve(const int32_t* out, cudaStream_t stream) {
  DSX_CHECK(multi_ws_of(out, stream) != nullptr, "argmax_reserve: called during a capture");
}

void argmax_rows(const float* x, int64_t ld, int rows, int64_t n, int32_t* out, cudaStream_t stream, int32_t* copy) {
  if (rows <= 0) return;
  DSX_CHECK(n >= 1 && n <= (int64_t{1} << 31) - 1 && ld >= n, "argmax_rows: bad row length ", n);
  // one long aligned row: many blocks (chunks of a multiple of 4 elements, >= 4096); the
  // workspace is kept per output (a session's pick buffer)
  if (rows == 1 && n >= 8192 && (reinterpret_cast<uintptr_t>(x) & 15) == 0) {
    const int64_t chunk = std::max<int64_t>(4096, ((n + kMaxMultiBlocks - 1) / kMaxMultiBlocks + 3) / 4 * 4);
    const int64_t blocks = (n + chunk - 1) / chunk;
    if (MultiWs* ws = multi_ws_of(out, stream)) {
      argmax_multi_kernel<<<static_cast<unsigned>(blocks), kMultiThreads, 0, stream>>>(x, n, chunk, ws, out, copy);
      DSX_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  argmax_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(x, ld, n, out, copy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
