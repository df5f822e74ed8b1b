#include "server/scheduler.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "server/byte_prefix.h"
#include "server/signing.h"
#include "text/chat.h"
#include "util/error.h"

namespace dsx::server {

using Clock = std::chrono::steady_clock;

namespace {
double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

int64_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b, int64_t lim) {
  int64_t n = 0;
  const int64_t m = std::min<int64_t>({static_cast<int64_t>(a.size()), static_cast<int64_t>(b.size()), lim});
  while (n < m && a[static_cast<size_t>(n)] == b[static_cast<size_t>(n)]) ++n;
  return n;
}
}  // namespace

struct Scheduler::Slot {
  std::unique_ptr<Session> s;
  bool busy = false;
  uint64_t last_use = 0;
  std::string hint;
  // positions of the session's current history whose state is on disk (saved or
  // restored from); the end of its last prefill (a checkpoint there), -1: none
  std::vector<int64_t> saved;
  int64_t prompt_end = -1;
  // DSpark: the drafter's rings of this session's history (SchedulerOptions::drafter)
  std::unique_ptr<DSparkContext> ctx;
  bool is_saved(int64_t p) const { return std::find(saved.begin(), saved.end(), p) != saved.end(); }
  // the history beyond p changed (went back to p)
  void forget_after(int64_t p) {
    saved.erase(std::remove_if(saved.begin(), saved.end(), [p](int64_t x) { return x > p; }), saved.end());
    if (prompt_end > p) prompt_end = -1;
  }
};

struct Scheduler::Active {
  std::shared_ptr<Job> job;
  Slot* slot = nullptr;
  bool decoding = false, done = false, started = false;
  int32_t anchor = -1;
  // the disk cache: the admission's lookup, the prefill's save points (ascending), the
  // tokens restored from disk and how long that took
  std::optional<CacheHit> hit;
  std::vector<std::pair<int64_t, SaveReason>> saves;
  size_t next_save = 0;
  int64_t restored = 0;
  double restore_seconds = 0;
  // the session's previous prompt end and what of its tokens the prompt kept (the log's
  // measure of how often clients edit earlier parts of a conversation); -1: none
  int64_t prev_prompt = -1, prev_common = -1;
  bool in_tool_call = false;
  int64_t generated = 0, reasoning_tokens = 0;
  bool in_reasoning = false;
  Usage usage;
  std::unique_ptr<text::DsmlParser> parser;
  std::unique_ptr<Sampler> sampler;
  std::vector<float> logits;
  // DSpark: this job's cycle (its own generator, seeded by its sampling seed), whether
  // this step verifies its block, the tokens of the block, and its counters
  std::unique_ptr<DSparkCycle> cycle;
  bool block = false;
  std::vector<int32_t> block_tokens;
  int64_t dspark_cycles = 0, dspark_accepted = 0, dspark_tokens = 0;
  Clock::time_point admitted, prefill_done, last_keepalive;
};

Scheduler::Scheduler(Engine& eng, const text::Tokenizer& tok, SchedulerOptions o) : eng_(eng), tok_(tok), o_(o) {
  DSX_CHECK(o_.max_sessions >= 1, "the server needs at least one session");
  if (o_.drafter)
    DSX_CHECK(o_.drafter->tap_width() == eng_.tap_width() && o_.drafter->vocab_size() == eng_.config().vocab_size,
              "DSpark: the drafter's taps (", o_.drafter->tap_width(), ") or vocabulary do not match the engine's (",
              eng_.tap_width(), "): another model?");
  auto single = [&](const char* marker) {
    const std::vector<int32_t> ids = tok_.encode(marker, true);
    return ids.size() == 1 ? ids[0] : -1;
  };
  user_id_ = single(text::tok::kUser);
  assistant_id_ = single(text::tok::kAssistant);
  stats_.footprint = eng_.footprint();
  worker_ = std::thread([this] { loop(); });
}

void Scheduler::log_line(const std::string& line) const {
  if (o_.log) {
    o_.log(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
  }
}

std::string persistent_secret(const std::string& dir) {
  const std::string path = dir + "/serve-secret";
  {
    std::ifstream in(path, std::ios::binary);
    std::string s;
    if (in && std::getline(in, s) && s.size() == 64 &&
        std::all_of(s.begin(), s.end(), [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); }))
      return s;
  }
  const std::string secret = new_secret();
  const std::string tmp = cat(path, ".tmp.", ::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail("cannot create ", tmp, ": ", std::strerror(errno));
  const std::string line = secret + "\n";
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    fail("cannot write ", path, ": ", std::strerror(errno));
  }
  return secret;
}

