// The OpenAI Responses adapter (src/server/api_responses.cpp): the request shapes Codex CLI
// and opencode (@ai-sdk/openai) send (../shared/agents/README.md), the SSE event sequence and
// the non-streaming JSON it writes, and its errors.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "server/adapters.h"
#include "server/signing.h"

using json = nlohmann::ordered_json;  // bodies keep their key order, as clients send them
using namespace dsx;
using namespace dsx::server;

namespace {

AdapterContext context() {
  AdapterContext c;
  c.secret = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
  c.model_id = "deepseek-v4.1-flash";
  c.context_tokens = 131072;
  return c;
}

GenRequest parse_ok_text(const std::string& body) {
  GenRequest r;
  ApiError e;
  const bool ok = responses_adapter().parse(body, context(), r, e);
  EXPECT_TRUE(ok) << "error: " << e.message;
  return r;
}

GenRequest parse_ok(const json& body) { return parse_ok_text(body.dump()); }

ApiError parse_err(const std::string& body) {
  GenRequest r;
  ApiError e;
  EXPECT_FALSE(responses_adapter().parse(body, context(), r, e)) << "accepted: " << body;
  return e;
}

const text::pyjson::Value* fn_member(const text::ToolSpec& t, const char* key) { return t.function.get(key); }

// What Codex 0.171 sends on its first turn (README "Codex → POST /v1/responses"), with the
// catalog entry's apply_patch custom tool.
json codex_tools() {
  json params = {{"type", "object"},
                 {"properties", {{"cmd", {{"type", "string"}}}, {"workdir", {{"type", "string"}}}}},
                 {"required", {"cmd"}},
                 {"additionalProperties", false}};
  return json::array(
      {{{"type", "function"}, {"name", "exec_command"}, {"description", "Runs a command"}, {"strict", false},
        {"parameters", params}},
       {{"type", "function"},
        {"name", "write_stdin"},
        {"description", "Writes to a session"},
        {"strict", false},
        {"parameters", {{"type", "object"}, {"properties", {{"session_id", {{"type", "number"}}}}}}}},
       {{"type", "namespace"},
        {"name", "multi_agent_v1"},
        {"description", "Sub-agents"},
        {"tools",
         {{{"type", "function"},
           {"name", "spawn_agent"},
           {"description", "Spawns an agent"},
           {"strict", false},
           {"parameters", {{"type", "object"}, {"properties", {{"message", {{"type", "string"}}}}}}}},
          {{"type", "function"},
           {"name", "wait_agent"},
           {"description", "Waits"},
           {"strict", false},
           {"parameters", {{"type", "object"}, {"properties", json::object()}}}}}}},
       {{"type", "web_search"}, {"external_web_access", false}},
       {{"type", "custom"},
        {"name", "apply_patch"},
        {"description", "Use the `apply_patch` tool to edit files."},
        {"format",
         {{"type", "grammar"}, {"syntax", "lark"}, {"definition", "start: begin_patch hunk+ end_patch\n"}}}}});
}

json codex_first_turn() {
  return {{"model", "dsx-v4-flash"},
          {"input",
           {{{"type", "message"}, {"role", "developer"}, {"content", {{{"type", "input_text"}, {"text", "BASE"}}}}},
            {{"type", "message"},
             {"role", "developer"},
             {"content", {{{"type", "input_text"}, {"text", "skills"}}, {{"type", "input_text"}, {"text", "perms"}}}}},
            {{"type", "message"},
             {"role", "user"},
             {"content", {{{"type", "input_text"}, {"text", "<environment_context>x</environment_context>"}}}}},
            {{"type", "message"}, {"role", "user"}, {"content", {{{"type", "input_text"}, {"text", "say hi"}}}}}}},
          {"tools", codex_tools()},
          {"tool_choice", "auto"},
          {"parallel_tool_calls", true},
          {"reasoning", {{"effort", "medium"}, {"summary", "auto"}}},
          {"store", false},
          {"stream", true},
          {"include", {"reasoning.encrypted_content"}},
          {"prompt_cache_key", "thread-42"},
          {"client_metadata", {{"x", "y"}}}};
}

// ---- SSE reading ------------------------------------------------------------------------------------------

struct Sse {
  std::vector<json> events;  // data payloads, in order
  int comments = 0;
};

// Parses SSE text; every block must be "event: T\ndata: {...}" with data.type == T, or a
// comment.
Sse read_sse(const std::string& s) {
  Sse out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated SSE block at " << pos;
    if (end == std::string::npos) break;
    const std::string block = s.substr(pos, end - pos);
    pos = end + 2;
    if (block[0] == ':') {
      ++out.comments;
      continue;
    }
    EXPECT_EQ(block.rfind("event: ", 0), 0u) << block;
    const size_t nl = block.find('\n');
    EXPECT_NE(nl, std::string::npos) << block;
    const std::string type = block.substr(7, nl - 7);
    EXPECT_EQ(block.compare(nl + 1, 6, "data: "), 0) << block;
    json d = json::parse(block.substr(nl + 7));
    EXPECT_EQ(d.value("type", ""), type);
    out.events.push_back(std::move(d));
  }
  // sequence_number: present and increasing
  for (size_t i = 0; i < out.events.size(); ++i) {
    EXPECT_TRUE(out.events[i].contains("sequence_number")) << out.events[i].dump();
    if (i) EXPECT_GT(out.events[i]["sequence_number"].get<int64_t>(), out.events[i - 1]["sequence_number"].get<int64_t>());
  }
  return out;
}

std::vector<std::string> types(const Sse& s) {
  std::vector<std::string> t;
  for (const json& e : s.events) t.push_back(e["type"]);
  return t;
}

std::string drain_all(Channel& ch) {
  EXPECT_TRUE(ch.wait_closed(std::chrono::milliseconds(100)));
  return ch.drain();
}

text::Event ev(text::EventType t, std::string text = "", int index = -1, std::string id = "", std::string name = "") {
  return text::Event{t, std::move(text), index, std::move(id), std::move(name)};
}

using ET = text::EventType;

}  // namespace

// ---- requests ---------------------------------------------------------------------------------------------

