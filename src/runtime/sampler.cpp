#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/engine.h"
#include "util/error.h"

namespace dsx {

// Two passes: the largest value (eight independent running maxima, branch-free, so the
// compiler vectorises it), then the first index holding it. A decode step's 129280
// logits took ~130-300 us on the plain scan's one dependent compare chain. Same result
// as the plain scan: the first index of the largest value; NaNs never win; a NaN at
// index 0 returns 0 (nothing compares greater than it).
int32_t argmax(const float* l, int64_t n) {
  if (n <= 0 || std::isnan(l[0])) return 0;
  constexpr int kLanes = 8;
  float m[kLanes];
  for (int j = 0; j < kLanes; ++j) m[j] = l[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) m[j] = l[i + j] > m[j] ? l[i + j] : m[j];
  float v = m[0];
  for (int j = 1; j < kLanes; ++j) v = m[j] > v ? m[j] : v;
  for (; i < n; ++i) v = l[i] > v ? l[i] : v;
  for (i = 0; i < n; ++i)
    if (l[i] == v) return static_cast<int32_t>(i);
  return 0;
}

int32_t Sampler::feed_and_pick(Session& s, const int32_t* ids, int64_t n, std::vector<float>& logits) {
  if (o_.temperature <= 0.0f) return s.feed_greedy(ids, n);
  s.feed(ids, n, logits.data(), false);
  return sample(logits.data(), static_cast<int64_t>(logits.size()));
}

int32_t Sampler::sample(const float* l, int64_t n) {
  if (o_.temperature <= 0.0f) return argmax(l, n);
  if (!(o_.top_p > 0.0f && o_.top_p <= 1.0f)) fail("top_p must be in (0, 1]");
  std::vector<int32_t> idx(static_cast<size_t>(n));
  std::iota(idx.begin(), idx.end(), 0);
  int64_t k = n;
  if (o_.top_k > 0 && o_.top_k < n) {
    k = o_.top_k;
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  } else {
    std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  }
  const double mx = l[idx[0]];
  std::vector<double> p(static_cast<size_t>(k));
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += (p[i] = std::exp((l[idx[i]] - mx) / o_.temperature));
  int64_t keep = k;
  if (o_.top_p < 1.0f) {
    double c = 0;
    for (int64_t i = 0; i < k; ++i) {
      c += p[i] / sum;
      if (c >= o_.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double tot = 0;
  for (int64_t i = 0; i < keep; ++i) tot += p[i];
  double u = std::uniform_real_distribution<double>(0.0, tot)(rng_);
  for (int64_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace dsx
