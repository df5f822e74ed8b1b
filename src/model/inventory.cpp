#include "model/inventory.h"

#include <cmath>

#include "model/layer_plan.h"
#include "util/error.h"

namespace dsx {

const char* role_name(Role r) {
  static const char* const names[kRoleCount] = {
      "embed", "head", "norm",
      "attn_norm", "ffn_norm",
      "hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
      "wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b", "attn_sink",
      "comp_wkv", "comp_wgate", "comp_norm",
      "idx_wq_b", "idx_weights_proj", "idx_wk", "idx_k_norm",
      "gate", "gate_bias", "gate_bias_vl",
      "expert_w1", "expert_w3", "expert_w2",
      "shared_w1", "shared_w3", "shared_w2",
      "engram_table", "engram_wkv", "engram_q_weight", "engram_k_weight",
      "main_proj", "main_norm", "stage_norm", "markov_embed", "markov_head", "confidence_proj",
  };
  return names[static_cast<int>(r)];
}

const char* storage_name(Storage s) {
  switch (s) {
    case Storage::F32Vector: return "F32 vector";
    case Storage::BF16Vector: return "BF16 vector";
    case Storage::F32Matrix: return "F32 matrix";
    case Storage::BF16Matrix: return "BF16 matrix";
    case Storage::FP8: return "FP8";
    case Storage::MXFP4: return "MXFP4";
    case Storage::EngramTable: return "Engram table";
  }
  return "?";
}

int64_t TensorSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

int64_t StoredTensor::bytes() const {
  int64_t n = static_cast<int64_t>(dtype_size(dtype));
  for (int64_t d : shape) n *= d;
  return n;
}

std::vector<StoredTensor> stored_tensors(const TensorSpec& t) {
  switch (t.storage) {
    case Storage::F32Vector:
    case Storage::F32Matrix: return {{t.name, DType::F32, t.shape}};
    case Storage::BF16Vector:
    case Storage::BF16Matrix: return {{t.name, DType::BF16, t.shape}};
    case Storage::FP8: {
      const int64_t b = t.block, n = t.rows(), k = t.cols();
      return {{t.name + ".weight", DType::F8_E4M3, {n, k}},
              {t.name + ".scale", DType::F8_E8M0, {(n + b - 1) / b, (k + b - 1) / b}}};
    }
    case Storage::MXFP4:
      return {{t.name + ".weight", DType::I8, {t.rows(), t.cols() / 2}},
              {t.name + ".scale", DType::F8_E8M0, {t.rows(), t.cols() / 32}}};
    case Storage::EngramTable:
      return {{t.name + ".weight", DType::F8_E4M3, {t.rows(), t.cols()}},
              {t.name + ".scale", DType::F8_E8M0, {t.rows(), t.cols() / t.block}}};
  }
  fail("stored_tensors: unknown storage of ", t.name);
}

int64_t stored_bytes(const TensorSpec& t) {
  int64_t n = 0;
  for (const StoredTensor& s : stored_tensors(t)) n += s.bytes();
  return n;
}

namespace {

// Appends the tensors of one layer or stage (names under `prefix`) to `out`.
struct Lister {
  const ModelConfig& c;
  std::vector<TensorSpec>& out;
  std::string prefix;
  int layer = -1;
  int stage = -1;

  TensorSpec& add(Role r, Storage s, const std::string& name, std::vector<int64_t> shape) {
    TensorSpec t;
    t.name = prefix + name;
    t.role = r;
    t.storage = s;
    t.shape = std::move(shape);
    t.layer = layer;
    t.stage = stage;
    if (s == Storage::FP8 || s == Storage::EngramTable) t.block = c.quant_block;
    if (s == Storage::MXFP4) t.block = 32;
    out.push_back(std::move(t));
    return out.back();
  }

