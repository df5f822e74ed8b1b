// The generation loop: a prompt in, tokens and text out, on one session.
//
//   generate(session, prompt, options, strategy, detok, on_chunk, cancel)
//
// 1. Prefill: the strategy syncs the session to the prompt without its last token
//    (Session::sync keeps the longest common prefix of what the session holds; the
//    result reports the reused and prefilled tokens). The prompt's last token is the
//    first *anchor*: the last committed token, which the target has not processed yet
//    (the DSpark spec's term, dspark.md §0.3).
// 2. Decode: each call of DecodingStrategy::next feeds the anchor (and whatever else it
//    verifies) and commits one or more tokens; the last of them is the next anchor.
//    Between calls the loop applies, token by token in order: stop ids, stop strings,
//    max_tokens, the context capacity and cancellation.
// 3. Text: committed tokens go through a TokenText (the text layer's streaming
//    detokenizer, text/token_text.h, or any other) and are streamed to a callback.
//
// Stop strings are matched on the detokenized text. Text that could still be the start
// of a stop string is held back until it is decided: the callback only ever receives
// text that is final (what it has received is always a prefix of GenerateResult::text).
// A matched stop string and everything after it are never emitted; a stop id is never
// passed to the detokenizer nor reported in ids.
//
// Thread safety: one generate() call uses its session (and engine) from the calling
// thread; CancelToken::cancel() may be called from any thread at any time.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/engine.h"
#include "runtime/sampler.h"

namespace dsx {

// Token ids -> text, incrementally (implemented by the text layer with its
// StreamDecoder: text/token_text.h; runtime does not depend on text/).
class TokenText {
 public:
  virtual ~TokenText() = default;
  // The text that id completes (may be empty: e.g. an incomplete UTF-8 sequence is held).
  virtual std::string push(int32_t id) = 0;
  // End of the stream: whatever is held, and back to the initial state.
  virtual std::string flush() = 0;
};

// Cancellation from another thread: generate() checks it before each decoding step
// (and before the prefill) and ends with FinishReason::Cancelled.
class CancelToken {
 public:
  void cancel() { flag_.store(true, std::memory_order_release); }
  bool cancelled() const { return flag_.load(std::memory_order_acquire); }
  void reset() { flag_.store(false, std::memory_order_release); }

