// dsx: chat prompt rendering for DeepSeek V4 / V4-0731 / V4.1. See chat.h and spec §2.
#include "text/chat.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "text/dsml.h"

namespace dsx::text {

// =========================================================================================================
// UTF-8

bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  size_t i = 0, n = s.size();
  while (i < n) {
    unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) {
      len = 2;
      cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3;
      cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > n) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000)) return false;
    if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += len;
  }
  return true;
}

static void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// =========================================================================================================
// pyjson

namespace pyjson {

const Value* Value::get(std::string_view key) const {
  if (type != Type::Object) return nullptr;
  for (const auto& [k, v] : members)
    if (k == key) return &v;
  return nullptr;
}

Value Value::string(std::string s) {
  Value v;
  v.type = Type::String;
  v.text = std::move(s);
  return v;
}

Value Value::object() {
  Value v;
  v.type = Type::Object;
  return v;
}

namespace {

class Parser {
 public:
  Parser(std::string_view s, const ParseOptions& o) : s_(s), o_(o) {}

  Value run() {
    skip_ws();
    Value v = value(0);
    skip_ws();
    if (i_ != s_.size()) error("extra data after the JSON value");
    return v;
  }

 private:
  std::string_view s_;
  const ParseOptions& o_;
  size_t i_ = 0;

  [[noreturn]] void error(const std::string& what) const { fail("JSON: ", what, " at byte ", i_); }

  void skip_ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\t' || s_[i_] == '\n' || s_[i_] == '\r')) ++i_;
  }
  bool consume(std::string_view lit) {
    if (s_.substr(i_, lit.size()) == lit) {
      i_ += lit.size();
      return true;
    }
    return false;
  }

  Value value(int depth) {
    if (depth > o_.max_depth) error("nesting too deep");
    if (i_ >= s_.size()) error("unexpected end of input");
    const char c = s_[i_];
    Value v;
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') {
      v.type = Type::String;
      v.text = string();
      return v;
    }
    if (consume("null")) return v;
    if (consume("true")) {
      v.type = Type::Bool;
      v.boolean = true;
      return v;
    }
    if (consume("false")) {
      v.type = Type::Bool;
      return v;
    }
    if (o_.allow_nan) {
      v.type = Type::Float;
      if (consume("NaN")) {
        v.number = std::nan("");
        return v;
      }
      if (consume("Infinity")) {
        v.number = HUGE_VAL;
        return v;
      }
      if (consume("-Infinity")) {
        v.number = -HUGE_VAL;
        return v;
      }
    }
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    error("unexpected character");
  }

  Value number() {
    const size_t start = i_;
    bool is_float = false;
    if (s_[i_] == '-') ++i_;
    if (i_ >= s_.size() || !(s_[i_] >= '0' && s_[i_] <= '9')) error("invalid number");
    if (s_[i_] == '0') {
      ++i_;
    } else {
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ + 1 < s_.size() && s_[i_] == '.' && s_[i_ + 1] >= '0' && s_[i_ + 1] <= '9') {
      is_float = true;
      ++i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      size_t j = i_ + 1;
      if (j < s_.size() && (s_[j] == '+' || s_[j] == '-')) ++j;
      if (j < s_.size() && s_[j] >= '0' && s_[j] <= '9') {
        is_float = true;
        i_ = j;
        while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      }
    }
    const std::string_view lex = s_.substr(start, i_ - start);
    Value v;
    if (!is_float) {
      v.type = Type::Int;
      v.text = (lex == "-0") ? std::string("0") : std::string(lex);
      return v;
    }
    v.type = Type::Float;
    double d = 0;
    auto r = std::from_chars(lex.data(), lex.data() + lex.size(), d);
    if (r.ec == std::errc::result_out_of_range) {
      std::string tmp(lex);
      d = std::strtod(tmp.c_str(), nullptr);  // ±inf or (sub)zero, as Python's float()
    } else if (r.ec != std::errc()) {
      error("invalid number");
    }
    v.number = d;
    return v;
  }

  unsigned hex4() {
    if (i_ + 4 > s_.size()) error("truncated \\u escape");
    unsigned v = 0;
    for (int k = 0; k < 4; ++k) {
      char h = s_[i_++];
      v <<= 4;
      if (h >= '0' && h <= '9') v |= unsigned(h - '0');
      else if (h >= 'a' && h <= 'f') v |= unsigned(h - 'a' + 10);
      else if (h >= 'A' && h <= 'F') v |= unsigned(h - 'A' + 10);
      else error("invalid \\u escape");
    }
    return v;
  }

