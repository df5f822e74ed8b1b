// Engram compressed token map (model-v41.md §3.2.1) against the goldens.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>

#include "test_util.h"
#include "text/engram_cmap.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/safetensors.h"

using dsx::text::Tokenizer;

namespace {

std::string tok_dir() { return dsx_test::golden_dir() + "/tokenizer"; }

const Tokenizer& tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& t = cache[name];
  if (!t) t = std::make_unique<Tokenizer>(Tokenizer::from_file(tok_dir() + "/" + name));
  return *t;
}

void expect_equal_to_golden(const std::vector<int32_t>& cmap, int32_t n_keys, const std::string& golden_path) {
  const dsx::SafetensorsFile f(golden_path);
  const auto& c = f.get("cmap");
  ASSERT_EQ(c.dtype, dsx::DType::I32);
  ASSERT_EQ(c.numel(), static_cast<int64_t>(cmap.size()));
  EXPECT_EQ(n_keys, f.get("n_keys").as<int32_t>()[0]);
  size_t diffs = 0, first = 0;
  for (size_t i = 0; i < cmap.size(); ++i)
    if (cmap[i] != c.as<int32_t>()[i] && diffs++ == 0) first = i;
  EXPECT_EQ(diffs, 0u) << "first difference at id " << first;
}

}  // namespace

TEST(EngramCmap, V41MatchesGolden) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  const auto t0 = std::chrono::steady_clock::now();
  int32_t n_keys = 0;
  const auto cmap = dsx::text::build_engram_token_map(tok, &n_keys);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ info     ] engram map of 129280 ids built in %.3f s\n", s);
  ASSERT_EQ(cmap.size(), 129280u);
  EXPECT_EQ(n_keys, 99092);
  EXPECT_EQ(cmap[2], 2);  // pad
  expect_equal_to_golden(cmap, n_keys, tok_dir() + "/engram-cmap-v41.safetensors");
}

TEST(EngramCmap, V4MatchesGolden) {
  DSX_REQUIRE_GOLDEN(g);
  int32_t n_keys = 0;
  const auto cmap = dsx::text::build_engram_token_map(tokenizer("tokenizer-v4.json"), &n_keys);
  EXPECT_EQ(n_keys, 99092);
  expect_equal_to_golden(cmap, n_keys, tok_dir() + "/engram-cmap-v4.safetensors");
}

TEST(EngramCmap, TinyModelCaseMap) {
  // golden.safetensors of the V4.1 case holds the map for the ids below its vocab size,
  // derived from the case directory's tokenizer.json.
  DSX_REQUIRE_GOLDEN(g);
  const std::string dir = g + "/deepseek_v41_tiny";
  const Tokenizer tok = Tokenizer::from_model_dir(dir);
  int32_t n_keys = 0;
  const auto cmap = dsx::text::build_engram_token_map(tok, &n_keys);
  const dsx::SafetensorsFile f(dir + "/golden.safetensors");
  const auto& m = f.get("engram_token_map");
  ASSERT_LE(static_cast<size_t>(m.numel()), cmap.size());
  for (int64_t i = 0; i < m.numel(); ++i) ASSERT_EQ(cmap[i], m.as<int32_t>()[i]) << "id " << i;
}

