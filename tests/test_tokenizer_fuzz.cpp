// Randomised tests of the tokenizer, each bounded in time (about 5 s in all): random
// bytes, mutations of the golden strings, DSML-like text. Checks: no crash,
// decode(encode(s)) == s for every byte string (invalid UTF-8 included), the streaming
// decoder emits only valid UTF-8 and ends with lossy(decode), client text never yields
// an added token, and the ASCII fast paths of the pre-tokenizer agree with PCRE2.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/tokenizer.h"
#include "text/unicode.h"

using dsx::text::StreamDecoder;
using dsx::text::Tokenizer;

namespace {

using Clock = std::chrono::steady_clock;

struct Fixture {
  Tokenizer fast;  // default configuration
  Tokenizer slow;  // PCRE2 only, no cache
  std::vector<std::string> seeds;
};

Fixture& fixture() {
  static Fixture* f = [] {
    const std::string dir = dsx_test::golden_dir() + "/tokenizer";
    auto* x = new Fixture{Tokenizer::from_file(dir + "/tokenizer-v41.json"),
                          Tokenizer::from_file(dir + "/tokenizer-v41.json"), {}};
    x->slow.set_fast_paths_enabled(false);
    x->slow.set_cache_enabled(false);
    std::ifstream in(dir + "/cases.jsonl");
    std::string line;
    while (std::getline(in, line))
      if (!line.empty()) x->seeds.push_back(nlohmann::json::parse(line).at("text").get<std::string>());
    return x;
  }();
  return *f;
}

// Runs `body(iteration)` until `seconds` have passed (at least `min_iters` times).
template <typename F>
int for_a_while(double seconds, int min_iters, F body) {
  (void)fixture();  // load outside the time budget
  const auto t0 = Clock::now();
  int i = 0;
  while (i < min_iters || std::chrono::duration<double>(Clock::now() - t0).count() < seconds) body(i++);
  return i;
}

// All properties checked on one input.
void check(const std::string& s) {
  Fixture& fx = fixture();
  const Tokenizer& tok = fx.fast;
  for (bool allow_added : {true, false}) {
    const std::vector<int32_t> ids = tok.encode(s, allow_added);
    ASSERT_EQ(tok.decode(ids), s) << "allow_added=" << allow_added << " input " << nlohmann::json(dsx::text::utf8::lossy(s)).dump();
    if (!allow_added) {
      for (int32_t id : ids) ASSERT_FALSE(tok.is_added(id)) << nlohmann::json(dsx::text::utf8::lossy(s)).dump();
    }
    // The fast paths must reproduce the PCRE2-only split.
    ASSERT_EQ(fx.slow.encode(s, allow_added), ids) << nlohmann::json(dsx::text::utf8::lossy(s)).dump();
    StreamDecoder sd(tok);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string out = sd.push(id);
      ASSERT_TRUE(dsx::text::utf8::is_valid(out));
      streamed += out;
    }
    streamed += sd.flush();
    ASSERT_EQ(streamed, dsx::text::utf8::lossy(s));
  }
}

const char* const kFragments[] = {
    "<｜DSML｜", "｜DSML｜", " calls>", " invoke name=\"", " parameter name=\"", "\" string=\"true\">", "\" string=\"false\">",
    "</｜DSML｜ invoke>", "</｜DSML｜ parameter>", "</｜DSML｜ calls>", "tool_calls>", "<｜User｜>", "<｜Assistant｜>",
    "<think>", "</think>", "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>", "<｜System｜>", "<｜latest_reminder｜>",
    "<｜", "｜>", "<", ">", "/", "\"", "\n", "\n\n", " ", "  ", "\t", "{\"city\": \"Paris\", \"days\": [1, 2, 3]}",
    "get_weather", "Reasoning Effort: 42", "café", "naïve", "東京タワー", "你好，世界", "١٢٣٤", "👍🏽", "\xF0\x9F",
    "\u200D", "\u00A0", "\r\n", "1234567", "x=1;", "//", "```python\n", "&lt;", "\\u003c"};

}  // namespace

