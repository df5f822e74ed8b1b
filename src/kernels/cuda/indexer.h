// Indexer scoring (spec model-v41.md §3.4.6; V41Cpu::indexer) and the candidate-block
// scores of the candidate source. Selection itself is topk.h.
//
// Pipeline of an index-source layer (per chunk; decode = 1 query):
//   rope_fq4e8 (elementwise.h)             indexer q -> FQ4e8 values q [T, H, hd]
//   indexer_scores                         S[t][i] for i < counts[t]
//   [candidate source] block_scores        B[t][b], newest block pinned +inf
//                      topk_select(B, candidate_topk_blocks) -> candidate block list
//   topk_select(S, index_topk)             -> selected rows
// Re-index layers call indexer_scores with the candidate block list (only the
// candidate rows are scored: i indexes the concatenated blocks) and topk_select maps
// positions back to rows through the same list.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

struct IndexerScoreArgs {
  int T = 0;                       // queries (positions p0 + t, p0 = *d_pos)
  int n_heads = 0;                 // index heads H (4, 8, 16, 32 or 64)
  int head_dim = 0;                // index head dim (% 32 == 0, <= 256)
  int ratio = 1;                   // compress ratio of the layer: query t sees rows j < (p0+t+1)/ratio
  const float* q = nullptr;        // [T, H, head_dim] FQ4e8 index queries (f32 values)
  const void* w = nullptr;         // [T, H] act: indexer.weights_proj output (unscaled)
  Fq4e8Rows keys;                  // index keys of the layer's KV source
  int64_t max_rows = 0;            // grid bound: >= every counts[t] of this call (rows, or
                                   // candidate blocks x block size)
  // Optional restriction to candidate blocks (re-index layers): rows of the blocks
  // cand_blocks[t][0 .. cand_count[t]) (ascending), i = block slot * bs + offset.
  const int32_t* cand_blocks = nullptr;
  int64_t cand_ld = 0;
  const int32_t* cand_count = nullptr;
  int cand_block_size = 1;
  float* scores = nullptr;         // out [T, ld]; -inf for invisible rows
  int64_t ld = 0;
  int32_t* counts = nullptr;       // out [T]: entries written per query
  const int64_t* d_pos = nullptr;
};

// F32 mode (V41Cpu): S = Σ_h fma(relu(q_h·k) * hd^-½, w_h * H^-½, S), sequential in h.
// BF16 mode (reference): d = bf16(q_h·k), term = bf16(relu(d) * ω_h) with
// ω = bf16(w * (hd·H)^-½), S = bf16(Σ_h term) (f32 sum, sequential in h).
// BF16 prefill chunks (T >= 32, 16 / 32 heads of 64 / 128 dims) form the q_h·k on the
// tensor cores (bf16 mma, f32 accumulation: FQ4e8 values and their products are exact,
// so only the f32 order of exact sums differs); the rest is the same sequence.
void indexer_scores(Act act, const IndexerScoreArgs& a, cudaStream_t stream);

// Candidate-block scores (candidate source): B[t][b] = max of S[t][j] over the block's
// rows j < counts[t]; the block holding row counts[t]-1 is pinned to +inf;
// out_counts[t] = ceil(counts[t] / block_size). max_blocks >= every out_counts[t].
void block_scores(int T, const float* scores, int64_t ld, const int32_t* counts, int block_size, float* out,
                  int64_t ld_out, int32_t* out_counts, int64_t max_blocks, cudaStream_t stream);

}  // namespace dsx::cuda
