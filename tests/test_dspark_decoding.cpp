// DSpark speculative decoding (runtime/dspark_decoding.h) on the CPU engine over the
// DSpark tiny golden model (../shared/golden/deepseek_v41_dspark_tiny: random weights,
// so its own drafts are almost never accepted; the draft hook of §13.1 supplies oracle
// drafts, corrupted at chosen rows, to force every accept count j = 0 .. k):
//   - greedy: the ids equal PlainDecoding's for several prompts, >= 512 tokens per
//     setting (on, static K = 1 .. 5, oracle-mixed drafts), stop ids / stop strings /
//     max_tokens / the context capacity landing inside accepted blocks, prefix reuse
//     (ring holes) and a context from another sequence;
//   - the session after generate holds exactly the committed tokens: one more step gives
//     the logits a fresh session fed the same tokens gives (bitwise);
//   - sampling: sampling_distribution is Sampler::sample's distribution; the verifier
//     (speculative_row / speculative_block) emits the target's law (chi-square, >= 2e5
//     draws per setting; one- and two-row blocks; sampled, point-mass, disjoint-support
//     and equal drafts; temperature / top-k / top-p); end to end, the first two sampled
//     tokens after a fixed prompt with DSpark follow the exact law (computed from the
//     engine's logits), as PlainDecoding's do (fewer draws: see EndToEnd*);
//   - negative controls computed in the tests: accept-always and the paper's peeking
//     scheduler (0.85 / 0.15) are rejected by the same statistics;
//   - choose_k: static, threshold, cost rule, non-anticipation (confidences after the
//     first failing row never change k); cost tables given and measured (the scratch
//     session leaves the others' numbers alone); the CLI's --dspark and --dspark-costs.
// Statistical tests use fixed seeds (deterministic); see kMinP for the threshold. The
// laws and the chi-square statistics are in dspark_law.h (shared with the CUDA test).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "model/dspark.h"
#include "runtime/dspark_decoding.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "dspark_law.h"
#include "util/error.h"

using namespace dsx;
using namespace dspark_law;  // (the laws and statistics shared with test_cuda_dspark.cpp)

namespace {

// A correct sampler fails a chi-square test at this p-value with probability 1e-3 per
// test; the seeds are fixed, so a pass is reproducible, and the ~20 goodness-of-fit tests
// here would all pass a correct implementation with probability ~98% had the seeds been
// drawn at random. The negative controls reach p-values below 1e-12 with the same
// number of draws, so the threshold leaves the tests their power. (The bar for
// the measured values is p > 0.01; the test logs every p-value.)
constexpr double kMinP = 1e-3;

std::string tiny_dir() {
  const std::string g = dsx_test::golden_dir();
  if (g.empty()) return "";
  const std::string d = g + "/deepseek_v41_dspark_tiny";
  return std::filesystem::exists(d + "/config.json") ? d : "";
}

struct Fixture {
  std::string dir;
  std::unique_ptr<Engine> eng;
  std::unique_ptr<DSparkDrafter> drafter;
};

Fixture& fx() {
  static Fixture f = [] {
    Fixture x;
    x.dir = tiny_dir();
    if (x.dir.empty()) return x;
    x.eng = load_engine(x.dir, EngineOptions{});
    x.drafter = DSparkDrafter::load(x.dir);
    return x;
  }();
  return f;
}

#define NEED_MODEL()                                                  \
  Fixture& F = fx();                                                  \
  if (!F.eng) GTEST_SKIP() << "golden deepseek_v41_dspark_tiny not found"

std::vector<int32_t> random_prompt(uint32_t seed, int n, int V) {
  std::vector<int32_t> p;
  uint32_t r = seed * 2654435761u + 12345u;
  for (int i = 0; i < n; ++i) {
    r = r * 1664525u + 1013904223u;
    p.push_back(3 + static_cast<int32_t>((r >> 8) % static_cast<uint32_t>(V - 8)));
  }
  return p;
}

// Plain greedy continuation (the reference) of a prompt.
std::vector<int32_t> plain_greedy(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  auto s = e.new_session();
  PlainDecoding plain;
  return generate(*s, prompt, no_stop(n), plain).ids;
}

// Oracle drafts: the reference continuation ref of prompt (position P + i holds ref[i]),
// replaced from row wrong(n) on by another id (so exactly min(k, wrong(n)) drafts of a
// block at anchor position n are accepted), confidences high (the "on" rule verifies
// all of them).
std::function<void(int64_t, DSparkDraft&)> oracle_hook(const std::vector<int32_t>* ref, int64_t P, int V,
                                                       std::function<int(int64_t)> wrong) {
  return [=](int64_t n, DSparkDraft& d) {
    const int w = wrong ? wrong(n) : 1 << 30;
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      const int64_t at = n + 1 + static_cast<int64_t>(i) - P;  // index in ref of the token d_{i+1}
      int32_t t = at >= 0 && at < static_cast<int64_t>(ref->size()) ? (*ref)[static_cast<size_t>(at)] : 5;
      if (static_cast<int>(i) >= w) t = (t + 1 + static_cast<int32_t>(n % 7)) % V;
      d.tokens[i] = t;
      d.confidence_logits[i] = 6.0f;
    }
  };
}

// Logits of one more token after the session's state, and after a fresh session fed the
// same tokens: the session holds exactly those tokens' state.
void expect_state_is_of_tokens(Engine& e, Session& s, const std::vector<int32_t>& want_tokens, const char* what) {
  ASSERT_EQ(s.tokens(), want_tokens) << what;
  ASSERT_EQ(s.position(), static_cast<int64_t>(want_tokens.size())) << what;
  const int64_t V = e.config().vocab_size;
  std::vector<float> a(static_cast<size_t>(V)), b(a.size());
  auto f = e.new_session();
  if (s.position() < s.capacity()) {
    const int32_t x = 7;
    s.feed(&x, 1, a.data(), false);
    f->sync(concat(want_tokens, {x}), b.data());
    EXPECT_EQ(a, b) << what << ": the session's state is not the state of its tokens";
    s.rollback(s.position() - 1);
  } else {
    // at capacity: the state before the last token, and that token's logits
    ASSERT_FALSE(want_tokens.empty()) << what;
    const int32_t x = want_tokens.back();
    s.rollback(s.position() - 1);
    s.feed(&x, 1, a.data(), false);
    f->sync(want_tokens, b.data());
    EXPECT_EQ(a, b) << what << ": the session's state (at capacity) is not the state of its tokens";
  }
}

std::vector<float> random_logits(std::mt19937_64& g, int V, float scale) {
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> l(static_cast<size_t>(V));
  for (float& x : l) x = n(g);
  return l;
}

