// Token sampling from a logits row: greedy (temperature 0), or temperature with
// optional top-k / top-p, from a seeded generator (reproducible).
#pragma once
#include <cstdint>
#include <random>

namespace dsx {

struct SamplerOptions {
  float temperature = 0.0f;  // 0: greedy
  float top_p = 1.0f;
  int top_k = 0;  // 0: off
  uint64_t seed = 0;
};

// Greedy choice: the largest logit, ties to the lowest id.
int32_t argmax(const float* logits, int64_t n);

class Sampler {
 public:
  explicit Sampler(const SamplerOptions& o) : o_(o), rng_(o.seed) {}
  int32_t sample(const float* logits, int64_t n);

 private:
  SamplerOptions o_;
  std::mt19937_64 rng_;
};

}  // namespace dsx
