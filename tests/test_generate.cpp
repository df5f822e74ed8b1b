// The generation loop (runtime/generate.h) on the CPU engine over a tiny random V4.1
// model: greedy generate equals a hand-written feed_greedy loop; max_tokens, stop ids,
// stop strings (spanning tokens, held back, never streamed), the context capacity and
// cancellation from another thread end it with the right finish reason; seeded sampling
// is reproducible; a strategy committing two tokens per call gives the plain ids; a
// second generate on an extended prompt reuses the session's state.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "model/make_tiny.h"
#include "model/v41_cpu.h"
#include "runtime/cpu_engine.h"
#include "runtime/generate.h"
#include "text/bpe.h"
#include "text/chat.h"
#include "text/token_text.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "test_util.h"
#include "util/error.h"

using namespace dsx;

namespace {

constexpr int kVocab = 512;

struct Model {
  std::string dir;
  std::vector<int32_t> prompt;
};

const Model& model() {
  static Model m = [] {
    Model x;
    x.dir = dsx_test::temp_dir("generate_model");
    TinySpec s;
    s.vocab = kVocab;
    s.engram_compressed_vocab = kVocab;
    s.seed = 11;
    write_tiny_model(x.dir, s, "");
    uint32_t r = 4242;
    for (int i = 0; i < 40; ++i) {
      r = r * 1664525u + 1013904223u;
      x.prompt.push_back(3 + static_cast<int32_t>((r >> 8) % (kVocab - 3)));
    }
    return x;
  }();
  return m;
}

// An engine over the tiny model with an identity Engram map; eos_id overridable.
std::unique_ptr<Engine> engine(EngineOptions o = {}, int32_t eos = -1) {
  ModelConfig cfg = load_model_config(model().dir);
  if (eos >= 0) cfg.eos_id = eos;
  std::vector<int32_t> cmap(kVocab);
  for (int i = 0; i < kVocab; ++i) cmap[i] = i;
  return make_cpu_engine(
      std::make_unique<V41Cpu>(cfg, bind_weights(cfg, std::make_shared<ModelFiles>(model().dir)), cmap), o);
}

// The reference: feed_greedy of the prompt, then of each picked id.
std::vector<int32_t> greedy_loop(Engine& e, const std::vector<int32_t>& prompt, int64_t n) {
  auto s = e.new_session();
  std::vector<int32_t> out;
  int32_t next = s->feed_greedy(prompt.data(), static_cast<int64_t>(prompt.size()));
  for (int64_t i = 0; i < n; ++i) {
    out.push_back(next);
    if (i + 1 < n) next = s->feed_greedy(&next, 1);
  }
  return out;
}

const std::vector<int32_t>& greedy_ref() {
  static const std::vector<int32_t> g = [] {
    auto e = engine();
    return greedy_loop(*e, model().prompt, 32);
  }();
  return g;
}

GenerateOptions no_stop(int64_t max_tokens) {
  GenerateOptions o;
  o.max_tokens = max_tokens;
  o.stop_ids.clear();
  return o;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The session holds prompt + ids, or that without its last token (generate.h).
void expect_state(const Session& s, const std::vector<int32_t>& prompt, const std::vector<int32_t>& ids) {
  const std::vector<int32_t> all = concat(prompt, ids);
  const std::vector<int32_t>& t = s.tokens();
  EXPECT_TRUE(t.size() == all.size() || t.size() + 1 == all.size()) << t.size() << " vs " << all.size();
  EXPECT_TRUE(std::equal(t.begin(), t.end(), all.begin()));
  EXPECT_EQ(s.position(), static_cast<int64_t>(t.size()));
}

// Fixed strings per id (id mod 6): an alphabet of a, b and space, one empty piece, so
// that stop strings partially match often.
class FakeText final : public TokenText {
 public:
  static std::string of(int32_t id) {
    static const char* w[] = {"ab", "b", "ba ", "a", "", "bab"};
    return w[id % 6];
  }
  std::string push(int32_t id) override { return of(id); }
  std::string flush() override { return {}; }
};

// Records the callback's calls.
struct Stream {
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
  std::string all() const {
    std::string s;
    for (const auto& t : texts) s += t;
    return s;
  }
  std::vector<int32_t> all_ids() const {
    std::vector<int32_t> v;
    for (const auto& i : ids) v.insert(v.end(), i.begin(), i.end());
    return v;
  }
  GenerateCallback fn() {
    return [this](std::string_view t, const std::vector<int32_t>& i) {
      EXPECT_TRUE(!t.empty() || !i.empty());
      texts.emplace_back(t);
      ids.push_back(i);
    };
  }
};

// Commits two tokens per call by calling the plain strategy twice (the multi-token contract).
class TwoPerCall final : public DecodingStrategy {
 public:
  void start(const SamplerOptions& o) override { plain_.start(o); }
  void next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) override {
    plain_.next(s, anchor, 1, out);
    if (limit >= 2) plain_.next(s, out.back(), 1, out);
  }

 private:
  PlainDecoding plain_;
};

// The first index k >= from whose id does not occur before it in g (-1: none).
int first_new(const std::vector<int32_t>& g, int from) {
  for (int k = from; k < static_cast<int>(g.size()); ++k)
    if (std::find(g.begin(), g.begin() + k, g[k]) == g.begin() + k) return k;
  return -1;
}

}  // namespace