Scheduler::~Scheduler() { shutdown(); }

bool Scheduler::submit(std::shared_ptr<Job> job) {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_ || queue_.size() >= o_.max_queue) return false;
  queue_.push_back(std::move(job));
  ++stats_.requests;
  cv_.notify_all();
  return true;
}

void Scheduler::shutdown() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
  if (o_.cache) o_.cache->flush();  // (the shutdown saves are written before the worker stops)
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  SchedulerStats s = stats_;
  s.queue_depth = static_cast<int64_t>(queue_.size());
  s.active = static_cast<int64_t>(active_.size());
  s.sessions = static_cast<int64_t>(slots_.size());
  return s;
}

// What a resident session keeps of a prompt without computing it again: the common
// prefix when the session can go back to it directly (the rollback depth), else its
// nearest checkpoint at or before it (Session::sync replays the rest).
int64_t Scheduler::live_reuse(const Slot& sl, const std::vector<int32_t>& prompt, int64_t goal) const {
  return live_reuse(sl, common_prefix(sl.s->tokens(), prompt, goal));
}

int64_t Scheduler::live_reuse(const Slot& sl, int64_t c) const {
  const Session& s = *sl.s;
  if (s.position() - c <= eng_.options().rollback_depth) return c;
  int64_t best = 0;
  for (int64_t cp : s.checkpoints())
    if (cp <= c) best = std::max(best, cp);
  return best;
}

bool Scheduler::slot_available() const {
  if (static_cast<int>(slots_.size()) < o_.max_sessions) return true;
  for (const auto& sl : slots_)
    if (!sl->busy) return true;
  return false;
}

// The idle resident session that keeps the longest prefix of the job's prompt (a
// client's session hint breaks ties), when that is a useful share (at least min_tokens
// or half the prompt) and no shorter than what the disk holds (disk_tokens); otherwise a
// new session while there is room, or the least recently used idle one (whose state is
// saved to disk before it is replaced). Null when every session is busy.
Scheduler::Slot* Scheduler::pick_slot(const Job& j, int64_t disk_tokens) {
  const int64_t goal = static_cast<int64_t>(j.prompt.size()) - 1;
  Slot* best = nullptr;
  int64_t best_len = -1;
  for (auto& sl : slots_) {
    if (sl->busy) continue;
    const int64_t len = live_reuse(*sl, j.prompt, goal);
    const bool hint = !j.session_hint.empty() && sl->hint == j.session_hint;
    if (len > best_len || (len == best_len && hint)) best = sl.get(), best_len = len;
  }
  const bool useful = best && best_len > 0 && (best_len >= o_.kv.min_tokens || 2 * best_len >= goal) &&
                      (best_len >= disk_tokens || best_len >= o_.kv.min_tokens);
  if (useful) return best;
  if (static_cast<int>(slots_.size()) < o_.max_sessions) {
    try {
      auto sl = std::make_unique<Slot>();
      sl->s = eng_.new_session();
      slots_.push_back(std::move(sl));
      return slots_.back().get();
    } catch (const Error& e) {
      // the state budget is full: reuse an idle session instead
      log_line(cat("dsx serve: no new session (", e.what(), ")"));
    }
  }
  if (best) {  // nothing useful shared: the least recently used idle one
    for (auto& sl : slots_)
      if (!sl->busy && sl->last_use < best->last_use) best = sl.get();
  }
  return best;
}

