// Tokenizer encoding throughput, single thread, on generated English prose, source
// code and CJK text (all synthesised here; no third-party corpora).
//
//   bench_tokenizer [--tokenizer FILE] [--mb N] [--seconds S] [--corpus prose|code|cjk]
//
// FILE defaults to the golden tokenizer-v3-base.json when ../shared/golden exists.
// For each corpus: "cold" = first encode with an empty piece cache; "warm" = best of
// repeated encodes (steady state of a long-running server); also decode throughput.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "text/tokenizer.h"
#include "util/error.h"

namespace {

using Clock = std::chrono::steady_clock;

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  size_t below(size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <typename T, size_t N>
  const T& pick(const T (&a)[N]) { return a[below(N)]; }

 private:
  std::mt19937_64 rng_;
};

const char* const kWords[] = {
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "on", "be", "at", "by",
    "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you", "were",
    "her", "all", "she", "there", "would", "their", "we", "him", "been", "has", "when", "who", "will",
    "more", "no", "if", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "can",
    "only", "other", "new", "some", "could", "time", "these", "two", "may", "then", "do", "first", "any",
    "my", "now", "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also",
    "did", "many", "before", "must", "through", "back", "years", "where", "much", "your", "way", "well",
    "down", "should", "because", "each", "just", "those", "people", "how", "too", "little", "state",
    "good", "very", "make", "world", "still", "own", "see", "men", "work", "long", "get", "here",
    "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while",
    "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came",
    "right", "used", "take", "three", "river", "morning", "window", "question", "government", "history",
    "understanding", "experiment", "remarkable", "particularly", "nevertheless", "architecture",
    "conversation", "temperature", "announcement", "extraordinary", "responsibility", "philosophy"};
const char* const kNames[] = {"Alice", "Bob", "London", "Paris", "Monday", "September", "Dr. Smith",
                              "the Committee", "Mount Everest", "the Atlantic"};

std::string make_prose(size_t bytes, uint64_t seed) {
  Gen g(seed);
  std::string s;
  while (s.size() < bytes) {
    const size_t sentences = 3 + g.below(5);
    for (size_t k = 0; k < sentences; ++k) {
      const size_t words = 6 + g.below(18);
      for (size_t w = 0; w < words; ++w) {
        std::string word = g.chance(0.05) ? g.pick(kNames) : g.pick(kWords);
        if (w == 0) word[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(word[0])));
        if (w) s += ' ';
        if (g.chance(0.02)) s += '"';
        s += word;
        if (g.chance(0.02)) s += g.chance(0.5) ? "'s" : "n't";
        if (g.chance(0.01)) s += std::to_string(g.below(3000));
        if (w + 1 < words && g.chance(0.07)) s += g.chance(0.8) ? "," : ";";
      }
      s += g.chance(0.85) ? ". " : (g.chance(0.5) ? "? " : "! ");
    }
    s += "\n\n";
  }
  return s;
}

const char* const kIdents[] = {"count", "buffer", "index", "result", "value", "node", "config", "path",
                               "items", "offset", "length", "parser", "token", "stream", "handler", "cache",
                               "data", "size", "next", "error"};
const char* const kTypes[] = {"int", "size_t", "std::string", "double", "bool", "auto", "uint32_t",
                              "std::vector<int>"};

