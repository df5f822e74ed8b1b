// Greedy choice against the plain first-maximum scan (an independent computation), on
// random rows with ties, signed zeros, infinities and NaNs at every position.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "runtime/sampler.h"

namespace {

int32_t plain_argmax(const std::vector<float>& l) {
  int64_t best = 0;
  for (size_t i = 1; i < l.size(); ++i)
    if (l[i] > l[static_cast<size_t>(best)]) best = static_cast<int64_t>(i);
  return static_cast<int32_t>(best);
}

}  // namespace

TEST(Sampler, ArgmaxMatchesPlainScan) {
  std::mt19937_64 rng(7);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (int trial = 0; trial < 4000; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 70);
    std::vector<float> l(static_cast<size_t>(n));
    const int levels = 1 + static_cast<int>(rng() % 4);  // few levels: many ties
    for (auto& v : l) v = static_cast<float>(static_cast<int>(rng() % levels)) - 1.0f;
    const int specials = static_cast<int>(rng() % 3);
    for (int k = 0; k < specials; ++k) {
      const float pick[6] = {nan, inf, -inf, -nan, 0.0f, -0.0f};
      l[rng() % l.size()] = pick[rng() % 6];
    }
    ASSERT_EQ(dsx::argmax(l.data(), n), plain_argmax(l)) << "trial " << trial << " n " << n;
  }
}

TEST(Sampler, ArgmaxVocabRow) {
  std::mt19937_64 rng(8);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> l(129280);
  for (int trial = 0; trial < 20; ++trial) {
    for (auto& v : l) v = nd(rng);
    l[rng() % l.size()] = 50.0f;  // one clear maximum ...
    if (trial % 2) l[rng() % l.size()] = 50.0f;  // ... or a tie
    EXPECT_EQ(dsx::argmax(l.data(), static_cast<int64_t>(l.size())), plain_argmax(l));
  }
}

TEST(Sampler, GreedySamplerIsArgmax) {
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f};
  dsx::Sampler s(dsx::SamplerOptions{});
  EXPECT_EQ(s.sample(l.data(), static_cast<int64_t>(l.size())), 1);
}