// §5.1: when an idle session's exact tokens spell a longer byte prefix of the prompt than
// any session's common token prefix (the model's answer, replayed by the client as text
// and tokenized differently), the prompt is rewritten onto those tokens: the session keeps
// its answer instead of prefilling it again (only where it can go back there directly).
// Not with a disk cache: its entries are matched by tokens, so an entry holding a sampled
// answer would serve a restarted server, which tokenizes the replay canonically, only up
// to that answer (docs/kv-cache.md).
void Scheduler::rebase_on_live(Job& j) {
  if (!o_.byte_prefix || o_.cache || j.prompt.size() < 2) return;
  const int64_t goal = static_cast<int64_t>(j.prompt.size()) - 1;
  int64_t plain = 0;
  const Slot* best = nullptr;
  BytePrefix bm;
  for (const auto& sl : slots_) {
    if (sl->busy) continue;
    const Session& s = *sl->s;
    const int64_t c = common_prefix(s.tokens(), j.prompt, goal);
    plain = std::max(plain, c);
    if (c == static_cast<int64_t>(s.tokens().size())) continue;  // (it keeps all of its tokens anyway)
    const BytePrefix m = byte_prefix(tok_, s.tokens(), j.prompt, c, goal);
    const int64_t n = m.live + static_cast<int64_t>(j.prompt.size()) - m.prompt;
    if (m.live > c && s.position() - m.live <= eng_.options().rollback_depth && n < s.capacity() &&
        (!best || m.live > bm.live))
      best = sl.get(), bm = m;
  }
  if (!best || bm.live <= plain) return;
  j.prompt = rebased_prompt(best->s->tokens(), j.prompt, bm);
}

bool Scheduler::admit(std::unique_lock<std::mutex>& lk) {
  bool any = false;
  while (!queue_.empty() && slot_available()) {
    rebase_on_live(*queue_.front());
    const Job& j = *queue_.front();
    const int64_t goal = static_cast<int64_t>(j.prompt.size()) - 1;
    // the disk: only when no resident session already keeps the whole prompt
    std::optional<CacheHit> hit;
    if (o_.cache && goal >= o_.kv.min_tokens) {
      int64_t live = 0;
      for (const auto& sl : slots_)
        if (!sl->busy) live = std::max(live, live_reuse(*sl, j.prompt, goal));
      if (live < goal) hit = o_.cache->lookup(j.prompt.data(), goal);
    }
    Slot* sl = pick_slot(j, hit ? hit->tokens : 0);
    if (!sl) break;
    auto a = std::make_unique<Active>();
    a->job = std::move(queue_.front());
    queue_.pop_front();
    a->slot = sl;
    a->hit = std::move(hit);
    sl->busy = true;
    sl->last_use = ++clock_;
    sl->hint = a->job->session_hint;
    a->parser = std::make_unique<text::DsmlParser>(a->job->parser);
    a->sampler = std::make_unique<Sampler>(a->job->sampling);
    if (o_.drafter) {
      if (!sl->ctx) sl->ctx = std::make_unique<DSparkContext>(*o_.drafter, eng_.options().rollback_depth);
      a->cycle = std::make_unique<DSparkCycle>(*o_.drafter, o_.dspark);
      a->cycle->start(a->job->sampling);
    }
    a->in_reasoning = a->job->parser.thinking;
    a->admitted = a->last_keepalive = Clock::now();
    a->usage.prompt_tokens = static_cast<int64_t>(a->job->prompt.size());
    active_.push_back(std::move(a));
    any = true;
  }
  return any;
}

// ---- the disk KV cache: save points and saves ------------------------------------------------------------
// The positions in (from, goal] at which a prefill from `from` stores the state (§5.4):
// cold (fewer than min_tokens reused): the chat anchor (the last <｜User｜> before the first
// <｜Assistant｜>: the system + tools prefix all of an agent's conversations share) and
// align_down(L - 32, 2048) (L itself when that is below min_tokens), for prompts up to
// cold_max_tokens; continued: every multiple of continued_interval.
std::vector<std::pair<int64_t, Scheduler::SaveReason>> Scheduler::save_points(const std::vector<int32_t>& p,
                                                                              int64_t from, int64_t goal,
                                                                              bool cold) const {
  std::vector<std::pair<int64_t, SaveReason>> v;
  if (!o_.cache) return v;
  const KvCachePolicy& k = o_.kv;
  const int64_t L = goal + 1;
  if (cold) {
    const auto asst = std::find(p.begin(), p.end(), assistant_id_);
    if (asst != p.end() && user_id_ >= 0) {
      const auto user = std::find(std::make_reverse_iterator(asst), p.rend(), user_id_);
      if (user != p.rend()) {
        const int64_t anchor = static_cast<int64_t>(user.base() - p.begin()) - 1;
        if (anchor <= k.cold_max_tokens) v.emplace_back(anchor, SaveReason::Cold);
      }
    }
    if (L <= k.cold_max_tokens && k.boundary_align > 0) {
      int64_t t = (L - k.boundary_trim) / k.boundary_align * k.boundary_align;
      if (t < k.min_tokens) t = L;
      v.emplace_back(std::min(t, goal), SaveReason::Cold);
    }
  }
  if (k.continued_interval > 0)
    for (int64_t m = (from / k.continued_interval + 1) * k.continued_interval; m <= goal; m += k.continued_interval)
      v.emplace_back(m, SaveReason::Continued);
  v.erase(std::remove_if(v.begin(), v.end(),
                         [&](const auto& x) { return x.first <= from || x.first > goal || x.first < k.min_tokens; }),
          v.end());
  // ascending; one save per position (a cold one before a continued one)
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : static_cast<int>(a.second) < static_cast<int>(b.second);
  });
  v.erase(std::unique(v.begin(), v.end(), [](const auto& a, const auto& b) { return a.first == b.first; }), v.end());
  return v;
}

