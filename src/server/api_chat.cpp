// The OpenAI Chat Completions adapter (POST /v1/chat/completions) and the /v1/models
// bodies (api_models.h).
//
// Request -> GenRequest (spec chat-and-serving.md §4.3, §4.5): messages with roles
// system / developer (both -> system) / user / assistant / tool / function, content as a
// string, null or an array of text parts (joined "\n\n"; any other part is a 400: the
// model is text-only), assistant reasoning_content (opencode echoes it back) and
// tool_calls, tools, tool_choice, sampling, stop, stream, reasoning_effort, thinking,
// response_format. Everything a client can fix is a 400 invalid_request_error whose
// message names the field. Unknown fields are ignored.
//
// The wire JSON is read and written with nlohmann::ordered_json (object order kept);
// tool schemas, tool-call arguments given as objects and response_format are taken from
// a second, Python-compatible parse of the same body (text::pyjson), so that the
// renderer sees them exactly as a Python reference would (integers of any size).
//
// Answer (§3.3, §3.8, §4.6): a chat.completion.chunk SSE stream (role, reasoning_content,
// content and tool_calls deltas, a final chunk whose finish_reason is always set, the
// usage chunk when stream_options.include_usage, then [DONE]), or one chat.completion
// object.
#include <cmath>
#include <ctime>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "server/adapters.h"
#include "server/api_models.h"
#include "util/error.h"

namespace dsx::server {

namespace {

using json = nlohmann::ordered_json;
using text::pyjson::Value;

// ---------------------------------------------------------------------------------------
// Request parsing

// A client error: `where` names the field (also reported as the error's param).
struct BadRequest {
  std::string where;
  std::string message;
};

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw BadRequest{where, where + ": " + what};
}

std::string got(const json& v) { return std::string("got ") + v.type_name(); }

// A member that is present and not null, else nullptr.
const json* member(const json& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

const Value* py_member(const Value* obj, std::string_view key) {
  if (!obj || !obj->is_object()) return nullptr;
  const Value* v = obj->get(key);
  return v && !v->is_null() ? v : nullptr;
}

const Value* py_item(const Value* arr, size_t i) {
  if (!arr || !arr->is_array() || i >= arr->items.size()) return nullptr;
  return &arr->items[i];
}

const std::string& want_string(const json& v, const std::string& where) {
  if (!v.is_string()) bad(where, "expected a string, " + got(v));
  return v.get_ref<const std::string&>();
}

bool want_bool(const json& v, const std::string& where) {
  if (!v.is_boolean()) bad(where, "expected a boolean, " + got(v));
  return v.get<bool>();
}

const json& want_object(const json& v, const std::string& where) {
  if (!v.is_object()) bad(where, "expected an object, " + got(v));
  return v;
}

double want_number(const json& v, const std::string& where, double lo, double hi) {
  if (!v.is_number()) bad(where, "expected a number, " + got(v));
  const double d = v.get<double>();
  if (!(d >= lo && d <= hi)) bad(where, cat("must be between ", lo, " and ", hi, ", got ", v.dump()));
  return d;
}

// An integer (a float with an integral value, e.g. 32000.0, is accepted). Above `hi`:
// clamped when `clamp`, else rejected.
int64_t want_int(const json& v, const std::string& where, int64_t lo, int64_t hi, bool clamp) {
  if (!v.is_number()) bad(where, "expected an integer, " + got(v));
  auto above = [&]() -> int64_t {
    if (clamp) return hi;
    bad(where, cat("must be at most ", hi, ", got ", v.dump()));
  };
  auto below = [&]() -> int64_t { bad(where, cat("must be at least ", lo, ", got ", v.dump())); };
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();  // (the JSON library reads every non-negative integer so)
    if (u > static_cast<uint64_t>(hi)) return above();
    return static_cast<int64_t>(u) < lo ? below() : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) {
    const int64_t x = v.get<int64_t>();
    if (x < lo) return below();
    return x > hi ? above() : x;
  }
  const double d = v.get<double>();
  if (d != std::floor(d)) bad(where, "expected an integer, got " + v.dump());
  if (d < static_cast<double>(lo)) return below();
  if (d >= 9223372036854775808.0 || d > static_cast<double>(hi)) return above();  // (2^63: beyond int64)
  const int64_t x = static_cast<int64_t>(d);
  return x < lo ? below() : x;
}

bool is_text_part(const std::string& t) { return t == "text" || t == "input_text" || t == "output_text"; }

// Content: a string, null, or an array of parts {type: "text", text} joined with "\n\n"
// (§4.3). Assistant "refusal" parts count as text. Any other part: the model is text-only.
std::string text_content(const json* c, const std::string& where) {
  if (!c) return "";
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) bad(where, "expected a string, null or an array of content parts, " + got(*c));
  std::string out;
  for (size_t j = 0; j < c->size(); ++j) {
    const std::string w = where + "[" + std::to_string(j) + "]";
    const json& part = (*c)[j];
    if (j) out += "\n\n";
    if (part.is_string()) {  // tolerated: a bare string part
      out += part.get<std::string>();
      continue;
    }
    want_object(part, w);
    const json* ty = member(part, "type");
    if (!ty) bad(w + ".type", "missing");
    const std::string& type = want_string(*ty, w + ".type");
    if (is_text_part(type) || type == "refusal") {
      const json* t = member(part, type == "refusal" ? "refusal" : "text");
      if (!t) bad(w + (type == "refusal" ? ".refusal" : ".text"), "missing");
      out += want_string(*t, w + (type == "refusal" ? ".refusal" : ".text"));
    } else {
      bad(w + ".type", "content part type '" + type + "' is not supported (text-only model)");
    }
  }
  return out;
}

