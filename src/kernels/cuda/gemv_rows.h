// Internal: the GEMV of 2..16 rows against a BF16 weight whose one-row product runs the
// CUDA-core kernel of gemv.cu without a K split (the head: 129280 x 5120). gemv() uses
// it when it applies (gemv_rows.cu says what it computes and how).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/quant_act.h"

namespace dsx::cuda {

// Rows at most (more: the caller's passes).
constexpr int kGemvRowsMax = 16;

// y[t, n] = sum_k x[t, k] W[n, k] for t < T (2 <= T <= kGemvRowsMax), W BF16 (wv: its
// device view, row-major), x of type xt (row stride ldx), y of type yt (row stride ldy).
// Each row's result is, bit for bit, what the one-row CUDA-core kernel (gemv.cu,
// gemv_kernel with one warp per row and no K split) gives for that row alone. false: not
// applicable (alignment, shared memory); the caller then runs its other kernels.
bool gemv_rows(const dev::WView& wv, int64_t N, int K, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y,
               int64_t ldy, cudaStream_t stream);

}  // namespace dsx::cuda
