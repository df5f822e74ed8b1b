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

class Session;

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& o) : o_(o), rng_(o.seed) {}
  int32_t sample(const float* logits, int64_t n);
  // Feeds ids[0..n) to s and picks the next id: greedy (temperature 0) on the backend
  // (Session::feed_greedy), else sample() of the last row's logits, which are written
  // to `logits` (the vocabulary's size).
  int32_t feed_and_pick(Session& s, const int32_t* ids, int64_t n, std::vector<float>& logits);

 private:
  SamplerOptions o_;
  std::mt19937_64 rng_;
};

}  // namespace dsx
