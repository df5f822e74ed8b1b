// The generation loop (generate.h): prefill, decoding steps through a strategy, stop
// ids / stop strings / max_tokens / capacity / cancellation, streamed text with the
// stop strings' hold-back.
#include "runtime/generate.h"

#include <algorithm>
#include <chrono>

#include "util/error.h"

namespace dsx {

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::Length: return "length";
    case FinishReason::Cancelled: return "cancelled";
  }
  return "?";
}

// ---- strategies ------------------------------------------------------------------------
SyncResult DecodingStrategy::prefill(Session& s, const int32_t* ids, int64_t n) {
  if (n > 0) return s.sync(ids, n);
  if (s.position() > 0) s.rollback(0);
  return SyncResult{};
}

void PlainDecoding::start(const SamplerOptions& sampling) {
  opts_ = sampling;
  sampler_ = Sampler(sampling);
}

void PlainDecoding::next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) {
  // (greedy does not read the logits buffer; sampling needs the vocabulary's size)
  const auto V = static_cast<size_t>(s.engine().config().vocab_size);
  if (opts_.temperature > 0.0f && logits_.size() != V) logits_.resize(V);
  out.push_back(sampler_.feed_and_pick(s, &anchor, 1, logits_));
}

// ---- stop strings ----------------------------------------------------------------------
namespace {

// The text not yet released and the stop strings' matching on it. Invariant: no stop
// string can start in released text. held_ is cut after each add() to its longest
// suffix that is a proper prefix of a stop string (every earlier position either holds
// a full match, which ends the text, or can no longer start one whatever follows).
class StopMatcher {
 public:
  explicit StopMatcher(const std::vector<std::string>& stops) : stops_(stops) {}
  // Appends t; returns the text that became final. After a match (matched() true) the
  // text is cut before the stop string and nothing more is released.
  std::string add(std::string_view t) {
    if (matched_ >= 0) return {};
    held_.append(t);
    size_t best = std::string::npos;
    for (size_t i = 0; i < stops_.size(); ++i) {
      const size_t p = held_.find(stops_[i]);
      if (p < best) best = p, matched_ = static_cast<int>(i);
    }
    if (matched_ >= 0) {
      std::string out = held_.substr(0, best);
      held_.clear();
      return out;
    }
    size_t hold = 0;
    for (const std::string& s : stops_) {
      for (size_t k = std::min(s.size() - 1, held_.size()); k > hold; --k)
        if (held_.compare(held_.size() - k, k, s, 0, k) == 0) {
          hold = k;
          break;
        }
    }
    std::string out = held_.substr(0, held_.size() - hold);
    held_.erase(0, held_.size() - hold);
    return out;
  }
  // End of the text: what is held is final.
  std::string finish() {
    std::string out;
    out.swap(held_);
    return out;
  }
  bool matched() const { return matched_ >= 0; }
  const std::string& match() const { return stops_[static_cast<size_t>(matched_)]; }

 private:
  const std::vector<std::string>& stops_;
  std::string held_;
  int matched_ = -1;
};

using Clock = std::chrono::steady_clock;
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

}  // namespace