TEST(ApiResponses, CodexFirstTurn) {
  const GenRequest r = parse_ok(codex_first_turn());
  EXPECT_EQ(r.api, "responses");
  EXPECT_EQ(r.model, "dsx-v4-flash");
  EXPECT_EQ(r.id_prefix, "call_");
  ASSERT_EQ(r.conv.messages.size(), 4u);
  EXPECT_EQ(r.conv.messages[0].role, text::Role::System);
  EXPECT_EQ(r.conv.messages[0].content, "BASE");
  EXPECT_EQ(r.conv.messages[1].role, text::Role::System);
  EXPECT_EQ(r.conv.messages[1].content, "skills\n\nperms");
  EXPECT_EQ(r.conv.messages[2].role, text::Role::User);
  EXPECT_EQ(r.conv.messages[3].content, "say hi");
  // Tools: web_search dropped, the namespace flattened under the functions' own names.
  std::vector<std::string> names;
  for (const auto& t : r.conv.tools) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"exec_command", "write_stdin", "spawn_agent", "wait_agent", "apply_patch"}));
  const auto& exec = r.conv.tools[0];
  EXPECT_EQ(text::pyjson::dumps(exec.function),
            R"({"name": "exec_command", "description": "Runs a command", "parameters": {"type": "object", )"
            R"("properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}}, "required": ["cmd"], )"
            R"("additionalProperties": false}})");
  EXPECT_EQ(fn_member(exec, "strict"), nullptr);
  EXPECT_EQ(fn_member(exec, "namespace"), nullptr);
  ASSERT_NE(fn_member(r.conv.tools[2], "namespace"), nullptr);
  EXPECT_EQ(fn_member(r.conv.tools[2], "namespace")->text, "multi_agent_v1");
  // apply_patch: one string parameter "input" whose description carries the grammar.
  const auto& ap = r.conv.tools[4];
  ASSERT_NE(fn_member(ap, "freeform"), nullptr);
  const text::pyjson::Value* params = fn_member(ap, "parameters");
  ASSERT_NE(params, nullptr);
  const text::pyjson::Value* input = params->get("properties")->get("input");
  ASSERT_NE(input, nullptr);
  EXPECT_EQ(input->get("type")->text, "string");
  EXPECT_NE(input->get("description")->text.find("lark grammar:\nstart: begin_patch hunk+ end_patch"), std::string::npos);
  EXPECT_EQ(params->get("required")->items.at(0).text, "input");
  EXPECT_EQ(fn_member(ap, "description")->text, "Use the `apply_patch` tool to edit files.");
  // Settings.
  EXPECT_TRUE(r.thinking);
  EXPECT_EQ(r.effort.kind, text::Effort::Kind::High);
  EXPECT_TRUE(r.stream);
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_TRUE(r.tools_enabled);
  EXPECT_EQ(r.session_hint, "thread-42");
  EXPECT_EQ(r.max_tokens, 0);
  EXPECT_FALSE(r.sampling_given);
  EXPECT_FALSE(r.response_format.has_value());
}

TEST(ApiResponses, CodexToolRoundTripHistory) {
  const AdapterContext ctx = context();
  json body = codex_first_turn();
  body["input"].push_back({{"type", "reasoning"},
                           {"id", "rs_1"},
                           {"summary", {{{"type", "summary_text"}, {"text", "summary only"}}}},
                           {"content", nullptr},
                           {"encrypted_content", seal(ctx.secret, "the full reasoning")}});
  body["input"].push_back({{"type", "function_call"},
                           {"status", "completed"},
                           {"id", "fc_1"},
                           {"name", "exec_command"},
                           {"arguments", R"({"cmd":"echo hi"})"},
                           {"call_id", "call_abc"}});
  body["input"].push_back({{"type", "function_call_output"},
                           {"id", "fco_999"},
                           {"call_id", "call_abc"},
                           {"output", "Chunk ID: 1\nProcess exited with code 0\nOutput:\nhi\n"}});
  // A reasoning item sealed by another server: its summary texts are used instead.
  body["input"].push_back({{"type", "reasoning"},
                           {"id", "rs_2"},
                           {"summary", {{{"type", "summary_text"}, {"text", "s1"}}, {{"type", "summary_text"}, {"text", "s2"}}}},
                           {"content", {{{"type", "reasoning_text"}, {"text", "c1"}}}},
                           {"encrypted_content", seal("another-secret", "foreign")}});
  body["input"].push_back({{"type", "message"},
                           {"role", "assistant"},
                           {"content", {{{"type", "output_text"}, {"text", "done"}, {"annotations", json::array()}}}}});
  body["input"].push_back({{"type", "message"}, {"role", "user"}, {"content", "thanks"}});
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 8u);
  const text::Message& a1 = r.conv.messages[4];
  EXPECT_EQ(a1.role, text::Role::Assistant);
  ASSERT_TRUE(a1.reasoning_content.has_value());
  EXPECT_EQ(*a1.reasoning_content, "the full reasoning");
  EXPECT_EQ(a1.content, "");
  ASSERT_EQ(a1.tool_calls.size(), 1u);
  EXPECT_EQ(a1.tool_calls[0].id, "call_abc");
  EXPECT_EQ(a1.tool_calls[0].name, "exec_command");
  EXPECT_EQ(a1.tool_calls[0].arguments, R"({"cmd":"echo hi"})");
  const text::Message& t = r.conv.messages[5];
  EXPECT_EQ(t.role, text::Role::Tool);
  EXPECT_EQ(t.tool_call_id, "call_abc");
  EXPECT_EQ(t.content, "Chunk ID: 1\nProcess exited with code 0\nOutput:\nhi\n");
  const text::Message& a2 = r.conv.messages[6];
  EXPECT_EQ(a2.role, text::Role::Assistant);
  ASSERT_TRUE(a2.reasoning_content.has_value());
  EXPECT_EQ(*a2.reasoning_content, "s1\ns2\nc1");
  EXPECT_EQ(a2.content, "done");
  EXPECT_TRUE(a2.tool_calls.empty());
  EXPECT_EQ(r.conv.messages[7].role, text::Role::User);
}

TEST(ApiResponses, ConsecutiveAssistantItemsMerge) {
  json body = {{"input",
                {{{"role", "user"}, {"content", "go"}},
                 {{"type", "message"}, {"role", "assistant"}, {"content", {{{"type", "output_text"}, {"text", "Running."}}}}},
                 {{"type", "function_call"}, {"name", "a"}, {"arguments", "{}"}, {"call_id", "c1"}},
                 {{"type", "function_call"}, {"name", "b"}, {"arguments", "{\"x\": 1}"}, {"call_id", "c2"}},
                 {{"type", "function_call_output"}, {"call_id", "c1"}, {"output", "one"}},
                 {{"type", "function_call_output"},
                  {"call_id", "c2"},
                  {"output", {{{"type", "input_text"}, {"text", "two"}}, {{"type", "output_text"}, {"text", "lines"}}}}},
                 // a reasoning item with nothing after it is dropped
                 {{"type", "reasoning"}, {"summary", {{{"type", "summary_text"}, {"text", "dangling"}}}}},
                 {{"role", "user"}, {"content", "next"}}}}};
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 5u);
  const text::Message& a = r.conv.messages[1];
  EXPECT_EQ(a.role, text::Role::Assistant);
  EXPECT_EQ(a.content, "Running.");
  EXPECT_FALSE(a.reasoning_content.has_value());
  ASSERT_EQ(a.tool_calls.size(), 2u);
  EXPECT_EQ(a.tool_calls[1].id, "c2");
  EXPECT_EQ(a.tool_calls[1].arguments, "{\"x\": 1}");
  EXPECT_EQ(r.conv.messages[2].tool_call_id, "c1");
  EXPECT_EQ(r.conv.messages[3].content, "two\n\nlines");
  EXPECT_EQ(r.conv.messages[4].content, "next");
}