// Tool-call arguments: a JSON text (string), or tolerated as an object / array (then
// written as Python's json.dumps would). Absent or null: "" (no parameters).
std::string arguments_text(const json* a, const Value* py, const std::string& where) {
  if (!a) return "";
  if (a->is_string()) return a->get<std::string>();
  if (a->is_object() || a->is_array()) {
    if (py) return text::pyjson::dumps(*py);
    return text::pyjson::dumps(text::pyjson::parse(a->dump()));
  }
  bad(where, "expected a JSON string, " + got(*a));
}

text::ToolCall tool_call(const json& tc, const Value* py, const std::string& where) {
  want_object(tc, where);
  text::ToolCall call;
  if (const json* id = member(tc, "id")) call.id = want_string(*id, where + ".id");
  if (const json* ty = member(tc, "type")) {
    const std::string& t = want_string(*ty, where + ".type");
    if (t != "function") bad(where + ".type", "unsupported tool call type '" + t + "' (expected \"function\")");
  }
  const json* fn = member(tc, "function");
  if (!fn) bad(where + ".function", "missing");
  want_object(*fn, where + ".function");
  const json* name = member(*fn, "name");
  if (!name) bad(where + ".function.name", "missing");
  call.name = want_string(*name, where + ".function.name");
  if (call.name.empty()) bad(where + ".function.name", "must not be empty");
  call.arguments = arguments_text(member(*fn, "arguments"), py_member(py_member(py, "function"), "arguments"),
                                  where + ".function.arguments");
  return call;
}

