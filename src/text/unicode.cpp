#include "text/unicode.h"

#include <cstring>

namespace dsx::text::utf8 {

Decoded decode(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  const unsigned b0 = p[i];
  if (b0 < 0x80) return {b0, 1, Decoded::kValid};

  // Number of continuation bytes and the allowed range of the first one (Table 3-7).
  unsigned need = 0, lo = 0x80, hi = 0xBF;
  char32_t cp = 0;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {0, 1, Decoded::kInvalid};  // 80..C1, F5..FF never start a sequence
  }
  uint32_t len = 1;
  for (unsigned k = 0; k < need; ++k) {
    if (i + len >= n) return {0, len, Decoded::kIncomplete};
    const unsigned b = p[i + len];
    const unsigned l = k == 0 ? lo : 0x80, h = k == 0 ? hi : 0xBF;
    if (b < l || b > h) return {0, len, Decoded::kInvalid};
    cp = (cp << 6) | (b & 0x3F);
    ++len;
  }
  return {cp, len, Decoded::kValid};
}

void append(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t ascii_prefix(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  // Eight bytes at a time: any byte with its top bit set stops the fast loop.
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w & 0x8080808080808080ULL) break;
  }
  while (i < n && p[i] < 0x80) ++i;
  return i;
}

size_t valid_run_end(std::string_view s, size_t from) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = from;
  while (i < n) {
    const unsigned b0 = p[i];
    if (b0 < 0x80) {
      i += ascii_prefix(s.substr(i));
      continue;
    }
    // Inline checks of Table 3-7 for the common well-formed cases.
    if (b0 >= 0xC2 && b0 <= 0xDF) {
      if (i + 1 < n && (p[i + 1] & 0xC0) == 0x80) {
        i += 2;
        continue;
      }
      return i;
    }
    if (b0 >= 0xE1 && b0 <= 0xEC) {
      if (i + 2 < n && (p[i + 1] & 0xC0) == 0x80 && (p[i + 2] & 0xC0) == 0x80) {
        i += 3;
        continue;
      }
      return i;
    }
    const Decoded d = decode(s, i);
    if (d.status != Decoded::kValid) return i;
    i += d.len;
  }
  return n;
}

bool is_valid(std::string_view s) { return valid_run_end(s, 0) == s.size(); }

std::string lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const Decoded d = decode(s, i);
    if (d.status == Decoded::kValid)
      out.append(s.data() + i, d.len);
    else
      out.append(kReplacementUtf8);
    i += d.len;
  }
  return out;
}

bool is_white_space(char32_t c) {
  if (c <= 0x20) return c == 0x20 || (c >= 0x09 && c <= 0x0D);
  if (c < 0x85) return false;
  switch (c) {
    case 0x85: case 0xA0: case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return c >= 0x2000 && c <= 0x200A;
  }
}

}  // namespace dsx::text::utf8
