#include "server/signing.h"

#include <openssl/crypto.h>
#include <openssl/hmac.h>

#include "text/dsml.h"  // random_hex
#include "util/error.h"

namespace dsx::server {

namespace {

const char* kB64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

std::string b64url(std::string_view in) {
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8) | uint8_t(in[i + 2]);
    for (int k = 18; k >= 0; k -= 6) out.push_back(kB64[(v >> k) & 63]);
  }
  if (i + 1 == in.size()) {
    const uint32_t v = uint8_t(in[i]) << 16;
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
  } else if (i + 2 == in.size()) {
    const uint32_t v = (uint8_t(in[i]) << 16) | (uint8_t(in[i + 1]) << 8);
    out.push_back(kB64[(v >> 18) & 63]);
    out.push_back(kB64[(v >> 12) & 63]);
    out.push_back(kB64[(v >> 6) & 63]);
  }
  return out;
}

bool unb64url(std::string_view in, std::string& out) {
  auto val = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '-') return 62;
    if (c == '_') return 63;
    return -1;
  };
  if (in.size() % 4 == 1) return false;
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const int v = val(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return true;
}

}  // namespace

std::string mac_hex(std::string_view secret, std::string_view text) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (!HMAC(EVP_sha256(), secret.data(), static_cast<int>(secret.size()),
            reinterpret_cast<const unsigned char*>(text.data()), text.size(), md, &len))
    fail("HMAC failed");
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned i = 0; i < len; ++i) {
    s.push_back(hex[md[i] >> 4]);
    s.push_back(hex[md[i] & 15]);
  }
  return s;
}

bool mac_ok(std::string_view secret, std::string_view text, std::string_view mac) {
  const std::string want = mac_hex(secret, text);
  return mac.size() == want.size() && CRYPTO_memcmp(want.data(), mac.data(), want.size()) == 0;
}

std::string seal(std::string_view secret, std::string_view text) {
  return b64url(text) + "." + mac_hex(secret, text);
}

std::optional<std::string> open(std::string_view secret, std::string_view blob) {
  const size_t dot = blob.rfind('.');
  if (dot == std::string_view::npos) return std::nullopt;
  std::string text;
  if (!unb64url(blob.substr(0, dot), text)) return std::nullopt;
  if (!mac_ok(secret, text, blob.substr(dot + 1))) return std::nullopt;
  return text;
}

std::string new_secret() { return text::random_hex(32); }

}  // namespace dsx::server
