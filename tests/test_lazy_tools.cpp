// The lazy tool grammar (server/constrain.h, lazy_tool_constraint): tool_choice "auto" decodes freely until
// the model opens a DSML tool-call block, then every call names a request tool with schema-valid arguments.
//   - golden V4.1 tokenizer, random / adversarial logits after a scripted trigger: the completion parses
//     (text/dsml.h) into calls whose names are tools and whose arguments pass an independent schema checker;
//     before the trigger the logits reach the pick function unmodified; a closer "</｜DSML｜" or a marker in the
//     reasoning is no trigger;
//   - lossless: a canonically rendered call (arguments in any order, several invokes) is accepted token for
//     token after the trigger, and every reference completion of the held-out agent prompts
//     (train/out/data/agent_eval.jsonl) likewise;
//   - the trained model assets/dsx-small-v41 (CPU, greedy): every held-out completion with a call validates;
//     a completion without a call is byte-identical with and without the constraint.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "runtime/engine.h"
#include "server/constrain.h"
#include "test_util.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "text/tokenizer.h"

using namespace dsx;
using namespace dsx::text;
using dsx::server::Constraint;
using dsx::server::lazy_tool_constraint;
using namespace dsx::text::tok;

namespace {

// ---- an independent JSON-schema checker (the subset the tool schemas here use) ---------------------------
bool same(const pyjson::Value& a, const pyjson::Value& b) { return pyjson::dumps(a) == pyjson::dumps(b); }

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

// Empty: valid; else the first problem.
std::string check(const pyjson::Value* s, const pyjson::Value& v, const std::string& at) {
  if (!s || !s->is_object()) return "";
  if (const auto* c = s->get("const"); c && !same(*c, v)) return at + ": not the const";
  if (const auto* e = s->get("enum")) {
    bool hit = false;
    for (const auto& x : e->items) hit = hit || same(x, v);
    if (!hit) return at + ": not in the enum";
  }
  for (const char* k : {"anyOf", "oneOf"})
    if (const auto* alts = s->get(k)) {
      bool hit = false;
      for (const auto& a : alts->items) hit = hit || check(&a, v, at).empty();
      if (!hit) return at + ": matches no alternative";
    }
  if (const auto* t = s->get("type")) {
    bool hit = t->is_string() && type_ok(t->text, v);
    for (const auto& x : t->items) hit = hit || type_ok(x.text, v);
    if (!hit) return at + ": wrong type for " + pyjson::dumps(v);
  }
  if (v.is_object()) {
    const auto* props = s->get("properties");
    if (const auto* req = s->get("required"))
      for (const auto& r : req->items)
        if (!v.get(r.text)) return at + ": missing required '" + r.text + "'";
    const auto* ap = s->get("additionalProperties");
    for (const auto& [k, x] : v.members) {
      const pyjson::Value* ps = props ? props->get(k) : nullptr;
      if (!ps && ap && ap->type == pyjson::Type::Bool && !ap->boolean) return at + ": unexpected key '" + k + "'";
      if (ps)
        if (std::string e = check(ps, x, at + "." + k); !e.empty()) return e;
    }
  }
  if (v.is_array()) {
    if (const auto* mn = s->get("minItems"); mn && v.items.size() < std::stoul(mn->text)) return at + ": too few items";
    if (const auto* mx = s->get("maxItems"); mx && v.items.size() > std::stoul(mx->text)) return at + ": too many";
    if (const auto* it = s->get("items"))
      for (size_t i = 0; i < v.items.size(); ++i)
        if (std::string e = check(it, v.items[i], at + "[" + std::to_string(i) + "]"); !e.empty()) return e;
  }
  return "";
}

// Every parsed call names one of the tools and its arguments validate; "" when so.
std::string check_calls(const ParseResult& r, const std::vector<ToolSpec>& tools) {
  if (r.stream_error) return "stream error: " + r.error;
  for (const auto& c : r.tool_calls) {
    const ToolSpec* spec = nullptr;
    for (const auto& t : tools)
      if (t.name == c.name) spec = &t;
    if (!spec) return "unknown tool '" + c.name + "'";
    pyjson::Value args;
    if (!pyjson::try_parse(c.arguments, args) || !args.is_object()) return c.name + ": arguments not an object";
    const pyjson::Value* params = spec->function.get("parameters");
    if (params)
      if (std::string e = check(params, args, c.name); !e.empty()) return e;
    if (!params && !args.members.empty()) return c.name + ": arguments for a tool without parameters";
  }
  return "";
}

const Tokenizer* golden_tokenizer() {
  static std::unique_ptr<Tokenizer> t = [] {
    const std::string p = dsx_test::golden_dir() + "/tokenizer/tokenizer-v41.json";
    return std::filesystem::exists(p) ? std::make_unique<Tokenizer>(Tokenizer::from_file(p)) : nullptr;
  }();
  return t.get();
}

const char* kTools = R"([
 {"type": "function", "function": {"name": "ReadFile", "parameters": {"type": "object", "properties": {
     "filepath": {"type": "string"}, "start_line": {"type": "integer"}, "limit": {"type": "integer"}},
     "required": ["filepath"]}}},
 {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
     "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
     "days": {"type": "integer"}}, "required": ["city", "unit"]}}},
 {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
     "config": {"type": "object", "properties": {"name": {"type": "string"}, "retries": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "retries"]},
     "verbose": {"type": "boolean"}, "key": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
     "required": ["config"]}}},
 {"type": "function", "function": {"name": "ping"}}
])";

