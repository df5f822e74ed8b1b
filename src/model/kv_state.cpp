#include "model/kv_state.h"

#include <algorithm>
#include <cstring>

#include "model/config.h"
#include "model/kv_formats.h"
#include "util/error.h"
#include "util/snapshot_io.h"

namespace dsx {

// ---- geometry --------------------------------------------------------------------
int64_t KVGeometry::fixed_bytes() const {
  int64_t b = 8;
  for (int l = 0; l < n_layers; ++l) b += window_cap() * fq8_row_bytes(head_dim) + 2 * int64_t{proj_cap(l)} * head_dim * 4;
  return b;
}

double KVGeometry::bytes_per_token() const {
  double b = 4;  // the token id
  for (int l = 0; l < n_layers; ++l)
    if (const int r = source_ratio[static_cast<size_t>(l)]; r > 0)
      b += static_cast<double>(fq4e4_row_bytes(head_dim) + fq4e8_row_bytes(idx_dim)) / r;
  return b;
}

bool KVGeometry::operator==(const KVGeometry& o) const {
  return n_layers == o.n_layers && window == o.window && rollback_depth == o.rollback_depth &&
         head_dim == o.head_dim && idx_dim == o.idx_dim && source_ratio == o.source_ratio;
}

KVGeometry KVGeometry::of(const ModelConfig& cfg, int rollback_depth) {
  KVGeometry g;
  g.n_layers = cfg.n_layers;
  g.window = cfg.window;
  g.rollback_depth = rollback_depth;
  g.head_dim = cfg.head_dim;
  g.idx_dim = cfg.index_head_dim;
  g.source_ratio.assign(static_cast<size_t>(cfg.n_layers), 0);
  for (int l = 0; l < cfg.n_layers; ++l)
    if (cfg.is_kv_source(l)) g.source_ratio[static_cast<size_t>(l)] = cfg.ratio(l);
  return g;
}

const char* StateSection::name() const {
  switch (tag) {
    case SectionTag::kTokens: return "token history";
    case SectionTag::kWindowCodes: return "window codes";
    case SectionTag::kWindowScales: return "window scales";
    case SectionTag::kCompPacked: return "compressed rows";
    case SectionTag::kCompScales: return "compressed row scales";
    case SectionTag::kKeyPacked: return "index keys";
    case SectionTag::kKeyScales: return "index key scales";
    case SectionTag::kProjKv: return "compressor kv ring";
    case SectionTag::kProjGate: return "compressor gate ring";
    case SectionTag::kF32: return "f32 state vector";
  }
  return "?";
}

std::vector<StateSection> state_sections(const KVGeometry& g, int64_t pos) {
  std::vector<StateSection> s;
  const int64_t cap = g.window_cap(), hd = g.head_dim, id = g.idx_dim;
  s.push_back({SectionTag::kTokens, kNoLayer, pos * 4});
  for (int l = 0; l < g.n_layers; ++l) {
    const auto L = static_cast<uint32_t>(l);
    s.push_back({SectionTag::kWindowCodes, L, cap * hd});
    s.push_back({SectionTag::kWindowScales, L, cap * hd / 32});
    const int r = g.source_ratio[static_cast<size_t>(l)];
    if (r == 0) continue;
    const int64_t n = pos / r;
    s.push_back({SectionTag::kCompPacked, L, n * hd / 2});
    s.push_back({SectionTag::kCompScales, L, n * hd / 16});
    s.push_back({SectionTag::kKeyPacked, L, n * id / 2});
    s.push_back({SectionTag::kKeyScales, L, n * id / 32});
    if (const int pc = g.proj_cap(l); pc > 0) {
      s.push_back({SectionTag::kProjKv, L, int64_t{pc} * hd * 4});
      s.push_back({SectionTag::kProjGate, L, int64_t{pc} * hd * 4});
    }
  }
  return s;
}

// ---- the CPU state ---------------------------------------------------------------------
KVGeometry geometry_of(const KVState& st) {
  KVGeometry g;
  g.n_layers = static_cast<int>(st.windows.size());
  g.rollback_depth = st.rollback_depth;
  g.window = st.windows.empty() ? 0 : st.windows[0].cap - st.rollback_depth;
  g.head_dim = st.windows.empty() ? 0 : st.windows[0].dim;
  g.source_ratio.assign(st.windows.size(), 0);
  for (size_t l = 0; l < st.caches.size(); ++l) {
    g.source_ratio[l] = st.caches[l].ratio;
    if (st.caches[l].ratio > 0) g.idx_dim = st.caches[l].idx_dim;
  }
  return g;
}

namespace {

// Writes / reads one section in the compact form, through a bounded staging buffer.
constexpr int64_t kStageRows = 4096;

template <typename Pack>
void put_rows(SnapshotWriter& w, SectionTag tag, uint32_t layer, const float* vals, int64_t rows, int dim,
              int64_t code_row, int64_t scale_row, bool codes, Pack pack) {
  std::vector<uint8_t> c(static_cast<size_t>(std::min(rows, kStageRows) * code_row));
  std::vector<uint8_t> s(static_cast<size_t>(std::min(rows, kStageRows) * scale_row));
  w.begin(static_cast<uint32_t>(tag), layer, static_cast<uint64_t>(rows * (codes ? code_row : scale_row)));
  for (int64_t r0 = 0; r0 < rows; r0 += kStageRows) {
    const int64_t n = std::min(kStageRows, rows - r0);
    pack(vals + r0 * dim, n, dim, c.data(), s.data());
    if (codes)
      w.write(c.data(), static_cast<size_t>(n * code_row));
    else
      w.write(s.data(), static_cast<size_t>(n * scale_row));
  }
}

template <typename Unpack>
void get_rows(SnapshotReader& rd, SectionTag code_tag, SectionTag scale_tag, uint32_t layer, float* out, int64_t rows,
              int dim, int64_t code_row, int64_t scale_row, Unpack unpack) {
  std::vector<uint8_t> c(static_cast<size_t>(rows * code_row)), s(static_cast<size_t>(rows * scale_row));
  rd.begin(static_cast<uint32_t>(code_tag), layer, c.size(), StateSection{code_tag, layer, 0}.name());
  rd.read(c.data(), c.size());
  rd.begin(static_cast<uint32_t>(scale_tag), layer, s.size(), StateSection{scale_tag, layer, 0}.name());
  rd.read(s.data(), s.size());
  unpack(c.data(), s.data(), rows, dim, out);
}

void put_f32(SnapshotWriter& w, SectionTag tag, uint32_t layer, const std::vector<float>& v) {
  w.begin(static_cast<uint32_t>(tag), layer, v.size() * 4);
  w.write(v.data(), v.size() * 4);
}

void get_f32(SnapshotReader& r, SectionTag tag, uint32_t layer, std::vector<float>& v) {
  r.begin(static_cast<uint32_t>(tag), layer, v.size() * 4, StateSection{tag, layer, 0}.name());
  r.read(v.data(), v.size() * 4);
}

}  // namespace

void KVState::save(SnapshotWriter& w) const {
  w.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, tokens.size() * 4);
  w.write(tokens.data(), tokens.size() * 4);
  for (size_t l = 0; l < windows.size(); ++l) {
    const auto L = static_cast<uint32_t>(l);
    const WindowRing& ring = windows[l];
    const CompressedCache& c = caches[l];
    if (!compact) {  // V4: the f32 vectors as they are
      put_f32(w, SectionTag::kF32, L, ring.rows);
      for (const auto* v : {&c.rows, &c.keys, &c.proj_kv, &c.proj_gate}) put_f32(w, SectionTag::kF32, L, *v);
      continue;
    }
    const int hd = ring.dim;
    put_rows(w, SectionTag::kWindowCodes, L, ring.rows.data(), ring.cap, hd, hd, hd / 32, true, pack_fq8_rows);
    put_rows(w, SectionTag::kWindowScales, L, ring.rows.data(), ring.cap, hd, hd, hd / 32, false, pack_fq8_rows);
    if (c.ratio == 0) continue;
    put_rows(w, SectionTag::kCompPacked, L, c.rows.data(), c.n, hd, hd / 2, hd / 16, true, pack_fq4e4_rows);
    put_rows(w, SectionTag::kCompScales, L, c.rows.data(), c.n, hd, hd / 2, hd / 16, false, pack_fq4e4_rows);
    const int id = c.idx_dim;
    put_rows(w, SectionTag::kKeyPacked, L, c.keys.data(), c.n, id, id / 2, id / 32, true, pack_fq4e8_rows);
    put_rows(w, SectionTag::kKeyScales, L, c.keys.data(), c.n, id, id / 2, id / 32, false, pack_fq4e8_rows);
    if (c.proj_cap > 0) {
      put_f32(w, SectionTag::kProjKv, L, c.proj_kv);
      put_f32(w, SectionTag::kProjGate, L, c.proj_gate);
    }
  }
}

