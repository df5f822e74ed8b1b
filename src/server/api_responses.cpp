// The OpenAI Responses adapter (POST /v1/responses): what Codex CLI speaks (and opencode
// through @ai-sdk/openai). Spec chat-and-serving.md §3.3 (projection), §3.8 (terminal
// events), §4.3 (items -> internal messages), §4.5 (effort), §4.6 (usage, errors);
// ../shared/agents/README.md (what Codex sends and requires).
//
// Request -> GenRequest:
//   - `input`: a string (one user message) or items. Items with type "message" or with no
//     type at all (opencode's @ai-sdk/openai sends {role, content}): roles system and
//     developer -> system, user, assistant; content a string or text parts (input_text,
//     output_text, text, summary_text, reasoning_text, refusal), parts joined "\n\n";
//     images / files / audio -> 400 "text-only model".
//     "reasoning" items are the reasoning of the next assistant item: recovered exactly from
//     encrypted_content when it is one this server sealed (signing.h), else the summary and
//     content texts joined "\n". A reasoning item that no assistant item follows is dropped.
//     "function_call" / "custom_tool_call" -> assistant tool calls (call_id is the id; a custom
//     call's raw `input` becomes the arguments {"input": <input>}); consecutive assistant items
//     (message, calls) merge into one assistant message, a reasoning item after them starts
//     the next one. "function_call_output" / "custom_tool_call_output" -> tool messages.
//     "additional_tools" items (Codex's responses-lite layout) contribute their tools.
//     "item_reference" -> 400 (nothing is stored); other item types (hosted-tool history such
//     as web_search_call, compaction) are skipped.
//   - `instructions` -> a leading system message.
//   - `tools`: "function" -> {name, description, parameters} ("strict" dropped);
//     "namespace" -> its functions flattened under their own names (Codex 0.171 dispatches a
//     call by the (namespace, name) pair: without "namespace" on the function_call item it
//     answers "unsupported call", so such a call carries "namespace" again on output); "custom" (freeform, e.g. Codex's apply_patch) -> a function with one string
//     parameter "input" whose description carries the grammar, called back as a
//     custom_tool_call with the raw input; hosted tools (web_search, file_search, ...) dropped.
//     A name already taken by an earlier tool is dropped (the first one wins).
//     The routing the answer needs (which function came from which namespace, which tools are
//     freeform) travels in the tool objects themselves, as members the model also sees:
//     "namespace": "<ns>" and "freeform": true (GenRequest has no adapter-private state).
//   - tool_choice "auto" | "none" | "required" | {type: "function" | "custom", name} |
//     {type: "allowed_tools", mode}; parallel_tool_calls ignored.
//   - reasoning.effort via text::map_api_effort ("none": thinking off; model "deepseek-chat"
//     without an effort: off too); reasoning.summary is accepted and not needed: the reasoning
//     item is always emitted (Codex replays it, with encrypted_content, only if it got one),
//     its text as the summary.
//   - max_output_tokens (or max_tokens), temperature, top_p, stream, prompt_cache_key
//     (-> session_hint), text.format json_schema / json_object (-> response_format, in the
//     chat-completions shape {type:"json_schema", json_schema:{name, schema, strict}}).
//   - previous_response_id / conversation non-null, background, prompt -> 400; store, include,
//     metadata and unknown fields are ignored (encrypted_content is always emitted).
//
// Answer: the SSE event sequence of the Responses API (every event also as an `event:` line,
// with "type" and an increasing "sequence_number"): response.created, response.in_progress;
// a reasoning item (output_item.added, reasoning_summary_part.added, reasoning_summary_text.
// delta..., reasoning_summary_text.done, reasoning_summary_part.done, output_item.done with
// summary and encrypted_content); a message item (output_item.added, content_part.added,
// output_text.delta..., output_text.done, content_part.done, output_item.done); per tool call
// a function_call item (output_item.added, function_call_arguments.delta..., .done,
// output_item.done) or a custom_tool_call item (custom_tool_call_input.delta / .done with the
// raw input once the call is complete); then response.completed | response.incomplete
// (incomplete_details.reason "max_output_tokens") | response.failed, with the full output and
// usage. Non-streaming: the response object alone.
#include <nlohmann/json.hpp>

#include <cmath>
#include <ctime>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "server/adapters.h"
#include "server/signing.h"
#include "util/error.h"

