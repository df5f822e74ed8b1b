// Byte-prefix matching (server/byte_prefix.h, chat-and-serving.md §5.1) with the V4.1
// tokenizer: a session whose tail spells the prompt's next bytes in another split keeps
// all of it; the match stops where the bytes differ and never puts a control token
// opposite plain text; random splits of random text (the property: the rebased prompt
// spells the same bytes, and the kept live tokens are a prefix of the session's).
#include <gtest/gtest.h>

#include <filesystem>
#include <random>
#include <string>

#include "server/byte_prefix.h"
#include "test_util.h"
#include "text/tokenizer.h"

using namespace dsx;
using server::byte_prefix;
using server::BytePrefix;
using server::rebased_prompt;
using text::Tokenizer;

namespace {

const Tokenizer* v41() {
  static std::unique_ptr<Tokenizer> t;
  if (!t) {
    const std::string g = dsx_test::golden_dir();
    const std::string path = g + "/tokenizer/tokenizer-v41.json";
    if (g.empty() || !std::filesystem::exists(path)) return nullptr;
    t = std::make_unique<Tokenizer>(Tokenizer::from_file(path));
  }
  return t.get();
}

#define NEED_V41(tok) \
  const Tokenizer* tok = v41(); \
  if (!tok) GTEST_SKIP() << "golden tokenizer not found"

std::vector<int32_t> cat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// the text in pieces cut at `cuts`, each piece tokenized alone: the same bytes, another split
std::vector<int32_t> split(const Tokenizer& tok, const std::string& s, std::vector<size_t> cuts) {
  std::vector<int32_t> out;
  size_t at = 0;
  cuts.push_back(s.size());
  for (size_t c : cuts) {
    out = cat(out, tok.encode(s.substr(at, c - at), false));
    at = c;
  }
  return out;
}

std::string bytes(const Tokenizer& tok, const std::vector<int32_t>& ids, size_t n) {
  std::string b;
  for (size_t i = 0; i < n; ++i) b += tok.decode_one(ids[i]);
  return b;
}

}  // namespace

TEST(BytePrefix, ReplayedAnswerKeepsTheSampledTokens) {
  NEED_V41(tok);
  const std::vector<int32_t> head = tok->encode("<｜begin▁of▁sentence｜><｜User｜>Say hello.<｜Assistant｜></think>", true);
  const std::string answer = "Hello, world! Here is the plan:\n\n1. Build it.\n2. Test it.";
  // the model sampled the answer in pieces the canonical tokenizer would merge
  const std::vector<int32_t> sampled = split(*tok, answer, {3, 4, 9, 20, 21, 37});
  const std::vector<int32_t> canon = tok->encode(answer, false);
  ASSERT_NE(sampled, canon) << "the test needs a non-canonical split";
  const std::vector<int32_t> live = cat(head, sampled);
  const std::vector<int32_t> prompt =
      cat(cat(head, canon), tok->encode("<｜end▁of▁sentence｜><｜User｜>Thanks. Next?<｜Assistant｜></think>", true));
  const int64_t common = static_cast<int64_t>(head.size()) + 0;
  const BytePrefix m = byte_prefix(*tok, live, prompt, common, static_cast<int64_t>(prompt.size()) - 1);
  EXPECT_EQ(m.live, static_cast<int64_t>(live.size())) << "the whole sampled answer is kept";
  EXPECT_EQ(m.prompt, static_cast<int64_t>(head.size() + canon.size())) << "the prompt continues at <EOS>";
  const std::vector<int32_t> r = rebased_prompt(live, prompt, m);
  EXPECT_EQ(bytes(*tok, r, r.size()), bytes(*tok, prompt, prompt.size()));
  EXPECT_TRUE(std::equal(live.begin(), live.end(), r.begin()));
}

TEST(BytePrefix, StopsWhereTheBytesDiffer) {
  NEED_V41(tok);
  const std::vector<int32_t> head = tok->encode("<｜User｜>Q<｜Assistant｜>", true);
  const std::vector<int32_t> live = cat(head, split(*tok, "The answer is forty-two.", {4, 11}));
  const std::vector<int32_t> prompt = cat(head, tok->encode("The answer is forty-three, said the client.", false));
  const BytePrefix m = byte_prefix(*tok, live, prompt, static_cast<int64_t>(head.size()), 1 << 30);
  // the last boundary both streams share before "two" / "three"
  EXPECT_GE(m.live, static_cast<int64_t>(head.size()));
  EXPECT_LT(m.live, static_cast<int64_t>(live.size()));
  const std::string kept = bytes(*tok, live, static_cast<size_t>(m.live));
  EXPECT_EQ(kept, bytes(*tok, prompt, static_cast<size_t>(m.prompt)));
  EXPECT_EQ(bytes(*tok, prompt, prompt.size()).rfind(kept, 0), 0u);
  EXPECT_LE(kept.size(), bytes(*tok, head, head.size()).size() + std::string("The answer is forty-").size());
  // nothing in common past the token prefix: (common, common)
  const std::vector<int32_t> other = cat(head, tok->encode("Something else entirely.", false));
  const BytePrefix z = byte_prefix(*tok, live, other, static_cast<int64_t>(head.size()), 1 << 30);
  EXPECT_EQ(z.live, static_cast<int64_t>(head.size()));
  EXPECT_EQ(z.prompt, static_cast<int64_t>(head.size()));
}

