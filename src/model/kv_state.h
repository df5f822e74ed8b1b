// Per-sequence decode state of the V4.1 backbone (spec model-v41.md §5.1): window
// rings of every layer, the compressed KV rows and index keys of every KV source, the
// ratio-2 compressor's pending f32 projections, and the token history (which also
// carries the Engram look-back). KVGeometry describes its shape for both backends; the
// CPU reference keeps the values in f32 (KVState), the CUDA backend in the compact forms
// (kv_formats.h). Both serialise the same canonical sections (state_sections), so a
// snapshot taken on one backend restores on the other.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx {

struct ModelConfig;
class SnapshotWriter;
class SnapshotReader;

// ---- geometry --------------------------------------------------------------------
struct KVGeometry {
  int n_layers = 0;
  int window = 0;
  int rollback_depth = 16;
  int head_dim = 0;
  int idx_dim = 0;
  std::vector<int> source_ratio;  // per layer: its ratio if it is a KV source, else 0

  int window_cap() const { return window + rollback_depth; }
  int proj_cap(int layer) const {
    const int r = source_ratio[static_cast<size_t>(layer)];
    return r > 1 ? r + rollback_depth : 0;
  }
  // Compact bytes: the fixed part (window rings, compressor rings) and per token
  // (compressed rows and index keys of every KV source, the token id).
  int64_t fixed_bytes() const;
  double bytes_per_token() const;
  bool operator==(const KVGeometry& o) const;

  static KVGeometry of(const ModelConfig& cfg, int rollback_depth);
};

// ---- the canonical sections of a V4.1 state at position pos (snapshots) ------------
enum class SectionTag : uint32_t {
  kTokens = 1,        // int32 [pos]
  kWindowCodes = 2,   // per layer: e4m3 [window_cap, head_dim]
  kWindowScales = 3,  // per layer: ue8m0 [window_cap, head_dim / 32]
  kCompPacked = 4,    // per KV source: e2m1 pairs [pos / r, head_dim / 2]
  kCompScales = 5,    // per KV source: e4m3 [pos / r, head_dim / 16]
  kKeyPacked = 6,     // per KV source: e2m1 pairs [pos / r, idx_dim / 2]
  kKeyScales = 7,     // per KV source: ue8m0 [pos / r, idx_dim / 32]
  kProjKv = 8,        // per ratio > 1 KV source: f32 [proj_cap, head_dim]
  kProjGate = 9,
  kF32 = 10,          // V4 (CPU): a raw f32 vector of the state (see KVState::save)
};
constexpr uint32_t kNoLayer = 0xffffffffu;

struct StateSection {
  SectionTag tag;
  uint32_t layer;  // kNoLayer for the token history
  int64_t bytes;
  const char* name() const;
};
std::vector<StateSection> state_sections(const KVGeometry& g, int64_t pos);

// ---- the CPU state (f32) -------------------------------------------------------------
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
  std::vector<float> proj_kv, proj_gate;  // [proj_cap, width], slot = position % proj_cap
};

struct KVState {
  int64_t pos = 0;  // tokens consumed
  int rollback_depth = 16;
  bool compact = true;  // V4.1: every cached value is a fake-quantizer output (compact sections)
  std::vector<int32_t> tokens;
  std::vector<WindowRing> windows;       // one per layer
  std::vector<CompressedCache> caches;   // one per layer (ratio 0 unless KV source)

  // The payload sections of this state (after the caller's header): V4.1 the canonical
  // compact sections (an exact encoding of the f32 values), V4 its f32 vectors.
  void save(SnapshotWriter& w) const;
  // Reads them into a state of the same geometry (this one's), whole or not at all:
  // throws dsx::Error naming the problem and leaves *this untouched.
  void restore(SnapshotReader& r, int64_t pos);
  // Moves back to position new_pos (pos - rollback_depth <= new_pos <= pos).
  void rollback(int64_t new_pos);
  // Back to position 0 (any stale ring contents are never read again).
  void reset();
  int64_t bytes() const;

  // The fixed-size part (window rings, compressor rings) at the current position: with
  // the compressed rows before it, which later steps never change, it is the whole state
  // there (a checkpoint, model-v41.md §5.3).
  struct Fixed {
    int64_t pos = 0;
    std::vector<WindowRing> windows;
    std::vector<std::vector<float>> proj_kv, proj_gate;
    int64_t bytes() const;
  };
  Fixed fixed() const;
  // Back to a position p <= pos whose fixed part was kept (rows past p / r dropped).
  void restore_fixed(const Fixed& f);
};

// An empty state (position 0) with the geometry of a V4.1 model: window rings of
// window + rollback_depth rows per layer; compressed caches on KV sources, with
// projection rings of ratio + rollback_depth tokens for ratio > 1.
KVState make_kv_state(const ModelConfig& cfg, int rollback_depth);
KVGeometry geometry_of(const KVState& st);

}  // namespace dsx
