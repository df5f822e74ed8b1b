#include "text/engram_cmap.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include <utf8proc.h>

#include "text/unicode.h"
#include "text/unicode_tables.h"
#include "util/error.h"
#include "util/safetensors.h"
#include "util/sha256.h"

namespace dsx::text {

namespace {

constexpr char32_t kSentinel = 0xE000;

// utf8proc_map over an explicit length (the text may contain NUL).
std::string utf8proc_apply(std::string_view s, int options) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(options));
  if (n < 0) {
    std::free(out);
    fail("engram normalisation: utf8proc failed (", utf8proc_errmsg(n), ")");
  }
  std::string r(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
  std::free(out);
  return r;
}

std::u32string to_u32(std::string_view s) {
  std::u32string r;
  r.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const utf8::Decoded d = utf8::decode(s, i);
    if (d.status != utf8::Decoded::kValid) fail("engram normalisation: invalid UTF-8");
    r.push_back(d.cp);
    i += d.len;
  }
  return r;
}

// StripAccents of HF: General_Category M as of Unicode 9.0.
bool is_mark9(char32_t c) {
  if (hf_unicode::assigned_after_9(c)) return false;
  if (const int o = hf_unicode::mark9_override(c); o >= 0) return o == 1;
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
}

// Lowercase of HF: Rust char::to_lowercase (Unicode 17.0), appended to `out`.
void append_lowercase(std::u32string& out, char32_t c) {
  if (c == 0x130) {  // the only unconditional special case: i + COMBINING DOT ABOVE
    out.push_back(U'i');
    out.push_back(0x307);
  } else if (const char32_t x = hf_unicode::lowercase17_extra(c)) {
    out.push_back(x);
  } else {
    out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
  }
}

// NFKC then NFD as HF computes them, with Unicode 9.0 data: a character assigned after
// 9.0 has no decomposition and combining class 0 there, so it is kept as it is and
// splits the text into runs that normalise independently; the runs only hold 9.0
// characters, whose mappings utf8proc's newer tables keep unchanged (normalization
// stability).
std::u32string nfkc_then_nfd_9(std::string_view text) {
  std::u32string out;
  size_t run = 0;
  auto flush = [&](size_t end) {
    if (end <= run) return;
    const std::string nfkc =
        utf8proc_apply(text.substr(run, end - run), UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    out += to_u32(utf8proc_apply(nfkc, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE));
  };
  for (size_t i = 0; i < text.size();) {
    const utf8::Decoded d = utf8::decode(text, i);
    if (d.status != utf8::Decoded::kValid) fail("engram normalisation: invalid UTF-8");
    if (d.cp >= 0x80 && hf_unicode::assigned_after_9(d.cp)) {
      flush(i);
      out.push_back(d.cp);
      run = i + d.len;
    }
    i += d.len;
  }
  flush(text.size());
  return out;
}

}  // namespace

std::string engram_normalize(std::string_view text) {
  // Strip accents, lowercase, collapse [ \t\r\n]+ runs. A removed mark does not end a
  // blank run: the reference strips accents before it replaces the runs.
  std::u32string s;
  bool in_blank_run = false;
  for (char32_t c : nfkc_then_nfd_9(text)) {
    if (is_mark9(c)) continue;
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      if (!in_blank_run) s.push_back(' ');
      in_blank_run = true;
      continue;
    }
    in_blank_run = false;
    append_lowercase(s, c);
  }
  if (s == U" ") s = std::u32string(1, kSentinel);
  size_t b = 0, e = s.size();
  while (b < e && utf8::is_white_space(s[b])) ++b;
  while (e > b && utf8::is_white_space(s[e - 1])) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) utf8::append(out, s[i] == kSentinel ? U' ' : s[i]);
  return out;
}

std::string engram_key(const Tokenizer& tok, int32_t id) {
  const std::string text = utf8::lossy(tok.decode_one(id));
  if (text.find(utf8::kReplacementUtf8) != std::string::npos) return tok.id_to_token(id);
  std::string n = engram_normalize(text);
  return n.empty() ? text : n;
}

std::vector<int32_t> build_engram_token_map(const Tokenizer& tok, int32_t* n_keys) {
  const size_t n = tok.size();
  std::vector<int32_t> cmap(n);
  std::unordered_map<std::string, int32_t> ids;
  ids.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const auto [it, inserted] = ids.emplace(engram_key(tok, static_cast<int32_t>(i)), static_cast<int32_t>(ids.size()));
    cmap[i] = it->second;
  }
  if (n_keys) *n_keys = static_cast<int32_t>(ids.size());
  return cmap;
}

std::string sha256_file_hex(const std::string& path) { return dsx::sha256_file_hex(path); }


}  // namespace dsx::text