void KVState::restore(SnapshotReader& r, int64_t new_pos) {
  if (new_pos < 0) r.corrupt(cat("position ", new_pos));
  KVState s = *this;  // geometry template
  s.pos = new_pos;
  s.tokens.resize(static_cast<size_t>(new_pos));
  r.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, s.tokens.size() * 4, "token history");
  r.read(s.tokens.data(), s.tokens.size() * 4);
  for (size_t l = 0; l < s.windows.size(); ++l) {
    const auto L = static_cast<uint32_t>(l);
    WindowRing& ring = s.windows[l];
    CompressedCache& c = s.caches[l];
    if (c.ratio > 0) {
      c.n = new_pos / c.ratio;
      c.rows.resize(static_cast<size_t>(c.n) * c.dim);
      if (compact || c.idx_dim > 0) c.keys.resize(static_cast<size_t>(c.n) * c.idx_dim);
    }
    if (!compact) {
      get_f32(r, SectionTag::kF32, L, ring.rows);
      for (auto* v : {&c.rows, &c.keys, &c.proj_kv, &c.proj_gate}) get_f32(r, SectionTag::kF32, L, *v);
      continue;
    }
    const int hd = ring.dim;
    get_rows(r, SectionTag::kWindowCodes, SectionTag::kWindowScales, L, ring.rows.data(), ring.cap, hd, hd, hd / 32,
             unpack_fq8_rows);
    if (c.ratio == 0) continue;
    get_rows(r, SectionTag::kCompPacked, SectionTag::kCompScales, L, c.rows.data(), c.n, hd, hd / 2, hd / 16,
             unpack_fq4e4_rows);
    const int id = c.idx_dim;
    get_rows(r, SectionTag::kKeyPacked, SectionTag::kKeyScales, L, c.keys.data(), c.n, id, id / 2, id / 32,
             unpack_fq4e8_rows);
    if (c.proj_cap > 0) {
      get_f32(r, SectionTag::kProjKv, L, c.proj_kv);
      get_f32(r, SectionTag::kProjGate, L, c.proj_gate);
    }
  }
  r.finish();
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