std::vector<double> dist(const std::vector<float>& l, const SamplerOptions& o) {
  std::vector<double> p(l.size());
  sampling_distribution(l.data(), static_cast<int64_t>(l.size()), o, p.data());
  return p;
}

}  // namespace

// ======================================================================================
// Greedy
// ======================================================================================

// Output ids with DSpark equal plain greedy decoding's: the model's own drafts (rarely
// accepted: random weights) under the default rule, a rule that verifies much, every
// static K, and oracle drafts corrupted at rotating rows (every j from 0 to k occurs).
TEST(DSparkDecoding, GreedyEqualsPlainDecoding) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), B = F.drafter->block_size();
  // prompts of 3 .. 60 tokens: shorter and longer than the window (16), 128 tokens each
  const std::vector<std::vector<int32_t>> prompts = {random_prompt(1, 3, V), random_prompt(2, 17, V),
                                                     random_prompt(3, 40, V), random_prompt(4, 60, V)};
  const int64_t N = 128;
  std::vector<std::vector<int32_t>> refs;
  auto t0 = std::chrono::steady_clock::now();
  for (const auto& p : prompts) refs.push_back(plain_greedy(*F.eng, p, N));
  std::printf("plain greedy: %lld tokens in %.2f s\n", static_cast<long long>(N * prompts.size()), seconds_since(t0));

  struct Setting {
    std::string name;
    DSparkOptions o;
    bool oracle = false;
  };
  std::vector<Setting> settings;
  settings.push_back({"on (default rule)", {}, false});
  {
    DSparkOptions o;
    o.schedule.draft_cost = 0;
    o.schedule.verify_cost = {1, 1, 1, 1, 1, 1};  // verifying is free: every draft the threshold admits
    o.schedule.threshold = 0.05f;
    settings.push_back({"on (free verify, threshold 0.05)", o, false});
  }
  for (int k = 1; k <= B; ++k) {
    DSparkOptions o;
    o.schedule.static_k = k;
    settings.push_back({cat("static ", k), o, false});
  }
  for (int k : {B, 3}) {
    DSparkOptions o;
    o.schedule.static_k = k;
    settings.push_back({cat("static ", k, ", oracle drafts wrong from a rotating row"), o, true});
  }
  settings.push_back({"on, oracle drafts wrong from a rotating row", {}, true});

  for (Setting& st : settings) {
    t0 = std::chrono::steady_clock::now();
    int64_t total = 0;
    DSparkStats sum;
    for (size_t i = 0; i < prompts.size(); ++i) {
      DSparkOptions o = st.o;
      if (st.oracle)
        o.draft_hook = oracle_hook(&refs[i], static_cast<int64_t>(prompts[i].size()), V,
                                   [B](int64_t n) { return static_cast<int>((n * 7 + n / 3) % (B + 2)); });
      DSparkDecoding ds(*F.drafter, o);
      auto s = F.eng->new_session();
      const GenerateResult r = generate(*s, prompts[i], no_stop(N), ds);
      ASSERT_EQ(r.ids, refs[i]) << st.name << ", prompt " << i;
      total += static_cast<int64_t>(r.ids.size());
      const DSparkStats& x = ds.stats();
      sum.cycles += x.cycles, sum.accepted += x.accepted, sum.verified += x.verified, sum.verify_rows += x.verify_rows;
      EXPECT_EQ(x.tokens, N) << st.name;
      EXPECT_EQ(x.cycles, r.steps) << st.name;
      if (st.oracle) EXPECT_GT(x.accepted, 0) << st.name;
      expect_state_is_of_tokens(*F.eng, *s, concat(prompts[i], std::vector<int32_t>(r.ids.begin(), r.ids.end() - 1)),
                                st.name.c_str());
    }
    EXPECT_GE(total, 512);
    std::printf("%-48s %lld tokens equal, %lld cycles, %.3f accepted drafts per cycle, %lld of %lld verified drafts "
                "accepted, %lld verify rows, %.2f s\n",
                st.name.c_str(), static_cast<long long>(total), static_cast<long long>(sum.cycles),
                sum.cycles ? static_cast<double>(sum.accepted) / sum.cycles : 0.0, static_cast<long long>(sum.accepted),
                static_cast<long long>(sum.verified), static_cast<long long>(sum.verify_rows), seconds_since(t0));
  }
}

// Fixed strings per id (id mod 5), so that stop strings fall inside blocks.
class FakeText final : public TokenText {
 public:
  static std::string of(int32_t id) {
    static const char* w[] = {"ab", "b", "ba ", "a", "c"};
    return w[id % 5];
  }
  std::string push(int32_t id) override { return of(id); }
  std::string flush() override { return {}; }
};

// Stop ids, stop strings, max_tokens and the context capacity ending generation inside
// a fully accepted block (oracle drafts, static K = B, so every block is 6 tokens): the
// result is plain decoding's, and the session holds exactly the committed tokens.
TEST(DSparkDecoding, StopsInsideAcceptedBlocks) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), B = F.drafter->block_size();
  const std::vector<int32_t> prompt = random_prompt(9, 20, V);
  const int64_t P = static_cast<int64_t>(prompt.size());
  const std::vector<int32_t> ref = plain_greedy(*F.eng, prompt, 48);
  DSparkOptions o;
  o.schedule.static_k = B;
  o.draft_hook = oracle_hook(&ref, P, V, nullptr);
  auto check = [&](const GenerateOptions& go, Engine& eng, const std::string& what, bool text) {
    auto sp = eng.new_session();
    auto sd = eng.new_session();
    PlainDecoding plain;
    DSparkDecoding ds(*F.drafter, o);
    FakeText t1, t2;
    const GenerateResult a = generate(*sp, prompt, go, plain, text ? &t1 : nullptr);
    const GenerateResult b = generate(*sd, prompt, go, ds, text ? &t2 : nullptr);
    EXPECT_EQ(b.ids, a.ids) << what;
    EXPECT_EQ(b.text, a.text) << what;
    EXPECT_EQ(b.finish, a.finish) << what;
    EXPECT_EQ(b.stop_id, a.stop_id) << what;
    EXPECT_EQ(b.stop_string, a.stop_string) << what;
    EXPECT_EQ(b.generated_tokens, a.generated_tokens) << what;
    // (prompt + ids, or that without its last token: generate.h)
    const std::vector<int32_t> all = concat(prompt, b.ids), have = sd->tokens();
    EXPECT_TRUE(have.size() + 1 >= all.size() && have.size() <= all.size() &&
                std::equal(have.begin(), have.end(), all.begin()))
        << what << ": the session holds " << have.size() << " tokens";
    if (b.steps > 1) EXPECT_GT(ds.stats().accepted, 0) << what;
    expect_state_is_of_tokens(eng, *sd, have, what.c_str());
  };
  // stop ids: the id at each of the first 14 places (its first occurrence stops)
  for (int i = 0; i < 14; ++i) {
    GenerateOptions go = no_stop(40);
    go.stop_ids = {ref[static_cast<size_t>(i)]};
    check(go, *F.eng, cat("stop id ", ref[static_cast<size_t>(i)], " (place ", i, ")"), false);
  }
  // max_tokens 0 .. 14
  for (int n = 0; n <= 14; ++n) check(no_stop(n), *F.eng, cat("max_tokens ", n), false);
  // stop strings made of the pieces of tokens 2 .. 9 (spanning tokens too)
  for (int i = 2; i < 10; ++i) {
    GenerateOptions go = no_stop(40);
    go.stop_strings = {FakeText::of(ref[static_cast<size_t>(i)]) + FakeText::of(ref[static_cast<size_t>(i + 1)])};
    check(go, *F.eng, cat("stop string '", go.stop_strings[0], "'"), true);
  }
  // the context capacity: P + 1 .. P + 13 tokens
  for (int64_t c = 1; c <= 13; ++c) {
    EngineOptions eo;
    eo.max_context = P + c;
    auto e = load_engine(F.dir, eo);
    check(no_stop(40), *e, cat("capacity P + ", c), false);
  }
}

