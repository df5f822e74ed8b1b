// Greedy choice against the plain first-maximum scan (an independent computation), on
// random rows with ties, signed zeros, infinities and NaNs at every position.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "runtime/sampler.h"
#include "util/error.h"

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

namespace {

// Sampler::sample's distribution by its definition (sampler.cpp), with one full sort of
// the candidates: the fast version sorts only the prefix its steps visit.
int32_t plain_sample(const std::vector<float>& l, float T, float top_p, int top_k, std::mt19937_64& rng) {
  const int64_t n = static_cast<int64_t>(l.size());
  std::vector<float> w(l.size());
  const float mx = dsx::sample_weights(l.data(), n, T, w.data());
  if (!std::isfinite(mx)) return dsx::argmax(l.data(), n);
  std::vector<int32_t> S;
  for (int64_t i = 0; i < n; ++i)
    if (w[static_cast<size_t>(i)] > 0.0f) S.push_back(static_cast<int32_t>(i));
  std::sort(S.begin(), S.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  if (top_k > 0 && top_k < static_cast<int>(S.size())) S.resize(static_cast<size_t>(top_k));
  std::vector<int32_t> byid = S;
  std::sort(byid.begin(), byid.end());
  std::vector<float> wid;
  for (int32_t i : byid) wid.push_back(w[static_cast<size_t>(i)]);
  const double sum = dsx::weight_sum(wid.data(), byid.data(), static_cast<int64_t>(byid.size()));
  size_t keep = S.size();
  if (top_p < 1.0f) {
    double c = 0;
    for (size_t i = 0; i < S.size(); ++i) {
      c += static_cast<double>(w[static_cast<size_t>(S[i])]) / sum;
      if (c >= top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  double tot = sum;
  if (keep < S.size()) {
    tot = 0;
    for (size_t i = 0; i < keep; ++i) tot += w[static_cast<size_t>(S[i])];
  }
  double u = std::uniform_real_distribution<double>(0.0, tot)(rng);
  for (size_t i = 0; i < keep; ++i) {
    u -= w[static_cast<size_t>(S[i])];
    if (u < 0) return S[i];
  }
  return S[keep - 1];
}

}  // namespace

// The fast sampler draws exactly what the full-sort definition draws (same generator),
// over flat and peaked rows, ties, -inf and NaN logits, temperatures, top_p and top_k.
TEST(Sampler, TemperatureSamplingMatchesFullSort) {
  std::mt19937_64 gen(11);
  const float ninf = -std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  int cases = 0;
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{300}, int64_t{5000}, int64_t{129280}}) {
    const int trials = n > 10000 ? 6 : 60;
    for (int trial = 0; trial < trials; ++trial) {
      std::vector<float> l(static_cast<size_t>(n));
      const int kind = trial % 4;
      std::normal_distribution<float> nd(0.0f, kind == 0 ? 3.0f : 0.5f);
      for (auto& v : l) v = kind == 2 ? static_cast<float>(static_cast<int>(gen() % 5)) : nd(gen);  // kind 2: ties
      if (kind == 1)  // peaked: a few far above the rest
        for (int j = 0; j < 5; ++j) l[gen() % l.size()] = 15.0f + static_cast<float>(j);
      if (kind == 3 && n > 2) {  // -inf and NaN entries
        l[gen() % l.size()] = ninf;
        l[gen() % l.size()] = nan;
      }
      const float T = std::array<float, 4>{0.3f, 0.7f, 1.0f, 1.6f}[gen() % 4];
      const float top_p = std::array<float, 4>{1.0f, 0.95f, 0.5f, 0.1f}[gen() % 4];
      const int top_k = std::array<int, 5>{0, 1, 5, 40, 1000}[gen() % 5];
      const uint64_t seed = gen();
      dsx::SamplerOptions o;
      o.temperature = T, o.top_p = top_p, o.top_k = top_k, o.seed = seed;
      dsx::Sampler s(o);
      std::mt19937_64 ref(seed);
      for (int draw = 0; draw < 4; ++draw) {
        const int32_t want = plain_sample(l, T, top_p, top_k, ref);
        ASSERT_EQ(s.sample(l.data(), n), want) << "n " << n << " kind " << kind << " T " << T << " top_p " << top_p
                                               << " top_k " << top_k << " draw " << draw;
        ++cases;
      }
    }
  }
  EXPECT_GT(cases, 900);
}

// Temperatures at the edges: below 1e-30 greedy, huge ones near uniform but valid ids, a
// NaN or infinite one a clear error.
TEST(Sampler, TemperatureEdges) {
  std::vector<float> l = {0.5f, 2.0f, -1.0f, 1.5f};
  dsx::SamplerOptions o;
  o.temperature = 1e-35f;
  EXPECT_EQ(dsx::Sampler(o).sample(l.data(), 4), 1);
  o.temperature = 1e30f;
  dsx::Sampler big(o);
  for (int i = 0; i < 100; ++i) {
    const int32_t id = big.sample(l.data(), 4);
    EXPECT_TRUE(id >= 0 && id < 4) << id;
  }
  o.temperature = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(dsx::Sampler(o).sample(l.data(), 4), dsx::Error);
  o.temperature = std::numeric_limits<float>::infinity();
  EXPECT_THROW(dsx::Sampler(o).sample(l.data(), 4), dsx::Error);
}

// The weights against std::exp2, and the drawn frequencies against the softmax computed
// directly (a property: 200000 draws, each within 5 standard deviations).
TEST(Sampler, WeightsAndFrequencies) {
  std::mt19937_64 gen(12);
  std::uniform_real_distribution<float> ud(-30.0f, 0.0f);
  std::vector<float> l(4096), w(4096);
  for (auto& v : l) v = ud(gen);
  l[17] = 0.0f;
  const float T = 0.7f;
  ASSERT_EQ(dsx::sample_weights(l.data(), 4096, T, w.data()), 0.0f);
  for (size_t i = 0; i < l.size(); ++i) {
    const double t = static_cast<double>(l[i] * static_cast<float>(1.4426950408889634 / T));
    if (t < -60.0) {
      EXPECT_EQ(w[i], 0.0f);
    } else {
      EXPECT_NEAR(w[i], std::exp2(t), 3e-7 * std::exp2(t)) << i;
    }
  }
  const std::vector<float> small = {1.0f, 0.5f, -0.3f, 2.0f, -4.0f};
  dsx::SamplerOptions o;
  o.temperature = 0.9f, o.seed = 5;
  dsx::Sampler s(o);
  std::vector<int> count(small.size(), 0);
  const int draws = 200000;
  for (int i = 0; i < draws; ++i) ++count[static_cast<size_t>(s.sample(small.data(), 5))];
  double z = 0;
  for (float v : small) z += std::exp(v / 0.9);
  for (size_t i = 0; i < small.size(); ++i) {
    const double p = std::exp(small[i] / 0.9) / z;
    EXPECT_NEAR(count[i], draws * p, 5 * std::sqrt(draws * p * (1 - p)) + 1) << "id " << i;
  }
}
