#include "runtime/cuda_engine.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "backend/cuda/runner.h"
#include "model/weights.h"
#include "util/error.h"
#include "util/snapshot_io.h"

namespace dsx {

namespace {

using cuda::DeviceSession;
using cuda::Runner;

class CudaBackend : public Session::Backend {
 public:
  CudaBackend(Runner& r) : r_(r), s_(r.new_session()) {}
  ~CudaBackend() override { r_.release(*s_); }
  DeviceSession& device() { return *s_; }
  int64_t position() const override { return s_->pos; }
  const std::vector<int32_t>& tokens() const override { return s_->tokens; }
  int64_t capacity() const override { return r_.max_context(); }
  void rollback(int64_t p) override { r_.rollback(*s_, p); }
  void reset() override { r_.reset(*s_); }
  struct Cp : Checkpoint {
    Runner::Checkpoint c;
  };
  std::unique_ptr<Checkpoint> checkpoint() const override {
    auto c = std::make_unique<Cp>();
    c->c = r_.checkpoint(*s_);
    c->pos = c->c.pos;
    c->bytes = static_cast<int64_t>(c->c.fixed.size());
    return c;
  }
  void restore(const Checkpoint& c) override { r_.restore(*s_, static_cast<const Cp&>(c).c); }
  void save(SnapshotWriter& w) const override { r_.save(*s_, w); }
  void restore(SnapshotReader& r, int64_t pos) override { r_.restore(*s_, r, pos); }
  int64_t state_bytes() const override { return s_->cache->device_bytes(); }
  bool synthetic_fill(int64_t n, uint64_t seed) override {
    r_.synthetic_fill(*s_, n, seed);
    return true;
  }

 private:
  Runner& r_;
  std::unique_ptr<DeviceSession> s_;
};

int64_t default_device_budget(int64_t reserve) {
  size_t free_b = 0, total_b = 0;
  DSX_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  // keep 5 % of the device (at least 1 GB) for the libraries and the graphs
  const int64_t margin = std::max<int64_t>(int64_t{1} << 30, static_cast<int64_t>(total_b) / 20);
  return std::max<int64_t>(reserve, static_cast<int64_t>(free_b) - margin);
}

class CudaEngine : public Engine {
 public:
  CudaEngine(std::unique_ptr<cuda::DeviceModel> m, EngineOptions o) : Engine(std::move(o)) {
    const int64_t ctx = opts_.max_context > 0 ? opts_.max_context : 8192;
    id_.model_id = m->fingerprint;
    id_.family = "deepseek_v41";
    id_.compact = true;
    r_ = std::make_unique<Runner>(std::move(m), ctx, opts_.rollback_depth);
    id_.geometry = r_->geometry();
    session_bytes_ = r_->session_device_bytes() + int64_t{opts_.max_checkpoints} * r_->fixed_bytes();
    budget_ = opts_.state_budget > 0 ? opts_.state_budget : default_device_budget(session_bytes_);
  }
  ~CudaEngine() override {
    if (!sessions().empty()) std::fprintf(stderr, "dsx: a CUDA engine destroyed before its %zu sessions\n", sessions().size());
  }
  const ModelConfig& config() const override { return r_->model().cfg; }
  std::string describe() const override {
    cudaDeviceProp p{};
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&p, dev);
    return cat("cuda ", p.name, ", ", cuda::act_name(r_->model().act), " activations, weights ",
               r_->model().weight_bytes / 1e9, " GB, ", r_->max_context(), "-token sessions");
  }
  std::string backend_name() const override { return "cuda"; }
  const StateIdentity& state_identity() const override { return id_; }
  std::unique_ptr<Session> new_session() override {
    check_budget(session_bytes_, budget_);
    return std::make_unique<Session>(*this, std::make_unique<CudaBackend>(*r_));
  }
  StateFootprint footprint() const override {
    StateFootprint f;
    f.fixed_bytes = r_->fixed_bytes();
    f.bytes_per_token = r_->geometry().bytes_per_token();
    f.session_bytes = session_bytes_;
    f.budget_bytes = budget_;
    f.sessions = static_cast<int>(sessions().size());
    for (const Session* s : sessions()) f.used_bytes += s->state_bytes();
    return f;
  }
  Runner& runner() { return *r_; }

 protected:
  void run(const Step& s) override {
    std::vector<cuda::SegmentFeed> feeds;
    for (const Feed& f : s.feeds)
      feeds.push_back(
          {&static_cast<CudaBackend&>(f.session->backend()).device(), f.ids, f.n, f.logits, f.taps, f.pick, f.picks});
    r_->step(feeds, s.all_rows);
  }

 private:
  std::unique_ptr<Runner> r_;
  StateIdentity id_;
  int64_t session_bytes_ = 0, budget_ = 0;
};

struct Registration {
  Registration() { register_engine_backend("cuda", load_cuda_engine); }
} registration;

}  // namespace

// (multi-GPU execution is not built: docs/multi-gpu.md)
static void refuse_expert_ranks(const EngineOptions& o) {
  if (o.expert_ranks != 1)
    fail("--gpus ", o.expert_ranks, ": multi-GPU execution on the cuda backend is not built yet (issue 28; "
         "docs/multi-gpu.md): the CUDA backend runs on one GPU only. The CPU backend runs the expert-parallel math "
         "of N ranks in one process (--backend cpu --gpus N); `dsx model plan --gpus N` prints the placement");
}

std::unique_ptr<Engine> load_cuda_engine(const std::string& dir, const EngineOptions& o) {
  refuse_expert_ranks(o);
  if (!cuda::device_available()) fail("backend cuda: no CUDA device is available");
  const cuda::Act act = cuda::parse_precision(o.precision);
  ModelConfig cfg = load_model_config(dir);
  if (cfg.family != Family::V41) fail(dir, ": the CUDA backend runs V4.1 models only");
  auto files = std::make_shared<ModelFiles>(dir);
  ModelWeights w = bind_weights(cfg, files);
  auto cmap = load_engram_token_map(dir, cfg);
  if (o.progress) o.progress(0.02);  // (checkpoint bound: the upload follows)
  return std::make_unique<CudaEngine>(cuda::DeviceModel::from_weights(cfg, w, act, std::move(cmap), o.progress), o);
}

std::unique_ptr<Engine> make_synthetic_cuda_engine(const ModelConfig& cfg, const EngineOptions& o, uint64_t seed) {
  refuse_expert_ranks(o);
  if (!cuda::device_available()) fail("backend cuda: no CUDA device is available");
  return std::make_unique<CudaEngine>(cuda::DeviceModel::synthetic(cfg, cuda::parse_precision(o.precision), seed), o);
}

CudaEngineStats cuda_engine_stats(Engine& e) {
  auto* ce = dynamic_cast<CudaEngine*>(&e);
  DSX_CHECK(ce, "cuda_engine_stats: not a CUDA engine");
  const cuda::RunnerStats r = ce->runner().stats();
  return {r.weight_bytes, r.decode_weight_bytes, r.workspace_bytes, r.copy_bandwidth_gb_s};
}

}  // namespace dsx
