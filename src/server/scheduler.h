// The server's engine loop: one worker thread owns the engine and its resident
// sessions. Requests (Jobs: a tokenized prompt, the DSML parser's options, sampling, a
// Sink) wait in a FIFO queue; a job is admitted when a session is free, gets the
// resident session whose history shares the longest prefix with its prompt (prefix
// reuse: Session::sync keeps it, checkpoints serve edits further back), is prefilled in
// chunks (other jobs keep decoding between the chunks; waiting clients get keep-alives),
// then decodes together with every other decoding job: one Engine::step per cycle over
// all of them. A job ends on EOS, a closed tool-call block or a stop string (the
// parser), max_tokens, a full context, or its client going away (Sink::cancelled).
//
// DSpark speculative decoding (SchedulerOptions::drafter; runtime/dspark_decoding.h):
//   - each slot keeps a DSparkContext (the drafter's rings) next to its session across
//     requests; prefix reuse keeps the common prefix, positions the session holds
//     without taps (a restore from disk, a checkpoint replay, a byte-prefix rebase)
//     are ring holes: lossless, only acceptance drops until the window refills. The
//     prefill asks the taps of its pieces that reach into the last W prompt rows (the
//     pieces are those of a plain prefill: the same numbers);
//   - each decode step, every decoding job without an active constraint drafts at its
//     anchor and contributes 1 + k rows (k by the schedule: DSparkCycle), the others one
//     row (with its taps, so that the rings stay whole), all in ONE Engine::step; then
//     per job the acceptance rule (T = 0 greedy, T > 0 exact speculative sampling with
//     its own seeded generator), the rejected rows rolled back, and the accepted tokens
//     emitted one by one through the plain path (parser, stop strings, EOS, max_tokens,
//     the context): a job that ends inside the block, or whose lazy tool grammar turns
//     active inside it, keeps exactly the tokens emitted so far and its session is
//     rolled back to them (the rest of the block was drafted for free decoding);
//   - a job under an active constraint (forced tool_choice, response_format, the lazy
//     tool grammar once a call opened) decodes plain rows: the constraint changes the
//     distribution the drafts were verified against. Lossless either way;
//   - with a disk cache, a block never steps over the next continued-save position
//     (k is capped so that the session can land on it).
//
// With a disk KV cache (SchedulerOptions::cache, docs/kv-cache.md), sessions outlive
// the process and their eviction from memory:
//   - admission looks the prompt up on disk (the longest stored token prefix of all but
//     its last token); when that covers more than the best resident session keeps, the
//     entry is restored into a session and only the rest is prefilled. A refused entry
//     (corrupt, truncated: DiskCache::restore) is logged and dropped, and the next
//     longest is tried (a cold prefill at worst);
//   - saves (chat-and-serving.md §5.4, KvCachePolicy): cold (a prompt that reused
//     nothing: at its chat anchor, the system + tools prefix, and at
//     align_down(L - 32, 2048)), continued (every 10240 tokens of a growing session, in
//     prefill or decode, not inside a tool call), evict (a session about to be
//     repurposed with >= min_tokens that would be lost) and shutdown (every resident
//     session). The prefill pauses at each save point so that the snapshot is taken at
//     exactly that position; the snapshot is serialized on the engine thread (the
//     state is ~1 KB per token) and written by the cache's background writer, so decode
//     never waits for the disk. Each slot remembers which positions of its history are
//     stored, so one state is never saved twice;
//   - every prefill ends with a session checkpoint at its last prompt position: a next
//     request whose replayed assistant turn tokenizes differently from the sampled tokens
//     goes back to there (not to the previous 4096-token checkpoint); evict and shutdown
//     also store that prompt-end state, the prefix a continuation always shares.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "cache/disk_cache.h"
#include "runtime/dspark_decoding.h"
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

// When the scheduler stores sessions on disk (chat-and-serving.md §5.4, ds4's defaults).
struct KvCachePolicy {
  int64_t min_tokens = 512;            // no entry holds fewer tokens
  int64_t cold_max_tokens = 30000;     // cold saves: prompts (anchor positions) up to this long
  int64_t continued_interval = 10240;  // continued saves at multiples of this (5 x 2048)
  int64_t boundary_trim = 32;          // cold save at align_down(L - trim, align)
  int64_t boundary_align = 2048;
};

