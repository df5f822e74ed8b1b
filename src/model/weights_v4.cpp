// V4 Flash tensor binding (spec model-v41.md §6.2). Shapes follow the config; see
// weights_v4.h for what is kept mapped and what is widened.
#include "model/weights_v4.h"

#include "model/weight_binder.h"
#include "util/error.h"
#include "util/safetensors.h"

namespace dsx {

V4LayerKind v4_layer_kind(const ModelConfig& c, int layer) {
  const int r = c.ratio(layer);
  if (r == 0) return V4LayerKind::Sliding;
  return r == 4 ? V4LayerKind::CSA : V4LayerKind::HCA;
}

namespace {

// Hash-routing table [vocab, top_k] (I64 in the official files, I32 accepted);
// every entry must name an expert.
std::vector<int32_t> bind_tid2eid(WeightBinder& b, const std::string& name, int64_t vocab, int64_t k,
                                  int64_t n_experts) {
  const TensorView& t = b.tensor(name, {vocab, k}, {DType::I64, DType::I32});
  std::vector<int32_t> v(static_cast<size_t>(vocab * k));
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t e = t.dtype == DType::I64 ? t.as<int64_t>()[i] : t.as<int32_t>()[i];
    if (e < 0 || e >= n_experts)
      fail(t.file, ": tensor '", name, "' row ", static_cast<int64_t>(i) / k, " names expert ", e, " (the model has ",
           n_experts, ")");
    v[i] = static_cast<int32_t>(e);
  }
  return v;
}

// Geometry checks the forward pass relies on (beyond what the config parser checks).
void validate_v4_config(const ModelConfig& c, const std::string& dir) {
  auto bad = [&](const std::string& what) { fail(dir, "/config.json: invalid V4 configuration: ", what); };
  if (c.family != Family::V4) bad("model_type is not deepseek_v4");
  if (c.n_hash_layers < 0 || c.n_hash_layers > c.n_layers) bad("num_hash_layers out of range");
  if (c.hc_mult <= 0) bad("hc_mult must be positive");
  for (int l = 0; l < c.n_layers; ++l) {
    const int r = c.ratio(l);
    if (r < 0) bad("negative compress ratio at layer " + std::to_string(l));
    if (r == 4) {
      if (c.index_head_dim <= c.rope_dim || c.index_head_dim % 2)
        bad("index_head_dim must be even and larger than qk_rope_head_dim (the indexer rotates its trailing rope dims)");
      if (c.index_n_heads <= 0 || c.index_topk <= 0) bad("indexer settings must be positive");
    }
  }
}

void bind_compressor(WeightBinder& b, V4CompressorWeights& cw, const std::string& p, int ratio, int dim, bool overlap,
                     int64_t D) {
  cw.ratio = ratio;
  cw.dim = dim;
  cw.coff = overlap ? 2 : 1;
  const int64_t w = cw.width();
  cw.wkv = b.dense(p + "wkv.weight", w, D);
  cw.wgate = b.dense(p + "wgate.weight", w, D);
  cw.ape = b.f32(p + "ape", {ratio, w});
  cw.norm = b.f32(p + "norm.weight", {dim});
}

}  // namespace

ModelWeightsV4 bind_weights_v4(const ModelConfig& c, std::shared_ptr<ModelFiles> files) {
  validate_v4_config(c, files->dir());
  WeightBinder b(c, *files, /*skip_vision=*/false);
  ModelWeightsV4 w;
  w.files = files;
  const int64_t D = c.hidden, V = c.vocab_size, M = c.hc_mult, mix = c.hc_mix_dim();
  const int64_t H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank;
  const int64_t E = c.n_routed_experts, I = c.moe_inter, K = c.n_experts_per_tok;
  w.embed = b.dense("embed.weight", V, D);
  w.head = b.dense("head.weight", V, D);
  w.norm = b.f32("norm.weight", {D});  // norms: BF16 in the release, F32 accepted
  w.hc_head_fn = b.dense("hc_head_fn", M, M * D, true);
  w.hc_head_base = b.f32("hc_head_base", {M});
  w.hc_head_scale = b.f32("hc_head_scale", {1});

  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeightsV4& L = w.layers[static_cast<size_t>(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    L.kind = v4_layer_kind(c, l);
    L.attn_norm = b.f32(p + "attn_norm.weight", {D});
    L.ffn_norm = b.f32(p + "ffn_norm.weight", {D});
    L.hc_attn_fn = b.dense(p + "hc_attn_fn", mix, M * D, true);
    L.hc_attn_base = b.f32(p + "hc_attn_base", {mix});
    L.hc_attn_scale = b.f32(p + "hc_attn_scale", {3});
    L.hc_ffn_fn = b.dense(p + "hc_ffn_fn", mix, M * D, true);
    L.hc_ffn_base = b.f32(p + "hc_ffn_base", {mix});
    L.hc_ffn_scale = b.f32(p + "hc_ffn_scale", {3});

    // attention (§6.2)
    L.wq_a = b.fp8(p + "attn.wq_a", ql, D);
    L.q_norm = b.f32(p + "attn.q_norm.weight", {ql});
    L.wq_b = b.fp8(p + "attn.wq_b", H * hd, ql);
    L.wkv = b.fp8(p + "attn.wkv", hd, D);
    L.kv_norm = b.f32(p + "attn.kv_norm.weight", {hd});
    L.wo_a = b.fp8(p + "attn.wo_a", G * ol, H * hd / G);
    L.wo_b = b.fp8(p + "attn.wo_b", D, G * ol);
    L.attn_sink = b.f32(p + "attn.attn_sink", {H});
    if (L.kind != V4LayerKind::Sliding)
      bind_compressor(b, L.comp, p + "attn.compressor.", c.ratio(l), c.head_dim, L.kind == V4LayerKind::CSA, D);
    if (L.kind == V4LayerKind::CSA) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      bind_compressor(b, L.idx_comp, p + "attn.indexer.compressor.", c.ratio(l), c.index_head_dim, true, D);
      L.idx_wq_b = b.fp8(p + "attn.indexer.wq_b", ih * ihd, ql);
      L.idx_weights_proj = b.dense(p + "attn.indexer.weights_proj.weight", ih, D);
    }

    // MoE: hash routing in the first num_hash_layers layers (§6.3.9)
    L.gate = b.dense(p + "ffn.gate.weight", E, D);
    if (l < c.n_hash_layers) {
      L.tid2eid = bind_tid2eid(b, p + "ffn.gate.tid2eid", V, K, E);
    } else {
      L.gate_bias = b.f32(p + "ffn.gate.bias", {E});
    }
    b.experts(L, p, E, I, D);
  }
  b.check_unused();
  return w;
}

}  // namespace dsx
