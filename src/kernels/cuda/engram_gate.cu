#include "kernels/cuda/engram_gate.h"

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

// One block per gathered row; one warp per 32-element scale block.
template <typename T>
__global__ void engram_gather_kernel(const uint8_t* __restrict__ table, const uint8_t* __restrict__ table_scale,
                                     int dim, const int64_t* __restrict__ ids, T* __restrict__ u,
                                     uint8_t* __restrict__ qc, float* __restrict__ qs) {
  const int64_t i = blockIdx.x;
  const int64_t r = ids[i];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int b = warp; b < dim / 32; b += nw) {
    const int d = b * 32 + lane;
    const float v = e4m3_to_f32(table[r * dim + d]) * e8m0_to_f32(table_scale[r * (dim / 32) + b]);
    st(u, i * dim + d, v);  // exact in bf16
    if (qc) {
      const QCode q = fq8_group(rnd<T>(v));
      qc[i * dim + d] = q.code;
      if (lane == 0) qs[i * (dim / 32) + b] = q.scale;
    }
  }
}

// One block per (stream m, token t).
template <typename T>
__global__ void engram_gate_kernel(int M, int64_t D, const T* __restrict__ yE, T* X, const float* __restrict__ w,
                                   float eps) {
  __shared__ double red_d[32];
  __shared__ float red_f[32];
  const int m = blockIdx.x, t = blockIdx.y;
  const T* yt = yE + static_cast<int64_t>(t) * (M + 1) * D;
  const T* key = yt + static_cast<int64_t>(m) * D;
  const T* value = yt + static_cast<int64_t>(M) * D;
  T* h = X + (static_cast<int64_t>(t) * M + m) * D;
  const float* wm = w + static_cast<int64_t>(m) * D;
  double hh = 0.0, kk = 0.0;
  float dot = 0.0f;
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) {
    const float hv = ld(h, i), kv = ld(key, i);
    hh += static_cast<double>(hv) * static_cast<double>(hv);
    kk += static_cast<double>(kv) * static_cast<double>(kv);
    dot = fmaf(hv * wm[i], kv, dot);  // CPU: dot += h * w * k (fused by the host compiler)
  }
  hh = block_sum(hh, red_d);
  kk = block_sum(kk, red_d);
  dot = block_sum(dot, red_f);
  const float rstd = (1.0f / sqrtf(static_cast<float>(hh / static_cast<double>(D)) + eps)) *
                     (1.0f / sqrtf(static_cast<float>(kk / static_cast<double>(D)) + eps));
  const float inv_sqrt_d = static_cast<float>(1.0 / sqrt(static_cast<double>(D)));
  const float dl = dot * rstd * inv_sqrt_d;
  const float g = sigmoid_dev(copysignf(sqrtf(fmaxf(fabsf(dl), 1e-6f)), dl));
  for (int64_t i = threadIdx.x; i < D; i += blockDim.x) st(h, i, fmaf(g, ld(value, i), ld(h, i)));
}

}  // namespace

void engram_gather(Act act, const uint8_t* table, const uint8_t* table_scale, int dim, const int64_t* ids, int n,
                   void* u, uint8_t* q_codes, float* q_scales, cudaStream_t stream) {
  if (n <= 0) return;
  DSX_CHECK(dim % 32 == 0, "engram_gather: row width must be a multiple of 32");
  DSX_CHECK((q_codes == nullptr) == (q_scales == nullptr), "engram_gather: give both QA8 outputs or neither");
  const int threads = dim >= 256 ? 256 : dim;
  DSX_DISPATCH_ACT(act, T,
                   engram_gather_kernel<T><<<n, threads, 0, stream>>>(table, table_scale, dim, ids, static_cast<T*>(u),
                                                                      q_codes, q_scales));
  check_launch("engram_gather");
}

void engram_gate(Act act, int T, int M, int64_t D, const void* yE, void* X, const float* w, float eps,
                 cudaStream_t stream) {
  if (T <= 0) return;
  dim3 grid(M, T);
  DSX_DISPATCH_ACT(act, T_,
                   engram_gate_kernel<T_><<<grid, 512, 0, stream>>>(M, D, static_cast<const T_*>(yE),
                                                                    static_cast<T_*>(X), w, eps));
  check_launch("engram_gate");
}

}  // namespace dsx::cuda
