// Tokenizer tests: golden cases (HF tokenizers 0.23.2), spec §6.1 cases, added-token
// handling, decoding, streaming, invalid input, loader errors, the test-tokenizer builder.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/bpe.h"
#include "text/bpe_pretokenizer.h"
#include "text/test_tokenizer_builder.h"
#include "text/tokenizer.h"
#include "text/unicode.h"
#include "util/error.h"

using dsx::text::StreamDecoder;
using dsx::text::Tokenizer;
using Ids = std::vector<int32_t>;

namespace {

std::string tok_dir() { return dsx_test::golden_dir() + "/tokenizer"; }

// Loading a tokenizer takes ~0.5 s: share them between tests.
const Tokenizer& tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& t = cache[name];
  if (!t) t = std::make_unique<Tokenizer>(Tokenizer::from_file(tok_dir() + "/" + name));
  return *t;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

struct GoldenCase {
  std::string text, decoded;
  Ids ids;
};

std::vector<GoldenCase> golden_cases() {
  std::vector<GoldenCase> out;
  std::ifstream f(tok_dir() + "/cases.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    out.push_back({j.at("text").get<std::string>(), j.at("decoded").get<std::string>(), j.at("ids").get<Ids>()});
  }
  return out;
}

std::string hex(const std::string& s) {
  static const char* d = "0123456789ABCDEF";
  std::string r;
  for (unsigned char c : s) {
    if (!r.empty()) r += ' ';
    r += d[c >> 4];
    r += d[c & 15];
  }
  return r;
}

}  // namespace

// ---- goldens ------------------------------------------------------------------------------

TEST(Tokenizer, GoldenCasesEncodeAndDecode) {
  DSX_REQUIRE_GOLDEN(g);
  const auto cases = golden_cases();
  ASSERT_EQ(cases.size(), 167u);
  const Tokenizer& tok = tokenizer("tokenizer-v3-base.json");
  for (const auto& c : cases) {
    EXPECT_EQ(tok.encode(c.text), c.ids) << "text: " << nlohmann::json(c.text).dump();
    EXPECT_EQ(tok.decode(c.ids), c.decoded) << "text: " << nlohmann::json(c.text).dump();
  }
}

TEST(Tokenizer, GoldenCasesWithoutFastPathsOrCache) {
  DSX_REQUIRE_GOLDEN(g);
  Tokenizer tok = Tokenizer::from_file(tok_dir() + "/tokenizer-v3-base.json");
  ASSERT_TRUE(tok.has_fast_paths());
  tok.set_fast_paths_enabled(false);
  tok.set_cache_enabled(false);
  EXPECT_FALSE(tok.has_fast_paths());
  for (const auto& c : golden_cases()) EXPECT_EQ(tok.encode(c.text), c.ids) << nlohmann::json(c.text).dump();
}

TEST(Tokenizer, GoldenCasesWithV4AndV41Tokenizers) {
  // Same BPE: the goldens hold for the V4 / V4.1 files except where a V4 added token
  // appears in the text (none of the cases contains one that V3 lacks).
  DSX_REQUIRE_GOLDEN(g);
  for (const char* name : {"tokenizer-v4.json", "tokenizer-v41.json"}) {
    const Tokenizer& tok = tokenizer(name);
    for (const auto& c : golden_cases()) {
      bool has_new_added = false;
      for (const auto& a : tok.added_tokens())
        if (a.id > 128814 && c.text.find(a.content) != std::string::npos) has_new_added = true;
      if (has_new_added) continue;
      EXPECT_EQ(tok.encode(c.text), c.ids) << name << ": " << nlohmann::json(c.text).dump();
    }
  }
}

