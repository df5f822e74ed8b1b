#include "backend/cuda/runner.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>

#include "backend/cuda/step_kernels.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/gemv.h"
#include "model/kv_formats.h"
#include "util/error.h"
#include "util/snapshot_io.h"
#include "util/switches.h"

namespace dsx::cuda {

Act parse_precision(const std::string& p) {
  if (p == "fp32") return Act::F32;
  if (p == "bf16") return Act::BF16;
  fail("unknown precision '", p, "' (fp32 or bf16)");
}

namespace {

// Ring-slot bytes a one-row step writes in layers [0, l1) (DeviceKVCache::slot_stash_bytes).
int64_t stash_bytes(const KVGeometry& g, int l1) {
  int64_t n = 0;
  for (int l = 0; l < l1; ++l) n += g.head_dim + g.head_dim / 32 + (g.proj_cap(l) > 0 ? 2 * g.head_dim * 4 : 0);
  return n;
}

}  // namespace

Runner::Runner(std::unique_ptr<DeviceModel> m, int64_t max_ctx, int rollback_depth)
    : m_(std::move(m)), geom_(KVGeometry::of(m_->cfg, rollback_depth)), max_ctx_(max_ctx) {
  const ModelConfig& c = m_->cfg;
  if (!sw::get_str(sw::Id::TRACE).empty() && !trace_enable())
    std::fprintf(stderr, "# DSX_TRACE: this build records no kernel timeline (configure with -DDSX_KERNEL_TRACE=ON)\n");
  if (!c.engram_layers.empty() && sw::on(sw::Id::ENGRAM_OVERLAP))
    split_layer_ = *std::min_element(c.engram_layers.begin(), c.engram_layers.end());
  // rows per pass (DSX_PREFILL_CHUNK, 64 .. 4096). 2048: the routed experts' weights are
  // streamed once per pass, so larger passes prefill faster (H200, 8 synthetic layers:
  // 1296 / 1938 / 2620 tok/s at 256 / 1024 / 2048); the shared scratch grows with it.
  const int rows = static_cast<int>(std::clamp<int64_t>(sw::get_int(sw::Id::PREFILL_CHUNK), 64, 4096));
  s_ = std::make_unique<Streams>();
  w_ = std::make_unique<Workspace>(*m_, rows, max_ctx_, stash_bytes(geom_, split_layer_));
  fwd_ = std::make_unique<Forward>(*m_, *w_, *s_, prof_);
  graph_timing_ = sw::on(sw::Id::GRAPH_TIMING);
}

Runner::~Runner() {
  if (s_) cudaStreamSynchronize(s_->main);  // (a step run ahead may still be running)
  const std::string tp = sw::get_str(sw::Id::TRACE);
  if (!tp.empty()) trace_dump(tp.c_str());
  if (graph_timing_ && graph_runs_ > 0)
    std::fprintf(stderr, "# DSX_GRAPH_TIMING: %d decode steps, graph %.3f ms/step on the device, %.3f ms/step wall\n",
                 graph_runs_, graph_ms_ / graph_runs_, step_wall_ms_ / graph_runs_);
  if (graph_timing_)
    for (const auto& [rows, t] : graph_ms_by_rows_)
      std::fprintf(stderr, "# DSX_GRAPH_TIMING: passes of %d rows: %d replayed, %.3f ms each on the device\n", rows,
                   t.second, t.first / t.second);
  graphs_.clear();
}

int64_t Runner::session_device_bytes() const { return device_state_bytes(geom_, max_ctx_); }

int64_t Runner::fixed_bytes() const {
  int64_t n = 0;
  for (int l = 0; l < geom_.n_layers; ++l)
    n += geom_.window_cap() * fq8_row_bytes(geom_.head_dim) + 2 * int64_t{geom_.proj_cap(l)} * geom_.head_dim * 4;
  return n;
}

std::unique_ptr<DeviceSession> Runner::new_session() {
  auto s = std::make_unique<DeviceSession>();
  s->id = next_id_++;
  s->cache = std::make_unique<DeviceKVCache>(geom_, max_ctx_);
  live_.push_back(s.get());
  return s;
}

void Runner::release(DeviceSession& s) {
  if (ahead_.session == &s) drop_ahead();
  if (stashed_session_ == &s) stashed_session_ = nullptr, stashed_pos_ = -1;
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  graphs_.drop_session(s.id);
  live_.erase(std::remove(live_.begin(), live_.end(), &s), live_.end());
}

int64_t Runner::decode_graph_ctx(int64_t ctx) const {
  int64_t b = std::max<int64_t>(1, sw::get_int(sw::Id::GRAPH_MIN_CTX));
  while (b < ctx) b *= 2;
  return std::min(b, max_ctx_);
}

// ---- inputs --------------------------------------------------------------------------
// Engram row ids of every row (host hashing of each session's token history, spec
// §3.2.2) and, for tables kept on the host, the gathered rows; copies on st.
void Runner::stage_engram(const Pass& p, const std::vector<const int32_t*>& ids, cudaStream_t st) {
  const EngramLayout& E = m_->engram;
  if (E.n_layers == 0) return;
  const ModelConfig& c = m_->cfg;
  const int nl = E.n_layers, nc = E.n_cols, T = p.T;
  const int64_t n = static_cast<int64_t>(T) * nc, ed = c.engram_head_dim;
  int64_t* rows = w_->h_engram_rows.data();  // [layer][row][col]
  std::vector<int32_t> hist;
  for (size_t i = 0; i < p.segs.size(); ++i) {
    const Segment& sg = p.segs[i];
    const DeviceSession& s = *sg.s;
    const int64_t p0 = s.pos, back = E.max_ngram - 1, h0 = std::max<int64_t>(0, p0 - back);
    hist.clear();
    for (int64_t q = h0; q < p0 + sg.n; ++q) {
      const int32_t raw = q < p0 ? s.tokens[static_cast<size_t>(q)] : ids[i][q - p0];
      hist.push_back(m_->cmap[static_cast<size_t>(raw)]);
    }
    for (int li = 0; li < nl; ++li)
      for (int t = 0; t < sg.n; ++t)
        E.row_ids(li, hist.data(), h0, p0 + t, rows + li * n + static_cast<int64_t>(sg.r0 + t) * nc);
  }
  DSX_CUDA_CHECK(cudaMemcpyAsync(w_->d_engram_ids, rows, static_cast<size_t>(nl * n) * 8, cudaMemcpyHostToDevice, st));
  for (int li = 0; li < nl; ++li) {
    const DevLayer& L = m_->layers[static_cast<size_t>(c.engram_layers[static_cast<size_t>(li)])];
    if (L.engram_table) continue;
    // gather this layer's rows on the host (the release tables stay memory-mapped)
    uint8_t* codes = w_->engram_host_stage.data() + li * n * (ed + ed / 32);
    uint8_t* scales = codes + n * ed;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[li * n + i] % L.engram_rows;
      std::memcpy(codes + i * ed, L.engram_host_table + r * ed, static_cast<size_t>(ed));
      std::memcpy(scales + i * (ed / 32), L.engram_host_scale + r * (ed / 32), static_cast<size_t>(ed / 32));
    }
    DSX_CUDA_CHECK(cudaMemcpyAsync(w_->engram_stage + li * n * ed, codes, static_cast<size_t>(n * ed),
                                   cudaMemcpyHostToDevice, st));
    DSX_CUDA_CHECK(cudaMemcpyAsync(w_->engram_stage_scale + li * n * (ed / 32), scales, static_cast<size_t>(n * ed / 32),
                                   cudaMemcpyHostToDevice, st));
  }
  // (the pinned staging buffers are rewritten by the next pass, which first waits for
  // this one: run_pass synchronises before staging)
}