std::vector<text::Message> parse_messages(const json& msgs, const Value* py_msgs) {
  if (!msgs.is_array()) bad("messages", "expected an array, " + got(msgs));
  if (msgs.empty()) bad("messages", "must contain at least one message");
  std::vector<text::Message> out;
  out.reserve(msgs.size());
  std::set<std::string> call_ids;  // ids of the tool calls seen so far
  for (size_t i = 0; i < msgs.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const json& m = msgs[i];
    const Value* py = py_item(py_msgs, i);
    want_object(m, where);
    const json* rv = member(m, "role");
    if (!rv) bad(where + ".role", "missing");
    const std::string& role = want_string(*rv, where + ".role");
    const json* content = member(m, "content");
    const std::string cwhere = where + ".content";
    text::Message msg;
    if (role == "system" || role == "developer") {
      msg.role = text::Role::System;  // OpenAI's developer is the system-instruction role (§4.3)
      msg.content = text_content(content, cwhere);
    } else if (role == "user") {
      msg.role = text::Role::User;
      msg.content = text_content(content, cwhere);
    } else if (role == "assistant") {
      msg.role = text::Role::Assistant;
      msg.content = text_content(content, cwhere);
      if (const json* r = member(m, "reasoning_content")) {
        msg.reasoning_content = want_string(*r, where + ".reasoning_content");
      } else if (const json* r2 = member(m, "reasoning")) {  // alias some clients use
        if (r2->is_string()) msg.reasoning_content = r2->get<std::string>();
      }
      if (const json* tcs = member(m, "tool_calls")) {
        if (!tcs->is_array()) bad(where + ".tool_calls", "expected an array, " + got(*tcs));
        const Value* py_tcs = py_member(py, "tool_calls");
        for (size_t j = 0; j < tcs->size(); ++j) {
          msg.tool_calls.push_back(
              tool_call((*tcs)[j], py_item(py_tcs, j), where + ".tool_calls[" + std::to_string(j) + "]"));
          call_ids.insert(msg.tool_calls.back().id);
        }
      } else if (const json* fc = member(m, "function_call")) {  // legacy single call
        const std::string w = where + ".function_call";
        want_object(*fc, w);
        const json* name = member(*fc, "name");
        if (!name) bad(w + ".name", "missing");
        text::ToolCall call;
        call.name = want_string(*name, w + ".name");
        if (call.name.empty()) bad(w + ".name", "must not be empty");
        call.arguments = arguments_text(member(*fc, "arguments"),
                                        py_member(py_member(py, "function_call"), "arguments"), w + ".arguments");
        msg.tool_calls.push_back(std::move(call));
      }
    } else if (role == "tool") {
      msg.role = text::Role::Tool;
      msg.content = text_content(content, cwhere);
      const json* id = member(m, "tool_call_id");
      if (!id) bad(where + ".tool_call_id", "missing");
      msg.tool_call_id = want_string(*id, where + ".tool_call_id");
      if (!call_ids.count(msg.tool_call_id))
        bad(where + ".tool_call_id", "no earlier assistant message has a tool call with id '" + msg.tool_call_id +
                                         "'; replay the full message history");
    } else if (role == "function") {  // legacy function result (answers a function_call)
      msg.role = text::Role::Tool;
      msg.content = text_content(content, cwhere);
      const json* name = member(m, "name");
      if (!name) bad(where + ".name", "missing");
      want_string(*name, where + ".name");
    } else {
      bad(where + ".role",
          "unknown role '" + role + "' (expected system, developer, user, assistant, tool or function)");
    }
    out.push_back(std::move(msg));
  }
  return out;
}

std::vector<text::ToolSpec> parse_tools(const json& tools, const Value* py_tools) {
  if (!tools.is_array()) bad("tools", "expected an array, " + got(tools));
  std::vector<text::ToolSpec> out;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string where = "tools[" + std::to_string(i) + "]";
    const json& t = tools[i];
    want_object(t, where);
    const json* ty = member(t, "type");
    if (!ty) bad(where + ".type", "missing");
    const std::string& type = want_string(*ty, where + ".type");
    if (type != "function") bad(where + ".type", "unsupported tool type '" + type + "' (expected \"function\")");
    const json* fn = member(t, "function");
    if (!fn) bad(where + ".function", "missing");
    want_object(*fn, where + ".function");
    const json* name = member(*fn, "name");
    if (!name) bad(where + ".function.name", "missing");
    if (want_string(*name, where + ".function.name").empty()) bad(where + ".function.name", "must not be empty");
    if (const json* d = member(*fn, "description")) want_string(*d, where + ".function.description");
    if (const json* p = member(*fn, "parameters")) want_object(*p, where + ".function.parameters");
    const Value* py = py_item(py_tools, i);
    try {
      out.push_back(py ? text::tool_from_value(*py, where)
                       : text::tool_from_value(text::pyjson::parse(t.dump()), where));
    } catch (const Error& e) {
      throw BadRequest{where, e.what()};
    }
  }
  return out;
}