// Stores the slot's state at its current position (unless shorter than min_tokens or
// already stored): serialized here, written by the cache's background writer (shutdown:
// written now). False when nothing was stored.
bool Scheduler::save_state(Slot& sl, SaveReason why) {
  if (!o_.cache) return false;
  Session& s = *sl.s;
  const int64_t pos = s.position();
  if (pos < o_.kv.min_tokens || sl.is_saved(pos)) return false;
  static const char* names[] = {"cold", "continued", "evict", "shutdown"};
  const char* name = names[static_cast<int>(why)];
  const auto t0 = Clock::now();
  bool ok = false;
  int64_t bytes = 0;
  try {
    std::vector<uint8_t> snap = s.save();
    bytes = static_cast<int64_t>(snap.size());
    std::vector<int32_t> tokens = s.tokens();
    if (why == SaveReason::Shutdown) {
      o_.cache->save_snapshot(snap, tokens);
      ok = true;
    } else {
      ok = o_.cache->save_async(std::move(snap), std::move(tokens));
      if (!ok) log_line(cat("dsx kv-cache: not saving the ", name, " state of ", pos, " tokens: the writer is busy"));
    }
  } catch (const std::exception& e) {
    log_line(cat("dsx kv-cache: saving the ", name, " state of ", pos, " tokens failed: ", e.what()));
  }
  const double dt = secs(t0, Clock::now());
  std::lock_guard<std::mutex> lk(mu_);
  stats_.kv_snapshot_seconds += dt;
  if (!ok) {
    ++stats_.kv_saves_dropped;
    return false;
  }
  stats_.kv_snapshot_bytes += bytes;
  int64_t* counter[] = {&stats_.kv_saves_cold, &stats_.kv_saves_continued, &stats_.kv_saves_evict,
                        &stats_.kv_saves_shutdown};
  ++*counter[static_cast<int>(why)];
  sl.saved.push_back(pos);
  return true;
}

// Before the slot's state is replaced (a job keeping only its first `keep` tokens, or the
// server stopping: keep 0): stores the whole state when at least min_tokens of it would be
// lost, and likewise the state at the end of its last prompt (where a checkpoint sits):
// that is a prefix of the conversation's next request even when the client's replay of
// the answer tokenizes differently from the tokens sampled.
void Scheduler::save_leaving(Slot& sl, int64_t keep, SaveReason why) {
  if (!o_.cache) return;
  Session& s = *sl.s;
  const int64_t P = s.position(), e = sl.prompt_end;
  if (P - keep >= o_.kv.min_tokens) save_state(sl, why);
  if (e >= o_.kv.min_tokens && e < P && e - keep >= o_.kv.min_tokens && !sl.is_saved(e)) {
    const std::vector<int64_t> cps = s.checkpoints();
    if (P - e <= eng_.options().rollback_depth || std::find(cps.begin(), cps.end(), e) != cps.end()) {
      s.rollback(e);
      sl.forget_after(e);
      sl.prompt_end = e;
      save_state(sl, why);
    }
  }
}

