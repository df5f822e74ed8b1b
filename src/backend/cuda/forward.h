// The V4.1 forward pass on the GPU for a pass of R rows that belong to one or more
// sessions (segments): the same computation as the CPU reference (model/v41_cpu.cpp),
// step for step, on the kernels of src/kernels/cuda. Every weight product runs once
// over all R rows (one weight stream; the MoE takes the union of the rows' experts);
// what depends on a session's state (window KV, compressor, indexer scores and top-k,
// attention, ring stores, the position) runs per segment on its own rows.
//
// Decode-sized passes (R <= kGemvMaxT) run independent chains on side streams (graph
// branches, streams.h); the runner captures such passes as CUDA graphs and replays them.
#pragma once
#include <cstdint>
#include <vector>

#include "backend/cuda/device_model.h"
#include "backend/cuda/kv_cache.h"
#include "backend/cuda/stage_timer.h"
#include "backend/cuda/streams.h"
#include "backend/cuda/workspace.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/hc.h"

namespace dsx::cuda {

struct Segment {
  DeviceSession* s = nullptr;
  int r0 = 0, n = 0;       // rows [r0, r0 + n) of the pass, positions pos .. pos + n - 1
  int64_t ctx_bound = 0;   // context bound of the indexer / top-k launches (>= pos + n)
  bool head = false;       // Pass::Head::Last: its last row goes through the head
};

struct Pass {
  std::vector<Segment> segs;
  int T = 0;  // rows
  // Last: the last row of every segment with `head` (logits row k: the k-th of them);
  // All: every row (logits row r: row r; passes of more than kHeadRows rows leave the
  // head to head_rows)
  enum class Head { None, Last, All } head = Head::Last;
  bool pick = false;          // greedy ids of the head's logits rows into d_pick / h_pick
  bool pick_in_head = false;  // (one row: the head's product itself picks, into d_ids: run-ahead input)
  bool taps = false;          // DSpark taps of every row into Workspace::taps
  int l0 = 0, l1 = -1;        // layers of this part of the step (-1: to the end)
};

class Forward {
 public:
  Forward(const DeviceModel& m, Workspace& w, Streams& s, StageTimer& prof) : m_(m), c_(m.cfg), w_(w), s_(s), prof_(prof) {}
  // The kernels of one pass: the embedding (l0 == 0), layers [l0, l1), the final fold,
  // the head (Head::Last) and the position advance (l1 == n_layers). Head::All leaves
  // the head of passes longer than kHeadRows to head_rows().
  void run(const Pass& p);
  // Logits of rows [r0, r0 + n) of the final norm's output (n <= kHeadRows) into
  // Workspace::logits.
  void head_rows(int r0, int n);

 private:
  void attention(const Pass& p, int l);
  void moe(const Pass& p, int l);
  void engram(const Pass& p, int l);
  void head_last(const Pass& p);
  // Launches on `st` (default: the session stream) with the GEMV split workspace of that
  // stream (concurrent branches must not share one). staged / out_staged: GemvOpts
  // (one row); returns whether out_staged was written. pick / pick_copy: GemvOpts::pick.
  bool lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8,
           int groups = 1, cudaStream_t st = nullptr, const uint32_t* staged = nullptr,
           uint32_t* out_staged = nullptr, int32_t* pick = nullptr, int32_t* pick_copy = nullptr);
  GemvOpts gemv_opts(bool qa8, int groups, cudaStream_t st) const;
  // A staged-activation buffer (producer -> consumer QA8 codes): null unless one row,
  // QA8 blocks of 32 and STAGED_X.
  uint32_t* staged_x(uint32_t* buf, int T) const;
  bool branches(int T) const;
  void hc_site_finish(const HcFinishArgs& fz, bool branch, bool consumer_here);
  void hc_site_pass(const HcPassArgs& p);
  void join_sides();
  // row offsets into the pass's activation buffers
  void* act_row(void* base, int64_t r, int64_t width) const { return static_cast<char*>(base) + r * width * w_.ab; }

  const DeviceModel& m_;
  const ModelConfig& c_;
  Workspace& w_;
  Streams& s_;
  StageTimer& prof_;
  // The Sinkhorn branch is joined by a signal (signal_device.cuh: the mix kernel signals
  // sig_hc, the next hc pass waits for it in the kernel, keeping its programmatic early
  // launch) where that pass runs in the same forward pass, else by an event. Every side
  // stream joins the session stream at the end of a forward pass (join_sides).
  enum class HcPending { none, event, signal };
  HcPending hc_pending_ = HcPending::none;
  unsigned side_used_ = 0;  // side streams forked since the last join (bit i: side[i], bit 3: side_hc)
};

}  // namespace dsx::cuda
