// Tests of constrained decoding (src/server/constrain.h) with the golden V4.1 tokenizer: each constraint is
// driven by random logits (greedy, sampled, and an adversarial pick that prefers tokens with structural
// characters) until done(); the text must parse (text/dsml.h) as exactly one valid tool call whose arguments
// satisfy the tool's schema, or as JSON content that satisfies the response schema.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "server/constrain.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

using namespace dsx;
using namespace dsx::text;
using dsx::server::Constraint;
using dsx::server::ConstraintLimits;

namespace {

const Tokenizer* tokenizer(const std::string& file) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& slot = cache[file];
  if (!slot) {
    const std::string g = dsx_test::golden_dir();
    const std::string path = g + "/tokenizer/" + file;
    if (g.empty() || !std::filesystem::exists(path)) return nullptr;
    slot = std::make_unique<Tokenizer>(Tokenizer::from_file(path));
  }
  return slot.get();
}

#define NEED_TOKENIZER(var, file)      \
  const Tokenizer* var = tokenizer(file); \
  if (!var) GTEST_SKIP() << "golden tokenizer " << file << " not found"

const std::vector<std::string>& token_bytes(const Tokenizer& tok) {
  static std::map<const Tokenizer*, std::vector<std::string>> cache;
  auto& v = cache[&tok];
  if (v.empty()) {
    v.resize(tok.size());
    for (size_t i = 0; i < tok.size(); ++i) {
      try {
        v[i] = tok.decode_one(static_cast<int32_t>(i));
      } catch (const std::exception&) {
      }
    }
  }
  return v;
}

// ---- an independent JSON-schema checker for what the tests use --------------------------------------------
bool same(const pyjson::Value& a, const pyjson::Value& b) { return pyjson::dumps(a) == pyjson::dumps(b); }

const pyjson::Value* follow(const pyjson::Value* s, const pyjson::Value& root) {
  while (s && s->is_object() && s->get("$ref")) {
    const std::string ref = s->get("$ref")->text;  // "#/$defs/Name" only
    const std::string pre = "#/$defs/";
    if (ref.rfind(pre, 0) != 0) return nullptr;
    const pyjson::Value* defs = root.get("$defs");
    s = defs ? defs->get(ref.substr(pre.size())) : nullptr;
  }
  return s;
}

bool type_ok(const std::string& t, const pyjson::Value& v) {
  using T = pyjson::Type;
  if (t == "string") return v.type == T::String;
  if (t == "integer") return v.type == T::Int;
  if (t == "number") return v.type == T::Int || (v.type == T::Float && std::isfinite(v.number));
  if (t == "boolean") return v.type == T::Bool;
  if (t == "null") return v.type == T::Null;
  if (t == "object") return v.type == T::Object;
  if (t == "array") return v.type == T::Array;
  return false;
}

// Empty string: valid; else the first problem found.
std::string check(const pyjson::Value* schema, const pyjson::Value& v, const pyjson::Value& root, const std::string& at) {
  schema = follow(schema, root);
  if (!schema) return at + ": unresolved schema";
  if (!schema->is_object()) return "";
  if (const auto* c = schema->get("const"); c && !same(*c, v)) return at + ": not the const";
  if (const auto* e = schema->get("enum")) {
    bool hit = false;
    for (const auto& x : e->items) hit = hit || same(x, v);
    if (!hit) return at + ": " + pyjson::dumps(v) + " not in the enum";
  }
  for (const char* k : {"anyOf", "oneOf"})
    if (const auto* alts = schema->get(k)) {
      bool hit = false;
      for (const auto& a : alts->items) hit = hit || check(&a, v, root, at).empty();
      if (!hit) return at + ": matches no alternative";
    }
  if (const auto* t = schema->get("type")) {
    bool hit = false;
    if (t->is_string()) hit = type_ok(t->text, v);
    for (const auto& x : t->items) hit = hit || type_ok(x.text, v);
    if (!hit) return at + ": wrong type for " + pyjson::dumps(v);
  }
  if (v.is_object()) {
    const auto* props = schema->get("properties");
    if (const auto* req = schema->get("required"))
      for (const auto& r : req->items)
        if (!v.get(r.text)) return at + ": missing required '" + r.text + "'";
    for (const auto& [k, x] : v.members) {
      const pyjson::Value* ps = props ? props->get(k) : nullptr;
      const auto* ap = schema->get("additionalProperties");
      if (!ps && ap && ap->type == pyjson::Type::Bool && !ap->boolean) return at + ": unexpected key '" + k + "'";
      if (ps) {
        std::string e = check(ps, x, root, at + "." + k);
        if (!e.empty()) return e;
      }
    }
  }
  if (v.is_array()) {
    if (const auto* mn = schema->get("minItems"); mn && v.items.size() < std::stoul(mn->text)) return at + ": too few items";
    if (const auto* mx = schema->get("maxItems"); mx && v.items.size() > std::stoul(mx->text)) return at + ": too many items";
    if (const auto* it = schema->get("items"))
      for (size_t i = 0; i < v.items.size(); ++i) {
        std::string e = check(it, v.items[i], root, at + "[" + std::to_string(i) + "]");
        if (!e.empty()) return e;
      }
  }
  return "";
}

