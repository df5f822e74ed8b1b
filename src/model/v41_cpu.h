// The DeepSeek V4.1 forward pass on the CPU, in f32 with every quantization point
// of the model (spec model-v41.md §3, §4.1). This is the reference path: readable
// top-to-bottom code following the spec; performance lives in the kernels.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "model/config.h"
#include "model/engram.h"
#include "model/rope.h"
#include "model/weights.h"
#include "model/kv_state.h"

namespace dsx {

// Decisions and intermediate values captured during one forward (for golden
// comparisons). Rows are the chunk's tokens.
struct ForwardDebug {
  std::vector<std::vector<int32_t>> router_experts;      // [layer] -> [T * top_k], descending biased score
  std::vector<std::vector<int32_t>> sparse_topk;         // [layer] -> [T * index_topk], ascending, -1 pad (index sources)
  std::vector<uint8_t> candidate_mask;                   // [T * n_compressed] at the candidate source
  int64_t candidate_mask_cols = 0;
  std::vector<int64_t> engram_hash_ids;                  // [T, n_engram_layers, n_cols]
  std::vector<std::vector<float>> attn_norm_out, ffn_norm_out;  // [layer] -> [T * D]
  std::vector<float> final_norm_out;                     // [T * D]
};

class V41Cpu {
 public:
  // engram_token_map: compressed id of every raw token id (may be empty when the
  // config has no Engram layers).
  V41Cpu(ModelConfig cfg, ModelWeights weights, std::vector<int32_t> engram_token_map);

  const ModelConfig& config() const { return cfg_; }
  const ModelWeights& weights() const { return w_; }
  KVState new_state(int rollback_depth = 16) const;
  const std::string& fingerprint() const { return fingerprint_; }

  // Expert parallelism (issue 28, docs/multi-gpu.md): the MoE of every layer computed as
  // `ranks` ranks would, each its own experts' partial output, combined in rank order
  // (model/cpu/expert_shards.h). 1 (the default) is the one-rank path. Throws dsx::Error
  // for ranks < 1 or more ranks than routed experts.
  void set_expert_ranks(int ranks);
  int expert_ranks() const { return expert_ranks_; }

  // Feeds ids[0..T) at positions st.pos.. and advances the state. Writes the logits
  // of every row ([T, vocab]) when all_rows, else of the last row only ([vocab]); none
  // when logits is null. taps (optional, [T, cfg.tap_width()]): the DSpark taps of every
  // row (spec model-v41.md §1.5: the mean over the hc streams entering each
  // dspark_target_layer_ids layer, after its Engram, ascending layer order).
  void forward(KVState& st, const int32_t* ids, int64_t T, float* logits, bool all_rows,
               ForwardDebug* dbg = nullptr, float* taps = nullptr) const;

 private:
  struct Step;  // per-forward scratch shared between layers

  void engram(int layer, Step& s, std::vector<float>& X) const;
  void hc_mix(const QMatrix& fn, const std::vector<float>& base, const std::vector<float>& scale,
              const std::vector<float>& X, int64_t T, std::vector<float>& pre, std::vector<float>& post,
              std::vector<float>& comb) const;
  void attention(int layer, Step& s, KVState& st, const std::vector<float>& a, std::vector<float>& out) const;
  void compressor(int layer, Step& s, KVState& st, const std::vector<float>& a, std::vector<float>& latents,
                  int64_t& first_group) const;
  void indexer(int layer, Step& s, KVState& st, const std::vector<float>& a, const std::vector<float>& q_lat,
               const std::vector<float>& new_latents, int64_t first_group) const;
  void moe(int layer, Step& s, const std::vector<float>& f, std::vector<float>& out) const;

  ModelConfig cfg_;
  ModelWeights w_;
  std::vector<int32_t> cmap_;
  EngramLayout engram_;
  RopeTable main_rope_, compress_rope_;
  std::string fingerprint_;
  int expert_ranks_ = 1;
};

}  // namespace dsx