// The first piece of a job's prefill: the longest prefix its session keeps (prefix
// reuse), or a longer one restored from disk; then the save points of the rest.
void Scheduler::begin_prefill(Active& a) {
  Slot& sl = *a.slot;
  Session& s = *sl.s;
  const std::vector<int32_t>& p = a.job->prompt;
  const int64_t goal = static_cast<int64_t>(p.size()) - 1;
  int64_t reused = 0;
  bool restored = false, touched = false;  // (touched: a restore attempt may have reset the session)
  // the session's prefix shared with the prompt, scanned once (and again after a failed restore)
  int64_t common = common_prefix(s.tokens(), p, goal);
  if (sl.prompt_end > 0) {
    a.prev_prompt = sl.prompt_end;
    a.prev_common = common;
  }
  if (o_.cache && a.hit && a.hit->tokens > live_reuse(sl, common)) {
    save_leaving(sl, common, SaveReason::Evict);
    touched = true;
    for (int attempt = 0; a.hit && attempt < 4; ++attempt) {
      const auto t0 = Clock::now();
      try {
        const RestoreResult r = o_.cache->restore(*a.hit, s);
        restored = true;
        reused = r.position;
        a.restored = r.position;
        a.restore_seconds = secs(t0, Clock::now());
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.kv_restores;
        stats_.kv_restored_tokens += r.position;
        stats_.kv_restore_seconds += a.restore_seconds;
        break;
      } catch (const std::exception& e) {
        // (the cache logged a refused file and dropped it; the session is reset or untouched)
        log_line(cat("dsx kv-cache: ", a.job->id, ": restore failed (", e.what(), "); trying the next entry"));
        {
          std::lock_guard<std::mutex> lk(mu_);
          ++stats_.kv_restore_failures;
        }
        const std::string failed = a.hit->name;
        const int64_t live = live_reuse(sl, p, goal);
        a.hit = o_.cache->lookup(p.data(), goal);
        if (a.hit && (a.hit->tokens <= live || a.hit->name == failed)) a.hit.reset();
      }
    }
  }
  if (restored) {
    sl.saved.assign(1, reused);
    sl.prompt_end = -1;
  } else {
    const int64_t c = touched ? common_prefix(s.tokens(), p, goal) : common;
    save_leaving(sl, c, SaveReason::Evict);
    if (c == 0) {
      if (s.position() > 0) s.rollback(0);
    } else {
      reused = s.sync(p.data(), c).reused;
    }
    sl.forget_after(s.position());
  }
  // the rings: what they hold of the kept prefix stays, the rest are holes
  if (sl.ctx) sl.ctx->align(s.tokens().data(), s.position(), /*scan=*/true);
  a.usage.cached_tokens = reused;
  a.saves = save_points(p, s.position(), goal, reused < o_.kv.min_tokens);
}

// One piece of a job's prefill: first back to the longest prefix its session keeps
// (or a restore from disk), then the prompt but its last token (the first decoding step
// feeds it) in pieces of prefill_chunk tokens that end at the save points.
void Scheduler::prefill_piece(Active& a) {
  Slot& sl = *a.slot;
  Session& s = *sl.s;
  const std::vector<int32_t>& p = a.job->prompt;
  const int64_t goal = static_cast<int64_t>(p.size()) - 1;
  const auto t0 = Clock::now();
  if (!a.started) {
    begin_prefill(a);
    a.started = true;
    a.job->sink->start(a.usage);
  } else {
    int64_t next = std::min(goal, s.position() + o_.prefill_chunk);
    if (a.next_save < a.saves.size()) next = std::min(next, a.saves[a.next_save].first);
    // DSpark: the pieces that reach into the last W rows before the anchor with taps
    if (sl.ctx && next > goal - o_.drafter->config().window) {
      prefill_with_taps(sl, p.data(), next);
    } else {
      s.sync(p.data(), next);
      if (sl.ctx) sl.ctx->align(s.tokens().data(), s.position());
    }
  }
  while (a.next_save < a.saves.size() && a.saves[a.next_save].first <= s.position()) {
    if (a.saves[a.next_save].first == s.position()) save_state(sl, a.saves[a.next_save].second);
    ++a.next_save;
  }
  const auto t1 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.prefill_seconds += secs(t0, t1);
  }
  if (s.position() >= goal) {
    // a checkpoint at the prompt's end: the next request of this conversation goes back
    // at most to here when its replay of the answer differs from the tokens sampled
    if (goal > 0) s.checkpoint();
    sl.prompt_end = goal;
    a.decoding = true;
    a.anchor = p.back();
    a.prefill_done = t1;
    std::lock_guard<std::mutex> lk(mu_);
    stats_.prefill_tokens += goal - a.usage.cached_tokens;
  }
}

// Tokens a job may still generate: its max_tokens, and its session's capacity (the last
// generated token is sampled, not fed); at 0 it ends with finish reason length.
int64_t Scheduler::output_left(const Active& a) const { return output_left(a, a.slot->s->position()); }

