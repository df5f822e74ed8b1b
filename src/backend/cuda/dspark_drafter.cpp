// The DSpark drafter on the GPU (dspark_drafter.h). The stage loop follows
// DSparkDrafter::block / stage / attention / moe (model/dspark.cpp) launch by launch on
// the target's kernels, in the order of the target's Forward::run (forward.cpp).
#include "backend/cuda/dspark_drafter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "backend/cuda/step_kernels.h"
#include "kernels/cuda/dspark.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/hc.h"
#include "kernels/cuda/kv_cache.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/router.h"
#include "model/rope.h"
#include "util/error.h"
#include "util/numerics.h"
#include "util/switches.h"

namespace dsx::cuda {

namespace {

constexpr int kRows = kGemvMaxT;  // rows per launch: pending ring rows + block rows

// The stages as a model of S window-only layers (the backend's upload and workspace).
ModelConfig stage_model_config(const ModelConfig& c, int S) {
  ModelConfig s = c;
  s.n_layers = S;
  s.compress_ratios.assign(static_cast<size_t>(S), 0);
  s.kv_source_layers.clear();
  s.index_source_layers.clear();
  s.candidate_source_layer = -1;
  s.engram_layers.clear();
  s.engram_num_embeddings.clear();
  s.n_hash_layers = 0;
  s.n_routed_experts = c.dspark_n_routed_experts;
  s.n_experts_per_tok = c.dspark_experts_per_tok;
  s.dspark_target_layers.clear();
  s.n_nextn_layers = 0;
  s.n_ratio_entries = S;
  return s;
}

Fq8Rows rows_from(const Fq8Rows& b, int64_t r0) {
  return {b.codes + r0 * b.dim, b.scales + r0 * (b.dim / 32), b.dim};
}

}  // namespace

// ---- the state ------------------------------------------------------------------------------
class CudaDraftState final : public DrafterState {
 public:
  CudaDraftState(const CudaDrafter& d, int rollback_depth)
      : d_(&d), W_(d.cfg_.window), cap_(d.cfg_.window + std::max(rollback_depth, 0)), hd_(d.cfg_.head_dim) {
    const int S = d.S_;
    ring_bytes_ = static_cast<size_t>(cap_) * Fq8Rows::row_bytes(hd_);
    buf_.alloc(static_cast<size_t>(S) * ring_bytes_ + static_cast<size_t>(cap_) * 8 + 256);
    DSX_CUDA_CHECK(cudaMemset(buf_.get(), 0, buf_.size()));
    uint8_t* p = static_cast<uint8_t*>(buf_.get());
    for (int s = 0; s < S; ++s) {
      Fq8Rows r;
      r.dim = hd_;
      r.codes = p + s * ring_bytes_;
      r.scales = r.codes + static_cast<int64_t>(cap_) * hd_;
      rings_.push_back(r);
    }
    d_held_ = reinterpret_cast<int64_t*>(p + ((S * ring_bytes_ + 255) & ~size_t{255}));
    held_.assign(static_cast<size_t>(cap_), -1);
    h_held_.resize(static_cast<size_t>(cap_));
    graphs_.assign(kRows + 1, nullptr);
    eager_.assign(kRows + 1, 0);
  }
  ~CudaDraftState() override {
    if (d_->stream_) cudaStreamSynchronize(d_->stream_);
    for (cudaGraphExec_t g : graphs_)
      if (g) cudaGraphExecDestroy(g);
  }
  int64_t end() const override { return end_; }
  int capacity() const override { return cap_; }
  int64_t bytes() const override { return static_cast<int64_t>(buf_.size()); }
  void truncate(int64_t p) override {
    p = std::max<int64_t>(p, 0);
    for (int64_t& h : held_)
      if (h >= p) h = -1, dirty_ = true;
    end_ = std::min(end_, p);
    if (pend_T_ > 0) {
      if (p <= pend_p0_)
        pend_T_ = 0;
      else if (p < pend_p0_ + pend_T_)
        pend_T_ = static_cast<int>(p - pend_p0_);
    }
  }
  int64_t context_rows(int64_t n) const override {
    int64_t k = 0;
    for (int64_t q = std::max<int64_t>(0, n - W_); q < n; ++q) k += held(q);
    return k;
  }
  bool held(int64_t p) const { return p >= 0 && held_[static_cast<size_t>(p % cap_)] == p; }
  void mark(int64_t p0, int64_t T) {
    for (int64_t p = p0; p < p0 + T; ++p) held_[static_cast<size_t>(p % cap_)] = p;
    dirty_ = true;
  }

