// The two kernels of the DSpark drafter (spec dspark.md §5.4, §5.6 - §5.7; the CPU
// reference is model/dspark.cpp) that no target kernel covers; everything else a draft
// runs is the target's kernels (backend/cuda/dspark_drafter.cpp).
//
//  * dspark_attention: every block row j (position n + j) attends to the ring rows of the
//    held positions max(0, n - W) .. n - 1 and to ALL B block rows (no causal mask), one
//    K = V row per key (compact FQ8 rows, kv_cache.h), logits q . k * scale in f32, one
//    sink logit per head in the denominator; q gets RoPE at n + j first (rounded to act)
//    and the output the inverse RoPE at n + j (rounded to act after the sum and after the
//    rotation, as the target's attention). The ring slot of position p is p mod cap; a
//    slot counts only when held[slot] == p (positions truncated or never observed are
//    holes).
//  * dspark_markov_row: one row j of the Markov walk: e = markov_embed[prev] (bf16 ->
//    f32), logits = base_j + markov_head . e (f32 sums), the greedy id (the first index of
//    the largest value, NaNs never win, a NaN at index 0 gives 0: the host argmax's rule)
//    and the confidence logit conf_w . [z_j ; e] (f32). prev is read from device memory,
//    so a greedy walk is B launches, row j + 1 reading the id row j wrote, without the
//    host; many blocks over the vocabulary, the last block to finish (ticket counter in
//    the workspace, left at 0) combining their candidates.
// Both read their dynamic inputs from device memory (CUDA-graph friendly).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

struct DSparkAttnArgs {
  int B = 0;                     // block rows (queries and block keys)
  int n_heads = 0, head_dim = 0; // head_dim % 32 == 0, <= 1024
  int window = 0;                // W
  const void* q = nullptr;       // [B, H, head_dim] act, before RoPE
  Fq8Rows ring;                  // [cap] ring rows
  int ring_cap = 0;
  const int64_t* held = nullptr; // [cap] position of each slot (-1: none)
  Fq8Rows block;                 // [B] the block's K = V rows
  const float* sink = nullptr;   // [H]
  float scale = 0.0f;
  int n_pairs = 0;               // RoPE pairs (trailing 2 n_pairs dims), table inv_freq
  const float* inv_freq = nullptr;
  const int64_t* d_n = nullptr;  // the anchor position n
  void* out = nullptr;           // [B, H, head_dim] act
};
void dspark_attention(Act act, const DSparkAttnArgs& a, cudaStream_t stream);

struct DSparkMarkovArgs {
  int64_t V = 0;
  int R = 0;                         // Markov rank (% 8 == 0, <= 2048)
  int64_t D = 0;
  const float* base = nullptr;       // [V] base logits of the row
  const uint16_t* embed = nullptr;   // bf16 [V, R]
  const uint16_t* head = nullptr;    // bf16 [V, R]
  const float* conf_w = nullptr;     // [D + R]
  const void* z = nullptr;           // [D] act: the row's collapsed state
  const int32_t* prev = nullptr;     // the row's previous token (device)
  float* logits = nullptr;           // out [V]
  int32_t* token = nullptr;          // out: the greedy id (device)
  float* conf = nullptr;             // out: the confidence logit (device)
  float* embed_out = nullptr;        // out (optional) [R]: e in f32
  // optional second destinations (e.g. pinned host memory)
  int32_t* token_copy = nullptr;
  float* conf_copy = nullptr;
  void* ws = nullptr;                // dspark_markov_ws_bytes(), zeroed once before the first launch
};
size_t dspark_markov_ws_bytes();
void dspark_markov_row(Act act, const DSparkMarkovArgs& a, cudaStream_t stream);

}  // namespace dsx::cuda