// (pos: the session's position as of the last token emitted; inside a DSpark block the
// session may already be further)
int64_t Scheduler::output_left(const Active& a, int64_t pos) const {
  return std::min<int64_t>(a.job->max_tokens - a.generated, a.slot->s->capacity() - 1 - pos);
}

// A prefill piece up to `to` as Session::sync feeds it (one step per stretch up to the
// next checkpoint: the same rows in the same passes as a plain prefill), with the taps
// of its rows observed into the slot's rings.
void Scheduler::prefill_with_taps(Slot& sl, const int32_t* ids, int64_t to) {
  Session& s = *sl.s;
  DSparkContext& ctx = *sl.ctx;
  ctx.align(s.tokens().data(), s.position());
  const int64_t TW = eng_.tap_width();
  for (int64_t q = s.position(); q < to;) {
    const int64_t end = s.piece_end(q, to);
    taps_.resize(static_cast<size_t>((end - q) * TW));
    Step st;
    st.feeds.push_back(Feed{&s, ids + q, end - q, nullptr, taps_.data(), nullptr, nullptr});
    eng_.step(st);
    ctx.observe(ids + q, taps_.data(), end - q);
    q = end;
  }
}

void Scheduler::decode_step(std::vector<Active*>& ds) {
  const int64_t V = eng_.config().vocab_size, TW = o_.drafter ? eng_.tap_width() : 0;
  const int64_t every = o_.cache ? o_.kv.continued_interval : 0;
  Step st;
  std::vector<int32_t> in(ds.size()), picks(ds.size(), -1);
  std::vector<float> row_taps(ds.size() * static_cast<size_t>(TW));
  int64_t rows = 0, blocks = 0, plain = 0;
  for (size_t i = 0; i < ds.size(); ++i) {
    Active& a = *ds[i];
    Session& s = *a.slot->s;
    in[i] = a.anchor;
    const bool greedy = a.job->sampling.temperature <= 0.0f;
    Constraint* c = a.job->constraint.get();
    if (c && output_left(a) <= o_.wrap_up_reserve) c->wrap_up();  // (this step's token comes next)
    if (c && c->passive()) c = nullptr;  // (a lazy constraint before its trigger: decoded as usual)
    DSparkContext* ctx = a.slot->ctx.get();
    if (ctx) ctx->align(s.tokens().data(), s.position());
    a.block = a.cycle && !c;
    if (a.block) {
      // the anchor and the drafts the schedule chooses (a block never steps over a
      // continued-save position: the session lands on it)
      int kmax = a.cycle->max_drafts(eng_, output_left(a));
      if (every > 0) kmax = static_cast<int>(std::min<int64_t>(kmax, (s.position() / every + 1) * every - s.position() - 1));
      a.cycle->draft(*ctx, a.anchor, kmax);
      st.feeds.push_back(a.cycle->verify_feed(s));
      if (a.cycle->needs_all_rows()) st.all_rows = true;
      rows += static_cast<int64_t>(a.cycle->rows().size());
      ++blocks;
      continue;
    }
    // a constrained job needs the logits on the host (or nothing, when its next token is forced)
    const bool want_logits = c ? c->needs_logits() : !greedy;
    if (want_logits) a.logits.resize(static_cast<size_t>(V));
    st.feeds.push_back(Feed{&s, &in[i], 1, want_logits ? a.logits.data() : nullptr,
                            ctx ? row_taps.data() + i * static_cast<size_t>(TW) : nullptr,
                            !c && greedy ? &picks[i] : nullptr, nullptr});
    ++rows;
    ++plain;
  }
  const auto t0 = Clock::now();
  eng_.step(st);
  const auto t1 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.decode_steps;
    stats_.decode_rows += rows;
    stats_.decode_step_seconds += secs(t0, t1);
    if (blocks > 0 && plain > 0) ++stats_.dspark_mixed_steps;
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    Active& a = *ds[i];
    if (a.block) {
      commit_block(a);
      continue;
    }
    // (a plain row of a DSpark slot: its taps keep the rings whole)
    if (DSparkContext* ctx = a.slot->ctx.get()) ctx->observe(&in[i], row_taps.data() + i * static_cast<size_t>(TW), 1);
    int32_t t;
    Constraint* c = a.job->constraint.get();
    if (c && !c->passive()) {
      const bool greedy = a.job->sampling.temperature <= 0.0f;
      Sampler& smp = *a.sampler;
      t = c->next(c->needs_logits() ? a.logits.data() : nullptr, V, [&](const float* l, int64_t n) {
        return greedy ? argmax(l, n) : smp.sample(l, n);
      });
    } else {
      t = picks[i] >= 0 ? picks[i] : a.sampler->sample(a.logits.data(), V);
      if (c) c->observe(t);
    }
    emit(a, t, a.slot->s->position());
  }
  // continued saves of growing sessions (not in the middle of a tool call, whose replay
  // is rendered from the parsed call)
  if (every > 0)
    for (Active* a : ds) {
      const int64_t pos = a->slot->s->position();
      if (pos % every == 0 && !a->in_tool_call) save_state(*a->slot, SaveReason::Continued);
    }
}