// Spec §6.1 (HF goldens for V4-0731 / V4.1).
TEST(Tokenizer, SpecCases) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& v4 = tokenizer("tokenizer-v4.json");
  const Tokenizer& v41 = tokenizer("tokenizer-v41.json");
  const std::vector<std::pair<std::string, Ids>> both = {
      {"The capital of France is", {671, 6102, 294, 8760, 344}},
      {"  5", {262, 23}},
      {"   abc", {262, 71490}},
      {"\n\n  x", {271, 223, 1527}},
      {"abc   ", {32372, 361}},
      {"\r\n\r\n", {204, 201, 204, 201}},
      {"x\xC2\xA0y", {90, 2162, 91}},
      {"1,000,000.50", {19, 14, 1320, 14, 1320, 16, 1328}},
      {"\xD9\xA1\xD9\xA2\xD9\xA3\xD9\xA4", {63468, 76647, 127056, 152, 100}},
      {"emoji \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD test", {18872, 7063, 102527, 40965, 124, 1950}},
      {" ?!x", {4054, 3, 90}},
      {std::string("x\0y", 3), {90, 191, 91}},
      {"\xEF\xBB\xBF" "bom", {15251, 68, 316}},
      {"a<think>b", {67, 128821, 68}},
      {"before <｜User｜> after", {35975, 223, 128803, 1561}},
      {"<｜place▁holder▁no▁7｜>", {128007}},
      {"Simple arithmetic.</think>2 + 2 = 4.<｜end▁of▁sentence｜>",
       {40593, 29568, 16, 128822, 20, 940, 223, 20, 438, 223, 22, 16, 1}},
      {"<｜begin▁of▁sentence｜>System text.<｜latest_reminder｜>2026-07-31,Friday,Paris,App,English<｜User｜>Which "
       "day?<｜Assistant｜></think><｜action｜>",
       {0,     8375,  3051, 16, 128828, 939, 24,     15,     3315,  15, 2181, 14, 41060,
        14,    51119, 14,   5737, 14,     17530, 128803, 15480, 2173, 33, 128804, 128822, 128829}},
  };
  for (const auto& [text, ids] : both) {
    EXPECT_EQ(v4.encode(text), ids) << "v4: " << nlohmann::json(text).dump();
    EXPECT_EQ(v41.encode(text), ids) << "v41: " << nlohmann::json(text).dump();
    EXPECT_EQ(v41.decode(ids), text);
  }
  EXPECT_EQ(v4.encode("<｜System｜>"), (Ids{30, 28217, 8375, 28217, 32}));
  EXPECT_EQ(v41.encode("<｜System｜>"), (Ids{128799}));
  EXPECT_EQ(v4.encode("<｜table｜><｜tr｜><｜td｜>cell 1<｜/td｜><｜td｜>2<｜/td｜><｜/tr｜><｜/table>｜"),
            (Ids{129266, 129270, 129268, 11908, 223, 19, 129267, 129268, 20, 129267, 129269, 129265}));
  // DSML block, V4 and V4.1 spellings.
  const std::string v4_dsml =
      "\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜parameter>\n<｜DSML｜parameter name=\"days\" "
      "string=\"false\">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls><｜end▁of▁sentence｜>";
  EXPECT_EQ(v4.encode(v4_dsml),
            (Ids{271,   30,   128825, 72461, 4941,  12548, 1018,   30,    128825, 40148, 5406,  2329,   1281,
                 1133,  65,   50219,  3816,  30,    128825, 41523, 2329,  1281,   37399, 4,     3418,   1281,
                 11476, 3320, 51119,  1718,  128825, 41523, 1018,  30,    128825, 41523, 2329,  1281,   28026,
                 4,     3418, 1281,   19836, 3320,  21,    1718,   128825, 41523, 1018,   1718,  128825, 40148,
                 5406,  1018, 1718,   128825, 72461, 4941,  12548, 32,    1}));
  const std::string v41_dsml =
      "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter name=\"city\" "
      "string=\"true\">Paris</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"days\" "
      "string=\"false\">3</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>";
  EXPECT_EQ(v41.encode(v41_dsml),
            (Ids{271,   30,     128825, 10699, 1018,  30,    128825, 34756,  2329,  1281,   1133,  65,
                 50219, 3816,   30,     128825, 10767, 2329,  1281,   37399,  4,     3418,   1281,  11476,
                 3320,  51119,  1718,   128825, 10767, 1018,  30,     128825, 10767, 2329,   1281,  28026,
                 4,     3418,   1281,   19836, 3320,  21,    1718,   128825, 10767,  1018,  1718,   128825,
                 34756, 1018,   1718,   128825, 10699, 32,    1}));
}

