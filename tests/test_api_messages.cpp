// Tests of the Anthropic Messages adapter (src/server/api_messages.cpp): the request shapes
// Claude Code and @ai-sdk/anthropic really send (shared/agents/README.md) -> Conversation and
// request settings; the SSE stream and the JSON answer the Sink writes for scripted event
// sequences; the signed-thinking round trip; errors for bad input.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/adapters.h"
#include "server/api_messages.h"
#include "server/signing.h"
#include "text/chat.h"
#include "text/dsml.h"

using namespace dsx;
using namespace dsx::server;
using J = nlohmann::ordered_json;

namespace {

AdapterContext test_ctx() {
  AdapterContext c;
  c.secret = "0123456789abcdef0123456789abcdef";
  c.model_id = "deepseek-v4.1-flash";
  c.context_tokens = 65536;
  return c;
}

struct Parsed {
  bool ok = false;
  GenRequest req;
  ApiError err;
};

Parsed parse(const std::string& body, const AdapterContext& ctx = test_ctx()) {
  Parsed p;
  p.ok = messages_adapter().parse(body, ctx, p.req, p.err);
  return p;
}

Parsed parse(const J& body, const AdapterContext& ctx = test_ctx()) { return parse(body.dump(), ctx); }

// A minimal valid request to modify.
J base() {
  return J::parse(R"({"model":"dsx-v4-flash","max_tokens":1024,
                      "messages":[{"role":"user","content":"say hi"}]})");
}

J bash_tool() {
  return J::parse(R"({"name":"Bash","description":"Run a shell command",
    "input_schema":{"$schema":"https://json-schema.org/draft/2020-12/schema","type":"object",
      "properties":{"command":{"type":"string","description":"The command"},
                    "timeout":{"type":"number"}},
      "required":["command"],"additionalProperties":false}})");
}

// Claude Code 2.1.x with an unknown model name: the newest feature set (README "Per-client traffic").
J claude_code_request() {
  J r = J::object();
  r["model"] = "dsx-v4-flash";
  r["max_tokens"] = 32000;
  r["stream"] = true;
  r["system"] = J::parse(R"([
    {"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.197; cc_entrypoint=sdk-cli;"},
    {"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude.","cache_control":{"type":"ephemeral"}},
    {"type":"text","text":"You are an interactive agent that helps users with software engineering tasks.","cache_control":{"type":"ephemeral"}}
  ])");
  r["messages"] = J::parse(R"([
    {"role":"user","content":[
      {"type":"text","text":"<system-reminder>\nToday's date is 2026-12-01.\n</system-reminder>"},
      {"type":"text","text":"say hi","cache_control":{"type":"ephemeral"}}]},
    {"role":"system","content":"# Environment\nWorking directory: /tmp/x"}
  ])");
  J read = J::parse(R"({"name":"Read","description":"Read a file",
    "input_schema":{"type":"object","properties":{"file_path":{"type":"string"},"limit":{"type":"integer"}},
      "required":["file_path"],"additionalProperties":false}})");
  r["tools"] = J::array({bash_tool(), read});
  r["thinking"] = J::parse(R"({"type":"adaptive"})");
  r["output_config"] = J::parse(R"({"effort":"high"})");
  r["context_management"] = J::parse(R"({"edits":[{"type":"clear_thinking_20251015","keep":"all"}]})");
  r["metadata"] = J::parse(R"({"user_id":"{\"device_id\":\"d\",\"session_id\":\"s\"}"})");
  return r;
}

// ---- SSE helpers -----------------------------------------------------------------------------------------

struct SseEvent {
  std::string event;
  J data;
};

// Splits an SSE text into events; every data line must be JSON whose "type" equals the event name.
std::vector<SseEvent> parse_sse(const std::string& s) {
  std::vector<SseEvent> out;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = s.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated SSE event at " << pos;
    if (end == std::string::npos) break;
    const std::string chunk = s.substr(pos, end - pos);
    pos = end + 2;
    if (chunk[0] == ':') continue;  // comment
    EXPECT_EQ(chunk.rfind("event: ", 0), 0u) << chunk;
    const size_t nl = chunk.find('\n');
    EXPECT_NE(nl, std::string::npos) << chunk;
    if (nl == std::string::npos) continue;
    SseEvent e;
    e.event = chunk.substr(7, nl - 7);
    const std::string dataline = chunk.substr(nl + 1);
    EXPECT_EQ(dataline.rfind("data: ", 0), 0u) << chunk;
    e.data = J::parse(dataline.substr(6));
    EXPECT_EQ(e.data["type"], e.event) << chunk;
    out.push_back(std::move(e));
  }
  return out;
}

std::vector<std::string> event_names(const std::vector<SseEvent>& evs) {
  std::vector<std::string> n;
  for (const auto& e : evs) n.push_back(e.event);
  return n;
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

struct SinkRig {
  AdapterContext ctx = test_ctx();
  GenRequest req;
  std::shared_ptr<Channel> ch = std::make_shared<Channel>();
  std::shared_ptr<Sink> sink;
  explicit SinkRig(bool stream, std::string model = "dsx-v4-flash") {
    req.api = "messages";
    req.model = std::move(model);
    req.stream = stream;
    req.id_prefix = "toolu_";
    sink = messages_adapter().make_sink(req, ctx, ch);
  }
};

Usage usage(int64_t prompt, int64_t cached, int64_t completion = 0, int64_t reasoning = 0) {
  Usage u;
  u.prompt_tokens = prompt;
  u.cached_tokens = cached;
  u.completion_tokens = completion;
  u.reasoning_tokens = reasoning;
  return u;
}

const std::string kArgs = R"({"command": "echo hi", "timeout": 120})";

text::ParseResult tool_result_script() {
  text::ParseResult r;
  r.reasoning = "Let me think.";
  r.reasoning_started = r.reasoning_closed = true;
  r.content = "I'll run it.";
  r.tool_calls.push_back({"toolu_0123456789abcdef0123456789abcdef", "Bash", kArgs});
  r.finish = text::FinishReason::ToolCalls;
  return r;
}

std::vector<text::Event> tool_events() {
  using T = text::EventType;
  const std::string id = "toolu_0123456789abcdef0123456789abcdef";
  return {ev(T::ReasoningDelta, "Let me "), ev(T::ReasoningDelta, "think."), ev(T::ReasoningEnd),
          ev(T::ContentDelta, "I'll "),     ev(T::ContentDelta, "run it."),  ev(T::ToolCallStart, "", 0, id, "Bash"),
          ev(T::ToolCallDelta, R"({"command": "echo hi)", 0, id, "Bash"),
          ev(T::ToolCallDelta, R"(", "timeout": 120})", 0, id, "Bash"), ev(T::ToolCallEnd, kArgs, 0, id, "Bash")};
}

}  // namespace

