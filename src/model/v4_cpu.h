// The DeepSeek V4 Flash forward pass on the CPU, in f32 with the quantization
// points of the V4 goldens (spec model-v41.md Part II §6.3; golden README §2a):
// QA8 with 1 x quant_block (128) blocks before every FP8 / FP4 matrix except wo_a,
// and no cache fake-quantizers (the golden's reference, transformers'
// DeepseekV4ForCausalLM, has no window-KV FP8, no indexer Hadamard / FP4 and no
// compressed-row quantization). Readable top-to-bottom code following the spec,
// like V41Cpu; performance lives in the kernels.
//
// Session state (runtime/kv_state.h, reused unchanged):
//   windows[l]  every layer: window ring of post-RoPE K=V rows (window + rollback slots);
//   caches[l]   compressed layers (ratio > 0): rows = compressed KV rows (post-norm,
//               post-RoPE), keys = the indexer's compressed keys (CSA layers; idx_dim 0
//               for HCA), and a ring of the f32 per-token compressor projections of the
//               most recent positions, proj_cap = coff * ratio + rollback_depth slots.
//               A ring row holds [main kv (coff*hd) | indexer kv (coff*ihd)] in proj_kv
//               and the raw gates (before ape) in the same layout in proj_gate. The
//               overlap of ratio-4 rows reads the previous group's A halves from it.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "model/config.h"
#include "model/rope.h"
#include "model/v41_cpu.h"  // ForwardDebug
#include "model/weights_v4.h"
#include "model/kv_state.h"

namespace dsx {

class V4Cpu {
 public:
  V4Cpu(ModelConfig cfg, ModelWeightsV4 weights);

  const ModelConfig& config() const { return cfg_; }
  const ModelWeightsV4& weights() const { return w_; }
  KVState new_state(int rollback_depth = 16) const;
  std::string fingerprint() const { return w_.files ? w_.files->fingerprint() : ""; }
  // Throws dsx::Error when a (restored) state does not have this model's geometry.
  void check_state(const KVState& st) const;

  // Feeds ids[0..T) at positions st.pos.. and advances the state. Writes the logits
  // of every row ([T, vocab]) when all_rows, else of the last row only ([vocab]).
  // Any split of a sequence into chunks gives the same result as one call.
  void forward(KVState& st, const int32_t* ids, int64_t T, float* logits, bool all_rows,
               ForwardDebug* dbg = nullptr) const;

  // Debugging aid for golden comparisons: called with every activation row right
  // before its QA8 (layer, site name — "wq_a", "wq_b", "wkv", "wo_b", "idx_wq_b",
  // "w1w3" (the input shared by the routed and shared experts), "w2.<expert id>",
  // "shared_w2" — the row's absolute position and the row, which the probe may
  // modify). Unset by default; not for concurrent forwards.
  using Qa8Probe = std::function<void(int layer, const char* site, int64_t pos, float* row, int64_t n)>;
  void set_qa8_probe(Qa8Probe probe) { probe_ = std::move(probe); }

 private:
  struct Step;  // per-forward scratch shared between layers

  void hc_mix(const QMatrix& fn, const std::vector<float>& base, const std::vector<float>& scale,
              const std::vector<float>& X, int64_t T, std::vector<float>& pre, std::vector<float>& post,
              std::vector<float>& comb) const;
  void attention(int layer, Step& s, KVState& st, const std::vector<float>& a, std::vector<float>& out) const;
  void compress(int layer, Step& s, KVState& st, const std::vector<float>& a) const;
  void indexer(int layer, Step& s, const KVState& st, const std::vector<float>& a, const std::vector<float>& q_lat,
               std::vector<std::vector<int32_t>>& sel) const;
  void moe(int layer, Step& s, const std::vector<float>& f, std::vector<float>& out) const;

  int64_t proj_width(int layer) const;  // floats per ring row of a compressed layer
  // Lin8 / Lin4: QA8 of every row of x [T, W.cols] (row i is the token at position
  // pos0 + (tok ? tok[i] : i)), then the product with the stored weight.
  std::vector<float> linear_q(const std::vector<float>& x, int64_t T, const QMatrix& W, int layer, const char* site,
                              int64_t pos0, const int64_t* tok = nullptr) const;

  ModelConfig cfg_;
  ModelWeightsV4 w_;
  RopeTable main_rope_, compress_rope_;
  Qa8Probe probe_;
};

}  // namespace dsx
