#include "kernels/cuda/quant_act.h"

#include <algorithm>
#include <atomic>

#include "kernels/cuda/quant_act_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

int sm_count() {
  static std::atomic<int> cache[64] = {};
  int dev = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  int n = cache[dev].load(std::memory_order_relaxed);
  if (n <= 0) {
    DSX_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    cache[dev].store(n, std::memory_order_relaxed);
  }
  return n;
}

namespace {

constexpr int kThreads = 256;

// One warp per (row, block); grid-stride loop.
template <int NE>
__global__ void __launch_bounds__(kThreads) qa8_kernel(const void* __restrict__ x, int xt, int64_t ldx,
                                                       int64_t rows, int64_t K, uint8_t* __restrict__ codes,
                                                       float* __restrict__ scales, void* __restrict__ y, int yt,
                                                       int64_t ldy) {
  constexpr int QB = NE * 32;
  const int lane = threadIdx.x & 31;
  const int64_t nb = K / QB;
  const int64_t total = rows * nb;
  const int64_t wid = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t nw = (static_cast<int64_t>(gridDim.x) * kThreads) >> 5;
  for (int64_t item = wid; item < total; item += nw) {
    const int64_t r = item / nb, b = item % nb;
    float v[NE];
#pragma unroll
    for (int j = 0; j < NE; ++j) v[j] = dev::load_act(x, xt, r * ldx + b * QB + lane + 32 * j);
    uint8_t c[NE];
    const float s = dev::qa8_warp_block<NE>(v, c);
    if (codes) {
#pragma unroll
      for (int j = 0; j < NE; ++j) codes[r * K + b * QB + lane + 32 * j] = c[j];
      if (lane == 0) scales[r * nb + b] = s;
    }
    if (y) {
#pragma unroll
      for (int j = 0; j < NE; ++j) dev::store_act(y, yt, r * ldy + b * QB + lane + 32 * j, e4m3_to_f32(c[j]) * s);
    }
  }
}

__global__ void convert_kernel(const void* __restrict__ x, int xt, void* __restrict__ y, int yt, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dev::store_act(y, yt, i, dev::load_act(x, xt, i));
}

void launch_qa8(DType xt, const void* x, int64_t ldx, int64_t rows, int64_t K, int block, uint8_t* codes,
                float* scales, DType yt, void* y, int64_t ldy, cudaStream_t stream) {
  DSX_CHECK(block == 32 || block == 64 || block == 128, "qa8: block must be 32, 64 or 128 (got ", block, ")");
  DSX_CHECK(K > 0 && K % block == 0, "qa8: K=", K, " is not a multiple of the block ", block);
  if (rows <= 0) return;
  const int64_t warps = rows * (K / block);
  const int64_t blocks = std::min<int64_t>((warps + 7) / 8, static_cast<int64_t>(sm_count()) * 16);
  const int g = static_cast<int>(std::max<int64_t>(blocks, 1));
  const int xi = static_cast<int>(xt), yi = static_cast<int>(yt);
  if (block == 32)
    qa8_kernel<1><<<g, kThreads, 0, stream>>>(x, xi, ldx, rows, K, codes, scales, y, yi, ldy);
  else if (block == 64)
    qa8_kernel<2><<<g, kThreads, 0, stream>>>(x, xi, ldx, rows, K, codes, scales, y, yi, ldy);
  else
    qa8_kernel<4><<<g, kThreads, 0, stream>>>(x, xi, ldx, rows, K, codes, scales, y, yi, ldy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void qa8_codes(DType xt, const void* x, int64_t ldx, int64_t rows, int64_t K, int block, uint8_t* codes,
               float* scales, cudaStream_t stream) {
  DSX_CHECK(codes && scales, "qa8_codes: null output");
  launch_qa8(xt, x, ldx, rows, K, block, codes, scales, DType::F32, nullptr, 0, stream);
}

void qa8_fake(DType xt, const void* x, int64_t ldx, int64_t rows, int64_t K, int block, DType yt, void* y,
              int64_t ldy, cudaStream_t stream) {
  DSX_CHECK(y, "qa8_fake: null output");
  launch_qa8(xt, x, ldx, rows, K, block, nullptr, nullptr, yt, y, ldy, stream);
}

void convert(DType xt, const void* x, DType yt, void* y, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int64_t blocks = std::min<int64_t>((n + 255) / 256, static_cast<int64_t>(sm_count()) * 32);
  convert_kernel<<<static_cast<int>(blocks), 256, 0, stream>>>(x, static_cast<int>(xt), y, static_cast<int>(yt), n);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
