#include "kernels/cuda/router.h"

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/quant_act_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxE = 1024;
constexpr int kMaxK = 16;

__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// One block per token.
__global__ void __launch_bounds__(kThreads)
    router_select_kernel(const float* __restrict__ z, int64_t ldz, int E, const float* __restrict__ bias, int topk,
                         float gate_temp, int norm, float route_scale, int32_t* __restrict__ ids,
                         float* __restrict__ weights) {
  __shared__ float sc[kMaxE], biased[kMaxE];
  __shared__ unsigned char taken[kMaxE];
  __shared__ float wv[kThreads / 32];
  __shared__ int wi[kThreads / 32];
  __shared__ int chosen[kMaxK];
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const float v = z[t * ldz + e] / gate_temp;
    const float sp = v > 20.0f ? v : log1pf(expf(v));
    const float s = sqrtf(sp);
    sc[e] = s;
    biased[e] = bias ? s + bias[e] : s;
    taken[e] = 0;
  }
  __syncthreads();
  for (int k = 0; k < topk; ++k) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = threadIdx.x; e < E; e += kThreads)
      if (!taken[e] && (bi == 0x7fffffff || better(biased[e], e, bv, bi))) {
        bv = biased[e];
        bi = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(dev::kFull, bv, o);
      const int oi = __shfl_xor_sync(dev::kFull, bi, o);
      if (oi != 0x7fffffff && (bi == 0x7fffffff || better(ov, oi, bv, bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      wv[warp] = bv;
      wi[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float v = wv[0];
      int i = wi[0];
      for (int w = 1; w < kThreads / 32; ++w)
        if (wi[w] != 0x7fffffff && (i == 0x7fffffff || better(wv[w], wi[w], v, i))) {
          v = wv[w];
          i = wi[w];
        }
      chosen[k] = i;
      taken[i] = 1;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int k = 0; k < topk; ++k) sum += sc[chosen[k]];
    for (int k = 0; k < topk; ++k) {
      float w = sc[chosen[k]];
      if (norm && topk > 1) w = w / (sum + 1e-20f);
      ids[t * topk + k] = chosen[k];
      weights[t * topk + k] = w * route_scale;
    }
  }
}

}  // namespace

void router_select(const float* z, int64_t ldz, int T, int E, const float* bias, int topk, const RouterOpts& o,
                   int32_t* ids, float* weights, cudaStream_t stream) {
  if (T <= 0) return;
  DSX_CHECK(E >= 1 && E <= kMaxE, "router: E=", E, " outside 1..", kMaxE);
  DSX_CHECK(topk >= 1 && topk <= kMaxK && topk <= E, "router: bad topk ", topk);
  router_select_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(z, ldz, E, bias, topk, o.gate_temp,
                                                                         o.norm_topk_prob ? 1 : 0, o.route_scale,
                                                                         ids, weights);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void router(DType xt, const void* x, int64_t ldx, int T, const QMatrix& gate, const float* bias, int topk,
            const RouterOpts& o, float* logits, int32_t* ids, float* weights, cudaStream_t stream) {
  DSX_CHECK(gate.fmt == WFormat::BF16 || gate.fmt == WFormat::F32, "router: gate must be BF16 or F32");
  GemvOpts g;
  gemv(gate, xt, x, ldx, T, DType::F32, logits, gate.rows, g, stream);
  router_select(logits, gate.rows, T, static_cast<int>(gate.rows), bias, topk, o, ids, weights, stream);
}

}  // namespace dsx::cuda
