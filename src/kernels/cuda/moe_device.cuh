// Device helpers of the MoE kernels (moe.cu).
#pragma once
#include <cuda_runtime.h>

#include "util/numerics.h"

namespace dsx::cuda::dev {

// h = w * silu(g) * u with the V4.1 clamp (limit > 0: u to [-limit, limit], g to at most
// limit); bf16: the reference rounding points (g, u and h rounded to bf16).
__device__ __forceinline__ float swiglu_h(float g, float u, float w, float lim, int bf16) {
  if (bf16) {
    g = round_bf16(g);
    u = round_bf16(u);
  }
  if (lim > 0.0f) {
    u = fminf(fmaxf(u, -lim), lim);
    g = fminf(g, lim);
  }
  float h = w * ((g / (1.0f + expf(-g))) * u);
  if (bf16) h = round_bf16(h);
  return h;
}

}  // namespace dsx::cuda::dev