// A second generate on the same session reuses its state (the prompt extends the first
// one's output), with the strategy's own context or a fresh one (its rings then have
// holes where the session kept state without taps), or a context of another sequence:
// still plain decoding's ids; and the holes are really there.
TEST(DSparkDecoding, PrefixReuseAndRingHoles) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), W = F.drafter->config().window;
  const std::vector<int32_t> a = random_prompt(21, 30, V);
  const int64_t N = 40;
  DSparkOptions o;
  o.schedule.static_k = 2;
  auto s = F.eng->new_session();
  DSparkContext ctx(*F.drafter);
  DSparkDecoding ds(*F.drafter, o, &ctx);
  const GenerateResult r1 = generate(*s, a, no_stop(N), ds);
  ASSERT_EQ(r1.ids, plain_greedy(*F.eng, a, N));
  EXPECT_EQ(ctx.tokens(), s->tokens());
  // the next turn: the first output (without its last 3 ids) and new ids
  std::vector<int32_t> b = concat(a, std::vector<int32_t>(r1.ids.begin(), r1.ids.end() - 3));
  b = concat(b, random_prompt(22, 9, V));
  const std::vector<int32_t> ref_b = plain_greedy(*F.eng, b, N);
  const GenerateResult r2 = generate(*s, b, no_stop(N), ds);
  EXPECT_EQ(r2.ids, ref_b);
  EXPECT_GE(r2.reused_tokens, static_cast<int64_t>(a.size()) + N - 4);
  EXPECT_EQ(ctx.tokens(), s->tokens());
  // a fresh context on a session that holds b but its last 4 tokens: holes
  {
    auto s2 = F.eng->new_session();
    s2->sync(b.data(), static_cast<int64_t>(b.size()) - 4);
    DSparkContext fresh(*F.drafter);
    DSparkDecoding ds2(*F.drafter, o, &fresh);
    ds2.start(SamplerOptions{});
    const SyncResult sr = ds2.prefill(*s2, b.data(), static_cast<int64_t>(b.size()) - 1);
    EXPECT_EQ(sr.reused, static_cast<int64_t>(b.size()) - 4);
    EXPECT_EQ(fresh.end(), static_cast<int64_t>(b.size()) - 1);
    EXPECT_EQ(fresh.context_rows(), 3) << "the reused positions have no ring rows (holes)";
    EXPECT_LT(fresh.context_rows(), W);
    const GenerateResult r3 = generate(*s2, b, no_stop(N), ds2);
    EXPECT_EQ(r3.ids, ref_b);
  }
  // a context of another sequence, the session fresh: the shared prefix is empty
  {
    auto s3 = F.eng->new_session();
    DSparkDecoding ds3(*F.drafter, o, &ctx);  // (ctx holds b's run)
    const GenerateResult r4 = generate(*s3, a, no_stop(N), ds3);
    EXPECT_EQ(r4.ids, r1.ids);
    EXPECT_EQ(ctx.tokens(), s3->tokens());
    EXPECT_EQ(ctx.context_rows(), W);
  }
  // a long prompt: only the last W rows get taps; the session's prefix is fed without
  const std::vector<int32_t> lp = random_prompt(23, 100, V);
  {
    auto s4 = F.eng->new_session();
    DSparkContext c4(*F.drafter);
    DSparkDecoding ds4(*F.drafter, o, &c4);
    ds4.start(SamplerOptions{});
    const SyncResult sr = ds4.prefill(*s4, lp.data(), static_cast<int64_t>(lp.size()) - 1);
    EXPECT_EQ(sr.reused, 0);
    EXPECT_EQ(sr.prefilled, static_cast<int64_t>(lp.size()) - 1);
    EXPECT_EQ(c4.context_rows(), W);
    EXPECT_EQ(c4.end(), static_cast<int64_t>(lp.size()) - 1);
    const GenerateResult r5 = generate(*s4, lp, no_stop(24), ds4);
    EXPECT_EQ(r5.ids, plain_greedy(*F.eng, lp, 24));
  }
}

