// Fuzzing the server's request handling (everything a request goes through before the
// model): mutated request bodies, made from the shapes the real agents send
// (../shared/agents/README.md), go through the adapter's parse and, when it succeeds,
// through the rendering and tokenization that src/server/http.cpp does; when parse fails
// the ApiError must be a well-formed 4xx in that API's shape. For a fraction of the
// accepted requests the adapter's Sink is driven with a valid event sequence (a random
// completion fed through the DSML parser, as the scheduler does) and every SSE data line /
// the JSON body must parse. Nothing may throw out of these calls except dsx::Error from
// the renderer (which the HTTP layer answers with a 400).
//
// Endpoints: /v1/chat/completions (opencode), /v1/messages (Claude Code),
// /v1/messages/count_tokens, /v1/responses (Codex).
//
// DSX_FUZZ_ITERS: mutated bodies per endpoint (default 5000; scripts/fuzz-server.sh runs
// 100000 under ASan/UBSan). DSX_FUZZ_SEED: the seed (printed). Iteration i of an endpoint
// draws from its own generator seeded by (seed, endpoint, i); what carries over between
// iterations is the replay map and the tool-call ids the sinks handed out (which mutations
// put back into histories), so a run is reproducible from its seed (up to ids the adapters
// draw themselves for history entries without one). DSX_FUZZ_MAX_DEPTH caps
// the nesting depth the mutations write (default 100000). A failing body is saved
// under /tmp (DSX_FUZZ_DIR overrides); a crash or sanitizer report leaves the body being
// processed in $DSX_FUZZ_DIR/dsx-server-fuzz-crash.json (and its iteration on stderr).
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_UNDEFINED__)
#define DSX_FUZZ_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define DSX_FUZZ_SANITIZED 1
#endif
#endif
#if defined(DSX_FUZZ_SANITIZED) && __has_include(<sanitizer/common_interface_defs.h>)
#include <sanitizer/common_interface_defs.h>
#define DSX_FUZZ_DEATH_CALLBACK 1
#endif

#include "server/adapters.h"
#include "server/api_messages.h"
#include "server/signing.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

using namespace dsx;
using namespace dsx::server;
using J = nlohmann::ordered_json;

namespace {

// ---- settings -------------------------------------------------------------------------------------------

uint64_t fuzz_seed() {
  if (const char* s = std::getenv("DSX_FUZZ_SEED")) return std::strtoull(s, nullptr, 10);
  return 0x5e7e7f22;
}

int64_t fuzz_iters() {
  if (const char* s = std::getenv("DSX_FUZZ_ITERS")) return std::max<int64_t>(1, std::strtoll(s, nullptr, 10));
  return 5000;
}

// The deepest nesting the mutations write (DSX_FUZZ_MAX_DEPTH; default 100000, as deep as a
// body of a few hundred KB can go).
size_t fuzz_max_depth() {
  if (const char* s = std::getenv("DSX_FUZZ_MAX_DEPTH")) return std::strtoull(s, nullptr, 10);
  return 100000;
}

std::string fuzz_dir() {
  if (const char* d = std::getenv("DSX_FUZZ_DIR")) return d;
  return "/tmp";
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// ---- the body being processed, left behind on a crash ----------------------------------------------------

const std::string* g_current = nullptr;
char g_crash_path[512] = {0};
char g_where[160] = {0};

void dump_current() {  // async-signal-safe: open / write / close only
  if (!g_current || !g_crash_path[0]) return;
  if (g_where[0]) {
    (void)!::write(2, g_where, std::strlen(g_where));
    (void)!::write(2, g_crash_path, std::strlen(g_crash_path));
    (void)!::write(2, "\n", 1);
  }
  const int fd = ::open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  const char* p = g_current->data();
  size_t left = g_current->size();
  while (left > 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w <= 0) break;
    p += w;
    left -= static_cast<size_t>(w);
  }
  ::close(fd);
}

#if !defined(DSX_FUZZ_SANITIZED)
void on_fatal_signal(int sig) {
  dump_current();
  ::raise(sig);  // (SA_RESETHAND: the default action now)
}
#endif

void install_crash_hooks() {
  static bool done = false;
  if (done) return;
  done = true;
  std::snprintf(g_crash_path, sizeof g_crash_path, "%s/dsx-server-fuzz-crash.json", fuzz_dir().c_str());
#if defined(DSX_FUZZ_DEATH_CALLBACK)
  __sanitizer_set_death_callback(&dump_current);
#elif !defined(DSX_FUZZ_SANITIZED)
  // on an alternate stack, so that a stack overflow still leaves the body behind
  static std::vector<char> alt(1 << 16);
  stack_t ss{};
  ss.ss_sp = alt.data();
  ss.ss_size = alt.size();
  ::sigaltstack(&ss, nullptr);
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) {
    struct sigaction sa {};
    sa.sa_handler = &on_fatal_signal;
    sa.sa_flags = SA_ONSTACK | SA_RESETHAND;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
#endif
}

struct CurrentBody {
  explicit CurrentBody(const std::string& b) { g_current = &b; }
  ~CurrentBody() { g_current = nullptr; }
};

// ---- the server's pieces --------------------------------------------------------------------------------

constexpr const char* kSecret = "a3f1c0de5eed00112233445566778899a3f1c0de5eed00112233445566778899";
constexpr int64_t kContext = 65536;

text::ReplayMap& replay_map() {
  static text::ReplayMap m(20000, size_t(64) << 20);
  return m;
}

const AdapterContext& ctx() {
  static const AdapterContext c = [] {
    AdapterContext a;
    a.replay = &replay_map();
    a.secret = kSecret;
    a.model_id = "deepseek-v4.1-flash";
    a.context_tokens = kContext;
    return a;
  }();
  return c;
}

const text::Tokenizer* tokenizer() {
  static std::unique_ptr<text::Tokenizer> t = []() -> std::unique_ptr<text::Tokenizer> {
    const std::string g = dsx_test::golden_dir();
    if (g.empty()) return nullptr;
    const std::string path = g + "/tokenizer/tokenizer-v41.json";
    if (!std::ifstream(path).good()) return nullptr;
    return std::make_unique<text::Tokenizer>(text::Tokenizer::from_file(path));
  }();
  return t.get();
}

#define REQUIRE_TOKENIZER()                                                                        \
  if (!tokenizer()) GTEST_SKIP() << "tokenizer-v41.json not found under the golden dir (../shared/golden)"

enum class Endpoint { Chat, Messages, CountTokens, Responses };

const char* endpoint_path(Endpoint e) {
  switch (e) {
    case Endpoint::Chat: return "/v1/chat/completions";
    case Endpoint::Messages: return "/v1/messages";
    case Endpoint::CountTokens: return "/v1/messages/count_tokens";
    case Endpoint::Responses: return "/v1/responses";
  }
  return "?";
}

const char* endpoint_tag(Endpoint e) {
  switch (e) {
    case Endpoint::Chat: return "chat";
    case Endpoint::Messages: return "messages";
    case Endpoint::CountTokens: return "count_tokens";
    case Endpoint::Responses: return "responses";
  }
  return "?";
}

const Adapter& adapter_of(Endpoint e) {
  switch (e) {
    case Endpoint::Chat: return chat_adapter();
    case Endpoint::Responses: return responses_adapter();
    default: return messages_adapter();
  }
}

bool anthropic(Endpoint e) { return e == Endpoint::Messages || e == Endpoint::CountTokens; }

// ---- checks of what goes back to the client (each returns "" or what is wrong) ---------------------------

std::optional<J> parse_json(std::string_view s) {
  J j = J::parse(s.begin(), s.end(), nullptr, false);
  if (j.is_discarded()) return std::nullopt;
  return j;
}

std::string str_member(const J& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || !it->is_string()) return {};
  return it->get<std::string>();
}

// An error body in the API's shape: Anthropic {"type":"error","error":{"type","message"}},
// OpenAI {"error":{"message","type",...}}.
std::string check_error_body(bool anth, const std::string& body) {
  auto j = parse_json(body);
  if (!j) return "error body is not valid JSON: " + body.substr(0, 300);
  if (!j->is_object()) return "error body is not an object";
  auto e = j->find("error");
  if (e == j->end() || !e->is_object()) return "error body has no error object: " + body.substr(0, 300);
  if (anth && str_member(*j, "type") != "error") return "Anthropic error body without type \"error\"";
  if (str_member(*e, "message").empty()) return "error body with an empty or missing message: " + body.substr(0, 300);
  if (str_member(*e, "type").empty()) return "error body with an empty or missing type: " + body.substr(0, 300);
  return {};
}

// A parse / render rejection: a 4xx the client can fix, not one opencode retries forever.
std::string check_api_error(Endpoint ep, const ApiError& err) {
  if (err.status < 400 || err.status > 499) return "status " + std::to_string(err.status) + " is not a 4xx";
  if (err.message.empty()) return "empty error message";
  if (err.type == "server_error" || err.type == "api_error") return "a 4xx of type " + err.type;
  return check_error_body(anthropic(ep), adapter_of(ep).error_body(err));
}

struct SseCheck {
  std::string problem;
  bool finished = false;  // a terminal event came (chat finish_reason / [DONE], message_stop, response.*)
  bool errored = false;   // an error event came
  int events = 0;
};

