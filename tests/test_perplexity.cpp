// dsx perplexity and dsx engram-cmap, run as the CLI:
//   - engram-cmap writes the golden's token map (the V4.1 release tokenizer's map of
//     ../shared/golden/tokenizer and each golden case's engram_token_map);
//   - perplexity's numbers equal the log-likelihood computed here from the engine's
//     logits of the same windows (BOS + window, one fresh session each), its bits per
//     byte the total in bits over the file's bytes, for one window and for many.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cli/golden_check.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "text/tokenizer.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

std::string dsx_binary() {
  const char* b = std::getenv("DSX_BUILD_DIR");
  return b && std::filesystem::exists(std::string(b) + "/dsx") ? std::string(b) + "/dsx" : "";
}

int run(const std::string& cmd, std::string* out) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return -1;
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
  const int rc = pclose(p);
  *out = s;
  return WEXITSTATUS(rc);
}

std::map<std::string, double> parse_lines(const std::string& out) {
  std::map<std::string, double> m;
  std::istringstream in(out);
  std::string k;
  double v;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream l(line);
    if (l >> k >> v) m[k] = v;
  }
  return m;
}

// Sum of -log p(token) over the windows, from the engine's all-row logits.
double reference_total_nll(Engine& e, const std::vector<int32_t>& ids, int64_t ctx) {
  const int64_t V = e.config().vocab_size, win = ctx - 1;
  double total = 0;
  for (size_t w0 = 0; w0 < ids.size(); w0 += static_cast<size_t>(win)) {
    const size_t w1 = std::min(ids.size(), w0 + static_cast<size_t>(win));
    std::vector<int32_t> rows = {e.config().bos_id};
    rows.insert(rows.end(), ids.begin() + static_cast<std::ptrdiff_t>(w0), ids.begin() + static_cast<std::ptrdiff_t>(w1) - 1);
    std::vector<float> l(rows.size() * static_cast<size_t>(V));
    auto s = e.new_session();
    s->feed(rows.data(), static_cast<int64_t>(rows.size()), l.data(), true);
    for (size_t r = 0; r < rows.size(); ++r) {
      const float* row = l.data() + r * static_cast<size_t>(V);
      long double z = 0;
      for (int64_t i = 0; i < V; ++i) z += std::exp(static_cast<long double>(row[i]));
      total += static_cast<double>(std::log(z) - static_cast<long double>(row[ids[w0 + r]]));
    }
  }
  return total;
}

}  // namespace

TEST(Perplexity, MatchesTheEnginesLogLikelihood) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string bin = dsx_binary();
  if (bin.empty()) GTEST_SKIP() << "dsx binary not found";
  const std::string dir = g + "/deepseek_v41_tiny";
  const std::string tmp = dsx_test::temp_dir("perplexity");
  // (the case's tokenizer is larger than its model's vocabulary: a text made of pieces
  // of low ids whose encoding stays inside it)
  const text::Tokenizer tok = text::Tokenizer::from_model_dir(dir);
  auto eng = load_engine(dir, EngineOptions{});
  const int32_t V = static_cast<int32_t>(eng->config().vocab_size);
  std::string text;
  for (int32_t id = 200; id < V && text.size() < 400; id += 11) {
    const std::string piece = tok.decode({id});
    bool ascii = !piece.empty();
    for (unsigned char c : piece) ascii = ascii && c >= 32 && c < 127;
    if (!ascii) continue;
    bool inside = true;
    for (int32_t t : tok.encode(text + piece + "\n", false)) inside = inside && t < V;
    if (inside) text += piece + (id % 3 ? "" : "\n");
  }
  { std::ofstream(tmp + "/t.txt", std::ios::binary) << text; }
  const std::vector<int32_t> ids = tok.encode(text, false);
  for (int32_t t : ids) ASSERT_LT(t, V);
  ASSERT_GT(ids.size(), 40u);
  for (int64_t ctx : {int64_t{4096}, int64_t{9}}) {
    std::string out;
    ASSERT_EQ(run(bin + " perplexity --quiet -m " + dir + " -f " + tmp + "/t.txt --ctx " + std::to_string(ctx), &out), 0)
        << out;
    const auto m = parse_lines(out);
    ASSERT_EQ(m.count("tokens") + m.count("bytes") + m.count("nll") + m.count("perplexity") + m.count("bits_per_byte"), 5u)
        << out;
    const double total = reference_total_nll(*eng, ids, ctx);
    EXPECT_EQ(m.at("tokens"), static_cast<double>(ids.size()));
    EXPECT_EQ(m.at("bytes"), static_cast<double>(text.size()));
    EXPECT_NEAR(m.at("nll"), total / static_cast<double>(ids.size()), 2e-6) << "ctx " << ctx;
    EXPECT_NEAR(m.at("perplexity"), std::exp(total / static_cast<double>(ids.size())), 1e-4 * m.at("perplexity"));
    EXPECT_NEAR(m.at("bits_per_byte"), total / std::log(2.0) / static_cast<double>(text.size()), 2e-6);
  }
  // bad input: named
  std::string out;
  EXPECT_NE(run(bin + " perplexity -m " + dir + " -f " + tmp + "/missing.txt", &out), 0);
  EXPECT_NE(out.find("missing.txt"), std::string::npos) << out;
  EXPECT_NE(run(bin + " perplexity -m " + dir + " -f " + tmp + "/t.txt --ctx 1", &out), 0);
  EXPECT_NE(out.find("--ctx"), std::string::npos) << out;
  EXPECT_EQ(run(bin + " perplexity --help", &out), 0);
  EXPECT_NE(out.find("bits_per_byte"), std::string::npos) << out;
}

TEST(EngramCmapCli, WritesTheGoldensMaps) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string bin = dsx_binary();
  if (bin.empty()) GTEST_SKIP() << "dsx binary not found";
  const std::string tmp = dsx_test::temp_dir("engram_cmap_cli");
  std::string out;
  // the release tokenizer's map, made by the reference's tokenizers library
  ASSERT_EQ(run(bin + " engram-cmap --tokenizer " + g + "/tokenizer/tokenizer-v41.json -o " + tmp + "/v41.safetensors", &out),
            0)
      << out;
  {
    SafetensorsFile got(tmp + "/v41.safetensors"), want(g + "/tokenizer/engram-cmap-v41.safetensors");
    const auto& a = got.get("cmap");
    const auto& b = want.get("cmap");
    ASSERT_EQ(a.numel(), b.numel());
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.as<int32_t>()[i], b.as<int32_t>()[i]) << "id " << i;
    EXPECT_EQ(got.get("n_keys").as<int32_t>()[0], want.get("n_keys").as<int32_t>()[0]);
  }
  // each V4.1 golden case's map, from its model directory
  for (const auto& e : std::filesystem::directory_iterator(g)) {
    const std::string dir = e.path().string();
    if (!is_v41_golden_case(dir)) continue;
    ASSERT_EQ(run(bin + " engram-cmap -m " + dir + " -o " + tmp + "/case.safetensors", &out), 0) << out;
    SafetensorsFile got(tmp + "/case.safetensors"), want(dir + "/golden.safetensors");
    const auto& a = got.get("cmap");
    const auto& b = want.get("engram_token_map");
    ASSERT_GE(a.numel(), b.numel()) << dir;
    for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(a.as<int32_t>()[i], b.as<int32_t>()[i]) << dir << " id " << i;
  }
  EXPECT_NE(run(bin + " engram-cmap -o " + tmp + "/x.safetensors", &out), 0);
  EXPECT_NE(out.find("--tokenizer"), std::string::npos) << out;
}
