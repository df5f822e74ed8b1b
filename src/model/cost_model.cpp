#include "model/cost_model.h"

#include <algorithm>

#include "model/inventory.h"
#include "model/layer_plan.h"
#include "util/error.h"

namespace dsx {

ModelConfig synthetic_v41_flash_config(int layers) {
  DSX_CHECK(layers >= 1 && layers <= 40, "--layers must be in [1, 40]");
  ModelConfig c;
  c.family = Family::V41;
  c.model_type = "deepseek_v41";
  c.vocab_size = 129280;
  c.hidden = 5120;
  c.n_layers = layers;
  c.n_heads = 64;
  c.head_dim = 512;
  c.rope_dim = 64;
  c.q_lora_rank = 1280;
  c.o_lora_rank = 1024;
  c.o_groups = 8;
  c.window = 128;
  c.rms_eps = 1e-20f;
  c.rope_theta = 10000;
  c.compress_rope_theta = 160000;
  c.yarn = {true, 16, 32, 1, 65536};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_topk_blocks = 2048;
  c.candidate_block_size = 8;
  c.moe_inter = 2304;
  c.n_routed_experts = 384;
  c.n_experts_per_tok = 6;
  c.scoring_func = "sqrtsoftplus";
  c.routed_scaling = 1.5f;
  c.swiglu_limit = 10.0f;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.quant_block = 32;
  // The release schedule in miniature: 0 window, 1 window + Engram, 2 ratio-2 KV
  // source, 3 ratio-2 reuse, 4 ratio-1 KV + candidate source, 5 reuse, 6 re-index, 7..
  // alternate reuse / re-index.
  const int pattern[8] = {0, 0, 2, 2, 1, 1, 1, 1};
  for (int l = 0; l < layers; ++l) c.compress_ratios.push_back(l < 8 ? pattern[l] : 1);
  if (layers > 2) c.kv_source_layers.push_back(2), c.index_source_layers.push_back(2);
  if (layers > 4) c.kv_source_layers.push_back(4), c.index_source_layers.push_back(4), c.candidate_source_layer = 4;
  for (int l = 6; l < layers; l += 2) c.index_source_layers.push_back(l);
  if (layers > 1) {
    c.engram_layers = {1};
    c.engram_num_embeddings = {384006168};
    c.engram_max_ngram = 4;
    c.engram_vocab_size = 16000000;
    c.engram_n_heads = 8;
    c.engram_head_dim = 256;
    c.engram_pad_id = 2;
    c.engram_compressed_vocab = 99092;
  }
  return c;
}


// The matrices and tables of the inventory, as much of each as a decode step reads. The
// vectors (norm weights, biases, sinks, hc base / scale, Engram q / k weights: a few KB a
// layer) are left out of the figure.
int64_t v41_decode_weight_bytes(const ModelConfig& c) {
  int64_t b = 0;
  const TensorInventory inv(c);
  for (const TensorSpec& t : inv.tensors())
    if (!is_vector(t.storage)) b += decode_read_bytes(c, t);
  return b;
}

int64_t decode_state_bytes(const ModelConfig& c, int64_t ctx) {
  int64_t b = 0;
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  const int64_t win_row = hd + hd / 32, cmp_row = hd / 2 + hd / 16, key_row = ihd / 2 + ihd / 32;
  for (int l = 0; l < c.n_layers; ++l) {
    b += std::min<int64_t>(ctx, c.window) * win_row;
    const LayerPlan p = layer_plan(c, l);
    if (!p.compressed()) continue;
    const int64_t n = ctx / p.ratio;
    b += std::min<int64_t>(n, c.index_topk) * cmp_row;
    if (p.index_source)
      b += (p.uses_candidates ? std::min<int64_t>(n, static_cast<int64_t>(c.candidate_topk_blocks) * c.candidate_block_size) : n) * key_row;
  }
  return b;
}
}  // namespace dsx
