// Prefill GEMM (many tokens) against weights in their stored formats: the weight is
// dequantized to a dense bf16 (or f32) matrix by a kernel - exact, spec §2.2 - and the
// product runs in cuBLAS with f32 accumulation; the activation is fake-quantized (QA8)
// first for FP8 / MXFP4 weights (values code * 2^k, exact in bf16), so the bf16 GEMM
// computes exactly Lin8 / Lin4 up to f32 summation order.
//
// Compute precision: BF16 (tensor cores, f32 accumulate) when requested and both operands
// are bf16-exact (weight not F32, activation bf16 or QA8'd); otherwise f32 (cuBLAS SGEMM,
// pedantic math: no TF32).
//
// cuBLAS handles are created on first use, one per device, shared (calls are serialised
// by a mutex); cuBLAS manages its own workspace. Not meant for CUDA-graph capture.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quant_act.h"
#include "model/qmatrix.h"

namespace dsx::cuda {

// Dense [N, K] copy of W (device pointers) as `out` (bf16: exact for FP8 / MXFP4 / BF16
// weights; F32 weights are rounded to bf16). dst row stride K elements.
void dequant(const QMatrix& W, DType out, void* dst, cudaStream_t stream);

// Dense product with an already dense weight: y[t, n] = sum_k a[t, k] * wd[n, k].
// a: [T, K] (row stride lda), wd: [N, K] (row stride K), both of type ct; y: [T, N] of
// type yt (row stride ldy); f32 accumulation. batch > 1: strided batch b uses
// a + b*stride_a, wd + b*stride_w, y + b*stride_y (element strides).
void gemm_dense(DType ct, const void* a, int64_t lda, int T, const void* wd, int64_t N, int64_t K, DType yt, void* y,
                int64_t ldy, cudaStream_t stream, int batch = 1, int64_t stride_a = 0, int64_t stride_w = 0,
                int64_t stride_y = 0);

struct GemmOpts {
  bool qa8 = true;   // QA8 for FP8 / MXFP4 weights (false for wo_a)
  int qblock = 32;
  int groups = 1;    // grouped product, same meaning as GemvOpts::groups
  DType compute = DType::BF16;  // requested precision (falls back to F32, see above)
};

// Workspace for gemm(): the dense weight plus the converted / quantized activation.
size_t gemm_ws_bytes(const QMatrix& W, int T, const GemmOpts& opts);

// y = Lin(x; W) for T rows (x type xt, row stride ldx; y type yt, row stride ldy).
void gemm(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
          const GemmOpts& opts, void* ws, size_t ws_bytes, cudaStream_t stream);

// The precision gemm() will use for these arguments.
DType gemm_compute_type(const QMatrix& W, DType xt, const GemmOpts& opts);

}  // namespace dsx::cuda