// The server's use of DSparkCycle: several sequences in ONE Engine::step, some verifying
// their blocks (greedy oracle drafts wrong from a rotating row, and the model's own
// drafts), one decoding plain rows beside them (with taps, keeping its rings whole),
// every sequence's ids equal plain greedy decoding's and its session holds exactly its
// committed tokens.
TEST(DSparkDecoding, CyclesOfSeveralSequencesShareOneStep) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), B = F.drafter->block_size();
  const int64_t N = 64;
  const std::vector<std::vector<int32_t>> prompts = {random_prompt(31, 12, V), random_prompt(32, 25, V),
                                                     random_prompt(33, 5, V)};
  std::vector<std::vector<int32_t>> refs;
  for (const auto& p : prompts) refs.push_back(plain_greedy(*F.eng, p, N));
  struct Seq {
    std::unique_ptr<Session> s;
    std::unique_ptr<DSparkContext> ctx;
    std::unique_ptr<DSparkCycle> cy;
    std::vector<int32_t> out;
    int32_t anchor = 0, pick = -1;
    bool plain = false;
    std::vector<float> taps;
  };
  std::vector<Seq> q(prompts.size());
  for (size_t i = 0; i < q.size(); ++i) {
    Seq& x = q[i];
    x.s = F.eng->new_session();
    x.ctx = std::make_unique<DSparkContext>(*F.drafter);
    DSparkOptions o;
    if (i == 0) {
      o.schedule.static_k = B;
      o.draft_hook = oracle_hook(&refs[i], static_cast<int64_t>(prompts[i].size()), V,
                                 [B](int64_t n) { return static_cast<int>((n * 5 + 1) % (B + 2)); });
    }
    x.cy = std::make_unique<DSparkCycle>(*F.drafter, o);
    x.cy->start(SamplerOptions{});
    x.plain = i == 2;
    x.s->sync(prompts[i].data(), static_cast<int64_t>(prompts[i].size()) - 1);
    x.ctx->align(x.s->tokens().data(), x.s->position());
    x.anchor = prompts[i].back();
    x.taps.resize(static_cast<size_t>(F.drafter->tap_width()));
  }
  int64_t steps = 0;
  for (bool left = true; left; ++steps) {
    Step st;
    for (Seq& x : q) {
      if (static_cast<int64_t>(x.out.size()) >= N) continue;
      if (x.plain) {
        st.feeds.push_back(Feed{x.s.get(), &x.anchor, 1, nullptr, x.taps.data(), &x.pick, nullptr});
      } else {
        x.cy->draft(*x.ctx, x.anchor, x.cy->max_drafts(*F.eng, N - static_cast<int64_t>(x.out.size())));
        st.feeds.push_back(x.cy->verify_feed(*x.s));
      }
    }
    F.eng->step(st);
    left = false;
    for (Seq& x : q) {
      if (static_cast<int64_t>(x.out.size()) >= N) continue;
      if (x.plain) {
        x.ctx->observe(&x.anchor, x.taps.data(), 1);
        x.out.push_back(x.pick);
      } else {
        x.cy->accept(*x.s, *x.ctx, x.out);
      }
      x.anchor = x.out.back();
      ASSERT_EQ(x.ctx->end(), x.s->position());
      left = left || static_cast<int64_t>(x.out.size()) < N;
    }
  }
  for (size_t i = 0; i < q.size(); ++i) {
    EXPECT_EQ(q[i].out, refs[i]) << "sequence " << i;
    expect_state_is_of_tokens(*F.eng, *q[i].s,
                              concat(prompts[i], std::vector<int32_t>(refs[i].begin(), refs[i].end() - 1)),
                              cat("sequence ", i).c_str());
  }
  EXPECT_GT(q[0].cy->stats().accepted, 0);
  EXPECT_EQ(q[2].ctx->context_rows(), F.drafter->config().window) << "the plain rows kept the rings whole";
  EXPECT_LT(steps, 2 * N);
}

// The rings a run leaves equal those of observing the committed tokens' taps from scratch
// (the drafter's state never holds a rejected row).
TEST(DSparkDecoding, RingsHoldOnlyCommittedRows) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), B = F.drafter->block_size();
  const std::vector<int32_t> a = random_prompt(31, 12, V);
  const std::vector<int32_t> ref = plain_greedy(*F.eng, a, 30);
  DSparkOptions o;
  o.schedule.static_k = B;
  o.draft_hook = oracle_hook(&ref, static_cast<int64_t>(a.size()), V, [B](int64_t n) { return static_cast<int>(n % (B + 1)); });
  auto s = F.eng->new_session();
  DSparkContext ctx(*F.drafter);
  DSparkDecoding ds(*F.drafter, o, &ctx);
  generate(*s, a, no_stop(30), ds);
  const std::vector<int32_t> toks = s->tokens();
  ASSERT_EQ(ctx.tokens(), toks);
  // from scratch: the taps of every committed token, observed at once
  const int64_t T = static_cast<int64_t>(toks.size()), TW = F.drafter->tap_width();
  std::vector<float> taps(static_cast<size_t>(T * TW));
  auto f = F.eng->new_session();
  Step st;
  st.feeds.push_back(Feed{f.get(), toks.data(), T, nullptr, taps.data(), nullptr, nullptr});
  F.eng->step(st);
  DSparkState want = F.drafter->new_state();
  F.drafter->observe(want, taps.data(), T, 0);
  const int hd = want.head_dim();
  int64_t compared = 0;
  for (int si = 0; si < F.drafter->n_stages(); ++si)
    for (int64_t p = T - want.window(); p < T; ++p) {
      const float* x = dynamic_cast<const DSparkState&>(ctx.state()).row(si, p);
      const float* y = want.row(si, p);
      ASSERT_TRUE(x && y) << "stage " << si << " position " << p;
      // (rows of a 1-row and a T-row forward: the CPU engine's rows are exact)
      for (int i = 0; i < hd; ++i) ASSERT_EQ(x[i], y[i]) << "stage " << si << " position " << p << " value " << i;
      ++compared;
    }
  EXPECT_EQ(compared, F.drafter->n_stages() * want.window());
  EXPECT_GT(ds.stats().accepted, 0);
}

// ======================================================================================
// choose_k
// ======================================================================================

TEST(DSparkDecoding, ChooseKRules) {
  auto logit = [](double c) { return static_cast<float>(std::log(c / (1 - c))); };
  DSparkSchedule s;
  std::vector<float> hi(5, logit(0.95)), lo(5, logit(0.01));
  // static: the confidences do not matter; capped by max_k
  s.static_k = 3;
  EXPECT_EQ(choose_k(s, lo.data(), 5, 5), 3);
  EXPECT_EQ(choose_k(s, hi.data(), 5, 2), 2);
  s.static_k = 0;
  EXPECT_EQ(choose_k(s, hi.data(), 5, 5), 0);
  // cost rule: confident drafts are all verified at the default table, hopeless ones none
  s = DSparkSchedule{};
  EXPECT_EQ(choose_k(s, hi.data(), 5, 5), 5);
  EXPECT_EQ(choose_k(s, lo.data(), 5, 5), 0);
  EXPECT_EQ(choose_k(s, hi.data(), 5, 3), 3);
  EXPECT_EQ(choose_k(s, hi.data(), 5, 0), 0);
  // the expected rate by hand: c = (0.9, 0.5, 0.2, 0.9, 0.9), draft 0.15, C(N) = 1 + 0.06 (N - 1)
  std::vector<float> c = {logit(0.9), logit(0.5), logit(0.2), logit(0.9), logit(0.9)};
  {
    double A = 1, E = 1, best = 1 / 1.15;
    int want = 0;
    for (int i = 1; i <= 5; ++i) {
      A *= dspark_confidence(c[static_cast<size_t>(i - 1)]);
      E += A;
      const double rate = E / (0.15 + 1 + 0.06 * i);
      if (!(rate > best)) break;
      best = rate, want = i;
    }
    EXPECT_EQ(choose_k(s, c.data(), 5, 5), want);
    EXPECT_EQ(want, 2);  // (A_3 = 0.09: worth less than its row)
  }
  // a linear table (rows cost what plain steps cost) and a free draft: verifying never
  // pays; with the draft's cost sunk, one confident draft does
  s.verify_cost = {1, 2, 3, 4, 5, 6};
  s.draft_cost = 0;
  EXPECT_EQ(choose_k(s, hi.data(), 5, 5), 0);
  s.draft_cost = 0.15;
  EXPECT_EQ(choose_k(s, hi.data(), 5, 5), 1);
  // threshold: stops at the first confidence below it
  s = DSparkSchedule{};
  s.threshold = 0.6f;
  EXPECT_EQ(choose_k(s, c.data(), 5, 5), 1);
  // survivals
  std::vector<double> A;
  choose_k(s, c.data(), 5, 5, &A);
  ASSERT_EQ(A.size(), 5u);
  EXPECT_NEAR(A[1], 0.45, 1e-6);
  // cost extrapolation beyond the table
  s.verify_cost = {1.0, 1.1};
  EXPECT_NEAR(s.cost(4), 1.3, 1e-12);
}

