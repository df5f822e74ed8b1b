#include "model/weights.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "model/weight_binder.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/numerics.h"

namespace dsx {

namespace {

std::string sha256_hex(const std::vector<std::pair<const void*, size_t>>& parts) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  for (const auto& [p, n] : parts) EVP_DigestUpdate(ctx, p, n);
  unsigned char md[32];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < len; ++i) {
    s.push_back(hex[md[i] >> 4]);
    s.push_back(hex[md[i] & 15]);
  }
  return s;
}

}  // namespace

ModelFiles::ModelFiles(const std::string& model_dir) : dir_(model_dir) {
  const std::string single = model_dir + "/model.safetensors";
  const std::string index = model_dir + "/model.safetensors.index.json";
  std::vector<std::string> shard_names;
  nlohmann::json weight_map;
  if (file_exists(index)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(read_text_file(index));
    } catch (const nlohmann::json::exception& e) {
      fail(index, ": not valid JSON: ", e.what());
    }
    if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
      fail(index, ": lacks a weight_map object");
    weight_map = j["weight_map"];
    std::set<std::string> seen;
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      if (!it->is_string()) fail(index, ": weight_map entry '", it.key(), "' is not a file name");
      std::string f = it->get<std::string>();
      if (f.find('/') != std::string::npos || f.empty() || f[0] == '.')
        fail(index, ": weight_map entry '", it.key(), "' names an invalid shard '", f, "'");
      if (seen.insert(f).second) shard_names.push_back(f);
    }
    for (const auto& s : shard_names)
      if (!file_exists(model_dir + "/" + s)) fail(index, ": shard '", s, "' is missing from ", model_dir);
  } else if (file_exists(single)) {
    shard_names.push_back("model.safetensors");
  } else {
    fail(model_dir, ": no model.safetensors or model.safetensors.index.json");
  }
  std::string cfg_text = file_exists(model_dir + "/config.json") ? read_text_file(model_dir + "/config.json") : "";
  std::vector<std::pair<const void*, size_t>> parts{{cfg_text.data(), cfg_text.size()}};
  for (const auto& s : shard_names) {
    files_.push_back(std::make_unique<SafetensorsFile>(model_dir + "/" + s));
    const auto& f = *files_.back();
    for (const auto& [name, tv] : f.tensors()) {
      if (!weight_map.is_null()) {
        auto it = weight_map.find(name);
        if (it == weight_map.end() || it->get<std::string>() != s)
          fail(f.path(), ": tensor '", name, "' is not listed for this shard in ", index);
      }
      index_.emplace_back(name, &tv);
      names_.push_back(name);
    }
  }
  if (!weight_map.is_null()) {
    for (auto it = weight_map.begin(); it != weight_map.end(); ++it) {
      bool found = false;
      for (const auto& f : files_)
        if (f->path() == model_dir + "/" + it->get<std::string>() && f->find(it.key())) found = true;
      if (!found) fail(index, ": tensor '", it.key(), "' is listed in shard '", it->get<std::string>(), "' but not stored there");
    }
  }
  std::sort(index_.begin(), index_.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (size_t i = 1; i < index_.size(); ++i)
    if (index_[i].first == index_[i - 1].first) fail(model_dir, ": tensor '", index_[i].first, "' is stored twice");
  // Fingerprint: config + each shard's header bytes.
  std::vector<std::string> headers;
  for (const auto& f : files_) {
    MappedFile m(f->path());
    uint64_t hl = 0;
    std::memcpy(&hl, m.data(), 8);
    headers.emplace_back(reinterpret_cast<const char*>(m.data()), static_cast<size_t>(8 + hl));
  }
  for (const auto& h : headers) parts.emplace_back(h.data(), h.size());
  fingerprint_ = sha256_hex(parts);
}

const TensorView* ModelFiles::find(const std::string& name) const {
  auto it = std::lower_bound(index_.begin(), index_.end(), name,
                             [](const auto& a, const std::string& n) { return a.first < n; });
  if (it == index_.end() || it->first != name) return nullptr;
  return it->second;
}

void EngramTable::gather_row(int64_t r, float* out) const {
  const uint8_t* w = data + r * dim;
  const uint8_t* s = scale + r * (dim / block);
  for (int j = 0; j < dim; ++j) out[j] = e4m3_to_f32(w[j]) * e8m0_to_f32(s[j / block]);
}

