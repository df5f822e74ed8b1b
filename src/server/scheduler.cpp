#include "server/scheduler.h"

#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

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
};

struct Scheduler::Active {
  std::shared_ptr<Job> job;
  Slot* slot = nullptr;
  bool decoding = false, done = false, reuse_synced = false;
  int32_t anchor = -1;
  int64_t generated = 0, reasoning_tokens = 0;
  bool in_reasoning = false;
  Usage usage;
  std::unique_ptr<text::DsmlParser> parser;
  std::unique_ptr<Sampler> sampler;
  std::vector<float> logits;
  Clock::time_point admitted, prefill_done, last_keepalive;
};

Scheduler::Scheduler(Engine& eng, const text::Tokenizer& tok, SchedulerOptions o) : eng_(eng), tok_(tok), o_(o) {
  DSX_CHECK(o_.max_sessions >= 1, "the server needs at least one session");
  worker_ = std::thread([this] { loop(); });
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
}

SchedulerStats Scheduler::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  SchedulerStats s = stats_;
  s.queue_depth = static_cast<int64_t>(queue_.size());
  s.active = static_cast<int64_t>(active_.size());
  s.sessions = static_cast<int64_t>(slots_.size());
  return s;
}

// The idle resident session whose history shares the longest prefix with the job's
// prompt (a client's session hint breaks ties), a new one while there is room, or the
// least recently used idle one. Null when every session is busy.
Scheduler::Slot* Scheduler::pick_slot(const Job& j) {
  Slot* best = nullptr;
  int64_t best_len = -1;
  for (auto& sl : slots_) {
    if (sl->busy) continue;
    int64_t len = common_prefix(sl->s->tokens(), j.prompt, static_cast<int64_t>(j.prompt.size()));
    const bool hint = !j.session_hint.empty() && sl->hint == j.session_hint;
    if (len > best_len || (len == best_len && hint)) best = sl.get(), best_len = len;
  }
  if ((!best || best_len == 0) && static_cast<int>(slots_.size()) < o_.max_sessions) {
    try {
      auto sl = std::make_unique<Slot>();
      sl->s = eng_.new_session();
      slots_.push_back(std::move(sl));
      return slots_.back().get();
    } catch (const Error& e) {
      // the state budget is full: reuse an idle session instead
      std::fprintf(stderr, "dsx serve: no new session (%s)\n", e.what());
    }
  }
  if (best && best_len == 0) {  // nothing shared: the least recently used idle one
    for (auto& sl : slots_)
      if (!sl->busy && sl->last_use < best->last_use) best = sl.get();
  }
  return best;
}

bool Scheduler::admit(std::unique_lock<std::mutex>& lk) {
  bool any = false;
  while (!queue_.empty()) {
    Slot* sl = pick_slot(*queue_.front());
    if (!sl) break;
    auto a = std::make_unique<Active>();
    a->job = std::move(queue_.front());
    queue_.pop_front();
    a->slot = sl;
    sl->busy = true;
    sl->last_use = ++clock_;
    sl->hint = a->job->session_hint;
    a->parser = std::make_unique<text::DsmlParser>(a->job->parser);
    a->sampler = std::make_unique<Sampler>(a->job->sampling);
    a->in_reasoning = a->job->parser.thinking;
    a->admitted = a->last_keepalive = Clock::now();
    a->usage.prompt_tokens = static_cast<int64_t>(a->job->prompt.size());
    active_.push_back(std::move(a));
    any = true;
  }
  return any;
}

// One piece of a job's prefill: first back to the longest prefix its session keeps
// (prefix reuse), then the prompt but its last token (the first decoding step feeds it)
// in pieces of prefill_chunk tokens.
void Scheduler::prefill_piece(Active& a) {
  Session& s = *a.slot->s;
  const std::vector<int32_t>& p = a.job->prompt;
  const int64_t goal = static_cast<int64_t>(p.size()) - 1;
  const auto t0 = Clock::now();
  if (!a.reuse_synced) {
    const int64_t c = common_prefix(s.tokens(), p, goal);
    int64_t reused = 0;
    if (c == 0) {
      if (s.position() > 0) s.rollback(0);
    } else {
      reused = s.sync(p.data(), c).reused;
    }
    a.usage.cached_tokens = reused;
    a.reuse_synced = true;
    a.job->sink->start(a.usage);
  } else {
    const int64_t next = std::min(goal, s.position() + o_.prefill_chunk);
    s.sync(p.data(), next);
  }
  const auto t1 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    stats_.prefill_seconds += secs(t0, t1);
  }
  if (s.position() >= goal) {
    a.decoding = true;
    a.anchor = p.back();
    a.prefill_done = t1;
    std::lock_guard<std::mutex> lk(mu_);
    stats_.prefill_tokens += goal - a.usage.cached_tokens;
  }
}

