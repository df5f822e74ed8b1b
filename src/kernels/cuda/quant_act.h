// QA8 activation quantization on the GPU (spec model-v41.md §3.0.3), bit-exact with
// dsx::cpu::qa8_codes / qa8_inplace, plus the activation-precision enum shared by all
// the weight-streaming kernels (gemv.h, gemm.h, moe.h, router.h).
//
// Two activation precisions are selected at run time (spec §4.2):
//   DType::F32  - f32 activations and results (reproduces the f32 CPU engine),
//   DType::BF16 - activations stored as bf16 (raw uint16 bit patterns), f32
//                 accumulation, each linear's output rounded once to bf16 (RNE).
// All pointers are device pointers; sizes are in elements; every launcher only
// enqueues work on `stream` (no host synchronisation, CUDA-graph capturable) unless
// its comment says otherwise.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cuda_util.h"

namespace dsx::cuda {

enum class DType : uint8_t { F32 = 0, BF16 = 1 };
inline size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }

// Multiprocessor count of the current device (cached per device).
int sm_count();

// QA8 of rows x[r, 0..K) (row stride ldx elements): per block of `block` (32 or
// 128, K % block == 0) consecutive elements a = max(max|x|, 1e-4),
// s = pow2ceil(a * fl32(1/448)), code = e4m3_rne(clamp(x / s, +-448)).
// codes: [rows, K] (row stride K), scales: [rows, K / block] f32 (powers of two).
void qa8_codes(DType xt, const void* x, int64_t ldx, int64_t rows, int64_t K, int block, uint8_t* codes,
               float* scales, cudaStream_t stream);

// The fake-quantized values code * scale written as yt (exact in bf16) to
// y[r, 0..K) (row stride ldy elements). y may alias x only when xt == yt and ldx == ldy.
void qa8_fake(DType xt, const void* x, int64_t ldx, int64_t rows, int64_t K, int block, DType yt, void* y,
              int64_t ldy, cudaStream_t stream);

// Elementwise conversion between activation types (f32 -> bf16 rounds to nearest even).
void convert(DType xt, const void* x, DType yt, void* y, int64_t n, cudaStream_t stream);

}  // namespace dsx::cuda
