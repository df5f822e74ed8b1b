// The DSpark drafter (model/dspark.h) against every DSpark golden case under
// ../shared/golden (README §8, case.json how_to_check_an_engine), and its properties:
//   - DrafterAloneMatchesGolden: from the golden's own taps, the fused context rows,
//     the ring rows of every stage, the block K=V rows, the stage streams and pre mixes,
//     the router choices, z, the base logits, the Markov logits and draft tokens, the
//     confidence logits and the forced variant, at every anchor;
//   - EndToEndMatchesGolden: the CPU target's taps, then the drafter on them, compared up
//     to the first tap row that differs (README §6: the reference is chaotic under QA8);
//   - observing incrementally == all at once; a ring rollback and re-observe == never
//     advanced; the anchor and state checks; bad checkpoints (no stages, a stage tensor
//     missing or of the wrong shape, a stage count that disagrees with the index) are
//     refused with an error naming the problem; `dsx draft` writes the golden's names.
// Tolerances are the golden's (README §8): ~1e-5 relative L2 per row for the logits and
// the other float rows; confidence logits |d| <= 1e-5 max(1, |ref|); a greedy draft token
// must equal the golden's wherever its greedy_margin is well above the row's logit error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "cli/golden_check.h"
#include "model/dspark.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

constexpr double kRowTol = 1e-5;  // README §8

// Every golden case directory with a DSpark golden file.
std::vector<std::string> dspark_cases(const std::string& gdir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(gdir))
    if (e.is_directory() && std::filesystem::exists(e.path() / "dspark_golden.safetensors")) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

template <typename T>
std::vector<T> vec(const SafetensorsFile& g, const std::string& name) {
  const TensorView& t = g.get(name);
  return std::vector<T>(t.as<T>(), t.as<T>() + t.numel());
}

// Running maxima of the errors per tensor, printed at the end of a test.
struct Errors {
  std::map<std::string, double> max;
  void add(const std::string& k, double e) { max[k] = std::max(max[k], e); }
  void print(const std::string& title) const {
    std::printf("%s:", title.c_str());
    for (const auto& [k, v] : max) std::printf(" %s %.3g;", k.c_str(), v);
    std::printf("\n");
  }
};

double conf_err(float got, float want) { return std::fabs(static_cast<double>(got) - want) / std::max(1.0, std::fabs(static_cast<double>(want))); }

double max_abs(const float* a, const float* b, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
}

// One golden case: its files and the drafter.
struct Case {
  std::string dir;
  std::unique_ptr<SafetensorsFile> g;
  std::unique_ptr<DSparkDrafter> d;
  int64_t A = 0, B = 0, V = 0, D = 0, M = 0, hd = 0, W = 0, S = 0, R = 0, TW = 0, T = 0, K = 0;
  std::vector<int32_t> ids, apos, atok, forced;

  explicit Case(const std::string& dir_) : dir(dir_) {
    g = std::make_unique<SafetensorsFile>(dir + "/dspark_golden.safetensors");
    d = DSparkDrafter::load(dir);
    const ModelConfig& c = d->config();
    B = c.dspark_block_size, V = c.vocab_size, D = c.hidden, M = c.hc_mult, hd = c.head_dim, W = c.window;
    S = d->n_stages(), R = c.dspark_markov_rank, TW = c.tap_width(), K = c.dspark_experts_per_tok;
    ids = vec<int32_t>(*g, "input_ids");
    apos = vec<int32_t>(*g, "anchor_positions");
    atok = vec<int32_t>(*g, "anchor_tokens");
    forced = vec<int32_t>(*g, "dspark.forced_prev_tokens");
    T = static_cast<int64_t>(ids.size());
    A = static_cast<int64_t>(apos.size());
  }
  const float* f32(const std::string& n) const { return g->get(n).as<float>(); }
  const int32_t* i32(const std::string& n) const { return g->get(n).as<int32_t>(); }
  bool has(const std::string& n) const { return g->find(n) != nullptr; }
};