// Every block "event: T\ndata: {...}" (data.type == T) or "data: {...}" or a comment; the
// text ends at a block boundary.
SseCheck check_sse(Endpoint ep, const std::string& s) {
  SseCheck c;
  size_t pos = 0;
  int64_t last_seq = -1;
  bool after_terminal = false;
  while (pos < s.size()) {
    const size_t end = s.find("\n\n", pos);
    if (end == std::string::npos) {
      c.problem = "unterminated SSE block (or not SSE) at byte " + std::to_string(pos) + ": " + s.substr(pos, 160);
      return c;
    }
    const std::string block = s.substr(pos, end - pos);
    pos = end + 2;
    if (block.empty()) {
      c.problem = "empty SSE block";
      return c;
    }
    if (block[0] == ':') {
      if (block.find('\n') != std::string::npos) c.problem = "multi-line SSE comment";
      continue;
    }
    std::string event, data;
    bool has_data = false;
    size_t lp = 0;
    while (lp <= block.size()) {
      size_t nl = block.find('\n', lp);
      if (nl == std::string::npos) nl = block.size();
      const std::string line = block.substr(lp, nl - lp);
      lp = nl + 1;
      if (line.rfind("event: ", 0) == 0) {
        event = line.substr(7);
      } else if (line.rfind("data: ", 0) == 0) {
        if (has_data) {
          c.problem = "two data lines in one SSE block";
          return c;
        }
        has_data = true;
        data = line.substr(6);
      } else {
        c.problem = "not an SSE line: " + line.substr(0, 200);
        return c;
      }
    }
    if (!has_data) {
      c.problem = "SSE block without data: " + block.substr(0, 200);
      return c;
    }
    if (after_terminal) {
      c.problem = "SSE data after the terminal event: " + block.substr(0, 200);
      return c;
    }
    ++c.events;
    if (ep == Endpoint::Chat && data == "[DONE]") {
      c.finished = true;
      after_terminal = true;
      continue;
    }
    auto j = parse_json(data);
    if (!j) {
      c.problem = "SSE data is not valid JSON: " + data.substr(0, 300);
      return c;
    }
    if (!j->is_object()) {
      c.problem = "SSE data is not an object";
      return c;
    }
    if (ep == Endpoint::Chat) {
      if (!event.empty()) {
        c.problem = "chat SSE with an event line";
        return c;
      }
      if (j->contains("error")) {
        if (std::string p = check_error_body(false, data); !p.empty()) {
          c.problem = "chat stream error: " + p;
          return c;
        }
        c.errored = true;
        after_terminal = true;
        continue;
      }
      if (str_member(*j, "object") != "chat.completion.chunk") {
        c.problem = "chat chunk without object chat.completion.chunk: " + data.substr(0, 200);
        return c;
      }
      auto ch = j->find("choices");
      if (ch == j->end() || !ch->is_array()) {
        c.problem = "chat chunk without choices";
        return c;
      }
      for (const auto& x : *ch) {
        auto f = x.find("finish_reason");
        if (f != x.end() && f->is_string()) c.finished = true;
      }
    } else {
      const std::string type = str_member(*j, "type");
      if (event.empty() || type != event) {
        c.problem = "SSE event '" + event + "' with data.type '" + type + "'";
        return c;
      }
      if (ep == Endpoint::Responses) {
        auto sq = j->find("sequence_number");
        if (sq == j->end() || !sq->is_number_integer() || sq->get<int64_t>() <= last_seq) {
          c.problem = "responses event without an increasing sequence_number: " + data.substr(0, 200);
          return c;
        }
        last_seq = sq->get<int64_t>();
        if (type == "response.completed" || type == "response.incomplete" || type == "response.failed") {
          c.finished = true;
          c.errored = type == "response.failed";
          after_terminal = true;
        } else if (type == "error") {
          c.errored = true;
        }
      } else {
        if (type == "message_stop") {
          c.finished = true;
          after_terminal = true;
        } else if (type == "error") {
          if (std::string p = check_error_body(true, data); !p.empty()) {
            c.problem = "messages stream error: " + p;
            return c;
          }
          c.errored = true;
          after_terminal = true;
        }
      }
    }
  }
  return c;
}

// A non-streaming answer: JSON; a 200 in the API's answer shape, else an error in its shape.
std::string check_json_answer(Endpoint ep, int status, const std::string& body) {
  if (status >= 400) {
    if (status > 599) return "status " + std::to_string(status);
    return check_error_body(anthropic(ep), body);
  }
  if (status != 200) return "status " + std::to_string(status);
  auto j = parse_json(body);
  if (!j) return "answer is not valid JSON: " + body.substr(0, 300);
  if (!j->is_object()) return "answer is not an object";
  switch (ep) {
    case Endpoint::Chat: {
      if (str_member(*j, "object") != "chat.completion") return "chat answer without object chat.completion";
      auto ch = j->find("choices");
      if (ch == j->end() || !ch->is_array() || ch->empty()) return "chat answer without choices";
      if (str_member((*ch)[0], "finish_reason").empty()) return "chat answer without finish_reason";
      break;
    }
    case Endpoint::Responses: {
      if (str_member(*j, "object") != "response") return "responses answer without object response";
      auto out = j->find("output");
      if (out == j->end() || !out->is_array()) return "responses answer without output";
      if (str_member(*j, "status").empty()) return "responses answer without status";
      break;
    }
    default: {
      if (str_member(*j, "type") != "message") return "messages answer without type message";
      auto c = j->find("content");
      if (c == j->end() || !c->is_array()) return "messages answer without content";
      if (str_member(*j, "stop_reason").empty()) return "messages answer without stop_reason";
      break;
    }
  }
  return {};
}

// ---- seeds: the request shapes of the real agents -------------------------------------------------------

J claude_tools() {
  return J::parse(R"([
    {"name":"Bash","description":"Executes a given bash command and returns its output.\n\nIMPORTANT: avoid `find`.",
     "input_schema":{"$schema":"https://json-schema.org/draft/2020-12/schema","type":"object",
       "properties":{"command":{"type":"string","description":"The command to execute"},
                     "timeout":{"type":"number","description":"Optional timeout in milliseconds, at most 600000"},
                     "description":{"type":"string"},
                     "run_in_background":{"type":"boolean"}},
       "required":["command"],"additionalProperties":false}},
    {"name":"Read","description":"Reads a file from the local filesystem.",
     "input_schema":{"$schema":"https://json-schema.org/draft/2020-12/schema","type":"object",
       "properties":{"file_path":{"type":"string"},"offset":{"type":"integer","minimum":0},
                     "limit":{"type":"integer","exclusiveMinimum":0}},
       "required":["file_path"],"additionalProperties":false}},
    {"name":"Edit","description":"Performs exact string replacements in files.",
     "input_schema":{"type":"object","properties":{"file_path":{"type":"string"},"old_string":{"type":"string"},
       "new_string":{"type":"string"},"replace_all":{"type":"boolean","default":false}},
       "required":["file_path","old_string","new_string"],"additionalProperties":false}},
    {"name":"TaskCreate","description":"Create a task.",
     "input_schema":{"type":"object","properties":{"tasks":{"type":"array","items":{"type":"object",
       "properties":{"content":{"type":"string"},"status":{"type":"string","enum":["pending","in_progress","completed"]}},
       "required":["content","status"]}}},"required":["tasks"]}}
  ])");
}

J claude_system() {
  return J::parse(R"([
    {"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197.a1b; cc_entrypoint=sdk-cli; cch=00000;"},
    {"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude.","cache_control":{"type":"ephemeral"}},
    {"type":"text","text":"You are an interactive agent that helps users with software engineering tasks. Use the instructions below and the tools available to you to assist the user.\n\n# Tone and style\n- Only use emojis if the user explicitly requests it. 👍\n- Your responses should be short and concise.","cache_control":{"type":"ephemeral"}}
  ])");
}

J claude_first_turn() {
  J r = J::object();
  r["model"] = "dsx-v4-flash";
  r["max_tokens"] = 32000;
  r["stream"] = true;
  r["system"] = claude_system();
  r["messages"] = J::parse(R"([
    {"role":"user","content":[
      {"type":"text","text":"<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# currentDate\nToday's date is 2026-12-01.\n</system-reminder>\n"},
      {"type":"text","text":"say hi","cache_control":{"type":"ephemeral"}}]},
    {"role":"system","content":"# Environment\nYou have been invoked in the following environment:\n - Primary working directory: /tmp/x\n - Is a git repository: false\n - Platform: linux"}
  ])");
  r["tools"] = claude_tools();
  r["thinking"] = J{{"type", "adaptive"}};
  r["output_config"] = J{{"effort", "high"}};
  r["context_management"] = J::parse(R"({"edits":[{"type":"clear_thinking_20251015","keep":"all"}]})");
  r["metadata"] = J{{"user_id", "{\"device_id\":\"0f3a\",\"account_uuid\":\"\",\"session_id\":\"5b1e\"}"}};
  return r;
}