std::vector<ToolSpec> tools() { return tools_from_value(pyjson::parse(kTools)); }

ParserOptions popts(const std::vector<ToolSpec>& t, bool thinking) {
  ParserOptions o;
  o.thinking = thinking;
  o.tools_enabled = true;
  o.tools = t;
  o.make_id = [] { return std::string("call_x"); };
  return o;
}

std::vector<int32_t> plain(const Tokenizer& tok, const std::string& s) { return tok.encode(s, false); }
int32_t added(const Tokenizer& tok, const char* s) {
  const auto ids = tok.encode(s, true);
  EXPECT_EQ(ids.size(), 1u);
  return ids[0];
}

// Drives c: first the `script` tokens (each must be allowed), then random picks (adversarial: mostly the
// tokens with structural characters) until done() or `max_steps`. Returns the ids.
std::vector<int32_t> drive(Constraint& c, const Tokenizer& tok, const std::vector<int32_t>& script, uint64_t seed,
                           bool adversarial, int max_steps = 3000) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  const int64_t V = static_cast<int64_t>(tok.size()) + 100;
  std::vector<float> logits(static_cast<size_t>(V));
  std::vector<int32_t> out;
  static std::vector<std::string> bytes;  // (one tokenizer in these tests)
  if (bytes.size() != tok.size()) {
    bytes.assign(tok.size(), "");
    for (size_t i = 0; i < tok.size(); ++i) try {
        bytes[i] = tok.decode_one(static_cast<int32_t>(i));
      } catch (const std::exception&) {
      }
  }
  while (!c.done() && static_cast<int>(out.size()) < max_steps) {
    int32_t t;
    if (!c.needs_logits()) {
      t = c.next(nullptr, V, [](const float*, int64_t) { return 0; });
      if (out.size() < script.size()) EXPECT_EQ(t, script[out.size()]) << "forced step at " << out.size();
    } else {
      for (auto& x : logits) x = normal(rng);
      const bool passive = c.passive();
      int32_t want = -1;
      t = c.next(logits.data(), V, [&](const float* l, int64_t n) -> int32_t {
        std::vector<int32_t> ok;
        for (int64_t i = 0; i < std::min<int64_t>(n, static_cast<int64_t>(tok.size())); ++i)
          if (std::isfinite(l[i])) ok.push_back(static_cast<int32_t>(i));
        if (passive) EXPECT_EQ(ok.size(), tok.size()) << "a passive step masked logits";
        if (out.size() < script.size()) {
          want = script[out.size()];
          EXPECT_TRUE(std::isfinite(l[want])) << "script token " << want << " disallowed at " << out.size();
          return want;
        }
        if (ok.empty()) return 0;
        if (adversarial && rng() % 10 < 7) {
          std::vector<int32_t> nasty;
          for (int32_t i : ok)
            if (bytes[static_cast<size_t>(i)].find_first_of("<>&\"\\/\n") != std::string::npos || tok.is_added(i))
              nasty.push_back(i);
          if (!nasty.empty()) return nasty[rng() % nasty.size()];
        }
        return ok[rng() % ok.size()];
      });
      if (want >= 0) EXPECT_EQ(t, want);
    }
    out.push_back(t);
    if (t == added(tok, kEos)) break;
  }
  return out;
}