  // The block of a layer (spec §2.3): what plan p says it owns, with n_experts routed experts.
  void block(const LayerPlan& p, int64_t n_experts) {
    const int64_t D = c.hidden, M = c.hc_mult, mix = c.hc_mix_dim(), H = c.n_heads, hd = c.head_dim;
    const int64_t ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank, I = c.moe_inter;
    using R = Role;
    using S = Storage;
    add(R::attn_norm, S::BF16Vector, "attn_norm.weight", {D});
    add(R::ffn_norm, S::BF16Vector, "ffn_norm.weight", {D});
    add(R::hc_attn_fn, S::F32Matrix, "hc_attn_fn", {mix, M * D});
    add(R::hc_attn_base, S::F32Vector, "hc_attn_base", {mix});
    add(R::hc_attn_scale, S::F32Vector, "hc_attn_scale", {3});
    add(R::hc_ffn_fn, S::F32Matrix, "hc_ffn_fn", {mix, M * D});
    add(R::hc_ffn_base, S::F32Vector, "hc_ffn_base", {mix});
    add(R::hc_ffn_scale, S::F32Vector, "hc_ffn_scale", {3});
    add(R::wq_a, S::FP8, "attn.wq_a", {ql, D});
    add(R::q_norm, S::BF16Vector, "attn.q_norm.weight", {ql});
    add(R::wq_b, S::FP8, "attn.wq_b", {H * hd, ql});
    add(R::wkv, S::FP8, "attn.wkv", {hd, D});
    add(R::kv_norm, S::BF16Vector, "attn.kv_norm.weight", {hd});
    add(R::wo_a, S::FP8, "attn.wo_a", {G * ol, H * hd / G});
    add(R::wo_b, S::FP8, "attn.wo_b", {D, G * ol});
    add(R::attn_sink, S::F32Vector, "attn.attn_sink", {H});
    if (p.kv_source) {
      add(R::comp_wkv, S::BF16Matrix, "attn.compressor.wkv.weight", {hd, D});
      if (p.ratio > 1) add(R::comp_wgate, S::BF16Matrix, "attn.compressor.wgate.weight", {hd, D});
      add(R::comp_norm, S::BF16Vector, "attn.compressor.norm.weight", {hd});
    }
    if (p.index_source) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      add(R::idx_wq_b, S::FP8, "attn.indexer.wq_b", {ih * ihd, ql});
      add(R::idx_weights_proj, S::BF16Matrix, "attn.indexer.weights_proj.weight", {ih, D});
      if (p.kv_source) {
        add(R::idx_wk, S::BF16Matrix, "attn.indexer.wk.weight", {ihd, hd});
        add(R::idx_k_norm, S::BF16Vector, "attn.indexer.k_norm.weight", {ihd});
      }
    }
    add(R::gate, S::BF16Matrix, "ffn.gate.weight", {n_experts, D});
    add(R::gate_bias, S::F32Vector, "ffn.gate.bias", {n_experts});
    add(R::gate_bias_vl, S::F32Vector, "ffn.gate.bias_vl", {n_experts}).optional = true;
    for (int64_t e = 0; e < n_experts; ++e) {
      const std::string q = "ffn.experts." + std::to_string(e) + ".";
      add(R::expert_w1, S::MXFP4, q + "w1", {I, D}).expert = static_cast<int>(e);
      add(R::expert_w3, S::MXFP4, q + "w3", {I, D}).expert = static_cast<int>(e);
      add(R::expert_w2, S::MXFP4, q + "w2", {D, I}).expert = static_cast<int>(e);
    }
    add(R::shared_w1, S::FP8, "ffn.shared_experts.w1", {I, D});
    add(R::shared_w3, S::FP8, "ffn.shared_experts.w3", {I, D});
    add(R::shared_w2, S::FP8, "ffn.shared_experts.w2", {D, I});
    if (p.engram >= 0) {
      const int64_t rows = c.engram_num_embeddings.at(static_cast<size_t>(p.engram)), ed = c.engram_head_dim;
      const int64_t ncols = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads;
      add(R::engram_table, S::EngramTable, "engram.embed", {rows, ed});
      add(R::engram_wkv, S::FP8, "engram.wkv", {(M + 1) * D, ncols * ed});
      add(R::engram_q_weight, S::BF16Vector, "engram.q_weight", {M, D});
      add(R::engram_k_weight, S::BF16Vector, "engram.k_weight", {M, D});
    }
  }
};

}  // namespace

uint64_t TensorInventory::key(int layer, Role role, int expert) {
  return (static_cast<uint64_t>(layer + 1) << 40) | (static_cast<uint64_t>(role) << 32) |
         static_cast<uint64_t>(static_cast<uint32_t>(expert + 1));
}

