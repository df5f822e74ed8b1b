// The multi-GPU placement plan (model/placement.h, issue 28): the expert partition puts
// every expert on exactly one rank in balanced contiguous ranges; the per-rank sums add up
// to totals computed independently (the safetensors headers of assets/dsx-small-v41, and
// the release's shapes written out from spec model-v41.md §1.3 / §2.3); the fit of the
// release on 2 and 4 H200s follows that arithmetic; bad GPU counts are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <regex>

#include "model/placement.h"
#include "model/release_config.h"
#include "test_util.h"
#include "util/error.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

const std::string kSmall = dsx_test::source_dir() + "/assets/dsx-small-v41";

int64_t group(const RankPlacement& r, WeightGroup g) { return r.bytes[static_cast<size_t>(g)]; }

}  // namespace

TEST(Placement, EveryExpertOnExactlyOneRankBalanced) {
  for (int E : {1, 2, 7, 8, 16, 384}) {
    for (int N = 1; N <= E && N <= 13; ++N) {
      const auto r = expert_ranges(E, N);
      ASSERT_EQ(static_cast<int>(r.size()), N);
      std::vector<int> owners(static_cast<size_t>(E), 0);
      int next = 0, lo = E, hi = 0;
      for (int k = 0; k < N; ++k) {
        EXPECT_EQ(r[k].begin, next) << "contiguous, ascending";
        next = r[k].end;
        lo = std::min(lo, r[k].count());
        hi = std::max(hi, r[k].count());
        // the first E % N ranks hold one more
        EXPECT_EQ(r[k].count(), E / N + (k < E % N ? 1 : 0)) << "E " << E << " N " << N << " rank " << k;
        for (int e = r[k].begin; e < r[k].end; ++e) {
          ++owners[static_cast<size_t>(e)];
          EXPECT_EQ(expert_rank(e, E, N), k);
        }
      }
      EXPECT_EQ(next, E);
      EXPECT_LE(hi - lo, 1);
      EXPECT_GE(lo, 1);
      for (int e = 0; e < E; ++e) EXPECT_EQ(owners[static_cast<size_t>(e)], 1) << "expert " << e;
    }
  }
}

TEST(Placement, BadGpuCountsAreClearErrors) {
  const ModelConfig cfg = load_model_config(kSmall);  // 8 experts
  for (int n : {0, -1, -8, 9, 1000}) {
    try {
      plan_placement(cfg, n, {});
      ADD_FAILURE() << n << " GPUs were accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("GPU"), std::string::npos) << m;
      EXPECT_NE(m.find(std::to_string(n)), std::string::npos) << m;
    }
    EXPECT_THROW(expert_ranges(8, n), Error);
  }
  EXPECT_THROW(expert_rank(8, 8, 2), Error);
  EXPECT_THROW(expert_rank(0, 8, 0), Error);
}