TEST(LazyTools, CallsAfterTheTriggerValidate) {
  const Tokenizer* tok = golden_tokenizer();
  if (!tok) GTEST_SKIP() << "golden tokenizer not found";
  const auto ts = tools();
  const int32_t dsml = added(*tok, kDsml), think_end = added(*tok, kThinkEnd);
  int with_calls = 0;
  for (bool thinking : {false, true})
    for (uint64_t seed = 1; seed <= 12; ++seed) {
      std::vector<int32_t> script;
      if (thinking) {
        script = plain(*tok, "I should read <the file");
        script.push_back(dsml);  // (inside the reasoning: no trigger)
        script.push_back(think_end);
      }
      for (int32_t id : plain(*tok, "Let me look.\n\n<")) script.push_back(id);
      script.push_back(dsml);
      dsx::server::ConstraintLimits lim;  // (short strings and arrays: quick random runs)
      lim.max_string_tokens = 6;
      lim.max_items = 3;
      auto c = lazy_tool_constraint(*tok, ts, Profile::V41, thinking, lim);
      ASSERT_TRUE(c);
      const auto ids = drive(*c, *tok, script, seed, seed % 2 == 0);
      ASSERT_TRUE(c->done()) << "not done after " << ids.size() << " tokens";
      const std::string text = tok->decode(ids);
      SCOPED_TRACE(text);
      const ParseResult r = parse_completion(text, popts(ts, thinking));
      EXPECT_EQ(r.finish, FinishReason::ToolCalls);
      EXPECT_TRUE(r.warnings.empty()) << r.warnings.front();
      EXPECT_EQ(r.content, "Let me look.");
      EXPECT_GE(r.tool_calls.size(), 1u);
      EXPECT_EQ(check_calls(r, ts), "");
      with_calls += !r.tool_calls.empty();
    }
  EXPECT_EQ(with_calls, 24);
}

TEST(LazyTools, PassiveWithoutTheTrigger) {
  const Tokenizer* tok = golden_tokenizer();
  if (!tok) GTEST_SKIP() << "golden tokenizer not found";
  const auto ts = tools();
  const int32_t dsml = added(*tok, kDsml);
  // a closer, a bare marker, "<" then other text: never the trigger
  std::vector<int32_t> s = plain(*tok, "text </");
  s.push_back(dsml);
  for (int32_t id : plain(*tok, " calls> and ")) s.push_back(id);
  s.push_back(dsml);
  for (int32_t id : plain(*tok, " <b>")) s.push_back(id);
  auto c = lazy_tool_constraint(*tok, ts, Profile::V41, false);
  for (int32_t id : s) {
    ASSERT_TRUE(c->passive());
    c->observe(id);
  }
  EXPECT_TRUE(c->passive());
  EXPECT_FALSE(c->done());
  c->observe(plain(*tok, "<")[0]);
  c->observe(dsml);
  EXPECT_FALSE(c->passive());
  // no tool can be written: no constraint
  EXPECT_EQ(lazy_tool_constraint(*tok, {}, Profile::V41, false), nullptr);
}

// Feeds `ids` (a completion) to a fresh constraint: passive tokens are observed, every later token must be the
// forced one or allowed by the mask. Returns "" or where it failed.
std::string accepts(const Tokenizer& tok, const std::vector<ToolSpec>& ts, bool thinking,
                    const std::vector<int32_t>& ids) {
  auto c = lazy_tool_constraint(tok, ts, Profile::V41, thinking);
  if (!c) return "no constraint";
  const int64_t V = static_cast<int64_t>(tok.size());
  std::vector<float> logits(static_cast<size_t>(V));
  for (size_t i = 0; i < ids.size(); ++i) {
    if (c->done()) return i + 1 == ids.size() && ids[i] == tok.encode(kEos, true)[0] ? "" : "done early at " + std::to_string(i);
    if (c->passive()) {
      c->observe(ids[i]);
      continue;
    }
    if (!c->needs_logits()) {
      const int32_t t = c->next(nullptr, V, [](const float*, int64_t) { return 0; });
      if (t != ids[i]) return "forced " + std::to_string(t) + " instead of " + std::to_string(ids[i]) + " at " + std::to_string(i);
      continue;
    }
    std::fill(logits.begin(), logits.end(), 0.0f);
    bool allowed = false;
    const int32_t t = c->next(logits.data(), V, [&](const float* l, int64_t) {
      allowed = std::isfinite(l[ids[i]]);
      return ids[i];
    });
    if (!allowed || t != ids[i])
      return "token " + std::to_string(ids[i]) + " '" + tok.decode_one(ids[i]) + "' disallowed at " + std::to_string(i);
  }
  return c->done() ? "" : "not done at the end";
}

