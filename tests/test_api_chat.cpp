// Tests of the OpenAI Chat Completions adapter (src/server/api_chat.cpp) and the
// /v1/models bodies (src/server/api_models.h): the request shapes opencode and other
// chat clients send (../shared/agents/README.md) -> GenRequest, the errors for bad
// input (every level, truncations, mutations), and the SSE stream / JSON answer the Sink
// writes for scripted event sequences and for the real DSML parser's events.
#include <gtest/gtest.h>

#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "server/adapters.h"
#include "server/api_models.h"
#include "text/chat.h"
#include "text/dsml.h"

using namespace dsx;
using namespace dsx::server;
using json = nlohmann::ordered_json;

namespace {

AdapterContext test_ctx() {
  AdapterContext c;
  c.model_id = "deepseek-v4.1-flash";
  c.context_tokens = 131072;
  return c;
}

GenRequest parse_ok(const std::string& body) {
  GenRequest req;
  ApiError err;
  const bool ok = chat_adapter().parse(body, test_ctx(), req, err);
  EXPECT_TRUE(ok) << "body: " << body.substr(0, 400) << "\nerror: " << err.message;
  return req;
}
GenRequest parse_ok(const json& j) { return parse_ok(j.dump()); }
GenRequest parse_ok(const char* s) { return parse_ok(std::string(s)); }

ApiError parse_err(const std::string& body) {
  GenRequest req;
  ApiError err;
  const bool ok = chat_adapter().parse(body, test_ctx(), req, err);
  EXPECT_FALSE(ok) << "body: " << body.substr(0, 400);
  return err;
}

json user_msg(const std::string& s) { return {{"role", "user"}, {"content", s}}; }

json body_with(const json& messages) { return json{{"model", "dsx-v4-flash"}, {"messages", messages}}; }

// opencode's bash tool (shape of ../shared/agents/README.md: {type, function{name, description, parameters}}).
json bash_tool() {
  return json::parse(R"({"type":"function","function":{"name":"bash","description":"Run a shell command",
    "parameters":{"type":"object","properties":{"command":{"type":"string","description":"The command"},
    "timeout":{"type":"number"},"workdir":{"type":"string"}},"required":["command"],"additionalProperties":false,
    "$schema":"http://json-schema.org/draft-07/schema#"}}})");
}
json read_tool() {
  return json::parse(R"({"type":"function","function":{"name":"read","description":"Read a file",
    "parameters":{"type":"object","properties":{"filePath":{"type":"string"},"offset":{"type":"integer","minimum":0}},
    "required":["filePath"]}}})");
}

// ---- SSE helpers ----------------------------------------------------------------------------------------

struct SseEvent {
  bool comment = false;  // ": …" line
  bool done = false;     // data: [DONE]
  std::string raw;
  json data;
};

std::vector<SseEvent> split_sse(const std::string& s) {
  std::vector<SseEvent> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = s.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated SSE event at byte " << pos << ": " << s.substr(pos);
    if (end == std::string::npos) break;
    SseEvent e;
    e.raw = s.substr(pos, end - pos);
    pos = end + 2;
    if (e.raw.rfind(": ", 0) == 0) {
      e.comment = true;
    } else {
      EXPECT_EQ(e.raw.rfind("data: ", 0), 0u) << e.raw;
      EXPECT_EQ(e.raw.find('\n'), std::string::npos) << "one data line per event: " << e.raw;
      const std::string payload = e.raw.substr(6);
      if (payload == "[DONE]") e.done = true;
      else e.data = json::parse(payload);
    }
    out.push_back(std::move(e));
  }
  return out;
}

text::Event ev(text::EventType t, std::string s = "", int index = -1, std::string id = "", std::string name = "") {
  text::Event e;
  e.type = t;
  e.text = std::move(s);
  e.index = index;
  e.id = std::move(id);
  e.name = std::move(name);
  return e;
}

GenRequest stream_req(bool include_usage) {
  GenRequest r;
  r.api = "chat";
  r.model = "dsx-v4-flash";
  r.stream = true;
  r.include_usage = include_usage;
  return r;
}

Usage usage(int64_t p, int64_t cached, int64_t c, int64_t reasoning) {
  Usage u;
  u.prompt_tokens = p;
  u.cached_tokens = cached;
  u.completion_tokens = c;
  u.reasoning_tokens = reasoning;
  return u;
}

void expect_chunk_head(const json& c, const std::string& id) {
  EXPECT_EQ(c.at("id"), id);
  EXPECT_EQ(c.at("object"), "chat.completion.chunk");
  EXPECT_EQ(c.at("model"), "dsx-v4-flash");
  EXPECT_TRUE(c.at("created").is_number_integer());
}

const json& delta_of(const json& c) { return c.at("choices").at(0).at("delta"); }

}  // namespace

// ---- requests the clients send --------------------------------------------------------------------------

TEST(ApiChat, OpencodeTitleRequest) {
  // opencode's first request: small_model, no tools, system string, 2 user strings, reasoning_effort low and
  // temperature 0.5 (with "reasoning": true), stream with usage, max_tokens 32000.
  json b = {{"model", "dsx-v4-flash"},
            {"messages", json::array({{{"role", "system"}, {"content", "You are a title generator."}},
                                      user_msg("Generate a title for this conversation:\n"),
                                      user_msg("\"say hi\"")})},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}},
            {"max_tokens", 32000},
            {"reasoning_effort", "low"},
            {"temperature", 0.5}};
  GenRequest r = parse_ok(b);
  EXPECT_EQ(r.api, "chat");
  EXPECT_EQ(r.model, "dsx-v4-flash");
  ASSERT_EQ(r.conv.messages.size(), 3u);
  EXPECT_EQ(r.conv.messages[0].role, text::Role::System);
  EXPECT_EQ(r.conv.messages[0].content, "You are a title generator.");
  EXPECT_EQ(r.conv.messages[1].role, text::Role::User);
  EXPECT_EQ(r.conv.messages[1].content, "Generate a title for this conversation:\n");
  EXPECT_EQ(r.conv.messages[2].content, "\"say hi\"");
  EXPECT_TRUE(r.conv.tools.empty());
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_EQ(r.max_tokens, 32000);
  EXPECT_TRUE(r.thinking);
  EXPECT_EQ(r.effort.kind, text::Effort::Kind::Low);
  EXPECT_TRUE(r.sampling_given);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_EQ(r.id_prefix, "call_");
  EXPECT_TRUE(r.stop.empty());
  EXPECT_FALSE(r.response_format.has_value());
}