TEST(ApiResponses, ReasoningStartsTheNextAssistantMessage) {
  json body = {{"input",
                {{{"role", "user"}, {"content", "q"}},
                 {{"type", "reasoning"}, {"summary", {{{"type", "summary_text"}, {"text", "r1"}}}}},
                 {{"type", "message"}, {"role", "assistant"}, {"content", "a1"}},
                 {{"type", "reasoning"}, {"summary", {{{"type", "summary_text"}, {"text", "r2"}}}}},
                 {{"type", "function_call"}, {"name", "f"}, {"arguments", "{}"}, {"call_id", "c"}}}}};
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 3u);
  EXPECT_EQ(*r.conv.messages[1].reasoning_content, "r1");
  EXPECT_EQ(r.conv.messages[1].content, "a1");
  EXPECT_TRUE(r.conv.messages[1].tool_calls.empty());
  EXPECT_EQ(*r.conv.messages[2].reasoning_content, "r2");
  ASSERT_EQ(r.conv.messages[2].tool_calls.size(), 1u);
}

TEST(ApiResponses, CustomAndNamespacedCallsInHistory) {
  json body = codex_first_turn();
  const std::string patch = "*** Begin Patch\n*** Add File: a.txt\n+\"quoted\" \\ back\n*** End Patch\n";
  body["input"].push_back({{"type", "custom_tool_call"},
                           {"status", "completed"},
                           {"call_id", "call_p"},
                           {"name", "apply_patch"},
                           {"input", patch}});
  body["input"].push_back({{"type", "custom_tool_call_output"}, {"call_id", "call_p"}, {"output", "Success."}});
  body["input"].push_back({{"type", "function_call"},
                           {"namespace", "multi_agent_v1"},
                           {"name", "spawn_agent"},
                           {"arguments", "{\"message\":\"m\"}"},
                           {"call_id", "call_s"}});
  body["input"].push_back({{"type", "function_call_output"}, {"call_id", "call_s"}, {"output", "ok"}});
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 8u);
  const text::ToolCall& c = r.conv.messages[4].tool_calls.at(0);
  EXPECT_EQ(c.id, "call_p");
  EXPECT_EQ(c.name, "apply_patch");
  const text::pyjson::Value args = text::pyjson::parse(c.arguments);
  ASSERT_TRUE(args.is_object());
  ASSERT_EQ(args.members.size(), 1u);
  EXPECT_EQ(args.get("input")->text, patch);
  EXPECT_EQ(r.conv.messages[5].role, text::Role::Tool);
  EXPECT_EQ(r.conv.messages[5].content, "Success.");
  EXPECT_EQ(r.conv.messages[6].tool_calls.at(0).name, "spawn_agent");
  EXPECT_EQ(r.conv.messages[7].tool_call_id, "call_s");
}

TEST(ApiResponses, OpencodeUntypedItems) {
  // @ai-sdk/openai: items without "type", max_output_tokens, store:false, prompt_cache_key.
  json body = {{"model", "dsx/dsx-v4-flash"},
               {"input",
                {{{"role", "system"}, {"content", "You are opencode."}},
                 {{"role", "user"}, {"content", {{{"type", "input_text"}, {"text", "say hi"}}}}},
                 {{"role", "assistant"}, {"content", {{{"type", "output_text"}, {"text", "hi"}}}}},
                 {{"role", "user"}, {"content", "again"}}}},
               {"max_output_tokens", 32000},
               {"temperature", 0.5},
               {"store", false},
               {"prompt_cache_key", "ses_1"},
               {"tools",
                {{{"type", "function"},
                  {"name", "bash"},
                  {"description", "Runs bash"},
                  {"parameters", {{"type", "object"}, {"properties", {{"command", {{"type", "string"}}}}}}},
                  {"strict", false}}}},
               {"tool_choice", "auto"},
               {"stream", true}};
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.messages.size(), 4u);
  EXPECT_EQ(r.conv.messages[0].role, text::Role::System);
  EXPECT_EQ(r.conv.messages[1].content, "say hi");
  EXPECT_EQ(r.conv.messages[2].role, text::Role::Assistant);
  EXPECT_EQ(r.conv.messages[2].content, "hi");
  EXPECT_EQ(r.max_tokens, 32000);
  EXPECT_TRUE(r.sampling_given);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 1.0f);
  EXPECT_EQ(r.session_hint, "ses_1");
  ASSERT_EQ(r.conv.tools.size(), 1u);
  EXPECT_EQ(r.conv.tools[0].name, "bash");
}

TEST(ApiResponses, InstructionsAndStringInput) {
  const GenRequest r = parse_ok({{"instructions", "Be brief."}, {"input", "hello"}, {"max_tokens", 7}, {"top_p", 0.9}});
  ASSERT_EQ(r.conv.messages.size(), 2u);
  EXPECT_EQ(r.conv.messages[0].role, text::Role::System);
  EXPECT_EQ(r.conv.messages[0].content, "Be brief.");
  EXPECT_EQ(r.conv.messages[1].role, text::Role::User);
  EXPECT_EQ(r.conv.messages[1].content, "hello");
  EXPECT_EQ(r.model, "deepseek-v4.1-flash");  // no model: the served one
  EXPECT_EQ(r.max_tokens, 7);
  EXPECT_FALSE(r.stream);
  EXPECT_TRUE(r.sampling_given);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 1.0f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
}

TEST(ApiResponses, ReasoningEffort) {
  auto with = [](json effort) { return parse_ok({{"input", "x"}, {"reasoning", {{"effort", effort}}}}); };
  const GenRequest none = with("none");
  EXPECT_FALSE(none.thinking);
  const GenRequest low = with("low");
  EXPECT_TRUE(low.thinking);
  EXPECT_EQ(low.effort.kind, text::Effort::Kind::Low);
  EXPECT_EQ(with("minimal").effort.kind, text::Effort::Kind::Low);
  EXPECT_EQ(with("xhigh").effort.kind, text::Effort::Kind::High);
  EXPECT_EQ(with("max").effort.kind, text::Effort::Kind::Max);
  const GenRequest n = with(60);
  EXPECT_EQ(n.effort.kind, text::Effort::Kind::Numeric);
  EXPECT_EQ(n.effort.value, 60);
  const GenRequest dflt = parse_ok({{"input", "x"}, {"reasoning", {{"summary", "auto"}}}});
  EXPECT_TRUE(dflt.thinking);
  EXPECT_EQ(dflt.effort.kind, text::Effort::Kind::Default);
  // deepseek-chat: thinking off unless an effort asks for it
  EXPECT_FALSE(parse_ok({{"model", "deepseek-chat"}, {"input", "x"}}).thinking);
  EXPECT_TRUE(parse_ok({{"model", "deepseek-chat"}, {"input", "x"}, {"reasoning", {{"effort", "high"}}}}).thinking);
  EXPECT_TRUE(parse_ok({{"model", "deepseek-reasoner"}, {"input", "x"}}).thinking);
  const ApiError e = parse_err(json{{"input", "x"}, {"reasoning", {{"effort", "turbo"}}}}.dump());
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.param, "reasoning.effort");
  EXPECT_NE(e.message.find("turbo"), std::string::npos);
}

