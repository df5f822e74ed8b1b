// The Anthropic Messages adapter: POST /v1/messages (and the body of
// /v1/messages/count_tokens) -> GenRequest, and the Sink writing the Messages SSE stream
// or the one message object (spec chat-and-serving.md §3.3, §4.3, §4.5, §4.6; the
// clients' measured behaviour in shared/agents/README.md). See api_messages.h.
#include "server/api_messages.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <exception>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "server/signing.h"
#include "text/chat.h"
#include "text/dsml.h"
#include "util/error.h"

namespace dsx::server {

namespace {

using J = nlohmann::ordered_json;
namespace pyjson = text::pyjson;


thread_local std::vector<std::string> t_dropped_tools;

// A client error found while parsing: `where` names the field ("messages[2].content").
struct BadRequest {
  std::string where;
  std::string what;
};

[[noreturn]] void bad(const std::string& where, const std::string& what) { throw BadRequest{where, what}; }

std::string at(const std::string& where, size_t i) { return where + "[" + std::to_string(i) + "]"; }
std::string dot(const std::string& where, const char* key) { return where.empty() ? key : where + "." + key; }

// The member `key` of an object, or nullptr when absent or null.
const J* member(const J& obj, const char* key) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

const char* kind(const J& v) {
  if (v.is_number_integer()) return "an integer";
  if (v.is_number_float()) return "a number";
  if (v.is_string()) return "a string";
  if (v.is_boolean()) return "a boolean";
  if (v.is_array()) return "an array";
  if (v.is_object()) return "an object";
  return "null";
}

const std::string& want_string(const J& v, const std::string& where) {
  if (!v.is_string()) bad(where, std::string("expected a string, got ") + kind(v));
  return v.get_ref<const std::string&>();
}

const J& want_object(const J& v, const std::string& where) {
  if (!v.is_object()) bad(where, std::string("expected an object, got ") + kind(v));
  return v;
}

bool want_bool(const J& v, const std::string& where) {
  if (!v.is_boolean()) bad(where, std::string("expected a boolean, got ") + kind(v));
  return v.get<bool>();
}

double want_number(const J& v, const std::string& where) {
  if (!v.is_number()) bad(where, std::string("expected a number, got ") + kind(v));
  return v.get<double>();
}

// An integer (any size: clamped to int64).
int64_t want_int(const J& v, const std::string& where) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u > uint64_t(INT64_MAX) ? INT64_MAX : static_cast<int64_t>(u);
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  bad(where, std::string("expected an integer, got ") + kind(v));
}

// Wire JSON -> pyjson (tool schemas, tool-call arguments).
pyjson::Value to_pyjson(const J& v, const std::string& where) {
  try {
    return pyjson::parse(v.dump());
  } catch (const std::exception& e) {
    bad(where, e.what());
  }
}

// pyjson -> wire JSON (tool-call arguments in answers). pyjson's depth is bounded by its parser.
J from_pyjson(const pyjson::Value& v) {
  switch (v.type) {
    case pyjson::Type::Null: return nullptr;
    case pyjson::Type::Bool: return v.boolean;
    case pyjson::Type::Int: {
      J n = J::parse(v.text, nullptr, false);  // beyond 64 bits: a double, as any JSON reader would
      return n.is_discarded() ? J(v.text) : n;
    }
    case pyjson::Type::Float: return std::isfinite(v.number) ? J(v.number) : J(nullptr);
    case pyjson::Type::String: return v.text;
    case pyjson::Type::Array: {
      J a = J::array();
      for (const auto& x : v.items) a.push_back(from_pyjson(x));
      return a;
    }
    case pyjson::Type::Object: {
      J o = J::object();
      for (const auto& [k, x] : v.members) o[k] = from_pyjson(x);
      return o;
    }
  }
  return nullptr;
}

// A tool call's arguments (a JSON object text from the parser) as the `input` object.
J arguments_object(const std::string& arguments) {
  pyjson::Value v;
  if (!arguments.empty() && pyjson::try_parse(arguments, v) && v.is_object()) return from_pyjson(v);
  return J::object();
}

J parse_body_json(std::string_view body) {
  if (!json_depth_ok(body)) bad("", "invalid JSON: nested deeper than " + std::to_string(kMaxRequestDepth) + " levels");
  try {
    return J::parse(body.begin(), body.end());
  } catch (const J::exception& e) {
    std::string m = e.what();  // "[json.exception.parse_error.101] parse error at ..."
    if (!m.empty() && m[0] == '[') {
      const size_t close = m.find("] ");
      if (close != std::string::npos) m = m.substr(close + 2);
    }
    bad("", "invalid JSON: " + m);
  }
}

std::string dump(const J& j) { return j.dump(-1, ' ', false, J::error_handler_t::replace); }

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

bool is_unsupported_media(const std::string& type) {
  return type == "image" || type == "document" || type == "audio" || type == "file" || type == "container_upload";
}

[[noreturn]] void unsupported_block(const std::string& where, const std::string& type, const char* context) {
  if (is_unsupported_media(type)) bad(where, type + " blocks are not supported (text-only model)");
  bad(where, "unsupported content block type '" + type + "' in " + context);
}

const std::string& block_type(const J& block, const std::string& where) {
  want_object(block, where);
  const J* t = member(block, "type");
  if (!t) bad(dot(where, "type"), "missing");
  return want_string(*t, dot(where, "type"));
}

// A system prompt: a string or text blocks, joined with "\n"; blocks whose text starts with
// "x-anthropic-" (Claude Code's per-request billing header) are dropped. nullopt: nothing left.
std::optional<std::string> system_text(const J& v, const std::string& where) {
  if (v.is_string()) return v.get<std::string>();
  if (!v.is_array()) bad(where, std::string("expected a string or an array of text blocks, got ") + kind(v));
  std::optional<std::string> out;
  for (size_t i = 0; i < v.size(); ++i) {
    const std::string w = at(where, i);
    const std::string& type = block_type(v[i], w);
    if (type != "text") {
      if (is_unsupported_media(type)) unsupported_block(w, type, "a system prompt");
      bad(dot(w, "type"), "expected \"text\" in a system prompt, got '" + type + "'");
    }
    const J* t = member(v[i], "text");
    if (!t) bad(dot(w, "text"), "missing");
    const std::string& s = want_string(*t, dot(w, "text"));
    if (starts_with(s, "x-anthropic-")) continue;
    if (out) *out += "\n";
    else out.emplace();
    *out += s;
  }
  return out;
}

// tool_result content: a string, or text blocks joined with "\n\n".
std::string tool_result_text(const J* c, const std::string& where) {
  if (!c) return "";
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) bad(where, std::string("expected a string or an array of text blocks, got ") + kind(*c));
  std::string out;
  for (size_t i = 0; i < c->size(); ++i) {
    const std::string w = at(where, i);
    const std::string& type = block_type((*c)[i], w);
    if (type != "text") unsupported_block(w, type, "a tool_result");
    const J* t = member((*c)[i], "text");
    if (!t) bad(dot(w, "text"), "missing");
    if (i) out += "\n\n";
    out += want_string(*t, dot(w, "text"));
  }
  return out;
}

