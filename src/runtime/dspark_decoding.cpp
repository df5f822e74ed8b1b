// DSpark speculative decoding (dspark_decoding.h): the sampler's distribution, the
// acceptance rule, the verify-length rule, the drafter's per-sequence context and the
// strategy's prefill / next.
#include "runtime/dspark_decoding.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <sstream>

#include "util/error.h"

namespace dsx {

// ---- the sampler's distribution ----------------------------------------------------------
namespace {
void one_hot(double* p, int64_t V, int32_t id) {
  std::fill(p, p + V, 0.0);
  if (V > 0) p[id] = 1.0;
}
}  // namespace

void sampling_distribution(const float* l, int64_t V, const SamplerOptions& o, double* p) {
  if (V <= 0) return;
  if (std::isnan(o.temperature) || std::isinf(o.temperature)) fail("temperature must be finite");
  // (as Sampler::sample: below 1e-30 greedy)
  if (o.temperature < 1e-30f) return one_hot(p, V, argmax(l, V));
  if (!(o.top_p > 0.0f && o.top_p <= 1.0f)) fail("top_p must be in (0, 1]");
  thread_local std::vector<float> w;
  thread_local std::vector<int32_t> S, byid;
  thread_local std::vector<float> wid;
  w.resize(static_cast<size_t>(V));
  const float mx = sample_weights(l, V, o.temperature, w.data());
  if (!std::isfinite(mx)) return one_hot(p, V, argmax(l, V));
  std::fill(p, p + V, 0.0);
  if (o.top_k <= 0 && o.top_p >= 1.0f) {  // every candidate, no order needed
    const double sum = weight_sum(w.data(), nullptr, V);
    for (int64_t i = 0; i < V; ++i) p[i] = static_cast<double>(w[static_cast<size_t>(i)]) / sum;
    return;
  }
  // S: the candidates by larger logit, then smaller id; C: its first top_k
  S.clear();
  for (int64_t i = 0; i < V; ++i)
    if (w[static_cast<size_t>(i)] > 0.0f) S.push_back(static_cast<int32_t>(i));
  auto before = [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); };
  if (o.top_k > 0 && o.top_k < static_cast<int>(S.size())) {
    std::partial_sort(S.begin(), S.begin() + o.top_k, S.end(), before);
    S.resize(static_cast<size_t>(o.top_k));
  } else {
    std::sort(S.begin(), S.end(), before);
  }
  // the sum over C in Sampler::sample's order (weight_sum by id)
  byid = S;
  std::sort(byid.begin(), byid.end());
  wid.clear();
  for (int32_t i : byid) wid.push_back(w[static_cast<size_t>(i)]);
  const double sum = weight_sum(wid.data(), byid.data(), static_cast<int64_t>(byid.size()));
  size_t keep = S.size();
  if (o.top_p < 1.0f) {
    double c = 0;
    for (size_t i = 0; i < S.size(); ++i) {
      c += static_cast<double>(w[static_cast<size_t>(S[i])]) / sum;
      if (c >= o.top_p) {
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
  for (size_t i = 0; i < keep; ++i) p[S[i]] = static_cast<double>(w[static_cast<size_t>(S[i])]) / tot;
}

int32_t sample_from(const double* w, int64_t V, double u) {
  double tot = 0;
  for (int64_t i = 0; i < V; ++i) tot += w[i] > 0 ? w[i] : 0.0;
  if (!(tot > 0)) return -1;
  const double t = u * tot;
  double c = 0;
  int32_t last = -1;
  for (int64_t i = 0; i < V; ++i) {
    if (!(w[i] > 0)) continue;
    c += w[i];
    last = static_cast<int32_t>(i);
    if (t < c) return last;
  }
  return last;
}

// ---- the acceptance rule ---------------------------------------------------------------------
bool speculative_row(const double* p, const double* q, int32_t d, int64_t V, double u_accept, double u_draw,
                     int32_t* token) {
  DSX_CHECK(d >= 0 && d < V, "speculative_row: draft ", d, " outside the vocabulary (", V, ")");
  const double qd = q ? q[d] : 1.0;
  if (u_accept * qd < p[d]) return true;  // u < min(1, p(d) / q(d)), without dividing
  thread_local std::vector<double> r;
  r.resize(static_cast<size_t>(V));
  if (q) {
    for (int64_t x = 0; x < V; ++x) r[static_cast<size_t>(x)] = std::max(0.0, p[x] - q[x]);
  } else {
    std::copy(p, p + V, r.begin());
    r[static_cast<size_t>(d)] = 0;
  }
  int32_t t = sample_from(r.data(), V, u_draw);
  if (t < 0) t = sample_from(p, V, u_draw);  // (no residual mass: p itself, §8.3)
  *token = t;
  return false;
}

SpeculativeResult speculative_block(const double* p, const double* q, const int32_t* drafts, int k, int64_t V,
                                    const double* u) {
  SpeculativeResult r;
  for (int i = 0; i < k; ++i) {
    int32_t t = -1;
    if (speculative_row(p + i * V, q ? q + i * V : nullptr, drafts[i], V, u[i], u[k], &t)) {
      r.tokens.push_back(drafts[i]);
      ++r.accepted;
    } else {
      r.tokens.push_back(t);
      return r;
    }
  }
  r.tokens.push_back(sample_from(p + static_cast<int64_t>(k) * V, V, u[k]));
  return r;
}

namespace {
constexpr int64_t kOnePieceTapBytes = int64_t{256} << 20;  // (host taps of a one-step prefill)
using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

// ---- choosing k --------------------------------------------------------------------------------
double DSparkSchedule::cost(int rows) const {
  const int m = static_cast<int>(verify_cost.size());
  if (m == 0) return rows;
  if (rows <= m) return verify_cost[static_cast<size_t>(std::max(rows, 1) - 1)];
  const double step = m >= 2 ? verify_cost[static_cast<size_t>(m - 1)] - verify_cost[static_cast<size_t>(m - 2)] : 1.0;
  return verify_cost[static_cast<size_t>(m - 1)] + step * (rows - m);
}

std::string DSparkSchedule::describe() const {
  char b[64];
  std::snprintf(b, sizeof b, "draft %.2f; verify 1-%zu rows:", draft_cost, verify_cost.size());
  std::string r = b;
  for (double c : verify_cost) {
    std::snprintf(b, sizeof b, " %.2f", c);
    r += b;
  }
  return r;
}

DSparkSchedule parse_schedule_costs(const std::string& v, const DSparkSchedule& base) {
  const size_t colon = v.find(':');
  if (colon == std::string::npos)
    fail("DSpark costs '", v, "': expected D:C1,C2,... (the draft cost, then the verify cost of 1, 2, .. rows)");
  auto number = [&](const std::string& t) {
    size_t used = 0;
    double x = 0;
    try {
      x = std::stod(t, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != t.size() || !std::isfinite(x) || x < 0)
      fail("DSpark costs '", v, "': '", t, "' is not a non-negative number");
    return x;
  };
  DSparkSchedule s = base;
  s.draft_cost = number(v.substr(0, colon));
  s.verify_cost.clear();
  std::stringstream ss(v.substr(colon + 1));
  std::string t;
  while (std::getline(ss, t, ',')) s.verify_cost.push_back(number(t));
  if (s.verify_cost.empty() || std::abs(s.verify_cost[0] - 1.0) > 1e-9)
    fail("DSpark costs '", v, "': the verify costs must start with C(1) = 1 (units of a one-row step)");
  return s;
}

DSparkSchedule measure_schedule(Engine& eng, const Drafter& d, const DSparkSchedule& base, int iters, int64_t context) {
  DSX_CHECK(eng.tap_width() == d.tap_width(), "DSpark costs: the engine's taps are ", eng.tap_width(),
            " wide, the drafter's ", d.tap_width());
  const int B = d.block_size();
  const int64_t V = d.vocab_size(), TW = d.tap_width();
  const int rows_max = std::min(B + 1, eng.options().rollback_depth);
  const int pend = std::max(1, B - 1);  // committed rows a cycle's drafter pass computes
  context = std::max<int64_t>(context, pend + 2);
  const int64_t cap = eng.options().max_context;
  DSX_CHECK(rows_max >= 1 && (cap <= 0 || context + rows_max <= cap), "DSpark costs: a context of ", context, " + ",
            rows_max, " rows does not fit the engine's ", cap, " tokens");
  iters = std::max(iters, 1);
  std::mt19937 rng(11);
  std::uniform_int_distribution<int32_t> tok(3, static_cast<int32_t>(std::min<int64_t>(V, 128000) - 1));
  std::vector<int32_t> prompt(static_cast<size_t>(context));
  for (auto& x : prompt) x = tok(rng);
  auto s = eng.new_session();
  std::vector<float> taps(static_cast<size_t>(context * TW));
  {
    Step st;
    st.feeds.push_back(Feed{s.get(), prompt.data(), context, nullptr, taps.data(), nullptr, nullptr});
    eng.step(st);
  }
  DSparkContext ctx(d);
  ctx.observe(prompt.data(), taps.data(), context);
  const int64_t n = context;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> t(static_cast<size_t>(rows_max) + 1);
  std::vector<int32_t> ids(static_cast<size_t>(rows_max)), picks(static_cast<size_t>(rows_max));
  std::vector<float> vtaps(static_cast<size_t>(rows_max * TW));
  for (int r = 1; r <= rows_max; ++r) {
    for (auto& x : ids) x = tok(rng);
    Step st;
    st.feeds.push_back(Feed{s.get(), ids.data(), r, nullptr, vtaps.data(), nullptr, picks.data()});
    std::vector<double> ts;
    for (int i = 0; i < iters + 2; ++i) {
      const Clock::time_point t0 = Clock::now();
      eng.step(st);
      const double dt = since(t0);
      s->rollback(n);
      if (i >= 2) ts.push_back(dt);
    }
    t[static_cast<size_t>(r)] = median(ts);
  }
  std::vector<double> td;
  const int64_t p0 = n - pend;
  for (int i = 0; i < iters + 2; ++i) {
    ctx.truncate(p0);
    ctx.observe(prompt.data() + p0, taps.data() + p0 * TW, pend);
    const Clock::time_point t0 = Clock::now();
    const std::unique_ptr<DraftBlock> blk = d.draft_block(ctx.state(), prompt[static_cast<size_t>(n - 1)], n);
    d.greedy(*blk, /*full=*/false);
    const double dt = since(t0);
    if (i >= 2) td.push_back(dt);
  }
  DSparkSchedule out = base;
  const double one = std::max(t[1], 1e-12);
  out.verify_cost.clear();
  for (int r = 1; r <= rows_max; ++r) out.verify_cost.push_back(r == 1 ? 1.0 : t[static_cast<size_t>(r)] / one);
  out.draft_cost = median(td) / one;
  return out;
}

int choose_k(const DSparkSchedule& s, const float* conf, int n, int max_k, std::vector<double>* survival) {
  max_k = std::clamp(max_k, 0, std::max(n, 0));
  std::vector<double> A(static_cast<size_t>(std::max(n, 0)));
  double a = 1;
  for (int i = 0; i < n; ++i) A[static_cast<size_t>(i)] = a *= dspark_confidence(conf[i]);
  if (survival) *survival = A;
  if (s.static_k >= 0) return std::min(s.static_k, max_k);
  int k = 0;
  double tokens = 1, best = 1.0 / (s.draft_cost + s.cost(1));
  for (int i = 1; i <= max_k; ++i) {
    if (dspark_confidence(conf[i - 1]) < s.threshold) break;
    tokens += A[static_cast<size_t>(i - 1)];
    const double rate = tokens / (s.draft_cost + s.cost(1 + i));
    if (!(rate > best)) break;
    best = rate;
    k = i;
  }
  return k;
}

// ---- the context ---------------------------------------------------------------------------------
DSparkContext::DSparkContext(const Drafter& d, int rollback_depth) : d_(&d), st_(d.make_state(rollback_depth)) {}

int64_t DSparkContext::keep_common_prefix(const int32_t* ids, int64_t n) {
  int64_t c = 0;
  const int64_t lim = std::min(end(), n);
  while (c < lim && tokens_[static_cast<size_t>(c)] == ids[c]) ++c;
  truncate(c);
  return c;
}

void DSparkContext::truncate(int64_t p) {
  p = std::max<int64_t>(p, 0);
  if (p >= end()) return;
  tokens_.resize(static_cast<size_t>(p));
  st_->truncate(p);
}

void DSparkContext::observe(const int32_t* ids, const float* taps, int64_t T) {
  if (T <= 0) return;
  d_->observe(*st_, taps, T, end());
  tokens_.insert(tokens_.end(), ids, ids + T);
}

void DSparkContext::skip(const int32_t* ids, int64_t T) {
  if (T <= 0) return;
  tokens_.insert(tokens_.end(), ids, ids + T);
  d_->observe(*st_, nullptr, 0, end());  // (positions before end() not observed: holes)
}

int64_t DSparkContext::align(const int32_t* t, int64_t n, bool scan) {
  if (!scan && end() == n && (n == 0 || tokens_.back() == t[n - 1])) return n;  // (already in step)
  const int64_t kept = keep_common_prefix(t, n);
  skip(t + kept, n - kept);
  return kept;
}

// ---- stats --------------------------------------------------------------------------------------
std::string DSparkStats::summary() const {
  char b[400];
  std::snprintf(b, sizeof b,
                "dspark: %lld cycles, %.3f accepted drafts per cycle (%.3f tokens per cycle), %lld of %lld verified "
                "drafts accepted (%.1f%%), %lld verify rows; draft %.3f s, verify %.3f s",
                static_cast<long long>(cycles), accepted_per_cycle(), tokens_per_cycle(),
                static_cast<long long>(accepted), static_cast<long long>(verified), 100.0 * acceptance(),
                static_cast<long long>(verify_rows), draft_seconds, verify_seconds);
  std::string s = b;
  if (!accepted_hist.empty()) {
    s += "; cycles by accepted drafts:";
    for (size_t j = 0; j < accepted_hist.size(); ++j) s += cat(" ", j, ":", accepted_hist[j]);
  }
  return s;
}


// ---- one cycle ---------------------------------------------------------------------------------
DSparkCycle::DSparkCycle(const Drafter& drafter, DSparkOptions o) : d_(drafter), o_(std::move(o)) { reset_stats(); }

void DSparkCycle::reset_stats() {
  stats_ = DSparkStats{};
  stats_.accepted_hist.assign(static_cast<size_t>(d_.block_size() + 1), 0);
  stats_.verify_steps_by_rows.assign(static_cast<size_t>(d_.block_size() + 2), 0);
  stats_.verify_seconds_by_rows.assign(static_cast<size_t>(d_.block_size() + 2), 0.0);
}

void DSparkCycle::start(const SamplerOptions& sampling) {
  sampling_ = sampling;
  rng_.seed(sampling.seed);
}

int DSparkCycle::max_drafts(const Engine& eng, int64_t limit) const {
  return static_cast<int>(
      std::max<int64_t>(0, std::min<int64_t>({d_.block_size(), limit - 1, eng.options().rollback_depth})));
}

int DSparkCycle::draft(DSparkContext& ctx, int32_t anchor, int kmax) {
  const int64_t n = ctx.end(), V = d_.vocab_size();
  const int B = d_.block_size();
  const bool sampling = sampling_on();
  kmax = std::min(kmax, B);
  n_ = n;
  rows_.assign(1, anchor);
  k_ = 0;
  point_ = true;
  if (kmax < 1 || n < 2) return 0;
  const Clock::time_point t0 = Clock::now();
  const std::unique_ptr<DraftBlock> blk = d_.draft_block(ctx.state(), anchor, n);
  DSparkDraft dr;
  int rows = B;
  if (sampling && o_.sampled_drafts && !o_.draft_hook) {
    // the Markov walk with sampled drafts: row j's q_j from prev_j = d_j (§5.6)
    point_ = false;
    rows = kmax;
    std::vector<int32_t> prev(static_cast<size_t>(B), anchor);
    dr.tokens.assign(static_cast<size_t>(B), anchor);
    dr.confidence_logits.assign(static_cast<size_t>(B), 0.0f);
    q_.resize(static_cast<size_t>(kmax * V));
    row_.resize(static_cast<size_t>(V));
    std::uniform_real_distribution<double> U(0.0, 1.0);
    for (int j = 0; j < kmax; ++j) {
      float conf = 0;
      d_.forced_row(*blk, j, prev[static_cast<size_t>(j)], row_.data(), &conf);
      double* qj = q_.data() + j * V;
      sampling_distribution(row_.data(), V, sampling_, qj);
      const int32_t t = sample_from(qj, V, U(rng_));
      dr.tokens[static_cast<size_t>(j)] = t;
      dr.confidence_logits[static_cast<size_t>(j)] = conf;
      if (j + 1 < B) prev[static_cast<size_t>(j + 1)] = t;
    }
  } else {
    dr = d_.greedy(*blk, /*full=*/false);
    if (o_.draft_hook) o_.draft_hook(n, dr);
    DSX_CHECK(static_cast<int>(dr.tokens.size()) >= kmax && static_cast<int>(dr.confidence_logits.size()) >= kmax,
              "DSpark: the draft hook left fewer than ", kmax, " drafts");
  }
  k_ = choose_k(o_.schedule, dr.confidence_logits.data(), rows, kmax);
  for (int i = 0; i < k_; ++i) rows_.push_back(dr.tokens[static_cast<size_t>(i)]);
  ++stats_.drafted;
  stats_.draft_seconds += since(t0);
  return k_;
}

Feed DSparkCycle::verify_feed(Session& s) {
  DSX_CHECK(s.position() == n_, "DSpark: the session is at ", s.position(), ", the block's anchor at ", n_);
  const int64_t R = static_cast<int64_t>(rows_.size()), V = d_.vocab_size();
  taps_.resize(static_cast<size_t>(R * d_.tap_width()));
  Feed f{&s, rows_.data(), R, nullptr, taps_.data(), nullptr, nullptr};
  if (sampling_on()) {
    logits_.resize(static_cast<size_t>(R * V));
    f.logits = logits_.data();
  } else {
    picks_.resize(static_cast<size_t>(R));
    f.picks = picks_.data();
  }
  verify_start_ = Clock::now();
  return f;
}

int DSparkCycle::accept(Session& s, DSparkContext& ctx, std::vector<int32_t>& out) {
  const int64_t n = n_, V = d_.vocab_size(), R = 1 + k_;
  const int k = k_;
  DSX_CHECK(s.position() == n + R && ctx.end() == n, "DSpark: accept after a verify of ", R, " rows at ", n,
            " finds the session at ", s.position(), " and the context at ", ctx.end());
  int j = 0;
  int32_t y = -1;
  if (!sampling_on()) {
    while (j < k && rows_[static_cast<size_t>(j + 1)] == picks_[static_cast<size_t>(j)]) ++j;
    y = picks_[static_cast<size_t>(j)];
  } else {
    p_.resize(static_cast<size_t>(R * V));
    for (int64_t r = 0; r < R; ++r) sampling_distribution(logits_.data() + r * V, V, sampling_, p_.data() + r * V);
    std::vector<double> u(static_cast<size_t>(k + 1));
    std::uniform_real_distribution<double> U(0.0, 1.0);
    for (double& x : u) x = U(rng_);
    const SpeculativeResult sr =
        speculative_block(p_.data(), point_ ? nullptr : q_.data(), rows_.data() + 1, k, V, u.data());
    j = sr.accepted;
    y = sr.tokens.back();
  }
  // commit: the session to the anchor and the accepted drafts, their taps to the rings
  if (j < k) s.rollback(n + j + 1);
  ctx.observe(rows_.data(), taps_.data(), j + 1);
  for (int i = 1; i <= j; ++i) out.push_back(rows_[static_cast<size_t>(i)]);
  out.push_back(y);
  const double vs = since(verify_start_);
  stats_.verify_seconds += vs;
  if (static_cast<size_t>(R) < stats_.verify_steps_by_rows.size()) {
    ++stats_.verify_steps_by_rows[static_cast<size_t>(R)];
    stats_.verify_seconds_by_rows[static_cast<size_t>(R)] += vs;
  }
  ++stats_.cycles;
  stats_.verified += k;
  stats_.accepted += j;
  stats_.verify_rows += R;
  stats_.tokens += j + 1;
  if (static_cast<size_t>(j) < stats_.accepted_hist.size()) ++stats_.accepted_hist[static_cast<size_t>(j)];
  return j;
}

// ---- the strategy ----------------------------------------------------------------------------------
DSparkDecoding::DSparkDecoding(const Drafter& drafter, DSparkOptions o, DSparkContext* ctx)
    : d_(drafter), cycle_(drafter, std::move(o)) {
  set_context(ctx);
}

void DSparkDecoding::set_context(DSparkContext* ctx) {
  if (ctx) {
    ctx_ = ctx;
    return;
  }
  if (!own_) own_ = std::make_unique<DSparkContext>(d_);
  ctx_ = own_.get();
}

void DSparkDecoding::start(const SamplerOptions& sampling) { cycle_.start(sampling); }

SyncResult DSparkDecoding::prefill(Session& s, const int32_t* ids, int64_t n) {
  DSX_CHECK(s.engine().tap_width() == d_.tap_width(), "DSpark: the engine's taps are ", s.engine().tap_width(),
            " wide, the drafter's ", d_.tap_width(), " (another model?)");
  ctx_->keep_common_prefix(ids, n);
  if (n <= 0) {
    if (s.position() > 0) s.rollback(0);
    return SyncResult{};
  }
  // the session: its prefix shared with ids, or up to the last W rows, without taps
  const std::vector<int32_t>& have = s.tokens();
  int64_t cs = 0;
  const int64_t lim = std::min<int64_t>(static_cast<int64_t>(have.size()), n);
  while (cs < lim && have[static_cast<size_t>(cs)] == ids[cs]) ++cs;
  const int64_t TW = d_.tap_width(), every = s.engine().options().checkpoint_every;
  // The rest in ONE step with taps when it fits, as Session::sync feeds it (one piece up
  // to the next checkpoint): a prefill's numbers may depend on how its rows are split into
  // passes (the CUDA engine's prefill products), and plain decoding's prefill is sync's.
  if (n - cs > 0 && (every <= 0 || n - cs < every) && (n - cs) * TW * 4 <= kOnePieceTapBytes) {
    if (s.position() > cs) s.rollback(cs);
    ctx_->truncate(cs);
    ctx_->skip(ids + ctx_->end(), cs - ctx_->end());
    taps_.resize(static_cast<size_t>((n - cs) * TW));
    Step st;
    st.feeds.push_back(Feed{&s, ids + cs, n - cs, nullptr, taps_.data(), nullptr, nullptr});
    s.engine().step(st);
    ctx_->observe(ids + cs, taps_.data(), n - cs);
    SyncResult r;
    r.reused = cs;
    r.prefilled = n - cs;
    return r;
  }
  const int64_t a = std::max<int64_t>(cs, std::max<int64_t>(0, n - d_.config().window));
  SyncResult r;
  if (a > 0) {
    r = s.sync(ids, a);
  } else if (s.position() > 0) {
    s.rollback(0);
  }
  DSX_CHECK(s.position() == a, "DSpark prefill: the session is at ", s.position(), " after a sync to ", a);
  // the context: what it holds of positions < a stays; positions it lacks are holes
  ctx_->truncate(a);
  ctx_->skip(ids + ctx_->end(), a - ctx_->end());
  // the last rows with taps, in chunks
  const int64_t chunk = std::max<int64_t>(cycle_.options().prefill_chunk, 1);
  for (int64_t q = a; q < n;) {
    const int64_t m = std::min(chunk, n - q);
    taps_.resize(static_cast<size_t>(m * TW));
    Step st;
    st.feeds.push_back(Feed{&s, ids + q, m, nullptr, taps_.data(), nullptr, nullptr});
    s.engine().step(st);
    ctx_->observe(ids + q, taps_.data(), m);
    q += m;
  }
  r.prefilled = n - r.reused;
  return r;
}

void DSparkDecoding::align(Session& s) { ctx_->align(s.tokens().data(), s.position()); }

void DSparkDecoding::next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) {
  align(s);
  cycle_.draft(*ctx_, anchor, cycle_.max_drafts(s.engine(), limit));
  Step st;
  st.feeds.push_back(cycle_.verify_feed(s));
  st.all_rows = cycle_.needs_all_rows();
  s.engine().step(st);
  cycle_.accept(s, *ctx_, out);
}

// ---- drafter backends -----------------------------------------------------------------------
namespace {
std::map<std::string, DrafterFactory>& drafter_registry() {
  static std::map<std::string, DrafterFactory> r;
  return r;
}
}  // namespace

void register_drafter_backend(const std::string& backend, DrafterFactory f) { drafter_registry()[backend] = std::move(f); }

bool drafter_backend_available(const std::string& backend) {
  return backend == "cpu" || drafter_registry().count(backend) > 0;
}

std::unique_ptr<Drafter> load_drafter(const std::string& dir, const Engine& eng, const std::string& backend) {
  const std::string b = backend.empty() ? eng.backend_name() : backend;
  if (b == "cpu") return DSparkDrafter::load(dir);
  auto it = drafter_registry().find(b);
  if (it == drafter_registry().end()) fail("DSpark: no drafter for backend '", b, "' in this build");
  return it->second(dir, eng);
}

}  // namespace dsx