TEST(ApiResponses, ToolChoice) {
  json body = codex_first_turn();
  body["tool_choice"] = "none";
  GenRequest r = parse_ok(body);
  EXPECT_FALSE(r.tools_enabled);
  EXPECT_EQ(r.tool_choice, "none");
  body["tool_choice"] = "required";
  EXPECT_EQ(parse_ok(body).tool_choice, "required");
  body["tool_choice"] = {{"type", "function"}, {"name", "exec_command"}};
  r = parse_ok(body);
  EXPECT_EQ(r.tool_choice, "exec_command");
  EXPECT_TRUE(r.tools_enabled);
  body["tool_choice"] = {{"type", "function"}, {"name", "spawn_agent"}, {"namespace", "multi_agent_v1"}};
  EXPECT_EQ(parse_ok(body).tool_choice, "spawn_agent");
  body["tool_choice"] = {{"type", "custom"}, {"name", "apply_patch"}};
  EXPECT_EQ(parse_ok(body).tool_choice, "apply_patch");
  body["tool_choice"] = {{"type", "allowed_tools"}, {"mode", "required"}, {"tools", json::array()}};
  EXPECT_EQ(parse_ok(body).tool_choice, "required");
  body["tool_choice"] = {{"type", "function"}, {"name", "nope"}};
  ApiError e = parse_err(body.dump());
  EXPECT_EQ(e.param, "tool_choice.name");
  body["tool_choice"] = "sometimes";
  EXPECT_EQ(parse_err(body.dump()).param, "tool_choice");
  body["tool_choice"] = {{"type", "web_search"}};
  EXPECT_EQ(parse_err(body.dump()).param, "tool_choice.type");
}

TEST(ApiResponses, DuplicateToolNamesFirstWins) {
  json body = {{"input", "x"},
               {"tools",
                {{{"type", "function"}, {"name", "read"}, {"description", "first"}},
                 {{"type", "namespace"},
                  {"name", "mcp__fs__"},
                  {"tools", {{{"type", "function"}, {"name", "read"}, {"description", "second"}}}}}}}};
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.tools.size(), 1u);
  EXPECT_EQ(fn_member(r.conv.tools[0], "description")->text, "first");
  EXPECT_EQ(fn_member(r.conv.tools[0], "namespace"), nullptr);
}

TEST(ApiResponses, AdditionalToolsItem) {
  json body = {{"input",
                {{{"type", "additional_tools"},
                  {"role", "developer"},
                  {"tools", {{{"type", "function"}, {"name", "wait"}, {"parameters", {{"type", "object"}}}}}}},
                 {{"role", "user"}, {"content", "hi"}}}}};
  const GenRequest r = parse_ok(body);
  ASSERT_EQ(r.conv.tools.size(), 1u);
  EXPECT_EQ(r.conv.tools[0].name, "wait");
  ASSERT_EQ(r.conv.messages.size(), 1u);
}

TEST(ApiResponses, TextFormat) {
  json schema = {{"type", "object"}, {"properties", {{"title", {{"type", "string"}}}}}, {"required", {"title"}}};
  GenRequest r = parse_ok({{"input", "x"},
                           {"text", {{"format", {{"type", "json_schema"}, {"name", "t"}, {"strict", true}, {"schema", schema}}}}}});
  ASSERT_TRUE(r.response_format.has_value());
  EXPECT_EQ(text::pyjson::dumps(*r.response_format),
            R"({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "properties": )"
            R"({"title": {"type": "string"}}, "required": ["title"]}, "strict": true}})");
  r = parse_ok({{"input", "x"}, {"text", {{"format", {{"type", "json_object"}}}}}});
  EXPECT_EQ(text::pyjson::dumps(*r.response_format), R"({"type": "json_object"})");
  r = parse_ok({{"input", "x"}, {"text", {{"format", {{"type", "text"}}}, {"verbosity", "low"}}}});
  EXPECT_FALSE(r.response_format.has_value());
  EXPECT_EQ(parse_err(json{{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}}}}}}.dump()).param,
            "text.format.schema");
}

// ---- request errors -------------------------------------------------------------------------------------

TEST(ApiResponses, StatefulFieldsRejected) {
  for (const char* k : {"previous_response_id", "conversation"}) {
    json body = {{"input", "x"}, {k, "resp_123"}};
    const ApiError e = parse_err(body.dump());
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.param, k);
    EXPECT_NE(e.message.find("is not supported; replay the full input instead"), std::string::npos) << e.message;
  }
  // null is fine
  parse_ok({{"input", "x"}, {"previous_response_id", nullptr}, {"conversation", nullptr}});
  EXPECT_EQ(parse_err(json{{"input", {{{"type", "item_reference"}, {"id", "msg_1"}}}}}.dump()).param, "input[0]");
}

TEST(ApiResponses, ImagesAreRejected) {
  json body = {{"input",
                {{{"role", "user"},
                  {"content", {{{"type", "input_text"}, {"text", "look"}}, {{"type", "input_image"}, {"image_url", "data:"}}}}}}}};
  const ApiError e = parse_err(body.dump());
  EXPECT_EQ(e.status, 400);
  EXPECT_EQ(e.type, "invalid_request_error");
  EXPECT_EQ(e.param, "input[0].content[1]");
  EXPECT_NE(e.message.find("text-only model"), std::string::npos);
  json out = {{"input",
               {{{"type", "function_call_output"}, {"call_id", "c"}, {"output", {{{"type", "input_image"}, {"image_url", "x"}}}}}}}};
  EXPECT_NE(parse_err(out.dump()).message.find("text-only model"), std::string::npos);
}