const std::string& nonempty_string(const J& block, const char* key, const std::string& where) {
  const J* v = member(block, key);
  if (!v) bad(dot(where, key), "missing");
  const std::string& s = want_string(*v, dot(where, key));
  if (s.empty()) bad(dot(where, key), "must not be empty");
  return s;
}

struct ParseState {
  const AdapterContext* ctx = nullptr;
  std::unordered_set<std::string> tool_use_ids;  // of the assistant messages so far
};

void parse_user(const J& content, const std::string& where, ParseState& st, std::vector<text::Message>& out) {
  if (content.is_string()) {
    text::Message m;
    m.role = text::Role::User;
    m.content = content.get<std::string>();
    out.push_back(std::move(m));
    return;
  }
  // Blocks in order: text runs become user messages, each tool_result a tool message (the renderer
  // merges them back into one user turn, §2.3 Step B).
  text::Message cur;
  cur.role = text::Role::User;
  auto flush = [&]() {
    if (!cur.blocks.empty()) out.push_back(std::move(cur));
    cur = text::Message{};
    cur.role = text::Role::User;
  };
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string w = at(where, i);
    const J& b = content[i];
    const std::string& type = block_type(b, w);
    if (type == "text") {
      const J* t = member(b, "text");
      if (!t) bad(dot(w, "text"), "missing");
      text::ContentBlock cb;
      cb.kind = text::ContentBlock::Kind::Text;
      cb.text = want_string(*t, dot(w, "text"));
      cur.blocks.push_back(std::move(cb));
    } else if (type == "tool_result") {
      const std::string& id = nonempty_string(b, "tool_use_id", w);
      if (!st.tool_use_ids.count(id))
        bad(dot(w, "tool_use_id"), "no tool_use block with id '" + id +
                                       "' precedes this tool_result; replay the full conversation history");
      if (const J* e = member(b, "is_error")) want_bool(*e, dot(w, "is_error"));  // (the text says what failed)
      text::Message tm;
      tm.role = text::Role::Tool;
      tm.tool_call_id = id;
      tm.content = tool_result_text(member(b, "content"), dot(w, "content"));
      flush();
      out.push_back(std::move(tm));
    } else {
      unsupported_block(w, type, "a user message");
    }
  }
  flush();
  if (content.empty()) {  // an empty list: one empty user turn
    text::Message m;
    m.role = text::Role::User;
    out.push_back(std::move(m));
  }
}

