// Per-sequence decode state of the V4.1 backbone (spec model-v41.md §5.1): window
// rings of every layer, the compressed KV rows and index keys of every KV source,
// the ratio-2 compressor's pending f32 projections, and the token history (which
// also carries the Engram look-back). Designed for exact save/restore and for
// rollback of up to `rollback_depth` tokens without re-running the prefix.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx {

struct WindowRing {
  int cap = 0;  // sliding window + rollback depth
  int dim = 0;
  std::vector<float> rows;  // [cap, dim], slot = position % cap
  float* row(int64_t pos) { return rows.data() + (pos % cap) * dim; }
  const float* row(int64_t pos) const { return rows.data() + (pos % cap) * dim; }
};

struct CompressedCache {
  int ratio = 0;  // 0: this layer is not a KV source
  int dim = 0, idx_dim = 0;
  int64_t n = 0;                // emitted groups (rows)
  std::vector<float> rows;      // [n, dim] compressed KV (post-RoPE, post-FQ4e4)
  std::vector<float> keys;      // [n, idx_dim] index keys (post-RoPE, post-FQ4e4e8)
  // ratio > 1: per-token f32 compressor projections of the most recent tokens
  int proj_cap = 0;
  std::vector<float> proj_kv, proj_gate;  // [proj_cap, dim], slot = position % proj_cap
};

struct KVState {
  int64_t pos = 0;  // tokens consumed
  int rollback_depth = 16;
  std::string fingerprint;  // model identity
  std::vector<int32_t> tokens;
  std::vector<WindowRing> windows;       // one per layer
  std::vector<CompressedCache> caches;   // one per layer (ratio 0 unless KV source)

  // Serialized form (little-endian, versioned, checked on restore).
  std::vector<uint8_t> save() const;
  // Restores into a state of the same geometry (created by the same model);
  // throws dsx::Error naming the problem for corrupt / foreign data.
  void restore(const uint8_t* data, size_t n);
  // Moves back to position new_pos (pos - rollback_depth <= new_pos <= pos).
  void rollback(int64_t new_pos);
  int64_t bytes() const;
};

struct ModelConfig;
// An empty state (position 0) with the geometry of a V4.1 model: window rings of
// window + rollback_depth rows per layer; compressed caches on KV sources, with
// projection rings of ratio + rollback_depth tokens for ratio > 1.
KVState make_kv_state(const ModelConfig& cfg, int rollback_depth, const std::string& fingerprint);

}  // namespace dsx
