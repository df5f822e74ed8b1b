// The DSpark drafter of DeepSeek V4.1 on the CPU: the draft stages mtp.<s>.* (loading and
// validation), the drafter's state (one context ring per stage), and one draft: the block
// of dspark_block_size rows through the stages, the base logits of the target's head, the
// Markov head walking the block and the confidence head. f32 with the model's
// quantization points, like the target's CPU forward (v41_cpu.h), whose block pieces it
// reuses (cpu_common.h); backend-agnostic in its interface, so the speculative decoder
// (runtime) and a CUDA drafter can be written against it.
//
// Section numbers refer to ../shared/spec/dspark.md; where it and the official
// DeepSeek-V4.1-Flash inference/model.py differ, this follows the official code, as the
// golden case deepseek_v41_dspark_tiny does (case.json: spec_corrections):
//   C1 (§5.1 step 4, §5.4 step 2, §14.1) the window-KV FP8 round trip covers the WHOLE
//      head_dim vector, RoPE dims included, in blocks of 32 with ue8m0 scales (the target's
//      FQ8 of its own window KV);
//   C2 (§5.4 step 1, §14.2) no per-head weightless RMS of q (only the q-LoRA RMSNorm);
//   C3 (§5.2) drafting starts at anchor position n >= 2 (the official draft call runs at
//      start_pos = n - 1 > 0; start_pos 0 is the seeding prefill);
//   C4 (§5.7) the confidence head returns a logit; the sigmoid is its consumer's
//      (dspark_confidence());
//   C5 (§4) taps are concatenated in ascending layer order (the target forward does so);
//   C6 (Appendix A) the hc mixer scales the projection by rsqrt(mean(v^2) + eps) after
//      the product (official hc_mixes), not before (the target forward's HF order; the
//      two agree up to rounding).
//
// The steps:
//   §2.2 / §3  load_dspark_weights: S = len(compress_ratios) - num_hidden_layers stages
//              (num_nextn_predict_layers is not trusted), cross-checked against the mtp.<s>.
//              prefixes of the tensor index; every tensor of dspark_inventory() checked
//              (presence, dtype, shape; errors name the tensor). Stage s is "layer" L + s:
//              compress ratio 0 (window only, main RoPE at rope_theta, no YaRN), MoE with
//              dspark_n_routed_experts / dspark_num_experts_per_tok.
//   §5.1       observe: u_p = main_norm(main_proj . QA8(g_p)) (fuse), then per stage the
//              ring row fq8(rope_p(kv_norm(wkv . QA8(u_p)))) in slot p mod capacity. Rows are
//              written only for committed positions; the block rows never enter a ring.
//   §5.2       block input: ids [anchor, noise x (B - 1)] at positions n .. n + B - 1, the
//              target's embedding copied into the hc streams, pre-mix one-hot on copy 0.
//   §5.3       each stage is the target's block (delayed mHC, V4.1 order: attention
//              collapses with the incoming pre, the FFN with the attention mixer's pre; the
//              FFN mixer's pre goes to the next stage) with DSpark attention and the stage's
//              MoE sizes (router, routed and shared experts as in the target).
//   §5.4       DSpark attention: q = rope(wq_b . QA8(q_norm(wq_a . QA8(y)))); block K = V =
//              fq8(rope(kv_norm(wkv . QA8(y)))); every query row sees the ring rows of
//              positions max(0, n - W) .. n - 1 (in the official slot order p mod W) and all
//              B block rows (no mask); scale head_dim^-0.5; per-head sink in the denominator;
//              output RoPE-inverted at n + j; grouped wo_a (no QA8), wo_b . QA8(.).
//   §5.5       z_j = the last stage's FFN pre collapsing the streams; base logits =
//              head . RMSNorm_{mtp.<S-1>.norm}(z_j) (the target's head, f32).
//   §5.6       Markov head: e_j = markov_head.embed[prev_j] (prev_0 = anchor, prev_j = d_j);
//              logits_j = base_j + markov_head.head . e_j (f32); greedy d_{j+1} = argmax
//              (ties to the lowest id), or a forced variant whose prev tokens are given.
//   §5.7       confidence logit_j = confidence_head.proj . [z_j ; e_j] in f32, no bias.
#pragma once
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/qmatrix.h"
#include "model/rope.h"
#include "model/weights.h"

