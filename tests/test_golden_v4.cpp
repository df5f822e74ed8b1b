// The V4 golden case (../shared/golden/deepseek_v4_tiny, README §1, §2a, §6) on the
// V4 CPU engine: leading-rows rule for the prefill and the incremental path, the
// greedy rule when the prefill agrees on every row, and — where a path diverges
// before its end — proof that the divergence is a rounding flip and not a bug: the
// golden's hidden states and debug tensors (router experts, indexer top-k) agree at
// f32-noise level up to the divergent row, the golden's hidden states locate the
// sublayer where it starts, and in that sublayer one QA8 input element lies within
// f32 noise of an e4m3 rounding boundary; rounding it the other way removes the
// divergence. Also the RoPE tables against the reference's recorded frequencies and
// the CLI (`dsx logits`, `dsx generate`) on the V4 directory.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "cli/golden_check.h"
#include "model/rope.h"
#include "model/v4_cpu.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/numerics.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

std::vector<std::string> v4_cases() {
  std::vector<std::string> out;
  const std::string g = dsx_test::golden_dir();
  if (g.empty()) return out;
  for (const auto& e : std::filesystem::directory_iterator(g))
    if (e.is_directory() && is_v4_golden_case(e.path().string())) out.push_back(e.path().string());
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int32_t> sorted_row(const int32_t* p, int64_t k) {
  std::vector<int32_t> v(p, p + k);
  std::sort(v.begin(), v.end());
  return v;
}

// Shared prefill of a case with decisions and hidden states captured.
struct Captured {
  ModelConfig cfg;
  std::unique_ptr<V4Cpu> model;
  std::vector<float> logits;
  ForwardDebug dbg;
};

Captured& captured(const std::string& dir) {
  static std::map<std::string, std::unique_ptr<Captured>> cache;
  auto& c = cache[dir];
  if (!c) {
    c = std::make_unique<Captured>();
    c->cfg = load_model_config(dir);
    c->model = std::make_unique<V4Cpu>(c->cfg, bind_weights_v4(c->cfg, std::make_shared<ModelFiles>(dir)));
    SafetensorsFile g(dir + "/golden.safetensors");
    const auto& ids = g.get("input_ids");
    KVState st = c->model->new_state();
    c->logits.resize(static_cast<size_t>(ids.numel() * c->cfg.vocab_size));
    c->model->forward(st, ids.as<int32_t>(), ids.numel(), c->logits.data(), true, &c->dbg);
  }
  return *c;
}

}  // namespace

TEST(GoldenV4, RopeTablesMatchReference) {
  auto cases = v4_cases();
  if (cases.empty()) GTEST_SKIP() << "no V4 golden case";
  for (const auto& dir : cases) {
    ModelConfig cfg = load_model_config(dir);
    auto cj = nlohmann::json::parse(read_text_file(dir + "/case.json"));
    RopeTable main = make_main_rope(cfg), comp = make_compress_rope(cfg);
    auto want_main = cj.at("main_inv_freq").get<std::vector<double>>();
    auto want_comp = cj.at("compress_inv_freq").get<std::vector<double>>();
    ASSERT_EQ(main.inv_freq.size(), want_main.size());
    ASSERT_EQ(comp.inv_freq.size(), want_comp.size());
    for (size_t i = 0; i < want_main.size(); ++i) EXPECT_EQ(main.inv_freq[i], static_cast<float>(want_main[i])) << i;
    for (size_t i = 0; i < want_comp.size(); ++i) EXPECT_EQ(comp.inv_freq[i], static_cast<float>(want_comp[i])) << i;
  }
}

// A rounding flip: an activation element entering a QA8 (layer, site, absolute
// position, index) whose value, in units of its block scale, lies within f32
// noise of an e4m3 rounding boundary, so that the reference may have rounded it to
// the other neighbouring grid point.
struct Flip {
  int layer = 0;
  std::string site;
  int64_t pos = 0, elem = 0;
  float v = 0;          // x / s
  float boundary = 0;   // the rounding midpoint next to |v|
  double margin = 0;    // | |v| - boundary | / |v|
  float ours = 0, other = 0;  // grid point we round to / the neighbour across the boundary
  float scale = 0;
};