std::string make_code(size_t bytes, uint64_t seed) {
  Gen g(seed);
  std::string s;
  int fn = 0;
  while (s.size() < bytes) {
    const bool py = g.chance(0.4);
    if (py) {
      s += "def ";
      s += g.pick(kIdents);
      s += "_" + std::to_string(fn++) + "(self, " + g.pick(kIdents) + ", " + g.pick(kIdents) + "=None):\n";
      s += "    \"\"\"Return the " + std::string(g.pick(kWords)) + " " + g.pick(kIdents) + ".\"\"\"\n";
      const size_t lines = 3 + g.below(10);
      for (size_t l = 0; l < lines; ++l) {
        const std::string ind(4 * (1 + g.below(3)), ' ');
        switch (g.below(5)) {
          case 0: s += ind + "if " + g.pick(kIdents) + " is None:\n" + ind + "    return []\n"; break;
          case 1: s += ind + "for i, " + g.pick(kIdents) + " in enumerate(self." + g.pick(kIdents) + "):\n"; break;
          case 2: s += ind + g.pick(kIdents) + " = self._" + g.pick(kIdents) + "[i] + " + std::to_string(g.below(100)) + "\n"; break;
          case 3: s += ind + "# " + g.pick(kWords) + " " + g.pick(kWords) + " " + g.pick(kWords) + "\n"; break;
          default: s += ind + "print(f\"{" + std::string(g.pick(kIdents)) + "!r}: {len(" + g.pick(kIdents) + ")}\")\n";
        }
      }
      s += "\n";
    } else {
      s += "static ";
      s += g.pick(kTypes);
      s += " ";
      s += g.pick(kIdents);
      s += "_" + std::to_string(fn++) + "(const " + g.pick(kTypes) + "& " + g.pick(kIdents) + ", " + g.pick(kTypes) + " " + g.pick(kIdents) + ") {\n";
      const size_t lines = 3 + g.below(10);
      for (size_t l = 0; l < lines; ++l) {
        const std::string ind(2 * (1 + g.below(3)), ' ');
        switch (g.below(5)) {
          case 0: s += ind + "if (" + g.pick(kIdents) + " == nullptr) return {};\n"; break;
          case 1: s += ind + "for (size_t i = 0; i < " + g.pick(kIdents) + ".size(); ++i) {\n" + ind + "  " + g.pick(kIdents) + " += " + g.pick(kIdents) + "[i] * 0x" + std::to_string(g.below(255)) + ";\n" + ind + "}\n"; break;
          case 2: s += ind + g.pick(kIdents) + "->" + g.pick(kIdents) + "(" + std::to_string(g.below(1000)) + ", &" + g.pick(kIdents) + ");\n"; break;
          case 3: s += ind + "// TODO(" + std::string(g.pick(kNames)) + "): " + g.pick(kWords) + " " + g.pick(kWords) + "\n"; break;
          default: s += "\treturn std::min<" + std::string(g.pick(kTypes)) + ">(" + g.pick(kIdents) + ", " + g.pick(kIdents) + " >> 2);\n";
        }
      }
      s += "}\n\n";
    }
  }
  return s;
}

// Common Chinese characters, kana and CJK punctuation (UTF-8 strings).
const char* const kHan[] = {"的", "一", "是", "不", "了", "人", "我", "在", "有", "他", "这", "中", "大", "来", "上",
                            "国", "个", "到", "说", "们", "为", "子", "和", "你", "地", "出", "道", "也", "时", "年",
                            "得", "就", "那", "要", "下", "以", "生", "会", "自", "着", "去", "之", "过", "家", "学",
                            "对", "可", "她", "里", "后", "小", "么", "心", "多", "天", "而", "能", "好", "都", "然",
                            "没", "日", "于", "起", "还", "发", "成", "事", "只", "作", "当", "想", "看", "文", "无",
                            "开", "手", "十", "用", "主", "行", "方", "又", "如", "前", "所", "本", "见", "经", "头"};
const char* const kKana[] = {"の", "に", "は", "を", "た", "が", "で", "て", "と", "し", "れ", "さ", "ある", "いる",
                             "する", "から", "です", "ます", "コンピュータ", "データ", "システム", "東京", "日本"};
const char* const kCjkPunct[] = {"，", "。", "、", "！", "？", "「", "」", "：", "（", "）"};

