// Properties of the runtime layer on every backend (CPU; CUDA in fp32 mode when a GPU
// is present), on the V4.1 golden model: a multi-row step equals the one-row path;
// sessions of one step equal each session run alone; 8 sessions decoding interleaved
// equal each alone; prefix sync reuses the common prefix (count checked) and equals a
// fresh prefill, also after an early edit through a checkpoint; snapshots round-trip
// bit for bit and cross backends; bad snapshots are refused; per-session memory is
// reported and the budget holds; the DSpark taps equal the golden's.
#include <gtest/gtest.h>

#include <filesystem>

#include <cmath>
#include <string>
#include <vector>

#include "cli/golden_check.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "util/error.h"
#include "util/safetensors.h"
#ifdef DSX_HAVE_CUDA
#include "kernels/cuda/cuda_util.h"
#endif

using namespace dsx;

namespace {

bool have_backend(const std::string& b) {
  if (b == "cpu") return true;
#ifdef DSX_HAVE_CUDA
  return cuda::device_available();
#else
  return false;
#endif
}

struct Golden {
  std::string dir;
  std::vector<int32_t> ids;
};

Golden golden(const std::string& gdir, const char* name = "deepseek_v41_tiny") {
  Golden g;
  g.dir = gdir + "/" + name;
  SafetensorsFile f(g.dir + (std::string(name).find("dspark") != std::string::npos ? "/dspark_golden.safetensors"
                                                                                    : "/golden.safetensors"));
  const auto& t = f.get("input_ids");
  g.ids.assign(t.as<int32_t>(), t.as<int32_t>() + t.numel());
  return g;
}

std::unique_ptr<Engine> engine(const std::string& backend, const std::string& dir, EngineOptions o = {}) {
  o.backend = backend;
  o.precision = "fp32";
  if (o.max_context == 0) o.max_context = 512;
  return load_engine(dir, o);
}

// logits of every position p0 .. p1 - 1 fed one row at a time after a prefill of p0
std::vector<float> one_row_path(Engine& e, const std::vector<int32_t>& ids, int64_t p0, int64_t p1) {
  const int64_t V = e.config().vocab_size;
  auto s = e.new_session();
  std::vector<float> l(static_cast<size_t>((p1 - p0) * V));
  s->feed(ids.data(), p0, l.data(), false);
  for (int64_t t = p0; t < p1; ++t) s->feed(ids.data() + t, 1, l.data() + (t - p0) * V, false);
  return l;
}

double max_rel(const float* a, const float* b, int64_t rows, int64_t V) {
  double m = 0;
  for (int64_t t = 0; t < rows; ++t) m = std::max(m, row_rel_l2(a + t * V, b + t * V, V));
  return m;
}

class Runtime : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!have_backend(GetParam())) GTEST_SKIP() << "backend " << GetParam() << " not available";
  }
};

// (fp32 noise level: the rows run in other kernel shapes; the golden README §6 rule is 1e-3)
constexpr double kTol = 1e-4;

}  // namespace

// A step of k rows gives each row the logits of the one-row path (several k, across
// the window wrap, ratio-2 group boundaries and the candidate blocks).
TEST_P(Runtime, MultiRowEqualsOneRow) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto e = engine(GetParam(), g.dir);
  const int64_t V = e->config().vocab_size, p0 = 41, p1 = 125;
  const std::vector<float> ref = one_row_path(*e, g.ids, p0, p1);
  for (int k : {2, 3, 5, 6, 8, 16, 17}) {
    auto s = e->new_session();
    std::vector<float> l(static_cast<size_t>((p1 - p0) * V));
    s->feed(g.ids.data(), p0, nullptr, false);
    for (int64_t t = p0; t < p1; t += k) {
      const int64_t n = std::min<int64_t>(k, p1 - t);
      s->feed(g.ids.data() + t, n, l.data() + (t - p0) * V, true);
    }
    const double err = max_rel(l.data(), ref.data(), p1 - p0, V);
    std::printf("[%s] %d-row steps vs one-row: max row rel-L2 %.3g\n", GetParam().c_str(), k, err);
    EXPECT_LE(err, kTol) << k << " rows";
  }
}