bool has_float(const pyjson::Value& v) {
  if (v.type == pyjson::Type::Float) return true;
  for (const auto& x : v.items)
    if (has_float(x)) return true;
  for (const auto& [k, x] : v.members)
    if (has_float(x)) return true;
  return false;
}

// ---- driving a constraint -----------------------------------------------------------------------------
// Script: a hostile model that tries to write `script` in plain (non-added) tokens, taking the longest allowed
// token that continues it, and samples at random once the script is written or when nothing continues it.
enum class Mode { Greedy, Random, Adversarial, Script };
const char* mode_name(Mode m) {
  return m == Mode::Greedy ? "greedy" : m == Mode::Random ? "random" : m == Mode::Adversarial ? "adversarial" : "script";
}

struct Drive {
  std::vector<int32_t> ids;
  int free_steps = 0, forced_steps = 0;
  double free_ms = 0;  // in next() on free steps, less the time of the test's own pick function
  double max_ms = 0;   // the slowest free step (with its pick)
};

Drive drive(Constraint& c, const Tokenizer& tok, uint64_t seed, Mode mode, int max_steps = 20000,
            const std::string& script = "", int wrap_after = -1) {
  Drive run;
  size_t script_pos = 0;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t V = static_cast<int64_t>(tok.size()) + 300;  // model vocabularies are padded past the tokenizer
  const auto& bytes = token_bytes(tok);
  std::vector<float> logits(static_cast<size_t>(V));
  int32_t picked = -1;
  size_t finite = 0;
  double pick_ms = 0;
  auto pick = [&](const float* l, int64_t n) -> int32_t {
    EXPECT_EQ(n, V);
    std::vector<int32_t> ok;
    for (int64_t i = 0; i < n; ++i)
      if (std::isfinite(l[i])) ok.push_back(static_cast<int32_t>(i));
    finite = ok.size();
    for (int64_t i = static_cast<int64_t>(tok.size()); i < n; ++i) EXPECT_TRUE(std::isinf(l[i])) << "id " << i;
    if (ok.empty()) return picked = 0;
    if (mode == Mode::Greedy) {
      int32_t best = ok[0];
      for (int32_t i : ok)
        if (l[i] > l[best]) best = i;
      return picked = best;
    }
    if (mode == Mode::Script && script_pos < script.size()) {
      const std::string_view rest = std::string_view(script).substr(script_pos);
      int32_t best = -1;
      for (int32_t i : ok) {
        const std::string& b = bytes[static_cast<size_t>(i)];
        if (!tok.is_added(i) && !b.empty() && rest.substr(0, b.size()) == b &&
            (best < 0 || b.size() > bytes[static_cast<size_t>(best)].size()))
          best = i;
      }
      if (best >= 0) {
        script_pos += bytes[static_cast<size_t>(best)].size();
        return picked = best;
      }
      script_pos = script.size();  // blocked: give up the script
    }
    if (mode == Mode::Adversarial && rng() % 10 < 8) {
      std::vector<int32_t> nasty;
      for (int32_t i : ok)
        if (bytes[static_cast<size_t>(i)].find_first_of("<>&\"\\/\n\xEF\xE3") != std::string::npos ||
            tok.is_added(i) || !valid_utf8(bytes[static_cast<size_t>(i)]))  // (partial characters too)
          nasty.push_back(i);
      if (!nasty.empty()) return picked = nasty[rng() % nasty.size()];
    }
    double mx = -1e30;
    for (int32_t i : ok) mx = std::max(mx, static_cast<double>(l[i]));
    std::vector<double> w;
    for (int32_t i : ok) w.push_back(std::exp(static_cast<double>(l[i]) - mx));
    std::discrete_distribution<size_t> d(w.begin(), w.end());
    return picked = ok[d(rng)];
  };
  auto no_pick = [&](const float*, int64_t) -> int32_t {
    ADD_FAILURE() << "pick called on a forced step";
    return 0;
  };
  while (!c.done()) {
    if (static_cast<int>(run.ids.size()) >= max_steps) {
      ADD_FAILURE() << "constraint not done after " << max_steps << " tokens";
      break;
    }
    int32_t t;
    if (static_cast<int>(run.ids.size()) == wrap_after) c.wrap_up();
    if (!c.needs_logits()) {
      t = c.next(nullptr, V, no_pick);
      ++run.forced_steps;
    } else {
      for (auto& x : logits) x = normal(rng);
      picked = -1;
      const auto t0 = std::chrono::steady_clock::now();
      t = c.next(logits.data(), V, [&](const float* l, int64_t n) {
        const auto p0 = std::chrono::steady_clock::now();
        const int32_t r = pick(l, n);
        pick_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - p0).count();
        return r;
      });
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      run.free_ms += ms;
      run.max_ms = std::max(run.max_ms, ms);
      ++run.free_steps;
      EXPECT_EQ(t, picked) << "the constraint replaced an allowed pick";
      EXPECT_GE(finite, 1u);
    }
    EXPECT_GE(t, 0);
    EXPECT_LT(t, static_cast<int32_t>(tok.size()));
    run.ids.push_back(t);
  }
  run.free_ms -= pick_ms;
  return run;
}