// --dspark-costs tables: "D:C1,..,CN", C(1) = 1; anything else refused by name.
TEST(DSparkDecoding, ScheduleCostsParse) {
  DSparkSchedule base;
  base.threshold = 0.25f;
  const DSparkSchedule s = parse_schedule_costs("0.9:1,1.25,1.5", base);
  EXPECT_DOUBLE_EQ(s.draft_cost, 0.9);
  ASSERT_EQ(s.verify_cost.size(), 3u);
  EXPECT_DOUBLE_EQ(s.verify_cost[1], 1.25);
  EXPECT_NEAR(s.cost(5), 2.0, 1e-12);  // (extrapolated with the last step)
  EXPECT_FLOAT_EQ(s.threshold, 0.25f);  // (kept from base)
  EXPECT_EQ(s.describe(), "draft 0.90; verify 1-3 rows: 1.00 1.25 1.50");
  for (const char* bad : {"", "1", "x:1", "1:", "1:2,3", "1:1,-2", "1:1,nan", "1:1,,2", "1:1,2x", "-1:1"}) {
    try {
      parse_schedule_costs(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("DSpark costs"), std::string::npos) << bad << ": " << e.what();
    }
  }
}

// measure_schedule on the CPU engine: a whole table in one-row steps, and the scratch
// session it measures on leaves the engine's other sessions as they were (their next
// logits bit for bit those of an engine that never measured).
TEST(DSparkDecoding, MeasureScheduleOnTheEngine) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size);
  const std::vector<int32_t> prompt = random_prompt(3, 24, V);
  auto logits_after = [&](Engine& e, bool measure) {
    auto s = e.new_session();
    s->sync(prompt.data(), static_cast<int64_t>(prompt.size()));
    if (measure) {
      DSparkSchedule base;
      base.threshold = 0.5f;
      const DSparkSchedule m = measure_schedule(e, *F.drafter, base, 2, 20);
      const size_t rows = static_cast<size_t>(std::min(F.drafter->block_size() + 1, e.options().rollback_depth));
      EXPECT_EQ(m.verify_cost.size(), rows);
      EXPECT_EQ(m.verify_cost[0], 1.0);
      for (double c : m.verify_cost) EXPECT_TRUE(std::isfinite(c) && c > 0) << m.describe();
      EXPECT_TRUE(std::isfinite(m.draft_cost) && m.draft_cost > 0) << m.describe();
      EXPECT_FLOAT_EQ(m.threshold, 0.5f);
      EXPECT_EQ(m.static_k, -1);
    }
    std::vector<float> out(static_cast<size_t>(V));
    const int32_t next = 5;
    s->feed(&next, 1, out.data(), false);
    return out;
  };
  const std::vector<float> a = logits_after(*F.eng, false), b = logits_after(*F.eng, true);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
}

// Non-anticipation (§6.1): k never depends on the confidences of rows after the first one
// that failed (row k, whose draft was not admitted): changing them leaves k alone.
TEST(DSparkDecoding, ChooseKIsNonAnticipating) {
  std::mt19937_64 g(5);
  std::normal_distribution<float> n(0.0f, 2.5f);
  for (int trial = 0; trial < 20000; ++trial) {
    DSparkSchedule s;
    s.threshold = trial % 3 == 0 ? 0.0f : 0.3f;
    if (trial % 2) s.verify_cost = {1.0, 1.02, 1.05, 1.3, 1.35, 1.6};
    std::vector<float> c(5);
    for (float& x : c) x = n(g);
    const int k = choose_k(s, c.data(), 5, 5);
    for (int i = k + 1; i < 5; ++i) c[static_cast<size_t>(i)] = n(g);
    ASSERT_EQ(choose_k(s, c.data(), 5, 5), k) << trial;
    // and k stays a prefix decision under a smaller max_k
    for (int m = 0; m <= 5; ++m) ASSERT_EQ(choose_k(s, c.data(), 5, m), std::min(k, m)) << trial;
  }
}

// ======================================================================================
// Sampling: the pure functions
// ======================================================================================

// sampling_distribution is the distribution Sampler::sample draws from (chi-square on
// 2e5 draws per setting), and 1 where Sampler::sample is greedy.
TEST(DSparkDecoding, SamplingDistributionIsTheSamplers) {
  std::mt19937_64 g(17);
  const std::vector<SamplerOptions> settings = {sopts(1.0f), sopts(0.7f, 4), sopts(1.3f, 0, 0.8f),
                                                sopts(0.9f, 6, 0.85f), sopts(2.0f, 12, 0.95f)};
  const int V = 40;
  for (const SamplerOptions& base : settings) {
    const std::vector<float> l = random_logits(g, V, 1.5f);
    const std::vector<double> p = dist(l, base);
    double sum = 0;
    for (double x : p) sum += x;
    EXPECT_NEAR(sum, 1.0, 1e-12);
    SamplerOptions o = base;
    o.seed = 99;
    Sampler smp(o);
    std::vector<int64_t> counts(static_cast<size_t>(V));
    for (int i = 0; i < 200000; ++i) ++counts[static_cast<size_t>(smp.sample(l.data(), V))];
    const Chi2 c = chi2(counts, p);
    std::printf("Sampler::sample vs sampling_distribution, %s: chi2 %.1f, dof %d, p %.3f\n", describe(base).c_str(),
                c.stat, c.dof, c.p);
    EXPECT_GT(c.p, kMinP) << describe(base);
  }
  // greedy / degenerate rows: one-hot on argmax
  std::vector<float> l = {0.5f, 2.0f, 2.0f, -1.0f};
  std::vector<double> p(4);
  sampling_distribution(l.data(), 4, sopts(1e-31f), p.data());
  EXPECT_EQ(p, (std::vector<double>{0, 1, 0, 0}));
  sampling_distribution(l.data(), 4, sopts(1.0f, 1), p.data());
  EXPECT_EQ(p, (std::vector<double>{0, 1, 0, 0}));  // (ties: the smaller id first, as Sampler)
  EXPECT_THROW(sampling_distribution(l.data(), 4, sopts(NAN), p.data()), Error);
  EXPECT_THROW(sampling_distribution(l.data(), 4, sopts(1.0f, 0, 0.0f), p.data()), Error);
}

