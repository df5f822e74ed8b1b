// dsx: chat prompt rendering for DeepSeek V4 / V4-0731 / V4.1 (spec chat-and-serving.md §2).
//
// The renderer turns an internal conversation (§2.2) into the prompt the model was trained on, byte for
// byte as the official encoders do (profiles `v4`, `v4-0731`, `v41`), plus the project-level decisions
// marked [P] in the spec (tool-result sentinel escape, DSML closer escape, leading-system merge, Think-Max
// context rule, default effort `high`).
//
// Security rule (overrides spec §1.5's default): client text can never become a control token. The
// renderer therefore returns a list of segments {text, trusted}: trusted text is what the renderer itself
// writes (BOS, role markers, <think>, DSML tags, the tools-block instructions, ...); untrusted text is
// everything that came from the client (message content, reasoning, tool results, tool names, argument
// keys/values, tool schemas). encode_segments() tokenizes trusted text with added-token matching and client
// text without it.
//
// Token-boundary analysis (why encode_segments() equals whole-string encoding for benign prompts):
// the reference tokenizes the whole prompt at once. Step 1 of the encoder (§1.3) cuts the string at every
// added-token match; the pre-tokenizer regexes and BPE then run on each piece *between* two added tokens
// independently, and inside such a piece a trusted/untrusted boundary is invisible to the reference (e.g.
// "agent." + "\n\n## Tools" forms the single regex piece ".\n\n", and " " + "Paris" can merge into " Paris").
// Encoding each segment separately would therefore change the ids. encode_segments() instead:
//   1. splits every trusted segment at the added tokens it contains (found by encoding it with matching on
//      and locating each added id's text), so only renderer-written markers become control tokens;
//   2. concatenates all remaining plain text between two consecutive control tokens — trusted and untrusted
//      alike — into one run and encodes that run once with added-token matching off.
// For a prompt whose client text contains no added-token string (and no string that completes one across a
// segment boundary), step 1 finds exactly the cuts the reference finds, and step 2 sees exactly the pieces
// the reference sees, so the ids are identical. When client text does contain such a string, it is
// tokenized as plain text (the hardening of §1.5) — the only case where ids differ from the hosted API.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "util/error.h"

namespace dsx::text {

// ---------------------------------------------------------------------------------------------------------
// Python-compatible JSON (json.loads / json.dumps(ensure_ascii=False) semantics): ordered objects, exact
// integers of any size, floats re-printed as Python's repr, duplicate keys resolved as Python does (last
// value wins, first position kept). Used for tool schemas, tool-call arguments and DSML values.
namespace pyjson {

enum class Type { Null, Bool, Int, Float, String, Array, Object };

struct Value {
  Type type = Type::Null;
  bool boolean = false;
  double number = 0;  // Float
  std::string text;   // String: decoded UTF-8; Int: canonical decimal digits (with '-')
  std::vector<Value> items;                             // Array
  std::vector<std::pair<std::string, Value>> members;  // Object, in order