text::Message parse_assistant(const J& content, const std::string& where, ParseState& st) {
  text::Message m;
  m.role = text::Role::Assistant;
  if (content.is_string()) {
    m.content = content.get<std::string>();
    return m;
  }
  bool have_text = false;
  for (size_t i = 0; i < content.size(); ++i) {
    const std::string w = at(where, i);
    const J& b = content[i];
    const std::string& type = block_type(b, w);
    if (type == "text") {
      const J* t = member(b, "text");
      if (!t) bad(dot(w, "text"), "missing");
      if (have_text) m.content += "\n\n";
      m.content += want_string(*t, dot(w, "text"));
      have_text = true;
    } else if (type == "thinking") {
      const J* t = member(b, "thinking");
      if (!t) bad(dot(w, "thinking"), "missing");
      const std::string& thinking = want_string(*t, dot(w, "thinking"));
      const J* sig = member(b, "signature");
      if (sig) want_string(*sig, dot(w, "signature"));
      // Only this server's own reasoning is taken back (anything else: ignored, as Anthropic
      // ignores blocks it did not sign).
      if (sig && !st.ctx->secret.empty() &&
          mac_ok(st.ctx->secret, thinking, sig->get_ref<const std::string&>())) {
        if (m.reasoning_content) *m.reasoning_content += "\n\n" + thinking;
        else m.reasoning_content = thinking;
      }
    } else if (type == "redacted_thinking") {
      // ignored (§4.3)
    } else if (type == "tool_use") {
      text::ToolCall call;
      call.id = nonempty_string(b, "id", w);
      call.name = nonempty_string(b, "name", w);
      if (!st.tool_use_ids.insert(call.id).second)
        bad(dot(w, "id"), "duplicate tool_use id '" + call.id + "'");
      const J* input = member(b, "input");
      if (input) {
        want_object(*input, dot(w, "input"));
        call.arguments = pyjson::dumps(to_pyjson(*input, dot(w, "input")));
      } else {
        call.arguments = "{}";
      }
      m.tool_calls.push_back(std::move(call));
    } else if (type == "tool_result") {
      bad(dot(w, "type"), "tool_result blocks belong in a user message");
    } else {
      unsupported_block(w, type, "an assistant message");
    }
  }
  return m;
}

