// V4 Flash tensor binding (spec model-v41.md §6.2). Shapes follow the config; see
// weights_v4.h for what is kept mapped and what is widened.
#include "model/weights_v4.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "util/error.h"
#include "util/numerics.h"
#include "util/safetensors.h"

namespace dsx {

V4LayerKind v4_layer_kind(const ModelConfig& c, int layer) {
  const int r = c.ratio(layer);
  if (r == 0) return V4LayerKind::Sliding;
  return r == 4 ? V4LayerKind::CSA : V4LayerKind::HCA;
}

namespace {

// Checks every tensor against the config and records which ones were used, so
// that leftovers can be reported.
class BinderV4 {
 public:
  BinderV4(const ModelConfig& c, const ModelFiles& f) : c_(c), f_(f) {}

  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape,
                           std::initializer_list<DType> dtypes) {
    const TensorView* t = f_.find(name);
    std::string want;
    for (DType d : dtypes) want += std::string(want.empty() ? "" : "/") + dtype_name(d);
    if (!t) fail(f_.dir(), ": tensor '", name, "' is missing (config expects ", want, " ", shape_to_string(shape), ")");
    if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end())
      fail(t->file, ": tensor '", name, "' has dtype ", dtype_name(t->dtype), ", expected ", want);
    if (t->shape != shape)
      fail(t->file, ": tensor '", name, "' has shape ", t->shape_str(), ", config expects ", shape_to_string(shape));
    used_.insert(name);
    return *t;
  }

  // Small f32 parameter (stored F32 or BF16), widened.
  std::vector<float> f32(const std::string& name, std::vector<int64_t> shape) {
    return widen(tensor(name, shape, {DType::F32, DType::BF16}));
  }
  // Norm weight [n] (BF16 in the release; F32 accepted).
  std::vector<float> vec(const std::string& name, int64_t n) { return f32(name, {n}); }

  // Plain matrix kept mapped (BF16 or F32).
  QMatrix dense(const std::string& name, int64_t n, int64_t k, bool f32_only = false) {
    const TensorView& t = f32_only ? tensor(name, {n, k}, {DType::F32}) : tensor(name, {n, k}, {DType::BF16, DType::F32});
    QMatrix m;
    m.fmt = t.dtype == DType::BF16 ? WFormat::BF16 : WFormat::F32;
    m.rows = n;
    m.cols = k;
    m.data = t.data;
    m.name = name;
    return m;
  }

  // Dense FP8 with BxB tiles of ue8m0 scales (B = quant_block, 128 in V4).
  QMatrix fp8(const std::string& base, int64_t n, int64_t k) {
    const int64_t b = c_.quant_block;
    const TensorView& w = tensor(base + ".weight", {n, k}, {DType::F8_E4M3});
    const TensorView& s = tensor(base + ".scale", {(n + b - 1) / b, (k + b - 1) / b}, {DType::F8_E8M0});
    QMatrix m;
    m.fmt = WFormat::FP8_BLOCK;
    m.rows = n;
    m.cols = k;
    m.block = static_cast<int>(b);
    m.data = w.data;
    m.scale = s.data;
    m.name = base;
    return m;
  }

  // Routed expert: packed e2m1 (low nibble first) + one ue8m0 scale per 32 inputs.
  QMatrix mxfp4(const std::string& base, int64_t n, int64_t k) {
    if (k % 32) fail(f_.dir(), ": ", base, ": input width ", k, " is not a multiple of 32 (MXFP4)");
    const TensorView& w = tensor(base + ".weight", {n, k / 2}, {DType::I8, DType::U8});
    const TensorView& s = tensor(base + ".scale", {n, k / 32}, {DType::F8_E8M0});
    QMatrix m;
    m.fmt = WFormat::MXFP4;
    m.rows = n;
    m.cols = k;
    m.block = 32;
    m.data = w.data;
    m.scale = s.data;
    m.name = base;
    return m;
  }