  std::string string() {
    ++i_;  // opening quote
    std::string out;
    size_t run = i_;
    for (;;) {
      if (i_ >= s_.size()) error("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[i_]);
      if (c == '"') {
        out.append(s_.substr(run, i_ - run));
        ++i_;
        break;
      }
      if (c < 0x20) error("raw control character in string");
      if (c == '\\') {
        out.append(s_.substr(run, i_ - run));
        ++i_;
        if (i_ >= s_.size()) error("unterminated string");
        const char e = s_[i_++];
        switch (e) {
          case '"': out += '"'; break;
          case '\\': out += '\\'; break;
          case '/': out += '/'; break;
          case 'b': out += '\b'; break;
          case 'f': out += '\f'; break;
          case 'n': out += '\n'; break;
          case 'r': out += '\r'; break;
          case 't': out += '\t'; break;
          case 'u': {
            uint32_t cp = hex4();
            if (cp >= 0xD800 && cp <= 0xDBFF) {
              if (i_ + 6 <= s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
                i_ += 2;
                uint32_t lo = hex4();
                if (lo < 0xDC00 || lo > 0xDFFF) error("lone surrogate in \\u escape");
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
              } else {
                error("lone surrogate in \\u escape");
              }
            } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
              error("lone surrogate in \\u escape");
            }
            append_utf8(out, cp);
            break;
          }
          default: error("invalid escape");
        }
        run = i_;
        continue;
      }
      if (c >= 0x80) {
        // validate one UTF-8 sequence
        size_t len = (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        if (len == 0 || i_ + len > s_.size() || !valid_utf8(s_.substr(i_, len))) error("invalid UTF-8");
        i_ += len;
        continue;
      }
      ++i_;
    }
    return out;
  }

  Value array(int depth) {
    ++i_;
    Value v;
    v.type = Type::Array;
    skip_ws();
    if (i_ < s_.size() && s_[i_] == ']') {
      ++i_;
      return v;
    }
    for (;;) {
      skip_ws();
      v.items.push_back(value(depth + 1));
      skip_ws();
      if (i_ >= s_.size()) error("unterminated array");
      if (s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (s_[i_] == ']') {
        ++i_;
        return v;
      }
      error("expected ',' or ']'");
    }
  }

  Value object(int depth) {
    ++i_;
    Value v;
    v.type = Type::Object;
    skip_ws();
    if (i_ < s_.size() && s_[i_] == '}') {
      ++i_;
      return v;
    }
    std::unordered_map<std::string, size_t> index;
    for (;;) {
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != '"') error("expected a string key");
      std::string key = string();
      skip_ws();
      if (i_ >= s_.size() || s_[i_] != ':') error("expected ':'");
      ++i_;
      skip_ws();
      Value member = value(depth + 1);
      // Python dict semantics: a repeated key keeps its first position and takes the last value.
      auto it = index.find(key);
      if (it != index.end()) {
        v.members[it->second].second = std::move(member);
      } else {
        index.emplace(key, v.members.size());
        v.members.emplace_back(std::move(key), std::move(member));
      }
      skip_ws();
      if (i_ >= s_.size()) error("unterminated object");
      if (s_[i_] == ',') {
        ++i_;
        continue;
      }
      if (s_[i_] == '}') {
        ++i_;
        return v;
      }
      error("expected ',' or '}'");
    }
  }
};

}  // namespace

Value parse(std::string_view text, const ParseOptions& opts) { return Parser(text, opts).run(); }

bool try_parse(std::string_view text, Value& out, const ParseOptions& opts) {
  try {
    out = parse(text, opts);
    return true;
  } catch (const Error&) {
    return false;
  }
}

void append_quoted(std::string& out, std::string_view s) {
  out += '"';
  size_t run = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const char* rep = nullptr;
    char buf[8];
    switch (c) {
      case '"': rep = "\\\""; break;
      case '\\': rep = "\\\\"; break;
      case '\n': rep = "\\n"; break;
      case '\r': rep = "\\r"; break;
      case '\t': rep = "\\t"; break;
      case '\b': rep = "\\b"; break;
      case '\f': rep = "\\f"; break;
      default:
        if (c < 0x20) {
          static const char* hx = "0123456789abcdef";
          buf[0] = '\\';
          buf[1] = 'u';
          buf[2] = '0';
          buf[3] = '0';
          buf[4] = hx[c >> 4];
          buf[5] = hx[c & 15];
          buf[6] = 0;
          rep = buf;
        }
    }
    if (rep) {
      out.append(s.substr(run, i - run));
      out += rep;
      run = i + 1;
    }
  }
  out.append(s.substr(run));
  out += '"';
}

std::string quoted(std::string_view s) {
  std::string out;
  append_quoted(out, s);
  return out;
}

std::string format_float(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(r.ptr - buf));
  bool neg = false;
  if (!sci.empty() && sci[0] == '-') {
    neg = true;
    sci.remove_prefix(1);
  }
  const size_t epos = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, epos))
    if (c != '.') digits += c;
  const int exp = std::atoi(std::string(sci.substr(epos + 1)).c_str());
  const int decpt = exp + 1;  // position of the decimal point relative to the digit string
  std::string out = neg ? "-" : "";
  const int nd = static_cast<int>(digits.size());
  if (decpt > -4 && decpt <= 16) {
    if (decpt <= 0) {
      out += "0.";
      out.append(static_cast<size_t>(-decpt), '0');
      out += digits;
    } else if (decpt >= nd) {
      out += digits;
      out.append(static_cast<size_t>(decpt - nd), '0');
      out += ".0";
    } else {
      out += digits.substr(0, static_cast<size_t>(decpt));
      out += '.';
      out += digits.substr(static_cast<size_t>(decpt));
    }
  } else {
    out += digits[0];
    if (nd > 1) {
      out += '.';
      out += digits.substr(1);
    }
    out += 'e';
    out += exp < 0 ? '-' : '+';
    const int ae = exp < 0 ? -exp : exp;
    if (ae < 10) out += '0';
    out += std::to_string(ae);
  }
  return out;
}

void dump_to(const Value& v, std::string& out) {
  switch (v.type) {
    case Type::Null: out += "null"; return;
    case Type::Bool: out += v.boolean ? "true" : "false"; return;
    case Type::Int: out += v.text; return;
    case Type::Float: out += format_float(v.number); return;
    case Type::String: append_quoted(out, v.text); return;
    case Type::Array:
      out += '[';
      for (size_t i = 0; i < v.items.size(); ++i) {
        if (i) out += ", ";
        dump_to(v.items[i], out);
      }
      out += ']';
      return;
    case Type::Object:
      out += '{';
      for (size_t i = 0; i < v.members.size(); ++i) {
        if (i) out += ", ";
        append_quoted(out, v.members[i].first);
        out += ": ";
        dump_to(v.members[i].second, out);
      }
      out += '}';
      return;
  }
}

