// Session: prefix sync with checkpoints, rollback to any position, streamed snapshots
// with a checked header, and the engine's session registry and budget (engine.h).
#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>

#include "runtime/engine.h"
#include "util/error.h"
#include "util/snapshot_io.h"

namespace dsx {

// ---- Engine ---------------------------------------------------------------------------
int64_t Engine::tap_width() const { return config().tap_width(); }

void Engine::check_budget(int64_t session_bytes, int64_t budget) const {
  if (budget <= 0) return;
  const int64_t used = static_cast<int64_t>(sessions_.size()) * session_bytes;  // (every session reserves the same)
  if (used + session_bytes > budget)
    fail("a new session needs ", session_bytes / 1e6, " MB of state but ", sessions_.size(), " sessions hold ",
         used / 1e6, " MB of the ", budget / 1e6, " MB budget (EngineOptions::state_budget, --ctx / --sessions)");
}

void Engine::check_step(const Step& s) const {
  const int64_t V = config().vocab_size;
  for (size_t i = 0; i < s.feeds.size(); ++i) {
    const Feed& f = s.feeds[i];
    DSX_CHECK(f.session && &f.session->engine() == this, "step: feed ", i, " has no session of this engine");
    DSX_CHECK(f.n > 0 && f.ids, "step: feed ", i, " has no tokens");
    for (size_t j = 0; j < i; ++j)
      DSX_CHECK(s.feeds[j].session != f.session, "step: feeds ", j, " and ", i, " are for the same session");
    for (int64_t t = 0; t < f.n; ++t)
      if (f.ids[t] < 0 || f.ids[t] >= V)
        fail("token id ", f.ids[t], " at position ", f.session->position() + t, " is outside the vocabulary (", V, ")");
    if (f.session->position() + f.n > f.session->capacity())
      fail("context of ", f.session->position() + f.n, " tokens exceeds the session's capacity of ",
           f.session->capacity(), " (EngineOptions::max_context)");
    if (f.taps && tap_width() == 0) fail("step: taps asked for, but the model has no dspark_target_layer_ids");
  }
}

void Engine::step(const Step& s) {
  if (s.feeds.empty()) return;
  check_step(s);
  run(s);
  for (const Feed& f : s.feeds) f.session->maybe_checkpoint();
}

// ---- Session ----------------------------------------------------------------------------
Session::Session(Engine& e, std::unique_ptr<Backend> b) : eng_(e), b_(std::move(b)) { eng_.sessions_.push_back(this); }

Session::~Session() {
  cps_.clear();
  b_.reset();
  auto& v = eng_.sessions_;
  v.erase(std::remove(v.begin(), v.end(), this), v.end());
}

void Session::feed(const int32_t* ids, int64_t n, float* logits, bool all_rows) {
  Step s;
  s.feeds.push_back(Feed{this, ids, n, logits, nullptr, nullptr});
  s.all_rows = all_rows;
  eng_.step(s);
}

int32_t Session::feed_greedy(const int32_t* ids, int64_t n) {
  int32_t pick = -1;
  Step s;
  s.feeds.push_back(Feed{this, ids, n, nullptr, nullptr, &pick});
  eng_.step(s);
  return pick;
}

int64_t Session::state_bytes() const {
  int64_t b = b_->state_bytes();
  for (const auto& c : cps_) b += c->bytes;
  return b;
}

std::vector<int64_t> Session::checkpoints() const {
  std::vector<int64_t> v;
  for (const auto& c : cps_) v.push_back(c->pos);
  return v;
}

void Session::take_checkpoint() {
  const int64_t p = position();
  drop_checkpoints_after(p - 1);  // (one at p is replaced)
  cps_.push_back(b_->checkpoint());
  const int keep = std::max(1, eng_.options().max_checkpoints);
  // Over the limit: drop the checkpoint whose removal leaves the smallest merged gap
  // (the newest one is always kept), so that the kept ones stay spread over the sequence.
  while (static_cast<int>(cps_.size()) > keep) {
    size_t drop = 0;
    int64_t best = INT64_MAX;
    for (size_t i = 0; i + 1 < cps_.size(); ++i) {
      const int64_t prev = i ? cps_[i - 1]->pos : 0;
      const int64_t gap = cps_[i + 1]->pos - prev;
      if (gap < best) best = gap, drop = i;
    }
    cps_.erase(cps_.begin() + static_cast<std::ptrdiff_t>(drop));
  }
}

void Session::checkpoint() { take_checkpoint(); }

int64_t Session::piece_end(int64_t q, int64_t n) const {
  const int64_t every = eng_.options().checkpoint_every;
  const int64_t last = cps_.empty() ? 0 : cps_.back()->pos;
  return every > 0 ? std::min(n, std::max(q + 1, last + every)) : n;
}

void Session::maybe_checkpoint() {
  const int64_t every = eng_.options().checkpoint_every;
  if (every <= 0) return;
  const int64_t last = cps_.empty() ? 0 : cps_.back()->pos;
  if (position() - last >= every) take_checkpoint();
}

void Session::drop_checkpoints_after(int64_t pos) {
  while (!cps_.empty() && cps_.back()->pos > pos) cps_.pop_back();
}

void Session::go_back(int64_t target, SyncResult* r) {
  const int64_t p = position();
  DSX_CHECK(target >= 0 && target <= p, "cannot roll back from position ", p, " to ", target);
  if (target == p) return;
  drop_checkpoints_after(target);
  if (p - target <= eng_.options().rollback_depth) {
    b_->rollback(target);
    return;
  }
  // Further back: the nearest checkpoint at or before the target (or the start), then a
  // replay of the history up to the target.
  const std::vector<int32_t> replay(tokens().begin(), tokens().begin() + target);
  int64_t from = 0;
  if (!cps_.empty()) {
    b_->restore(*cps_.back());
    from = cps_.back()->pos;
  } else {
    b_->reset();
  }
  if (r) {
    r->checkpoint = cps_.empty() ? -1 : from;
    r->reused = from;  // (the replayed tokens are computed again)
  }
  for (int64_t q = from; q < target;) {
    const int64_t end = piece_end(q, target);
    feed(replay.data() + q, end - q, nullptr, false);
    q = end;
  }
}

void Session::rollback(int64_t pos) { go_back(pos, nullptr); }

SyncResult Session::sync(const int32_t* ids, int64_t n, float* logits) {
  DSX_CHECK(n > 0, "sync: no tokens");
  const std::vector<int32_t>& have = tokens();
  int64_t c = 0;
  const int64_t lim = std::min<int64_t>(static_cast<int64_t>(have.size()), n);
  while (c < lim && have[static_cast<size_t>(c)] == ids[c]) ++c;
  // (with logits wanted, the last token is fed again: its logits are not kept)
  const int64_t keep = logits ? std::min(c, n - 1) : c;
  SyncResult r;
  r.reused = -1;
  if (keep < position()) go_back(keep, &r);
  if (r.reused < 0) r.reused = position();
  r.prefilled = n - r.reused;
  // prefill the rest, in pieces that end where a checkpoint is due
  for (int64_t q = position(); q < n;) {
    const int64_t end = piece_end(q, n);
    feed(ids + q, end - q, end == n ? logits : nullptr, false);
    q = end;
  }
  return r;
}

// ---- snapshots ------------------------------------------------------------------------------
namespace {

nlohmann::json geometry_json(const KVGeometry& g) {
  return {{"n_layers", g.n_layers},   {"window", g.window},   {"rollback_depth", g.rollback_depth},
          {"head_dim", g.head_dim},   {"idx_dim", g.idx_dim}, {"source_ratio", g.source_ratio}};
}

}  // namespace

void Session::save(ByteSink& out) const {
  const StateIdentity& id = eng_.state_identity();
  nlohmann::json h = {{"format", "dsx-session"},
                      {"model", id.model_id},
                      {"family", id.family},
                      {"encoding", id.compact ? "compact" : "f32"},
                      {"position", position()},
                      {"geometry", geometry_json(id.geometry)},
                      {"backend", eng_.backend_name()}};
  SnapshotWriter w(out, h.dump());
  b_->save(w);
  w.finish();
}

void Session::restore(ByteSource& in) {
  SnapshotReader r(in);
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(r.header());
  } catch (const std::exception&) {
    r.corrupt("header is not JSON");
  }
  const StateIdentity& id = eng_.state_identity();
  auto field = [&](const char* k) -> const nlohmann::json& {
    if (!h.is_object() || !h.contains(k)) r.corrupt(cat("header lacks '", k, "'"));
    return h[k];
  };
  if (field("format") != "dsx-session") r.corrupt("header format is not dsx-session");
  const std::string model = field("model").is_string() ? field("model").get<std::string>() : "";
  if (model != id.model_id)
    fail("session snapshot belongs to a different model (", model.substr(0, 16), "… vs ", id.model_id.substr(0, 16),
         "…)");
  if (field("family") != id.family || field("encoding") != (id.compact ? "compact" : "f32"))
    fail("session snapshot is of another model family or encoding (", field("family").dump(), ", ",
         field("encoding").dump(), ")");
  if (field("geometry") != geometry_json(id.geometry))
    fail("session snapshot has a different state geometry (", field("geometry").dump(), " vs ",
         geometry_json(id.geometry).dump(), "): another rollback depth or model shape");
  if (!field("position").is_number_integer()) r.corrupt("position is not an integer");
  const int64_t pos = field("position").get<int64_t>();
  if (pos < 0) r.corrupt(cat("position ", pos));
  if (pos > capacity()) fail("snapshot of ", pos, " tokens exceeds this session's capacity of ", capacity());
  cps_.clear();
  b_->restore(r, pos);
}