TEST(ApiResponses, MalformedBodies) {
  struct Case {
    std::string body;
    std::string param;     // expected ApiError.param
    std::string contains;  // expected in the message
  };
  const std::string deep = std::string(5000, '[') + std::string(5000, ']');
  const std::vector<Case> cases = {
      {"", "", "invalid JSON"},
      {R"({"input": "hi")", "", "invalid JSON"},
      {R"({"input": "hi"} trailing)", "", "invalid JSON"},
      {"[1,2]", "", "expected a JSON object"},
      {"\"input\"", "", "expected a JSON object"},
      {R"({"input": "\ud800"})", "", "invalid JSON"},
      {"{\"input\": \"\xff\xfe\"}", "", "invalid JSON"},
      {"{\"input\": \"caf\xc3\"}", "", "invalid JSON"},
      {"{\"input\": " + deep + "}", "", "nested deeper"},
      {R"({})", "input", "missing"},
      {R"({"input": 5})", "input", "expected a string or an array"},
      {R"({"input": {"role": "user"}})", "input", "expected a string or an array"},
      {R"({"input": [5]})", "input[0]", "expected an object"},
      {R"({"input": [{"role": 5, "content": "x"}]})", "input[0].role", "expected a string"},
      {R"({"input": [{"content": "x"}]})", "input[0].role", "missing"},
      {R"({"input": [{"role": "tool", "content": "x"}]})", "input[0].role", "unknown role"},
      {R"({"input": [{"role": "user", "content": 5}]})", "input[0].content", "expected a string or an array of parts"},
      {R"({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]})", "input[0].content[0].text",
       "expected a string"},
      {R"({"input": [{"role": "user", "content": [{"type": "input_text"}]}]})", "input[0].content[0].text", "missing"},
      {R"({"input": [{"role": "user", "content": [{"type": "hologram", "text": "x"}]}]})", "input[0].content[0].type",
       "unsupported content part type"},
      {R"({"input": [{"type": 7}]})", "input[0].type", "expected a string"},
      {R"({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})", "input[0].call_id", "missing"},
      {R"({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]})", "input[0].name", "missing"},
      {R"({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 3}]})", "input[0].arguments",
       "expected a string"},
      {R"({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]})", "input[0].output",
       "expected a string or an array"},
      {R"({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "p", "input": []}]})", "input[0].input",
       "expected a string"},
      {R"({"input": [{"type": "reasoning", "summary": "x"}]})", "input[0].summary", "expected an array"},
      {R"({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 1}]}]})",
       "input[0].summary[0].text", "expected a string"},
      {R"({"input": [{"type": "reasoning", "encrypted_content": 5}]})", "input[0].encrypted_content", "expected a string"},
      {R"({"input": "x", "instructions": ["a"]})", "instructions", "expected a string"},
      {R"({"input": "x", "model": 4})", "model", "expected a string"},
      {R"({"input": "x", "tools": {}})", "tools", "expected an array"},
      {R"({"input": "x", "tools": [1]})", "tools[0]", "expected an object"},
      {R"({"input": "x", "tools": [{"type": "function"}]})", "tools[0].name", "missing"},
      {R"({"input": "x", "tools": [{"type": "function", "name": ""}]})", "tools[0].name", "empty"},
      {R"({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": "x"}]})", "tools[0].parameters",
       "expected an object"},
      {R"({"input": "x", "tools": [{"type": "function", "name": "f", "description": 1}]})", "tools[0].description",
       "expected a string"},
      {R"({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"name": 3}]}]})", "tools[0].tools[0].name",
       "expected a string"},
      {R"({"input": "x", "tools": [{"type": "custom", "name": "p", "format": {"type": "regexp"}}]})",
       "tools[0].format.type", "unsupported custom tool format"},
      {R"({"input": "x", "reasoning": "high"})", "reasoning", "expected an object"},
      {R"({"input": "x", "reasoning": {"effort": true}})", "reasoning.effort", "expected a string"},
      {R"({"input": "x", "max_output_tokens": "10"})", "max_output_tokens", "expected an integer"},
      {R"({"input": "x", "max_output_tokens": 0})", "max_output_tokens", "at least 1"},
      {R"({"input": "x", "max_output_tokens": -5})", "max_output_tokens", "at least 1"},
      {R"({"input": "x", "max_output_tokens": 1.5})", "max_output_tokens", "expected an integer"},
      {R"({"input": "x", "max_output_tokens": -99999999999999999999999})", "max_output_tokens", "at least 1"},
      {R"({"input": "x", "temperature": "hot"})", "temperature", "expected a number"},
      {R"({"input": "x", "temperature": 3})", "temperature", "between 0 and 2"},
      {R"({"input": "x", "temperature": 1e400})", "", "invalid JSON"},
      {R"({"input": "x", "top_p": 0})", "top_p", "greater than 0"},
      {R"({"input": "x", "stream": "yes"})", "stream", "expected a boolean"},
      {R"({"input": "x", "store": 1})", "store", "expected a boolean"},
      {R"({"input": "x", "include": "reasoning.encrypted_content"})", "include", "expected an array"},
      {R"({"input": "x", "include": [1]})", "include[0]", "expected a string"},
      {R"({"input": "x", "prompt_cache_key": 9})", "prompt_cache_key", "expected a string"},
      {R"({"input": "x", "parallel_tool_calls": "yes"})", "parallel_tool_calls", "expected a boolean"},
      {R"({"input": "x", "text": {"format": "json"}})", "text.format", "expected an object"},
      {R"({"input": "x", "tool_choice": 1})", "tool_choice", "expected an object"},
      {R"({"input": "x", "background": true})", "background", "not supported"},
      {R"({"input": "x", "prompt": {"id": "p"}})", "prompt", "not supported"},
      {R"({"input": []})", "input", "no messages"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body.size() > 200 ? c.body.substr(0, 200) : c.body);
    const ApiError e = parse_err(c.body);
    EXPECT_EQ(e.status, 400);
    EXPECT_EQ(e.type, "invalid_request_error");
    EXPECT_EQ(e.param, c.param);
    EXPECT_NE(e.message.find(c.contains), std::string::npos) << e.message;
    if (!c.param.empty()) EXPECT_EQ(e.message.rfind(c.param, 0), 0u) << "the message names the field: " << e.message;
  }
}

TEST(ApiResponses, HugeNumbers) {
  // A limit beyond int64 is clamped, and then exceeds the server's context (a 400 naming the
  // field); with no context known it stands.
  for (const char* v : {"99999999999999999999999", "18446744073709551615", "1e30", "131073"}) {
    const ApiError e = parse_err(std::string(R"({"input": "x", "max_output_tokens": )") + v + "}");
    EXPECT_EQ(e.param, "max_output_tokens");
    EXPECT_NE(e.message.find("exceeds this server's context of 131072 tokens"), std::string::npos) << e.message;
  }
  EXPECT_EQ(parse_err(R"({"input": "x", "max_tokens": 1e30})").param, "max_tokens");
  EXPECT_EQ(parse_ok(json::parse(R"({"input": "x", "max_output_tokens": 131072})")).max_tokens, 131072);
  {
    AdapterContext no_ctx = context();
    no_ctx.context_tokens = 0;
    GenRequest g;
    ApiError e;
    ASSERT_TRUE(responses_adapter().parse(R"({"input": "x", "max_output_tokens": 1e30})", no_ctx, g, e)) << e.message;
    EXPECT_EQ(g.max_tokens, std::numeric_limits<int64_t>::max());
  }
  GenRequest r = parse_ok(json::parse(
      R"({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "maxItems": 18446744073709551615}}]})"));
  EXPECT_EQ(r.conv.tools.at(0).function.get("parameters")->get("maxItems")->text, "18446744073709551615");
  // Beyond uint64 (nlohmann would make it a float): the schema is taken from the
  // Python-compatible parse, exactly as a Python reference renders it.
  r = parse_ok_text(std::string(
      R"({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "function", "name": "f", )"
      R"("parameters": {"type": "object", "maximum": 123456789012345678901234567890, "x": 1.0}}]}], )"
      R"("text": {"format": {"type": "json_schema", "schema": {"maxLength": 99999999999999999999999}}}})"));
  EXPECT_EQ(text::pyjson::dumps(*r.conv.tools.at(0).function.get("parameters")),
            R"({"type": "object", "maximum": 123456789012345678901234567890, "x": 1.0})");
  EXPECT_EQ(text::pyjson::dumps(*r.response_format->get("json_schema")->get("schema")),
            R"({"maxLength": 99999999999999999999999})");
}

TEST(ApiResponses, ErrorBody) {
  ApiError e{400, "invalid_request_error", "input: missing", "", "input"};
  json b = json::parse(responses_adapter().error_body(e));
  EXPECT_EQ(b["error"]["message"], "input: missing");
  EXPECT_EQ(b["error"]["type"], "invalid_request_error");
  EXPECT_EQ(b["error"]["param"], "input");
  EXPECT_TRUE(b["error"]["code"].is_null());
  ApiError ctx{400, "invalid_request_error", "prompt of 200000 tokens exceeds the context", "context_length_exceeded", ""};
  b = json::parse(responses_adapter().error_body(ctx));
  EXPECT_EQ(b["error"]["code"], "context_length_exceeded");
  EXPECT_TRUE(b["error"]["param"].is_null());
}

// ---- the answer --------------------------------------------------------------------------------------------