  bool is_null() const { return type == Type::Null; }
  bool is_string() const { return type == Type::String; }
  bool is_object() const { return type == Type::Object; }
  bool is_array() const { return type == Type::Array; }
  const Value* get(std::string_view key) const;  // object member or nullptr
  static Value string(std::string s);
  static Value object();
};

struct ParseOptions {
  bool allow_nan = true;  // NaN / Infinity / -Infinity literals (Python accepts them; strict JSON does not)
  int max_depth = 512;
};

// Throws dsx::Error ("JSON: <problem> at byte N") on malformed input, invalid UTF-8, lone surrogates,
// raw control characters in strings, nesting deeper than max_depth, or trailing data.
Value parse(std::string_view text, const ParseOptions& opts = {});
bool try_parse(std::string_view text, Value& out, const ParseOptions& opts = {});

std::string dumps(const Value& v);
void dump_to(const Value& v, std::string& out);
void append_quoted(std::string& out, std::string_view utf8);  // "..." with Python's escapes
std::string quoted(std::string_view utf8);
std::string format_float(double d);  // Python float repr (json.dumps form: NaN, Infinity, -Infinity)

}  // namespace pyjson

bool valid_utf8(std::string_view s);

// ---------------------------------------------------------------------------------------------------------
// Profiles and reasoning effort (§2.1, §2.5, §4.5)

enum class Profile { V4, V4_0731, V41 };
Profile parse_profile(std::string_view name);  // "v4", "v4-0731", "v41" (throws otherwise)
const char* profile_name(Profile p);

struct Effort {
  enum class Kind { Default, Low, High, Max, Numeric };
  Kind kind = Kind::Default;
  int value = 0;  // Numeric only (1..100, v41 only)
};
// Renderer-level effort names: "low", "high", "max" or an integer "1".."100". Anything else throws
// (the official V4.1 test rejects e.g. "medium", 0, 101).
Effort parse_effort(std::string_view s);

// API-level request (§4.5): "none" → thinking off; minimal/low → low; medium/high/xhigh → high;
// max/ultra → max; integer 1..100 → numeric. Throws on anything else.
struct ThinkingRequest {
  bool thinking = true;
  Effort effort;
};
ThinkingRequest map_api_effort(std::string_view requested);

// Exact prefix strings of §2.5.
extern const char* const kEffortAbsMax;     // ABS_MAX
extern const char* const kEffortBeyondMax;  // BEYOND_MAX
std::string v41_effort_text(int n);         // V41(n)

// ---------------------------------------------------------------------------------------------------------
// Internal message model (§2.2)

enum class Role { System, Developer, User, Assistant, Tool, LatestReminder };
Role parse_role(std::string_view s);  // throws on unknown roles
const char* role_name(Role r);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text (object expected; see render rules for anything else)
};

struct ContentBlock {
  enum class Kind { Text, ToolResult, Other };
  Kind kind = Kind::Text;
  std::string text;         // Text: the text; ToolResult: the result content (already flattened)
  std::string tool_use_id;  // ToolResult
  std::string type_name;    // Other: the block's type (rendered "[Unsupported <type>]")
};

// A tool as the model sees it: the OpenAI `function` object {name, description, parameters, ...}
// (Anthropic and Responses shapes are converted to {name, description, parameters}, §2.6).
struct ToolSpec {
  std::string name;
  pyjson::Value function;
};

struct Message {
  Role role = Role::User;
  std::string content;
  std::vector<ContentBlock> blocks;  // user messages: content as blocks (takes precedence when non-empty)
  std::optional<std::string> reasoning_content;
  std::vector<ToolCall> tool_calls;   // assistant
  std::string tool_call_id;           // tool
  std::optional<std::string> task;    // quick-instruction task (§2.9)
  bool wo_eos = false;                // assistant: no EOS (continue final message)
  std::optional<pyjson::Value> response_format;  // system/developer
  std::vector<ToolSpec> tools;  // system/developer: tools attached to this message (reference layout)
};

struct Conversation {
  std::vector<Message> messages;
  std::vector<ToolSpec> tools;
  // Optional request-level settings found in a JSON request object ({"messages": …, "thinking_mode": …}).
  std::optional<bool> thinking;
  std::optional<Effort> effort;
  std::optional<bool> tools_enabled;  // from "tool_choice" ("none" → false)
};

// JSON front end. `json` is either an OpenAI-style messages array or an object with "messages" (and
// optionally "tools", "tool_choice", "thinking_mode" ("thinking"|"chat"), "thinking" (bool or
// {"type": …}), "reasoning_effort"). Roles: system, developer, user, assistant, tool, latest_reminder.
// Assistant "reasoning" is accepted as an alias of "reasoning_content". Images are rejected (text-only).
// `developer_as_system` maps every developer message to system (OpenAI semantics, §4.3).
struct JsonOptions {
  bool developer_as_system = false;
};
Conversation parse_conversation(std::string_view json, const JsonOptions& opts = {});
Conversation conversation_from_value(const pyjson::Value& root, const JsonOptions& opts = {});
std::vector<Message> messages_from_value(const pyjson::Value& messages, const JsonOptions& opts = {});
std::vector<ToolSpec> tools_from_value(const pyjson::Value& tools);
ToolSpec tool_from_value(const pyjson::Value& tool, const std::string& where = "tools[0]");