TEST(Generate, GreedyEqualsFeedGreedyLoop) {
  const auto& g = greedy_ref();
  auto e = engine();
  auto s = e->new_session();
  const auto& p = model().prompt;
  const GenerateResult r = generate(*s, p, no_stop(32));
  EXPECT_EQ(r.ids, g);
  EXPECT_EQ(r.finish, FinishReason::Length);
  EXPECT_EQ(r.prompt_tokens, static_cast<int64_t>(p.size()));
  EXPECT_EQ(r.reused_tokens, 0);
  EXPECT_EQ(r.prefilled_tokens, static_cast<int64_t>(p.size()));
  EXPECT_EQ(r.generated_tokens, 32);
  EXPECT_EQ(r.steps, 32);
  EXPECT_TRUE(r.text.empty());
  EXPECT_GT(r.prefill_seconds, 0.0);
  EXPECT_GT(r.decode_seconds, 0.0);
  expect_state(*s, p, r.ids);
  EXPECT_EQ(s->position(), static_cast<int64_t>(p.size() + 31));  // the last id is the anchor, not fed
  // the tiny model does not just repeat one id (the other tests need some variety)
  EXPECT_GE(first_new(g, 3), 3);
}

TEST(Generate, MaxTokensGivesLength) {
  const auto& g = greedy_ref();
  auto e = engine();
  for (int64_t n : {0, 1, 5}) {
    auto s = e->new_session();
    const GenerateResult r = generate(*s, model().prompt, no_stop(n));
    EXPECT_EQ(r.finish, FinishReason::Length) << n;
    EXPECT_EQ(static_cast<int64_t>(r.ids.size()), n);
    EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + n));
    EXPECT_EQ(r.steps, n);
    expect_state(*s, model().prompt, r.ids);
  }
}

TEST(Generate, StopIdStopsBeforeIt) {
  const auto& g = greedy_ref();
  const int k = first_new(g, 3);
  ASSERT_GE(k, 3);
  auto e = engine();
  auto s = e->new_session();
  GenerateOptions o = no_stop(32);
  o.stop_ids = {kVocab - 1, g[static_cast<size_t>(k)]};
  Stream st;
  FakeText ft;
  const GenerateResult r = generate(*s, model().prompt, o, &ft, st.fn());
  EXPECT_EQ(r.finish, FinishReason::Stop);
  EXPECT_EQ(r.stop_id, g[static_cast<size_t>(k)]);
  EXPECT_TRUE(r.stop_string.empty());
  EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + k));
  EXPECT_EQ(r.generated_tokens, k + 1);
  EXPECT_EQ(st.all_ids(), r.ids);
  std::string want;
  for (int i = 0; i < k; ++i) want += FakeText::of(g[static_cast<size_t>(i)]);
  EXPECT_EQ(r.text, want);  // (the stop id's text is not there)
  EXPECT_EQ(st.all(), want);
  EXPECT_EQ(s->tokens(), concat(model().prompt, r.ids));  // every id fed, the stop id not

  // the default stop list is the model's eos_id
  auto e2 = engine({}, g[static_cast<size_t>(k)]);
  auto s2 = e2->new_session();
  GenerateOptions d;
  d.max_tokens = 32;
  const GenerateResult r2 = generate(*s2, model().prompt, d);
  EXPECT_EQ(r2.finish, FinishReason::Stop);
  EXPECT_EQ(r2.ids, r.ids);
}