// tool_choice: "auto" | "none" | "required" | {type: "function", function: {name}}.
std::string parse_tool_choice(const json& tc, const std::vector<text::ToolSpec>& tools) {
  std::string choice;
  if (tc.is_string()) {
    choice = tc.get<std::string>();
    if (choice != "auto" && choice != "none" && choice != "required")
      bad("tool_choice", "expected \"auto\", \"none\", \"required\" or a function, got \"" + choice + "\"");
  } else if (tc.is_object()) {
    const json* ty = member(tc, "type");
    if (!ty) bad("tool_choice.type", "missing");
    const std::string& type = want_string(*ty, "tool_choice.type");
    if (type == "function") {
      const json* fn = member(tc, "function");
      if (!fn) bad("tool_choice.function", "missing");
      want_object(*fn, "tool_choice.function");
      const json* name = member(*fn, "name");
      if (!name) bad("tool_choice.function.name", "missing");
      choice = want_string(*name, "tool_choice.function.name");
      bool found = false;
      for (const auto& t : tools) found = found || t.name == choice;
      if (!found) bad("tool_choice.function.name", "no tool named '" + choice + "' in tools");
    } else if (type == "auto" || type == "none" || type == "required") {
      choice = type;
    } else {
      bad("tool_choice.type", "unsupported tool_choice type '" + type + "'");
    }
  } else {
    bad("tool_choice", "expected a string or an object, " + got(tc));
  }
  if (choice == "required" && tools.empty()) bad("tool_choice", "\"required\" needs tools");
  return choice;
}

// thinking: a boolean or {type: "enabled" | "disabled" | "adaptive" | "auto"}.
bool parse_thinking(const json& th) {
  if (th.is_boolean()) return th.get<bool>();
  if (!th.is_object()) bad("thinking", "expected a boolean or an object, " + got(th));
  const json* ty = member(th, "type");
  if (!ty) bad("thinking.type", "missing");
  const std::string& t = want_string(*ty, "thinking.type");
  if (t == "enabled" || t == "adaptive" || t == "auto") return true;
  if (t == "disabled") return false;
  bad("thinking.type", "expected \"enabled\" or \"disabled\", got \"" + t + "\"");
}