TEST(LazyTools, RenderedCallsPassUnchanged) {
  const Tokenizer* tok = golden_tokenizer();
  if (!tok) GTEST_SKIP() << "golden tokenizer not found";
  const auto ts = tools();
  const std::vector<std::vector<ToolCall>> cases = {
      {{"c1", "ReadFile", R"({"limit": 20, "filepath": "src/a.py", "start_line": 3})"}},  // not schema order
      {{"c1", "get_weather", R"({"unit": "celsius", "city": "Paris"})"},
       {"c2", "ping", "{}"},
       {"c3", "configure", R"({"key": null, "config": {"name": "x", "retries": 2, "tags": ["a", "b"]}})"}},
      {{"c1", "configure", R"({"verbose": true, "config": {"name": "<｜DSML｜ quote \"&lt;", "retries": -4}})"}},
  };
  for (bool thinking : {false, true})
    for (const auto& calls : cases) {
      std::string text = thinking ? "plan <｜DSML｜ it</think>" : "";
      text += "Reading.";
      auto ids = tok->encode(text, true);
      // (as the model writes them: the tags with the marker token, values in plain tokens)
      for (const auto& s : render_tool_calls_block(calls, Profile::V41)) {
        text += s.text;
        for (int32_t id : tok->encode(s.text, s.trusted)) ids.push_back(id);
      }
      SCOPED_TRACE(text);
      EXPECT_EQ(accepts(*tok, ts, thinking, ids), "");
      EXPECT_EQ(check_calls(parse_completion(text, popts(ts, thinking)), ts), "");
    }
}

// ---- the held-out agent prompts and the trained model -------------------------------------------------------
struct Item {
  std::vector<ToolSpec> tools;
  bool thinking = false;
  std::vector<int32_t> prompt;
  std::string reference;
  pyjson::Value messages;
};

std::vector<Item> agent_items() {
  std::vector<Item> v;
  std::ifstream f(dsx_test::source_dir() + "/train/out/data/agent_eval.jsonl");
  std::string line;
  while (std::getline(f, line)) {
    const pyjson::Value j = pyjson::parse(line);
    Item it;
    it.tools = tools_from_value(*j.get("tools"));
    it.thinking = j.get("thinking")->type == pyjson::Type::Bool && j.get("thinking")->boolean;
    for (const auto& x : j.get("prompt_ids")->items) it.prompt.push_back(static_cast<int32_t>(std::stoll(x.text)));
    it.reference = j.get("reference_completion")->text;
    it.messages = *j.get("messages");
    v.push_back(std::move(it));
  }
  return v;
}

const std::string kModel = dsx_test::source_dir() + "/assets/dsx-small-v41";

TEST(LazyTools, AgentReferenceCompletionsPassUnchanged) {
  const auto items = agent_items();
  if (items.empty() || !std::filesystem::exists(kModel + "/tokenizer.json")) GTEST_SKIP() << "no agent eval data";
  const Tokenizer tok = Tokenizer::from_model_dir(kModel);
  int n = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const Item& it = items[i];
    SCOPED_TRACE("item " + std::to_string(i) + ": " + it.reference);
    // the reference as the model writes it (the reasoning, when thinking, comes before it in the completion)
    EXPECT_EQ(accepts(tok, it.tools, false, tok.encode(it.reference, true)), "");
    EXPECT_EQ(check_calls(parse_completion(it.reference, popts(it.tools, false)), it.tools), "");
    ++n;
  }
  EXPECT_EQ(n, 200);
}