// The follow-up after a tool call: the thinking block comes back with this server's signature.
J claude_tool_round_trip() {
  J r = claude_first_turn();
  const std::string thinking = "The user wants me to run echo. I'll use the Bash tool.";
  J assistant = {{"role", "assistant"},
                 {"content",
                  J::array({J{{"type", "thinking"}, {"thinking", thinking}, {"signature", mac_hex(kSecret, thinking)}},
                            J{{"type", "text"}, {"text", "I'll run it."}},
                            J{{"type", "tool_use"},
                              {"id", "toolu_01A09q90qw90lq917835lq9"},
                              {"name", "Bash"},
                              {"input", {{"command", "echo dsx-tool-ok"}, {"description", "Print a marker"}}}}})}};
  J result = {{"role", "user"},
              {"content",
               J::array({J{{"type", "tool_result"},
                           {"tool_use_id", "toolu_01A09q90qw90lq917835lq9"},
                           {"content", "dsx-tool-ok\n"},
                           {"is_error", false},
                           {"cache_control", {{"type", "ephemeral"}}}}})}};
  r["messages"].push_back(assistant);
  r["messages"].push_back(result);
  // a second, denied call with block content and a redacted thinking block
  J assistant2 = {{"role", "assistant"},
                  {"content",
                   J::array({J{{"type", "redacted_thinking"}, {"data", "EmwKAhgBEgy3va3pzix/LafPsn4a"}},
                             J{{"type", "tool_use"},
                               {"id", "toolu_02"},
                               {"name", "Edit"},
                               {"input", {{"file_path", "/tmp/x/a.txt"}, {"old_string", "a"}, {"new_string", "b"}}}}})}};
  J result2 = {{"role", "user"},
               {"content",
                J::array({J{{"type", "tool_result"},
                            {"tool_use_id", "toolu_02"},
                            {"content", J::array({J{{"type", "text"}, {"text", "Permission to use Edit has been denied."}}})},
                            {"is_error", true}},
                          J{{"type", "text"}, {"text", "try again with Bash"}}})}};
  r["messages"].push_back(assistant2);
  r["messages"].push_back(result2);
  return r;
}

// --model claude-sonnet-4-5: the classic shape (thinking enabled with a budget, no system message).
J claude_classic() {
  J r = J::object();
  r["model"] = "claude-sonnet-4-5";
  r["max_tokens"] = 32000;
  r["stream"] = true;
  r["system"] = claude_system();
  r["messages"] = J::parse(R"([{"role":"user","content":[{"type":"text","text":"<system-reminder>ctx</system-reminder>"},
    {"type":"text","text":"list the files"},{"type":"text","text":"in /tmp"},{"type":"text","text":"please"}]}])");
  r["tools"] = claude_tools();
  r["thinking"] = J{{"type", "enabled"}, {"budget_tokens", 31999}};
  r["metadata"] = J{{"user_id", "u"}};
  return r;
}

// @ai-sdk/anthropic (opencode pointed at /v1/messages): no beta features, tool_choice auto, no thinking,
// not streaming; plus sampling fields and a prefill.
J aisdk_anthropic() {
  J r = J::object();
  r["model"] = "dsx-v4-flash";
  r["max_tokens"] = 4096;
  r["system"] = J::array({J{{"type", "text"}, {"text", "You are opencode."}, {"cache_control", {{"type", "ephemeral"}}}}});
  r["messages"] = J::parse(R"([{"role":"user","content":"write a haiku about json"},
    {"role":"assistant","content":[{"type":"text","text":"Braces"}]}])");
  r["tools"] = J::array({claude_tools()[0]});
  r["tool_choice"] = J{{"type", "auto"}, {"disable_parallel_tool_use", false}};
  r["temperature"] = 0.7;
  r["top_p"] = 0.95;
  r["top_k"] = 40;
  r["stop_sequences"] = J::array({"\n\nHuman:", "END"});
  r["stream"] = false;
  return r;
}

J claude_server_tools() {
  J r = claude_first_turn();
  r["stream"] = false;
  r["tools"].push_back(J{{"type", "web_search_20250305"}, {"name", "web_search"}, {"max_uses", 5}});
  r["tools"].push_back(J{{"type", "bash_20250124"}, {"name", "bash"}});
  r["tool_choice"] = J{{"type", "tool"}, {"name", "Read"}};
  r["thinking"] = J{{"type", "disabled"}};
  return r;
}

std::vector<J> messages_seeds() {
  return {claude_first_turn(), claude_tool_round_trip(), claude_classic(), aisdk_anthropic(), claude_server_tools()};
}

std::vector<J> count_tokens_seeds() {
  std::vector<J> out;
  for (J r : messages_seeds()) {
    r.erase("max_tokens");
    r.erase("stream");
    r.erase("metadata");
    out.push_back(std::move(r));
  }
  out.push_back(J::parse(R"({"model":"dsx-v4-flash","messages":[{"role":"user","content":"Hello, world"}]})"));
  return out;
}

J opencode_tools() {
  return J::parse(R"([
    {"type":"function","function":{"name":"bash","description":"Executes a given bash command in a persistent shell session.",
      "parameters":{"type":"object","properties":{"command":{"type":"string","description":"The command to execute"},
        "timeout":{"type":"number","description":"Optional timeout in milliseconds"},
        "workdir":{"type":"string"},"description":{"type":"string"}},
        "required":["command","description"],"additionalProperties":false,"$schema":"http://json-schema.org/draft-07/schema#"}}},
    {"type":"function","function":{"name":"read","description":"Read a file.",
      "parameters":{"type":"object","properties":{"filePath":{"type":"string"},"offset":{"type":"number"},"limit":{"type":"number"}},
        "required":["filePath"],"additionalProperties":false}}},
    {"type":"function","function":{"name":"todowrite","description":"Write the todo list.",
      "parameters":{"type":"object","properties":{"todos":{"type":"array","items":{"type":"object",
        "properties":{"content":{"type":"string"},"status":{"type":"string"},"priority":{"type":"string"},"id":{"type":"string"}},
        "required":["content","status","priority","id"]}}},"required":["todos"]}}},
    {"type":"function","function":{"name":"webfetch","description":"Fetch a URL.",
      "parameters":{"type":"object","properties":{"url":{"type":"string","format":"uri"},
        "format":{"type":"string","enum":["text","markdown","html"]},"timeout":{"type":"number","maximum":120}},
        "required":["url","format"]}}}
  ])");
}

J opencode_title() {
  return J::parse(R"({"model":"dsx-v4-flash","messages":[
    {"role":"system","content":"You are a title generator. You output ONLY a thread title. Nothing else.\n\n<task>\nGenerate a brief title\n</task>"},
    {"role":"user","content":"Generate a title for this conversation:\n"},
    {"role":"user","content":"\"say hi\""}],
    "max_tokens":32000,"temperature":0.5,"reasoning_effort":"low","stream":true,"stream_options":{"include_usage":true}})");
}

J opencode_agent() {
  J r = J::object();
  r["model"] = "dsx-v4-flash";
  r["messages"] = J::parse(R"([
    {"role":"system","content":"You are opencode, an interactive CLI tool that helps users with software engineering tasks.\n\n# Tool usage\n- Prefer the read tool.\n<env>\n  Working directory: /tmp/x\n  Platform: linux\n  Today's date: Tue Dec 01 2026\n</env>"},
    {"role":"user","content":"run echo dsx-tool-ok"}])");
  r["tools"] = opencode_tools();
  r["tool_choice"] = "auto";
  r["stream"] = true;
  r["stream_options"] = J{{"include_usage", true}};
  r["max_tokens"] = 32000;
  return r;
}

J opencode_history() {
  J r = opencode_agent();
  r["reasoning_effort"] = "high";
  r["messages"].push_back(J::parse(R"({"role":"assistant","content":"","reasoning_content":"The user wants a shell command run. I'll call bash.",
    "tool_calls":[{"id":"call_00_a1b2c3","type":"function","function":{"name":"bash","arguments":"{\"command\":\"echo dsx-tool-ok\",\"description\":\"Print marker\"}"}},
                  {"id":"call_01_d4e5f6","type":"function","function":{"name":"read","arguments":"{\"filePath\":\"/tmp/x/a.txt\",\"limit\":2000}"}}]})"));
  r["messages"].push_back(J::parse(R"({"role":"tool","tool_call_id":"call_00_a1b2c3","content":"dsx-tool-ok\n"})"));
  r["messages"].push_back(J::parse(R"({"role":"tool","tool_call_id":"call_01_d4e5f6","content":[{"type":"text","text":"<file>\n00001| a\n</file>"}]})"));
  r["messages"].push_back(J::parse(R"({"role":"assistant","content":"Done: it printed dsx-tool-ok.","reasoning_content":"It worked."})"));
  r["messages"].push_back(J::parse(R"({"role":"user","content":[{"type":"text","text":"now summarise"},{"type":"text","text":"briefly"}]})"));
  return r;
}

J chat_structured() {
  return J::parse(R"({"model":"deepseek-chat","stream":false,
    "messages":[{"role":"developer","content":"Answer in JSON."},{"role":"user","content":"Three primes?"},
                {"role":"assistant","content":null,"tool_calls":[{"id":"call_9","type":"function","function":{"name":"bash","arguments":{"command":"seq 3"}}}]},
                {"role":"tool","tool_call_id":"call_9","content":"1\n2\n3"}],
    "tools":[{"type":"function","function":{"name":"bash","parameters":{"type":"object","properties":{"command":{"type":"string"}}}}}],
    "tool_choice":{"type":"function","function":{"name":"bash"}},
    "response_format":{"type":"json_schema","json_schema":{"name":"primes","strict":true,
      "schema":{"type":"object","properties":{"primes":{"type":"array","items":{"type":"integer"}}},"required":["primes"]}}},
    "temperature":0,"top_p":1,"stop":["\n\n\n"],"seed":7,"n":1,"thinking":{"type":"disabled"}})");
}

std::vector<J> chat_seeds() { return {opencode_title(), opencode_agent(), opencode_history(), chat_structured()}; }

