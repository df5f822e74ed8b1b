// Writes random V4.1 models in the official release format (config.json in the
// nested layout, model.safetensors with official names and quantized storage):
// the embedded default model, synthetic benchmark models and test fixtures.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace dsx {

struct TinySpec {
  int64_t vocab = 2048;
  int hidden = 256;
  int layers = 9;
  int heads = 4;
  int head_dim = 64;
  int rope_dim = 16;
  int q_lora = 64;
  int o_groups = 2;
  int o_lora = 32;
  int window = 16;
  int experts = 16;
  int experts_per_tok = 3;
  int moe_inter = 64;
  int index_heads = 8;
  int index_head_dim = 32;
  int index_topk = 8;
  std::vector<int> ratios = {0, 0, 2, 2, 2, 1, 1, 1, 1};
  std::vector<int> kv_sources = {2, 5};
  std::vector<int> index_sources = {2, 4, 5, 7};
  int candidate_source = 5;
  int candidate_blocks = 3;
  int candidate_block_size = 4;
  std::vector<int> engram_layers = {1, 5};
  int engram_vocab = 64;  // start of the prime search
  int engram_heads = 2;
  int engram_head_dim = 32;
  int engram_max_ngram = 4;
  int64_t engram_compressed_vocab = 0;  // from the tokenizer; 0 disables Engram
  uint64_t seed = 1;

  static TinySpec preset(const std::string& name);  // "tiny" (default), "bench"
};

// Writes <dir>/config.json and <dir>/model.safetensors (creating dir). When
// tokenizer_json is non-empty it is copied to <dir>/tokenizer.json.
void write_tiny_model(const std::string& dir, const TinySpec& spec, const std::string& tokenizer_json_path);

}  // namespace dsx
