// Unicode 16.0 additions to the general-category classes of PCRE2's tables.
//
// HF `tokenizers` 0.23 matches its pre-tokenizer regexes with Oniguruma, whose tables
// are Unicode 16.0 (checked: U+10D50 GARAY letter is \p{L}, U+31EF is \p{S}, while
// Unicode 17.0 additions such as U+10940 are in no class). Debian's PCRE2 10.42 has
// Unicode 14.0 tables, so characters assigned in 15.0, 15.1 and 16.0 (CJK extensions H
// and I, new emoji such as U+1FAE8, Kawi, Garay, ...) would be unassigned for it and
// split differently. The pattern translation therefore adds these code points to
// \p{L}, \p{M}, \p{N}, \p{Nd}, \p{P} and \p{S}.
#pragma once
#include <string>
#include <string_view>

namespace dsx::text::unicode16 {

// PCRE2 class items ("\x{1C89}-\x{1C8A}...") for the code points that Unicode 16.0
// puts in category `cat` ("L", "M", "N", "Nd", "P", "S") and PCRE2 10.42 (Unicode 14.0)
// leaves unassigned; empty for any other category name.
std::string extra_class_items(std::string_view cat);

}  // namespace dsx::text::unicode16

// The Unicode data behind HF `tokenizers`' normalizers, as far as it differs from
// utf8proc 2.8 (Unicode 15.0). NFKC / NFD / StripAccents use the tables of the crate
// unicode-normalization-alignments, which are Unicode 9.0 (checked against tokenizers
// 0.23.2: U+08D4, new in 9.0, is stripped as a mark; U+1CF7, new in 10.0, is not; the
// compatibility mappings of U+1FBF0.. (13.0) and U+A7F2.. (14.0) are not applied).
// Lowercase is Rust's char::to_lowercase of the Rust release tokenizers 0.23.2 was built
// with: Unicode 17.0 (checked: U+16EA0, a capital letter of 17.0, is lowercased).
namespace dsx::text::hf_unicode {

// True for a code point that Unicode 17.0 assigns and Unicode 9.0 did not: HF's
// normalization tables do not know it (no decomposition, combining class 0, not a mark).
bool assigned_after_9(char32_t c);

// For a Unicode 9.0 character whose Mark status differs between 9.0 and utf8proc's
// tables: 1 if it is a mark in 9.0, 0 if not; -1 for every other character.
int mark9_override(char32_t c);

// Simple lowercase mapping of Unicode 17.0 missing from utf8proc's tables; 0 if none.
char32_t lowercase17_extra(char32_t c);

}  // namespace dsx::text::hf_unicode

