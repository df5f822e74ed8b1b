#include "model/config.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "util/error.h"
#include "util/mmap_file.h"

namespace dsx {

using nlohmann::json;

bool ModelConfig::is_kv_source(int l) const {
  return std::find(kv_source_layers.begin(), kv_source_layers.end(), l) != kv_source_layers.end();
}
bool ModelConfig::is_index_source(int l) const {
  return std::find(index_source_layers.begin(), index_source_layers.end(), l) != index_source_layers.end();
}
bool ModelConfig::is_engram_layer(int l) const { return engram_index(l) >= 0; }
int ModelConfig::engram_index(int l) const {
  for (size_t i = 0; i < engram_layers.size(); ++i)
    if (engram_layers[i] == l) return static_cast<int>(i);
  return -1;
}
int ModelConfig::tap_index(int l) const {
  for (size_t i = 0; i < dspark_target_layers.size(); ++i)
    if (dspark_target_layers[i] == l) return static_cast<int>(i);
  return -1;
}
int ModelConfig::kv_source_of(int l) const {
  int best = -1;
  for (int s : kv_source_layers)
    if (s <= l && s > best) best = s;
  return best;
}

namespace {

struct Reader {
  const json& j;
  std::string origin;
  std::string where;  // "text_config." or ""

  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    fail(origin, ": ", where, key, ": ", what);
  }
  const json& need(const std::string& key) const {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) bad(key, "missing");
    return *it;
  }
  bool has(const std::string& key) const {
    auto it = j.find(key);
    return it != j.end() && !it->is_null();
  }
  int64_t i64(const std::string& key) const {
    const json& v = need(key);
    if (!v.is_number_integer()) bad(key, "must be an integer, got " + v.dump());
    return v.get<int64_t>();
  }
  int64_t i64(const std::string& key, int64_t def) const { return has(key) ? i64(key) : def; }
  int pos_int(const std::string& key) const {
    int64_t v = i64(key);
    if (v <= 0 || v > (int64_t{1} << 31) - 1) bad(key, "must be a positive integer");
    return static_cast<int>(v);
  }
  double num(const std::string& key) const {
    const json& v = need(key);
    if (!v.is_number()) bad(key, "must be a number, got " + v.dump());
    return v.get<double>();
  }
  double num(const std::string& key, double def) const { return has(key) ? num(key) : def; }
  bool boolean(const std::string& key, bool def) const {
    if (!has(key)) return def;
    const json& v = need(key);
    if (!v.is_boolean()) bad(key, "must be a boolean");
    return v.get<bool>();
  }
  std::string str(const std::string& key, const std::string& def) const {
    if (!has(key)) return def;
    const json& v = need(key);
    if (!v.is_string()) bad(key, "must be a string");
    return v.get<std::string>();
  }
  template <typename T>
  std::vector<T> ints(const std::string& key) const {
    const json& v = need(key);
    if (!v.is_array()) bad(key, "must be an array");
    std::vector<T> r;
    for (const auto& e : v) {
      if (!e.is_number_integer()) bad(key, "must be an array of integers");
      r.push_back(static_cast<T>(e.get<int64_t>()));
    }
    return r;
  }
  template <typename T>
  std::vector<T> ints_or_empty(const std::string& key) const {
    return has(key) ? ints<T>(key) : std::vector<T>{};
  }
};

void parse_rope_scaling(const Reader& r, ModelConfig& c) {
  if (!r.has("rope_scaling")) return;
  const json& rs = r.need("rope_scaling");
  if (!rs.is_object()) r.bad("rope_scaling", "must be an object");
  Reader s{rs, r.origin, r.where + "rope_scaling."};
  std::string type = s.str("rope_type", s.str("type", ""));
  if (type.empty() || type == "default") return;
  if (type != "yarn") s.bad("type", "unsupported rope scaling '" + type + "' (only yarn)");
  c.yarn.enabled = true;
  c.yarn.factor = s.num("factor");
  c.yarn.beta_fast = s.num("beta_fast", 32.0);
  c.yarn.beta_slow = s.num("beta_slow", 1.0);
  c.yarn.original_max_position = s.i64("original_max_position_embeddings");
}

