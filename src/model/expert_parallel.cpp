#include "model/expert_parallel.h"

#include <algorithm>

#include "util/error.h"

// Plain f32 adds in a fixed order (no contraction could apply, none is wanted).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsx {

DispatchLists dispatch_routes(const std::vector<int32_t>& chosen, const std::vector<float>& weight, int64_t T, int K,
                              const std::vector<ExpertRange>& ranges) {
  if (T < 0 || K < 1) fail("dispatch: bad shape T = ", T, ", K = ", K);
  if (static_cast<int64_t>(chosen.size()) != T * K || static_cast<int64_t>(weight.size()) != T * K)
    fail("dispatch: ", chosen.size(), " expert ids and ", weight.size(), " weights for ", T, " tokens x ", K, " experts");
  if (ranges.empty()) fail("dispatch: no ranks");
  const int n_experts = ranges.back().end;
  // the owner of every expert id
  std::vector<int> owner(static_cast<size_t>(n_experts), -1);
  for (size_t r = 0; r < ranges.size(); ++r)
    for (int e = ranges[r].begin; e < ranges[r].end; ++e) owner[static_cast<size_t>(e)] = static_cast<int>(r);
  DispatchLists lists(ranges.size());
  for (int64_t t = 0; t < T; ++t)
    for (int k = 0; k < K; ++k) {
      const int32_t e = chosen[static_cast<size_t>(t * K + k)];
      if (e < 0 || e >= n_experts || owner[static_cast<size_t>(e)] < 0)
        fail("dispatch: token ", t, " chose expert ", e, ", which no rank holds (experts 0..", n_experts - 1, ")");
      lists[static_cast<size_t>(owner[static_cast<size_t>(e)])].push_back(
          {static_cast<int32_t>(t), static_cast<int32_t>(k), e, weight[static_cast<size_t>(t * K + k)]});
    }
  for (auto& l : lists)
    std::stable_sort(l.begin(), l.end(), [](const RoutedPair& a, const RoutedPair& b) { return a.expert < b.expert; });
  return lists;
}

void combine_partials(const std::vector<std::vector<float>>& partials, const std::vector<float>* shared,
                      std::vector<float>& out) {
  if (partials.empty()) fail("combine: no partial outputs");
  const size_t n = partials.front().size();
  for (size_t r = 0; r < partials.size(); ++r)
    if (partials[r].size() != n) fail("combine: rank ", r, "'s partial has ", partials[r].size(), " values, rank 0's ", n);
  if (shared && shared->size() != n) fail("combine: the shared expert's output has ", shared->size(), " values, not ", n);
  out.assign(n, 0.0f);
  for (const auto& p : partials)
    for (size_t i = 0; i < n; ++i) out[i] += p[i];
  if (shared)
    for (size_t i = 0; i < n; ++i) out[i] += (*shared)[i];
}

}  // namespace dsx