namespace dsx::server {

namespace {

using json = nlohmann::ordered_json;
namespace pyjson = text::pyjson;


// A client error: `param` names the field (it is also the message's prefix).
struct BadRequest {
  std::string param;
  std::string message;
};

template <typename... Args>
[[noreturn]] void bad(const std::string& param, const Args&... args) {
  throw BadRequest{param, cat(args...)};
}

const char* kind_of(const json& j) {
  switch (j.type()) {
    case json::value_t::null: return "null";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
    case json::value_t::number_float: return "a number";
    case json::value_t::string: return "a string";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "an unsupported value";
  }
}

// The member `key` of object `o`, or nullptr when absent or null.
const json* member(const json& o, const char* key) {
  auto it = o.find(key);
  if (it == o.end() || it->is_null()) return nullptr;
  return &*it;
}

const std::string& want_string(const json& j, const std::string& where) {
  if (!j.is_string()) bad(where, where, ": expected a string, got ", kind_of(j));
  return j.get_ref<const std::string&>();
}

std::optional<std::string> opt_string(const json& o, const char* key, const std::string& where) {
  const json* v = member(o, key);
  if (!v) return std::nullopt;
  return want_string(*v, where + "." + key);
}

bool want_bool(const json& j, const std::string& where) {
  if (!j.is_boolean()) bad(where, where, ": expected a boolean, got ", kind_of(j));
  return j.get<bool>();
}

const json& want_object(const json& j, const std::string& where) {
  if (!j.is_object()) bad(where, where, ": expected an object, got ", kind_of(j));
  return j;
}

const json& want_array(const json& j, const std::string& where) {
  if (!j.is_array()) bad(where, where, ": expected an array, got ", kind_of(j));
  return j;
}

double want_number(const json& j, const std::string& where) {
  if (!j.is_number()) bad(where, where, ": expected a number, got ", kind_of(j));
  const double d = j.get<double>();
  if (!std::isfinite(d)) bad(where, where, ": expected a finite number");
  return d;
}

// A positive token limit; values beyond int64 (a huge integer, or an integral float such as
// 1e30) are clamped (and then exceed any context).
int64_t want_limit(const json& j, const std::string& where) {
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    v = u > uint64_t(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max() : int64_t(u);
  } else if (j.is_number_integer()) {
    v = j.get<int64_t>();
  } else if (j.is_number_float()) {
    const double d = j.get<double>();
    if (!std::isfinite(d) || d != std::floor(d)) bad(where, where, ": expected an integer");
    v = d >= 9.2e18 ? std::numeric_limits<int64_t>::max() : d <= -9.2e18 ? -1 : int64_t(d);
  } else {
    bad(where, where, ": expected an integer, got ", kind_of(j));
  }
  if (v < 1) bad(where, where, ": must be at least 1");
  return v;
}

std::string idx(const std::string& where, size_t i) { return where + "[" + std::to_string(i) + "]"; }

pyjson::Value to_py(const json& j, const std::string& where) {
  try {
    return pyjson::parse(j.dump());
  } catch (const std::exception& e) {
    bad(where, where, ": ", e.what());
  }
}

// The Python-compatible parse of the same body (integers of any size, floats as Python
// prints them) is where tool schemas and the response schema are taken from; these walk it
// alongside the nlohmann tree (nullptr when the counterpart is missing).
const pyjson::Value* py_get(const pyjson::Value* v, const char* key) {
  const pyjson::Value* m = v ? v->get(key) : nullptr;
  return m && !m->is_null() ? m : nullptr;
}
const pyjson::Value* py_at(const pyjson::Value* v, size_t i) {
  return v && v->is_array() && i < v->items.size() ? &v->items[i] : nullptr;
}
// `py` when it is the counterpart of `j` (same JSON type), else `j` converted.
pyjson::Value py_or(const pyjson::Value* py, const json& j, const std::string& where) {
  if (py && ((py->is_object() && j.is_object()) || (py->is_array() && j.is_array()))) return *py;
  return to_py(j, where);
}

bool is_text_part(const std::string& t) {
  return t == "input_text" || t == "output_text" || t == "text" || t == "summary_text" || t == "reasoning_text";
}
bool is_media_part(const std::string& t) {
  return t == "input_image" || t == "input_file" || t == "input_audio" || t == "image_url" || t == "image" ||
         t == "file" || t == "audio" || t == "computer_screenshot";
}

// Content: a string, or an array of text parts joined with "\n\n" (spec §4.3).
std::string content_text(const json* c, const std::string& where) {
  if (!c) return "";
  if (c->is_string()) return c->get<std::string>();
  if (!c->is_array()) bad(where, where, ": expected a string or an array of parts, got ", kind_of(*c));
  std::string out;
  for (size_t i = 0; i < c->size(); ++i) {
    const std::string w = idx(where, i);
    const json& p = (*c)[i];
    if (p.is_string()) {  // tolerated: a bare string part
      if (i) out += "\n\n";
      out += p.get<std::string>();
      continue;
    }
    want_object(p, w);
    std::string type;
    if (const json* t = member(p, "type")) type = want_string(*t, w + ".type");
    std::string text;
    if (type.empty() || is_text_part(type)) {
      const json* t = member(p, "text");
      if (!t) bad(w + ".text", w, ".text: missing");
      text = want_string(*t, w + ".text");
    } else if (type == "refusal") {
      const json* t = member(p, "refusal");
      text = t ? want_string(*t, w + ".refusal") : "";
    } else if (is_media_part(type)) {
      bad(w, w, ": '", type, "' content is not supported (text-only model)");
    } else {
      bad(w + ".type", w, ".type: unsupported content part type '", type, "'");
    }
    if (i) out += "\n\n";
    out += text;
  }
  return out;
}

// A tool call's output: a string, text parts, or {content: ...}.
std::string output_text(const json* o, const std::string& where) {
  if (o && o->is_object()) return content_text(member(*o, "content"), where + ".content");
  return content_text(o, where);
}

// ---------------------------------------------------------------------------------------------------------
// Tools

constexpr const char* kFreeformInput =
    "The tool's raw input, written verbatim as this string (it is not JSON; it is passed to the tool "
    "exactly as written).";

class ToolSet {
 public:
  void add_function(const json& t, const pyjson::Value* pt, const std::string& where, const std::string& ns) {
    const std::string name = tool_name(t, where);
    if (taken(name)) return;
    pyjson::Value fn = pyjson::Value::object();
    fn.members.emplace_back("name", pyjson::Value::string(name));
    if (!ns.empty()) fn.members.emplace_back("namespace", pyjson::Value::string(ns));
    if (auto d = opt_string(t, "description", where)) fn.members.emplace_back("description", pyjson::Value::string(*d));
    if (const json* p = member(t, "parameters")) {
      want_object(*p, where + ".parameters");
      fn.members.emplace_back("parameters", py_or(py_get(pt, "parameters"), *p, where + ".parameters"));
    }
    push(name, std::move(fn));
    if (!ns.empty()) by_ns_[{ns, name}] = name;
  }