// ---- requests --------------------------------------------------------------------------------------------

TEST(ApiMessages, ClaudeCodeFirstRequest) {
  Parsed p = parse(claude_code_request());
  ASSERT_TRUE(p.ok) << p.err.message;
  const GenRequest& r = p.req;
  EXPECT_EQ(r.api, "messages");
  EXPECT_EQ(r.model, "dsx-v4-flash");
  EXPECT_EQ(r.max_tokens, 32000);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.thinking);
  EXPECT_EQ(r.effort.kind, text::Effort::Kind::High);
  EXPECT_FALSE(r.sampling_given);
  EXPECT_TRUE(r.stop.empty());
  EXPECT_EQ(r.id_prefix, "toolu_");
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_TRUE(r.tools_enabled);
  EXPECT_TRUE(last_dropped_tools().empty());

  const auto& m = r.conv.messages;
  ASSERT_EQ(m.size(), 3u);
  // the billing header block is dropped; the other two join with "\n"
  EXPECT_EQ(m[0].role, text::Role::System);
  EXPECT_EQ(m[0].content,
            "You are Claude Code, Anthropic's official CLI for Claude.\n"
            "You are an interactive agent that helps users with software engineering tasks.");
  EXPECT_EQ(m[1].role, text::Role::User);
  ASSERT_EQ(m[1].blocks.size(), 2u);
  EXPECT_EQ(m[1].blocks[0].kind, text::ContentBlock::Kind::Text);
  EXPECT_EQ(m[1].blocks[0].text, "<system-reminder>\nToday's date is 2026-12-01.\n</system-reminder>");
  EXPECT_EQ(m[1].blocks[1].text, "say hi");
  EXPECT_EQ(m[2].role, text::Role::System);  // the mid-conversation system message, in place
  EXPECT_EQ(m[2].content, "# Environment\nWorking directory: /tmp/x");

  ASSERT_EQ(r.conv.tools.size(), 2u);
  EXPECT_EQ(r.conv.tools[0].name, "Bash");
  EXPECT_EQ(r.conv.tools[1].name, "Read");
  // {name, description, parameters}: input_schema renamed, key order kept
  EXPECT_EQ(text::pyjson::dumps(r.conv.tools[0].function),
            R"({"name": "Bash", "description": "Run a shell command", "parameters": {"$schema": )"
            R"("https://json-schema.org/draft/2020-12/schema", "type": "object", "properties": {"command": )"
            R"({"type": "string", "description": "The command"}, "timeout": {"type": "number"}}, "required": )"
            R"(["command"], "additionalProperties": false}})");
  EXPECT_EQ(r.conv.tools[1].function.get("parameters")->get("properties")->members[1].first, "limit");
}

TEST(ApiMessages, ClassicThinkingShapesAndEffort) {
  struct Case {
    const char* thinking;  // JSON or nullptr (absent)
    const char* effort;    // or nullptr
    bool on;
    text::Effort::Kind kind;
  };
  const Case cases[] = {
      {nullptr, nullptr, true, text::Effort::Kind::Default},
      {R"({"type":"enabled","budget_tokens":31999})", nullptr, true, text::Effort::Kind::Default},
      {R"({"type":"adaptive","budget_tokens":0})", "max", true, text::Effort::Kind::Max},
      {R"({"type":"adaptive"})", "low", true, text::Effort::Kind::Low},
      {R"({"type":"adaptive"})", "medium", true, text::Effort::Kind::High},
      {R"({"type":"disabled"})", nullptr, false, text::Effort::Kind::Default},
      {R"({"type":"disabled"})", "high", false, text::Effort::Kind::Default},
      {nullptr, "none", false, text::Effort::Kind::Default},
      {"null", nullptr, true, text::Effort::Kind::Default},
  };
  for (const Case& c : cases) {
    J b = base();
    if (c.thinking) b["thinking"] = J::parse(c.thinking);
    if (c.effort) b["output_config"]["effort"] = c.effort;
    Parsed p = parse(b);
    ASSERT_TRUE(p.ok) << b.dump() << ": " << p.err.message;
    EXPECT_EQ(p.req.thinking, c.on) << b.dump();
    if (c.on) EXPECT_EQ(p.req.effort.kind, c.kind) << b.dump();
  }
}

TEST(ApiMessages, ToolRoundTripWithSignedThinking) {
  const AdapterContext ctx = test_ctx();
  const std::string reasoning = "The user wants a command run.";
  J r = claude_code_request();
  r["messages"].push_back({{"role", "assistant"},
                           {"content",
                            J::array({{{"type", "thinking"}, {"thinking", reasoning},
                                       {"signature", mac_hex(ctx.secret, reasoning)}},
                                      {{"type", "text"}, {"text", "Running it."}},
                                      {{"type", "tool_use"},
                                       {"id", "toolu_aa"},
                                       {"name", "Bash"},
                                       {"input", J::parse(R"({"command":"echo hi","timeout":120})")}},
                                      {{"type", "tool_use"},
                                       {"id", "toolu_bb"},
                                       {"name", "Read"},
                                       {"input", J::parse(R"({"file_path":"/etc/hostname"})")}}})}});
  r["messages"].push_back(
      {{"role", "user"},
       {"content", J::array({{{"type", "tool_result"}, {"tool_use_id", "toolu_aa"}, {"content", "hi\n"},
                              {"is_error", false}, {"cache_control", {{"type", "ephemeral"}}}},
                             {{"type", "tool_result"},
                              {"tool_use_id", "toolu_bb"},
                              {"content", J::array({{{"type", "text"}, {"text", "host"}},
                                                    {{"type", "text"}, {"text", "name"}}})},
                              {"is_error", true}},
                             {{"type", "text"}, {"text", "<system-reminder>go on</system-reminder>"}}})}});
  Parsed p = parse(r, ctx);
  ASSERT_TRUE(p.ok) << p.err.message;
  const auto& m = p.req.conv.messages;
  ASSERT_EQ(m.size(), 7u);
  const text::Message& a = m[3];
  EXPECT_EQ(a.role, text::Role::Assistant);
  ASSERT_TRUE(a.reasoning_content.has_value());
  EXPECT_EQ(*a.reasoning_content, reasoning);
  EXPECT_EQ(a.content, "Running it.");
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[0].id, "toolu_aa");
  EXPECT_EQ(a.tool_calls[0].name, "Bash");
  EXPECT_EQ(a.tool_calls[0].arguments, R"({"command": "echo hi", "timeout": 120})");
  EXPECT_EQ(a.tool_calls[1].id, "toolu_bb");
  EXPECT_EQ(a.tool_calls[1].arguments, R"({"file_path": "/etc/hostname"})");
  EXPECT_FALSE(a.wo_eos);
  EXPECT_EQ(m[4].role, text::Role::Tool);
  EXPECT_EQ(m[4].tool_call_id, "toolu_aa");
  EXPECT_EQ(m[4].content, "hi\n");
  EXPECT_EQ(m[5].role, text::Role::Tool);
  EXPECT_EQ(m[5].tool_call_id, "toolu_bb");
  EXPECT_EQ(m[5].content, "host\n\nname");
  EXPECT_EQ(m[6].role, text::Role::User);
  ASSERT_EQ(m[6].blocks.size(), 1u);
  EXPECT_EQ(m[6].blocks[0].text, "<system-reminder>go on</system-reminder>");
  EXPECT_TRUE(p.req.thinking);

  // The conversation renders: the reasoning before </think>, the calls, the results in one user turn.
  text::RenderOptions ro;
  ro.profile = text::Profile::V41;
  ro.thinking = true;
  const text::RenderedPrompt rp = text::render_prompt(p.req.conv, ro);
  EXPECT_NE(rp.text.find(reasoning + "</think>Running it."), std::string::npos) << rp.text;
  EXPECT_NE(rp.text.find("<tool_result>hi\n</tool_result>\n\n<tool_result>host\n\nname</tool_result>\n\n"
                         "<system-reminder>go on</system-reminder>"),
            std::string::npos)
      << rp.text;
  EXPECT_EQ(rp.text.find("x-anthropic-billing-header"), std::string::npos);
}

