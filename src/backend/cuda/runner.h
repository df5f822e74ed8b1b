// The CUDA backend of an engine: the device model, the shared workspace and streams,
// the captured graphs, and the sessions' device states. step() runs a multi-row,
// multi-session step: the rows of all feeds are packed into passes of at most
// max_rows() rows (one weight stream per pass), decode-sized passes are captured as
// graphs (graphs.h) and replayed, and a greedy one-row step of one session starts the
// next step before the host has read its id (the run-ahead, docs/gpu.md).
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/device_model.h"
#include "backend/cuda/forward.h"
#include "backend/cuda/graphs.h"
#include "backend/cuda/kv_cache.h"
#include "backend/cuda/stage_timer.h"
#include "backend/cuda/streams.h"
#include "backend/cuda/workspace.h"

namespace dsx {
class SnapshotWriter;
class SnapshotReader;
}  // namespace dsx

namespace dsx::cuda {

// What one session contributes to a step (runtime Feed, with the device session).
struct SegmentFeed {
  DeviceSession* s = nullptr;
  const int32_t* ids = nullptr;
  int64_t n = 0;
  float* logits = nullptr;  // [n, vocab] (all_rows) or [vocab]; may be null
  float* taps = nullptr;    // [n, tap_width]; may be null
  int32_t* pick = nullptr;  // greedy id of the last row; may be null
  int32_t* picks = nullptr; // [n] greedy id of every row; may be null
};

struct RunnerStats {
  int64_t weight_bytes = 0;           // device memory of the weights
  int64_t decode_weight_bytes = 0;    // weight bytes one decode step must read
  int64_t workspace_bytes = 0;        // the shared scratch
  double copy_bandwidth_gb_s = 0;     // measured device-to-device copy bandwidth
};

class Runner {
 public:
  Runner(std::unique_ptr<DeviceModel> m, int64_t max_ctx, int rollback_depth);
  ~Runner();
  const DeviceModel& model() const { return *m_; }
  const KVGeometry& geometry() const { return geom_; }
  int64_t max_context() const { return max_ctx_; }
  int max_rows() const { return w_->max_rows; }
  int64_t session_device_bytes() const;  // one session's state
  int64_t fixed_bytes() const;           // a checkpoint's

  std::unique_ptr<DeviceSession> new_session();
  void release(DeviceSession& s);  // (before the session's state goes away)

  void step(const std::vector<SegmentFeed>& feeds, bool all_rows);

  // State operations of one session (each first drops a step run ahead).
  void rollback(DeviceSession& s, int64_t pos);
  void reset(DeviceSession& s);
  void save(const DeviceSession& s, SnapshotWriter& w);
  // (the token history section is read by the caller; on an error the session is reset)
  void restore(DeviceSession& s, SnapshotReader& r, int64_t pos);
  struct Checkpoint {
    int64_t pos = 0;
    DeviceBuffer fixed;
  };
  Checkpoint checkpoint(const DeviceSession& s);
  void restore(DeviceSession& s, const Checkpoint& c);
  void synthetic_fill(DeviceSession& s, int64_t n, uint64_t seed);

  RunnerStats stats();

 private:
  void drop_ahead();
  void greedy_one(DeviceSession& s, int32_t id, int32_t* pick);
  void run_ahead(DeviceSession& s);
  void continue_ahead(DeviceSession& s, int32_t id);
  void stage_engram(const Pass& p, const std::vector<const int32_t*>& ids, cudaStream_t st);
  int64_t decode_graph_ctx(int64_t ctx) const;
  GraphKey key_of(const Pass& p) const;
  void capture(GraphEntry& e, const Pass& p);
  cudaGraphExec_t capture_part(const Pass& p, int l0, int l1);
  // Runs one pass (eagerly or from its graph); inputs staged first.
  void run_pass(Pass& p, const std::vector<const int32_t*>& ids, bool decode_sized);
  void note_graph_time();

  std::unique_ptr<DeviceModel> m_;
  KVGeometry geom_;
  int64_t max_ctx_ = 0;
  int split_layer_ = 0;  // the first Engram layer when its rows are gathered while layers before it run
  std::unique_ptr<Streams> s_;
  std::unique_ptr<Workspace> w_;
  StageTimer prof_;
  std::unique_ptr<Forward> fwd_;
  GraphCache graphs_;
  uint64_t next_id_ = 1;
  std::vector<DeviceSession*> live_;
  // greedy run-ahead: a step of `session` at `pos` launched on the device's pick
  struct Ahead {
    DeviceSession* session = nullptr;
    int64_t pos = 0;
    int32_t id = -1;
    GraphKey key;
  };
  Ahead ahead_;
  DeviceSession* stashed_session_ = nullptr;
  int64_t stashed_pos_ = -1;  // the position whose step slots the stash holds (-1: none)
  // DSX_GRAPH_TIMING
  bool graph_timing_ = false, timing_pending_ = false;
  double graph_ms_ = 0, step_wall_ms_ = 0;
  int graph_runs_ = 0, timing_rows_ = 0;
  std::map<int, std::pair<double, int>> graph_ms_by_rows_;  // rows of a pass -> (device ms, passes)
};

Act parse_precision(const std::string& p);

}  // namespace dsx::cuda
