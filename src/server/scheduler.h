// The server's engine loop: one worker thread owns the engine and its resident
// sessions. Requests (Jobs: a tokenized prompt, the DSML parser's options, sampling, a
// Sink) wait in a FIFO queue; a job is admitted when a session is free, gets the
// resident session whose history shares the longest prefix with its prompt (prefix
// reuse: Session::sync keeps it, checkpoints serve edits further back), is prefilled in
// chunks (other jobs keep decoding between the chunks; waiting clients get keep-alives),
// then decodes together with every other decoding job: one Engine::step of one row per
// job per token. A job ends on EOS, a closed tool-call block or a stop string (the
// parser), max_tokens, a full context, or its client going away (Sink::cancelled).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "server/api.h"
#include "server/constrain.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

namespace dsx::server {

struct Job {
  std::string id;   // request id (logs)
  std::string api;  // endpoint (logs, metrics)
  std::vector<int32_t> prompt;
  text::ParserOptions parser;
  int64_t max_tokens = 0;  // > 0
  SamplerOptions sampling;
  std::shared_ptr<Sink> sink;
  // tool_choice required / named, response_format: the tokens are chosen under this
  // constraint (logits on the host every step), and the completion ends when it is done
  std::unique_ptr<Constraint> constraint;
  std::string session_hint;
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_keepalive = submitted;  // (while queued; the scheduler's)
};

struct SchedulerOptions {
  int max_sessions = 4;           // resident sessions (and jobs running at once)
  int64_t prefill_chunk = 1024;   // prompt tokens per prefill piece between decode steps
  double keepalive_seconds = 5;   // keep-alive interval for a client whose prompt waits or prefills
  size_t max_queue = 256;         // jobs waiting; more are refused (503)
  bool log_requests = true;       // one line per finished request on stderr
};

struct SchedulerStats {
  int64_t requests = 0, finished = 0, cancelled = 0, failed = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0, generated_tokens = 0;
  int64_t queue_depth = 0, active = 0, sessions = 0;
  int64_t decode_steps = 0;
  double decode_step_seconds = 0;   // total over the steps
  int64_t decode_rows = 0;          // rows over the steps (mean batch = rows / steps)
  int64_t prefill_tokens = 0;
  double prefill_seconds = 0;
};

class Scheduler {
 public:
  Scheduler(Engine& eng, const text::Tokenizer& tok, SchedulerOptions o);
  ~Scheduler();  // shutdown()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  // Queues a job; false when the queue is full or the scheduler is shutting down.
  bool submit(std::shared_ptr<Job> job);
  // Refuses new jobs, lets the queued and running ones finish, stops the worker.
  void shutdown();
  SchedulerStats stats() const;
  const SchedulerOptions& options() const { return o_; }

 private:
  struct Slot;
  struct Active;
  void loop();
  bool admit(std::unique_lock<std::mutex>& lk);
  void prefill_piece(Active& a);
  void decode_step(std::vector<Active*>& ds);
  void finish(Active& a, text::EndCause cause);
  void drop(Active& a, const char* why);
  Slot* pick_slot(const Job& j);

  Engine& eng_;
  const text::Tokenizer& tok_;
  SchedulerOptions o_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::unique_ptr<Active>> active_;
  SchedulerStats stats_;
  uint64_t clock_ = 0;
  std::thread worker_;
};

}  // namespace dsx::server