std::string dumps(const Value& v) {
  std::string out;
  dump_to(v, out);
  return out;
}

}  // namespace pyjson

// =========================================================================================================
// Profiles, effort

Profile parse_profile(std::string_view name) {
  if (name == "v4") return Profile::V4;
  if (name == "v4-0731" || name == "v4_0731") return Profile::V4_0731;
  if (name == "v41" || name == "v4.1") return Profile::V41;
  fail("unknown prompt profile '", name, "' (expected v4, v4-0731 or v41)");
}

const char* profile_name(Profile p) {
  switch (p) {
    case Profile::V4: return "v4";
    case Profile::V4_0731: return "v4-0731";
    case Profile::V41: return "v41";
  }
  return "?";
}

static bool parse_int_1_100(std::string_view s, int& out) {
  if (s.empty() || s.size() > 3) return false;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  if (v < 1 || v > 100 || (s.size() > 1 && s[0] == '0')) return false;
  out = v;
  return true;
}

Effort parse_effort(std::string_view s) {
  Effort e;
  if (s == "low") e.kind = Effort::Kind::Low;
  else if (s == "high") e.kind = Effort::Kind::High;
  else if (s == "max") e.kind = Effort::Kind::Max;
  else if (int n; parse_int_1_100(s, n)) {
    e.kind = Effort::Kind::Numeric;
    e.value = n;
  } else {
    fail("invalid reasoning effort '", s, "' (expected low, high, max or an integer 1-100)");
  }
  return e;
}

ThinkingRequest map_api_effort(std::string_view s) {
  ThinkingRequest r;
  if (s == "none") {
    r.thinking = false;
  } else if (s == "minimal" || s == "low") {
    r.effort.kind = Effort::Kind::Low;
  } else if (s == "medium" || s == "high" || s == "xhigh") {
    r.effort.kind = Effort::Kind::High;
  } else if (s == "max" || s == "ultra") {
    r.effort.kind = Effort::Kind::Max;
  } else if (int n; parse_int_1_100(s, n)) {
    r.effort.kind = Effort::Kind::Numeric;
    r.effort.value = n;
  } else {
    fail("invalid reasoning_effort '", s, "'");
  }
  return r;
}

const char* const kEffortAbsMax =
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n";

const char* const kEffortBeyondMax =
    "Reasoning Effort: Beyond maximum \xE2\x80\x94 exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively "
    "decompose the problem into its most fundamental components, trace every causal chain to its root, and "
    "resolve the underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are "
    "certain that no assumption remains unchecked and no error remains undiscovered.\n\n";

std::string v41_effort_text(int n) {
  return "Reasoning Effort: " + std::to_string(n) +
         " (range 1-100, the higher the value, the more thorough the reasoning)\n\n";
}

// =========================================================================================================
// Roles

Role parse_role(std::string_view s) {
  if (s == "system") return Role::System;
  if (s == "developer") return Role::Developer;
  if (s == "user") return Role::User;
  if (s == "assistant") return Role::Assistant;
  if (s == "tool") return Role::Tool;
  if (s == "latest_reminder") return Role::LatestReminder;
  fail("unknown role '", s, "'");
}

const char* role_name(Role r) {
  switch (r) {
    case Role::System: return "system";
    case Role::Developer: return "developer";
    case Role::User: return "user";
    case Role::Assistant: return "assistant";
    case Role::Tool: return "tool";
    case Role::LatestReminder: return "latest_reminder";
  }
  return "?";
}

// =========================================================================================================
// JSON front end

namespace {

using pyjson::Type;
using pyjson::Value;

const std::string& want_string(const Value& v, const std::string& where) {
  if (v.type != Type::String) fail(where, ": expected a string");
  return v.text;
}

std::optional<std::string> opt_string(const Value& obj, std::string_view key, const std::string& where) {
  const Value* v = obj.get(key);
  if (!v || v->is_null()) return std::nullopt;
  return want_string(*v, where + "." + std::string(key));
}

bool is_image_type(const std::string& t) {
  return t == "image" || t == "image_url" || t == "input_image" || t == "image_file";
}

bool is_text_type(const std::string& t) {
  return t == "text" || t == "input_text" || t == "output_text";
}

// Content of a part: {"type": "text", "text": …} (or a bare string).
std::string part_text(const Value& part, const std::string& where) {
  if (part.is_string()) return part.text;
  const Value* t = part.get("text");
  if (!t || t->is_null()) return "";
  return want_string(*t, where + ".text");
}

std::string part_type(const Value& part, const std::string& where) {
  if (part.is_string()) return "text";
  if (!part.is_object()) fail(where, ": expected an object or a string");
  const Value* t = part.get("type");
  if (!t) fail(where, ".type: missing");
  return want_string(*t, where + ".type");
}

// Tool-result content: string, or list of parts (text joined "\n\n", others "[Unsupported <type>]").
std::string tool_result_text(const Value& c, const std::string& where) {
  if (c.is_null()) return "";
  if (c.is_string()) return c.text;
  if (!c.is_array()) fail(where, ": expected a string or an array of content parts");
  std::string out;
  for (size_t j = 0; j < c.items.size(); ++j) {
    const std::string w = where + "[" + std::to_string(j) + "]";
    const std::string type = part_type(c.items[j], w);
    if (j) out += "\n\n";
    if (is_text_type(type)) out += part_text(c.items[j], w);
    else if (is_image_type(type)) fail(w, ": images are not supported (text-only model)");
    else out += "[Unsupported " + type + "]";
  }
  return out;
}

// Plain text of a non-user message's content (arrays: text parts joined "\n\n", §4.3).
std::string plain_content(const Value* c, const std::string& where) {
  if (!c || c->is_null()) return "";
  if (c->is_string()) return c->text;
  if (!c->is_array()) fail(where, ": expected a string, null or an array of content parts");
  std::string out;
  for (size_t j = 0; j < c->items.size(); ++j) {
    const std::string w = where + "[" + std::to_string(j) + "]";
    const std::string type = part_type(c->items[j], w);
    if (is_image_type(type)) fail(w, ": images are not supported (text-only model)");
    if (!is_text_type(type)) fail(w, ": unsupported content part type '", type, "'");
    if (j) out += "\n\n";
    out += part_text(c->items[j], w);
  }
  return out;
}

std::string arguments_text(const Value* a, const std::string& where) {
  if (!a || a->is_null()) return "";
  if (a->is_string()) return a->text;
  if (a->is_object() || a->is_array()) return pyjson::dumps(*a);  // tolerated: arguments given as JSON
  fail(where, ": expected a JSON string");
}

ToolCall tool_call_from_value(const Value& tc, const std::string& where) {
  if (!tc.is_object()) fail(where, ": expected an object");
  ToolCall call;
  if (auto id = opt_string(tc, "id", where)) call.id = *id;
  const Value* fn = tc.get("function");
  if (fn && !fn->is_null()) {
    if (!fn->is_object()) fail(where, ".function: expected an object");
    const Value* name = fn->get("name");
    if (!name) fail(where, ".function.name: missing");
    call.name = want_string(*name, where + ".function.name");
    call.arguments = arguments_text(fn->get("arguments"), where + ".function.arguments");
  } else {
    const Value* name = tc.get("name");
    if (!name) fail(where, ".function: missing");
    call.name = want_string(*name, where + ".name");
    const Value* args = tc.get("arguments");
    if (!args) args = tc.get("input");
    call.arguments = arguments_text(args, where + ".arguments");
  }
  return call;
}

}  // namespace