// ---- graphs --------------------------------------------------------------------------------
GraphKey Runner::key_of(const Pass& p) const {
  GraphKey k;
  for (const Segment& sg : p.segs) {
    k.sessions.push_back(sg.s->id);
    k.rows.push_back(sg.n);
    k.bounds.push_back(sg.ctx_bound);
    k.heads.push_back(sg.head);
  }
  k.head = static_cast<int>(p.head);
  k.pick = p.pick, k.pick_in_head = p.pick_in_head, k.taps = p.taps;
  return k;
}

cudaGraphExec_t Runner::capture_part(const Pass& p, int l0, int l1) {
  Pass part = p;
  part.l0 = l0, part.l1 = l1;
  cudaGraph_t g = nullptr;
  DSX_CUDA_CHECK(cudaStreamBeginCapture(s_->main, cudaStreamCaptureModeThreadLocal));
  try {
    fwd_->run(part);
  } catch (...) {
    cudaStreamEndCapture(s_->main, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  DSX_CUDA_CHECK(cudaStreamEndCapture(s_->main, &g));
  cudaGraphExec_t e = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&e, g, s_->side_prio ? cudaGraphInstantiateFlagUseNodePriority : 0);
  cudaGraphDestroy(g);
  DSX_CUDA_CHECK(err);
  return e;
}

// The pass's layers as graphs: [0, split) and [split, n_layers) when the host gathers
// Engram rows meanwhile, else one. A graph that ends with a one-row head also picks
// the greedy id (Pass::pick_in_head).
void Runner::capture(GraphEntry& e, const Pass& p) {
  if (p.pick_in_head) {
    gemv_pick_reserve(w_->d_ids, s_->main);
    argmax_reserve(w_->d_ids, s_->main);  // (in case the head runs another path)
  }
  if (p.pick) argmax_reserve(w_->d_pick, s_->main);
  const int L = m_->cfg.n_layers, split = split_layer_ < L ? split_layer_ : 0;
  if (split > 0) e.a = capture_part(p, 0, split);
  e.b = capture_part(p, split, L);
}

void Runner::run_pass(Pass& p, const std::vector<const int32_t*>& ids, bool decode_sized) {
  // the pinned input buffers may still be read by the previous pass's copies
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  for (size_t i = 0; i < p.segs.size(); ++i)
    std::memcpy(w_->h_ids.data() + p.segs[i].r0, ids[i], static_cast<size_t>(p.segs[i].n) * 4);
  DSX_CUDA_CHECK(cudaMemcpyAsync(w_->d_ids, w_->h_ids.data(), static_cast<size_t>(p.T) * 4, cudaMemcpyHostToDevice,
                                 s_->main));
  GraphEntry* e = nullptr;
  if (decode_sized && !prof_.on()) {
    e = &graphs_.at(key_of(p));
    if (!e->captured() && e->eager_runs >= 1) capture(*e, p);
  }
  if (e && e->captured()) {
    if (graph_timing_) DSX_CUDA_CHECK(cudaEventRecord(s_->gt0, s_->main));
    if (e->a) {
      // the layers before the first Engram layer run while the host gathers its rows
      DSX_CUDA_CHECK(cudaGraphLaunch(e->a, s_->main));
      stage_engram(p, ids, s_->copy);
      DSX_CUDA_CHECK(cudaEventRecord(s_->ev_engram, s_->copy));
      DSX_CUDA_CHECK(cudaStreamWaitEvent(s_->main, s_->ev_engram, 0));
    } else {
      stage_engram(p, ids, s_->main);
    }
    DSX_CUDA_CHECK(cudaGraphLaunch(e->b, s_->main));
    if (graph_timing_) {
      DSX_CUDA_CHECK(cudaEventRecord(s_->gt1, s_->main));
      timing_pending_ = true;
      timing_rows_ = p.T;
    }
  } else {
    stage_engram(p, ids, s_->main);
    fwd_->run(p);
    if (e) ++e->eager_runs;
  }
}

// ---- steps -----------------------------------------------------------------------------------
void Runner::step(const std::vector<SegmentFeed>& feeds, bool all_rows) {
  if (feeds.empty()) return;
  const ModelConfig& c = m_->cfg;
  const int64_t V = c.vocab_size, W = c.tap_width();
  for (const SegmentFeed& f : feeds) {
    DSX_CHECK(f.n > 0 && f.s->pos + f.n <= max_ctx_, "context of ", f.s->pos + f.n,
              " tokens exceeds the session's capacity of ", max_ctx_);
    DSX_CHECK(!f.taps || W > 0, "taps: the model has no DSpark target layers");
  }
  const SegmentFeed& f0 = feeds[0];
  if (feeds.size() == 1 && f0.n == 1 && f0.pick && !f0.logits && !f0.taps && !f0.picks && !all_rows) {
    greedy_one(*f0.s, f0.ids[0], f0.pick);
    return;
  }
  drop_ahead();
  // every row through the head: all-row logits or per-row picks asked for
  bool every_row = false;
  for (const SegmentFeed& f : feeds) every_row |= (all_rows && f.logits) || f.picks;
  const int R = w_->max_rows;
  std::vector<int64_t> done(feeds.size(), 0);
  size_t first = 0;  // the first feed with rows left
  while (first < feeds.size()) {
    Pass p;
    p.head = every_row ? Pass::Head::All : Pass::Head::Last;
    std::vector<const int32_t*> ids;
    std::vector<size_t> src;  // feed of each segment
    for (size_t i = first; i < feeds.size() && p.T < R; ++i) {
      const SegmentFeed& f = feeds[i];
      const int k = static_cast<int>(std::min<int64_t>(f.n - done[i], R - p.T));
      Segment sg;
      sg.s = f.s;
      sg.r0 = p.T;
      sg.n = k;
      const bool last = done[i] + k == f.n;
      sg.head = (every_row && (f.logits || f.picks || f.pick)) || (last && (f.logits || f.pick));
      p.pick |= (last && f.pick) || f.picks;
      p.taps |= f.taps != nullptr;
      p.segs.push_back(sg);
      ids.push_back(f.ids + done[i]);
      src.push_back(i);
      p.T += k;
    }
    bool any_head = false;
    for (const Segment& sg : p.segs) any_head |= sg.head;
    if (!any_head) p.head = Pass::Head::None, p.pick = false;
    const bool decode_sized = p.T <= kGemvMaxT;
    for (size_t i = 0; i < p.segs.size(); ++i) {
      Segment& sg = p.segs[i];
      const int64_t end = feeds[src[i]].s->pos + sg.n;
      sg.ctx_bound = decode_sized ? decode_graph_ctx(end) : end;
    }
    p.pick_in_head = p.head == Pass::Head::Last && p.T == 1 && p.segs[0].head;
    if (p.pick_in_head) p.pick = false;  // (the head's product picks: the same graph as a greedy step's)
    run_pass(p, ids, decode_sized);
    // outputs: the logits row of a segment's row t (Head::All: the pass row; Head::Last:
    // the k-th head segment's last row)
    std::vector<float*> pinned_rows;  // (Head::Last rows staged in pinned memory)
    auto copy_rows = [&](float* dst, int64_t from, int64_t n) {
      DSX_CUDA_CHECK(cudaMemcpyAsync(dst, w_->logits + from * V, static_cast<size_t>(n * V) * 4, cudaMemcpyDeviceToHost,
                                     s_->main));
    };
    int hk = 0;
    for (size_t i = 0; i < p.segs.size(); ++i) {
      const Segment& sg = p.segs[i];
      const SegmentFeed& f = feeds[src[i]];
      const int64_t off = done[src[i]];
      if (f.taps)
        DSX_CUDA_CHECK(cudaMemcpyAsync(f.taps + off * W, w_->taps + static_cast<int64_t>(sg.r0) * W,
                                       static_cast<size_t>(sg.n * W) * 4, cudaMemcpyDeviceToHost, s_->main));
      if (p.head == Pass::Head::Last && sg.head) {
        if (f.logits) copy_rows(hk < kGemvMaxT ? w_->h_logits.data() + hk * V : f.logits, hk, 1);
        ++hk;
      }
      if (p.head == Pass::Head::All && p.T <= kHeadRows && f.logits && sg.head) {
        if (all_rows)
          copy_rows(f.logits + off * V, sg.r0, sg.n);
        else if (off + sg.n == f.n)
          copy_rows(f.logits, sg.r0 + sg.n - 1, 1);
      }
    }
    if (p.head == Pass::Head::All && p.T > kHeadRows) {
      for (int b = 0; b < p.T; b += kHeadRows) {
        const int nb = std::min(kHeadRows, p.T - b);
        fwd_->head_rows(b, nb);
        if (p.pick) argmax_rows(w_->logits, V, nb, V, w_->d_pick + b, s_->main, w_->h_pick.data() + b);
        for (size_t i = 0; i < p.segs.size(); ++i) {
          const Segment& sg = p.segs[i];
          const SegmentFeed& f = feeds[src[i]];
          int lo = std::max(b, sg.r0);
          const int hi = std::min(b + nb, sg.r0 + sg.n);
          if (!f.logits || !sg.head || lo >= hi) continue;
          if (!all_rows) {  // (only the feed's last row)
            if (done[src[i]] + sg.n != f.n || hi != sg.r0 + sg.n) continue;
            lo = hi - 1;
          }
          float* dst = f.logits + (all_rows ? (done[src[i]] + lo - sg.r0) * V : 0);
          DSX_CUDA_CHECK(cudaMemcpyAsync(dst, w_->logits + (lo - b) * V, static_cast<size_t>((hi - lo) * V) * 4,
                                         cudaMemcpyDeviceToHost, s_->main));
        }
        DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));  // (the next block rewrites the logits)
      }
    }
    DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
    hk = 0;
    const int32_t* hp = w_->h_pick.data();
    for (size_t i = 0; i < p.segs.size(); ++i) {
      const Segment& sg = p.segs[i];
      const SegmentFeed& f = feeds[src[i]];
      const int64_t off = done[src[i]];
      const bool last = off + sg.n == f.n;
      if (p.head == Pass::Head::Last && sg.head) {
        if (f.logits && hk < kGemvMaxT) std::memcpy(f.logits, w_->h_logits.data() + hk * V, static_cast<size_t>(V) * 4);
        if (f.pick && last) *f.pick = hp[p.pick_in_head ? 0 : hk];
        ++hk;
      }
      if (p.head == Pass::Head::All && sg.head) {
        if (f.pick && last) *f.pick = hp[sg.r0 + sg.n - 1];
        if (f.picks) std::copy(hp + sg.r0, hp + sg.r0 + sg.n, f.picks + off);
      }
      DeviceSession& s = *f.s;
      s.tokens.insert(s.tokens.end(), ids[i], ids[i] + sg.n);
      s.pos += sg.n;
      done[src[i]] += sg.n;
    }
    while (first < feeds.size() && done[first] == feeds[first].n) ++first;
  }
  note_graph_time();
}

