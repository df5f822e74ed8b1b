#include "util/sha256.h"

#include <openssl/evp.h>

#include <fstream>
#include <vector>

#include "util/error.h"

namespace dsx {

Sha256::Sha256() {
  EVP_MD_CTX* c = EVP_MD_CTX_new();
  if (!c || EVP_DigestInit_ex(c, EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(c);
    fail("SHA-256 unavailable");
  }
  ctx_ = c;
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

void Sha256::update(const void* data, size_t n) {
  if (n) EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), data, n);
}

std::string Sha256::hex() {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), md, &len);
  static const char* digits = "0123456789abcdef";
  std::string s;
  s.reserve(2 * len);
  for (unsigned i = 0; i < len; ++i) {
    s.push_back(digits[md[i] >> 4]);
    s.push_back(digits[md[i] & 15]);
  }
  return s;
}

std::string sha256_hex(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.hex();
}

std::string sha256_file_hex(const std::string& path, const std::function<void(int64_t)>& progress) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open ", path, " to hash it");
  Sha256 h;
  std::vector<char> buf(1 << 20);
  int64_t done = 0, reported = 0;
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (f.gcount() > 0) {
      h.update(buf.data(), static_cast<size_t>(f.gcount()));
      done += f.gcount();
      if (progress && done - reported >= (int64_t{64} << 20)) {
        progress(done);
        reported = done;
      }
    }
  }
  if (f.bad()) fail("cannot read ", path, " to hash it");
  if (progress && done != reported) progress(done);
  return h.hex();
}

}  // namespace dsx