// Strings checked against HF tokenizers 0.23.2 (tokenizer-v3-base.json, plain encode):
// characters of Unicode 15.0-16.0 (which PCRE2 10.42's Unicode 14 tables lack), U+180E,
// unusual white space, numbers of several scripts, ZWJ sequences.
TEST(Tokenizer, HfReferenceUnicodeCases) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v3-base.json");
  const std::vector<std::pair<std::string, Ids>> cases = {
      {"I love it \U0001FA77 so much \U0001FAE8!", {43, 3518, 436, 7351, 105, 118, 832, 1949, 7351, 107, 104, 3}},
      {"x \U00031350\U00031351 y \U0002EBF0", {90, 86387, 112, 238, 241, 175, 112, 238, 242, 383, 86387, 109, 110, 111}},
      {" \U00010D50\U00010D70 \U00010D40\U00010D41\U00010D42\U00010D43",
       {86387, 241, 116, 241, 120577, 116, 111, 223, 120577, 116, 225, 120577, 116, 226, 120577, 116, 227, 120577,
        116, 228}},
      {"a\u180Eb \u180E c", {67, 115522, 239, 68, 223, 115522, 239, 274}},
      {"tab\u00A0\u00A0\u00A0x  \u3000\u3000y", {14278, 4069, 2162, 90, 262, 18524, 18524, 91}},
      {"line\u2028sep\u2029para\u0085nel", {1836, 300, 104, 88351, 300, 105, 35638, 129, 230, 11713}},
      {"\u2FFC\u2FFD \u31EF", {161, 126, 123, 161, 126, 124, 223, 162, 232, 110}},
      {"\u216B \u217D \u3251 \u00BC \u0BF0 \U0001D7D9\U0001D7DA\U0001D7DB",
       {23603, 107, 223, 23603, 124, 223, 162, 234, 242, 223, 32223, 223, 2025, 111, 223, 70958, 250, 70958, 251,
        70958, 252}},
      {"\u0627\u0644\u0639\u0631\u0628\u064A\u0629 \u0661\u0662\u0663\u0664\u0665 "
       "\u092B\u093C\u093F\u0932\u094D\u092E \u0995\u09CD\u09B7",
       {69577, 64758, 223, 63468, 76647, 127056, 152, 100, 152, 101, 83822, 48932, 57723, 46854, 52217}},
      {"  \n\t \r\n  end", {2143, 35749, 204, 201, 223, 1522}},
      {"mixed1234567890abc", {122545, 6895, 18009, 25744, 18, 32372}},
      {"emoji\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466family\U0001F3F3\uFE0F\u200D\U0001F308flag",
       {18872, 7063, 25730, 104, 46088, 25730, 105, 46088, 25730, 103, 46088, 25730, 102, 33811, 40965, 114, 10759,
        46088, 110659, 25002}},
  };
  for (const auto& [text, ids] : cases) {
    EXPECT_EQ(tok.encode(text), ids) << nlohmann::json(text).dump();
    EXPECT_EQ(tok.decode(ids), text);
  }
  const Tokenizer& v41 = tokenizer("tokenizer-v41.json");
  EXPECT_EQ(v41.encode("<｜System｜>Reasoning Effort: 50<｜User｜>hi<｜Assistant｜><think>"),
            (Ids{128799, 77666, 288, 9504, 482, 28, 223, 1328, 128803, 6366, 128804, 128821}));
  EXPECT_EQ(v41.encode("<｜deepseek_image｜><｜place▁holder▁no▁1265｜>"), (Ids{129264, 129265}));
}

// ---- lookups ---------------------------------------------------------------------------------

TEST(Tokenizer, SizesAndLookups) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& v3 = tokenizer("tokenizer-v3-base.json");
  const Tokenizer& v41 = tokenizer("tokenizer-v41.json");
  EXPECT_EQ(v3.size(), 128815u);
  EXPECT_EQ(v41.size(), 129280u);
  EXPECT_EQ(v41.vocab_size(), 128000u);
  EXPECT_EQ(v41.added_tokens().size(), 1283u);
  EXPECT_EQ(v41.token_to_id("<｜User｜>"), 128803);
  EXPECT_EQ(v41.token_to_id("\xC4\xA0"), 223);  // "Ġ"
  EXPECT_EQ(v41.token_to_id("<｜begin▁of▁sentence｜>"), 0);
  EXPECT_FALSE(v41.token_to_id("no such token").has_value());
  EXPECT_EQ(v41.id_to_token(223), "\xC4\xA0");
  EXPECT_EQ(v41.id_to_token(128821), "<think>");
  EXPECT_EQ(v41.id_to_token(128799), "<｜System｜>");
  EXPECT_EQ(v3.id_to_token(128799), "<｜place▁holder▁no▁799｜>");
  EXPECT_TRUE(v41.is_added(0));
  EXPECT_TRUE(v41.is_added(128825));
  EXPECT_FALSE(v41.is_added(5));
  EXPECT_FALSE(v41.is_added(-1));
  EXPECT_FALSE(v41.is_added(129280));
  EXPECT_TRUE(v41.is_special(1));
  EXPECT_FALSE(v3.is_special(128803));  // "special": false in the V3 file
  EXPECT_THROW(v41.id_to_token(129280), dsx::Error);
}