  const CudaDrafter* d_;
  int W_, cap_, hd_;
  size_t ring_bytes_ = 0;
  DeviceBuffer buf_;
  std::vector<Fq8Rows> rings_;
  int64_t* d_held_ = nullptr;
  std::vector<int64_t> held_;
  Pinned<int64_t> h_held_;
  bool dirty_ = true;
  int64_t end_ = 0;
  // pending ring rows: positions pend_p0 .. pend_p0 + pend_T - 1, their taps
  int64_t pend_p0_ = 0;
  int pend_T_ = 0;
  std::vector<float> pend_taps_;
  std::vector<cudaGraphExec_t> graphs_;  // by pending rows
  std::vector<int> eager_;
};

class CudaDraftBlock final : public DraftBlock {
 public:
  uint64_t generation = 0;
  const CudaDrafter* owner = nullptr;
};

// ---- construction -----------------------------------------------------------------------------
CudaDrafter::CudaDrafter(const ModelConfig& cfg, Act act) : cfg_(cfg), act_(act) {}

CudaDrafter::CudaDrafter(const ModelConfig& cfg, const DSparkWeights& w, Act act) : CudaDrafter(cfg, act) {
  S_ = w.n_stages;
  DSX_CHECK(S_ > 0 && static_cast<int>(w.stages.size()) == S_, "CUDA drafter: no DSpark stages");
  const ModelConfig sc = stage_model_config(cfg_, S_);
  ModelWeights mw;
  mw.files = w.files;
  mw.embed = w.embed;
  mw.head = w.head;
  mw.norm = w.norm;
  mw.layers = w.stages;
  dm_ = DeviceModel::from_weights(sc, mw, act, {});
  // the drafter-only tensors
  const int64_t D = cfg_.hidden, V = cfg_.vocab_size, R = cfg_.dspark_markov_rank;
  DSX_CHECK(w.markov_embed.fmt == WFormat::BF16 && w.markov_head.fmt == WFormat::BF16 && w.markov_embed.rows == V &&
                w.markov_head.rows == V && w.markov_embed.cols == R && w.markov_head.cols == R,
            "CUDA drafter: the Markov tables are not BF16 [", V, ", ", R, "]");
  const bool tile = w.main_proj.fmt == WFormat::FP8_BLOCK && sw::on(sw::Id::TILED) && tile16_fits(w.main_proj);
  const size_t mp_data = static_cast<size_t>(w.main_proj.data_bytes()), mp_scale = static_cast<size_t>(w.main_proj.scale_bytes());
  const size_t tab = static_cast<size_t>(V * R * 2);
  size_t total = 0;
  auto sz = [&](size_t n) { total += aligned(n); };
  sz(mp_data), sz(mp_scale), sz(D * 4), sz(tab), sz(tab), sz((D + R) * 4);
  extra_.alloc(total);
  size_t off = 0;
  auto put = [&](const void* host, size_t n) {
    void* dptr = static_cast<char*>(extra_.get()) + off;
    off += aligned(n);
    if (n) DSX_CUDA_CHECK(cudaMemcpy(dptr, host, n, cudaMemcpyHostToDevice));
    return dptr;
  };
  main_proj_ = w.main_proj;
  if (tile) {
    std::vector<uint8_t> t(mp_data);
    tile16_pack(w.main_proj.data, w.main_proj.rows, w.main_proj.row_bytes(), t.data());
    main_proj_.data = static_cast<const uint8_t*>(put(t.data(), mp_data));
  } else {
    main_proj_.data = static_cast<const uint8_t*>(put(w.main_proj.data, mp_data));
  }
  main_proj_.tiled = tile;
  main_proj_.scale = mp_scale ? static_cast<const uint8_t*>(put(w.main_proj.scale, mp_scale)) : nullptr;
  main_norm_ = static_cast<float*>(put(w.main_norm.data(), D * 4));
  markov_embed_ = static_cast<const uint16_t*>(put(w.markov_embed.data, tab));
  markov_head_ = static_cast<const uint16_t*>(put(w.markov_head.data, tab));
  confidence_ = static_cast<float*>(put(w.confidence.data(), (D + R) * 4));
  weight_bytes_ = dm_->weight_bytes + w.main_proj.bytes() + 2 * static_cast<int64_t>(tab) + (D + R + D) * 4;
  init_buffers();
}

std::unique_ptr<CudaDrafter> CudaDrafter::synthetic(const ModelConfig& cfg, int S, Act act, uint64_t seed) {
  DSX_CHECK(S > 0 && cfg.dspark_block_size > 0 && cfg.dspark_markov_rank > 0 && cfg.dspark_n_routed_experts > 0 &&
                cfg.dspark_experts_per_tok > 0 && !cfg.dspark_target_layers.empty(),
            "synthetic CUDA drafter: the config has no DSpark keys");
  std::unique_ptr<CudaDrafter> d(new CudaDrafter(cfg, act));
  d->S_ = S;
  d->dm_ = DeviceModel::synthetic(stage_model_config(cfg, S), act, seed);
  const int64_t D = cfg.hidden, V = cfg.vocab_size, R = cfg.dspark_markov_rank, TW = cfg.tap_width();
  QMatrix& mp = d->main_proj_;
  mp.fmt = WFormat::FP8_BLOCK;
  mp.rows = D, mp.cols = TW, mp.block = cfg.quant_block, mp.name = "mtp.0.main_proj";
  const size_t mp_data = static_cast<size_t>(mp.data_bytes()), mp_scale = static_cast<size_t>(mp.scale_bytes());
  const size_t tab = static_cast<size_t>(V * R * 2);
  d->extra_.alloc(aligned(mp_data) + aligned(mp_scale) + aligned(D * 4) + 2 * aligned(tab) + aligned((D + R) * 4));
  char* p = static_cast<char*>(d->extra_.get());
  auto take = [&](size_t n) {
    char* q = p;
    p += aligned(n);
    return q;
  };
  uint64_t k = seed * 7919 + 17;
  const int center = 127 - 6 - static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(TW))));
  mp.data = reinterpret_cast<const uint8_t*>(take(mp_data));
  fill_random(const_cast<uint8_t*>(mp.data), static_cast<int64_t>(mp_data), 0, ++k, 0.02f, 0, 120, 1, nullptr);
  mp.scale = reinterpret_cast<const uint8_t*>(take(mp_scale));
  fill_random(const_cast<uint8_t*>(mp.scale), static_cast<int64_t>(mp_scale), 2, ++k, 0, 0, center, 1, nullptr);
  d->main_norm_ = reinterpret_cast<float*>(take(D * 4));
  fill_random(d->main_norm_, D * 4, 4, ++k, 0.0f, 1.0f, 0, 1, nullptr);
  d->markov_embed_ = reinterpret_cast<const uint16_t*>(take(tab));
  fill_random(const_cast<uint16_t*>(d->markov_embed_), static_cast<int64_t>(tab), 3, ++k, 1.0f, 0, 0, 1, nullptr);
  d->markov_head_ = reinterpret_cast<const uint16_t*>(take(tab));
  fill_random(const_cast<uint16_t*>(d->markov_head_), static_cast<int64_t>(tab), 3, ++k,
              1.0f / std::sqrt(static_cast<float>(R)), 0, 0, 1, nullptr);
  d->confidence_ = reinterpret_cast<float*>(take((D + R) * 4));
  fill_random(d->confidence_, (D + R) * 4, 4, ++k, 0.02f, 0.0f, 0, 1, nullptr);
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  d->weight_bytes_ = d->dm_->weight_bytes + mp.bytes() + 2 * static_cast<int64_t>(tab) + (D + R + D) * 4;
  d->init_buffers();
  return d;
}

