// dsx: incremental parser of sampled completions (spec chat-and-serving.md §3): separates reasoning, visible
// content and DSML tool calls, produces protocol-neutral streaming events, applies the hold-back rules of
// §3.2, the argument typing of §3.4 and the malformed-output policy of §3.5, maps outcomes to finish reasons
// (§3.8) and keeps the tool-call-id → exact-DSML replay map (§3.7).
//
// Usage (per request):
//   DsmlParser p(opts);
//   for each sampled token: events = p.push(decoded_bytes); forward events; if (p.should_stop()) stop;
//   events = p.finish(EndCause::Eos or EndCause::Length); forward; const ParseResult& r = p.result();
//
// Projection onto the wire protocols (§3.3), event by event:
//   ReasoningDelta  → OpenAI delta.reasoning_content | Anthropic thinking_delta | Responses reasoning text delta
//   ReasoningEnd    → (Anthropic: signature_delta + content_block_stop of the thinking block;
//                      Responses: reasoning item done). Absent when </think> never came (item "incomplete").
//   ContentDelta    → OpenAI delta.content | Anthropic text_delta | Responses output_text.delta
//   ToolCallStart   → OpenAI tool_calls[{index,id,type,function{name,arguments:""}}] | Anthropic
//                     content_block_start tool_use{id,name,input:{}} | Responses output_item.added function_call
//   ToolCallDelta   → OpenAI function.arguments fragment | Anthropic input_json_delta.partial_json |
//                     Responses function_call_arguments.delta. The fragments of one call concatenate to its
//                     final `arguments` (a JSON object text), byte for byte.
//   ToolCallEnd     → Anthropic content_block_stop | Responses function_call_arguments.done + output_item.done
//                     (text = the full arguments)
//   Error           → terminal protocol error (a tool block failed after a call header was streamed):
//                     OpenAI error event | Anthropic event: error | Responses response.failed.
// Events come in stream order; call i is complete (ToolCallEnd) before call i+1 starts.
#pragma once
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "text/chat.h"

namespace dsx::text {

// ---- finish reasons (§3.8) ------------------------------------------------------------------------------
enum class FinishReason { Stop, ToolCalls, Length, StopSequence };
const char* finish_reason_name(FinishReason r);      // "stop", "tool_calls", "length", "stop_sequence"
const char* openai_finish_reason(FinishReason r);    // stop | tool_calls | length | stop
const char* anthropic_stop_reason(FinishReason r);   // end_turn | tool_use | max_tokens | stop_sequence
struct ResponsesTerminal {
  const char* event;              // "response.completed" | "response.incomplete"
  const char* status;             // "completed" | "incomplete"
  const char* incomplete_reason;  // "max_output_tokens" or nullptr
};
ResponsesTerminal responses_terminal(FinishReason r);

enum class EndCause {
  Eos,     // EOS sampled (or any natural end)
  Length,  // max_tokens reached or context full
};

// ---- events ----------------------------------------------------------------------------------------------
enum class EventType { ReasoningDelta, ReasoningEnd, ContentDelta, ToolCallStart, ToolCallDelta, ToolCallEnd, Error };
const char* event_type_name(EventType t);

struct Event {
  EventType type = EventType::ContentDelta;
  std::string text;  // delta text (UTF-8, never a partial character); ToolCallEnd: full arguments; Error: message
  int index = -1;    // tool-call index within the completion
  std::string id;    // ToolCallStart / ToolCallEnd: call id
  std::string name;  // ToolCallStart / ToolCallEnd: tool name
};

// ---- result (non-streaming view) -------------------------------------------------------------------------
struct ParsedToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON object text, `{"k": "v", "n": 2}` style (keys/strings escaped as json.dumps)
};