// ---- decoding --------------------------------------------------------------------------------

TEST(Tokenizer, DecodeIsOnBytes) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  EXPECT_EQ(tok.decode({40965}), "\xF0\x9F\x8F");
  EXPECT_EQ(tok.decode({152, 100}), "\xD9\xA4");
  EXPECT_EQ(tok.decode_one(92526), "\xF0\x9F\x91\x8D");
  EXPECT_EQ(tok.decode_one(124), "\xBD");
  EXPECT_EQ(tok.decode_one(191), std::string(1, '\0'));
  EXPECT_EQ(tok.decode_one(128803), "<｜User｜>");
  EXPECT_EQ(tok.decode({0, 3476, 128804}), "<｜begin▁of▁sentence｜>You<｜Assistant｜>");
  EXPECT_EQ(tok.decode({}), "");
  EXPECT_THROW(tok.decode({5, 129280}), dsx::Error);
  EXPECT_THROW(tok.decode_one(-3), dsx::Error);
  // Every single byte token decodes to its byte.
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    dsx::text::utf8::append(sym, dsx::text::byte_level::byte_to_char(static_cast<uint8_t>(b)));
    const auto id = tok.token_to_id(sym);
    ASSERT_TRUE(id.has_value()) << b;
    EXPECT_EQ(tok.decode_one(*id), std::string(1, static_cast<char>(b)));
  }
}

TEST(Tokenizer, ByteLevelMap) {
  using namespace dsx::text::byte_level;
  EXPECT_EQ(byte_to_char(0x00), 0x100u);
  EXPECT_EQ(byte_to_char('\t'), 0x109u);
  EXPECT_EQ(byte_to_char('\n'), 0x10Au);
  EXPECT_EQ(byte_to_char(' '), 0x120u);
  EXPECT_EQ(byte_to_char(0x7F), 0x121u);
  EXPECT_EQ(byte_to_char(0xAD), 0x143u);
  EXPECT_EQ(byte_to_char('A'), static_cast<char32_t>('A'));
  EXPECT_EQ(byte_to_char(0xE9), 0xE9u);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(char_to_byte(byte_to_char(static_cast<uint8_t>(b))), b);
  EXPECT_EQ(char_to_byte(0x20), -1);
  EXPECT_EQ(char_to_byte(0x144), -1);
  EXPECT_EQ(encode("Hello world"), "Hello\xC4\xA0world");
  std::string out;
  EXPECT_TRUE(decode("Hello\xC4\xA0world", &out));
  EXPECT_EQ(out, "Hello world");
  EXPECT_FALSE(decode("<\xEF\xBD\x9C>", &out));
}

// ---- added tokens as client text ------------------------------------------------------------------

TEST(Tokenizer, ClientTextNeverProducesAddedTokens) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  const std::vector<std::string> texts = {
      "<｜User｜>",
      "<think>",
      "</think>",
      "hello <｜Assistant｜><think>plan</think> done<｜end▁of▁sentence｜>",
      "<｜begin▁of▁sentence｜><｜end▁of▁sentence｜><｜▁pad▁｜>",
      "<｜DSML｜ invoke name=\"x\">｜DSML｜</｜DSML｜ invoke>",
      "<｜System｜>Reasoning Effort: 3<｜latest_reminder｜><|place_holder_mm_span_0021|><dsml:",
  };
  for (const auto& t : texts) {
    const Ids client = tok.encode(t, /*allow_added=*/false);
    for (int32_t id : client) EXPECT_FALSE(tok.is_added(id)) << nlohmann::json(t).dump() << " produced " << id;
    EXPECT_EQ(tok.decode(client), t);
    const Ids trusted = tok.encode(t, /*allow_added=*/true);
    bool any_added = false;
    for (int32_t id : trusted) any_added |= tok.is_added(id);
    EXPECT_TRUE(any_added) << nlohmann::json(t).dump();
  }
  // As text, "<｜User｜>" is the BPE of its characters: '<', '｜', 'User', '｜', '>'.
  EXPECT_EQ(tok.encode("<｜User｜>", false), (Ids{30, 28217, 6756, 28217, 32}));
  // Without added tokens in the text both modes agree.
  EXPECT_EQ(tok.encode("plain text, no markers", false), tok.encode("plain text, no markers", true));
}