void CudaDrafter::init_buffers() {
  const ModelConfig& c = cfg_;
  const int64_t B = c.dspark_block_size, V = c.vocab_size, R = c.dspark_markov_rank, TW = c.tap_width();
  DSX_CHECK(B >= 1 && B < kRows, "CUDA drafter: dspark_block_size ", B, " must be below ", kRows);
  DSX_CHECK(c.hc_mult == kHcStreams, "CUDA drafter: hc_mult ", c.hc_mult, " (the kernels take ", kHcStreams, ")");
  ws_ = std::make_unique<Workspace>(*dm_, kRows, 1, 0);
  GemvOpts o;
  o.qblock = c.quant_block;
  for (int t = 1; t <= kRows; t *= 2) mp_ws_bytes_ = std::max(mp_ws_bytes_, gemv_split_ws_bytes(main_proj_, t, o));
  const size_t ab = act_bytes(act_);
  size_t total = 0;
  auto sz = [&](size_t n) { total += aligned(n); };
  sz(sizeof(Inputs)), sz(kRows * TW * ab), sz(2 * B * V * 4), sz(2 * B * R * 4), sz((B + 1) * 4), sz(B * 4),
      sz(B * 4), sz(B * 4), sz(B * 4), sz(dspark_markov_ws_bytes()), sz(std::max<size_t>(mp_ws_bytes_, 256));
  buf_.alloc(total);
  DSX_CUDA_CHECK(cudaMemset(buf_.get(), 0, total));
  char* p = static_cast<char*>(buf_.get());
  auto take = [&](size_t n) {
    char* q = p;
    p += aligned(n);
    return static_cast<void*>(q);
  };
  d_in_ = static_cast<Inputs*>(take(sizeof(Inputs)));
  d_taps_ = take(kRows * TW * ab);
  d_mk_g_ = static_cast<float*>(take(2 * B * V * 4));
  d_mk_f_ = d_mk_g_ + B * V;
  d_e_g_ = static_cast<float*>(take(2 * B * R * 4));
  d_e_f_ = d_e_g_ + B * R;
  d_g_ = static_cast<int32_t*>(take((B + 1) * 4));
  d_fprev_ = static_cast<int32_t*>(take(B * 4));
  d_ftok_ = static_cast<int32_t*>(take(B * 4));
  d_cg_ = static_cast<float*>(take(B * 4));
  d_cf_ = static_cast<float*>(take(B * 4));
  d_markov_ws_ = take(dspark_markov_ws_bytes());
  d_mp_ws_ = static_cast<float*>(take(std::max<size_t>(mp_ws_bytes_, 256)));
  h_in_.resize(1);
  h_taps_.resize(static_cast<size_t>(kRows * TW) * ab);
  h_ids_.resize(static_cast<size_t>(B));
  h_tok_.resize(static_cast<size_t>(B));
  h_ftok_.resize(static_cast<size_t>(B));
  h_fprev_.resize(static_cast<size_t>(B));
  h_conf_.resize(static_cast<size_t>(B));
  h_fconf_.resize(static_cast<size_t>(B));
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  if (sw::on(sw::Id::GRAPH_TIMING)) {
    DSX_CUDA_CHECK(cudaEventCreate(&gt0_));
    DSX_CUDA_CHECK(cudaEventCreate(&gt1_));
  }
}