TEST(ApiChat, OpencodeToolRoundTrip) {
  // The follow-up after a tool call: [system, user, assistant{content:"", reasoning_content, tool_calls}, tool].
  json b = {{"model", "dsx-v4-flash"},
            {"messages", json::array({{{"role", "system"}, {"content", "You are opencode."}},
                                      user_msg("run echo dsx-tool-ok"),
                                      {{"role", "assistant"},
                                       {"content", ""},
                                       {"reasoning_content", "The user wants me to run a command."},
                                       {"tool_calls", json::array({{{"id", "call_0123456789abcdef0123456789abcdef"},
                                                                    {"type", "function"},
                                                                    {"function", {{"name", "bash"},
                                                                                  {"arguments", "{\"command\":\"echo dsx-tool-ok\"}"}}}}})}},
                                      {{"role", "tool"},
                                       {"tool_call_id", "call_0123456789abcdef0123456789abcdef"},
                                       {"content", "dsx-tool-ok\n"}}})},
            {"tools", json::array({bash_tool(), read_tool()})},
            {"tool_choice", "auto"},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}},
            {"max_tokens", 32000}};
  GenRequest r = parse_ok(b);
  ASSERT_EQ(r.conv.messages.size(), 4u);
  const auto& a = r.conv.messages[2];
  EXPECT_EQ(a.role, text::Role::Assistant);
  EXPECT_EQ(a.content, "");
  ASSERT_TRUE(a.reasoning_content.has_value());
  EXPECT_EQ(*a.reasoning_content, "The user wants me to run a command.");
  ASSERT_EQ(a.tool_calls.size(), 1u);
  EXPECT_EQ(a.tool_calls[0].id, "call_0123456789abcdef0123456789abcdef");
  EXPECT_EQ(a.tool_calls[0].name, "bash");
  EXPECT_EQ(a.tool_calls[0].arguments, "{\"command\":\"echo dsx-tool-ok\"}");  // the string, untouched
  const auto& t = r.conv.messages[3];
  EXPECT_EQ(t.role, text::Role::Tool);
  EXPECT_EQ(t.tool_call_id, "call_0123456789abcdef0123456789abcdef");
  EXPECT_EQ(t.content, "dsx-tool-ok\n");
  ASSERT_EQ(r.conv.tools.size(), 2u);
  EXPECT_EQ(r.conv.tools[0].name, "bash");
  EXPECT_EQ(r.conv.tools[1].name, "read");
  // The schema as the renderer gets it: the function object in the client's key order, Python-style dump.
  EXPECT_EQ(text::pyjson::dumps(r.conv.tools[1].function),
            R"({"name": "read", "description": "Read a file", "parameters": {"type": "object", "properties": )"
            R"({"filePath": {"type": "string"}, "offset": {"type": "integer", "minimum": 0}}, "required": ["filePath"]}})");
  EXPECT_TRUE(r.tools_enabled);
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_TRUE(r.thinking);
  EXPECT_EQ(r.effort.kind, text::Effort::Kind::Default);
  EXPECT_FALSE(r.sampling_given);
}

TEST(ApiChat, OpenAiSdkShapes) {
  // A generic OpenAI SDK request: developer message with content parts, user parts, assistant content null with
  // two calls, tool results as part arrays, max_completion_tokens, stop array, seed.
  json b = {{"model", "gpt-something"},
            {"messages",
             json::array({{{"role", "developer"}, {"content", json::array({{{"type", "text"}, {"text", "Be brief."}},
                                                                           {{"type", "text"}, {"text", "Use tools."}}})}},
                          {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "part one"}},
                                                                      {{"type", "text"}, {"text", "part two"}}})}},
                          {{"role", "assistant"},
                           {"content", nullptr},
                           {"tool_calls", json::array({{{"id", "c1"}, {"type", "function"},
                                                        {"function", {{"name", "read"}, {"arguments", "{}"}}}},
                                                       {{"id", "c2"}, {"type", "function"},
                                                        {"function", {{"name", "bash"}, {"arguments", "{\"command\":\"ls\"}"}}}}})}},
                          {{"role", "tool"}, {"tool_call_id", "c2"},
                           {"content", json::array({{{"type", "text"}, {"text", "a"}}, {{"type", "text"}, {"text", "b"}}})}},
                          {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", nullptr}},
                          {{"role", "assistant"}, {"content", json::array({{{"type", "refusal"}, {"refusal", "no"}}})}},
                          user_msg("again")})},
            {"tools", json::array({read_tool(), bash_tool()})},
            {"max_completion_tokens", 500},
            {"max_tokens", 900},
            {"stop", json::array({"END", "", "STOP"})},
            {"seed", 42},
            {"parallel_tool_calls", true},
            {"user", "someone"},
            {"metadata", {{"k", "v"}}},
            {"some_future_field", {{"nested", json::array({1, 2})}}}};
  GenRequest r = parse_ok(b);
  EXPECT_EQ(r.model, "gpt-something");
  ASSERT_EQ(r.conv.messages.size(), 7u);
  EXPECT_EQ(r.conv.messages[0].role, text::Role::System);  // developer -> system (§4.3)
  EXPECT_EQ(r.conv.messages[0].content, "Be brief.\n\nUse tools.");
  EXPECT_EQ(r.conv.messages[1].content, "part one\n\npart two");
  EXPECT_TRUE(r.conv.messages[1].blocks.empty());
  EXPECT_EQ(r.conv.messages[2].content, "");
  ASSERT_EQ(r.conv.messages[2].tool_calls.size(), 2u);
  EXPECT_EQ(r.conv.messages[2].tool_calls[1].id, "c2");
  EXPECT_EQ(r.conv.messages[2].tool_calls[1].arguments, "{\"command\":\"ls\"}");
  EXPECT_FALSE(r.conv.messages[2].reasoning_content.has_value());
  EXPECT_EQ(r.conv.messages[3].content, "a\n\nb");
  EXPECT_EQ(r.conv.messages[3].tool_call_id, "c2");
  EXPECT_EQ(r.conv.messages[4].content, "");
  EXPECT_EQ(r.conv.messages[5].content, "no");
  EXPECT_EQ(r.max_tokens, 500);  // max_completion_tokens wins
  EXPECT_EQ(r.stop, (std::vector<std::string>{"END", "STOP"}));
  EXPECT_EQ(r.sampling.seed, 42u);
  EXPECT_FALSE(r.sampling_given);
  EXPECT_FALSE(r.stream);
}

TEST(ApiChat, ArgumentsAndSchemasExact) {
  // Arguments given as an object (tolerated) and schemas with big integers, floats and duplicate keys keep
  // Python's json semantics: exact integers, float repr, last duplicate wins at the first position.
  const std::string body = R"({"messages":[{"role":"user","content":"x"},
    {"role":"assistant","content":"ok","tool_calls":[{"id":"i1","type":"function",
      "function":{"name":"f","arguments":{"b":1,"a":[1.0,12345678901234567890123,"é"],"b":2}}}]},
    {"role":"tool","tool_call_id":"i1","content":"r"}],
    "tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object",
      "properties":{"n":{"type":"integer","maximum":123456789012345678901234567890,"multipleOf":0.1}}}}}]})";
  GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 3u);
  ASSERT_EQ(r.conv.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.conv.messages[1].tool_calls[0].arguments, R"({"b": 2, "a": [1.0, 12345678901234567890123, "é"]})");
  ASSERT_EQ(r.conv.tools.size(), 1u);
  EXPECT_EQ(text::pyjson::dumps(r.conv.tools[0].function),
            R"({"name": "f", "parameters": {"type": "object", "properties": {"n": {"type": "integer", )"
            R"("maximum": 123456789012345678901234567890, "multipleOf": 0.1}}}})");
  // Missing / null arguments: no parameters.
  GenRequest r2 = parse_ok(body_with(json::array(
      {user_msg("x"), {{"role", "assistant"}, {"tool_calls", json::array({{{"id", "q"}, {"function", {{"name", "f"}}}}})}}})));
  ASSERT_EQ(r2.conv.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r2.conv.messages[1].tool_calls[0].arguments, "");
}

