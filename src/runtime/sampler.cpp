#include "runtime/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "runtime/engine.h"
#include "util/error.h"

namespace dsx {

namespace {
// The largest value of l[0..n), NaNs skipped (-inf when there is none): eight independent
// running maxima, branch-free, so the compiler vectorises it (a decode step's 129280
// logits took ~130-300 us on one dependent compare chain), then theirs.
float max_value(const float* l, int64_t n) {
  constexpr int kLanes = 8;
  float m[kLanes];
  for (int j = 0; j < kLanes; ++j) m[j] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) m[j] = l[i + j] > m[j] ? l[i + j] : m[j];
  for (; i < n; ++i) m[0] = l[i] > m[0] ? l[i] : m[0];
  float mx = m[0];
  for (int j = 1; j < kLanes; ++j) mx = m[j] > mx ? m[j] : mx;
  return mx;
}
}  // namespace

// Two passes: the largest value, then the first index holding it. Same result as the
// plain scan: the first index of the largest value; NaNs never win; a NaN at index 0
// returns 0 (nothing compares greater than it).
int32_t argmax(const float* l, int64_t n) {
  if (n <= 0 || std::isnan(l[0])) return 0;
  const float v = max_value(l, n);
  for (int64_t i = 0; i < n; ++i)
    if (l[i] == v) return static_cast<int32_t>(i);
  return 0;
}

int32_t Sampler::feed_and_pick(Session& s, const int32_t* ids, int64_t n, std::vector<float>& logits) {
  if (o_.temperature <= 0.0f) return s.feed_greedy(ids, n);
  s.feed(ids, n, logits.data(), false);
  return sample(logits.data(), static_cast<int64_t>(logits.size()));
}

// Temperature sampling. The distribution (the test's plain version implements it with
// one full sort):
//  1. mx = the largest logit (NaNs are never sampled; a row without a finite maximum,
//     e.g. all -inf or one +inf, gives argmax).
//  2. w = sample_weights(): 2^t with t = (l - mx) log2(e) / T, 0 below t = -60; the
//     candidates are the ids with w > 0 (the others together have probability < 1e-13).
//  3. S = the candidates ordered by larger logit, then smaller id; top_k > 0: C = the
//     first top_k of S, else all candidates.
//  4. sum = weight_sum of C (eight partial sums by id mod 8, in id order, then added
//     pairwise).
//  5. keep = the shortest prefix of S (within C) whose running c += w / sum reaches
//     top_p (all of C when top_p = 1 or it never does); tot = that prefix's weights
//     added in S order, or sum when all of C is kept.
//  6. u = uniform(0, tot) from the generator; walk S subtracting weights until u < 0
//     (the last kept id if rounding leaves u >= 0).
// Only the prefix of S that steps 3, 5 and 6 visit is sorted: the candidates of weight
// in a band [theta / 1000, theta) follow every candidate of a higher band in S, so the
// bands are sorted one at a time until the prefix holds what the step needs (a count,
// or a mass with a margin far above the rounding of its sums). A full index sort of
// the 129280 logits took ~22 ms per token, double exp() of every logit ~1.2 ms.
namespace {

using Cand = Sampler::Cand;

constexpr float kMinT = -60.0f;  // 2^-60

// S order: larger logit first, then the smaller id.
bool s_before(const Cand& a, const Cand& b) { return a.l > b.l || (a.l == b.l && a.id < b.id); }

// The candidates in S order, band by band.
class Bands {
 public:
  Bands(const float* l, const float* w, int64_t n, std::vector<Cand>& s) : l_(l), w_(w), n_(n), s_(s) { s_.clear(); }
  bool complete() const { return complete_; }
  // sorts the next band onto the prefix
  void extend() {
    const float lo = hi_ > 1e-15f ? hi_ * 1e-3f : 0.0f;
    const size_t first = s_.size();
    for (int64_t i = 0; i < n_; ++i)
      if (w_[i] < hi_ && w_[i] >= lo && w_[i] > 0.0f) s_.push_back({l_[i], static_cast<int32_t>(i), w_[i]});
    std::sort(s_.begin() + static_cast<std::ptrdiff_t>(first), s_.end(), s_before);
    for (size_t i = first; i < s_.size(); ++i) mass_ += s_[i].p;
    hi_ = lo;
    complete_ = lo == 0.0f;
  }
  // the sorted prefix's length once it holds more than m of weight (or all candidates)
  int64_t until_mass(double m) {
    while (!complete_ && !(mass_ > m * (1 + 1e-9))) extend();
    return static_cast<int64_t>(s_.size());
  }
  // the first min(k, candidates) of S, sorted (the prefix ends there: complete): one pass
  // with a heap of the best k so far (its front: the last of them in S order)
  int64_t first_k(int64_t k) {
    s_.clear();
    for (int64_t i = 0; i < n_; ++i) {
      if (!(w_[i] > 0.0f)) continue;
      if (static_cast<int64_t>(s_.size()) < k) {
        s_.push_back({l_[i], static_cast<int32_t>(i), w_[i]});
        std::push_heap(s_.begin(), s_.end(), s_before);
      } else if (l_[i] > s_.front().l) {  // (equal logits: the earlier id stays)
        std::pop_heap(s_.begin(), s_.end(), s_before);
        s_.back() = {l_[i], static_cast<int32_t>(i), w_[i]};
        std::push_heap(s_.begin(), s_.end(), s_before);
      }
    }
    std::sort(s_.begin(), s_.end(), s_before);
    complete_ = true;
    return static_cast<int64_t>(s_.size());
  }

