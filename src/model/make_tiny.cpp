#include "model/make_tiny.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "model/config.h"
#include "model/engram.h"
#include "model/inventory.h"
#include "model/make_tiny_quant.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/numerics.h"
#include "util/safetensors.h"

namespace dsx {

TinySpec TinySpec::preset(const std::string& name) {
  TinySpec s;
  if (name == "tiny") return s;
  if (name == "bench") {
    // A larger synthetic model for CPU speed measurements (same layer schedule).
    s.hidden = 1024;
    s.heads = 8;
    s.head_dim = 128;
    s.rope_dim = 32;
    s.q_lora = 256;
    s.o_groups = 4;
    s.o_lora = 128;
    s.window = 64;
    s.experts = 32;
    s.experts_per_tok = 4;
    s.moe_inter = 256;
    s.index_heads = 8;
    s.index_head_dim = 64;
    s.index_topk = 32;
    s.candidate_blocks = 8;
    s.candidate_block_size = 8;
    s.engram_head_dim = 64;
    return s;
  }
  fail("unknown model preset '", name, "' (tiny, bench)");
}

namespace {

uint8_t e8m0_of(float pow2) {
  int e = std::ilogb(pow2);
  return static_cast<uint8_t>(std::clamp(e + 127, 1, 254));
}

}  // namespace

namespace {

std::vector<float> normals(std::mt19937_64& rng, float std, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = std::normal_distribution<float>(0.0f, std)(rng);
  return v;
}

}  // namespace

QuantizedWeight random_fp8(std::mt19937_64& rng, float std, int64_t n, int64_t k, int64_t B) {
  const std::vector<float> v = normals(rng, std, n * k);
  const int64_t sn = (n + B - 1) / B, sk = (k + B - 1) / B;
  QuantizedWeight q;
  q.codes_dtype = DType::F8_E4M3;
  q.codes_shape = {n, k};
  q.scales_shape = {sn, sk};
  std::vector<uint8_t>& codes = q.codes;
  std::vector<uint8_t>& scales = q.scales;
  codes.resize(v.size());
  scales.resize(static_cast<size_t>(sn * sk));
  for (int64_t bi = 0; bi < sn; ++bi)
    for (int64_t bj = 0; bj < sk; ++bj) {
      float amax = 0;
      for (int64_t i = bi * B; i < std::min(n, (bi + 1) * B); ++i)
        for (int64_t j = bj * B; j < std::min(k, (bj + 1) * B); ++j) amax = std::max(amax, std::fabs(v[i * k + j]));
      const float s = pow2ceil(std::max(amax, 1e-30f) / 448.0f);
      scales[bi * sk + bj] = e8m0_of(s);
      for (int64_t i = bi * B; i < std::min(n, (bi + 1) * B); ++i)
        for (int64_t j = bj * B; j < std::min(k, (bj + 1) * B); ++j) codes[i * k + j] = f32_to_e4m3(v[i * k + j] / s);
    }
  return q;
}

QuantizedWeight random_mxfp4(std::mt19937_64& rng, float std, int64_t n, int64_t k) {
  const std::vector<float> v = normals(rng, std, n * k);
  QuantizedWeight q;
  q.codes_dtype = DType::I8;
  q.codes_shape = {n, k / 2};
  q.scales_shape = {n, k / 32};
  std::vector<uint8_t>& packed = q.codes;
  std::vector<uint8_t>& scales = q.scales;
  packed.resize(static_cast<size_t>(n * k / 2));
  scales.resize(static_cast<size_t>(n * k / 32));
  for (int64_t i = 0; i < n; ++i) {
    const float* row = v.data() + i * k;
    for (int64_t b = 0; b < k / 32; ++b) {
      float amax = 0;
      for (int64_t j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(row[b * 32 + j]));
      const float s = pow2ceil(std::max(amax, 1e-30f) / 6.0f);
      scales[i * (k / 32) + b] = e8m0_of(s);
      for (int64_t j = 0; j < 32; j += 2) {
        uint8_t lo = f32_to_e2m1(std::clamp(row[b * 32 + j] / s, -6.f, 6.f));
        uint8_t hi = f32_to_e2m1(std::clamp(row[b * 32 + j + 1] / s, -6.f, 6.f));
        packed[i * (k / 2) + (b * 32 + j) / 2] = static_cast<uint8_t>(lo | (hi << 4));
      }
    }
  }
  return q;
}

namespace {

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  float normal(float std) { return std::normal_distribution<float>(0.0f, std)(rng_); }
  float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

struct Builder {
  SafetensorsWriter w;
  Gen g;
  int B;
  explicit Builder(uint64_t seed, int block) : g(seed), B(block) {}

