// UTF-8 helpers shared by the tokenizer, the streaming detokenizer and the Engram
// token map: strict decoding with the Unicode "maximal subpart" rule for ill-formed
// input, lossy conversion identical to Rust's String::from_utf8_lossy (what the HF
// `tokenizers` decoders return), and the White_Space property (Rust char::is_whitespace).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace dsx::text::utf8 {

inline constexpr char32_t kReplacement = 0xFFFD;
inline constexpr std::string_view kReplacementUtf8 = "\xEF\xBF\xBD";

struct Decoded {
  enum Status : uint8_t {
    kValid,       // a well-formed sequence; `cp` is its code point
    kInvalid,     // ill-formed; `len` is the maximal subpart to replace by one U+FFFD
    kIncomplete,  // a proper prefix of a well-formed sequence that runs into the end of the input
  };
  char32_t cp = 0;
  uint32_t len = 0;  // bytes consumed (>= 1 whenever i < s.size())
  Status status = kValid;
};

// Decodes the sequence starting at s[i] (requires i < s.size()). Well-formedness is
// that of Unicode Table 3-7: no overlongs, no surrogates, nothing above U+10FFFF.
Decoded decode(std::string_view s, size_t i);

// Appends the UTF-8 encoding of `cp` (must be a scalar value).
void append(std::string& out, char32_t cp);

bool is_valid(std::string_view s);

// End of the longest well-formed run of s starting at `from` (== s.size() when the
// rest is valid).
size_t valid_run_end(std::string_view s, size_t from);

// Number of leading bytes < 0x80.
size_t ascii_prefix(std::string_view s);
inline bool is_ascii(std::string_view s) { return ascii_prefix(s) == s.size(); }

// Rust String::from_utf8_lossy: every maximal ill-formed subpart (and an incomplete
// sequence at the end) becomes one U+FFFD.
std::string lossy(std::string_view s);

// Unicode White_Space (= Rust char::is_whitespace, = Oniguruma's Unicode \s).
bool is_white_space(char32_t c);

}  // namespace dsx::text::utf8
