#include "model/cpu/expert_shards.h"

#include "util/error.h"

namespace dsx::cpu {

using Vec = std::vector<float>;

void rank_partial(const ModelConfig& cfg, const Vec& fq, int64_t T, const std::vector<RoutedPair>& pairs,
                  const fwd::ExpertWeights& w, fwd::MatmulFn matmul, const fwd::DownProj& down, Vec& partial) {
  const int64_t D = cfg.hidden;
  DSX_CHECK(static_cast<int64_t>(fq.size()) == T * D, "rank_partial: the MoE input is not [T, D]");
  partial.assign(static_cast<size_t>(T * D), 0.0f);
  std::vector<int64_t> tok;
  Vec wt;
  for (size_t i = 0; i < pairs.size();) {
    // the run of pairs of one expert (pairs are expert-major)
    const int32_t e = pairs[i].expert;
    DSX_CHECK(e >= 0 && e < static_cast<int32_t>(w.w1.size()), "rank_partial: expert id outside the layer");
    tok.clear();
    wt.clear();
    for (; i < pairs.size() && pairs[i].expert == e; ++i) {
      DSX_CHECK(pairs[i].token >= 0 && pairs[i].token < T, "rank_partial: a pair's token is outside the chunk");
      tok.push_back(pairs[i].token);
      wt.push_back(pairs[i].weight);
    }
    fwd::add_routed_expert(cfg, fq, e, tok, wt, w, matmul, down, partial);
  }
}

void expert_parallel_moe(const ModelConfig& cfg, const Vec& fq, int64_t T, const std::vector<int32_t>& chosen,
                         const Vec& weight, const fwd::ExpertWeights& w, fwd::MatmulFn matmul, const fwd::DownProj& down,
                         int ranks, Vec& out, DispatchLists* lists) {
  const std::vector<ExpertRange> ranges = expert_ranges(cfg.n_routed_experts, ranks);
  DispatchLists d = dispatch_routes(chosen, weight, T, cfg.n_experts_per_tok, ranges);
  std::vector<Vec> partials(static_cast<size_t>(ranks));
  for (int r = 0; r < ranks; ++r)
    rank_partial(cfg, fq, T, d[static_cast<size_t>(r)], w, matmul, down, partials[static_cast<size_t>(r)]);
  const Vec shared = fwd::shared_expert(cfg, fq, T, w, matmul, down);
  combine_partials(partials, &shared, out);
  if (lists) *lists = std::move(d);
}

}  // namespace dsx::cpu
