// dsx: incremental DSML / reasoning / content parser and the exact-replay map. See dsml.h and spec §3.
#include "text/dsml.h"

#include <sys/random.h>

#include <algorithm>
#include <cctype>
#include <random>
#include <set>

namespace dsx::text {

// =========================================================================================================
// finish reasons

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::ToolCalls: return "tool_calls";
    case FinishReason::Length: return "length";
    case FinishReason::StopSequence: return "stop_sequence";
  }
  return "?";
}

const char* openai_finish_reason(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "stop";
    case FinishReason::ToolCalls: return "tool_calls";
    case FinishReason::Length: return "length";
    case FinishReason::StopSequence: return "stop";
  }
  return "stop";
}

const char* anthropic_stop_reason(FinishReason r) {
  switch (r) {
    case FinishReason::Stop: return "end_turn";
    case FinishReason::ToolCalls: return "tool_use";
    case FinishReason::Length: return "max_tokens";
    case FinishReason::StopSequence: return "stop_sequence";
  }
  return "end_turn";
}

ResponsesTerminal responses_terminal(FinishReason r) {
  if (r == FinishReason::Length) return {"response.incomplete", "incomplete", "max_output_tokens"};
  return {"response.completed", "completed", nullptr};
}

const char* event_type_name(EventType t) {
  switch (t) {
    case EventType::ReasoningDelta: return "reasoning_delta";
    case EventType::ReasoningEnd: return "reasoning_end";
    case EventType::ContentDelta: return "content_delta";
    case EventType::ToolCallStart: return "tool_call_start";
    case EventType::ToolCallDelta: return "tool_call_delta";
    case EventType::ToolCallEnd: return "tool_call_end";
    case EventType::Error: return "error";
  }
  return "?";
}

// =========================================================================================================
// ids and the replay map

std::string random_hex(size_t nbytes) {
  std::string raw(nbytes, '\0');
  size_t got = 0;
  while (got < nbytes) {
    ssize_t r = getrandom(raw.data() + got, nbytes - got, 0);
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  if (got < nbytes) {
    std::random_device rd;
    for (size_t i = got; i < nbytes; ++i) raw[i] = static_cast<char>(rd() & 0xFF);
  }
  static const char* hx = "0123456789abcdef";
  std::string out;
  out.reserve(nbytes * 2);
  for (unsigned char c : raw) {
    out += hx[c >> 4];
    out += hx[c & 15];
  }
  return out;
}

ReplayMap::ReplayMap(size_t max_ids, size_t max_bytes) : max_ids_(max_ids), max_bytes_(max_bytes) {}

void ReplayMap::erase_locked(const std::string& id) {
  auto it = map_.find(id);
  if (it == map_.end()) return;
  auto block = it->second.block;
  lru_.erase(it->second.lru);
  map_.erase(it);
  if (--block->live == 0) bytes_ -= block->bytes;
}

void ReplayMap::evict_locked() {
  while (!lru_.empty() && (map_.size() > max_ids_ || bytes_ > max_bytes_)) erase_locked(lru_.back());
}

void ReplayMap::remember(const std::vector<std::string>& ids, const std::vector<std::string>& names,
                         std::vector<Segment> block) {
  if (ids.empty()) return;
  auto b = std::make_shared<Block>();
  b->segments = std::move(block);
  b->ids = ids;
  b->names = names;
  for (const auto& s : b->segments) b->bytes += s.text.size();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& id : ids) erase_locked(id);
  for (const auto& id : ids) {
    if (map_.count(id)) continue;  // duplicate id inside one turn
    lru_.push_front(id);
    map_.emplace(id, Entry{b, lru_.begin()});
    if (b->live++ == 0) bytes_ += b->bytes;
  }
  evict_locked();
}

void ReplayMap::remember(const ParseResult& r) {
  if (r.tool_calls.empty() || r.block_segments.empty()) return;
  std::vector<std::string> ids, names;
  for (const auto& c : r.tool_calls) {
    ids.push_back(c.id);
    names.push_back(c.name);
  }
  remember(ids, names, r.block_segments);
}

