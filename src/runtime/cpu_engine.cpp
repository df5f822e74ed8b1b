// The CPU reference engines: V41Cpu (and V4Cpu for V4 Flash directories) behind the
// Engine / Session interface. The state lives on the host in f32 (model/kv_state.h);
// a multi-row step runs one reference forward per session (the CPU path is the
// reference, not the fast one), so every row is exactly what the one-session path
// computes.
#include <sys/sysinfo.h>

#include <algorithm>
#include <type_traits>

#include "model/v41_cpu.h"
#include "model/v4_cpu.h"
#include "model/weights.h"
#include "runtime/cpu_engine.h"
#include "runtime/sampler.h"
#include "util/error.h"
#include "util/snapshot_io.h"
#include "util/threadpool.h"

namespace dsx {

namespace {

template <class M>
class CpuBackendOf : public Session::Backend {
 public:
  CpuBackendOf(const M& m, int rollback, int64_t capacity)
      : m_(m), st_(m.new_state(rollback)), capacity_(capacity) {}
  int64_t position() const override { return st_.pos; }
  const std::vector<int32_t>& tokens() const override { return st_.tokens; }
  int64_t capacity() const override { return capacity_; }
  void rollback(int64_t p) override { st_.rollback(p); }
  void reset() override { st_.reset(); }
  struct Cp : Checkpoint {
    KVState::Fixed f;
  };
  std::unique_ptr<Checkpoint> checkpoint() const override {
    auto c = std::make_unique<Cp>();
    c->f = st_.fixed();
    c->pos = st_.pos;
    c->bytes = c->f.bytes();
    return c;
  }
  void restore(const Checkpoint& c) override { st_.restore_fixed(static_cast<const Cp&>(c).f); }
  void save(SnapshotWriter& w) const override { st_.save(w); }
  void restore(SnapshotReader& r, int64_t pos) override {
    KVState tmp = st_;
    tmp.restore(r, pos);  // whole or not at all
    if constexpr (std::is_same_v<M, V4Cpu>) m_.check_state(tmp);
    st_ = std::move(tmp);
  }
  int64_t state_bytes() const override { return st_.bytes(); }

  // One feed: the reference forward, then the greedy pick from the last row.
  void run(const Feed& f, bool all_rows, std::vector<float>& row) {
    const int64_t V = m_.config().vocab_size;
    float* logits = f.logits;
    // (every row's logits for picks; the last row's for a pick alone)
    const bool all = (all_rows && f.logits) || f.picks;
    if ((!logits && f.pick) || (f.picks && !(all_rows && f.logits))) {
      row.resize(static_cast<size_t>(all ? f.n * V : V));
      logits = row.data();
    }
    if constexpr (std::is_same_v<M, V4Cpu>) {
      DSX_CHECK(!f.taps, "taps: the V4 CPU engine has no DSpark taps");
      m_.forward(st_, f.ids, f.n, logits, all);
    } else {
      m_.forward(st_, f.ids, f.n, logits, all, nullptr, f.taps);
    }
    if (f.pick) *f.pick = argmax(all ? logits + (f.n - 1) * V : logits, V);
    if (f.picks)
      for (int64_t t = 0; t < f.n; ++t) f.picks[t] = argmax(logits + t * V, V);
    if (f.logits && !all_rows && logits != f.logits)
      std::copy(logits + (f.n - 1) * V, logits + f.n * V, f.logits);  // (logits of the last row)
  }