TEST(TokenizerFuzz, RandomBytes) {
  DSX_REQUIRE_GOLDEN(g);
  std::mt19937_64 rng(1234);
  const int n = for_a_while(1.0, 200, [&](int) {
    std::string s(rng() % 160, '\0');
    const int mode = static_cast<int>(rng() % 3);
    for (auto& c : s) {
      if (mode == 0) c = static_cast<char>(rng());                    // any byte
      else if (mode == 1) c = static_cast<char>(0x20 + rng() % 0x60);  // printable ASCII
      else c = static_cast<char>(rng() % 4 ? 0x80 + rng() % 0x40 : 0xC0 + rng() % 0x40);  // UTF-8-ish
    }
    check(s);
  });
  std::printf("[ info     ] %d random byte strings\n", n);
}

TEST(TokenizerFuzz, MutatedGoldenStrings) {
  DSX_REQUIRE_GOLDEN(g);
  Fixture& fx = fixture();
  std::mt19937_64 rng(99);
  const int n = for_a_while(1.5, 300, [&](int) {
    std::string s = fx.seeds[rng() % fx.seeds.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t pos = s.empty() ? 0 : rng() % (s.size() + 1);
      switch (rng() % 6) {
        case 0: if (!s.empty() && pos < s.size()) s[pos] = static_cast<char>(rng()); break;  // byte flip
        case 1: s.insert(pos, kFragments[rng() % std::size(kFragments)]); break;
        case 2: s.insert(pos, fx.seeds[rng() % fx.seeds.size()]); break;
        case 3: if (pos < s.size()) s.erase(pos, rng() % 8); break;
        case 4: s = s.substr(0, pos); break;  // truncation, possibly inside a character
        default: s += s.substr(pos); break;   // duplication
      }
    }
    check(s);
  });
  std::printf("[ info     ] %d mutated strings\n", n);
}

TEST(TokenizerFuzz, DsmlLikeText) {
  DSX_REQUIRE_GOLDEN(g);
  std::mt19937_64 rng(7);
  const int n = for_a_while(1.5, 300, [&](int) {
    std::string s;
    const size_t parts = 1 + rng() % 40;
    for (size_t k = 0; k < parts; ++k) {
      if (rng() % 5 == 0) {
        std::string word;
        for (size_t c = rng() % 12; c > 0; --c) word += static_cast<char>('a' + rng() % 26);
        s += word;
      } else {
        s += kFragments[rng() % std::size(kFragments)];
      }
    }
    check(s);
    // Valid UTF-8 text must also stream back to itself exactly.
    if (dsx::text::utf8::is_valid(s)) {
      ASSERT_EQ(dsx::text::utf8::lossy(s), s);
    }
  });
  std::printf("[ info     ] %d DSML-like strings\n", n);
}

TEST(TokenizerFuzz, RandomCodePoints) {
  // Valid UTF-8 over the whole code space: the fast paths must agree with PCRE2 when
  // non-ASCII characters of every kind sit next to ASCII ones.
  DSX_REQUIRE_GOLDEN(g);
  std::mt19937_64 rng(5);
  const char32_t ascii_bias[] = {' ', ' ', '\n', 'a', 'Z', '7', '.', '\'', '\t', '\r', '-', '_'};
  const int n = for_a_while(1.0, 200, [&](int) {
    std::string s;
    for (size_t k = rng() % 60; k > 0; --k) {
      char32_t c;
      switch (rng() % 4) {
        case 0: c = ascii_bias[rng() % std::size(ascii_bias)]; break;
        case 1: c = static_cast<char32_t>(rng() % 0x80); break;
        case 2: c = static_cast<char32_t>(0x80 + rng() % 0x3000); break;
        default: c = static_cast<char32_t>(rng() % 0x110000); break;
      }
      if (c >= 0xD800 && c < 0xE000) c = 0xFFFD;
      dsx::text::utf8::append(s, c);
    }
    check(s);
  });
  std::printf("[ info     ] %d random code point strings\n", n);
}

TEST(TokenizerFuzz, ConcurrentEncodersShareOneTokenizer) {
  // One Tokenizer (and its piece cache) used from several threads at once.
  DSX_REQUIRE_GOLDEN(g);
  Fixture& fx = fixture();
  std::vector<std::vector<int32_t>> expected;
  for (const auto& s : fx.seeds) expected.push_back(fx.slow.encode(s));
  fx.fast.clear_cache();
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (size_t k = (t * 37 + round) % fx.seeds.size(), n = 0; n < fx.seeds.size(); ++n, k = (k + 1) % fx.seeds.size())
          if (fx.fast.encode(fx.seeds[k]) != expected[k]) ++bad[t];
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(bad[t], 0) << "thread " << t;
}
