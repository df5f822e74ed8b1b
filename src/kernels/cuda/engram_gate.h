// Engram (spec model-v41.md §3.2.3; V41Cpu::engram): the table-row gather feeding
// engram.wkv and the per-stream gated update of the residual streams. The wkv product
// itself (Lin8) is the GEMV/GEMM engineer's.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"

namespace dsx::cuda {

// u[i] = dequantized table row ids[i] (format C: e4m3 codes [R, dim] and ue8m0 scales
// [R, dim / 32]; value = e4m3(code) * 2^(scale - 127), exact in bf16), i < n, written as
// act into u [n, dim]. For a token's 24 columns, rows i = t * 24 + c give the wkv
// input [T, 24 * dim]. q_codes / q_scales (optional): QA8 of u ([n, dim] e4m3 and
// [n, dim / 32] f32), the wkv activation format. dim % 32 == 0.
// The table may be the whole device-resident table, or a staging buffer of rows the
// host gathered (then ids = 0..n-1).
void engram_gather(Act act, const uint8_t* table, const uint8_t* table_scale, int dim, const int64_t* ids, int n,
                   void* u, uint8_t* q_codes, float* q_scales, cudaStream_t stream);

// The gated update of every stream (dead tokens are not supported: text-only engine):
// yE [T, (M + 1) * D] act (keys k_m = yE[m D .. (m+1) D), value v = yE[M D ..]),
// X [T, M, D] act updated in place, w [M, D] f32 = q_weight ⊙ k_weight. For each
// (t, m): r = (mean h² + eps)^-½ (mean k² + eps)^-½, δ = (Σ h w k) r D^-½,
// g = sigmoid(sign(δ) sqrt(max(|δ|, 1e-6))), X_m <- h + g v.
void engram_gate(Act act, int T, int M, int64_t D, const void* yE, void* X, const float* w, float eps,
                 cudaStream_t stream);

}  // namespace dsx::cuda