  void add_custom(const json& t, const std::string& where) {
    const std::string name = tool_name(t, where);
    if (taken(name)) return;
    std::string input_desc = kFreeformInput;
    if (const json* f = member(t, "format")) {
      const std::string fw = where + ".format";
      want_object(*f, fw);
      const json* ft = member(*f, "type");
      const std::string type = ft ? want_string(*ft, fw + ".type") : "text";
      if (type == "grammar") {
        const std::string syntax = opt_string(*f, "syntax", fw).value_or("lark");
        const std::string def = opt_string(*f, "definition", fw).value_or("");
        input_desc += " It must conform to this " + syntax + " grammar:\n" + def;
      } else if (type != "text") {
        bad(fw + ".type", fw, ".type: unsupported custom tool format '", type, "'");
      }
    }
    pyjson::Value fn = pyjson::Value::object();
    fn.members.emplace_back("name", pyjson::Value::string(name));
    pyjson::Value yes;
    yes.type = pyjson::Type::Bool;
    yes.boolean = true;
    fn.members.emplace_back("freeform", yes);
    if (auto d = opt_string(t, "description", where)) fn.members.emplace_back("description", pyjson::Value::string(*d));
    pyjson::Value input = pyjson::Value::object();
    input.members.emplace_back("type", pyjson::Value::string("string"));
    input.members.emplace_back("description", pyjson::Value::string(input_desc));
    pyjson::Value props = pyjson::Value::object();
    props.members.emplace_back("input", std::move(input));
    pyjson::Value req;
    req.type = pyjson::Type::Array;
    req.items.push_back(pyjson::Value::string("input"));
    pyjson::Value no;
    no.type = pyjson::Type::Bool;
    pyjson::Value params = pyjson::Value::object();
    params.members.emplace_back("type", pyjson::Value::string("object"));
    params.members.emplace_back("properties", std::move(props));
    params.members.emplace_back("required", std::move(req));
    params.members.emplace_back("additionalProperties", no);
    fn.members.emplace_back("parameters", std::move(params));
    push(name, std::move(fn));
  }

  // One entry of `tools` (or of a namespace's / an additional_tools item's tools).
  void add(const json& t, const pyjson::Value* pt, const std::string& where, const std::string& ns = "") {
    want_object(t, where);
    std::string type = "function";
    if (const json* ty = member(t, "type")) type = want_string(*ty, where + ".type");
    if (type == "function") {
      add_function(t, pt, where, ns);
    } else if (type == "custom") {
      add_custom(t, where);
    } else if (type == "namespace" && ns.empty()) {
      const std::string name = tool_name(t, where);
      const json* inner = member(t, "tools");
      if (!inner) return;
      want_array(*inner, where + ".tools");
      const pyjson::Value* pin = py_get(pt, "tools");
      for (size_t i = 0; i < inner->size(); ++i) add((*inner)[i], py_at(pin, i), idx(where + ".tools", i), name);
    }
    // Hosted tools (web_search, file_search, code_interpreter, local_shell, mcp, tool_search,
    // image_generation, ...) cannot run here: dropped.
  }

  void add_all(const json& tools, const pyjson::Value* pt, const std::string& where) {
    want_array(tools, where);
    for (size_t i = 0; i < tools.size(); ++i) add(tools[i], py_at(pt, i), idx(where, i));
  }

  // The model-visible name of a call to function `name` of namespace `ns`.
  std::string visible(const std::string& ns, const std::string& name) const {
    if (!ns.empty()) {
      auto it = by_ns_.find({ns, name});
      if (it != by_ns_.end()) return it->second;
    }
    return name;
  }
  bool has(const std::string& name) const { return names_.count(name) != 0; }
  std::vector<text::ToolSpec> take() { return std::move(specs_); }

 private:
  static std::string tool_name(const json& t, const std::string& where) {
    const json* n = member(t, "name");
    if (!n) bad(where + ".name", where, ".name: missing");
    const std::string& s = want_string(*n, where + ".name");
    if (s.empty()) bad(where + ".name", where, ".name: empty");
    return s;
  }
  bool taken(const std::string& name) const { return names_.count(name) != 0; }
  void push(const std::string& name, pyjson::Value fn) {
    names_.insert(name);
    specs_.push_back(text::ToolSpec{name, std::move(fn)});
  }

  std::vector<text::ToolSpec> specs_;
  std::set<std::string> names_;
  std::map<std::pair<std::string, std::string>, std::string> by_ns_;
};

// ---------------------------------------------------------------------------------------------------------
// Input items -> messages

class InputBuilder {
 public:
  InputBuilder(const AdapterContext& ctx, const ToolSet& tools) : ctx_(ctx), tools_(tools) {}

  void add_item(const json& item, const std::string& where) {
    want_object(item, where);
    std::string type;
    if (const json* t = member(item, "type")) type = want_string(*t, where + ".type");
    if (type.empty() || type == "message") return add_message(item, where);
    if (type == "reasoning") return add_reasoning(item, where);
    if (type == "function_call") return add_function_call(item, where);
    if (type == "custom_tool_call") return add_custom_call(item, where);
    if (type == "function_call_output" || type == "custom_tool_call_output") return add_output(item, where);
    if (type == "item_reference")
      bad(where, where, ": item_reference is not supported (nothing is stored); replay the full input instead");
    // additional_tools (handled by the caller), hosted-tool history, compaction, ...: skipped.
  }

  std::vector<text::Message> take() { return std::move(msgs_); }

 private:
  void add_message(const json& item, const std::string& where) {
    const json* r = member(item, "role");
    if (!r) bad(where + ".role", where, ".role: missing");
    const std::string& role = want_string(*r, where + ".role");
    const std::string content = content_text(member(item, "content"), where + ".content");
    if (role == "assistant") {
      text::Message& m = assistant();
      if (!m.content.empty() && !content.empty()) m.content += "\n\n";
      m.content += content;
      return;
    }
    text::Message m;
    if (role == "system" || role == "developer") m.role = text::Role::System;
    else if (role == "user") m.role = text::Role::User;
    else bad(where + ".role", where, ".role: unknown role '", role, "' (expected system, developer, user or assistant)");
    m.content = content;
    push(std::move(m));
  }