TEST(ApiChat, LegacyFunctionCalls) {
  json b = body_with(json::array({user_msg("x"),
                                  {{"role", "assistant"}, {"content", nullptr},
                                   {"function_call", {{"name", "bash"}, {"arguments", "{\"command\":\"ls\"}"}}}},
                                  {{"role", "function"}, {"name", "bash"}, {"content", "files"}}}));
  b["functions"] = json::array();  // (ignored)
  GenRequest r = parse_ok(b);
  ASSERT_EQ(r.conv.messages.size(), 3u);
  ASSERT_EQ(r.conv.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(r.conv.messages[1].tool_calls[0].name, "bash");
  EXPECT_EQ(r.conv.messages[1].tool_calls[0].arguments, "{\"command\":\"ls\"}");
  EXPECT_EQ(r.conv.messages[2].role, text::Role::Tool);
  EXPECT_EQ(r.conv.messages[2].content, "files");
}

TEST(ApiChat, ToolChoice) {
  auto with_choice = [](const json& tc, bool tools = true) {
    json b = body_with(json::array({user_msg("x")}));
    if (tools) b["tools"] = json::array({bash_tool(), read_tool()});
    b["tool_choice"] = tc;
    return b.dump();
  };
  GenRequest r = parse_ok(with_choice("none"));
  EXPECT_EQ(r.tool_choice, "none");
  EXPECT_FALSE(r.tools_enabled);
  ASSERT_TRUE(r.conv.tools_enabled.has_value());
  EXPECT_FALSE(*r.conv.tools_enabled);
  r = parse_ok(with_choice("required"));
  EXPECT_EQ(r.tool_choice, "required");
  EXPECT_TRUE(r.tools_enabled);
  r = parse_ok(with_choice({{"type", "function"}, {"function", {{"name", "read"}}}}));
  EXPECT_EQ(r.tool_choice, "read");
  r = parse_ok(with_choice("auto", false));
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_EQ(parse_err(with_choice({{"type", "function"}, {"function", {{"name", "write"}}}})).param,
            "tool_choice.function.name");
  EXPECT_EQ(parse_err(with_choice("required", false)).param, "tool_choice");
  EXPECT_EQ(parse_err(with_choice("sometimes")).param, "tool_choice");
  EXPECT_EQ(parse_err(with_choice(3)).param, "tool_choice");
  EXPECT_EQ(parse_err(with_choice({{"type", "web"}})).param, "tool_choice.type");
}

TEST(ApiChat, ThinkingAndEffort) {
  struct Case {
    json extra;
    std::string model;
    bool thinking;
    text::Effort::Kind kind;
    int value;
  };
  using K = text::Effort::Kind;
  const std::vector<Case> cases = {
      {json::object(), "dsx", true, K::Default, 0},
      {{{"thinking", {{"type", "disabled"}, {"budget_tokens", 1024}}}}, "dsx", false, K::Default, 0},
      {{{"thinking", {{"type", "enabled"}}}}, "dsx", true, K::Default, 0},
      {{{"thinking", true}}, "dsx", true, K::Default, 0},
      {{{"thinking", false}}, "dsx", false, K::Default, 0},
      {{{"think", false}}, "dsx", false, K::Default, 0},
      {{{"chat_template_kwargs", {{"enable_thinking", false}}}}, "dsx", false, K::Default, 0},
      {{{"reasoning_effort", "none"}}, "dsx", false, K::Default, 0},
      {{{"reasoning_effort", "minimal"}}, "dsx", true, K::Low, 0},
      {{{"reasoning_effort", "medium"}}, "dsx", true, K::High, 0},
      {{{"reasoning_effort", "xhigh"}}, "dsx", true, K::High, 0},
      {{{"reasoning_effort", "max"}}, "dsx", true, K::Max, 0},
      {{{"reasoning_effort", "ultra"}}, "dsx", true, K::Max, 0},
      {{{"reasoning_effort", 60}}, "dsx", true, K::Numeric, 60},
      {{{"reasoning_effort", "33"}}, "dsx", true, K::Numeric, 33},
      {json::object(), "deepseek-chat", false, K::Default, 0},
      {json::object(), "deepseek-reasoner", true, K::Default, 0},
      {{{"reasoning_effort", "high"}}, "deepseek-chat", true, K::High, 0},
      {{{"thinking", {{"type", "disabled"}}}, {"reasoning_effort", "high"}}, "dsx", false, K::High, 0},
      {{{"thinking", {{"type", "enabled"}}}, {"reasoning_effort", "none"}}, "dsx", false, K::Default, 0},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i) + ": " + cases[i].extra.dump() + " model " + cases[i].model);
    json b = body_with(json::array({user_msg("x")}));
    b["model"] = cases[i].model;
    for (auto& [k, v] : cases[i].extra.items()) b[k] = v;
    GenRequest r = parse_ok(b);
    EXPECT_EQ(r.thinking, cases[i].thinking);
    EXPECT_EQ(r.effort.kind, cases[i].kind);
    if (cases[i].kind == K::Numeric) EXPECT_EQ(r.effort.value, cases[i].value);
    ASSERT_TRUE(r.conv.thinking.has_value());
    EXPECT_EQ(*r.conv.thinking, cases[i].thinking);
  }
  for (const json& bad : {json("banana"), json(0), json(101), json(1.5), json::array()}) {
    json b = body_with(json::array({user_msg("x")}));
    b["reasoning_effort"] = bad;
    const ApiError e = parse_err(b.dump());
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.param, "reasoning_effort") << bad.dump();
  }
}

TEST(ApiChat, SamplingAndLimits) {
  auto req = [](const json& extra) {
    json b = body_with(json::array({user_msg("x")}));
    for (auto& [k, v] : extra.items()) b[k] = v;
    return b;
  };
  GenRequest r = parse_ok(req({{"top_k", 40}}));
  EXPECT_TRUE(r.sampling_given);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_EQ(r.sampling.top_k, 40);
  r = parse_ok(req({{"temperature", 0}, {"top_p", 0.9}, {"top_k", -1}}));
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 0);
  r = parse_ok(req({{"seed", 18446744073709551615ull}}));
  EXPECT_EQ(r.sampling.seed, 18446744073709551615ull);
  r = parse_ok(req({{"seed", -1}}));
  EXPECT_EQ(r.sampling.seed, 18446744073709551615ull);
  r = parse_ok(req({{"max_tokens", 32000.0}}));
  EXPECT_EQ(r.max_tokens, 32000);
  r = parse_ok(req({{"max_tokens", 1e300}}));
  EXPECT_EQ(r.max_tokens, std::numeric_limits<int64_t>::max());  // as much as the context allows
  r = parse_ok(R"({"messages":[{"role":"user","content":"x"}],"max_tokens":99999999999999999999999999})");
  EXPECT_EQ(r.max_tokens, std::numeric_limits<int64_t>::max());
  r = parse_ok(req({{"n", 1}, {"stop", "###"}, {"stream", false}, {"prompt_cache_key", "sess-1"}}));
  EXPECT_EQ(r.stop, std::vector<std::string>{"###"});
  EXPECT_EQ(r.session_hint, "sess-1");
  r = parse_ok(req({{"n", 1.0}, {"top_logprobs", 0}, {"logprobs", false}, {"top_k", 7.0}, {"max_tokens", 1}}));
  EXPECT_EQ(r.sampling.top_k, 7);
  EXPECT_EQ(r.max_tokens, 1);
  r = parse_ok(req({{"seed", -9223372036854775807.0 - 1}}));
  EXPECT_EQ(r.sampling.seed, 9223372036854775808ull);
  r = parse_ok(req(json::object()));
  EXPECT_EQ(r.max_tokens, 0);
  EXPECT_EQ(r.model, "dsx-v4-flash");
  r = parse_ok(R"({"messages":[{"role":"user","content":"x"}]})");
  EXPECT_EQ(r.model, "deepseek-v4.1-flash");  // (the served id when the client names none)
}