namespace {

// One row of speculative sampling, 2e5 times: d ~ q (or the point mass), then
// speculative_row; the emitted tokens' counts. accept_always: the biased rule (the
// draft is always emitted), for the negative control.
std::vector<int64_t> run_rows(const std::vector<double>& p, const std::vector<double>* q, int32_t point, int draws,
                              uint64_t seed, bool accept_always = false, double* acc_rate = nullptr) {
  const int64_t V = static_cast<int64_t>(p.size());
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  std::vector<int64_t> counts(static_cast<size_t>(V));
  int64_t acc = 0;
  for (int i = 0; i < draws; ++i) {
    const int32_t d = q ? sample_from(q->data(), V, U(g)) : point;
    const double ua = U(g), ud = U(g);
    int32_t t = -1;
    if (accept_always || speculative_row(p.data(), q ? q->data() : nullptr, d, V, ua, ud, &t)) t = d, ++acc;
    ++counts[static_cast<size_t>(t)];
  }
  if (acc_rate) *acc_rate = static_cast<double>(acc) / draws;
  return counts;
}

}  // namespace

// One verify row emits the target's distribution p, whatever q: q the same transform of
// other logits (sampled drafts: logits near the target's, or independent of them), a
// point mass (greedy drafts: argmax of the near logits), q with zeros where p > 0
// and p with zeros where q > 0 (other top-k sets), q = p; for several temperature /
// top-k / top-p settings; 2e5 draws each. Negative control: emitting the draft always
// (accept-always) is rejected by the same test.
TEST(DSparkDecoding, VerifierRowEmitsTargetDistribution) {
  std::mt19937_64 g(23);
  const int V = 24, draws = std::getenv("DSX_DRAWS") ? std::atoi(std::getenv("DSX_DRAWS")) : 200000;
  const std::vector<SamplerOptions> settings = {sopts(1.0f), sopts(0.7f, 5), sopts(1.3f, 0, 0.8f), sopts(0.9f, 8, 0.9f)};
  int idx = 0;
  for (const SamplerOptions& o : settings) {
    const std::vector<float> lp = random_logits(g, V, 1.2f), lo = random_logits(g, V, 1.2f);
    std::vector<float> lq = lp;  // a drafter close to the target
    for (float& x : lq) x += std::normal_distribution<float>(0.0f, 0.7f)(g);
    const std::vector<double> p = dist(lp, o), q = dist(lq, o), qo = dist(lo, o);
    SamplerOptions narrow = o;
    narrow.top_k = 3;  // q's support: 3 ids (zeros where p > 0)
    const std::vector<double> qn = dist(lq, narrow);
    const int32_t point = argmax(lq.data(), V);
    struct Case {
      const char* name;
      const std::vector<double>* q;
    };
    for (const Case& c : {Case{"sampled q near p", &q}, Case{"sampled q independent of p", &qo},
                          Case{"point mass", nullptr}, Case{"q of 3 ids", &qn}, Case{"q = p", &p}}) {
      double acc = 0;
      const std::vector<int64_t> counts = run_rows(p, c.q, point, draws, 1000 + idx++, false, &acc);
      const Chi2 r = chi2(counts, p);
      std::printf("verify row, %s, %s: acceptance %.3f, chi2 %.1f, dof %d, p %.3f\n", describe(o).c_str(), c.name, acc,
                  r.stat, r.dof, r.p);
      EXPECT_GT(r.p, kMinP) << describe(o) << ", " << c.name;
      if (c.q == &p) EXPECT_EQ(acc, 1.0);
    }
    // negative control: accept always (emits q's law; q near p)
    const Chi2 bad = chi2(run_rows(p, &q, point, draws, 77, true), p);
    std::printf("verify row, %s, accept-always (negative control): chi2 %.1f, dof %d, p %.3g\n", describe(o).c_str(),
                bad.stat, bad.dof, bad.p);
    EXPECT_LT(bad.p, 1e-12) << describe(o);
  }
}