ModelWeights bind_weights(const ModelConfig& c, std::shared_ptr<ModelFiles> files) {
  if (c.family != Family::V41) fail(files->dir(), ": model_type '", c.model_type, "' is not supported yet by the forward pass");
  WeightBinder b(c, *files, /*skip_vision=*/true);  // V4.1 checkpoints may carry the vision modules
  ModelWeights w;
  w.files = files;
  const int64_t D = c.hidden, V = c.vocab_size, M = c.hc_mult, mix = c.hc_mix_dim();
  w.embed = b.dense("embed.weight", V, D);
  w.head = b.dense("head.weight", V, D);
  w.norm = b.vec("norm.weight", D);
  const int64_t H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank;
  const int64_t E = c.n_routed_experts, I = c.moe_inter;
  w.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    LayerWeights& L = w.layers[static_cast<size_t>(l)];
    const std::string p = "layers." + std::to_string(l) + ".";
    L.attn_norm = b.vec(p + "attn_norm.weight", D);
    L.ffn_norm = b.vec(p + "ffn_norm.weight", D);
    for (const char* site : {"attn", "ffn"}) {
      const std::string s = p + "hc_" + site + "_";
      QMatrix fn = b.dense(s + "fn", mix, M * D);
      if (fn.fmt != WFormat::F32) fail(files->dir(), ": tensor '", s, "fn' must be F32");
      auto base = b.f32(s + "base", {mix});
      auto scale = b.f32(s + "scale", {3});
      if (std::string(site) == "attn") {
        L.hc_attn_fn = fn, L.hc_attn_base = base, L.hc_attn_scale = scale;
      } else {
        L.hc_ffn_fn = fn, L.hc_ffn_base = base, L.hc_ffn_scale = scale;
      }
    }
    L.wq_a = b.fp8(p + "attn.wq_a", ql, D);
    L.q_norm = b.vec(p + "attn.q_norm.weight", ql);
    L.wq_b = b.fp8(p + "attn.wq_b", H * hd, ql);
    L.wkv = b.fp8(p + "attn.wkv", hd, D);
    L.kv_norm = b.vec(p + "attn.kv_norm.weight", hd);
    L.wo_a = b.fp8(p + "attn.wo_a", G * ol, H * hd / G);
    L.wo_b = b.fp8(p + "attn.wo_b", D, G * ol);
    L.attn_sink = b.f32(p + "attn.attn_sink", {H});
    if (c.is_kv_source(l)) {
      L.comp_wkv = b.dense(p + "attn.compressor.wkv.weight", hd, D);
      if (c.ratio(l) > 1) L.comp_wgate = b.dense(p + "attn.compressor.wgate.weight", hd, D);
      L.comp_norm = b.vec(p + "attn.compressor.norm.weight", hd);
    }
    if (c.is_index_source(l)) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      L.idx_wq_b = b.fp8(p + "attn.indexer.wq_b", ih * ihd, ql);
      L.idx_weights_proj = b.dense(p + "attn.indexer.weights_proj.weight", ih, D);
      if (c.is_kv_source(l)) {
        L.idx_wk = b.dense(p + "attn.indexer.wk.weight", ihd, hd);
        L.idx_k_norm = b.vec(p + "attn.indexer.k_norm.weight", ihd);
      }
    }
    L.gate = b.dense(p + "ffn.gate.weight", E, D);
    L.gate_bias = b.f32(p + "ffn.gate.bias", {E});
    if (b.has(p + "ffn.gate.bias_vl")) b.f32(p + "ffn.gate.bias_vl", {E});  // image tokens only
    b.experts(L, p, E, I, D);
    const int ei = c.engram_index(l);
    if (ei >= 0) {
      L.has_engram = true;
      const int64_t R = c.engram_num_embeddings[static_cast<size_t>(ei)], ed = c.engram_head_dim;
      const int64_t ncols = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads;
      const TensorView& tw = b.tensor(p + "engram.embed.weight", {R, ed}, {DType::F8_E4M3});
      const TensorView& ts = b.tensor(p + "engram.embed.scale", {R, ed / c.quant_block}, {DType::F8_E8M0});
      L.engram_table = EngramTable{R, static_cast<int>(ed), c.quant_block, tw.data, ts.data};
      L.engram_wkv = b.fp8(p + "engram.wkv", (M + 1) * D, ncols * ed);
      auto qw = b.f32(p + "engram.q_weight", {M, D});
      auto kw = b.f32(p + "engram.k_weight", {M, D});
      L.engram_w.resize(qw.size());
      for (size_t i = 0; i < qw.size(); ++i) L.engram_w[i] = qw[i] * kw[i];
    }
  }
  b.check_unused();
  return w;
}

}  // namespace dsx