std::optional<std::vector<Segment>> ReplayMap::lookup(const std::vector<ToolCall>& calls) {
  if (calls.empty()) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<Block> block;
  for (const auto& c : calls) {
    auto it = map_.find(c.id);
    if (c.id.empty() || it == map_.end()) return std::nullopt;
    if (!block) block = it->second.block;
    else if (block != it->second.block) return std::nullopt;
  }
  if (block->ids.size() != calls.size()) return std::nullopt;
  for (size_t i = 0; i < calls.size(); ++i)
    if (block->ids[i] != calls[i].id || block->names[i] != calls[i].name) return std::nullopt;
  for (const auto& c : calls) {
    auto it = map_.find(c.id);
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  return block->segments;
}

bool ReplayMap::contains(std::string_view id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.count(std::string(id)) > 0;
}

std::string ReplayMap::new_id(std::string_view prefix) {
  for (;;) {
    std::string id = std::string(prefix) + random_hex(16);
    if (!contains(id)) return id;
  }
}

size_t ReplayMap::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.size();
}

size_t ReplayMap::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_;
}

// =========================================================================================================
// parser

namespace {

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kEosText = "<｜end▁of▁sentence｜>";
constexpr const char* kReplacement = "\xEF\xBF\xBD";

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

// s is a non-empty proper prefix of p
bool proper_prefix(std::string_view s, std::string_view p) { return s.size() < p.size() && starts_with(p, s); }

// Longest k < p.size() such that s ends with p[0:k].
size_t partial_suffix(std::string_view s, std::string_view p) {
  size_t k = std::min(s.size(), p.size() - 1);
  for (; k > 0; --k)
    if (s.substr(s.size() - k) == p.substr(0, k)) return k;
  return 0;
}

enum class TagKind { Block, Invoke, Param };

// Spellings accepted on output (§3.5): "<｜DSML｜name", "<DSML｜name" (first bar missing) and plain "<name";
// V4 names ("tool_calls", "invoke", "parameter") and V4.1 names (" calls", " invoke", " parameter").
struct Head {
  std::string text;  // "<" or "</" + prefix + name
  TagKind kind;
  bool closing;
  bool v41;          // spaced V4.1 spelling
  std::string prefix;
  std::string name;
};

const std::vector<Head>& all_heads() {
  static const std::vector<Head> heads = [] {
    std::vector<Head> v;
    const char* prefixes[] = {"｜DSML｜", "DSML｜", ""};
    struct N {
      TagKind k;
      const char* name;
      bool v41;
    } names[] = {{TagKind::Block, "tool_calls", false}, {TagKind::Block, " calls", true},
                 {TagKind::Invoke, "invoke", false},    {TagKind::Invoke, " invoke", true},
                 {TagKind::Param, "parameter", false},  {TagKind::Param, " parameter", true}};
    for (int closing = 0; closing < 2; ++closing)
      for (const char* p : prefixes)
        for (const auto& n : names) {
          if (!*p && n.v41) continue;  // "< calls>" is not a spelling
          Head h;
          h.text = std::string(closing ? "</" : "<") + p + n.name;
          h.kind = n.k;
          h.closing = closing != 0;
          h.v41 = n.v41;
          h.prefix = p;
          h.name = n.name;
          v.push_back(std::move(h));
        }
    return v;
  }();
  return heads;
}

enum class Match { None, Partial, Full };

// Does `s` (starting at '<') begin with one of the heads allowed by `allowed(head)`, followed by a delimiter?
template <typename Pred>
Match match_head(std::string_view s, Pred allowed, const Head** out) {
  Match best = Match::None;
  for (const Head& h : all_heads()) {
    if (!allowed(h)) continue;
    if (s.size() <= h.text.size()) {
      if (starts_with(h.text, s)) best = Match::Partial;  // need the delimiter (or more) to decide
      continue;
    }
    if (!starts_with(s, h.text)) continue;
    const char d = s[h.text.size()];
    if (d == '>' || is_ws(d) || (!h.closing && d == '/')) {
      *out = &h;
      return Match::Full;
    }
  }
  return best;
}

// Block openers accepted in content: an exact head followed directly by '>'.
Match match_block_opener(std::string_view s, size_t* len) {
  Match best = Match::None;
  for (const Head& h : all_heads()) {
    if (h.kind != TagKind::Block || h.closing) continue;
    const std::string full = h.text + ">";
    if (starts_with(s, full)) {
      *len = full.size();
      return Match::Full;
    }
    if (proper_prefix(s, full)) best = Match::Partial;
  }
  return best;
}

}  // namespace

struct DsmlParser::Impl {
  ParserOptions o;
  ParseResult res;
  std::vector<Event>* ev = nullptr;
  bool finished = false;

  // Ended: the EOS token's text was passed in (callers normally stop at the EOS id and pass nothing).
  enum class St { Reasoning, Content, Tool, Done, Failed, Stopped, Ended };
  St st;
  bool at_output_start = true;
  bool dsml_enabled;
  std::string utf8_tail;
  bool warned_utf8 = false;
  std::string buf;  // unprocessed valid UTF-8
  size_t ws_prefix = 0;  // Content: leading bytes of buf known to be held whitespace (no '<' among them)