std::vector<ToolSpec> tools_of(const std::string& json) { return tools_from_value(pyjson::parse(json)); }

const char* kTools = R"([
 {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
   "parameters": {"type": "object", "properties": {
     "city": {"type": "string", "description": "City name"},
     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
     "days": {"type": "integer"}}, "required": ["city", "unit"]}}},
 {"type": "function", "function": {"name": "calc", "parameters": {"type": "object", "properties": {
     "x": {"type": "number"}, "y": {"type": "number"}, "op": {"enum": ["+", "-", "*", "/"]}},
     "required": ["x", "y", "op"]}}},
 {"type": "function", "function": {"name": "set_flags", "parameters": {"type": "object", "properties": {
     "verbose": {"type": "boolean"}, "dry_run": {"type": "boolean"}, "reset": {"type": "null"}},
     "required": ["verbose", "reset"]}}},
 {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
     "config": {"type": "object", "properties": {
        "name": {"type": "string"}, "retries": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "mode": {"enum": ["fast", "safe", 3, null]}}, "required": ["name", "retries"]}},
     "required": ["config"]}}},
 {"type": "function", "function": {"name": "add_items", "parameters": {"type": "object", "properties": {
     "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "label": {"type": "string"}}, "required": ["id"]}}},
     "required": ["items"]}}},
 {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
 {"type": "function", "function": {"name": "ping", "description": "no parameters at all"}},
 {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {
     "key": {"anyOf": [{"type": "string"}, {"type": "null"}]},
     "count": {"type": ["integer", "string"]},
     "choice": {"enum": [1, "two", true, null]}}, "required": ["key", "count", "choice"]}}},
 {"type": "function", "function": {"name": "store", "parameters": {"type": "object", "properties": {
     "meta": {"type": "object"}, "data": {}}, "required": ["meta", "data"]}}},
 {"type": "function", "function": {"name": "refd", "parameters": {"type": "object",
     "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
     "properties": {"p": {"$ref": "#/$defs/Point"},
                    "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 2}},
     "required": ["p"]}}}
])";

ConstraintLimits small_limits() {
  ConstraintLimits lim;
  lim.max_reasoning_tokens = 10;
  lim.max_string_tokens = 8;
  lim.max_number_chars = 12;
  lim.max_items = 3;
  lim.max_depth = 3;
  return lim;
}

ParserOptions parser_options(const std::vector<ToolSpec>& tools, bool thinking, Profile profile = Profile::V41) {
  ParserOptions o;
  o.profile = profile;
  o.thinking = thinking;
  o.tools_enabled = true;
  o.tools = tools;
  o.make_id = [] { return std::string("call_test"); };
  return o;
}

const ToolSpec* find_tool(const std::vector<ToolSpec>& tools, const std::string& name) {
  for (const auto& t : tools)
    if (t.name == name) return &t;
  return nullptr;
}

// Parses a tool-call completion and checks everything the constraint promises. Returns the call's name.
std::string check_call(const Tokenizer& tok, const Drive& run, const std::vector<ToolSpec>& tools,
                       const std::set<std::string>& allowed_names, bool thinking, bool exact_render,
                       Profile profile = Profile::V41) {
  const std::string text = tok.decode(run.ids);
  SCOPED_TRACE(text);
  const ParseResult r = parse_completion(text, parser_options(tools, thinking, profile));
  EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
  EXPECT_FALSE(r.stream_error) << r.error;
  EXPECT_EQ(r.finish, FinishReason::ToolCalls);
  EXPECT_EQ(r.content, "");
  if (thinking) {
    EXPECT_TRUE(r.reasoning_closed);
    EXPECT_EQ(text, r.reasoning + "</think>" + r.block_text) << "only the reasoning and the block";
  } else {
    EXPECT_FALSE(r.reasoning_started);
    EXPECT_EQ(text, r.block_text);
  }
  if (r.tool_calls.size() != 1) {
    ADD_FAILURE() << "expected exactly one call, got " << r.tool_calls.size();
    return "";
  }
  const ParsedToolCall& call = r.tool_calls[0];
  EXPECT_TRUE(allowed_names.count(call.name)) << call.name;
  const ToolSpec* spec = find_tool(tools, call.name);
  if (!spec) {
    ADD_FAILURE() << "unknown tool " << call.name;
    return call.name;
  }
  pyjson::Value args;
  if (!pyjson::try_parse(call.arguments, args) || !args.is_object()) {
    ADD_FAILURE() << "arguments are not a JSON object: " << call.arguments;
    return call.name;
  }
  const pyjson::Value* params = spec->function.get("parameters");
  if (params) {
    EXPECT_EQ(check(params, args, *params, "$"), "") << call.arguments;
  } else {
    EXPECT_TRUE(args.members.empty()) << call.arguments;
  }
  // The block is byte for byte what the renderer writes for this call (exact numbers only: a float such as
  // 1.50 re-prints as 1.5; free-form objects may repeat keys).
  if (exact_render && !has_float(args)) {
    std::string rendered;
    for (const auto& s : render_tool_calls_block({ToolCall{"call_test", call.name, call.arguments}}, profile))
      rendered += s.text;
    EXPECT_EQ(r.block_text, rendered);
  }
  return call.name;
}