J codex_tools() {
  return J::parse(R"([
    {"type":"function","name":"exec_command","description":"Runs a command in a PTY, returning output or a session ID.",
     "strict":false,"parameters":{"type":"object","properties":{"cmd":{"type":"string","description":"Shell command to execute."},
       "workdir":{"type":"string"},"shell":{"type":"string"},"tty":{"type":"boolean"},"login":{"type":"boolean"},
       "yield_time_ms":{"type":"number"},"max_output_tokens":{"type":"number"},"justification":{"type":"string"},
       "sandbox_permissions":{"type":"string"},"prefix_rule":{"type":"array","items":{"type":"string"}}},
       "required":["cmd"],"additionalProperties":false}},
    {"type":"function","name":"write_stdin","description":"Writes characters to an existing session.","strict":false,
     "parameters":{"type":"object","properties":{"session_id":{"type":"number"},"chars":{"type":"string"}},"required":["session_id"],"additionalProperties":false}},
    {"type":"function","name":"update_goal","description":"Update the goal.","strict":false,
     "parameters":{"type":"object","properties":{"status":{"type":"string","enum":["active","complete"]}},"required":["status"],"additionalProperties":false}},
    {"type":"namespace","name":"multi_agent_v1","description":"Tools to manage sub-agents.","tools":[
      {"type":"function","name":"spawn_agent","description":"Spawns an agent.","strict":false,
       "parameters":{"type":"object","properties":{"message":{"type":"string"},"agent_type":{"type":"string"}},"required":["message"]}},
      {"type":"function","name":"wait_agent","description":"Waits for agents.","strict":false,
       "parameters":{"type":"object","properties":{"ids":{"type":"array","items":{"type":"string"}},"timeout_ms":{"type":"number"}}}}]},
    {"type":"web_search","external_web_access":false},
    {"type":"custom","name":"apply_patch","description":"Use the `apply_patch` tool to edit files.",
     "format":{"type":"grammar","syntax":"lark","definition":"start: begin_patch hunk+ end_patch\nbegin_patch: \"*** Begin Patch\" LF\nend_patch: \"*** End Patch\" LF?\n"}}
  ])");
}

J codex_first_turn() {
  J r = J::object();
  r["model"] = "dsx-v4-flash";
  r["input"] = J::parse(R"([
    {"type":"message","role":"developer","content":[{"type":"input_text","text":"You are Codex, a coding agent based on GPT-5. You and the user share the same workspace.\n\n## General\n- Prefer `rg` over `grep`."}]},
    {"type":"message","role":"developer","content":[{"type":"input_text","text":"<skills_instructions>\n## Skills\n- none\n</skills_instructions>"},
                                                     {"type":"input_text","text":"<permissions instructions>\nsandbox_mode is read-only\n</permissions instructions>"}]},
    {"type":"message","role":"user","content":[{"type":"input_text","text":"<environment_context>\n  <cwd>/var/tmp/x</cwd>\n  <shell>bash</shell>\n</environment_context>"}]},
    {"type":"message","role":"user","content":[{"type":"input_text","text":"say hi"}]}])");
  r["tools"] = codex_tools();
  r["tool_choice"] = "auto";
  r["parallel_tool_calls"] = true;
  r["reasoning"] = J{{"effort", "medium"}, {"summary", "auto"}};
  r["store"] = false;
  r["stream"] = true;
  r["include"] = J::array({"reasoning.encrypted_content"});
  r["prompt_cache_key"] = "019a0c3e-7d1b-7c52-9f1e-3a4b5c6d7e8f";
  r["client_metadata"] = J{{"x-codex-turn", "1"}};
  return r;
}

// The stateless follow-up: reasoning (sealed by this server), function_call, function_call_output,
// a custom_tool_call and its output.
J codex_tool_round_trip() {
  J r = codex_first_turn();
  const std::string reasoning = "**Running the command**\n\nThe user asked to run echo; exec_command does it.";
  r["input"].push_back(J{{"type", "reasoning"},
                         {"id", "rs_0a1b"},
                         {"summary", J::array({J{{"type", "summary_text"}, {"text", "**Running the command**"}}})},
                         {"content", nullptr},
                         {"encrypted_content", seal(kSecret, reasoning)}});
  r["input"].push_back(J{{"type", "function_call"},
                         {"status", "completed"},
                         {"id", "fc_0a1b"},
                         {"name", "exec_command"},
                         {"arguments", "{\"cmd\":\"echo dsx-tool-ok\",\"workdir\":\"/var/tmp/x\"}"},
                         {"call_id", "call_0a1b"}});
  r["input"].push_back(J{{"type", "function_call_output"},
                         {"id", "fco_0a1b"},
                         {"call_id", "call_0a1b"},
                         {"output",
                          "Chunk ID: 4f2a\nWall time: 0.0112 seconds\nProcess exited with code 0\nOriginal token count: 4\n"
                          "Output:\ndsx-tool-ok\n"}});
  r["input"].push_back(J{{"type", "reasoning"},
                         {"id", "rs_0a1c"},
                         {"summary", J::array({J{{"type", "summary_text"}, {"text", "Patch the file"}}})},
                         {"content", J::array({J{{"type", "reasoning_text"}, {"text", "I need apply_patch."}}})}});
  r["input"].push_back(J{{"type", "custom_tool_call"},
                         {"status", "completed"},
                         {"call_id", "call_0a1c"},
                         {"name", "apply_patch"},
                         {"input", "*** Begin Patch\n*** Add File: a.txt\n+hello\n*** End Patch\n"}});
  r["input"].push_back(J{{"type", "custom_tool_call_output"}, {"call_id", "call_0a1c"}, {"output", "Success."}});
  r["input"].push_back(J{{"type", "function_call"},
                         {"name", "spawn_agent"},
                         {"namespace", "multi_agent_v1"},
                         {"arguments", "{\"message\":\"look around\"}"},
                         {"call_id", "call_0a1d"}});
  r["input"].push_back(J{{"type", "function_call_output"}, {"call_id", "call_0a1d"}, {"output", "agent-1"}});
  r["input"].push_back(J{{"type", "message"},
                         {"role", "assistant"},
                         {"content", J::array({J{{"type", "output_text"}, {"text", "It printed dsx-tool-ok."}}})}});
  r["input"].push_back(J{{"type", "web_search_call"}, {"id", "ws_1"}, {"status", "completed"}});
  r["input"].push_back(J{{"type", "message"}, {"role", "user"}, {"content", "thanks"}});
  return r;
}

// @ai-sdk/openai (opencode pointed at /v1/responses): items without "type", max_output_tokens.
J aisdk_responses() {
  return J::parse(R"({"model":"dsx-v4-flash","input":[
      {"role":"system","content":"You are opencode."},
      {"role":"user","content":[{"type":"input_text","text":"hello"}]},
      {"role":"assistant","content":[{"type":"output_text","text":"Hi!"}]},
      {"role":"user","content":"What is 2+2?"}],
    "max_output_tokens":8192,"store":false,"prompt_cache_key":"ses_1","temperature":0.3,"top_p":0.9,
    "tools":[{"type":"function","name":"bash","description":"run","parameters":{"type":"object","properties":{"command":{"type":"string"}},"required":["command"]},"strict":false}],
    "tool_choice":{"type":"function","name":"bash"},"stream":false})");
}

J responses_structured() {
  return J::parse(R"({"model":"deepseek-chat","instructions":"Be terse.","input":"Name three colours.",
    "text":{"format":{"type":"json_schema","name":"colours","strict":true,
      "schema":{"type":"object","properties":{"colours":{"type":"array","items":{"type":"string"}}},"required":["colours"]}}},
    "reasoning":{"effort":"none"},"tool_choice":"none","metadata":{"k":"v"}})");
}

std::vector<J> responses_seeds() {
  return {codex_first_turn(), codex_tool_round_trip(), aisdk_responses(), responses_structured()};
}

std::vector<J> seeds_of(Endpoint e) {
  switch (e) {
    case Endpoint::Chat: return chat_seeds();
    case Endpoint::Messages: return messages_seeds();
    case Endpoint::CountTokens: return count_tokens_seeds();
    case Endpoint::Responses: return responses_seeds();
  }
  return {};
}

// Every seed of every endpoint (for splicing).
const std::vector<J>& all_seeds() {
  static const std::vector<J> all = [] {
    std::vector<J> v;
    for (Endpoint e : {Endpoint::Chat, Endpoint::Messages, Endpoint::CountTokens, Endpoint::Responses})
      for (J& s : seeds_of(e)) v.push_back(std::move(s));
    return v;
  }();
  return all;
}

const std::vector<std::string>& all_seed_texts() {
  static const std::vector<std::string> t = [] {
    std::vector<std::string> v;
    for (const J& s : all_seeds()) v.push_back(s.dump());
    return v;
  }();
  return t;
}

// Tool-call ids the sinks handed out (their blocks are in the replay map): mutations put them
// into histories.
std::vector<std::string>& recent_ids() {
  static std::vector<std::string> v;
  return v;
}

void remember_id(const std::string& id, uint64_t r) {
  auto& v = recent_ids();
  if (v.size() < 256) v.push_back(id);
  else v[r % v.size()] = id;
}

// ---- mutations ------------------------------------------------------------------------------------------

std::string dump(const J& j, int indent = -1) { return j.dump(indent, ' ', false, J::error_handler_t::replace); }