// Sessions at different positions with different row counts in one step: each equals
// the session stepped alone; last-row logits and the greedy picks too.
TEST_P(Runtime, SessionMixEqualsAlone) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto e = engine(GetParam(), g.dir);
  const int64_t V = e->config().vocab_size;
  struct Case {
    int64_t start, n;
  };
  const std::vector<std::vector<Case>> mixes = {{{40, 1}, {70, 4}, {10, 2}}, {{33, 1}, {34, 1}, {90, 1}, {5, 1}},
                                               {{60, 6}, {20, 3}}, {{1, 16}, {100, 5}}};
  for (size_t m = 0; m < mixes.size(); ++m) {
    const auto& mix = mixes[m];
    for (bool all : {true, false}) {
      std::vector<std::unique_ptr<Session>> ss;
      std::vector<std::vector<float>> got(mix.size());
      std::vector<int32_t> picks(mix.size(), -1);
      Step st;
      st.all_rows = all;
      for (size_t i = 0; i < mix.size(); ++i) {
        ss.push_back(e->new_session());
        ss[i]->feed(g.ids.data(), mix[i].start, nullptr, false);
        got[i].resize(static_cast<size_t>((all ? mix[i].n : 1) * V));
        st.feeds.push_back(Feed{ss[i].get(), g.ids.data() + mix[i].start, mix[i].n, got[i].data(), nullptr,
                                all ? nullptr : &picks[i]});
      }
      e->step(st);
      for (size_t i = 0; i < mix.size(); ++i) {
        auto alone = e->new_session();
        std::vector<float> want(static_cast<size_t>(mix[i].n * V));
        alone->feed(g.ids.data(), mix[i].start, nullptr, false);
        alone->feed(g.ids.data() + mix[i].start, mix[i].n, want.data(), true);
        const float* w = all ? want.data() : want.data() + (mix[i].n - 1) * V;
        const double err = max_rel(got[i].data(), w, all ? mix[i].n : 1, V);
        EXPECT_LE(err, kTol) << "mix " << m << " session " << i << (all ? " all rows" : " last row");
        if (!all) EXPECT_EQ(picks[i], argmax(got[i].data(), V)) << "mix " << m << " session " << i;
        EXPECT_EQ(ss[i]->position(), mix[i].start + mix[i].n);
        EXPECT_EQ(ss[i]->tokens(), alone->tokens());
      }
    }
  }
}

// 8 sessions decoding greedily, all in one step per token, pick the tokens each picks
// when run alone.
TEST_P(Runtime, EightSessionsInterleavedEqualAlone) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto e = engine(GetParam(), g.dir);
  const int n_sess = 8, steps = 12;
  std::vector<std::unique_ptr<Session>> ss;
  std::vector<int32_t> next(n_sess);
  for (int i = 0; i < n_sess; ++i) {
    ss.push_back(e->new_session());
    next[i] = ss[i]->feed_greedy(g.ids.data() + 7 * i, 20 + 9 * i);  // other prompts, other lengths
  }
  std::vector<std::vector<int32_t>> got(n_sess);
  for (int k = 0; k < steps; ++k) {
    Step st;
    std::vector<int32_t> in = next;
    for (int i = 0; i < n_sess; ++i) st.feeds.push_back(Feed{ss[i].get(), &in[i], 1, nullptr, nullptr, &next[i]});
    e->step(st);
    for (int i = 0; i < n_sess; ++i) got[i].push_back(next[i]);
  }
  for (int i = 0; i < n_sess; ++i) {
    auto alone = e->new_session();
    int32_t t = alone->feed_greedy(g.ids.data() + 7 * i, 20 + 9 * i);
    std::vector<int32_t> want;
    for (int k = 0; k < steps; ++k) want.push_back(t = alone->feed_greedy(&t, 1));
    EXPECT_EQ(got[i], want) << "session " << i;
    EXPECT_EQ(ss[i]->tokens(), alone->tokens()) << "session " << i;
  }
}

