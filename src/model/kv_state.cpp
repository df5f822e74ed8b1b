#include "model/kv_state.h"

#include <cstring>

#include "model/config.h"
#include "util/error.h"

namespace dsx {

namespace {

constexpr char kMagic[8] = {'D', 'S', 'X', 'K', 'V', 'S', '0', '1'};

class Writer {
 public:
  void bytes(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out.insert(out.end(), b, b + n);
  }
  template <typename T>
  void pod(T v) {
    bytes(&v, sizeof v);
  }
  template <typename T>
  void vec(const std::vector<T>& v) {
    pod<uint64_t>(v.size());
    bytes(v.data(), v.size() * sizeof(T));
  }
  void str(const std::string& s) {
    pod<uint64_t>(s.size());
    bytes(s.data(), s.size());
  }
  std::vector<uint8_t> out;
};

class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  void bytes(void* dst, size_t n) {
    if (n > n_ - off_) fail("session snapshot is truncated (needs ", n, " more bytes at offset ", off_, ")");
    std::memcpy(dst, p_ + off_, n);
    off_ += n;
  }
  template <typename T>
  T pod() {
    T v;
    bytes(&v, sizeof v);
    return v;
  }
  template <typename T>
  std::vector<T> vec(size_t expect_max) {
    uint64_t n = pod<uint64_t>();
    if (n > expect_max || n * sizeof(T) > n_ - off_) fail("session snapshot is corrupt (bad array length ", n, ")");
    std::vector<T> v(n);
    bytes(v.data(), n * sizeof(T));
    return v;
  }
  std::string str(size_t expect_max) {
    uint64_t n = pod<uint64_t>();
    if (n > expect_max || n > n_ - off_) fail("session snapshot is corrupt (bad string length)");
    std::string s(n, '\0');
    bytes(s.data(), n);
    return s;
  }
  bool done() const { return off_ == n_; }

