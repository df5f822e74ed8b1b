#include "text/bpe_pretokenizer.h"

#include <array>
#include <utility>

#include <nlohmann/json.hpp>
#include <pcre2.h>

#include "text/unicode.h"
#include "text/unicode_tables.h"
#include "util/error.h"

namespace dsx::text {

// ---- Oniguruma -> PCRE2 -----------------------------------------------------------

namespace {
// Oniguruma's Unicode \s: U+0009..U+000D, U+0085, General_Category Z (Zs, Zl, Zp).
constexpr std::string_view kSpaceItems = "\\t\\n\\x{0B}\\f\\r\\x{85}\\p{Z}";
constexpr std::string_view kHexItems = "0-9a-fA-F";

// Class items for \p{name}: PCRE2's class plus the code points Unicode 16.0 added.
std::string prop_items(std::string_view name) {
  return cat("\\p{", name, "}", unicode16::extra_class_items(name));
}
}  // namespace

std::string onig_to_pcre2(std::string_view p, const std::string& where) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\') {
      if (i + 1 >= p.size()) fail(where, ": regex '", p, "' ends with a lone backslash");
      const char e = p[i + 1];
      ++i;
      // Emits a set of class items: bare inside [...], bracketed outside.
      auto set = [&](const std::string& items, bool negated) {
        if (in_class) {
          if (negated) fail(where, ": regex '", p, "': negated class escape \\", e, " inside [...] is not supported");
          out += items;
        } else {
          out += negated ? "[^" : "[";
          out += items;
          out += ']';
        }
      };
      switch (e) {
        case 's': set(std::string(kSpaceItems), false); break;
        case 'S': set(std::string(kSpaceItems), true); break;
        case 'w': set(prop_items("L") + prop_items("M") + prop_items("Nd") + "\\p{Pc}", false); break;
        case 'W': set(prop_items("L") + prop_items("M") + prop_items("Nd") + "\\p{Pc}", true); break;
        case 'h': set(std::string(kHexItems), false); break;
        case 'H': set(std::string(kHexItems), true); break;
        case 'd': set(prop_items("Nd"), false); break;
        case 'D': set(prop_items("Nd"), true); break;
        case 'p':
        case 'P': {
          const size_t close = p.find('}', i + 1);
          if (i + 1 >= p.size() || p[i + 1] != '{' || close == std::string_view::npos)
            fail(where, ": regex '", p, "': \\", e, " needs {name}");
          std::string_view name = p.substr(i + 2, close - i - 2);
          bool negated = e == 'P';
          if (!name.empty() && name[0] == '^') {
            negated = !negated;
            name.remove_prefix(1);
          }
          if (unicode16::extra_class_items(name).empty()) {
            out += negated ? "\\P{" : "\\p{";
            out += name;
            out += '}';
          } else {
            set(prop_items(name), negated);
          }
          i = close;
          break;
        }
        default:
          out += '\\';
          out += e;
      }
      continue;
    }
    if (in_class) {
      if (c == ']') {
        in_class = false;
      } else if (c == '[') {
        if (i + 1 < p.size() && p[i + 1] == ':') {
          // POSIX bracket expression [:name:], copied as is.
          const size_t close = p.find(":]", i + 2);
          if (close == std::string_view::npos) fail(where, ": regex '", p, "': unterminated [: :]");
          out.append(p.substr(i, close + 2 - i));
          i = close + 1;
          continue;
        }
        fail(where, ": regex '", p, "': nested character classes are not supported");
      } else if (c == '&' && i + 1 < p.size() && p[i + 1] == '&') {
        fail(where, ": regex '", p, "': class intersection (&&) is not supported");
      }
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      out += c;
      size_t j = i + 1;
      if (j < p.size() && p[j] == '^') {
        out += '^';
        ++j;
      }
      // A ']' right after '[' or '[^' is a literal.
      if (j < p.size() && p[j] == ']') {
        out += "\\]";
        ++j;
      }
      i = j - 1;
      continue;
    }
    out += c;
  }
  if (in_class) fail(where, ": regex '", p, "': unterminated character class");
  return out;
}

// ---- Regex ------------------------------------------------------------------------

