// Binding of a model directory's tensors (official names, spec model-v41.md §2)
// to the per-layer structures the forward pass uses. Every tensor's presence,
// shape and dtype is checked against the config before anything runs; data stays
// memory-mapped (small vectors such as norms are widened to f32).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "model/qmatrix.h"
#include "model/config.h"
#include "util/safetensors.h"

namespace dsx {

// All safetensors files of a model directory (one file, or shards listed by
// model.safetensors.index.json).
class ModelFiles {
 public:
  explicit ModelFiles(const std::string& model_dir);
  const TensorView* find(const std::string& name) const;
  const std::vector<std::string>& names() const { return names_; }
  const std::string& dir() const { return dir_; }
  // SHA-256 over config.json and every shard's header (identifies the checkpoint).
  std::string fingerprint() const { return fingerprint_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::vector<std::pair<std::string, const TensorView*>> index_;  // sorted by name
  std::string fingerprint_;
};

struct EngramTable {
  int64_t rows = 0;
  int dim = 0;
  int block = 32;
  const uint8_t* data = nullptr;   // e4m3 [rows, dim]
  const uint8_t* scale = nullptr;  // e8m0 [rows, dim / block]
  void gather_row(int64_t r, float* out) const;
};

struct LayerWeights {
  std::vector<float> attn_norm, ffn_norm;
  QMatrix hc_attn_fn, hc_ffn_fn;                 // F32 [mix, M*D]
  std::vector<float> hc_attn_base, hc_attn_scale, hc_ffn_base, hc_ffn_scale;

  // attention
  QMatrix wq_a, wq_b, wkv, wo_a, wo_b;
  std::vector<float> q_norm, kv_norm, attn_sink;
  // compressor (KV sources)
  QMatrix comp_wkv, comp_wgate;                  // wgate only for ratio > 1
  std::vector<float> comp_norm;
  // indexer (index sources)
  QMatrix idx_wq_b, idx_weights_proj, idx_wk;    // wk only on KV sources
  std::vector<float> idx_k_norm;

  // MoE
  QMatrix gate;                                  // BF16 [E, D]
  std::vector<float> gate_bias;                  // [E]; empty for V4 hash layers
  std::vector<int32_t> tid2eid;                  // V4 hash layers: [vocab, top_k]
  std::vector<QMatrix> w1, w2, w3;               // routed experts (MXFP4)
  QMatrix sw1, sw2, sw3;                         // shared expert (FP8)

  // Engram
  bool has_engram = false;
  EngramTable engram_table;
  QMatrix engram_wkv;
  std::vector<float> engram_w;                   // q_weight * k_weight, [M, D] f32
};

struct ModelWeights {
  std::shared_ptr<ModelFiles> files;
  QMatrix embed, head;                           // BF16 [V, D]
  std::vector<float> norm;
  std::vector<LayerWeights> layers;
  // V4 only
  QMatrix hc_head_fn;
  std::vector<float> hc_head_base, hc_head_scale;
};

class WeightBinder;  // model/weight_binder.h
struct TensorSpec;   // model/inventory.h

// Binds one per-layer tensor of the inventory (a backbone layer's or a DSpark stage's
// block: norms, hc mixers, attention, compressor, indexer, router, experts, Engram) into
// L, checked by b. Returns false for a role that has no place in a layer (global and
// DSpark-only tensors).
bool bind_layer_tensor(WeightBinder& b, const TensorSpec& t, LayerWeights& L);

// Binds and validates every tensor. Unknown tensors are an error, except the
// modules a text backbone does not use (vision / aligner / image delimiters, and
// the draft stages mtp.* when the config declares them).
ModelWeights bind_weights(const ModelConfig& cfg, std::shared_ptr<ModelFiles> files);

}  // namespace dsx