  void add_reasoning(const json& item, const std::string& where) {
    std::optional<std::string> text;
    if (const json* enc = member(item, "encrypted_content")) {
      if (auto t = open(ctx_.secret, want_string(*enc, where + ".encrypted_content"))) text = std::move(*t);
    }
    if (!text) {
      std::vector<std::string> parts;
      auto collect = [&](const char* key, bool summary) {
        const json* arr = member(item, key);
        if (!arr) return;
        const std::string w = where + "." + key;
        want_array(*arr, w);
        for (size_t i = 0; i < arr->size(); ++i) {
          const std::string wi = idx(w, i);
          const json& p = want_object((*arr)[i], wi);
          std::string type = summary ? "summary_text" : "reasoning_text";
          if (const json* t = member(p, "type")) type = want_string(*t, wi + ".type");
          if (!is_text_part(type)) bad(wi + ".type", wi, ".type: unsupported reasoning part type '", type, "'");
          const json* tx = member(p, "text");
          parts.push_back(tx ? want_string(*tx, wi + ".text") : "");
        }
      };
      collect("summary", true);
      collect("content", false);
      if (!parts.empty()) {
        std::string joined;
        for (size_t i = 0; i < parts.size(); ++i) joined += (i ? "\n" : "") + parts[i];
        text = std::move(joined);
      }
    }
    // A reasoning item opens the next response's output: the open assistant message is done.
    if (open_) {
      const text::Message& m = msgs_.back();
      if (!m.content.empty() || !m.tool_calls.empty() || m.reasoning_content) open_ = false;
    }
    if (!text) return;
    if (pending_) *pending_ += "\n" + *text;
    else pending_ = std::move(text);
  }

  void add_function_call(const json& item, const std::string& where) {
    text::ToolCall c;
    c.id = call_id(item, where);
    const json* n = member(item, "name");
    if (!n) bad(where + ".name", where, ".name: missing");
    const std::string ns = opt_string(item, "namespace", where).value_or("");
    c.name = tools_.visible(ns, want_string(*n, where + ".name"));
    const json* a = member(item, "arguments");
    if (!a) c.arguments = "{}";
    else if (a->is_string()) c.arguments = a->get<std::string>();
    else if (a->is_object()) c.arguments = pyjson::dumps(to_py(*a, where + ".arguments"));  // tolerated
    else bad(where + ".arguments", where, ".arguments: expected a string, got ", kind_of(*a));
    assistant().tool_calls.push_back(std::move(c));
  }

  void add_custom_call(const json& item, const std::string& where) {
    text::ToolCall c;
    c.id = call_id(item, where);
    const json* n = member(item, "name");
    if (!n) bad(where + ".name", where, ".name: missing");
    c.name = want_string(*n, where + ".name");
    const json* in = member(item, "input");
    pyjson::Value args = pyjson::Value::object();
    args.members.emplace_back("input", pyjson::Value::string(in ? want_string(*in, where + ".input") : ""));
    c.arguments = pyjson::dumps(args);
    assistant().tool_calls.push_back(std::move(c));
  }

  void add_output(const json& item, const std::string& where) {
    text::Message m;
    m.role = text::Role::Tool;
    m.tool_call_id = call_id(item, where);
    m.content = output_text(member(item, "output"), where + ".output");
    push(std::move(m));
  }

  static std::string call_id(const json& item, const std::string& where) {
    const json* c = member(item, "call_id");
    if (!c) bad(where + ".call_id", where, ".call_id: missing");
    const std::string& s = want_string(*c, where + ".call_id");
    if (s.empty()) bad(where + ".call_id", where, ".call_id: empty");
    return s;
  }

  // The assistant message the current item merges into (opened on demand, taking the
  // pending reasoning).
  text::Message& assistant() {
    if (!open_) {
      text::Message m;
      m.role = text::Role::Assistant;
      m.reasoning_content = std::move(pending_);
      pending_.reset();
      msgs_.push_back(std::move(m));
      open_ = true;
    }
    return msgs_.back();
  }

  void push(text::Message m) {
    open_ = false;
    pending_.reset();  // reasoning that no assistant item followed
    msgs_.push_back(std::move(m));
  }