// Per-rank sums against the checkpoint's own headers: every tensor's stored bytes, sorted
// by name alone (no inventory): routed experts by id, Engram tables, DSpark stages, the rest.
TEST(Placement, SmallModelSumsEqualTheSafetensorsHeaders) {
  const ModelConfig cfg = load_model_config(kSmall);
  SafetensorsFile f(kSmall + "/model.safetensors");
  const std::regex expert(R"(^layers\.\d+\.ffn\.experts\.(\d+)\..*)");
  std::map<int, int64_t> per_expert;
  int64_t routed = 0, host = 0, stages = 0, rest = 0, all = 0;
  for (const auto& [name, t] : f.tensors()) {
    const auto b = static_cast<int64_t>(t.nbytes);
    all += b;
    std::smatch m;
    if (std::regex_match(name, m, expert)) {
      per_expert[std::stoi(m[1])] += b;
      routed += b;
    } else if (name.find(".engram.embed.") != std::string::npos) {
      host += b;
    } else if (name.rfind("mtp.", 0) == 0) {
      stages += b;
    } else {
      rest += b;
    }
  }
  ASSERT_EQ(static_cast<int>(per_expert.size()), cfg.n_routed_experts);
  ASSERT_GT(host, 0);
  ASSERT_GT(stages, 0);
  for (int N : {1, 2, 3, 4, 8}) {
    const PlacementPlan p = plan_placement(cfg, N, {});
    ASSERT_EQ(static_cast<int>(p.per_rank.size()), N);
    EXPECT_EQ(p.host_bytes, host);
    EXPECT_EQ(p.model_bytes[static_cast<size_t>(WeightGroup::dspark_stages)], stages);
    EXPECT_EQ(p.model_bytes[static_cast<size_t>(WeightGroup::routed_experts)], routed);
    int64_t sharded = 0, model = 0;
    for (int64_t b : p.model_bytes) model += b;
    EXPECT_EQ(model, all) << "the plan's groups cover the file exactly";
    for (const RankPlacement& r : p.per_rank) {
      int64_t want = 0;
      for (int e = r.experts.begin; e < r.experts.end; ++e) want += per_expert[e];
      EXPECT_EQ(group(r, WeightGroup::routed_experts), want) << "N " << N << " rank " << r.rank;
      sharded += group(r, WeightGroup::routed_experts);
      // replicated: everything but the experts and the host tables, on every rank
      EXPECT_EQ(r.weight_bytes - group(r, WeightGroup::routed_experts), rest + stages) << "N " << N;
      EXPECT_EQ(group(r, WeightGroup::engram_tables), 0);
    }
    EXPECT_EQ(sharded, routed) << "N " << N;
  }
}

