// The on-disk KV cache: entry files (format in disk_cache.h), the in-memory index with
// block-hash prefix lookup, LRU eviction, the background writer, verification.
#include "cache/disk_cache.h"

#include <dirent.h>
#include <fcntl.h>
#include <openssl/evp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "cache/prefetch_reader.h"
#include "model/kv_state.h"
#include "util/error.h"
#include "util/snapshot_io.h"

namespace dsx {

namespace {

constexpr char kMagic[8] = {'D', 'S', 'X', 'K', 'V', 'C', '\r', '\n'};
constexpr char kSnapMagic[8] = {'D', 'S', 'X', 'S', 'N', 'A', 'P', '\n'};
constexpr char kOldSnapMagic[8] = {'D', 'S', 'X', 'K', 'V', 'S', '0', '1'};
constexpr char kSnapEnd[8] = {'D', 'S', 'X', 'E', 'N', 'D', '\0', '\0'};
constexpr size_t kFixed = 48;
constexpr uint32_t kMaxIdentity = 64u << 10;
constexpr uint32_t kMaxSnapHeader = 1u << 20;
constexpr uint64_t kChainSeed = 0x6473786b76636163ull;  // "dsxkvcac"
constexpr const char* kExt = ".dsxkv";
constexpr const char* kTmpInfix = ".dsxkv.tmp.";

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

template <typename T>
void put_le(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);  // (little-endian hosts only, as the snapshots)
}
template <typename T>
T get_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// The entry's file name: 128 bits of SHA-256 over the identity text and the token bytes.
std::string entry_name(const std::string& identity, const std::vector<int32_t>& tokens) {
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  const uint64_t ni = identity.size();
  EVP_DigestUpdate(ctx, &ni, 8);
  EVP_DigestUpdate(ctx, identity.data(), identity.size());
  EVP_DigestUpdate(ctx, tokens.data(), tokens.size() * 4);
  unsigned char md[32];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < 16; ++i) {
    s.push_back(hex[md[i] >> 4]);
    s.push_back(hex[md[i] & 15]);
  }
  return s + kExt;
}

// Block-hash chain: h_0 = seed, h_{k+1} = XXH3(block k, seed h_k) over whole blocks of
// kCacheBlockTokens tokens; the tail hash continues from the last whole block's.
uint64_t chain_next(uint64_t h, const int32_t* block) {
  return XXH3_64bits_withSeed(block, static_cast<size_t>(kCacheBlockTokens) * 4, h);
}
uint64_t tail_hash(uint64_t h, const int32_t* t, int64_t n) {
  return XXH3_64bits_withSeed(t, static_cast<size_t>(n) * 4, h);
}

nlohmann::json geometry_json(const KVGeometry& g) {
  return {{"n_layers", g.n_layers},   {"window", g.window},   {"rollback_depth", g.rollback_depth},
          {"head_dim", g.head_dim},   {"idx_dim", g.idx_dim}, {"source_ratio", g.source_ratio}};
}

KVGeometry geometry_from_json(const nlohmann::json& j) {
  KVGeometry g;
  g.n_layers = j.at("n_layers").get<int>();
  g.window = j.at("window").get<int>();
  g.rollback_depth = j.at("rollback_depth").get<int>();
  g.head_dim = j.at("head_dim").get<int>();
  g.idx_dim = j.at("idx_dim").get<int>();
  g.source_ratio = j.at("source_ratio").get<std::vector<int>>();
  if (g.n_layers < 0 || g.n_layers > 4096 || static_cast<int>(g.source_ratio.size()) != g.n_layers)
    fail("inconsistent geometry");
  return g;
}

// A refusal of a file: its reason, and whether the file is kept (another model's or
// layout's, a newer version) or bad (deleted when the directory is owned).
struct Refusal : Error {
  Refusal(const std::string& why, bool keep_file) : Error(why), keep(keep_file) {}
  bool keep;
};
[[noreturn]] void bad(const std::string& why) { throw Refusal(why, false); }
[[noreturn]] void keep(const std::string& why) { throw Refusal(why, true); }

// ---- buffered file streams ------------------------------------------------------------
class BufferedSource : public ByteSource {
 public:
  BufferedSource(int fd, size_t buf, const std::string& what) : fd_(fd), buf_(buf), what_(what) {}
  size_t read(void* p, size_t n) override {
    auto* out = static_cast<uint8_t*>(p);
    size_t got = 0;
    while (got < n) {
      if (pos_ < len_) {
        const size_t k = std::min(n - got, len_ - pos_);
        std::memcpy(out + got, buf_.data() + pos_, k);
        pos_ += k;
        got += k;
        continue;
      }
      if (eof_) break;
      // large reads go straight to the caller's memory
      const bool direct = n - got >= buf_.size();
      const size_t r = raw(direct ? out + got : buf_.data(), direct ? n - got : buf_.size());
      if (r == 0) {
        eof_ = true;
        break;
      }
      if (direct) {
        got += r;
      } else {
        pos_ = 0;
        len_ = r;
      }
    }
    consumed_ += got;
    return got;
  }
  uint64_t consumed() const { return consumed_; }

 private:
  size_t raw(uint8_t* p, size_t n) {
    for (;;) {
      const ssize_t r = ::read(fd_, p, n);
      if (r >= 0) return static_cast<size_t>(r);
      if (errno != EINTR) fail(what_, ": read failed: ", std::strerror(errno));
    }
  }
  int fd_;
  std::vector<uint8_t> buf_;
  std::string what_;
  size_t pos_ = 0, len_ = 0;
  bool eof_ = false;
  uint64_t consumed_ = 0;
};

// At most `limit` bytes of another source.
class LimitedSource : public ByteSource {
 public:
  LimitedSource(ByteSource& s, uint64_t limit) : s_(s), left_(limit) {}
  size_t read(void* p, size_t n) override {
    const size_t k = static_cast<size_t>(std::min<uint64_t>(n, left_));
    const size_t got = k ? s_.read(p, k) : 0;
    left_ -= got;
    return got;
  }