  const AdapterContext& ctx_;
  const ToolSet& tools_;
  std::vector<text::Message> msgs_;
  std::optional<std::string> pending_;
  bool open_ = false;
};

void parse_tool_choice(const json& tc, const ToolSet& tools, GenRequest& out) {
  const std::string where = "tool_choice";
  if (tc.is_string()) {
    const std::string& s = tc.get_ref<const std::string&>();
    if (s != "auto" && s != "none" && s != "required")
      bad(where, where, ": expected \"auto\", \"none\", \"required\" or an object, got '", s, "'");
    out.tool_choice = s;
    return;
  }
  want_object(tc, where);
  const json* t = member(tc, "type");
  if (!t) bad(where + ".type", where, ".type: missing");
  const std::string& type = want_string(*t, where + ".type");
  if (type == "function" || type == "custom") {
    const json* n = member(tc, "name");
    if (!n) bad(where + ".name", where, ".name: missing");
    const std::string ns = opt_string(tc, "namespace", where).value_or("");
    const std::string name = tools.visible(ns, want_string(*n, where + ".name"));
    if (!tools.has(name)) bad(where + ".name", where, ".name: no tool named '", name, "'");
    out.tool_choice = name;
  } else if (type == "allowed_tools") {
    const std::string mode = opt_string(tc, "mode", where).value_or("auto");
    if (mode != "auto" && mode != "required") bad(where + ".mode", where, ".mode: expected \"auto\" or \"required\"");
    out.tool_choice = mode;
  } else if (type == "auto" || type == "none" || type == "required") {
    out.tool_choice = type;
  } else {
    bad(where + ".type", where, ".type: unsupported tool choice '", type, "' (hosted tools are not available)");
  }
}

void parse_text_format(const json& t, const pyjson::Value* pt, GenRequest& out) {
  want_object(t, "text");
  const json* f = member(t, "format");
  if (!f) return;
  const std::string w = "text.format";
  want_object(*f, w);
  const json* ty = member(*f, "type");
  if (!ty) bad(w + ".type", w, ".type: missing");
  const std::string& type = want_string(*ty, w + ".type");
  if (type == "text") return;
  if (type == "json_object") {
    out.response_format = to_py(json{{"type", "json_object"}}, w);
    return;
  }
  if (type != "json_schema") bad(w + ".type", w, ".type: unsupported format '", type, "'");
  const json* schema = member(*f, "schema");
  if (!schema) bad(w + ".schema", w, ".schema: missing");
  want_object(*schema, w + ".schema");
  pyjson::Value js = pyjson::Value::object();
  js.members.emplace_back("name", pyjson::Value::string(opt_string(*f, "name", w).value_or("response")));
  if (auto d = opt_string(*f, "description", w)) js.members.emplace_back("description", pyjson::Value::string(*d));
  js.members.emplace_back("schema", py_or(py_get(py_get(pt, "format"), "schema"), *schema, w + ".schema"));
  if (const json* s = member(*f, "strict")) {
    pyjson::Value b;
    b.type = pyjson::Type::Bool;
    b.boolean = want_bool(*s, w + ".strict");
    js.members.emplace_back("strict", b);
  }
  pyjson::Value rf = pyjson::Value::object();
  rf.members.emplace_back("type", pyjson::Value::string("json_schema"));
  rf.members.emplace_back("json_schema", std::move(js));
  out.response_format = std::move(rf);
}

void parse_request(std::string_view body, const AdapterContext& ctx, GenRequest& out) {
  if (!json_depth_ok(body)) bad("", "request body: invalid JSON: nested deeper than ", kMaxRequestDepth, " levels");
  json root;
  try {
    root = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {  // parse_error, out_of_range (number overflow)
    std::string m = e.what();
    if (m.rfind("[json.exception", 0) == 0 && m.find("] ") != std::string::npos) m = m.substr(m.find("] ") + 2);
    bad("", "request body: invalid JSON: ", m);
  }
  if (!root.is_object()) bad("", "request body: expected a JSON object, got ", kind_of(root));
  pyjson::Value py_root;
  const pyjson::Value* py = nullptr;
  if (pyjson::try_parse(body, py_root)) py = &py_root;

  for (const char* k : {"previous_response_id", "conversation"})
    if (member(root, k)) bad(k, k, " is not supported; replay the full input instead");
  if (const json* b = member(root, "background"); b && want_bool(*b, "background"))
    bad("background", "background: background responses are not supported");
  if (member(root, "prompt")) bad("prompt", "prompt: stored prompt templates are not supported");

  out.api = "responses";
  out.id_prefix = "call_";
  if (const json* m = member(root, "model")) out.model = want_string(*m, "model");
  if (out.model.empty()) out.model = ctx.model_id;

  // Tools first: the history's calls of namespaced functions map to their visible names.
  ToolSet tools;
  if (const json* t = member(root, "tools")) tools.add_all(*t, py_get(py, "tools"), "tools");
  const json* input = member(root, "input");
  if (!input) bad("input", "input: missing");
  if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) {
      const json& it = (*input)[i];
      if (!it.is_object()) continue;  // (reported below)
      const json* ty = member(it, "type");
      if (ty && ty->is_string() && ty->get<std::string>() == "additional_tools")
        if (const json* t = member(it, "tools"))
          tools.add_all(*t, py_get(py_at(py_get(py, "input"), i), "tools"), idx("input", i) + ".tools");
    }
  }

  InputBuilder b(ctx, tools);
  if (input->is_string()) {
    json item = {{"role", "user"}, {"content", *input}};
    b.add_item(item, "input");
  } else if (input->is_array()) {
    for (size_t i = 0; i < input->size(); ++i) b.add_item((*input)[i], idx("input", i));
  } else {
    bad("input", "input: expected a string or an array of items, got ", kind_of(*input));
  }
  std::vector<text::Message> msgs = b.take();
  if (const json* ins = member(root, "instructions")) {
    text::Message sys;
    sys.role = text::Role::System;
    sys.content = want_string(*ins, "instructions");
    msgs.insert(msgs.begin(), std::move(sys));
  }
  if (msgs.empty()) bad("input", "input: no messages");
  out.conv.messages = std::move(msgs);

  if (const json* tc = member(root, "tool_choice")) parse_tool_choice(*tc, tools, out);
  out.tools_enabled = out.tool_choice != "none";
  out.conv.tools = tools.take();
  if (const json* p = member(root, "parallel_tool_calls")) want_bool(*p, "parallel_tool_calls");

  out.thinking = out.model != "deepseek-chat";  // spec §4.4: that alias means thinking off, unless an effort is given
  if (const json* r = member(root, "reasoning")) {
    want_object(*r, "reasoning");
    if (const json* e = member(*r, "effort")) {
      std::string s;
      if (e->is_number_integer()) s = std::to_string(e->get<int64_t>());
      else s = want_string(*e, "reasoning.effort");
      try {
        const text::ThinkingRequest tr = text::map_api_effort(s);
        out.thinking = tr.thinking;
        out.effort = tr.effort;
      } catch (const Error&) {
        bad("reasoning.effort", "reasoning.effort: unsupported value '", s,
            "' (expected none, minimal, low, medium, high, xhigh, max or 1-100)");
      }
    }
    if (const json* s = member(*r, "summary")) want_string(*s, "reasoning.summary");
  }

  const char* limit_key = member(root, "max_output_tokens") ? "max_output_tokens" : "max_tokens";
  if (const json* mt = member(root, limit_key)) {
    out.max_tokens = want_limit(*mt, limit_key);
    if (ctx.context_tokens > 0 && out.max_tokens > ctx.context_tokens)
      bad(limit_key, limit_key, ": ", out.max_tokens, " exceeds this server's context of ", ctx.context_tokens, " tokens");
  }

  const json* temp = member(root, "temperature");
  const json* top_p = member(root, "top_p");
  if (temp || top_p) {
    out.sampling_given = true;
    out.sampling.temperature = 1.0f;
    out.sampling.top_p = 1.0f;
    if (temp) {
      const double t = want_number(*temp, "temperature");
      if (t < 0 || t > 2) bad("temperature", "temperature: must be between 0 and 2");
      out.sampling.temperature = float(t);
    }
    if (top_p) {
      const double p = want_number(*top_p, "top_p");
      if (!(p > 0) || p > 1) bad("top_p", "top_p: must be greater than 0 and at most 1");
      out.sampling.top_p = float(p);
    }
  }