TEST(ApiChat, ResponseFormat) {
  json b = body_with(json::array({user_msg("x")}));
  b["response_format"] = {{"type", "json_schema"},
                          {"json_schema", {{"name", "answer"}, {"strict", true},
                                           {"schema", {{"type", "object"}, {"properties", {{"a", {{"type", "number"}}}}}}}}}};
  GenRequest r = parse_ok(b);
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(text::pyjson::dumps(*r.response_format),
            R"({"type": "json_schema", "json_schema": {"name": "answer", "strict": true, "schema": )"
            R"({"type": "object", "properties": {"a": {"type": "number"}}}}})");
  b["response_format"] = {{"type", "json_object"}};
  r = parse_ok(b);
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(text::pyjson::dumps(*r.response_format), R"({"type": "json_object"})");
  b["response_format"] = {{"type", "text"}};
  EXPECT_FALSE(parse_ok(b).response_format.has_value());
  b["response_format"] = {{"type", "xml"}};
  EXPECT_EQ(parse_err(b.dump()).param, "response_format.type");
  b["response_format"] = {{"type", "json_schema"}};
  EXPECT_EQ(parse_err(b.dump()).param, "response_format.json_schema");
}

// ---- errors ---------------------------------------------------------------------------------------------

TEST(ApiChat, ErrorsNameTheField) {
  const std::string U = R"({"role":"user","content":"hi"})";
  const std::string A = R"({"role":"assistant","content":"","tool_calls":[{"id":"c1","type":"function","function":{"name":"bash","arguments":"{}"}}]})";
  auto msgs = [](const std::string& m) { return R"({"model":"m","messages":[)" + m + "]}"; };
  struct Case {
    std::string body, param, needle;
  };
  const std::vector<Case> cases = {
      {"", "", "invalid JSON"},
      {R"({"messages":[{"role":"user","content":"hi"})", "", "invalid JSON"},
      {R"({"messages":[{"role":"user","content":"hi"}]} x)", "", "invalid JSON"},
      {R"({"messages":[{"role":"user","content":"hi"}],"temperature":NaN})", "", "invalid JSON"},
      {R"({"messages":[{"role":"user","content":"hi"}],"temperature":1e400})", "", "invalid JSON"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"bad \xC3\x28 utf8\"}]}", "", "invalid JSON"},
      {"{\"messages\":[{\"role\":\"user\",\"content\":\"\xED\xA0\x80\"}]}", "", "invalid JSON"},
      {R"({"messages":[{"role":"user","content":"lone \ud800"}]})", "", "invalid JSON"},
      {"[1,2]", "body", "expected a JSON object"},
      {R"({"model":"m"})", "messages", "missing"},
      {R"({"messages":{}})", "messages", "expected an array"},
      {R"({"messages":[]})", "messages", "at least one"},
      {msgs(R"("hi")"), "messages[0]", "expected an object"},
      {msgs(R"({"content":"hi"})"), "messages[0].role", "missing"},
      {msgs(R"({"role":5,"content":"hi"})"), "messages[0].role", "expected a string"},
      {msgs(R"({"role":"robot","content":"hi"})"), "messages[0].role", "unknown role"},
      {msgs(R"({"role":"latest_reminder","content":"hi"})"), "messages[0].role", "unknown role"},
      {msgs(U + R"(,{"role":"user","content":5})"), "messages[1].content", "expected a string, null or an array"},
      {msgs(R"({"role":"user","content":{"text":"hi"}})"), "messages[0].content", "expected a string, null or an array"},
      {msgs(R"({"role":"user","content":[{"type":"image_url","image_url":{"url":"data:"}}]})"),
       "messages[0].content[0].type", "text-only model"},
      {msgs(R"({"role":"user","content":[{"type":"text","text":"a"},{"type":"input_audio","input_audio":{}}]})"),
       "messages[0].content[1].type", "text-only model"},
      {msgs(R"({"role":"system","content":[{"type":"file","file":{}}]})"), "messages[0].content[0].type", "text-only model"},
      {msgs(R"({"role":"user","content":[{"type":"text","text":5}]})"), "messages[0].content[0].text", "expected a string"},
      {msgs(R"({"role":"user","content":[{"type":"text"}]})"), "messages[0].content[0].text", "missing"},
      {msgs(R"({"role":"user","content":[{"text":"a"}]})"), "messages[0].content[0].type", "missing"},
      {msgs(R"({"role":"user","content":[7]})"), "messages[0].content[0]", "expected an object"},
      {msgs(U + R"(,{"role":"assistant","content":"x","reasoning_content":5})"), "messages[1].reasoning_content",
       "expected a string"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":{}})"), "messages[1].tool_calls", "expected an array"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[5]})"), "messages[1].tool_calls[0]", "expected an object"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[{"id":"c","type":"function"}]})"),
       "messages[1].tool_calls[0].function", "missing"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[{"id":"c","function":{"name":3}}]})"),
       "messages[1].tool_calls[0].function.name", "expected a string"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[{"id":"c","function":{"name":"f","arguments":5}}]})"),
       "messages[1].tool_calls[0].function.arguments", "expected a JSON string"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[{"id":"c","type":"custom","custom":{}}]})"),
       "messages[1].tool_calls[0].type", "unsupported tool call type"},
      {msgs(U + R"(,{"role":"assistant","tool_calls":[{"id":7,"function":{"name":"f"}}]})"),
       "messages[1].tool_calls[0].id", "expected a string"},
      {msgs(U + "," + A + R"(,{"role":"tool","content":"r"})"), "messages[2].tool_call_id", "missing"},
      {msgs(U + "," + A + R"(,{"role":"tool","tool_call_id":"c9","content":"r"})"), "messages[2].tool_call_id",
       "replay the full message history"},
      {msgs(U + R"(,{"role":"tool","tool_call_id":"c1","content":"r"})"), "messages[1].tool_call_id",
       "replay the full message history"},
      {msgs(U + "," + A + R"(,{"role":"tool","tool_call_id":"c1","content":[{"type":"image_url"}]})"),
       "messages[2].content[0].type", "text-only model"},
      {msgs(U + R"(,{"role":"function","content":"r"})"), "messages[1].name", "missing"},
      {R"({"messages":[)" + U + R"(],"tools":{}})", "tools", "expected an array"},
      {R"({"messages":[)" + U + R"(],"tools":[{"type":"custom","name":"apply_patch"}]})", "tools[0].type",
       "unsupported tool type"},
      {R"({"messages":[)" + U + R"(],"tools":[{"type":"function"}]})", "tools[0].function", "missing"},
      {R"({"messages":[)" + U + R"(],"tools":[{"type":"function","function":{"name":""}}]})", "tools[0].function.name",
       "must not be empty"},
      {R"({"messages":[)" + U + R"(],"tools":[{"type":"function","function":{"name":"f","parameters":"x"}}]})",
       "tools[0].function.parameters", "expected an object"},
      {R"({"messages":[)" + U + R"(],"tools":[{"type":"function","function":{"name":"f","description":[]}}]})",
       "tools[0].function.description", "expected a string"},
      {R"({"messages":[)" + U + R"(],"n":2})", "n", "n = 1"},
      {R"({"messages":[)" + U + R"(],"n":"2"})", "n", "expected an integer"},
      {R"({"messages":[)" + U + R"(],"stream":"yes"})", "stream", "expected a boolean"},
      {R"({"messages":[)" + U + R"(],"stream_options":{"include_usage":1}})", "stream_options.include_usage",
       "expected a boolean"},
      {R"({"messages":[)" + U + R"(],"stream_options":true})", "stream_options", "expected an object"},
      {R"({"messages":[)" + U + R"(],"temperature":3})", "temperature", "between"},
      {R"({"messages":[)" + U + R"(],"temperature":"hot"})", "temperature", "expected a number"},
      {R"({"messages":[)" + U + R"(],"temperature":true})", "temperature", "expected a number"},
      {R"({"messages":[)" + U + R"(],"top_p":1.5})", "top_p", "between"},
      {R"({"messages":[)" + U + R"(],"top_k":-2})", "top_k", "at least"},
      {R"({"messages":[)" + U + R"(],"top_k":2.5})", "top_k", "expected an integer"},
      {R"({"messages":[)" + U + R"(],"seed":1.5})", "seed", "expected an integer"},
      {R"({"messages":[)" + U + R"(],"seed":1e30})", "seed", "at most"},
      {R"({"messages":[)" + U + R"(],"max_tokens":0})", "max_tokens", "at least 1"},
      {R"({"messages":[)" + U + R"(],"max_tokens":-5})", "max_tokens", "at least 1"},
      {R"({"messages":[)" + U + R"(],"max_tokens":-1e300})", "max_tokens", "at least 1"},
      {R"({"messages":[)" + U + R"(],"max_tokens":1.5})", "max_tokens", "expected an integer"},
      {R"({"messages":[)" + U + R"(],"max_completion_tokens":"100"})", "max_completion_tokens", "expected an integer"},
      {R"({"messages":[)" + U + R"(],"stop":5})", "stop", "expected a string or an array"},
      {R"({"messages":[)" + U + R"(],"stop":["a",5]})", "stop[1]", "expected a string"},
      {R"({"messages":[)" + U + R"(],"thinking":"on"})", "thinking", "expected a boolean or an object"},
      {R"({"messages":[)" + U + R"(],"thinking":{"type":"sometimes"}})", "thinking.type", "expected"},
      {R"({"messages":[)" + U + R"(],"logprobs":true})", "logprobs", "not supported"},
      {R"({"messages":[)" + U + R"(],"modalities":["text","audio"]})", "modalities[1]", "text-only model"},
      {R"({"messages":[)" + U + R"(],"model":5})", "model", "expected a string"},
      {R"({"messages":[)" + U + R"(],"response_format":"json"})", "response_format", "expected an object"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("body: " + c.body);
    const ApiError e = parse_err(c.body);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.param, c.param);
    EXPECT_NE(e.message.find(c.needle), std::string::npos) << e.message;
    if (!c.param.empty()) EXPECT_EQ(e.message.rfind(c.param + ": ", 0), 0u) << e.message;
    EXPECT_TRUE(text::valid_utf8(e.message)) << e.message;
    // The body in the OpenAI error shape.
    const json body = json::parse(chat_adapter().error_body(e));
    EXPECT_EQ(body.at("error").at("message"), e.message);
    EXPECT_EQ(body.at("error").at("type"), "invalid_request_error");
  }
}