 private:
  std::atomic<bool> flag_{false};
};

enum class FinishReason {
  Stop,       // a stop id or a stop string
  Length,     // max_tokens, or the session's context capacity is full
  Cancelled,  // CancelToken
};
const char* finish_reason_name(FinishReason r);  // "stop" | "length" | "cancelled"

struct GenerateOptions {
  SamplerOptions sampling;  // given to DecodingStrategy::start (a fresh seeded generator per call)
  int64_t max_tokens = 256;  // committed tokens at most (a stop id is not one of them)
  // Token ids that end generation (not included in ids, not detokenized). kEos stands
  // for the model's eos_id (ModelConfig::eos_id); clear the list to never stop on ids.
  static constexpr int32_t kEos = -1;
  std::vector<int32_t> stop_ids = {kEos};
  // Strings that end generation, matched on the detokenized text (needs a TokenText):
  // it stops as soon as the text contains one (when several complete at once, the one
  // that starts first; then the first listed). Empty strings are an error.
  std::vector<std::string> stop_strings;
};

struct GenerateResult {
  // Committed tokens, in order: every token through the one that completed a stop
  // string (its text is cut at the stop string), without a stop id.
  std::vector<int32_t> ids;
  std::string text;  // what the callback received, concatenated
  FinishReason finish = FinishReason::Length;
  int32_t stop_id = -1;     // the stop id that ended it (-1: none)
  std::string stop_string;  // the stop string that ended it (empty: none)
  int64_t prompt_tokens = 0;
  int64_t reused_tokens = 0;     // prompt tokens whose state was kept (SyncResult::reused)
  int64_t prefilled_tokens = 0;  // prompt tokens computed (a replay included): prompt - reused
  // Tokens the model produced: ids plus the stop id, if one ended it (tokens a
  // strategy returned after a stop are not counted).
  int64_t generated_tokens = 0;
  int64_t steps = 0;  // DecodingStrategy::next calls
  // Wall time of the prefill: the sync and the first next() call, i.e. up to the first
  // token (time to first token); and of the remaining calls (decode).
  double prefill_seconds = 0;
  double decode_seconds = 0;
};

// How the next tokens are chosen. The contract of one generate() call:
//
//   start(sampling)             once, first: the request's sampling options.
//   prefill(s, ids, n)          once: make s's state that of ids[0..n) (the prompt but its
//                               last token; n may be 0). Default: Session::sync (n = 0:
//                               back to position 0); a speculative strategy may override
//                               it, e.g. to take the taps of the prompt's last rows for
//                               its drafter. generate() checks s.tokens() afterwards.
//   next(s, anchor, limit, out) repeatedly, until the loop stops.
//
// next(): on entry, with C the committed tokens (the prompt and every token committed
// so far) and anchor == C.back(): s.tokens() == C without its last token (the anchor is
// not fed yet) and limit >= 1. It must append to `out` between 1 and `limit` new
// committed tokens t_1..t_r, in order, and leave s.tokens() == C + t_1..t_{r-1}: the
// anchor and every returned token but the last fed, t_r the new anchor, not fed. Rows
// fed beyond that (e.g. rejected drafts) must be rolled back (Session::rollback) before
// returning. `limit` is the fewest of the tokens max_tokens still allows and the tokens
// the session's capacity can still take (r tokens feed r rows). The plain strategy
// returns one token per call; a speculative one (DSpark: draft k tokens, verify the
// anchor and the drafts, 1 + k rows, in one Engine::step, accept a prefix j, roll back
// the rest) returns j + 1 (the accepted drafts and the correction / bonus token).
//
// The loop may keep only a prefix of the returned tokens (up to a stop id, through the
// token that completes a stop string) and then rolls the session back itself. generate() checks the position
// after every call and fails (dsx::Error) when a strategy breaks the contract.
class DecodingStrategy {
 public:
  virtual ~DecodingStrategy() = default;
  virtual void start(const SamplerOptions& sampling) = 0;
  virtual SyncResult prefill(Session& s, const int32_t* ids, int64_t n);
  virtual void next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) = 0;
};

// One token per call with Sampler::feed_and_pick's semantics: greedy at temperature 0
// on the backend (Session::feed_greedy, no logits leave the device), else the anchor's
// logits and Sampler::sample (temperature, top-k, top-p, the seeded generator).
class PlainDecoding final : public DecodingStrategy {
 public:
  PlainDecoding() = default;
  void start(const SamplerOptions& sampling) override;
  void next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) override;

 private:
  SamplerOptions opts_;
  Sampler sampler_{SamplerOptions{}};
  std::vector<float> logits_;
};

// Receives, after each decoding step, the text that became final and the ids the step
// committed (either may be empty, not both; the last call may carry only the text
// released at the end).
using GenerateCallback = std::function<void(std::string_view text, const std::vector<int32_t>& ids)>;

// The loop above. detok may be null (no text; stop_strings must then be empty),
// on_chunk empty, cancel null. The prompt must not be empty. Errors of the engine
// (ids outside the vocabulary, ...) and of the callback propagate.
//
// On return, s.tokens() is prompt + ids, or that without its last token when that one
// is the anchor (not fed), so that a later generate() on a prompt extending them reuses
// all of it; a cancellation before the prefill leaves the session untouched.
GenerateResult generate(Session& s, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                        DecodingStrategy& strategy, TokenText* detok = nullptr, const GenerateCallback& on_chunk = {},
                        CancelToken* cancel = nullptr);
// With a PlainDecoding.
GenerateResult generate(Session& s, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                        TokenText* detok = nullptr, const GenerateCallback& on_chunk = {},
                        CancelToken* cancel = nullptr);

}  // namespace dsx