// ---- the loop ----------------------------------------------------------------------------
GenerateResult generate(Session& s, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                        DecodingStrategy& strategy, TokenText* detok, const GenerateCallback& on_chunk,
                        CancelToken* cancel) {
  DSX_CHECK(!prompt.empty(), "generate: the prompt is empty");
  DSX_CHECK(opts.max_tokens >= 0, "generate: max_tokens must be >= 0 (got ", opts.max_tokens, ")");
  for (const std::string& st : opts.stop_strings) DSX_CHECK(!st.empty(), "generate: a stop string is empty");
  DSX_CHECK(opts.stop_strings.empty() || detok, "generate: stop strings need a detokenizer (TokenText)");
  std::vector<int32_t> stop_ids = opts.stop_ids;
  for (int32_t& id : stop_ids)
    if (id == GenerateOptions::kEos) id = s.engine().config().eos_id;
  auto is_stop_id = [&](int32_t id) { return std::find(stop_ids.begin(), stop_ids.end(), id) != stop_ids.end(); };

  GenerateResult r;
  const auto P = static_cast<int64_t>(prompt.size());
  r.prompt_tokens = P;
  if (cancel && cancel->cancelled()) {
    r.finish = FinishReason::Cancelled;
    return r;
  }
  const Clock::time_point t0 = Clock::now();
  strategy.start(opts.sampling);
  const SyncResult sr = strategy.prefill(s, prompt.data(), P - 1);
  DSX_CHECK(s.position() == P - 1 && std::equal(prompt.begin(), prompt.end() - 1, s.tokens().begin()),
            "generate: the decoding strategy's prefill left the session at position ", s.position(),
            " instead of the prompt without its last token (", P - 1, ")");
  r.reused_tokens = sr.reused;
  r.prefilled_tokens = P - sr.reused;

  StopMatcher stops(opts.stop_strings);
  auto emit = [&](const std::string& text, const std::vector<int32_t>& ids) {
    r.text += text;
    if (on_chunk && (!text.empty() || !ids.empty())) on_chunk(text, ids);
  };
  Clock::time_point t_first = t0;
  int32_t anchor = prompt.back();
  std::vector<int32_t> out, kept;
  std::string text;
  for (;;) {
    if (static_cast<int64_t>(r.ids.size()) >= opts.max_tokens) {
      r.finish = FinishReason::Length;
      break;
    }
    if (cancel && cancel->cancelled()) {
      r.finish = FinishReason::Cancelled;
      break;
    }
    const int64_t room = s.capacity() - s.position();
    if (room < 1) {
      r.finish = FinishReason::Length;
      break;
    }
    const int64_t limit = std::min(opts.max_tokens - static_cast<int64_t>(r.ids.size()), room);
    const int64_t pos0 = s.position();
    out.clear();
    strategy.next(s, anchor, limit, out);
    if (r.steps++ == 0) t_first = Clock::now();
    const auto n = static_cast<int64_t>(out.size());
    DSX_CHECK(n >= 1 && n <= limit, "generate: the decoding strategy returned ", n, " tokens (1 to ", limit,
              " allowed)");
    DSX_CHECK(s.position() == pos0 + n, "generate: the decoding strategy left the session at position ",
              s.position(), " after returning ", n, " tokens from position ", pos0, " (expected ", pos0 + n, ")");
    kept.clear();
    text.clear();
    bool done = false;
    for (int32_t t : out) {
      ++r.generated_tokens;
      if (is_stop_id(t)) {
        r.finish = FinishReason::Stop;
        r.stop_id = t;
        done = true;
        break;
      }
      r.ids.push_back(t);
      kept.push_back(t);
      if (detok) {
        text += stops.add(detok->push(t));
        if (stops.matched()) {
          r.finish = FinishReason::Stop;
          r.stop_string = stops.match();
          done = true;
          break;
        }
      }
    }
    emit(text, kept);
    if (done) break;
    anchor = out.back();
  }
  // the end of the text: what the detokenizer and the matcher hold
  if (detok) {
    std::string tail = detok->flush();
    if (!stops.matched()) {
      text = stops.add(tail);
      if (stops.matched()) {
        r.stop_string = stops.match();
        if (r.finish != FinishReason::Cancelled) r.finish = FinishReason::Stop;
      } else {
        text += stops.finish();
      }
      emit(text, {});
    }
  }
  // tokens the strategy fed beyond what was kept
  const int64_t end = P + static_cast<int64_t>(r.ids.size());
  if (s.position() > end) s.rollback(end);
  const Clock::time_point t1 = Clock::now();
  r.prefill_seconds = seconds(t0, r.steps ? t_first : t1);
  r.decode_seconds = r.steps ? seconds(t_first, t1) : 0.0;
  return r;
}

GenerateResult generate(Session& s, const std::vector<int32_t>& prompt, const GenerateOptions& opts,
                        TokenText* detok, const GenerateCallback& on_chunk, CancelToken* cancel) {
  PlainDecoding plain;
  return generate(s, prompt, opts, plain, detok, on_chunk, cancel);
}

}  // namespace dsx
