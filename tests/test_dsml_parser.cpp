// Tests of the incremental completion parser (src/text/dsml.h): the parsing cases P1-P13 and streaming cases
// S1-S8 of spec chat-and-serving.md §6.4/§6.5, fed at every byte split point, plus the malformed-output
// policy (§3.5), argument typing (§3.4), finish-reason mapping (§3.8) and the replay map (§3.7).
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <random>

#include "test_util.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

using namespace dsx;
using namespace dsx::text;

namespace {

const std::string D = "｜DSML｜";
const std::string kEosText = "<｜end▁of▁sentence｜>";

ParserOptions popts(Profile p, bool thinking, bool tools = true) {
  ParserOptions o;
  o.profile = p;
  o.thinking = thinking;
  o.tools_enabled = tools;
  auto counter = std::make_shared<int>(0);
  o.make_id = [counter]() { return "call_" + std::to_string((*counter)++); };
  return o;
}

struct FeedRun {
  ParseResult r;
  std::vector<Event> events;
};

FeedRun feed(const std::string& text, const ParserOptions& o, const std::vector<size_t>& cuts,
         EndCause cause = EndCause::Eos) {
  DsmlParser p(o);
  FeedRun run;
  size_t prev = 0;
  auto add = [&](std::vector<Event> ev) { run.events.insert(run.events.end(), ev.begin(), ev.end()); };
  for (size_t c : cuts) {
    c = std::min(c, text.size());
    if (c < prev) continue;
    add(p.push(std::string_view(text).substr(prev, c - prev)));
    prev = c;
  }
  add(p.push(std::string_view(text).substr(prev)));
  add(p.finish(cause));
  run.r = p.result();
  return run;
}

FeedRun feed_bytewise(const std::string& text, const ParserOptions& o, EndCause cause = EndCause::Eos) {
  std::vector<size_t> cuts;
  for (size_t i = 1; i < text.size(); ++i) cuts.push_back(i);
  return feed(text, o, cuts, cause);
}

std::string concat(const std::vector<Event>& ev, EventType t, int index = -1) {
  std::string s;
  for (const auto& e : ev)
    if (e.type == t && (index < 0 || e.index == index)) s += e.text;
  return s;
}

// Properties every event stream must have.
void check_invariants(const FeedRun& run) {
  const ParseResult& r = run.r;
  bool reasoning_ended = false;
  int open_call = -1, next_call = 0;
  for (const auto& e : run.events) {
    EXPECT_TRUE(valid_utf8(e.text)) << event_type_name(e.type);
    switch (e.type) {
      case EventType::ReasoningDelta: EXPECT_FALSE(reasoning_ended); EXPECT_FALSE(e.text.empty()); break;
      case EventType::ReasoningEnd: EXPECT_FALSE(reasoning_ended); reasoning_ended = true; break;
      case EventType::ContentDelta: EXPECT_EQ(open_call, -1); EXPECT_FALSE(e.text.empty()); break;
      case EventType::ToolCallStart:
        EXPECT_EQ(open_call, -1);
        EXPECT_EQ(e.index, next_call);
        open_call = e.index;
        break;
      case EventType::ToolCallDelta: EXPECT_EQ(e.index, open_call); break;
      case EventType::ToolCallEnd:
        EXPECT_EQ(e.index, open_call);
        EXPECT_EQ(concat(run.events, EventType::ToolCallDelta, e.index), e.text);  // S8
        {
          pyjson::Value v;
          pyjson::ParseOptions strict;
          strict.allow_nan = false;
          EXPECT_TRUE(pyjson::try_parse(e.text, v, strict) && v.is_object()) << e.text;
        }
        open_call = -1;
        ++next_call;
        break;
      case EventType::Error: EXPECT_TRUE(r.stream_error); break;
    }
  }
  EXPECT_EQ(concat(run.events, EventType::ReasoningDelta), r.reasoning);
  EXPECT_EQ(reasoning_ended, r.reasoning_closed);
  if (!r.stream_error) {
    EXPECT_EQ(concat(run.events, EventType::ContentDelta), r.content);
    EXPECT_EQ(static_cast<size_t>(next_call), r.tool_calls.size());
    for (size_t i = 0; i < r.tool_calls.size(); ++i) {
      EXPECT_EQ(concat(run.events, EventType::ToolCallDelta, static_cast<int>(i)), r.tool_calls[i].arguments);
      for (const auto& e : run.events)
        if (e.type == EventType::ToolCallStart && e.index == static_cast<int>(i)) {
          EXPECT_EQ(e.id, r.tool_calls[i].id);  // S7
          EXPECT_EQ(e.name, r.tool_calls[i].name);
        }
    }
  } else {
    EXPECT_TRUE(r.tool_calls.empty());
  }
  if (!r.tool_calls.empty()) {
    EXPECT_EQ(r.finish, FinishReason::ToolCalls);
  }
}

// Same observable result regardless of how the text was split.
void expect_same(const ParseResult& a, const ParseResult& b) {
  EXPECT_EQ(a.reasoning, b.reasoning);
  EXPECT_EQ(a.reasoning_closed, b.reasoning_closed);
  EXPECT_EQ(a.content, b.content);
  EXPECT_EQ(a.finish, b.finish);
  EXPECT_EQ(a.stream_error, b.stream_error);
  EXPECT_EQ(a.block_text, b.block_text);
  ASSERT_EQ(a.tool_calls.size(), b.tool_calls.size());
  for (size_t i = 0; i < a.tool_calls.size(); ++i) {
    EXPECT_EQ(a.tool_calls[i].name, b.tool_calls[i].name);
    EXPECT_EQ(a.tool_calls[i].arguments, b.tool_calls[i].arguments);
  }
}

// One-shot parse, then every single split point, every byte, and checks of the invariants.
ParseResult parse_all_splits(const std::string& text, const ParserOptions& o, EndCause cause = EndCause::Eos) {
  const FeedRun whole = feed(text, o, {}, cause);
  check_invariants(whole);
  for (size_t k = 0; k <= text.size(); ++k) {
    SCOPED_TRACE("split at " + std::to_string(k));
    const FeedRun r = feed(text, o, {k}, cause);
    expect_same(whole.r, r.r);
    check_invariants(r);
    if (::testing::Test::HasFailure()) break;
  }
  const FeedRun bw = feed_bytewise(text, o, cause);
  expect_same(whole.r, bw.r);
  check_invariants(bw);
  return whole.r;
}

std::string param(const std::string& name, const char* str, const std::string& value, bool v41 = false) {
  const std::string tag = v41 ? " parameter" : "parameter";
  std::string attrs = " name=\"" + name + "\"";
  if (str) attrs += std::string(" string=\"") + str + "\"";
  return "<" + D + tag + attrs + ">" + value + "</" + D + tag + ">";
}

std::string invoke(const std::string& name, const std::vector<std::string>& params, bool v41 = false) {
  const std::string tag = v41 ? " invoke" : "invoke";
  std::string s = "<" + D + tag + " name=\"" + name + "\">\n";
  for (size_t i = 0; i < params.size(); ++i) s += (i ? "\n" : "") + params[i];
  return s + "\n</" + D + tag + ">";
}

std::string block(const std::vector<std::string>& invokes, bool v41 = false) {
  const std::string tag = v41 ? " calls" : "tool_calls";
  std::string s = "<" + D + tag + ">\n";
  for (size_t i = 0; i < invokes.size(); ++i) s += (i ? "\n" : "") + invokes[i];
  return s + "\n</" + D + tag + ">";
}

}  // namespace

