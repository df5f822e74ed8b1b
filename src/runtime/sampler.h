// Token sampling from a logits row: greedy (temperature 0), or temperature with
// optional top-k / top-p, from a seeded generator (reproducible).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace dsx {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;
  int top_k = 0;  // 0: off
  uint64_t seed = 0;
};

// Greedy choice: the largest logit, ties to the lowest id.
int32_t argmax(const float* logits, int64_t n);

// Temperature sampling's weights (Sampler::sample): w[i] = 2^t, t = (l[i] - mx) log2(e) /
// T (a degree-6 polynomial, relative error < 2e-7), 0 where t < -60 or l[i] is NaN.
// Returns mx, the largest logit (not finite: w is not written).
float sample_weights(const float* l, int64_t n, float T, float* w);
// The sum of weights w[0..n) of ids (null: ids 0..n-1) in Sampler::sample's order: eight
// partial sums by id mod 8, each in the given order, added pairwise.
double weight_sum(const float* w, const int32_t* ids, int64_t n);

class Session;

class Sampler {
 public:
  struct Cand {  // a candidate of sample(): logit, id, weight
    float l;
    int32_t id;
    double p;
  };
  explicit Sampler(const SamplerOptions& o) : o_(o), rng_(o.seed) {}
  int32_t sample(const float* logits, int64_t n);
  // Feeds ids[0..n) to s and picks the next id: greedy (temperature 0) on the backend
  // (Session::feed_greedy), else sample() of the last row's logits, which are written
  // to `logits` (the vocabulary's size).
  int32_t feed_and_pick(Session& s, const int32_t* ids, int64_t n, std::vector<float>& logits);

 private:
  SamplerOptions o_;
  std::mt19937_64 rng_;
  // sample()'s working set (kept between calls)
  std::vector<Cand> cand_;
  std::vector<float> weights_, kw_;
  std::vector<int32_t> ids_;
};

}  // namespace dsx