// A stop string whose first occurrence spans three tokens: the text stops before it,
// the ids end with the token that completed it, and the streamed text never held any
// of it (what was streamed is exactly the final text), for one and two tokens per call.
TEST(Generate, StopStringSpanningTokensIsHeldBackAndNotEmitted) {
  const auto& g = greedy_ref();
  std::string full;
  std::vector<size_t> end;  // end offset of each token's text
  for (int32_t id : g) end.push_back((full += FakeText::of(id)).size());
  auto token_at = [&](size_t off) {  // the token whose text holds byte off
    return static_cast<size_t>(std::upper_bound(end.begin(), end.end(), off) - end.begin());
  };
  int cases = 0, with_suffixes = 0;
  for (size_t len : {4, 5, 7}) {
    // the first position whose substring occurs there first and spans >= 3 tokens
    size_t at = std::string::npos;
    for (size_t p = 0; p + len <= full.size() && at == std::string::npos; ++p)
      if (full.find(full.substr(p, len)) == p && token_at(p + len - 1) >= token_at(p) + 2) at = p;
    if (at == std::string::npos) continue;
    const std::string stop = full.substr(at, len);
    const size_t last = token_at(at + len - 1);
    // its suffix completes at the same token but starts later: the earlier start wins
    // even when listed first (when the suffix does not occur before)
    const std::string suffix = stop.substr(1);
    const bool with_suffix = full.find(suffix) == at + 1;
    with_suffixes += with_suffix;
    for (int per_call : {1, 2}) {
      SCOPED_TRACE("stop '" + stop + "', tokens per call " + std::to_string(per_call));
      auto e = engine();
      auto s = e->new_session();
      GenerateOptions o = no_stop(32);
      o.stop_strings = {"zz", stop};
      if (with_suffix) o.stop_strings.push_back(suffix);
      Stream st;
      FakeText ft;
      PlainDecoding plain;
      TwoPerCall two;
      DecodingStrategy& strat = per_call == 1 ? static_cast<DecodingStrategy&>(plain) : two;
      const GenerateResult r = generate(*s, model().prompt, o, strat, &ft, st.fn());
      EXPECT_EQ(r.finish, FinishReason::Stop);
      EXPECT_EQ(r.stop_string, stop);
      EXPECT_EQ(r.text, full.substr(0, at));
      EXPECT_EQ(st.all(), r.text);
      EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + static_cast<std::ptrdiff_t>(last) + 1));
      EXPECT_EQ(st.all_ids(), r.ids);
      expect_state(*s, model().prompt, r.ids);
      ++cases;
    }
  }
  EXPECT_GE(cases, 2);
  EXPECT_GE(with_suffixes, 1);
}

// Text that could start a stop string is held back while undecided and released when
// generation ends without the stop string completing; other text streams per token.
TEST(Generate, PartialStopMatchIsReleasedAtTheEnd) {
  const auto& g = greedy_ref();
  std::string full;
  for (int32_t id : g) full += FakeText::of(id);
  ASSERT_GE(full.size(), 2u);
  auto e = engine();
  {
    auto s = e->new_session();
    Stream st;
    FakeText ft;
    const GenerateResult r = generate(*s, model().prompt, no_stop(32), &ft, st.fn());
    EXPECT_EQ(r.text, full);
    ASSERT_EQ(st.texts.size(), 32u);  // one call per token, each with its text
    for (size_t i = 0; i < 32; ++i) {
      EXPECT_EQ(st.ids[i], std::vector<int32_t>{g[i]});
      EXPECT_EQ(st.texts[i], FakeText::of(g[i]));
    }
  }
  auto s = e->new_session();
  GenerateOptions o = no_stop(32);
  o.stop_strings = {full.substr(full.size() - 2) + "Z"};  // its first two bytes end the text
  Stream st;
  FakeText ft;
  const GenerateResult r = generate(*s, model().prompt, o, &ft, st.fn());
  EXPECT_EQ(r.finish, FinishReason::Length);
  EXPECT_TRUE(r.stop_string.empty());
  EXPECT_EQ(r.text, full);
  EXPECT_EQ(st.all(), full);
  ASSERT_FALSE(st.texts.empty());
  EXPECT_TRUE(st.ids.back().empty());  // the release at the end ...
  EXPECT_EQ(st.texts.back(), full.substr(full.size() - 2));  // ... of the held bytes
}

