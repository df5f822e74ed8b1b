// Compressor of a KV-source layer (spec model-v41.md §3.4.3-§3.4.5; V41Cpu::compressor
// and the key part of V41Cpu::indexer): for every group j completed by the chunk
// (positions jr .. jr+r-1 <= p0+T-1, j >= p0/r):
//   z_j      = Σ_m softmax_m(γ) κ  (ratio > 1, per channel, f32; pending earlier tokens
//              come from the projection rings) or the token's projection (ratio 1),
//              rounded to act;
//   latent_j = RMSNorm(z_j; compressor.norm)                       (act)
//   row_j    = FQ4e4(RoPE_{jr}(latent_j))       -> compressed rows[j]
//   key_j    = FQ4e8(RoPE_{jr}(RMSNorm(LinBF(latent_j; indexer.wk); indexer.k_norm)))
//                                               -> index keys[j]
// with act roundings after the wk product, the norm and each RoPE. The projections κ, γ
// (LinF32 of compressor.wkv / wgate, f32) or the ratio-1 projection (LinBF, act) come
// from the GEMV engineer's kernels; after this kernel, proj_store (kv_cache.h) must
// copy the chunk's κ, γ into the rings.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

struct CompressorArgs {
  int T = 0;               // tokens in the chunk (positions p0 .. p0+T-1, p0 = *d_pos)
  int ratio = 0;           // 1 or 2 (any r >= 1)
  int head_dim = 0;        // compressed row width (<= 1024, % 32 == 0)
  int idx_dim = 0;         // index key width (<= head_dim, % 32 == 0)
  int n_pairs = 0;         // RoPE pairs (compress table)
  float eps = 1e-20f;      // rms_norm_eps
  const float* kv = nullptr;          // ratio > 1: κ [T, head_dim] f32
  const float* gate = nullptr;        // ratio > 1: γ [T, head_dim] f32
  const void* kv_act = nullptr;       // ratio == 1: [T, head_dim] act
  const float* proj_kv = nullptr;     // ratio > 1: rings with the positions < p0
  const float* proj_gate = nullptr;
  int proj_cap = 0;
  const float* norm = nullptr;        // compressor.norm [head_dim]
  const float* inv_freq = nullptr;    // compress RoPE table [n_pairs]
  const uint16_t* wk = nullptr;       // indexer.wk bf16 [idx_dim, head_dim]
  const float* k_norm = nullptr;      // indexer.k_norm [idx_dim]
  Fq4e4Rows rows;                     // compressed rows of this source (row j = group j)
  Fq4e8Rows keys;                     // index keys of this source
  void* latents = nullptr;            // optional [max_groups, head_dim] act: pre-RoPE latent of
                                      // emitted group p0/r + i at row i
  const int64_t* d_pos = nullptr;
};

// Grid size (groups a chunk of T tokens can complete).
int compressor_max_groups(int T, int ratio);

void compressor_emit(Act act, const CompressorArgs& a, cudaStream_t stream);

}  // namespace dsx::cuda