void Runner::note_graph_time() {
  if (!timing_pending_) return;
  timing_pending_ = false;
  float ms = 0;
  DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, s_->gt0, s_->gt1));
  auto& [by_ms, by_n] = graph_ms_by_rows_[timing_rows_];
  by_ms += ms;
  ++by_n;
  if (timing_rows_ != 1) return;  // (the totals: one-row decode steps, against their wall time)
  graph_ms_ += ms;
  ++graph_runs_;
}

// One greedy row of one session: the decode graph picks the id on the device (also the
// next step's input), and the next step's first graph is launched on it before the host
// reads the id (run_ahead).
void Runner::greedy_one(DeviceSession& s, int32_t id, int32_t* pick) {
  const auto wall0 = std::chrono::steady_clock::now();
  if (ahead_.session == &s && ahead_.pos == s.pos && ahead_.id == id && graphs_.find(ahead_.key)) {
    continue_ahead(s, id);
  } else {
    drop_ahead();
    Pass p;
    Segment sg;
    sg.s = &s;
    sg.n = 1;
    sg.head = true;
    sg.ctx_bound = decode_graph_ctx(s.pos + 1);
    p.segs.push_back(sg);
    p.T = 1;
    p.head = Pass::Head::Last;
    p.pick_in_head = true;
    run_pass(p, {&id}, true);
    s.tokens.push_back(id);
    ++s.pos;
  }
  DSX_CUDA_CHECK(cudaEventRecord(s_->ev_pick, s_->main));
  run_ahead(s);
  DSX_CUDA_CHECK(cudaEventSynchronize(s_->ev_pick));
  *pick = w_->h_pick.data()[0];
  if (ahead_.session) ahead_.id = *pick;
  if (timing_pending_) {
    note_graph_time();
    step_wall_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall0).count();
  }
}

