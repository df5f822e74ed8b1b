// Model configuration parsed from a release config.json (spec model-v41.md §1,
// Part II §6.1). Shapes always come from here, so the tiny golden models and the
// 40-layer release run the same code.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx {

enum class Family { V41, V4 };

struct YarnConfig {
  bool enabled = false;
  double factor = 1.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  int64_t original_max_position = 0;
};

struct ModelConfig {
  Family family = Family::V41;
  std::string model_type;

  // geometry
  int64_t vocab_size = 0;
  int64_t hidden = 0;            // D
  int n_layers = 0;
  int n_heads = 0;               // H
  int n_kv_heads = 1;
  int head_dim = 0;              // d
  int rope_dim = 0;              // d_r
  int q_lora_rank = 0;
  int o_lora_rank = 0;
  int o_groups = 0;
  int window = 0;                // sliding window W (query + W-1 previous)
  float rms_eps = 1e-6f;
  double rope_theta = 10000.0;
  double compress_rope_theta = 160000.0;
  YarnConfig yarn;
  int64_t max_position = 0;

  // compression / sparse attention (per backbone layer)
  std::vector<int> compress_ratios;   // n_layers entries
  std::vector<int> kv_source_layers;  // V4.1
  std::vector<int> index_source_layers;
  int index_n_heads = 0;
  int index_head_dim = 0;
  int index_topk = 0;
  int candidate_source_layer = -1;
  int candidate_topk_blocks = 0;
  int candidate_block_size = 1;

  // MoE
  int moe_inter = 0;
  int n_routed_experts = 0;
  int n_shared_experts = 1;
  int n_experts_per_tok = 0;
  std::string scoring_func;
  bool norm_topk_prob = true;
  float routed_scaling = 1.0f;
  float swiglu_limit = 0.0f;
  float gate_temp = 1.0f;
  int n_hash_layers = 0;  // V4

  // hyper-connections
  int hc_mult = 4;
  int hc_sinkhorn_iters = 20;
  float hc_eps = 1e-6f;

  // Engram (V4.1)
  std::vector<int> engram_layers;
  std::vector<int64_t> engram_num_embeddings;
  int engram_max_ngram = 0;
  int64_t engram_vocab_size = 0;
  int engram_n_heads = 0;
  int engram_head_dim = 0;
  int engram_pad_id = 2;
  int64_t engram_compressed_vocab = 0;

  // quantization
  int quant_block = 32;          // weight block and activation-quant block
  bool experts_fp4 = true;

  // tokens
  int bos_id = 0, eos_id = 1, pad_id = 2;

  // DSpark draft stages (spec dspark.md; the stages themselves are loaded by the drafter)
  int n_nextn_layers = 0;            // num_nextn_predict_layers
  int n_ratio_entries = 0;           // len(compress_ratios) as stored (backbone + stages)
  std::vector<int> dspark_target_layers;  // dspark_target_layer_ids, ascending (the tap order)
  int dspark_block_size = 0;
  int dspark_noise_token_id = -1;
  int dspark_markov_rank = 0;
  int dspark_n_routed_experts = 0;
  int dspark_experts_per_tok = 0;

  std::string config_json;  // the raw file, for fingerprints

  // ---- derived helpers ----
  int nope_dim() const { return head_dim - rope_dim; }
  int ratio(int l) const { return compress_ratios[static_cast<size_t>(l)]; }
  bool is_kv_source(int l) const;
  bool is_index_source(int l) const;
  bool is_engram_layer(int l) const;
  int engram_index(int l) const;   // position of l in engram_layers, -1 if none
  // Nearest KV source <= l (V4.1), -1 if none.
  int kv_source_of(int l) const;
  int64_t hc_dim() const { return static_cast<int64_t>(hc_mult) * hidden; }
  int hc_mix_dim() const { return (2 + hc_mult) * hc_mult; }
  // Position of layer l among the DSpark targets (its tap), -1 if none.
  int tap_index(int l) const;
  int64_t tap_width() const { return static_cast<int64_t>(dspark_target_layers.size()) * hidden; }
};

// Parse config.json text (composite V4.1 layout or flat V4 layout). `origin`
// names the file in error messages. Validates invariants (spec §1.4).
ModelConfig parse_model_config(const std::string& json_text, const std::string& origin);
ModelConfig load_model_config(const std::string& model_dir);

}  // namespace dsx