 private:
  const float* l_;
  const float* w_;
  int64_t n_;
  std::vector<Cand>& s_;
  float hi_ = 2.0f;  // (weights are <= 1)
  double mass_ = 0;
  bool complete_ = false;
};

// One weight of sample_weights for mx and k = log2(e) / T: 2^t = 2^r * 2^f, r = round(t),
// |f| <= 1/2, 2^f = e^x (x = f ln 2) by its Taylor polynomial of degree 6 (relative error
// < 2e-7). Branch-free, selects as bit masks: loops of it vectorise.
inline float weight_of(float l, float mx, float k) {
  const float t0 = (l - mx) * k;
  const uint32_t keep = 0u - static_cast<uint32_t>(t0 >= kMinT);  // (NaN: 0)
  const float t = std::bit_cast<float>(std::bit_cast<uint32_t>(t0) & keep);
  const float r = (t + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 2^23; |t| <= 60)
  const float x = (t - r) * 0.6931471805599453f;
  float q = 1.0f / 720.0f;
  q = q * x + 1.0f / 120.0f;
  q = q * x + 1.0f / 24.0f;
  q = q * x + 1.0f / 6.0f;
  q = q * x + 0.5f;
  q = q * x + 1.0f;
  q = q * x + 1.0f;
  const float v = q * std::bit_cast<float>((static_cast<int32_t>(r) + 127) << 23);  // 2^r, r >= -60
  return std::bit_cast<float>(std::bit_cast<uint32_t>(v) & keep);
}
// (GCC's default -O2 cost model leaves this loop scalar: 1.1 vs 0.26 ms for 129280
// logits on the CI machine)
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("tree-vectorize", "vect-cost-model=dynamic")))
#endif
void weights_of(const float* __restrict l, int64_t n, float mx, float k, float* __restrict w) {
  for (int64_t i = 0; i < n; ++i) w[i] = weight_of(l[i], mx, k);
}
}  // namespace

float sample_weights(const float* l, int64_t n, float T, float* w) {
  const float mx = max_value(l, n);
  if (!std::isfinite(mx)) return mx;
  weights_of(l, n, mx, static_cast<float>(1.4426950408889634 / static_cast<double>(T)), w);
  return mx;
}

double weight_sum(const float* w, const int32_t* ids, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (ids) {
    for (int64_t i = 0; i < n; ++i) lane[ids[i] & 7] += w[i];
  } else {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      for (int j = 0; j < 8; ++j) lane[j] += w[i + j];
    for (; i < n; ++i) lane[i & 7] += w[i];
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

int32_t Sampler::sample(const float* l, int64_t n) {
  if (std::isnan(o_.temperature) || std::isinf(o_.temperature)) fail("temperature must be finite");
  // (below 1e-30, log2(e) / T overflows: as greedy)
  if (o_.temperature < 1e-30f) return argmax(l, n);
  if (!(o_.top_p > 0.0f && o_.top_p <= 1.0f)) fail("top_p must be in (0, 1]");
  if (n <= 0) return 0;
  weights_.resize(static_cast<size_t>(n));
  const float mx = sample_weights(l, n, o_.temperature, weights_.data());
  if (!std::isfinite(mx)) return argmax(l, n);
  Bands b(l, weights_.data(), n, cand_);
  std::vector<Cand>& s = cand_;
  // 3, 4: C and its sum
  int64_t nc = -1;  // |C|, -1: every candidate (not all sorted)
  double sum;
  if (o_.top_k > 0) {
    nc = b.first_k(o_.top_k);
    ids_.resize(static_cast<size_t>(nc));
    kw_.resize(static_cast<size_t>(nc));
    for (int64_t i = 0; i < nc; ++i) ids_[static_cast<size_t>(i)] = s[static_cast<size_t>(i)].id;
    std::sort(ids_.begin(), ids_.end());  // (C in id order)
    for (int64_t i = 0; i < nc; ++i) kw_[static_cast<size_t>(i)] = weights_[static_cast<size_t>(ids_[static_cast<size_t>(i)])];
    sum = weight_sum(kw_.data(), ids_.data(), nc);
  } else {
    sum = weight_sum(weights_.data(), nullptr, n);
  }
  // 5. the top_p prefix (within the sorted prefix that holds its mass)
  int64_t keep = -1;  // -1: all of C
  double tot = sum;
  if (o_.top_p < 1.0f) {
    const int64_t m = nc >= 0 ? nc : b.until_mass(static_cast<double>(o_.top_p) * sum);
    double c = 0;
    for (int64_t i = 0; i < m; ++i) {
      c += s[static_cast<size_t>(i)].p / sum;
      if (c >= o_.top_p) {
        keep = i + 1;
        break;
      }
    }
    const int64_t all = nc >= 0 ? nc : (b.complete() ? static_cast<int64_t>(s.size()) : -1);
    if (keep == all) keep = -1;
    if (keep >= 0) {
      tot = 0;
      for (int64_t i = 0; i < keep; ++i) tot += s[static_cast<size_t>(i)].p;
    }
  }
  // 6. the walk
  double u = std::uniform_real_distribution<double>(0.0, tot)(rng_);
  const double u0 = u;
  for (int64_t i = 0;;) {
    int64_t lim = keep >= 0 ? keep : nc;
    if (lim < 0) {  // all candidates: sorted as far as the walk goes
      lim = b.until_mass(u0);
      if (i >= lim && !b.complete()) {  // (rounding: one band more)
        b.extend();
        continue;
      }
    }
    if (i >= lim) break;
    u -= s[static_cast<size_t>(i)].p;
    if (u < 0) return s[static_cast<size_t>(i)].id;
    ++i;
  }
  const int64_t last = keep >= 0 ? keep : (nc >= 0 ? nc : b.until_mass(std::numeric_limits<double>::infinity()));
  return s[static_cast<size_t>(last - 1)].id;
}

}  // namespace dsx