 private:
  ByteSource& s_;
  uint64_t left_;
};

// Hashes (XXH3-64) what passes through while on.
class HashingSource : public ByteSource {
 public:
  explicit HashingSource(ByteSource& s) : s_(s), h_(XXH3_createState()) { XXH3_64bits_reset(h_); }
  ~HashingSource() override { XXH3_freeState(h_); }
  size_t read(void* p, size_t n) override {
    const size_t got = s_.read(p, n);
    XXH3_64bits_update(h_, p, got);
    return got;
  }
  size_t read_unhashed(void* p, size_t n) { return s_.read(p, n); }
  void hash(const void* p, size_t n) { XXH3_64bits_update(h_, p, n); }
  uint64_t digest() const { return XXH3_64bits_digest(h_); }

 private:
  ByteSource& s_;
  XXH3_state_t* h_;
};

class BufferedSink : public ByteSink {
 public:
  BufferedSink(int fd, size_t buf, const std::string& what) : fd_(fd), what_(what) { buf_.reserve(buf); }
  void write(const void* p, size_t n) override {
    const auto* b = static_cast<const uint8_t*>(p);
    written_ += n;
    if (buf_.size() + n <= buf_.capacity()) {
      buf_.insert(buf_.end(), b, b + n);
      return;
    }
    flush();
    if (n >= buf_.capacity()) {
      raw(b, n);
    } else {
      buf_.insert(buf_.end(), b, b + n);
    }
  }
  void flush() {
    raw(buf_.data(), buf_.size());
    buf_.clear();
  }
  uint64_t written() const { return written_; }

 private:
  void raw(const uint8_t* p, size_t n) {
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(what_, ": write failed: ", std::strerror(errno));
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  int fd_;
  std::string what_;
  std::vector<uint8_t> buf_;
  uint64_t written_ = 0;
};

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

void read_exact(ByteSource& s, void* p, size_t n, const char* what) {
  const size_t got = s.read(p, n);
  if (got != n) bad(cat("truncated (", what, ")"));
}

// ---- the entry header ---------------------------------------------------------------------
struct EntryHeader {
  uint32_t version = 0;
  uint64_t n = 0, snapshot_bytes = 0;
  int64_t created_ns = 0;
  std::string identity;
  nlohmann::json identity_json;
  std::vector<int32_t> tokens;
  uint64_t header_bytes() const { return kFixed + identity.size() + 4 * n + 8; }
};

// Reads and checks the entry header of a file of `file_size` bytes from its start.
EntryHeader read_entry_header(ByteSource& src, uint64_t file_size) {
  if (file_size == 0) bad("empty file");
  uint8_t f[kFixed];
  const size_t got = src.read(f, kFixed);
  if (got >= 8 && std::memcmp(f, kSnapMagic, 8) == 0) bad("a bare session snapshot, not a kv cache entry");
  if (got < 8 && std::memcmp(f, kMagic, got) == 0) bad("truncated (entry header)");
  if (got < 8 || std::memcmp(f, kMagic, 8) != 0) bad("not a dsx kv cache entry (bad magic)");
  if (got < 12) bad("truncated (entry header)");
  EntryHeader h;
  h.version = get_le<uint32_t>(f + 8);
  if (h.version < kCacheFormatVersion)
    bad(cat("old kv cache format version ", h.version, "; this build reads version ", kCacheFormatVersion, " only"));
  if (h.version > kCacheFormatVersion)
    keep(cat("kv cache format version ", h.version, " is newer than this build's (", kCacheFormatVersion, ")"));
  if (got < kFixed) bad("truncated (entry header)");
  const uint32_t ni = get_le<uint32_t>(f + 12);
  h.n = get_le<uint64_t>(f + 16);
  h.snapshot_bytes = get_le<uint64_t>(f + 24);
  h.created_ns = get_le<int64_t>(f + 32);
  // (sizes first, so that a corrupt count does not allocate: the checksum follows)
  if (ni > kMaxIdentity) bad(cat("corrupt (identity of ", ni, " bytes)"));
  if (h.n == 0 || h.n > (uint64_t{1} << 40)) bad(cat("corrupt (token count ", h.n, ")"));
  const uint64_t hb = kFixed + ni + 4 * h.n + 8;
  if (file_size < hb)
    bad(cat("truncated (", file_size, " bytes; its header of ", h.n, " tokens alone takes ", hb, ")"));
  h.identity.resize(ni);
  read_exact(src, h.identity.data(), ni, "identity");
  h.tokens.resize(h.n);
  read_exact(src, h.tokens.data(), 4 * h.n, "token list");
  uint8_t sum[8];
  read_exact(src, sum, 8, "entry header checksum");
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  XXH3_64bits_update(st, f, kFixed);
  XXH3_64bits_update(st, h.identity.data(), ni);
  XXH3_64bits_update(st, h.tokens.data(), 4 * h.n);
  const uint64_t d = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  if (d != get_le<uint64_t>(sum)) bad("corrupt (entry header checksum mismatch)");
  if (file_size < hb + h.snapshot_bytes)
    bad(cat("truncated (", file_size, " bytes of ", hb + h.snapshot_bytes, ")"));
  if (file_size > hb + h.snapshot_bytes)
    bad(cat("has ", file_size - hb - h.snapshot_bytes, " trailing bytes after its snapshot"));
  try {
    h.identity_json = nlohmann::json::parse(h.identity);
    if (!h.identity_json.is_object() || !h.identity_json.at("model").is_string()) bad("identity lacks a model");
    geometry_from_json(h.identity_json.at("geometry"));
  } catch (const Refusal&) {
    throw;
  } catch (const std::exception& e) {
    bad(cat("corrupt (identity: ", e.what(), ")"));
  }
  return h;
}

std::vector<uint8_t> encode_fixed(uint32_t ni, uint64_t n, uint64_t s, int64_t created) {
  std::vector<uint8_t> f(kFixed, 0);
  std::memcpy(f.data(), kMagic, 8);
  put_le<uint32_t>(f.data() + 8, kCacheFormatVersion);
  put_le<uint32_t>(f.data() + 12, ni);
  put_le<uint64_t>(f.data() + 16, n);
  put_le<uint64_t>(f.data() + 24, s);
  put_le<int64_t>(f.data() + 32, created);
  return f;
}

// Checks a snapshot header (JSON) against the entry's identity and token count.
void check_snapshot_header(const std::string& text, const nlohmann::json& identity, uint64_t n) {
  nlohmann::json h;
  try {
    h = nlohmann::json::parse(text);
  } catch (const std::exception&) {
    bad("corrupt (snapshot header is not JSON)");
  }
  auto field = [&](const char* k) -> const nlohmann::json& {
    if (!h.is_object() || !h.contains(k)) bad(cat("corrupt (snapshot header lacks '", k, "')"));
    return h[k];
  };
  if (field("format") != "dsx-session") bad("corrupt (snapshot header format is not dsx-session)");
  for (const char* k : {"model", "family", "encoding", "geometry"})
    if (field(k) != identity.at(k))
      bad(cat("corrupt (its snapshot's ", k, " ", field(k).dump().substr(0, 40), " differs from the entry's ",
              identity.at(k).dump().substr(0, 40), ")"));
  if (!field("position").is_number_integer() || field("position").get<int64_t>() != static_cast<int64_t>(n))
    bad(cat("corrupt (its snapshot's position ", field("position").dump(), " is not its ", n, " tokens)"));
}

// Reads the snapshot's magic, version and header (what SnapshotReader checks) and the
// header's fields; `src` is positioned at the snapshot's start.
void check_snapshot_prefix(ByteSource& src, const nlohmann::json& identity, uint64_t n, uint64_t snapshot_bytes) {
  uint8_t p[16];
  const size_t got = src.read(p, 16);
  if (got >= 8 && std::memcmp(p, kOldSnapMagic, 8) == 0)
    bad("its snapshot is in the old dsx snapshot format (DSXKVS01, version 1)");
  if (got < 8 || std::memcmp(p, kSnapMagic, 8) != 0) bad("corrupt (its snapshot has a bad magic)");
  if (got < 16) bad("truncated (snapshot header)");
  const uint32_t v = get_le<uint32_t>(p + 8), hn = get_le<uint32_t>(p + 12);
  if (v < kSnapshotVersion)
    bad(cat("its snapshot has the old format version ", v, "; this build reads version ", kSnapshotVersion, " only"));
  if (v > kSnapshotVersion)
    keep(cat("its snapshot has format version ", v, ", newer than this build's (", kSnapshotVersion, ")"));
  if (hn > kMaxSnapHeader || 16 + hn + 16 > snapshot_bytes) bad(cat("corrupt (snapshot header length ", hn, ")"));
  std::vector<uint8_t> pre(16 + hn);
  std::memcpy(pre.data(), p, 16);
  read_exact(src, pre.data() + 16, hn, "snapshot header");
  SpanSource ss(pre);
  SnapshotReader r(ss, "its snapshot");
  check_snapshot_header(r.header(), identity, n);
}

}  // namespace

