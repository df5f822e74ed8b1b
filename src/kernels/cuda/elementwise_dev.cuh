// Device helpers shared by the non-GEMM kernels (include from .cu files only):
// activation load/store with the mode's rounding, deterministic reductions, the
// model's fake-quantizers on warp groups, RoPE with in-kernel angles, compact-row
// decoders. Formulas follow the CPU code operation by operation (including where
// the host compiler fuses a multiply-add: see the notes at each helper).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/quant_act_device.cuh"
#include "util/numerics.h"

namespace dsx::cuda::dev {

using bf16 = __nv_bfloat16;

// ---- activation storage ---------------------------------------------------------
__device__ __forceinline__ float ld(const float* p, int64_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void st(float* p, int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }

// The value a store of v into T keeps.
template <typename T>
__device__ __forceinline__ float rnd(float v) {
  return v;
}
template <>
__device__ __forceinline__ float rnd<bf16>(float v) {
  return __bfloat162float(__float2bfloat16_rn(v));
}
__device__ __forceinline__ float round_bf16_dev(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

#define DSX_DISPATCH_ACT(act, T, ...)        \
  do {                                       \
    if ((act) == ::dsx::cuda::Act::F32) {    \
      using T = float;                       \
      __VA_ARGS__;                           \
    } else {                                 \
      using T = ::dsx::cuda::dev::bf16;      \
      __VA_ARGS__;                           \
    }                                        \
  } while (0)

// (warp_sum, warp_max and block_sum: quant_act_device.cuh)

// ---- fake-quantizers on groups of consecutive lanes ----------------------------------
// Each lane holds one element; a group is G consecutive lanes (G = 16 or 32); all 32
// lanes of the warp must execute the call. Results match dsx::cpu::{qa8,fq4_e8,fq4_e4}
// bit for bit (same formulas from util/numerics.h).
template <int G>
__device__ __forceinline__ float group_amax(float v) {
  float a = fabsf(v);
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  return a;
}

struct QCode {
  uint8_t code;  // e4m3 byte (FQ8) or e2m1 nibble (FQ4)
  float scale;   // the block scale (power of two for FQ8 / FQ4e8, an e4m3 value for FQ4e4)
  float value;   // code x scale (the fake-quantized value)
};

// QA8 / FQ8: block 32, e4m3 codes, power-of-two scale.
__device__ __forceinline__ QCode fq8_group(float v) {
  const float amax = group_amax<32>(v);
  const float s = pow2ceil(fmaxf(amax, 1e-4f) * (1.0f / 448.0f));
  const uint8_t c = f32_to_e4m3(fminf(fmaxf(v / s, -448.0f), 448.0f));
  return {c, s, e4m3_to_f32(c) * s};
}

// FQ4e8: block 32, e2m1 codes, power-of-two scale.
__device__ __forceinline__ QCode fq4e8_group(float v) {
  const float amax = group_amax<32>(v);
  const float floor_ = 6.0f * bits_f32(0x00800000u);  // 6 * 2^-126
  const float s = pow2ceil(fmaxf(amax, floor_) * (1.0f / 6.0f));
  const uint8_t c = f32_to_e2m1(fminf(fmaxf(v / s, -6.0f), 6.0f));
  return {c, s, e2m1_to_f32(c) * s};
}

// FQ4e4: block 16, e2m1 codes, e4m3 scale from a true division.
__device__ __forceinline__ QCode fq4e4_group(float v) {
  const float amax = group_amax<16>(v);
  const float floor_ = 6.0f * 0.001953125f;  // 6 * 2^-9
  const uint8_t sc = f32_to_e4m3(fmaxf(amax, floor_) / 6.0f);
  const float s = e4m3_to_f32(sc);
  const uint8_t c = f32_to_e2m1(fminf(fmaxf(v / s, -6.0f), 6.0f));
  return {c, s, e2m1_to_f32(c) * s};
}

// ue8m0 byte of a normal power-of-two scale.
__device__ __forceinline__ uint8_t ue8m0_byte(float pow2) { return static_cast<uint8_t>((f32_bits(pow2) >> 23) & 0xffu); }

// Packs the e2m1 nibbles of lane pairs (even lane = low nibble); valid in even lanes.
__device__ __forceinline__ uint8_t pack_nibbles(uint8_t code) {
  const uint32_t hi = __shfl_down_sync(0xffffffffu, static_cast<uint32_t>(code), 1);
  return static_cast<uint8_t>((code & 0xfu) | ((hi & 0xfu) << 4));
}

// Branch-free e2m1 decode (same values as dsx::e2m1_to_f32, -0 for code 8).
__device__ __forceinline__ float e2m1_dev(uint32_t c) {
  const uint32_t m = c & 7u, e = m >> 1, mb = m & 1u;
  uint32_t bits = e ? (((e + 126u) << 23) | (mb << 22)) : (mb ? 0x3f000000u : 0u);
  bits |= (c & 8u) << 28;
  return __uint_as_float(bits);
}
// e4m3fn decode without NaN handling (valid codes only), exact.
__device__ __forceinline__ float e4m3_dev(uint32_t b) {
  const uint32_t sign = (b & 0x80u) << 24, e = (b >> 3) & 15u, m = b & 7u;
  const float sub = static_cast<float>(m) * 0.001953125f;
  const float v = e ? __uint_as_float(((e + 120u) << 23) | (m << 20)) : sub;
  return __uint_as_float(__float_as_uint(v) | sign);
}
// ue8m0 decode (byte 0 -> 2^-127).
__device__ __forceinline__ float e8m0_dev(uint32_t u) { return u ? __uint_as_float(u << 23) : __uint_as_float(0x00400000u); }

// ---- RoPE (spec §3.0.6) ------------------------------------------------------------
// Angle fl32(fl32(pos) * inv_freq), cos/sin evaluated in double and rounded once to
// f32 (libm-quality; not the fast intrinsics).
__device__ __forceinline__ void rope_cs(float pos, float inv_freq, float& c, float& s) {
  const float ang = __fmul_rn(pos, inv_freq);
  double sd, cd;
  sincos(static_cast<double>(ang), &sd, &cd);
  c = static_cast<float>(cd);
  s = static_cast<float>(sd);
}

// Rotation of one pair, computed as the CPU does (products rounded, then add/sub; no
// fused multiply-add). inverse = conjugate rotation.
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, bool inverse, float& ra, float& rb) {
  if (inverse) s = -s;
  ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
  rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
}

// One element per lane (lane pairs hold elements 2i, 2i+1 of the vector; all lanes of
// the warp call it). d = element index, len = vector length; rotates the trailing
// 2 * n_pairs elements. Returns the rotated value (not rounded).
// rope_lane in two steps: rope_lane_cs (the lane's cos / sin, which need only the
// position: e.g. before a grid-dependency wait), then rope_lane_apply.
__device__ __forceinline__ void rope_lane_cs(int d, int len, int n_pairs, float pos, const float* inv_freq, float& c,
                                             float& s) {
  const int off = len - 2 * n_pairs;
  c = 1.0f, s = 0.0f;
  if (d >= off && d < len) rope_cs(pos, inv_freq[(d - off) >> 1], c, s);
}
__device__ __forceinline__ float rope_lane_apply(float v, int d, int len, int n_pairs, float c, float s, bool inverse) {
  const float other = __shfl_xor_sync(0xffffffffu, v, 1);
  const int off = len - 2 * n_pairs;
  if (d < off || d >= len) return v;
  float ra, rb;
  if ((d & 1) == 0) {
    rope_pair(v, other, c, s, inverse, ra, rb);
    return ra;
  }
  rope_pair(other, v, c, s, inverse, ra, rb);
  return rb;
}
__device__ __forceinline__ float rope_lane(float v, int d, int len, int n_pairs, float pos, const float* inv_freq,
                                           bool inverse) {
  float c, s;
  rope_lane_cs(d, len, n_pairs, pos, inv_freq, c, s);
  return rope_lane_apply(v, d, len, n_pairs, c, s, inverse);
}

// sigmoid as the CPU: 1 / (1 + exp(-x))
__device__ __forceinline__ float sigmoid_dev(float x) { return 1.0f / (1.0f + expf(-x)); }

}  // namespace dsx::cuda::dev
