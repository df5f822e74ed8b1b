// Mixture-of-experts FFN on the GPU (spec model-v41.md §3.5): routed experts (MXFP4)
// selected on the device by the router (router.h) plus the always-on shared expert
// (FP8_BLOCK), for one MoE layer.
//
// Per token t with experts e_j and weights w_j (j < topk):
//   routed j: g = Lin4(f; w1), u = Lin4(f; w3) (QA8(f) shared by all experts);
//             u = clamp(u, +-limit), g = min(g, limit) (limit > 0); h = w_j * silu(g) * u;
//             y_j = Lin4(h; w2) (QA8(h))
//   shared:   the same with the FP8 matrices and no routing weight
//   out = sum_j y_j (ascending expert id) + y_shared, f32 accumulation.
// BF16 mode (xt/yt == BF16) adds the reference rounding points: g, u, h, every y_j and
// the output are rounded to bf16. F32 mode rounds nothing (the f32 CPU engine).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quant_act.h"
#include "model/qmatrix.h"

namespace dsx::cuda {

// Weights of one MoE layer, all pointers on the device. Routed experts are separate
// tensors: per-expert base pointers are passed as DEVICE arrays of E device pointers
// (contiguous experts: fill the arrays with base + e * stride). All 16-byte aligned.
struct MoeLayer {
  int n_experts = 0;   // E
  int64_t hidden = 0;  // D (% 32 == 0)
  int64_t inter = 0;   // I (% 32 == 0, % qblock == 0)
  const uint8_t* const* w1 = nullptr;        // [E] -> packed e2m1 [I, D/2]   (gate proj)
  const uint8_t* const* w1_scale = nullptr;  // [E] -> e8m0 [I, D/32]
  const uint8_t* const* w3 = nullptr;        // [E] -> [I, D/2]               (up proj)
  const uint8_t* const* w3_scale = nullptr;  // [E] -> [I, D/32]
  const uint8_t* const* w2 = nullptr;        // [E] -> [D, I/2]               (down proj)
  const uint8_t* const* w2_scale = nullptr;  // [E] -> [D, I/32]
  // The routed experts' data (w1, w3, w2 alike) in the 16-row tile layout (qmatrix.h);
  // needs shapes that fit it (moe_experts_tile16).
  bool tiled = false;
  // Shared expert, FP8_BLOCK (device pointers); shared_w1.data == nullptr: none.
  QMatrix shared_w1, shared_w3, shared_w2;   // [I, D], [I, D], [D, I]
  float swiglu_limit = 10.0f;  // <= 0: no clamp
  int qblock = 32;             // QA8 block
};

// Whether MXFP4 experts [I, D] (w1, w3) and [D, I] (w2) all fit the tile layout.
inline bool moe_experts_tile16(int64_t D, int64_t I) {
  QMatrix up, down;
  up.fmt = down.fmt = WFormat::MXFP4;
  up.rows = down.cols = I;
  up.cols = down.rows = D;
  return tile16_fits(up) && tile16_fits(down);
}

// ---- decode: one or a few tokens, two or three launches, no host synchronisation -----
//
// x: ffn_norm output [T, D] (type xt, row stride ldx); ids / weights: [T, topk] on the
// device (router order; a row's experts distinct, as the router's top-k); y: [T, D] of
// type yt (row stride ldy).
// Tensor-core modes (BF16, or F32 with DSX_GEMV_MMA=2; QA8 blocks of 32): one row runs
// the one-token ring kernels; 2..16 rows the expert-major kernels (moe_rows.cu), which
// stream each distinct routed expert once for all the rows routed to it and the shared
// expert once for all rows, and give every row bit for bit the one-row result; 2..8
// rows of a layer whose routed experts all fit in L2 (at most 16 MB: the trained model's,
// the DSpark stages') the one-token kernels of every row side by side in one launch each
// (their re-reads hit L2; fewer dependent launches than the expert-major kernels). F32 mode
// (default): the CUDA-core kernels, per (row, slot), whose per-row arithmetic does not
// depend on T either.
// ws: workspace of moe_decode_ws_bytes() bytes. Its first T * S * I floats
// (S = topk + 1 with a shared expert, else topk) hold the QA8'd hidden vectors h
// ([T][S][I], slot order as in ids, shared expert last), for tests / debugging.
size_t moe_decode_ws_bytes(const MoeLayer& m, int T, int topk);
// x_staged (optional, T = 1): QA8 of x (32-element blocks) staged by its producer in the
// FP8 B order, then the MXFP4 B order (hc_finish's `staged`, staged_act_words(D) words
// each); the one-token kernels copy it instead of quantizing x. It must be QA8 of exactly x.
// It is read before the up kernel's grid-dependency wait, so it must be complete when the
// launch before moe_decode (the router, which releases its dependents only after its own
// wait) lets it start: its producer must not be that launch.
void moe_decode(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                cudaStream_t stream, const uint32_t* x_staged = nullptr);

// ---- prefill: many tokens -----------------------------------------------------------
//
// Tokens are grouped by expert on the device (histogram, scan, stable compaction:
// deterministic). Default (DSX_MOE_PREFILL=grouped, layers grouped_supported takes):
// the tile plan is made on the device too and the products run as grouped tensor-core
// GEMMs over all experts and the shared expert, the MXFP4 / FP8 weights decoded in the
// kernels (moe_grouped.h): no host synchronisation. DSX_MOE_PREFILL=cublas: the
// per-expert counts are copied to the host (ONE stream synchronisation per call - not
// graph-capturable) to size the per-expert products: experts with >= gemm_min_tokens
// tokens use the GEMM path (gemm.h: dequantize to bf16 / f32 + cuBLAS), the others the
// GEMV kernels; the shared expert the GEMM path for T >= gemm_min_tokens (opts apply to
// this path only). Results equal moe_decode's up to f32 summation order.
struct MoePrefillOpts {
  int gemm_min_tokens = 16;
};
size_t moe_prefill_ws_bytes(const MoeLayer& m, int T, int topk);
void moe_prefill(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                 const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                 cudaStream_t stream, const MoePrefillOpts& opts = {});

}  // namespace dsx::cuda