namespace {

// Per-thread match data and JIT stack (neither may be shared between threads).
struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(64 * 1024, 64 * 1024 * 1024, nullptr);
    if (!data || !context || !jit_stack) throw std::bad_alloc();
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchScratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

MatchScratch& scratch() {
  thread_local MatchScratch s;
  return s;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  if (pcre2_get_error_message(code, buf, sizeof buf) < 0) return cat("PCRE2 error ", code);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

Regex::Regex(const std::string& pattern, bool literal, const std::string& where) : where_(where) {
  int err = 0;
  PCRE2_SIZE off = 0;
  uint32_t opts = PCRE2_UTF | PCRE2_UCP;
  if (literal) opts |= PCRE2_LITERAL;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), opts, &err, &off, nullptr);
  if (!code) fail(where, ": cannot compile regex '", pattern, "' at offset ", off, ": ", pcre2_message(err));
  // JIT is an optimisation: without it pcre2_match interprets the same pattern.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

Regex::~Regex() {
  if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

Regex::Regex(Regex&& o) noexcept : code_(std::exchange(o.code_, nullptr)), where_(std::move(o.where_)) {}

Regex& Regex::operator=(Regex&& o) noexcept {
  if (this != &o) {
    if (code_) pcre2_code_free(static_cast<pcre2_code*>(code_));
    code_ = std::exchange(o.code_, nullptr);
    where_ = std::move(o.where_);
  }
  return *this;
}

bool Regex::search(std::string_view subject, size_t start, size_t* b, size_t* e) const {
  MatchScratch& s = scratch();
  auto* code = static_cast<pcre2_code*>(code_);
  const auto* subj = reinterpret_cast<PCRE2_SPTR>(subject.data());
  // Subjects were validated by the caller: skip PCRE2's own UTF check.
  int rc = pcre2_match(code, subj, subject.size(), start, PCRE2_NO_UTF_CHECK, s.data, s.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) fail(where_, ": regex matching failed: ", pcre2_message(rc));
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
  *b = ov[0];
  *e = ov[1];
  return true;
}

// ---- fast paths for DeepSeek V3's patterns ----------------------------------------------

namespace {

// The three Split regexes of DeepSeek V3's tokenizer.json, as stored there.
const std::string kDsDigits = "\\p{N}{1,3}";
const std::string kDsCjk =
    "[\xE4\xB8\x80-\xE9\xBE\xA5\xE3\x81\x80-\xE3\x82\x9F\xE3\x82\xA0-\xE3\x83\xBF]+";  // [一-龥぀-ゟ゠-ヿ]+
const std::string kDsMain =
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";

const std::string kGpt2Pattern = "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

enum class FastKind { kNone, kDsDigits, kDsCjk, kDsMain };

// Outcome of a fast scan from some position p.
enum class Fast {
  kMatch,    // [*b, *e) is the leftmost match at or after p
  kUnknown,  // no match in [p, *b); at *b a non-ASCII character must be inspected: ask PCRE2
  kEnd,      // no match at or after p
};

// ASCII character classes as the patterns see them.
enum : uint8_t {
  kOther = 0,   // controls other than \t..\r, DEL: in no class
  kLetter = 1,  // A-Z a-z (\p{L})
  kDigit = 2,   // 0-9 (\p{N})
  kPunct = 3,   // the 32 ASCII punctuation / symbol characters (\p{P} or \p{S})
  kSpace = 4,   // ' '
  kBlank = 5,   // \t \v \f (\s)
  kNewline = 6, // \r \n (\s)
  kNonAscii = 7,
  kEndOfText = 8,
};

struct AsciiClasses {
  std::array<uint8_t, 256> cls{};
  AsciiClasses() {
    for (int c = 0; c < 256; ++c) {
      uint8_t k = kOther;
      if (c >= 0x80)
        k = kNonAscii;
      else if ((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z'))
        k = kLetter;
      else if (c >= '0' && c <= '9')
        k = kDigit;
      else if (c > 0x20 && c < 0x7F)
        k = kPunct;
      else if (c == ' ')
        k = kSpace;
      else if (c == '\t' || c == 0x0B || c == 0x0C)
        k = kBlank;
      else if (c == '\r' || c == '\n')
        k = kNewline;
      cls[c] = k;
    }
  }
};

const AsciiClasses kAscii;

struct Text {
  const unsigned char* p;
  size_t n;
  uint8_t at(size_t i) const { return i < n ? kAscii.cls[p[i]] : uint8_t{kEndOfText}; }
};

inline bool is_ws(uint8_t k) { return k == kSpace || k == kBlank || k == kNewline; }

Fast fast_digits(const Text& t, size_t p, size_t* b, size_t* e) {
  for (size_t i = p; i < t.n; ++i) {
    const uint8_t k = kAscii.cls[t.p[i]];
    if (k == kNonAscii) {
      *b = i;
      return Fast::kUnknown;
    }
    if (k != kDigit) continue;
    size_t j = i + 1;
    while (j < t.n && j < i + 3 && t.at(j) == kDigit) ++j;
    // A run of fewer than 3 ASCII digits might continue with a non-ASCII number.
    if (j < i + 3 && t.at(j) == kNonAscii) {
      *b = i;
      return Fast::kUnknown;
    }
    *b = i;
    *e = j;
    return Fast::kMatch;
  }
  return Fast::kEnd;
}

Fast fast_cjk(const Text& t, size_t p, size_t* b, size_t*) {
  // The class has no ASCII member.
  const size_t i = p + utf8::ascii_prefix(std::string_view(reinterpret_cast<const char*>(t.p) + p, t.n - p));
  if (i >= t.n) return Fast::kEnd;
  *b = i;
  return Fast::kUnknown;
}

// The main pattern at one ASCII position i. Returns 1 = match [i, *e), 0 = no match
// at i, -1 = undecidable without classifying a non-ASCII character.
int main_at(const Text& t, size_t i, size_t* e) {
  const uint8_t c = t.at(i);
  // 1. [!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+
  if (c == kPunct && t.at(i + 1) == kLetter) {
    size_t j = i + 2;
    while (t.at(j) == kLetter) ++j;
    *e = j;
    return 1;
  }
  // 2. [^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+
  auto letters_from = [&](size_t j) {
    while (t.at(j) == kLetter) ++j;
    if (t.at(j) == kNonAscii) return -1;  // could be a letter or a mark
    *e = j;
    return 1;
  };
  if (c == kLetter) return letters_from(i + 1);
  if (c == kOther || c == kDigit || c == kSpace || c == kBlank) {
    const uint8_t k = t.at(i + 1);
    if (k == kNonAscii) return -1;
    if (k == kLetter) return letters_from(i + 2);
    // else: without the optional character, c itself is no letter: no match here.
  }
  // 3.  ?[\p{P}\p{S}]+[\r\n]*
  auto punct_from = [&](size_t j) {
    while (t.at(j) == kPunct) ++j;
    if (t.at(j) == kNonAscii) return -1;  // could continue the punctuation run
    while (t.at(j) == kNewline) ++j;
    *e = j;
    return 1;
  };
  if (c == kPunct) return punct_from(i + 1);
  if (c == kSpace) {
    const uint8_t k = t.at(i + 1);
    if (k == kNonAscii) return -1;
    if (k == kPunct) return punct_from(i + 2);
  }
  if (!is_ws(c)) return 0;  // alternatives 4-6 all start with \s
  size_t k = i;
  size_t last_newline = SIZE_MAX;
  while (is_ws(t.at(k))) {
    if (t.at(k) == kNewline) last_newline = k;
    ++k;
  }
  if (t.at(k) == kNonAscii) return -1;  // could be more white space
  // 4. \s*[\r\n]+ : ends after the last CR/LF of the run.
  if (last_newline != SIZE_MAX) {
    *e = last_newline + 1;
    return 1;
  }
  // 5. \s+(?!\S) : the whole run at the end of the text, else all but its last character.
  if (k == t.n) {
    *e = k;
    return 1;
  }
  if (k - i >= 2) {
    *e = k - 1;
    return 1;
  }
  // 6. \s+
  *e = k;
  return 1;
}

Fast fast_main(const Text& t, size_t p, size_t* b, size_t* e) {
  for (size_t i = p; i < t.n; ++i) {
    if (t.p[i] >= 0x80) {
      *b = i;
      return Fast::kUnknown;
    }
    const int r = main_at(t, i, e);
    if (r == 0) continue;
    *b = i;
    return r > 0 ? Fast::kMatch : Fast::kUnknown;
  }
  return Fast::kEnd;
}

}  // namespace

// ---- PreTokenizer -------------------------------------------------------------------

struct PreTokenizer::Step {
  Regex re;
  bool keep_matches = true;  // Isolated (true) or Removed (false)
  FastKind fast = FastKind::kNone;
  bool fast_enabled = true;
};

PreTokenizer::PreTokenizer() = default;
PreTokenizer::~PreTokenizer() = default;
PreTokenizer::PreTokenizer(PreTokenizer&&) noexcept = default;
PreTokenizer& PreTokenizer::operator=(PreTokenizer&&) noexcept = default;

PreTokenizer PreTokenizer::from_json(const nlohmann::json& j, const std::string& where) {
  PreTokenizer pt;
  if (j.is_null()) return pt;
  std::vector<const nlohmann::json*> flat;
  if (!j.is_object()) fail(where, ": pre_tokenizer must be an object or null");
  if (j.value("type", "") == "Sequence") {
    const auto it = j.find("pretokenizers");
    if (it == j.end() || !it->is_array()) fail(where, ": pre_tokenizer Sequence needs an array 'pretokenizers'");
    for (const auto& s : *it) flat.push_back(&s);
  } else {
    flat.push_back(&j);
  }
  bool byte_level_seen = false;
  for (size_t idx = 0; idx < flat.size(); ++idx) {
    const nlohmann::json& s = *flat[idx];
    const std::string field = cat(where, ": pre_tokenizer[", idx, "]");
    if (!s.is_object() || !s.contains("type") || !s["type"].is_string()) fail(field, " has no 'type'");
    const std::string type = s["type"].get<std::string>();
    if (byte_level_seen) fail(field, " (", type, ") after ByteLevel is not supported");
    if (type == "Split") {
      const auto pat = s.find("pattern");
      if (pat == s.end() || !pat->is_object()) fail(field, ".pattern missing");
      std::string pattern;
      bool literal = false;
      if (pat->contains("Regex") && (*pat)["Regex"].is_string()) {
        pattern = (*pat)["Regex"].get<std::string>();
      } else if (pat->contains("String") && (*pat)["String"].is_string()) {
        pattern = (*pat)["String"].get<std::string>();
        literal = true;
      } else {
        fail(field, ".pattern needs a string 'Regex' or 'String'");
      }
      if (!utf8::is_valid(pattern)) fail(field, ".pattern is not valid UTF-8");
      const std::string behavior = s.value("behavior", "");
      if (behavior != "Isolated" && behavior != "Removed")
        fail(field, ".behavior '", behavior, "' is not supported (Isolated, Removed)");
      if (s.value("invert", false)) fail(field, ".invert=true is not supported");
      Step st{Regex(literal ? pattern : onig_to_pcre2(pattern, field), literal, field), behavior == "Isolated"};
      if (!literal && behavior == "Isolated") {
        if (pattern == kDsDigits) st.fast = FastKind::kDsDigits;
        if (pattern == kDsCjk) st.fast = FastKind::kDsCjk;
        if (pattern == kDsMain) st.fast = FastKind::kDsMain;
      }
      pt.steps_.push_back(std::move(st));
    } else if (type == "ByteLevel") {
      byte_level_seen = true;
      if (s.value("add_prefix_space", false)) fail(field, ": ByteLevel add_prefix_space=true is not supported");
      if (s.value("use_regex", true))
        pt.steps_.push_back(Step{Regex(onig_to_pcre2(kGpt2Pattern, field), false, field), true});
    } else {
      fail(field, ": pre-tokenizer type '", type, "' is not supported (Split, ByteLevel)");
    }
  }
  if (!byte_level_seen) fail(where, ": pre_tokenizer has no ByteLevel step (only byte-level BPE is supported)");
  // The fast paths are only valid for the complete DeepSeek V3 sequence, in order.
  const bool ds = pt.steps_.size() == 3 && pt.steps_[0].fast == FastKind::kDsDigits &&
                  pt.steps_[1].fast == FastKind::kDsCjk && pt.steps_[2].fast == FastKind::kDsMain;
  if (!ds)
    for (auto& st : pt.steps_) st.fast = FastKind::kNone;
  return pt;
}

bool PreTokenizer::has_fast_paths() const {
  for (const auto& s : steps_)
    if (s.fast != FastKind::kNone && s.fast_enabled) return true;
  return false;
}

void PreTokenizer::set_fast_paths_enabled(bool on) {
  for (auto& s : steps_) s.fast_enabled = on;
}

void PreTokenizer::split(std::string_view text, std::vector<Span>& out) const {
  if (text.empty()) return;
  if (steps_.empty()) {
    out.push_back({0, text.size()});
    return;
  }
  std::vector<Span> cur{{0, text.size()}}, next;
  for (size_t si = 0; si < steps_.size(); ++si) {
    const Step& st = steps_[si];
    const bool last = si + 1 == steps_.size();
    std::vector<Span>& dst = last ? out : next;
    if (!last) next.clear();
    const FastKind fast = st.fast_enabled ? st.fast : FastKind::kNone;
    for (const Span& piece : cur) {
      const std::string_view s = text.substr(piece.begin, piece.end - piece.begin);
      const Text t{reinterpret_cast<const unsigned char*>(s.data()), s.size()};
      auto emit = [&](size_t b, size_t e) {
        if (e > b) dst.push_back({piece.begin + b, piece.begin + e});
      };
      size_t pos = 0, gap = 0;  // search position; start of the pending gap
      while (pos < s.size()) {
        size_t b = 0, e = 0;
        Fast r = Fast::kUnknown;
        switch (fast) {
          case FastKind::kDsDigits: r = fast_digits(t, pos, &b, &e); break;
          case FastKind::kDsCjk: r = fast_cjk(t, pos, &b, &e); break;
          case FastKind::kDsMain: r = fast_main(t, pos, &b, &e); break;
          case FastKind::kNone: b = pos; break;
        }
        if (r == Fast::kEnd) break;
        if (r == Fast::kUnknown && !st.re.search(s, b, &b, &e)) break;
        if (st.keep_matches) {
          emit(gap, b);
          emit(b, e);
        } else {
          emit(gap, b);
        }
        if (e == b) {  // empty match: step over one character, it stays in the gap
          gap = b;
          pos = b + utf8::decode(s, b).len;
        } else {
          gap = pos = e;
        }
      }
      emit(gap, s.size());
    }
    if (!last) std::swap(cur, next);
  }
}

}  // namespace dsx::text