// One generated token through the completion's path: the parser (events, stop strings,
// a closed tool-call block), EOS, the constraint's end, the output budget. pos: the
// session's position with the token before it fed. True when the job ended on it.
bool Scheduler::emit(Active& a, int32_t t, int64_t pos) {
  a.anchor = t;
  ++a.generated;
  if (a.in_reasoning) ++a.reasoning_tokens;
  if (t == eng_.config().eos_id) {
    finish(a, text::EndCause::Eos);
    return true;
  }
  std::vector<text::Event> ev = a.parser->push(tok_.decode_one(t));
  for (const auto& e : ev) {
    if (e.type == text::EventType::ReasoningEnd) a.in_reasoning = false;
    if (e.type == text::EventType::ToolCallStart) a.in_tool_call = true;
    if (e.type == text::EventType::ToolCallEnd) a.in_tool_call = false;
  }
  if (!ev.empty()) a.job->sink->events(ev);
  if (a.parser->should_stop() || (a.job->constraint && a.job->constraint->done())) {
    finish(a, text::EndCause::Eos);
    return true;
  }
  if (output_left(a, pos) <= 0) {
    finish(a, text::EndCause::Length);
    return true;
  }
  return false;
}

// After the step: a job's DSpark block accepted (DSparkCycle::accept: the session at
// n + j + 1), its tokens emitted one by one. When the job ends on the m-th, or its lazy
// tool grammar turns active on it (the next token is constrained, the rest of the block
// was verified for free decoding), the session and the rings go back to n + m: they
// hold exactly the emitted tokens but the last, the new anchor, as after plain steps.
void Scheduler::commit_block(Active& a) {
  Session& s = *a.slot->s;
  DSparkContext& ctx = *a.slot->ctx;
  const int64_t n = a.cycle->anchor_position();
  a.block_tokens.clear();
  const int j = a.cycle->accept(s, ctx, a.block_tokens);
  // (counted first: the request's log line is written when it ends, inside the loop)
  ++a.dspark_cycles;
  a.dspark_accepted += j;
  Constraint* c = a.job->constraint.get();
  const int64_t T = static_cast<int64_t>(a.block_tokens.size());
  int64_t m = 0;
  while (m < T) {
    const int32_t t = a.block_tokens[static_cast<size_t>(m++)];
    ++a.dspark_tokens;
    if (c) c->observe(t);
    if (emit(a, t, n + m)) break;
    if (c && !c->passive()) break;
  }
  if (m < T) {
    s.rollback(n + m);
    ctx.truncate(n + m);
  }
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.dspark_cycles;
  stats_.dspark_verified += static_cast<int64_t>(a.cycle->rows().size()) - 1;
  stats_.dspark_accepted += j;
  stats_.dspark_tokens += m;
}

