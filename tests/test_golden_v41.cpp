// Every V4.1 golden case under ../shared/golden passes the leading-rows rule of
// README §6 on the CPU engine (prefill path and incremental path), with the
// greedy rule when the prefill agrees on every row.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>

#include "cli/golden_check.h"
#include "model/v41_cpu.h"
#include "runtime/cpu_engine.h"
#include "test_util.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

// A CPU engine over a golden case directory that uses the case's recorded
// engram_token_map (the tokenizer-derived map is checked separately).
std::unique_ptr<Engine> golden_engine(const std::string& dir) {
  SafetensorsFile g(dir + "/golden.safetensors");
  const auto& cm = g.get("engram_token_map");
  ModelConfig cfg = load_model_config(dir);
  return make_cpu_engine(std::make_unique<V41Cpu>(cfg, bind_weights(cfg, std::make_shared<ModelFiles>(dir)),
                                                  std::vector<int32_t>(cm.as<int32_t>(), cm.as<int32_t>() + cm.numel())));
}

}  // namespace

TEST(GoldenV41, AllCasesLeadingRows) {
  DSX_REQUIRE_GOLDEN(gdir);
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(gdir)) {
    const std::string dir = e.path().string();
    if (!e.is_directory() || !is_v41_golden_case(dir)) continue;
    ++n;
    auto eng = golden_engine(dir);
    GoldenReport r = check_golden_case(dir, *eng, true);
    std::printf("%s\n", r.summary().c_str());
    EXPECT_TRUE(r.prefill.ok()) << r.summary();
    EXPECT_TRUE(r.incremental.ok()) << r.summary();
    EXPECT_TRUE(r.greedy_ok) << r.summary();
    // rows that agree do so at fp32 accumulation-noise level
    EXPECT_LT(r.prefill.max_err, 1e-3);
  }
  EXPECT_GT(n, 0) << "no V4.1 golden case found in " << gdir;
}