TEST(Tokenizer, AddedTokenMatchingIsLeftmostLongest) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  // "<｜DSML｜" is not a token but contains "｜DSML｜"; "</think>" contains no shorter token.
  EXPECT_EQ(tok.encode("<｜DSML｜"), (Ids{30, 128825}));
  EXPECT_EQ(tok.encode("<think></think><think>"), (Ids{128821, 128822, 128821}));
  // Near misses stay text.
  const Ids near = tok.encode("<｜User|> <think > <｜place▁holder▁no▁7｜");
  for (int32_t id : near) EXPECT_FALSE(tok.is_added(id));
}

// ---- streaming ---------------------------------------------------------------------------------

TEST(StreamDecoder, NeverEmitsPartialUtf8) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  for (const auto& c : golden_cases()) {
    StreamDecoder sd(tok);
    std::string all;
    for (int32_t id : c.ids) {
      const std::string piece = sd.push(id);
      EXPECT_TRUE(dsx::text::utf8::is_valid(piece)) << hex(piece);
      all += piece;
    }
    all += sd.flush();
    EXPECT_EQ(all, tok.decode(c.ids)) << nlohmann::json(c.text).dump();
  }
  // 👍🏽 = 92526 (F0 9F 91 8D), 40965 (F0 9F 8F), 124 (BD).
  StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(92526), "\xF0\x9F\x91\x8D");
  EXPECT_EQ(sd.push(40965), "");
  EXPECT_EQ(sd.pending_bytes(), 3u);
  EXPECT_EQ(sd.push(124), "\xF0\x9F\x8F\xBD");
  EXPECT_EQ(sd.flush(), "");
  // ١٢٣٤ ends with 152 (D9), 100 (A4).
  StreamDecoder sd2(tok);
  EXPECT_EQ(sd2.push(152), "");
  EXPECT_EQ(sd2.push(100), "\xD9\xA4");
}

TEST(StreamDecoder, IllFormedBytesBecomeReplacementCharacters) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  StreamDecoder sd(tok);
  EXPECT_EQ(sd.push(40965), "");                        // F0 9F 8F: incomplete, held back
  EXPECT_EQ(sd.push(*tok.token_to_id("A")), "\xEF\xBF\xBD" "A");  // broken by 'A'
  EXPECT_EQ(sd.push(152), "");                          // D9
  EXPECT_EQ(sd.flush(), "\xEF\xBF\xBD");                // end of stream
  EXPECT_EQ(sd.flush(), "");
  StreamDecoder sd3(tok);
  EXPECT_EQ(sd3.push_bytes("\xFF" "a\xC0\xAF"), "\xEF\xBF\xBD" "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(sd3.push_bytes("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(sd3.push_bytes("\xE2\x82"), "");
  EXPECT_EQ(sd3.push_bytes("\xAC"), "\xE2\x82\xAC");
}

// ---- invalid input -----------------------------------------------------------------------------

TEST(Tokenizer, InvalidUtf8IsEncodedByteByByte) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  const std::vector<std::string> inputs = {"\xFF", "a\xFF" "b", "\xC3", "caf\xC3", "\xE2\x82", "\xF0\x9F\x91",
                                           "x\xED\xA0\x80y", "\xC0\xAF", "ok \xF5\x80\x80\x80 ok", "\x80\x80\x80"};
  for (const auto& s : inputs) {
    const Ids ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s) << hex(s);
  }
  // The valid runs around an ill-formed byte are encoded as if they stood alone.
  Ids expect = tok.encode("hello");
  expect.push_back(*tok.token_to_id("\xC3\xBF"));  // byte FF -> "ÿ"
  const Ids world = tok.encode(" world");
  expect.insert(expect.end(), world.begin(), world.end());
  EXPECT_EQ(tok.encode("hello\xFF world"), expect);
}

TEST(Tokenizer, LongPiecesAndRuns) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  std::string js;  // one 100 kB piece: minified code without spaces
  while (js.size() < 100000) js += "a=b[c++]+d*e;f(g,h);if(i){j=k}else{l=m};";
  const std::vector<std::string> texts = {std::string(200000, ' '),     std::string(200000, 'a'),
                                          std::string(100000, '\n'),    std::string(50000, '7'),
                                          js,                           std::string(150000, '.'),
                                          std::string(100000, ' ') + "x", "\xC2\xA0" + std::string(100000, ' ')};
  for (const auto& t : texts) {
    const Ids ids = tok.encode(t);
    EXPECT_EQ(tok.decode(ids), t) << t.size();
    EXPECT_LT(ids.size(), t.size() + 1);
  }
  std::string cjk;
  for (int i = 0; i < 20000; ++i) cjk += (i % 7 == 0) ? "\xE4\xB8\xAD" : "\xE6\x96\x87";  // 中文 run
  EXPECT_EQ(tok.decode(tok.encode(cjk)), cjk);
}