// sync keeps the common prefix (within the rollback depth: rollback; further back: the
// nearest checkpoint) and equals a fresh prefill of the new list.
TEST_P(Runtime, SyncReusesPrefixAndCheckpoints) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  EngineOptions o;
  o.checkpoint_every = 32;
  auto e = engine(GetParam(), g.dir, o);
  const int64_t V = e->config().vocab_size;
  auto fresh = [&](const std::vector<int32_t>& ids) {
    auto s = e->new_session();
    std::vector<float> l(static_cast<size_t>(V));
    s->feed(ids.data(), static_cast<int64_t>(ids.size()), l.data(), false);
    return l;
  };
  auto s = e->new_session();
  std::vector<float> l(static_cast<size_t>(V));
  std::vector<int32_t> a(g.ids.begin(), g.ids.begin() + 100);
  SyncResult r = s->sync(a, l.data());
  EXPECT_EQ(r.reused, 0);
  EXPECT_EQ(r.prefilled, 100);
  EXPECT_EQ(s->checkpoints(), (std::vector<int64_t>{32, 64, 96}));
  EXPECT_LE(row_rel_l2(l.data(), fresh(a).data(), V), kTol);
  // growing conversation: the prefix is kept
  std::vector<int32_t> b(g.ids.begin(), g.ids.begin() + 130);
  r = s->sync(b, l.data());
  EXPECT_EQ(r.reused, 100);
  EXPECT_EQ(r.prefilled, 30);
  EXPECT_EQ(r.checkpoint, -1);
  EXPECT_LE(row_rel_l2(l.data(), fresh(b).data(), V), kTol);
  // the same list again: the last token is fed again for its logits
  r = s->sync(b, l.data());
  EXPECT_EQ(r.reused, 129);
  EXPECT_LE(row_rel_l2(l.data(), fresh(b).data(), V), kTol);
  // a different last few tokens (within the rollback depth)
  std::vector<int32_t> c = b;
  for (int i = 120; i < 130; ++i) c[static_cast<size_t>(i)] = 5 + i;
  r = s->sync(c, l.data());
  EXPECT_EQ(r.reused, 120);
  EXPECT_EQ(r.checkpoint, -1);
  EXPECT_LE(row_rel_l2(l.data(), fresh(c).data(), V), kTol);
  // an early edit (position 70): back to the checkpoint at 64, replay, prefill
  std::vector<int32_t> d = c;
  d[70] = 11;
  d.push_back(17);
  r = s->sync(d, l.data());
  EXPECT_EQ(r.checkpoint, 64);
  EXPECT_EQ(r.reused, 64);
  EXPECT_EQ(r.prefilled, static_cast<int64_t>(d.size()) - 64);
  EXPECT_LE(row_rel_l2(l.data(), fresh(d).data(), V), kTol);
  EXPECT_EQ(s->tokens(), d);
  // rollback further than the depth, then continue like a fresh session
  s->rollback(50);
  EXPECT_EQ(s->position(), 50);
  std::vector<int32_t> f(d.begin(), d.begin() + 50);
  f.push_back(9);
  s->feed(&f.back(), 1, l.data(), false);
  EXPECT_LE(row_rel_l2(l.data(), fresh(f).data(), V), kTol);
}

// restore(save(s)) == s bit for bit, continues identically, and a snapshot of one
// backend restores on the other.
TEST_P(Runtime, SnapshotRoundTripAndCrossBackend) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto e = engine(GetParam(), g.dir);
  auto cpu = engine("cpu", g.dir);
  const int64_t V = e->config().vocab_size;
  for (int64_t cut : {1, 77, 78, 150}) {
    auto a = e->new_session();
    a->feed(g.ids.data(), cut, nullptr, false);
    const std::vector<uint8_t> snap = a->save();
    auto b = e->new_session();
    b->restore(snap);
    EXPECT_EQ(b->save(), snap) << "cut " << cut;
    EXPECT_EQ(b->tokens(), a->tokens());
    std::vector<float> la(static_cast<size_t>(10 * V)), lb(la.size()), lc(la.size());
    a->feed(g.ids.data() + cut, 10, la.data(), true);
    b->feed(g.ids.data() + cut, 10, lb.data(), true);
    EXPECT_EQ(la, lb) << "cut " << cut;
    auto c = cpu->new_session();
    c->restore(snap);
    c->feed(g.ids.data() + cut, 10, lc.data(), true);
    EXPECT_LE(max_rel(lc.data(), la.data(), 10, V), kTol) << "cut " << cut << " on the CPU";
    // and back
    auto d = e->new_session();
    d->restore(c->save());
    EXPECT_EQ(d->position(), cut + 10);
  }
}

// Bad snapshots are refused with the reason; the session is then untouched (CPU) or
// empty (CUDA: restored in place), never half restored.
TEST_P(Runtime, BadSnapshotsRefused) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto e = engine(GetParam(), g.dir);
  auto a = e->new_session();
  a->feed(g.ids.data(), 60, nullptr, false);
  const auto snap = a->save();
  auto expect = [&](std::vector<uint8_t> bytes, const char* needle) {
    auto b = e->new_session();
    b->feed(g.ids.data(), 5, nullptr, false);
    try {
      b->restore(bytes);
      ADD_FAILURE() << "accepted a bad snapshot (" << needle << ")";
    } catch (const Error& err) {
      EXPECT_NE(std::string(err.what()).find(needle), std::string::npos) << err.what();
    }
    EXPECT_TRUE(b->position() == 5 || b->position() == 0) << b->position();
    // and it works afterwards
    b->restore(snap);
    EXPECT_EQ(b->position(), 60);
  };
  auto t = snap;
  t.resize(t.size() * 2 / 3);
  expect(t, "truncated");
  auto f = snap;
  f[f.size() / 2] ^= 0x10;
  expect(f, "checksum");
  EngineOptions o;
  o.rollback_depth = 8;
  auto e8 = engine(GetParam(), g.dir, o);
  auto c = e8->new_session();
  c->feed(g.ids.data(), 20, nullptr, false);
  expect(c->save(), "geometry");
  // a snapshot longer than the capacity
  EngineOptions small;
  small.max_context = 40;
  auto es = engine(GetParam(), g.dir, small);
  auto s = es->new_session();
  EXPECT_THROW(s->restore(snap), Error);
  EXPECT_THROW(s->feed(g.ids.data(), 41, nullptr, false), Error);
  EXPECT_EQ(s->position(), 0);
}