TEST(ApiMessages, ThinkingWithoutOurSignatureIsIgnored) {
  const AdapterContext ctx = test_ctx();
  auto with_thinking = [&](J block) {
    J b = base();
    b["messages"].push_back({{"role", "assistant"}, {"content", J::array({block, {{"type", "text"}, {"text", "hi"}}})}});
    b["messages"].push_back({{"role", "user"}, {"content", "more"}});
    return b;
  };
  const std::string t = "secret thoughts";
  const J cases[] = {
      {{"type", "thinking"}, {"thinking", t}, {"signature", mac_hex("another server's secret", t)}},
      {{"type", "thinking"}, {"thinking", t}, {"signature", "EqQBCkYIBxgCKkBnotoursignature"}},
      {{"type", "thinking"}, {"thinking", t + " (edited)"}, {"signature", mac_hex(ctx.secret, t)}},
      {{"type", "thinking"}, {"thinking", t}},
      {{"type", "redacted_thinking"}, {"data", "EmwKAhgBEgy3va3pzix"}},
  };
  for (const J& c : cases) {
    Parsed p = parse(with_thinking(c), ctx);
    ASSERT_TRUE(p.ok) << c.dump() << ": " << p.err.message;
    ASSERT_EQ(p.req.conv.messages.size(), 3u);
    EXPECT_FALSE(p.req.conv.messages[1].reasoning_content.has_value()) << c.dump();
    EXPECT_EQ(p.req.conv.messages[1].content, "hi");
  }
  // the genuine signature is taken; without a server secret nothing is
  J good = {{"type", "thinking"}, {"thinking", t}, {"signature", mac_hex(ctx.secret, t)}};
  Parsed p = parse(with_thinking(good), ctx);
  ASSERT_TRUE(p.ok);
  EXPECT_EQ(p.req.conv.messages[1].reasoning_content.value_or("<none>"), t);
  AdapterContext no_secret = ctx;
  no_secret.secret.clear();
  J forged = {{"type", "thinking"}, {"thinking", t}, {"signature", mac_hex("", t)}};
  p = parse(with_thinking(forged), no_secret);
  ASSERT_TRUE(p.ok);
  EXPECT_FALSE(p.req.conv.messages[1].reasoning_content.has_value());
}

TEST(ApiMessages, ToolResultsAndTextKeepTheirOrder) {
  J b = base();
  b["messages"] = J::parse(R"([
    {"role":"user","content":"list files"},
    {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"Bash","input":{"command":"ls"}},
                                   {"type":"tool_use","id":"t2","name":"Bash","input":{}}]},
    {"role":"user","content":[{"type":"text","text":"first"},
                              {"type":"tool_result","tool_use_id":"t2","content":[]},
                              {"type":"text","text":"between"},
                              {"type":"tool_result","tool_use_id":"t1"}]}])");
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  const auto& m = p.req.conv.messages;
  ASSERT_EQ(m.size(), 6u);
  EXPECT_EQ(m[1].tool_calls[1].arguments, "{}");
  EXPECT_EQ(m[2].role, text::Role::User);
  EXPECT_EQ(m[2].blocks.at(0).text, "first");
  EXPECT_EQ(m[3].role, text::Role::Tool);
  EXPECT_EQ(m[3].tool_call_id, "t2");
  EXPECT_EQ(m[3].content, "");
  EXPECT_EQ(m[4].role, text::Role::User);
  EXPECT_EQ(m[4].blocks.at(0).text, "between");
  EXPECT_EQ(m[5].role, text::Role::Tool);
  EXPECT_EQ(m[5].tool_call_id, "t1");
}

TEST(ApiMessages, AiSdkAnthropicShape) {
  // opencode via @ai-sdk/anthropic: a system block with cache_control, tool_choice auto, no thinking.
  J b = J::parse(R"({"model":"dsx-v4-flash","max_tokens":32000,"stream":true,
    "system":[{"type":"text","text":"You are opencode.","cache_control":{"type":"ephemeral"}}],
    "messages":[{"role":"user","content":[{"type":"text","text":"say hi"}]}],
    "tool_choice":{"type":"auto"},"temperature":0.5})");
  b["tools"] = J::array({bash_tool()});
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  EXPECT_EQ(p.req.conv.messages.size(), 2u);
  EXPECT_EQ(p.req.conv.messages[0].content, "You are opencode.");
  EXPECT_EQ(p.req.tool_choice, "auto");
  EXPECT_TRUE(p.req.sampling_given);
  EXPECT_FLOAT_EQ(p.req.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(p.req.sampling.top_p, 1.0f);
  EXPECT_EQ(p.req.sampling.top_k, 0);
  EXPECT_TRUE(p.req.thinking);  // absent: on (spec §4.5)
}