struct ToolCase {
  const char* name;
  bool exact;  // no number / free-form values: the block re-renders byte-identically
};
const ToolCase kCases[] = {{"get_weather", true}, {"calc", false},  {"set_flags", true}, {"configure", true},
                           {"add_items", true},   {"now", true},    {"ping", true},      {"lookup", true},
                           {"store", false},      {"refd", true}};

}  // namespace

TEST(ConstrainTool, NamedToolEverySchema) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  double ms = 0;
  int free_steps = 0;
  uint64_t seed = 1;
  for (const ToolCase& tc : kCases)
    for (bool thinking : {false, true})
      for (Mode mode : {Mode::Greedy, Mode::Random, Mode::Adversarial}) {
        SCOPED_TRACE(std::string(tc.name) + (thinking ? " thinking " : " chat ") + mode_name(mode));
        auto c = server::tool_call_constraint(*tok, tools, tc.name, Profile::V41, thinking, small_limits());
        const Drive run = drive(*c, *tok, seed++, mode);
        EXPECT_EQ(check_call(*tok, run, tools, {tc.name}, thinking, tc.exact), tc.name);
        ms += run.free_ms;
        free_steps += run.free_steps;
      }
  std::printf("[constrain] %d free steps, %.2f ms per step\n", free_steps, free_steps ? ms / free_steps : 0.0);
}

TEST(ConstrainTool, RequiredPicksAmongTheTools) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto all = tools_of(kTools);
  std::set<std::string> names, seen;
  for (const auto& t : all) names.insert(t.name);
  for (uint64_t seed = 100; seed < 116; ++seed) {
    const bool thinking = seed % 2 == 0;
    const Mode mode = seed % 3 == 0 ? Mode::Adversarial : Mode::Random;
    auto c = server::tool_call_constraint(*tok, all, "required", Profile::V41, thinking, small_limits());
    const Drive run = drive(*c, *tok, seed, mode);
    const std::string name = check_call(*tok, run, all, names, thinking, false);
    seen.insert(name);
  }
  EXPECT_GE(seen.size(), 3u) << "the tool name is a real choice";
}

TEST(ConstrainTool, DefaultLimitsAndLongStrings) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  // Default limits: a random model rarely closes a string itself, so strings run to max_string_tokens.
  auto c = server::tool_call_constraint(*tok, tools, "get_weather", Profile::V41, false);
  const Drive run = drive(*c, *tok, 7, Mode::Random);
  check_call(*tok, run, tools, {"get_weather"}, false, true);
  EXPECT_GT(run.ids.size(), 256u);
  EXPECT_LT(run.ids.size(), 2 * 256u + 64u);
  std::printf("[constrain] default limits: %zu tokens, %.2f ms per free step, slowest step %.2f ms (with pick)\n",
              run.ids.size(), run.free_ms / std::max(1, run.free_steps), run.max_ms);
}

// Wrap-up (the scheduler's output budget nearly spent): the open reasoning and strings close at once, so a
// random model that would write 256-token strings finishes the call within a few dozen tokens, still valid.
TEST(ConstrainTool, WrapUpFinishesTheCallSoon) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  for (const ToolCase& tc : kCases) {
    for (int wrap_after : {0, 5, 40}) {
      SCOPED_TRACE(std::string(tc.name) + " wrap after " + std::to_string(wrap_after));
      auto c = server::tool_call_constraint(*tok, tools, tc.name, Profile::V41, true);
      const Drive run = drive(*c, *tok, 11 + static_cast<uint64_t>(wrap_after), Mode::Random, 20000, "", wrap_after);
      check_call(*tok, run, tools, {tc.name}, true, tc.exact);
      // what is left after the wrap-up: the reasoning's closer, the call's fixed text, required values
      // (strings closed at once, numbers, enums, items up to the limits) and optional ones the model picks
      EXPECT_LT(run.ids.size(), static_cast<size_t>(wrap_after) + 160) << tok->decode(run.ids);
    }
  }
  // the lazy grammar: a wrap-up before the trigger holds for the block opened later
  for (uint64_t seed = 0; seed < 4; ++seed) {
    auto c = server::lazy_tool_constraint(*tok, tools, Profile::V41, false);
    ASSERT_TRUE(c);
    c->wrap_up();
    const std::vector<int32_t> lt = tok->encode("<", false);
    ASSERT_EQ(lt.size(), 1u);
    c->observe(lt[0]);
    c->observe(*tok->token_to_id("｜DSML｜"));
    ASSERT_FALSE(c->passive());
    const Drive run = drive(*c, *tok, 70 + seed, Mode::Random);
    EXPECT_LT(run.ids.size(), 400u) << tok->decode(run.ids);
    std::vector<int32_t> all = {lt[0], *tok->token_to_id("｜DSML｜")};
    all.insert(all.end(), run.ids.begin(), run.ids.end());
    const std::string text = tok->decode(all);
    const ParseResult r = parse_completion(text, parser_options(tools, false));
    EXPECT_FALSE(r.stream_error) << r.error << "\n" << text;
    EXPECT_EQ(r.finish, FinishReason::ToolCalls) << text;
    ASSERT_GE(r.tool_calls.size(), 1u) << text;
    for (const auto& call : r.tool_calls) {
      const ToolSpec* spec = find_tool(tools, call.name);
      ASSERT_TRUE(spec) << call.name;
      pyjson::Value args;
      ASSERT_TRUE(pyjson::try_parse(call.arguments, args)) << call.arguments;
      if (const pyjson::Value* params = spec->function.get("parameters"))
        EXPECT_EQ(check(params, args, *params, "$"), "") << call.arguments;
    }
  }
}