TEST(ApiChat, DeepNestingIsAClientError) {
  // Deep nesting in an ignored field: no crash, a 400 (the Python-compatible parse limits the depth).
  const std::string deep(200000, '[');
  const ApiError e = parse_err(R"({"messages":[{"role":"user","content":"x"}],"x":)" + deep + std::string(200000, ']') + "}");
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_NE(e.message.find("invalid JSON"), std::string::npos) << e.message;
  // Moderate nesting in an ignored field is fine.
  parse_ok(R"({"messages":[{"role":"user","content":"x"}],"x":)" + std::string(100, '[') + std::string(100, ']') + "}");
}

namespace {

// Every failure is a well-formed 400 invalid_request_error naming its field; never an exception.
void expect_clean(const std::string& body, int* failures = nullptr) {
  GenRequest req;
  ApiError err;
  bool ok = false;
  EXPECT_NO_THROW(ok = chat_adapter().parse(body, test_ctx(), req, err)) << body;
  if (ok) return;
  if (failures) ++*failures;
  EXPECT_EQ(err.status, 400) << body;
  EXPECT_EQ(err.type, "invalid_request_error") << body;
  EXPECT_FALSE(err.message.empty()) << body;
  EXPECT_TRUE(text::valid_utf8(err.message)) << body;
  if (!err.param.empty()) EXPECT_EQ(err.message.rfind(err.param + ": ", 0), 0u) << err.message;
  EXPECT_NO_THROW(json::parse(chat_adapter().error_body(err)));
}

json full_body() {
  return {{"model", "dsx-v4-flash"},
          {"messages", json::array({{{"role", "system"}, {"content", "sys"}},
                                    {{"role", "user"}, {"content", json::array({{{"type", "text"}, {"text", "q"}}})}},
                                    {{"role", "assistant"},
                                     {"content", ""},
                                     {"reasoning_content", "r"},
                                     {"tool_calls", json::array({{{"id", "c1"}, {"type", "function"},
                                                                  {"function", {{"name", "bash"}, {"arguments", "{\"command\":\"ls\"}"}}}}})}},
                                    {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "out"}}})},
          {"tools", json::array({bash_tool()})},
          {"tool_choice", {{"type", "function"}, {"function", {{"name", "bash"}}}}},
          {"stream", true},
          {"stream_options", {{"include_usage", true}}},
          {"max_tokens", 100},
          {"temperature", 0.7},
          {"top_p", 0.9},
          {"top_k", 20},
          {"seed", 1},
          {"stop", json::array({"x"})},
          {"reasoning_effort", "high"},
          {"thinking", {{"type", "enabled"}}},
          {"response_format", {{"type", "json_object"}}}};
}

void replace_everywhere(json& root, json& node, const std::vector<json>& subs, int& checked, int& failures) {
  std::vector<json*> children;
  if (node.is_object()) for (auto& [k, v] : node.items()) children.push_back(&v);
  if (node.is_array()) for (auto& v : node) children.push_back(&v);
  for (json* c : children) {
    const json saved = *c;
    for (const json& s : subs) {
      if (s == saved) continue;
      *c = s;
      expect_clean(root.dump(), &failures);
      ++checked;
    }
    *c = saved;
    replace_everywhere(root, *c, subs, checked, failures);
  }
}

}  // namespace

TEST(ApiChat, WrongTypesAtEveryLevel) {
  json root = full_body();
  parse_ok(root);
  const std::vector<json> subs = {nullptr, json(1), json(-7), json(1e300), json(2.5), json("s"), json(true),
                                  json::array(), json::object(), json::array({1})};
  int checked = 0, failures = 0;
  replace_everywhere(root, root, subs, checked, failures);
  EXPECT_GT(checked, 300);
  EXPECT_GT(failures, checked / 3);  // most substitutions are rejected (and cleanly)
}

