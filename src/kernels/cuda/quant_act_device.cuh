// Device-side helpers shared by the weight-streaming kernels and (through elementwise_dev.cuh)
// the other kernels: activation loads / stores, warp and block reductions, QA8 (CUDA only).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "util/numerics.h"

namespace dsx::cuda::dev {

constexpr unsigned kFull = 0xffffffffu;

__device__ __forceinline__ float load_act(const void* x, int xt, int64_t i) {
  if (xt == 0) return static_cast<const float*>(x)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(x)[i]);
}

__device__ __forceinline__ void store_act(void* y, int yt, int64_t i, float v) {
  if (yt == 0)
    static_cast<float*>(y)[i] = v;
  else
    static_cast<uint16_t*>(y)[i] = f32_to_bf16(v);
}

// ---- reductions (deterministic: fixed butterfly / warp order) ---------------------
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFull, v, o));
  return v;
}

template <typename V>
__device__ __forceinline__ V warp_sum(V v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Block-wide sum, result in every thread. blockDim.x must be a multiple of 32 and
// every thread must call it. scratch: >= 32 elements of shared memory.
template <typename V>
__device__ __forceinline__ V block_sum(V v, V* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[w] = v;
  __syncthreads();
  V r = scratch[0];
  for (int i = 1; i < nw; ++i) r += scratch[i];
  return r;
}

// QA8 scale of a block whose max |x| is amax (spec §3.0.3; identical expression to
// dsx::cpu::qa8_codes).
// (pow2ceil by its bits: the argument is a normal number >= 2^-23 or inf, so the
// rounded-up exponent field fits in 8 bits and 255 is inf, as pow2ceil gives.)
__device__ __forceinline__ float qa8_scale(float amax) {
  const float inv448 = 1.0f / 448.0f;
  const uint32_t u = __float_as_uint(fmaxf(amax, 1e-4f) * inv448);
  return __uint_as_float(((u >> 23) + ((u & 0x7fffffu) != 0 ? 1u : 0u)) << 23);
}

// 1 / s for a power of two s in [2^-126, 2^126] (exact, an exponent subtraction) or
// s = inf (0), as 1.0f / s but without the division's instruction sequence.
__device__ __forceinline__ float pow2_recip(float s) {
  const uint32_t b = __float_as_uint(s);
  return b >= 0x7f800000u ? 0.0f : __uint_as_float(0x7f000000u - b);
}

__device__ __forceinline__ uint8_t qa8_code(float v, float s) {
  return f32_to_e4m3(fminf(fmaxf(v / s, -448.0f), 448.0f));
}

// One warp quantizes one block of NE*32 consecutive values v[j] (lane holds
// elements lane + 32*j). Returns the scale; codes[j] receive the e4m3 codes.
template <int NE>
__device__ __forceinline__ float qa8_warp_block(const float (&v)[NE], uint8_t (&codes)[NE]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < NE; ++j) m = fmaxf(m, fabsf(v[j]));
  m = warp_max(m);
  const float s = qa8_scale(m);
#pragma unroll
  for (int j = 0; j < NE; ++j) codes[j] = qa8_code(v[j], s);
  return s;
}

// ---- weight decoding "tricks" (exact) --------------------------------------------
// e4m3 byte J of word v as an f32 equal to e4m3(b) * 2^-120 (normal codes land on the
// f32 exponent, subnormal codes on f32 subnormals; both exact).
template <int J>
__device__ __forceinline__ float fp8_trick(uint32_t v) {
  const uint32_t x = v << (24 - 8 * J);
  return __uint_as_float((x & 0x80000000u) | ((x >> 4) & 0x07F00000u));
}
// e2m1 nibble J (0..7, J = 0 is the low nibble of byte 0) of word v as an f32 equal to
// e2m1(c) * 2^-126 (exact).
template <int J>
__device__ __forceinline__ float fp4_trick(uint32_t v) {
  const uint32_t x = v << (28 - 4 * J);
  return __uint_as_float((x & 0x80000000u) | ((x >> 6) & 0x01C00000u));
}

// Activations feeding FP8 / MXFP4 weights are staged multiplied by 2^34 (exact) so
// that products with the trick-scaled weights stay in the f32 normal range; the
// per-block factors below undo both offsets:
//   FP8:   y = p * 2^(u - 127) * 2^120 / 2^34 = p * 2^(u - 41)
//   MXFP4: y = p * 2^(u - 127) * 2^126 / 2^34 = p * 2^(u - 35)
// (valid for scale bytes u <= 168 resp. 162, i.e. any realistic weight scale).
constexpr float kTrickPrescale = 17179869184.0f;  // 2^34
__device__ __forceinline__ float fp8_factor(uint32_t u) { return __uint_as_float((u + 86u) << 23); }
__device__ __forceinline__ float fp4_factor(uint32_t u) { return __uint_as_float((u + 92u) << 23); }

// Streaming 16-byte load (read once: no L1 allocation).
__device__ __forceinline__ uint4 ldg_stream(const void* p) {
  uint4 r;
#if defined(__CUDA_ARCH__)
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
#else
  r = *static_cast<const uint4*>(p);  // host emulation only
#endif
  return r;
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Shared-memory swizzle of staged activations: float4 index i of a row lives at
// i ^ ((i >> 3) & 7). Conflict-free for 16-byte reads when consecutive lanes read
// consecutive chunks of 1, 2, 4 or 8 float4 (F32, BF16, FP8, MXFP4 weights).
__device__ __forceinline__ int swz(int i) { return i ^ ((i >> 3) & 7); }

}  // namespace dsx::cuda::dev