// ---- §6.4 parsing cases ----------------------------------------------------------------------------------

TEST(DsmlParser, P1OfficialV41) {
  const std::string text =
      "  reason  </think>summary\n\n" +
      block({invoke("lookup", {param("query", "true", "value", true), param("limit", "false", "2", true)}, true)}, true) +
      kEosText;
  const ParseResult r = parse_all_splits(text, popts(Profile::V41, true));
  EXPECT_EQ(r.reasoning, "  reason  ");
  EXPECT_EQ(r.content, "summary");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "lookup");
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"query": "value", "limit": 2})");
  EXPECT_EQ(r.finish, FinishReason::ToolCalls);
  EXPECT_TRUE(r.warnings.empty());
  EXPECT_EQ(r.block_text, "\n\n" + block({invoke("lookup", {param("query", "true", "value", true),
                                                          param("limit", "false", "2", true)}, true)}, true));
}

TEST(DsmlParser, P2OfficialV4Turns) {
  const std::string t1 = "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n" +
                         block({invoke("get_weather", {param("location", "true", "Beijing"), param("unit", "true", "celsius")})}) +
                         kEosText;
  ParseResult r = parse_all_splits(t1, popts(Profile::V4, true));
  EXPECT_EQ(r.reasoning, "The user wants to know the weather in Beijing. I should use the get_weather tool.");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"location": "Beijing", "unit": "celsius"})");
  const std::string t2 = "Got the weather data. Let me format a nice response.</think>The weather in Beijing is currently "
                         "sunny with a temperature of 22°C and 45% humidity." + kEosText;
  r = parse_all_splits(t2, popts(Profile::V4, true));
  EXPECT_NE(r.content.find("22°C"), std::string::npos);
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_EQ(r.finish, FinishReason::Stop);
}