TEST(ConstrainTool, StringLimitAndReasoningLimit) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  for (int cap : {0, 1, 3}) {
    ConstraintLimits lim = small_limits();
    lim.max_string_tokens = cap;
    lim.max_reasoning_tokens = cap;
    for (uint64_t seed = 0; seed < 3; ++seed) {
      auto c = server::tool_call_constraint(*tok, tools, "get_weather", Profile::V41, true, lim);
      const Drive run = drive(*c, *tok, 40 + seed, Mode::Adversarial);
      check_call(*tok, run, tools, {"get_weather"}, true, true);
      // reasoning: at most `cap` tokens before </think> (plus tokens completing a character)
      const int32_t think_end = *tok->token_to_id("</think>");
      size_t k = 0;
      while (k < run.ids.size() && run.ids[k] != think_end) ++k;
      ASSERT_LT(k, run.ids.size());
      EXPECT_LE(k, static_cast<size_t>(cap) + 3);
      // the city string: at most `cap` tokens (+ character completion) between its header and its closer
      const std::string text = tok->decode(run.ids);
      const ParseResult r = parse_completion(text, parser_options(tools, true));
      ASSERT_EQ(r.tool_calls.size(), 1u);
      const pyjson::Value args = pyjson::parse(r.tool_calls[0].arguments);
      const std::string city = args.get("city")->text;
      const std::string head = "<｜DSML｜ parameter name=\"city\" string=\"true\">";
      const size_t start = text.find(head) + head.size();
      ASSERT_NE(text.find(head), std::string::npos);
      EXPECT_EQ(text.substr(start, city.size()), city);
      size_t at = 0, inside = 0;
      for (int32_t id : run.ids) {
        const size_t n = tok->decode_one(id).size();
        if (at < start + city.size() && at + n > start) ++inside;
        at += n;
      }
      EXPECT_LE(inside, static_cast<size_t>(cap) + 3) << city;
      if (cap == 0) {
        EXPECT_EQ(city, "");
        EXPECT_EQ(r.reasoning, "");
      }
    }
  }
}

TEST(ConstrainTool, ForcedStepsAreTheRenderersTokens) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  // A named tool without parameters is fully determined: every step is forced, and the tokens are those of
  // encode(canonical block, true) — the DSML markers as single added tokens.
  for (const char* name : {"now", "ping"}) {
    auto c = server::tool_call_constraint(*tok, tools, name, Profile::V41, false);
    EXPECT_FALSE(c->needs_logits());
    const Drive run = drive(*c, *tok, 1, Mode::Greedy);
    EXPECT_EQ(run.free_steps, 0);
    std::string block;
    for (const auto& s : render_tool_calls_block({ToolCall{"x", name, "{}"}}, Profile::V41)) block += s.text;
    EXPECT_EQ(block, std::string("\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"") + name +
                         "\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
    EXPECT_EQ(run.ids, tok->encode(block, true));
    EXPECT_EQ(tok->decode(run.ids), block);
  }
  // With thinking the first step is free (reasoning), and the </think> token is forced at the limit.
  ConstraintLimits lim;
  lim.max_reasoning_tokens = 2;
  auto c = server::tool_call_constraint(*tok, tools, "now", Profile::V41, true, lim);
  EXPECT_TRUE(c->needs_logits());
  const Drive run = drive(*c, *tok, 3, Mode::Random);
  check_call(*tok, run, tools, {"now"}, true, true);
  EXPECT_LE(run.free_steps, 3);
}

TEST(ConstrainTool, V4Profile) {
  NEED_TOKENIZER(tok, "tokenizer-v4.json");
  const auto tools = tools_of(kTools);
  for (const char* name : {"get_weather", "configure", "lookup"}) {
    auto c = server::tool_call_constraint(*tok, tools, name, Profile::V4, true, small_limits());
    const Drive run = drive(*c, *tok, 11, Mode::Adversarial);
    check_call(*tok, run, tools, {name}, true, true, Profile::V4);
    EXPECT_NE(tok->decode(run.ids).find("<｜DSML｜tool_calls>"), std::string::npos);
  }
}

TEST(ConstrainTool, Errors) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  EXPECT_THROW(server::tool_call_constraint(*tok, tools, "nope", Profile::V41, false), dsx::Error);
  EXPECT_THROW(server::tool_call_constraint(*tok, tools, "auto", Profile::V41, false), dsx::Error);
  EXPECT_THROW(server::tool_call_constraint(*tok, {}, "required", Profile::V41, false), dsx::Error);
  const auto bad = tools_of(R"([{"type": "function", "function": {"name": "q", "parameters": {"type": "object",
      "properties": {"a\"b": {"type": "string"}}}}}])");
  EXPECT_THROW(server::tool_call_constraint(*tok, bad, "q", Profile::V41, false), dsx::Error);
  auto c = server::tool_call_constraint(*tok, tools, "now", Profile::V41, false);
  drive(*c, *tok, 1, Mode::Greedy);
  ASSERT_TRUE(c->done());
  EXPECT_THROW(c->next(nullptr, 10, [](const float*, int64_t) { return 0; }), dsx::Error);
}

