// The Engram compressed token map of a model directory, derived from its tokenizer.json
// (spec model-v41.md §3.2.1): registered with the runtime (runtime/engine.h), which
// asks for it when an engine loads a model with Engram layers.
#include "runtime/engine.h"
#include "text/engram_cmap.h"
#include "text/tokenizer.h"
#include "util/error.h"
#include "util/mmap_file.h"

namespace dsx::text {

namespace {

std::vector<int32_t> engram_map_of(const std::string& dir, const ModelConfig& cfg) {
  const std::string tj = dir + "/tokenizer.json";
  if (!file_exists(tj))
    fail(dir, ": the model has Engram layers, whose hashes need the compressed token map derived from tokenizer.json, "
              "but the directory has no tokenizer.json");
  Tokenizer tok = Tokenizer::from_model_dir(dir);
  int32_t n_keys = 0;
  std::vector<int32_t> map = build_engram_token_map(tok, &n_keys);
  if (n_keys != cfg.engram_compressed_vocab)
    fail(tj, ": the tokenizer yields ", n_keys, " distinct Engram keys but the config's engram_compressed_vocab_size is ",
         cfg.engram_compressed_vocab, " (wrong tokenizer for this model?)");
  if (static_cast<int64_t>(map.size()) < cfg.vocab_size) map.resize(static_cast<size_t>(cfg.vocab_size), -1);
  for (int64_t i = 0; i < cfg.vocab_size; ++i)
    if (map[static_cast<size_t>(i)] < 0)
      map[static_cast<size_t>(i)] = map[static_cast<size_t>(cfg.engram_pad_id)];  // ids beyond the tokenizer never occur in text
  return map;
}

struct Registration {
  Registration() { register_engram_map_provider(engram_map_of); }
} registration;

}  // namespace

}  // namespace dsx::text