  // stop strings
  std::string stop_hold;
  size_t max_stop = 0;

  // tool block
  struct Frame {
    TagKind kind;  // Block, Invoke, or Param (= nested object inside a parameter)
    size_t count = 0;
    std::set<std::string> keys;
  };
  enum class TS { Between, StrValue, JsonValue, Undecided };
  TS ts = TS::Between;
  std::vector<Frame> stack;
  std::string block_raw;
  std::vector<Segment> block_segs;
  bool calls_started = false;
  std::vector<ParsedToolCall> calls;
  ParsedToolCall cur;
  std::string cur_key;
  std::string closer, esc_closer;
  size_t json_scan = 0;
  std::string failed_text;
  bool warned_after_done = false;
  bool block_done = false;
  bool saw_other_profile_spelling = false;

  // schema types: tool → param → types
  std::unordered_map<std::string, std::unordered_map<std::string, std::vector<std::string>>> schema;

  explicit Impl(ParserOptions opts) : o(std::move(opts)) {
    st = o.thinking ? St::Reasoning : St::Content;
    res.reasoning_started = o.thinking;
    dsml_enabled = o.tools_enabled;
    for (const auto& s : o.stop) max_stop = std::max(max_stop, s.size());
    o.stop.erase(std::remove(o.stop.begin(), o.stop.end(), std::string()), o.stop.end());
    for (const auto& t : o.tools) {
      const pyjson::Value* params = t.function.get("parameters");
      const pyjson::Value* props = params ? params->get("properties") : nullptr;
      if (!props || !props->is_object()) continue;
      auto& m = schema[t.name];
      for (const auto& [k, v] : props->members) {
        const pyjson::Value* ty = v.get("type");
        if (!ty) continue;
        if (ty->is_string()) m[k].push_back(ty->text);
        else if (ty->is_array())
          for (const auto& x : ty->items)
            if (x.is_string()) m[k].push_back(x.text);
      }
    }
  }

  void warn(std::string w) { res.warnings.push_back(std::move(w)); }
  void emit(EventType t, std::string text, int index = -1, const std::string& id = "", const std::string& name = "") {
    Event e;
    e.type = t;
    e.text = std::move(text);
    e.index = index;
    e.id = id;
    e.name = name;
    ev->push_back(std::move(e));
  }