  // Hash-routing table [vocab, top_k] (I64 in the official files, I32 accepted);
  // every entry must name an expert.
  std::vector<int32_t> tid2eid(const std::string& name, int64_t vocab, int64_t k, int64_t n_experts) {
    const TensorView& t = tensor(name, {vocab, k}, {DType::I64, DType::I32});
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

  bool has(const std::string& name) const { return f_.find(name) != nullptr; }

  void check_unused() const {
    for (const auto& name : f_.names()) {
      if (used_.count(name) || ignorable(name)) continue;
      fail(f_.find(name)->file, ": unexpected tensor '", name, "' (not part of a ", c_.model_type,
           " model with this config)");
    }
  }

 private:
  bool ignorable(const std::string& n) const {
    if (n.rfind("mtp.", 0) != 0) return false;
    // the MTP stages the config declares are not used by the backbone
    const size_t dot = n.find('.', 4);
    if (dot == std::string::npos) return false;
    const int stage = std::atoi(n.substr(4, dot - 4).c_str());
    return stage >= 0 && stage < c_.n_nextn_layers;
  }
  static std::vector<float> widen(const TensorView& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype == DType::F32) {
      std::memcpy(v.data(), t.data, v.size() * 4);
    } else {
      const auto* p = t.as<uint16_t>();
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(p[i]);
    }
    return v;
  }

  const ModelConfig& c_;
  const ModelFiles& f_;
  std::set<std::string> used_;
};

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

void bind_compressor(BinderV4& b, V4CompressorWeights& cw, const std::string& p, int ratio, int dim, bool overlap,
                     int64_t D) {
  cw.ratio = ratio;
  cw.dim = dim;
  cw.coff = overlap ? 2 : 1;
  const int64_t w = cw.width();
  cw.wkv = b.dense(p + "wkv.weight", w, D);
  cw.wgate = b.dense(p + "wgate.weight", w, D);
  cw.ape = b.f32(p + "ape", {ratio, w});
  cw.norm = b.vec(p + "norm.weight", dim);
}

}  // namespace

ModelWeightsV4 bind_weights_v4(const ModelConfig& c, std::shared_ptr<ModelFiles> files) {
  validate_v4_config(c, files->dir());
  BinderV4 b(c, *files);
  ModelWeightsV4 w;
  w.files = files;
  const int64_t D = c.hidden, V = c.vocab_size, M = c.hc_mult, mix = c.hc_mix_dim();
  const int64_t H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank;
  const int64_t E = c.n_routed_experts, I = c.moe_inter, K = c.n_experts_per_tok;
  w.embed = b.dense("embed.weight", V, D);
  w.head = b.dense("head.weight", V, D);
  w.norm = b.vec("norm.weight", D);
  w.hc_head_fn = b.dense("hc_head_fn", M, M * D, true);
  w.hc_head_base = b.f32("hc_head_base", {M});
  w.hc_head_scale = b.f32("hc_head_scale", {1});

  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeightsV4& L = w.layers[static_cast<size_t>(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    L.kind = v4_layer_kind(c, l);
    L.attn_norm = b.vec(p + "attn_norm.weight", D);
    L.ffn_norm = b.vec(p + "ffn_norm.weight", D);
    L.hc_attn_fn = b.dense(p + "hc_attn_fn", mix, M * D, true);
    L.hc_attn_base = b.f32(p + "hc_attn_base", {mix});
    L.hc_attn_scale = b.f32(p + "hc_attn_scale", {3});
    L.hc_ffn_fn = b.dense(p + "hc_ffn_fn", mix, M * D, true);
    L.hc_ffn_base = b.f32(p + "hc_ffn_base", {mix});
    L.hc_ffn_scale = b.f32(p + "hc_ffn_scale", {3});

    // attention (§6.2)
    L.wq_a = b.fp8(p + "attn.wq_a", ql, D);
    L.q_norm = b.vec(p + "attn.q_norm.weight", ql);
    L.wq_b = b.fp8(p + "attn.wq_b", H * hd, ql);
    L.wkv = b.fp8(p + "attn.wkv", hd, D);
    L.kv_norm = b.vec(p + "attn.kv_norm.weight", hd);
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
      L.tid2eid = b.tid2eid(p + "ffn.gate.tid2eid", V, K, E);
    } else {
      L.gate_bias = b.f32(p + "ffn.gate.bias", {E});
    }
    L.w1.resize(static_cast<size_t>(E));
    L.w2.resize(static_cast<size_t>(E));
    L.w3.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "ffn.experts." + std::to_string(e) + ".";
      L.w1[static_cast<size_t>(e)] = b.mxfp4(q + "w1", I, D);
      L.w3[static_cast<size_t>(e)] = b.mxfp4(q + "w3", I, D);
      L.w2[static_cast<size_t>(e)] = b.mxfp4(q + "w2", D, I);
    }
    L.sw1 = b.fp8(p + "ffn.shared_experts.w1", I, D);
    L.sw3 = b.fp8(p + "ffn.shared_experts.w3", I, D);
    L.sw2 = b.fp8(p + "ffn.shared_experts.w2", D, I);
  }
  b.check_unused();
  return w;
}

}  // namespace dsx