  void bf16(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<uint16_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = f32_to_bf16(mean + (std > 0 ? g.normal(std) : 0.0f));
    w.add(name, DType::BF16, std::move(shape), v);
  }
  void f32(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = mean + (std > 0 ? g.normal(std) : 0.0f);
    w.add(name, DType::F32, std::move(shape), v);
  }
  void quantized(const std::string& base, const QuantizedWeight& q) {
    w.add(base + ".weight", q.codes_dtype, q.codes_shape, q.codes);
    w.add(base + ".scale", DType::F8_E8M0, q.scales_shape, q.scales);
  }
  // Dense FP8 with BxB tiles: normal values quantized with one pow2 scale per tile.
  void fp8(const std::string& base, int64_t n, int64_t k, float std) {
    quantized(base, random_fp8(g.rng(), std, n, k, B));
  }
  // MXFP4: packed e2m1 (low nibble first) with one pow2 scale per 32 inputs.
  void mxfp4(const std::string& base, int64_t n, int64_t k, float std) {
    quantized(base, random_mxfp4(g.rng(), std, n, k));
  }
  // Engram table: e4m3 rows with one pow2 scale per 32 columns of each row.
  void engram_table(const std::string& base, int64_t rows, int64_t dim, float std) {
    std::vector<uint8_t> codes(static_cast<size_t>(rows * dim)), scales(static_cast<size_t>(rows * dim / B));
    std::vector<float> v(static_cast<size_t>(B));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < dim / B; ++b) {
        float amax = 0;
        for (auto& x : v) amax = std::max(amax, std::fabs(x = g.normal(std)));
        const float s = pow2ceil(std::max(amax, 1e-30f) / 448.0f);
        scales[r * (dim / B) + b] = e8m0_of(s);
        for (int64_t j = 0; j < B; ++j) codes[r * dim + b * B + j] = f32_to_e4m3(v[j] / s);
      }
    w.add(base + ".weight", DType::F8_E4M3, {rows, dim}, codes);
    w.add(base + ".scale", DType::F8_E8M0, {rows, dim / B}, scales);
  }
};

}  // namespace