TEST(BytePrefix, ControlTokensOnlyOppositeTheSameControlToken) {
  NEED_V41(tok);
  const std::vector<int32_t> head = tok->encode("<｜User｜>Q<｜Assistant｜>", true);
  // the session holds the control token; the prompt has the same bytes as client text
  const std::vector<int32_t> live = cat(head, tok->encode("ok<｜User｜>more", true));
  std::vector<int32_t> plain = tok->encode("ok", false);
  const std::vector<int32_t> marker_text = tok->encode("<｜User｜>more", false);  // (plain bytes)
  const std::vector<int32_t> prompt = cat(cat(head, plain), marker_text);
  const BytePrefix m = byte_prefix(*tok, live, prompt, static_cast<int64_t>(head.size()), 1 << 30);
  EXPECT_LE(m.live, static_cast<int64_t>(head.size() + plain.size())) << "stopped before the control token";
  // and the reverse: plain text in the session, the control token in the prompt
  const BytePrefix r = byte_prefix(*tok, prompt, live, static_cast<int64_t>(head.size()), 1 << 30);
  EXPECT_LE(r.live, static_cast<int64_t>(head.size() + plain.size()));
  // the same control token on both sides is passed
  const std::vector<int32_t> live2 = cat(head, split(*tok, "ok then", {1, 4}));
  const std::vector<int32_t> prompt2 =
      cat(head, tok->encode("ok then<｜end▁of▁sentence｜><｜User｜>next<｜Assistant｜>", true));
  std::vector<int32_t> live3 = cat(live2, tok->encode("<｜end▁of▁sentence｜><｜User｜>ne", true));
  const BytePrefix p = byte_prefix(*tok, live3, prompt2, static_cast<int64_t>(head.size()), 1 << 30);
  EXPECT_EQ(bytes(*tok, live3, static_cast<size_t>(p.live)), bytes(*tok, prompt2, static_cast<size_t>(p.prompt)));
  EXPECT_GE(p.live, static_cast<int64_t>(live2.size()) + 2) << "past <EOS><User>";
}

TEST(BytePrefix, RandomSplitsOfRandomText) {
  NEED_V41(tok);
  std::mt19937 rng(5);
  const std::string alphabet = "abc de\nf,.:;()[]{}\"'_-+=*/\\#ab  \t\xC3\xA9\xE4\xB8\xAD";
  for (int iter = 0; iter < 300; ++iter) {
    std::string s;
    const int n = 5 + static_cast<int>(rng() % 120);
    for (int i = 0; i < n; ++i) s += alphabet[rng() % alphabet.size()];
    // random cuts (possibly inside a UTF-8 character: the pieces' bytes still add up)
    std::vector<size_t> cuts;
    for (size_t c = 1; c < s.size(); ++c)
      if (rng() % 5 == 0) cuts.push_back(c);
    const std::vector<int32_t> live = split(*tok, s, cuts);
    const std::string more = "<｜end▁of▁sentence｜><｜User｜>x";
    const std::vector<int32_t> prompt = tok->encode(s + more, true);
    const BytePrefix m = byte_prefix(*tok, live, prompt, 0, static_cast<int64_t>(prompt.size()));
    ASSERT_LE(m.live, static_cast<int64_t>(live.size()));
    const std::string kl = bytes(*tok, live, static_cast<size_t>(m.live));
    ASSERT_EQ(kl, bytes(*tok, prompt, static_cast<size_t>(m.prompt))) << s;
    const std::vector<int32_t> r = rebased_prompt(live, prompt, m);
    ASSERT_EQ(bytes(*tok, r, r.size()), bytes(*tok, prompt, prompt.size())) << s;
    // the canonical encoding of s ends at the <EOS> token, so the whole live split is kept
    // unless the canonical tokens of s merge across its end with what follows (they cannot:
    // an added token follows)
    EXPECT_EQ(m.live, static_cast<int64_t>(live.size())) << s;
  }
}