 private:
  const M& m_;
  KVState st_;
  int64_t capacity_;
};

int64_t default_cpu_budget() {
  struct sysinfo si {};
  if (sysinfo(&si) != 0) return 0;
  return static_cast<int64_t>(si.totalram) * si.mem_unit / 2;
}

template <class M>
class CpuEngineOf : public Engine {
 public:
  CpuEngineOf(std::unique_ptr<M> m, EngineOptions o, const char* family)
      : Engine(std::move(o)), m_(std::move(m)) {
    const ModelConfig& c = m_->config();
    if constexpr (std::is_same_v<M, V41Cpu>) {
      m_->set_expert_ranks(opts_.expert_ranks);
    } else if (opts_.expert_ranks != 1) {
      fail("expert parallelism (", opts_.expert_ranks, " ranks) is built for V4.1 models only, not ", family);
    }
    capacity_ = opts_.max_context > 0 ? opts_.max_context : (c.max_position > 0 ? c.max_position : int64_t{1} << 20);
    KVState st = m_->new_state(opts_.rollback_depth);
    id_.model_id = m_->fingerprint();
    id_.family = family;
    id_.compact = st.compact;
    id_.geometry = geometry_of(st);
    fixed_ = st.bytes();
    // f32 state per token: compressed rows and keys of every KV source (4 B per value)
    per_token_ = 4;
    for (const auto& cc : st.caches)
      if (cc.ratio > 0) per_token_ += 4.0 * (cc.dim + cc.idx_dim) / cc.ratio;
    budget_ = opts_.state_budget > 0 ? opts_.state_budget : default_cpu_budget();
  }
  const ModelConfig& config() const override { return m_->config(); }
  std::string describe() const override {
    return cat("cpu f32 (", id_.family, "), ", num_threads(), " threads",
               opts_.expert_ranks > 1 ? cat(", MoE as ", opts_.expert_ranks, " expert-parallel ranks") : "");
  }
  std::string backend_name() const override { return "cpu"; }
  const StateIdentity& state_identity() const override { return id_; }
  std::unique_ptr<Session> new_session() override {
    check_budget(session_bytes(), budget_);
    return std::make_unique<Session>(*this, std::make_unique<CpuBackendOf<M>>(*m_, opts_.rollback_depth, capacity_));
  }
  StateFootprint footprint() const override {
    StateFootprint f;
    f.fixed_bytes = fixed_;
    f.bytes_per_token = per_token_;
    f.session_bytes = session_bytes();
    f.budget_bytes = budget_;
    f.sessions = static_cast<int>(sessions().size());
    for (const Session* s : sessions()) f.used_bytes += s->state_bytes();
    return f;
  }

 protected:
  void run(const Step& s) override {
    for (const Feed& f : s.feeds) static_cast<CpuBackendOf<M>&>(f.session->backend()).run(f, s.all_rows, row_);
  }

 private:
  // what a session may grow to: its capacity, and its checkpoints' fixed parts
  int64_t session_bytes() const {
    return fixed_ * (1 + opts_.max_checkpoints) + static_cast<int64_t>(per_token_ * static_cast<double>(capacity_));
  }
  std::unique_ptr<M> m_;
  StateIdentity id_;
  int64_t capacity_ = 0, fixed_ = 0, budget_ = 0;
  double per_token_ = 0;
  std::vector<float> row_;
};

struct Registration {
  Registration() {
    register_engine_backend("cpu", [](const std::string& dir, const EngineOptions& opts) -> std::unique_ptr<Engine> {
      if (opts.precision != "fp32")
        fail("the CPU engine computes in fp32 only (got --precision ", opts.precision, ")");
      ModelConfig cfg = load_model_config(dir);
      auto files = std::make_shared<ModelFiles>(dir);
      if (cfg.family == Family::V4)
        return std::make_unique<CpuEngineOf<V4Cpu>>(std::make_unique<V4Cpu>(cfg, bind_weights_v4(cfg, files)), opts,
                                                    "deepseek_v4");
      if (opts.progress) opts.progress(0.1);
      ModelWeights w = bind_weights(cfg, files);
      if (opts.progress) opts.progress(0.6);
      std::vector<int32_t> cmap = load_engram_token_map(dir, cfg);
      if (opts.progress) opts.progress(1.0);
      return std::make_unique<CpuEngineOf<V41Cpu>>(std::make_unique<V41Cpu>(cfg, std::move(w), std::move(cmap)), opts,
                                                   "deepseek_v41");
    });
  }
} registration;

}  // namespace

std::unique_ptr<Engine> make_cpu_engine(std::unique_ptr<V41Cpu> model, const EngineOptions& opts) {
  return std::make_unique<CpuEngineOf<V41Cpu>>(std::move(model), opts, "deepseek_v41");
}

}  // namespace dsx