std::vector<uint8_t> Session::save() const {
  VectorSink s;
  save(s);
  return std::move(s.bytes);
}

void Session::restore(const std::vector<uint8_t>& bytes) {
  SpanSource s(bytes);
  restore(s);
}

// ---- backends -----------------------------------------------------------------------------
namespace {
std::map<std::string, EngineFactory>& factories() {
  static std::map<std::string, EngineFactory> f;
  return f;
}
EngramMapProvider& engram_provider() {
  static EngramMapProvider p;
  return p;
}
}  // namespace

void register_engine_backend(const std::string& name, EngineFactory f) { factories()[name] = std::move(f); }
void register_engram_map_provider(EngramMapProvider f) { engram_provider() = std::move(f); }

std::vector<int32_t> load_engram_token_map(const std::string& dir, const ModelConfig& cfg) {
  if (cfg.engram_layers.empty()) return {};
  DSX_CHECK(engram_provider(), "no Engram token map provider is linked in (the text layer registers it)");
  return engram_provider()(dir, cfg);
}

std::unique_ptr<Engine> load_engine(const std::string& dir, const EngineOptions& opts) {
  auto it = factories().find(opts.backend);
  if (it == factories().end()) {
    std::string names;
    for (const auto& [k, v] : factories()) names += (names.empty() ? "" : ", ") + k;
    fail("backend '", opts.backend, "' is not available in this build (", names, ")");
  }
  return it->second(dir, opts);
}

}  // namespace dsx
