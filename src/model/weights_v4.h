// Binding of a DeepSeek V4 Flash model directory (official tensor names, spec
// model-v41.md §6.2 and Appendix A "V4 Flash") to the per-layer structures of the
// V4 forward pass (src/model/v4_cpu.h). Every tensor's presence, shape and dtype is
// checked against the config before anything runs; errors name file and tensor.
// Matrices stay memory-mapped; small vectors (norms, ape, sinks, hc parameters,
// router bias, tid2eid) are widened / copied.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/qmatrix.h"
#include "model/config.h"
#include "model/weights.h"  // ModelFiles

namespace dsx {

// What a V4 layer's compress ratio means (spec §6.1, §6.3.5): 0 = sliding window
// only; 4 = "CSA" (overlapping compressor + indexer); any other positive ratio =
// "HCA" (non-overlapping compressor, every visible compressed row attended).
enum class V4LayerKind { Sliding, CSA, HCA };
V4LayerKind v4_layer_kind(const ModelConfig& c, int layer);

// One compressor (the main one of a CSA/HCA layer, or the indexer's own one of a
// CSA layer). Rows of width d_c; a token's projections are coff * d_c wide
// (coff = 2 for the overlapping ratio-4 compressors, 1 otherwise).
struct V4CompressorWeights {
  int ratio = 0;
  int dim = 0;    // d_c: head_dim (main) or index_head_dim (indexer)
  int coff = 1;   // 2 when overlapping
  QMatrix wkv, wgate;            // BF16 (or F32) [coff * d_c, D], used in f32 without QA8
  std::vector<float> ape;        // [ratio, coff * d_c] learned position bias (F32 or BF16 on disk)
  std::vector<float> norm;       // [d_c]
  int64_t width() const { return static_cast<int64_t>(coff) * dim; }
};

struct LayerWeightsV4 {
  V4LayerKind kind = V4LayerKind::Sliding;
  std::vector<float> attn_norm, ffn_norm;
  QMatrix hc_attn_fn, hc_ffn_fn;  // F32 [(2+M)M, M*D]
  std::vector<float> hc_attn_base, hc_attn_scale, hc_ffn_base, hc_ffn_scale;

  // attention
  QMatrix wq_a, wq_b, wkv, wo_a, wo_b;  // FP8 (block = quant_block)
  std::vector<float> q_norm, kv_norm, attn_sink;
  V4CompressorWeights comp;             // CSA / HCA
  // indexer (CSA only)
  V4CompressorWeights idx_comp;
  QMatrix idx_wq_b;                     // FP8 [ih * ihd, q_lora]
  QMatrix idx_weights_proj;             // BF16 [ih, D]

  // MoE
  QMatrix gate;                         // BF16 [E, D]
  std::vector<float> gate_bias;         // [E]; empty in hash-routed layers
  std::vector<int32_t> tid2eid;         // hash-routed layers: [vocab, top_k] expert ids
  std::vector<QMatrix> w1, w2, w3;      // routed experts (MXFP4)
  QMatrix sw1, sw2, sw3;                // shared expert (FP8)
};

struct ModelWeightsV4 {
  std::shared_ptr<ModelFiles> files;
  QMatrix embed, head;                  // BF16 [V, D]
  std::vector<float> norm;              // [D]
  QMatrix hc_head_fn;                   // F32 [M, M*D]
  std::vector<float> hc_head_base;      // [M]
  std::vector<float> hc_head_scale;     // [1]
  std::vector<LayerWeightsV4> layers;
};

// Binds and validates every tensor of a V4 model. Unknown tensors are an error,
// except the MTP stages (mtp.*) the config declares.
ModelWeightsV4 bind_weights_v4(const ModelConfig& cfg, std::shared_ptr<ModelFiles> files);

}  // namespace dsx