  if (const json* s = member(root, "stream")) out.stream = want_bool(*s, "stream");
  if (const json* s = member(root, "store")) want_bool(*s, "store");
  if (const json* inc = member(root, "include")) {
    want_array(*inc, "include");
    for (size_t i = 0; i < inc->size(); ++i) want_string((*inc)[i], idx("include", i));
  }
  if (const json* k = member(root, "prompt_cache_key")) out.session_hint = want_string(*k, "prompt_cache_key");
  if (const json* t = member(root, "text")) parse_text_format(*t, py_get(py, "text"), out);
  // No seed in the Responses API: a fresh one per request (as the chat adapter does).
  out.sampling.seed = std::stoull(text::random_hex(8), nullptr, 16);
}

// ---------------------------------------------------------------------------------------------------------
// The answer

std::string new_item_id(const char* prefix) { return prefix + text::random_hex(12); }

json usage_json(const Usage& u) {
  return json{{"input_tokens", u.prompt_tokens},
              {"input_tokens_details", {{"cached_tokens", u.cached_tokens}}},
              {"output_tokens", u.completion_tokens},
              {"output_tokens_details", {{"reasoning_tokens", u.reasoning_tokens}}},
              {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body_json(const ApiError& e) {
  json err = {{"message", e.message},
              {"type", e.type},
              {"param", e.param.empty() ? json(nullptr) : json(e.param)},
              {"code", e.code.empty() ? json(nullptr) : json(e.code)}};
  return dump(json{{"error", err}});
}

// A custom tool's raw input from the model's arguments {"input": "..."} (or the only string
// member; else the arguments text itself).
std::string custom_input(const std::string& args) {
  json j = json::parse(args, nullptr, false);
  if (j.is_object()) {
    auto it = j.find("input");
    if (it != j.end() && it->is_string()) return it->get<std::string>();
    if (j.empty()) return "";
    if (j.size() == 1 && j.begin()->is_string()) return j.begin()->get<std::string>();
  }
  return args;
}

class ResponsesSink final : public Sink {
 public:
  ResponsesSink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch)
      : ch_(std::move(ch)),
        secret_(ctx.secret),
        model_(req.model.empty() ? ctx.model_id : req.model),
        stream_(req.stream),
        max_tokens_(req.max_tokens),
        tool_choice_(req.tool_choice),
        id_(new_item_id("resp_")),
        created_(int64_t(std::time(nullptr))) {
    for (const text::ToolSpec& t : req.conv.tools) {
      if (const pyjson::Value* ns = t.function.get("namespace"); ns && ns->is_string()) ns_[t.name] = ns->text;
      if (const pyjson::Value* f = t.function.get("freeform"); f && f->type == pyjson::Type::Bool && f->boolean)
        freeform_.insert(t.name);
    }
  }

  void start(const Usage& u) override {
    usage_ = u;
    if (!stream_ || started_ || finished_) return;
    started_ = true;
    emit("response.created", {{"response", response("in_progress", nullptr)}});
    emit("response.in_progress", {{"response", response("in_progress", nullptr)}});
  }

  void events(const std::vector<text::Event>& evs) override {
    if (!stream_ || finished_) return;
    if (!started_) start(usage_);
    for (const text::Event& e : evs) {
      if (finished_) return;
      on_event(e);
    }
  }

  void keepalive() override {
    if (stream_ && !finished_) ch_->push(": keepalive\n\n");
  }

  void end(const text::ParseResult& r, const Usage& u) override {
    if (finished_) return;
    usage_ = u;
    const text::ResponsesTerminal term = text::responses_terminal(r.finish);
    const bool length = r.finish == text::FinishReason::Length;
    if (!stream_) {
      json out = json::array();
      if (!r.reasoning.empty())
        out.push_back(reasoning_item(new_item_id("rs_"), r.reasoning, r.reasoning_closed ? "completed" : "incomplete"));
      if (!r.content.empty())
        out.push_back(message_item(new_item_id("msg_"), r.content, length ? "incomplete" : "completed"));
      for (const text::ParsedToolCall& c : r.tool_calls) out.push_back(call_item(c.id, c.name, c.arguments, "completed"));
      output_ = std::move(out);
      ch_->set_status(200, "application/json");
      ch_->push(dump(response(term.status, term.incomplete_reason, true)));
      finished_ = true;
      ch_->close();
      return;
    }
    if (!started_) start(u);
    reconcile(r);
    close_reasoning(r.reasoning_closed ? "completed" : "incomplete");
    close_message(length ? "incomplete" : "completed");
    emit(term.event, {{"response", response(term.status, term.incomplete_reason, true)}});
    finished_ = true;
    ch_->close();
  }

  // A streaming answer always fails in-stream (response.failed, with the error's code, e.g.
  // context_length_exceeded, which Codex recognises): the HTTP layer sends a stream's 200
  // and SSE headers before the first byte comes, and keep-alives may already have gone out
  // while the request waited. A non-streaming one gets the error body and status.
  void fail(const ApiError& e) override {
    if (finished_) return;
    finished_ = true;
    if (!stream_) {
      ch_->set_status(e.status, "application/json");
      ch_->push(error_body_json(e));
      ch_->close();
      return;
    }
    failed(e.code.empty() ? e.type : e.code, e.message);
  }

  bool cancelled() const override { return ch_->cancelled(); }

 private:
  enum class Kind { Reasoning, Message, Call, Custom };
  struct Item {
    Kind kind;
    std::string id;
    std::string text;  // reasoning / content / arguments
    std::string call_id, name;
    bool open = true;
  };

  void on_event(const text::Event& e) {
    using T = text::EventType;
    switch (e.type) {
      case T::ReasoningDelta: {
        if (e.text.empty()) break;
        Item* it = current(Kind::Reasoning);
        if (!it) it = open_reasoning();
        it->text += e.text;
        emit("response.reasoning_summary_text.delta",
             {{"item_id", it->id}, {"output_index", index_of(*it)}, {"summary_index", 0}, {"delta", e.text}});
        break;
      }
      case T::ReasoningEnd: close_reasoning("completed"); break;
      case T::ContentDelta: {
        if (e.text.empty()) break;
        close_reasoning("completed");
        Item* it = current(Kind::Message);
        if (!it) it = open_message();
        it->text += e.text;
        emit("response.output_text.delta", {{"item_id", it->id},
                                            {"output_index", index_of(*it)},
                                            {"content_index", 0},
                                            {"delta", e.text},
                                            {"logprobs", json::array()}});
        break;
      }
      case T::ToolCallStart: {
        close_reasoning("completed");
        close_message("completed");
        open_call(e.id, e.name);
        break;
      }
      case T::ToolCallDelta: {
        Item* it = current_call(e.id);
        if (!it || e.text.empty()) break;
        it->text += e.text;
        if (it->kind == Kind::Call)
          emit("response.function_call_arguments.delta",
               {{"item_id", it->id}, {"output_index", index_of(*it)}, {"delta", e.text}});
        break;
      }
      case T::ToolCallEnd: {
        Item* it = current_call(e.id);
        if (!it) it = open_call(e.id, e.name);
        it->text = e.text;
        close_call(*it);
        break;
      }
      case T::Error: failed("server_error", e.text.empty() ? "invalid tool call" : e.text); break;
    }
  }

  // Items the events left out but the result has (a scheduler that only reports the end).
  void reconcile(const text::ParseResult& r) {
    bool have_reasoning = false, have_message = false;
    size_t calls = 0;
    for (const Item& it : items_) {
      have_reasoning |= it.kind == Kind::Reasoning;
      have_message |= it.kind == Kind::Message;
      calls += it.kind == Kind::Call || it.kind == Kind::Custom;
    }
    if (!have_reasoning && !r.reasoning.empty() && items_.empty()) {
      on_event(text::Event{text::EventType::ReasoningDelta, r.reasoning, -1, "", ""});
      if (r.reasoning_closed) close_reasoning("completed");
    }
    if (!r.content.empty()) {
      Item* m = current(Kind::Message);
      if (m && r.content.size() > m->text.size() && r.content.compare(0, m->text.size(), m->text) == 0) {
        on_event(text::Event{text::EventType::ContentDelta, r.content.substr(m->text.size()), -1, "", ""});
      } else if (!have_message && calls == 0) {
        on_event(text::Event{text::EventType::ContentDelta, r.content, -1, "", ""});
      }
    }
    for (size_t k = calls; k < r.tool_calls.size(); ++k) {
      const text::ParsedToolCall& c = r.tool_calls[k];
      on_event(text::Event{text::EventType::ToolCallStart, "", int(k), c.id, c.name});
      on_event(text::Event{text::EventType::ToolCallEnd, c.arguments, int(k), c.id, c.name});
    }
  }

  Item* current(Kind k) {
    if (items_.empty() || !items_.back().open || items_.back().kind != k) return nullptr;
    return &items_.back();
  }
  Item* current_call(const std::string& id) {
    if (items_.empty()) return nullptr;
    Item& it = items_.back();
    if (!it.open || (it.kind != Kind::Call && it.kind != Kind::Custom)) return nullptr;
    if (!id.empty() && it.call_id != id) return nullptr;
    return &it;
  }
  int index_of(const Item& it) const { return int(&it - items_.data()); }

  Item* open_reasoning() {
    items_.push_back(Item{Kind::Reasoning, new_item_id("rs_"), "", "", "", true});
    Item& it = items_.back();
    const int i = index_of(it);
    emit("response.output_item.added",
         {{"output_index", i},
          {"item", {{"type", "reasoning"}, {"id", it.id}, {"summary", json::array()}, {"status", "in_progress"}}}});
    emit("response.reasoning_summary_part.added", {{"item_id", it.id},
                                                   {"output_index", i},
                                                   {"summary_index", 0},
                                                   {"part", {{"type", "summary_text"}, {"text", ""}}}});
    return &items_.back();
  }

  void close_reasoning(const char* status) {
    Item* it = current(Kind::Reasoning);
    if (!it) return;
    it->open = false;
    const int i = index_of(*it);
    emit("response.reasoning_summary_text.done",
         {{"item_id", it->id}, {"output_index", i}, {"summary_index", 0}, {"text", it->text}});
    emit("response.reasoning_summary_part.done", {{"item_id", it->id},
                                                  {"output_index", i},
                                                  {"summary_index", 0},
                                                  {"part", {{"type", "summary_text"}, {"text", it->text}}}});
    done(*it, reasoning_item(it->id, it->text, status));
  }

  Item* open_message() {
    items_.push_back(Item{Kind::Message, new_item_id("msg_"), "", "", "", true});
    Item& it = items_.back();
    const int i = index_of(it);
    emit("response.output_item.added", {{"output_index", i},
                                        {"item",
                                         {{"type", "message"},
                                          {"id", it.id},
                                          {"status", "in_progress"},
                                          {"role", "assistant"},
                                          {"content", json::array()}}}});
    emit("response.content_part.added", {{"item_id", it.id},
                                         {"output_index", i},
                                         {"content_index", 0},
                                         {"part", text_part("")}});
    return &items_.back();
  }

  void close_message(const char* status) {
    Item* it = current(Kind::Message);
    if (!it) return;
    it->open = false;
    const int i = index_of(*it);
    emit("response.output_text.done", {{"item_id", it->id},
                                       {"output_index", i},
                                       {"content_index", 0},
                                       {"text", it->text},
                                       {"logprobs", json::array()}});
    emit("response.content_part.done",
         {{"item_id", it->id}, {"output_index", i}, {"content_index", 0}, {"part", text_part(it->text)}});
    done(*it, message_item(it->id, it->text, status));
  }

  Item* open_call(const std::string& call_id, const std::string& name) {
    const bool custom = freeform_.count(name) != 0;
    items_.push_back(Item{custom ? Kind::Custom : Kind::Call, new_item_id(custom ? "ctc_" : "fc_"), "", call_id, name,
                          true});
    Item& it = items_.back();
    json item = custom ? custom_item(it.id, call_id, name, "", "in_progress")
                       : function_item(it.id, call_id, name, "", "in_progress");
    emit("response.output_item.added", {{"output_index", index_of(it)}, {"item", item}});
    return &items_.back();
  }

  void close_call(Item& it) {
    it.open = false;
    const int i = index_of(it);
    if (it.kind == Kind::Custom) {
      const std::string input = custom_input(it.text);
      if (!input.empty())
        emit("response.custom_tool_call_input.delta",
             {{"item_id", it.id}, {"output_index", i}, {"call_id", it.call_id}, {"delta", input}});
      emit("response.custom_tool_call_input.done",
           {{"item_id", it.id}, {"output_index", i}, {"call_id", it.call_id}, {"input", input}});
      done(it, custom_item(it.id, it.call_id, it.name, input, "completed"));
    } else {
      emit("response.function_call_arguments.done",
           {{"item_id", it.id}, {"output_index", i}, {"name", it.name}, {"arguments", it.text}});
      done(it, function_item(it.id, it.call_id, it.name, it.text, "completed"));
    }
  }

  void done(const Item& it, json item) {
    const size_t i = size_t(index_of(it));
    if (output_.size() <= i) output_.push_back(item);  // items close in order
    else output_[i] = item;
    emit("response.output_item.done", {{"output_index", int(i)}, {"item", std::move(item)}});
  }

  void failed(const std::string& code, const std::string& message) {
    finished_ = true;
    // Items still open are reported as they stand (incomplete); the response failed.
    json resp = response("failed", nullptr, true);
    resp["error"] = {{"code", code}, {"message", message}};
    emit("response.failed", {{"response", std::move(resp)}});
    ch_->close();
  }

  static json text_part(const std::string& text) {
    return {{"type", "output_text"}, {"text", text}, {"annotations", json::array()}, {"logprobs", json::array()}};
  }

  json reasoning_item(const std::string& id, const std::string& text, const char* status) const {
    json item = {{"type", "reasoning"}, {"id", id}, {"summary", json::array()}};
    if (!text.empty()) item["summary"].push_back({{"type", "summary_text"}, {"text", text}});
    item["encrypted_content"] = seal(secret_, text);
    item["status"] = status;
    return item;
  }

  static json message_item(const std::string& id, const std::string& text, const char* status) {
    return {{"type", "message"},
            {"id", id},
            {"status", status},
            {"role", "assistant"},
            {"content", json::array({text_part(text)})}};
  }

  json function_item(const std::string& id, const std::string& call_id, const std::string& name,
                     const std::string& args, const char* status) const {
    json item = {{"type", "function_call"}, {"id", id}, {"call_id", call_id}, {"name", name}};
    if (auto it = ns_.find(name); it != ns_.end()) item["namespace"] = it->second;
    item["arguments"] = args;
    item["status"] = status;
    return item;
  }

  static json custom_item(const std::string& id, const std::string& call_id, const std::string& name,
                          const std::string& input, const char* status) {
    return {{"type", "custom_tool_call"}, {"id", id}, {"call_id", call_id}, {"name", name}, {"input", input},
            {"status", status}};
  }

  // A complete call from the result (non-streaming answers).
  json call_item(const std::string& call_id, const std::string& name, const std::string& args,
                 const char* status) const {
    if (freeform_.count(name)) return custom_item(new_item_id("ctc_"), call_id, name, custom_input(args), status);
    return function_item(new_item_id("fc_"), call_id, name, args, status);
  }

  json response(const char* status, const char* incomplete_reason, bool final = false) const {
    json r = {{"id", id_},
              {"object", "response"},
              {"created_at", created_},
              {"status", status},
              {"error", nullptr},
              {"incomplete_details", incomplete_reason ? json{{"reason", incomplete_reason}} : json(nullptr)},
              {"model", model_},
              {"output", final ? output_ : json::array()},
              {"parallel_tool_calls", true},
              {"tool_choice", tool_choice_json()},
              {"max_output_tokens", max_tokens_ > 0 ? json(max_tokens_) : json(nullptr)},
              {"usage", final ? usage_json(usage_) : json(nullptr)}};
    return r;
  }

  json tool_choice_json() const {
    if (tool_choice_ == "auto" || tool_choice_ == "none" || tool_choice_ == "required") return tool_choice_;
    return {{"type", freeform_.count(tool_choice_) ? "custom" : "function"}, {"name", tool_choice_}};
  }

  void emit(const char* type, json fields) {
    json ev = {{"type", type}, {"sequence_number", seq_++}};
    for (auto& [k, v] : fields.items()) ev[k] = std::move(v);
    std::string s = "event: ";
    s += type;
    s += "\ndata: ";
    s += dump(ev);
    s += "\n\n";
    ch_->push(std::move(s));
  }

  std::shared_ptr<Channel> ch_;
  std::string secret_, model_;
  bool stream_;
  int64_t max_tokens_;
  std::string tool_choice_;
  std::string id_;
  int64_t created_;
  std::map<std::string, std::string> ns_;  // visible tool name -> its namespace
  std::set<std::string> freeform_;         // custom (freeform) tools
  Usage usage_;
  bool started_ = false, finished_ = false;
  int64_t seq_ = 0;
  std::vector<Item> items_;
  json output_ = json::array();  // the done items, by output index
};

bool parse(std::string_view body, const AdapterContext& ctx, GenRequest& out, ApiError& err) {
  try {
    GenRequest req;
    parse_request(body, ctx, req);
    out = std::move(req);
    return true;
  } catch (const BadRequest& e) {
    err = ApiError{400, "invalid_request_error", e.message, "", e.param};
  } catch (const json::exception& e) {
    err = ApiError{400, "invalid_request_error", std::string("request body: ") + e.what(), "", ""};
  } catch (const Error& e) {
    err = ApiError{400, "invalid_request_error", e.what(), "", ""};
  } catch (const std::exception& e) {
    err = ApiError{500, "server_error", std::string("internal error while reading the request: ") + e.what(), "", ""};
  }
  return false;
}

std::shared_ptr<Sink> make_sink(const GenRequest& req, const AdapterContext& ctx, std::shared_ptr<Channel> ch) {
  return std::make_shared<ResponsesSink>(req, ctx, std::move(ch));
}

}  // namespace

const Adapter& responses_adapter() {
  static const Adapter a{Api::Responses, &parse, &make_sink, &error_body_json};
  return a;
}

}  // namespace dsx::server