TEST(DsmlParser, P3ShortSpelling) {
  const std::string text =
      "<think>need a tool</think><DSML｜tool_calls>\n<DSML｜invoke name=\"bash\">\n<DSML｜parameter name=\"description\" "
      "string=\"true\">list files</DSML｜parameter>\n<DSML｜parameter name=\"command\" string=\"true\">ls -la"
      "</DSML｜parameter>\n</DSML｜invoke>\n</DSML｜tool_calls>";
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, true));
  EXPECT_EQ(r.reasoning, "need a tool");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "bash");
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"description": "list files", "command": "ls -la"})");
}

TEST(DsmlParser, P4LooseNestedParameters) {
  const std::string text =
      "review done\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"edit\">\n" + param("path", nullptr, "/private/tmp/tetris.c") +
      "\n<" + D + "parameter name=\"edits\">\n" + param("oldText", "true", "old &lt;text&gt;") + "\n" +
      param("newText", "true", "new text") + "\n</" + D + "invoke>\n</" + D + "tool_calls>";
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  EXPECT_EQ(r.content, "review done");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].name, "edit");
  // Unlike ds4 we do not decode XML entities (spec §2.7 / §6.4 P4).
  EXPECT_EQ(r.tool_calls[0].arguments,
            R"({"path": "/private/tmp/tetris.c", "edits": {"oldText": "old &lt;text&gt;", "newText": "new text"}})");
  // The outer parameter may also be closed explicitly.
  const std::string closed =
      "<" + D + "tool_calls>\n<" + D + "invoke name=\"edit\">\n<" + D + "parameter name=\"edits\">\n" +
      param("a", "false", "1") + "\n</" + D + "parameter>\n" + param("b", nullptr, "  <x>  ") + "\n</" + D +
      "invoke>\n</" + D + "tool_calls>";
  const ParseResult r2 = parse_all_splits(closed, popts(Profile::V4, false));
  ASSERT_EQ(r2.tool_calls.size(), 1u);
  EXPECT_EQ(r2.tool_calls[0].arguments, R"({"edits": {"a": 1}, "b": "  <x>  "})");
}

TEST(DsmlParser, P5InvokeWithoutName) {
  const std::string text = "trying a tool\n\n<" + D + "tool_calls>\n<" + D + "invoke>\n</" + D + "tool_calls>";
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_EQ(r.content, text);
  EXPECT_EQ(r.finish, FinishReason::Stop);
  EXPECT_FALSE(r.stream_error);
  ASSERT_FALSE(r.warnings.empty());
  EXPECT_EQ(r.warnings[0].rfind("invalid tool call", 0), 0u);
}

TEST(DsmlParser, P6DsmlInsideReasoningIsNotACall) {
  const std::string blk = block({invoke("bash", {param("command", "true", "true")})});
  const std::string text = "<think>I might mention a malformed or tentative tool call here:\n\n" + blk +
                           "\nBut it is still reasoning, not an assistant action.</think>Final answer.";
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, true));
  EXPECT_TRUE(r.tool_calls.empty());
  EXPECT_NE(r.reasoning.find("<" + D + "tool_calls>"), std::string::npos);
  EXPECT_EQ(r.content, "Final answer.");
}

TEST(DsmlParser, P7ToolAfterThinkClose) {
  const std::string text = "<think>need a shell check</think>\n\n" + block({invoke("bash", {param("command", "true", "pwd")})});
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, true));
  EXPECT_EQ(r.reasoning, "need a shell check");
  EXPECT_EQ(r.content, "");
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"command": "pwd"})");
}

TEST(DsmlParser, P8ZeroParameterInvoke) {
  const std::string text = "\n\n" + block({invoke("now", {})});
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, "{}");
}

TEST(DsmlParser, P9TwoInvokes) {
  const std::string text = "x\n\n" + block({invoke("a", {param("k", "true", "1")}), invoke("b", {})});
  const FeedRun run = feed(text, popts(Profile::V4, false), {});
  check_invariants(run);
  ASSERT_EQ(run.r.tool_calls.size(), 2u);
  EXPECT_NE(run.r.tool_calls[0].id, run.r.tool_calls[1].id);
  std::vector<std::string> order;
  for (const auto& e : run.events)
    if (e.type == EventType::ToolCallStart || e.type == EventType::ToolCallEnd)
      order.push_back(std::string(event_type_name(e.type)) + std::to_string(e.index));
  EXPECT_EQ(order, (std::vector<std::string>{"tool_call_start0", "tool_call_end0", "tool_call_start1", "tool_call_end1"}));
  // Random ids (no make_id): call_ + 32 lowercase hex, distinct.
  ParserOptions o = popts(Profile::V4, false);
  o.make_id = nullptr;
  const ParseResult r = parse_completion(text, o);
  ASSERT_EQ(r.tool_calls.size(), 2u);
  for (const auto& c : r.tool_calls) {
    ASSERT_EQ(c.id.size(), 5u + 32u);
    EXPECT_EQ(c.id.rfind("call_", 0), 0u);
    EXPECT_EQ(c.id.find_first_not_of("0123456789abcdef", 5), std::string::npos);
  }
  EXPECT_NE(r.tool_calls[0].id, r.tool_calls[1].id);
  o.id_prefix = "toolu_";
  EXPECT_EQ(parse_completion(text, o).tool_calls[0].id.rfind("toolu_", 0), 0u);
}

