// Decode GEMV / small-T GEMM on the GPU against weights in their stored formats
// (spec model-v41.md §2.2, §3.0.4): y[t, n] = sum_k x'[t, k] * W[n, k] for t < T,
// with x' = QA8(x) (fake-quantized, fused in the kernel's prologue) for FP8_BLOCK and
// MXFP4 weights when opts.qa8, else x' = x. The weight bytes are streamed once per
// pass of up to 16 tokens (more tokens: several passes; use gemm.h for prefill).
// f32 accumulation; the output is written as yt (bf16: rounded once, RNE).
// BF16 mode (xt == BF16) runs FP8_BLOCK (T <= 8) and MXFP4 (3 <= T <= 4) products with
// QA8 (qblock 32, one group) on the tensor cores (gemv_device.cuh: exact f16 operands,
// one mma chain per 32-element scale block, f32 accumulation), and FP8_BLOCK products
// without QA8 (wo_a, grouped, T <= 8) too, with the bf16 activations staged as f16 times
// a power of two per 32-element block (exact within 2^31 of the block maximum;
// gemv_device.cuh noqa_block_exp); everything else, and F32 mode, on the CUDA-core
// kernel. Several rows, where each row's result is that of a one-row call bit for bit:
// FP8 on the shared ring (2..8 rows with the one-row K split; 9..16 rows as two calls of
// at most 8), BF16 weights of the one-row CUDA-core kernel without a K split (the head;
// 2..16 rows, gemv_rows.h). Switches: gemv_launch.h (DSX_GEMV_MMA, DSX_PDL, ...);
// DSX_GEMV_TRACE=1 prints every call's shape and kernel to stderr.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quant_act.h"
#include "model/qmatrix.h"

namespace dsx::cuda {

struct GemvOpts {
  // QA8 of the activation (FP8_BLOCK / MXFP4 weights only; ignored for F32 / BF16).
  // false for wo_a (spec §3.4.8: bf16 grouped product without activation quantization).
  bool qa8 = true;
  int qblock = 32;  // QA8 block (V4.1: 32, V4: 128)
  // Grouped product (wo_a, spec §3.4.8): W has groups * R rows (R = W.rows / groups) and
  // W.cols = Kg inputs; group g multiplies rows [g R, (g+1) R) with x[t, g Kg .. (g+1) Kg)
  // and writes y[t, g R .. (g+1) R). ldx >= groups * Kg, ldy >= W.rows.
  int groups = 1;
  // Optional f32 workspace for splitting K over several blocks when there are few rows
  // (e.g. hc fn [24, 20480], weights_proj [32, 5120]); see gemv_split_ws_bytes. The
  // partial sums are reduced in a fixed order (deterministic). Without it, only the
  // 8 warps of a block split K.
  float* split_ws = nullptr;
  size_t split_ws_bytes = 0;
  // Optional RMS norm of the input rows first (spec §3.4.1: q_norm between wq_a and wq_b):
  // the product is taken with x'[t, k] = act(norm_w[k] * (x[t, k] * r_t)),
  // r_t = 1 / sqrt(mean_k x[t, k]^2 + norm_eps) (the rmsnorm kernel's formula), and x' is
  // also written to norm_out ([T, K] of the activation type) for other consumers. The
  // one-token tensor-core kernels compute it while staging their activations (no launch of
  // its own); other paths run rmsnorm into norm_out first. One group only.
  const float* norm_w = nullptr;
  float norm_eps = 0.0f;
  void* norm_out = nullptr;
  // Optional: the one-token input already quantized by its producer (hc_finish's
  // `staged`): QA8 (32-element blocks) of x in the B order of the one-token FP8
  // tensor-core kernel, [K/32][16] words of f16 code pairs, then K/32 scales. That kernel
  // copies it instead of staging x itself (x is then not read); the others ignore it. It
  // must be QA8 of exactly x.
  const uint32_t* staged = nullptr;
  // Optional, T = 1: staged outputs for the next one-token FP8 consumer (GemvOpts::staged
  // layout). norm_staged (with norm_w): QA8 of the normalized row; out_staged: QA8 of the
  // output row y (of the activation type), 32-element blocks of the W.rows outputs (all
  // groups). Written only when the one-token shared-ring kernel runs with a plan that can
  // (gemv_last_staged says whether the last call did); a consumer must not use the buffer
  // otherwise.
  uint32_t* norm_staged = nullptr;
  uint32_t* out_staged = nullptr;
  // Optional, one token, one group, f32 output: the greedy id of the output row (the
  // first index of its largest value; NaNs never win; a NaN at index 0 gives 0, as
  // argmax_rows) into pick[0] and, when set, pick_copy[0] (e.g. pinned host memory). The
  // CUDA-core kernel folds it into its epilogue (each block its best, the last block to
  // finish writes the id: no launch of its own); other paths run argmax_rows after the
  // product. Calls with one pick pointer must be ordered (one stream); its workspace is
  // allocated by gemv_pick_reserve, or on the first call outside a stream capture.
  int32_t* pick = nullptr;
  int32_t* pick_copy = nullptr;
  // Optional: at most this many resident blocks per SM for the one-wave streaming kernel
  // (0: as many as fit). A product on a side stream beside the critical chain (the
  // compressor's) leaves SMs to the chain's next launch.
  int max_blocks_per_sm = 0;
};

// Allocates GemvOpts::pick's workspace for `pick` (outside a stream capture).
void gemv_pick_reserve(const int32_t* pick, cudaStream_t stream);

// Whether the last gemv() call of this thread wrote the staged outputs it was given.
bool gemv_last_staged();

// 32-bit words of one token's staged activations in one B order (GemvOpts::staged),
// rounded up to 16 bytes: K/32 blocks of 16 words and their K/32 scales. A producer that
// writes both one-token orders (hc_finish) puts the FP8 order first, then the MXFP4 order
// (scales times 2^14) at this offset.
constexpr int64_t staged_act_words(int64_t K) { return (K / 32 * 17 + 3) / 4 * 4; }

// W: descriptor with DEVICE pointers (data 16-byte aligned; FP8 tile size 32 or 128).
// x: [T, >= K] activations of type xt, row stride ldx elements. y: [T, >= N] of type yt,
// row stride ldy. Requires W.cols % 32 == 0 (and % qblock when QA8 applies).
void gemv(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
          const GemvOpts& opts, cudaStream_t stream);

// The kernel the last gemv() call of this thread ran: "stream", "mma-ring",
// "mma-register", "rows" or "cuda-core" ("" before the first call; 9..16 rows taken as
// two calls: the second's). For tests and diagnostics.
const char* gemv_last_path();

// Workspace bytes that let gemv use its largest K split for this shape (0 if it never
// splits K over blocks for this shape).
size_t gemv_split_ws_bytes(const QMatrix& W, int T, const GemvOpts& opts);

}  // namespace dsx::cuda
