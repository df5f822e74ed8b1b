// Hyper-connections (spec model-v41.md §3.3; V41Cpu::hc_mix, collapse, expand) for
// hc_mult = 4 streams.
//
// A site transition is two launches:
//   hc_pass   : one pass over the streams X [T, 4, D] (act) of every token that fuses
//               (1) expand of the finished sublayer (optional):
//                     X_k <- post_k * y + Σ_j comb[j][k] X_j      (stored, act rounding)
//               (2) the partial sums of the next hc_mix (optional): per column chunk,
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
// Launch structure (hc_splits(T, D) = number of column chunks = partials per sum):
//   hc_pass, T < 32 (decode): "narrow" blocks of 32 columns x 1 token, grid (D/32, T);
//               with Φ the block has 2 warps, each holding 12 of the 24 Φ rows of its
//               columns in registers (48 independent loads per lane); D = 5120: 160
//               blocks / 320 warps stream Φ (2 MB) over all SMs.
//   hc_pass, T >= 32 (prefill): "wide" blocks of 128 columns x 8 tokens, Φ of a column
//               in registers for the 8 tokens, grid (D/128, T/8).
//   hc_finish : grid (mix + D/128, T) of 128 threads. With the mix, block 0 of a token
//               sums the 24 z rows (3 warps) and Σx² (1 warp) from the partials (loads
//               all in flight; fixed order: per lane sequential, then the warp butterfly)
//               and runs the Sinkhorn on warp 0; the other blocks each RMSNorm 128
//               columns (each warp sums the Σc² partials the same way) beside it.
// Both kernels use programmatic dependent launch (unless DSX_PDL=0): Φ, β, α and the
// norm weights are read before griddepcontrol.wait, everything a previous kernel wrote
// (X, y, post, comb, pre, the partials, the collapsed row) and every global write come
// after it; the dependents are released before the wait (they wait for all of this
// kernel in their own). Exception: a decode pass with an expand and
// HcPassArgs::inputs_ready reads X, post, comb and pre before its wait too (see there).
// The partials are stored [T][24][ns] f32 and [T][2][ns] f64 in `work`, every value
// written by exactly one block: results are deterministic (no atomics).
//
// Arithmetic follows V41Cpu: expand = fma chains in stream order, collapse = fma chain,
// Σx² in double. Differences from the CPU are reduction order only (and z is scaled by ν
// after the projection, the reference's order, instead of before); the Sinkhorn sums are
// formed in the CPU's order (bit-identical to it for the same z and ν).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/elementwise_types.h"

namespace dsx::cuda {

inline constexpr int kHcStreams = 4;
inline constexpr int kHcMix = (2 + kHcStreams) * kHcStreams;  // 24

// Number of column chunks (partials per sum) of a pass over T tokens, and the
// workspace hc_pass / hc_finish share for any token count up to T.
int hc_splits(int T, int64_t D);
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
  // optional (decode, T < 32): a signal slot (signal_device.cuh) set by the hc_finish on
  // another stream that computes post / comb / pre (HcFinishArgs::signal); every block
  // waits for it before touching anything that kernel reads or writes
  unsigned* wait_signal = nullptr;
  // T < 32 with an expand: X, post, comb and pre are complete when this grid launches,
  // so they are loaded before its grid-dependency wait (only y is the previous kernel's).
  // True when the previous kernel is the sublayer's last weight kernel, which writes
  // only y and releases its dependents after its own wait (or is launched without
  // programmatic dependent launch), and the mix is joined (wait_signal, an event, or
  // computed on this stream before that kernel).
  bool inputs_ready = false;
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
  // optional, T = 1: QA8 of norm_out staged for its one-token consumers
  // (GemvOpts::staged, moe_decode's x_staged): the FP8 B order, then the MXFP4 B order,
  // staged_act_words(D) words each (gemv.h)
  uint32_t* staged = nullptr;
  // optional, mix only (no norm): each token's mix block signals once its pre / post /
  // comb are written (T signals; the next hc_pass's HcPassArgs::wait_signal)
  unsigned* signal = nullptr;
};
void hc_finish(Act act, const HcFinishArgs& a, cudaStream_t stream);

// DSpark hook: out[t] = mean over the 4 streams of X[t] ([T, D] act).
void hc_stream_mean(Act act, int T, int64_t D, const void* X, void* out, cudaStream_t stream);

}  // namespace dsx::cuda