namespace {

text::ParseResult tool_turn_result() {
  text::ParseResult r;
  r.reasoning = "Let me think";
  r.reasoning_started = r.reasoning_closed = true;
  r.content = "Hello world";
  r.tool_calls.push_back({"call_x", "exec_command", "{\"cmd\": \"ls\"}"});
  r.finish = text::FinishReason::ToolCalls;
  return r;
}

std::vector<text::Event> tool_turn_events() {
  return {ev(ET::ReasoningDelta, "Let me "),   ev(ET::ReasoningDelta, "think"),
          ev(ET::ReasoningEnd),                ev(ET::ContentDelta, "Hello"),
          ev(ET::ContentDelta, " world"),      ev(ET::ToolCallStart, "", 0, "call_x", "exec_command"),
          ev(ET::ToolCallDelta, "{\"cmd\": ", 0, "call_x", "exec_command"),
          ev(ET::ToolCallDelta, "\"ls\"}", 0, "call_x", "exec_command"),
          ev(ET::ToolCallEnd, "{\"cmd\": \"ls\"}", 0, "call_x", "exec_command")};
}

Usage usage_full() {
  Usage u;
  u.prompt_tokens = 100;
  u.cached_tokens = 40;
  u.completion_tokens = 25;
  u.reasoning_tokens = 10;
  return u;
}

}  // namespace

TEST(ApiResponses, StreamEventSequence) {
  const AdapterContext ctx = context();
  GenRequest req = parse_ok(codex_first_turn());
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, ctx, ch);
  Usage start;
  start.prompt_tokens = 100;
  start.cached_tokens = 40;
  sink->start(start);
  sink->keepalive();
  sink->events(tool_turn_events());
  EXPECT_FALSE(ch->done());
  sink->end(tool_turn_result(), usage_full());
  EXPECT_EQ(ch->status(), 200);
  EXPECT_EQ(ch->content_type(), "text/event-stream");
  const Sse sse = read_sse(drain_all(*ch));
  EXPECT_EQ(sse.comments, 1);
  const std::vector<std::string> expected = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.reasoning_summary_part.added",
      "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
      "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
      "response.output_item.done",
      "response.output_item.added", "response.content_part.added",
      "response.output_text.delta", "response.output_text.delta",
      "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.function_call_arguments.delta",
      "response.function_call_arguments.delta", "response.function_call_arguments.done",
      "response.output_item.done", "response.completed"};
  ASSERT_EQ(types(sse), expected);
  const auto& E = sse.events;
  EXPECT_EQ(E[0]["sequence_number"], 0);
  const json& created = E[0]["response"];
  EXPECT_EQ(created["status"], "in_progress");
  EXPECT_EQ(created["object"], "response");
  EXPECT_EQ(created["model"], "dsx-v4-flash");
  EXPECT_TRUE(created["output"].empty());
  const std::string resp_id = created["id"];
  EXPECT_EQ(resp_id.rfind("resp_", 0), 0u);
  EXPECT_EQ(resp_id.size(), 5u + 24u);
  // reasoning item
  EXPECT_EQ(E[2]["output_index"], 0);
  EXPECT_EQ(E[2]["item"]["type"], "reasoning");
  const std::string rs_id = E[2]["item"]["id"];
  EXPECT_EQ(rs_id.rfind("rs_", 0), 0u);
  EXPECT_TRUE(E[2]["item"]["summary"].empty());
  EXPECT_EQ(E[3]["item_id"], rs_id);
  EXPECT_EQ(E[3]["summary_index"], 0);
  EXPECT_EQ(E[4]["delta"], "Let me ");
  EXPECT_EQ(E[4]["summary_index"], 0);
  EXPECT_EQ(E[5]["delta"], "think");
  EXPECT_EQ(E[6]["text"], "Let me think");
  const json& rs = E[8]["item"];
  EXPECT_EQ(rs["id"], rs_id);
  ASSERT_EQ(rs["summary"].size(), 1u);
  EXPECT_EQ(rs["summary"][0]["type"], "summary_text");
  EXPECT_EQ(rs["summary"][0]["text"], "Let me think");
  auto opened = open(ctx.secret, rs["encrypted_content"].get<std::string>());
  ASSERT_TRUE(opened.has_value());
  EXPECT_EQ(*opened, "Let me think");
  // message item
  EXPECT_EQ(E[9]["output_index"], 1);
  EXPECT_EQ(E[9]["item"]["type"], "message");
  EXPECT_EQ(E[9]["item"]["role"], "assistant");
  EXPECT_TRUE(E[9]["item"]["content"].empty());
  const std::string msg_id = E[9]["item"]["id"];
  EXPECT_EQ(msg_id.rfind("msg_", 0), 0u);
  EXPECT_EQ(E[10]["part"]["type"], "output_text");
  EXPECT_EQ(E[10]["part"]["text"], "");
  EXPECT_EQ(E[11]["item_id"], msg_id);
  EXPECT_EQ(E[11]["content_index"], 0);
  EXPECT_EQ(E[11]["delta"], "Hello");
  EXPECT_EQ(E[12]["delta"], " world");
  EXPECT_EQ(E[13]["text"], "Hello world");
  EXPECT_EQ(E[14]["part"]["text"], "Hello world");
  EXPECT_EQ(E[15]["item"]["content"][0]["text"], "Hello world");
  EXPECT_EQ(E[15]["item"]["status"], "completed");
  // function call item
  const json& added = E[16]["item"];
  EXPECT_EQ(E[16]["output_index"], 2);
  EXPECT_EQ(added["type"], "function_call");
  EXPECT_EQ(added["call_id"], "call_x");
  EXPECT_EQ(added["name"], "exec_command");
  EXPECT_EQ(added["arguments"], "");
  EXPECT_FALSE(added.contains("namespace"));
  const std::string fc_id = added["id"];
  EXPECT_EQ(fc_id.rfind("fc_", 0), 0u);
  EXPECT_EQ(E[17]["item_id"], fc_id);
  EXPECT_EQ(E[17]["delta"], "{\"cmd\": ");
  EXPECT_EQ(E[18]["delta"], "\"ls\"}");
  EXPECT_EQ(E[19]["arguments"], "{\"cmd\": \"ls\"}");
  EXPECT_EQ(E[20]["item"]["arguments"], "{\"cmd\": \"ls\"}");
  EXPECT_EQ(E[20]["item"]["status"], "completed");
  // terminal
  const json& resp = E[21]["response"];
  EXPECT_EQ(resp["id"], resp_id);
  EXPECT_EQ(resp["status"], "completed");
  EXPECT_TRUE(resp["incomplete_details"].is_null());
  ASSERT_EQ(resp["output"].size(), 3u);
  EXPECT_EQ(resp["output"][0], rs);
  EXPECT_EQ(resp["output"][1], E[15]["item"]);
  EXPECT_EQ(resp["output"][2], E[20]["item"]);
  const json& u = resp["usage"];
  EXPECT_EQ(u["input_tokens"], 100);
  EXPECT_EQ(u["input_tokens_details"]["cached_tokens"], 40);
  EXPECT_EQ(u["output_tokens"], 25);
  EXPECT_EQ(u["output_tokens_details"]["reasoning_tokens"], 10);
  EXPECT_EQ(u["total_tokens"], 125);
  EXPECT_TRUE(ch->done());
}

