// Top-k selection by a bounded radix select (no sort), one thread-block cluster per
// query (spec model-v41.md §3.4.6, §4.3). Semantics of V41Cpu's topk_finite:
//   the min(k, #finite) largest finite entries (+inf counts as finite; -inf and NaN are
//   never selected), ties broken by the lower position, returned in ascending position
//   order.
// Algorithm: f32 scores map to order-preserving 32-bit keys; three histogram passes
// (11 + 11 + 10 bits) over the entries find the k-th largest key τ and how many entries
// equal to τ are taken; a count pass and a write pass (cluster-wide scan in position
// order) emit the selection. The cluster's CTAs split the entries in contiguous slices
// and combine histograms through distributed shared memory. 5 reads of the scores in
// total (L2-resident right after the scoring kernel); identical results for any split of
// the work (prefill and decode select the same rows).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsx::cuda {

// For every query t < T: entries scores[t][0 .. counts[t]) (row stride ld, counts on the
// device). out[t][0 .. out_count[t]) receives the ids of the selected entries in
// ascending position order; id of position i = i, or with id_blocks:
// id_blocks[t][i / id_block_size] * id_block_size + i % id_block_size (candidate rows of
// re-index layers). Unused out slots are left untouched. 1 <= k <= out_ld.
// max_n: an upper bound of every counts[t] known to the caller (< 0: ld). Rows of at most
// 16384 entries take a one-CTA kernel holding the keys in registers (DSX_TOPK_SMALL=0:
// always the general kernel); the result is the same.
void topk_select(int T, const float* scores, int64_t ld, const int32_t* counts, int k, const int32_t* id_blocks,
                 int64_t id_ld, int id_block_size, int32_t* out, int64_t out_ld, int32_t* out_count,
                 cudaStream_t stream, int64_t max_n = -1);

// Whether topk_select runs the 8-CTA cluster kernel (needs sm_90 device code in the
// build); otherwise one CTA per query does the same passes (slower on long rows).
bool topk_uses_clusters();

}  // namespace dsx::cuda
