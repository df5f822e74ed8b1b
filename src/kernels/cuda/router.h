// MoE router on the GPU (spec model-v41.md §3.5, twin: the router in V41Cpu::moe):
//   z = gate . f / gate_temp (bf16 weight, f32 math), s = sqrt(softplus(z)) (PyTorch
//   softplus, threshold 20), top-k of s + bias (ties -> lower expert id), weights
//   w_i = s[idx_i] / (sum_i s[idx_i] + 1e-20) (norm_topk_prob and k > 1) * route_scale.
// Expert ids and weights stay on the device (router order: descending biased score).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quant_act.h"
#include "model/qmatrix.h"

namespace dsx::cuda {

struct RouterOpts {
  float gate_temp = 1.0f;
  bool norm_topk_prob = true;
  float route_scale = 1.5f;
};

// Selection from precomputed logits z [T, E] (row stride ldz, before / gate_temp).
// bias: [E] f32 or nullptr. E <= 1024, 1 <= topk <= 16. ids / weights: [T, topk].
void router_select(const float* z, int64_t ldz, int T, int E, const float* bias, int topk, const RouterOpts& o,
                   int32_t* ids, float* weights, cudaStream_t stream);

// The whole router: gate product (BF16 or F32 weight [E, D] -> f32 logits, f32 sums)
// into logits ([T, E], row stride E, caller-provided device buffer, left holding z) and
// the selection of router_select (same ids and bit-identical weights for given logits).
// Decode (T <= 8, E <= 1024, D % 8 == 0): one launch (router.cu: the last block to finish
// its logits ranks the experts), with programmatic dependent launch; the launch uses a
// 4-byte device counter per logits buffer, allocated and zeroed on the first call for
// that buffer and left at 0 by every launch (CUDA-graph replays are fine). A buffer first
// seen while the stream is being captured cannot get one (no allocation during capture):
// that call takes the two launches. 9..16 rows: that launch for rows 0..7 and one for
// the rest (the second counter belongs to row 8 of the logits). Each row's logits, ids
// and weights are then, bit for bit, those of a one-row call. Otherwise: the gate GEMV
// (gemv.h) then router_select, two launches. Calls sharing a logits buffer must be
// ordered (one stream), as the buffer's contents already require.
void router(DType xt, const void* x, int64_t ldx, int T, const QMatrix& gate, const float* bias, int topk,
            const RouterOpts& o, float* logits, int32_t* ids, float* weights, cudaStream_t stream);

}  // namespace dsx::cuda
