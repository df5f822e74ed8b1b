#include "kernels/cuda/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/pdl_device.cuh"  // (trace marks)
#include "util/error.h"
#include "util/numerics.h"

namespace dsx::cuda {

// ---------------------------------------------------------------------------------
// Kernels
namespace {

__global__ void window_store_kernel(const uint8_t* __restrict__ src_codes, const uint8_t* __restrict__ src_scales,
                                    uint8_t* __restrict__ dst_codes, uint8_t* __restrict__ dst_scales, int dim,
                                    int T, int first, int cap, const int64_t* __restrict__ d_pos) {
  const int i = first + static_cast<int>(blockIdx.x);  // chunk row
  const int64_t slot = (*d_pos + i) % cap;
  const uint8_t* sc = src_codes + static_cast<int64_t>(i) * dim;
  uint8_t* dc = dst_codes + slot * dim;
  if (dim % 16 == 0) {
    for (int k = threadIdx.x; k < dim / 16; k += blockDim.x)
      reinterpret_cast<uint4*>(dc)[k] = reinterpret_cast<const uint4*>(sc)[k];
  } else {
    for (int k = threadIdx.x; k < dim; k += blockDim.x) dc[k] = sc[k];
  }
  for (int k = threadIdx.x; k < dim / 32; k += blockDim.x)
    dst_scales[slot * (dim / 32) + k] = src_scales[static_cast<int64_t>(i) * (dim / 32) + k];
}

__global__ void proj_store_kernel(const float* __restrict__ kv, const float* __restrict__ gate, int dim, int first,
                                  float* __restrict__ ring_kv, float* __restrict__ ring_gate, int cap,
                                  const int64_t* __restrict__ d_pos) {
  dev::trace_mark(73);
  const int i = first + static_cast<int>(blockIdx.x);
  const int64_t slot = (*d_pos + i) % cap;
  for (int k = threadIdx.x; k < dim; k += blockDim.x) {
    ring_kv[slot * dim + k] = kv[static_cast<int64_t>(i) * dim + k];
    ring_gate[slot * dim + k] = gate[static_cast<int64_t>(i) * dim + k];
  }
}

__global__ void advance_kernel(int64_t* d_pos, int64_t delta) { *d_pos += delta; }

// Block b copies span b (a few hundred bytes to a few KB: byte-wise is enough).
constexpr int kMaxSpans = 16;
struct ByteSpans {
  ByteCopy c[kMaxSpans];
};
__global__ void copy_spans_kernel(ByteSpans s) {
  const ByteCopy c = s.c[blockIdx.x];
  for (int64_t k = threadIdx.x; k < c.n; k += blockDim.x) c.dst[k] = c.src[k];
}

}  // namespace

void copy_spans(const std::vector<ByteCopy>& copies, cudaStream_t stream) {
  for (size_t i0 = 0; i0 < copies.size(); i0 += kMaxSpans) {
    ByteSpans s{};
    const size_t m = std::min<size_t>(kMaxSpans, copies.size() - i0);
    for (size_t i = 0; i < m; ++i) s.c[i] = copies[i0 + i];
    copy_spans_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(s);
    check_launch("copy_spans");
  }
}

void advance_position(int64_t* d_pos, int64_t delta, cudaStream_t stream) {
  advance_kernel<<<1, 1, 0, stream>>>(d_pos, delta);
  check_launch("advance_position");
}

void window_store(const Fq8Rows& chunk, int T, const Fq8Rows& ring, int cap, const int64_t* d_pos,
                  cudaStream_t stream) {
  if (T <= 0) return;
  DSX_CHECK(chunk.dim == ring.dim && chunk.dim % 32 == 0, "window_store: row widths differ");
  const int n = std::min(T, cap);
  window_store_kernel<<<n, 128, 0, stream>>>(chunk.codes, chunk.scales, ring.codes, ring.scales, chunk.dim, T, T - n,
                                              cap, d_pos);
  check_launch("window_store");
}

void proj_store(const float* kv, const float* gate, int T, int dim, float* ring_kv, float* ring_gate, int proj_cap,
                const int64_t* d_pos, cudaStream_t stream) {
  if (T <= 0 || proj_cap <= 0) return;
  const int n = std::min(T, proj_cap);
  proj_store_kernel<<<n, 256, 0, stream>>>(kv, gate, dim, T - n, ring_kv, ring_gate, proj_cap, d_pos);
  check_launch("proj_store");
}

}  // namespace dsx::cuda