std::vector<Message> messages_from_value(const Value& arr, const JsonOptions& opts) {
  if (!arr.is_array()) fail("messages: expected an array");
  std::vector<Message> out;
  out.reserve(arr.items.size());
  for (size_t i = 0; i < arr.items.size(); ++i) {
    const std::string where = "messages[" + std::to_string(i) + "]";
    const Value& m = arr.items[i];
    if (!m.is_object()) fail(where, ": expected an object");
    const Value* rv = m.get("role");
    if (!rv) fail(where, ".role: missing");
    Message msg;
    try {
      msg.role = parse_role(want_string(*rv, where + ".role"));
    } catch (const Error& e) {
      fail(where, ".role: ", e.what());
    }
    if (msg.role == Role::Developer && opts.developer_as_system) msg.role = Role::System;
    const Value* content = m.get("content");
    const std::string cwhere = where + ".content";
    switch (msg.role) {
      case Role::User:
        if (content && content->is_array()) {
          for (size_t j = 0; j < content->items.size(); ++j) {
            const std::string w = cwhere + "[" + std::to_string(j) + "]";
            const Value& part = content->items[j];
            const std::string type = part_type(part, w);
            ContentBlock b;
            if (is_text_type(type)) {
              b.kind = ContentBlock::Kind::Text;
              b.text = part_text(part, w);
            } else if (type == "tool_result") {
              b.kind = ContentBlock::Kind::ToolResult;
              if (auto id = opt_string(part, "tool_use_id", w)) b.tool_use_id = *id;
              const Value* c = part.get("content");
              b.text = c ? tool_result_text(*c, w + ".content") : "";
            } else if (is_image_type(type)) {
              fail(w, ": images are not supported (text-only model)");
            } else {
              b.kind = ContentBlock::Kind::Other;
              b.type_name = type;
            }
            msg.blocks.push_back(std::move(b));
          }
          if (msg.blocks.empty()) msg.blocks.push_back(ContentBlock{});  // empty list → one empty text
        } else {
          msg.content = plain_content(content, cwhere);
        }
        break;
      case Role::Tool:
        msg.content = content ? tool_result_text(*content, cwhere) : "";
        if (auto id = opt_string(m, "tool_call_id", where)) msg.tool_call_id = *id;
        break;
      default:
        msg.content = plain_content(content, cwhere);
        break;
    }
    if (msg.role == Role::Assistant) {
      if (auto r = opt_string(m, "reasoning_content", where)) msg.reasoning_content = *r;
      else if (auto r2 = opt_string(m, "reasoning", where)) msg.reasoning_content = *r2;
      if (const Value* tcs = m.get("tool_calls"); tcs && !tcs->is_null()) {
        if (!tcs->is_array()) fail(where, ".tool_calls: expected an array");
        for (size_t j = 0; j < tcs->items.size(); ++j)
          msg.tool_calls.push_back(
              tool_call_from_value(tcs->items[j], where + ".tool_calls[" + std::to_string(j) + "]"));
      }
    }
    if (auto t = opt_string(m, "task", where)) msg.task = *t;
    if (const Value* w = m.get("wo_eos"); w && !w->is_null()) {
      if (w->type != Type::Bool) fail(where, ".wo_eos: expected a boolean");
      msg.wo_eos = w->boolean;
    }
    if (const Value* rf = m.get("response_format"); rf && !rf->is_null()) msg.response_format = *rf;
    if (const Value* tl = m.get("tools"); tl && !tl->is_null()) {
      try {
        msg.tools = tools_from_value(*tl);
      } catch (const Error& e) {
        fail(where, ".", e.what());
      }
    }
    out.push_back(std::move(msg));
  }
  return out;
}