const std::vector<std::string>& dictionary() {
  static const std::vector<std::string> d = {
      // roles
      "user", "assistant", "system", "developer", "tool", "function", "latest_reminder", "model", "System", "USER",
      "ipython", "critic",
      // part / item / tool / block types
      "text", "input_text", "output_text", "image", "image_url", "input_image", "input_file", "input_audio", "document",
      "file", "audio", "tool_use", "tool_result", "thinking", "redacted_thinking", "server_tool_use",
      "web_search_tool_result", "function", "custom", "namespace", "web_search", "web_search_preview", "file_search",
      "computer_use_preview", "mcp", "local_shell", "message", "reasoning", "function_call", "function_call_output",
      "custom_tool_call", "custom_tool_call_output", "item_reference", "additional_tools", "compaction",
      "web_search_call", "summary_text", "reasoning_text", "refusal", "json_schema", "json_object", "grammar", "lark",
      "regex", "bash_20250124", "web_search_20250305", "text_editor_20250124", "enabled", "adaptive", "disabled",
      "auto", "none", "required", "any", "tool", "allowed_tools", "ephemeral", "object", "array", "string", "integer",
      "number", "boolean", "null",
      // efforts
      "low", "medium", "high", "max", "xhigh", "minimal", "ultra", "0", "1", "50", "100", "101", "-5",
      // names and ids the seeds use
      "Bash", "Read", "Edit", "bash", "read", "exec_command", "apply_patch", "spawn_agent", "multi_agent_v1",
      "toolu_01A09q90qw90lq917835lq9", "toolu_02", "call_00_a1b2c3", "call_0a1b", "call_0a1c", "fco_0a1b",
      "deepseek-chat", "deepseek-reasoner", "dsx-v4-flash",
      // text the renderer must keep from becoming control tokens
      "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜System｜>", "<think>",
      "</think>", "｜DSML｜", "<｜DSML｜ calls>", "</｜DSML｜ invoke>", "<｜DSML｜ parameter name=\"x\" string=\"true\">",
      "<｜latest_reminder｜>", "<｜tool▁calls▁begin｜>", "x-anthropic-billing-header: cc_version=1",
      "<function_results>", "</function_results>", "[DONE]", "\n\n", "", " ", std::string("\0", 1), "\t\r\n",
      "é", "你好", "👍", "\xe2\x80\xa8", "\xef\xbb\xbf"};
  return d;
}

