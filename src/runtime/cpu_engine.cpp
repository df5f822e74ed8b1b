// The CPU reference engines: V41Cpu (and V4Cpu for V4 Flash directories) behind
// the Engine / Session interface.
#include <map>
#include <mutex>
#include <type_traits>

#include "model/v41_cpu.h"
#include "model/v4_cpu.h"
#include "model/weights.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "util/error.h"
#include "util/threadpool.h"

namespace dsx {

int32_t Session::feed_greedy_on_host(const int32_t* ids, int64_t n, int64_t vocab) {
  greedy_row_.resize(static_cast<size_t>(vocab));
  feed(ids, n, greedy_row_.data(), false);
  return argmax(greedy_row_.data(), vocab);
}

namespace {

// A session of a CPU model M (V41Cpu, or V4Cpu for DeepSeek V4 Flash): the KV state
// on the host, the forward on the CPU kernels. A restored snapshot replaces the state
// only once it has been read and checked whole (KVState::restore checks the model
// fingerprint and the geometry; V4 also checks its pooled-cache rings).
template <class M>
class CpuSessionOf : public Session {
 public:
  CpuSessionOf(const M& m, int rollback) : m_(m), st_(m.new_state(rollback)) {}
  int64_t position() const override { return st_.pos; }
  const std::vector<int32_t>& tokens() const override { return st_.tokens; }
  void feed(const int32_t* ids, int64_t n, float* logits, bool all_rows) override {
    m_.forward(st_, ids, n, logits, all_rows);
  }
  int32_t feed_greedy(const int32_t* ids, int64_t n) override {
    return feed_greedy_on_host(ids, n, m_.config().vocab_size);
  }
  std::vector<uint8_t> save() const override { return st_.save(); }
  void restore(const std::vector<uint8_t>& s) override {
    if constexpr (std::is_same_v<M, V4Cpu>) {
      KVState tmp = st_;
      tmp.restore(s.data(), s.size());
      m_.check_state(tmp);
      st_ = std::move(tmp);
    } else {
      st_.restore(s.data(), s.size());  // transactional itself
    }
  }
  void rollback(int64_t p) override { st_.rollback(p); }
  int64_t state_bytes() const override { return st_.bytes(); }

 private:
  const M& m_;
  KVState st_;
};

template <class M>
class CpuEngineOf : public Engine {
 public:
  CpuEngineOf(std::unique_ptr<M> m, int rollback, const char* label)
      : m_(std::move(m)), rollback_(rollback), label_(label) {}
  const ModelConfig& config() const override { return m_->config(); }
  std::unique_ptr<Session> new_session() override { return std::make_unique<CpuSessionOf<M>>(*m_, rollback_); }
  std::string describe() const override { return cat("cpu f32", label_, ", ", num_threads(), " threads"); }

 private:
  std::unique_ptr<M> m_;
  int rollback_;
  const char* label_;
};

std::map<std::string, EngineFactory>& factories() {
  static std::map<std::string, EngineFactory> f;
  return f;
}

}  // namespace

void register_engine_backend(const std::string& name, EngineFactory f) { factories()[name] = std::move(f); }

std::unique_ptr<Engine> load_engine(const std::string& dir, const EngineOptions& opts) {
  if (opts.backend != "cpu") {
    auto it = factories().find(opts.backend);
    if (it == factories().end())
      fail("backend '", opts.backend, "' is not available in this build (cpu", factories().empty() ? "" : ", ",
           [] {
             std::string s;
             for (const auto& [k, v] : factories()) s += (s.empty() ? "" : ", ") + k;
             return s;
           }(),
           ")");
    return it->second(dir, opts);
  }
  if (opts.precision != "fp32") fail("the CPU engine computes in fp32 only (got --precision ", opts.precision, ")");
  ModelConfig cfg = load_model_config(dir);
  auto files = std::make_shared<ModelFiles>(dir);
  if (cfg.family == Family::V4)
    return std::make_unique<CpuEngineOf<V4Cpu>>(std::make_unique<V4Cpu>(cfg, bind_weights_v4(cfg, files)),
                                                opts.rollback_depth, " (deepseek_v4)");
  ModelWeights w = bind_weights(cfg, files);
  std::vector<int32_t> cmap = load_engram_token_map(dir, cfg);
  return std::make_unique<CpuEngineOf<V41Cpu>>(std::make_unique<V41Cpu>(cfg, std::move(w), std::move(cmap)),
                                               opts.rollback_depth, "");
}

}  // namespace dsx
