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
