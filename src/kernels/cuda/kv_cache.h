// Device layout of the V4.1 decode state (spec model-v41.md §5.1) in its lossless
// compact forms, plus exact host pack/unpack to and from the CPU KVState (f32).
//
// Row formats (every value is exactly code x scale, a bf16-representable number):
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
//
// Per layer: a window ring of cap = window + rollback_depth rows (slot = position %
// cap), like the CPU WindowRing. Per KV source: compressed rows and index keys with a
// capacity of max_context / ratio rows (row j = group j), and for ratio > 1 the f32
// compressor projection rings proj_kv / proj_gate [proj_cap, head_dim] (slot =
// position % proj_cap, proj_cap = ratio + rollback_depth), exactly as in the CPU
// CompressedCache. The position counter (tokens consumed) lives on the device too
// (d_pos) so captured decode graphs read it; the kernels never advance it (the
// engine does, after the step).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "model/config.h"
#include "model/kv_state.h"

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

// ---- exact host conversions (f32 fake-quantized values <-> compact rows) --------
// pack_*: the inputs must be outputs of the matching fake-quantizer (any block of
// values code x scale); a block that no code/scale pair reproduces bit-exactly
// makes the function throw dsx::Error. The chosen scale is the one the quantizer
// itself would produce on these values whenever that one reproduces them.
void pack_fq8_rows(const float* vals, int64_t rows, int dim, uint8_t* codes, uint8_t* scales);
void unpack_fq8_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int dim, float* out);
void pack_fq4e4_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales);
void unpack_fq4e4_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out);
void pack_fq4e8_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales);
void unpack_fq4e8_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out);

// ---- geometry ---------------------------------------------------------------------
struct DeviceKVGeometry {
  int n_layers = 0;
  int window = 0;
  int rollback_depth = 16;
  int head_dim = 0;
  int idx_dim = 0;
  int64_t max_context = 0;        // capacity in tokens
  std::vector<int> source_ratio;  // per layer: ratio if the layer is a KV source, else 0

  int window_cap() const { return window + rollback_depth; }
  int proj_cap(int layer) const { return source_ratio[layer] > 1 ? source_ratio[layer] + rollback_depth : 0; }
  int64_t row_capacity(int layer) const { return source_ratio[layer] > 0 ? max_context / source_ratio[layer] : 0; }
  int64_t device_bytes() const;

  static DeviceKVGeometry from_config(const ModelConfig& cfg, int64_t max_context, int rollback_depth);
};

// ---- the device state of one sequence ----------------------------------------------
class DeviceKVCache {
 public:
  DeviceKVCache() = default;
  explicit DeviceKVCache(const DeviceKVGeometry& g) { allocate(g); }
  void allocate(const DeviceKVGeometry& g);  // zero-filled, position 0
  const DeviceKVGeometry& geometry() const { return g_; }

  Fq8Rows window(int layer) const;
  Fq4e4Rows compressed(int layer) const;  // KV sources only
  Fq4e8Rows keys(int layer) const;        // KV sources only
  float* proj_kv(int layer) const;        // ratio > 1 KV sources only
  float* proj_gate(int layer) const;
  int64_t* d_pos() const { return pos_.as<int64_t>(); }

  // Exact copy of a CPU state of the same geometry onto the device (synchronous).
  void upload(const KVState& st, cudaStream_t stream = nullptr);
  // Exact copy back: fills st.pos, windows, caches (rows / keys / n / projections).
  // st must have the geometry of this cache (e.g. from V41Cpu::new_state); its token
  // history is left alone (the device does not keep it).
  void download(KVState& st, cudaStream_t stream = nullptr) const;
  int64_t position() const;  // reads d_pos (synchronous)
  void set_position(int64_t pos, cudaStream_t stream = nullptr);

  // The ring slots that a one-token step at position p writes in layers [0, l1): the
  // window row (codes and scales) and, on ratio > 1 KV sources, the projection rows.
  // A step run ahead of the host and then dropped (CudaSession's greedy run-ahead) puts
  // them back, which leaves the state byte for byte as if it had never run (compressed
  // rows and index keys it may have emitted lie past the row count: never read, never
  // saved, rewritten by the next step there). stash_slots copies the slots into `stash`
  // (slot_stash_bytes(l1) device bytes), unstash_slots copies them back (async on stream).
  int64_t slot_stash_bytes(int l1) const;
  void stash_slots(int l1, int64_t p, uint8_t* stash, cudaStream_t stream) const;
  void unstash_slots(int l1, int64_t p, const uint8_t* stash, cudaStream_t stream);

 private:
  struct Layer {
    DeviceBuffer win_codes, win_scales;
    DeviceBuffer cmp_packed, cmp_scales, key_packed, key_scales;
    DeviceBuffer proj_kv, proj_gate;
  };
  // (ring address, bytes) of the slots of slot_stash_bytes, in stash order
  std::vector<std::pair<uint8_t*, int64_t>> step_slots(int l1, int64_t p) const;
  DeviceKVGeometry g_;
  std::vector<Layer> layers_;
  DeviceBuffer pos_;
};

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