// ---- Oniguruma -> PCRE2 ---------------------------------------------------------------------------

TEST(Pretokenizer, OnigurumaClassesKeepTheirMeaning) {
  using dsx::text::onig_to_pcre2;
  using dsx::text::Regex;
  auto full_match = [](const std::string& onig, const std::string& subject) {
    const Regex re(onig_to_pcre2(onig, "test"), false, "test");
    size_t b = 0, e = 0;
    return re.search(subject, 0, &b, &e) && b == 0 && e == subject.size();
  };
  // \s: Oniguruma's Unicode white space (no U+180E, unlike PCRE2's UCP \s).
  for (const char* ws : {" ", "\t", "\n", "\x0B", "\x0C", "\r", "\xC2\x85", "\xC2\xA0", "\xE2\x80\x83", "\xE2\x80\xA8", "\xE3\x80\x80"})
    EXPECT_TRUE(full_match("\\s", ws)) << hex(ws);
  EXPECT_FALSE(full_match("\\s", "\xE1\xA0\x8E"));  // U+180E
  EXPECT_TRUE(full_match("\\S", "\xE1\xA0\x8E"));
  EXPECT_TRUE(full_match("[\\s\\d]+", " 7\xD9\xA3"));
  // Unicode 16.0 characters in their classes.
  EXPECT_TRUE(full_match("\\p{L}", "\xF0\x90\xB5\x90"));      // U+10D50 GARAY CAPITAL LETTER A
  EXPECT_TRUE(full_match("\\p{N}", "\xF0\x90\xB5\x80"));      // U+10D40 GARAY DIGIT ZERO
  EXPECT_TRUE(full_match("\\d", "\xF0\x90\xB5\x80"));
  EXPECT_TRUE(full_match("\\p{S}", "\xF0\x9F\xAB\xA8"));      // U+1FAE8 SHAKING FACE
  EXPECT_TRUE(full_match("[^\\p{S}]", "a"));
  EXPECT_FALSE(full_match("\\P{S}", "\xF0\x9F\xAB\xA8"));
  EXPECT_FALSE(full_match("\\p{^S}", "\xF0\x9F\xAB\xA8"));
  EXPECT_FALSE(full_match("\\p{L}", "\xF0\x90\xA5\x80"));     // U+10940: Unicode 17.0, unknown to HF too
  // \h is a hex digit in Oniguruma.
  EXPECT_TRUE(full_match("\\h+", "09afAF"));
  EXPECT_FALSE(full_match("\\h", " "));
  EXPECT_TRUE(full_match("[]a]+", "]a]"));
  EXPECT_THROW(onig_to_pcre2("[\\S]", "test"), dsx::Error);
  EXPECT_THROW(onig_to_pcre2("[a[b]]", "test"), dsx::Error);
  EXPECT_THROW(onig_to_pcre2("[a-z&&[^aeiou]]", "test"), dsx::Error);
  EXPECT_THROW(onig_to_pcre2("abc\\", "test"), dsx::Error);
  EXPECT_THROW(Regex("(", false, "test"), dsx::Error);
}

// ---- the BPE merge strategies --------------------------------------------------------------------------

TEST(Bpe, ScanAndHeapMergeAgree) {
  // A synthetic merge table over symbols 0..7; merged ids from 100 on.
  dsx::text::MergeTable m;
  std::mt19937 rng(42);
  int32_t next_id = 100, rank = 0;
  std::vector<int32_t> symbols = {0, 1, 2, 3, 4, 5, 6, 7};
  for (int k = 0; k < 60; ++k) {
    const int32_t a = symbols[rng() % symbols.size()], b = symbols[rng() % symbols.size()];
    if (m.find(a, b)) continue;
    m.set(a, b, rank++, next_id);
    symbols.push_back(next_id++);
  }
  for (int iter = 0; iter < 3000; ++iter) {
    std::vector<int32_t> s(1 + rng() % 120);
    for (auto& x : s) x = static_cast<int32_t>(rng() % 8);
    std::vector<int32_t> a = s, b = s;
    dsx::text::bpe_merge_scan(m, a);
    dsx::text::bpe_merge_heap(m, b);
    ASSERT_EQ(a, b);
  }
}

// ---- loader errors ------------------------------------------------------------------------------------

