#include "text/engram_cmap.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include <openssl/evp.h>
#include <utf8proc.h>

#include "text/unicode.h"
#include "util/error.h"
#include "util/safetensors.h"

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

bool is_mark(char32_t c) {
  const utf8proc_category_t cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_MC || cat == UTF8PROC_CATEGORY_ME;
}

}  // namespace

std::string engram_normalize(std::string_view text) {
  // NFKC, then NFD.
  const std::string nfkc = utf8proc_apply(text, UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  const std::string nfd = utf8proc_apply(nfkc, UTF8PROC_STABLE | UTF8PROC_DECOMPOSE);
  // Strip accents, lowercase (full mapping per character; U+0130 is the only
  // unconditional lowercase special case), collapse [ \t\r\n]+.
  std::u32string s;
  bool in_blank_run = false;
  for (char32_t c : to_u32(nfd)) {
    if (is_mark(c)) continue;
    const bool blank = c == ' ' || c == '\t' || c == '\r' || c == '\n';
    if (blank) {
      if (!in_blank_run) s.push_back(' ');
      in_blank_run = true;
      continue;
    }
    in_blank_run = false;
    if (c == 0x130) {
      s.push_back(U'i');
      s.push_back(0x307);
    } else {
      s.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
    }
  }
  // (A removed mark does not end a blank run: the reference strips accents before
  // it replaces the runs.)
  std::u32string& merged = s;
  if (merged == U" ") merged = std::u32string(1, kSentinel);
  size_t b = 0, e = merged.size();
  while (b < e && utf8::is_white_space(merged[b])) ++b;
  while (e > b && utf8::is_white_space(merged[e - 1])) --e;
  std::string out;
  for (size_t i = b; i < e; ++i) utf8::append(out, merged[i] == kSentinel ? U' ' : merged[i]);
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

std::string sha256_file_hex(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot open ", path, " to hash it");
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(ctx);
    fail("SHA-256 unavailable");
  }
  std::vector<char> buf(1 << 16);
  while (f) {
    f.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (f.gcount() > 0) EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(f.gcount()));
  }
  const bool bad = f.bad();
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  if (bad) fail("cannot read ", path, " to hash it");
  static const char* hex = "0123456789abcdef";
  std::string r;
  for (unsigned i = 0; i < len; ++i) {
    r.push_back(hex[md[i] >> 4]);
    r.push_back(hex[md[i] & 15]);
  }
  return r;
}

std::vector<int32_t> load_or_build_engram_token_map(const std::string& model_dir, const Tokenizer& tok,
                                                    int32_t* n_keys) {
  namespace fs = std::filesystem;
  const std::string tok_path = (fs::path(model_dir) / "tokenizer.json").string();
  const std::string cache_path = (fs::path(model_dir) / "engram_cmap.safetensors").string();
  std::string sha;
  std::error_code ec;
  if (fs::is_regular_file(tok_path, ec)) sha = sha256_file_hex(tok_path);

  if (!sha.empty() && fs::is_regular_file(cache_path, ec)) {
    try {
      SafetensorsFile f(cache_path);
      const auto it = f.metadata().find("tokenizer_sha256");
      const TensorView& c = f.get("cmap");
      const TensorView& k = f.get("n_keys");
      if (it != f.metadata().end() && it->second == sha && c.dtype == DType::I32 && c.shape.size() == 1 &&
          static_cast<size_t>(c.shape[0]) == tok.size() && k.dtype == DType::I32 && k.numel() == 1) {
        std::vector<int32_t> cmap(c.as<int32_t>(), c.as<int32_t>() + tok.size());
        if (n_keys) *n_keys = k.as<int32_t>()[0];
        return cmap;
      }
    } catch (const Error&) {
      // unreadable or foreign file: rebuild below
    }
  }

  int32_t nk = 0;
  std::vector<int32_t> cmap = build_engram_token_map(tok, &nk);
  if (n_keys) *n_keys = nk;
  if (!sha.empty()) {
    try {
      SafetensorsWriter w;
      w.add("cmap", DType::I32, {static_cast<int64_t>(cmap.size())}, cmap);
      w.add("n_keys", DType::I32, {1}, std::vector<int32_t>{nk});
      w.set_metadata("tokenizer_sha256", sha);
      w.set_metadata("n_keys", std::to_string(nk));
      w.set_metadata("len_tokenizer", std::to_string(tok.size()));
      w.write(cache_path);
    } catch (const Error&) {
      // read-only model directory: the computed map is still returned
    }
  }
  return cmap;
}

}  // namespace dsx::text