void KVState::reset() {
  pos = 0;
  tokens.clear();
  for (auto& c : caches) {
    c.n = 0;
    c.rows.clear();
    c.keys.clear();
  }
}

int64_t KVState::bytes() const {
  int64_t b = static_cast<int64_t>(tokens.size()) * 4;
  for (const auto& r : windows) b += static_cast<int64_t>(r.rows.size()) * 4;
  for (const auto& c : caches)
    b += static_cast<int64_t>(c.rows.size() + c.keys.size() + c.proj_kv.size() + c.proj_gate.size()) * 4;
  return b;
}

int64_t KVState::Fixed::bytes() const {
  int64_t b = 0;
  for (const auto& w : windows) b += static_cast<int64_t>(w.rows.size()) * 4;
  for (const auto& v : proj_kv) b += static_cast<int64_t>(v.size()) * 8;
  return b;
}

KVState::Fixed KVState::fixed() const {
  Fixed f;
  f.pos = pos;
  f.windows = windows;
  for (const auto& c : caches) {
    f.proj_kv.push_back(c.proj_kv);
    f.proj_gate.push_back(c.proj_gate);
  }
  return f;
}

void KVState::restore_fixed(const Fixed& f) {
  DSX_CHECK(f.pos <= pos && f.windows.size() == windows.size(), "checkpoint at ", f.pos, " does not fit the state at ",
            pos);
  windows = f.windows;
  for (size_t l = 0; l < caches.size(); ++l) {
    CompressedCache& c = caches[l];
    c.proj_kv = f.proj_kv[l];
    c.proj_gate = f.proj_gate[l];
    if (c.ratio == 0) continue;
    c.n = f.pos / c.ratio;
    c.rows.resize(static_cast<size_t>(c.n) * c.dim);
    c.keys.resize(static_cast<size_t>(c.n) * c.idx_dim);
  }
  pos = f.pos;
  tokens.resize(static_cast<size_t>(f.pos));
}

KVState make_kv_state(const ModelConfig& cfg, int rollback_depth) {
  DSX_CHECK(rollback_depth >= 0, "rollback depth must be >= 0");
  KVState st;
  st.rollback_depth = rollback_depth;
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