namespace {

// Drives a json constraint and returns the parsed content (after checking the completion's shape).
pyjson::Value json_content(const Tokenizer& tok, const Drive& run, bool thinking) {
  const int32_t eos = *tok.token_to_id("<｜end▁of▁sentence｜>");
  EXPECT_FALSE(run.ids.empty());
  if (run.ids.empty()) return {};
  EXPECT_EQ(run.ids.back(), eos) << "the completion ends with EOS";
  std::vector<int32_t> body(run.ids.begin(), run.ids.end() - 1);  // the scheduler stops at EOS
  for (int32_t t : body) EXPECT_NE(t, eos);
  const std::string text = tok.decode(body);
  SCOPED_TRACE(text);
  ParserOptions o;
  o.thinking = thinking;
  const ParseResult r = parse_completion(text, o);
  EXPECT_EQ(r.finish, FinishReason::Stop);
  EXPECT_TRUE(r.tool_calls.empty());
  if (thinking) EXPECT_TRUE(r.reasoning_closed);
  pyjson::Value v;
  pyjson::ParseOptions strict;
  strict.allow_nan = false;
  EXPECT_TRUE(pyjson::try_parse(r.content, v, strict)) << "content is not JSON: " << r.content;
  return v;
}

}  // namespace

TEST(ConstrainJson, Schemas) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const char* schemas[] = {
      R"({"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"},
          "sources": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
          "verdict": {"enum": ["yes", "no", "unsure"]}, "extra": {"type": ["integer", "null"]}},
          "required": ["answer", "confidence", "verdict"], "additionalProperties": false})",
      R"({"type": "array", "items": {"type": "object", "properties": {"n": {"type": "integer"},
          "ok": {"type": "boolean"}}, "required": ["n", "ok"]}, "minItems": 2, "maxItems": 3})",
      R"({"type": "integer"})",
      R"({"type": "string"})",
      R"({"enum": ["red", "green", 7, false]})",
      R"({"$defs": {"Node": {"type": "object", "properties": {"v": {"type": "integer"},
          "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2}}, "required": ["v"]}},
          "$ref": "#/$defs/Node"})",
      R"({"type": "object", "properties": {"nested": {"type": "object", "properties": {"deep": {"type": "object",
          "properties": {"x": {"type": "null"}}, "required": ["x"]}}, "required": ["deep"]}}, "required": ["nested"]})",
      R"({})",
  };
  uint64_t seed = 500;
  for (const char* s : schemas)
    for (bool thinking : {false, true})
      for (Mode mode : {Mode::Random, Mode::Adversarial}) {
        SCOPED_TRACE(std::string(s) + (thinking ? " thinking " : " chat ") + mode_name(mode));
        const pyjson::Value schema = pyjson::parse(s);
        pyjson::Value rf = pyjson::Value::object();
        rf.members.emplace_back("type", pyjson::Value::string("json_schema"));
        pyjson::Value js = pyjson::Value::object();
        js.members.emplace_back("name", pyjson::Value::string("out"));
        js.members.emplace_back("schema", schema);
        rf.members.emplace_back("json_schema", js);
        auto c = server::json_constraint(*tok, rf, thinking, small_limits());
        const Drive run = drive(*c, *tok, seed++, mode);
        const pyjson::Value v = json_content(*tok, run, thinking);
        EXPECT_EQ(check(&schema, v, schema, "$"), "") << pyjson::dumps(v);
      }
}

TEST(ConstrainJson, JsonObjectAndResponsesShape) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  for (uint64_t seed = 0; seed < 6; ++seed) {
    const pyjson::Value rf = pyjson::parse(R"({"type": "json_object"})");
    auto c = server::json_constraint(*tok, rf, seed % 2 == 1, small_limits());
    const Drive run = drive(*c, *tok, 900 + seed, seed % 3 == 0 ? Mode::Adversarial : Mode::Random);
    const pyjson::Value v = json_content(*tok, run, seed % 2 == 1);
    EXPECT_TRUE(v.is_object()) << pyjson::dumps(v);
  }
  // Responses text.format: {type: json_schema, name, schema}
  const pyjson::Value rf = pyjson::parse(
      R"({"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {"k": {"type": "boolean"}},
          "required": ["k"]}})");
  auto c = server::json_constraint(*tok, rf, false, small_limits());
  const Drive run = drive(*c, *tok, 77, Mode::Random);
  const pyjson::Value v = json_content(*tok, run, false);
  ASSERT_TRUE(v.is_object());
  ASSERT_NE(v.get("k"), nullptr);
  EXPECT_EQ(v.get("k")->type, pyjson::Type::Bool);
  EXPECT_EQ(v.members.size(), 1u);
  // The structure is forced: '{"k": ' comes without logits, then one free choice between true and false.
  EXPECT_EQ(run.free_steps, 1);
}

