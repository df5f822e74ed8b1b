#include "model/placement.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "model/cost_model.h"
#include "model/inventory.h"
#include "model/kv_state.h"
#include "util/error.h"

namespace dsx {

// ---- the expert partition ------------------------------------------------------------------
std::vector<ExpertRange> expert_ranges(int n_experts, int ranks) {
  if (n_experts < 1) fail("expert parallelism: the model has no routed experts (n_routed_experts = ", n_experts, ")");
  if (ranks < 1) fail("expert parallelism: the number of GPUs must be at least 1 (got ", ranks, ")");
  if (ranks > n_experts)
    fail("expert parallelism: ", ranks, " GPUs for ", n_experts, " routed experts a layer: at most ", n_experts,
         " GPUs (each must hold at least one expert)");
  std::vector<ExpertRange> r(static_cast<size_t>(ranks));
  const int base = n_experts / ranks, extra = n_experts % ranks;
  int e = 0;
  for (int i = 0; i < ranks; ++i) {
    r[static_cast<size_t>(i)].begin = e;
    e += base + (i < extra ? 1 : 0);
    r[static_cast<size_t>(i)].end = e;
  }
  return r;
}

int expert_rank(int expert, int n_experts, int ranks) {
  if (expert < 0 || expert >= n_experts) fail("expert ", expert, " outside 0..", n_experts - 1);
  (void)expert_ranges(n_experts, ranks);  // (validates ranks)
  const int base = n_experts / ranks, extra = n_experts % ranks;
  const int big = extra * (base + 1);  // experts held by the ranks with one more
  return expert < big ? expert / (base + 1) : extra + (expert - big) / base;
}

// ---- groups ---------------------------------------------------------------------------------
const char* weight_group_name(WeightGroup g) {
  switch (g) {
    case WeightGroup::embed: return "embedding";
    case WeightGroup::head: return "head + final norm";
    case WeightGroup::attention: return "attention";
    case WeightGroup::hyper_connections: return "hyper-connections";
    case WeightGroup::compressor_indexer: return "compressors + indexers";
    case WeightGroup::router: return "router + ffn norm";
    case WeightGroup::shared_expert: return "shared expert";
    case WeightGroup::routed_experts: return "routed experts";
    case WeightGroup::engram_projection: return "Engram projections";
    case WeightGroup::dspark_stages: return "DSpark stages";
    case WeightGroup::engram_tables: return "Engram tables";
    case WeightGroup::count: break;
  }
  return "?";
}

Residence residence(WeightGroup g) {
  if (g == WeightGroup::routed_experts) return Residence::sharded;
  if (g == WeightGroup::engram_tables) return Residence::host;
  return Residence::replicated;
}

namespace {

WeightGroup group_of(const TensorSpec& t) {
  if (t.stage >= 0) return WeightGroup::dspark_stages;
  switch (t.role) {
    case Role::embed: return WeightGroup::embed;
    case Role::head:
    case Role::norm: return WeightGroup::head;
    case Role::attn_norm:
    case Role::wq_a:
    case Role::q_norm:
    case Role::wq_b:
    case Role::wkv:
    case Role::kv_norm:
    case Role::wo_a:
    case Role::wo_b:
    case Role::attn_sink: return WeightGroup::attention;
    case Role::hc_attn_fn:
    case Role::hc_attn_base:
    case Role::hc_attn_scale:
    case Role::hc_ffn_fn:
    case Role::hc_ffn_base:
    case Role::hc_ffn_scale: return WeightGroup::hyper_connections;
    case Role::comp_wkv:
    case Role::comp_wgate:
    case Role::comp_norm:
    case Role::idx_wq_b:
    case Role::idx_weights_proj:
    case Role::idx_wk:
    case Role::idx_k_norm: return WeightGroup::compressor_indexer;
    case Role::ffn_norm:
    case Role::gate:
    case Role::gate_bias:
    case Role::gate_bias_vl: return WeightGroup::router;
    case Role::shared_w1:
    case Role::shared_w3:
    case Role::shared_w2: return WeightGroup::shared_expert;
    case Role::expert_w1:
    case Role::expert_w3:
    case Role::expert_w2: return WeightGroup::routed_experts;
    case Role::engram_wkv:
    case Role::engram_q_weight:
    case Role::engram_k_weight: return WeightGroup::engram_projection;
    case Role::engram_table: return WeightGroup::engram_tables;
    default: break;
  }
  fail("placement: tensor ", t.name, " (", role_name(t.role), ") belongs to no group");
}

// E[max_r c_r] and E[c_r] of the counts c_r of k distinct items drawn uniformly from
// n = sum(sizes) items in groups of `sizes` (multivariate hypergeometric). E[c_r] =
// k sizes[r] / n; E[max] = sum over m >= 0 of P(max > m), where P(max <= m) counts the
// k-subsets with at most m items in every group: the t^k coefficient of
// prod_r sum_{x <= m} C(sizes[r], x) t^x, over C(n, k). O(groups k^2) per m.
void hypergeometric_moments(const std::vector<int>& sizes, int k, double& e_max, std::vector<double>& e_count) {
  int n = 0;
  for (int s : sizes) n += s;
  auto choose = [](int a, int b) {
    double c = 1;
    for (int i = 1; i <= b; ++i) c = c * (a - b + i) / i;
    return c;
  };
  const double all = choose(n, k);
  e_count.clear();
  for (int s : sizes) e_count.push_back(static_cast<double>(k) * s / n);
  e_max = 0;
  for (int m = 0; m < k; ++m) {
    std::vector<double> poly(static_cast<size_t>(k) + 1, 0.0), next;
    poly[0] = 1;
    for (int s : sizes) {
      next.assign(poly.size(), 0.0);
      for (int j = 0; j <= k; ++j)
        if (poly[static_cast<size_t>(j)] != 0)
          for (int x = 0; x <= std::min({m, s, k - j}); ++x)
            next[static_cast<size_t>(j + x)] += poly[static_cast<size_t>(j)] * choose(s, x);
      poly.swap(next);
    }
    e_max += 1.0 - poly[static_cast<size_t>(k)] / all;  // P(max > m)
  }
}

std::string gb(double b) {
  char s[32];
  if (b >= 1e9) std::snprintf(s, sizeof s, "%.2f GB", b / 1e9);
  else if (b >= 1e6) std::snprintf(s, sizeof s, "%.2f MB", b / 1e6);
  else if (b >= 1e3) std::snprintf(s, sizeof s, "%.1f kB", b / 1e3);
  else std::snprintf(s, sizeof s, "%.0f B", b);
  return s;
}

}  // namespace

double PlacementPlan::decode_bytes_busiest_rank(int64_t context) const {
  return static_cast<double>(decode_replicated_bytes) + expected_max_experts * n_layers * static_cast<double>(expert_bytes) +
         static_cast<double>(decode_state_bytes(cfg, context));
}

bool PlacementPlan::fits() const {
  return std::all_of(per_rank.begin(), per_rank.end(), [](const RankPlacement& r) { return r.fits; });
}

PlacementPlan plan_placement(const ModelConfig& cfg, int ranks, const PlacementOptions& o) {
  if (cfg.family != Family::V41) fail("the placement plan describes deepseek_v41 models, not '", cfg.model_type, "'");
  if (o.context < 0 || o.sessions < 0) fail("placement: context and sessions must not be negative");
  PlacementPlan p;
  p.cfg = cfg;
  p.ranks = ranks;
  p.n_layers = cfg.n_layers;
  p.n_experts = cfg.n_routed_experts;
  p.experts_per_tok = cfg.n_experts_per_tok;
  p.options = o;
  const std::vector<ExpertRange> ranges = expert_ranges(cfg.n_routed_experts, ranks);

  // one copy of every tensor, by group; the routed experts by expert id (every layer)
  std::vector<int64_t> per_expert(static_cast<size_t>(cfg.n_routed_experts), 0);
  const TensorInventory inv(cfg);
  std::vector<TensorSpec> all = inv.tensors();
  if (o.dspark)
    for (TensorSpec& t : dspark_inventory(cfg)) all.push_back(std::move(t));
  for (const TensorSpec& t : all) {
    const WeightGroup g = group_of(t);
    const int64_t b = stored_bytes(t);
    p.model_bytes[static_cast<size_t>(g)] += b;
    if (g == WeightGroup::routed_experts) per_expert[static_cast<size_t>(t.expert)] += b;
    if (t.stage >= 0) continue;  // (a plain decode step runs no stage)
    if (g == WeightGroup::engram_tables) p.decode_host_gather_bytes += decode_read_bytes(cfg, t);
    else if (g != WeightGroup::routed_experts) p.decode_replicated_bytes += decode_read_bytes(cfg, t);
    if (g == WeightGroup::routed_experts && t.layer == 0 && t.expert == 0) p.expert_bytes += b;  // (all one shape)
  }
  p.host_bytes = p.model_bytes[static_cast<size_t>(WeightGroup::engram_tables)];

  const KVGeometry geo = KVGeometry::of(cfg, o.rollback_depth);
  p.state_fixed_bytes = geo.fixed_bytes();
  p.state_bytes_per_token = geo.bytes_per_token();
  const int64_t state = o.sessions * (p.state_fixed_bytes +
                                      static_cast<int64_t>(std::ceil(p.state_bytes_per_token * static_cast<double>(o.context))));

  std::vector<int> sizes;
  for (const ExpertRange& r : ranges) sizes.push_back(r.count());
  std::vector<double> e_count;
  hypergeometric_moments(sizes, cfg.n_experts_per_tok, p.expected_max_experts, e_count);
  p.combine_bytes_per_layer = cfg.hidden * 4;

  for (int r = 0; r < ranks; ++r) {
    RankPlacement rp;
    rp.rank = r;
    rp.experts = ranges[static_cast<size_t>(r)];
    for (int g = 0; g < kWeightGroups; ++g) {
      const auto wg = static_cast<WeightGroup>(g);
      if (residence(wg) == Residence::replicated) rp.bytes[static_cast<size_t>(g)] = p.model_bytes[static_cast<size_t>(g)];
    }
    int64_t ex = 0;
    for (int e = rp.experts.begin; e < rp.experts.end; ++e) ex += per_expert[static_cast<size_t>(e)];
    rp.bytes[static_cast<size_t>(WeightGroup::routed_experts)] = ex;
    for (int64_t b : rp.bytes) rp.weight_bytes += b;
    rp.state_bytes = state;
    rp.total_bytes = rp.weight_bytes + rp.state_bytes + o.reserve_bytes;
    rp.fits = rp.total_bytes <= o.gpu_bytes;
    rp.expected_experts = e_count[static_cast<size_t>(r)];
    p.per_rank.push_back(rp);
  }
  return p;
}

std::string format_placement(const PlacementPlan& p, const std::string& title) {
  std::string s;
  auto line = [&](const std::string& l) { s += l + "\n"; };
  char b[512];
  std::snprintf(b, sizeof b, "placement of %s on %d GPU%s: routed experts sharded, everything else replicated,", title.c_str(),
                p.ranks, p.ranks == 1 ? "" : "s");
  line(b);
  line("Engram tables in host memory (memory-mapped, rows gathered per token); bytes of the on-disk dtypes");
  line("");
  std::snprintf(b, sizeof b, "  %-24s %-12s %12s  %s", "weights", "where", "one copy", "per GPU");
  line(b);
  const RankPlacement& r0 = p.per_rank.front();
  const RankPlacement& rl = p.per_rank.back();
  for (int g = 0; g < kWeightGroups; ++g) {
    const auto wg = static_cast<WeightGroup>(g);
    const int64_t one = p.model_bytes[static_cast<size_t>(g)];
    if (one == 0) continue;
    std::string where, per;
    switch (residence(wg)) {
      case Residence::replicated: where = "replicated", per = gb(static_cast<double>(one)); break;
      case Residence::host: where = "host memory", per = "-"; break;
      case Residence::sharded: {
        where = "sharded";
        const int64_t a = r0.bytes[static_cast<size_t>(g)], z = rl.bytes[static_cast<size_t>(g)];
        per = a == z ? gb(static_cast<double>(a)) : gb(static_cast<double>(z)) + " .. " + gb(static_cast<double>(a));
        per += r0.experts.count() == rl.experts.count()
                   ? cat(" (", r0.experts.count(), " of ", p.n_experts, " experts a layer)")
                   : cat(" (", rl.experts.count(), " or ", r0.experts.count(), " of ", p.n_experts,
                         " experts a layer: ", p.n_experts % p.ranks, " ranks hold one more)");
        break;
      }
    }
    std::snprintf(b, sizeof b, "  %-24s %-12s %12s  %s", weight_group_name(wg), where.c_str(), gb(static_cast<double>(one)).c_str(),
                  per.c_str());
    line(b);
  }
  line("");
  const PlacementOptions& o = p.options;
  std::snprintf(b, sizeof b, "session state on every GPU (attention replicated): %s fixed + %.1f B per token of context",
                gb(static_cast<double>(p.state_fixed_bytes)).c_str(), p.state_bytes_per_token);
  line(b);
  std::snprintf(b, sizeof b, "  %-5s %-11s %12s %14s %10s %12s  %s", "rank", "experts", "weights",
                cat("state ", o.sessions, "x", o.context).c_str(), "reserve", "total", cat("fits ", gb(static_cast<double>(o.gpu_bytes))).c_str());
  line(b);
  for (const RankPlacement& r : p.per_rank) {
    std::snprintf(b, sizeof b, "  %-5d %-11s %12s %14s %10s %12s  %s", r.rank, cat(r.experts.begin, "..", r.experts.end - 1).c_str(),
                  gb(static_cast<double>(r.weight_bytes)).c_str(), gb(static_cast<double>(r.state_bytes)).c_str(),
                  gb(static_cast<double>(o.reserve_bytes)).c_str(), gb(static_cast<double>(r.total_bytes)).c_str(),
                  r.fits ? "yes" : cat("NO (", gb(static_cast<double>(r.total_bytes - o.gpu_bytes)), " over)").c_str());
    line(b);
  }
  std::snprintf(b, sizeof b, "host memory: %s of Engram tables", gb(static_cast<double>(p.host_bytes)).c_str());
  line(b);
  line(p.fits() ? cat("fits on ", p.ranks, " GPU", p.ranks == 1 ? "" : "s", " of ", gb(static_cast<double>(o.gpu_bytes)))
                : cat("does NOT fit on ", p.ranks, " GPU", p.ranks == 1 ? "" : "s", " of ", gb(static_cast<double>(o.gpu_bytes))));
  line("");
  line("one decoded token (uniform routing assumed):");
  std::snprintf(b, sizeof b, "  replicated weights read by every rank  %s (+ %s of Engram rows from host memory)",
                gb(static_cast<double>(p.decode_replicated_bytes)).c_str(), gb(static_cast<double>(p.decode_host_gather_bytes)).c_str());
  line(b);
  std::snprintf(b, sizeof b, "  routed experts a layer on the busiest rank  %.3f expected (of %d; one expert %s)",
                p.expected_max_experts, p.experts_per_tok, gb(static_cast<double>(p.expert_bytes)).c_str());
  line(b);
  std::snprintf(b, sizeof b, "  bytes on the busiest rank at %lld tokens  %s; combine: one all-reduce of %s per layer (%d layers)",
                static_cast<long long>(o.context), gb(p.decode_bytes_busiest_rank(o.context)).c_str(),
                gb(static_cast<double>(p.combine_bytes_per_layer)).c_str(), p.n_layers);
  line(b);
  return s;
}

}  // namespace dsx