void Scheduler::decode_step(std::vector<Active*>& ds) {
  const int64_t V = eng_.config().vocab_size;
  Step st;
  std::vector<int32_t> in(ds.size()), picks(ds.size(), -1);
  for (size_t i = 0; i < ds.size(); ++i) {
    Active& a = *ds[i];
    in[i] = a.anchor;
    const bool greedy = a.job->sampling.temperature <= 0.0f;
    Constraint* c = a.job->constraint.get();
    // a constrained job needs the logits on the host (or nothing, when its next token is forced)
    const bool want_logits = c ? c->needs_logits() : !greedy;
    if (want_logits) a.logits.resize(static_cast<size_t>(V));
    st.feeds.push_back(Feed{a.slot->s.get(), &in[i], 1, want_logits ? a.logits.data() : nullptr, nullptr,
                            !c && greedy ? &picks[i] : nullptr});
  }
  const auto t0 = Clock::now();
  eng_.step(st);
  const auto t1 = Clock::now();
  {
    std::lock_guard<std::mutex> lk(mu_);
    ++stats_.decode_steps;
    stats_.decode_rows += static_cast<int64_t>(ds.size());
    stats_.decode_step_seconds += secs(t0, t1);
  }
  for (size_t i = 0; i < ds.size(); ++i) {
    Active& a = *ds[i];
    int32_t t;
    if (Constraint* c = a.job->constraint.get()) {
      const bool greedy = a.job->sampling.temperature <= 0.0f;
      Sampler& smp = *a.sampler;
      t = c->next(c->needs_logits() ? a.logits.data() : nullptr, V, [&](const float* l, int64_t n) {
        return greedy ? argmax(l, n) : smp.sample(l, n);
      });
    } else {
      t = picks[i] >= 0 ? picks[i] : a.sampler->sample(a.logits.data(), V);
    }
    a.anchor = t;
    ++a.generated;
    if (a.in_reasoning) ++a.reasoning_tokens;
    if (t == eng_.config().eos_id) {
      finish(a, text::EndCause::Eos);
      continue;
    }
    std::vector<text::Event> ev = a.parser->push(tok_.decode_one(t));
    for (const auto& e : ev)
      if (e.type == text::EventType::ReasoningEnd) a.in_reasoning = false;
    if (!ev.empty()) a.job->sink->events(ev);
    if (a.parser->should_stop() || (a.job->constraint && a.job->constraint->done())) {
      finish(a, text::EndCause::Eos);
    } else if (a.generated >= a.job->max_tokens || a.slot->s->position() + 1 >= a.slot->s->capacity()) {
      finish(a, text::EndCause::Length);
    }
  }
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
                        {"tokens_out", a.generated},
                        {"queue_ms", static_cast<int64_t>(secs(a.job->submitted, a.admitted) * 1000)},
                        {"prefill_tok_s", pf > 0 ? (a.usage.prompt_tokens - a.usage.cached_tokens) / pf : 0.0},
                        {"decode_tok_s", dc > 0 ? a.generated / dc : 0.0},
                        {"finish", text::finish_reason_name(r.finish)}};
    std::fprintf(stderr, "%s\n", j.dump().c_str());
  }
}

void Scheduler::drop(Active& a, const char* why) {
  a.done = true;
  std::lock_guard<std::mutex> lk(mu_);
  ++stats_.cancelled;
  if (o_.log_requests)
    std::fprintf(stderr, "%s\n",
                 nlohmann::json({{"id", a.job->id}, {"endpoint", a.job->api}, {"cancelled", why},
                                 {"tokens_out", a.generated}})
                     .dump()
                     .c_str());
}

void Scheduler::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      admit(lk);
      if (active_.empty()) {
        if (stopping_ && queue_.empty()) break;
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
    std::lock_guard<std::mutex> lk(mu_);
    for (auto& a : active_)
      if (a->done) a->slot->busy = false, a->slot->last_use = ++clock_;
    active_.erase(std::remove_if(active_.begin(), active_.end(), [](const auto& a) { return a->done; }), active_.end());
  }
}

}  // namespace dsx::server
