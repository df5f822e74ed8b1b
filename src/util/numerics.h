// Scalar number formats of the checkpoint and of the model's fake-quantizers
// (spec model-v41.md §2.2, §3.0.2-§3.0.5). Host/device inline so CUDA kernels and
// their CPU twins share the exact same definitions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define DSX_HD __host__ __device__ __forceinline__
#else
#define DSX_HD inline
#endif

namespace dsx {

DSX_HD uint32_t f32_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
DSX_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---- bfloat16 ---------------------------------------------------------------
DSX_HD float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }
// Round to nearest even (NaN stays NaN).
DSX_HD uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
DSX_HD float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

// ---- e8m0 (ue8m0) scale byte: 2^(u-127); u = 0 -> 2^-127 (subnormal), 255 -> NaN
DSX_HD float e8m0_to_f32(uint8_t u) {
  if (u == 0) return bits_f32(0x00400000u);
  if (u == 255) return bits_f32(0x7fc00000u);
  return bits_f32(static_cast<uint32_t>(u) << 23);
}

// ---- e4m3fn (OCP, bias 7, max 448, 0x7f/0xff NaN) ------------------------------
DSX_HD float e4m3_to_f32(uint8_t b) {
  const uint32_t sign = (b & 0x80u) << 24;
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  if (e == 15 && m == 7) return bits_f32(sign | 0x7fc00000u);
  if (e == 0) {
    // m * 2^-9, exact
    float v = static_cast<float>(m) * 0.001953125f;
    return sign ? -v : v;
  }
  return bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

// Round-to-nearest-even onto the e4m3fn grid, saturating at +-448 (inputs of the
// fake-quantizers are pre-clamped, so saturation never changes their result).
DSX_HD uint8_t f32_to_e4m3(float f) {
  uint32_t u = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  if (u >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7e);  // >= 448 -> 448
  const int exp = static_cast<int>(u >> 23) - 127;
  if (exp < -6) {
    // subnormal range: value = m * 2^-9, m in [0, 8]; m = 8 is the smallest normal.
    float a = bits_f32(u) * 512.0f;  // exact scaling by a power of two
    // round half to even on integer grid
    float r = std::nearbyint(a);
#if !defined(__CUDA_ARCH__)
    // std::nearbyint follows the current rounding mode (default: to nearest even).
#endif
    int m = static_cast<int>(r);
    if (m >= 8) return static_cast<uint8_t>(sign | 0x08);  // 2^-6 (e=1, m=0)
    return static_cast<uint8_t>(sign | m);
  }
  // normal: keep 3 mantissa bits with RNE
  uint32_t mant = u & 0x7fffffu;
  uint32_t keep = mant >> 20, rest = mant & 0xfffffu;
  const uint32_t half = 0x80000u;
  if (rest > half || (rest == half && (keep & 1u))) keep += 1;
  int e = exp + 7;
  if (keep == 8) {
    keep = 0;
    e += 1;
  }
  if (e > 15 || (e == 15 && keep == 7)) return static_cast<uint8_t>(sign | 0x7e);
  return static_cast<uint8_t>(sign | (e << 3) | keep);
}
DSX_HD float round_e4m3(float f) { return e4m3_to_f32(f32_to_e4m3(f)); }

// ---- e2m1 (FP4): bit 3 sign, bits 0-2 index into {0,.5,1,1.5,2,3,4,6} ------------
DSX_HD float e2m1_to_f32(uint8_t c) {
  constexpr float kMag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float v = kMag[c & 7u];
  return (c & 8u) ? -v : v;
}
// Round-to-nearest-even onto the e2m1 grid; input pre-clamped to [-6, 6]. Ties go
// to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
DSX_HD uint8_t f32_to_e2m1(float v) {
  const uint8_t sign = (f32_bits(v) >> 31) ? 8 : 0;
  float a = std::fabs(v);
  uint8_t c;
  if (a <= 0.25f) c = 0;
  else if (a < 0.75f) c = 1;
  else if (a <= 1.25f) c = 2;
  else if (a < 1.75f) c = 3;
  else if (a <= 2.5f) c = 4;
  else if (a < 3.5f) c = 5;
  else if (a <= 5.0f) c = 6;
  else c = 7;
  return static_cast<uint8_t>(sign | c);
}

// ---- power-of-two scale rounding (spec §3.0.2): 2^(E-127+[F!=0]) ---------------
DSX_HD float pow2ceil(float v) {
  const uint32_t u = f32_bits(v);
  const int e = static_cast<int>((u >> 23) & 0xffu) - 127 + ((u & 0x7fffffu) != 0 ? 1 : 0);
  // exp2 of an integer, exact; covers subnormal results too
  return std::ldexp(1.0f, e);
}

}  // namespace dsx