// Two-token law through whole blocks (speculative_block, k = 2, then blocks from the new
// prefix until two tokens are out), with a target and a drafter whose second-position
// distributions depend on the first token: the joint law of the first two tokens is the
// target's (chi-square over V^2 cells, 2e5 sequences per setting), with sampled and
// point-mass drafts. Negative controls: the paper's peeking scheduler (verify d_1 only
// when it is id 0: target (0.7, 0.3), draft (0.5, 0.5) gives (0.85, 0.15)) and
// accept-always, both rejected.
TEST(DSparkDecoding, VerifierBlockEmitsTargetJointLaw) {
  std::mt19937_64 g(29);
  const int V = 6, draws = 200000;
  for (const SamplerOptions& o : {sopts(1.0f), sopts(0.8f, 4), sopts(1.2f, 0, 0.85f)}) {
    // target p0, p1[x1], p2[x1][x2]; drafter q0, q1[x1]
    const std::vector<double> p0 = dist(random_logits(g, V, 1.3f), o), q0 = dist(random_logits(g, V, 1.3f), o);
    std::vector<std::vector<double>> p1(V), q1(V);
    std::vector<std::vector<std::vector<double>>> p2(V, std::vector<std::vector<double>>(V));
    for (int a = 0; a < V; ++a) {
      p1[a] = dist(random_logits(g, V, 1.3f), o);
      q1[a] = dist(random_logits(g, V, 1.3f), o);
      for (int b = 0; b < V; ++b) p2[a][b] = dist(random_logits(g, V, 1.3f), o);
    }
    std::vector<double> law(static_cast<size_t>(V * V));
    for (int a = 0; a < V; ++a)
      for (int b = 0; b < V; ++b) law[static_cast<size_t>(a * V + b)] = p0[a] * p1[a][b];
    for (int mode = 0; mode < 3; ++mode) {  // 0: sampled drafts, 1: point-mass drafts (argmax of q), 2: accept-always
      std::mt19937_64 r(500 + mode);
      std::uniform_real_distribution<double> U(0.0, 1.0);
      std::vector<int64_t> counts(law.size());
      for (int it = 0; it < draws; ++it) {
        std::vector<int32_t> out;
        while (out.size() < 2) {
          if (out.empty()) {  // a block of k = 2 at the start
            int32_t d1, d2;
            if (mode == 1) {
              d1 = static_cast<int32_t>(std::max_element(q0.begin(), q0.end()) - q0.begin());
              d2 = static_cast<int32_t>(std::max_element(q1[d1].begin(), q1[d1].end()) - q1[d1].begin());
            } else {
              d1 = sample_from(q0.data(), V, U(r));
              d2 = sample_from(q1[d1].data(), V, U(r));
            }
            if (mode == 2) {
              out = {d1, d2};
              break;
            }
            std::vector<double> P, Q;
            for (const std::vector<double>* row : std::initializer_list<const std::vector<double>*>{&p0, &p1[d1], &p2[d1][d2]}) P.insert(P.end(), row->begin(), row->end());
            for (const std::vector<double>* row : std::initializer_list<const std::vector<double>*>{&q0, &q1[d1]}) Q.insert(Q.end(), row->begin(), row->end());
            const int32_t dd[2] = {d1, d2};
            const double u[3] = {U(r), U(r), U(r)};
            out = speculative_block(P.data(), mode == 1 ? nullptr : Q.data(), dd, 2, V, u).tokens;
          } else {  // one token out: a block of k = 1 from it
            const int32_t a = out[0];
            const int32_t d = mode == 1 ? static_cast<int32_t>(std::max_element(q1[a].begin(), q1[a].end()) - q1[a].begin())
                                        : sample_from(q1[a].data(), V, U(r));
            std::vector<double> P = p1[a];
            P.insert(P.end(), p2[a][d].begin(), p2[a][d].end());
            const double u[2] = {U(r), U(r)};
            const SpeculativeResult sr = speculative_block(P.data(), mode == 1 ? nullptr : q1[a].data(), &d, 1, V, u);
            out.push_back(sr.tokens[0]);
          }
        }
        ++counts[static_cast<size_t>(out[0] * V + out[1])];
      }
      const Chi2 c = chi2(counts, law);
      const char* name = mode == 0 ? "sampled drafts" : mode == 1 ? "point-mass drafts" : "accept-always (negative control)";
      std::printf("verify blocks, joint law of 2 tokens, %s, %s: chi2 %.1f, dof %d, p %.3g\n", describe(o).c_str(), name,
                  c.stat, c.dof, c.p);
      if (mode < 2) EXPECT_GT(c.p, kMinP) << describe(o) << ", " << name;
      else EXPECT_LT(c.p, 1e-12) << describe(o);
    }
  }
  // the paper's counterexample: target (0.7, 0.3), draft (0.5, 0.5)
  const std::vector<double> p = {0.7, 0.3}, q = {0.5, 0.5};
  std::mt19937_64 r(3);
  std::uniform_real_distribution<double> U(0.0, 1.0);
  std::vector<int64_t> honest(2), peek(2);
  for (int it = 0; it < draws; ++it) {
    const int32_t d = sample_from(q.data(), 2, U(r));
    const double u[2] = {U(r), U(r)};
    const std::vector<double> P = {0.7, 0.3, 0.7, 0.3};  // (row 1: whatever follows, unused for the first token)
    ++honest[static_cast<size_t>(speculative_block(P.data(), q.data(), &d, 1, 2, u).tokens[0])];
    const int k = d == 0 ? 1 : 0;  // peeks at the draft itself
    ++peek[static_cast<size_t>(speculative_block(P.data(), q.data(), &d, k, 2, u).tokens[0])];
  }
  const Chi2 h = chi2(honest, p), b = chi2(peek, p);
  const double f = static_cast<double>(peek[0]) / draws;
  std::printf("counterexample: honest p %.3f; peeking scheduler emits id 0 with frequency %.4f (0.85 expected), p %.3g\n",
              h.p, f, b.p);
  EXPECT_GT(h.p, kMinP);
  EXPECT_NEAR(f, 0.85, 0.005);
  EXPECT_LT(b.p, 1e-12);
}

// ======================================================================================
// Sampling end to end
// ======================================================================================

// The first two sampled tokens after a fixed prompt follow the exact law of plain
// sampling with DSpark (the model's sampled drafts; point-mass drafts from an oracle
// that drafts the likeliest continuation, so that blocks are often accepted), as they do
// with PlainDecoding. 3000 draws per setting and strategy (each a generate() call: a
// prefill back to the prompt and one or two cycles, ~6 ms on the CI machine); the 2e5
// draws of the verifier itself are the tests above.
TEST(DSparkDecoding, EndToEndSamplingMatchesPlain) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size), B = F.drafter->block_size();
  const std::vector<int32_t> prompt = random_prompt(41, 12, V);
  const int draws = 3000;
  for (const SamplerOptions& o : {sopts(1.0f, 6), sopts(0.8f, 10, 0.9f)}) {
    const TwoTokenLaw L = two_token_law(*F.eng, prompt, o);
    std::vector<double> probs;
    auto t0 = std::chrono::steady_clock::now();
    PlainDecoding plain;
    const Chi2 cp = chi2(sample_two(*F.eng, prompt, o, plain, L, draws, 0, probs), probs);
    std::printf("end to end, %s, %zu cells: plain chi2 %.1f, dof %d, p %.3f (%.1f s)\n", describe(o).c_str(),
                L.cells.size(), cp.stat, cp.dof, cp.p, seconds_since(t0));
    EXPECT_GT(cp.p, kMinP) << describe(o) << " plain";
    for (int mode = 0; mode < 2; ++mode) {
      DSparkOptions d;
      d.schedule.static_k = mode == 0 ? 2 : B;
      if (mode == 1) {  // the likeliest continuation of the law's tables, point-mass q
        const int64_t P = static_cast<int64_t>(prompt.size());
        d.draft_hook = [&L, P](int64_t n, DSparkDraft& dr) {
          auto best = [](const std::vector<double>& p) {
            return static_cast<int32_t>(std::max_element(p.begin(), p.end()) - p.begin());
          };
          if (n == P - 1) {
            dr.tokens[0] = best(L.p1);
            dr.tokens[1] = best(L.p2.at(dr.tokens[0]));
          } else if (n == P && L.p2.count(dr.prev[0])) {
            dr.tokens[0] = best(L.p2.at(dr.prev[0]));
          }
        };
      }
      DSparkDecoding ds(*F.drafter, d);
      t0 = std::chrono::steady_clock::now();
      const Chi2 c = chi2(sample_two(*F.eng, prompt, o, ds, L, draws, 1000000, probs), probs);
      const DSparkStats& x = ds.stats();
      std::printf("end to end, %s, DSpark %s: chi2 %.1f, dof %d, p %.3f; %.3f accepted drafts per cycle (%.1f s)\n",
                  describe(o).c_str(), mode == 0 ? "sampled drafts, static 2" : "oracle point-mass drafts, static 5",
                  c.stat, c.dof, c.p, x.accepted_per_cycle(), seconds_since(t0));
      EXPECT_GT(c.p, kMinP) << describe(o) << " dspark mode " << mode;
      // (the random drafter's sampled drafts rarely fall in the target's top-k: only the
      // oracle's blocks must be accepted, so that the acceptance path is exercised)
      if (mode == 1) EXPECT_GT(x.accepted, 0) << describe(o) << " mode " << mode;
    }
  }
}