// After a greedy step's pick (enqueued, not yet read): the next step's first graph on
// the pick, when captured graphs serve that step. The ring slots it is about to write
// are in the stash already (continue_ahead copied them on the copy stream) or are
// stashed now (a tiny copy on the session stream, before it).
void Runner::run_ahead(DeviceSession& s) {
  if (!sw::on(sw::Id::RUN_AHEAD) || split_layer_ <= 0 || prof_.on() || s.pos + 1 > max_ctx_) return;
  Pass p;
  Segment sg;
  sg.s = &s;
  sg.n = 1;
  sg.head = true;
  sg.ctx_bound = decode_graph_ctx(s.pos + 1);
  p.segs.push_back(sg);
  p.T = 1;
  p.pick_in_head = true;
  const GraphKey k = key_of(p);
  GraphEntry* e = graphs_.find(k);
  if (!e || !e->captured() || !e->a) return;
  if (stashed_session_ != &s || stashed_pos_ != s.pos) s.cache->stash_slots(split_layer_, s.pos, w_->ahead_stash, s_->main);
  stashed_session_ = &s;
  stashed_pos_ = s.pos;
  if (graph_timing_) DSX_CUDA_CHECK(cudaEventRecord(s_->gt0_ahead, s_->main));
  DSX_CUDA_CHECK(cudaGraphLaunch(e->a, s_->main));
  ahead_.session = &s;
  ahead_.pos = s.pos;
  ahead_.id = -1;  // (set once the host has read the pick)
  ahead_.key = k;
}