void Scheduler::finish(Active& a, text::EndCause cause) {
  std::vector<text::Event> ev = a.parser->finish(cause);
  if (!ev.empty()) a.job->sink->events(ev);
  a.usage.completion_tokens = a.generated;
  a.usage.reasoning_tokens = a.reasoning_tokens;
  const text::ParseResult& r = a.parser->result();
  a.job->sink->end(r, a.usage);
  a.done = true;
  const auto now = Clock::now();
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.finished;
  stats_.prompt_tokens += a.usage.prompt_tokens;
  stats_.cached_tokens += a.usage.cached_tokens;
  stats_.generated_tokens += a.generated;
  if (o_.log_requests) {
    const double pf = secs(a.admitted, a.prefill_done), dc = secs(a.prefill_done, now);
    nlohmann::json j = {{"id", a.job->id},
                        {"endpoint", a.job->api},
                        {"tokens_in", a.usage.prompt_tokens},
                        {"tokens_cached", a.usage.cached_tokens},
                        {"tokens_restored", a.restored},
                        {"tokens_out", a.generated},
                        {"queue_ms", static_cast<int64_t>(secs(a.job->submitted, a.admitted) * 1000)},
                        {"prefill_tok_s", pf > 0 ? (a.usage.prompt_tokens - a.usage.cached_tokens) / pf : 0.0},
                        {"decode_tok_s", dc > 0 ? a.generated / dc : 0.0},
                        {"finish", text::finish_reason_name(r.finish)}};
    if (a.restored > 0) j["restore_ms"] = static_cast<int64_t>(a.restore_seconds * 1000);
    if (a.dspark_cycles > 0) {
      const double cy = static_cast<double>(a.dspark_cycles);
      j["dspark_cycles"] = a.dspark_cycles;
      j["accepted_per_cycle"] = std::round(a.dspark_accepted / cy * 1000) / 1000;
      j["tokens_per_cycle"] = std::round(a.dspark_tokens / cy * 1000) / 1000;
    }
    if (a.prev_prompt > 0) {
      // the session it continued: its previous prompt's length and the tokens of it this
      // prompt shares (less than all: an earlier part of the conversation changed)
      j["prev_prompt"] = a.prev_prompt;
      j["prev_common"] = std::min(a.prev_common, a.prev_prompt);
    }
    log_line(j.dump());
  }
}

void Scheduler::drop(Active& a, const char* why) {
  a.done = true;
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.cancelled;
  if (o_.log_requests)
    log_line(nlohmann::json({{"id", a.job->id}, {"endpoint", a.job->api}, {"cancelled", why},
                             {"tokens_out", a.generated}})
                 .dump());
}

void Scheduler::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      admit(lk);
      if (active_.empty()) {
        if (stopping_ && queue_.empty()) {
          lk.unlock();
          // shutdown: every resident session to disk (written before the worker stops)
          for (auto& sl : slots_) save_leaving(*sl, 0, SaveReason::Shutdown);
          break;
        }
        cv_.wait_for(lk, std::chrono::milliseconds(100));
        if (queue_.empty()) continue;
      }
    }
    for (auto& a : active_)
      if (!a->done && a->job->sink->cancelled()) drop(*a, "client went away");
    // one prefill piece (the oldest job still prefilling), keep-alives to the others
    Active* pf = nullptr;
    for (auto& a : active_)
      if (!a->done && !a->decoding) {
        pf = a.get();
        break;
      }
    if (pf) {
      try {
        prefill_piece(*pf);
      } catch (const std::exception& e) {
        pf->job->sink->fail(ApiError{500, "server_error", cat("prefill failed: ", e.what()), "", ""});
        pf->done = true;
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.failed;
      }
    }
    const auto now = Clock::now();
    for (auto& a : active_)
      if (!a->done && !a->decoding && secs(a->last_keepalive, now) >= o_.keepalive_seconds) {
        a->job->sink->keepalive();
        a->last_keepalive = now;
      }
    {
      // jobs waiting for a session: keep-alives too, and the ones whose client left go
      std::lock_guard<std::mutex> lk(mu_);
      for (const auto& q : queue_)
        if (!q->sink->cancelled() && secs(q->last_keepalive, now) >= o_.keepalive_seconds) {
          q->sink->keepalive();
          q->last_keepalive = now;
        }
      const size_t before = queue_.size();
      queue_.erase(std::remove_if(queue_.begin(), queue_.end(), [](const auto& q) { return q->sink->cancelled(); }),
                   queue_.end());
      stats_.cancelled += static_cast<int64_t>(before - queue_.size());
    }
    std::vector<Active*> ds;
    for (auto& a : active_)
      if (!a->done && a->decoding) ds.push_back(a.get());
    if (!ds.empty()) {
      try {
        decode_step(ds);
      } catch (const std::exception& e) {
        for (Active* a : ds)
          if (!a->done) {
            a->job->sink->fail(ApiError{500, "server_error", cat("decode failed: ", e.what()), "", ""});
            a->done = true;
          }
        std::lock_guard<std::mutex> lk(mu_);
        ++stats_.failed;
      }
    }
    const StateFootprint fp = eng_.footprint();
    std::lock_guard<std::mutex> lk(mu_);
    stats_.footprint = fp;
    for (auto& a : active_)
      if (a->done) a->slot->busy = false, a->slot->last_use = ++clock_;
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& a) { return a->done; }), active_.end());
  }
}

}  // namespace dsx::server
