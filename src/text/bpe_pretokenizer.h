// Pre-tokenizer of a HF byte-level BPE tokenizer.json (chat-and-serving.md §1.3 step 3):
// a sequence of regex Split steps (behaviour Isolated or Removed) followed by ByteLevel.
// The patterns are Oniguruma patterns (the engine HF uses); they are translated to
// PCRE2 (UTF + UCP, JIT) so that the Perl classes keep Oniguruma's meaning, and the
// general categories \p{L} \p{M} \p{N} \p{Nd} \p{P} \p{S} get the code points that
// Unicode 16.0 (HF's Oniguruma) added over PCRE2 10.42's Unicode 14.0 (unicode_tables.h).
//
// For DeepSeek V3's three patterns, ASCII fast paths decide what they can from ASCII
// characters alone and hand every position that needs a non-ASCII character to PCRE2;
// the tests check them against the PCRE2-only path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace dsx::text {

// Oniguruma -> PCRE2 translation of the escapes whose meaning differs:
// \s \S (Oniguruma: 9-13, 0x85, Zs, Zl, Zp; PCRE2's UCP \s also has U+180E),
// \d \D \w \W (Unicode in Oniguruma), \h \H (hex digit in Oniguruma, horizontal
// space in PCRE2), \p{..} \P{..} (Unicode 16.0 additions). Nested classes and class
// intersection ("&&") are rejected.
std::string onig_to_pcre2(std::string_view pattern, const std::string& where);

// A compiled PCRE2 pattern (UTF, UCP, JIT). Subjects must be valid UTF-8.
class Regex {
 public:
  Regex(const std::string& pcre2_pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(Regex&& o) noexcept;
  Regex& operator=(Regex&& o) noexcept;
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Leftmost match starting at or after `start`: true and [*b, *e), or false.
  bool search(std::string_view subject, size_t start, size_t* b, size_t* e) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
  std::string where_;
};

struct Span {
  size_t begin;
  size_t end;
};

class PreTokenizer {
 public:
  // `pre_tokenizer` is the tokenizer.json field (may be null); `where` names the file.
  static PreTokenizer from_json(const nlohmann::json& pre_tokenizer, const std::string& where);

  PreTokenizer();
  ~PreTokenizer();
  PreTokenizer(PreTokenizer&&) noexcept;
  PreTokenizer& operator=(PreTokenizer&&) noexcept;

  // Splits valid UTF-8 `text` into pieces; appends their offsets (non-empty, in order) to `out`.
  void split(std::string_view text, std::vector<Span>& out) const;

  // True when the steps are exactly DeepSeek V3's three Split regexes, for which
  // ASCII fast paths (checked against PCRE2 by the tests) are used.
  bool has_fast_paths() const;
  // Tests: disable the fast paths so that every position goes through PCRE2.
  void set_fast_paths_enabled(bool on);

 private:
  struct Step;
  std::vector<Step> steps_;
};

}  // namespace dsx::text