// Greedy decoding with an optional constraint, as the scheduler does it.
std::vector<int32_t> greedy(Engine& e, const std::vector<int32_t>& prompt, Constraint* c, int max_new, int32_t eos) {
  auto s = e.new_session();
  const int64_t V = e.config().vocab_size;
  std::vector<float> logits(static_cast<size_t>(V));
  s->feed(prompt.data(), static_cast<int64_t>(prompt.size()), logits.data(), false);
  auto argmax = [](const float* l, int64_t n) {
    int64_t b = 0;
    for (int64_t i = 1; i < n; ++i)
      if (l[i] > l[b]) b = i;
    return static_cast<int32_t>(b);
  };
  std::vector<int32_t> out;
  while (static_cast<int>(out.size()) < max_new) {
    int32_t t;
    if (c && !c->passive()) {
      t = c->next(c->needs_logits() ? logits.data() : nullptr, V, argmax);
    } else {
      t = argmax(logits.data(), V);
      if (c) c->observe(t);
    }
    out.push_back(t);
    if (t == eos || (c && c->done())) break;
    s->feed(&t, 1, logits.data(), false);
  }
  return out;
}

TEST(LazyTools, TrainedModelCallsValidate) {
  const auto items = agent_items();
  if (items.empty() || !std::filesystem::exists(kModel + "/model.safetensors")) GTEST_SKIP() << "no trained model";
  const Tokenizer tok = Tokenizer::from_model_dir(kModel);
  auto eng = load_engine(kModel, EngineOptions{});
  const int32_t eos = eng->config().eos_id;
  int n_calls = 0;
  const int n = 6;
  for (int i = 0; i < n; ++i) {
    const Item& it = items[static_cast<size_t>(i * 33 % items.size())];
    auto c = lazy_tool_constraint(tok, it.tools, Profile::V41, it.thinking);
    const auto ids = greedy(*eng, it.prompt, c.get(), 200, eos);
    const std::string text = tok.decode(ids);
    SCOPED_TRACE(text);
    const ParseResult r = parse_completion(text, popts(it.tools, it.thinking), EndCause::Eos);
    EXPECT_EQ(check_calls(r, it.tools), "");
    if (!r.tool_calls.empty()) {
      ++n_calls;
      EXPECT_TRUE(c->done());
    }
  }
  EXPECT_EQ(n_calls, n) << "the trained model calls a tool on these prompts";
}

// Free and lazy greedy completions agree up to the trigger (the marker token after '<'), and entirely when the
// free completion has none. The trained model calls a tool whenever the prompt lists tools, so the no-call case
// uses prompts rendered without them (the constraint still gets the tools).
TEST(LazyTools, TrainedModelUnchangedBeforeTheTrigger) {
  const auto items = agent_items();
  if (items.empty() || !std::filesystem::exists(kModel + "/model.safetensors")) GTEST_SKIP() << "no trained model";
  const Tokenizer tok = Tokenizer::from_model_dir(kModel);
  auto eng = load_engine(kModel, EngineOptions{});
  const int32_t eos = eng->config().eos_id, dsml = tok.encode(kDsml, true)[0];
  int untouched = 0, triggered = 0;
  for (bool with_tools : {true, false})
    for (const char* ask : {"Complete this Python function: def fib(n):", "What is 2 + 2? Answer in one word."}) {
      Conversation conv;
      conv.messages =
          messages_from_value(pyjson::parse(std::string(R"([{"role": "user", "content": ")") + ask + "\"}]"));
      if (with_tools) conv.tools = items[0].tools;
      RenderOptions ro;
      ro.thinking = false;
      const auto prompt = tok.encode(render_prompt(conv, ro).text, true);
      const auto free_ids = greedy(*eng, prompt, nullptr, 64, eos);
      auto c = lazy_tool_constraint(tok, items[0].tools, Profile::V41, false);
      const auto lazy_ids = greedy(*eng, prompt, c.get(), 64, eos);
      const std::string free_text = tok.decode(free_ids);
      SCOPED_TRACE(free_text);
      size_t trig = free_ids.size();
      for (size_t i = 1; i < free_ids.size(); ++i)
        if (free_ids[i] == dsml && tok.decode_one(free_ids[i - 1]).back() == '<') {
          trig = i + 1;
          break;
        }
      if (trig == free_ids.size()) {
        EXPECT_EQ(lazy_ids, free_ids);
        EXPECT_TRUE(c->passive());
        ++untouched;
      } else {
        ASSERT_GE(lazy_ids.size(), trig);
        EXPECT_EQ(std::vector<int32_t>(lazy_ids.begin(), lazy_ids.begin() + static_cast<long>(trig)),
                  std::vector<int32_t>(free_ids.begin(), free_ids.begin() + static_cast<long>(trig)));
        ++triggered;
      }
    }
  EXPECT_GE(untouched, 1) << "no prompt without a call";
}

}  // namespace