void parse_request(const json& root, const Value& py_root, const AdapterContext& ctx, GenRequest& out) {
  if (!root.is_object()) bad("body", "expected a JSON object, " + got(root));
  out = GenRequest{};
  out.api = "chat";
  out.id_prefix = "call_";

  if (const json* m = member(root, "model")) out.model = want_string(*m, "model");
  if (out.model.empty()) out.model = ctx.model_id;

  const json* msgs = member(root, "messages");
  if (!msgs) bad("messages", "missing");
  out.conv.messages = parse_messages(*msgs, py_member(&py_root, "messages"));

  if (const json* t = member(root, "tools")) out.conv.tools = parse_tools(*t, py_member(&py_root, "tools"));
  if (const json* tc = member(root, "tool_choice")) {
    out.tool_choice = parse_tool_choice(*tc, out.conv.tools);
  } else if (const json* fc = member(root, "function_call")) {  // legacy: "none" | "auto" | {name}
    if (fc->is_string() && (*fc == "none" || *fc == "auto")) out.tool_choice = fc->get<std::string>();
    else if (fc->is_object()) out.tool_choice = parse_tool_choice(json{{"type", "function"}, {"function", *fc}}, out.conv.tools);
    else bad("function_call", "expected \"none\", \"auto\" or an object");
  }
  out.tools_enabled = out.tool_choice != "none";
  out.conv.tools_enabled = out.tools_enabled;

  if (const json* n = member(root, "n")) {
    const int64_t v = want_int(*n, "n", 1, std::numeric_limits<int64_t>::max(), true);
    if (v != 1) bad("n", "only n = 1 is supported");
  }
  if (const json* lp = member(root, "logprobs"); lp && want_bool(*lp, "logprobs"))
    bad("logprobs", "logprobs are not supported");
  if (const json* tl = member(root, "top_logprobs"); tl && want_int(*tl, "top_logprobs", 0, 20, false) != 0)
    bad("top_logprobs", "logprobs are not supported");
  if (const json* mod = member(root, "modalities")) {
    if (!mod->is_array()) bad("modalities", "expected an array, " + got(*mod));
    for (size_t i = 0; i < mod->size(); ++i) {
      const std::string w = "modalities[" + std::to_string(i) + "]";
      if (want_string((*mod)[i], w) != "text") bad(w, "only \"text\" is supported (text-only model)");
    }
  }

  // Thinking and effort (§4.5): an explicit switch wins over reasoning_effort, which wins
  // over the model alias (deepseek-chat: off by default); default on.
  std::optional<bool> thinking;
  if (const json* th = member(root, "thinking")) thinking = parse_thinking(*th);
  if (const json* th = member(root, "think"); th && !thinking) thinking = want_bool(*th, "think");
  if (const json* kw = member(root, "chat_template_kwargs"); kw && !thinking) {
    want_object(*kw, "chat_template_kwargs");
    if (const json* t = member(*kw, "thinking")) thinking = want_bool(*t, "chat_template_kwargs.thinking");
    else if (const json* e = member(*kw, "enable_thinking"))
      thinking = want_bool(*e, "chat_template_kwargs.enable_thinking");
  }
  bool effort_thinking = true, effort_given = false;
  if (const json* re = member(root, "reasoning_effort")) {
    std::string s;
    if (re->is_string()) s = re->get<std::string>();
    else if (re->is_number_integer()) s = re->dump();
    else bad("reasoning_effort", "expected a string or an integer, " + got(*re));
    try {
      const text::ThinkingRequest tr = text::map_api_effort(s);
      effort_given = true;
      effort_thinking = tr.thinking;
      out.effort = tr.effort;
    } catch (const Error&) {
      bad("reasoning_effort", "invalid value '" + s +
                                  "' (expected none, minimal, low, medium, high, xhigh, max, ultra or an integer 1-100)");
    }
  }
  if (thinking) out.thinking = *thinking && effort_thinking;
  else if (effort_given) out.thinking = effort_thinking;
  else out.thinking = out.model != "deepseek-chat";
  out.conv.thinking = out.thinking;
  if (out.effort.kind != text::Effort::Kind::Default) out.conv.effort = out.effort;

  if (const json* rf = member(root, "response_format")) {
    want_object(*rf, "response_format");
    const json* ty = member(*rf, "type");
    if (!ty) bad("response_format.type", "missing");
    const std::string& type = want_string(*ty, "response_format.type");
    if (type == "json_schema") {
      const json* js = member(*rf, "json_schema");
      if (!js) bad("response_format.json_schema", "missing");
      want_object(*js, "response_format.json_schema");
      if (const json* s = member(*js, "schema")) want_object(*s, "response_format.json_schema.schema");
    } else if (type != "json_object" && type != "text") {
      bad("response_format.type", "expected \"text\", \"json_object\" or \"json_schema\", got \"" + type + "\"");
    }
    if (type != "text") {
      const Value* py = py_member(&py_root, "response_format");
      out.response_format = py ? *py : text::pyjson::parse(rf->dump());
    }
  }

  if (const json* s = member(root, "stream")) out.stream = want_bool(*s, "stream");
  if (const json* so = member(root, "stream_options")) {
    want_object(*so, "stream_options");
    if (const json* iu = member(*so, "include_usage")) out.include_usage = want_bool(*iu, "stream_options.include_usage");
  }

  const int64_t kMax = std::numeric_limits<int64_t>::max();
  if (const json* mt = member(root, "max_completion_tokens")) out.max_tokens = want_int(*mt, "max_completion_tokens", 1, kMax, true);
  else if (const json* mt2 = member(root, "max_tokens")) out.max_tokens = want_int(*mt2, "max_tokens", 1, kMax, true);

  // Sampling: any of temperature / top_p / top_k makes the client's sampling count; the
  // others then take OpenAI's defaults (1, 1, off).
  std::optional<double> temperature, top_p;
  std::optional<int64_t> top_k;
  if (const json* t = member(root, "temperature")) temperature = want_number(*t, "temperature", 0, 2);
  if (const json* p = member(root, "top_p")) top_p = want_number(*p, "top_p", 0, 1);
  if (const json* k = member(root, "top_k")) {
    top_k = want_int(*k, "top_k", -1, std::numeric_limits<int>::max(), true);
    if (*top_k < 0) *top_k = 0;  // -1: off (vLLM)
  }
  if (const json* mp = member(root, "min_p")) want_number(*mp, "min_p", 0, 1);  // (no min-p in the sampler)
  if (temperature || top_p || top_k) {
    out.sampling_given = true;
    out.sampling.temperature = static_cast<float>(temperature.value_or(1.0));
    out.sampling.top_p = static_cast<float>(top_p.value_or(1.0));
    out.sampling.top_k = static_cast<int>(top_k.value_or(0));
  }
  if (const json* sd = member(root, "seed")) {
    if (sd->is_number_unsigned()) out.sampling.seed = sd->get<uint64_t>();
    else out.sampling.seed = static_cast<uint64_t>(want_int(*sd, "seed", std::numeric_limits<int64_t>::min(), kMax, false));
  } else {
    out.sampling.seed = std::stoull(text::random_hex(8), nullptr, 16);
  }

  if (const json* st = member(root, "stop")) {
    auto add = [&](const json& s, const std::string& where) {
      const std::string& v = want_string(s, where);
      if (v.size() > 1024) bad(where, "a stop string may have at most 1024 bytes");
      if (!v.empty()) out.stop.push_back(v);
    };
    if (st->is_string()) {
      add(*st, "stop");
    } else if (st->is_array()) {
      if (st->size() > 16) bad("stop", "at most 16 stop strings are supported");
      for (size_t i = 0; i < st->size(); ++i) add((*st)[i], "stop[" + std::to_string(i) + "]");
    } else {
      bad("stop", "expected a string or an array of strings, " + got(*st));
    }
  }

  if (const json* pk = member(root, "prompt_cache_key"); pk && pk->is_string()) out.session_hint = pk->get<std::string>();
}