TEST(Generate, ContextCapacityGivesLength) {
  const auto& g = greedy_ref();
  EngineOptions eo;
  const int64_t P = static_cast<int64_t>(model().prompt.size());
  eo.max_context = P + 5;
  auto e = engine(eo);
  auto s = e->new_session();
  const GenerateResult r = generate(*s, model().prompt, no_stop(100));
  EXPECT_EQ(r.finish, FinishReason::Length);
  // every fed row fits: the prompt and 5 ids, the 6th id is the anchor
  EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + 6));
  EXPECT_EQ(s->position(), P + 5);
}

TEST(Generate, CancelFromAnotherThread) {
  const auto& g = greedy_ref();
  auto e = engine();
  auto s = e->new_session();
  CancelToken cancel;
  std::mutex mu;
  std::condition_variable cv;
  bool asked = false, done = false;
  std::thread canceller([&] {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [&] { return asked; });
    cancel.cancel();
    done = true;
    cv.notify_all();
  });
  size_t seen = 0;
  const GenerateResult r = generate(
      *s, model().prompt, no_stop(1000), nullptr,
      [&](std::string_view, const std::vector<int32_t>& ids) {
        seen += ids.size();
        if (seen == 3) {  // the other thread cancels while this step's callback waits
          std::unique_lock<std::mutex> l(mu);
          asked = true;
          cv.notify_all();
          cv.wait(l, [&] { return done; });
        }
      },
      &cancel);
  canceller.join();
  EXPECT_EQ(r.finish, FinishReason::Cancelled);
  EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + 3));
  expect_state(*s, model().prompt, r.ids);
  // cancelled before it starts: nothing runs
  auto s2 = e->new_session();
  const GenerateResult r2 = generate(*s2, model().prompt, no_stop(10), nullptr, {}, &cancel);
  EXPECT_EQ(r2.finish, FinishReason::Cancelled);
  EXPECT_TRUE(r2.ids.empty());
  EXPECT_EQ(s2->position(), 0);
}

TEST(Generate, SeededSamplingIsReproducible) {
  auto e = engine();
  auto run = [&](uint64_t seed, float T, int top_k, DecodingStrategy* strat = nullptr) {
    auto s = e->new_session();
    GenerateOptions o = no_stop(24);
    o.sampling.temperature = T;
    o.sampling.seed = seed;
    o.sampling.top_k = top_k;
    PlainDecoding plain;
    return generate(*s, model().prompt, o, strat ? *strat : plain).ids;
  };
  const auto a = run(1, 1.5f, 0), b = run(1, 1.5f, 0), c = run(2, 1.5f, 0);
  EXPECT_EQ(a.size(), 24u);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_NE(a, std::vector<int32_t>(greedy_ref().begin(), greedy_ref().begin() + 24));
  // top-k 1 at T > 0 is greedy
  EXPECT_EQ(run(3, 1.5f, 1), std::vector<int32_t>(greedy_ref().begin(), greedy_ref().begin() + 24));
  // two per call draws the same numbers in the same order
  TwoPerCall two;
  EXPECT_EQ(run(1, 1.5f, 0, &two), a);
}

TEST(Generate, TwoTokensPerCallEqualsPlain) {
  const auto& g = greedy_ref();
  auto e = engine();
  {
    auto s = e->new_session();
    TwoPerCall two;
    const GenerateResult r = generate(*s, model().prompt, no_stop(25), two);  // (the last call may take 1)
    EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + 25));
    EXPECT_EQ(r.finish, FinishReason::Length);
    EXPECT_EQ(r.steps, 13);
    expect_state(*s, model().prompt, r.ids);
  }
  // a stop id first or second in a call's pair: the ids before it, the session rolled
  // back to them
  int tried = 0;
  for (int k = first_new(g, 1); k > 0 && tried < 4; k = first_new(g, k + 1), ++tried) {
    auto s = e->new_session();
    TwoPerCall two;
    GenerateOptions o = no_stop(32);
    o.stop_ids = {g[static_cast<size_t>(k)]};
    const GenerateResult r = generate(*s, model().prompt, o, two);
    EXPECT_EQ(r.finish, FinishReason::Stop) << k;
    EXPECT_EQ(r.ids, std::vector<int32_t>(g.begin(), g.begin() + k)) << k;
    EXPECT_EQ(s->tokens(), concat(model().prompt, r.ids)) << k;
  }
  EXPECT_GE(tried, 2);
}