TEST(ApiMessages, ToolChoiceMapping) {
  const std::pair<const char*, const char*> cases[] = {
      {R"({"type":"auto"})", "auto"},
      {R"({"type":"any"})", "required"},
      {R"({"type":"none"})", "none"},
      {R"({"type":"tool","name":"Bash"})", "Bash"},
      {R"({"type":"auto","disable_parallel_tool_use":true})", "auto"},
  };
  for (const auto& [tc, want] : cases) {
    J b = base();
    b["tools"] = J::array({bash_tool()});
    b["tool_choice"] = J::parse(tc);
    Parsed p = parse(b);
    ASSERT_TRUE(p.ok) << tc << ": " << p.err.message;
    EXPECT_EQ(p.req.tool_choice, want) << tc;
    EXPECT_EQ(p.req.tools_enabled, std::string(want) != "none") << tc;
  }
  J b = base();
  b["tools"] = J::array({bash_tool()});
  b["tool_choice"] = J::parse(R"({"type":"tool","name":"Write"})");
  Parsed p = parse(b);
  EXPECT_FALSE(p.ok);
  EXPECT_NE(p.err.message.find("tool_choice.name"), std::string::npos) << p.err.message;
}

TEST(ApiMessages, ServerToolsAreDroppedAndReported) {
  J b = base();
  b["tools"] = J::array({bash_tool(),
                         J::parse(R"({"type":"web_search_20250305","name":"web_search","max_uses":5})"),
                         J::parse(R"({"type":"custom","name":"Lookup","input_schema":{"type":"object"}})"),
                         J::parse(R"({"type":"text_editor_20250124","name":"str_replace_editor"})")});
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  ASSERT_EQ(p.req.conv.tools.size(), 2u);
  EXPECT_EQ(p.req.conv.tools[0].name, "Bash");
  EXPECT_EQ(p.req.conv.tools[1].name, "Lookup");
  EXPECT_EQ(last_dropped_tools(),
            (std::vector<std::string>{"web_search (web_search_20250305)", "str_replace_editor (text_editor_20250124)"}));
  // the next parse starts a fresh list
  ASSERT_TRUE(parse(base()).ok);
  EXPECT_TRUE(last_dropped_tools().empty());
}

TEST(ApiMessages, SamplingAndStopSequences) {
  J b = base();
  b["top_p"] = 0.9;
  b["top_k"] = 40;
  b["stop_sequences"] = J::array({"\nHuman:", "END"});
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  EXPECT_TRUE(p.req.sampling_given);
  EXPECT_FLOAT_EQ(p.req.sampling.temperature, 1.0f);  // the API's default
  EXPECT_FLOAT_EQ(p.req.sampling.top_p, 0.9f);
  EXPECT_EQ(p.req.sampling.top_k, 40);
  EXPECT_EQ(p.req.stop, (std::vector<std::string>{"\nHuman:", "END"}));
  EXPECT_FALSE(p.req.stream);
  EXPECT_NE(p.req.sampling.seed, parse(b).req.sampling.seed);  // a fresh seed per request
  b = base();
  b["temperature"] = 0;
  p = parse(b);
  ASSERT_TRUE(p.ok);
  EXPECT_EQ(p.req.sampling.temperature, 0.0f);
  b = base();
  b["max_tokens"] = J::parse("18446744073709551615");  // beyond int64: clamped
  p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  EXPECT_EQ(p.req.max_tokens, INT64_MAX);
  // no model: the served model's id
  b = base();
  b.erase("model");
  p = parse(b);
  ASSERT_TRUE(p.ok);
  EXPECT_EQ(p.req.model, "deepseek-v4.1-flash");
}

TEST(ApiMessages, AssistantPrefill) {
  J b = base();
  b["messages"].push_back({{"role", "assistant"}, {"content", "{\"answer\": "}});
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  ASSERT_EQ(p.req.conv.messages.size(), 2u);
  EXPECT_TRUE(p.req.conv.messages[1].wo_eos);
  EXPECT_EQ(p.req.conv.messages[1].content, "{\"answer\": ");
  EXPECT_FALSE(p.req.thinking);
  // the renderer continues it: the prompt ends with the prefill
  text::RenderOptions ro;
  ro.thinking = p.req.thinking;
  const std::string text = text::render_prompt(p.req.conv, ro).text;
  EXPECT_EQ(text.substr(text.size() - 11), "{\"answer\": ") << text;

  b = base();
  b["messages"].push_back(
      {{"role", "assistant"},
       {"content", J::array({{{"type", "tool_use"}, {"id", "t1"}, {"name", "Bash"}, {"input", J::object()}}})}});
  p = parse(b);
  EXPECT_FALSE(p.ok);
  EXPECT_EQ(p.err.status, 400);
  EXPECT_NE(p.err.message.find("messages[1].content"), std::string::npos) << p.err.message;
}

TEST(ApiMessages, CountTokens) {
  J b = base();
  b.erase("max_tokens");
  GenRequest req;
  ApiError err;
  ASSERT_TRUE(parse_count_tokens(b.dump(), test_ctx(), req, err)) << err.message;
  EXPECT_EQ(req.conv.messages.size(), 1u);
  EXPECT_EQ(req.conv.messages[0].content, "say hi");
  // /v1/messages itself requires max_tokens
  Parsed p = parse(b);
  EXPECT_FALSE(p.ok);
  EXPECT_EQ(p.err.status, 400);
  EXPECT_EQ(p.err.param, "max_tokens");
  EXPECT_NE(p.err.message.find("max_tokens"), std::string::npos);
  // count_tokens validates the rest of the body the same way
  b["messages"] = 5;
  EXPECT_FALSE(parse_count_tokens(b.dump(), test_ctx(), req, err));
  EXPECT_EQ(err.status, 400);
  EXPECT_EQ(err.param, "messages");
  EXPECT_EQ(J::parse(count_tokens_body(19234)), J::parse(R"({"input_tokens":19234})"));
}

