#include "model/rope.h"

#include <algorithm>
#include <cmath>

namespace dsx {

namespace {
std::vector<float> base_freqs(double theta, int dim) {
  // pos_freqs = base ** (arange(0, dim, 2) / dim) in f32
  std::vector<float> pf;
  for (int i = 0; i < dim; i += 2) {
    const float e = static_cast<float>(i) / static_cast<float>(dim);
    pf.push_back(std::pow(static_cast<float>(theta), e));
  }
  return pf;
}
}  // namespace

void RopeTable::angles(int64_t pos, float* c, float* s) const {
  const float p = static_cast<float>(pos);
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    // f32 angle, cos/sin evaluated in double and rounded once (the CUDA kernels do the same)
    const float a = p * inv_freq[i];
    c[i] = static_cast<float>(std::cos(static_cast<double>(a)));
    s[i] = static_cast<float>(std::sin(static_cast<double>(a)));
  }
}

RopeTable make_main_rope(const ModelConfig& c) {
  RopeTable t;
  for (float f : base_freqs(c.rope_theta, c.rope_dim)) t.inv_freq.push_back(1.0f / f);
  return t;
}

RopeTable make_compress_rope(const ModelConfig& c) {
  RopeTable t;
  const int dim = c.rope_dim;
  const auto pf = base_freqs(c.compress_rope_theta, dim);
  if (!c.yarn.enabled || c.yarn.original_max_position <= 0) {
    for (float f : pf) t.inv_freq.push_back(1.0f / f);
    return t;
  }
  const double base = c.compress_rope_theta;
  auto corr_dim = [&](double rot) {
    return (dim * std::log(static_cast<double>(c.yarn.original_max_position) / (rot * 2 * M_PI))) / (2 * std::log(base));
  };
  double lo = std::max(std::floor(corr_dim(c.yarn.beta_fast)), 0.0);
  double hi = std::min(std::ceil(corr_dim(c.yarn.beta_slow)), static_cast<double>(dim - 1));
  if (lo == hi) hi += 0.001;
  const float factor = static_cast<float>(c.yarn.factor);
  for (int i = 0; i < dim / 2; ++i) {
    const float extrap = 1.0f / pf[static_cast<size_t>(i)];
    const float interp = 1.0f / (factor * pf[static_cast<size_t>(i)]);
    float ramp = (static_cast<float>(i) - static_cast<float>(lo)) / static_cast<float>(hi - lo);
    ramp = std::clamp(ramp, 0.0f, 1.0f);
    const float extrap_factor = 1.0f - ramp;
    t.inv_freq.push_back(interp * (1.0f - extrap_factor) + extrap * extrap_factor);
  }
  return t;
}

}  // namespace dsx
