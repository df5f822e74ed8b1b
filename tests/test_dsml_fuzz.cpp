// Fuzz tests (time-bounded, ≤ 5 s in total): random and mutated DSML fed to the incremental parser at random
// split points, random/mutated conversations fed to the renderer, and canonical-render → parse round trips.
// Properties: no crash, only dsx::Error on bad input, event streams consistent with the final result, results
// independent of how the text was split, UTF-8-clean output, and lossless DSML round trips.
// DSX_FUZZ_SEED overrides the seed; DSX_FUZZ_SECONDS the time budget per test (default 1.5).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <algorithm>
#include <cstdlib>
#include <map>
#include <random>

#include "test_util.h"
#include "text/chat.h"
#include "text/dsml.h"

using namespace dsx;
using namespace dsx::text;

namespace {

uint64_t fuzz_seed() {
  if (const char* s = std::getenv("DSX_FUZZ_SEED")) return std::strtoull(s, nullptr, 10);
  return 0x5eed1234;
}

double fuzz_seconds() {
  if (const char* s = std::getenv("DSX_FUZZ_SECONDS")) return std::atof(s);
  return 1.5;
}

class Deadline {
 public:
  explicit Deadline(double s)
      : end_(std::chrono::steady_clock::now() +
             std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(s))) {}
  bool over() const { return std::chrono::steady_clock::now() >= end_; }

 private:
  std::chrono::steady_clock::time_point end_;
};

const std::string D = "｜DSML｜";

const std::vector<std::string>& fragments() {
  static const std::vector<std::string> f = {
      "<", "</", "<" + D, "</" + D, D, "DSML｜", "｜", "tool_calls", " calls", "invoke", " invoke", "parameter",
      " parameter", " name=\"", "\"", ">", ">\n", "\n", "\n\n", " ", "  ", "\t", " string=\"true\"", " string=\"false\"",
      " string=\"maybe\"", "</think>", "<think>", "</thi", "&lt;", "&lt;/" + D + "parameter>", "{", "}", "[1,", "[1, 2]",
      "\"x\"", "true", "null", "-1.5e3", "NaN", "é", "你好", "👍", "\xF0\x9F", "\x8F", "\xFF", "\xC0\xAF", "\xED\xA0\x80",
      "<｜end▁of▁sentence｜>", "<tool_calls>", "<invoke name=\"f\">", "<parameter name=\"p\">", "=", "name", "f", "abc",
      "END", "\x01", "\\", "/"};
  return f;
}

std::string random_text(std::mt19937_64& rng, size_t max_parts) {
  std::uniform_int_distribution<size_t> n(0, max_parts);
  std::uniform_int_distribution<size_t> pick(0, fragments().size() - 1);
  std::uniform_int_distribution<int> byte(0, 255), coin(0, 9);
  std::string s;
  const size_t parts = n(rng);
  for (size_t i = 0; i < parts; ++i) {
    if (coin(rng) == 0) s += static_cast<char>(byte(rng));
    else s += fragments()[pick(rng)];
  }
  return s;
}

std::string valid_dsml(std::mt19937_64& rng, bool v41) {
  const std::string blk = v41 ? " calls" : "tool_calls", inv = v41 ? " invoke" : "invoke",
                    par = v41 ? " parameter" : "parameter";
  std::uniform_int_distribution<int> k(0, 3);
  std::string s = k(rng) ? "reasoning text</think>" : "";
  s += k(rng) ? "Some content <b>x</b>\n" : "";
  s += "\n\n<" + D + blk + ">\n";
  const int calls = 1 + k(rng) % 3;
  for (int c = 0; c < calls; ++c) {
    s += "<" + D + inv + " name=\"tool" + std::to_string(c) + "\">\n";
    const int params = k(rng);
    for (int p = 0; p < params; ++p) {
      const bool str = k(rng) % 2;
      s += "<" + D + par + " name=\"p" + std::to_string(p) + "\" string=\"" + (str ? "true" : "false") + "\">";
      s += str ? "value </b> é 👍 &lt;/" + D + par + "> " + std::to_string(p) : "[1, {\"a\": null}]";
      s += "</" + D + par + ">\n";
    }
    s += "</" + D + inv + ">\n";
  }
  s += "</" + D + blk + ">";
  return s;
}