TEST(Tokenizer, LoaderErrorsNameTheFile) {
  const std::string dir = dsx_test::temp_dir("tokenizer_errors");
  auto expect_error = [&](const std::string& name, const std::string& text, const std::string& what) {
    const std::string path = dir + "/" + name;
    write_file(path, text);
    try {
      (void)Tokenizer::from_file(path);
      ADD_FAILURE() << name << ": no error";
    } catch (const dsx::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << msg;
      EXPECT_NE(msg.find(what), std::string::npos) << msg;
    }
  };
  expect_error("broken.json", "{\"model\": {\"type\": \"BPE\", ", "malformed JSON");
  expect_error("empty.json", "", "malformed JSON");
  expect_error("array.json", "[1, 2]", "JSON object");
  expect_error("nomodel.json", "{\"decoder\": {\"type\": \"ByteLevel\"}}", "model");
  expect_error("unigram.json", "{\"model\": {\"type\": \"Unigram\", \"vocab\": []}}", "not supported");
  expect_error("novocab.json", "{\"model\": {\"type\": \"BPE\", \"merges\": []}}", "model.vocab");
  expect_error("badid.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}", "vocab['a']");
  expect_error("nobytes.json", "{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}", "byte-level symbol");
  try {
    (void)Tokenizer::from_file(dir + "/does-not-exist.json");
    ADD_FAILURE() << "no error for a missing file";
  } catch (const dsx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("does-not-exist.json"), std::string::npos);
  }
  EXPECT_THROW((void)Tokenizer::from_model_dir(dir + "/no-such-dir"), dsx::Error);
}

// A small byte-level BPE tokenizer.json: the 256 byte symbols, three merges, one added
// token, the GPT-2 split (ByteLevel use_regex=true).
static nlohmann::json minimal_tokenizer() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) {
    std::string sym;
    dsx::text::utf8::append(sym, dsx::text::byte_level::byte_to_char(static_cast<uint8_t>(b)));
    vocab[sym] = b;
  }
  vocab["\xC4\xA0t"] = 256;  // "Ġt"
  vocab["he"] = 257;
  vocab["\xC4\xA0the"] = 258;
  nlohmann::json added = nlohmann::json::array();
  added.push_back({{"id", 259}, {"content", "<|end|>"}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                   {"normalized", false}, {"special", true}});
  return {{"version", "1.0"},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}}},
          {"model",
           {{"type", "BPE"},
            {"vocab", vocab},
            {"merges", {"\xC4\xA0 t", "h e", "\xC4\xA0t he"}}}}};
}

TEST(Tokenizer, MinimalTokenizerJson) {
  const Tokenizer tok = Tokenizer::from_json_text(minimal_tokenizer().dump(), "minimal");
  EXPECT_EQ(tok.size(), 260u);
  EXPECT_FALSE(tok.has_fast_paths());
  EXPECT_EQ(tok.encode(" the<|end|>"), (Ids{258, 259}));
  const Ids ids = tok.encode("the the");  // "the" " the" -> t he, Ġthe
  EXPECT_EQ(ids, (Ids{'t', 257, 258}));
  EXPECT_EQ(tok.decode(ids), "the the");
  EXPECT_EQ(tok.encode("<|end|>", false).size(), 7u);
  // Merges may also be written as pairs of strings (newer tokenizers.json files).
  auto j = minimal_tokenizer();
  using nlohmann::json;
  j["model"]["merges"] = json::array({json::array({"\xC4\xA0", "t"}), json::array({"h", "e"}), json::array({"\xC4\xA0t", "he"})});
  const Tokenizer pairs = Tokenizer::from_json_text(j.dump(), "minimal with pairs");
  EXPECT_EQ(pairs.encode("the the"), (Ids{'t', 257, 258}));
}