ToolSpec tool_from_value(const Value& t, const std::string& where) {
  if (!t.is_object()) fail(where, ": expected an object");
  ToolSpec spec;
  const Value* type = t.get("type");
  if (type && !type->is_null() && want_string(*type, where + ".type") != "function")
    fail(where, ".type: unsupported tool type '", type->text, "'");
  if (const Value* fn = t.get("function"); fn && !fn->is_null()) {
    // OpenAI chat: the function object exactly as received.
    if (!fn->is_object()) fail(where, ".function: expected an object");
    spec.function = *fn;
  } else {
    // Responses {type, name, description, parameters} or Anthropic {name, description, input_schema}.
    spec.function = Value::object();
    const Value* name = t.get("name");
    if (!name) fail(where, ": missing 'function' or 'name'");
    spec.function.members.emplace_back("name", *name);
    if (const Value* d = t.get("description")) spec.function.members.emplace_back("description", *d);
    if (const Value* p = t.get("parameters")) spec.function.members.emplace_back("parameters", *p);
    else if (const Value* s = t.get("input_schema")) spec.function.members.emplace_back("parameters", *s);
  }
  const Value* name = spec.function.get("name");
  if (!name) fail(where, ".function.name: missing");
  spec.name = want_string(*name, where + ".function.name");
  return spec;
}

std::vector<ToolSpec> tools_from_value(const Value& tools) {
  if (tools.is_null()) return {};
  if (!tools.is_array()) fail("tools: expected an array");
  std::vector<ToolSpec> out;
  for (size_t i = 0; i < tools.items.size(); ++i)
    out.push_back(tool_from_value(tools.items[i], "tools[" + std::to_string(i) + "]"));
  return out;
}

Conversation conversation_from_value(const Value& root, const JsonOptions& opts) {
  Conversation conv;
  if (root.is_array()) {
    conv.messages = messages_from_value(root, opts);
    return conv;
  }
  if (!root.is_object()) fail("expected a messages array or an object with \"messages\"");
  const Value* msgs = root.get("messages");
  if (!msgs) fail("messages: missing");
  conv.messages = messages_from_value(*msgs, opts);
  if (const Value* t = root.get("tools")) conv.tools = tools_from_value(*t);
  if (const Value* tc = root.get("tool_choice"); tc && !tc->is_null()) {
    if (tc->is_string()) conv.tools_enabled = tc->text != "none";
    else if (tc->is_object()) {
      const Value* ty = tc->get("type");
      conv.tools_enabled = !(ty && ty->is_string() && ty->text == "none");
    } else {
      fail("tool_choice: expected a string or an object");
    }
  }
  if (auto tm = opt_string(root, "thinking_mode", "request")) {
    if (*tm == "thinking") conv.thinking = true;
    else if (*tm == "chat") conv.thinking = false;
    else fail("thinking_mode: expected \"thinking\" or \"chat\"");
  }
  if (const Value* th = root.get("thinking"); th && !th->is_null()) {
    if (th->type == Type::Bool) {
      conv.thinking = th->boolean;
    } else if (th->is_object()) {
      const Value* ty = th->get("type");
      if (ty) conv.thinking = want_string(*ty, "thinking.type") != "disabled";
    } else {
      fail("thinking: expected a boolean or an object");
    }
  }
  if (const Value* re = root.get("reasoning_effort"); re && !re->is_null()) {
    std::string s;
    if (re->is_string()) s = re->text;
    else if (re->type == Type::Int) s = re->text;
    else fail("reasoning_effort: expected a string or an integer");
    ThinkingRequest tr = map_api_effort(s);
    if (!tr.thinking) conv.thinking = false;
    else conv.effort = tr.effort;
  }
  return conv;
}

Conversation parse_conversation(std::string_view json, const JsonOptions& opts) {
  return conversation_from_value(pyjson::parse(json), opts);
}

// =========================================================================================================
// Rendering

namespace {

class Out {
 public:
  void trusted(std::string_view s) { add(s, true); }
  void client(std::string_view s) { add(s, false); }
  void append(const std::vector<Segment>& segs) {
    for (const auto& s : segs) add(s.text, s.trusted);
  }
  std::vector<Segment> take() { return std::move(segs_); }

 private:
  std::vector<Segment> segs_;
  void add(std::string_view s, bool trusted) {
    if (s.empty()) return;
    if (!segs_.empty() && segs_.back().trusted == trusted) segs_.back().text.append(s);
    else segs_.push_back(Segment{std::string(s), trusted});
  }
};

const char* task_token(const std::string& task) {
  if (task == "action") return "<｜action｜>";
  if (task == "query") return "<｜query｜>";
  if (task == "authority") return "<｜authority｜>";
  if (task == "domain") return "<｜domain｜>";
  if (task == "title") return "<｜title｜>";
  if (task == "read_url") return "<｜read_url｜>";
  return nullptr;
}

// Client text with the single-sentinel escape: the '<' of every exact `sentinel` becomes "&lt;".
void client_escaped(Out& out, std::string_view text, std::string_view sentinel) {
  size_t pos = 0;
  for (;;) {
    size_t at = text.find(sentinel, pos);
    if (at == std::string_view::npos) break;
    out.client(text.substr(pos, at - pos));
    out.client("&lt;");
    out.client(sentinel.substr(1));
    pos = at + sentinel.size();
  }
  out.client(text.substr(pos));
}

void check_utf8(std::string_view s, const std::string& where) {
  if (!valid_utf8(s)) fail(where, ": invalid UTF-8");
}

}  // namespace

DsmlNames dsml_names(Profile p) {
  if (p == Profile::V41) return {" calls", " invoke", " parameter"};
  return {"tool_calls", "invoke", "parameter"};
}