CudaDrafter::~CudaDrafter() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  if (graph_runs_ > 0)
    std::fprintf(stderr, "# DSX_GRAPH_TIMING: drafter blocks: %d replayed, %.3f ms each on the device\n", graph_runs_,
                 graph_ms_ / graph_runs_);
  for (cudaEvent_t e : {gt0_, gt1_})
    if (e) cudaEventDestroy(e);
}

// The device time of the block graph launched last (DSX_GRAPH_TIMING), once it is done.
void CudaDrafter::note_graph_time() const {
  if (!timing_pending_) return;
  timing_pending_ = false;
  float ms = 0;
  DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, gt0_, gt1_));
  graph_ms_ += ms;
  ++graph_runs_;
}

std::unique_ptr<DrafterState> CudaDrafter::make_state(int rollback_depth) const {
  return std::make_unique<CudaDraftState>(*this, rollback_depth);
}

CudaDraftState& CudaDrafter::state_of(const DrafterState& st) const {
  auto* s = dynamic_cast<const CudaDraftState*>(&st);
  DSX_CHECK(s && s->d_ == this, "DSpark: a drafter state of another drafter given to the CUDA drafter");
  return const_cast<CudaDraftState&>(*s);
}

void CudaDrafter::check_block(const DraftBlock& b) const {
  auto* cb = dynamic_cast<const CudaDraftBlock*>(&b);
  DSX_CHECK(cb && cb->owner == this, "DSpark: a draft block of another drafter given to the CUDA drafter");
  DSX_CHECK(cb->generation == generation_, "DSpark: the CUDA drafter keeps only its latest block (this one is older)");
}

// ---- launches --------------------------------------------------------------------------------
void CudaDrafter::lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8,
                      int groups, float* split_ws, size_t split_bytes) const {
  GemvOpts o;
  o.qa8 = qa8;
  o.qblock = cfg_.quant_block;
  o.groups = groups;
  o.split_ws = split_ws ? split_ws : ws_->gemv_ws;
  o.split_ws_bytes = split_ws ? split_bytes : ws_->gemv_ws_bytes;
  gemv(W, act_, x, ldx, T, yt, y, ldy, o, stream_);
}

void CudaDrafter::stage_taps(const float* taps, int64_t T, int64_t row0) const {
  const int64_t TW = cfg_.tap_width(), n = T * TW;
  if (act_ == Act::F32) {
    std::memcpy(reinterpret_cast<float*>(h_taps_.data()) + row0 * TW, taps, static_cast<size_t>(n) * 4);
  } else {  // (the target's taps are bf16 values in bf16 mode: exact)
    uint16_t* h = reinterpret_cast<uint16_t*>(h_taps_.data()) + row0 * TW;
    for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(taps[i]);
  }
}

void CudaDrafter::upload_held(CudaDraftState& s) const {
  if (!s.dirty_) return;
  std::memcpy(s.h_held_.data(), s.held_.data(), s.held_.size() * 8);
  DSX_CUDA_CHECK(cudaMemcpyAsync(s.d_held_, s.h_held_.data(), s.held_.size() * 8, cudaMemcpyHostToDevice, stream_));
  s.dirty_ = false;
}

// Ring rows of positions p0 .. p0 + T - 1 now, kRows at a time.
void CudaDrafter::eager_observe(CudaDraftState& s, const float* taps, int64_t T, int64_t p0) const {
  const int64_t D = cfg_.hidden, hd = cfg_.head_dim, TW = cfg_.tap_width();
  const int np = cfg_.rope_dim / 2;
  const size_t ab = act_bytes(act_);
  for (int64_t r0 = 0; r0 < T; r0 += kRows) {
    const int c = static_cast<int>(std::min<int64_t>(kRows, T - r0));
    DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (the pinned staging is rewritten)
    stage_taps(taps + r0 * TW, c, 0);
    h_in_.data()->p0 = p0 + r0;
    h_in_.data()->n = p0 + r0 + c;
    DSX_CUDA_CHECK(cudaMemcpyAsync(d_in_, h_in_.data(), sizeof(Inputs), cudaMemcpyHostToDevice, stream_));
    DSX_CUDA_CHECK(cudaMemcpyAsync(d_taps_, h_taps_.data(), static_cast<size_t>(c * TW) * ab, cudaMemcpyHostToDevice, stream_));
    lin(main_proj_, d_taps_, TW, c, act_, ws_->a, D, true, 1, d_mp_ws_, mp_ws_bytes_);
    rmsnorm(act_, ws_->a, ws_->a, main_norm_, c, static_cast<int>(D), cfg_.rms_eps, nullptr, nullptr, stream_);
    for (int st = 0; st < S_; ++st) {
      const DevLayer& L = dm_->layers[static_cast<size_t>(st)];
      lin(L.wkv, ws_->a, D, c, act_, ws_->kv_raw, hd, true);
      kv_finish(act_, ws_->kv_raw, L.kv_norm, cfg_.rms_eps, c, static_cast<int>(hd), np, dm_->main_inv_freq, &d_in_->p0,
                ws_->chunk, stream_);
      window_store(ws_->chunk, c, s.rings_[static_cast<size_t>(st)], s.cap_, &d_in_->p0, stream_);
    }
  }
}