struct ParseResult {
  std::string reasoning;
  bool reasoning_started = false;  // thinking mode, or a leading <think> was seen
  bool reasoning_closed = false;   // </think> was seen
  std::string content;
  std::vector<ParsedToolCall> tool_calls;
  FinishReason finish = FinishReason::Stop;
  std::string stop_sequence;   // the matched stop string (finish == StopSequence)
  bool stream_error = false;   // an Error event was emitted (streamed calls could not be completed)
  std::string error;           // its message
  std::vector<std::string> warnings;
  // The exact sampled DSML block (from the "\n\n" before the opener, or from '<' when there was none, to the
  // end of the block closer) when tool calls were parsed; segments mark tags trusted and values untrusted.
  std::string block_text;
  std::vector<Segment> block_segments;
};

// ---- exact-replay map (§3.7) -----------------------------------------------------------------------------
// id → the sampled DSML block of its assistant turn (shared by all ids of the turn). LRU-bounded by ids and
// bytes. Thread-safe.
class ReplayMap {
 public:
  explicit ReplayMap(size_t max_ids = 100000, size_t max_bytes = size_t(512) << 20);
  ReplayMap(const ReplayMap&) = delete;
  ReplayMap& operator=(const ReplayMap&) = delete;

  void remember(const std::vector<std::string>& ids, const std::vector<std::string>& names,
                std::vector<Segment> block);
  void remember(const ParseResult& r);  // no-op unless r has tool calls and a block
  // The stored block when every call id maps to the same block whose ids and names equal the calls' (in
  // order); nullopt otherwise (render canonically).
  std::optional<std::vector<Segment>> lookup(const std::vector<ToolCall>& calls);
  bool contains(std::string_view id) const;
  std::string new_id(std::string_view prefix);  // prefix + 32 hex, never an id present in the map
  size_t size() const;
  size_t bytes() const;

 private:
  struct Block {
    std::vector<Segment> segments;
    std::vector<std::string> ids;
    std::vector<std::string> names;
    size_t bytes = 0;
    size_t live = 0;  // ids of this block still in the map
  };
  struct Entry {
    std::shared_ptr<Block> block;
    std::list<std::string>::iterator lru;
  };
  void evict_locked();
  void erase_locked(const std::string& id);

  size_t max_ids_, max_bytes_;
  mutable std::mutex mu_;
  std::list<std::string> lru_;  // front = most recently used
  std::unordered_map<std::string, Entry> map_;
  size_t bytes_ = 0;
};

std::string random_hex(size_t nbytes);  // CSPRNG

// ---- parser ----------------------------------------------------------------------------------------------
struct ParserOptions {
  Profile profile = Profile::V41;
  bool thinking = true;          // the prompt ended with <think>
  bool tools_enabled = false;    // request offered tools and tool_choice != none: DSML is interpreted
  std::vector<ToolSpec> tools;   // schemas for argument typing (§3.4); may be empty
  std::vector<std::string> stop; // stop strings, matched on visible content only
  std::string id_prefix = "call_";        // "toolu_" for Anthropic
  std::function<std::string()> make_id;   // overrides id generation (tests)
  ReplayMap* replay = nullptr;            // ids avoid it; a closed block is remembered in it
  size_t max_tag_bytes = 4096;            // a DSML tag longer than this is malformed
};

class DsmlParser {
 public:
  explicit DsmlParser(ParserOptions opts);
  ~DsmlParser();
  DsmlParser(const DsmlParser&) = delete;
  DsmlParser& operator=(const DsmlParser&) = delete;

  // Feed sampled bytes (any split, including inside markers and inside UTF-8 characters).
  std::vector<Event> push(std::string_view bytes);
  // End of generation. Flushes held text and finalizes result(). Further push/finish calls are no-ops.
  std::vector<Event> finish(EndCause cause);
  // True once generation should stop: the tool block closed, a stop string matched, or the stream failed.
  bool should_stop() const;
  bool finished() const;
  const ParseResult& result() const;  // complete after finish()

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One-shot: feed `text` in one piece and finish.
ParseResult parse_completion(std::string_view text, const ParserOptions& opts, EndCause cause = EndCause::Eos);

}  // namespace dsx::text