// A strategy that feeds more rows than it commits is refused.
TEST(Generate, StrategyBreakingTheContractIsAnError) {
  class FeedsTwo final : public DecodingStrategy {
   public:
    void start(const SamplerOptions&) override {}
    void next(Session& s, int32_t anchor, int64_t, std::vector<int32_t>& out) override {
      const int32_t two[2] = {anchor, anchor};
      out.push_back(s.feed_greedy(two, 2));
    }
  } bad;
  auto e = engine();
  auto s = e->new_session();
  try {
    (void)generate(*s, model().prompt, no_stop(4), bad);
    ADD_FAILURE() << "no error";
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("position"), std::string::npos) << err.what();
  }
  GenerateOptions o = no_stop(4);
  o.stop_strings = {"x"};
  EXPECT_THROW((void)generate(*s, model().prompt, o), Error);  // stop strings without a detokenizer
  EXPECT_THROW((void)generate(*s, {}, no_stop(4)), Error);     // empty prompt
}

// A second turn on the same session: its prompt extends the first one's and its output,
// so all of that is reused and only the last token is fed again; the ids continue the
// greedy sequence. A one-token prompt works from any state.
TEST(Generate, SecondTurnReusesTheSession) {
  const auto& g = greedy_ref();
  auto e = engine();
  auto s = e->new_session();
  const auto& p = model().prompt;
  const GenerateResult r1 = generate(*s, p, no_stop(10));
  const std::vector<int32_t> p2 = concat(p, r1.ids);
  const GenerateResult r2 = generate(*s, p2, no_stop(12));
  EXPECT_EQ(r2.reused_tokens, static_cast<int64_t>(p2.size()) - 1);
  EXPECT_EQ(r2.prefilled_tokens, 1);
  EXPECT_EQ(r2.ids, std::vector<int32_t>(g.begin() + 10, g.begin() + 22));
  const GenerateResult r3 = generate(*s, {p[0]}, no_stop(3));
  EXPECT_EQ(r3.reused_tokens, 0);
  EXPECT_EQ(r3.ids, greedy_loop(*e, {p[0]}, 3));
}