 private:
  const uint8_t* p_;
  size_t n_, off_ = 0;
};

uint64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::vector<uint8_t> KVState::save() const {
  Writer w;
  w.bytes(kMagic, 8);
  w.str(fingerprint);
  w.pod<int64_t>(pos);
  w.pod<int32_t>(rollback_depth);
  w.vec(tokens);
  w.pod<uint32_t>(static_cast<uint32_t>(windows.size()));
  for (const auto& r : windows) {
    w.pod<int32_t>(r.cap);
    w.pod<int32_t>(r.dim);
    w.vec(r.rows);
  }
  for (const auto& c : caches) {
    w.pod<int32_t>(c.ratio);
    w.pod<int32_t>(c.dim);
    w.pod<int32_t>(c.idx_dim);
    w.pod<int64_t>(c.n);
    w.vec(c.rows);
    w.vec(c.keys);
    w.pod<int32_t>(c.proj_cap);
    w.vec(c.proj_kv);
    w.vec(c.proj_gate);
  }
  uint64_t sum = checksum(w.out.data(), w.out.size());
  w.pod<uint64_t>(sum);
  return std::move(w.out);
}

void KVState::restore(const uint8_t* data, size_t n) {
  if (n < 16 || std::memcmp(data, kMagic, 8) != 0) fail("not a dsx session snapshot (bad magic)");
  uint64_t stored;
  std::memcpy(&stored, data + n - 8, 8);
  if (checksum(data, n - 8) != stored) fail("session snapshot is corrupt (checksum mismatch)");
  Reader r(data + 8, n - 16);
  std::string fp = r.str(1024);
  if (fp != fingerprint) fail("session snapshot belongs to a different model (fingerprint ", fp.substr(0, 16), "… vs ", fingerprint.substr(0, 16), "…)");
  KVState s = *this;  // geometry template
  s.pos = r.pod<int64_t>();
  s.rollback_depth = r.pod<int32_t>();
  s.tokens = r.vec<int32_t>(size_t{1} << 40);
  if (s.pos < 0 || static_cast<size_t>(s.pos) != s.tokens.size()) fail("session snapshot is corrupt (position)");
  if (r.pod<uint32_t>() != windows.size()) fail("session snapshot has a different layer count");
  for (auto& ring : s.windows) {
    int cap = r.pod<int32_t>(), dim = r.pod<int32_t>();
    if (cap != ring.cap || dim != ring.dim) fail("session snapshot has a different window geometry");
    ring.rows = r.vec<float>(ring.rows.size());
    if (ring.rows.size() != static_cast<size_t>(cap) * dim) fail("session snapshot is corrupt (window rows)");
  }
  for (auto& c : s.caches) {
    int ratio = r.pod<int32_t>(), dim = r.pod<int32_t>(), idim = r.pod<int32_t>();
    if (ratio != c.ratio || dim != c.dim || idim != c.idx_dim) fail("session snapshot has a different cache geometry");
    c.n = r.pod<int64_t>();
    c.rows = r.vec<float>(size_t{1} << 40);
    c.keys = r.vec<float>(size_t{1} << 40);
    if (c.ratio > 0 && (c.n != s.pos / c.ratio || c.rows.size() != static_cast<size_t>(c.n) * dim ||
                        c.keys.size() != static_cast<size_t>(c.n) * idim))
      fail("session snapshot is corrupt (compressed cache size)");
    int pc = r.pod<int32_t>();
    if (pc != c.proj_cap) fail("session snapshot has a different compressor geometry");
    c.proj_kv = r.vec<float>(size_t{1} << 32);
    c.proj_gate = r.vec<float>(size_t{1} << 32);
  }
  if (!r.done()) fail("session snapshot has trailing bytes");
  *this = std::move(s);
}

void KVState::rollback(int64_t new_pos) {
  if (new_pos > pos || new_pos < 0 || pos - new_pos > rollback_depth)
    fail("cannot roll back from position ", pos, " to ", new_pos, " (at most ", rollback_depth, " tokens)");
  pos = new_pos;
  tokens.resize(static_cast<size_t>(new_pos));
  for (auto& c : caches) {
    if (c.ratio == 0) continue;
    c.n = new_pos / c.ratio;
    c.rows.resize(static_cast<size_t>(c.n) * c.dim);
    c.keys.resize(static_cast<size_t>(c.n) * c.idx_dim);
  }
  // Window rings and compressor projection rings keep rollback_depth extra slots,
  // so every row the new position needs is still intact.
}

int64_t KVState::bytes() const {
  int64_t b = static_cast<int64_t>(tokens.size()) * 4;
  for (const auto& r : windows) b += static_cast<int64_t>(r.rows.size()) * 4;
  for (const auto& c : caches)
    b += static_cast<int64_t>(c.rows.size() + c.keys.size() + c.proj_kv.size() + c.proj_gate.size()) * 4;
  return b;
}

KVState make_kv_state(const ModelConfig& cfg, int rollback_depth, const std::string& fingerprint) {
  KVState st;
  st.rollback_depth = rollback_depth;
  st.fingerprint = fingerprint;
  st.windows.resize(static_cast<size_t>(cfg.n_layers));
  st.caches.resize(static_cast<size_t>(cfg.n_layers));
  for (int l = 0; l < cfg.n_layers; ++l) {
    auto& r = st.windows[static_cast<size_t>(l)];
    r.cap = cfg.window + rollback_depth;
    r.dim = cfg.head_dim;
    r.rows.assign(static_cast<size_t>(r.cap) * r.dim, 0.0f);
    if (cfg.is_kv_source(l)) {
      auto& c = st.caches[static_cast<size_t>(l)];
      c.ratio = cfg.ratio(l);
      c.dim = cfg.head_dim;
      c.idx_dim = cfg.index_head_dim;
      if (c.ratio > 1) {
        c.proj_cap = c.ratio + rollback_depth;
        c.proj_kv.assign(static_cast<size_t>(c.proj_cap) * c.dim, 0.0f);
        c.proj_gate.assign(static_cast<size_t>(c.proj_cap) * c.dim, 0.0f);
      }
    }
  }
  return st;
}

}  // namespace dsx
