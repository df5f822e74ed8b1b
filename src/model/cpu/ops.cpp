#include "model/cpu/ops.h"

namespace dsx::cpu {

void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float var = static_cast<float>(ss / static_cast<double>(n));
  const float r = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * r;
    out[i] = w ? w[i] * v : v;
  }
}

void rope_apply(float* x, int64_t len, int n_pairs, const float* cos, const float* sin, bool inverse) {
  float* p = x + (len - 2 * n_pairs);
  for (int i = 0; i < n_pairs; ++i) {
    const float c = cos[i], s = inverse ? -sin[i] : sin[i];
    const float a = p[2 * i], b = p[2 * i + 1];
    p[2 * i] = a * c - b * s;
    p[2 * i + 1] = a * s + b * c;
  }
}

}  // namespace dsx::cpu