// Compares the outputs of anchor a (block b, greedy draft gd, forced draft fd) with the
// golden's; returns false when a row is off (the failures are reported).
void check_outputs(const Case& c, int64_t a, const DSparkBlock& b, const DSparkDraft& gd, const DSparkDraft& fd,
                   Errors& err, const std::string& what) {
  const int64_t B = c.B, V = c.V, D = c.D, R = c.R;
  const std::string at = what + " anchor " + std::to_string(c.apos[a]);
  for (int64_t j = 0; j < B; ++j) {
    const int64_t k = a * B + j;
    if (c.has("dspark.z")) {
      const double e = row_rel_l2(b.z.data() + j * D, c.f32("dspark.z") + k * D, D);
      err.add("z", e);
      EXPECT_LE(e, kRowTol) << at << " z row " << j;
    }
    const double eb = row_rel_l2(b.base_logits.data() + j * V, c.f32("dspark.base_logits") + k * V, V);
    err.add("base_logits", eb);
    EXPECT_LE(eb, kRowTol) << at << " base_logits row " << j;
    // forced variant: always comparable
    const double ef = row_rel_l2(fd.markov_logits.data() + j * V, c.f32("dspark.forced_markov_logits") + k * V, V);
    err.add("forced_markov_logits", ef);
    EXPECT_LE(ef, kRowTol) << at << " forced_markov_logits row " << j;
    const double ecf = conf_err(fd.confidence_logits[j], c.f32("dspark.forced_confidence_logits")[k]);
    err.add("forced_confidence_logits", ecf);
    EXPECT_LE(ecf, kRowTol) << at << " forced_confidence_logits row " << j;
  }
  // greedy walk: rows are comparable while every earlier draft equals the golden's
  for (int64_t j = 0; j < B; ++j) {
    const int64_t k = a * B + j;
    if (c.has("dspark.markov_prev_tokens")) EXPECT_EQ(gd.prev[j], c.i32("dspark.markov_prev_tokens")[k]) << at << " row " << j;
    if (gd.prev[j] != (j == 0 ? c.atok[a] : c.i32("dspark.draft_tokens")[k - 1])) break;
    if (c.has("dspark.markov_embed")) {
      const double e = max_abs(gd.markov_embed.data() + j * R, c.f32("dspark.markov_embed") + k * R, R);
      err.add("markov_embed (abs)", e);
      EXPECT_EQ(e, 0.0) << at << " markov_embed row " << j;
    }
    const float* want = c.f32("dspark.markov_logits") + k * V;
    const double em = row_rel_l2(gd.markov_logits.data() + j * V, want, V);
    err.add("markov_logits", em);
    EXPECT_LE(em, kRowTol) << at << " markov_logits row " << j;
    const double ec = conf_err(gd.confidence_logits[j], c.f32("dspark.confidence_logits")[k]);
    err.add("confidence_logits", ec);
    EXPECT_LE(ec, kRowTol) << at << " confidence_logits row " << j;
    // the draft token, where the golden's margin is well above this row's logit error
    const double abs_err = max_abs(gd.markov_logits.data() + j * V, want, V);
    err.add("markov_logits (abs)", abs_err);
    const float margin = c.has("dspark.greedy_margin") ? c.f32("dspark.greedy_margin")[k] : INFINITY;
    if (margin > 10 * abs_err) {
      EXPECT_EQ(gd.tokens[j], c.i32("dspark.draft_tokens")[k]) << at << " draft row " << j << " margin " << margin;
      err.add("draft tokens differing", gd.tokens[j] != c.i32("dspark.draft_tokens")[k]);
    } else {
      std::printf("%s row %lld: golden margin %.3g not above the logit error %.3g: token not compared\n", at.c_str(),
                  static_cast<long long>(j), margin, abs_err);
    }
  }
}

}  // namespace