void parse_tools(const J& tools, GenRequest& req) {
  if (!tools.is_array()) bad("tools", std::string("expected an array, got ") + kind(tools));
  std::unordered_set<std::string> names;
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string w = at("tools", i);
    const J& t = want_object(tools[i], w);
    if (const J* ty = member(t, "type")) {
      const std::string& type = want_string(*ty, dot(w, "type"));
      if (type != "custom") {
        // A server tool (web_search_20250305, code_execution_..., bash_20250124, ...): the server
        // cannot run it and has no schema to show the model.
        const J* n = member(t, "name");
        t_dropped_tools.push_back(n && n->is_string() ? n->get<std::string>() + " (" + type + ")" : type);
        continue;
      }
    }
    const std::string& name = nonempty_string(t, "name", w);
    if (!names.insert(name).second) bad(dot(w, "name"), "duplicate tool name '" + name + "'");
    text::ToolSpec spec;
    spec.name = name;
    spec.function = pyjson::Value::object();
    spec.function.members.emplace_back("name", pyjson::Value::string(name));
    if (const J* d = member(t, "description"))
      spec.function.members.emplace_back("description", pyjson::Value::string(want_string(*d, dot(w, "description"))));
    const J* schema = member(t, "input_schema");
    if (!schema) bad(dot(w, "input_schema"), "missing");
    want_object(*schema, dot(w, "input_schema"));
    spec.function.members.emplace_back("parameters", to_pyjson(*schema, dot(w, "input_schema")));
    req.conv.tools.push_back(std::move(spec));
  }
}

void parse_tool_choice(const J& tc, GenRequest& req) {
  want_object(tc, "tool_choice");
  const J* ty = member(tc, "type");
  if (!ty) bad("tool_choice.type", "missing");
  const std::string& type = want_string(*ty, "tool_choice.type");
  if (type == "auto") {
    req.tool_choice = "auto";
  } else if (type == "any") {
    req.tool_choice = "required";
  } else if (type == "none") {
    req.tool_choice = "none";
    req.tools_enabled = false;
  } else if (type == "tool") {
    const std::string& name = nonempty_string(tc, "name", "tool_choice");
    bool found = false;
    for (const auto& t : req.conv.tools) found = found || t.name == name;
    if (!found) bad("tool_choice.name", "no tool named '" + name + "' in tools");
    req.tool_choice = name;
  } else {
    bad("tool_choice.type", "expected \"auto\", \"any\", \"none\" or \"tool\", got '" + type + "'");
  }
  if (const J* p = member(tc, "disable_parallel_tool_use")) want_bool(*p, "tool_choice.disable_parallel_tool_use");
}

