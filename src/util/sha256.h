// SHA-256 (OpenSSL's EVP implementation) as lower-case hex: of bytes in memory, streamed
// piece by piece, or of a whole file (with optional progress for large files). The one
// place the engine computes SHA-256 of plain data: model fingerprints
// (ModelFiles::fingerprint), the Engram map's tokenizer hash and run manifests use it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

namespace dsx {

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void update(const void* data, size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // The digest as 64 hex characters; the object is spent afterwards.
  std::string hex();

 private:
  void* ctx_ = nullptr;  // EVP_MD_CTX
};

std::string sha256_hex(std::string_view data);

// A file's bytes, read in blocks. `progress` (optional) is called with the bytes hashed
// so far after every block of about 64 MiB. Throws dsx::Error naming the file when it
// cannot be opened or read ("cannot open PATH to hash it").
std::string sha256_file_hex(const std::string& path, const std::function<void(int64_t)>& progress = {});

}  // namespace dsx