// The message of a JSON library exception without its "[json.exception.…] " prefix and
// without the echo of the bytes it read last (they may be invalid UTF-8).
std::string json_error_text(const std::exception& e) {
  std::string s = e.what();
  if (s.rfind("[json.exception.", 0) == 0) {
    const size_t close = s.find("] ");
    if (close != std::string::npos) s.erase(0, close + 2);
  }
  if (const size_t lr = s.find("; last read: "); lr != std::string::npos) s.erase(lr);
  if (!text::valid_utf8(s)) s = "malformed JSON";
  return s;
}

bool chat_parse(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err) {
  err = ApiError{};
  try {
    if (!json_depth_ok(body))
      throw BadRequest{"", "invalid JSON body: nested deeper than " + std::to_string(kMaxRequestDepth) + " levels"};
    json root;
    try {
      root = json::parse(body.begin(), body.end());
    } catch (const json::exception& e) {
      throw BadRequest{"", "invalid JSON body: " + json_error_text(e)};
    }
    Value py_root;
    try {
      py_root = text::pyjson::parse(body);
    } catch (const Error& e) {
      throw BadRequest{"", std::string("invalid JSON body: ") + e.what()};
    }
    parse_request(root, py_root, ctx, out);
    return true;
  } catch (const BadRequest& b) {
    err.status = 400;
    err.type = "invalid_request_error";
    err.message = b.message;
    err.param = b.where;
  } catch (const Error& e) {  // the text layer (pyjson conversions)
    err.status = 400;
    err.type = "invalid_request_error";
    err.message = e.what();
  } catch (const json::exception& e) {
    err.status = 400;
    err.type = "invalid_request_error";
    err.message = "invalid request: " + json_error_text(e);
  }
  return false;
}

// ---------------------------------------------------------------------------------------
// Answer

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