// Seeded DSpark sampling is reproducible (the consumption order is fixed), and differs
// across seeds.
TEST(DSparkDecoding, SeededSamplingIsReproducible) {
  NEED_MODEL();
  const int V = static_cast<int>(F.eng->config().vocab_size);
  const std::vector<int32_t> prompt = random_prompt(51, 10, V);
  GenerateOptions go = no_stop(40);
  go.sampling = sopts(1.0f, 20, 0.95f);
  go.sampling.seed = 5;
  DSparkDecoding a(*F.drafter), b(*F.drafter);
  auto s1 = F.eng->new_session(), s2 = F.eng->new_session();
  const GenerateResult r1 = generate(*s1, prompt, go, a), r2 = generate(*s2, prompt, go, b);
  EXPECT_EQ(r1.ids, r2.ids);
  go.sampling.seed = 6;
  const GenerateResult r3 = generate(*s2, prompt, go, b);
  EXPECT_NE(r1.ids, r3.ids);
  expect_state_is_of_tokens(*F.eng, *s2, concat(prompt, std::vector<int32_t>(r3.ids.begin(), r3.ids.end() - 1)), "sampled");
}

// ======================================================================================
// CLI
// ======================================================================================

TEST(DSparkDecoding, CliDSparkOption) {
  NEED_MODEL();
  const char* b = std::getenv("DSX_BUILD_DIR");
  if (!b || !std::filesystem::exists(std::string(b) + "/dsx")) GTEST_SKIP() << "dsx binary not found";
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
  const std::string ids = F.dir + "/dspark_golden.safetensors";
  std::string off, log;
  ASSERT_EQ(run(dsx + " generate -m " + F.dir + " --ids " + ids + " -n 40 --dspark off", &off), 0) << off;
  for (const std::string m : {"on", "static 3", "static=1"}) {
    ASSERT_EQ(run(dsx + " generate -m " + F.dir + " --ids " + ids + " -n 40 --stats --dspark " + m, &log), 0) << log;
    EXPECT_NE(log.find(off), std::string::npos) << m << ": " << log;
    EXPECT_NE(log.find("accepted drafts per cycle"), std::string::npos) << m << ": " << log;
  }
  ASSERT_EQ(run(dsx + " generate -m " + F.dir + " --ids " + ids + " -n 40 --stats", &log), 0) << log;  // default: on
  EXPECT_NE(log.find("accepted drafts per cycle"), std::string::npos) << log;
  EXPECT_NE(run(dsx + " generate -m " + F.dir + " --ids " + ids + " --dspark sometimes", &log), 0);
  EXPECT_NE(log.find("--dspark must be"), std::string::npos) << log;
  EXPECT_NE(run(dsx + " generate -m " + F.dir + " --ids " + ids + " --dspark static 9", &log), 0);
  // the cost table: given (the same greedy output), measured, refused when malformed
  for (const std::string c : {"--dspark-costs 0.5:1,1.1,1.2", "--dspark-costs=measure", "--dspark-costs default"}) {
    ASSERT_EQ(run(dsx + " generate -m " + F.dir + " --ids " + ids + " -n 40 --stats " + c, &log), 0) << log;
    EXPECT_NE(log.find(off), std::string::npos) << c << ": " << log;
    EXPECT_NE(log.find("DSpark costs "), std::string::npos) << c << ": " << log;
  }
  EXPECT_NE(log.find("DSpark costs built-in: draft 0.15"), std::string::npos) << log;
  ASSERT_EQ(run(dsx + " generate -m " + F.dir + " --ids " + ids + " -n 4 --stats --dspark-costs measure", &log), 0);
  EXPECT_NE(log.find("DSpark costs measured on cpu: draft "), std::string::npos) << log;
  EXPECT_NE(run(dsx + " generate -m " + F.dir + " --ids " + ids + " --dspark-costs 1:2,3", &log), 0);
  EXPECT_NE(log.find("C(1) = 1"), std::string::npos) << log;
  EXPECT_EQ(run(dsx + " generate --help", &log), 0);
  EXPECT_NE(log.find("--dspark off|on|static K"), std::string::npos) << log;
  EXPECT_EQ(run(dsx + " run --help", &log), 0);
  EXPECT_NE(log.find("--dspark off|on|static K"), std::string::npos) << log;
  // a model without stages: plain decoding, silently by default, said once when asked for
  const std::string plain = dsx_test::golden_dir() + "/deepseek_v41_tiny";
  if (std::filesystem::exists(plain + "/config.json")) {
    ASSERT_EQ(run(dsx + " generate -m " + plain + " --ids " + ids + " -n 4", &log), 0) << log;
    EXPECT_EQ(log.find("DSpark"), std::string::npos) << log;
    ASSERT_EQ(run(dsx + " generate -m " + plain + " --ids " + ids + " -n 4 --dspark on", &log), 0) << log;
    const size_t at = log.find("model has no DSpark stages: plain decoding");
    EXPECT_NE(at, std::string::npos) << log;
    EXPECT_EQ(log.find("model has no DSpark stages", at + 1), std::string::npos) << log;
    ASSERT_EQ(run(dsx + " generate -m " + plain + " --ids " + ids + " -n 4 --dspark off", &log), 0) << log;
    EXPECT_EQ(log.find("DSpark"), std::string::npos) << log;
  }
}
