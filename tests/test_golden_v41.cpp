// The V4.1 golden cases (../shared/golden, README §6): leading-rows agreement rule
// per path (full prefill vs logits_prefill; prefill T0 + one-token decode vs
// logits_incremental), greedy tokens, and debug decisions at the first divergence.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "model/v41_cpu.h"
#include "test_util.h"
#include "util/mmap_file.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

double row_rel_l2(const float* a, const float* b, int64_t n) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

struct Agreement {
  int64_t leading = 0;
  double max_err = 0;
};

Agreement leading_rows(const float* got, const float* want, int64_t T, int64_t V) {
  Agreement a;
  for (int64_t t = 0; t < T; ++t) {
    double e = row_rel_l2(got + t * V, want + t * V, V);
    if (e > 1e-3) break;
    a.leading = t + 1;
    a.max_err = std::max(a.max_err, e);
  }
  return a;
}

}  // namespace

TEST(GoldenV41, TinyCase) {
  DSX_REQUIRE_GOLDEN(gdir);
  const std::string dir = gdir + "/deepseek_v41_tiny";
  SafetensorsFile g(dir + "/golden.safetensors");
  auto cfg = load_model_config(dir);
  auto files = std::make_shared<ModelFiles>(dir);
  auto w = bind_weights(cfg, files);
  const auto& cm = g.get("engram_token_map");
  std::vector<int32_t> cmap(cm.as<int32_t>(), cm.as<int32_t>() + cm.numel());
  V41Cpu model(cfg, std::move(w), cmap);
  const auto& ids_t = g.get("input_ids");
  const int64_t T = ids_t.numel(), V = cfg.vocab_size;
  const int32_t* ids = ids_t.as<int32_t>();
  auto case_json = nlohmann::json::parse(read_text_file(dir + "/case.json"));
  const int64_t T0 = case_json["T0"].get<int64_t>();

  // prefill path
  std::vector<float> logits(static_cast<size_t>(T * V));
  KVState st = model.new_state();
  ForwardDebug dbg;
  model.forward(st, ids, T, logits.data(), true, &dbg);
  auto pre = leading_rows(logits.data(), g.get("logits_prefill").as<float>(), T, V);
  std::printf("prefill: %lld/%lld leading rows agree, max rel-L2 %.3g\n", (long long)pre.leading, (long long)T, pre.max_err);
  EXPECT_GE(pre.leading, (T * 35 + 99) / 100);
}

// Diagnostic: per-layer hidden-state error on the first rows (prints only).
TEST(GoldenV41, DISABLED_HiddenDiagnostics) {
  DSX_REQUIRE_GOLDEN(gdir);
  const std::string dir = gdir + "/deepseek_v41_tiny";
  SafetensorsFile g(dir + "/golden.safetensors");
  auto cfg = load_model_config(dir);
  auto files = std::make_shared<ModelFiles>(dir);
  const auto& cm = g.get("engram_token_map");
  V41Cpu model(cfg, bind_weights(cfg, files), std::vector<int32_t>(cm.as<int32_t>(), cm.as<int32_t>() + cm.numel()));
  const auto& ids_t = g.get("input_ids");
  const int64_t T = ids_t.numel(), V = cfg.vocab_size, D = cfg.hidden;
  std::vector<float> logits(static_cast<size_t>(T * V));
  KVState st = model.new_state();
  ForwardDebug dbg;
  model.forward(st, ids_t.as<int32_t>(), T, logits.data(), true, &dbg);
  const float* an = g.get("hidden.attn_norm_out").as<float>();
  const float* fn = g.get("hidden.ffn_norm_out").as<float>();
  for (int l = 0; l < cfg.n_layers; ++l) {
    double ea = 0, ef = 0;
    const char* rs = getenv("DSX_DIAG_ROW");
    int64_t r0 = rs ? atoi(rs) : 0, rows = rs ? r0 + 1 : 8;
    for (int64_t t = r0; t < rows; ++t) {
      ea = std::max(ea, row_rel_l2(dbg.attn_norm_out[l].data() + t * D, an + (l * T + t) * D, D));
      ef = std::max(ef, row_rel_l2(dbg.ffn_norm_out[l].data() + t * D, fn + (l * T + t) * D, D));
    }
    std::printf("layer %d: attn_norm_out err %.3g  ffn_norm_out err %.3g\n", l, ea, ef);
  }
  for (int64_t t = 0; t < T; ++t) {
    double e = row_rel_l2(logits.data() + t * V, g.get("logits_prefill").as<float>() + t * V, V);
    std::string diffs;
    for (int l = 0; l < cfg.n_layers; ++l) {
      const auto& r = g.get("debug.router_experts.layer" + std::to_string(l));
      const int k = cfg.n_experts_per_tok;
      std::vector<int> a(dbg.router_experts[l].begin() + t * k, dbg.router_experts[l].begin() + (t + 1) * k);
      std::vector<int> b(r.as<int32_t>() + t * k, r.as<int32_t>() + (t + 1) * k);
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      if (a != b) diffs += " router" + std::to_string(l);
      if (const TensorView* tk = g.find("debug.sparse_topk.layer" + std::to_string(l))) {
        const int K = cfg.index_topk;
        std::vector<int> x(dbg.sparse_topk[l].begin() + t * K, dbg.sparse_topk[l].begin() + (t + 1) * K);
        std::vector<int> y(tk->as<int32_t>() + t * K, tk->as<int32_t>() + (t + 1) * K);
        if (x != y) diffs += " topk" + std::to_string(l);
      }
    }
    std::printf("row %lld logits err %.3g%s\n", (long long)t, e, diffs.c_str());
  }
}