// The step at s.pos with id, whose first graph runs already: the Engram rows of the
// history, then the rest of the step (as run_pass does after the first graph).
void Runner::continue_ahead(DeviceSession& s, int32_t id) {
  GraphEntry* e = graphs_.find(ahead_.key);
  Pass p;
  Segment sg;
  sg.s = &s;
  sg.n = 1;
  sg.head = true;
  p.segs.push_back(sg);
  p.T = 1;
  ahead_.session = nullptr;
  if (graph_timing_) std::swap(s_->gt0, s_->gt0_ahead);
  // the next position's slots (nothing pending writes them: the first graph writes this
  // position's, the second only layers from split_layer_ on)
  stashed_session_ = nullptr, stashed_pos_ = -1;
  if (s.pos + 2 <= max_ctx_) {
    Pass q = p;
    q.segs[0].ctx_bound = decode_graph_ctx(s.pos + 2);
    q.pick_in_head = true;
    if (GraphEntry* n = graphs_.find(key_of(q)); n && n->captured()) {
      s.cache->stash_slots(split_layer_, s.pos + 1, w_->ahead_stash, s_->copy);
      stashed_session_ = &s, stashed_pos_ = s.pos + 1;
    }
  }
  stage_engram(p, {&id}, s_->copy);
  DSX_CUDA_CHECK(cudaEventRecord(s_->ev_engram, s_->copy));
  DSX_CUDA_CHECK(cudaStreamWaitEvent(s_->main, s_->ev_engram, 0));
  DSX_CUDA_CHECK(cudaGraphLaunch(e->b, s_->main));
  if (graph_timing_) {
    DSX_CUDA_CHECK(cudaEventRecord(s_->gt1, s_->main));
    timing_pending_ = true;
    timing_rows_ = 1;
  }
  ++s.pos;
  s.tokens.push_back(id);
}