std::string cache_identity_text(const StateIdentity& id) {
  nlohmann::json j = {{"model", id.model_id},
                      {"family", id.family},
                      {"encoding", id.compact ? "compact" : "f32"},
                      {"geometry", geometry_json(id.geometry)}};
  return j.dump();
}

int64_t parse_byte_size(const std::string& text) {
  size_t i = 0;
  while (i < text.size() && (std::isdigit(static_cast<unsigned char>(text[i])) || text[i] == '.')) ++i;
  std::string num = text.substr(0, i), unit = text.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double v = 0;
  try {
    size_t used = 0;
    v = std::stod(num, &used);
    if (used != num.size()) throw std::invalid_argument("x");
  } catch (const std::exception&) {
    fail("'", text, "' is not a byte size (e.g. 8G, 512MiB, 1.5GB, 1000000)");
  }
  double m = 1;
  if (unit.empty() || unit == "B") m = 1;
  else if (unit == "K" || unit == "KIB") m = 1024.0;
  else if (unit == "M" || unit == "MIB") m = 1024.0 * 1024;
  else if (unit == "G" || unit == "GIB") m = 1024.0 * 1024 * 1024;
  else if (unit == "T" || unit == "TIB") m = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB") m = 1e3;
  else if (unit == "MB") m = 1e6;
  else if (unit == "GB") m = 1e9;
  else if (unit == "TB") m = 1e12;
  else fail("'", text, "': unknown unit '", text.substr(i), "' (B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB, TB)");
  const double b = std::floor(v * m);
  if (!(b >= 0) || b > 9.2e18) fail("'", text, "' is out of range");
  return static_cast<int64_t>(b);
}

// ---- the index ------------------------------------------------------------------------------
struct DiskCache::Entry {
  std::string name, model;
  std::vector<int32_t> tokens;
  uint64_t block_hash = 0;  // chain hash after the last whole block
  uint64_t full_hash = 0;   // continued over the tail
  int64_t bytes = 0, created_ns = 0, last_use_ns = 0, hits = 0;
};

namespace {
void hash_entry(const std::vector<int32_t>& t, uint64_t* block, uint64_t* full) {
  uint64_t h = kChainSeed;
  const int64_t n = static_cast<int64_t>(t.size()), k = n / kCacheBlockTokens;
  for (int64_t b = 0; b < k; ++b) h = chain_next(h, t.data() + b * kCacheBlockTokens);
  *block = h;
  *full = tail_hash(h, t.data() + k * kCacheBlockTokens, n - k * kCacheBlockTokens);
}
}  // namespace