namespace dsx {

// ---- loading (§2, §3) -------------------------------------------------------------------

// The DSpark stages of a checkpoint: S = len(compress_ratios) - num_hidden_layers, which
// must equal the number of mtp.<s>. stage prefixes of the tensor index (0 .. S - 1). 0
// when the checkpoint has none; throws dsx::Error naming the disagreement otherwise.
int dspark_stage_count(const ModelConfig& c, const ModelFiles& f);

// Whether a model directory can draft; when not, why (e.g. "no DSpark stages ...") in
// *why. Callers that get false run plain decoding. Never throws for a valid target.
bool dspark_available(const std::string& model_dir, std::string* why = nullptr);

struct DSparkWeights {
  std::shared_ptr<ModelFiles> files;
  int n_stages = 0;
  QMatrix embed, head;                  // the target's embed.weight / head.weight (tied)
  QMatrix main_proj;                    // mtp.0.main_proj: FP8 (or BF16) [D, tap_width]
  std::vector<float> main_norm;         // [D]
  std::vector<LayerWeights> stages;     // mtp.<s>.* blocks (window-only layers)
  std::vector<float> norm;              // mtp.<S-1>.norm [D]
  QMatrix markov_embed, markov_head;    // BF16 [V, R]
  std::vector<float> confidence;        // mtp.<S-1>.confidence_head.proj, [D + R] in f32
};

// Binds and validates the stages of a V4.1 checkpoint (errors name the tensor). Throws
// "<dir>: no DSpark stages (...)" when it has none.
DSparkWeights load_dspark_weights(const ModelConfig& c, std::shared_ptr<ModelFiles> files);

// ---- the drafter interface (backend-agnostic) -----------------------------------------

// A drafter's per-sequence state (§5.1): one context ring per stage, wherever the
// drafter keeps it (host memory for DSparkDrafter, device memory for the CUDA drafter).
// Made by Drafter::make_state and used only with the drafter that made it (which must
// outlive it).
class DrafterState {
 public:
  virtual ~DrafterState() = default;
  // One past the last observed position (the next position observe expects).
  virtual int64_t end() const = 0;
  // Forgets the rows of positions >= p (see DSparkState::truncate).
  virtual void truncate(int64_t p) = 0;
  void reset() { truncate(0); }
  // Ring rows an anchor at n sees: those held of positions max(0, n - W) .. n - 1.
  virtual int64_t context_rows(int64_t n) const = 0;
  virtual int capacity() const = 0;
  virtual int64_t bytes() const = 0;  // (host or device) memory of the state
};

// The parallel part of one draft (block(), §5.2 - §5.5), where its drafter keeps it.
// A drafter may keep only its latest block (the CUDA drafter: its device workspace);
// walking an older one is an error.
class DraftBlock {
 public:
  virtual ~DraftBlock() = default;
  int64_t n = 0;       // anchor position; row j sits at n + j
  int32_t anchor = 0;
};

struct DSparkDraft;

// What the speculative decoder (runtime/dspark_decoding.h) asks of a drafter: the ring
// writes of committed positions, the block at an anchor and the two Markov walks. The
// CPU reference DSparkDrafter (below) and the CUDA drafter (backend/cuda/dspark_drafter.h)
// implement it with the same semantics (§5.1 - §5.7, corrections C1 - C6 above).
// Thread safety: one thread at a time (as an engine).
class Drafter {
 public:
  virtual ~Drafter() = default;
  virtual const ModelConfig& config() const = 0;  // the target's, with the stages' keys resolved
  virtual int n_stages() const = 0;
  virtual std::string backend_name() const = 0;   // "cpu" | "cuda"
  virtual int64_t weight_bytes() const = 0;       // the stages' weights where the drafter computes
  int block_size() const { return config().dspark_block_size; }
  int64_t tap_width() const { return config().tap_width(); }
  int64_t vocab_size() const { return config().vocab_size; }

