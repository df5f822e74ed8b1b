// dsx: constrained decoding (spec chat-and-serving.md §3.6): tool_choice "required" / a named tool, and
// response_format json_schema / json_object. The constraint steers one completion token by token so that
// even a weak model emits a call the DSML parser (text/dsml.h) reads as exactly one valid tool call, or
// content that is one JSON value valid against the requested schema.
//
// How it works. Each request compiles a small grammar over *symbols*: the 256 byte values plus three marker
// symbols that only the added tokens "｜DSML｜", "</think>" and EOS produce (an ordinary BPE token that spells
// the same bytes is a different, byte-level, thing). A token is allowed when its symbols keep the output a
// valid prefix of the grammar. Each step:
//   - if the grammar admits exactly one next symbol, the whole deterministic run is computed and emitted as
//     forced tokens (byte runs as Tokenizer::encode(bytes, false), markers as their added tokens — the same
//     ids encode(text, true) gives for renderer-written text), one per step with needs_logits() false;
//   - otherwise the vocabulary is scanned (bucketed by first symbol, so a fixed choice such as a tool name
//     or an enum only looks at the tokens that can start one of its values), disallowed logits are set to
//     -infinity and the caller's pick function chooses.
// Inside free text the allowed-token mask depends only on the text's own state, so masks are cached per
// constraint and a step costs well under a millisecond on the 129k vocabulary (a full scan, a few ms, when the
// state is new). Token bytes are cached once per Tokenizer (thread-safe); a Constraint is used by one request
// and keeps a reference to its Tokenizer, which must outlive it.
//
// Tool call grammar (the bytes text::render_tool_calls_block writes for the resulting call):
//   [REASONING "</think>"] "\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"" NAME "\">\n" PARAMS "\n</｜DSML｜ invoke>"
//   "\n</｜DSML｜ calls>"   (V4 / V4-0731 spell the tags without the leading space, text::dsml_names)
//   - REASONING (thinking only): free text — any ordinary token, valid UTF-8, never the bytes "</think>" — until
//     the model picks the </think> token; after max_reasoning_tokens it is forced (after completing a
//     character).
//   - NAME: the named tool, or one of the tools' names for "required".
//   - PARAMS: the schema's properties in schema order, separated by "\n"; every required property is
//     present, each optional one is offered to the model (it may skip it). Properties listed in "required"
//     but missing from "properties" are appended (any JSON value). A tool without properties has none
//     (an invoke with no parameters: "\">\n\n</｜DSML｜ invoke>").
//   - a parameter is `<｜DSML｜ parameter name="KEY" string="true|false">VALUE</｜DSML｜ parameter>`:
//       string → string="true", VALUE free text (valid UTF-8, never containing the parameter closer or its
//                escaped form "&lt;/｜DSML｜ parameter>", no added tokens), closed by force after
//                max_string_tokens;
//       enum / const → one of the listed values (strings raw with string="true", others as JSON with
//                string="false");
//       type unions (["string","null"], anyOf / oneOf) → the model picks string="true" text or
//                string="false" JSON of the other alternatives;
//       anything else → string="false" and VALUE one JSON value as below.
//   The completion ends right after the block closer (done()).
// JSON values (parameters with string="false", and response_format), always in Python json.dumps form
// (", " and ": " separators, the escapes json.dumps writes, no other whitespace):
//   string: JSON string, free content (valid UTF-8, escapes \" \\ \b \f \n \r \t and \u00XX for the other
//     C0 controls), closed by force after max_string_tokens; integer: -?(0|[1-9][0-9]*) (no -0);
//   number: JSON number with a lower-case 'e', at most two exponent digits and no bare -0; both at most
//   max_number_chars characters (integers are therefore written exactly as json.dumps re-prints them);
//   boolean / null / enum / const: one of the literal values (dumps form);
//   object with properties: "{" the properties in schema order, required ones always, optional ones
//     offered, "}" (additional properties are never generated); object without properties: any object (free
//     string keys, values per additionalProperties or any JSON value; "{}" when additionalProperties is false);
//   array: "[" items per "items" (any JSON value when absent) "]", honouring minItems, at most
//     min(maxItems, max_items) items (but at least minItems);
//   anyOf / oneOf / type lists: a union of the alternatives whose first characters differ (an alternative
//     that starts like an earlier one is dropped); allOf (in a schema without type / properties of its own):
//     its first subschema; local "$ref" (#/…) resolved;
//   no type (or true / {}): any JSON value, objects and arrays nested at most max_depth deep (past that only
//     scalars). A schema nested deeper than max_depth (recursive $ref) is still followed, minimally: required
//     properties only, the fewest array items. Keywords not listed (pattern, format, minimum, minLength,
//     uniqueItems, …) are not enforced; free-form objects may repeat a key.
//   Inside a DSML value, JSON strings also never contain the parameter closer bytes (nor its escaped form);
//   in response_format content they never contain the EOS text (the parser would end the content there).
// Lazy tool grammar (tool_choice "auto" with tools; llama.cpp calls this a lazy grammar): the completion is
// free (the constraint is passive: the caller picks as usual and reports each token with observe()) until, in
// the content (after </think> when thinking), the model picks the "｜DSML｜" marker token right after a '<'
// byte, i.e. starts the block opener "<｜DSML｜ calls>". From the marker's end on the constraint steers:
//   NAMES_REST ">\n<｜DSML｜ invoke name=\"" INVOKE ("\n<｜DSML｜ invoke name=\"" INVOKE)* "\n</｜DSML｜ calls>"
//   INVOKE = NAME "\">\n" PARAMS' "\n</｜DSML｜ invoke>"
// (NAMES_REST: " calls" / "tool_calls" per profile), NAME one of the tools' names, PARAMS' as PARAMS above but
// the properties in any order (each at most once, the required ones all present), so that a call already
// written in the renderer's form, whatever its argument order, is never changed. The completion ends after
// the block closer (done()). Tools whose name contains '"' are left out; nullptr when no tool can be written
// or a schema cannot be compiled (then the completion is decoded freely).
// response_format grammar: [REASONING "</think>"] VALUE EOS — the EOS token ends the completion (the
// scheduler stops at EOS); done() is true after it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "text/chat.h"
#include "text/tokenizer.h"