// The engine reports what a session holds; the budget admits as many sessions as fit.
TEST_P(Runtime, MemoryReportedAndBudget) {
  DSX_REQUIRE_GOLDEN(gdir);
  const Golden g = golden(gdir);
  auto probe = engine(GetParam(), g.dir);
  const StateFootprint f0 = probe->footprint();
  EXPECT_GT(f0.fixed_bytes, 0);
  EXPECT_GT(f0.bytes_per_token, 0);
  EXPECT_GT(f0.session_bytes, f0.fixed_bytes);
  std::printf("[%s] state: %lld B fixed, %.1f B per token, %lld B per session of %d tokens\n", GetParam().c_str(),
              (long long)f0.fixed_bytes, f0.bytes_per_token, (long long)f0.session_bytes, 512);
  EngineOptions o;
  o.state_budget = 3 * f0.session_bytes + f0.session_bytes / 2;
  auto e = engine(GetParam(), g.dir, o);
  std::vector<std::unique_ptr<Session>> ss;
  for (int i = 0; i < 3; ++i) ss.push_back(e->new_session());
  try {
    e->new_session();
    ADD_FAILURE() << "a fourth session exceeded the budget";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("budget"), std::string::npos) << err.what();
  }
  for (auto& s : ss) s->feed(g.ids.data(), 100, nullptr, false);
  const StateFootprint f = e->footprint();
  EXPECT_EQ(f.sessions, 3);
  EXPECT_LE(f.used_bytes, f.budget_bytes);
  EXPECT_GE(f.used_bytes, 3 * f.fixed_bytes);
  ss.pop_back();
  EXPECT_NO_THROW(e->new_session());  // (a dropped session frees its share)
}

// The DSpark taps of a prefill equal the golden's (model-v41.md §1.5), and a multi-row
// step's taps equal the one-row path's.
TEST_P(Runtime, TapsMatchGolden) {
  DSX_REQUIRE_GOLDEN(gdir);
  if (!std::filesystem::exists(gdir + "/deepseek_v41_dspark_tiny/dspark_golden.safetensors"))
    GTEST_SKIP() << "the DSpark golden case is not in " << gdir;
  const Golden g = golden(gdir, "deepseek_v41_dspark_tiny");
  auto e = engine(GetParam(), g.dir);
  const int64_t W = e->tap_width(), T = static_cast<int64_t>(g.ids.size());
  ASSERT_GT(W, 0);
  SafetensorsFile f(g.dir + "/dspark_golden.safetensors");
  const auto& want = f.get("taps");
  ASSERT_EQ(want.numel(), T * W);
  auto s = e->new_session();
  std::vector<float> taps(static_cast<size_t>(T * W));
  Step st;
  st.feeds.push_back(Feed{s.get(), g.ids.data(), T, nullptr, taps.data(), nullptr});
  e->step(st);
  int64_t lead = 0;
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double err = row_rel_l2(taps.data() + t * W, want.as<float>() + t * W, W);
    if (lead == t && err <= 1e-5) lead = t + 1, worst = std::max(worst, err);
  }
  std::printf("[%s] taps: %lld/%lld leading prefill rows within 1e-5 (max %.3g)\n", GetParam().c_str(), (long long)lead,
              (long long)T, worst);
  EXPECT_GE(lead, T * 35 / 100);
  // multi-row == one-row
  auto a = e->new_session(), b = e->new_session();
  a->feed(g.ids.data(), 30, nullptr, false);
  b->feed(g.ids.data(), 30, nullptr, false);
  std::vector<float> ta(static_cast<size_t>(6 * W)), tb(ta.size());
  Step s6;
  s6.feeds.push_back(Feed{a.get(), g.ids.data() + 30, 6, nullptr, ta.data(), nullptr});
  e->step(s6);
  for (int i = 0; i < 6; ++i) {
    Step s1;
    s1.feeds.push_back(Feed{b.get(), g.ids.data() + 30 + i, 1, nullptr, tb.data() + i * W, nullptr});
    e->step(s1);
  }
  EXPECT_LE(max_rel(ta.data(), tb.data(), 6, W), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Backends, Runtime, ::testing::Values(std::string("cpu"), std::string("cuda")),
                         [](const auto& i) { return i.param; });