std::string mutate(std::string s, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> op(0, 5), byte(0, 255), times(1, 4);
  const int n = times(rng);
  for (int t = 0; t < n && !s.empty(); ++t) {
    std::uniform_int_distribution<size_t> pos(0, s.size() - 1);
    const size_t a = pos(rng), b = pos(rng);
    const size_t lo = std::min(a, b), hi = std::max(a, b);
    switch (op(rng)) {
      case 0: s.erase(lo, hi - lo); break;                                    // delete a range
      case 1: s.insert(a, s.substr(lo, std::min<size_t>(hi - lo, 64))); break;  // duplicate a range
      case 2: s[a] = static_cast<char>(byte(rng)); break;                     // flip a byte
      case 3: s.insert(a, random_text(rng, 3)); break;                        // insert fragments
      case 4: s.resize(a); break;                                             // truncate
      case 5: std::swap(s[a], s[b]); break;
    }
  }
  return s;
}

ParserOptions random_options(std::mt19937_64& rng) {
  std::uniform_int_distribution<int> k(0, 5);
  ParserOptions o;
  o.profile = k(rng) % 2 ? Profile::V41 : Profile::V4;
  o.thinking = k(rng) % 2;
  o.tools_enabled = k(rng) != 0;
  if (k(rng) == 0) o.stop = {"END", "\n\n\n"};
  if (k(rng) == 0) o.max_tag_bytes = 16;
  auto counter = std::make_shared<int>(0);
  o.make_id = [counter]() { return "call_" + std::to_string((*counter)++); };
  return o;
}

struct Outcome {
  ParseResult r;
  std::vector<Event> events;
};

Outcome run_parser(const std::string& text, const ParserOptions& o, std::vector<size_t> cuts, EndCause cause) {
  Outcome out;
  DsmlParser p(o);
  std::sort(cuts.begin(), cuts.end());
  size_t prev = 0;
  for (size_t c : cuts) {
    auto ev = p.push(std::string_view(text).substr(prev, c - prev));
    out.events.insert(out.events.end(), ev.begin(), ev.end());
    prev = c;
  }
  auto ev = p.push(std::string_view(text).substr(prev));
  out.events.insert(out.events.end(), ev.begin(), ev.end());
  ev = p.finish(cause);
  out.events.insert(out.events.end(), ev.begin(), ev.end());
  out.r = p.result();
  return out;
}

// Returns an empty string when all properties hold, else a description.
std::string check(const Outcome& a, const Outcome& whole) {
  std::string reasoning, content;
  std::map<int, std::string> args;
  for (const auto& e : a.events) {
    if (!valid_utf8(e.text)) return "event text is not valid UTF-8";
    if (e.type == EventType::ReasoningDelta) reasoning += e.text;
    if (e.type == EventType::ContentDelta) content += e.text;
    if (e.type == EventType::ToolCallDelta) args[e.index] += e.text;
    if (e.type == EventType::ToolCallEnd) {
      if (args[e.index] != e.text) return "argument deltas differ from the final arguments";
      pyjson::Value v;
      pyjson::ParseOptions strict;
      strict.allow_nan = false;
      if (!pyjson::try_parse(e.text, v, strict) || !v.is_object()) return "arguments are not a JSON object: " + e.text;
    }
  }
  const ParseResult& r = a.r;
  if (!valid_utf8(r.content) || !valid_utf8(r.reasoning)) return "result is not valid UTF-8";
  if (reasoning != r.reasoning) return "reasoning deltas differ from the result";
  if (!r.stream_error && content != r.content) return "content deltas differ from the result";
  for (size_t i = 0; i < r.tool_calls.size(); ++i)
    if (args[static_cast<int>(i)] != r.tool_calls[i].arguments) return "call arguments differ from the deltas";
  const ParseResult& w = whole.r;
  if (r.reasoning != w.reasoning || r.content != w.content || r.finish != w.finish ||
      r.stream_error != w.stream_error || r.tool_calls.size() != w.tool_calls.size() || r.block_text != w.block_text)
    return "result depends on the split points";
  for (size_t i = 0; i < r.tool_calls.size(); ++i)
    if (r.tool_calls[i].arguments != w.tool_calls[i].arguments || r.tool_calls[i].name != w.tool_calls[i].name)
      return "calls depend on the split points";
  return "";
}

