// Elementwise / per-row kernels of the V4.1 forward (spec model-v41.md §3.0):
// RMSNorm (+ QA8 of its output), RoPE / inverse RoPE with in-kernel angles, the
// cache fake-quantizers, and their fusions (window KV, indexer queries).
//
// Conventions of every launcher in src/kernels/cuda/{elementwise,hc,engram_gate,
// compressor,indexer,topk,attention,kv_cache}.h:
//  * pointers are device pointers; `void*` activations hold f32 or bf16 per `Act`;
//  * positions come from device memory (`d_pos` = position of the chunk's first row,
//    the tokens consumed before the chunk), so a decode step can be captured once as a
//    CUDA graph and replayed; row r of a chunk has position *d_pos + r;
//  * weights of norms are f32 device vectors (widened from bf16 at load);
//  * RoPE tables are f32 device vectors of n_pairs inverse frequencies
//    (RopeTable::inv_freq of the main or compress table);
//  * everything is asynchronous on `stream`; launch errors throw dsx::Error.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

// RMSNorm of every row (spec §3.0.1 as the CPU engine computes it: Σx² in double,
// r = 1 / sqrt(float(Σx²/n) + eps), y = w * (x * r), one rounding to `act`).
// x, y: [rows, n] act, y may alias x. w: f32 [n] or null (unweighted).
// q_codes / q_scales (optional, both or neither): QA8 of the stored y for the
// following FP8 linear: e4m3 codes [rows, n] and f32 power-of-two scales
// [rows, n / 32] (blocks of 32 along n; n % 32 == 0), i.e. dsx::cpu::qa8_codes of y.
void rmsnorm(Act act, const void* x, void* y, const float* w, int rows, int n, float eps, uint8_t* q_codes,
             float* q_scales, cudaStream_t stream);

// QA8 codes / scales of rows x [rows, n] act (the format above). Used where the
// quantized input is not produced by a fused kernel.
void qa8_rows(Act act, const void* x, int rows, int n, uint8_t* q_codes, float* q_scales, cudaStream_t stream);

// In-place RoPE (inverse = conjugate) on the trailing 2 * n_pairs dims of every head
// of x [rows, heads, head_dim] act; row r uses position *d_pos + r.
void rope(Act act, void* x, int rows, int heads, int head_dim, int n_pairs, const float* inv_freq,
          const int64_t* d_pos, bool inverse, cudaStream_t stream);

// Indexer queries (spec §3.4.6): per head, RoPE (rounded to act) then FQ4e8.
// in [rows, heads, head_dim] act (indexer.wq_b output) -> out f32 [rows, heads,
// head_dim] fake-quantized values. head_dim % 32 == 0, head_dim <= 1024.
void rope_fq4e8(Act act, const void* in, float* out, int rows, int heads, int head_dim, int n_pairs,
                const float* inv_freq, const int64_t* d_pos, cudaStream_t stream);

// Window KV of a chunk (spec §3.4.2): c = FQ8(RoPE(RMSNorm(kv; kv_norm))) with act
// roundings after the norm and after the RoPE; written as compact rows (row r of
// `out` = chunk row r). kv: [rows, head_dim] act (the wkv output).
// head_dim % 32 == 0, head_dim <= 1024.
// ring (one row only, i.e. a decode step): also writes the row into the window ring slot
// (pos % ring_cap), which is what window_store would do after the attention. Safe for
// one query: its attention reads the ring only for positions pos - window + 1 .. pos - 1,
// and with ring_cap >= window the slot written (position pos - ring_cap) is not one of them.
void kv_finish(Act act, const void* kv, const float* kv_norm, float eps, int rows, int head_dim, int n_pairs,
               const float* inv_freq, const int64_t* d_pos, const Fq8Rows& out, cudaStream_t stream,
               const Fq8Rows* ring = nullptr, int ring_cap = 0);

// Standalone fake-quantizers, in place on f32 data of n elements (n % block == 0):
// bit-exact with dsx::cpu::qa8_inplace(.., 32) / fq4_e8_inplace(.., 32) /
// fq4_e4_inplace(.., 16).
enum class FakeQuant : uint8_t { FQ8, FQ4e8, FQ4e4 };
void fake_quant_inplace(FakeQuant kind, float* x, int64_t n, cudaStream_t stream);

// Compact forms of f32 rows [rows, dim] (quantizing them): the device counterpart of
// pack_fq*_rows for values that are not yet quantized.
void quantize_fq8_rows(const float* x, int64_t rows, int dim, const Fq8Rows& out, cudaStream_t stream);
void quantize_fq4e4_rows(const float* x, int64_t rows, int dim, const Fq4e4Rows& out, cudaStream_t stream);
void quantize_fq4e8_rows(const float* x, int64_t rows, int dim, const Fq4e8Rows& out, cudaStream_t stream);

// Dequantized f32 values of compact rows [rows, dim] (exact).
void dequant_fq8_rows(const Fq8Rows& in, int64_t rows, float* out, cudaStream_t stream);
void dequant_fq4e4_rows(const Fq4e4Rows& in, int64_t rows, float* out, cudaStream_t stream);
void dequant_fq4e8_rows(const Fq4e8Rows& in, int64_t rows, float* out, cudaStream_t stream);

// Internal: throws with the launch error (if any) of the last kernel.
void check_launch(const char* what);

}  // namespace dsx::cuda