struct SchedulerOptions {
  int max_sessions = 4;           // resident sessions (and jobs running at once)
  int64_t prefill_chunk = 1024;   // prompt tokens per prefill piece between decode steps
  double keepalive_seconds = 5;   // keep-alive interval for a client whose prompt waits or prefills
  size_t max_queue = 256;         // jobs waiting; more are refused (503)
  bool log_requests = true;       // one line per finished request on stderr
  // A constrained completion (tool call, JSON) with at most this many tokens of its budget
  // left wraps up (Constraint::wrap_up): its open strings close, so that the call or value
  // still ends inside max_tokens.
  int wrap_up_reserve = 48;
  // Byte-prefix matching (chat-and-serving.md §5.1, server/byte_prefix.h): a prompt whose
  // bytes continue an idle session's exact tokens past their common token prefix (a
  // replayed answer tokenized differently from the model's sampled tokens) keeps them.
  // Only without a disk cache (whose entries are matched by tokens; docs/kv-cache.md).
  bool byte_prefix = true;
  // The on-disk KV cache (not owned; outlives the scheduler), or null: none.
  DiskCache* cache = nullptr;
  KvCachePolicy kv;
  // The HTTP layer's secret for the reasoning it hands out (thinking-block signatures,
  // Responses encrypted_content; server/signing.h). Empty: a fresh one per process. A
  // server with a disk cache keeps it beside the cache (persistent_secret), so that a
  // restarted server still recognises, and renders exactly, the reasoning clients
  // replay: otherwise every conversation's prefix changes at a restart.
  std::string secret;
  // Log lines (request lines, kv-cache events); default: stderr.
  std::function<void(const std::string&)> log;
  // DSpark speculative decoding: the model's drafter (not owned; outlives the scheduler;
  // its tap width must be the engine's), or null: plain decoding. dspark: the schedule
  // (cli/dspark_option.h: --dspark on / static K).
  const Drafter* drafter = nullptr;
  DSparkOptions dspark;
};

// The secret kept in `dir`/serve-secret (0600; created when missing or malformed).
std::string persistent_secret(const std::string& dir);

struct SchedulerStats {
  int64_t requests = 0, finished = 0, cancelled = 0, failed = 0;
  int64_t prompt_tokens = 0, cached_tokens = 0, generated_tokens = 0;
  int64_t queue_depth = 0, active = 0, sessions = 0;
  int64_t decode_steps = 0;
  double decode_step_seconds = 0;   // total over the steps
  int64_t decode_rows = 0;          // rows over the steps (mean batch = rows / steps)
  // DSpark: cycles (one job's verified block: anchor + k drafts), the drafts verified and
  // accepted, the tokens the cycles emitted (accepted drafts and the correction / bonus,
  // less the rest of a block that ended inside), steps that verified blocks beside plain
  // rows of other jobs
  int64_t dspark_cycles = 0, dspark_verified = 0, dspark_accepted = 0, dspark_tokens = 0;
  int64_t dspark_mixed_steps = 0;
  int64_t prefill_tokens = 0;
  double prefill_seconds = 0;
  // the disk KV cache (the store's own counters: DiskCache::stats)
  int64_t kv_restores = 0, kv_restored_tokens = 0, kv_restore_failures = 0;
  double kv_restore_seconds = 0;
  int64_t kv_saves_cold = 0, kv_saves_continued = 0, kv_saves_evict = 0, kv_saves_shutdown = 0;
  int64_t kv_saves_dropped = 0;    // the background writer's queue was full
  double kv_snapshot_seconds = 0;  // serializing snapshots on the engine thread
  int64_t kv_snapshot_bytes = 0;
  // the engine's session state as the worker saw it after its last loop turn (the engine
  // is the worker's alone: other threads never read its sessions)
  StateFootprint footprint;
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
  enum class SaveReason { Cold, Continued, Evict, Shutdown };
  void loop();
  bool admit(std::unique_lock<std::mutex>& lk);
  void begin_prefill(Active& a);
  void prefill_piece(Active& a);
  void decode_step(std::vector<Active*>& ds);
  bool emit(Active& a, int32_t t, int64_t pos);
  void commit_block(Active& a);
  void prefill_with_taps(Slot& sl, const int32_t* ids, int64_t to);
  void finish(Active& a, text::EndCause cause);
  void drop(Active& a, const char* why);
  Slot* pick_slot(const Job& j, int64_t disk_tokens);
  void rebase_on_live(Job& j);
  int64_t output_left(const Active& a) const;
  int64_t output_left(const Active& a, int64_t pos) const;
  bool slot_available() const;
  int64_t live_reuse(const Slot& sl, const std::vector<int32_t>& prompt, int64_t goal) const;
  int64_t live_reuse(const Slot& sl, int64_t common) const;  // (common: its tokens' prefix shared with the prompt)
  std::vector<std::pair<int64_t, SaveReason>> save_points(const std::vector<int32_t>& prompt, int64_t from,
                                                          int64_t goal, bool cold) const;
  bool save_state(Slot& sl, SaveReason why);
  void save_leaving(Slot& sl, int64_t keep, SaveReason why);
  void log_line(const std::string& s) const;

  Engine& eng_;
  const text::Tokenizer& tok_;
  SchedulerOptions o_;
  int32_t user_id_ = -1, assistant_id_ = -1;  // <｜User｜>, <｜Assistant｜> (the chat anchor)
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stopping_ = false;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<std::unique_ptr<Active>> active_;
  SchedulerStats stats_;
  uint64_t clock_ = 0;
  std::vector<float> taps_;  // (the engine thread's: prefill pieces with taps)
  std::thread worker_;
};

}  // namespace dsx::server
