// Row formats of the V4.1 decode state on the device (spec model-v41.md §5.1, the
// compact forms of model/kv_formats.h) and the small kernels that move rows into the
// rings. The per-session cache that holds them is backend/cuda/kv_cache.h.
//
//  * Fq8Rows  (window KV, FQ8 output): codes [rows, dim] e4m3fn bytes and
//             scales [rows, dim/32] ue8m0 bytes (2^(u-127)).           512 + 16 B/row
//  * Fq4e4Rows (compressed KV rows, FQ4e4 output): packed [rows, dim/2] e2m1 nibbles
//             (low nibble = even element) and scales [rows, dim/16] e4m3fn bytes.
//                                                                     256 + 32 B/row
//  * Fq4e8Rows (index keys, FQ4e8 output): packed [rows, dim/2] e2m1 nibbles and
//             scales [rows, dim/32] ue8m0 bytes.                        64 + 4 B/row
//
// Code and scale planes are separate arrays (row r of codes at codes + r * dim etc.),
// so every row's codes start 16-byte aligned when dim is a multiple of 32.
//
// Why the compact FQ8 form for the window ring (and not bf16 rows): the attention
// kernels decode a row once into shared memory (as bf16, exact) and then use it for
// all 64 heads, so the decode costs a few integer ops per element against 128 FMAs
// per element of compute; the compact row halves the L2/HBM bytes per row (528 vs
// 1024 B) and the ring footprint.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"

namespace dsx::cuda {

struct Fq8Rows {
  static constexpr int kBlock = 32;
  uint8_t* codes = nullptr;   // [rows, dim]
  uint8_t* scales = nullptr;  // [rows, dim / 32] ue8m0
  int dim = 0;
  static constexpr int64_t row_bytes(int dim) { return dim + dim / kBlock; }
};

struct Fq4e4Rows {
  static constexpr int kBlock = 16;
  uint8_t* packed = nullptr;  // [rows, dim / 2]
  uint8_t* scales = nullptr;  // [rows, dim / 16] e4m3
  int dim = 0;
  static constexpr int64_t row_bytes(int dim) { return dim / 2 + dim / kBlock; }
};

struct Fq4e8Rows {
  static constexpr int kBlock = 32;
  uint8_t* packed = nullptr;  // [rows, dim / 2]
  uint8_t* scales = nullptr;  // [rows, dim / 32] ue8m0
  int dim = 0;
  static constexpr int64_t row_bytes(int dim) { return dim / 2 + dim / kBlock; }
};

// Byte copies between device spans (a few hundred bytes to a few KB each), one block
// per span: the ring slots a greedy run-ahead stashes and puts back.
struct ByteCopy {
  const uint8_t* src;
  uint8_t* dst;
  int64_t n;
};
void copy_spans(const std::vector<ByteCopy>& copies, cudaStream_t stream);

// ---- kernels --------------------------------------------------------------------------
// Copies the window rows of a chunk (chunk row i = position p0 + i, p0 = *d_pos) into
// the ring: positions max(p0, p0 + T - cap) .. p0 + T - 1. Run after the chunk's
// attention (the attention kernels read positions >= p0 from the chunk rows).
void window_store(const Fq8Rows& chunk, int T, const Fq8Rows& ring, int cap, const int64_t* d_pos,
                  cudaStream_t stream);

// Copies the chunk's compressor projections (f32 [T, dim]) into the projection rings
// (positions max(p0, p0 + T - proj_cap) .. p0 + T - 1). Run after compressor_emit.
void proj_store(const float* kv, const float* gate, int T, int dim, float* ring_kv, float* ring_gate, int proj_cap,
                const int64_t* d_pos, cudaStream_t stream);

// *d_pos += delta (device side, for captured decode graphs: the last node of a step).
void advance_position(int64_t* d_pos, int64_t delta, cudaStream_t stream);

}  // namespace dsx::cuda