DiskCache::DiskCache(std::string dir, std::optional<StateIdentity> id, DiskCacheOptions o)
    : dir_(std::move(dir)), id_(std::move(id)), opt_(std::move(o)) {
  while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  if (id_) identity_text_ = cache_identity_text(*id_);
  st_.budget_bytes = opt_.budget_bytes;
  std::error_code ec;
  if (!std::filesystem::exists(dir_, ec)) {
    if (!opt_.create) fail("kv cache directory ", dir_, " does not exist");
    const auto parent = std::filesystem::path(dir_).parent_path();
    if (!parent.empty()) std::filesystem::create_directories(parent, ec);
    if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
      fail("kv cache directory ", dir_, ": cannot create: ", std::strerror(errno));
  }
  if (!std::filesystem::is_directory(dir_, ec)) fail("kv cache directory ", dir_, " is not a directory");
  if (opt_.exclusive) {
    const std::string lock = dir_ + "/.lock";
    lock_fd_ = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) fail("kv cache directory ", dir_, ": cannot open ", lock, ": ", std::strerror(errno));
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      ::close(lock_fd_);
      lock_fd_ = -1;
      if (e == EWOULDBLOCK)
        fail("kv cache directory ", dir_, " is in use by another dsx process (", lock, " is locked)");
      fail("kv cache directory ", dir_, ": cannot lock ", lock, ": ", std::strerror(e));
    }
  }
  scan();
}

std::unique_ptr<DiskCache> DiskCache::open(const std::string& dir, int64_t budget_bytes, const StateIdentity& id,
                                           DiskCacheOptions o) {
  o.budget_bytes = budget_bytes;
  return std::unique_ptr<DiskCache>(new DiskCache(dir, id, std::move(o)));
}

std::unique_ptr<DiskCache> DiskCache::open_any(const std::string& dir, DiskCacheOptions o) {
  return std::unique_ptr<DiskCache>(new DiskCache(dir, std::nullopt, std::move(o)));
}

DiskCache::~DiskCache() {
  if (writer_.joinable()) {
    {
      std::unique_lock<std::mutex> l(mu_);
      idle_cv_.wait(l, [&] { return queue_.empty() && !busy_; });
      stop_ = true;
    }
    cv_.notify_all();
    writer_.join();
  }
  if (lock_fd_ >= 0) ::close(lock_fd_);  // (releases the lock)
}

void DiskCache::log(const std::string& line) const {
  if (opt_.log) {
    opt_.log(line);
  } else {
    std::fprintf(stderr, "dsx kv-cache: %s\n", line.c_str());
  }
}

void DiskCache::refuse(const std::string& name, const std::string& reason, bool remove, bool foreign,
                       int64_t bytes) {
  RefusedFile r{name, reason, false, foreign};
  if (remove && opt_.exclusive) r.deleted = ::unlink(path(name).c_str()) == 0 || errno == ENOENT;
  log(cat("refused ", path(name), ": ", reason,
          r.deleted ? " (deleted)" : foreign || !opt_.exclusive ? " (kept, not loaded)" : " (not loaded)"));
  std::lock_guard<std::mutex> l(mu_);
  refused_.push_back(r);
  ++st_.refused;
  if (foreign) {
    ++st_.foreign_files;
    st_.foreign_bytes += bytes;
  }
}