TEST(ApiMessages, BadRequestsAreClientErrorsNamingTheField) {
  struct Case {
    std::string body;
    std::string field;  // must appear in the message
  };
  auto with = [](const std::string& key, const std::string& json) {
    J b = base();
    b[key] = J::parse(json);
    return b.dump();
  };
  auto msg = [](const std::string& content_json) {
    J b = base();
    b["messages"] = J::array({{{"role", "user"}, {"content", J::parse(content_json)}}});
    return b.dump();
  };
  auto asst = [](const std::string& content_json) {
    J b = base();
    b["messages"] = J::array({{{"role", "assistant"}, {"content", J::parse(content_json)}},
                              {{"role", "user"}, {"content", "ok"}}});
    return b.dump();
  };
  const std::string full = base().dump();
  const std::vector<Case> cases = {
      {full.substr(0, full.size() / 2), "invalid JSON"},
      {"", "invalid JSON"},
      {"[1,2]", "JSON object"},
      {"\"hello\"", "JSON object"},
      {full + "x", "invalid JSON"},
      {R"({"model":"m","max_tokens":10,"messages":[{"role":"user","content":"caf\xff"}]})", "invalid JSON"},
      {R"({"model":"m","max_tokens":10,"messages":[{"role":"user","content":"\ud800"}]})", "invalid JSON"},
      {R"({"model":"m","max_tokens":1e999,"messages":[]})", "invalid JSON"},
      {std::string(2000, '[') + std::string(2000, ']'), "nested deeper"},
      {R"({"model":"m","max_tokens":10})", "messages"},
      {with("messages", R"({"role":"user"})"), "messages"},
      {with("messages", "[]"), "messages"},
      {with("messages", "[3]"), "messages[0]"},
      {with("messages", R"([{"content":"x"}])"), "messages[0].role"},
      {with("messages", R"([{"role":"tool","content":"x"}])"), "messages[0].role"},
      {with("messages", R"([{"role":7,"content":"x"}])"), "messages[0].role"},
      {with("messages", R"([{"role":"user"}])"), "messages[0].content"},
      {msg("12"), "messages[0].content"},
      {msg("null"), "messages[0].content"},
      {msg(R"(["just a string"])"), "messages[0].content[0]"},
      {msg(R"([{"text":"no type"}])"), "messages[0].content[0].type"},
      {msg(R"([{"type":"text","text":5}])"), "messages[0].content[0].text"},
      {msg(R"([{"type":"text"}])"), "messages[0].content[0].text"},
      {msg(R"([{"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}}])"),
       "text-only model"},
      {msg(R"([{"type":"document","source":{"type":"text","data":"x"}}])"), "text-only model"},
      {msg(R"([{"type":"mystery"}])"), "messages[0].content[0]"},
      {msg(R"([{"type":"tool_use","id":"t","name":"n","input":{}}])"), "messages[0].content[0]"},
      {msg(R"([{"type":"tool_result","tool_use_id":"never_issued","content":"x"}])"), "never_issued"},
      {msg(R"([{"type":"tool_result","content":"x"}])"), "messages[0].content[0].tool_use_id"},
      {asst(R"([{"type":"tool_use","name":"Bash","input":{}}])"), "messages[0].content[0].id"},
      {asst(R"([{"type":"tool_use","id":"t1","input":{}}])"), "messages[0].content[0].name"},
      {asst(R"([{"type":"tool_use","id":"t1","name":"Bash","input":"ls"}])"), "messages[0].content[0].input"},
      {R"({"model":"m","max_tokens":10,"messages":[{"role":"assistant","content":[{"type":"tool_use","id":"t1",)"
       R"("name":"B","input":{"n":1e400}}]},{"role":"user","content":"ok"}]})",
       "invalid JSON"},
      {asst(R"([{"type":"tool_use","id":"t1","name":"B","input":{}},{"type":"tool_use","id":"t1","name":"B","input":{}}])"),
       "messages[0].content[1].id"},
      {asst(R"([{"type":"thinking","thinking":["x"],"signature":"s"}])"), "messages[0].content[0].thinking"},
      {asst(R"([{"type":"thinking","thinking":"x","signature":5}])"), "messages[0].content[0].signature"},
      {asst(R"([{"type":"tool_result","tool_use_id":"x","content":"y"}])"), "messages[0].content[0].type"},
      {asst(R"([{"type":"image","source":{}}])"), "text-only model"},
      {with("messages", R"([{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"tool_use",
         "id":"t1","name":"B","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",
         "content":[{"type":"image","source":{}}]}]}])"),
       "text-only model"},
      {with("messages", R"([{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"tool_use",
         "id":"t1","name":"B","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",
         "content":7}]}])"),
       "messages[2].content[0].content"},
      {with("messages", R"([{"role":"user","content":"a"},{"role":"assistant","content":[{"type":"tool_use",
         "id":"t1","name":"B","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t1",
         "content":"x","is_error":"yes"}]}])"),
       "messages[2].content[0].is_error"},
      {with("max_tokens", R"("1024")"), "max_tokens"},
      {with("max_tokens", "0"), "max_tokens"},
      {with("max_tokens", "-5"), "max_tokens"},
      {with("max_tokens", "10.5"), "max_tokens"},
      {with("max_tokens", "99999999999999999999999"), "max_tokens"},
      {with("model", "42"), "model"},
      {with("temperature", R"("hot")"), "temperature"},
      {with("temperature", "3"), "temperature"},
      {with("temperature", "-0.1"), "temperature"},
      {with("top_p", "0"), "top_p"},
      {with("top_p", "1.5"), "top_p"},
      {with("top_k", "-1"), "top_k"},
      {with("top_k", "2.5"), "top_k"},
      {with("stream", R"("yes")"), "stream"},
      {with("stop_sequences", R"("END")"), "stop_sequences"},
      {with("stop_sequences", R"(["END", 1])"), "stop_sequences[1]"},
      {with("stop_sequences", R"([""])"), "stop_sequences[0]"},
      {with("thinking", "true"), "thinking"},
      {with("thinking", R"({"budget_tokens":100})"), "thinking.type"},
      {with("thinking", R"({"type":"maybe"})"), "thinking.type"},
      {with("thinking", R"({"type":"enabled","budget_tokens":"lots"})"), "thinking.budget_tokens"},
      {with("output_config", R"("high")"), "output_config"},
      {with("output_config", R"({"effort":"turbo"})"), "output_config.effort"},
      {with("output_config", R"({"effort":3})"), "output_config.effort"},
      {with("tools", R"({"name":"x"})"), "tools"},
      {with("tools", R"([5])"), "tools[0]"},
      {with("tools", R"([{"description":"d","input_schema":{}}])"), "tools[0].name"},
      {with("tools", R"([{"name":"x"}])"), "tools[0].input_schema"},
      {with("tools", R"([{"name":"x","input_schema":"object"}])"), "tools[0].input_schema"},
      {with("tools", R"([{"name":"x","description":5,"input_schema":{}}])"), "tools[0].description"},
      {with("tools", R"([{"name":"x","input_schema":{}},{"name":"x","input_schema":{}}])"), "tools[1].name"},
      {with("tools", R"([{"type":7,"name":"x"}])"), "tools[0].type"},
      {with("tool_choice", R"("auto")"), "tool_choice"},
      {with("tool_choice", R"({"type":"sometimes"})"), "tool_choice.type"},
      {with("tool_choice", R"({"type":"tool"})"), "tool_choice.name"},
      {with("system", "5"), "system"},
      {with("system", R"([{"type":"image","source":{}}])"), "text-only model"},
      {with("system", R"([{"type":"text"}])"), "system[0].text"},
      {with("system", R"(["plain"])"), "system[0]"},
  };
  for (const Case& c : cases) {
    Parsed p = parse(c.body);
    ASSERT_FALSE(p.ok) << c.body;
    EXPECT_EQ(p.err.status, 400) << c.body;
    EXPECT_EQ(p.err.type, "invalid_request_error") << c.body;
    EXPECT_NE(p.err.message.find(c.field), std::string::npos) << c.body << "\n -> " << p.err.message;
    const J body = J::parse(messages_adapter().error_body(p.err));
    EXPECT_EQ(body["type"], "error");
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
    EXPECT_EQ(body["error"]["message"], p.err.message);
  }
}

