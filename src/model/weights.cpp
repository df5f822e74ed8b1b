#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "model/inventory.h"
#include "model/weight_binder.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/numerics.h"
#include "util/sha256.h"

namespace dsx {

namespace {

std::string sha256_hex(const std::vector<std::pair<const void*, size_t>>& parts) {
  Sha256 h;
  for (const auto& [p, n] : parts) h.update(p, n);
  return h.hex();
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
  // Fingerprint: config + each shard's header bytes + a sample of its tensor bytes
  // (kSamples blocks of kSampleBytes, evenly spaced, the last one ending at the file's
  // end): two checkpoints of one shape (a fine-tune, a re-export) differ in it, and it
  // reads ~64 KiB per shard, not the whole model.
  constexpr size_t kSamples = 16, kSampleBytes = 4096;
  std::vector<std::string> headers;
  for (const auto& f : files_) {
    MappedFile m(f->path());
    uint64_t hl = 0;
    std::memcpy(&hl, m.data(), 8);
    const auto* bytes = reinterpret_cast<const char*>(m.data());
    std::string h(bytes, static_cast<size_t>(8 + hl));
    const size_t start = static_cast<size_t>(8 + hl), size = m.size();
    if (size > start) {
      const size_t span = size - start, block = std::min(kSampleBytes, span);
      for (size_t k = 0; k < kSamples; ++k) {
        const size_t off = start + (span - block) * k / (kSamples - 1);
        h.append(bytes + off, block);
      }
    }
    headers.push_back(std::move(h));
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

bool bind_layer_tensor(WeightBinder& b, const TensorSpec& t, LayerWeights& L) {
  const size_t e = static_cast<size_t>(t.expert);
  if (t.expert >= 0 && L.w1.size() <= e) L.w1.resize(e + 1), L.w2.resize(e + 1), L.w3.resize(e + 1);
  switch (t.role) {
    case Role::attn_norm: L.attn_norm = b.values(t); break;
    case Role::ffn_norm: L.ffn_norm = b.values(t); break;
    case Role::hc_attn_fn: L.hc_attn_fn = b.matrix(t); break;
    case Role::hc_attn_base: L.hc_attn_base = b.values(t); break;
    case Role::hc_attn_scale: L.hc_attn_scale = b.values(t); break;
    case Role::hc_ffn_fn: L.hc_ffn_fn = b.matrix(t); break;
    case Role::hc_ffn_base: L.hc_ffn_base = b.values(t); break;
    case Role::hc_ffn_scale: L.hc_ffn_scale = b.values(t); break;
    case Role::wq_a: L.wq_a = b.matrix(t); break;
    case Role::q_norm: L.q_norm = b.values(t); break;
    case Role::wq_b: L.wq_b = b.matrix(t); break;
    case Role::wkv: L.wkv = b.matrix(t); break;
    case Role::kv_norm: L.kv_norm = b.values(t); break;
    case Role::wo_a: L.wo_a = b.matrix(t); break;
    case Role::wo_b: L.wo_b = b.matrix(t); break;
    case Role::attn_sink: L.attn_sink = b.values(t); break;
    case Role::comp_wkv: L.comp_wkv = b.matrix(t); break;
    case Role::comp_wgate: L.comp_wgate = b.matrix(t); break;
    case Role::comp_norm: L.comp_norm = b.values(t); break;
    case Role::idx_wq_b: L.idx_wq_b = b.matrix(t); break;
    case Role::idx_weights_proj: L.idx_weights_proj = b.matrix(t); break;
    case Role::idx_wk: L.idx_wk = b.matrix(t); break;
    case Role::idx_k_norm: L.idx_k_norm = b.values(t); break;
    case Role::gate: L.gate = b.matrix(t); break;
    case Role::gate_bias: L.gate_bias = b.values(t); break;
    case Role::gate_bias_vl: b.values(t); break;  // checked; image tokens only
    case Role::expert_w1: L.w1[e] = b.matrix(t); break;
    case Role::expert_w3: L.w3[e] = b.matrix(t); break;
    case Role::expert_w2: L.w2[e] = b.matrix(t); break;
    case Role::shared_w1: L.sw1 = b.matrix(t); break;
    case Role::shared_w3: L.sw3 = b.matrix(t); break;
    case Role::shared_w2: L.sw2 = b.matrix(t); break;
    case Role::engram_table: {
      const std::vector<StoredTensor> st = stored_tensors(t);
      const TensorView& tw = b.tensor(st[0].name, st[0].shape, {st[0].dtype});
      const TensorView& ts = b.tensor(st[1].name, st[1].shape, {st[1].dtype});
      L.has_engram = true;
      L.engram_table = EngramTable{t.rows(), static_cast<int>(t.cols()), t.block, tw.data, ts.data};
      break;
    }
    case Role::engram_wkv: L.engram_wkv = b.matrix(t); break;
    case Role::engram_q_weight: L.engram_w = b.values(t); break;  // times k_weight, which follows
    case Role::engram_k_weight: {
      const std::vector<float> kw = b.values(t);
      for (size_t i = 0; i < kw.size(); ++i) L.engram_w[i] = L.engram_w[i] * kw[i];
      break;
    }
    default: return false;
  }
  return true;
}

ModelWeights bind_weights(const ModelConfig& c, std::shared_ptr<ModelFiles> files) {
  if (c.family != Family::V41) fail(files->dir(), ": model_type '", c.model_type, "' is not supported yet by the forward pass");
  WeightBinder b(c, *files, /*skip_vision=*/true);  // V4.1 checkpoints may carry the vision modules
  ModelWeights w;
  w.files = files;
  w.layers.resize(static_cast<size_t>(c.n_layers));
  const size_t E = static_cast<size_t>(c.n_routed_experts);
  for (LayerWeights& L : w.layers) L.w1.resize(E), L.w2.resize(E), L.w3.resize(E);
  // every tensor of the inventory, in its order (the first one that fails is reported)
  const TensorInventory inv(c);
  for (const TensorSpec& t : inv.tensors()) {
    if (t.optional && !b.has(t.name)) continue;
    if (t.layer < 0) {
      switch (t.role) {
        case Role::embed: w.embed = b.matrix(t); break;
        case Role::head: w.head = b.matrix(t); break;
        case Role::norm: w.norm = b.values(t); break;
        default: fail("bind_weights: no place for the ", role_name(t.role), " tensor '", t.name, "'");
      }
      continue;
    }
    if (!bind_layer_tensor(b, t, w.layers[static_cast<size_t>(t.layer)]))
      fail("bind_weights: no place for the ", role_name(t.role), " tensor '", t.name, "'");
  }
  b.check_unused();
  return w;
}

}  // namespace dsx