TEST(DsmlParser, P10TypedValues) {
  const std::string text = block({invoke("t", {param("a", "false", "[\"a\", \"b\"]"), param("o", "false", "{\"k\": 1}"),
                                               param("b", "false", "true"), param("n", "false", "null"),
                                               param("f", "false", "-1.5e3"), param("bad", "false", "[1,")})});
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  const pyjson::Value v = pyjson::parse(r.tool_calls[0].arguments);
  EXPECT_EQ(pyjson::dumps(v), R"({"a": ["a", "b"], "o": {"k": 1}, "b": true, "n": null, "f": -1500.0, "bad": "[1,"})");
  bool warned = false;
  for (const auto& w : r.warnings) warned = warned || w.find("'bad'") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST(DsmlParser, SchemaCoercion) {
  ParserOptions o = popts(Profile::V4, false);
  o.tools.push_back(tool_from_value(pyjson::parse(
      R"({"type":"function","function":{"name":"t","parameters":{"type":"object","properties":{
        "s":{"type":"string"},"i":{"type":"integer"},"b":{"type":"boolean"},"u":{"type":["number","null"]}}}}})")));
  const std::string text = block({invoke("t", {param("s", "false", "hello world"), param("i", "false", "'5'"),
                                               param("b", "false", "True"), param("u", "false", " 2.5 "),
                                               param("x", "false", "")})});
  const ParseResult r = parse_all_splits(text, o);
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"s": "hello world", "i": 5, "b": true, "u": 2.5, "x": ""})");
}

TEST(DsmlParser, P11DuplicateParameterLastWins) {
  const std::string text = block({invoke("t", {param("k", "true", "first"), param("k", "true", "second")})});
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(pyjson::dumps(pyjson::parse(r.tool_calls[0].arguments)), R"({"k": "second"})");
  bool warned = false;
  for (const auto& w : r.warnings) warned = warned || w.find("duplicate parameter 'k'") != std::string::npos;
  EXPECT_TRUE(warned);
}

TEST(DsmlParser, P12LengthInsideStringParameter) {
  const std::string text = "ok\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"write\">\n<" + D +
                           "parameter name=\"body\" string=\"true\">partial file con";
  const FeedRun run = feed(text, popts(Profile::V4, false), {}, EndCause::Length);
  check_invariants(run);
  EXPECT_TRUE(run.r.stream_error);
  EXPECT_EQ(run.events.back().type, EventType::Error);
  EXPECT_EQ(run.r.content, text);  // non-streaming view: raw text as content
  EXPECT_TRUE(run.r.tool_calls.empty());
  EXPECT_EQ(run.r.finish, FinishReason::Length);
  // Header streamed before the failure.
  bool started = false;
  for (const auto& e : run.events) started = started || e.type == EventType::ToolCallStart;
  EXPECT_TRUE(started);
  for (size_t k = 0; k <= text.size(); ++k) expect_same(run.r, feed(text, popts(Profile::V4, false), {k}, EndCause::Length).r);
}

TEST(DsmlParser, P13ExtraBlankLinesBeforeBlock) {
  const std::string blk = block({invoke("f", {param("x", "true", "1")})});
  const std::string text = "text\n\n\n\n" + blk;
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, false));
  EXPECT_EQ(r.content, "text\n\n");
  EXPECT_EQ(r.block_text, "\n\n" + blk);
  EXPECT_EQ(r.content + r.block_text, text);  // replay reproduces the sampled bytes
  // No blank line at all: the block starts at '<'.
  const ParseResult r2 = parse_all_splits("text" + blk, popts(Profile::V4, false));
  EXPECT_EQ(r2.content, "text");
  EXPECT_EQ(r2.block_text, blk);
  // A single newline stays content.
  const ParseResult r3 = parse_all_splits("text\n" + blk, popts(Profile::V4, false));
  EXPECT_EQ(r3.content, "text\n");
  EXPECT_EQ(r3.block_text, blk);
}

TEST(DsmlParser, ReasoningAndContentReconstructSampledBytes) {
  const std::string text = "think hard</think>Answer:\n  " + std::string("\n\n") + block({invoke("f", {param("v", "true", "a</b")})});
  const ParseResult r = parse_all_splits(text, popts(Profile::V4, true));
  EXPECT_EQ(r.reasoning + "</think>" + r.content + r.block_text, text);
  std::string seg;
  for (const auto& s : r.block_segments) seg += s.text;
  EXPECT_EQ(seg, r.block_text);
  std::string untrusted;
  for (const auto& s : r.block_segments)
    if (!s.trusted) untrusted += s.text;
  EXPECT_EQ(untrusted, "fvtruea</b");  // attribute values and parameter values are model payload
}