void parse_request(const J& root, const AdapterContext& ctx, bool count_only, GenRequest& req) {
  if (!root.is_object()) bad("", std::string("the request body must be a JSON object, got ") + kind(root));
  req.api = "messages";
  req.id_prefix = "toolu_";
  req.model = ctx.model_id;
  if (const J* m = member(root, "model")) req.model = want_string(*m, "model");

  if (!count_only) {
    const J* mt = member(root, "max_tokens");
    if (!mt) bad("max_tokens", "missing (required by the Messages API)");
    req.max_tokens = want_int(*mt, "max_tokens");
    if (req.max_tokens < 1) bad("max_tokens", "must be at least 1");
    if (const J* s = member(root, "stream")) req.stream = want_bool(*s, "stream");
  }

  // sampling
  const J* temp = member(root, "temperature");
  const J* top_p = member(root, "top_p");
  const J* top_k = member(root, "top_k");
  if (temp || top_p || top_k) {
    req.sampling_given = true;
    req.sampling.temperature = 1.0f;  // the API's defaults for what was not given
    req.sampling.top_p = 1.0f;
    req.sampling.top_k = 0;
  }
  req.sampling.seed = std::stoull(text::random_hex(8), nullptr, 16);  // (the API has no seed)
  if (temp) {
    const double t = want_number(*temp, "temperature");
    if (!(t >= 0 && t <= 2)) bad("temperature", "must be between 0 and 2");
    req.sampling.temperature = static_cast<float>(t);
  }
  if (top_p) {
    const double p = want_number(*top_p, "top_p");
    if (!(p > 0 && p <= 1)) bad("top_p", "must be greater than 0 and at most 1");
    req.sampling.top_p = static_cast<float>(p);
  }
  if (top_k) {
    const int64_t k = want_int(*top_k, "top_k");
    if (k < 0) bad("top_k", "must not be negative");
    req.sampling.top_k = static_cast<int>(std::min<int64_t>(k, INT_MAX));
  }
  if (const J* ss = member(root, "stop_sequences")) {
    if (!ss->is_array()) bad("stop_sequences", std::string("expected an array of strings, got ") + kind(*ss));
    for (size_t i = 0; i < ss->size(); ++i) {
      const std::string& s = want_string((*ss)[i], at("stop_sequences", i));
      if (s.empty()) bad(at("stop_sequences", i), "must not be empty");
      req.stop.push_back(s);
    }
  }

  // thinking (on unless disabled, §4.5) and effort
  if (const J* th = member(root, "thinking")) {
    want_object(*th, "thinking");
    const J* ty = member(*th, "type");
    if (!ty) bad("thinking.type", "missing");
    const std::string& type = want_string(*ty, "thinking.type");
    if (type == "enabled" || type == "adaptive" || type == "auto") req.thinking = true;
    else if (type == "disabled") req.thinking = false;
    else bad("thinking.type", "expected \"enabled\", \"adaptive\" or \"disabled\", got '" + type + "'");
    if (const J* b = member(*th, "budget_tokens")) want_int(*b, "thinking.budget_tokens");  // (ignored)
  }
  if (const J* oc = member(root, "output_config")) {
    want_object(*oc, "output_config");
    if (const J* e = member(*oc, "effort")) {
      const std::string& effort = want_string(*e, "output_config.effort");
      text::ThinkingRequest tr;
      try {
        tr = text::map_api_effort(effort);
      } catch (const Error&) {
        bad("output_config.effort", "expected \"low\", \"medium\", \"high\" or \"max\", got '" + effort + "'");
      }
      if (!tr.thinking) req.thinking = false;
      else req.effort = tr.effort;
    }
  }

  // tools (before messages: tool_choice checks names)
  if (const J* tools = member(root, "tools")) parse_tools(*tools, req);
  if (const J* tc = member(root, "tool_choice")) parse_tool_choice(*tc, req);

  // system
  if (const J* sys = member(root, "system")) {
    if (auto s = system_text(*sys, "system")) {
      text::Message m;
      m.role = text::Role::System;
      m.content = std::move(*s);
      req.conv.messages.push_back(std::move(m));
    }
  }

  // messages
  const J* msgs = member(root, "messages");
  if (!msgs) bad("messages", "missing");
  if (!msgs->is_array()) bad("messages", std::string("expected an array, got ") + kind(*msgs));
  if (msgs->empty()) bad("messages", "must contain at least one message");
  ParseState st;
  st.ctx = &ctx;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const std::string w = at("messages", i);
    const J& m = want_object((*msgs)[i], w);
    const J* rv = member(m, "role");
    if (!rv) bad(dot(w, "role"), "missing");
    const std::string& role = want_string(*rv, dot(w, "role"));
    const J* content = member(m, "content");
    const std::string cw = dot(w, "content");
    if (!content) bad(cw, "missing");
    if (!content->is_string() && !content->is_array())
      bad(cw, std::string("expected a string or an array of content blocks, got ") + kind(*content));
    if (role == "user") {
      parse_user(*content, cw, st, req.conv.messages);
    } else if (role == "assistant") {
      text::Message a = parse_assistant(*content, cw, st);
      if (i + 1 == msgs->size()) {
        // A prefill: the answer continues this text (rendered without EOS, in chat mode).
        if (!a.tool_calls.empty())
          bad(cw, "the final assistant message has tool_use blocks; send their tool_result blocks in a user "
                  "message after it");
        a.wo_eos = true;
        req.thinking = false;
      }
      req.conv.messages.push_back(std::move(a));
    } else if (role == "system") {
      // Claude Code's mid-conversation system message: a system message in place.
      text::Message s;
      s.role = text::Role::System;
      if (auto t = system_text(*content, cw)) s.content = std::move(*t);
      req.conv.messages.push_back(std::move(s));
    } else {
      bad(dot(w, "role"), "unknown role '" + role + "' (expected \"user\", \"assistant\" or \"system\")");
    }
  }
}