TEST(ApiResponses, StreamCustomAndNamespacedCalls) {
  GenRequest req = parse_ok(codex_first_turn());
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, context(), ch);
  sink->start(Usage{});
  const std::string args = R"({"input": "*** Begin Patch\n*** End Patch\n"})";
  sink->events({ev(ET::ToolCallStart, "", 0, "call_p", "apply_patch"), ev(ET::ToolCallDelta, "{\"input\": \"*** Begin", 0, "call_p"),
                ev(ET::ToolCallDelta, " Patch\\n*** End Patch\\n\"}", 0, "call_p"),
                ev(ET::ToolCallEnd, args, 0, "call_p", "apply_patch"),
                ev(ET::ToolCallStart, "", 1, "call_s", "spawn_agent"),
                ev(ET::ToolCallEnd, R"({"message": "go"})", 1, "call_s", "spawn_agent")});
  text::ParseResult r;
  r.tool_calls = {{"call_p", "apply_patch", args}, {"call_s", "spawn_agent", R"({"message": "go"})"}};
  r.finish = text::FinishReason::ToolCalls;
  sink->end(r, Usage{});
  const Sse sse = read_sse(drain_all(*ch));
  const std::vector<std::string> expected = {"response.created",
                                             "response.in_progress",
                                             "response.output_item.added",
                                             "response.custom_tool_call_input.delta",
                                             "response.custom_tool_call_input.done",
                                             "response.output_item.done",
                                             "response.output_item.added",
                                             "response.function_call_arguments.done",
                                             "response.output_item.done",
                                             "response.completed"};
  ASSERT_EQ(types(sse), expected);
  const auto& E = sse.events;
  EXPECT_EQ(E[2]["item"]["type"], "custom_tool_call");
  EXPECT_EQ(E[2]["item"]["call_id"], "call_p");
  EXPECT_EQ(E[2]["item"]["input"], "");
  EXPECT_EQ(E[3]["delta"], "*** Begin Patch\n*** End Patch\n");
  EXPECT_EQ(E[4]["input"], "*** Begin Patch\n*** End Patch\n");
  const json& ctc = E[5]["item"];
  EXPECT_EQ(ctc["type"], "custom_tool_call");
  EXPECT_EQ(ctc["name"], "apply_patch");
  EXPECT_EQ(ctc["input"], "*** Begin Patch\n*** End Patch\n");
  EXPECT_EQ(ctc["status"], "completed");
  EXPECT_EQ(ctc["id"].get<std::string>().rfind("ctc_", 0), 0u);
  const json& fc = E[8]["item"];
  EXPECT_EQ(fc["type"], "function_call");
  EXPECT_EQ(fc["name"], "spawn_agent");
  EXPECT_EQ(fc["namespace"], "multi_agent_v1");
  EXPECT_EQ(fc["arguments"], R"({"message": "go"})");
  EXPECT_EQ(E[9]["response"]["output"].size(), 2u);
}

TEST(ApiResponses, StreamLengthIsIncomplete) {
  GenRequest req = parse_ok({{"input", "x"}, {"stream", true}, {"max_output_tokens", 3}});
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, context(), ch);
  sink->start(Usage{});
  sink->events({ev(ET::ReasoningDelta, "still thinking")});
  text::ParseResult r;
  r.reasoning = "still thinking";
  r.reasoning_started = true;
  r.finish = text::FinishReason::Length;
  sink->end(r, usage_full());
  const Sse sse = read_sse(drain_all(*ch));
  const auto t = types(sse);
  ASSERT_GE(t.size(), 2u);
  EXPECT_EQ(t.back(), "response.incomplete");
  EXPECT_EQ(t[t.size() - 2], "response.output_item.done");
  const json& item = sse.events[sse.events.size() - 2]["item"];
  EXPECT_EQ(item["type"], "reasoning");
  EXPECT_EQ(item["status"], "incomplete");
  const json& resp = sse.events.back()["response"];
  EXPECT_EQ(resp["status"], "incomplete");
  EXPECT_EQ(resp["incomplete_details"]["reason"], "max_output_tokens");
  EXPECT_EQ(resp["max_output_tokens"], 3);
  EXPECT_EQ(resp["output"].size(), 1u);
}

TEST(ApiResponses, StreamParserErrorFails) {
  GenRequest req = parse_ok(codex_first_turn());
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, context(), ch);
  sink->start(Usage{});
  sink->events({ev(ET::ToolCallStart, "", 0, "call_x", "exec_command"), ev(ET::ToolCallDelta, "{\"cmd\": ", 0, "call_x"),
                ev(ET::Error, "invalid tool call: unterminated tool call"), ev(ET::ContentDelta, "late")});
  text::ParseResult r;
  r.stream_error = true;
  r.content = "raw";
  sink->end(r, Usage{});
  sink->keepalive();
  const Sse sse = read_sse(drain_all(*ch));
  const std::vector<std::string> expected = {"response.created", "response.in_progress", "response.output_item.added",
                                             "response.function_call_arguments.delta", "response.failed"};
  ASSERT_EQ(types(sse), expected);
  EXPECT_EQ(sse.comments, 0);
  const json& resp = sse.events.back()["response"];
  EXPECT_EQ(resp["status"], "failed");
  EXPECT_EQ(resp["error"]["code"], "server_error");
  EXPECT_EQ(resp["error"]["message"], "invalid tool call: unterminated tool call");
}

TEST(ApiResponses, FailBeforeAndAfterStart) {
  GenRequest req = parse_ok(codex_first_turn());
  {
    // Streaming, before start (keep-alives may have gone out while queued): in-stream.
    auto ch = std::make_shared<Channel>();
    auto sink = responses_adapter().make_sink(req, context(), ch);
    sink->keepalive();
    sink->fail(ApiError{400, "invalid_request_error", "prompt too long", "context_length_exceeded", "input"});
    const Sse sse = read_sse(drain_all(*ch));
    EXPECT_EQ(sse.comments, 1);
    ASSERT_EQ(types(sse), std::vector<std::string>{"response.failed"});
    const json& resp = sse.events[0]["response"];
    EXPECT_EQ(resp["status"], "failed");
    EXPECT_EQ(resp["error"]["code"], "context_length_exceeded");
    EXPECT_EQ(resp["error"]["message"], "prompt too long");
    EXPECT_TRUE(resp["output"].empty());
    sink->end(text::ParseResult{}, Usage{});  // ignored: the answer is complete
    EXPECT_TRUE(ch->done());
  }
  {
    // Not streaming, before start: the error body with its status.
    GenRequest plain = parse_ok({{"input", "x"}});
    auto ch = std::make_shared<Channel>();
    auto sink = responses_adapter().make_sink(plain, context(), ch);
    sink->fail(ApiError{400, "invalid_request_error", "prompt too long", "context_length_exceeded", "input"});
    EXPECT_EQ(ch->status(), 400);
    EXPECT_EQ(ch->content_type(), "application/json");
    json b = json::parse(drain_all(*ch));
    EXPECT_EQ(b["error"]["code"], "context_length_exceeded");
    EXPECT_EQ(b["error"]["type"], "invalid_request_error");
    EXPECT_EQ(b["error"]["param"], "input");
  }
  {
    auto ch = std::make_shared<Channel>();
    auto sink = responses_adapter().make_sink(req, context(), ch);
    sink->start(Usage{});
    sink->events({ev(ET::ContentDelta, "partial")});
    sink->fail(ApiError{500, "server_error", "backend failed", "", ""});
    EXPECT_EQ(ch->status(), 200);
    const Sse sse = read_sse(drain_all(*ch));
    ASSERT_EQ(types(sse).back(), "response.failed");
    const json& resp = sse.events.back()["response"];
    EXPECT_EQ(resp["status"], "failed");
    EXPECT_EQ(resp["error"]["code"], "server_error");
    EXPECT_EQ(resp["error"]["message"], "backend failed");
  }
}