// ---------------------------------------------------------------------------------------------------------
// Rendering

struct Segment {
  std::string text;
  bool trusted = false;
};

class ReplayMap;  // dsml.h

struct RenderOptions {
  Profile profile = Profile::V41;
  bool thinking = true;
  Effort effort;                           // Default = high (hosted-API default, §2.5 [P])
  std::optional<int64_t> context_tokens;   // session context; Think-Max needs >= max_effort_min_context
  int64_t max_effort_min_context = 393216;
  bool drop_thinking = true;
  bool tools_enabled = true;               // false when tool_choice == "none": tools not rendered
  bool merge_leading_system = true;        // join consecutive leading system messages with "\n\n" [P]
  bool merge_consecutive_assistants = true;  // [P] (Responses splits text and calls)
  bool continue_final_message = false;     // final assistant message rendered without EOS
  ReplayMap* replay = nullptr;             // exact DSML replay (§3.7); nullptr = always canonical
};

struct RenderedPrompt {
  std::vector<Segment> segments;
  std::string text;              // concatenation of the segments
  std::string effective_effort;  // "none" (chat), "low", "high", "max" or the V4.1 number
  int replayed_blocks = 0;       // assistant DSML blocks written from the replay map
  int canonical_blocks = 0;      // assistant DSML blocks rendered canonically
};

RenderedPrompt render_prompt(const Conversation& conv, const RenderOptions& opts);

// Canonical DSML block of one assistant turn, starting with "\n\n" (§2.7), as segments.
std::vector<Segment> render_tool_calls_block(const std::vector<ToolCall>& calls, Profile profile);
// The tools block of §2.6 (without the leading "\n\n").
std::vector<Segment> render_tools_block(const std::vector<ToolSpec>& tools, Profile profile);

// DSML tag spellings per profile.
struct DsmlNames {
  const char* block;   // "tool_calls" | " calls"
  const char* invoke;  // "invoke" | " invoke"
  const char* param;   // "parameter" | " parameter"
};
DsmlNames dsml_names(Profile p);

// Added-token strings the renderer writes.
namespace tok {
inline constexpr const char* kBos = "<｜begin▁of▁sentence｜>";
inline constexpr const char* kEos = "<｜end▁of▁sentence｜>";
inline constexpr const char* kUser = "<｜User｜>";
inline constexpr const char* kAssistant = "<｜Assistant｜>";
inline constexpr const char* kSystem = "<｜System｜>";  // V4.1 only
inline constexpr const char* kThink = "<think>";
inline constexpr const char* kThinkEnd = "</think>";
inline constexpr const char* kDsml = "｜DSML｜";
inline constexpr const char* kLatestReminder = "<｜latest_reminder｜>";
}  // namespace tok

// ---------------------------------------------------------------------------------------------------------
// Segments → token ids (see the analysis at the top of this file). `Tok` is dsx::text::Tokenizer or any
// type with encode(text, allow_added), is_added(id) and decode_one(id).
template <typename Tok>
std::vector<int32_t> encode_segments(const Tok& tokenizer, const std::vector<Segment>& segments) {
  std::vector<int32_t> out;
  std::string plain;
  auto flush = [&]() {
    if (plain.empty()) return;
    auto ids = tokenizer.encode(std::string_view(plain), false);
    out.insert(out.end(), ids.begin(), ids.end());
    plain.clear();
  };
  for (const Segment& s : segments) {
    if (!s.trusted) {
      plain += s.text;
      continue;
    }
    auto ids = tokenizer.encode(std::string_view(s.text), true);
    size_t pos = 0;
    for (int32_t id : ids) {
      if (!tokenizer.is_added(id)) continue;
      const std::string marker = tokenizer.decode_one(id);
      const size_t at = marker.empty() ? std::string::npos : s.text.find(marker, pos);
      DSX_CHECK(at != std::string::npos, "encode_segments: added token ", id, " not found in trusted text");
      plain.append(s.text, pos, at - pos);
      flush();
      out.push_back(id);
      pos = at + marker.size();
    }
    plain.append(s.text, pos, std::string::npos);
  }
  flush();
  return out;
}

}  // namespace dsx::text