void CudaDrafter::flush_pending(CudaDraftState& s) const {
  if (s.pend_T_ == 0) return;
  eager_observe(s, s.pend_taps_.data(), s.pend_T_, s.pend_p0_);
  s.pend_T_ = 0;
}

void CudaDrafter::flush(const DrafterState& st) const {
  CudaDraftState& s = state_of(st);
  flush_pending(s);
  upload_held(s);
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// One block: To pending ring rows (positions n - To .. n - 1, their taps in d_taps_)
// and the B block rows, through the stages, the head and the greedy walk.
void CudaDrafter::run_block(CudaDraftState& s, int To) const {
  const ModelConfig& c = cfg_;
  const DeviceModel& m = *dm_;
  Workspace& w = *ws_;
  const int B = c.dspark_block_size, Tall = To + B;
  const int64_t D = c.hidden, M = c.hc_mult, H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank;
  const int64_t G = c.o_groups, ol = c.o_lora_rank, V = c.vocab_size, TW = c.tap_width();
  const int K = c.dspark_experts_per_tok, np = c.rope_dim / 2;
  const size_t ab = act_bytes(act_);
  auto row = [&](void* base, int64_t r, int64_t width) { return static_cast<void*>(static_cast<char*>(base) + r * width * ab); };
  cudaStream_t st = stream_;
  // §5.1 the pending rows' u_p = main_norm(main_proj . QA8(g_p)): rows [0, To) of `a`
  if (To > 0) {
    lin(main_proj_, d_taps_, TW, To, act_, w.a, D, true, 1, d_mp_ws_, mp_ws_bytes_);
    rmsnorm(act_, w.a, w.a, main_norm_, To, static_cast<int>(D), c.rms_eps, nullptr, nullptr, st);
  }
  void* A = row(w.a, To, D);  // the block's attention input rows
  // §5.2 block input
  embed_streams(act_, reinterpret_cast<const uint16_t*>(m.embed.data), w.d_ids, B, static_cast<int>(M), D, w.X, st);
  onehot_pre(w.pre0, B, static_cast<int>(M), st);
  const float* pre = w.pre0;
  const void* pend_y = nullptr;
  const float *pend_post = nullptr, *pend_comb = nullptr;
  RouterOpts ro;
  ro.gate_temp = c.gate_temp;
  ro.norm_topk_prob = c.norm_topk_prob && K > 1;
  ro.route_scale = c.routed_scaling;
  for (int s_ = 0; s_ < S_; ++s_) {
    const DevLayer& L = m.layers[static_cast<size_t>(s_)];
    // §5.3 the attention site: expand the previous FFN, mix, collapse with the incoming pre
    {
      HcPassArgs a;
      a.T = B, a.D = D, a.X = w.X, a.y = pend_y, a.post = pend_post, a.comb = pend_comb;
      a.fn = reinterpret_cast<const float*>(L.hc_attn_fn.data), a.pre = pre, a.collapsed = A, a.work = w.hc_work;
      hc_pass(act_, a, st);
      HcFinishArgs fz;
      fz.T = B, fz.D = D, fz.work = w.hc_work, fz.have_mix = true, fz.base = L.hc_attn_base, fz.scale = L.hc_attn_scale;
      fz.norm_eps = c.rms_eps, fz.hc_eps = c.hc_eps, fz.sinkhorn_iters = c.hc_sinkhorn_iters;
      fz.pre = w.pa, fz.post = w.qa, fz.comb = w.Ca, fz.collapsed = A, fz.norm_w = L.attn_norm, fz.norm_out = A;
      hc_finish(act_, fz, st);
    }
    // §5.1 + §5.4: K = V rows of the pending positions and of the block in one product
    // (positions n - To .. n + B - 1, consecutive); the pending ones into the ring
    lin(L.wkv, w.a, D, Tall, act_, w.kv_raw, hd, true);
    kv_finish(act_, w.kv_raw, L.kv_norm, c.rms_eps, Tall, static_cast<int>(hd), np, m.main_inv_freq, &d_in_->p0,
              w.chunk, st);
    if (To > 0) window_store(w.chunk, To, s.rings_[static_cast<size_t>(s_)], s.cap_, &d_in_->p0, st);
    // §5.4 queries (C2: the q-LoRA norm only; RoPE in the attention)
    lin(L.wq_a, A, D, B, act_, w.q_lat, ql, true);
    {
      GemvOpts o;
      o.qa8 = true, o.qblock = c.quant_block, o.split_ws = w.gemv_ws, o.split_ws_bytes = w.gemv_ws_bytes;
      o.norm_w = L.q_norm, o.norm_eps = c.rms_eps, o.norm_out = w.q_latn;
      gemv(L.wq_b, act_, w.q_lat, ql, B, act_, w.q, H * hd, o, st);
    }
    DSparkAttnArgs da;
    da.B = B, da.n_heads = static_cast<int>(H), da.head_dim = static_cast<int>(hd), da.window = c.window;
    da.q = w.q, da.ring = s.rings_[static_cast<size_t>(s_)], da.ring_cap = s.cap_, da.held = s.d_held_;
    da.block = rows_from(w.chunk, To), da.sink = L.attn_sink;
    da.scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
    da.n_pairs = np, da.inv_freq = m.main_inv_freq, da.d_n = &d_in_->n, da.out = w.o;
    dspark_attention(act_, da, st);
    lin(L.wo_a, w.o, H * hd, B, act_, w.zeta, G * ol, false, static_cast<int>(G));
    lin(L.wo_b, w.zeta, G * ol, B, act_, w.y, D, true);
    // the FFN site: expand the attention, mix, collapse with the attention mixer's pre
    {
      HcPassArgs a;
      a.T = B, a.D = D, a.X = w.X, a.y = w.y, a.post = w.qa, a.comb = w.Ca;
      a.fn = reinterpret_cast<const float*>(L.hc_ffn_fn.data), a.pre = w.pa, a.collapsed = w.f, a.work = w.hc_work;
      hc_pass(act_, a, st);
      HcFinishArgs fz;
      fz.T = B, fz.D = D, fz.work = w.hc_work, fz.have_mix = true, fz.base = L.hc_ffn_base, fz.scale = L.hc_ffn_scale;
      fz.norm_eps = c.rms_eps, fz.hc_eps = c.hc_eps, fz.sinkhorn_iters = c.hc_sinkhorn_iters;
      fz.pre = w.pf, fz.post = w.qf, fz.comb = w.Cf, fz.collapsed = w.f, fz.norm_w = L.ffn_norm, fz.norm_out = w.f;
      hc_finish(act_, fz, st);
    }
    // the stage's MoE
    router(act_, w.f, D, B, L.gate, L.gate_bias, K, ro, w.router_logits, w.route_ids, w.route_w, st);
    moe_decode(L.moe, act_, w.f, D, B, K, w.route_ids, w.route_w, act_, w.y, D, w.moe_ws, w.moe_ws_bytes, st);
    pend_y = w.y, pend_post = w.qf, pend_comb = w.Cf;
    pre = w.pf;
  }
  // §5.5 z = the last FFN pre's collapse (into h), base logits of norm(z)
  {
    HcPassArgs a;
    a.T = B, a.D = D, a.X = w.X, a.y = pend_y, a.post = pend_post, a.comb = pend_comb;
    a.pre = pre, a.collapsed = w.h, a.work = w.hc_work;
    hc_pass(act_, a, st);
    HcFinishArgs fz;
    fz.T = B, fz.D = D, fz.work = w.hc_work, fz.norm_eps = c.rms_eps;
    fz.collapsed = w.h, fz.norm_w = m.norm, fz.norm_out = w.f;
    hc_finish(act_, fz, st);
  }
  lin(m.head, w.f, D, B, Act::F32, w.logits, V, false);
  // §5.6 - §5.7 the greedy walk
  markov_rows(true, 0, B);
}

void CudaDrafter::markov_rows(bool greedy, int j0, int j1) const {
  const int64_t V = cfg_.vocab_size, R = cfg_.dspark_markov_rank, D = cfg_.hidden;
  for (int j = j0; j < j1; ++j) {
    DSparkMarkovArgs a;
    a.V = V, a.R = static_cast<int>(R), a.D = D;
    a.base = ws_->logits + j * V;
    a.embed = markov_embed_, a.head = markov_head_, a.conf_w = confidence_;
    a.z = static_cast<const char*>(ws_->h) + j * D * act_bytes(act_);
    if (greedy) {
      a.prev = d_g_ + j, a.token = d_g_ + j + 1, a.conf = d_cg_ + j;
      a.logits = d_mk_g_ + j * V, a.embed_out = d_e_g_ + j * R;
      a.token_copy = h_tok_.data() + j, a.conf_copy = h_conf_.data() + j;
    } else {
      a.prev = d_fprev_ + j, a.token = d_ftok_ + j, a.conf = d_cf_ + j;
      a.logits = d_mk_f_ + j * V, a.embed_out = d_e_f_ + j * R;
      a.token_copy = h_ftok_.data() + j, a.conf_copy = h_fconf_.data() + j;
    }
    a.ws = d_markov_ws_;
    dspark_markov_row(act_, a, stream_);
  }
}

// ---- the interface --------------------------------------------------------------------------------
void CudaDrafter::observe(DrafterState& st, const float* taps, int64_t T, int64_t p0) const {
  CudaDraftState& s = state_of(st);
  DSX_CHECK(T >= 0 && p0 >= 0, "DSpark observe: bad rows (", T, " at position ", p0, ")");
  s.truncate(p0);  // (p0 > end: positions end .. p0 - 1 stay holes)
  const int64_t skip = std::max<int64_t>(0, T - s.cap_);
  const int64_t n = T - skip, start = p0 + skip, TW = cfg_.tap_width();
  const int maxp = kRows - cfg_.dspark_block_size;
  if (n > 0) {
    const float* t = taps + skip * TW;
    if (s.pend_T_ > 0 && start == s.pend_p0_ + s.pend_T_ && s.pend_T_ + n <= maxp) {
      s.pend_taps_.resize(static_cast<size_t>((s.pend_T_ + n) * TW));
      std::memcpy(s.pend_taps_.data() + s.pend_T_ * TW, t, static_cast<size_t>(n * TW) * 4);
      s.pend_T_ += static_cast<int>(n);
    } else {
      flush_pending(s);
      if (n <= maxp) {
        s.pend_taps_.assign(t, t + n * TW);
        s.pend_p0_ = start, s.pend_T_ = static_cast<int>(n);
      } else {
        eager_observe(s, t, n, start);
      }
    }
    s.mark(start, n);
  }
  s.end_ = p0 + T;
}

std::unique_ptr<DraftBlock> CudaDrafter::draft_block(const DrafterState& st, int32_t anchor, int64_t n) const {
  CudaDraftState& s = state_of(st);
  if (n < 2) fail("DSpark draft: anchor position ", n, " < 2 (the official drafter drafts from position 2 on)");
  if (n > s.end_)
    fail("DSpark draft: anchor position ", n, " but the drafter observed positions up to ", s.end_ - 1,
         " only (observe the committed positions first)");
  if (anchor < 0 || anchor >= cfg_.vocab_size)
    fail("DSpark draft: anchor token ", anchor, " outside the vocabulary (", cfg_.vocab_size, ")");
  const int B = cfg_.dspark_block_size;
  const int64_t TW = cfg_.tap_width();
  if (s.pend_T_ > 0 && s.pend_p0_ + s.pend_T_ != n) flush_pending(s);
  const int To = s.pend_T_;
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));  // (the pinned staging is rewritten)
  for (int j = 0; j < B; ++j) h_ids_.data()[j] = j == 0 ? anchor : cfg_.dspark_noise_token_id;
  h_in_.data()->p0 = n - To;
  h_in_.data()->n = n;
  if (To > 0) stage_taps(s.pend_taps_.data(), To, 0);
  upload_held(s);
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_in_, h_in_.data(), sizeof(Inputs), cudaMemcpyHostToDevice, stream_));
  DSX_CUDA_CHECK(cudaMemcpyAsync(ws_->d_ids, h_ids_.data(), static_cast<size_t>(B) * 4, cudaMemcpyHostToDevice, stream_));
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_g_, h_ids_.data(), 4, cudaMemcpyHostToDevice, stream_));
  if (To > 0)
    DSX_CUDA_CHECK(cudaMemcpyAsync(d_taps_, h_taps_.data(), static_cast<size_t>(To * TW) * act_bytes(act_),
                                   cudaMemcpyHostToDevice, stream_));
  cudaGraphExec_t& g = s.graphs_[static_cast<size_t>(To)];
  if (graphs_ && !g && s.eager_[static_cast<size_t>(To)] >= 1) {
    cudaGraph_t gr = nullptr;
    DSX_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      run_block(s, To);
    } catch (...) {
      cudaStreamEndCapture(stream_, &gr);
      if (gr) cudaGraphDestroy(gr);
      throw;
    }
    DSX_CUDA_CHECK(cudaStreamEndCapture(stream_, &gr));
    const cudaError_t e = cudaGraphInstantiate(&g, gr, 0);
    cudaGraphDestroy(gr);
    DSX_CUDA_CHECK(e);
  }
  if (graphs_ && g) {
    if (gt0_) DSX_CUDA_CHECK(cudaEventRecord(gt0_, stream_));
    DSX_CUDA_CHECK(cudaGraphLaunch(g, stream_));
    if (gt0_) {
      DSX_CUDA_CHECK(cudaEventRecord(gt1_, stream_));
      timing_pending_ = true;
    }
  } else {
    run_block(s, To);
    ++s.eager_[static_cast<size_t>(To)];
  }
  s.pend_T_ = 0;
  auto b = std::make_unique<CudaDraftBlock>();
  b->n = n;
  b->anchor = anchor;
  b->owner = this;
  b->generation = ++generation_;
  block_n_ = n;
  return b;
}