// ---- §6.5 streaming cases --------------------------------------------------------------------------------

TEST(DsmlStream, S1Utf8NeverSplit) {
  for (bool tools : {false, true}) {
    DsmlParser p(popts(Profile::V4, false, tools));
    std::vector<std::string> deltas;
    for (const char* piece : {"emo", "ji", " \xF0\x9F\x91\x8D", "\xF0\x9F\x8F", "\xBD", " test"})
      for (const auto& e : p.push(piece))
        if (e.type == EventType::ContentDelta) deltas.push_back(e.text);
    for (const auto& e : p.finish(EndCause::Eos))
      if (e.type == EventType::ContentDelta) deltas.push_back(e.text);
    EXPECT_EQ(deltas, (std::vector<std::string>{"emo", "ji", " 👍", "🏽", " test"}));
  }
}

TEST(DsmlStream, S2ThinkCloserAsPieces) {
  DsmlParser p(popts(Profile::V4, true));
  std::string reasoning;
  for (const char* piece : {"reason", "</", "think", ">", "answer"})
    for (const auto& e : p.push(piece)) {
      if (e.type == EventType::ReasoningDelta) reasoning += e.text;
      EXPECT_EQ(e.text.find('<'), std::string::npos);
    }
  p.finish(EndCause::Eos);
  EXPECT_EQ(reasoning, "reason");
  EXPECT_EQ(p.result().content, "answer");
}

TEST(DsmlStream, S3BlockStartNotLeaked) {
  DsmlParser p(popts(Profile::V4, false));
  std::string content;
  const std::vector<std::string> pieces = {"Let me check.", "\n\n", "<", D, "tool", "_c", "alls", ">\n", "<", D, "invoke",
                                           " name", "=\"", "f", "\">\n", "</", D, "invoke", ">\n", "</", D, "tool", "_c",
                                           "alls", ">"};
  for (const auto& piece : pieces) {
    for (const auto& e : p.push(piece))
      if (e.type == EventType::ContentDelta) content += e.text;
    EXPECT_EQ(content.find('\n'), std::string::npos);
    EXPECT_EQ(content.find('<'), std::string::npos);
  }
  EXPECT_TRUE(p.should_stop());  // stop at the block closer, do not wait for EOS
  p.finish(EndCause::Eos);
  EXPECT_EQ(content, "Let me check.");
  EXPECT_EQ(p.result().finish, FinishReason::ToolCalls);
}

TEST(DsmlStream, S4AngleBracketReleased) {
  DsmlParser p(popts(Profile::V4, false));
  std::string content;
  auto push = [&](const char* s) {
    for (const auto& e : p.push(s))
      if (e.type == EventType::ContentDelta) content += e.text;
  };
  push("x");
  push(" <");
  EXPECT_EQ(content, "x");
  push("b");
  EXPECT_EQ(content, "x <b");
  push("> y");
  EXPECT_EQ(content, "x <b> y");
}

TEST(DsmlStream, S5PartialCloserHeld) {
  DsmlParser p(popts(Profile::V4, false));
  std::string args;
  auto push = [&](const std::string& s) {
    for (const auto& e : p.push(s))
      if (e.type == EventType::ToolCallDelta) args += e.text;
  };
  push("<" + D + "tool_calls>\n<" + D + "invoke name=\"f\">\n<" + D + "parameter name=\"v\" string=\"true\">value</");
  EXPECT_EQ(args, "{\"v\": \"value");
  push(D + "parameter>");
  EXPECT_EQ(args, "{\"v\": \"value\"");
  push("\n</" + D + "invoke>");
  EXPECT_EQ(args, "{\"v\": \"value\"}");
}

TEST(DsmlStream, S6StopStringAcrossPieces) {
  ParserOptions o = popts(Profile::V4, false);
  o.stop = {"END"};
  DsmlParser p(o);
  std::string content;
  for (const char* s : {"abc", "EN", "D", "more"}) {
    for (const auto& e : p.push(s))
      if (e.type == EventType::ContentDelta) content += e.text;
  }
  EXPECT_TRUE(p.should_stop());
  p.finish(EndCause::Eos);
  EXPECT_EQ(content, "abc");
  EXPECT_EQ(p.result().content, "abc");
  EXPECT_EQ(p.result().finish, FinishReason::StopSequence);
  EXPECT_EQ(p.result().stop_sequence, "END");
  // Stop strings do not apply to reasoning or tool arguments; a partial match is released at the end.
  o.thinking = true;
  const ParseResult r = parse_completion("say END</think>fine EN", o);
  EXPECT_EQ(r.reasoning, "say END");
  EXPECT_EQ(r.content, "fine EN");
  EXPECT_EQ(r.finish, FinishReason::Stop);
  o.stop = {"ab", "b"};  // earliest match wins
  o.thinking = false;
  EXPECT_EQ(parse_completion("xab", o).content, "x");
}