// Before anything but a step continued from the run-ahead: a step run ahead will not go
// on, so its ring slots go back as they were (ordered after it on the session stream; the
// device position never moved, the first graph does not advance it, and anything else
// it wrote is scratch or lies past the cache's row counts); and the stash is forgotten
// (what runs next may write the slots it holds).
void Runner::drop_ahead() {
  if (ahead_.session) {
    ahead_.session->cache->unstash_slots(split_layer_, ahead_.pos, w_->ahead_stash, s_->main);
    ahead_.session = nullptr;
    DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  }
  stashed_session_ = nullptr;
  stashed_pos_ = -1;
}

// ---- state operations ---------------------------------------------------------------------
void Runner::rollback(DeviceSession& s, int64_t p) {
  DSX_CHECK(p >= 0 && p <= s.pos && s.pos - p <= geom_.rollback_depth, "cannot roll back from position ", s.pos,
            " to ", p, " (at most ", geom_.rollback_depth, " tokens)");
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  s.cache->set_position(p, s_->main);
  s.pos = p;
  s.tokens.resize(static_cast<size_t>(p));
}

void Runner::reset(DeviceSession& s) {
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  s.cache->set_position(0, s_->main);
  s.pos = 0;
  s.tokens.clear();
}

void Runner::save(const DeviceSession& s, SnapshotWriter& w) {
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  w.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, s.tokens.size() * 4);
  w.write(s.tokens.data(), s.tokens.size() * 4);
  s.cache->save(w, s.pos, w_->stage.data(), w_->stage.size(), s_->main);
}

void Runner::restore(DeviceSession& s, SnapshotReader& r, int64_t pos) {
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  std::vector<int32_t> tokens(static_cast<size_t>(pos));
  try {
    r.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, tokens.size() * 4, "token history");
    r.read(tokens.data(), tokens.size() * 4);
    s.cache->restore(r, pos, w_->stage.data(), w_->stage.size(), s_->main);
    r.finish();
  } catch (const Error& e) {
    reset(s);
    fail(e.what(), " (the session was reset to empty)");
  }
  s.pos = pos;
  s.tokens = std::move(tokens);
}

