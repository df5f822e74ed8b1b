#include "model/cpu/quant.h"

#include <algorithm>
#include <cmath>

#include "util/numerics.h"

namespace dsx::cpu {

namespace {
float block_amax(const float* x, int64_t n) {
  float m = 0.f;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}
}  // namespace

void qa8_inplace(float* x, int64_t n, int block) {
  const float inv448 = 1.0f / 448.0f;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min<int64_t>(block, n - b0);
    float* p = x + b0;
    const float s = pow2ceil(std::max(block_amax(p, len), 1e-4f) * inv448);
    for (int64_t i = 0; i < len; ++i) p[i] = round_e4m3(std::clamp(p[i] / s, -448.0f, 448.0f)) * s;
  }
}

void qa8_codes(const float* x, int64_t n, int block, uint8_t* codes, float* scales) {
  const float inv448 = 1.0f / 448.0f;
  for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, ++bi) {
    const int64_t len = std::min<int64_t>(block, n - b0);
    const float s = pow2ceil(std::max(block_amax(x + b0, len), 1e-4f) * inv448);
    scales[bi] = s;
    for (int64_t i = 0; i < len; ++i) codes[b0 + i] = f32_to_e4m3(std::clamp(x[b0 + i] / s, -448.0f, 448.0f));
  }
}

void fq4_e8_inplace(float* x, int64_t n, int block) {
  const float inv6 = 1.0f / 6.0f;
  const float floor_ = 6.0f * std::ldexp(1.0f, -126);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min<int64_t>(block, n - b0);
    float* p = x + b0;
    const float s = pow2ceil(std::max(block_amax(p, len), floor_) * inv6);
    for (int64_t i = 0; i < len; ++i) p[i] = e2m1_to_f32(f32_to_e2m1(std::clamp(p[i] / s, -6.0f, 6.0f))) * s;
  }
}

void fq4_e4_inplace(float* x, int64_t n, int block) {
  const float floor_ = 6.0f * std::ldexp(1.0f, -9);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const int64_t len = std::min<int64_t>(block, n - b0);
    float* p = x + b0;
    const float s = round_e4m3(std::max(block_amax(p, len), floor_) / 6.0f);
    for (int64_t i = 0; i < len; ++i) p[i] = e2m1_to_f32(f32_to_e2m1(std::clamp(p[i] / s, -6.0f, 6.0f))) * s;
  }
}

}  // namespace dsx::cpu
