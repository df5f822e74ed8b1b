// The tensor inventory of a V4.1 checkpoint (spec model-v41.md §2.3, Appendix A): every
// tensor a configuration implies, with its official name, logical shape, storage, layer
// and role, in the release's per-layer order. Which layers own a compressor, an indexer,
// the index-key projection or an Engram module comes from layer_plan(). This is the one
// list of the model's tensors: the loader (bind_weights), the random-model writer
// (write_tiny_model), the CUDA uploader and the cost model read it.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "model/config.h"
#include "util/safetensors.h"

namespace dsx {

// What a tensor is. Per-layer roles are the same for backbone layers and DSpark stages.
enum class Role : uint8_t {
  // global
  embed, head, norm,
  // every layer
  attn_norm, ffn_norm,
  hc_attn_fn, hc_attn_base, hc_attn_scale, hc_ffn_fn, hc_ffn_base, hc_ffn_scale,
  wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink,
  // KV sources: the compressor (wgate only for ratio > 1)
  comp_wkv, comp_wgate, comp_norm,
  // index sources; wk / k_norm only on KV sources
  idx_wq_b, idx_weights_proj, idx_wk, idx_k_norm,
  // MoE: router, routed experts (TensorSpec::expert), shared expert
  gate, gate_bias, gate_bias_vl,
  expert_w1, expert_w3, expert_w2,
  shared_w1, shared_w3, shared_w2,
  // Engram layers
  engram_table, engram_wkv, engram_q_weight, engram_k_weight,
  // DSpark stages only (mtp.<s>.*): first stage main_proj / main_norm, last stage the rest
  main_proj, main_norm, stage_norm, markov_embed, markov_head, confidence_proj,
};
constexpr int kRoleCount = static_cast<int>(Role::confidence_proj) + 1;
const char* role_name(Role r);

enum class Storage : uint8_t {
  F32Vector,    // F32 elementwise parameters (biases, sinks, hc base / scale)
  BF16Vector,   // BF16 elementwise parameters (norm weights; Engram q / k weights, one row per stream)
  F32Matrix,    // F32 [rows, cols], an operand of a product
  BF16Matrix,   // BF16 [rows, cols]
  FP8,          // <name>.weight F8_E4M3 [rows, cols] + <name>.scale F8_E8M0 [ceil(rows/B), ceil(cols/B)]
  MXFP4,        // <name>.weight I8 [rows, cols / 2] (packed e2m1, low nibble first) + <name>.scale F8_E8M0 [rows, cols / 32]
  EngramTable,  // <name>.weight F8_E4M3 [rows, dim] + <name>.scale F8_E8M0 [rows, dim / B]
};
const char* storage_name(Storage s);
inline bool is_vector(Storage s) { return s == Storage::F32Vector || s == Storage::BF16Vector; }

struct TensorSpec {
  std::string name;             // official name; FP8 / MXFP4 / Engram table: the base of .weight + .scale
  Role role = Role::embed;
  Storage storage = Storage::BF16Vector;
  std::vector<int64_t> shape;   // logical shape: [rows, cols] of matrices and tables (MXFP4 unpacked)
  int layer = -1;               // backbone layer; -1: global, or a DSpark stage
  int stage = -1;               // DSpark stage s of mtp.<s>.*; -1 otherwise
  int expert = -1;              // routed experts: the expert index
  int block = 0;                // FP8 / Engram table: the scale block (quant_block); MXFP4: 32
  bool optional = false;        // used by image tokens only (gate.bias_vl): a text checkpoint may lack it

  int64_t rows() const { return shape.front(); }
  int64_t cols() const { return shape.back(); }
  int64_t numel() const;
};

// One tensor as stored in the safetensors files.
struct StoredTensor {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  int64_t bytes() const;
};
// The stored tensors of t: one, or two (.weight then .scale) for FP8, MXFP4 and tables.
std::vector<StoredTensor> stored_tensors(const TensorSpec& t);
int64_t stored_bytes(const TensorSpec& t);

// The tensors of a V4.1 backbone: the global ones, then layer by layer, each layer in the
// release's order (norms, hc, attention, compressor, indexer, router, routed experts
// e = 0.. as w1 w3 w2, shared expert, Engram). The DSpark stages are not part of it.
class TensorInventory {
 public:
  explicit TensorInventory(const ModelConfig& c);

  const std::vector<TensorSpec>& tensors() const { return t_; }
  // The tensor of `role` in `layer` (-1: global; `expert` for routed experts); null when
  // the layer has none (e.g. no compressor).
  const TensorSpec* find(int layer, Role role, int expert = -1) const;
  // The tensor of `role`, which the layer must have.
  const TensorSpec& at(int layer, Role role, int expert = -1) const;
  // How many tensors the layer (-1: global) has.
  size_t count(int layer) const;

 private:
  static uint64_t key(int layer, Role role, int expert);
  std::vector<TensorSpec> t_;
  std::unordered_map<uint64_t, size_t> index_;
  std::vector<size_t> per_layer_;  // [layer + 1]
};

// The DSpark draft stages mtp.<s>.* of a config with num_nextn_predict_layers stages
// (spec dspark.md §3): per stage the block of a window-only layer with
// dspark_n_routed_experts experts; mtp.0 adds main_proj / main_norm, the last stage norm,
// the Markov head and the confidence head. Empty without stages. Loaded by model/dspark.h.
std::vector<TensorSpec> dspark_inventory(const ModelConfig& c);

// Bytes of t one decode step reads: all of it, except the embedding (one row), the routed
// experts (n_experts_per_tok of a layer's experts are read: those with index < that count
// stand for them, all having one shape) and the Engram tables (the rows gathered, one per
// hash column).
int64_t decode_read_bytes(const ModelConfig& c, const TensorSpec& t);

// The distribution a random model draws t from (make-tiny writes it; the CUDA synthetic
// model takes the vectors' mean / std): normal(mean, std), std 0 meaning all `mean`.
struct RandomInit {
  float std = 0.0f;
  float mean = 0.0f;
};
RandomInit random_init(const TensorSpec& t);

}  // namespace dsx