  // ---- input: UTF-8 sanitation ----------------------------------------------------------------------
  static size_t seq_len(unsigned char c) {
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) return 2;
    if ((c & 0xF0) == 0xE0) return 3;
    if (c >= 0xF0 && c <= 0xF4) return 4;
    return 0;
  }
  static bool second_ok(unsigned char lead, unsigned char b) {
    if ((b & 0xC0) != 0x80) return false;
    if (lead == 0xE0) return b >= 0xA0;
    if (lead == 0xED) return b <= 0x9F;
    if (lead == 0xF0) return b >= 0x90;
    if (lead == 0xF4) return b <= 0x8F;
    return true;
  }
  void bad_byte() {
    buf += kReplacement;
    if (!warned_utf8) {
      warned_utf8 = true;
      warn("invalid UTF-8 in the sampled text replaced by U+FFFD");
    }
  }
  void feed_bytes(std::string_view bytes, bool final) {
    std::string in = utf8_tail + std::string(bytes);
    utf8_tail.clear();
    const auto* p = reinterpret_cast<const unsigned char*>(in.data());
    const size_t n = in.size();
    size_t i = 0, run = 0;
    while (i < n) {
      if (p[i] < 0x80) {
        ++i;
        continue;
      }
      const size_t len = seq_len(p[i]);
      bool ok = len > 0;
      size_t have = std::min(len, n - i);
      for (size_t k = 1; ok && k < have; ++k)
        ok = (k == 1) ? second_ok(p[i], p[i + 1]) : (p[i + k] & 0xC0) == 0x80;
      if (ok && have < len) {  // incomplete character at the end
        buf.append(in, run, i - run);
        if (final) bad_byte();
        else utf8_tail.assign(in, i, std::string::npos);
        return;
      }
      if (!ok) {
        buf.append(in, run, i - run);
        bad_byte();
        ++i;
        run = i;
        continue;
      }
      i += len;
    }
    buf.append(in, run, std::string::npos);
  }

  // ---- output channels --------------------------------------------------------------------------------
  void reasoning(std::string_view s) {
    if (s.empty()) return;
    res.reasoning.append(s);
    emit(EventType::ReasoningDelta, std::string(s));
  }
  void content_out(std::string_view s) {
    if (s.empty()) return;
    res.content.append(s);
    emit(EventType::ContentDelta, std::string(s));
  }
  // Visible content goes through the stop-string matcher.
  void content(std::string_view s) {
    if (s.empty() || st == St::Stopped) return;
    if (o.stop.empty()) {
      content_out(s);
      return;
    }
    stop_hold.append(s);
    size_t best = std::string::npos;
    const std::string* which = nullptr;
    for (const auto& stop : o.stop) {
      size_t at = stop_hold.find(stop);
      if (at != std::string::npos && at < best) {
        best = at;
        which = &stop;
      }
    }
    if (which) {
      content_out(std::string_view(stop_hold).substr(0, best));
      res.stop_sequence = *which;
      stop_hold.clear();
      buf.clear();
      st = St::Stopped;
      return;
    }
    size_t keep = std::min(stop_hold.size(), max_stop - 1);
    size_t cut = stop_hold.size() - keep;
    while (cut > 0 && cut < stop_hold.size() && (static_cast<unsigned char>(stop_hold[cut]) & 0xC0) == 0x80) --cut;
    content_out(std::string_view(stop_hold).substr(0, cut));
    stop_hold.erase(0, cut);
  }
  void flush_stop_hold() {
    if (st == St::Stopped) return;
    content_out(stop_hold);
    stop_hold.clear();
  }

  // ---- block bookkeeping --------------------------------------------------------------------------------
  void raw(std::string_view s, bool trusted) {
    if (s.empty()) return;
    block_raw.append(s);
    if (!block_segs.empty() && block_segs.back().trusted == trusted) block_segs.back().text.append(s);
    else block_segs.push_back(Segment{std::string(s), trusted});
  }
  void args(std::string s) {
    if (s.empty()) return;
    cur.arguments += s;
    emit(EventType::ToolCallDelta, std::move(s), static_cast<int>(calls.size()), cur.id, cur.name);
  }
  std::string new_id() {
    for (;;) {
      std::string id;
      if (o.make_id) id = o.make_id();
      else if (o.replay) id = o.replay->new_id(o.id_prefix);
      else id = o.id_prefix + random_hex(16);
      bool dup = false;
      for (const auto& c : calls) dup = dup || c.id == id;
      if (!dup || o.make_id) return id;
    }
  }

  void fail_block(const std::string& reason) {
    warn("invalid tool call: " + reason);
    stack.clear();
    ts = TS::Between;
    if (calls_started) {
      res.stream_error = true;
      res.error = "invalid tool call: " + reason;
      emit(EventType::Error, res.error);
      failed_text = block_raw + buf;
      buf.clear();
      st = St::Failed;
    } else {
      // Nothing of the block was streamed: it is ordinary content; stop interpreting DSML in this completion.
      dsml_enabled = false;
      st = St::Content;
      ws_prefix = 0;
      content(block_raw);
    }
    block_raw.clear();
    block_segs.clear();
    calls.clear();
  }

  void block_closed() {
    st = St::Done;
    block_done = true;
    res.tool_calls = calls;
    res.block_text = block_raw;
    res.block_segments = block_segs;
    if (o.replay) o.replay->remember(res);
  }

  // ---- state handlers (return true when progress was made and the loop should continue) ---------------
  bool step_reasoning(bool final) {
    if (at_output_start) {
      if (starts_with(buf, kThinkOpen)) {
        buf.erase(0, kThinkOpen.size());  // the model repeated <think>: strip one
        at_output_start = false;
        return true;
      }
      if (!final && proper_prefix(buf, kThinkOpen)) return false;
      if (!buf.empty()) at_output_start = false;
    }
    const size_t pos = buf.find(kThinkClose);
    if (pos != std::string::npos) {
      reasoning(std::string_view(buf).substr(0, pos));
      buf.erase(0, pos + kThinkClose.size());
      res.reasoning_closed = true;
      emit(EventType::ReasoningEnd, "");
      st = St::Content;
      ws_prefix = 0;
      return true;
    }
    const size_t keep = final ? 0 : partial_suffix(buf, kThinkClose);
    reasoning(std::string_view(buf).substr(0, buf.size() - keep));
    buf.erase(0, buf.size() - keep);
    return false;
  }

  bool step_content(bool final) {
    if (at_output_start) {  // chat mode: a completion that opens with <think> is reasoning
      if (starts_with(buf, kThinkOpen)) {
        buf.erase(0, kThinkOpen.size());
        at_output_start = false;
        res.reasoning_started = true;
        st = St::Reasoning;
        return true;
      }
      if (!final && proper_prefix(buf, kThinkOpen)) return false;
      if (!buf.empty()) at_output_start = false;
    }
    size_t hold = buf.size();
    for (size_t p = buf.find('<', ws_prefix); p != std::string::npos; p = buf.find('<', p + 1)) {
      const std::string_view rest = std::string_view(buf).substr(p);
      if (starts_with(rest, kEosText)) {
        content(std::string_view(buf).substr(0, p));
        if (st == St::Stopped) return false;
        buf.clear();
        st = St::Ended;
        return false;
      }
      if (!final && proper_prefix(rest, kEosText)) {
        hold = p;
        break;
      }
      if (!dsml_enabled) continue;
      size_t len = 0;
      const Match m = match_block_opener(std::string_view(buf).substr(p), &len);
      if (m == Match::Full) {
        const size_t b = (p >= 2 && buf[p - 2] == '\n' && buf[p - 1] == '\n') ? p - 2 : p;
        content(std::string_view(buf).substr(0, b));
        if (st == St::Stopped) return false;
        flush_stop_hold();
        const std::string_view opener = std::string_view(buf).substr(p, len);
        note_spelling(opener.find(" calls") != std::string_view::npos);
        raw(std::string_view(buf).substr(b, p - b), true);
        raw(opener, true);
        buf.erase(0, p + len);
        st = St::Tool;
        stack.assign(1, Frame{TagKind::Block, 0, {}});
        ts = TS::Between;
        calls_started = false;
        calls.clear();
        return true;
      }
      if (m == Match::Partial && !final) {
        hold = p;
        break;
      }
    }
    const size_t candidate = hold;
    if (final) {
      hold = buf.size();
    } else if (dsml_enabled) {  // a trailing whitespace run may belong to a block: hold it
      while (hold > ws_prefix && is_ws(buf[hold - 1])) --hold;
      if (hold == ws_prefix) hold = 0;  // buf[0, ws_prefix) is whitespace already
    }
    content(std::string_view(buf).substr(0, hold));
    if (st == St::Stopped) return false;
    buf.erase(0, hold);
    ws_prefix = final ? 0 : candidate - hold;  // what is left before the candidate is whitespace
    return false;
  }

  void note_spelling(bool v41_spelling) {
    if (v41_spelling != (o.profile == Profile::V41) && !saw_other_profile_spelling) {
      saw_other_profile_spelling = true;
      warn(std::string("DSML spelled for profile ") + (v41_spelling ? "v41" : "v4") + " under profile " +
           profile_name(o.profile) + " (accepted)");
    }
  }

  // Parse the attributes of an opener tag (` key="value" …` up to the final '>'). `pieces` receives the tag
  // split into trusted markup and untrusted attribute values.
  static bool parse_attrs(std::string_view tag, size_t from, std::vector<std::pair<std::string, std::string>>& attrs,
                          std::vector<Segment>& pieces) {
    size_t i = from;
    const size_t end = tag.size() - 1;  // position of '>'
    size_t seg = 0;
    while (true) {
      while (i < end && is_ws(tag[i])) ++i;
      if (i == end) break;
      if (tag[i] == '/' && i + 1 == end) {
        ++i;
        break;
      }
      const size_t ks = i;
      while (i < end && (std::isalnum(static_cast<unsigned char>(tag[i])) || tag[i] == '_' || tag[i] == '-' ||
                         tag[i] == ':'))
        ++i;
      if (i == ks) return false;
      std::string key(tag.substr(ks, i - ks));
      while (i < end && is_ws(tag[i])) ++i;
      if (i >= end || tag[i] != '=') return false;
      ++i;
      while (i < end && is_ws(tag[i])) ++i;
      if (i >= end || tag[i] != '"') return false;
      ++i;
      const size_t vs = i;
      while (i < end && tag[i] != '"') ++i;
      if (i >= end) return false;
      pieces.push_back(Segment{std::string(tag.substr(seg, vs - seg)), true});
      pieces.push_back(Segment{std::string(tag.substr(vs, i - vs)), false});
      seg = i;
      attrs.emplace_back(std::move(key), std::string(tag.substr(vs, i - vs)));
      ++i;
    }
    pieces.push_back(Segment{std::string(tag.substr(seg)), true});
    return true;
  }

  static const std::string* attr(const std::vector<std::pair<std::string, std::string>>& a, std::string_view k) {
    for (const auto& [key, v] : a)
      if (key == k) return &v;
    return nullptr;
  }

  void param_done() {
    ++stack.back().count;
    ts = TS::Between;
  }

  void close_nested() {
    args("}");
    stack.pop_back();
    param_done();
  }

  void close_invoke() {
    args(stack.back().count == 0 ? "{}" : "}");
    stack.pop_back();
    const int idx = static_cast<int>(calls.size());
    emit(EventType::ToolCallEnd, cur.arguments, idx, cur.id, cur.name);
    calls.push_back(std::move(cur));
    cur = ParsedToolCall{};
    ts = TS::Between;
  }

  bool handle_tag(const Head& h, std::string_view tag) {
    Frame& f = stack.back();
    if (h.closing) {
      for (size_t i = h.text.size(); i + 1 < tag.size(); ++i)
        if (!is_ws(tag[i])) {
          fail_block("malformed closing tag");
          return true;
        }
      raw(tag, true);
      if (h.kind == TagKind::Block && f.kind == TagKind::Block) {
        block_closed();
        return true;
      }
      if (h.kind == TagKind::Invoke && f.kind != TagKind::Block) {
        while (stack.back().kind == TagKind::Param) close_nested();
        close_invoke();
        return true;
      }
      if (h.kind == TagKind::Param && f.kind == TagKind::Param) {
        close_nested();
        return true;
      }
      fail_block("unexpected closing tag " + std::string(tag));
      return true;
    }
    std::vector<std::pair<std::string, std::string>> attrs;
    std::vector<Segment> pieces;
    if (!parse_attrs(tag, h.text.size(), attrs, pieces)) {
      raw(tag, true);
      fail_block("malformed tag attributes");
      return true;
    }
    for (const auto& piece : pieces) raw(piece.text, piece.trusted);
    if (h.kind == TagKind::Invoke && f.kind == TagKind::Block) {
      const std::string* name = attr(attrs, "name");
      if (!name || name->empty()) {
        fail_block("invoke without a name");
        return true;
      }
      note_spelling(h.v41);
      cur = ParsedToolCall{};
      cur.id = new_id();
      cur.name = *name;
      calls_started = true;
      emit(EventType::ToolCallStart, "", static_cast<int>(calls.size()), cur.id, cur.name);
      stack.push_back(Frame{TagKind::Invoke, 0, {}});
      ts = TS::Between;
      return true;
    }
    if (h.kind == TagKind::Param && f.kind != TagKind::Block) {
      const std::string* name = attr(attrs, "name");
      if (!name) {
        fail_block("parameter without a name");
        return true;
      }
      cur_key = *name;
      if (!f.keys.insert(cur_key).second)
        warn("tool '" + cur.name + "': duplicate parameter '" + cur_key + "' (last value wins)");
      std::string pre = f.count == 0 ? (f.kind == TagKind::Invoke ? "{" : "") : ", ";
      pre += pyjson::quoted(cur_key);
      pre += ": ";
      closer = "</" + h.prefix + h.name + ">";
      esc_closer = "&lt;" + closer.substr(1);
      const std::string* str = attr(attrs, "string");
      if (str && (*str == "true" || *str == "True")) {
        args(pre + "\"");
        ts = TS::StrValue;
      } else if (str && (*str == "false" || *str == "False")) {
        args(pre);
        ts = TS::JsonValue;
        json_scan = 0;
      } else {
        if (str) warn("parameter '" + cur_key + "': string=\"" + *str + "\" treated as a string");
        args(pre);
        ts = str ? TS::StrValue : TS::Undecided;
        if (str) args("\"");
      }
      return true;
    }
    fail_block("unexpected tag " + std::string(tag));
    return true;
  }

  // Decode the single escape the renderer applies (§2.7): "&lt;" + closer-without-'<' → closer.
  std::string decode_value(std::string_view v) const {
    std::string out;
    size_t pos = 0;
    for (;;) {
      size_t at = v.find(esc_closer, pos);
      if (at == std::string_view::npos) break;
      out.append(v.substr(pos, at - pos));
      out += closer;
      pos = at + esc_closer.size();
    }
    out.append(v.substr(pos));
    return out;
  }

  std::string quoted_body(std::string_view s) {
    std::string q = pyjson::quoted(s);
    return q.substr(1, q.size() - 2);
  }

  // §3.4: a string="false" value.
  std::string coerce_json(const std::string& value) {
    size_t a = value.find_first_not_of(" \t\r\n");
    size_t b = value.find_last_not_of(" \t\r\n");
    const std::string trimmed = a == std::string::npos ? std::string() : value.substr(a, b - a + 1);
    pyjson::ParseOptions strict;
    strict.allow_nan = false;
    pyjson::Value v;
    if (!trimmed.empty() && pyjson::try_parse(trimmed, v, strict)) return trimmed;
    std::vector<std::string> types;
    if (stack.size() == 2 && stack.back().kind == TagKind::Invoke) {  // top-level parameter of the call
      auto t = schema.find(cur.name);
      if (t != schema.end()) {
        auto p = t->second.find(cur_key);
        if (p != t->second.end()) types = p->second;
      }
    }
    auto has = [&](const char* t) { return std::find(types.begin(), types.end(), t) != types.end(); };
    if (has("string")) return pyjson::quoted(value);
    if (has("number") || has("integer") || has("boolean")) {
      std::string t = trimmed;
      if (t == "True" || t == "TRUE") t = "true";
      else if (t == "False" || t == "FALSE") t = "false";
      else if (t.size() >= 2 && (t.front() == '"' || t.front() == '\'') && t.back() == t.front())
        t = t.substr(1, t.size() - 2);
      if (!t.empty() && pyjson::try_parse(t, v, strict) &&
          (v.type == pyjson::Type::Int || v.type == pyjson::Type::Float || v.type == pyjson::Type::Bool))
        return t;
    }
    warn("tool '" + cur.name + "' parameter '" + cur_key + "': string=\"false\" value is not valid JSON; passed as a string");
    return pyjson::quoted(value);
  }

  bool step_tool(bool final) {
    switch (ts) {
      case TS::Between: {
        size_t i = 0;
        while (i < buf.size() && is_ws(buf[i])) ++i;
        raw(std::string_view(buf).substr(0, i), true);
        buf.erase(0, i);
        if (buf.empty()) return false;
        if (buf[0] != '<') {
          fail_block("unexpected text between DSML tags");
          return true;
        }
        const TagKind fk = stack.back().kind;
        const Head* h = nullptr;
        const Match m = match_head(
            buf,
            [&](const Head& x) {
              if (fk == TagKind::Block) return (x.kind == TagKind::Invoke && !x.closing) || (x.kind == TagKind::Block && x.closing);
              if (fk == TagKind::Invoke) return x.kind == TagKind::Param ? !x.closing : (x.kind == TagKind::Invoke && x.closing);
              return x.kind == TagKind::Param || (x.kind == TagKind::Invoke && x.closing);
            },
            &h);
        if (m == Match::None || (m == Match::Partial && final)) {
          fail_block("unexpected DSML tag");
          return true;
        }
        if (m == Match::Partial) return false;
        bool in_quote = false;
        size_t end = std::string::npos;
        for (size_t k = h->text.size(); k < buf.size() && k < o.max_tag_bytes; ++k) {
          if (buf[k] == '"') in_quote = !in_quote;
          else if (buf[k] == '>' && !in_quote) {
            end = k;
            break;
          }
        }
        if (end == std::string::npos) {
          if (final || buf.size() >= o.max_tag_bytes) {
            fail_block("unterminated DSML tag");
            return true;
          }
          return false;
        }
        const std::string tag = buf.substr(0, end + 1);
        buf.erase(0, end + 1);
        return handle_tag(*h, tag);
      }
      case TS::StrValue: {
        const size_t c = buf.find(closer);
        const size_t e = buf.find(esc_closer);
        if (e != std::string::npos && (c == std::string::npos || e < c)) {
          args(quoted_body(std::string_view(buf).substr(0, e)) + quoted_body(closer));
          raw(std::string_view(buf).substr(0, e + esc_closer.size()), false);
          buf.erase(0, e + esc_closer.size());
          return true;
        }
        if (c != std::string::npos) {
          args(quoted_body(std::string_view(buf).substr(0, c)) + "\"");
          raw(std::string_view(buf).substr(0, c), false);
          raw(closer, true);
          buf.erase(0, c + closer.size());
          param_done();
          return true;
        }
        const size_t keep = final ? 0 : std::max(partial_suffix(buf, closer), partial_suffix(buf, esc_closer));
        const size_t n = buf.size() - keep;
        args(quoted_body(std::string_view(buf).substr(0, n)));
        raw(std::string_view(buf).substr(0, n), false);
        buf.erase(0, n);
        return false;
      }
      case TS::JsonValue: {
        const size_t c = buf.find(closer, json_scan);
        if (c == std::string::npos) {
          json_scan = buf.size() >= closer.size() ? buf.size() - closer.size() + 1 : 0;
          return false;
        }
        const std::string value = decode_value(std::string_view(buf).substr(0, c));
        args(coerce_json(value));
        raw(std::string_view(buf).substr(0, c), false);
        raw(closer, true);
        buf.erase(0, c + closer.size());
        param_done();
        return true;
      }
      case TS::Undecided: {
        // No string attribute: a string, unless the value opens with a nested parameter (loose XML for an
        // object parameter, §3.4) — then the nested parameters form a JSON object.
        size_t i = 0;
        while (i < buf.size() && is_ws(buf[i])) ++i;
        if (i == buf.size()) {
          if (final) {
            ts = TS::StrValue;
            args("\"");
            return true;
          }
          return false;
        }
        if (buf[i] == '<') {
          const Head* h = nullptr;
          const Match m = match_head(std::string_view(buf).substr(i),
                                     [](const Head& x) { return x.kind == TagKind::Param && !x.closing; }, &h);
          if (m == Match::Partial && !final) return false;
          if (m == Match::Full) {
            raw(std::string_view(buf).substr(0, i), true);
            buf.erase(0, i);
            args("{");
            stack.push_back(Frame{TagKind::Param, 0, {}});
            ts = TS::Between;
            return true;
          }
        }
        ts = TS::StrValue;
        args("\"");
        return true;
      }
    }
    return false;
  }

  void run(bool final) {
    for (;;) {
      bool progress = false;
      switch (st) {
        case St::Reasoning: progress = step_reasoning(final); break;
        case St::Content: progress = step_content(final); break;
        case St::Tool: progress = step_tool(final); break;
        case St::Failed:
          failed_text += buf;
          buf.clear();
          break;
        case St::Done:
          if (starts_with(buf, kEosText)) {
            buf.erase(0, kEosText.size());
            st = St::Ended;
            progress = true;
            break;
          }
          if (!final && proper_prefix(buf, kEosText)) break;
          if (!buf.empty() && !warned_after_done) {
            warned_after_done = true;
            warn("text after the tool-call block closer ignored");
          }
          buf.clear();
          break;
        case St::Stopped:
        case St::Ended: buf.clear(); break;
      }
      if (!progress) return;
    }
  }

  std::vector<Event> push(std::string_view bytes) {
    std::vector<Event> events;
    if (finished) return events;
    ev = &events;
    feed_bytes(bytes, false);
    run(false);
    ev = nullptr;
    return events;
  }

  std::vector<Event> finish(EndCause cause) {
    std::vector<Event> events;
    if (finished) return events;
    ev = &events;
    feed_bytes("", true);
    run(true);
    if (st == St::Tool) {
      fail_block("unterminated tool call");
      run(true);
    }
    if (st == St::Failed) {
      if (failed_text.size() >= kEosText.size() &&
          failed_text.compare(failed_text.size() - kEosText.size(), kEosText.size(), kEosText) == 0)
        failed_text.resize(failed_text.size() - kEosText.size());
      res.content += failed_text;
      failed_text.clear();
    }
    flush_stop_hold();
    const bool closed = block_done;
    if (closed) res.finish = FinishReason::ToolCalls;
    else if (st == St::Stopped) res.finish = FinishReason::StopSequence;
    else res.finish = cause == EndCause::Length ? FinishReason::Length : FinishReason::Stop;
    if (!closed) {
      res.tool_calls.clear();
      res.block_text.clear();
      res.block_segments.clear();
    }
    if (o.tools_enabled) {
      for (const Head& h : all_heads())
        if (h.kind == TagKind::Block && h.closing && !h.prefix.empty() &&
            res.content.find(h.text + ">") != std::string::npos) {
          warn("tool-call block closer without opener in content");
          break;
        }
    }
    finished = true;
    ev = nullptr;
    return events;
  }
};

DsmlParser::DsmlParser(ParserOptions opts) : impl_(std::make_unique<Impl>(std::move(opts))) {}
DsmlParser::~DsmlParser() = default;
std::vector<Event> DsmlParser::push(std::string_view bytes) { return impl_->push(bytes); }
std::vector<Event> DsmlParser::finish(EndCause cause) { return impl_->finish(cause); }
bool DsmlParser::should_stop() const {
  using St = Impl::St;
  return impl_->st == St::Done || impl_->st == St::Stopped || impl_->st == St::Failed || impl_->st == St::Ended;
}
bool DsmlParser::finished() const { return impl_->finished; }
const ParseResult& DsmlParser::result() const { return impl_->res; }

ParseResult parse_completion(std::string_view text, const ParserOptions& opts, EndCause cause) {
  DsmlParser p(opts);
  p.push(text);
  p.finish(cause);
  return p.result();
}

}  // namespace dsx::text