TEST(ApiChat, TruncationsAndMutations) {
  const std::string body = full_body().dump();
  int failures = 0;
  for (size_t k = 0; k < body.size(); ++k) expect_clean(body.substr(0, k), &failures);
  EXPECT_EQ(failures, static_cast<int>(body.size()));  // every proper prefix is invalid JSON
  std::mt19937 rng(1234);
  const char alphabet[] = "{}[]\",:0123456789.eE-+ntfalsrue\\u\xC3\xA9\xFF\x00 ";
  for (int i = 0; i < 3000; ++i) {
    std::string m = body;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % m.size();
      const char c = alphabet[rng() % (sizeof(alphabet) - 1)];
      switch (rng() % 3) {
        case 0: m[at] = c; break;
        case 1: m.insert(m.begin() + static_cast<std::ptrdiff_t>(at), c); break;
        default: m.erase(at, 1); break;
      }
    }
    expect_clean(m);
    if (::testing::Test::HasFailure()) break;
  }
}

// ---- the stream -----------------------------------------------------------------------------------------

TEST(ApiChat, StreamEventByEvent) {
  auto ch = std::make_shared<Channel>();
  GenRequest req = stream_req(true);
  auto sink = chat_adapter().make_sink(req, test_ctx(), ch);
  EXPECT_FALSE(sink->cancelled());
  sink->keepalive();  // (queued)
  sink->start(usage(100, 40, 0, 0));
  sink->events({ev(text::EventType::ReasoningDelta, "Let me "), ev(text::EventType::ReasoningDelta, "think."),
                ev(text::EventType::ReasoningEnd)});
  sink->keepalive();
  sink->events({ev(text::EventType::ContentDelta, "I'll run it."), ev(text::EventType::ContentDelta, "")});
  sink->events({ev(text::EventType::ToolCallStart, "", 0, "call_aaa", "bash"),
                ev(text::EventType::ToolCallDelta, "{\"command\": ", 0, "call_aaa", "bash"),
                ev(text::EventType::ToolCallDelta, "\"ls\"", 0, "call_aaa", "bash")});
  sink->events({ev(text::EventType::ToolCallDelta, "}", 0, "call_aaa", "bash"),
                ev(text::EventType::ToolCallEnd, "{\"command\": \"ls\"}", 0, "call_aaa", "bash"),
                ev(text::EventType::ToolCallStart, "", 1, "call_bbb", "read"),
                ev(text::EventType::ToolCallDelta, "{\"filePath\": \"a\"}", 1, "call_bbb", "read"),
                ev(text::EventType::ToolCallEnd, "{\"filePath\": \"a\"}", 1, "call_bbb", "read")});
  text::ParseResult r;
  r.reasoning = "Let me think.";
  r.reasoning_started = r.reasoning_closed = true;
  r.content = "I'll run it.";
  r.tool_calls = {{"call_aaa", "bash", "{\"command\": \"ls\"}"}, {"call_bbb", "read", "{\"filePath\": \"a\"}"}};
  r.finish = text::FinishReason::ToolCalls;
  sink->end(r, usage(100, 40, 25, 9));
  EXPECT_FALSE(ch->done());  // (bytes still queued)
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
  EXPECT_EQ(ch->status(), 200);
  EXPECT_EQ(ch->content_type(), "text/event-stream");
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 13u);
  EXPECT_TRUE(evs[0].comment);
  EXPECT_EQ(evs[0].raw, ": keepalive");
  const std::string id = evs[1].data.at("id");
  EXPECT_EQ(id.rfind("chatcmpl-", 0), 0u);
  EXPECT_GT(id.size(), 20u);
  for (size_t i = 1; i < evs.size() - 1; ++i) {
    if (evs[i].comment) continue;
    SCOPED_TRACE("event " + std::to_string(i));
    expect_chunk_head(evs[i].data, id);
  }
  // 1: role
  EXPECT_EQ(delta_of(evs[1].data), json({{"role", "assistant"}}));
  EXPECT_TRUE(evs[1].data["choices"][0]["finish_reason"].is_null());
  EXPECT_EQ(evs[1].data["choices"][0]["index"], 0);
  // 2: reasoning (the two deltas of one call as one chunk)
  EXPECT_EQ(delta_of(evs[2].data), json({{"reasoning_content", "Let me think."}}));
  EXPECT_TRUE(evs[3].comment);
  EXPECT_EQ(delta_of(evs[4].data), json({{"content", "I'll run it."}}));
  // 5: the first call's header
  EXPECT_EQ(delta_of(evs[5].data),
            json::parse(R"({"tool_calls":[{"index":0,"id":"call_aaa","type":"function","function":{"name":"bash","arguments":""}}]})"));
  EXPECT_EQ(delta_of(evs[6].data), json::parse(R"({"tool_calls":[{"index":0,"function":{"arguments":"{\"command\": \"ls\""}}]})"));
  EXPECT_EQ(delta_of(evs[7].data), json::parse(R"({"tool_calls":[{"index":0,"function":{"arguments":"}"}}]})"));
  EXPECT_EQ(delta_of(evs[8].data)["tool_calls"][0]["index"], 1);
  EXPECT_EQ(delta_of(evs[8].data)["tool_calls"][0]["id"], "call_bbb");
  EXPECT_EQ(delta_of(evs[8].data)["tool_calls"][0]["function"]["name"], "read");
  EXPECT_EQ(delta_of(evs[9].data)["tool_calls"][0]["function"]["arguments"], "{\"filePath\": \"a\"}");
  // 10: finish
  EXPECT_EQ(delta_of(evs[10].data), json::object());
  EXPECT_EQ(evs[10].data["choices"][0]["finish_reason"], "tool_calls");
  // 11: usage, then [DONE]
  EXPECT_EQ(evs[11].data.at("choices"), json::array());
  EXPECT_EQ(evs[11].data.at("usage").at("total_tokens"), 125);
  EXPECT_TRUE(evs[12].done);
}

TEST(ApiChat, StreamUsageChunkAndDone) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(true), test_ctx(), ch);
  sink->start(usage(100, 40, 0, 0));
  sink->events({ev(text::EventType::ContentDelta, "Hi")});
  text::ParseResult r;
  r.content = "Hi";
  r.finish = text::FinishReason::Stop;
  sink->end(r, usage(100, 40, 25, 9));
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 5u);
  EXPECT_EQ(delta_of(evs[1].data), json({{"content", "Hi"}}));
  EXPECT_EQ(evs[2].data["choices"][0]["finish_reason"], "stop");
  const json& u = evs[3].data;
  EXPECT_EQ(u.at("object"), "chat.completion.chunk");
  EXPECT_EQ(u.at("choices"), json::array());
  EXPECT_EQ(u.at("usage").at("prompt_tokens"), 100);
  EXPECT_EQ(u.at("usage").at("completion_tokens"), 25);
  EXPECT_EQ(u.at("usage").at("total_tokens"), 125);
  EXPECT_EQ(u.at("usage").at("prompt_tokens_details").at("cached_tokens"), 40);
  EXPECT_EQ(u.at("usage").at("completion_tokens_details").at("reasoning_tokens"), 9);
  EXPECT_EQ(u.at("usage").at("prompt_cache_hit_tokens"), 40);
  EXPECT_EQ(u.at("usage").at("prompt_cache_miss_tokens"), 60);
  EXPECT_TRUE(evs[4].done);
  // Nothing after the end.
  sink->events({ev(text::EventType::ContentDelta, "late")});
  sink->keepalive();
  sink->fail(ApiError{});
  EXPECT_TRUE(ch->drain().empty());
}

