#include "model/kv_formats.h"

#include <algorithm>
#include <cmath>

#include "util/error.h"
#include "util/numerics.h"

namespace dsx {

namespace {

bool same_bits(float a, float b) { return f32_bits(a) == f32_bits(b); }

float block_amax(const float* v, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
  return m;
}

bool try_e4m3_codes(const float* v, int n, float s, uint8_t* codes) {
  for (int i = 0; i < n; ++i) {
    const float q = v[i] / s;
    if (!(std::fabs(q) <= 448.0f)) return false;
    const uint8_t c = f32_to_e4m3(q);
    if (!same_bits(e4m3_to_f32(c) * s, v[i])) return false;
    codes[i] = c;
  }
  return true;
}

bool try_e2m1_codes(const float* v, int n, float s, uint8_t* nib) {
  for (int i = 0; i < n; ++i) {
    const float q = v[i] / s;
    if (!(std::fabs(q) <= 6.0f)) return false;
    const uint8_t c = f32_to_e2m1(q);
    if (!same_bits(e2m1_to_f32(c) * s, v[i])) return false;
    nib[i] = c;
  }
  return true;
}

bool is_normal_pow2(float s) {
  const uint32_t u = f32_bits(s);
  return (u & 0x7fffffu) == 0 && ((u >> 23) & 0xffu) >= 1 && ((u >> 23) & 0xffu) <= 254 && !(u >> 31);
}

// Tries the preferred power-of-two scale, then its neighbours.
template <typename Try>
bool pow2_search(float s0, Try&& attempt, float& s_out) {
  for (int k = 0; k <= 40; ++k) {
    for (int sign : {1, -1}) {
      if (k == 0 && sign < 0) continue;
      const float s = std::ldexp(s0, sign * k);
      if (!is_normal_pow2(s)) continue;
      if (attempt(s)) {
        s_out = s;
        return true;
      }
    }
  }
  return false;
}

void put_nibbles(const uint8_t* nib, int n, uint8_t* packed) {
  for (int i = 0; i < n; i += 2) packed[i / 2] = static_cast<uint8_t>((nib[i] & 15u) | ((nib[i + 1] & 15u) << 4));
}

}  // namespace

void pack_fq8_rows(const float* vals, int64_t rows, int dim, uint8_t* codes, uint8_t* scales) {
  DSX_CHECK(dim % 32 == 0, "pack_fq8_rows: dim must be a multiple of 32");
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 32; ++b) {
      const float* v = vals + r * dim + b * 32;
      uint8_t* c = codes + r * dim + b * 32;
      const float s0 = pow2ceil(std::max(block_amax(v, 32), 1e-4f) * (1.0f / 448.0f));
      float s = 0;
      if (!pow2_search(s0, [&](float sc) { return try_e4m3_codes(v, 32, sc, c); }, s))
        fail("pack_fq8_rows: row ", r, " block ", b, " is not an FQ8 output (no e4m3 x 2^k representation)");
      scales[r * (dim / 32) + b] = static_cast<uint8_t>((f32_bits(s) >> 23) & 0xffu);
    }
}

void unpack_fq8_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d)
      out[r * dim + d] = e4m3_to_f32(codes[r * dim + d]) * e8m0_to_f32(scales[r * (dim / 32) + d / 32]);
}

void pack_fq4e8_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales) {
  DSX_CHECK(dim % 32 == 0, "pack_fq4e8_rows: dim must be a multiple of 32");
  uint8_t nib[32];
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 32; ++b) {
      const float* v = vals + r * dim + b * 32;
      const float s0 = pow2ceil(std::max(block_amax(v, 32), 6.0f * std::ldexp(1.0f, -126)) * (1.0f / 6.0f));
      float s = 0;
      if (!pow2_search(s0, [&](float sc) { return try_e2m1_codes(v, 32, sc, nib); }, s))
        fail("pack_fq4e8_rows: row ", r, " block ", b, " is not an FQ4e8 output (no e2m1 x 2^k representation)");
      put_nibbles(nib, 32, packed + (r * dim + b * 32) / 2);
      scales[r * (dim / 32) + b] = static_cast<uint8_t>((f32_bits(s) >> 23) & 0xffu);
    }
}

void unpack_fq4e8_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const uint8_t c = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 15u);
      out[i] = e2m1_to_f32(c) * e8m0_to_f32(scales[r * (dim / 32) + d / 32]);
    }
}

void pack_fq4e4_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales) {
  DSX_CHECK(dim % 16 == 0, "pack_fq4e4_rows: dim must be a multiple of 16");
  static constexpr float kCodes[7] = {6.0f, 4.0f, 3.0f, 2.0f, 1.5f, 1.0f, 0.5f};
  uint8_t nib[16];
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 16; ++b) {
      const float* v = vals + r * dim + b * 16;
      const float amax = block_amax(v, 16);
      // the quantizer's own choice on these values, then amax / (a grid value)
      float cand[8];
      int nc = 0;
      cand[nc++] = round_e4m3(std::max(amax, 6.0f * std::ldexp(1.0f, -9)) / 6.0f);
      if (amax > 0)
        for (float c : kCodes) cand[nc++] = amax / c;
      bool ok = false;
      for (int i = 0; i < nc && !ok; ++i) {
        const float s = cand[i];
        if (!(s > 0) || !same_bits(round_e4m3(s), s)) continue;
        if (try_e2m1_codes(v, 16, s, nib)) {
          put_nibbles(nib, 16, packed + (r * dim + b * 16) / 2);
          scales[r * (dim / 16) + b] = f32_to_e4m3(s);
          ok = true;
        }
      }
      if (!ok) fail("pack_fq4e4_rows: row ", r, " block ", b, " is not an FQ4e4 output (no e2m1 x e4m3 representation)");
    }
}

void unpack_fq4e4_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const uint8_t c = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 15u);
      out[i] = e2m1_to_f32(c) * e4m3_to_f32(scales[r * (dim / 16) + d / 16]);
    }
}

}  // namespace dsx