// The release (spec model-v41.md §1.2) from its shapes, written out here: bytes per
// routed expert 3 (I D / 2 + I D / 32) = 18,800,640 (§1.3), the replicated tensors of
// §2.3, the Engram tables, the DSpark stages, the compact state (§5.1: 890 B of compressed
// rows and keys per token, + 4 B token id).
TEST(Placement, ReleaseArithmeticAndFit) {
  const ModelConfig cfg = release_v41_flash_config();
  const int64_t D = 5120, I = 2304, E = 384, L = 40, V = 129280;
  auto fp8 = [](int64_t r, int64_t c) { return r * c + ((r + 31) / 32) * ((c + 31) / 32); };
  auto mxfp4 = [](int64_t r, int64_t c) { return r * c / 2 + r * c / 32; };
  const int64_t expert = 3 * mxfp4(I, D);
  ASSERT_EQ(expert, 18800640);
  const int64_t routed = L * E * expert;
  // one layer's replicated block (window-only layer)
  auto block = [&](int64_t n_experts) {
    return 2 * D * 2                                           // attn_norm, ffn_norm (bf16)
           + 2 * (24 * 4 * D * 4 + 24 * 4 + 3 * 4)             // hc_attn / hc_ffn fn, base, scale (f32)
           + fp8(1280, D) + 1280 * 2 + fp8(64 * 512, 1280)      // wq_a, q_norm, wq_b
           + fp8(512, D) + 512 * 2                              // wkv, kv_norm
           + fp8(8 * 1024, 64 * 512 / 8) + fp8(D, 8 * 1024)     // wo_a, wo_b
           + 64 * 4                                             // attn_sink
           + n_experts * D * 2 + 2 * n_experts * 4              // gate, bias, bias_vl
           + 3 * fp8(I, D);                                     // shared expert (w2 [D, I]: same bytes)
  };
  int64_t backbone = L * block(E);
  backbone += 4 * (512 * D * 2 + 512 * 2) + 3 * 512 * D * 2;    // compressors (wgate on the 3 ratio-2 sources)
  backbone += 8 * (fp8(32 * 128, 1280) + 32 * D * 2) + 4 * (128 * 512 * 2 + 128 * 2);  // indexers
  backbone += 2 * (fp8(5 * D, 24 * 256) + 2 * 4 * D * 2);       // Engram wkv, q / k weights
  backbone += 2 * V * D * 2 + D * 2;                            // embed, head, norm
  const int64_t stages = 3 * (block(128) + 128 * expert) + fp8(D, 3 * D) + D * 2 + D * 2 + 2 * V * 256 * 2 + (D + 256) * 2;
  const int64_t host = (int64_t{384006168} + 384016682) * (256 + 8);
  const double per_token = 890 + 4;
  const int64_t fixed = 8 + L * 144 * (512 + 16) + 3 * 2 * 18 * 512 * 4;

  PlacementOptions o;  // 141 GB H200, 6 GB reserve, one session of 65536 tokens
  const int64_t state = fixed + static_cast<int64_t>(std::ceil(per_token * o.context));
  std::map<int, bool> fits;
  for (int N : {1, 2, 3, 4, 8}) {
    const PlacementPlan p = plan_placement(cfg, N, o);
    EXPECT_EQ(p.expert_bytes, expert);
    EXPECT_EQ(p.host_bytes, host);
    EXPECT_EQ(p.model_bytes[static_cast<size_t>(WeightGroup::dspark_stages)], stages);
    EXPECT_EQ(p.state_fixed_bytes, fixed);
    EXPECT_DOUBLE_EQ(p.state_bytes_per_token, per_token);
    int64_t replicated_plan = 0;
    for (int g = 0; g < kWeightGroups; ++g)
      if (residence(static_cast<WeightGroup>(g)) == Residence::replicated) replicated_plan += p.model_bytes[static_cast<size_t>(g)];
    EXPECT_EQ(replicated_plan, backbone + stages);
    bool all = true;
    for (const RankPlacement& r : p.per_rank) {
      const int64_t want = backbone + stages + r.experts.count() * L * expert;
      EXPECT_EQ(r.weight_bytes, want);
      EXPECT_EQ(r.total_bytes, want + state + o.reserve_bytes);
      const bool f = want + state + o.reserve_bytes <= o.gpu_bytes;
      EXPECT_EQ(r.fits, f);
      all = all && f;
    }
    EXPECT_EQ(p.fits(), all);
    fits[N] = all;
    int64_t sharded = 0;
    for (const RankPlacement& r : p.per_rank) sharded += group(r, WeightGroup::routed_experts);
    EXPECT_EQ(sharded, routed);
  }
  // what that arithmetic says: ~17.6 GB replicated + 288.8 GB of experts / N
  EXPECT_FALSE(fits[1]);
  EXPECT_FALSE(fits[2]);
  EXPECT_TRUE(fits[4]);
  EXPECT_TRUE(fits[8]);
  std::printf("release: replicated %.3f GB, experts %.3f GB, host %.3f GB; fits on 2 / 3 / 4 / 8: %d %d %d %d\n",
              (backbone + stages) / 1e9, routed / 1e9, host / 1e9, fits[2], fits[3], fits[4], fits[8]);
}

// The expected experts of the busiest rank for one token: the hypergeometric figure
// against a brute-force count over every K-subset of a small expert set.
TEST(Placement, ExpectedBusiestRankByEnumeration) {
  ModelConfig cfg = load_model_config(kSmall);  // 8 experts, top-2
  for (int N : {1, 2, 3, 4, 8}) {
    const PlacementPlan p = plan_placement(cfg, N, {});
    const int E = cfg.n_routed_experts;
    ASSERT_EQ(cfg.n_experts_per_tok, 2);
    double sum = 0;
    int n = 0;
    for (int a = 0; a < E; ++a)
      for (int b = a + 1; b < E; ++b, ++n) sum += expert_rank(a, E, N) == expert_rank(b, E, N) ? 2 : 1;
    EXPECT_NEAR(p.expected_max_experts, sum / n, 1e-12) << "N " << N;
    double mean = 0;
    for (const RankPlacement& r : p.per_rank) mean += r.expected_experts;
    EXPECT_NEAR(mean, 2.0, 1e-12);
  }
}