TensorInventory::TensorInventory(const ModelConfig& c) {
  if (c.family != Family::V41) fail("the tensor inventory describes deepseek_v41 models, not '", c.model_type, "'");
  const int64_t V = c.vocab_size, D = c.hidden;
  Lister g{c, t_, "", -1, -1};
  g.add(Role::embed, Storage::BF16Matrix, "embed.weight", {V, D});
  g.add(Role::head, Storage::BF16Matrix, "head.weight", {V, D});
  g.add(Role::norm, Storage::BF16Vector, "norm.weight", {D});
  for (int l = 0; l < c.n_layers; ++l) {
    Lister a{c, t_, "layers." + std::to_string(l) + ".", l, -1};
    a.block(layer_plan(c, l), c.n_routed_experts);
  }
  per_layer_.assign(static_cast<size_t>(c.n_layers) + 1, 0);
  index_.reserve(t_.size());
  for (size_t i = 0; i < t_.size(); ++i) {
    const TensorSpec& t = t_[i];
    ++per_layer_[static_cast<size_t>(t.layer + 1)];
    index_.emplace(key(t.layer, t.role, t.expert), i);
  }
}

const TensorSpec* TensorInventory::find(int layer, Role role, int expert) const {
  auto it = index_.find(key(layer, role, expert));
  return it == index_.end() ? nullptr : &t_[it->second];
}

const TensorSpec& TensorInventory::at(int layer, Role role, int expert) const {
  const TensorSpec* t = find(layer, role, expert);
  if (!t) fail("tensor inventory: layer ", layer, " has no ", role_name(role), expert >= 0 ? cat(" of expert ", expert) : "");
  return *t;
}

size_t TensorInventory::count(int layer) const {
  const size_t i = static_cast<size_t>(layer + 1);
  return i < per_layer_.size() ? per_layer_[i] : 0;
}

std::vector<TensorSpec> dspark_inventory(const ModelConfig& c) {
  std::vector<TensorSpec> out;
  const int S = c.n_nextn_layers;
  if (S <= 0) return out;
  if (c.dspark_target_layers.empty() || c.dspark_markov_rank <= 0 || c.dspark_n_routed_experts <= 0)
    fail("the config declares ", S, " draft stages but no DSpark targets, Markov rank or expert count");
  const int64_t D = c.hidden, V = c.vocab_size, rank = c.dspark_markov_rank;
  LayerPlan window;  // a stage is a window-only layer: no compressor, indexer or Engram
  for (int s = 0; s < S; ++s) {
    Lister a{c, out, "mtp." + std::to_string(s) + ".", -1, s};
    if (s == 0) {
      a.add(Role::main_proj, Storage::FP8, "main_proj", {D, c.tap_width()});
      a.add(Role::main_norm, Storage::BF16Vector, "main_norm.weight", {D});
    }
    a.block(window, c.dspark_n_routed_experts);
    if (s == S - 1) {
      a.add(Role::stage_norm, Storage::BF16Vector, "norm.weight", {D});
      a.add(Role::markov_embed, Storage::BF16Matrix, "markov_head.embed.weight", {V, rank});
      a.add(Role::markov_head, Storage::BF16Matrix, "markov_head.head.weight", {V, rank});
      a.add(Role::confidence_proj, Storage::BF16Matrix, "confidence_head.proj.weight", {1, D + rank});
    }
  }
  return out;
}

int64_t decode_read_bytes(const ModelConfig& c, const TensorSpec& t) {
  if (t.stage >= 0) return 0;  // the draft stages are not part of a backbone step
  switch (t.role) {
    case Role::embed: return stored_bytes(t) / t.rows();  // one row
    case Role::expert_w1:
    case Role::expert_w3:
    case Role::expert_w2: return t.expert < c.n_experts_per_tok ? stored_bytes(t) : 0;
    case Role::engram_table: {
      const int64_t ncols = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads;
      return ncols * (stored_bytes(t) / t.rows());  // one row (codes + scales) per hash column
    }
    default: return stored_bytes(t);
  }
}

RandomInit random_init(const TensorSpec& t) {
  switch (t.role) {
    case Role::embed: return {1.0f, 0.0f};
    case Role::hc_attn_fn:
    case Role::hc_ffn_fn: return {0.02f, 0.0f};
    case Role::hc_attn_base:
    case Role::hc_ffn_base: return {0.1f, 0.0f};
    case Role::attn_sink: return {0.5f, 0.0f};
    case Role::gate_bias:
    case Role::gate_bias_vl: return {0.05f, 0.0f};
    case Role::engram_table: return {0.5f, 0.0f};
    default: break;
  }
  if (is_vector(t.storage)) return {0.0f, 1.0f};  // norm weights, hc scales, Engram q / k weights
  return {1.0f / std::sqrt(static_cast<float>(t.cols())), 0.0f};  // linear layers: std 1 / sqrt(fan-in)
}

}  // namespace dsx