bool parse_any(std::string_view body, const AdapterContext& ctx, bool count_only, GenRequest& out, ApiError& err) {
  t_dropped_tools.clear();
  auto fill = [&](std::string param, std::string message) {
    err = ApiError{};
    err.status = 400;
    err.type = "invalid_request_error";
    const size_t cut = param.find_first_of(".[");
    err.param = cut == std::string::npos ? param : param.substr(0, cut);
    err.message = param.empty() ? std::move(message) : param + ": " + message;
  };
  try {
    const J root = parse_body_json(body);
    GenRequest req;
    parse_request(root, ctx, count_only, req);
    out = std::move(req);
    return true;
  } catch (const BadRequest& b) {
    fill(b.where, b.what);
  } catch (const std::exception& e) {  // anything else the body provoked is still the client's
    fill("", std::string("invalid request: ") + e.what());
  }
  return false;
}

bool parse_messages(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err) {
  return parse_any(body, ctx, false, out, err);
}

// ---- errors ----------------------------------------------------------------------------------------------

std::string anthropic_error_type(const ApiError& e) {
  static const char* const kTypes[] = {"invalid_request_error", "authentication_error", "permission_error",
                                       "not_found_error",       "request_too_large",    "rate_limit_error",
                                       "api_error",             "overloaded_error"};
  for (const char* t : kTypes)
    if (e.type == t) return t;
  switch (e.status) {
    case 401: return "authentication_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503:
    case 529: return "overloaded_error";
    default: return e.status < 500 ? "invalid_request_error" : "api_error";
  }
}

std::string error_message(const ApiError& e) {
  std::string m = e.message.empty() ? "request failed" : e.message;
  // Claude Code compacts its conversation when the message says so (the API's wording).
  if (e.code == "context_length_exceeded" && !starts_with(m, "prompt is too long")) m = "prompt is too long: " + m;
  return m;
}

J error_json(const ApiError& e) {
  J j = J::object();
  j["type"] = "error";
  j["error"] = J::object();
  j["error"]["type"] = anthropic_error_type(e);
  j["error"]["message"] = error_message(e);
  return j;
}

std::string error_body(const ApiError& e) { return dump(error_json(e)); }

// ---- answers ---------------------------------------------------------------------------------------------

J usage_json(const Usage& u, bool with_output) {
  J j = J::object();
  j["input_tokens"] = std::max<int64_t>(0, u.prompt_tokens - u.cached_tokens);
  j["cache_creation_input_tokens"] = 0;
  j["cache_read_input_tokens"] = u.cached_tokens;
  j["output_tokens"] = with_output ? u.completion_tokens : 0;
  return j;
}

J stop_sequence_json(const text::ParseResult& r) {
  if (r.finish == text::FinishReason::StopSequence) return r.stop_sequence;
  return nullptr;
}