TEST(ConstrainJson, Errors) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  EXPECT_THROW(server::json_constraint(*tok, pyjson::parse(R"({"type": "text"})"), false), dsx::Error);
  EXPECT_THROW(server::json_constraint(*tok, pyjson::parse(R"({})"), false), dsx::Error);
  EXPECT_THROW(server::json_constraint(*tok, pyjson::parse(R"({"type": "json_schema", "json_schema": {"schema": 3}})"), false),
               dsx::Error);
}

TEST(ConstrainTool, HostileTextCannotCloseEarly) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  const std::string closer = "</｜DSML｜ parameter>";
  struct Case {
    std::string script;
    std::string kept;  // what the model gets to write (the last byte of the forbidden sequence is refused)
  } cases[] = {{"a" + closer + "b", "a" + closer.substr(0, closer.size() - 1)},
               {"&lt;" + closer.substr(1) + "c", "&lt;" + closer.substr(1, closer.size() - 2)},
               {"x</x</" + closer, "x</x</" + closer.substr(0, closer.size() - 1)}};
  for (const Case& cs : cases) {
    SCOPED_TRACE(cs.script);
    ConstraintLimits lim = small_limits();
    lim.max_string_tokens = 40;
    auto c = server::tool_call_constraint(*tok, tools, "get_weather", Profile::V41, false, lim);
    const Drive run = drive(*c, *tok, 5, Mode::Script, 20000, cs.script);
    check_call(*tok, run, tools, {"get_weather"}, false, true);
    const ParseResult r = parse_completion(tok->decode(run.ids), parser_options(tools, false));
    ASSERT_EQ(r.tool_calls.size(), 1u);
    const std::string city = pyjson::parse(r.tool_calls[0].arguments).get("city")->text;
    EXPECT_EQ(city.rfind(cs.kept, 0), 0u) << city;
    EXPECT_EQ(city.find(closer), std::string::npos) << city;
  }
  // reasoning that spells </think> in plain tokens
  {
    ConstraintLimits lim = small_limits();
    lim.max_reasoning_tokens = 30;
    auto c = server::tool_call_constraint(*tok, tools, "now", Profile::V41, true, lim);
    const Drive run = drive(*c, *tok, 6, Mode::Script, 20000, "x</think>y");
    check_call(*tok, run, tools, {"now"}, true, true);
    const ParseResult r = parse_completion(tok->decode(run.ids), parser_options(tools, true));
    EXPECT_EQ(r.reasoning.rfind("x</think", 0), 0u) << r.reasoning;
    EXPECT_EQ(r.reasoning.find("</think>"), std::string::npos) << r.reasoning;
  }
}

TEST(ConstrainJson, HostileTextCannotEndTheContent) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const pyjson::Value rf = pyjson::parse(
      R"({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"k": {"type": "string"}},
          "required": ["k"]}}})");
  ConstraintLimits lim = small_limits();
  lim.max_string_tokens = 40;
  auto c = server::json_constraint(*tok, rf, false, lim);
  // after the forced '{"k": "', the model tries to write the EOS text, a raw newline and a bad escape
  const std::string eos = "<｜end▁of▁sentence｜>";
  const Drive run = drive(*c, *tok, 8, Mode::Script, 20000, "q" + eos + "\n\\x\"}");
  const pyjson::Value v = json_content(*tok, run, false);
  ASSERT_TRUE(v.is_object());
  ASSERT_NE(v.get("k"), nullptr);
  const std::string k = v.get("k")->text;
  EXPECT_EQ(k.rfind("q" + eos.substr(0, eos.size() - 1), 0), 0u) << k;
  EXPECT_EQ(k.find(eos), std::string::npos);
}

namespace {

// Runs forced steps until the constraint needs logits; returns their tokens.
std::vector<int32_t> run_forced(Constraint& c) {
  std::vector<int32_t> ids;
  while (!c.done() && !c.needs_logits())
    ids.push_back(c.next(nullptr, 0, [](const float*, int64_t) -> int32_t {
      ADD_FAILURE() << "pick on a forced step";
      return 0;
    }));
  return ids;
}

// One free step that picks `want`; returns the set of allowed tokens of that step.
std::set<int32_t> free_step(Constraint& c, const Tokenizer& tok, int32_t want) {
  std::vector<float> logits(tok.size(), 0.0f);
  std::set<int32_t> allowed;
  const int32_t got = c.next(logits.data(), static_cast<int64_t>(logits.size()), [&](const float* l, int64_t n) {
    for (int64_t i = 0; i < n; ++i)
      if (std::isfinite(l[i])) allowed.insert(static_cast<int32_t>(i));
    return want;
  });
  EXPECT_TRUE(allowed.count(want)) << "token " << want << " (" << tok.decode_one(want) << ") not allowed";
  if (allowed.count(want)) EXPECT_EQ(got, want);
  return allowed;
}

int32_t byte_token(const Tokenizer& tok, unsigned char b) {
  const auto ids = tok.encode(std::string(1, static_cast<char>(b)), false);
  EXPECT_EQ(ids.size(), 1u);
  return ids.at(0);
}

}  // namespace