TEST(DsmlStream, S7IdsMatchReplayMap) {
  ReplayMap map;
  ParserOptions o = popts(Profile::V41, false);
  o.make_id = nullptr;
  o.replay = &map;
  const std::string text = "\n\n" + block({invoke("a", {}, true), invoke("b", {param("x", "true", "y", true)}, true)}, true);
  const FeedRun run = feed(text, o, {7, 20, 40});
  check_invariants(run);
  ASSERT_EQ(run.r.tool_calls.size(), 2u);
  std::vector<ToolCall> calls;
  for (const auto& c : run.r.tool_calls) {
    EXPECT_TRUE(map.contains(c.id));
    calls.push_back(ToolCall{c.id, c.name, c.arguments});
  }
  auto seg = map.lookup(calls);
  ASSERT_TRUE(seg.has_value());
  std::string joined;
  for (const auto& s : *seg) joined += s.text;
  EXPECT_EQ(joined, text);
}

// ---- malformed output (§3.5) and other behaviour -----------------------------------------------------------

TEST(DsmlParser, MalformedDegradesToContent) {
  struct Case {
    std::string text;
    bool header_streamed;
  };
  const std::vector<Case> cases = {
      {"a\n\n<" + D + "tool_calls>\nhello</" + D + "tool_calls>", false},                   // text between tags
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=bash>\n", false},                  // unquoted attribute
      {"a\n\n<" + D + "tool_calls>\n<" + D + "parameter name=\"x\">", false},                // parameter outside invoke
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"f\">\n<" + D + "bogus>", true},  // unknown tag
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"f\">\nstray", true},             // text inside invoke
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"f\">\n</" + D + "tool_calls>", true},  // invoke not closed
      {"a\n\n<" + D + "tool_calls>\n", false},                                                // unterminated, no header
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"f\">\n<" + D + "parameter string=\"true\">v</" + D +
           "parameter>",
       true},  // parameter without name
      {"a\n\n<" + D + "tool_calls>\n<" + D + "invoke name=\"" + std::string(5000, 'n') + "\">", false},  // tag too long
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.text.substr(0, 120));
    const ParseResult r = parse_all_splits(c.text, popts(Profile::V4, false));
    EXPECT_TRUE(r.tool_calls.empty());
    EXPECT_EQ(r.stream_error, c.header_streamed);
    EXPECT_EQ(r.content, c.text);
    EXPECT_EQ(r.finish, FinishReason::Stop);
    EXPECT_FALSE(r.warnings.empty());
  }
}