TEST(ApiMessages, FuzzedBodiesNeverCrashAndAnswer4xx) {
  // Every prefix of a real request, and single-byte corruptions of it: parse either succeeds or gives a
  // 400 invalid_request_error with a message.
  J r = claude_code_request();
  r["messages"].push_back(J::parse(R"({"role":"assistant","content":[{"type":"thinking","thinking":"t",
    "signature":"s"},{"type":"tool_use","id":"toolu_1","name":"Bash","input":{"command":"ls","n":[1,2.5,null]}}]})"));
  r["messages"].push_back(J::parse(
      R"({"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"x"}]})"));
  const std::string body = r.dump();
  ASSERT_TRUE(parse(body).ok);
  int failures = 0;
  for (size_t n = 0; n < body.size(); n += 7) {
    Parsed p = parse(body.substr(0, n));
    ASSERT_FALSE(p.ok) << n;
    ASSERT_EQ(p.err.status, 400);
    ASSERT_FALSE(p.err.message.empty());
    ++failures;
  }
  const char subs[] = {'"', '{', '}', '[', ']', ',', ':', '0', 'n', '\\', '\xff', '\x01'};
  uint32_t seed = 12345;
  for (int k = 0; k < 3000; ++k) {
    seed = seed * 1103515245u + 12345u;
    std::string b = body;
    b[(seed >> 8) % b.size()] = subs[(seed >> 4) % sizeof(subs)];
    Parsed p = parse(b);
    if (!p.ok) {
      ASSERT_EQ(p.err.status, 400) << b;
      ASSERT_EQ(p.err.type, "invalid_request_error");
      ASSERT_FALSE(p.err.message.empty());
      ++failures;
    }
  }
  EXPECT_GT(failures, 1000);
}

TEST(ApiMessages, HugeNumbersInToolInput) {
  J b = base();
  b["messages"] = J::parse(R"([{"role":"user","content":"a"},
    {"role":"assistant","content":[{"type":"tool_use","id":"t1","name":"B",
       "input":{"big":18446744073709551615,"neg":-9223372036854775808,"f":1.5e300,"z":-0.0,"u":"é\n"}}]},
    {"role":"user","content":[{"type":"tool_result","tool_use_id":"t1","content":"ok"}]}])");
  Parsed p = parse(b);
  ASSERT_TRUE(p.ok) << p.err.message;
  EXPECT_EQ(p.req.conv.messages[1].tool_calls[0].arguments,
            R"({"big": 18446744073709551615, "neg": -9223372036854775808, "f": 1.5e+300, "z": -0.0, "u": "é\n"})");
}

// ---- the Sink: streaming ---------------------------------------------------------------------------------