namespace dsx::server {

// Steers one completion token by token. Each step the scheduler calls next() with that step's logits
// (vocabulary-sized, host memory) and a pick function (greedy argmax or the request's sampler) that it must
// apply to the logits with every token the constraint does not allow set to -infinity; or, when
// needs_logits() is false, the constraint returns its forced token without them (logits may be nullptr).
// A token id >= the tokenizer's size is never allowed. If pick returns a disallowed token, the allowed token
// with the highest logit is taken instead.
class Constraint {
 public:
  virtual ~Constraint() = default;
  virtual bool needs_logits() const = 0;
  virtual int32_t next(float* logits, int64_t vocab, const std::function<int32_t(const float*, int64_t)>& pick) = 0;
  virtual bool done() const = 0;  // the constrained output is complete: the scheduler ends the completion
  // Passive (the lazy tool grammar before its trigger): the caller may pick this step's token itself, from
  // the unmodified logits (on the device), and must then report it with observe() instead of calling next().
  virtual bool passive() const { return false; }
  virtual void observe(int32_t /*token*/) {}
  // The output budget is nearly spent: from now on every open string value and the reasoning close at the next
  // character boundary, as if their token limits were reached, and so does every string entered later, so that
  // a call or JSON value started near the end is still completed (the rest of the grammar is unchanged:
  // required properties still come, with values closed at once).
  virtual void wrap_up() {}
};

struct ConstraintLimits {
  int max_reasoning_tokens = 512;
  int max_string_tokens = 256;  // per string value (DSML string parameter, JSON string or key)
  int max_number_chars = 24;
  int max_items = 16;  // items of an array / members of a free-form object
  int max_depth = 6;   // nesting of free-form JSON (objects / arrays) and of recursive schemas
};

// tool_choice "required" (any of `tools`) or a tool's name (throws dsx::Error for an unknown name, an empty
// tool list, or a name / property name containing '"'). thinking: the prompt ended with <think>.
std::unique_ptr<Constraint> tool_call_constraint(const text::Tokenizer& tok, const std::vector<text::ToolSpec>& tools,
                                                 const std::string& choice, text::Profile profile, bool thinking,
                                                 ConstraintLimits lim = {});

// tool_choice "auto" with tools: the lazy tool grammar above (nullptr: no constraint).
std::unique_ptr<Constraint> lazy_tool_constraint(const text::Tokenizer& tok, const std::vector<text::ToolSpec>& tools,
                                                 text::Profile profile, bool thinking, ConstraintLimits lim = {});

// response_format {type: "json_schema", json_schema: {schema}} (also {type: "json_schema", schema}, the
// Responses API text.format shape) or {type: "json_object"}: the content is one JSON value valid against the
// schema (json_object, or json_schema without a schema: any object), after the reasoning as above. Other
// types throw dsx::Error.
std::unique_ptr<Constraint> json_constraint(const text::Tokenizer& tok, const text::pyjson::Value& response_format,
                                            bool thinking, ConstraintLimits lim = {});

}  // namespace dsx::server