void write_tiny_model(const std::string& dir, const TinySpec& s, const std::string& tokenizer_json_path) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  const int L = s.layers;
  DSX_CHECK(static_cast<int>(s.ratios.size()) == L, "make-tiny: ratios must have one entry per layer");
  const bool engram = s.engram_compressed_vocab > 0 && !s.engram_layers.empty();
  const int B = 32;

  // Engram table sizes follow from the prime buckets (sum of each layer's primes).
  std::vector<int64_t> engram_rows;
  ModelConfig ec;
  if (engram) {
    ec.engram_layers = s.engram_layers;
    ec.engram_max_ngram = s.engram_max_ngram;
    ec.engram_vocab_size = s.engram_vocab;
    ec.engram_n_heads = s.engram_heads;
    ec.engram_head_dim = s.engram_head_dim;
    ec.engram_compressed_vocab = s.engram_compressed_vocab;
    for (const auto& primes : engram_bucket_primes(static_cast<int>(s.engram_layers.size()), s.engram_max_ngram,
                                                   s.engram_heads, s.engram_vocab)) {
      int64_t total = 0;
      for (int64_t p : primes) total += p;
      engram_rows.push_back(total);
    }
    ec.engram_num_embeddings = engram_rows;
    EngramLayout::build(ec, 0);  // self-check
  }

  nlohmann::ordered_json tc;
  tc["model_type"] = "deepseek_v41_text";
  tc["vocab_size"] = s.vocab;
  tc["hidden_size"] = s.hidden;
  tc["moe_intermediate_size"] = s.moe_inter;
  tc["num_hidden_layers"] = L;
  tc["num_attention_heads"] = s.heads;
  tc["num_key_value_heads"] = 1;
  tc["head_dim"] = s.head_dim;
  tc["qk_rope_head_dim"] = s.rope_dim;
  tc["q_lora_rank"] = s.q_lora;
  tc["o_lora_rank"] = s.o_lora;
  tc["o_groups"] = s.o_groups;
  tc["hidden_act"] = "silu";
  tc["swiglu_limit"] = 10.0;
  tc["rms_norm_eps"] = 1e-20;
  tc["attention_bias"] = false;
  tc["tie_word_embeddings"] = false;
  tc["max_position_embeddings"] = 1048576;
  tc["rope_theta"] = 10000;
  tc["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 16}, {"beta_fast", 32}, {"beta_slow", 1},
                        {"original_max_position_embeddings", 65536}};
  tc["n_routed_experts"] = s.experts;
  tc["n_shared_experts"] = 1;
  tc["num_experts_per_tok"] = s.experts_per_tok;
  tc["scoring_func"] = "sqrtsoftplus";
  tc["topk_method"] = "noaux_tc";
  tc["norm_topk_prob"] = true;
  tc["routed_scaling_factor"] = 1.5;
  tc["sliding_window"] = s.window;
  tc["compress_ratios"] = s.ratios;
  tc["compress_rope_theta"] = 160000;
  tc["kv_source_layer_ids"] = s.kv_sources;
  tc["index_source_layer_ids"] = s.index_sources;
  tc["index_n_heads"] = s.index_heads;
  tc["index_head_dim"] = s.index_head_dim;
  tc["index_topk"] = s.index_topk;
  tc["candidate_source_layer_id"] = s.candidate_source;
  tc["candidate_topk_blocks"] = s.candidate_blocks;
  tc["candidate_block_size"] = s.candidate_block_size;
  tc["hc_mult"] = 4;
  tc["hc_sinkhorn_iters"] = 20;
  tc["hc_eps"] = 1e-6;
  if (engram) {
    tc["engram_layer_ids"] = s.engram_layers;
    tc["engram_num_embeddings"] = engram_rows;
    tc["engram_max_ngram_size"] = s.engram_max_ngram;
    tc["engram_vocab_size"] = s.engram_vocab;
    tc["engram_n_heads"] = s.engram_heads;
    tc["engram_head_dim"] = s.engram_head_dim;
    tc["engram_pad_token_id"] = 2;
    tc["engram_compressed_vocab_size"] = s.engram_compressed_vocab;
  } else {
    tc["engram_layer_ids"] = nlohmann::json::array();
  }
  tc["num_nextn_predict_layers"] = 0;
  nlohmann::ordered_json cfg;
  cfg["architectures"] = {"DeepseekV41ForCausalLM"};
  cfg["model_type"] = "deepseek_v41";
  cfg["dtype"] = "bfloat16";
  cfg["bos_token_id"] = 0;
  cfg["eos_token_id"] = 1;
  cfg["pad_token_id"] = 2;
  cfg["tie_word_embeddings"] = false;
  cfg["quantization_config"] = {{"quant_method", "fp8"}, {"activation_scheme", "dynamic"},
                                {"weight_block_size", {32, 32}}, {"scale_fmt", "ue8m0"}, {"expert_dtype", "fp4"}};
  cfg["text_config"] = tc;
  cfg["vision_config"] = {{"model_type", "deepseek_v41_vision"}, {"num_hidden_layers", 0}};
  const std::string cfg_text = cfg.dump(2) + "\n";
  // validate with the real parser before writing anything; the tensors follow from it
  const ModelConfig parsed = parse_model_config(cfg_text, dir + "/config.json");

  // every tensor of the config's inventory, in its order (the order of the random draws)
  Builder b(s.seed, B);
  const TensorInventory inv(parsed);
  for (const TensorSpec& t : inv.tensors()) {
    const RandomInit r = random_init(t);
    switch (t.storage) {
      case Storage::F32Vector:
      case Storage::F32Matrix: b.f32(t.name, t.shape, r.std, r.mean); break;
      case Storage::BF16Vector:
      case Storage::BF16Matrix: b.bf16(t.name, t.shape, r.std, r.mean); break;
      case Storage::FP8: b.fp8(t.name, t.rows(), t.cols(), r.std); break;
      case Storage::MXFP4: b.mxfp4(t.name, t.rows(), t.cols(), r.std); break;
      case Storage::EngramTable: b.engram_table(t.name, t.rows(), t.cols(), r.std); break;
    }
  }
  b.w.set_metadata("format", "pt");
  b.w.set_metadata("generator", "dsx make-tiny");
  b.w.write(dir + "/model.safetensors");
  write_file_atomic(dir + "/config.json", cfg_text.data(), cfg_text.size());
  if (!tokenizer_json_path.empty()) {
    const std::string t = read_text_file(tokenizer_json_path);
    write_file_atomic(dir + "/tokenizer.json", t.data(), t.size());
  }
}

}  // namespace dsx