std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c >= 0x20 && c < 0x7f) out += static_cast<char>(c);
    else {
      char b[8];
      std::snprintf(b, sizeof b, "\\x%02x", c);
      out += b;
    }
  }
  return out;
}

}  // namespace

TEST(DsmlFuzz, ParserRandomAndMutatedInput) {
  std::mt19937_64 rng(fuzz_seed());
  Deadline deadline(fuzz_seconds());
  size_t iterations = 0, with_calls = 0, stream_errors = 0, degraded = 0;
  while (!deadline.over()) {
    std::uniform_int_distribution<int> kind(0, 2);
    std::string text;
    switch (kind(rng)) {
      case 0: text = random_text(rng, 60); break;
      case 1: text = mutate(valid_dsml(rng, rng() % 2), rng); break;
      default: text = valid_dsml(rng, rng() % 2); break;
    }
    const ParserOptions o = random_options(rng);
    const EndCause cause = rng() % 2 ? EndCause::Eos : EndCause::Length;
    const Outcome whole = run_parser(text, o, {}, cause);
    std::vector<size_t> cuts;
    const size_t ncuts = text.empty() ? 0 : rng() % 8;
    for (size_t i = 0; i < ncuts; ++i) cuts.push_back(rng() % (text.size() + 1));
    const Outcome split = run_parser(text, o, cuts, cause);
    std::string problem = check(whole, whole);
    if (problem.empty()) problem = check(split, whole);
    ASSERT_TRUE(problem.empty()) << problem << "\ninput: " << printable(text);
    ++iterations;
    with_calls += !whole.r.tool_calls.empty();
    stream_errors += whole.r.stream_error;
    degraded += !whole.r.stream_error && whole.r.tool_calls.empty() && !whole.r.warnings.empty();
  }
  std::printf("[ fuzz     ] %zu inputs: %zu with calls, %zu stream errors, %zu degraded with warnings\n", iterations,
              with_calls, stream_errors, degraded);
  EXPECT_GT(iterations, 100u);
  EXPECT_GT(with_calls, 0u);
  EXPECT_GT(stream_errors, 0u);
  EXPECT_GT(degraded, 0u);
}

TEST(DsmlFuzz, CanonicalRenderParseRoundTrip) {
  // Canonical DSML (renderer) → parser gives back the same calls, whatever the values contain, except the
  // one documented ambiguity: a value holding the literal escaped closer "&lt;/｜DSML｜parameter>".
  std::mt19937_64 rng(fuzz_seed() + 1);
  Deadline deadline(fuzz_seconds());
  size_t iterations = 0;
  while (!deadline.over()) {
    const Profile prof = rng() % 2 ? Profile::V41 : Profile::V4;
    std::vector<ToolCall> calls;
    const int ncalls = 1 + static_cast<int>(rng() % 3);
    for (int c = 0; c < ncalls; ++c) {
      pyjson::Value args = pyjson::Value::object();
      const int np = static_cast<int>(rng() % 4);
      for (int p = 0; p < np; ++p) {
        pyjson::Value v;
        switch (rng() % 4) {
          case 0: {
            std::string s = random_text(rng, 8);
            // keep it valid UTF-8 and free of the escaped-closer literal
            pyjson::Value probe;
            if (!valid_utf8(s)) s = "plain";
            if (s.find("&lt;/") != std::string::npos) s = "amp";
            v = pyjson::Value::string(s);
            break;
          }
          case 1: v = pyjson::parse("[1, \"a\", {\"k\": null}, 2.5, true]"); break;
          case 2: v = pyjson::parse(std::to_string(static_cast<int>(rng() % 1000) - 500)); break;
          default: v = pyjson::parse("{\"nested\": \"</" + D + "parameter> x\"}"); break;
        }
        args.members.emplace_back("k" + std::to_string(p), v);
      }
      calls.push_back(ToolCall{"id" + std::to_string(c), "tool_" + std::to_string(c), pyjson::dumps(args)});
    }
    std::string text = "lead text";
    for (const auto& s : render_tool_calls_block(calls, prof)) text += s.text;
    ParserOptions o;
    o.profile = prof;
    o.thinking = false;
    o.tools_enabled = true;
    std::vector<size_t> cuts;
    for (int i = 0; i < 5; ++i) cuts.push_back(rng() % (text.size() + 1));
    const Outcome out = run_parser(text, o, cuts, EndCause::Eos);
    ASSERT_EQ(out.r.content, "lead text") << printable(text);
    ASSERT_EQ(out.r.tool_calls.size(), calls.size()) << printable(text);
    for (size_t i = 0; i < calls.size(); ++i) {
      EXPECT_EQ(out.r.tool_calls[i].name, calls[i].name);
      EXPECT_EQ(pyjson::dumps(pyjson::parse(out.r.tool_calls[i].arguments)), calls[i].arguments) << printable(text);
    }
    // Re-rendering the parsed calls gives the same canonical bytes.
    std::vector<ToolCall> again;
    for (const auto& c : out.r.tool_calls) again.push_back(ToolCall{c.id, c.name, c.arguments});
    std::string text2 = "lead text";
    for (const auto& s : render_tool_calls_block(again, prof)) text2 += s.text;
    ASSERT_EQ(text2, text);
    ++iterations;
  }
  EXPECT_GT(iterations, 100u);
}