// Runs one path of the golden (prefill, or T0-prefill + single-token steps) with
// the given flips resolved the other way (the element is set to the neighbouring
// grid point, which QA8 keeps exactly), and optionally collects every QA8 element
// at one position with its distance to the nearest rounding boundary.
struct FlipLab {
  V4Cpu& m;
  const int32_t* ids;
  int64_t T, T0, V;
  const float* want;  // the golden logits of the path
  const SafetensorsFile& golden;

  std::vector<float> run(bool incremental, const std::vector<Flip>& flips, int64_t collect_pos = -1,
                         std::vector<Flip>* cands = nullptr, ForwardDebug* dbg = nullptr) {
    const int B = m.config().quant_block;
    m.set_qa8_probe([&](int layer, const char* site, int64_t pos, float* x, int64_t n) {
      for (const Flip& f : flips)
        if (f.layer == layer && f.pos == pos && f.site == site) x[f.elem] = std::copysign(f.other, f.v) * f.scale;
      if (pos != collect_pos || !cands) return;
      for (int64_t b0 = 0; b0 < n; b0 += B) {
        const int64_t b1 = std::min(n, b0 + B);
        float amax = 0;
        for (int64_t i = b0; i < b1; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float s = pow2ceil(std::max(amax, 1e-4f) * (1.0f / 448.0f));
        for (int64_t i = b0; i < b1; ++i) {
          Flip f;
          f.layer = layer, f.site = site, f.pos = pos, f.elem = i, f.scale = s, f.v = x[i] / s;
          const float a = std::fabs(f.v);
          const uint8_t code = f32_to_e4m3(a);
          const float q = e4m3_to_f32(code);
          const float lo = q <= a ? q : e4m3_to_f32(static_cast<uint8_t>(code - 1));
          const float hi = q <= a ? e4m3_to_f32(static_cast<uint8_t>(code + 1)) : q;
          if (a == 0.0f || hi > 448.0f) continue;
          f.boundary = 0.5f * (lo + hi);
          f.margin = std::fabs(a - f.boundary) / a;
          f.ours = q, f.other = q == lo ? hi : lo;
          cands->push_back(f);
        }
      }
    });
    KVState st = m.new_state();
    std::vector<float> lg(static_cast<size_t>(T * V));
    const int64_t first = incremental ? T0 : T;
    m.forward(st, ids, first, lg.data(), true, dbg);  // dbg: the rows of the first chunk
    for (int64_t t = first; t < T; ++t) m.forward(st, ids + t, 1, lg.data() + t * V, false);
    m.set_qa8_probe(nullptr);
    return lg;
  }
  int64_t leading(const std::vector<float>& lg, double* max_err) const {
    *max_err = 0;
    for (int64_t t = 0; t < T; ++t) {
      const double e = row_rel_l2(lg.data() + t * V, want + t * V, V);
      if (!(e <= 1e-3)) return t;
      *max_err = std::max(*max_err, e);
    }
    return T;
  }
};

// Explains the divergences of one path: at each first divergent row, the QA8
// elements of that position closest to a rounding boundary (within 1e-6 relative,
// i.e. f32 noise) are tried in turn; the first whose other rounding moves the
// divergence later is taken as the flip. Returns the flips and the leading rows
// once they are resolved.
std::vector<Flip> explain(FlipLab& lab, bool incremental, int64_t* leading_after, double* err_after) {
  std::vector<Flip> flips;
  double err = 0;
  int64_t R = lab.leading(lab.run(incremental, flips), &err);
  const ModelConfig& cfg = lab.m.config();
  for (int iter = 0; iter < 6 && R < lab.T; ++iter) {
    std::vector<Flip> cands;
    ForwardDebug dbg;
    lab.run(incremental, flips, R, &cands, incremental ? nullptr : &dbg);
    std::sort(cands.begin(), cands.end(), [](const Flip& a, const Flip& b) { return a.margin < b.margin; });
    // Prefill path: the golden's hidden states at row R locate the sublayer in which
    // our computation starts to differ (the first normalised input that differs
    // follows the sublayer that contains the flip).
    int site_layer = -1;
    bool site_attn = false;
    if (!incremental) {
      const int64_t D = cfg.hidden;
      const float* an = lab.golden.get("hidden.attn_norm_out").as<float>();
      const float* fn = lab.golden.get("hidden.ffn_norm_out").as<float>();
      for (int l = 0; l < cfg.n_layers && site_layer < 0; ++l) {
        const double ea = row_rel_l2(dbg.attn_norm_out[l].data() + R * D, an + (l * lab.T + R) * D, D);
        const double ef = row_rel_l2(dbg.ffn_norm_out[l].data() + R * D, fn + (l * lab.T + R) * D, D);
        if (ea > 1e-5) {
          site_layer = l - 1;
          std::printf("    row %lld: golden hidden states: layer %d attention input differs (rel-L2 %.2e) -> the change "
                      "comes from layer %d's MoE\n",
                      (long long)R, l, ea, l - 1);
        } else if (ef > 1e-5) {
          site_layer = l, site_attn = true;
          std::printf("    row %lld: golden hidden states: layer %d attention input agrees (%.2e), its FFN input differs "
                      "(%.2e) -> the change comes from layer %d's attention\n",
                      (long long)R, l, ea, ef, l);
        }
      }
    }
    bool found = false;
    for (size_t i = 0; i < cands.size() && i < 4 && cands[i].margin < 1e-6 && !found; ++i) {
      auto trial = flips;
      trial.push_back(cands[i]);
      double e2 = 0;
      const int64_t R2 = lab.leading(lab.run(incremental, trial), &e2);
      if (R2 > R) {
        const Flip& f = cands[i];
        std::printf("    row %lld: layer %d %s[%lld] = %.9g x 2^%d is %.2e (relative) from the e4m3 rounding boundary %g; "
                    "ours rounds to %g, resolving it to %g moves the first divergent row to %lld\n",
                    (long long)R, f.layer, f.site.c_str(), (long long)f.elem, f.v, std::ilogb(f.scale), f.margin,
                    f.boundary, f.ours, f.other, (long long)R2);
        if (site_layer >= 0) {
          const bool attn_site = f.site == "wq_a" || f.site == "wq_b" || f.site == "wkv" || f.site == "idx_wq_b" ||
                                 f.site == "wo_b";
          EXPECT_EQ(f.layer, site_layer) << "flip at row " << R << " is not where the golden's hidden states change";
          EXPECT_EQ(attn_site, site_attn) << "flip at row " << R << " is not where the golden's hidden states change";
        }
        flips = trial;
        R = R2;
        err = e2;
        found = true;
      }
    }
    if (!found) {
      std::printf("    row %lld: no QA8 element within 1e-6 of a rounding boundary explains the divergence\n", (long long)R);
      break;
    }
  }
  *leading_after = R;
  *err_after = err;
  return flips;
}

// README §6 rule on both paths. A path whose first divergence comes before the
// required row passes only if that divergence is proven to be a rounding flip:
// one QA8 element within f32 noise (< 1e-6 relative) of an e4m3 rounding boundary
// whose other rounding — the one the reference took — removes the divergence, and
// the rule then holds.
TEST(GoldenV4, LeadingRowsOrProvenRoundingFlips) {
  auto cases = v4_cases();
  if (cases.empty()) GTEST_SKIP() << "no V4 golden case";
  for (const auto& dir : cases) {
    auto eng = load_engine(dir);  // the engine the CLI uses; V4 needs no tokenizer
    GoldenReport r = check_golden_case(dir, *eng, true);
    std::printf("%s\n", r.summary().c_str());
    EXPECT_TRUE(r.prefill.ok()) << r.summary();
    EXPECT_TRUE(r.greedy_ok) << r.summary();
    EXPECT_LT(r.prefill.max_err, 1e-5);
    EXPECT_LT(r.incremental.max_err, 1e-5);
    Captured& c = captured(dir);
    SafetensorsFile g(dir + "/golden.safetensors");
    const auto& ids = g.get("input_ids");
    for (bool incremental : {false, true}) {
      const PathAgreement& p = incremental ? r.incremental : r.prefill;
      if (p.leading == p.rows) continue;
      FlipLab lab{*c.model, ids.as<int32_t>(), ids.numel(), r.T0, c.cfg.vocab_size,
                  g.get(incremental ? "logits_incremental" : "logits_prefill").as<float>(), g};
      std::printf("  %s path: first divergent row %lld (rule: %lld); rounding flips:\n",
                  incremental ? "incremental" : "prefill", (long long)p.leading, (long long)p.required);
      int64_t after = 0;
      double err = 0;
      auto flips = explain(lab, incremental, &after, &err);
      std::printf("  %s path with the %zu flip(s) resolved as the reference did: %lld/%lld leading rows, max rel-L2 %.3g\n",
                  incremental ? "incremental" : "prefill", flips.size(), (long long)after, (long long)p.rows, err);
      if (!p.ok()) {
        EXPECT_GE(after, p.required) << (incremental ? "incremental" : "prefill")
                                     << " path: divergence before the required row is not explained by rounding flips";
        EXPECT_LT(err, 1e-5);
      }
      for (const Flip& f : flips) EXPECT_LT(f.margin, 1e-6);
    }
  }
}

// Every layer's normalised attention / FFN input and the final norm output agree
// with the golden's at fp32-noise level on the rows before the first divergent
// logits row, and so do the router's experts and the indexer's top-k sets.
TEST(GoldenV4, HiddenStatesAndDecisions) {
  auto cases = v4_cases();
  if (cases.empty()) GTEST_SKIP() << "no V4 golden case";
  for (const auto& dir : cases) {
    Captured& c = captured(dir);
    SafetensorsFile g(dir + "/golden.safetensors");
    const int64_t T = g.get("input_ids").numel(), V = c.cfg.vocab_size, D = c.cfg.hidden;
    const float* want = g.get("logits_prefill").as<float>();
    int64_t R = T;
    for (int64_t t = 0; t < T; ++t)
      if (row_rel_l2(c.logits.data() + t * V, want + t * V, V) > 1e-3) {
        R = t;
        break;
      }
    std::printf("%s: prefill logits agree (rel-L2 <= 1e-3) on rows 0..%lld of %lld\n", dir.c_str(), (long long)R - 1,
                (long long)T);
    const float* an = g.get("hidden.attn_norm_out").as<float>();
    const float* fn = g.get("hidden.ffn_norm_out").as<float>();
    const float* hn = g.get("hidden.final_norm_out").as<float>();
    double worst = 0;
    for (int l = 0; l < c.cfg.n_layers; ++l) {
      double ea = 0, ef = 0;
      for (int64_t t = 0; t < R; ++t) {
        ea = std::max(ea, row_rel_l2(c.dbg.attn_norm_out[l].data() + t * D, an + (l * T + t) * D, D));
        ef = std::max(ef, row_rel_l2(c.dbg.ffn_norm_out[l].data() + t * D, fn + (l * T + t) * D, D));
      }
      std::printf("  layer %d: max rel-L2 on rows < %lld: attn_norm_out %.2e, ffn_norm_out %.2e\n", l, (long long)R, ea,
                  ef);
      worst = std::max({worst, ea, ef});
    }
    double eh = 0;
    for (int64_t t = 0; t < R; ++t) eh = std::max(eh, row_rel_l2(c.dbg.final_norm_out.data() + t * D, hn + t * D, D));
    std::printf("  final_norm_out: %.2e\n", eh);
    EXPECT_LT(worst, 1e-4);
    EXPECT_LT(eh, 1e-4);
    // decisions on the agreeing rows
    for (int l = 0; l < c.cfg.n_layers; ++l) {
      const int64_t k = c.cfg.n_experts_per_tok;
      const auto& re = g.get("debug.router_experts.layer" + std::to_string(l));
      int64_t first = -1;
      for (int64_t t = 0; t < T && first < 0; ++t)
        if (sorted_row(c.dbg.router_experts[l].data() + t * k, k) != sorted_row(re.as<int32_t>() + t * k, k)) first = t;
      std::printf("  layer %d router: %s", l, first < 0 ? "all rows equal" : cat("first differing row ", first).c_str());
      if (first >= 0) EXPECT_GE(first, R) << "layer " << l;
      if (const TensorView* tk = g.find("debug.sparse_topk.layer" + std::to_string(l))) {
        const int64_t K = c.cfg.index_topk;
        int64_t ft = -1;
        for (int64_t t = 0; t < T && ft < 0; ++t)
          if (sorted_row(c.dbg.sparse_topk[l].data() + t * K, K) != sorted_row(tk->as<int32_t>() + t * K, K)) ft = t;
        std::printf("; top-k: %s", ft < 0 ? "all rows equal" : cat("first differing row ", ft).c_str());
        if (ft >= 0) EXPECT_GE(ft, R) << "layer " << l;
      }
      std::printf("\n");
    }
  }
}

// `dsx logits` (both paths) and `dsx generate` on the V4 directory, which has no
// tokenizer.json (V4 has no Engram, so none is needed): the CLI's figures are the
// engine's (the rule itself is checked above).
TEST(GoldenV4, CliLogitsAndGenerate) {
  auto cases = v4_cases();
  if (cases.empty()) GTEST_SKIP() << "no V4 golden case";
  const char* b = std::getenv("DSX_BUILD_DIR");
  const std::string bin = b ? std::string(b) + "/dsx" : "";
  if (bin.empty() || !file_exists(bin)) GTEST_SKIP() << "dsx binary not found (run through ctest)";
  const std::string tmp = dsx_test::temp_dir("cli_v4");
  auto run = [](const std::string& cmd, std::string* out) {
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    std::string s;
    char buf[4096];
    while (size_t n = fread(buf, 1, sizeof buf, p)) s.append(buf, n);
    const int rc = pclose(p);
    if (out) *out = s;
    return WEXITSTATUS(rc);
  };
  for (const auto& dir : cases) {
    auto cj = nlohmann::json::parse(read_text_file(dir + "/case.json"));
    const int64_t T0 = cj["T0"].get<int64_t>();
    const std::string ids = dir + "/golden.safetensors";
    std::string out;
    ASSERT_EQ(0, run(bin + " logits -m " + dir + " --ids " + ids + " -o " + tmp + "/p.safetensors", &out)) << out;
    ASSERT_EQ(0, run(bin + " logits -m " + dir + " --ids " + ids + " --decode-from " + std::to_string(T0) + " -o " + tmp +
                         "/i.safetensors",
                     &out))
        << out;
    SafetensorsFile g(ids), p(tmp + "/p.safetensors"), inc(tmp + "/i.safetensors");
    const int64_t T = g.get("input_ids").numel(), V = p.get("logits").dim(1);
    ASSERT_EQ(p.get("logits").dim(0), T);
    ASSERT_EQ(inc.get("logits").dim(0), T);
    auto leading = [&](const float* got, const float* want) {
      int64_t n = 0;
      for (int64_t t = 0; t < T && row_rel_l2(got + t * V, want + t * V, V) <= 1e-3; ++t) n = t + 1;
      return n;
    };
    const int64_t lp = leading(p.get("logits").as<float>(), g.get("logits_prefill").as<float>());
    const int64_t li = leading(inc.get("logits").as<float>(), g.get("logits_incremental").as<float>());
    std::printf("%s via CLI: prefill %lld/%lld, incremental %lld/%lld leading rows\n", dir.c_str(), (long long)lp,
                (long long)T, (long long)li, (long long)T);
    // the same numbers as the in-process engine
    auto eng = load_engine(dir);
    std::vector<float> want_p(static_cast<size_t>(T * V)), want_i(want_p.size());
    {
      auto s = eng->new_session();
      s->feed(g.get("input_ids").as<int32_t>(), T, want_p.data(), true);
      auto s2 = eng->new_session();
      s2->feed(g.get("input_ids").as<int32_t>(), T0, want_i.data(), true);
      for (int64_t t = T0; t < T; ++t) s2->feed(g.get("input_ids").as<int32_t>() + t, 1, want_i.data() + t * V, false);
    }
    EXPECT_EQ(0, std::memcmp(p.get("logits").data, want_p.data(), want_p.size() * 4));
    EXPECT_EQ(0, std::memcmp(inc.get("logits").data, want_i.data(), want_i.size() * 4));
    EXPECT_GE(lp, (T * 35 + 99) / 100);
    ASSERT_EQ(0, run(bin + " generate -m " + dir + " --ids " + ids + " -n 8 --greedy", &out)) << out;
    const auto& gt = g.get("greedy_tokens");
    std::string want;
    for (int i = 0; i < 8; ++i) want += (i ? " " : "") + std::to_string(gt.as<int32_t>()[i]);
    const std::string got = out.substr(0, out.find('\n'));
    std::printf("  generate -n 8 --greedy: %s (golden %s)\n", got.c_str(), want.c_str());
    EXPECT_EQ(got, want);
  }
}