TEST(ApiChat, StreamWithoutUsageFinishLength) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(false), test_ctx(), ch);
  sink->start(usage(10, 0, 0, 0));
  sink->events({ev(text::EventType::ReasoningDelta, "never closed")});
  text::ParseResult r;
  r.reasoning = "never closed";
  r.reasoning_started = true;
  r.finish = text::FinishReason::Length;
  sink->end(r, usage(10, 0, 3, 3));
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 4u);
  EXPECT_EQ(delta_of(evs[1].data), json({{"reasoning_content", "never closed"}}));
  EXPECT_EQ(evs[2].data["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(evs[2].data.contains("usage"));
  EXPECT_TRUE(evs[3].done);
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
}

TEST(ApiChat, StreamStopSequenceIsStop) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(false), test_ctx(), ch);
  sink->start(Usage{});
  text::ParseResult r;
  r.finish = text::FinishReason::StopSequence;
  r.stop_sequence = "###";
  sink->end(r, Usage{});
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 3u);
  EXPECT_EQ(evs[1].data["choices"][0]["finish_reason"], "stop");
}

TEST(ApiChat, StreamErrorEventEndsTheStream) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(true), test_ctx(), ch);
  sink->start(Usage{});
  sink->events({ev(text::EventType::ToolCallStart, "", 0, "call_x", "bash"),
                ev(text::EventType::ToolCallDelta, "{\"command\": \"", 0, "call_x", "bash"),
                ev(text::EventType::Error, "invalid tool call: unexpected tag"),
                ev(text::EventType::ContentDelta, "after the error")});
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
  text::ParseResult r;
  r.stream_error = true;
  r.error = "invalid tool call: unexpected tag";
  sink->end(r, Usage{});  // (ignored: the stream is over)
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 4u);
  EXPECT_TRUE(delta_of(evs[1].data).contains("tool_calls"));
  EXPECT_EQ(delta_of(evs[2].data)["tool_calls"][0]["function"]["arguments"], "{\"command\": \"");
  ASSERT_TRUE(evs[3].data.contains("error"));
  EXPECT_EQ(evs[3].data["error"]["message"], "invalid tool call: unexpected tag");
  EXPECT_EQ(evs[3].data["error"]["type"], "server_error");
  EXPECT_EQ(ch->status(), 200);
}

TEST(ApiChat, StreamFailBeforeStartIsAnHttpError) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(true), test_ctx(), ch);
  ApiError e;
  e.status = 400;
  e.message = "This model's maximum context length is 131072 tokens; the prompt has 140000.";
  e.code = "context_length_exceeded";
  e.param = "messages";
  sink->fail(e);
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
  EXPECT_EQ(ch->status(), 400);
  EXPECT_EQ(ch->content_type(), "application/json");
  const json body = json::parse(ch->drain());
  EXPECT_EQ(body.at("error").at("code"), "context_length_exceeded");
  EXPECT_EQ(body.at("error").at("type"), "invalid_request_error");
  EXPECT_EQ(body.at("error").at("param"), "messages");
  EXPECT_EQ(body.at("error").at("message"), e.message);
}

TEST(ApiChat, StreamFailAfterStartIsAnErrorEvent) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(true), test_ctx(), ch);
  sink->start(Usage{});
  sink->events({ev(text::EventType::ContentDelta, "partial")});
  ApiError e;
  e.status = 500;
  e.type = "server_error";
  e.message = "backend failure";
  sink->fail(e);
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
  EXPECT_EQ(ch->status(), 200);
  const auto evs = split_sse(ch->drain());
  ASSERT_EQ(evs.size(), 3u);
  EXPECT_EQ(evs[2].data, json::parse(R"({"error":{"message":"backend failure","type":"server_error","param":null,"code":null}})"));
  // A client-side error after a keep-alive (headers may be out): an error event keeping its type and code.
  auto ch2 = std::make_shared<Channel>();
  auto sink2 = chat_adapter().make_sink(stream_req(true), test_ctx(), ch2);
  sink2->keepalive();
  ApiError c;
  c.status = 400;
  c.message = "too long";
  c.code = "context_length_exceeded";
  sink2->fail(c);
  const auto evs2 = split_sse(ch2->drain());
  ASSERT_EQ(evs2.size(), 2u);
  EXPECT_TRUE(evs2[0].comment);
  EXPECT_EQ(evs2[1].data["error"]["type"], "invalid_request_error");
  EXPECT_EQ(evs2[1].data["error"]["code"], "context_length_exceeded");
}

TEST(ApiChat, CancelledFollowsTheChannel) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(stream_req(true), test_ctx(), ch);
  EXPECT_FALSE(sink->cancelled());
  ch->cancel();
  EXPECT_TRUE(sink->cancelled());
}

// ---- the JSON answer ------------------------------------------------------------------------------------

TEST(ApiChat, NonStreamAnswer) {
  auto ch = std::make_shared<Channel>();
  GenRequest req;
  req.model = "my-model";
  auto sink = chat_adapter().make_sink(req, test_ctx(), ch);
  sink->start(usage(50, 10, 0, 0));
  sink->keepalive();
  sink->events({ev(text::EventType::ContentDelta, "ignored: the answer comes from the result")});
  EXPECT_TRUE(ch->drain().empty());
  EXPECT_FALSE(ch->wait_closed(std::chrono::milliseconds(0)));
  text::ParseResult r;
  r.reasoning = "thought";
  r.reasoning_started = r.reasoning_closed = true;
  r.content = "Here.";
  r.tool_calls = {{"call_1", "bash", "{\"command\": \"ls\"}"}};
  r.finish = text::FinishReason::ToolCalls;
  sink->end(r, usage(50, 10, 12, 4));
  EXPECT_TRUE(ch->wait_closed(std::chrono::milliseconds(0)));
  EXPECT_EQ(ch->status(), 200);
  EXPECT_EQ(ch->content_type(), "application/json");
  const json b = json::parse(ch->drain());
  EXPECT_EQ(b.at("object"), "chat.completion");
  EXPECT_EQ(b.at("id").get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(b.at("model"), "my-model");
  EXPECT_TRUE(b.at("created").is_number_integer());
  ASSERT_EQ(b.at("choices").size(), 1u);
  const json& c = b["choices"][0];
  EXPECT_EQ(c.at("index"), 0);
  EXPECT_EQ(c.at("finish_reason"), "tool_calls");
  EXPECT_EQ(c.at("message").at("role"), "assistant");
  EXPECT_EQ(c.at("message").at("content"), "Here.");
  EXPECT_EQ(c.at("message").at("reasoning_content"), "thought");
  EXPECT_EQ(c.at("message").at("tool_calls"),
            json::parse(R"([{"id":"call_1","type":"function","function":{"name":"bash","arguments":"{\"command\": \"ls\"}"}}])"));
  EXPECT_EQ(b.at("usage").at("prompt_tokens"), 50);
  EXPECT_EQ(b.at("usage").at("completion_tokens"), 12);
  EXPECT_EQ(b.at("usage").at("total_tokens"), 62);
  EXPECT_EQ(b.at("usage").at("prompt_tokens_details").at("cached_tokens"), 10);
  EXPECT_EQ(b.at("usage").at("completion_tokens_details").at("reasoning_tokens"), 4);
}