// how_to_check_an_engine, "drafter alone": the golden's taps of the ring positions, the
// anchor token at its position; every intermediate the golden records.
TEST(DSpark, DrafterAloneMatchesGolden) {
  DSX_REQUIRE_GOLDEN(gdir);
  const auto cases = dspark_cases(gdir);
  if (cases.empty()) GTEST_SKIP() << "no DSpark golden case";
  for (const std::string& dir : cases) {
    const Case c(dir);
    const DSparkDrafter& d = *c.d;
    ASSERT_EQ(c.g->get("taps").numel(), c.T * c.TW) << dir;
    const float* taps = c.f32("taps");
    Errors err;
    for (int64_t a = 0; a < c.A; ++a) {
      const int64_t n = c.apos[a];
      const std::string at = dir + " anchor " + std::to_string(n);
      DSparkState st = d.new_state();
      d.observe(st, taps, n, 0);  // the committed positions 0 .. n - 1
      ASSERT_EQ(st.context_rows(n), std::min(n, c.W)) << at;
      DSparkDebug dbg;
      const DSparkBlock b = d.block(st, c.atok[a], n, &dbg);
      const DSparkDraft gd = d.greedy(b);
      const DSparkDraft fd = d.forced(b, c.forced.data() + a * c.B);

      // the window: which positions, their fused rows u_p and every stage's ring row
      if (c.has("dspark.window_positions")) {
        const int64_t slots = c.g->get("dspark.window_positions").dim(1);
        std::set<int64_t> want_pos, got_pos(dbg.ring_positions.begin(), dbg.ring_positions.end());
        for (int64_t k = 0; k < slots; ++k) {
          const int64_t p = c.i32("dspark.window_positions")[a * slots + k];
          if (p < 0) continue;
          want_pos.insert(p);
          ASSERT_EQ(p % c.W, k) << at << ": the golden's slot rule";
          std::vector<float> u(static_cast<size_t>(c.D));
          d.fuse(taps + p * c.TW, 1, u.data());
          if (c.has("dspark.main_x")) {
            const double e = row_rel_l2(u.data(), c.f32("dspark.main_x") + (a * slots + k) * c.D, c.D);
            err.add("main_x", e);
            EXPECT_LE(e, kRowTol) << at << " main_x slot " << k;
          }
          if (c.has("dspark.window_taps")) {
            EXPECT_EQ(max_abs(taps + p * c.TW, c.f32("dspark.window_taps") + (a * slots + k) * c.TW, c.TW), 0.0) << at;
          }
          if (c.has("dspark.ring_kv"))
            for (int64_t s = 0; s < c.S; ++s) {
              const float* r = st.row(static_cast<int>(s), p);
              ASSERT_NE(r, nullptr) << at << " stage " << s << " position " << p;
              const double e = row_rel_l2(r, c.f32("dspark.ring_kv") + ((a * c.S + s) * slots + k) * c.hd, c.hd);
              err.add("ring_kv", e);
              EXPECT_LE(e, kRowTol) << at << " ring_kv stage " << s << " slot " << k;
            }
        }
        EXPECT_EQ(got_pos, want_pos) << at << ": ring positions attended";
      }
      // the block through the stages
      for (int64_t s = 0; s < c.S; ++s)
        for (int64_t j = 0; j < c.B; ++j) {
          const int64_t sj = (a * c.S + s) * c.B + j, mj = s * c.B + j;
          if (c.has("dspark.block_kv")) {
            const double e = row_rel_l2(dbg.block_kv.data() + mj * c.hd, c.f32("dspark.block_kv") + sj * c.hd, c.hd);
            err.add("block_kv", e);
            EXPECT_LE(e, kRowTol) << at << " block_kv stage " << s << " row " << j;
          }
          if (c.has("dspark.stage_out")) {
            const int64_t n_ = c.M * c.D;
            const double e = row_rel_l2(dbg.stage_out.data() + mj * n_, c.f32("dspark.stage_out") + sj * n_, n_);
            err.add("stage_out", e);
            EXPECT_LE(e, kRowTol) << at << " stage_out stage " << s << " row " << j;
          }
          if (c.has("dspark.stage_pre_mix")) {
            const double e = row_rel_l2(dbg.stage_pre.data() + mj * c.M, c.f32("dspark.stage_pre_mix") + sj * c.M, c.M);
            err.add("stage_pre_mix", e);
            EXPECT_LE(e, kRowTol) << at << " stage_pre_mix stage " << s << " row " << j;
          }
          if (c.has("dspark.router_experts")) {
            std::vector<int32_t> got(dbg.router_experts.begin() + mj * c.K, dbg.router_experts.begin() + (mj + 1) * c.K);
            std::vector<int32_t> want(c.i32("dspark.router_experts") + sj * c.K, c.i32("dspark.router_experts") + (sj + 1) * c.K);
            std::sort(got.begin(), got.end());
            std::sort(want.begin(), want.end());
            EXPECT_EQ(got, want) << at << " experts of stage " << s << " row " << j;
          }
        }
      check_outputs(c, a, b, gd, fd, err, dir + " alone");
    }
    err.print("[dspark alone] " + std::filesystem::path(dir).filename().string());
  }
}