TEST(ApiResponses, StreamEndWithoutEventsStillEmitsItems) {
  GenRequest req = parse_ok(codex_first_turn());
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, context(), ch);
  sink->start(Usage{});
  sink->end(tool_turn_result(), usage_full());
  const Sse sse = read_sse(drain_all(*ch));
  int done = 0;
  for (const json& e : sse.events) done += e["type"] == "response.output_item.done";
  EXPECT_EQ(done, 3);
  const json& resp = sse.events.back()["response"];
  ASSERT_EQ(resp["output"].size(), 3u);
  EXPECT_EQ(resp["output"][0]["summary"][0]["text"], "Let me think");
  EXPECT_EQ(resp["output"][1]["content"][0]["text"], "Hello world");
  EXPECT_EQ(resp["output"][2]["call_id"], "call_x");
}

TEST(ApiResponses, NonStreamingJson) {
  const AdapterContext ctx = context();
  json body = codex_first_turn();
  body["stream"] = false;
  GenRequest req = parse_ok(body);
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, ctx, ch);
  sink->start(Usage{});
  sink->events(tool_turn_events());
  sink->keepalive();
  text::ParseResult r = tool_turn_result();
  r.tool_calls.push_back({"call_p", "apply_patch", R"({"input": "patch text"})"});
  sink->end(r, usage_full());
  EXPECT_EQ(ch->status(), 200);
  EXPECT_EQ(ch->content_type(), "application/json");
  const json b = json::parse(drain_all(*ch));
  EXPECT_EQ(b["object"], "response");
  EXPECT_EQ(b["id"].get<std::string>().rfind("resp_", 0), 0u);
  EXPECT_EQ(b["status"], "completed");
  EXPECT_EQ(b["model"], "dsx-v4-flash");
  EXPECT_TRUE(b["created_at"].is_number_integer());
  ASSERT_EQ(b["output"].size(), 4u);
  EXPECT_EQ(b["output"][0]["type"], "reasoning");
  EXPECT_EQ(*open(ctx.secret, b["output"][0]["encrypted_content"].get<std::string>()), "Let me think");
  EXPECT_EQ(b["output"][1]["type"], "message");
  EXPECT_EQ(b["output"][1]["content"][0]["type"], "output_text");
  EXPECT_EQ(b["output"][1]["content"][0]["text"], "Hello world");
  EXPECT_EQ(b["output"][2]["type"], "function_call");
  EXPECT_EQ(b["output"][2]["call_id"], "call_x");
  EXPECT_EQ(b["output"][2]["arguments"], "{\"cmd\": \"ls\"}");
  EXPECT_EQ(b["output"][3]["type"], "custom_tool_call");
  EXPECT_EQ(b["output"][3]["input"], "patch text");
  EXPECT_EQ(b["usage"]["input_tokens_details"]["cached_tokens"], 40);
  EXPECT_EQ(b["usage"]["total_tokens"], 125);
}

TEST(ApiResponses, NonStreamingLengthAndError) {
  GenRequest req = parse_ok({{"input", "x"}});
  {
    auto ch = std::make_shared<Channel>();
    auto sink = responses_adapter().make_sink(req, context(), ch);
    text::ParseResult r;
    r.content = "cut";
    r.finish = text::FinishReason::Length;
    sink->end(r, Usage{});
    const json b = json::parse(drain_all(*ch));
    EXPECT_EQ(b["status"], "incomplete");
    EXPECT_EQ(b["incomplete_details"]["reason"], "max_output_tokens");
    EXPECT_EQ(b["output"][0]["status"], "incomplete");
  }
  {
    auto ch = std::make_shared<Channel>();
    auto sink = responses_adapter().make_sink(req, context(), ch);
    sink->start(Usage{});
    sink->fail(ApiError{503, "server_error", "shutting down", "", ""});
    EXPECT_EQ(ch->status(), 503);
    EXPECT_EQ(json::parse(drain_all(*ch))["error"]["message"], "shutting down");
  }
}

// The server's own output, sent back as the next request's input (Codex's stateless
// follow-up), gives back the exact reasoning, the call id and the arguments.
TEST(ApiResponses, OwnOutputRoundTrips) {
  const AdapterContext ctx = context();
  GenRequest req = parse_ok(codex_first_turn());
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, ctx, ch);
  sink->start(Usage{});
  const std::string reasoning = "Multi-line\nreasoning with \"quotes\" and unicode: \xc3\xa9\xe2\x82\xac";
  sink->events({ev(ET::ReasoningDelta, reasoning), ev(ET::ReasoningEnd),
                ev(ET::ToolCallStart, "", 0, "call_1", "spawn_agent"),
                ev(ET::ToolCallEnd, R"({"message": "x"})", 0, "call_1", "spawn_agent")});
  text::ParseResult r;
  r.reasoning = reasoning;
  r.reasoning_started = r.reasoning_closed = true;
  r.tool_calls = {{"call_1", "spawn_agent", R"({"message": "x"})"}};
  r.finish = text::FinishReason::ToolCalls;
  sink->end(r, Usage{});
  const Sse sse = read_sse(drain_all(*ch));
  json next = codex_first_turn();
  for (const json& item : sse.events.back()["response"]["output"]) next["input"].push_back(item);
  next["input"].push_back({{"type", "function_call_output"}, {"call_id", "call_1"}, {"output", "spawned"}});
  const GenRequest r2 = parse_ok(next);
  ASSERT_EQ(r2.conv.messages.size(), 6u);
  const text::Message& a = r2.conv.messages[4];
  EXPECT_EQ(a.role, text::Role::Assistant);
  ASSERT_TRUE(a.reasoning_content.has_value());
  EXPECT_EQ(*a.reasoning_content, reasoning);
  ASSERT_EQ(a.tool_calls.size(), 1u);
  EXPECT_EQ(a.tool_calls[0].id, "call_1");
  EXPECT_EQ(a.tool_calls[0].name, "spawn_agent");
  EXPECT_EQ(a.tool_calls[0].arguments, R"({"message": "x"})");
  EXPECT_EQ(r2.conv.messages[5].tool_call_id, "call_1");
}

TEST(ApiResponses, CancelledFollowsTheChannel) {
  GenRequest req = parse_ok({{"input", "x"}, {"stream", true}});
  auto ch = std::make_shared<Channel>();
  auto sink = responses_adapter().make_sink(req, context(), ch);
  EXPECT_FALSE(sink->cancelled());
  ch->cancel();
  EXPECT_TRUE(sink->cancelled());
}
