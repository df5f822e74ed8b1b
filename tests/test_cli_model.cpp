// The project's checks call these exact CLI forms: `dsx logits` (both paths) and
// `dsx generate` on every V4.1 golden case, with the Engram map derived from the
// case's tokenizer.json.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "cli/golden_check.h"
#include "model/config.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

std::string dsx_binary() {
  const char* b = std::getenv("DSX_BUILD_DIR");
  return b ? std::string(b) + "/dsx" : "";
}

int run(const std::string& cmd, std::string* out = nullptr) {
  std::string full = cmd + " 2>&1";
  FILE* p = popen(full.c_str(), "r");
  if (!p) return -1;
  std::string s;
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
  int rc = pclose(p);
  if (out) *out = s;
  return WEXITSTATUS(rc);
}

int64_t leading(const float* got, const float* want, int64_t T, int64_t V) {
  int64_t n = 0;
  for (int64_t t = 0; t < T && row_rel_l2(got + t * V, want + t * V, V) <= 1e-3; ++t) n = t + 1;
  return n;
}

}  // namespace

TEST(CliModel, EngramMapFromTokenizerMatchesGolden) {
  DSX_REQUIRE_GOLDEN(gdir);
  for (const auto& e : std::filesystem::directory_iterator(gdir)) {
    const std::string dir = e.path().string();
    if (!is_v41_golden_case(dir)) continue;
    ModelConfig cfg = load_model_config(dir);
    auto map = load_engram_token_map(dir, cfg);
    SafetensorsFile g(dir + "/golden.safetensors");
    const auto& want = g.get("engram_token_map");
    ASSERT_GE(map.size(), static_cast<size_t>(want.numel()));
    for (int64_t i = 0; i < want.numel(); ++i) ASSERT_EQ(map[i], want.as<int32_t>()[i]) << dir << " id " << i;
  }
}

TEST(CliModel, LogitsAndGenerateOnGoldenCases) {
  DSX_REQUIRE_GOLDEN(gdir);
  const std::string bin = dsx_binary();
  if (bin.empty() || !file_exists(bin)) GTEST_SKIP() << "dsx binary not found (run through ctest)";
  const std::string tmp = dsx_test::temp_dir("cli_model");
  for (const auto& e : std::filesystem::directory_iterator(gdir)) {
    const std::string dir = e.path().string();
    if (!is_v41_golden_case(dir)) continue;
    auto cj = nlohmann::json::parse(read_text_file(dir + "/case.json"));
    const int64_t T0 = cj["T0"].get<int64_t>();
    const std::string ids = dir + "/golden.safetensors";
    ASSERT_EQ(0, run(bin + " logits -m " + dir + " --ids " + ids + " -o " + tmp + "/p.safetensors"));
    ASSERT_EQ(0, run(bin + " logits -m " + dir + " --ids " + ids + " --decode-from " + std::to_string(T0) + " -o " + tmp +
                     "/i.safetensors"));
    SafetensorsFile g(ids), p(tmp + "/p.safetensors"), inc(tmp + "/i.safetensors");
    const int64_t T = g.get("input_ids").numel();
    const int64_t V = p.get("logits").dim(1);
    ASSERT_EQ(p.get("logits").dim(0), T);
    const int64_t lp = leading(p.get("logits").as<float>(), g.get("logits_prefill").as<float>(), T, V);
    const int64_t li = leading(inc.get("logits").as<float>(), g.get("logits_incremental").as<float>(), T, V);
    std::printf("%s via CLI: prefill %lld/%lld, incremental %lld/%lld leading rows\n", dir.c_str(), (long long)lp,
                (long long)T, (long long)li, (long long)T);
    EXPECT_GE(lp, (T * 35 + 99) / 100);
    EXPECT_GE(li, std::max(T0 + 8, (T * 35 + 99) / 100));
    std::string out;
    ASSERT_EQ(0, run(bin + " generate -m " + dir + " --ids " + ids + " -n 8 --greedy", &out));
    std::istringstream is(out);
    int n = 0;
    for (int64_t x; is >> x; ++n) EXPECT_TRUE(x >= 0 && x < V);
    EXPECT_EQ(n, 8) << out;
  }
}

TEST(CliModel, ClearErrors) {
  const std::string bin = dsx_binary();
  if (bin.empty() || !file_exists(bin)) GTEST_SKIP() << "dsx binary not found (run through ctest)";
  std::string out;
  EXPECT_EQ(1, run(bin + " logits -m /nonexistent/model --ids /nonexistent/ids.safetensors -o /tmp/x", &out));
  EXPECT_NE(out.find("/nonexistent/ids.safetensors"), std::string::npos) << out;
  EXPECT_NE(0, run(bin + " logits --bogus-flag", &out));
  EXPECT_NE(out.find("--bogus-flag"), std::string::npos) << out;
  EXPECT_EQ(2, run(bin + " no-such-command", &out));
}