// how_to_check_an_engine, "target taps" and "end to end": the CPU target's prefill taps
// against the golden's, then the drafter on the engine's own taps at every anchor whose
// window lies inside the leading tap rows that agree (README §6: past the first flipped
// rounding the reference itself is chaotic).
TEST(DSpark, EndToEndMatchesGolden) {
  DSX_REQUIRE_GOLDEN(gdir);
  const auto cases = dspark_cases(gdir);
  if (cases.empty()) GTEST_SKIP() << "no DSpark golden case";
  for (const std::string& dir : cases) {
    const Case c(dir);
    EngineOptions o;
    o.max_context = c.T + 16;
    auto eng = load_engine(dir, o);
    ASSERT_EQ(eng->tap_width(), c.TW);
    std::vector<float> taps(static_cast<size_t>(c.T * c.TW));
    auto s = eng->new_session();
    Step st;
    st.feeds.push_back(Feed{s.get(), c.ids.data(), c.T, nullptr, taps.data(), nullptr, nullptr});
    eng->step(st);
    int64_t lead = 0;
    double worst = 0;
    while (lead < c.T) {
      const double e = row_rel_l2(taps.data() + lead * c.TW, c.f32("taps") + lead * c.TW, c.TW);
      if (!(e <= kRowTol)) break;
      worst = std::max(worst, e);
      ++lead;
    }
    std::printf("[dspark end to end] %s: taps %lld/%lld leading rows within 1e-5 (max %.3g)\n", dir.c_str(),
                static_cast<long long>(lead), static_cast<long long>(c.T), worst);
    EXPECT_GT(lead, 0) << dir << ": the first tap row differs";
    // the decoding path's taps (prefill of T0 rows, then one row per step) against the
    // golden's incremental ones: rows < T0 are the prefill's, later ones informative
    int64_t T0 = 0;
    if (std::filesystem::exists(dir + "/case.json")) {
      const auto j = nlohmann::json::parse(read_text_file(dir + "/case.json"));
      if (j.contains("taps_incremental_vs_prefill") && j["taps_incremental_vs_prefill"].contains("T0"))
        T0 = j["taps_incremental_vs_prefill"]["T0"].get<int64_t>();
    }
    if (T0 > 0 && T0 < c.T && c.has("taps_incremental")) {
      auto si = eng->new_session();
      std::vector<float> inc(taps.size());
      for (int64_t p = 0; p < c.T; p += p == 0 ? T0 : 1) {
        Step one;
        one.feeds.push_back(Feed{si.get(), c.ids.data() + p, p == 0 ? T0 : 1, nullptr, inc.data() + p * c.TW, nullptr, nullptr});
        eng->step(one);
      }
      int64_t lead_inc = 0;
      while (lead_inc < c.T &&
             row_rel_l2(inc.data() + lead_inc * c.TW, c.f32("taps_incremental") + lead_inc * c.TW, c.TW) <= kRowTol)
        ++lead_inc;
      std::printf("[dspark end to end] %s: incremental taps (T0 = %lld) %lld/%lld leading rows within 1e-5\n",
                  dir.c_str(), static_cast<long long>(T0), static_cast<long long>(lead_inc), static_cast<long long>(c.T));
      EXPECT_GE(lead_inc, std::min(T0, lead)) << dir;
    }
    Errors err;
    DSparkState ds = c.d->new_state();
    int compared = 0;
    for (int64_t a = 0; a < c.A; ++a) {
      const int64_t n = c.apos[a];
      if (n > lead) continue;  // the window holds a tap row past the first divergence
      ++compared;
      if (n < ds.end()) ds = c.d->new_state();
      c.d->observe(ds, taps.data() + ds.end() * c.TW, n - ds.end(), ds.end());
      const DSparkBlock b = c.d->block(ds, c.atok[a], n);
      check_outputs(c, a, b, c.d->greedy(b), c.d->forced(b, c.forced.data() + a * c.B), err, dir + " end to end");
    }
    std::printf("[dspark end to end] %d of %lld anchors inside the agreeing taps\n", compared, static_cast<long long>(c.A));
    err.print("[dspark end to end] " + std::filesystem::path(dir).filename().string());
  }
}

