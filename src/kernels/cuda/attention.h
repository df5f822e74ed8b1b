// Sparse multi-query attention of V4.1 (spec model-v41.md §3.4.7, §4.4; V41Cpu::attention):
// per query row t (position p = p0 + t) and head h, the key/value rows (K = V) are
//   window rows of positions max(0, p - W + 1) .. p (positions < p0 from the layer's
//   ring, positions >= p0 from the chunk's own rows: causal inside the chunk)
//   + the selected compressed rows sel[t][0 .. sel_count[t]) of the KV source's cache,
// logits = q_h · z * scale (f32), one extra sink logit per head (denominator only),
// output = Σ softmax · z, written as act, optionally followed by the inverse RoPE of the
// output (conjugate rotation at position p, rounded to act again).
//
// All heads of a query share the same rows: a block decodes each compact row once into
// shared memory (as bf16: every cached value is exactly bf16) and uses it for 16 heads.
// The row list of a query is split over n_splits blocks (flash-decoding: decode uses
// n_splits > 1 and a combine kernel; prefill n_splits = 1). Online softmax in chunks of
// 32 rows; in BF16 mode the unnormalised probabilities are rounded to bf16 before the
// value product (the reference kernel's rounding, §4.4), the denominator stays f32.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

struct AttnArgs {
  int T = 0;                     // query rows (positions p0 + t, p0 = *d_pos)
  int n_heads = 0;               // H (multiple of 16, or 2/4/8)
  int head_dim = 0;              // 64, 128, 256 or 512
  int window = 0;                // W
  const void* q = nullptr;       // [T, H, head_dim] act, post-RoPE (unless q_inv_freq)
  // non-null: q is pre-RoPE; the queries get RoPE at their positions (n_pairs pairs,
  // this table, rounded to act) as rope() would do; the tensor-core kernel applies it
  // to its shared-memory copy (q is left as is), the other paths rotate q in place first.
  const float* q_inv_freq = nullptr;
  Fq8Rows ring;                  // the layer's window ring (positions < p0)
  int ring_cap = 0;
  Fq8Rows chunk;                 // window rows of this chunk (row i = position p0 + i)
  Fq4e4Rows cmp;                 // compressed rows of the KV source (packed == null: none)
  const int32_t* sel = nullptr;  // [T, sel_ld] selected compressed rows (null: none)
  int64_t sel_ld = 0;
  const int32_t* sel_count = nullptr;  // [T]
  int max_sel = 0;               // bound on sel_count (index_topk), for the split size
  // The selections were written before the previous kernel of the stream (a layer that
  // reuses an earlier layer's top-k), and the rows / ring by kernels that have completed
  // when this one launches (the graph's full edges): the one-token tensor-core kernel then
  // reads them and issues its first row copies before its grid-dependency wait.
  bool sel_early = false;
  const float* sink = nullptr;   // [H] f32
  float scale = 0.0f;            // head_dim^-1/2
  int n_pairs = 0;               // inverse RoPE of the output: pairs and table
  const float* inv_freq = nullptr;  // null: no inverse RoPE
  void* out = nullptr;           // [T, H, head_dim] act
  const int64_t* d_pos = nullptr;
  int n_splits = 1;              // blocks per (query, head group) along the row list
  float* work = nullptr;         // n_splits > 1: attention_work_floats(T, H, head_dim, n_splits)
  // BF16 mode only (ignored for F32): use the mma.sync tensor-core kernel when
  // n_heads % 16 == 0, head_dim % 64 == 0 and the build has sm_80+ device code.
  // Same numerics up to f32 summation order; much faster for prefill.
  bool tensor_cores = false;
};

size_t attention_work_floats(int T, int n_heads, int head_dim, int n_splits);

// A good n_splits for a decode step (1 query): about one 32-row chunk per block.
int attention_decode_splits(int window, int max_sel);

void sparse_attention(Act act, const AttnArgs& a, cudaStream_t stream);

// Whether AttnArgs::tensor_cores can take effect in this build on this device.
bool attention_tensor_cores_available();

}  // namespace dsx::cuda
