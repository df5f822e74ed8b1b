// Hyper-connections (spec model-v41.md §3.3; V41Cpu::hc_mix, collapse, expand) for
// hc_mult = 4 streams.
//
// A site transition is two launches:
//   hc_pass   : one pass over the streams X [T, 4, D] (act) of every token that fuses
//               (1) expand of the finished sublayer (optional):
//                     X_k <- post_k * y + Σ_j comb[j][k] X_j      (stored, act rounding)
//               (2) the partial sums of the next hc_mix (optional): per D-chunk of 128,
//                     Φ[:, chunk] · x (24 sums) and Σ x² (double) of the stored X
//               (3) collapse with known coefficients (optional):
//                     c = Σ_m pre_m X_m -> `collapsed` [T, D] act, and its Σ c² per chunk
//   hc_finish : per token, (2') hc_mix coefficients from the partials: ν, z = (Φ·x)·ν,
//               pre = sigmoid(α0 z + β) + eps, post = 2 sigmoid(α1 z + β), comb = softmax +
//               eps then Sinkhorn (1 column pass + (iters-1) row/column pairs), and (3')
//               the RMSNorm of the collapsed row (+ QA8 codes / scales of the result).
// In the V4.1 forward: after the attention of layer l, hc_pass(expand attn, mix ffn,
// collapse with pre_attn) + hc_finish(mix ffn, ffn_norm); after the MoE,
// hc_pass(expand ffn, mix attn of l+1, collapse with pre_ffn) + hc_finish(mix attn of
// l+1, attn_norm of l+1). Engram layers split the pass (expand only; engram; mix +
// collapse). The final fold is hc_pass(collapse) + hc_finish(norm only).
//
// Arithmetic follows V41Cpu: expand = fma chains in stream order, collapse = fma chain,
// Σx² in double. Differences from the CPU are reduction order only (and z is scaled by ν
// after the projection, the reference's order, instead of before).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/elementwise_types.h"

namespace dsx::cuda {

inline constexpr int kHcStreams = 4;
inline constexpr int kHcMix = (2 + kHcStreams) * kHcStreams;  // 24

// Number of D-chunks and the workspace hc_pass / hc_finish share for T tokens.
int hc_splits(int64_t D);
size_t hc_work_bytes(int T, int64_t D);

struct HcPassArgs {
  int T = 0;
  int64_t D = 0;
  void* X = nullptr;               // [T, 4, D] act streams (updated in place when y is set)
  // (1) expand
  const void* y = nullptr;         // [T, D] act sublayer output, null = no expand
  const float* post = nullptr;     // [T, 4]
  const float* comb = nullptr;     // [T, 16], comb[j * 4 + k], j = source stream
  // (2) mix partials
  const float* fn = nullptr;       // Φ [24, 4 * D] f32, null = no mix
  // (3) collapse
  const float* pre = nullptr;      // [T, 4] collapse weights, null = no collapse
  void* collapsed = nullptr;       // [T, D] act
  void* work = nullptr;            // hc_work_bytes(T, D)
};
void hc_pass(Act act, const HcPassArgs& a, cudaStream_t stream);

struct HcFinishArgs {
  int T = 0;
  int64_t D = 0;
  const void* work = nullptr;      // written by hc_pass
  // mix coefficients (when the pass had fn)
  bool have_mix = false;
  const float* base = nullptr;     // β [24]
  const float* scale = nullptr;    // α [3]
  float norm_eps = 1e-20f;         // rms_norm_eps (ν)
  float hc_eps = 1e-6f;
  int sinkhorn_iters = 20;
  float* pre = nullptr;            // out [T, 4]
  float* post = nullptr;           // out [T, 4]
  float* comb = nullptr;           // out [T, 16]
  // RMSNorm of the collapsed row (when the pass had pre)
  const void* collapsed = nullptr; // [T, D] act
  const float* norm_w = nullptr;   // [D]
  void* norm_out = nullptr;        // [T, D] act (may alias collapsed); null = no norm
  uint8_t* q_codes = nullptr;      // optional QA8 of norm_out: [T, D] e4m3
  float* q_scales = nullptr;       //                          [T, D / 32] f32
};
void hc_finish(Act act, const HcFinishArgs& a, cudaStream_t stream);

// DSpark hook: out[t] = mean over the 4 streams of X[t] ([T, D] act).
void hc_stream_mean(Act act, int T, int64_t D, const void* X, void* out, cudaStream_t stream);

}  // namespace dsx::cuda
