// Laws of sampled outputs and goodness-of-fit statistics for the DSpark sampling tests
// (test_dspark_decoding.cpp on the CPU engine, test_cuda_dspark.cpp on CUDA):
//   - gamma_q / chi2: the chi-square goodness-of-fit p-value of counts against a law;
//   - reference_probs: plain sampling's distribution of one row by an independent
//     full-sort transform (Sampler::sample's definition, sampler.cpp);
//   - TwoTokenLaw: the exact law of the first two sampled tokens after a prompt, from an
//     engine's logits (two_token_law: the whole prompt synced at once, as the CPU test
//     computes it; two_token_law_as_decoded: the rows fed as generate() feeds them);
//   - sample_two: counts of the first two tokens over generate() calls;
//   - TwoTokenLanes: the same counts with several sequences per Engine::step (plain rows
//     and Sampler, or DSparkCycle blocks), for engines where one generate() per draw is
//     too slow for 10^5 draws.
// Header-only; inline functions in namespace dspark_law.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/dspark.h"
#include "runtime/dspark_decoding.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "util/error.h"

namespace dspark_law {

using dsx::DecodingStrategy;
using dsx::Engine;
using dsx::GenerateOptions;
using dsx::GenerateResult;
using dsx::SamplerOptions;

inline double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

inline GenerateOptions no_stop(int64_t n) {
  GenerateOptions o;
  o.max_tokens = n;
  o.stop_ids.clear();
  return o;
}

inline std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---- statistics ---------------------------------------------------------------------------

// Regularized upper incomplete gamma Q(a, x) (Numerical Recipes gammq).
inline double gamma_q(double a, double x) {
  if (x <= 0) return 1.0;
  const double gln = std::lgamma(a);
  if (x < a + 1) {
    double ap = a, sum = 1.0 / a, del = sum;
    for (int n = 0; n < 10000; ++n) {
      ap += 1;
      del *= x / ap;
      sum += del;
      if (std::fabs(del) < std::fabs(sum) * 1e-15) break;
    }
    return std::max(0.0, 1.0 - sum * std::exp(-x + a * std::log(x) - gln));
  }
  double b = x + 1 - a, c = 1e300, d = 1 / b, h = d;
  for (int i = 1; i < 10000; ++i) {
    const double an = -i * (i - a);
    b += 2;
    d = an * d + b;
    if (std::fabs(d) < 1e-300) d = 1e-300;
    c = b + an / c;
    if (std::fabs(c) < 1e-300) c = 1e-300;
    d = 1 / d;
    const double del = d * c;
    h *= del;
    if (std::fabs(del - 1) < 1e-15) break;
  }
  return std::exp(-x + a * std::log(x) - gln) * h;
}

// Chi-square goodness of fit of counts against probabilities (N draws): cells of expected
// count < 5 are pooled (smallest first) until the pool reaches 5. Returns the p-value; 0
// when a cell of probability 0 has a count (impossible under the law).
struct Chi2 {
  double stat = 0, p = 1;
  int dof = 0;
};
inline Chi2 chi2(const std::vector<int64_t>& counts, const std::vector<double>& probs) {
  int64_t N = 0;
  for (int64_t c : counts) N += c;
  Chi2 r;
  std::vector<std::pair<double, int64_t>> cells;  // expected, observed
  for (size_t i = 0; i < counts.size(); ++i) {
    if (probs[i] <= 0) {
      if (counts[i] > 0) {
        r.p = 0;
        r.stat = INFINITY;
        return r;
      }
      continue;
    }
    cells.push_back({probs[i] * static_cast<double>(N), counts[i]});
  }
  std::sort(cells.begin(), cells.end());
  std::vector<std::pair<double, int64_t>> merged;
  double pe = 0;
  int64_t po = 0;
  size_t i = 0;
  for (; i < cells.size() && cells[i].first < 5; ++i) {
    pe += cells[i].first;
    po += cells[i].second;
    if (pe >= 5) {
      merged.push_back({pe, po});
      pe = 0, po = 0;
    }
  }
  for (; i < cells.size(); ++i) merged.push_back(cells[i]);
  if (pe > 0) {
    if (merged.empty()) merged.push_back({pe, po});
    else merged.front().first += pe, merged.front().second += po;
  }
  for (const auto& [e, o] : merged) r.stat += (o - e) * (o - e) / e;
  r.dof = static_cast<int>(merged.size()) - 1;
  r.p = r.dof > 0 ? gamma_q(r.dof / 2.0, r.stat / 2.0) : 1.0;
  return r;
}

inline SamplerOptions sopts(float T, int top_k = 0, float top_p = 1.0f) {
  SamplerOptions o;
  o.temperature = T;
  o.top_k = top_k;
  o.top_p = top_p;
  return o;
}

inline std::string describe(const SamplerOptions& o) {
  return dsx::cat("T=", o.temperature, " top_k=", o.top_k, " top_p=", o.top_p);
}

// ---- the law of the first two tokens ----------------------------------------------------------

// Plain sampling's distribution of one row through an independent full-sort transform
// (Sampler::sample's definition, as test_sampler.cpp's plain_sample, but returning
// probabilities).
inline std::vector<double> reference_probs(const std::vector<float>& l, const SamplerOptions& o) {
  const int64_t n = static_cast<int64_t>(l.size());
  std::vector<float> w(l.size());
  dsx::sample_weights(l.data(), n, o.temperature, w.data());
  std::vector<int32_t> S;
  for (int64_t i = 0; i < n; ++i)
    if (w[static_cast<size_t>(i)] > 0.0f) S.push_back(static_cast<int32_t>(i));
  std::sort(S.begin(), S.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  if (o.top_k > 0 && o.top_k < static_cast<int>(S.size())) S.resize(static_cast<size_t>(o.top_k));
  double sum = 0;
  for (int32_t i : S) sum += w[static_cast<size_t>(i)];
  size_t keep = S.size();
  double c = 0;
  for (size_t i = 0; i < S.size() && o.top_p < 1.0f; ++i) {
    c += w[static_cast<size_t>(S[i])] / sum;
    if (c >= o.top_p) {
      keep = i + 1;
      break;
    }
  }
  double tot = 0;
  for (size_t i = 0; i < keep; ++i) tot += w[static_cast<size_t>(S[i])];
  std::vector<double> p(l.size());
  for (size_t i = 0; i < keep; ++i) p[static_cast<size_t>(S[i])] = w[static_cast<size_t>(S[i])] / tot;
  return p;
}

struct TwoTokenLaw {
  std::vector<int32_t> first;                 // the first token's support
  std::vector<double> p1;                     // [V]
  std::map<int32_t, std::vector<double>> p2;  // first token -> [V]
  std::map<std::pair<int32_t, int32_t>, double> cells;
};

// The law from the engine's logits after the prompt and after the prompt and each
// possible first token (each synced in one piece).
inline TwoTokenLaw two_token_law(Engine& e, const std::vector<int32_t>& prompt, const SamplerOptions& o) {
  const int64_t V = e.config().vocab_size;
  TwoTokenLaw L;
  std::vector<float> l(static_cast<size_t>(V));
  auto s = e.new_session();
  s->sync(prompt, l.data());
  L.p1 = reference_probs(l, o);
  for (int32_t a = 0; a < V; ++a) {
    if (L.p1[static_cast<size_t>(a)] <= 0) continue;
    L.first.push_back(a);
    s->sync(concat(prompt, {a}), l.data());
    L.p2[a] = reference_probs(l, o);
    for (int32_t b = 0; b < V; ++b)
      if (L.p2[a][static_cast<size_t>(b)] > 0) L.cells[{a, b}] = L.p1[static_cast<size_t>(a)] * L.p2[a][static_cast<size_t>(b)];
  }
  return L;
}

// The same law with the rows fed as generate() feeds them: the prompt without its last
// token in one piece (Session::sync), then the last token as one row, then each possible
// first token as one row (and back). On a backend whose numbers depend on how rows are
// split into passes (the CUDA engine's prefill products), this is plain sampling's law
// exactly, not a neighbour of it.
inline TwoTokenLaw two_token_law_as_decoded(Engine& e, const std::vector<int32_t>& prompt, const SamplerOptions& o) {
  DSX_CHECK(prompt.size() >= 2, "two_token_law_as_decoded: a prompt of at least 2 tokens");
  const int64_t V = e.config().vocab_size, P = static_cast<int64_t>(prompt.size());
  TwoTokenLaw L;
  std::vector<float> l(static_cast<size_t>(V));
  auto s = e.new_session();
  s->sync(prompt.data(), P - 1);
  s->feed(&prompt.back(), 1, l.data(), false);
  L.p1 = reference_probs(l, o);
  for (int32_t a = 0; a < V; ++a) {
    if (L.p1[static_cast<size_t>(a)] <= 0) continue;
    L.first.push_back(a);
    s->feed(&a, 1, l.data(), false);
    s->rollback(P);
    L.p2[a] = reference_probs(l, o);
    for (int32_t b = 0; b < V; ++b)
      if (L.p2[a][static_cast<size_t>(b)] > 0) L.cells[{a, b}] = L.p1[static_cast<size_t>(a)] * L.p2[a][static_cast<size_t>(b)];
  }
  return L;
}

// Counts of pairs in the law's cell order, and their probabilities (probs), the last
// cell gathering the pairs the law gives probability 0 (an impossible pair fails chi2).
inline std::vector<int64_t> cell_counts(const std::map<std::pair<int32_t, int32_t>, int64_t>& c, const TwoTokenLaw& L,
                                        std::vector<double>& probs) {
  std::vector<int64_t> counts;
  probs.clear();
  int64_t outside = 0;
  for (const auto& [k, n] : c)
    if (!L.cells.count(k)) outside += n;
  for (const auto& [k, p] : L.cells) {
    probs.push_back(p);
    const auto it = c.find(k);
    counts.push_back(it != c.end() ? it->second : 0);
  }
  probs.push_back(0);
  counts.push_back(outside);
  return counts;
}

// Counts of the first two tokens over `draws` generate() calls with seeds seed0 + i, on
// one session (each call's prefill goes back to the prompt), in the law's cell order.
inline std::vector<int64_t> sample_two(Engine& e, const std::vector<int32_t>& prompt, SamplerOptions o,
                                       DecodingStrategy& st, const TwoTokenLaw& L, int draws, uint64_t seed0,
                                       std::vector<double>& probs) {
  std::map<std::pair<int32_t, int32_t>, int64_t> c;
  auto s = e.new_session();
  GenerateOptions go = no_stop(3);  // (the first cycle verifies up to 2 drafts)
  for (int i = 0; i < draws; ++i) {
    go.sampling = o;
    go.sampling.seed = seed0 + static_cast<uint64_t>(i);
    const GenerateResult r = generate(*s, prompt, go, st);
    EXPECT_EQ(r.ids.size(), 3u);
    ++c[{r.ids[0], r.ids[1]}];
  }
  return cell_counts(c, L, probs);
}

// ---- several sequences per step ---------------------------------------------------------------

// The first two sampled tokens of many generations after one prompt, several sequences
// per Engine::step as the server batches them (DSparkCycle: dspark_decoding.h). Each
// lane is a session (and a DSpark context with its rings) prefilled once with the prompt
// without its last token (DSparkDecoding::prefill: one piece with taps, as
// Session::sync feeds it); a draw goes back to that position, seeds its generator with
// seed0 + the draw's index and decodes as generate() with max_tokens 3 would until two
// tokens are out:
//   plain:  the anchor as one row (its logits), Sampler::sample (PlainDecoding's pick);
//   DSpark: DSparkCycle::draft (at most min(block, 3 - tokens out) drafts), the verify
//           rows of every lane in one step (all rows' logits), DSparkCycle::accept.
// A step holds at most max_rows rows, so that each pass stays in the engine's one-row
// (decode-sized) path, whose rows are those of one-row steps.
class TwoTokenLanes {
 public:
  struct Run {
    std::map<std::pair<int32_t, int32_t>, int64_t> pairs;
    dsx::DSparkStats stats;  // DSpark: summed over the lanes
    int64_t steps = 0;       // Engine::step calls
    double seconds = 0;
  };

  TwoTokenLanes(Engine& e, const dsx::Drafter& d, std::vector<int32_t> prompt, int lanes)
      : e_(e), d_(d), prompt_(std::move(prompt)) {
    const int64_t P = static_cast<int64_t>(prompt_.size());
    DSX_CHECK(P >= 3 && lanes >= 1, "TwoTokenLanes: a prompt of at least 3 tokens and a lane");
    for (int i = 0; i < lanes; ++i) {
      Lane x;
      x.s = e_.new_session();
      x.ctx = std::make_unique<dsx::DSparkContext>(d_);
      dsx::DSparkDecoding pre(d_, dsx::DSparkOptions{}, x.ctx.get());
      pre.start(SamplerOptions{});
      pre.prefill(*x.s, prompt_.data(), P - 1);
      DSX_CHECK(x.s->position() == P - 1 && x.ctx->end() == P - 1, "TwoTokenLanes: the prefill left lane ", i,
                " at ", x.s->position());
      x.logits.resize(static_cast<size_t>(e_.config().vocab_size));
      lanes_.push_back(std::move(x));
    }
  }

  // plain: dspark null. Uses the first min(lanes, max_rows / rows per lane) lanes.
  Run run(const SamplerOptions& o, const dsx::DSparkOptions* dspark, int draws, uint64_t seed0, int max_rows = 16) {
    const auto t0 = std::chrono::steady_clock::now();
    const int64_t P = static_cast<int64_t>(prompt_.size()), V = e_.config().vocab_size;
    const int per_lane = dspark ? 1 + std::min(2, d_.block_size()) : 1;
    const size_t n = std::min(lanes_.size(), static_cast<size_t>(std::max(1, max_rows / per_lane)));
    Run r;
    std::vector<std::unique_ptr<dsx::DSparkCycle>> cy(n);
    int64_t next = 0;
    auto begin = [&](size_t i) {
      Lane& x = lanes_[i];
      x.active = next < draws;
      if (!x.active) return;
      SamplerOptions so = o;
      so.seed = seed0 + static_cast<uint64_t>(next++);
      if (x.s->position() > P - 1) x.s->rollback(P - 1);
      x.ctx->truncate(P - 1);
      x.out.clear();
      x.anchor = prompt_.back();
      if (dspark) {
        if (!cy[i]) cy[i] = std::make_unique<dsx::DSparkCycle>(d_, *dspark);
        cy[i]->start(so);
      } else {
        x.smp = std::make_unique<dsx::Sampler>(so);
      }
    };
    for (size_t i = 0; i < n; ++i) begin(i);
    for (;;) {
      dsx::Step st;
      std::vector<size_t> in;
      int64_t rows = 0;
      for (size_t i = 0; i < n; ++i) {
        Lane& x = lanes_[i];
        if (!x.active) continue;
        if (dspark) {
          dsx::DSparkCycle& c = *cy[i];
          c.draft(*x.ctx, x.anchor, c.max_drafts(e_, 3 - static_cast<int64_t>(x.out.size())));
          st.feeds.push_back(c.verify_feed(*x.s));
          st.all_rows = st.all_rows || c.needs_all_rows();
        } else {
          st.feeds.push_back(dsx::Feed{x.s.get(), &x.anchor, 1, x.logits.data(), nullptr, nullptr, nullptr});
        }
        rows += st.feeds.back().n;
        in.push_back(i);
      }
      if (in.empty()) break;
      DSX_CHECK(rows <= max_rows, "TwoTokenLanes: a step of ", rows, " rows");
      e_.step(st);
      ++r.steps;
      for (size_t i : in) {
        Lane& x = lanes_[i];
        if (dspark) cy[i]->accept(*x.s, *x.ctx, x.out);
        else x.out.push_back(x.smp->sample(x.logits.data(), V));
        x.anchor = x.out.back();
        if (x.out.size() >= 2) {
          ++r.pairs[{x.out[0], x.out[1]}];
          begin(i);
        }
      }
    }
    if (dspark) {
      r.stats.accepted_hist.assign(static_cast<size_t>(d_.block_size() + 1), 0);
      for (const auto& c : cy) {
        if (!c) continue;
        const dsx::DSparkStats& s = c->stats();
        r.stats.cycles += s.cycles, r.stats.drafted += s.drafted, r.stats.verified += s.verified;
        r.stats.accepted += s.accepted, r.stats.verify_rows += s.verify_rows, r.stats.tokens += s.tokens;
        r.stats.draft_seconds += s.draft_seconds, r.stats.verify_seconds += s.verify_seconds;
        for (size_t j = 0; j < s.accepted_hist.size() && j < r.stats.accepted_hist.size(); ++j)
          r.stats.accepted_hist[j] += s.accepted_hist[j];
      }
    }
    r.seconds = seconds_since(t0);
    return r;
  }

 private:
  struct Lane {
    std::unique_ptr<dsx::Session> s;
    std::unique_ptr<dsx::DSparkContext> ctx;
    std::unique_ptr<dsx::Sampler> smp;
    std::vector<float> logits;
    std::vector<int32_t> out;
    int32_t anchor = 0;
    bool active = false;
  };
  Engine& e_;
  const dsx::Drafter& d_;
  std::vector<int32_t> prompt_;
  std::vector<Lane> lanes_;
};

}  // namespace dspark_law