TEST(EngramCmap, NormalizerSteps) {
  using dsx::text::engram_normalize;
  EXPECT_EQ(engram_normalize("Hello"), "hello");
  EXPECT_EQ(engram_normalize("  Hello\t\n World "), "hello world");
  EXPECT_EQ(engram_normalize(" "), " ");       // a lone space is kept
  EXPECT_EQ(engram_normalize("\t"), " ");      // ... also when it came from a blank run
  EXPECT_EQ(engram_normalize("\n\n"), " ");
  EXPECT_EQ(engram_normalize("\xC2\xA0"), " ");  // NBSP -> NFKC " " -> a lone space
  EXPECT_EQ(engram_normalize("\xC2\xA0x\xE2\x80\x83"), "x");  // NBSP, EM SPACE -> " x " -> stripped
  EXPECT_EQ(engram_normalize(""), "");
  EXPECT_EQ(engram_normalize("\xC3\x89" "cole"), "ecole");                 // É: accent stripped
  EXPECT_EQ(engram_normalize("\xEF\xAC\x81"), "fi");                       // ﬁ: NFKC
  EXPECT_EQ(engram_normalize("\xEF\xBC\xA1\xEF\xBC\xA2"), "ab");           // fullwidth ＡＢ
  EXPECT_EQ(engram_normalize("\xC4\xB0stanbul"), "istanbul");               // İ -> I + U+0307 -> i
  EXPECT_EQ(engram_normalize("\xCE\xA3\xCE\x9F\xCE\xA3"), "\xCF\x83\xCE\xBF\xCF\x83");  // ΣΟΣ: no final sigma
  EXPECT_EQ(engram_normalize("\xE0\xA4\x95\xE0\xA4\xBE"), "\xE0\xA4\x95");  // का: Mc vowel sign stripped
  EXPECT_EQ(engram_normalize("a\xCC\x81 \xCC\x81 b"), "a b");              // marks inside a blank run
  EXPECT_EQ(engram_normalize("x\xEE\x80\x80y"), "x y");                    // U+E000 (the sentinel) -> space
  EXPECT_EQ(engram_normalize("\xE3\x80\x80x\xE3\x80\x80"), "x");           // ideographic space stripped
}

// HF's NFKC / NFD / StripAccents use Unicode 9.0 tables and its Lowercase Unicode 17.0
// (expected values from tokenizers 0.23.2's normalizers).
TEST(EngramCmap, NormalizerUnicodeVersionsOfTheReference) {
  using dsx::text::engram_normalize;
  EXPECT_EQ(engram_normalize("a\u1CF7b"), "a\u1CF7b");            // mark of Unicode 10.0: not stripped
  EXPECT_EQ(engram_normalize("a\u08D4b"), "ab");                   // mark of Unicode 9.0: stripped
  EXPECT_EQ(engram_normalize("a\u1CF2b"), "ab");                   // Mc in 9.0, Lo since 10.0
  EXPECT_EQ(engram_normalize("a\U000111C9b"), "a\U000111C9b");    // Po in 9.0, Mn since 11.0
  EXPECT_EQ(engram_normalize("\U0001FBF0"), "\U0001FBF0");        // compatibility digit of 13.0: unmapped
  EXPECT_EQ(engram_normalize("\uA7F2"), "\uA7F2");                // modifier letter of 14.0: unmapped
  EXPECT_EQ(engram_normalize("\U00011935\U00011930"), "\U00011935\U00011930");  // no 13.0 composition
  EXPECT_EQ(engram_normalize("\u1C89"), "\u1C8A");                // lowercase pair of 16.0
  EXPECT_EQ(engram_normalize("\U00016EA0"), "\U00016EBB");        // lowercase pair of 17.0
}

TEST(EngramCmap, KeysOfPartialUtf8TokensAreVocabStrings) {
  DSX_REQUIRE_GOLDEN(g);
  const Tokenizer& tok = tokenizer("tokenizer-v41.json");
  EXPECT_EQ(dsx::text::engram_key(tok, 152), tok.id_to_token(152));      // byte D9
  EXPECT_EQ(dsx::text::engram_key(tok, 40965), tok.id_to_token(40965));  // F0 9F 8F
  EXPECT_EQ(dsx::text::engram_key(tok, 223), " ");                       // "Ġ" decodes to a lone space
  EXPECT_EQ(dsx::text::engram_key(tok, 128803), "<|user|>");  // NFKC: U+FF5C -> '|'
}

TEST(EngramCmap, TokenizerFileHash) {
  DSX_REQUIRE_GOLDEN(g);
  EXPECT_EQ(dsx::text::sha256_file_hex(tok_dir() + "/tokenizer-v41.json"),
            "49bf9d4c789b0c4b644dd2d5b20e21154f98f5923c0a8a3c8686b04f30e0af35");
}