  virtual std::unique_ptr<DrafterState> make_state(int rollback_depth = 16) const = 0;
  // §5.1: the ring rows of committed positions p0 .. p0 + T - 1 from their taps [T,
  // tap_width] (host memory); positions >= p0 observed before are forgotten first; p0
  // beyond st.end() leaves holes (see DSparkDrafter::observe).
  virtual void observe(DrafterState& st, const float* taps, int64_t T, int64_t p0) const = 0;
  // §5.2 - §5.5: the block of the anchor token at position n (2 <= n <= st.end(), C3).
  virtual std::unique_ptr<DraftBlock> draft_block(const DrafterState& st, int32_t anchor, int64_t n) const = 0;
  // §5.6 - §5.7 greedy (prev_j = d_j) / with given previous tokens prev [B]. tokens, prev
  // and confidence_logits always; markov_logits and markov_embed when `full` (else they
  // may be left empty).
  virtual DSparkDraft greedy(const DraftBlock& b, bool full = true) const = 0;
  virtual DSparkDraft forced(const DraftBlock& b, const int32_t* prev, bool full = true) const = 0;
  // Row j of the forced walk alone: its Markov logits [V] (base_j + the Markov bias of
  // prev) and its confidence logit.
  virtual void forced_row(const DraftBlock& b, int j, int32_t prev, float* logits, float* confidence_logit) const = 0;
  // The block's z [B, D] (pre-norm collapsed state, the confidence input) and base logits
  // [B, V] (either may be null): checks against goldens.
  virtual void block_values(const DraftBlock& b, std::vector<float>* z, std::vector<float>* base_logits) const = 0;
};

// ---- the drafter's state (§5.1) ---------------------------------------------------------

// One context ring per stage: the K = V row of every observed committed position p in
// slot p mod capacity(), capacity = W + rollback_depth, so that truncating back by up to
// rollback_depth positions keeps every row a later anchor's window needs.
class DSparkState final : public DrafterState {
 public:
  DSparkState() = default;
  DSparkState(int n_stages, int window, int head_dim, int rollback_depth);

  int n_stages() const { return S_; }
  int window() const { return W_; }
  int capacity() const override { return cap_; }
  int head_dim() const { return hd_; }
  // One past the last observed position (the next position observe expects).
  int64_t end() const override { return end_; }
  // The ring row of stage s for position p, null when not held.
  const float* row(int s, int64_t p) const;
  // Forgets the rows of positions >= p (a rollback of the committed sequence to length p);
  // rows of positions < p that newer rows overwrote are gone (holes) once the rollback
  // goes back more than rollback_depth positions.
  void truncate(int64_t p) override;
  void reset() { truncate(0); }
  // Ring rows an anchor at n sees: those held of positions max(0, n - W) .. n - 1.
  int64_t context_rows(int64_t n) const override;
  int64_t bytes() const override { return static_cast<int64_t>(rows_.size() * 4 + held_.size() * 8); }

 private:
  friend class DSparkDrafter;
  float* slot(int s, int64_t p) { return rows_.data() + (static_cast<int64_t>(s) * cap_ + p % cap_) * hd_; }
  int S_ = 0, W_ = 0, cap_ = 0, hd_ = 0;
  int64_t end_ = 0;
  std::vector<float> rows_;     // [S, cap, hd]
  std::vector<int64_t> held_;   // [cap] position held by each slot, -1: none
};

// ---- one draft (§5.2 - §5.7) ------------------------------------------------------------

// The parallel part of a draft: the block through the stages and the head.
struct DSparkBlock final : DraftBlock {
  std::vector<float> z;             // [B, D] pre-norm collapsed state (confidence input)
  std::vector<float> base_logits;   // [B, V]; row j predicts position n + j + 1
};

// The sequential part: the Markov walk and the confidence head.
struct DSparkDraft {
  std::vector<int32_t> prev;               // [B] prev_j (anchor, then d_1 .. d_{B-1} or the forced ones)
  std::vector<int32_t> tokens;             // [B] d_{j+1} = argmax markov_logits row j (positions n + 1 ..)
  std::vector<float> markov_logits;        // [B, V] base + Markov bias of prev_j
  std::vector<float> markov_embed;         // [B, R] markov_head.embed[prev_j]
  std::vector<float> confidence_logits;    // [B]; sigmoid = P(d_{j+1} accepted | d_{<=j} accepted)
};

// What one block computed on the way (golden comparisons).
struct DSparkDebug {
  std::vector<int64_t> ring_positions;     // positions of the ring rows seen, in the order attended
  std::vector<float> block_kv;             // [S, B, hd] block K = V rows per stage
  std::vector<float> stage_out;            // [S, B, M, D] streams after each stage
  std::vector<float> stage_pre;            // [S, B, M] pre produced by each stage's FFN mixer
  std::vector<int32_t> router_experts;     // [S, B, K] experts per stage and row, best first
};

inline float dspark_confidence(float logit) { return 1.0f / (1.0f + std::exp(-logit)); }

class DSparkDrafter final : public Drafter {
 public:
  DSparkDrafter(ModelConfig cfg, DSparkWeights w);
  // The target config and stages of a model directory (throws "no DSpark stages" when
  // it has none: see dspark_available).
  static std::unique_ptr<DSparkDrafter> load(const std::string& model_dir);