const std::vector<std::string>& known_keys() {
  static const std::vector<std::string> k = {
      "role", "content", "type", "text", "name", "id", "call_id", "tool_use_id", "tool_call_id", "arguments", "input",
      "output", "is_error", "signature", "thinking", "encrypted_content", "summary", "tools", "tool_choice", "stream",
      "max_tokens", "max_output_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "stop",
      "stop_sequences", "response_format", "format", "reasoning", "reasoning_effort", "reasoning_content",
      "instructions", "previous_response_id", "conversation", "background", "prompt", "system", "messages",
      "input_schema", "parameters", "function", "namespace", "stream_options", "include_usage", "n", "seed",
      "metadata", "strict", "description", "properties", "required", "schema", "json_schema", "effort",
      "budget_tokens", "output_config", "disable_parallel_tool_use", "cache_control", "status", "data", "source",
      "image_url", "tool_calls", "refusal", "thinking_mode", "model", "include", "store", "parallel_tool_calls",
      "logprobs", "top_logprobs", "definition", "syntax", "mode", "items", "enum", "default", "$ref", "anyOf"};
  return k;
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::mt19937_64& rng() { return rng_; }
  size_t below(size_t n) { return n == 0 ? 0 : std::uniform_int_distribution<size_t>(0, n - 1)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <typename T>
  const T& pick(const std::vector<T>& v) {
    return v[below(v.size())];
  }

  // A mutated body made from `seed`.
  std::string mutate(const J& seed) {
    const size_t mode = below(100);
    if (mode < 62) {  // JSON-aware: structural edits, then maybe raw text in a value's place
      J j = seed;
      const size_t n = 1 + below(4);
      for (size_t i = 0; i < n; ++i) structural(j);
      raws_.clear();
      if (chance(0.4)) raw(j);
      if (chance(0.1)) raw(j);
      std::string text = dump(j, chance(0.2) ? 2 : -1);
      for (size_t k = 0; k < raws_.size(); ++k) replace_all(text, "\"" + placeholder(k) + "\"", raws_[k]);
      if (chance(0.1)) bytes(text, 1);
      return text;
    }
    std::string text = dump(seed, chance(0.2) ? 2 : -1);
    bytes(text, 1 + below(6));
    return text;
  }

  // A JSON value of a random type (small).
  J random_value(int depth = 0) {
    switch (below(depth > 2 ? 5 : 7)) {
      case 0: return nullptr;
      case 1: return chance(0.5);
      case 2: return interesting_int();
      case 3: return interesting_float();
      case 4: return random_string();
      case 5: {
        J a = J::array();
        for (size_t i = below(4); i > 0; --i) a.push_back(random_value(depth + 1));
        return a;
      }
      default: {
        J o = J::object();
        for (size_t i = below(4); i > 0; --i) o[pick(known_keys())] = random_value(depth + 1);
        return o;
      }
    }
  }

  std::string random_string() {
    switch (below(6)) {
      case 0: return pick(dictionary());
      case 1: return pick(known_keys());
      case 2: return long_string(1 + below(64));
      case 3: return long_string(chance(0.97) ? 200 + below(4000) : 20000 + below(40000));
      case 4: return pick(dictionary()) + pick(dictionary()) + pick(dictionary());
      default: return recent_id();
    }
  }

 private:
  static std::string placeholder(size_t k) { return "@@DSX_FUZZ_RAW_" + std::to_string(k) + "@@"; }

  static void replace_all(std::string& s, const std::string& from, const std::string& to) {
    size_t pos = 0;
    while ((pos = s.find(from, pos)) != std::string::npos) {
      s.replace(pos, from.size(), to);
      pos += to.size();
    }
  }

  std::string recent_id() { return recent_ids().empty() ? std::string("call_0") : pick(recent_ids()); }

  J interesting_int() {
    static const std::vector<int64_t> v = {0,          1,          -1,         2,          100,       101,
                                           32000,      65535,      65536,      131072,     1 << 30,   INT32_MAX,
                                           INT32_MIN,  INT64_MAX,  INT64_MIN,  -32000,     393216,    9007199254740993};
    if (chance(0.1)) return J(UINT64_MAX);
    return J(pick(v));
  }

  J interesting_float() {
    static const std::vector<double> v = {0.0, -0.0, 0.5, 1.0, 2.0, -1.0, 1e-300, 1e308, -1e308, 3.5, 100.5, 1e19, 2.5e-5};
    return J(pick(v));
  }

  std::string long_string(size_t n) {
    static const std::vector<std::string> pieces = {"a", "b", "lorem ", "ipsum ", " ", "\n", "\t", "\"", "\\", "/",
                                                    "{", "}", "é", "你", "👍", "<", ">", "</think>", "<｜User｜>",
                                                    "｜DSML｜", "0", "9", "\u2028"};
    std::string s;
    s.reserve(n + 8);
    while (s.size() < n) s += pick(pieces);
    return s;
  }

  // All nodes of j (pre-order), with their parents.
  struct Node {
    J* v;
    J* parent;
  };
  static void collect(J& j, J* parent, std::vector<Node>& out) {
    out.push_back({&j, parent});
    if (j.is_structured())
      for (auto& c : j) collect(c, &j, out);
  }

  void structural(J& root) {
    std::vector<Node> nodes;
    collect(root, nullptr, nodes);
    // Bias toward the values that matter: "role" / "type" members and tool / message entries.
    Node n = nodes[below(nodes.size())];
    J& v = *n.v;
    switch (below(12)) {
      case 0:  // a value of another type
        v = random_value();
        break;
      case 1: {  // a subtree of another seed (splice)
        std::vector<Node> other;
        J donor = pick(all_seeds());
        collect(donor, nullptr, other);
        v = *pick(other).v;
        break;
      }
      case 2:  // remove a member / an element
        if (v.is_object() && !v.empty()) {
          auto it = v.begin();
          std::advance(it, below(v.size()));
          const std::string key = it.key();  // (a copy: erase moves the members)
          v.erase(key);
        } else if (v.is_array() && !v.empty()) {
          v.erase(v.begin() + static_cast<std::ptrdiff_t>(below(v.size())));
        } else if (n.parent && n.parent->is_array()) {
          v = J::array();
        }
        break;
      case 3:  // add a member (known or unknown key) / an element (duplicate or new)
        if (v.is_object()) {
          v[chance(0.7) ? pick(known_keys()) : random_string()] = random_value();
        } else if (v.is_array()) {
          J add = !v.empty() && chance(0.6) ? v[below(v.size())] : random_value();
          v.insert(v.begin() + static_cast<std::ptrdiff_t>(below(v.size() + 1)), std::move(add));
        } else {
          v = J::array({v});
        }
        break;
      case 4:  // a string value: an interesting one
        if (v.is_string() || chance(0.3)) v = random_string();
        break;
      case 5:  // a number
        v = chance(0.7) ? interesting_int() : interesting_float();
        break;
      case 6:  // reorder an array
        if (v.is_array() && v.size() > 1) std::swap(v[below(v.size())], v[below(v.size())]);
        break;
      case 7:  // empty a container
        if (v.is_structured()) v = v.is_array() ? J::array() : J::object();
        break;
      case 8:  // rename a member
        if (v.is_object() && !v.empty()) {
          auto it = v.begin();
          std::advance(it, below(v.size()));
          const std::string key = it.key();
          J val = *it;
          v.erase(key);
          v[chance(0.7) ? pick(known_keys()) : random_string()] = std::move(val);
        }
        break;
      case 9:
      case 10: {  // role / type of some object: unknown or another known one
        std::vector<J*> tagged;
        for (const Node& x : nodes)
          if (x.v->is_object() && (x.v->contains("role") || x.v->contains("type"))) tagged.push_back(x.v);
        if (tagged.empty()) break;
        J& o = *pick(tagged);
        const char* key = o.contains("role") && (!o.contains("type") || chance(0.5)) ? "role" : "type";
        o[key] = chance(0.8) ? J(pick(dictionary())) : random_value();
        break;
      }
      default:  // wrap a value in an array / object
        v = chance(0.5) ? J::array({v}) : J{{pick(known_keys()), v}};
        break;
    }
  }

  // Raw text in the place of some value: what a tree cannot hold.
  void raw(J& root) {
    std::vector<Node> nodes;
    collect(root, nullptr, nodes);
    J& v = *pick(nodes).v;
    std::string r;
    switch (below(7)) {
      case 0: {  // huge / odd numbers
        static const std::vector<std::string> nums = {
            "1e400", "-1e400", "1e-400", "123456789012345678901234567890", "-98765432109876543210987654321",
            "18446744073709551616", "9223372036854775808", "-9223372036854775809", "NaN", "Infinity", "-Infinity",
            "-0", "0.0000000000000000000000001", "1.7976931348623157e308", "4.9e-324", "1E+2", "00", "01", "1.",
            ".5", "+1", "0x10", "1e", "--1"};
        r = pick(nums);
        if (chance(0.1)) r = "1" + std::string(300 + below(2000), '0');
        break;
      }
      case 1: {  // deep nesting
        static const std::vector<size_t> depths = {10, 64, 100, 127, 128, 129, 255, 256, 257, 511, 512, 513, 1000, 5000};
        size_t d = pick(depths);
        if (chance(0.05)) d = 20000 + below(80000);
        d = std::min(d, fuzz_max_depth());
        if (chance(0.5)) {
          r = std::string(d, '[') + (chance(0.5) ? "1" : "") + std::string(d, ']');
        } else {
          r.clear();
          for (size_t i = 0; i < d; ++i) r += "{\"a\":";
          r += "null";
          r += std::string(d, '}');
        }
        break;
      }
      case 2:  // a long string
        r = dump(J(long_string(chance(0.95) ? 1000 + below(8000) : 100000 + below(100000))));
        break;
      case 3: {  // invalid UTF-8 inside a string
        static const std::vector<std::string> bad = {"\xff", "\xfe", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80",
                                                     "\xf4\x90\x80\x80", "\xf8\x88\x80\x80\x80", "\xc3", "\xe4\xbd",
                                                     "\xf0\x9f\x91", "\x80", "\xbf"};
        r = "\"" + pick(dictionary()) + pick(bad) + (chance(0.5) ? pick(bad) : "") + "tail\"";
        break;
      }
      case 4: {  // lone surrogates and other escapes
        static const std::vector<std::string> esc = {"\\ud800", "\\udbff", "\\udc00", "\\udfff", "\\ud83d\\u0041",
                                                     "\\ud83d\\ude00", "\\u0000", "\\ud800\\ud800", "\\uDFFF\\uD800",
                                                     "\\u12", "\\x41", "\\", "\\ud83d"};
        r = "\"a" + pick(esc) + (chance(0.5) ? pick(esc) : "") + "b\"";
        break;
      }
      case 5: {  // duplicate keys
        if (v.is_object() && !v.empty()) {
          auto it = v.begin();
          std::advance(it, below(v.size()));
          const std::string dup = "," + dump(J(it.key())) + ":" + dump(chance(0.5) ? random_value() : *it);
          r = dump(v);
          if (chance(0.5)) r.insert(r.size() - 1, dup);                     // the duplicate last
          else r.insert(1, dup.substr(1) + ",");                            // or first
        } else {
          const std::string k = dump(J(pick(known_keys())));
          r = "{" + k + ":" + dump(random_value()) + "," + k + ":" + dump(random_value()) + "}";
        }
        break;
      }
      default: {  // raw control characters in a string
        r = "\"a";
        r += static_cast<char>(below(32));
        r += "b\"";
        break;
      }
    }
    v = placeholder(raws_.size());
    raws_.push_back(std::move(r));
  }

  void bytes(std::string& s, size_t times) {
    static const std::vector<std::string> frags = {"{", "}", "[", "]", ",", ":", "\"", "\\", "null", "true", "-",
                                                   "\\u", "\\ud800", "\xff", "\xc3", "1e999", "\"role\":", "\n", std::string(1, '\0')};
    for (size_t t = 0; t < times; ++t) {
      if (s.empty()) {
        s = pick(frags);
        continue;
      }
      const size_t a = below(s.size()), b = below(s.size());
      const size_t lo = std::min(a, b), hi = std::max(a, b);
      switch (below(9)) {
        case 0: s[a] = static_cast<char>(s[a] ^ (1 << below(8))); break;                      // bit flip
        case 1: s[a] = static_cast<char>(below(256)); break;                                  // random byte
        case 2: s.insert(a, pick(frags)); break;                                              // insert a fragment
        case 3: s.erase(lo, std::min<size_t>(hi - lo, 1 + below(64))); break;                 // delete a range
        case 4: s.resize(a); break;                                                           // truncate
        case 5: s.insert(a, s.substr(lo, std::min<size_t>(hi - lo, 256))); break;             // duplicate a range
        case 6: {                                                                             // splice another seed
          const std::string& o = pick(all_seed_texts());
          const size_t p = below(o.size()), len = std::min<size_t>(o.size() - p, 1 + below(512));
          if (chance(0.5)) s.insert(a, o, p, len);
          else s = s.substr(0, a) + o.substr(p);
          break;
        }
        case 7: std::swap(s[a], s[b]); break;
        default: {  // insert random bytes
          const size_t n = 1 + below(8);
          for (size_t i = 0; i < n; ++i) s.insert(s.begin() + static_cast<std::ptrdiff_t>(a), static_cast<char>(below(256)));
          break;
        }
      }
    }
  }

  std::mt19937_64 rng_;
  std::vector<std::string> raws_;
};

// ---- driving a Sink -------------------------------------------------------------------------------------

// A sampled completion for the request: reasoning (thinking mode), content, maybe a DSML tool block
// using the request's tools, maybe damaged.
std::string random_completion(Mutator& m, const GenRequest& g) {
  const std::string D = text::tok::kDsml;
  static const std::vector<std::string> words = {"Hello", " world", ".", " The", " file", "\n", "\n\n", " é", " 你好",
                                                 " 👍", " `code`", " <b>", "</b>", " {\"a\": 1}", " \\", " \"q\""};
  auto text_of = [&](size_t n) {
    std::string s;
    for (size_t i = 0; i < n; ++i) s += m.pick(words);
    return s;
  };
  std::string s;
  if (g.thinking) {
    s += text_of(m.below(12));
    if (m.chance(0.9)) s += "</think>";
  }
  s += text_of(m.below(12));
  if (!g.conv.tools.empty() && m.chance(0.6)) {
    s += "\n\n<" + D + " calls>\n";
    const size_t calls = 1 + m.below(3);
    for (size_t c = 0; c < calls; ++c) {
      const text::ToolSpec& t = g.conv.tools[m.below(g.conv.tools.size())];
      const std::string name = m.chance(0.9) ? t.name : std::string("no_such_tool");
      s += "<" + D + " invoke name=\"" + name + "\">\n";
      std::vector<std::string> params;
      if (const auto* p = t.function.get("parameters"))
        if (const auto* props = p->get("properties"))
          for (const auto& [k, v] : props->members) params.push_back(k);
      if (params.empty()) params.push_back("input");
      const size_t np = m.below(params.size() + 1);
      for (size_t i = 0; i < np; ++i) {
        const bool str = m.chance(0.6);
        s += "<" + D + " parameter name=\"" + params[m.below(params.size())] + "\" string=\"" + (str ? "true" : "false") +
             "\">";
        s += str ? text_of(1 + m.below(4)) : (m.chance(0.5) ? std::string("42") : std::string("[1, {\"a\": null}]"));
        s += "</" + D + " parameter>\n";
      }
      s += "</" + D + " invoke>\n";
    }
    s += "</" + D + " calls>";
  }
  if (m.chance(0.15)) {  // damage: truncate, or insert stray markers
    if (m.chance(0.5) && !s.empty()) s.resize(m.below(s.size()));
    else s.insert(s.empty() ? 0 : m.below(s.size()), m.chance(0.5) ? "<" + D + " invoke name=\"" : "</think>");
  }
  return s;
}

struct SinkRun {
  std::string problem;
  std::string calls;  // the sequence of Sink calls, for the report
};

std::string check_sink_output(Endpoint ep, const GenRequest& g, Channel& ch, bool failed, bool stream_error);

// As the scheduler: start, events (in random pieces) with keepalives, then end or fail.
SinkRun drive_sink(Endpoint ep, Mutator& m, const GenRequest& g0, int64_t prompt_tokens) {
  SinkRun out;
  GenRequest g = g0;
  if (m.chance(0.5)) g.stream = !g.stream;
  const Adapter& ad = adapter_of(ep);
  auto ch = std::make_shared<Channel>();
  std::shared_ptr<Sink> sink = ad.make_sink(g, ctx(), ch);
  if (!sink) {
    out.problem = "make_sink returned null";
    return out;
  }
  text::ParserOptions po;
  po.profile = text::Profile::V41;
  po.thinking = g.thinking;
  po.tools_enabled = g.tools_enabled && !g.conv.tools.empty();
  po.tools = g.conv.tools;
  po.stop = g.stop;
  po.id_prefix = g.id_prefix;
  po.replay = &replay_map();
  // ids from this iteration's generator instead of the CSPRNG, so that a run (whose ids come back in
  // later histories) is reproducible from its seed
  po.make_id = [&m, prefix = g.id_prefix] {
    char hex[40];
    std::snprintf(hex, sizeof hex, "%016llx%016llx", static_cast<unsigned long long>(m.rng()()),
                  static_cast<unsigned long long>(m.rng()()));
    return prefix + hex;
  };
  text::DsmlParser parser(po);

  Usage u;
  u.prompt_tokens = prompt_tokens;
  u.cached_tokens = static_cast<int64_t>(m.below(static_cast<size_t>(prompt_tokens) + 1));
  const size_t fate = m.below(100);  // <4: fail before start; <9: fail midway; else end
  bool failed = false, stream_error = false;
  std::string& calls = out.calls;
  calls = g.stream ? "stream:" : "json:";
  auto keepalive = [&] {
    sink->keepalive();
    calls += " keepalive";
  };
  auto fail = [&](const char* what) {
    if (m.chance(0.7)) sink->fail(ApiError{500, "server_error", what, "", ""});
    else sink->fail(ApiError{400, "invalid_request_error", "the prompt does not fit", "context_length_exceeded", "messages"});
    calls += " fail";
    failed = true;
  };
  if (fate < 4) {
    if (m.chance(0.5)) keepalive();
    fail("prefill failed: out of memory");
  } else {
    if (m.chance(0.2)) keepalive();
    sink->start(u);
    calls += " start";
    const std::string text = random_completion(m, g);
    size_t pos = 0;
    int64_t generated = 0;
    const bool fail_midway = fate < 9;
    const size_t fail_at = text.empty() ? 0 : m.below(text.size());
    while (pos < text.size() && !parser.should_stop()) {
      if (fail_midway && pos >= fail_at) break;
      const size_t n = std::min(text.size() - pos, 1 + m.below(12));
      auto ev = parser.push(std::string_view(text).substr(pos, n));
      pos += n;
      ++generated;
      if (!ev.empty()) {
        sink->events(ev);
        if (calls.size() < 400) calls += " events(" + std::to_string(ev.size()) + ")";
      }
      if (m.chance(0.03)) keepalive();
    }
    if (fail_midway) {
      fail("decode failed: device lost");
    } else {
      auto ev = parser.finish(m.chance(0.2) ? text::EndCause::Length : text::EndCause::Eos);
      if (!ev.empty()) {
        sink->events(ev);
        calls += " events(" + std::to_string(ev.size()) + ")";
      }
      u.completion_tokens = generated;
      u.reasoning_tokens = generated / 2;
      const text::ParseResult& r = parser.result();
      sink->end(r, u);
      calls += " end";
      for (const auto& c : r.tool_calls) remember_id(c.id, m.rng()());
      stream_error = r.stream_error;
    }
  }
  out.problem = check_sink_output(ep, g, *ch, failed, stream_error);
  return out;
}

std::string check_sink_output(Endpoint ep, const GenRequest& g, Channel& ch, bool failed, bool stream_error) {
  if (!ch.wait_closed(std::chrono::milliseconds(0)))
    return std::string("the sink did not close the channel after ") + (failed ? "fail" : "end");
  const std::string body = ch.drain();
  const std::string ctype = ch.content_type();
  // Answered as http.cpp does. A streaming request: http.cpp waits for the sink's first bytes; a
  // sink that set an error status before streaming anything (a failure before start) is answered
  // as that one JSON error with its status, anything else as a 200 event stream of the pushed
  // bytes. A non-streaming one is the one JSON body with the sink's status.
  if (g.stream && ch.status() != 200) {
    if (!failed) return "an ended stream with error status " + std::to_string(ch.status());
    if (ctype.rfind("application/json", 0) != 0) return "a stream's error answer with content type '" + ctype + "'";
    return check_json_answer(ep, ch.status(), body);
  }
  if (!g.stream) {
    if (ctype.rfind("application/json", 0) != 0) return "a non-streaming answer with content type '" + ctype + "'";
    if (std::string p = check_json_answer(ep, ch.status(), body); !p.empty()) return p;
    if (failed && ch.status() < 400) return "a failed answer with status 200";
    if (!failed && !stream_error && ch.status() != 200) return "an ended answer with an error status";
    return {};
  }
  const SseCheck c = check_sse(ep, body);
  if (!c.problem.empty()) return c.problem;
  if (!c.finished && !c.errored) return "the stream ended without a terminal event";
  if (failed && !c.errored) return "a failed stream without an error event";
  return {};
}

// ---- one body through the request path ------------------------------------------------------------------

struct Stats {
  int64_t total = 0, ok = 0, parse_4xx = 0, render_4xx = 0, prompt_4xx = 0, sinks = 0, tokens = 0;
  int64_t failures = 0;
};

// "" or what went wrong. `drive` asks for a Sink run when the request is accepted.
std::string run_one(Endpoint ep, const std::string& body, Mutator& m, bool drive, Stats& st) {
  CurrentBody cur(body);
  ++st.total;
  GenRequest g;
  ApiError err;
  bool parsed = false;
  try {
    parsed = ep == Endpoint::CountTokens ? parse_count_tokens(body, ctx(), g, err)
                                         : adapter_of(ep).parse(body, ctx(), g, err);
  } catch (const std::exception& e) {
    return std::string("parse threw: ") + e.what();
  } catch (...) {
    return "parse threw a non-std exception";
  }
  if (!parsed) {
    ++st.parse_4xx;
    return check_api_error(ep, err);
  }
  if (ep == Endpoint::Messages || ep == Endpoint::CountTokens)
    for (const std::string& t : last_dropped_tools())
      if (t.empty()) return "last_dropped_tools() holds an empty name";
  // the operator's --thinking on|off (http.cpp applies it after parse)
  if (ep != Endpoint::CountTokens) {
    const size_t op = m.below(10);
    if (op == 0) g.thinking = true;
    if (op == 1) g.thinking = false;
  }
  text::RenderOptions ro;
  ro.thinking = g.thinking;
  ro.effort = g.effort;  // the server's default effort is the renderer's default
  ro.tools_enabled = g.tools_enabled;
  ro.context_tokens = ctx().context_tokens;
  ro.replay = &replay_map();
  text::RenderedPrompt rendered;
  try {
    rendered = text::render_prompt(g.conv, ro);
  } catch (const Error& e) {
    ++st.render_4xx;
    return check_api_error(ep, ApiError{400, "invalid_request_error", e.what(), "", ""});
  } catch (const std::exception& e) {
    return std::string("render_prompt threw a non-dsx::Error: ") + e.what();
  } catch (...) {
    return "render_prompt threw a non-std exception";
  }
  std::vector<int32_t> ids;
  try {
    ids = text::encode_segments(*tokenizer(), rendered.segments);
  } catch (const std::exception& e) {
    return std::string("encode_segments threw: ") + e.what();
  } catch (...) {
    return "encode_segments threw a non-std exception";
  }
  const int64_t n = static_cast<int64_t>(ids.size());
  st.tokens += n;
  if (ep == Endpoint::CountTokens) {
    auto j = parse_json(count_tokens_body(n));
    if (!j || !j->is_object() || !(*j)["input_tokens"].is_number_integer() || (*j)["input_tokens"].get<int64_t>() != n)
      return "count_tokens_body is not {\"input_tokens\": n}";
    ++st.ok;
    return {};
  }
  if (n == 0 || n >= kContext || g.max_tokens > kContext) {  // http.cpp's 400s
    ++st.prompt_4xx;
    return check_api_error(ep, ApiError{400, "invalid_request_error", "the prompt does not fit", "", "messages"});
  }
  ++st.ok;
  if (!drive) return {};
  ++st.sinks;
  try {
    SinkRun r = drive_sink(ep, m, g, n);
    return r.problem.empty() ? std::string() : "sink: " + r.problem + "\n  sink calls: " + r.calls;
  } catch (const std::exception& e) {
    return std::string("sink threw: ") + e.what();
  } catch (...) {
    return "sink threw a non-std exception";
  }
}

std::string save_body(Endpoint ep, int64_t iter, const std::string& body) {
  const std::string path =
      fuzz_dir() + "/dsx-server-fuzz-" + endpoint_tag(ep) + "-" + std::to_string(iter) + ".json";
  std::ofstream(path, std::ios::binary) << body;
  return path;
}

void fuzz_endpoint(Endpoint ep) {
  install_crash_hooks();
  const uint64_t seed = fuzz_seed();
  const int64_t iters = fuzz_iters();
  std::vector<J> seeds = seeds_of(ep);
  ASSERT_FALSE(seeds.empty());
  Stats st;
  std::map<std::string, int64_t> kinds;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    Mutator m(splitmix(splitmix(seed) ^ (static_cast<uint64_t>(ep) << 56) ^ static_cast<uint64_t>(i)));
    const J& s = seeds[m.below(seeds.size())];
    const std::string body = m.mutate(s);
    const bool drive = m.chance(0.15);
    std::snprintf(g_where, sizeof g_where, "[ServerFuzz] crashed in %s iteration %lld (seed %llu); body in ",
                  endpoint_path(ep), static_cast<long long>(i), static_cast<unsigned long long>(seed));
    const std::string problem = run_one(ep, body, m, drive, st);
    if (!problem.empty()) {
      ++st.failures;
      // one report (and at most 3 saved bodies) per kind of problem; the run goes on
      int64_t& seen = kinds[problem.substr(0, std::min<size_t>(problem.find('\n'), 56))];
      if (seen++ < 3) {
        const std::string path = save_body(ep, i, body);
        ADD_FAILURE() << endpoint_path(ep) << " iteration " << i << " (DSX_FUZZ_SEED=" << seed << "): " << problem
                      << "\n  body saved to " << path << " (" << body.size() << " bytes)";
      }
      if (kinds.size() >= 20 || st.failures >= 2000) break;
    }
  }
  for (const auto& [kind, n] : kinds)
    std::printf("[ServerFuzz] %s: %lld x \"%s...\"\n", endpoint_path(ep), static_cast<long long>(n), kind.c_str());
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ServerFuzz] %-26s seed=%llu bodies=%lld ok(2xx)=%lld 4xx=%lld (parse %lld, render %lld, prompt %lld) "
              "sinks=%lld tokens=%lld failures=%lld %.1fs\n",
              endpoint_path(ep), static_cast<unsigned long long>(seed), static_cast<long long>(st.total),
              static_cast<long long>(st.ok), static_cast<long long>(st.parse_4xx + st.render_4xx + st.prompt_4xx),
              static_cast<long long>(st.parse_4xx), static_cast<long long>(st.render_4xx),
              static_cast<long long>(st.prompt_4xx), static_cast<long long>(st.sinks), static_cast<long long>(st.tokens),
              static_cast<long long>(st.failures), secs);
  std::fflush(stdout);
  g_where[0] = 0;
  if (st.failures == 0) {
    EXPECT_EQ(st.ok + st.parse_4xx + st.render_4xx + st.prompt_4xx, st.total);
  }
  // Both paths must be reached, or the mutations are too weak / too destructive to test anything.
  if (st.failures == 0 && iters >= 1000) {
    EXPECT_GE(st.ok * 20, st.total) << "fewer than 5% of the mutated bodies were accepted";
    EXPECT_GE(st.parse_4xx * 5, st.total) << "fewer than 20% of the mutated bodies were rejected";
    if (ep != Endpoint::CountTokens) {
      EXPECT_GT(st.sinks, 0);
    }
  }
}

}  // namespace