// The text layer's adapter over a byte-level tokenizer (ids 0..255 are the bytes):
// UTF-8 split over tokens comes out whole, and a stop string spanning a split
// character stops before it. The ids come from a scripted strategy (the model only
// advances the state).
TEST(Generate, StreamTokenTextWithStopString) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    text::utf8::append(sym, text::byte_level::byte_to_char(static_cast<uint8_t>(b)));
    vocab[sym] = b;
  }
  const nlohmann::json j = {{"version", "1.0"},
                            {"added_tokens", nlohmann::json::array()},
                            {"normalizer", nullptr},
                            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
                            {"decoder", {{"type", "ByteLevel"}}},
                            {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", nlohmann::json::array()}}}};
  const text::Tokenizer tok = text::Tokenizer::from_json_text(j.dump(), "bytes");
  const std::string reply = "h\xC3\xA9llo w\xC3\xB6rld";  // "héllo wörld"
  class Scripted final : public DecodingStrategy {
   public:
    explicit Scripted(const std::string& t) : t_(t) {}
    void start(const SamplerOptions&) override { i_ = 0; }
    void next(Session& s, int32_t anchor, int64_t, std::vector<int32_t>& out) override {
      s.feed(&anchor, 1, nullptr, false);
      out.push_back(static_cast<uint8_t>(t_[i_++ % t_.size()]));
    }

   private:
    std::string t_;
    size_t i_ = 0;
  };
  auto e = engine();
  for (const auto& [stop, want] : std::vector<std::pair<std::string, std::string>>{
           {"w\xC3\xB6", "h\xC3\xA9llo "}, {"\xC3\xA9l", "h"}, {"xyz", reply}}) {
    auto s = e->new_session();
    Scripted script(reply);
    text::StreamTokenText detok(tok);
    GenerateOptions o = no_stop(static_cast<int64_t>(reply.size()));
    o.stop_strings = {stop};
    Stream st;
    const GenerateResult r = generate(*s, model().prompt, o, script, &detok, st.fn());
    EXPECT_EQ(r.text, want) << stop;
    EXPECT_EQ(st.all(), want);
    for (const std::string& piece : st.texts) EXPECT_TRUE(text::valid_utf8(piece)) << piece;
    EXPECT_EQ(r.finish, want == reply ? FinishReason::Length : FinishReason::Stop);
  }
}

// ---- the CLI -------------------------------------------------------------------------------
namespace {

std::string dsx_binary() {
  const char* b = std::getenv("DSX_BUILD_DIR");
  return b ? std::string(b) + "/dsx" : "";
}

int run_cmd(const std::string& cmd, std::string* out, bool with_stderr = true) {
  const std::string full = cmd + (with_stderr ? " 2>&1" : " 2>/dev/null");
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
  const int rc = pclose(p);
  *out = s;
  return WEXITSTATUS(rc);
}

}  // namespace

TEST(GenerateCli, HelpListsTheOptions) {
  const std::string bin = dsx_binary();
  if (bin.empty() || !std::filesystem::exists(bin)) GTEST_SKIP() << "dsx binary not found (run through ctest)";
  std::string out;
  ASSERT_EQ(0, run_cmd(bin + " run --help", &out));
  for (const char* o : {"-m DIR", "-p PROMPT", "-n N", "--stop STRING", "--temperature", "--top-p", "--top-k", "--seed",
                        "--system", "--thinking", "--raw", "--show-prompt", "--backend", "--stats"})
    EXPECT_NE(out.find(o), std::string::npos) << o << "\n" << out;
  ASSERT_EQ(0, run_cmd(bin + " generate --help", &out));
  for (const char* o : {"-m DIR", "--ids FILE", "-n N", "--greedy", "--temperature", "--seed", "--stop-eos"})
    EXPECT_NE(out.find(o), std::string::npos) << o << "\n" << out;
  EXPECT_NE(0, run_cmd(bin + " run -m x -p y --stop", &out));
  EXPECT_NE(out.find("--stop"), std::string::npos) << out;
}

// `dsx run` with --stop (repeated) prints the reply of a run without it up to the stop
// string, on a tiny model with the V4.1 test tokenizer.
TEST(GenerateCli, RunStopsAtAStopString) {
  const std::string bin = dsx_binary();
  if (bin.empty() || !std::filesystem::exists(bin)) GTEST_SKIP() << "dsx binary not found (run through ctest)";
  DSX_REQUIRE_GOLDEN(gdir);
  const std::string tok = gdir + "/tokenizer/tokenizer-v41.json";
  if (!std::filesystem::exists(tok)) GTEST_SKIP() << tok << " not found";
  const std::string dir = dsx_test::temp_dir("generate_cli") + "/m";
  std::string out, full, cut;
  ASSERT_EQ(0, run_cmd(bin + " make-tiny -o " + dir + " --tokenizer " + tok, &out)) << out;
  const std::string cmd = bin + " run -m " + dir + " -p 'Write a haiku about the sea.' -n 24";
  ASSERT_EQ(0, run_cmd(cmd, &full, false));
  ASSERT_GT(full.size(), 12u);
  ASSERT_EQ(full.back(), '\n');
  // an ASCII piece of the reply that first occurs where it is taken
  size_t at = std::string::npos, len = 3;
  for (size_t p = full.size() / 3; p + len < full.size() && at == std::string::npos; ++p) {
    const std::string s = full.substr(p, len);
    if (std::all_of(s.begin(), s.end(), [](char c) { return c > ' ' && c < 127 && c != '\''; }) && full.find(s) == p)
      at = p;
  }
  ASSERT_NE(at, std::string::npos) << full;
  ASSERT_EQ(0, run_cmd(cmd + " --stop '" + full.substr(at, len) + "' --stop=QQQQQ --stats", &cut)) << cut;
  EXPECT_EQ(cut.substr(0, at + 1), full.substr(0, at) + "\n") << cut;
  EXPECT_NE(cut.find("finish: stop"), std::string::npos) << cut;
}