void validate(ModelConfig& c, const std::string& origin) {
  auto bad = [&](const std::string& what) { fail(origin, ": invalid configuration: ", what); };
  if (c.head_dim <= c.rope_dim || c.rope_dim % 2) bad("qk_rope_head_dim must be even and smaller than head_dim");
  if (c.n_heads % c.o_groups) bad("num_attention_heads must be divisible by o_groups");
  if (c.n_kv_heads != 1) bad("num_key_value_heads must be 1 (shared K=V latent)");
  if (static_cast<int>(c.compress_ratios.size()) < c.n_layers)
    bad("compress_ratios has " + std::to_string(c.compress_ratios.size()) + " entries for " +
        std::to_string(c.n_layers) + " layers");
  c.n_ratio_entries = static_cast<int>(c.compress_ratios.size());
  c.compress_ratios.resize(static_cast<size_t>(c.n_layers));
  for (int l : c.dspark_target_layers)
    if (l < 0 || l >= c.n_layers) bad("dspark target layer " + std::to_string(l) + " out of range");
  if (c.n_experts_per_tok <= 0 || c.n_experts_per_tok > c.n_routed_experts) bad("num_experts_per_tok out of range");
  if (c.scoring_func != "sqrtsoftplus") bad("scoring_func '" + c.scoring_func + "' is not supported");
  if (c.n_shared_experts != 1) bad("n_shared_experts must be 1");
  if (c.quant_block <= 0 || c.hidden % c.quant_block) bad("hidden_size must be a multiple of the weight block");
  if (c.family == Family::V41) {
    for (int l = 0; l < c.n_layers; ++l) {
      int r = c.ratio(l);
      if (r < 0 || r > 2) bad("V4.1 compress ratio " + std::to_string(r) + " at layer " + std::to_string(l));
    }
    for (int s : c.kv_source_layers) {
      if (s < 0 || s >= c.n_layers) bad("kv source layer " + std::to_string(s) + " out of range");
      if (c.ratio(s) <= 0) bad("kv source layer " + std::to_string(s) + " has ratio 0");
      if (!c.is_index_source(s)) bad("kv source layer " + std::to_string(s) + " is not an index source");
    }
    for (int s : c.index_source_layers) {
      if (s < 0 || s >= c.n_layers) bad("index source layer " + std::to_string(s) + " out of range");
      if (c.ratio(s) <= 0) bad("index source layer " + std::to_string(s) + " has ratio 0");
      if (c.kv_source_of(s) < 0) bad("index source layer " + std::to_string(s) + " has no kv source before it");
    }
    for (int l = 0; l < c.n_layers; ++l) {
      if (c.ratio(l) == 0) continue;
      int s = c.kv_source_of(l);
      if (s < 0) bad("layer " + std::to_string(l) + " has a compressed branch but no kv source before it");
      if (c.ratio(s) != c.ratio(l))
        bad("layer " + std::to_string(l) + " has ratio " + std::to_string(c.ratio(l)) + " but its kv source " +
            std::to_string(s) + " has ratio " + std::to_string(c.ratio(s)));
      bool has_index = false;
      for (int i : c.index_source_layers)
        if (i <= l && i >= s) has_index = true;
      if (!has_index) bad("layer " + std::to_string(l) + " has no index source in its group");
    }
    if (c.candidate_source_layer >= 0) {
      if (!c.is_index_source(c.candidate_source_layer)) bad("candidate source layer is not an index source");
      if (c.candidate_block_size <= 0 || c.candidate_topk_blocks <= 0) bad("candidate block settings must be positive");
      if (static_cast<int64_t>(c.candidate_topk_blocks) * c.candidate_block_size - (c.candidate_block_size - 1) <
          c.index_topk)
        bad("candidate_topk_blocks * candidate_block_size is too small for index_topk");
    }
    if (!c.engram_layers.empty()) {
      if (c.engram_num_embeddings.size() != c.engram_layers.size())
        bad("engram_num_embeddings must have one entry per engram layer");
      if (c.engram_max_ngram < 2 || c.engram_n_heads <= 0 || c.engram_head_dim <= 0)
        bad("engram n-gram settings must be positive");
      if (c.engram_head_dim % c.quant_block) bad("engram_head_dim must be a multiple of the block size");
      if (c.engram_compressed_vocab <= 0) bad("engram_compressed_vocab_size must be positive");
      for (int l : c.engram_layers)
        if (l < 0 || l >= c.n_layers) bad("engram layer " + std::to_string(l) + " out of range");
    }
  }
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  json root;
  try {
    root = json::parse(text);
  } catch (const std::exception& e) {
    fail(origin, ": not valid JSON: ", e.what());
  }
  if (!root.is_object()) fail(origin, ": top level is not a JSON object");
  ModelConfig c;
  c.config_json = text;
  Reader top{root, origin, ""};
  c.model_type = top.str("model_type", "");
  if (c.model_type == "deepseek_v41") {
    c.family = Family::V41;
  } else if (c.model_type == "deepseek_v4") {
    c.family = Family::V4;
  } else {
    fail(origin, ": unsupported model_type '", c.model_type, "' (dsx runs deepseek_v41 and deepseek_v4)");
  }
  const json* tj = &root;
  std::string where;
  if (c.family == Family::V41) {
    if (!root.contains("text_config") || !root["text_config"].is_object())
      fail(origin, ": deepseek_v41 config lacks a text_config object");
    tj = &root["text_config"];
    where = "text_config.";
  }
  Reader r{*tj, origin, where};
  c.vocab_size = r.i64("vocab_size");
  if (c.vocab_size <= 0) r.bad("vocab_size", "must be positive");
  c.hidden = r.pos_int("hidden_size");
  c.n_layers = r.pos_int("num_hidden_layers");
  c.n_heads = r.pos_int("num_attention_heads");
  c.n_kv_heads = static_cast<int>(r.i64("num_key_value_heads", 1));
  c.head_dim = r.pos_int("head_dim");
  c.rope_dim = r.pos_int("qk_rope_head_dim");
  c.q_lora_rank = r.pos_int("q_lora_rank");
  c.o_lora_rank = r.pos_int("o_lora_rank");
  c.o_groups = r.pos_int("o_groups");
  c.window = r.pos_int("sliding_window");
  c.rms_eps = static_cast<float>(r.num("rms_norm_eps"));
  c.rope_theta = r.num("rope_theta", 10000.0);
  c.compress_rope_theta = r.num("compress_rope_theta", 160000.0);
  c.max_position = r.i64("max_position_embeddings", 0);
  parse_rope_scaling(r, c);
  c.compress_ratios = r.ints<int>("compress_ratios");
  c.index_n_heads = r.pos_int("index_n_heads");
  c.index_head_dim = r.pos_int("index_head_dim");
  c.index_topk = r.pos_int("index_topk");
  c.moe_inter = r.pos_int("moe_intermediate_size");
  c.n_routed_experts = r.pos_int("n_routed_experts");
  c.n_shared_experts = static_cast<int>(r.i64("n_shared_experts", 1));
  c.n_experts_per_tok = r.pos_int("num_experts_per_tok");
  c.scoring_func = r.str("scoring_func", "sqrtsoftplus");
  c.norm_topk_prob = r.boolean("norm_topk_prob", true);
  c.routed_scaling = static_cast<float>(r.num("routed_scaling_factor", 1.0));
  c.swiglu_limit = static_cast<float>(r.num("swiglu_limit", 0.0));
  c.gate_temp = static_cast<float>(r.num("gate_temp", 1.0));
  if (c.gate_temp <= 0) r.bad("gate_temp", "must be positive");
  c.hc_mult = r.pos_int("hc_mult");
  c.hc_sinkhorn_iters = r.pos_int("hc_sinkhorn_iters");
  c.hc_eps = static_cast<float>(r.num("hc_eps"));
  c.n_nextn_layers = static_cast<int>(r.i64("num_nextn_predict_layers", 0));
  c.bos_id = static_cast<int>(top.i64("bos_token_id", r.i64("bos_token_id", 0)));
  c.eos_id = static_cast<int>(top.i64("eos_token_id", r.i64("eos_token_id", 1)));
  c.pad_id = static_cast<int>(top.i64("pad_token_id", r.i64("pad_token_id", c.eos_id)));

  // quantization
  const json* qj = root.contains("quantization_config") ? &root["quantization_config"] : nullptr;
  if (!qj || !qj->is_object()) fail(origin, ": quantization_config missing (dsx loads the FP8/FP4 release format)");
  Reader q{*qj, origin, "quantization_config."};
  if (q.str("quant_method", "") != "fp8") q.bad("quant_method", "only fp8 is supported");
  auto wbs = q.ints<int>("weight_block_size");
  if (wbs.size() != 2 || wbs[0] != wbs[1] || wbs[0] <= 0) q.bad("weight_block_size", "must be [B, B]");
  c.quant_block = wbs[0];
  if (q.has("scale_fmt") && q.str("scale_fmt", "") != "ue8m0") q.bad("scale_fmt", "only ue8m0 is supported");
  std::string expert_dtype = q.str("expert_dtype", top.str("expert_dtype", "fp4"));
  if (expert_dtype != "fp4") fail(origin, ": expert_dtype '", expert_dtype, "' is not supported (fp4 only)");
  c.experts_fp4 = true;

  if (c.family == Family::V41) {
    c.kv_source_layers = r.ints<int>("kv_source_layer_ids");
    c.index_source_layers = r.ints<int>("index_source_layer_ids");
    c.candidate_source_layer = static_cast<int>(r.i64("candidate_source_layer_id", -1));
    c.candidate_topk_blocks = static_cast<int>(r.i64("candidate_topk_blocks", 0));
    c.candidate_block_size = static_cast<int>(r.i64("candidate_block_size", 1));
    c.engram_layers = r.ints_or_empty<int>("engram_layer_ids");
    if (!c.engram_layers.empty()) {
      c.engram_num_embeddings = r.ints<int64_t>("engram_num_embeddings");
      c.engram_max_ngram = r.pos_int("engram_max_ngram_size");
      c.engram_vocab_size = r.i64("engram_vocab_size");
      c.engram_n_heads = r.pos_int("engram_n_heads");
      c.engram_head_dim = r.pos_int("engram_head_dim");
      c.engram_pad_id = static_cast<int>(r.i64("engram_pad_token_id", r.i64("engram_pad_id", 2)));
      c.engram_compressed_vocab = r.i64("engram_compressed_vocab_size");
    }
    c.dspark_target_layers = r.ints_or_empty<int>("dspark_target_layer_ids");
    std::sort(c.dspark_target_layers.begin(), c.dspark_target_layers.end());
    c.dspark_block_size = static_cast<int>(r.i64("dspark_block_size", 0));
    c.dspark_noise_token_id = static_cast<int>(r.i64("dspark_noise_token_id", -1));
    c.dspark_markov_rank = static_cast<int>(r.i64("dspark_markov_rank", 0));
    c.dspark_n_routed_experts = static_cast<int>(r.i64("dspark_n_routed_experts", 0));
    c.dspark_experts_per_tok = static_cast<int>(r.i64("dspark_num_experts_per_tok", 0));
  } else {
    c.n_hash_layers = static_cast<int>(r.i64("num_hash_layers", 0));
  }
  validate(c, origin);
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  if (!file_exists(path)) fail(path, ": missing (not a model directory?)");
  return parse_model_config(read_text_file(path), path);
}

}  // namespace dsx