TEST(ConstrainTool, MaskInsideAStringValue) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  const int32_t dsml = *tok->token_to_id("｜DSML｜"), lt_slash = tok->encode("</", false).at(0);
  ConstraintLimits lim;
  lim.max_string_tokens = 8;
  auto c = server::tool_call_constraint(*tok, tools, "get_weather", Profile::V41, false, lim);
  std::vector<int32_t> ids = run_forced(*c);
  EXPECT_EQ(tok->decode(ids), "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"get_weather\">\n<｜DSML｜ parameter "
                              "name=\"city\" string=\"true\">");
  // (free_step returns what was allowed at the step that picks its token)
  // plain text: most of the vocabulary, never an added token
  std::set<int32_t> a = free_step(*c, *tok, byte_token(*tok, 0xE4));  // first byte of "中"
  EXPECT_GT(a.size(), 100000u);
  for (int32_t t : a) EXPECT_FALSE(tok->is_added(t)) << t;
  // inside a character only continuation bytes may follow
  a = free_step(*c, *tok, byte_token(*tok, 0xB8));
  for (int32_t t : a) {
    const unsigned char b0 = static_cast<unsigned char>(tok->decode_one(t)[0]);
    EXPECT_TRUE(b0 >= 0x80 && b0 <= 0xBF) << t;
  }
  EXPECT_FALSE(a.count(lt_slash));
  free_step(*c, *tok, byte_token(*tok, 0xAD));
  a = free_step(*c, *tok, lt_slash);  // after "中": text only
  EXPECT_FALSE(a.count(dsml));
  a = free_step(*c, *tok, byte_token(*tok, 'x'));  // after "中</": text, or the closer's marker
  EXPECT_TRUE(a.count(dsml));
  EXPECT_GT(a.size(), 100000u);
  a = free_step(*c, *tok, lt_slash);  // after "中</x": that "</" was text
  EXPECT_FALSE(a.count(dsml));
  a = free_step(*c, *tok, dsml);  // after "中</x</": the marker closes the value
  EXPECT_TRUE(a.count(lt_slash));
  // the rest of the closer, then the next parameter: "unit" (required) is forced
  ids = run_forced(*c);
  EXPECT_EQ(tok->decode(ids), " parameter>\n<｜DSML｜ parameter name=\"unit\" string=\"true\">");  // (both enum values are strings)
}

TEST(ConstrainTool, StringLimitForcesTheCloser) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  ConstraintLimits lim;
  lim.max_string_tokens = 2;
  auto c = server::tool_call_constraint(*tok, tools, "get_weather", Profile::V41, false, lim);
  run_forced(*c);
  free_step(*c, *tok, byte_token(*tok, 'a'));
  free_step(*c, *tok, byte_token(*tok, 0xE4));  // the limit is reached inside a character
  std::set<int32_t> a = free_step(*c, *tok, byte_token(*tok, 0xB8));
  for (int32_t t : a) {
    const std::string b = tok->decode_one(t);
    EXPECT_TRUE(static_cast<unsigned char>(b[0]) >= 0x80 && static_cast<unsigned char>(b[0]) <= 0xBF) << t;
  }
  free_step(*c, *tok, byte_token(*tok, 0xAD));
  EXPECT_FALSE(c->needs_logits()) << "the closer is forced";
  const std::vector<int32_t> ids = run_forced(*c);
  EXPECT_EQ(tok->decode(ids), "</｜DSML｜ parameter>\n<｜DSML｜ parameter name=\"unit\" string=\"true\">");  // (both enum values are strings)
}

TEST(ConstrainTool, ReasoningMask) {
  NEED_TOKENIZER(tok, "tokenizer-v41.json");
  const auto tools = tools_of(kTools);
  const int32_t think_end = *tok->token_to_id("</think>"), eos = *tok->token_to_id("<｜end▁of▁sentence｜>");
  auto c = server::tool_call_constraint(*tok, tools, "now", Profile::V41, true);
  EXPECT_TRUE(run_forced(*c).empty());
  std::set<int32_t> a = free_step(*c, *tok, byte_token(*tok, 0xE4));
  EXPECT_TRUE(a.count(think_end));
  EXPECT_FALSE(a.count(eos));
  EXPECT_FALSE(a.count(*tok->token_to_id("｜DSML｜")));
  a = free_step(*c, *tok, byte_token(*tok, 0xB8));
  EXPECT_FALSE(a.count(think_end)) << "</think> inside a character";
  a = free_step(*c, *tok, byte_token(*tok, 0xAD));
  EXPECT_FALSE(a.count(think_end));
  a = free_step(*c, *tok, think_end);
  const std::vector<int32_t> ids = run_forced(*c);
  EXPECT_TRUE(c->done());
  EXPECT_EQ(tok->decode(ids), "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"now\">\n\n</｜DSML｜ invoke>\n</｜DSML｜ calls>");
}
