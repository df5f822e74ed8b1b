// The DSpark drafter on the GPU (model/dspark.h's Drafter; the CPU reference is
// DSparkDrafter, whose steps and spec corrections it follows).
//
// Weights: the stages are uploaded once, in their stored formats, by the backend's own
// device upload (DeviceModel::from_weights of a "stage model": S window-only layers with
// the stages' MoE sizes, the target's embedding and head, mtp.<S-1>.norm as the final
// norm), plus main_proj (FP8), main_norm, the Markov tables (BF16) and the confidence
// head (f32). Activations in the engine's precision (Act::F32: the CPU drafter's
// arithmetic up to summation order; Act::BF16: the target's bf16 rounding points).
//
// State (CudaDraftState): per stage a device ring of capacity W + rollback_depth compact
// FQ8 rows (the target's window-KV format, exact for these values) and a device array of
// the position each slot holds; a host mirror of the slots answers end() /
// context_rows() and is uploaded when it changed. observe() of a few rows (a verify's
// committed rows) only keeps their taps: the next block() computes their ring rows in
// its own launches (their wkv in the same product as the block rows', their kv_finish
// and ring store in the same launches), so a cycle's drafter work is one graph.
//
// One draft: block() uploads the anchor, the positions and the pending taps, and
// replays a CUDA graph (per state and pending row count; the first run of a shape is
// eager) that runs the pending ring rows, the block through the stages (the target's
// hc / GEMV / router / MoE / kv_finish kernels, the DSpark attention of
// kernels/cuda/dspark.h), the head, and the greedy Markov walk (B launches, each row
// reading the id the previous one picked on the device); the drafts and confidence logits
// land in pinned host memory. greedy() waits for it: the only host synchronisation of a
// draft. forced() / forced_row() walk the kept block again with given tokens.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/cuda/device_model.h"
#include "backend/cuda/workspace.h"
#include "kernels/cuda/elementwise_types.h"
#include "model/dspark.h"

namespace dsx::cuda {

class CudaDraftState;

class CudaDrafter final : public Drafter {
 public:
  // cfg: a drafter's resolved config (DSparkDrafter::config()), w its stage weights.
  CudaDrafter(const ModelConfig& cfg, const DSparkWeights& w, Act act);
  // Random weights in the official formats at cfg's shapes (cfg: a V4.1 config with the
  // dspark_* keys set; S stages), generated on the device: the benchmark's.
  static std::unique_ptr<CudaDrafter> synthetic(const ModelConfig& cfg, int n_stages, Act act, uint64_t seed);
  ~CudaDrafter() override;

  const ModelConfig& config() const override { return cfg_; }
  int n_stages() const override { return S_; }
  std::string backend_name() const override { return "cuda"; }
  int64_t weight_bytes() const override { return weight_bytes_; }
  Act act() const { return act_; }

  std::unique_ptr<DrafterState> make_state(int rollback_depth = 16) const override;
  void observe(DrafterState& st, const float* taps, int64_t T, int64_t p0) const override;
  std::unique_ptr<DraftBlock> draft_block(const DrafterState& st, int32_t anchor, int64_t n) const override;
  DSparkDraft greedy(const DraftBlock& b, bool full = true) const override;
  DSparkDraft forced(const DraftBlock& b, const int32_t* prev, bool full = true) const override;
  void forced_row(const DraftBlock& b, int j, int32_t prev, float* logits, float* confidence_logit) const override;
  void block_values(const DraftBlock& b, std::vector<float>* z, std::vector<float>* base_logits) const override;

  // Tests: the ring row of stage s for position p of a state (dequantized), empty when
  // the slot does not hold p.
  std::vector<float> ring_row(const DrafterState& st, int s, int64_t p) const;
  // Pending ring rows are computed by the next block; this computes them now.
  void flush(const DrafterState& st) const;
  // false: every block runs eagerly (no CUDA graphs; tests compare the two).
  void set_graphs(bool on) { graphs_ = on; }

 private:
  friend class CudaDraftState;
  CudaDrafter(const ModelConfig& cfg, Act act);
  void init_buffers();
  CudaDraftState& state_of(const DrafterState& st) const;
  void check_block(const DraftBlock& b) const;
  // Host inputs -> pinned staging (taps rounded to act)
  void stage_taps(const float* taps, int64_t T, int64_t row0) const;
  void eager_observe(CudaDraftState& s, const float* taps, int64_t T, int64_t p0) const;
  void flush_pending(CudaDraftState& s) const;
  void upload_held(CudaDraftState& s) const;
  // The device work of one block with `To` pending rows (launches on stream_).
  void run_block(CudaDraftState& s, int To) const;
  void markov_rows(bool greedy, int j0, int j1) const;
  void note_graph_time() const;
  void lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8, int groups = 1,
           float* split_ws = nullptr, size_t split_bytes = 0) const;

  ModelConfig cfg_;
  int S_ = 0;
  Act act_ = Act::F32;
  int64_t weight_bytes_ = 0;
  std::unique_ptr<DeviceModel> dm_;  // the stage model
  std::unique_ptr<Workspace> ws_;
  // drafter-only weights
  DeviceBuffer extra_;
  QMatrix main_proj_;
  float* main_norm_ = nullptr;
  const uint16_t *markov_embed_ = nullptr, *markov_head_ = nullptr;
  float* confidence_ = nullptr;
  // buffers
  DeviceBuffer buf_;
  struct Inputs {
    int64_t p0 = 0, n = 0;  // first pending row's position, the anchor position
  };
  Inputs* d_in_ = nullptr;
  void* d_taps_ = nullptr;           // [kRows, tap_width] act
  float *d_mk_g_ = nullptr, *d_mk_f_ = nullptr;  // [B, V] Markov logits (greedy, forced)
  float *d_e_g_ = nullptr, *d_e_f_ = nullptr;    // [B, R]
  int32_t *d_g_ = nullptr;           // [B + 1] greedy walk: anchor, d_1 .. d_B
  int32_t *d_fprev_ = nullptr, *d_ftok_ = nullptr;  // [B]
  float *d_cg_ = nullptr, *d_cf_ = nullptr;      // [B] confidence logits
  void* d_markov_ws_ = nullptr;
  float* d_mp_ws_ = nullptr;  // main_proj's split workspace
  size_t mp_ws_bytes_ = 0;
  mutable Pinned<Inputs> h_in_;
  mutable Pinned<uint8_t> h_taps_;   // [kRows, tap_width] act
  mutable Pinned<int32_t> h_ids_, h_tok_, h_ftok_, h_fprev_;
  mutable Pinned<float> h_conf_, h_fconf_;
  cudaStream_t stream_ = nullptr;
  mutable uint64_t generation_ = 0;  // of the latest block
  mutable int64_t block_n_ = -1;
  bool graphs_ = true;
  // DSX_GRAPH_TIMING: device time of the replayed block graphs (printed at exit)
  cudaEvent_t gt0_ = nullptr, gt1_ = nullptr;
  mutable bool timing_pending_ = false;
  mutable double graph_ms_ = 0;
  mutable int graph_runs_ = 0;
};

}  // namespace dsx::cuda
