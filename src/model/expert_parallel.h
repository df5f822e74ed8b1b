// The two steps of an expert-parallel MoE layer that every implementation shares (the CPU
// ranks-in-one-process math of model/cpu/expert_shards.h today, an NCCL one later; the
// design in docs/multi-gpu.md):
//
//  * dispatch: from the router's choice of every token (chosen / weight [T, K], as
//    fwd::route returns them), per rank the (token, expert, weight) pairs whose expert it
//    holds (model/placement.h expert_ranges). With attention replicated every rank has
//    every token's MoE input and routes it itself, so the dispatch is a local filter; an
//    all-to-all version sends exactly these lists.
//  * combine: the MoE output of every token = the ranks' partial outputs summed in rank
//    order (0, 1, ..., N-1; each rank's partial holds its experts' weighted outputs, the
//    experts added in ascending id), then the shared expert added once. With one rank this
//    is the order of fwd::experts, bit for bit.
//
// No CUDA and no arithmetic of the model here: the lists and the sum order are the
// contract an NCCL all-reduce / all-to-all implementation must keep.
#pragma once
#include <cstdint>
#include <vector>

#include "model/placement.h"

namespace dsx {

// One routed pair as a rank receives it.
struct RoutedPair {
  int32_t token = 0;   // row of the chunk
  int32_t slot = 0;    // k: its position in the token's top-k list
  int32_t expert = 0;  // expert id (global)
  float weight = 0;    // routing weight
  bool operator==(const RoutedPair& o) const {
    return token == o.token && slot == o.slot && expert == o.expert && weight == o.weight;
  }
};

// Per rank, its pairs expert-major: ascending expert id, then token, then slot (the order
// in which fwd::experts visits them).
using DispatchLists = std::vector<std::vector<RoutedPair>>;

// The dispatch of T tokens with K experts each over `ranges` (one per rank). Throws
// dsx::Error when chosen / weight do not hold T * K entries or an expert id is outside
// the ranges.
DispatchLists dispatch_routes(const std::vector<int32_t>& chosen, const std::vector<float>& weight, int64_t T, int K,
                              const std::vector<ExpertRange>& ranges);

// out = (((0 + partials[0]) + partials[1]) + ... + partials[N-1]) + shared, element by
// element in f32 (shared may be null: no shared expert). Every partial (and shared) must
// have the size of partials[0]; throws dsx::Error otherwise.
void combine_partials(const std::vector<std::vector<float>>& partials, const std::vector<float>* shared,
                      std::vector<float>& out);

}  // namespace dsx