std::vector<Segment> render_tools_block(const std::vector<ToolSpec>& tools, Profile profile) {
  const DsmlNames n = dsml_names(profile);
  const std::string d = tok::kDsml;
  const std::string blk = std::string(n.block), inv = n.invoke, par = n.param;
  Out out;
  out.trusted("## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke "
              "tools by writing a \"<" + d + blk + ">\" block like the following:\n\n<" + d + blk + ">\n<" + d +
              inv + " name=\"$TOOL_NAME\">\n<" + d + par +
              " name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</" + d + par + ">\n...\n</" +
              d + inv + ">\n<" + d + inv + " name=\"$TOOL_NAME2\">\n...\n</" + d + inv + ">\n</" + d + blk +
              ">\n\nString parameters should be specified as is and set `string=\"true\"`. For all other types "
              "(numbers, booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`."
              "\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
              "inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, output directly "
              "after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n");
  for (size_t i = 0; i < tools.size(); ++i) {
    if (i) out.trusted("\n");
    const std::string schema = pyjson::dumps(tools[i].function);
    check_utf8(schema, "tools[" + std::to_string(i) + "]");
    out.client(schema);
  }
  out.trusted("\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
              "calls.\n");
  return out.take();
}

std::vector<Segment> render_tool_calls_block(const std::vector<ToolCall>& calls, Profile profile) {
  const DsmlNames n = dsml_names(profile);
  const std::string d = tok::kDsml;
  const std::string par_closer = "</" + d + n.param + ">";
  Out out;
  out.trusted("\n\n<" + d + n.block + ">\n");
  for (size_t c = 0; c < calls.size(); ++c) {
    const ToolCall& call = calls[c];
    if (c) out.trusted("\n");
    out.trusted("<" + d + n.invoke + " name=\"");
    out.client(call.name);
    out.trusted("\">\n");
    // Arguments (§2.7, §2.4): a JSON object (or a JSON string holding one, possibly double-encoded);
    // empty/null → no parameters; anything else → one string parameter "arguments" with the raw text.
    std::vector<std::pair<std::string, pyjson::Value>> params;
    {
      std::string_view raw = call.arguments;
      size_t a = raw.find_first_not_of(" \t\r\n");
      const bool blank = a == std::string_view::npos;
      pyjson::Value v;
      bool ok = false;
      if (!blank && pyjson::try_parse(raw, v)) {
        for (int k = 0; k < 2 && v.is_string(); ++k) {
          pyjson::Value inner;
          if (!pyjson::try_parse(v.text, inner)) break;
          v = std::move(inner);
        }
        if (v.is_object()) {
          params = std::move(v.members);
          ok = true;
        } else if (v.is_null()) {
          ok = true;
        }
      }
      if (!blank && !ok) params.emplace_back("arguments", pyjson::Value::string(call.arguments));
    }
    for (size_t p = 0; p < params.size(); ++p) {
      const auto& [key, value] = params[p];
      if (p) out.trusted("\n");
      out.trusted("<" + d + n.param + " name=\"");
      out.client(key);
      out.trusted(value.is_string() ? "\" string=\"true\">" : "\" string=\"false\">");
      client_escaped(out, value.is_string() ? value.text : pyjson::dumps(value), par_closer);
      out.trusted(par_closer);
    }
    out.trusted("\n</" + d + n.invoke + ">");
  }
  out.trusted("\n</" + d + n.block + ">");
  return out.take();
}