TEST(ApiMessages, StreamThinkingTextAndToolCall) {
  SinkRig rig(true);
  rig.sink->start(usage(100, 60));
  rig.sink->keepalive();
  rig.sink->events(tool_events());
  EXPECT_FALSE(rig.ch->done());
  rig.sink->end(tool_result_script(), usage(100, 60, 42, 5));
  const std::string sse = rig.ch->drain();
  EXPECT_TRUE(rig.ch->done());
  EXPECT_EQ(rig.ch->status(), 200);
  EXPECT_EQ(rig.ch->content_type(), "text/event-stream");
  const auto evs = parse_sse(sse);
  const std::vector<std::string> want = {
      "message_start",       "ping",                "ping",                "content_block_start",
      "content_block_delta", "content_block_delta", "content_block_delta", "content_block_stop",
      "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
      "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
      "message_delta",       "message_stop"};
  ASSERT_EQ(event_names(evs), want) << sse;

  const J& msg = evs[0].data["message"];
  EXPECT_EQ(msg["id"].get<std::string>().rfind("msg_", 0), 0u);
  EXPECT_EQ(msg["type"], "message");
  EXPECT_EQ(msg["role"], "assistant");
  EXPECT_EQ(msg["model"], "dsx-v4-flash");
  EXPECT_EQ(msg["content"], J::array());
  EXPECT_TRUE(msg["stop_reason"].is_null());
  EXPECT_EQ(msg["usage"]["input_tokens"], 40);
  EXPECT_EQ(msg["usage"]["cache_read_input_tokens"], 60);
  EXPECT_EQ(msg["usage"]["cache_creation_input_tokens"], 0);
  EXPECT_EQ(msg["usage"]["output_tokens"], 0);

  // thinking block 0
  EXPECT_EQ(evs[3].data["index"], 0);
  EXPECT_EQ(evs[3].data["content_block"]["type"], "thinking");
  EXPECT_EQ(evs[3].data["content_block"]["thinking"], "");
  EXPECT_EQ(evs[4].data["delta"], J::parse(R"({"type":"thinking_delta","thinking":"Let me "})"));
  EXPECT_EQ(evs[5].data["delta"]["thinking"], "think.");
  EXPECT_EQ(evs[6].data["delta"]["type"], "signature_delta");
  const std::string sig = evs[6].data["delta"]["signature"];
  EXPECT_TRUE(mac_ok(rig.ctx.secret, "Let me think.", sig));
  EXPECT_EQ(evs[7].data["index"], 0);
  // text block 1
  EXPECT_EQ(evs[8].data["index"], 1);
  EXPECT_EQ(evs[8].data["content_block"], J::parse(R"({"type":"text","text":""})"));
  EXPECT_EQ(evs[9].data["delta"], J::parse(R"({"type":"text_delta","text":"I'll "})"));
  EXPECT_EQ(evs[10].data["delta"]["text"], "run it.");
  EXPECT_EQ(evs[11].data["index"], 1);
  // tool_use block 2
  EXPECT_EQ(evs[12].data["index"], 2);
  EXPECT_EQ(evs[12].data["content_block"],
            J::parse(R"({"type":"tool_use","id":"toolu_0123456789abcdef0123456789abcdef","name":"Bash","input":{}})"));
  std::string partial;
  for (int i : {13, 14}) {
    EXPECT_EQ(evs[i].data["index"], 2);
    EXPECT_EQ(evs[i].data["delta"]["type"], "input_json_delta");
    partial += evs[i].data["delta"]["partial_json"].get<std::string>();
  }
  EXPECT_EQ(partial, kArgs);
  EXPECT_EQ(evs[15].data["index"], 2);
  // end
  EXPECT_EQ(evs[16].data["delta"]["stop_reason"], "tool_use");
  EXPECT_TRUE(evs[16].data["delta"]["stop_sequence"].is_null());
  EXPECT_EQ(evs[16].data["usage"]["output_tokens"], 42);
  EXPECT_EQ(evs[16].data["usage"]["input_tokens"], 40);

  // Claude Code's next request echoes the blocks back: the reasoning is recovered.
  J next = base();
  next["messages"].push_back(
      {{"role", "assistant"},
       {"content", J::array({{{"type", "thinking"}, {"thinking", "Let me think."}, {"signature", sig}},
                             {{"type", "text"}, {"text", "I'll run it."}},
                             {{"type", "tool_use"},
                              {"id", "toolu_0123456789abcdef0123456789abcdef"},
                              {"name", "Bash"},
                              {"input", J::parse(partial)}}})}});
  next["messages"].push_back({{"role", "user"},
                              {"content", J::array({{{"type", "tool_result"},
                                                     {"tool_use_id", "toolu_0123456789abcdef0123456789abcdef"},
                                                     {"content", "hi\n"}}})}});
  Parsed p = parse(next, rig.ctx);
  ASSERT_TRUE(p.ok) << p.err.message;
  const text::Message& a = p.req.conv.messages[1];
  EXPECT_EQ(a.reasoning_content.value_or("<none>"), "Let me think.");
  EXPECT_EQ(a.content, "I'll run it.");
  ASSERT_EQ(a.tool_calls.size(), 1u);
  EXPECT_EQ(a.tool_calls[0].arguments, kArgs);  // byte for byte what was streamed
}

TEST(ApiMessages, StreamThinkingCutByMaxTokens) {
  using T = text::EventType;
  SinkRig rig(true);
  rig.sink->start(usage(10, 0));
  rig.sink->events({ev(T::ReasoningDelta, "hmm, "), ev(T::ReasoningDelta, "")});
  rig.sink->events({ev(T::ReasoningDelta, "so")});
  text::ParseResult r;
  r.reasoning = "hmm, so";
  r.reasoning_started = true;
  r.finish = text::FinishReason::Length;
  rig.sink->end(r, usage(10, 0, 7, 7));
  const auto evs = parse_sse(rig.ch->drain());
  const std::vector<std::string> want = {"message_start",       "ping",
                                         "content_block_start", "content_block_delta",
                                         "content_block_delta", "content_block_delta",
                                         "content_block_stop",  "content_block_start",
                                         "content_block_stop",  "message_delta",
                                         "message_stop"};
  ASSERT_EQ(event_names(evs), want);
  EXPECT_EQ(evs[5].data["delta"]["type"], "signature_delta");
  EXPECT_EQ(evs[5].data["delta"]["signature"], mac_hex(rig.ctx.secret, "hmm, so"));
  // the empty text block Claude Code needs after a thinking-only answer
  EXPECT_EQ(evs[7].data["index"], 1);
  EXPECT_EQ(evs[7].data["content_block"]["type"], "text");
  EXPECT_EQ(evs[9].data["delta"]["stop_reason"], "max_tokens");
  EXPECT_EQ(evs[9].data["usage"]["output_tokens"], 7);
}

TEST(ApiMessages, StreamStopSequence) {
  using T = text::EventType;
  SinkRig rig(true);
  rig.sink->start(usage(5, 5));
  rig.sink->events({ev(T::ContentDelta, "one two")});
  text::ParseResult r;
  r.content = "one two";
  r.finish = text::FinishReason::StopSequence;
  r.stop_sequence = "END";
  rig.sink->end(r, usage(5, 5, 3));
  const auto evs = parse_sse(rig.ch->drain());
  ASSERT_EQ(event_names(evs),
            (std::vector<std::string>{"message_start", "ping", "content_block_start", "content_block_delta",
                                      "content_block_stop", "message_delta", "message_stop"}));
  EXPECT_EQ(evs[0].data["message"]["usage"]["input_tokens"], 0);
  EXPECT_EQ(evs[0].data["message"]["usage"]["cache_read_input_tokens"], 5);
  EXPECT_EQ(evs[5].data["delta"]["stop_reason"], "stop_sequence");
  EXPECT_EQ(evs[5].data["delta"]["stop_sequence"], "END");
}

TEST(ApiMessages, StreamToolCallErrorEvent) {
  using T = text::EventType;
  SinkRig rig(true);
  rig.sink->start(usage(5, 0));
  rig.sink->events({ev(T::ToolCallStart, "", 0, "toolu_x", "Bash"), ev(T::ToolCallDelta, "{\"a\": ", 0),
                    ev(T::Error, "invalid tool call: bad tag"), ev(T::ContentDelta, "after")});
  text::ParseResult r;
  r.stream_error = true;
  r.error = "invalid tool call: bad tag";
  rig.sink->end(r, usage(5, 0, 9));  // nothing more after the error
  const auto evs = parse_sse(rig.ch->drain());
  ASSERT_EQ(event_names(evs), (std::vector<std::string>{"message_start", "ping", "content_block_start",
                                                         "content_block_delta", "error"}));
  EXPECT_EQ(evs[4].data["error"]["type"], "api_error");
  EXPECT_EQ(evs[4].data["error"]["message"], "invalid tool call: bad tag");
  EXPECT_TRUE(rig.ch->done());
}

TEST(ApiMessages, StreamFailAfterAndBeforeStart) {
  using T = text::EventType;
  {
    SinkRig rig(true);
    rig.sink->start(usage(5, 0));
    rig.sink->events({ev(T::ContentDelta, "partial")});
    ApiError e;
    e.status = 500;
    e.type = "server_error";
    e.message = "backend failure";
    rig.sink->fail(e);
    rig.sink->end(text::ParseResult{}, usage(5, 0));  // ignored
    const auto evs = parse_sse(rig.ch->drain());
    ASSERT_EQ(event_names(evs), (std::vector<std::string>{"message_start", "ping", "content_block_start",
                                                           "content_block_delta", "error"}));
    EXPECT_EQ(evs[4].data["error"], J::parse(R"({"type":"api_error","message":"backend failure"})"));
    EXPECT_TRUE(rig.ch->done());
    EXPECT_EQ(rig.ch->status(), 200);
  }
  {
    SinkRig rig(true);
    rig.sink->keepalive();  // before start: an SSE comment, no event
    ApiError e;
    e.status = 400;
    e.code = "context_length_exceeded";
    e.param = "messages";
    e.message = "the prompt has 70000 tokens, the context is 65536";
    rig.sink->fail(e);
    // (the keep-alive already went out on a 200 SSE stream: the error is an in-stream event)
    EXPECT_EQ(rig.ch->status(), 200);
    const std::string out = rig.ch->drain();
    ASSERT_EQ(out.rfind(": keepalive\n\nevent: error\ndata: ", 0), 0u) << out;
    const size_t nl = out.find('\n', 32);
    const J body = J::parse(out.substr(32, nl - 32));
    EXPECT_EQ(body["type"], "error");
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
    EXPECT_EQ(body["error"]["message"], "prompt is too long: the prompt has 70000 tokens, the context is 65536");
    EXPECT_TRUE(rig.ch->done());
  }
}

TEST(ApiMessages, StreamEmptyAnswerAndEndWithoutStart) {
  SinkRig rig(true);
  text::ParseResult r;
  rig.sink->end(r, usage(3, 1, 1));
  const auto evs = parse_sse(rig.ch->drain());
  ASSERT_EQ(event_names(evs), (std::vector<std::string>{"message_start", "ping", "content_block_start",
                                                         "content_block_stop", "message_delta", "message_stop"}));
  EXPECT_EQ(evs[0].data["message"]["usage"]["input_tokens"], 2);
  EXPECT_EQ(evs[4].data["delta"]["stop_reason"], "end_turn");
}

// ---- the Sink: one JSON answer ---------------------------------------------------------------------------

TEST(ApiMessages, NonStreamMessage) {
  SinkRig rig(false, "claude-sonnet-4-5");
  rig.sink->start(usage(200, 150));
  rig.sink->keepalive();
  rig.sink->events(tool_events());
  EXPECT_TRUE(rig.ch->drain().empty());  // nothing before the end
  rig.sink->end(tool_result_script(), usage(200, 150, 30, 4));
  EXPECT_TRUE(rig.ch->wait_closed(std::chrono::milliseconds(0)));
  EXPECT_EQ(rig.ch->status(), 200);
  EXPECT_EQ(rig.ch->content_type(), "application/json");
  const J m = J::parse(rig.ch->drain());
  EXPECT_EQ(m["id"].get<std::string>().substr(0, 4), "msg_");
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["model"], "claude-sonnet-4-5");
  ASSERT_EQ(m["content"].size(), 3u);
  EXPECT_EQ(m["content"][0]["type"], "thinking");
  EXPECT_EQ(m["content"][0]["thinking"], "Let me think.");
  EXPECT_TRUE(mac_ok(rig.ctx.secret, "Let me think.", m["content"][0]["signature"].get<std::string>()));
  EXPECT_EQ(m["content"][1], J::parse(R"({"type":"text","text":"I'll run it."})"));
  EXPECT_EQ(m["content"][2]["type"], "tool_use");
  EXPECT_EQ(m["content"][2]["id"], "toolu_0123456789abcdef0123456789abcdef");
  EXPECT_EQ(m["content"][2]["name"], "Bash");
  EXPECT_EQ(m["content"][2]["input"].dump(), R"({"command":"echo hi","timeout":120})");  // key order kept
  EXPECT_EQ(m["stop_reason"], "tool_use");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  EXPECT_EQ(m["usage"], J::parse(R"({"input_tokens":50,"cache_creation_input_tokens":0,
                                     "cache_read_input_tokens":150,"output_tokens":30})"));
}

TEST(ApiMessages, NonStreamPlainAndEmpty) {
  {
    SinkRig rig(false);
    rig.sink->start(usage(1, 0));
    text::ParseResult r;
    r.content = "hello from dsx";
    rig.sink->end(r, usage(1, 0, 4));
    const J m = J::parse(rig.ch->drain());
    EXPECT_EQ(m["content"], J::parse(R"([{"type":"text","text":"hello from dsx"}])"));
    EXPECT_EQ(m["stop_reason"], "end_turn");
  }
  {
    SinkRig rig(false);
    rig.sink->start(usage(1, 0));
    text::ParseResult r;
    r.finish = text::FinishReason::Length;
    r.reasoning = "long thoughts";
    r.tool_calls.push_back({"toolu_1", "Odd", "{\"x\": NaN, \"big\": 123456789012345678901234567890}"});
    rig.sink->end(r, usage(1, 0, 4));
    const J m = J::parse(rig.ch->drain());
    ASSERT_EQ(m["content"].size(), 2u);
    EXPECT_EQ(m["content"][0]["type"], "thinking");
    EXPECT_EQ(m["content"][1]["type"], "tool_use");
    EXPECT_TRUE(m["content"][1]["input"]["x"].is_null());
    EXPECT_TRUE(m["content"][1]["input"]["big"].is_number());
    EXPECT_EQ(m["stop_reason"], "max_tokens");
  }
}

TEST(ApiMessages, NonStreamErrors) {
  struct Case {
    int status;
    std::string type;
    std::string want_type;
  };
  const Case cases[] = {{400, "invalid_request_error", "invalid_request_error"},
                        {500, "server_error", "api_error"},
                        {503, "server_error", "overloaded_error"},
                        {404, "", "not_found_error"},
                        {429, "", "rate_limit_error"},
                        {409, "invalid_request_error", "invalid_request_error"}};
  for (const Case& c : cases) {
    SinkRig rig(false);
    ApiError e;
    e.status = c.status;
    e.type = c.type;
    e.message = "it failed";
    rig.sink->fail(e);
    rig.sink->end(text::ParseResult{}, Usage{});  // ignored
    EXPECT_EQ(rig.ch->status(), c.status);
    EXPECT_EQ(rig.ch->content_type(), "application/json");
    const J body = J::parse(rig.ch->drain());
    EXPECT_EQ(body, J({{"type", "error"}, {"error", {{"type", c.want_type}, {"message", "it failed"}}}}))
        << c.status;
    EXPECT_TRUE(rig.ch->done());
  }
}

TEST(ApiMessages, CancelledFollowsTheChannel) {
  SinkRig rig(true);
  EXPECT_FALSE(rig.sink->cancelled());
  rig.ch->cancel();
  EXPECT_TRUE(rig.sink->cancelled());
}