TEST(Tokenizer, LoaderRejectsUnsupportedConfigurations) {
  const std::string dir = dsx_test::temp_dir("tokenizer_unsupported");
  const nlohmann::json base = minimal_tokenizer();
  auto expect_error = [&](const char* name, const nlohmann::json& j, const std::string& what) {
    const std::string path = dir + "/" + name;
    write_file(path, j.dump());
    try {
      (void)Tokenizer::from_file(path);
      ADD_FAILURE() << name << ": no error";
    } catch (const dsx::Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  };
  auto j = base;
  j["normalizer"] = {{"type", "NFC"}};
  expect_error("nfc.json", j, "normalizer");
  j = base;
  j["decoder"] = {{"type", "Metaspace"}};
  expect_error("metaspace.json", j, "decoder");
  j = base;
  j["added_tokens"][0]["lstrip"] = true;
  expect_error("lstrip.json", j, "lstrip");
  j = base;
  j["added_tokens"][0]["content"] = "";
  expect_error("emptyadded.json", j, "content");
  j = base;
  j["pre_tokenizer"] = {{"type", "Sequence"},
                        {"pretokenizers",
                         {{{"type", "Split"}, {"pattern", {{"Regex", "[a-"}}}, {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  expect_error("badregex.json", j, "regex");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\s+";
  j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "MergedWithNext";
  expect_error("behavior.json", j, "behavior");
  j = base;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};
  expect_error("whitespace.json", j, "not supported");
  j = base;
  j["model"]["merges"][1] = "he";
  expect_error("badmerge.json", j, "merges[1]");
  j = base;
  j["model"]["merges"][2] = "\xC4\xA0 zzzz";
  expect_error("oovmerge.json", j, "not in the vocab");
  j = base;
  j["model"]["dropout"] = 0.1;
  expect_error("dropout.json", j, "dropout");
  j = base;
  j["model"]["vocab"]["x"] = {{"nested", 1}};
  expect_error("nestedvocab.json", j, "model.vocab['x']");
  j = base;
  j["model"]["vocab"]["x"] = -4;
  expect_error("negativeid.json", j, "model.vocab['x']");
  j = base;
  j["model"]["merges"][0] = nlohmann::json::array({"\xC4\xA0", 5});
  expect_error("pairmerge.json", j, "merges[0]");
  j = base;
  j["model"]["vocab"]["x"] = 5;  // id 5 is byte 0x05's symbol already
  expect_error("dupid.json", j, "two tokens with id 5");
}

// ---- the test-tokenizer builder ------------------------------------------------------------------------

TEST(TestTokenizerBuilder, V41IsByteIdenticalToGolden) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string built = dsx::text::build_v41_test_tokenizer(tok_dir() + "/tokenizer-v3-base.json");
  const std::string golden = read_file(tok_dir() + "/tokenizer-v41.json");
  ASSERT_EQ(built.size(), golden.size());
  EXPECT_TRUE(built == golden);
  // And it is a working tokenizer.
  const Tokenizer tok = Tokenizer::from_json_text(built, "built v4.1 tokenizer");
  EXPECT_EQ(tok.size(), 129280u);
  EXPECT_EQ(tok.encode("<｜System｜>hi<｜User｜>"), (Ids{128799, 6366, 128803}));
}

TEST(TestTokenizerBuilder, V4IsByteIdenticalToGolden) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string built =
      dsx::text::build_test_tokenizer(tok_dir() + "/tokenizer-v3-base.json", dsx::text::TestTokenizerProfile::kV4);
  EXPECT_TRUE(built == read_file(tok_dir() + "/tokenizer-v4.json"));
}

TEST(TestTokenizerBuilder, RejectsOtherFiles) {
  DSX_REQUIRE_GOLDEN(g);
  EXPECT_THROW(dsx::text::build_v41_test_tokenizer(tok_dir() + "/tokenizer-v41.json"), dsx::Error);
  const std::string dir = dsx_test::temp_dir("builder_errors");
  write_file(dir + "/bad.json", "{\"added_tokens\": [");
  try {
    dsx::text::build_v41_test_tokenizer(dir + "/bad.json");
    ADD_FAILURE() << "no error";
  } catch (const dsx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
  EXPECT_THROW(dsx::text::build_v41_test_tokenizer(dir + "/missing.json"), dsx::Error);
}

TEST(TestTokenizerBuilder, PythonJsonDumps) {
  // Expected output: Python 3.11 json.dumps(json.loads(src), ensure_ascii=False).
  const std::string src =
      R"({"a": 1.0, "b": [1e-05, 1.5e+16, 0.1, 100.0, 1e16, 123456789012345678.0, 0.0001, -2.5e-7, 12, -3], )"
      R"("c": "x\u0001\"\\\n\u00e9\u007f\t", "d": {}, "e": [], "f": null, "g": true})";
  const std::string want =
      "{\"a\": 1.0, \"b\": [1e-05, 1.5e+16, 0.1, 100.0, 1e+16, 1.2345678901234568e+17, 0.0001, -2.5e-07, 12, -3], "
      "\"c\": \"x\\u0001\\\"\\\\\\n\xC3\xA9\x7F\\t\", \"d\": {}, \"e\": [], \"f\": null, \"g\": true}";
  EXPECT_EQ(dsx::text::python_json_dumps(src, "test"), want);
  EXPECT_THROW(dsx::text::python_json_dumps("{\"a\": ", "test"), dsx::Error);
}
