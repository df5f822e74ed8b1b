// What the three wire APIs (OpenAI chat completions, Anthropic messages, OpenAI
// responses) share inside the server: a protocol-neutral generation request, the
// usage and error values, and the Sink through which the engine's output (the DSML
// parser's protocol-neutral events, text/dsml.h) goes back to one API's wire format.
//
// Per API, an adapter (api_chat.cpp, api_messages.cpp, api_responses.cpp) provides:
//   - parse: the request body -> GenRequest, or an ApiError in that API's shape;
//   - a Sink that turns the events into that API's SSE stream, or into its one JSON
//     answer when not streaming, written to a Channel (channel.h) that the HTTP layer
//     drains into the response.
// The HTTP layer (http.cpp) renders and tokenizes the conversation (text/chat.h), hands
// the prompt to the scheduler (scheduler.h), which runs prefill and decode and calls the
// Sink on its thread, in this order: start once, then events / keepalive any number of
// times, then exactly one of end or fail (fail may also come before start).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/sampler.h"
#include "text/chat.h"
#include "text/dsml.h"

namespace dsx::server {

// A request the engine can run, whichever API it came from.
struct GenRequest {
  std::string api;    // "chat" | "messages" | "responses" (for logs and metrics)
  std::string model;  // echoed back (any id is served by the loaded model)
  text::Conversation conv;
  bool thinking = true;      // the model's thinking mode (spec chat-and-serving.md §4.5)
  text::Effort effort;       // Default = the server's default effort
  bool tools_enabled = true; // tool_choice != "none"
  // tool_choice: "auto" | "none" | "required" | a tool's name (forced call)
  std::string tool_choice = "auto";
  std::optional<text::pyjson::Value> response_format;  // json_schema / json_object, if asked
  bool stream = false;
  bool include_usage = false;  // chat: stream_options.include_usage
  int64_t max_tokens = 0;      // 0: until the context is full
  SamplerOptions sampling;     // temperature 0: greedy
  bool sampling_given = false; // the client set temperature / top_p / top_k
  std::vector<std::string> stop;
  std::string id_prefix = "call_";  // tool-call ids ("toolu_" for Anthropic, "fc_" / "call_" for responses)
  std::string session_hint;         // a client's conversation key (x-session-affinity, prompt_cache_key, ...)
};

struct Usage {
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;      // prompt tokens served from a kept state (prefix reuse)
  int64_t completion_tokens = 0;  // tokens generated (reasoning included)
  int64_t reasoning_tokens = 0;   // of which inside the reasoning
};

// An error answered to the client. status < 500 for anything the client can fix, with
// type invalid_request_error (opencode retries 5xx and server_error forever).
struct ApiError {
  int status = 400;
  std::string type = "invalid_request_error";
  std::string message;
  std::string code;   // e.g. "context_length_exceeded"
  std::string param;  // e.g. "messages"
};

class Sink {
 public:
  virtual ~Sink() = default;
  // The prompt was admitted: prompt-side usage (prompt_tokens, cached_tokens).
  virtual void start(const Usage& u) = 0;
  virtual void events(const std::vector<text::Event>& ev) = 0;
  // A long prefill is still running: keep the stream alive (an SSE comment or ping).
  virtual void keepalive() = 0;
  // The completion: the parse result (reasoning, content, tool calls, finish) and the
  // full usage.
  virtual void end(const text::ParseResult& r, const Usage& u) = 0;
  virtual void fail(const ApiError& e) = 0;
  // The client went away (the HTTP layer could not write): the scheduler stops the job.
  virtual bool cancelled() const = 0;
};

// JSON nesting accepted in a request body. Deeper bodies are refused (a 400 "invalid JSON:
// nested deeper than ... levels") before any parser sees them: nlohmann's DOM parser
// copies nested values recursively and the tool-schema re-serializers recurse, so a few
// hundred KB of brackets would otherwise overflow the stack. Real requests nest < 30.
constexpr int kMaxRequestDepth = 200;

// Whether the JSON text s nests at most `max` arrays / objects deep (brackets inside
// strings do not count; s need not be valid JSON).
inline bool json_depth_ok(std::string_view s, int max = kMaxRequestDepth) {
  int d = 0;
  bool in_str = false, esc = false;
  for (char c : s) {
    if (in_str) {
      if (esc) esc = false;
      else if (c == '\\') esc = true;
      else if (c == '"') in_str = false;
    } else if (c == '"') {
      in_str = true;
    } else if (c == '[' || c == '{') {
      if (++d > max) return false;
    } else if (c == ']' || c == '}') {
      --d;
    }
  }
  return true;
}

}  // namespace dsx::server