  const ModelConfig& config() const override { return cfg_; }
  const DSparkWeights& weights() const { return w_; }
  int n_stages() const override { return w_.n_stages; }
  std::string backend_name() const override { return "cpu"; }
  int64_t weight_bytes() const override;
  DSparkState new_state(int rollback_depth = 16) const;
  std::unique_ptr<DrafterState> make_state(int rollback_depth = 16) const override;

  // §5.1 step 1: u [T, D] of T tap rows g [T, tap_width].
  void fuse(const float* taps, int64_t T, float* u) const;
  // §5.1: the ring rows of committed positions p0 .. p0 + T - 1 from their taps [T,
  // tap_width] (the target's taps of those rows). Positions >= p0 observed before are
  // forgotten first (a re-observe after a rollback). p0 beyond st.end() leaves positions
  // st.end() .. p0 - 1 as holes (a prefix restored without taps, §5.1: the window refills;
  // context_rows() tells). Only the last capacity() rows are computed.
  void observe(DSparkState& st, const float* taps, int64_t T, int64_t p0) const;
  void observe(DrafterState& st, const float* taps, int64_t T, int64_t p0) const override;

  // §5.2 - §5.5: the block of the anchor token at position n (2 <= n <= st.end(), C3).
  DSparkBlock block(const DSparkState& st, int32_t anchor, int64_t n, DSparkDebug* dbg = nullptr) const;
  std::unique_ptr<DraftBlock> draft_block(const DrafterState& st, int32_t anchor, int64_t n) const override;
  // §5.6 - §5.7, greedy drafting (temperature 0): prev_j = d_j (b: a DSparkBlock).
  DSparkDraft greedy(const DraftBlock& b, bool full = true) const override;
  // §5.6 - §5.7 with given previous tokens prev [B] (prev[0] is normally the anchor).
  DSparkDraft forced(const DraftBlock& b, const int32_t* prev, bool full = true) const override;
  void forced_row(const DraftBlock& b, int j, int32_t prev, float* logits, float* confidence_logit) const override;
  void block_values(const DraftBlock& b, std::vector<float>* z, std::vector<float>* base_logits) const override;
  // block + greedy.
  DSparkDraft draft(const DSparkState& st, int32_t anchor, int64_t n) const { return greedy(block(st, anchor, n)); }

 private:
  void stage(int s, const DSparkState& st, int64_t n, std::vector<float>& X, std::vector<float>& pre,
             const std::vector<float>& cos, const std::vector<float>& sin, DSparkDebug* dbg) const;
  void attention(int s, const DSparkState& st, int64_t n, const std::vector<float>& y, const std::vector<float>& cos,
                 const std::vector<float>& sin, std::vector<float>& out, DSparkDebug* dbg) const;
  void moe(int s, const std::vector<float>& f, std::vector<float>& out, DSparkDebug* dbg) const;
  void markov(const DSparkBlock& b, const int32_t* prev, DSparkDraft& d) const;
  // Row j's Markov logits [V] (base_j + bias of p) and confidence logit; e gets the embed row [R].
  void markov_row(const DSparkBlock& b, int64_t j, int32_t p, float* logits, float* e, float* conf) const;

  ModelConfig cfg_;        // the target's
  ModelConfig stage_cfg_;  // the stages' view: MoE sizes dspark_n_routed_experts / _experts_per_tok
  DSparkWeights w_;
  RopeTable rope_;         // main RoPE (compress ratio 0: rope_theta, no YaRN)
};

}  // namespace dsx