class MessagesSink : public Sink {
 public:
  MessagesSink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch)
      : ch_(std::move(ch)), stream_(req.stream), model_(req.model), secret_(ctx.secret),
        id_("msg_" + text::random_hex(12)) {}

  void start(const Usage& u) override {
    if (done_ || started_) return;
    started_ = true;
    if (!stream_) return;
    J msg = J::object();
    msg["id"] = id_;
    msg["type"] = "message";
    msg["role"] = "assistant";
    msg["model"] = model_;
    msg["content"] = J::array();
    msg["stop_reason"] = nullptr;
    msg["stop_sequence"] = nullptr;
    msg["usage"] = usage_json(u, false);
    J ev = J::object();
    ev["type"] = "message_start";
    ev["message"] = std::move(msg);
    send(ev);
    J ping = J::object();
    ping["type"] = "ping";
    send(ping);
  }

  void events(const std::vector<text::Event>& evs) override {
    if (done_ || !stream_) return;
    if (!started_) start(Usage{});
    for (const text::Event& e : evs) {
      if (done_) return;
      switch (e.type) {
        case text::EventType::ReasoningDelta:
          if (e.text.empty()) break;
          if (open_ != Block::Thinking) {
            close_block();
            J cb = J::object();
            cb["type"] = "thinking";
            cb["thinking"] = "";
            cb["signature"] = "";
            open_block(Block::Thinking, std::move(cb));
          }
          reasoning_ += e.text;
          delta("thinking_delta", "thinking", e.text);
          break;
        case text::EventType::ReasoningEnd:
          if (open_ == Block::Thinking) close_block();
          break;
        case text::EventType::ContentDelta:
          if (e.text.empty()) break;
          if (open_ != Block::Text) {
            close_block();
            open_text();
          }
          delta("text_delta", "text", e.text);
          break;
        case text::EventType::ToolCallStart: {
          close_block();
          J cb = J::object();
          cb["type"] = "tool_use";
          cb["id"] = e.id;
          cb["name"] = e.name;
          cb["input"] = J::object();
          open_block(Block::Tool, std::move(cb));
          had_answer_ = true;
          break;
        }
        case text::EventType::ToolCallDelta:
          if (open_ == Block::Tool && !e.text.empty()) delta("input_json_delta", "partial_json", e.text);
          break;
        case text::EventType::ToolCallEnd:
          if (open_ == Block::Tool) close_block();
          break;
        case text::EventType::Error:
          stream_error(e.text.empty() ? "the model produced an invalid tool call" : e.text, "api_error");
          return;
      }
    }
  }

  void keepalive() override {
    if (done_ || !stream_) return;
    if (!started_) {
      ch_->push(": keepalive\n\n");  // (events only after message_start)
      sent_any_ = true;
      return;
    }
    J ping = J::object();
    ping["type"] = "ping";
    send(ping);
  }

  void end(const text::ParseResult& r, const Usage& u) override {
    if (done_) return;
    if (!stream_) {
      finish_json(r, u);
      return;
    }
    if (!started_) start(u);
    if (done_) return;
    close_block();
    if (!had_answer_) {  // Claude Code expects a non-thinking block
      open_text();
      close_block();
    }
    J md = J::object();
    md["type"] = "message_delta";
    md["delta"] = J::object();
    md["delta"]["stop_reason"] = text::anthropic_stop_reason(r.finish);
    md["delta"]["stop_sequence"] = stop_sequence_json(r);
    md["usage"] = usage_json(u, true);
    send(md);
    J stop = J::object();
    stop["type"] = "message_stop";
    send(stop);
    done_ = true;
    ch_->close();
  }

  void fail(const ApiError& e) override {
    if (done_) return;
    if (stream_ && (started_ || sent_any_)) {  // (bytes of the stream are out: an in-stream error)
      stream_error(error_message(e), anthropic_error_type(e));
      return;
    }
    done_ = true;
    ch_->set_status(e.status, "application/json");
    ch_->push(error_body(e));
    ch_->close();
  }

  bool cancelled() const override { return ch_->cancelled(); }

 private:
  enum class Block { None, Thinking, Text, Tool };

  void send(const J& ev) {
    std::string s = "event: ";
    s += ev["type"].get<std::string>();
    s += "\ndata: ";
    s += dump(ev);
    s += "\n\n";
    ch_->push(std::move(s));
  }

  void open_block(Block b, J content_block) {
    J ev = J::object();
    ev["type"] = "content_block_start";
    ev["index"] = index_;
    ev["content_block"] = std::move(content_block);
    send(ev);
    open_ = b;
  }

  void open_text() {
    J cb = J::object();
    cb["type"] = "text";
    cb["text"] = "";
    open_block(Block::Text, std::move(cb));
    had_answer_ = true;
  }

  void delta(const char* type, const char* field, const std::string& text) {
    J ev = J::object();
    ev["type"] = "content_block_delta";
    ev["index"] = index_;
    ev["delta"] = J::object();
    ev["delta"]["type"] = type;
    ev["delta"][field] = text;
    send(ev);
  }

  void close_block() {
    if (open_ == Block::None) return;
    if (open_ == Block::Thinking) {
      J ev = J::object();
      ev["type"] = "content_block_delta";
      ev["index"] = index_;
      ev["delta"] = J::object();
      ev["delta"]["type"] = "signature_delta";
      ev["delta"]["signature"] = mac_hex(secret_, reasoning_);
      send(ev);
    }
    J ev = J::object();
    ev["type"] = "content_block_stop";
    ev["index"] = index_;
    send(ev);
    open_ = Block::None;
    ++index_;
  }

  void stream_error(const std::string& message, const std::string& type) {
    J ev = J::object();
    ev["type"] = "error";
    ev["error"] = J::object();
    ev["error"]["type"] = type;
    ev["error"]["message"] = message;
    send(ev);
    done_ = true;
    ch_->close();
  }

  void finish_json(const text::ParseResult& r, const Usage& u) {
    J content = J::array();
    if (!r.reasoning.empty()) {
      J b = J::object();
      b["type"] = "thinking";
      b["thinking"] = r.reasoning;
      b["signature"] = mac_hex(secret_, r.reasoning);
      content.push_back(std::move(b));
    }
    if (!r.content.empty() || r.tool_calls.empty()) {
      J b = J::object();
      b["type"] = "text";
      b["text"] = r.content;
      content.push_back(std::move(b));
    }
    for (const auto& c : r.tool_calls) {
      J b = J::object();
      b["type"] = "tool_use";
      b["id"] = c.id;
      b["name"] = c.name;
      b["input"] = arguments_object(c.arguments);
      content.push_back(std::move(b));
    }
    J msg = J::object();
    msg["id"] = id_;
    msg["type"] = "message";
    msg["role"] = "assistant";
    msg["model"] = model_;
    msg["content"] = std::move(content);
    msg["stop_reason"] = text::anthropic_stop_reason(r.finish);
    msg["stop_sequence"] = stop_sequence_json(r);
    msg["usage"] = usage_json(u, true);
    done_ = true;
    ch_->set_status(200, "application/json");
    ch_->push(dump(msg));
    ch_->close();
  }

  std::shared_ptr<Channel> ch_;
  bool stream_;
  std::string model_, secret_, id_;
  bool started_ = false, done_ = false, sent_any_ = false;
  bool had_answer_ = false;  // a text or tool_use block was sent
  Block open_ = Block::None;
  int index_ = 0;
  std::string reasoning_;
};

std::shared_ptr<Sink> make_sink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch) {
  return std::make_shared<MessagesSink>(req, ctx, std::move(ch));
}

}  // namespace

bool parse_count_tokens(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err) {
  return parse_any(body, ctx, true, out, err);
}

std::string count_tokens_body(int64_t n) {
  J j = J::object();
  j["input_tokens"] = n;
  return dump(j);
}

const std::vector<std::string>& last_dropped_tools() { return t_dropped_tools; }

const Adapter& messages_adapter() {
  static const Adapter a{Api::Messages, &parse_messages, &make_sink, &error_body};
  return a;
}

}  // namespace dsx::server