void DiskCache::scan() {
  std::vector<std::string> names;
  {
    DIR* d = ::opendir(dir_.c_str());
    if (!d) fail("kv cache directory ", dir_, ": cannot read: ", std::strerror(errno));
    while (dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    if (name.find(kTmpInfix) != std::string::npos) {
      // a write that never completed (its process died): never an entry
      if (opt_.exclusive && ::unlink(path(name).c_str()) == 0) {
        log(cat("removed ", path(name), ": a temporary file left by an interrupted save"));
        std::lock_guard<std::mutex> l(mu_);
        ++st_.temp_files_removed;
      }
      continue;
    }
    if (!ends_with(name, kExt)) continue;
    const std::string p = path(name);
    struct stat sb;
    if (::stat(p.c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;
    Fd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.fd < 0) {
      log(cat("cannot open ", p, ": ", std::strerror(errno)));
      continue;
    }
    try {
      BufferedSource src(fd.fd, 16 << 10, p);  // (the header: small reads)
      EntryHeader h = read_entry_header(src, static_cast<uint64_t>(sb.st_size));
      if (entry_name(h.identity, h.tokens) != name) bad("its name does not match its contents (renamed or corrupt)");
      check_snapshot_prefix(src, h.identity_json, h.n, h.snapshot_bytes);
      auto e = std::make_shared<Entry>();
      e->name = name;
      e->model = h.identity_json.at("model").get<std::string>();
      e->tokens = std::move(h.tokens);
      hash_entry(e->tokens, &e->block_hash, &e->full_hash);
      e->bytes = static_cast<int64_t>(sb.st_size);
      e->created_ns = h.created_ns;
      e->last_use_ns = static_cast<int64_t>(sb.st_mtim.tv_sec) * 1000000000 + sb.st_mtim.tv_nsec;
      if (id_ && h.identity != identity_text_) {
        const nlohmann::json mine = nlohmann::json::parse(identity_text_);
        if (e->model != id_->model_id)
          keep(cat("belongs to another model (", e->model.substr(0, 16), "…; this one is ",
                   id_->model_id.substr(0, 16), "…)"));
        std::string what;
        for (const char* k : {"family", "encoding", "geometry"})
          if (h.identity_json.at(k) != mine.at(k))
            what += cat(what.empty() ? "" : ", ", k, " ", h.identity_json.at(k).dump(), " vs ", mine.at(k).dump());
        keep(cat("was written for another state layout of this model (", what,
                 "): another rollback depth or encoding"));
      }
      std::lock_guard<std::mutex> l(mu_);
      insert_locked(std::move(e));
    } catch (const Refusal& r) {
      refuse(name, r.what(), !r.keep, r.keep, static_cast<int64_t>(sb.st_size));
    } catch (const Error& err) {
      refuse(name, err.what(), true, false, static_cast<int64_t>(sb.st_size));
    }
  }
  std::lock_guard<std::mutex> l(mu_);
  if (opt_.exclusive) evict_locked("", budget());
}

void DiskCache::insert_locked(std::shared_ptr<Entry> e) {
  erase_locked(e->name, false);
  st_.entries += 1;
  st_.bytes += e->bytes;
  last_stamp_ = std::max(last_stamp_, e->last_use_ns);
  by_block_.emplace(e->block_hash, e);
  entries_[e->name] = std::move(e);
}

void DiskCache::erase_locked(const std::string& name, bool delete_file) {
  auto it = entries_.find(name);
  if (it == entries_.end()) return;
  const std::shared_ptr<Entry> e = it->second;
  auto [a, b] = by_block_.equal_range(e->block_hash);
  for (auto i = a; i != b; ++i)
    if (i->second == e) {
      by_block_.erase(i);
      break;
    }
  entries_.erase(it);
  st_.entries -= 1;
  st_.bytes -= e->bytes;
  if (delete_file) ::unlink(path(name).c_str());
}

void DiskCache::touch_locked(Entry& e) {
  const int64_t t = std::max(now_ns(), last_stamp_ + 1);
  last_stamp_ = t;
  e.last_use_ns = t;
  if (!opt_.exclusive) return;
  // the last use is the file's mtime (metadata: the published bytes never change)
  const struct timespec ts[2] = {{0, UTIME_OMIT},
                                 {static_cast<time_t>(t / 1000000000), static_cast<long>(t % 1000000000)}};
  ::utimensat(AT_FDCWD, path(e.name).c_str(), ts, 0);
}

void DiskCache::evict_locked(const std::string& protect, int64_t limit) {
  if (limit < 0) return;
  while (st_.bytes > limit) {
    std::shared_ptr<Entry> victim;
    for (const auto& [name, e] : entries_) {
      if (name == protect) continue;
      if (!victim || e->last_use_ns < victim->last_use_ns ||
          (e->last_use_ns == victim->last_use_ns && e->bytes > victim->bytes))
        victim = e;
    }
    if (!victim) break;
    ++st_.evictions;
    st_.evicted_bytes += victim->bytes;
    erase_locked(victim->name, true);
  }
}

int64_t DiskCache::prune(int64_t target_bytes) {
  require_owner("prune");
  std::lock_guard<std::mutex> l(mu_);
  const int64_t before = st_.bytes;
  evict_locked("", std::max<int64_t>(target_bytes, 0));
  return before - st_.bytes;
}

void DiskCache::require_model(const char* what) const {
  if (!id_) fail("kv cache ", dir_, ": ", what, " needs a cache opened for a model");
}

void DiskCache::require_owner(const char* what) const {
  if (!opt_.exclusive) fail("kv cache ", dir_, ": ", what, " needs the directory (opened read only)");
}

std::optional<CacheHit> DiskCache::lookup(const int32_t* t, int64_t n) {
  require_model("lookup");
  const int64_t m = n / kCacheBlockTokens;
  std::vector<uint64_t> chain(static_cast<size_t>(m + 1));
  chain[0] = kChainSeed;
  for (int64_t k = 0; k < m; ++k) chain[static_cast<size_t>(k + 1)] = chain_next(chain[k], t + k * kCacheBlockTokens);
  std::lock_guard<std::mutex> l(mu_);
  for (int64_t k = m; k >= 0; --k) {
    // entries whose whole blocks are the request's first k blocks: the longest whose
    // tail matches too (an entry of a higher level is longer than any of a lower one)
    auto [a, b] = by_block_.equal_range(chain[static_cast<size_t>(k)]);
    std::vector<std::shared_ptr<Entry>> cands;
    for (auto i = a; i != b; ++i) {
      const Entry& e = *i->second;
      const int64_t len = static_cast<int64_t>(e.tokens.size());
      if (len / kCacheBlockTokens != k || len > n) continue;
      if (tail_hash(chain[static_cast<size_t>(k)], t + k * kCacheBlockTokens, len - k * kCacheBlockTokens) !=
          e.full_hash)
        continue;
      cands.push_back(i->second);
    }
    std::sort(cands.begin(), cands.end(),
              [](const auto& x, const auto& y) { return x->tokens.size() > y->tokens.size(); });
    for (const auto& e : cands) {
      if (std::memcmp(e->tokens.data(), t, e->tokens.size() * 4) != 0) continue;  // (a hash collision)
      ++st_.hits;
      ++e->hits;
      touch_locked(*e);
      return CacheHit{e->name, static_cast<int64_t>(e->tokens.size()), e->bytes};
    }
  }
  ++st_.misses;
  return std::nullopt;
}

void DiskCache::drop(const std::string& name, const std::string& reason) {
  int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (auto it = entries_.find(name); it != entries_.end()) bytes = it->second->bytes;
    erase_locked(name, false);
  }
  refuse(name, reason, true, false, bytes);
}

RestoreResult DiskCache::restore(const CacheHit& hit, Session& s) {
  require_model("restore");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string p = path(hit.name);
  std::shared_ptr<Entry> e;
  {
    std::lock_guard<std::mutex> l(mu_);
    if (auto it = entries_.find(hit.name); it != entries_.end()) e = it->second;
  }
  if (!e) fail("kv cache entry ", p, " is no longer in the cache");
  if (cache_identity_text(s.engine().state_identity()) != identity_text_)
    fail("kv cache ", dir_, ": restore into a session of another model state than the cache's");
  const int64_t n = static_cast<int64_t>(e->tokens.size());
  if (n > s.capacity())
    fail("kv cache entry ", p, " holds ", n, " tokens, more than the session's capacity of ", s.capacity());
  auto reset = [&] {
    try {
      if (s.position() != 0) s.rollback(0);
    } catch (const std::exception&) {
    }
  };
  // O_DIRECT: the reader's chunks go from the disk into its buffers, not through the
  // page cache (PrefetchReader falls back where the file system refuses)
  Fd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT));
  if (fd.fd < 0 && errno == EINVAL) fd.fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) {
    const int err = errno;
    std::lock_guard<std::mutex> l(mu_);
    erase_locked(hit.name, false);
    ++st_.restore_failures;
    fail("kv cache entry ", p, ": cannot open: ", std::strerror(err));
  }
  try {
    struct stat sb;
    if (::fstat(fd.fd, &sb) != 0) fail("cannot stat: ", std::strerror(errno));
    if (sb.st_size != e->bytes) bad(cat("its size changed from ", e->bytes, " to ", sb.st_size, " bytes"));
    // read ahead on a thread while the restore below hashes and uploads what arrived (one
    // synchronous buffered read at a time reached ~57-70 % of the disk's bandwidth on the
    // H200 machine)
    PrefetchReader src(fd.fd, static_cast<uint64_t>(sb.st_size), p);
    EntryHeader h = read_entry_header(src, static_cast<uint64_t>(sb.st_size));
    if (h.identity != identity_text_ || h.tokens != e->tokens) bad("its header changed since it was indexed");
    LimitedSource body(src, h.snapshot_bytes);
    s.restore(body);
    if (s.tokens() != e->tokens) bad("its snapshot's token history differs from the entry's token list");
    RestoreResult r;
    r.position = s.position();
    r.bytes = e->bytes;
    r.seconds = seconds_since(t0);
    std::lock_guard<std::mutex> l(mu_);
    ++st_.restores;
    st_.restored_bytes += r.bytes;
    st_.restore_seconds += r.seconds;
    return r;
  } catch (const Error& err) {
    reset();
    {
      std::lock_guard<std::mutex> l(mu_);
      ++st_.restore_failures;
    }
    drop(hit.name, err.what());
    fail("kv cache entry ", p, " refused: ", err.what());
  } catch (...) {
    reset();
    std::lock_guard<std::mutex> l(mu_);
    ++st_.restore_failures;
    throw;
  }
}