TEST(DsmlParser, LenientForms) {
  // V4 spelling under v41 and vice versa: accepted, with a warning.
  ParseResult r = parse_all_splits(block({invoke("f", {})}), popts(Profile::V41, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_FALSE(r.warnings.empty());
  r = parse_all_splits(block({invoke("f", {}, true)}, true), popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  // Plain <tool_calls>/<invoke>/<parameter>.
  r = parse_all_splits("<tool_calls>\n<invoke name=\"f\">\n<parameter name=\"a\" string=\"true\">x</parameter>\n</invoke>\n</tool_calls>",
                       popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, R"({"a": "x"})");
  // The escaped closer inside a string value is decoded (§2.7), other entities are not.
  r = parse_all_splits(block({invoke("f", {param("s", "true", "a&lt;/" + D + "parameter>b&amp;c")})}), popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(pyjson::parse(r.tool_calls[0].arguments).get("s")->text, "a</" + D + "parameter>b&amp;c");
  // Escaping and JSON string escaping of values: quotes, backslashes, newlines, control chars.
  r = parse_all_splits(block({invoke("f", {param("s", "true", "\"q\" \\ \n\t\x01 é")})}), popts(Profile::V4, false));
  ASSERT_EQ(r.tool_calls.size(), 1u);
  EXPECT_EQ(r.tool_calls[0].arguments, "{\"s\": \"\\\"q\\\" \\\\ \\n\\t\\u0001 é\"}");
  EXPECT_EQ(pyjson::parse(r.tool_calls[0].arguments).get("s")->text, "\"q\" \\ \n\t\x01 é");
}

TEST(DsmlParser, ToolsDisabledAndReasoningEdgeCases) {
  const std::string blk = "\n\n" + block({invoke("f", {})});
  // Tools not offered: DSML-looking text is ordinary content.
  ParseResult r = parse_all_splits("x" + blk, popts(Profile::V4, false, false));
  EXPECT_EQ(r.content, "x" + blk);
  EXPECT_TRUE(r.tool_calls.empty());
  // Thinking never closed: everything is reasoning, finish length.
  r = parse_all_splits("still thinking </thi", popts(Profile::V4, true), EndCause::Length);
  EXPECT_EQ(r.reasoning, "still thinking </thi");
  EXPECT_FALSE(r.reasoning_closed);
  EXPECT_EQ(r.finish, FinishReason::Length);
  // Repeated leading <think> is stripped once; chat-mode completions opening with <think> are reasoning.
  r = parse_all_splits("<think><think>x</think>y", popts(Profile::V4, true));
  EXPECT_EQ(r.reasoning, "<think>x");
  EXPECT_EQ(r.content, "y");
  r = parse_all_splits("<think>x</think>y", popts(Profile::V4, false));
  EXPECT_EQ(r.reasoning, "x");
  EXPECT_EQ(r.content, "y");
  r = parse_all_splits("<thinking is fun", popts(Profile::V4, false));
  EXPECT_EQ(r.content, "<thinking is fun");
  // Closer without opener stays content, with a warning.
  r = parse_all_splits("odd </" + D + "tool_calls> text", popts(Profile::V4, false));
  EXPECT_EQ(r.content, "odd </" + D + "tool_calls> text");
  EXPECT_FALSE(r.warnings.empty());
  // Trailing whitespace is content when the completion ends.
  r = parse_all_splits("answer\n\n", popts(Profile::V4, false));
  EXPECT_EQ(r.content, "answer\n\n");
  // Text after the block closer is ignored (generation should have stopped); EOS text silently.
  r = parse_all_splits(blk + kEosText, popts(Profile::V4, false));
  EXPECT_TRUE(r.warnings.empty());
  r = parse_all_splits(blk + "junk", popts(Profile::V4, false));
  EXPECT_EQ(r.tool_calls.size(), 1u);
  EXPECT_FALSE(r.warnings.empty());
  // EOS text in content ends the message.
  r = parse_all_splits("done" + kEosText + "ignored", popts(Profile::V4, false));
  EXPECT_EQ(r.content, "done");
  // Invalid UTF-8 becomes U+FFFD, an incomplete tail at the end too.
  r = parse_all_splits("a\xFF" "b\xE2\x82", popts(Profile::V4, false));
  EXPECT_EQ(r.content, "a\xEF\xBF\xBD" "b\xEF\xBF\xBD");
  EXPECT_FALSE(r.warnings.empty());
}

TEST(DsmlParser, PushAfterFinishIsHarmless) {
  DsmlParser p(popts(Profile::V4, false));
  p.push("a");
  p.finish(EndCause::Eos);
  EXPECT_TRUE(p.finished());
  EXPECT_TRUE(p.push("b").empty());
  EXPECT_TRUE(p.finish(EndCause::Length).empty());
  EXPECT_EQ(p.result().content, "a");
  EXPECT_EQ(p.result().finish, FinishReason::Stop);
}

TEST(DsmlFinish, ReasonMapping) {
  EXPECT_STREQ(openai_finish_reason(FinishReason::Stop), "stop");
  EXPECT_STREQ(openai_finish_reason(FinishReason::ToolCalls), "tool_calls");
  EXPECT_STREQ(openai_finish_reason(FinishReason::Length), "length");
  EXPECT_STREQ(openai_finish_reason(FinishReason::StopSequence), "stop");
  EXPECT_STREQ(anthropic_stop_reason(FinishReason::Stop), "end_turn");
  EXPECT_STREQ(anthropic_stop_reason(FinishReason::ToolCalls), "tool_use");
  EXPECT_STREQ(anthropic_stop_reason(FinishReason::Length), "max_tokens");
  EXPECT_STREQ(anthropic_stop_reason(FinishReason::StopSequence), "stop_sequence");
  EXPECT_STREQ(responses_terminal(FinishReason::Length).event, "response.incomplete");
  EXPECT_STREQ(responses_terminal(FinishReason::Length).incomplete_reason, "max_output_tokens");
  EXPECT_STREQ(responses_terminal(FinishReason::ToolCalls).status, "completed");
  EXPECT_EQ(responses_terminal(FinishReason::Stop).incomplete_reason, nullptr);
}

TEST(ReplayMapTest, LookupRulesAndEviction) {
  ReplayMap map(3, 1 << 20);
  map.remember({"a", "b"}, {"f", "g"}, {Segment{"\n\nBLOCK1", true}});
  map.remember({"c"}, {"h"}, {Segment{"\n\nBLOCK2", true}});
  auto calls = [](std::vector<std::pair<std::string, std::string>> v) {
    std::vector<ToolCall> out;
    for (auto& [id, name] : v) out.push_back(ToolCall{id, name, "{}"});
    return out;
  };
  EXPECT_TRUE(map.lookup(calls({{"a", "f"}, {"b", "g"}})).has_value());
  EXPECT_FALSE(map.lookup(calls({{"a", "f"}})).has_value());              // call count differs
  EXPECT_FALSE(map.lookup(calls({{"b", "g"}, {"a", "f"}})).has_value());  // order differs
  EXPECT_FALSE(map.lookup(calls({{"a", "f"}, {"b", "x"}})).has_value());  // name differs
  EXPECT_FALSE(map.lookup(calls({{"a", "f"}, {"c", "h"}})).has_value());  // two blocks
  EXPECT_FALSE(map.lookup(calls({{"zz", "f"}})).has_value());
  EXPECT_EQ(map.size(), 3u);
  // "c" is least recently used (a/b were just touched): a new id evicts it.
  map.remember({"d"}, {"k"}, {Segment{"\n\nBLOCK3", true}});
  EXPECT_EQ(map.size(), 3u);
  EXPECT_FALSE(map.contains("c"));
  EXPECT_TRUE(map.contains("a"));
  // Byte bound.
  ReplayMap small(100, 10);
  small.remember({"x"}, {"f"}, {Segment{"0123456789", true}});
  small.remember({"y"}, {"f"}, {Segment{"abcdefghij", true}});
  EXPECT_FALSE(small.contains("x"));
  EXPECT_TRUE(small.contains("y"));
  EXPECT_EQ(small.bytes(), 10u);
  const std::string id = map.new_id("call_");
  EXPECT_EQ(id.size(), 37u);
  EXPECT_FALSE(map.contains(id));
}

// ---- driven by real token ids (golden tokenizer) --------------------------------------------------------

namespace {

const dsx::text::Tokenizer* parser_tokenizer() {
  static std::unique_ptr<dsx::text::Tokenizer> tok;
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string g = dsx_test::golden_dir();
    const std::string path = g + "/tokenizer/tokenizer-v4.json";
    if (!g.empty() && std::filesystem::exists(path))
      tok = std::make_unique<dsx::text::Tokenizer>(dsx::text::Tokenizer::from_file(path));
  });
  return tok.get();
}

}  // namespace

TEST(DsmlStream, TokenIdsS1AndBlockStart) {
  DSX_REQUIRE_GOLDEN(golden);
  const auto* tok = parser_tokenizer();
  if (!tok) GTEST_SKIP() << "golden tokenizer not found";
  // S1: ids 18872, 7063, 102527, 40965, 124, 1950 → "emo", "ji", " 👍", "🏽", " test".
  {
    DsmlParser p(popts(Profile::V4, false));
    std::vector<std::string> deltas;
    for (int32_t id : {18872, 7063, 102527, 40965, 124, 1950})
      for (const auto& e : p.push(tok->decode_one(id))) deltas.push_back(e.text);
    for (const auto& e : p.finish(EndCause::Eos)) deltas.push_back(e.text);
    EXPECT_EQ(deltas, (std::vector<std::string>{"emo", "ji", " 👍", "🏽", " test"}));
  }
  // S3 / §3.2: the sampled token sequence of a V4 block (§6.1's golden ids), after visible content.
  {
    const std::vector<int32_t> block_ids = {
        271,  30,    128825, 72461, 4941,  12548, 1018,  30,    128825, 40148, 5406,  2329,  1281,  1133,   65,
        50219, 3816, 30,     128825, 41523, 2329,  1281,  37399, 4,      3418,  1281,  11476, 3320,  51119,  1718,
        128825, 41523, 1018, 30,     128825, 41523, 2329,  1281,  28026,  4,     3418,  1281,  19836, 3320,   21,
        1718,  128825, 41523, 1018,  1718,  128825, 40148, 5406,  1018,   1718,  128825, 72461, 4941, 12548, 32};
    DsmlParser p(popts(Profile::V4, false));
    std::string content;
    bool stopped_at_closer = false;
    for (int32_t id : tok->encode("Let me check.", true)) p.push(tok->decode_one(id));
    for (size_t i = 0; i < block_ids.size(); ++i) {
      for (const auto& e : p.push(tok->decode_one(block_ids[i])))
        if (e.type == EventType::ContentDelta) content += e.text;
      if (p.should_stop()) {
        stopped_at_closer = i + 1 == block_ids.size();
        break;
      }
    }
    EXPECT_TRUE(stopped_at_closer);  // before the EOS id 1 is even sampled
    p.finish(EndCause::Eos);
    const ParseResult& r = p.result();
    EXPECT_EQ(r.content, "Let me check.");
    ASSERT_EQ(r.tool_calls.size(), 1u);
    EXPECT_EQ(r.tool_calls[0].name, "get_weather");
    EXPECT_EQ(r.tool_calls[0].arguments, R"({"city": "Paris", "days": 3})");
    // The stored block re-tokenizes to exactly the sampled ids (trusted tags, untrusted values).
    EXPECT_EQ(encode_segments(*tok, r.block_segments), block_ids);
  }
}