std::string make_cjk(size_t bytes, uint64_t seed) {
  Gen g(seed);
  std::string s;
  while (s.size() < bytes) {
    const bool ja = g.chance(0.3);
    const size_t n = 8 + g.below(30);
    for (size_t i = 0; i < n; ++i) {
      s += ja && g.chance(0.5) ? g.pick(kKana) : g.pick(kHan);
      if (g.chance(0.08)) s += g.pick(kCjkPunct);
      if (g.chance(0.01)) s += std::to_string(g.below(2030));
    }
    s += ja ? "。" : (g.chance(0.8) ? "。" : "！");
    if (g.chance(0.2)) s += "\n";
  }
  return s;
}

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct Result {
  double cold_mbs, warm_mbs, decode_mbs, bytes_per_token;
};

Result measure(const dsx::text::Tokenizer& tok, const std::string& text, double budget_s) {
  const double mb = static_cast<double>(text.size()) / 1e6;
  tok.clear_cache();
  auto t0 = Clock::now();
  std::vector<int32_t> ids = tok.encode(text);
  const double cold = seconds_since(t0);
  double best = 1e30;
  const auto start = Clock::now();
  int reps = 0;
  while (reps < 3 || (seconds_since(start) < budget_s && reps < 50)) {
    t0 = Clock::now();
    ids = tok.encode(text);
    best = std::min(best, seconds_since(t0));
    ++reps;
  }
  double best_dec = 1e30;
  for (int r = 0; r < 3; ++r) {
    t0 = Clock::now();
    const std::string back = tok.decode(ids);
    best_dec = std::min(best_dec, seconds_since(t0));
    if (back != text) dsx::fail("decode(encode(text)) differs from the text");
  }
  return {mb / cold, mb / best, mb / best_dec, static_cast<double>(text.size()) / static_cast<double>(ids.size())};
}

}  // namespace

int main(int argc, char** argv) {
  std::string path, only;
  double mb = 4, seconds = 2;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--tokenizer")
      path = value();
    else if (a == "--mb")
      mb = std::stod(value());
    else if (a == "--seconds")
      seconds = std::stod(value());
    else if (a == "--corpus")
      only = value();
    else {
      std::fprintf(stderr, "usage: bench_tokenizer [--tokenizer FILE] [--mb N] [--seconds S] [--corpus prose|code|cjk]\n");
      return 2;
    }
  }
  if (path.empty()) {
    for (const char* cand : {"../shared/golden/tokenizer/tokenizer-v3-base.json",
                             "../../shared/golden/tokenizer/tokenizer-v3-base.json"})
      if (std::filesystem::exists(cand)) {
        path = cand;
        break;
      }
    if (path.empty()) {
      std::fprintf(stderr, "no tokenizer given (--tokenizer FILE) and the golden tokenizer was not found\n");
      return 2;
    }
  }
  try {
    auto t0 = Clock::now();
    const auto tok = dsx::text::Tokenizer::from_file(path);
    std::printf("tokenizer %s: %zu ids, loaded in %.3f s\n", path.c_str(), tok.size(), seconds_since(t0));
    const size_t bytes = static_cast<size_t>(mb * 1e6);
    struct Corpus {
      const char* name;
      const char* key;
      std::string (*make)(size_t, uint64_t);
    };
    const Corpus corpora[] = {{"english prose", "prose", make_prose},
                              {"source code", "code", make_code},
                              {"CJK text", "cjk", make_cjk}};
    std::printf("%-14s %8s %10s %10s %10s %10s\n", "corpus", "MB", "cold MB/s", "warm MB/s", "dec MB/s", "bytes/tok");
    uint64_t seed = 0;
    for (const auto& c : corpora) {
      ++seed;
      if (!only.empty() && only != c.key) continue;
      const std::string text = c.make(bytes, seed);
      const Result r = measure(tok, text, seconds);
      std::printf("%-14s %8.2f %10.1f %10.1f %10.1f %10.2f\n", c.name, static_cast<double>(text.size()) / 1e6,
                  r.cold_mbs, r.warm_mbs, r.decode_mbs, r.bytes_per_token);
    }
  } catch (const dsx::Error& e) {
    std::fprintf(stderr, "bench_tokenizer: %s\n", e.what());
    return 1;
  }
  return 0;
}