// ---- tests ----------------------------------------------------------------------------------------------

// The checks themselves: each rejects what it is there to reject.
TEST(ServerFuzz, CheckersRejectMalformedAnswers) {
  EXPECT_EQ(check_error_body(true, R"({"type":"error","error":{"type":"invalid_request_error","message":"m"}})"), "");
  EXPECT_NE(check_error_body(true, R"({"error":{"type":"invalid_request_error","message":"m"}})"), "");
  EXPECT_NE(check_error_body(false, R"({"error":{"type":"invalid_request_error","message":""}})"), "");
  EXPECT_NE(check_error_body(false, "{\"error\":{\"type\":\"x\",\"message\":\"\xff\"}}"), "");
  EXPECT_NE(check_error_body(false, R"({"error":{"type":"x","message":"m"})"), "");
  EXPECT_NE(check_api_error(Endpoint::Chat, ApiError{500, "server_error", "m", "", ""}), "");
  EXPECT_NE(check_api_error(Endpoint::Chat, ApiError{400, "server_error", "m", "", ""}), "");
  EXPECT_NE(check_api_error(Endpoint::Chat, ApiError{400, "invalid_request_error", "", "", ""}), "");
  EXPECT_EQ(check_api_error(Endpoint::Responses, ApiError{400, "invalid_request_error", "m", "", ""}), "");

  EXPECT_EQ(check_sse(Endpoint::Chat, "data: {\"object\":\"chat.completion.chunk\",\"choices\":[]}\n\n: ka\n\ndata: [DONE]\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Chat, "data: {\"object\":\"chat.completion.chunk\",\"choices\":[]}\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Chat, "data: {\"object\":\"chat.completion.chunk\",\"choices\":[]\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Chat, "data: [DONE]\n\ndata: {\"object\":\"chat.completion.chunk\",\"choices\":[]}\n\n").problem, "");
  EXPECT_FALSE(check_sse(Endpoint::Chat, "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"finish_reason\":null}]}\n\n").finished);
  EXPECT_TRUE(check_sse(Endpoint::Chat, "data: {\"object\":\"chat.completion.chunk\",\"choices\":[{\"finish_reason\":\"stop\"}]}\n\n").finished);
  EXPECT_EQ(check_sse(Endpoint::Messages, "event: ping\ndata: {\"type\":\"ping\"}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Messages, "event: ping\ndata: {\"type\":\"pong\"}\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Messages, "data: {\"type\":\"ping\"}\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Messages, "event: ping\n\n").problem, "");
  EXPECT_NE(check_sse(Endpoint::Responses,
                      "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":1}\n\n"
                      "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":1}\n\n")
                .problem,
            "");
  EXPECT_TRUE(check_sse(Endpoint::Responses,
                        "event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":0}\n\n")
                  .finished);

  EXPECT_EQ(check_json_answer(Endpoint::Chat, 200, R"({"object":"chat.completion","choices":[{"finish_reason":"stop"}]})"), "");
  EXPECT_NE(check_json_answer(Endpoint::Chat, 200, R"({"object":"chat.completion","choices":[]})"), "");
  EXPECT_NE(check_json_answer(Endpoint::Messages, 200, R"({"type":"message","content":[]})"), "");
  EXPECT_NE(check_json_answer(Endpoint::Responses, 200, "{\"object\":\"response\""), "");
  EXPECT_NE(check_json_answer(Endpoint::Responses, 500, R"({"error":{"message":"m"}})"), "");
}

// The seeds are valid requests: each is accepted, renders, tokenizes within the context, and
// its Sink (streaming and not, ended and failed) writes well-formed answers.
TEST(ServerFuzz, SeedsAreAcceptedAndAnswered) {
  REQUIRE_TOKENIZER();
  install_crash_hooks();
  for (Endpoint ep : {Endpoint::Chat, Endpoint::Messages, Endpoint::CountTokens, Endpoint::Responses}) {
    const std::vector<J> seeds = seeds_of(ep);
    for (size_t i = 0; i < seeds.size(); ++i) {
      const std::string body = seeds[i].dump();
      GenRequest g;
      ApiError err;
      const bool ok = ep == Endpoint::CountTokens ? parse_count_tokens(body, ctx(), g, err)
                                                  : adapter_of(ep).parse(body, ctx(), g, err);
      ASSERT_TRUE(ok) << endpoint_path(ep) << " seed " << i << ": " << err.message;
      EXPECT_FALSE(g.conv.messages.empty()) << endpoint_path(ep) << " seed " << i;
      for (uint64_t k = 0; k < 40; ++k) {
        Mutator m(splitmix(k * 977 + i));
        Stats st;
        EXPECT_EQ(run_one(ep, body, m, true, st), "") << endpoint_path(ep) << " seed " << i << " run " << k;
        EXPECT_EQ(st.ok, 1) << endpoint_path(ep) << " seed " << i << " run " << k;
      }
    }
  }
  // The signed reasoning of the round-trip seeds is recognised (not dropped as forged).
  {
    GenRequest g;
    ApiError err;
    ASSERT_TRUE(messages_adapter().parse(claude_tool_round_trip().dump(), ctx(), g, err)) << err.message;
    bool found = false;
    for (const auto& msg : g.conv.messages)
      if (msg.reasoning_content && msg.reasoning_content->find("I'll use the Bash tool") != std::string::npos) found = true;
    EXPECT_TRUE(found) << "the signed thinking block was not recovered";
  }
  {
    GenRequest g;
    ApiError err;
    ASSERT_TRUE(responses_adapter().parse(codex_tool_round_trip().dump(), ctx(), g, err)) << err.message;
    bool found = false;
    for (const auto& msg : g.conv.messages)
      if (msg.reasoning_content && msg.reasoning_content->find("exec_command does it") != std::string::npos) found = true;
    EXPECT_TRUE(found) << "the sealed reasoning item was not recovered";
  }
}

TEST(ServerFuzz, ChatCompletions) {
  REQUIRE_TOKENIZER();
  fuzz_endpoint(Endpoint::Chat);
}

TEST(ServerFuzz, Messages) {
  REQUIRE_TOKENIZER();
  fuzz_endpoint(Endpoint::Messages);
}

TEST(ServerFuzz, CountTokens) {
  REQUIRE_TOKENIZER();
  fuzz_endpoint(Endpoint::CountTokens);
}

TEST(ServerFuzz, Responses) {
  REQUIRE_TOKENIZER();
  fuzz_endpoint(Endpoint::Responses);
}

// Nesting far beyond any real request (a few hundred KB of brackets) is a 4xx, not a stack
// overflow. (Last in this file: a crash here must not hide the results above.)
TEST(ServerFuzz, DeepNestingIsA4xx) {
  REQUIRE_TOKENIZER();
  install_crash_hooks();
  for (Endpoint ep : {Endpoint::Chat, Endpoint::Messages, Endpoint::CountTokens, Endpoint::Responses}) {
    for (size_t depth : {600, 10000, 100000}) {
      for (int shape = 0; shape < 2; ++shape) {
        const std::string deep = shape == 0 ? std::string(depth, '[') + std::string(depth, ']')
                                            : [&] {
                                                std::string s;
                                                for (size_t i = 0; i < depth; ++i) s += "{\"a\":";
                                                return s + "1" + std::string(depth, '}');
                                              }();
        // as a member of the request object, after which the parser still adds members
        std::string body = seeds_of(ep)[0].dump();
        body.insert(1, "\"x_deep\":" + deep + ",");
        std::snprintf(g_where, sizeof g_where, "[ServerFuzz] crashed in %s at nesting depth %zu; body in ",
                      endpoint_path(ep), depth);
        Mutator m(depth);
        Stats st;
        EXPECT_EQ(run_one(ep, body, m, false, st), "") << endpoint_path(ep) << " depth " << depth;
        EXPECT_EQ(st.parse_4xx, 1) << endpoint_path(ep) << " depth " << depth << ": not rejected";
      }
    }
  }
  g_where[0] = 0;
}