// ---- saving -------------------------------------------------------------------------------
bool DiskCache::too_large(uint64_t bytes) const {
  return opt_.budget_bytes > 0 && static_cast<double>(bytes) * 1.01 > static_cast<double>(opt_.budget_bytes);
}

SaveResult DiskCache::write_entry(const std::vector<int32_t>& tokens, int64_t body_bytes,
                                  const std::function<void(ByteSink&)>& body) {
  const auto t0 = std::chrono::steady_clock::now();
  SaveResult res;
  res.name = entry_name(identity_text_, tokens);
  res.tokens = static_cast<int64_t>(tokens.size());
  std::string tmp;
  const auto too_large_note = [&] {
    return cat("not stored: an entry of ", res.tokens, " tokens takes ", res.bytes, " bytes, more than the budget of ",
               opt_.budget_bytes, " allows");
  };
  {
    std::unique_lock<std::mutex> l(mu_);
    if (auto it = entries_.find(res.name); it != entries_.end()) {
      struct stat sb;
      if (::stat(path(res.name).c_str(), &sb) == 0 && sb.st_size == it->second->bytes) {
        touch_locked(*it->second);
        ++st_.save_existing;
        res.outcome = SaveResult::kExisting;
        res.bytes = it->second->bytes;
        return res;
      }
      erase_locked(res.name, false);  // (its file went away: write it again)
    }
    if (body_bytes >= 0 && too_large(kFixed + identity_text_.size() + 4 * tokens.size() + 8 + body_bytes)) {
      ++st_.save_too_large;
      res.outcome = SaveResult::kTooLarge;
      res.bytes = static_cast<int64_t>(kFixed + identity_text_.size() + 4 * tokens.size() + 8) + body_bytes;
      l.unlock();
      log(too_large_note());
      return res;
    }
    tmp = path(res.name) + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(tmp_seq_++);
  }
  const std::string final_path = path(res.name);
  const int64_t created = now_ns();
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600));
  if (fd.fd < 0) fail("kv cache: cannot create ", tmp, ": ", std::strerror(errno));
  try {
    const auto ni = static_cast<uint32_t>(identity_text_.size());
    const uint64_t n = tokens.size();
    BufferedSink sink(fd.fd, std::max<size_t>(opt_.io_buffer_bytes, 1 << 16), tmp);
    const std::vector<uint8_t> zero(kFixed, 0);
    sink.write(zero.data(), kFixed);  // (the fixed part and the checksum, once the snapshot's size is known)
    sink.write(identity_text_.data(), ni);
    sink.write(tokens.data(), 4 * n);
    sink.write(zero.data(), 8);
    const uint64_t hb = sink.written();
    body(sink);
    sink.flush();
    const uint64_t s = sink.written() - hb;
    const std::vector<uint8_t> f = encode_fixed(ni, n, s, created);
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    XXH3_64bits_update(st, f.data(), kFixed);
    XXH3_64bits_update(st, identity_text_.data(), ni);
    XXH3_64bits_update(st, tokens.data(), 4 * n);
    uint8_t sum[8];
    put_le<uint64_t>(sum, XXH3_64bits_digest(st));
    XXH3_freeState(st);
    if (::pwrite(fd.fd, f.data(), kFixed, 0) != static_cast<ssize_t>(kFixed) ||
        ::pwrite(fd.fd, sum, 8, static_cast<off_t>(hb - 8)) != 8)
      fail(tmp, ": write failed: ", std::strerror(errno));
    res.bytes = static_cast<int64_t>(hb + s);
    if (too_large(static_cast<uint64_t>(res.bytes))) {
      ::unlink(tmp.c_str());
      log(too_large_note());
      std::lock_guard<std::mutex> l(mu_);
      ++st_.save_too_large;
      res.outcome = SaveResult::kTooLarge;
      return res;
    }
    if (::fsync(fd.fd) != 0) fail(tmp, ": fsync failed: ", std::strerror(errno));
    const int f0 = fd.fd;
    fd.fd = -1;
    if (::close(f0) != 0) fail(tmp, ": close failed: ", std::strerror(errno));
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) fail(final_path, ": rename failed: ", std::strerror(errno));
  } catch (const std::exception& e) {
    ::unlink(tmp.c_str());
    fail("kv cache: saving ", final_path, " failed: ", e.what());
  }
  // the rename is durable once the directory is synced
  if (Fd d(::open(dir_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC)); d.fd >= 0) ::fsync(d.fd);
  auto e = std::make_shared<Entry>();
  e->name = res.name;
  e->model = id_->model_id;
  e->tokens = tokens;
  hash_entry(e->tokens, &e->block_hash, &e->full_hash);
  e->bytes = res.bytes;
  e->created_ns = created;
  res.seconds = seconds_since(t0);
  std::lock_guard<std::mutex> l(mu_);
  touch_locked(*e);  // (the mtime from the same clock as later uses: file times are coarse)
  insert_locked(e);
  ++st_.saves;
  st_.written_bytes += res.bytes;
  st_.save_seconds += res.seconds;
  evict_locked(res.name, budget());
  return res;
}