namespace {

std::string tiny_dspark_dir() {
  const std::string g = dsx_test::golden_dir();
  if (g.empty()) return "";
  const std::string d = g + "/deepseek_v41_dspark_tiny";
  return std::filesystem::exists(d) ? d : "";
}

std::vector<float> golden_taps(const std::string& dir) { return vec<float>(SafetensorsFile(dir + "/dspark_golden.safetensors"), "taps"); }

void expect_same_draft(const DSparkDrafter& d, const DSparkState& a, const DSparkState& b, int32_t anchor, int64_t n,
                       const std::string& what) {
  const DSparkDraft x = d.draft(a, anchor, n), y = d.draft(b, anchor, n);
  EXPECT_EQ(x.tokens, y.tokens) << what;
  EXPECT_EQ(x.markov_logits, y.markov_logits) << what;
  EXPECT_EQ(x.confidence_logits, y.confidence_logits) << what;
}

void expect_same_window(const DSparkState& a, const DSparkState& b, int64_t n, const std::string& what) {
  ASSERT_EQ(a.context_rows(n), b.context_rows(n)) << what;
  for (int s = 0; s < a.n_stages(); ++s)
    for (int64_t p = std::max<int64_t>(0, n - a.window()); p < n; ++p) {
      const float* x = a.row(s, p);
      const float* y = b.row(s, p);
      ASSERT_EQ(x == nullptr, y == nullptr) << what << " stage " << s << " position " << p;
      if (x) ASSERT_EQ(0, std::memcmp(x, y, static_cast<size_t>(a.head_dim()) * 4)) << what << " stage " << s << " position " << p;
    }
}

// A copy of a model directory whose model.safetensors is rewritten by `edit` (name ->
// keep / rename / reshape), config.json optionally replaced.
std::string edited_model(const std::string& src, const std::string& name,
                         const std::function<bool(const std::string&, std::string&, std::vector<int64_t>&, size_t&)>& edit,
                         const std::string& config = "") {
  const std::string dir = dsx_test::temp_dir(name);
  for (const char* f : {"config.json", "tokenizer.json"})
    if (std::filesystem::exists(src + "/" + f)) std::filesystem::copy_file(src + "/" + f, dir + "/" + f);
  if (!config.empty()) std::ofstream(dir + "/config.json", std::ios::trunc) << config;
  SafetensorsFile in(src + "/model.safetensors");
  SafetensorsWriter w;
  for (const auto& [n, t] : in.tensors()) {
    std::string nn = n;
    std::vector<int64_t> shape = t.shape;
    size_t bytes = t.nbytes;
    if (!edit(n, nn, shape, bytes)) continue;
    w.add(nn, t.dtype, shape, t.data, bytes);
  }
  w.write(dir + "/model.safetensors");
  return dir;
}

std::string load_error(const std::string& dir) {
  try {
    DSparkDrafter::load(dir);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// Rows are independent per position: observing the committed positions in pieces (as a
// decoder does, prefill chunks then one cycle at a time) gives the same rings and the same
// draft as observing them at once.
TEST(DSpark, IncrementalObserveEqualsAllAtOnce) {
  const std::string dir = tiny_dspark_dir();
  if (dir.empty()) GTEST_SKIP() << "golden DSpark case not found";
  auto d = DSparkDrafter::load(dir);
  const std::vector<float> taps = golden_taps(dir);
  const int64_t TW = d->tap_width();
  const int64_t n = 61;  // well past the window (16): the ring wraps several times
  DSparkState all = d->new_state(), inc = d->new_state();
  d->observe(all, taps.data(), n, 0);
  for (int64_t p = 0; p < n;) {
    const int64_t k = std::min<int64_t>(n - p, 1 + (p % 5));  // pieces of 1 .. 5 rows
    d->observe(inc, taps.data() + p * TW, k, p);
    p += k;
  }
  EXPECT_EQ(inc.end(), n);
  expect_same_window(all, inc, n, "incremental");
  expect_same_draft(*d, all, inc, 7, n, "incremental");
  // and a draft at every step of a one-row-at-a-time walk equals the fresh one's
  DSparkState walk = d->new_state();
  d->observe(walk, taps.data(), 2, 0);
  for (int64_t p = 2; p < 24; ++p) {
    DSparkState fresh = d->new_state();
    d->observe(fresh, taps.data(), p, 0);
    expect_same_draft(*d, fresh, walk, 11, p, "walk at " + std::to_string(p));
    d->observe(walk, taps.data() + p * TW, 1, p);
  }
}

// A rollback of the committed sequence: rows observed past position r (rejected or
// rewritten) are forgotten by truncate(r); re-observing other rows from r gives the state
// of a drafter that never saw them, as long as the rollback is within rollback_depth.
TEST(DSpark, RollbackThenReobserveEqualsNeverAdvanced) {
  const std::string dir = tiny_dspark_dir();
  if (dir.empty()) GTEST_SKIP() << "golden DSpark case not found";
  auto d = DSparkDrafter::load(dir);
  const std::vector<float> taps = golden_taps(dir);
  const int64_t TW = d->tap_width(), T = static_cast<int64_t>(taps.size()) / TW;
  const int depth = 6;
  for (int64_t r : {20, 33, 47}) {
    for (int64_t k : {1, 3, 6}) {
      DSparkState st = d->new_state(depth);
      d->observe(st, taps.data(), r, 0);
      // advance by k rows of other taps (the rows of a rejected verify), then roll back
      d->observe(st, taps.data() + (T - k) * TW, k, r);
      st.truncate(r);
      EXPECT_EQ(st.end(), r);
      // re-observe the true rows r .. r + 2
      d->observe(st, taps.data() + r * TW, 3, r);
      DSparkState never = d->new_state(depth);
      d->observe(never, taps.data(), r + 3, 0);
      const std::string what = "rollback to " + std::to_string(r) + " after " + std::to_string(k);
      expect_same_window(never, st, r + 3, what);
      expect_same_draft(*d, never, st, 5, r + 3, what);
      // observe() itself forgets the positions it rewrites
      DSparkState re = d->new_state(depth);
      d->observe(re, taps.data(), r, 0);
      d->observe(re, taps.data() + (T - k) * TW, k, r);
      d->observe(re, taps.data() + r * TW, 3, r);
      expect_same_window(never, re, r + 3, what + " (observe over)");
    }
  }
  // beyond the rollback depth, the overwritten rows are holes (never silently wrong)
  DSparkState st = d->new_state(2);
  d->observe(st, taps.data(), 40, 0);
  st.truncate(30);
  EXPECT_LT(st.context_rows(30), 16);
  EXPECT_EQ(st.row(0, 30), nullptr);
}

TEST(DSpark, AnchorAndStateChecks) {
  const std::string dir = tiny_dspark_dir();
  if (dir.empty()) GTEST_SKIP() << "golden DSpark case not found";
  auto d = DSparkDrafter::load(dir);
  const std::vector<float> taps = golden_taps(dir);
  DSparkState st = d->new_state();
  d->observe(st, taps.data(), 10, 0);
  auto err = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(err([&] { d->block(st, 5, 1); }).find("< 2"), std::string::npos);  // C3: n >= 2
  EXPECT_NE(err([&] { d->block(st, 5, 11); }).find("observed positions up to 9"), std::string::npos);
  EXPECT_NE(err([&] { d->block(st, static_cast<int32_t>(d->vocab_size()), 10); }).find("vocabulary"), std::string::npos);
  const DSparkBlock b = d->block(st, 5, 10);
  std::vector<int32_t> prev(static_cast<size_t>(d->block_size()), -1);
  EXPECT_NE(err([&] { d->forced(b, prev.data()); }).find("outside the vocabulary"), std::string::npos);
  // a state of another geometry
  DSparkState other(d->n_stages() + 1, d->config().window, d->config().head_dim, 4);
  EXPECT_NE(err([&] { d->observe(other, taps.data(), 1, 0); }).find("another drafter"), std::string::npos);
  // the block is B rows; the greedy draft walks them in order
  const DSparkDraft g = d->greedy(b);
  ASSERT_EQ(static_cast<int>(g.tokens.size()), d->block_size());
  EXPECT_EQ(g.prev[0], 5);
  for (int j = 1; j < d->block_size(); ++j) EXPECT_EQ(g.prev[j], g.tokens[j - 1]);
  // a forced walk with the greedy tokens is the greedy walk
  const DSparkDraft f = d->forced(b, g.prev.data());
  EXPECT_EQ(f.markov_logits, g.markov_logits);
  EXPECT_EQ(f.confidence_logits, g.confidence_logits);
}

TEST(DSpark, CheckpointsWithoutOrWithBadStagesAreRefused) {
  const std::string dir = tiny_dspark_dir();
  if (dir.empty()) GTEST_SKIP() << "golden DSpark case not found";
  // no stages: the plain target golden
  const std::string plain = dsx_test::golden_dir() + "/deepseek_v41_tiny";
  if (std::filesystem::exists(plain)) {
    EXPECT_NE(load_error(plain).find("no DSpark stages"), std::string::npos) << load_error(plain);
    std::string why;
    EXPECT_FALSE(dspark_available(plain, &why));
    EXPECT_NE(why.find("no DSpark stages"), std::string::npos) << why;
  }
  std::string why;
  EXPECT_TRUE(dspark_available(dir, &why)) << why;

  // a stage tensor missing
  const std::string gone = "mtp.1.attn.wkv.weight";
  const std::string m = edited_model(dir, "dspark_missing", [&](const std::string& n, std::string&, auto&, size_t&) { return n != gone; });
  const std::string e1 = load_error(m);
  EXPECT_NE(e1.find("'" + gone + "' is missing"), std::string::npos) << e1;
  // a stage tensor renamed: the expected name is missing, the stray one is reported
  const std::string rn = edited_model(dir, "dspark_renamed", [&](const std::string& n, std::string& nn, auto&, size_t&) {
    if (n == "mtp.2.markov_head.head.weight") nn = "mtp.2.markov_head.proj.weight";
    return true;
  });
  const std::string e2 = load_error(rn);
  EXPECT_NE(e2.find("mtp.2.markov_head.head.weight"), std::string::npos) << e2;
  // a stage tensor truncated (one row short)
  const std::string tr = edited_model(dir, "dspark_truncated", [&](const std::string& n, std::string&, std::vector<int64_t>& shape, size_t& bytes) {
    if (n == "mtp.0.main_norm.weight") {
      bytes -= bytes / static_cast<size_t>(shape[0]);
      shape[0] -= 1;
    }
    return true;
  });
  const std::string e3 = load_error(tr);
  EXPECT_NE(e3.find("mtp.0.main_norm.weight"), std::string::npos) << e3;
  EXPECT_NE(e3.find("shape"), std::string::npos) << e3;
  // an extra tensor under a stage
  const std::string ex = edited_model(dir, "dspark_extra", [&](const std::string& n, std::string& nn, auto&, size_t&) {
    if (n == "mtp.0.main_norm.weight") nn = "mtp.1.main_norm.weight";
    return true;
  });
  const std::string e4 = load_error(ex);
  EXPECT_NE(e4.find("mtp.0.main_norm.weight"), std::string::npos) << e4;
  // the stage count of compress_ratios disagrees with the index (4 declared, 3 stored)
  nlohmann::json cfg = nlohmann::json::parse(read_text_file(dir + "/config.json"));
  cfg["text_config"]["compress_ratios"].push_back(0);
  const std::string four = edited_model(dir, "dspark_count", [](const std::string&, std::string&, auto&, size_t&) { return true; }, cfg.dump(2));
  const std::string e5 = load_error(four);
  EXPECT_NE(e5.find("declares 4 DSpark stages"), std::string::npos) << e5;
  EXPECT_NE(e5.find("{0, 1, 2}"), std::string::npos) << e5;
  EXPECT_FALSE(dspark_available(four, &why));
  // a stage with a compress ratio
  cfg["text_config"]["compress_ratios"].erase(cfg["text_config"]["compress_ratios"].size() - 1);
  cfg["text_config"]["compress_ratios"].back() = 2;
  const std::string rat = edited_model(dir, "dspark_ratio", [](const std::string&, std::string&, auto&, size_t&) { return true; }, cfg.dump(2));
  const std::string e6 = load_error(rat);
  EXPECT_NE(e6.find("window-only"), std::string::npos) << e6;
  // the missing noise id
  cfg = nlohmann::json::parse(read_text_file(dir + "/config.json"));
  cfg["text_config"].erase("dspark_noise_token_id");
  const std::string noise = edited_model(dir, "dspark_noise", [](const std::string&, std::string&, auto&, size_t&) { return true; }, cfg.dump(2));
  const std::string e7 = load_error(noise);
  EXPECT_NE(e7.find("dspark_noise_token_id"), std::string::npos) << e7;
}

// The exact CLI form the project's checks use writes the golden's names, shapes and
// dtypes; bad inputs are clear errors with a non-zero exit code.
TEST(DSpark, CliDraftWritesTheGoldensTensors) {
  const std::string dir = tiny_dspark_dir();
  const char* b = std::getenv("DSX_BUILD_DIR");
  if (dir.empty() || !b || !std::filesystem::exists(std::string(b) + "/dsx")) GTEST_SKIP() << "golden case or dsx binary not found";
  const std::string dsx = std::string(b) + "/dsx";
  auto run = [](const std::string& cmd, std::string* out) {
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    std::string s;
    char buf[4096];
    while (size_t k = fread(buf, 1, sizeof buf, p)) s.append(buf, k);
    const int rc = pclose(p);
    if (out) *out = s;
    return WEXITSTATUS(rc);
  };
  const std::string tmp = dsx_test::temp_dir("dspark_cli");
  const std::string golden = dir + "/dspark_golden.safetensors", out = tmp + "/out.safetensors";
  std::string log;
  ASSERT_EQ(run(dsx + " draft -m " + dir + " --golden " + golden + " -o " + out, &log), 0) << log;
  SafetensorsFile g(golden), o(out);
  for (const char* n : {"taps", "dspark.base_logits", "dspark.draft_tokens", "dspark.markov_logits", "dspark.confidence_logits",
                        "dspark.forced_markov_logits", "dspark.forced_confidence_logits"}) {
    const TensorView* w = g.find(n);
    const TensorView* t = o.find(n);
    ASSERT_NE(t, nullptr) << n;
    ASSERT_NE(w, nullptr) << n;
    EXPECT_EQ(t->shape, w->shape) << n;
    EXPECT_EQ(t->dtype, w->dtype) << n;
  }
  // every tensor both files have has the golden's shape and dtype
  for (const auto& [n, t] : o.tensors())
    if (const TensorView* w = g.find(n)) {
      EXPECT_EQ(t.shape, w->shape) << n;
      EXPECT_EQ(t.dtype, w->dtype) << n;
    }
  EXPECT_EQ(run(dsx + " draft --help", &log), 0);
  EXPECT_NE(log.find("--golden"), std::string::npos) << log;
  // no stages
  const std::string plain = dsx_test::golden_dir() + "/deepseek_v41_tiny";
  if (std::filesystem::exists(plain)) {
    EXPECT_NE(run(dsx + " draft -m " + plain + " --golden " + golden + " -o " + tmp + "/x.safetensors", &log), 0);
    EXPECT_NE(log.find("no DSpark stages"), std::string::npos) << log;
  }
  // a golden without the inputs
  EXPECT_NE(run(dsx + " draft -m " + dir + " --golden " + dir + "/model.safetensors -o " + tmp + "/x.safetensors", &log), 0);
  EXPECT_NE(log.find("'input_ids' is missing"), std::string::npos) << log;
  // wrong shapes: forced tokens of another block size
  SafetensorsWriter w;
  for (const char* n : {"input_ids", "anchor_positions", "anchor_tokens"}) {
    const TensorView& t = g.get(n);
    w.add(n, t.dtype, t.shape, t.data, t.nbytes);
  }
  const TensorView& f = g.get("dspark.forced_prev_tokens");
  w.add("dspark.forced_prev_tokens", DType::I32, {f.dim(0) * f.dim(1)}, f.data, f.nbytes);
  w.write(tmp + "/bad.safetensors");
  EXPECT_NE(run(dsx + " draft -m " + dir + " --golden " + tmp + "/bad.safetensors -o " + tmp + "/x.safetensors", &log), 0);
  EXPECT_NE(log.find("dspark.forced_prev_tokens"), std::string::npos) << log;
  EXPECT_NE(run(dsx + " draft -m " + dir + " -o " + tmp + "/x.safetensors", &log), 0);
  EXPECT_NE(log.find("--golden"), std::string::npos) << log;
}