RenderedPrompt render_prompt(const Conversation& conv, const RenderOptions& opts) {
  const Profile P = opts.profile;
  const bool v41 = P == Profile::V41;
  const bool T = opts.thinking;
  if (conv.messages.empty()) fail("messages: must not be empty");

  // ---- validation and working copy -------------------------------------------------------------------
  std::vector<Message> msgs;
  msgs.reserve(conv.messages.size() + 1);
  for (size_t i = 0; i < conv.messages.size(); ++i) {
    const Message& m = conv.messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    check_utf8(m.content, where + ".content");
    for (const auto& b : m.blocks) {
      check_utf8(b.text, where + ".content");
      check_utf8(b.tool_use_id, where + ".content.tool_use_id");
      check_utf8(b.type_name, where + ".content.type");
    }
    if (m.reasoning_content) check_utf8(*m.reasoning_content, where + ".reasoning_content");
    for (const auto& tc : m.tool_calls) {
      check_utf8(tc.name, where + ".tool_calls.name");
      check_utf8(tc.arguments, where + ".tool_calls.arguments");
      check_utf8(tc.id, where + ".tool_calls.id");
    }
    if (m.task && !task_token(*m.task)) fail(where, ".task: invalid task '", *m.task, "'");
    if (v41) {
      // The reference rejects a literal image placeholder in text (§2.4).
      static const std::string kImg = "<｜deepseek_image｜>";
      auto has_img = [&](const std::string& s) { return s.find(kImg) != std::string::npos; };
      bool bad = has_img(m.content) || (m.reasoning_content && has_img(*m.reasoning_content));
      for (const auto& b : m.blocks) bad = bad || has_img(b.text);
      if (bad) fail(where, ": text contains the image placeholder <｜deepseek_image｜>");
    }
    Message w = m;
    if (!opts.tools_enabled || (w.role != Role::System && w.role != Role::Developer)) w.tools.clear();
    if (v41 && w.role == Role::Developer) w.role = Role::System;  // V4.1 has no developer role [P]
    if (w.role != Role::Assistant) {
      w.reasoning_content.reset();
      w.tool_calls.clear();
    }
    msgs.push_back(std::move(w));
  }

  // [P] merge consecutive leading system messages ("\n\n").
  if (opts.merge_leading_system) {
    size_t k = 1;
    while (k < msgs.size() && msgs[0].role == Role::System && msgs[k].role == Role::System &&
           !msgs[k].response_format && !msgs[0].response_format)
      ++k;
    if (k > 1) {
      for (size_t j = 1; j < k; ++j) msgs[0].content += "\n\n" + msgs[j].content;
      msgs.erase(msgs.begin() + 1, msgs.begin() + static_cast<std::ptrdiff_t>(k));
    }
  }
  // [P] merge consecutive assistant messages.
  if (opts.merge_consecutive_assistants) {
    std::vector<Message> merged;
    for (auto& w : msgs) {
      if (!merged.empty() && merged.back().role == Role::Assistant && w.role == Role::Assistant &&
          !merged.back().wo_eos) {
        Message& a = merged.back();
        a.content += w.content;
        for (auto& tc : w.tool_calls) a.tool_calls.push_back(std::move(tc));
        if ((!a.reasoning_content || a.reasoning_content->empty()) && w.reasoning_content)
          a.reasoning_content = w.reasoning_content;
        a.wo_eos = w.wo_eos;
        continue;
      }
      merged.push_back(std::move(w));
    }
    msgs = std::move(merged);
  }
  if (opts.continue_final_message && msgs.back().role == Role::Assistant) msgs.back().wo_eos = true;

  // ---- Step A: attach tools --------------------------------------------------------------------------
  if (!conv.tools.empty() && opts.tools_enabled) {
    if (msgs[0].role == Role::System || msgs[0].role == Role::Developer) {
      msgs[0].tools.insert(msgs[0].tools.begin(), conv.tools.begin(), conv.tools.end());
    } else {
      Message sys;
      sys.role = Role::System;
      sys.tools = conv.tools;
      msgs.insert(msgs.begin(), std::move(sys));
    }
  }

  // ---- Step B: merge tool results and user turns -----------------------------------------------------
  {
    std::vector<Message> built;
    for (auto& w : msgs) {
      Message& m = w;
      const bool last_user_blocks =
          !built.empty() && built.back().role == Role::User && !built.back().blocks.empty();
      if (m.role == Role::Tool) {
        ContentBlock b;
        b.kind = ContentBlock::Kind::ToolResult;
        b.tool_use_id = m.tool_call_id;
        b.text = std::move(m.content);
        if (last_user_blocks) {
          built.back().blocks.push_back(std::move(b));
        } else {
          Message u;
          u.role = Role::User;
          u.blocks.push_back(std::move(b));
          built.push_back(std::move(u));
        }
      } else if (m.role == Role::User) {
        std::vector<ContentBlock> blocks = std::move(m.blocks);
        if (blocks.empty()) {
          ContentBlock b;
          b.text = std::move(m.content);
          blocks.push_back(std::move(b));
        }
        if (last_user_blocks && !built.back().task) {
          for (auto& b : blocks) built.back().blocks.push_back(std::move(b));
        } else {
          Message u;
          u.role = Role::User;
          u.blocks = std::move(blocks);
          u.task = m.task;
          u.wo_eos = m.wo_eos;
          built.push_back(std::move(u));
        }
      } else {
        built.push_back(std::move(w));
      }
    }
    msgs = std::move(built);
  }

  // ---- Step C: order tool results by the preceding call order ---------------------------------------
  {
    std::unordered_map<std::string, size_t> order;
    for (auto& w : msgs) {
      if (w.role == Role::Assistant && !w.tool_calls.empty()) {
        order.clear();
        for (size_t k = 0; k < w.tool_calls.size(); ++k)
          if (!w.tool_calls[k].id.empty()) order[w.tool_calls[k].id] = k;
      } else if (w.role == Role::User && !order.empty()) {
        std::vector<ContentBlock> results;
        for (auto& b : w.blocks)
          if (b.kind == ContentBlock::Kind::ToolResult) results.push_back(b);
        if (results.size() > 1) {
          auto pos = [&](const ContentBlock& b) {
            auto it = order.find(b.tool_use_id);
            return it == order.end() ? size_t(0) : it->second;
          };
          std::stable_sort(results.begin(), results.end(),
                           [&](const ContentBlock& a, const ContentBlock& b) { return pos(a) < pos(b); });
          size_t r = 0;
          for (auto& b : w.blocks)
            if (b.kind == ContentBlock::Kind::ToolResult) b = std::move(results[r++]);
        }
      }
    }
  }

  // ---- Steps D/E: drop decision and drop pass --------------------------------------------------------
  auto is_user_like = [&](const std::vector<Message>& v, size_t i) {
    const Role r = v[i].role;
    if (v41) return r == Role::User || (r == Role::System && i > 0);
    return r == Role::User || r == Role::Developer;
  };
  auto find_last_user = [&](const std::vector<Message>& v) -> long {
    for (size_t i = v.size(); i-- > 0;)
      if (is_user_like(v, i)) return static_cast<long>(i);
    return -1;
  };
  bool any_tools = false;
  for (const auto& w : msgs) any_tools = any_tools || !w.tools.empty();
  const bool drop = opts.drop_thinking && !any_tools;
  if (T && drop) {
    const long lu = find_last_user(msgs);
    std::vector<Message> kept;
    for (size_t i = 0; i < msgs.size(); ++i) {
      const Role r = msgs[i].role;
      const bool keep_role =
          r == Role::User || r == Role::System || r == Role::Tool || r == Role::LatestReminder;
      if (keep_role || static_cast<long>(i) >= lu) {
        kept.push_back(std::move(msgs[i]));
      } else if (r == Role::Assistant) {
        msgs[i].reasoning_content.reset();
        kept.push_back(std::move(msgs[i]));
      }  // other roles (developer) before the last user turn are removed (official encoder quirk)
    }
    msgs = std::move(kept);
  }
  const long last_user = find_last_user(msgs);

  // ---- effort ---------------------------------------------------------------------------------------
  RenderedPrompt result;
  std::string effort_text;
  bool system_marker_for_effort = false;
  if (!T) {
    result.effective_effort = "none";
  } else {
    const bool max_allowed = !opts.context_tokens || *opts.context_tokens >= opts.max_effort_min_context;
    Effort::Kind k = opts.effort.kind;
    if (P != Profile::V41 && k == Effort::Kind::Numeric)
      fail("reasoning effort ", opts.effort.value, ": numeric efforts need profile v41");
    if (k == Effort::Kind::Max && !max_allowed) k = Effort::Kind::High;  // Think-Max context rule
    switch (P) {
      case Profile::V4:
        result.effective_effort = k == Effort::Kind::Max ? "max" : k == Effort::Kind::Low ? "low" : "high";
        if (k == Effort::Kind::Max) effort_text = kEffortAbsMax;
        break;
      case Profile::V4_0731:
        result.effective_effort = k == Effort::Kind::Max ? "max" : k == Effort::Kind::Low ? "low" : "high";
        if (k == Effort::Kind::Max) effort_text = kEffortBeyondMax;
        else if (k != Effort::Kind::Low) effort_text = kEffortAbsMax;
        break;
      case Profile::V41: {
        int n = 75;
        if (k == Effort::Kind::Low) n = 50;
        else if (k == Effort::Kind::Max) n = 100;
        else if (k == Effort::Kind::Numeric) {
          n = opts.effort.value;
          if (n < 1 || n > 100) fail("reasoning effort ", n, ": must be within 1-100");
          if (n >= 100 && !max_allowed) n = 75;
        }
        result.effective_effort = std::to_string(n);
        effort_text = v41_effort_text(n);
        system_marker_for_effort = true;
        break;
      }
    }
  }

  // ---- Step F: emit ---------------------------------------------------------------------------------
  Out out;
  out.trusted(tok::kBos);
  const std::string tr_open = "<tool_result>", tr_close = "</tool_result>";
  for (size_t i = 0; i < msgs.size(); ++i) {
    const Message& m = msgs[i];
    const Role role = m.role;
    if (i == 0 && T) {
      if (v41 && (system_marker_for_effort || role == Role::System)) out.trusted(tok::kSystem);
      out.trusted(effort_text);
    } else if (i == 0 && v41 && role == Role::System) {
      out.trusted(tok::kSystem);
    }
    auto system_extras = [&]() {
      if (!m.tools.empty()) {
        out.trusted("\n\n");
        out.append(render_tools_block(m.tools, P));
      }
      if (m.response_format) {
        out.trusted("\n\n## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n");
        const std::string schema = pyjson::dumps(*m.response_format);
        check_utf8(schema, "messages[" + std::to_string(i) + "].response_format");
        out.client(schema);
      }
    };
    switch (role) {
      case Role::System:
        if (v41 && i > 0) out.trusted(tok::kSystem);
        out.client(m.content);
        system_extras();
        break;
      case Role::Developer:
        out.trusted(tok::kUser);
        out.client(m.content);
        system_extras();
        break;
      case Role::User:
        out.trusted(tok::kUser);
        for (size_t b = 0; b < m.blocks.size(); ++b) {
          const ContentBlock& blk = m.blocks[b];
          if (b) out.trusted("\n\n");
          switch (blk.kind) {
            case ContentBlock::Kind::Text: out.client(blk.text); break;
            case ContentBlock::Kind::ToolResult:
              out.trusted(tr_open);
              client_escaped(out, blk.text, tr_close);
              out.trusted(tr_close);
              break;
            case ContentBlock::Kind::Other: out.client("[Unsupported " + blk.type_name + "]"); break;
          }
        }
        break;
      case Role::LatestReminder:
        out.trusted(tok::kLatestReminder);
        out.client(m.content);
        break;
      case Role::Tool: fail("internal: tool message survived the merge step");
      case Role::Assistant: {
        const bool prev_has_task = i > 0 && msgs[i - 1].task.has_value();
        if (T && !prev_has_task && (!drop || static_cast<long>(i) > last_user)) {
          out.client(m.reasoning_content.value_or(""));
          out.trusted(tok::kThinkEnd);
        }
        out.client(m.content);
        if (!m.tool_calls.empty()) {
          std::optional<std::vector<Segment>> replayed;
          if (opts.replay) replayed = opts.replay->lookup(m.tool_calls);
          if (replayed) {
            out.append(*replayed);
            ++result.replayed_blocks;
          } else {
            out.append(render_tool_calls_block(m.tool_calls, P));
            ++result.canonical_blocks;
          }
        }
        if (!m.wo_eos) out.trusted(tok::kEos);
        break;
      }
    }
    // transition
    if (i + 1 < msgs.size() && msgs[i + 1].role != Role::Assistant &&
        msgs[i + 1].role != Role::LatestReminder)
      continue;
    if (m.task) {
      if (*m.task != "action") {
        out.trusted(task_token(*m.task));
      } else {
        out.trusted(tok::kAssistant);
        out.trusted(T ? tok::kThink : tok::kThinkEnd);
        out.trusted(task_token(*m.task));
      }
    } else if (role == Role::User || role == Role::Developer || (v41 && role == Role::System && i > 0)) {
      out.trusted(tok::kAssistant);
      out.trusted(T && (!drop || static_cast<long>(i) >= last_user) ? tok::kThink : tok::kThinkEnd);
    }
  }
  result.segments = out.take();
  size_t total = 0;
  for (const auto& s : result.segments) total += s.text.size();
  result.text.reserve(total);
  for (const auto& s : result.segments) result.text += s.text;
  return result;
}

}  // namespace dsx::text