DSparkDraft CudaDrafter::greedy(const DraftBlock& b, bool full) const {
  check_block(b);
  const int64_t B = cfg_.dspark_block_size, V = cfg_.vocab_size, R = cfg_.dspark_markov_rank;
  DSparkDraft d;
  if (full) {
    d.markov_logits.resize(static_cast<size_t>(B * V));
    d.markov_embed.resize(static_cast<size_t>(B * R));
    DSX_CUDA_CHECK(cudaMemcpyAsync(d.markov_logits.data(), d_mk_g_, d.markov_logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    DSX_CUDA_CHECK(cudaMemcpyAsync(d.markov_embed.data(), d_e_g_, d.markov_embed.size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  note_graph_time();
  d.tokens.assign(h_tok_.data(), h_tok_.data() + B);
  d.confidence_logits.assign(h_conf_.data(), h_conf_.data() + B);
  d.prev.resize(static_cast<size_t>(B));
  for (int64_t j = 0; j < B; ++j) d.prev[static_cast<size_t>(j)] = j == 0 ? b.anchor : d.tokens[static_cast<size_t>(j - 1)];
  return d;
}

DSparkDraft CudaDrafter::forced(const DraftBlock& b, const int32_t* prev, bool full) const {
  check_block(b);
  DSX_CHECK(prev, "DSpark forced: no previous tokens");
  const int64_t B = cfg_.dspark_block_size, V = cfg_.vocab_size, R = cfg_.dspark_markov_rank;
  for (int64_t j = 0; j < B; ++j)
    if (prev[j] < 0 || prev[j] >= V) fail("DSpark: previous token ", prev[j], " of block row ", j, " outside the vocabulary (", V, ")");
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(h_fprev_.data(), prev, static_cast<size_t>(B) * 4);
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_fprev_, h_fprev_.data(), static_cast<size_t>(B) * 4, cudaMemcpyHostToDevice, stream_));
  markov_rows(false, 0, static_cast<int>(B));
  DSparkDraft d;
  if (full) {
    d.markov_logits.resize(static_cast<size_t>(B * V));
    d.markov_embed.resize(static_cast<size_t>(B * R));
    DSX_CUDA_CHECK(cudaMemcpyAsync(d.markov_logits.data(), d_mk_f_, d.markov_logits.size() * 4, cudaMemcpyDeviceToHost, stream_));
    DSX_CUDA_CHECK(cudaMemcpyAsync(d.markov_embed.data(), d_e_f_, d.markov_embed.size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  d.prev.assign(prev, prev + B);
  d.tokens.assign(h_ftok_.data(), h_ftok_.data() + B);
  d.confidence_logits.assign(h_fconf_.data(), h_fconf_.data() + B);
  return d;
}

void CudaDrafter::forced_row(const DraftBlock& b, int j, int32_t prev, float* logits, float* conf) const {
  check_block(b);
  const int64_t V = cfg_.vocab_size;
  DSX_CHECK(j >= 0 && j < cfg_.dspark_block_size, "DSpark forced_row: row ", j, " outside the block");
  if (prev < 0 || prev >= V) fail("DSpark: previous token ", prev, " of block row ", j, " outside the vocabulary (", V, ")");
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  h_fprev_.data()[j] = prev;
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_fprev_ + j, h_fprev_.data() + j, 4, cudaMemcpyHostToDevice, stream_));
  markov_rows(false, j, j + 1);
  DSX_CUDA_CHECK(cudaMemcpyAsync(logits, d_mk_f_ + j * V, static_cast<size_t>(V) * 4, cudaMemcpyDeviceToHost, stream_));
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  *conf = h_fconf_.data()[j];
}

void CudaDrafter::block_values(const DraftBlock& b, std::vector<float>* z, std::vector<float>* base) const {
  check_block(b);
  const int64_t B = cfg_.dspark_block_size, V = cfg_.vocab_size, D = cfg_.hidden;
  if (base) {
    base->resize(static_cast<size_t>(B * V));
    DSX_CUDA_CHECK(cudaMemcpyAsync(base->data(), ws_->logits, base->size() * 4, cudaMemcpyDeviceToHost, stream_));
  }
  std::vector<uint16_t> zb;
  if (z) {
    z->resize(static_cast<size_t>(B * D));
    if (act_ == Act::F32) {
      DSX_CUDA_CHECK(cudaMemcpyAsync(z->data(), ws_->h, z->size() * 4, cudaMemcpyDeviceToHost, stream_));
    } else {
      zb.resize(z->size());
      DSX_CUDA_CHECK(cudaMemcpyAsync(zb.data(), ws_->h, zb.size() * 2, cudaMemcpyDeviceToHost, stream_));
    }
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  for (size_t i = 0; i < zb.size(); ++i) (*z)[i] = bf16_to_f32(zb[i]);
}

std::vector<float> CudaDrafter::ring_row(const DrafterState& st, int s_, int64_t p) const {
  CudaDraftState& s = state_of(st);
  DSX_CHECK(s_ >= 0 && s_ < S_, "ring_row: stage ", s_, " outside the ", S_, " stages");
  flush(st);
  if (!s.held(p)) return {};
  const int hd = s.hd_;
  const int64_t slot = p % s.cap_;
  std::vector<uint8_t> codes(static_cast<size_t>(hd)), scales(static_cast<size_t>(hd / 32));
  const Fq8Rows& r = s.rings_[static_cast<size_t>(s_)];
  DSX_CUDA_CHECK(cudaMemcpy(codes.data(), r.codes + slot * hd, codes.size(), cudaMemcpyDeviceToHost));
  DSX_CUDA_CHECK(cudaMemcpy(scales.data(), r.scales + slot * (hd / 32), scales.size(), cudaMemcpyDeviceToHost));
  std::vector<float> out(static_cast<size_t>(hd));
  for (int i = 0; i < hd; ++i)
    out[static_cast<size_t>(i)] = e4m3_to_f32(codes[static_cast<size_t>(i)]) *
                                  std::ldexp(1.0f, static_cast<int>(scales[static_cast<size_t>(i / 32)]) - 127);
  return out;
}

}  // namespace dsx::cuda