json usage_json(const Usage& u) {
  json j;
  j["prompt_tokens"] = u.prompt_tokens;
  j["completion_tokens"] = u.completion_tokens;
  j["total_tokens"] = u.prompt_tokens + u.completion_tokens;
  j["prompt_tokens_details"] = {{"cached_tokens", u.cached_tokens}};
  j["completion_tokens_details"] = {{"reasoning_tokens", u.reasoning_tokens}};
  // DeepSeek's names of the same numbers
  j["prompt_cache_hit_tokens"] = u.cached_tokens;
  j["prompt_cache_miss_tokens"] = u.prompt_tokens - u.cached_tokens;
  return j;
}

json error_json(const ApiError& e) {
  json err;
  err["message"] = e.message;
  err["type"] = e.type.empty() ? (e.status >= 500 ? "server_error" : "invalid_request_error") : e.type;
  err["param"] = e.param.empty() ? json(nullptr) : json(e.param);
  err["code"] = e.code.empty() ? json(nullptr) : json(e.code);
  return json{{"error", std::move(err)}};
}

std::string chat_error_body(const ApiError& e) { return dump(error_json(e)); }

class ChatSink final : public Sink {
 public:
  ChatSink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch)
      : ch_(std::move(ch)),
        id_("chatcmpl-" + text::random_hex(12)),
        created_(static_cast<int64_t>(std::time(nullptr))),
        model_(req.model.empty() ? ctx.model_id : req.model),
        stream_(req.stream),
        include_usage_(req.include_usage) {}

  void start(const Usage& u) override {
    if (done_ || started_) return;
    started_ = true;
    if (stream_) role_chunk();
  }

  void events(const std::vector<text::Event>& evs) override {
    if (done_ || !stream_) return;  // (not streaming: the answer comes from end()'s result)
    if (!role_sent_) role_chunk();
    // Consecutive deltas of one kind (and one tool call) go out as one chunk.
    enum class Kind { None, Reasoning, Content, Args } kind = Kind::None;
    int index = -1;
    std::string pending;
    auto flush = [&]() {
      if (kind == Kind::None || pending.empty()) {
        kind = Kind::None;
        return;
      }
      json delta;
      if (kind == Kind::Reasoning) delta["reasoning_content"] = pending;
      else if (kind == Kind::Content) delta["content"] = pending;
      else delta["tool_calls"] = json::array({{{"index", index}, {"function", {{"arguments", pending}}}}});
      chunk(std::move(delta), nullptr);
      pending.clear();
      kind = Kind::None;
    };
    auto add = [&](Kind k, int idx, const std::string& s) {
      if (s.empty()) return;
      if (k != kind || idx != index) flush();
      kind = k;
      index = idx;
      pending += s;
    };
    for (const text::Event& e : evs) {
      switch (e.type) {
        case text::EventType::ReasoningDelta: add(Kind::Reasoning, -1, e.text); break;
        case text::EventType::ContentDelta: add(Kind::Content, -1, e.text); break;
        case text::EventType::ToolCallDelta: add(Kind::Args, e.index, e.text); break;
        case text::EventType::ToolCallStart: {
          flush();
          json call = {{"index", e.index},
                       {"id", e.id},
                       {"type", "function"},
                       {"function", {{"name", e.name}, {"arguments", ""}}}};
          chunk(json{{"tool_calls", json::array({std::move(call)})}}, nullptr);
          break;
        }
        case text::EventType::Error:
          flush();
          stream_error(e.text, "server_error", "");
          return;
        case text::EventType::ReasoningEnd:
        case text::EventType::ToolCallEnd: break;
      }
    }
    flush();
  }

  void keepalive() override {
    if (done_ || !stream_) return;  // (a JSON answer cannot carry one)
    push(": keepalive\n\n");
  }

  void end(const text::ParseResult& r, const Usage& u) override {
    if (done_) return;
    if (!stream_) {
      json msg;
      msg["role"] = "assistant";
      msg["content"] = r.content.empty() && !r.tool_calls.empty() ? json(nullptr) : json(r.content);
      if (!r.reasoning.empty()) msg["reasoning_content"] = r.reasoning;
      if (!r.tool_calls.empty()) {
        json calls = json::array();
        for (const auto& c : r.tool_calls)
          calls.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
        msg["tool_calls"] = std::move(calls);
      }
      json choice;
      choice["index"] = 0;
      choice["message"] = std::move(msg);
      choice["logprobs"] = nullptr;
      choice["finish_reason"] = text::openai_finish_reason(r.finish);
      json body = head("chat.completion");
      body["choices"] = json::array({std::move(choice)});
      body["usage"] = usage_json(u);
      ch_->set_status(200, "application/json");
      ch_->push(dump(body));
      close();
      return;
    }
    if (!role_sent_) role_chunk();
    if (r.stream_error) {  // the Error event should already have ended the stream
      stream_error(r.error.empty() ? "invalid tool call" : r.error, "server_error", "");
      return;
    }
    chunk(json::object(), text::openai_finish_reason(r.finish));
    if (include_usage_) {
      json c = head("chat.completion.chunk");
      c["choices"] = json::array();
      c["usage"] = usage_json(u);
      push("data: " + dump(c) + "\n\n");
    }
    push("data: [DONE]\n\n");
    close();
  }

  void fail(const ApiError& e) override {
    if (done_) return;
    if (stream_ && committed_) {
      stream_error(e.message, e.status >= 500 || e.type.empty() ? "server_error" : e.type, e.code);
      return;
    }
    ch_->set_status(e.status, "application/json");
    ch_->push(chat_error_body(e));
    close();
  }

  bool cancelled() const override { return ch_->cancelled(); }

 private:
  json head(const char* object) const {
    json j;
    j["id"] = id_;
    j["object"] = object;
    j["created"] = created_;
    j["model"] = model_;
    return j;
  }
  void push(std::string s) {
    committed_ = true;
    ch_->push(std::move(s));
  }
  void chunk(json delta, const char* finish) {
    json choice;
    choice["index"] = 0;
    choice["delta"] = std::move(delta);
    choice["logprobs"] = nullptr;
    choice["finish_reason"] = finish ? json(finish) : json(nullptr);
    json c = head("chat.completion.chunk");
    c["choices"] = json::array({std::move(choice)});
    push("data: " + dump(c) + "\n\n");
  }
  void role_chunk() {
    role_sent_ = true;
    chunk(json{{"role", "assistant"}}, nullptr);
  }
  void stream_error(const std::string& message, const std::string& type, const std::string& code) {
    json err;
    err["message"] = message;
    err["type"] = type;
    err["param"] = nullptr;
    err["code"] = code.empty() ? json(nullptr) : json(code);
    push("data: " + dump(json{{"error", std::move(err)}}) + "\n\n");
    close();
  }
  void close() {
    done_ = true;
    ch_->close();
  }

  std::shared_ptr<Channel> ch_;
  std::string id_;
  int64_t created_;
  std::string model_;
  bool stream_, include_usage_;
  bool started_ = false, role_sent_ = false, committed_ = false, done_ = false;
};

std::shared_ptr<Sink> chat_make_sink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch) {
  return std::make_shared<ChatSink>(req, ctx, std::move(ch));
}

// ---------------------------------------------------------------------------------------
// /v1/models

int64_t process_created() {
  static const int64_t t = static_cast<int64_t>(std::time(nullptr));
  return t;
}

json model_object(const AdapterContext& ctx, const std::string& id) {
  json m;
  m["id"] = id;
  m["object"] = "model";
  m["created"] = process_created();
  m["owned_by"] = "dsx";
  m["context_length"] = ctx.context_tokens;
  return m;
}

}  // namespace

const Adapter& chat_adapter() {
  static const Adapter a{Api::Chat, &chat_parse, &chat_make_sink, &chat_error_body};
  return a;
}

std::string models_body(const AdapterContext& ctx, const std::string& id_or_empty) {
  if (id_or_empty.empty()) return models_list_body(ctx);
  return dump(model_object(ctx, id_or_empty));
}

std::string models_list_body(const AdapterContext& ctx) {
  json list;
  list["object"] = "list";
  list["data"] = json::array({model_object(ctx, ctx.model_id)});
  return dump(list);
}

}  // namespace dsx::server