TEST(DsmlFuzz, RendererRandomConversations) {
  std::mt19937_64 rng(fuzz_seed() + 2);
  Deadline deadline(fuzz_seconds());
  const char* roles[] = {"system", "developer", "user", "assistant", "tool", "latest_reminder", "robot"};
  const std::string base = R"({"messages":[{"role":"system","content":"S"},{"role":"user","content":[{"type":"text","text":"a"}]},
    {"role":"assistant","reasoning_content":"r","content":"c","tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{\"x\": [1, 2.50, 1e400]}"}}]},
    {"role":"tool","tool_call_id":"1","content":"res"},{"role":"user","content":"b","task":"query"}],
    "tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object","properties":{"x":{"type":"array"}}}}}],
    "reasoning_effort":"high"})";
  size_t iterations = 0, rendered = 0;
  while (!deadline.over()) {
    std::string json;
    if (rng() % 2) {
      json = mutate(base, rng);
    } else {
      // structurally valid conversations with random strings
      json = "{\"messages\":[";
      const int n = 1 + static_cast<int>(rng() % 6);
      for (int i = 0; i < n; ++i) {
        if (i) json += ",";
        const char* role = roles[rng() % 7];
        const std::string text = random_text(rng, 6);
        pyjson::Value s = pyjson::Value::string(valid_utf8(text) ? text : std::string("x"));
        json += std::string("{\"role\":\"") + role + "\",\"content\":" + pyjson::dumps(s);
        if (std::string(role) == "assistant" && rng() % 2)
          json += ",\"reasoning_content\":" + pyjson::dumps(s) + ",\"tool_calls\":[{\"id\":\"" + std::to_string(i) +
                  "\",\"function\":{\"name\":" + pyjson::dumps(s) + ",\"arguments\":" + pyjson::dumps(s) + "}}]";
        if (std::string(role) == "tool") json += ",\"tool_call_id\":\"" + std::to_string(i - 1) + "\"";
        json += "}";
      }
      json += "]}";
    }
    for (Profile prof : {Profile::V4, Profile::V4_0731, Profile::V41}) {
      RenderOptions o;
      o.profile = prof;
      o.thinking = rng() % 2;
      o.drop_thinking = rng() % 2;
      try {
        const RenderedPrompt r = render_prompt(parse_conversation(json), o);
        std::string joined;
        for (const auto& s : r.segments) {
          ASSERT_FALSE(s.text.empty());
          joined += s.text;
        }
        ASSERT_EQ(joined, r.text);
        ASSERT_TRUE(valid_utf8(r.text));
        ASSERT_EQ(r.text.rfind("<｜begin▁of▁sentence｜>", 0), 0u);
        ++rendered;
      } catch (const Error&) {
        // rejected input is fine; anything else (crash, other exception) is not
      }
    }
    ++iterations;
  }
  std::printf("[ fuzz     ] %zu conversations, %zu renders succeeded\n", iterations, rendered);
  EXPECT_GT(iterations, 100u);
  EXPECT_GT(rendered, 10u);
}