SaveResult DiskCache::save(const Session& s) {
  require_model("save");
  require_owner("save");
  if (cache_identity_text(s.engine().state_identity()) != identity_text_)
    fail("kv cache ", dir_, ": save of a session of another model state than the cache's");
  if (s.position() == 0) fail("kv cache: nothing to save (the session is empty)");
  const std::vector<int32_t> tokens = s.tokens();
  return write_entry(tokens, -1, [&](ByteSink& sink) { s.save(sink); });
}

SaveResult DiskCache::save_snapshot(const std::vector<uint8_t>& snap, const std::vector<int32_t>& tokens) {
  require_model("save");
  require_owner("save");
  if (tokens.empty()) fail("kv cache: nothing to save (no tokens)");
  // the snapshot is whole (its checksum), of this model state, and of these tokens
  try {
    if (snap.size() < 32 || std::memcmp(snap.data() + snap.size() - 16, kSnapEnd, 8) != 0 ||
        XXH3_64bits(snap.data(), snap.size() - 16) != get_le<uint64_t>(snap.data() + snap.size() - 8))
      bad("the snapshot is incomplete or corrupt (checksum)");
    SpanSource src(snap);
    const nlohmann::json mine = nlohmann::json::parse(identity_text_);
    check_snapshot_prefix(src, mine, tokens.size(), snap.size());
    uint8_t sec[16];
    read_exact(src, sec, 16, "token history");
    if (get_le<uint32_t>(sec) != static_cast<uint32_t>(SectionTag::kTokens) || get_le<uint32_t>(sec + 4) != kNoLayer ||
        get_le<uint64_t>(sec + 8) != 4 * tokens.size())
      bad("the snapshot does not begin with its token history");
    std::vector<int32_t> hist(tokens.size());
    read_exact(src, hist.data(), 4 * hist.size(), "token history");
    if (hist != tokens) bad("the snapshot's token history is not the token list given");
  } catch (const Error& e) {
    fail("kv cache: not saving a snapshot of ", tokens.size(), " tokens: ", e.what());
  }
  return write_entry(tokens, static_cast<int64_t>(snap.size()),
                     [&](ByteSink& sink) { sink.write(snap.data(), snap.size()); });
}

bool DiskCache::save_async(std::vector<uint8_t> snapshot, std::vector<int32_t> tokens) {
  require_model("save");
  require_owner("save");
  const std::string name = entry_name(identity_text_, tokens);
  std::unique_lock<std::mutex> l(mu_);
  if (auto it = entries_.find(name); it != entries_.end()) {
    touch_locked(*it->second);
    ++st_.save_existing;
    return true;
  }
  const auto bytes = static_cast<int64_t>(snapshot.size());
  if (queue_.size() >= std::max<size_t>(opt_.queue_entries, 1) ||
      (!queue_.empty() && queue_bytes_ + bytes > opt_.queue_bytes)) {
    ++st_.queue_full;
    return false;
  }
  if (!writer_.joinable()) writer_ = std::thread([this] { writer_loop(); });
  queue_.push_back(Job{std::move(snapshot), std::move(tokens)});
  queue_bytes_ += bytes;
  ++st_.queued;
  l.unlock();
  cv_.notify_one();
  return true;
}

void DiskCache::writer_loop() {
  std::unique_lock<std::mutex> l(mu_);
  for (;;) {
    cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // (stop)
    Job job = std::move(queue_.front());
    queue_.pop_front();
    queue_bytes_ -= static_cast<int64_t>(job.snapshot.size());
    busy_ = true;
    l.unlock();
    try {
      save_snapshot(job.snapshot, job.tokens);
    } catch (const std::exception& e) {
      log(cat("background save failed: ", e.what()));
      std::lock_guard<std::mutex> g(mu_);
      ++st_.write_errors;
    }
    job = Job{};
    l.lock();
    busy_ = false;
    if (queue_.empty()) idle_cv_.notify_all();
  }
}

void DiskCache::flush() {
  std::unique_lock<std::mutex> l(mu_);
  idle_cv_.wait(l, [&] { return queue_.empty() && !busy_; });
}

// ---- reports ------------------------------------------------------------------------------
DiskCacheStats DiskCache::stats() const {
  std::lock_guard<std::mutex> l(mu_);
  DiskCacheStats s = st_;
  s.pending = static_cast<int64_t>(queue_.size()) + (busy_ ? 1 : 0);
  return s;
}

std::vector<CacheEntryInfo> DiskCache::entries() const {
  std::vector<CacheEntryInfo> v;
  {
    std::lock_guard<std::mutex> l(mu_);
    for (const auto& [name, e] : entries_)
      v.push_back({name, e->model, static_cast<int64_t>(e->tokens.size()), e->bytes, e->created_ns, e->last_use_ns,
                   e->hits});
  }
  std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
    return a.last_use_ns != b.last_use_ns ? a.last_use_ns > b.last_use_ns : a.name < b.name;
  });
  return v;
}

std::vector<RefusedFile> DiskCache::refused_files() const {
  std::lock_guard<std::mutex> l(mu_);
  return refused_;
}

