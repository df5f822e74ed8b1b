// Backend-independent interface of a loaded model (Engine) and of one sequence's
// decode state on it (Session). The CPU reference engine implements it in
// src/runtime/cpu_engine.cpp; the CUDA engine in src/cuda/.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "model/config.h"

namespace dsx {

struct EngineOptions {
  std::string backend = "cpu";        // cpu | cuda
  std::string precision = "fp32";     // fp32 | bf16 (CUDA production precision)
  int rollback_depth = 16;            // tokens a session can roll back without re-running
  int64_t max_context = 0;            // 0: backend default (CUDA preallocates caches)
};

class Session {
 public:
  virtual ~Session() = default;
  virtual int64_t position() const = 0;
  virtual const std::vector<int32_t>& tokens() const = 0;
  // Feeds ids at positions position()..; writes logits of every fed row
  // ([n, vocab]) when all_rows, else of the last row ([vocab]).
  virtual void feed(const int32_t* ids, int64_t n, float* logits, bool all_rows) = 0;
  // feed(ids, n) and the greedy choice from the last row's logits (argmax of
  // runtime/sampler.h), without handing the logits out: the CUDA backend picks the id
  // on the device and copies 4 bytes instead of the vocabulary's logits.
  virtual int32_t feed_greedy(const int32_t* ids, int64_t n) = 0;
  // Exact snapshot of the state (portable between backends of the same model).
  virtual std::vector<uint8_t> save() const = 0;
  virtual void restore(const std::vector<uint8_t>& snapshot) = 0;
  // Back to an earlier position within the rollback depth, without re-running.
  virtual void rollback(int64_t position) = 0;
  virtual int64_t state_bytes() const = 0;
  // Benchmarks only: jump to position position()+n with random (valid) cache
  // contents instead of a prefill. Returns false when the backend cannot.
  virtual bool synthetic_fill(int64_t n, uint64_t seed) { return false; }

 protected:
  // feed_greedy through feed and the host argmax (backends without a device pick).
  int32_t feed_greedy_on_host(const int32_t* ids, int64_t n, int64_t vocab);

 private:
  std::vector<float> greedy_row_;
};

class Engine {
 public:
  virtual ~Engine() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::unique_ptr<Session> new_session() = 0;
  virtual std::string describe() const = 0;  // backend, precision, memory
};

// Loads a model directory on the chosen backend. Throws dsx::Error naming the
// problem (missing / corrupt files, unsupported configuration, no GPU, ...).
std::unique_ptr<Engine> load_engine(const std::string& model_dir, const EngineOptions& opts = {});

// Backends register a factory (the CUDA backend does so when compiled in).
using EngineFactory = std::function<std::unique_ptr<Engine>(const std::string&, const EngineOptions&)>;
void register_engine_backend(const std::string& name, EngineFactory f);

// The Engram compressed token map of a model directory (from its tokenizer.json),
// checked against the config's engram_compressed_vocab_size. Empty when the
// model has no Engram layers.
std::vector<int32_t> load_engram_token_map(const std::string& model_dir, const ModelConfig& cfg);

}  // namespace dsx