TEST(ApiChat, NonStreamContentNullOnlyWithToolCalls) {
  auto answer = [](const text::ParseResult& r) {
    auto ch = std::make_shared<Channel>();
    auto sink = chat_adapter().make_sink(GenRequest{}, test_ctx(), ch);
    sink->start(Usage{});
    sink->end(r, Usage{});
    return json::parse(ch->drain());
  };
  text::ParseResult calls_only;
  calls_only.tool_calls = {{"call_1", "f", "{}"}};
  calls_only.finish = text::FinishReason::ToolCalls;
  json b = answer(calls_only);
  EXPECT_TRUE(b["choices"][0]["message"]["content"].is_null());
  EXPECT_FALSE(b["choices"][0]["message"].contains("reasoning_content"));
  EXPECT_EQ(b["model"], "deepseek-v4.1-flash");  // (no model in the request: the served id)
  text::ParseResult empty;
  empty.finish = text::FinishReason::Length;
  b = answer(empty);
  EXPECT_EQ(b["choices"][0]["message"]["content"], "");
  EXPECT_FALSE(b["choices"][0]["message"].contains("tool_calls"));
  EXPECT_EQ(b["choices"][0]["finish_reason"], "length");
  // A malformed block the parser gave back as content (stream_error set after a streamed header).
  text::ParseResult failed;
  failed.content = "raw <DSML text";
  failed.stream_error = true;
  failed.finish = text::FinishReason::Stop;
  b = answer(failed);
  EXPECT_EQ(b["choices"][0]["message"]["content"], "raw <DSML text");
  EXPECT_EQ(b["choices"][0]["finish_reason"], "stop");
}

TEST(ApiChat, NonStreamFail) {
  auto ch = std::make_shared<Channel>();
  auto sink = chat_adapter().make_sink(GenRequest{}, test_ctx(), ch);
  sink->start(Usage{});
  ApiError e;
  e.status = 503;
  e.type = "server_error";
  e.message = "shutting down";
  sink->fail(e);
  EXPECT_EQ(ch->status(), 503);
  EXPECT_EQ(ch->content_type(), "application/json");
  EXPECT_EQ(json::parse(ch->drain()),
            json::parse(R"({"error":{"message":"shutting down","type":"server_error","param":null,"code":null}})"));
  sink->end(text::ParseResult{}, Usage{});
  EXPECT_TRUE(ch->drain().empty());
}

TEST(ApiChat, ErrorBody) {
  ApiError e;
  e.message = "messages: missing";
  e.param = "messages";
  EXPECT_EQ(json::parse(chat_adapter().error_body(e)),
            json::parse(R"({"error":{"message":"messages: missing","type":"invalid_request_error","param":"messages","code":null}})"));
  e.code = "context_length_exceeded";
  EXPECT_EQ(json::parse(chat_adapter().error_body(e))["error"]["code"], "context_length_exceeded");
  EXPECT_EQ(chat_adapter().api, Api::Chat);
}

// ---- the real parser's events through the sink ----------------------------------------------------------

TEST(ApiChat, ParserEventsThroughTheStream) {
  const std::string D = "｜DSML｜";
  const std::string completion = "I should list the files.</think>Listing.\n\n<" + D + " calls>\n<" + D +
                                 " invoke name=\"bash\">\n<" + D + " parameter name=\"command\" string=\"true\">ls \"-la\"</" +
                                 D + " parameter>\n<" + D + " parameter name=\"timeout\" string=\"false\">30</" + D +
                                 " parameter>\n</" + D + " invoke>\n</" + D + " calls>";
  GenRequest req = parse_ok(json{{"model", "dsx-v4-flash"},
                                 {"messages", json::array({user_msg("list")})},
                                 {"tools", json::array({bash_tool()})},
                                 {"stream", true}});
  text::ParserOptions po;
  po.profile = text::Profile::V41;
  po.thinking = req.thinking;
  po.tools_enabled = req.tools_enabled && !req.conv.tools.empty();
  po.tools = req.conv.tools;
  for (size_t piece : {size_t(1), size_t(3), size_t(7), completion.size()}) {
    SCOPED_TRACE("piece " + std::to_string(piece));
    auto ch = std::make_shared<Channel>();
    auto sink = chat_adapter().make_sink(req, test_ctx(), ch);
    text::DsmlParser p(po);
    sink->start(usage(20, 0, 0, 0));
    for (size_t at = 0; at < completion.size() && !p.should_stop(); at += piece)
      sink->events(p.push(std::string_view(completion).substr(at, piece)));
    sink->events(p.finish(text::EndCause::Eos));
    const text::ParseResult& r = p.result();
    ASSERT_EQ(r.tool_calls.size(), 1u);
    sink->end(r, usage(20, 0, 40, 8));
    const auto evs = split_sse(ch->drain());
    ASSERT_GE(evs.size(), 5u);
    std::string reasoning, content, args, call_id, call_name;
    std::string finish;
    for (size_t i = 1; i < evs.size(); ++i) {
      if (evs[i].done) {
        EXPECT_EQ(i, evs.size() - 1);
        continue;
      }
      const json& d = delta_of(evs[i].data);
      if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
      if (d.contains("content")) content += d["content"].get<std::string>();
      if (d.contains("tool_calls")) {
        const json& tc = d["tool_calls"][0];
        EXPECT_EQ(tc["index"], 0);
        if (tc.contains("id")) {
          EXPECT_TRUE(call_id.empty());
          call_id = tc["id"];
          call_name = tc["function"]["name"];
          EXPECT_EQ(tc["function"]["arguments"], "");
        }
        args += tc["function"]["arguments"].get<std::string>();
      }
      if (!evs[i].data["choices"][0]["finish_reason"].is_null()) finish = evs[i].data["choices"][0]["finish_reason"];
    }
    EXPECT_EQ(reasoning, "I should list the files.");
    EXPECT_EQ(content, "Listing.");
    EXPECT_EQ(call_id, r.tool_calls[0].id);
    EXPECT_EQ(call_id.rfind("call_", 0), 0u);
    EXPECT_EQ(call_name, "bash");
    EXPECT_EQ(args, r.tool_calls[0].arguments);
    EXPECT_EQ(json::parse(args), json::parse(R"({"command": "ls \"-la\"", "timeout": 30})"));
    EXPECT_EQ(finish, "tool_calls");
    EXPECT_TRUE(evs.back().done);
  }
}

// ---- /v1/models -----------------------------------------------------------------------------------------

TEST(ApiChat, ModelsBodies) {
  const AdapterContext ctx = test_ctx();
  const json list = json::parse(models_list_body(ctx));
  EXPECT_EQ(list.at("object"), "list");
  ASSERT_EQ(list.at("data").size(), 1u);
  const json& m = list["data"][0];
  EXPECT_EQ(m.at("id"), "deepseek-v4.1-flash");
  EXPECT_EQ(m.at("object"), "model");
  EXPECT_EQ(m.at("owned_by"), "dsx");
  EXPECT_EQ(m.at("context_length"), 131072);
  EXPECT_TRUE(m.at("created").is_number_integer());
  EXPECT_EQ(json::parse(models_body(ctx, "")), list);
  const json one = json::parse(models_body(ctx, "dsx-v4-flash"));
  EXPECT_EQ(one.at("id"), "dsx-v4-flash");
  EXPECT_EQ(one.at("object"), "model");
  EXPECT_EQ(one.at("context_length"), 131072);
  EXPECT_EQ(one.at("created"), m.at("created"));
  EXPECT_EQ(json::parse(models_body(ctx, "a\"b/é"))["id"], "a\"b/é");
}