Runner::Checkpoint Runner::checkpoint(const DeviceSession& s) {
  drop_ahead();
  Checkpoint c;
  c.pos = s.pos;
  c.fixed.alloc(static_cast<size_t>(std::max<int64_t>(1, fixed_bytes())));
  int64_t off = 0;
  for (const auto& [p, n] : s.cache->fixed_spans()) {
    DSX_CUDA_CHECK(cudaMemcpyAsync(c.fixed.as<uint8_t>() + off, p, static_cast<size_t>(n), cudaMemcpyDeviceToDevice,
                                   s_->main));
    off += n;
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(s_->main));
  return c;
}

void Runner::restore(DeviceSession& s, const Checkpoint& c) {
  DSX_CHECK(c.pos <= s.pos, "checkpoint at ", c.pos, " is past the session's position ", s.pos);
  drop_ahead();
  int64_t off = 0;
  for (const auto& [p, n] : s.cache->fixed_spans()) {
    DSX_CUDA_CHECK(cudaMemcpyAsync(p, c.fixed.as<uint8_t>() + off, static_cast<size_t>(n), cudaMemcpyDeviceToDevice,
                                   s_->main));
    off += n;
  }
  s.cache->set_position(c.pos, s_->main);  // (synchronises)
  s.pos = c.pos;
  s.tokens.resize(static_cast<size_t>(c.pos));
}

void Runner::synthetic_fill(DeviceSession& s, int64_t n, uint64_t seed) {
  DSX_CHECK(s.pos + n <= max_ctx_, "synthetic_fill: ", s.pos + n, " tokens exceed the capacity of ", max_ctx_);
  drop_ahead();
  const KVGeometry& g = geom_;
  const int64_t hd = g.head_dim, id = g.idx_dim, end = s.pos + n;
  uint64_t k = seed;
  cudaStream_t st = s_->main;
  for (int l = 0; l < g.n_layers; ++l) {
    const Fq8Rows w = s.cache->window(l);
    fill_random(w.codes, g.window_cap() * hd, 0, ++k, 0, 0, 0, 0, st);
    fill_random(w.scales, g.window_cap() * hd / 32, 2, ++k, 0, 0, 120, 1, st);
    if (g.source_ratio[static_cast<size_t>(l)] == 0) continue;
    const int64_t rows = end / g.source_ratio[static_cast<size_t>(l)];
    const Fq4e4Rows c = s.cache->compressed(l);
    fill_random(c.packed, rows * hd / 2, 1, ++k, 0, 0, 0, 0, st);
    fill_random(c.scales, rows * hd / 16, 2, ++k, 0, 0, 0x30, 1, st);  // positive e4m3 scales
    const Fq4e8Rows key = s.cache->keys(l);
    fill_random(key.packed, rows * id / 2, 1, ++k, 0, 0, 0, 0, st);
    fill_random(key.scales, rows * id / 32, 2, ++k, 0, 0, 120, 1, st);
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(st));
  s.cache->set_position(end, st);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int32_t V = static_cast<int32_t>(m_->cfg.vocab_size);
  for (int64_t i = 0; i < n; ++i) s.tokens.push_back(3 + static_cast<int32_t>(rng() % static_cast<uint32_t>(V - 3)));
  s.pos = end;
}

RunnerStats Runner::stats() {
  RunnerStats r;
  r.weight_bytes = m_->weight_bytes;
  r.decode_weight_bytes = m_->decode_weight_bytes;
  r.workspace_bytes = w_->bytes;
  // device-to-device copy bandwidth (read + write counted once each)
  const size_t n = size_t{1} << 30;
  DeviceBuffer a(n), b(n);
  cudaEvent_t e0, e1;
  DSX_CUDA_CHECK(cudaEventCreate(&e0));
  DSX_CUDA_CHECK(cudaEventCreate(&e1));
  DSX_CUDA_CHECK(cudaMemcpy(b.get(), a.get(), n, cudaMemcpyDeviceToDevice));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    DSX_CUDA_CHECK(cudaEventRecord(e0));
    DSX_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice));
    DSX_CUDA_CHECK(cudaEventRecord(e1));
    DSX_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  r.copy_bandwidth_gb_s = 2.0 * n / (best * 1e-3) / 1e9;
  return r;
}

}  // namespace dsx::cuda
