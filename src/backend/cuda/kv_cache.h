// The device state of one sequence (spec model-v41.md §5.1) in the compact forms of
// kernels/cuda/kv_cache.h, in one device allocation: per layer a window ring of cap =
// window + rollback_depth rows (slot = position % cap); per KV source the compressed
// rows and index keys for max_context / ratio rows (row j = group j) and, for ratio > 1,
// the f32 compressor projection rings [proj_cap, head_dim] (slot = position % proj_cap).
// The position counter (tokens consumed) lives on the device too (d_pos), so captured
// graphs read it; kernels never advance it (the step's last launch does).
//
// Snapshots stream the canonical sections of model/kv_state.h straight from / to these
// buffers through a pinned staging buffer; checkpoints copy the fixed part (rings) into
// a device buffer.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/kv_cache.h"
#include "model/kv_state.h"

namespace dsx {
class SnapshotWriter;
class SnapshotReader;
}  // namespace dsx

namespace dsx::cuda {

// Device bytes of a session's state with capacity max_context.
int64_t device_state_bytes(const KVGeometry& g, int64_t max_context);

class DeviceKVCache {
 public:
  DeviceKVCache(const KVGeometry& g, int64_t max_context);  // zero-filled, position 0
  const KVGeometry& geometry() const { return g_; }
  int64_t max_context() const { return max_ctx_; }
  int64_t row_capacity(int layer) const;
  int64_t device_bytes() const { return static_cast<int64_t>(buf_.size()); }

  Fq8Rows window(int layer) const;
  Fq4e4Rows compressed(int layer) const;  // KV sources only
  Fq4e8Rows keys(int layer) const;        // KV sources only
  float* proj_kv(int layer) const;        // ratio > 1 KV sources only
  float* proj_gate(int layer) const;
  int64_t* d_pos() const { return pos_; }
  void set_position(int64_t pos, cudaStream_t stream);  // (synchronous)

  // The sections of a snapshot at position pos (after the token history), in the
  // order of state_sections(): (device address, bytes).
  std::vector<std::pair<uint8_t*, int64_t>> section_spans(int64_t pos) const;
  // Writes / reads them through `stage` (pinned, stage_bytes). restore checks that
  // every section is the expected one; on an error the caller resets the position.
  void save(SnapshotWriter& w, int64_t pos, uint8_t* stage, size_t stage_bytes, cudaStream_t stream) const;
  void restore(SnapshotReader& r, int64_t pos, uint8_t* stage, size_t stage_bytes, cudaStream_t stream);

  // The fixed part (window rings, compressor rings): what a checkpoint keeps.
  std::vector<std::pair<uint8_t*, int64_t>> fixed_spans() const;
  int64_t fixed_bytes() const;

  // The ring slots that a one-token step at position p writes in layers [0, l1): the
  // window row (codes and scales) and, on ratio > 1 KV sources, the projection rows.
  // A step run ahead of the host and then dropped (the greedy run-ahead) puts them
  // back, which leaves the state byte for byte as if it had never run (compressed rows
  // and index keys it may have emitted lie past the row count: never read, never
  // saved, rewritten by the next step there). stash_slots copies the slots into
  // `stash` (slot_stash_bytes(l1) device bytes), unstash_slots copies them back.
  int64_t slot_stash_bytes(int l1) const;
  void stash_slots(int l1, int64_t p, uint8_t* stash, cudaStream_t stream) const;
  void unstash_slots(int l1, int64_t p, const uint8_t* stash, cudaStream_t stream);

 private:
  struct Layer {
    uint8_t *win_codes = nullptr, *win_scales = nullptr;
    uint8_t *cmp_packed = nullptr, *cmp_scales = nullptr, *key_packed = nullptr, *key_scales = nullptr;
    float *proj_kv = nullptr, *proj_gate = nullptr;
  };
  std::vector<std::pair<uint8_t*, int64_t>> step_slots(int l1, int64_t p) const;
  KVGeometry g_;
  int64_t max_ctx_ = 0;
  DeviceBuffer buf_;
  std::vector<Layer> layers_;
  int64_t* pos_ = nullptr;
};

// One sequence on the device: its state and the host copy of its token history (the
// Engram look-back, snapshots).
struct DeviceSession {
  uint64_t id = 0;
  std::unique_ptr<DeviceKVCache> cache;
  int64_t pos = 0;
  std::vector<int32_t> tokens;
};

}  // namespace dsx::cuda
