// Small kernels of the CUDA engine's forward step that belong to no kernel family:
// embedding gather, the one-hot initial pre-mix, the DSpark taps, the position counter,
// synthetic weights. All read their dynamic inputs from device memory (CUDA-graph friendly).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"

namespace dsx::cuda {

// X[t, m, :] = embed[ids[t], :] for every stream m < M (bf16 table [V, D] -> act).
void embed_streams(Act act, const uint16_t* embed, const int32_t* ids, int T, int M, int64_t D, void* X,
                   cudaStream_t stream);

// pre[t, :] = (1, 0, ..., 0) for t < T (M entries per row).
void onehot_pre(float* pre, int T, int M, cudaStream_t stream);

// DSpark taps (spec model-v41.md §1.5): out[t * ld + d] = the mean over the M streams of
// X[t, m, d] (act), summed in stream order in f32 (bf16 mode: rounded to bf16).
void stream_mean(Act act, const void* X, int T, int M, int64_t D, float* out, int64_t ld, cudaStream_t stream);

// *d_pos += n.
void advance_pos(int64_t* d_pos, int64_t n, cudaStream_t stream);

// Fills `n` bytes with valid random codes of a weight format, from a counter-based
// hash of (seed, index):
//   kind 0: e4m3 codes from a normal-ish distribution (never NaN),
//   kind 1: packed e2m1 nibble pairs,
//   kind 2: e8m0 scale bytes in [center - spread, center + spread],
//   kind 3: bf16 values ~ N(0, std) (n counts bytes, even),
//   kind 4: f32 values ~ N(mean, std) (n counts bytes, multiple of 4).
void fill_random(void* dst, int64_t n, int kind, uint64_t seed, float std, float mean, int center, int spread,
                 cudaStream_t stream);

}  // namespace dsx::cuda