namespace {

// Reads a whole entry file and checks everything that can be checked without a model:
// the entry header, the snapshot's header against it, the section structure (the
// canonical sections of its geometry for the compact encoding, layer vectors for f32),
// the token history against the entry's list, the snapshot checksum, nothing after it.
void verify_file(const std::string& p, size_t buf) {
  Fd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.fd < 0) fail("cannot open: ", std::strerror(errno));
  struct stat sb;
  if (::fstat(fd.fd, &sb) != 0) fail("cannot stat: ", std::strerror(errno));
  ::posix_fadvise(fd.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  BufferedSource file(fd.fd, buf, p);
  EntryHeader h = read_entry_header(file, static_cast<uint64_t>(sb.st_size));
  if (entry_name(h.identity, h.tokens) != std::filesystem::path(p).filename().string())
    bad("its name does not match its contents (renamed or corrupt)");
  LimitedSource body(file, h.snapshot_bytes);
  HashingSource hs(body);
  {
    // the magic, version and header (hashed as read), through SnapshotReader's checks
    std::vector<uint8_t> pre(16);
    pre.resize(hs.read(pre.data(), 16));
    if (pre.size() == 16 && std::memcmp(pre.data(), kSnapMagic, 8) == 0) {
      const uint32_t hn = get_le<uint32_t>(pre.data() + 12);
      if (hn > kMaxSnapHeader || 32 + uint64_t{hn} > h.snapshot_bytes)
        bad(cat("corrupt (snapshot header length ", hn, ")"));
      pre.resize(16 + hn);
      if (hs.read(pre.data() + 16, hn) != hn) bad("truncated (snapshot header)");
    }
    SpanSource again(pre);
    check_snapshot_prefix(again, h.identity_json, h.n, h.snapshot_bytes);
  }
  const KVGeometry g = geometry_from_json(h.identity_json.at("geometry"));
  const bool compact = h.identity_json.at("encoding") == "compact";
  std::vector<StateSection> want;
  if (compact) want = state_sections(g, static_cast<int64_t>(h.n));
  std::vector<uint8_t> chunk(buf);
  size_t index = 0;
  int64_t last_layer = -1;
  for (;;) {
    uint8_t sec[16];
    if (hs.read_unhashed(sec, 16) != 16) bad(cat("truncated (after ", index, " sections)"));
    if (std::memcmp(sec, kSnapEnd, 8) == 0) {
      if (hs.digest() != get_le<uint64_t>(sec + 8)) bad("corrupt (snapshot checksum mismatch)");
      uint8_t extra;
      if (hs.read_unhashed(&extra, 1) != 0) bad("has bytes after its snapshot's trailer");
      break;
    }
    hs.hash(sec, 16);
    const uint32_t tag = get_le<uint32_t>(sec), layer = get_le<uint32_t>(sec + 4);
    const uint64_t bytes = get_le<uint64_t>(sec + 8);
    const std::string where = cat("section ", index, " (tag ", tag, ", layer ", static_cast<int32_t>(layer), ", ",
                                  bytes, " bytes)");
    if (index == 0) {
      if (tag != static_cast<uint32_t>(SectionTag::kTokens) || layer != kNoLayer || bytes != 4 * h.n)
        bad(cat("corrupt (", where, " is not the token history of ", h.n, " tokens)"));
      std::vector<int32_t> hist(h.n);
      if (hs.read(hist.data(), bytes) != bytes) bad("truncated (token history)");
      if (hist != h.tokens) bad("corrupt (its snapshot's token history differs from the entry's token list)");
    } else {
      if (compact) {
        if (index >= want.size() || want[index].tag != static_cast<SectionTag>(tag) || want[index].layer != layer ||
            static_cast<uint64_t>(want[index].bytes) != bytes)
          bad(cat("corrupt (", where, " is not the canonical section ", index, " of its geometry)"));
      } else if (tag != static_cast<uint32_t>(SectionTag::kF32) || layer >= static_cast<uint32_t>(g.n_layers) ||
                 static_cast<int64_t>(layer) < last_layer) {
        bad(cat("corrupt (", where, " is not an f32 state vector of a layer in order)"));
      }
      last_layer = layer;
      for (uint64_t left = bytes; left > 0;) {
        const size_t k = static_cast<size_t>(std::min<uint64_t>(left, chunk.size()));
        if (hs.read(chunk.data(), k) != k) bad(cat("truncated (in ", where, ")"));
        left -= k;
      }
    }
    ++index;
  }
  if (compact && index != want.size()) bad(cat("corrupt (", index, " sections, its geometry has ", want.size(), ")"));
  if (!compact && index != 1 + 5 * static_cast<size_t>(g.n_layers))
    bad(cat("corrupt (", index, " sections, an f32 state of ", g.n_layers, " layers has ", 1 + 5 * g.n_layers, ")"));
}

}  // namespace

VerifyReport DiskCache::verify() {
  const auto t0 = std::chrono::steady_clock::now();
  VerifyReport rep;
  std::vector<std::string> names;
  {
    DIR* d = ::opendir(dir_.c_str());
    if (!d) fail("kv cache directory ", dir_, ": cannot read: ", std::strerror(errno));
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (ends_with(n, kExt)) names.push_back(n);
    }
    ::closedir(d);
  }
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    VerifyReport::File f;
    f.name = name;
    struct stat sb;
    if (::stat(path(name).c_str(), &sb) == 0) f.bytes = static_cast<int64_t>(sb.st_size);
    bool ours;
    {
      std::lock_guard<std::mutex> l(mu_);
      ours = entries_.count(name) > 0;
    }
    try {
      verify_file(path(name), std::max<size_t>(opt_.io_buffer_bytes, 1 << 16));
      f.ok = true;
      f.foreign = !ours;  // (intact, but not one of this cache's entries: another model's)
    } catch (const Refusal& r) {
      f.reason = r.what();
      f.foreign = r.keep;
      f.ok = false;
    } catch (const Error& e) {
      f.reason = e.what();
    }
    if (!f.ok && !f.foreign) {
      ++rep.bad;
      if (ours) drop(name, f.reason);
      else refuse(name, f.reason, true, false, f.bytes);
    }
    rep.files.push_back(std::move(f));
  }
  rep.seconds = seconds_since(t0);
  return rep;
}

}  // namespace dsx
