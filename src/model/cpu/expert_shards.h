// Expert-parallel MoE on the CPU: the N ranks of model/placement.h computed one after
// the other in one process, exactly as N GPUs would (docs/multi-gpu.md). Every rank
// computes only its experts' outputs for the pairs dispatched to it (model/expert_parallel.h),
// into a partial [T, D]; the shared expert is computed once (replicated on the GPUs, where
// it overlaps the combine); combine_partials sums them in rank order. Each (token, expert)
// output is bit-identical to the one of fwd::experts (the same products on the same rows),
// so the result differs from the one-rank path only in the order of the final sums (not at
// all with one rank, or when every token's experts lie on one rank).
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"
#include "model/cpu_common.h"
#include "model/expert_parallel.h"

namespace dsx::cpu {

// The partial [T, D] of one rank: Σ over its pairs, in their order (expert-major), of the
// routed expert's output (the SwiGLU hidden times the routing weight, then w2 through
// `down`), by fwd::add_routed_expert as fwd::experts computes it. fq [T, D] is the QA8'd
// MoE input.
void rank_partial(const ModelConfig& cfg, const std::vector<float>& fq, int64_t T, const std::vector<RoutedPair>& pairs,
                  const fwd::ExpertWeights& w, fwd::MatmulFn matmul, const fwd::DownProj& down, std::vector<float>& partial);

// The whole layer on `ranks` ranks: dispatch, every rank's partial, the shared expert,
// combine. out [T, D]. lists (optional) receives the dispatch.
void expert_parallel_moe(const ModelConfig& cfg, const std::vector<float>& fq, int64_t T,
                         const std::vector<int32_t>& chosen, const std::vector<float>& weight,
                         const fwd::ExpertWeights& w, fwd::MatmulFn matmul, const fwd::DownProj& down, int ranks,
                         std::vector<float>& out, DispatchLists* lists = nullptr);

}  // namespace dsx::cpu
