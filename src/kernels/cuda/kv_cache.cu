#include "kernels/cuda/kv_cache.h"

#include <algorithm>
#include <cmath>

#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/pdl_device.cuh"  // (trace marks)
#include "util/error.h"
#include "util/numerics.h"

namespace dsx::cuda {

// ---------------------------------------------------------------------------------
// Exact host conversions
namespace {

bool same_bits(float a, float b) { return f32_bits(a) == f32_bits(b); }

float block_amax(const float* v, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(v[i]));
  return m;
}

bool try_e4m3_codes(const float* v, int n, float s, uint8_t* codes) {
  for (int i = 0; i < n; ++i) {
    const float q = v[i] / s;
    if (!(std::fabs(q) <= 448.0f)) return false;
    const uint8_t c = f32_to_e4m3(q);
    if (!same_bits(e4m3_to_f32(c) * s, v[i])) return false;
    codes[i] = c;
  }
  return true;
}

bool try_e2m1_codes(const float* v, int n, float s, uint8_t* nib) {
  for (int i = 0; i < n; ++i) {
    const float q = v[i] / s;
    if (!(std::fabs(q) <= 6.0f)) return false;
    const uint8_t c = f32_to_e2m1(q);
    if (!same_bits(e2m1_to_f32(c) * s, v[i])) return false;
    nib[i] = c;
  }
  return true;
}

bool is_normal_pow2(float s) {
  const uint32_t u = f32_bits(s);
  return (u & 0x7fffffu) == 0 && ((u >> 23) & 0xffu) >= 1 && ((u >> 23) & 0xffu) <= 254 && !(u >> 31);
}

// Tries the preferred power-of-two scale, then its neighbours.
template <typename Try>
bool pow2_search(float s0, Try&& attempt, float& s_out) {
  for (int k = 0; k <= 40; ++k) {
    for (int sign : {1, -1}) {
      if (k == 0 && sign < 0) continue;
      const float s = std::ldexp(s0, sign * k);
      if (!is_normal_pow2(s)) continue;
      if (attempt(s)) {
        s_out = s;
        return true;
      }
    }
  }
  return false;
}

void put_nibbles(const uint8_t* nib, int n, uint8_t* packed) {
  for (int i = 0; i < n; i += 2) packed[i / 2] = static_cast<uint8_t>((nib[i] & 15u) | ((nib[i + 1] & 15u) << 4));
}

}  // namespace

void pack_fq8_rows(const float* vals, int64_t rows, int dim, uint8_t* codes, uint8_t* scales) {
  DSX_CHECK(dim % 32 == 0, "pack_fq8_rows: dim must be a multiple of 32");
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 32; ++b) {
      const float* v = vals + r * dim + b * 32;
      uint8_t* c = codes + r * dim + b * 32;
      const float s0 = pow2ceil(std::max(block_amax(v, 32), 1e-4f) * (1.0f / 448.0f));
      float s = 0;
      if (!pow2_search(s0, [&](float sc) { return try_e4m3_codes(v, 32, sc, c); }, s))
        fail("pack_fq8_rows: row ", r, " block ", b, " is not an FQ8 output (no e4m3 x 2^k representation)");
      scales[r * (dim / 32) + b] = static_cast<uint8_t>((f32_bits(s) >> 23) & 0xffu);
    }
}

void unpack_fq8_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d)
      out[r * dim + d] = e4m3_to_f32(codes[r * dim + d]) * e8m0_to_f32(scales[r * (dim / 32) + d / 32]);
}

void pack_fq4e8_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales) {
  DSX_CHECK(dim % 32 == 0, "pack_fq4e8_rows: dim must be a multiple of 32");
  uint8_t nib[32];
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 32; ++b) {
      const float* v = vals + r * dim + b * 32;
      const float s0 = pow2ceil(std::max(block_amax(v, 32), 6.0f * std::ldexp(1.0f, -126)) * (1.0f / 6.0f));
      float s = 0;
      if (!pow2_search(s0, [&](float sc) { return try_e2m1_codes(v, 32, sc, nib); }, s))
        fail("pack_fq4e8_rows: row ", r, " block ", b, " is not an FQ4e8 output (no e2m1 x 2^k representation)");
      put_nibbles(nib, 32, packed + (r * dim + b * 32) / 2);
      scales[r * (dim / 32) + b] = static_cast<uint8_t>((f32_bits(s) >> 23) & 0xffu);
    }
}

void unpack_fq4e8_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const uint8_t c = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 15u);
      out[i] = e2m1_to_f32(c) * e8m0_to_f32(scales[r * (dim / 32) + d / 32]);
    }
}

void pack_fq4e4_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales) {
  DSX_CHECK(dim % 16 == 0, "pack_fq4e4_rows: dim must be a multiple of 16");
  static constexpr float kCodes[7] = {6.0f, 4.0f, 3.0f, 2.0f, 1.5f, 1.0f, 0.5f};
  uint8_t nib[16];
  for (int64_t r = 0; r < rows; ++r)
    for (int b = 0; b < dim / 16; ++b) {
      const float* v = vals + r * dim + b * 16;
      const float amax = block_amax(v, 16);
      // the quantizer's own choice on these values, then amax / (a grid value)
      float cand[8];
      int nc = 0;
      cand[nc++] = round_e4m3(std::max(amax, 6.0f * std::ldexp(1.0f, -9)) / 6.0f);
      if (amax > 0)
        for (float c : kCodes) cand[nc++] = amax / c;
      bool ok = false;
      for (int i = 0; i < nc && !ok; ++i) {
        const float s = cand[i];
        if (!(s > 0) || !same_bits(round_e4m3(s), s)) continue;
        if (try_e2m1_codes(v, 16, s, nib)) {
          put_nibbles(nib, 16, packed + (r * dim + b * 16) / 2);
          scales[r * (dim / 16) + b] = f32_to_e4m3(s);
          ok = true;
        }
      }
      if (!ok) fail("pack_fq4e4_rows: row ", r, " block ", b, " is not an FQ4e4 output (no e2m1 x e4m3 representation)");
    }
}

void unpack_fq4e4_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out) {
  for (int64_t r = 0; r < rows; ++r)
    for (int d = 0; d < dim; ++d) {
      const int64_t i = r * dim + d;
      const uint8_t c = (i & 1) ? (packed[i / 2] >> 4) : (packed[i / 2] & 15u);
      out[i] = e2m1_to_f32(c) * e4m3_to_f32(scales[r * (dim / 16) + d / 16]);
    }
}

// ---------------------------------------------------------------------------------
// Geometry and the device cache
int64_t DeviceKVGeometry::device_bytes() const {
  int64_t b = 8;
  for (int l = 0; l < n_layers; ++l) {
    b += static_cast<int64_t>(window_cap()) * Fq8Rows::row_bytes(head_dim);
    if (source_ratio[l] > 0)
      b += row_capacity(l) * (Fq4e4Rows::row_bytes(head_dim) + Fq4e8Rows::row_bytes(idx_dim)) +
           2 * static_cast<int64_t>(proj_cap(l)) * head_dim * 4;
  }
  return b;
}

DeviceKVGeometry DeviceKVGeometry::from_config(const ModelConfig& cfg, int64_t max_context, int rollback_depth) {
  DeviceKVGeometry g;
  g.n_layers = cfg.n_layers;
  g.window = cfg.window;
  g.rollback_depth = rollback_depth;
  g.head_dim = cfg.head_dim;
  g.idx_dim = cfg.index_head_dim;
  g.max_context = max_context;
  g.source_ratio.assign(static_cast<size_t>(cfg.n_layers), 0);
  for (int l = 0; l < cfg.n_layers; ++l)
    if (cfg.is_kv_source(l)) g.source_ratio[static_cast<size_t>(l)] = cfg.ratio(l);
  return g;
}

void DeviceKVCache::allocate(const DeviceKVGeometry& g) {
  DSX_CHECK(g.head_dim % 32 == 0 && g.idx_dim % 32 == 0, "DeviceKVCache: head dims must be multiples of 32");
  DSX_CHECK(static_cast<int>(g.source_ratio.size()) == g.n_layers, "DeviceKVCache: source_ratio size");
  g_ = g;
  layers_.clear();
  layers_.resize(static_cast<size_t>(g.n_layers));
  const int64_t cap = g.window_cap(), hd = g.head_dim, id = g.idx_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    L.win_codes.alloc(static_cast<size_t>(cap * hd));
    L.win_scales.alloc(static_cast<size_t>(cap * hd / 32));
    L.win_codes.zero();
    L.win_scales.zero();
    if (g.source_ratio[static_cast<size_t>(l)] > 0) {
      const int64_t rc = std::max<int64_t>(g.row_capacity(l), 1);
      L.cmp_packed.alloc(static_cast<size_t>(rc * hd / 2));
      L.cmp_scales.alloc(static_cast<size_t>(rc * hd / 16));
      L.key_packed.alloc(static_cast<size_t>(rc * id / 2));
      L.key_scales.alloc(static_cast<size_t>(rc * id / 32));
      for (auto* b : {&L.cmp_packed, &L.cmp_scales, &L.key_packed, &L.key_scales}) b->zero();
      if (g.proj_cap(l) > 0) {
        L.proj_kv.alloc(static_cast<size_t>(g.proj_cap(l)) * hd * 4);
        L.proj_gate.alloc(static_cast<size_t>(g.proj_cap(l)) * hd * 4);
        L.proj_kv.zero();
        L.proj_gate.zero();
      }
    }
  }
  pos_.alloc(8);
  pos_.zero();
}

Fq8Rows DeviceKVCache::window(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  return {L.win_codes.as<uint8_t>(), L.win_scales.as<uint8_t>(), g_.head_dim};
}
Fq4e4Rows DeviceKVCache::compressed(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  DSX_CHECK(g_.source_ratio[static_cast<size_t>(l)] > 0, "layer ", l, " is not a KV source");
  return {L.cmp_packed.as<uint8_t>(), L.cmp_scales.as<uint8_t>(), g_.head_dim};
}
Fq4e8Rows DeviceKVCache::keys(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  DSX_CHECK(g_.source_ratio[static_cast<size_t>(l)] > 0, "layer ", l, " is not a KV source");
  return {L.key_packed.as<uint8_t>(), L.key_scales.as<uint8_t>(), g_.idx_dim};
}
float* DeviceKVCache::proj_kv(int l) const { return layers_.at(static_cast<size_t>(l)).proj_kv.as<float>(); }
float* DeviceKVCache::proj_gate(int l) const { return layers_.at(static_cast<size_t>(l)).proj_gate.as<float>(); }

int64_t DeviceKVCache::position() const {
  int64_t p = 0;
  pos_.download(&p, 8);
  return p;
}

void DeviceKVCache::set_position(int64_t pos, cudaStream_t stream) {
  DSX_CUDA_CHECK(cudaMemcpyAsync(pos_.get(), &pos, 8, cudaMemcpyHostToDevice, stream));
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
}

namespace {
void h2d(void* dst, const void* src, size_t n, cudaStream_t s) {
  if (n) DSX_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, s));
}
void d2h(void* dst, const void* src, size_t n, cudaStream_t s) {
  if (n) DSX_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, s));
}
}  // namespace

void DeviceKVCache::upload(const KVState& st, cudaStream_t stream) {
  const DeviceKVGeometry& g = g_;
  DSX_CHECK(static_cast<int>(st.windows.size()) == g.n_layers && static_cast<int>(st.caches.size()) == g.n_layers,
            "DeviceKVCache::upload: layer count differs");
  DSX_CHECK(st.pos >= 0 && st.pos <= g.max_context, "DeviceKVCache::upload: position ", st.pos,
            " exceeds the device capacity ", g.max_context);
  const int hd = g.head_dim, id = g.idx_dim, cap = g.window_cap();
  for (int l = 0; l < g.n_layers; ++l) {
    const WindowRing& ring = st.windows[static_cast<size_t>(l)];
    DSX_CHECK(ring.cap == cap && ring.dim == hd, "DeviceKVCache::upload: window geometry of layer ", l);
    std::vector<uint8_t> codes(static_cast<size_t>(cap) * hd), scales(static_cast<size_t>(cap) * hd / 32);
    pack_fq8_rows(ring.rows.data(), cap, hd, codes.data(), scales.data());
    const Layer& L = layers_[static_cast<size_t>(l)];
    h2d(L.win_codes.get(), codes.data(), codes.size(), stream);
    h2d(L.win_scales.get(), scales.data(), scales.size(), stream);
    const CompressedCache& c = st.caches[static_cast<size_t>(l)];
    const int r = g.source_ratio[static_cast<size_t>(l)];
    DSX_CHECK(c.ratio == r, "DeviceKVCache::upload: KV-source layout of layer ", l, " differs");
    if (r == 0) {
      DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
      continue;
    }
    DSX_CHECK(c.dim == hd && c.idx_dim == id && c.proj_cap == g.proj_cap(l),
              "DeviceKVCache::upload: cache geometry of layer ", l);
    DSX_CHECK(c.n <= g.row_capacity(l) && static_cast<int64_t>(c.rows.size()) == c.n * hd &&
                  static_cast<int64_t>(c.keys.size()) == c.n * id,
              "DeviceKVCache::upload: compressed rows of layer ", l);
    std::vector<uint8_t> cp(static_cast<size_t>(c.n) * hd / 2), cs(static_cast<size_t>(c.n) * hd / 16);
    std::vector<uint8_t> kp(static_cast<size_t>(c.n) * id / 2), ks(static_cast<size_t>(c.n) * id / 32);
    pack_fq4e4_rows(c.rows.data(), c.n, hd, cp.data(), cs.data());
    pack_fq4e8_rows(c.keys.data(), c.n, id, kp.data(), ks.data());
    h2d(L.cmp_packed.get(), cp.data(), cp.size(), stream);
    h2d(L.cmp_scales.get(), cs.data(), cs.size(), stream);
    h2d(L.key_packed.get(), kp.data(), kp.size(), stream);
    h2d(L.key_scales.get(), ks.data(), ks.size(), stream);
    if (c.proj_cap > 0) {
      h2d(L.proj_kv.get(), c.proj_kv.data(), c.proj_kv.size() * 4, stream);
      h2d(L.proj_gate.get(), c.proj_gate.data(), c.proj_gate.size() * 4, stream);
    }
    DSX_CUDA_CHECK(cudaStreamSynchronize(stream));  // host staging buffers die here
  }
  h2d(pos_.get(), &st.pos, 8, stream);
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void DeviceKVCache::download(KVState& st, cudaStream_t stream) const {
  const DeviceKVGeometry& g = g_;
  DSX_CHECK(static_cast<int>(st.windows.size()) == g.n_layers && static_cast<int>(st.caches.size()) == g.n_layers,
            "DeviceKVCache::download: layer count differs");
  int64_t pos = 0;
  d2h(&pos, pos_.get(), 8, stream);
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int hd = g.head_dim, id = g.idx_dim, cap = g.window_cap();
  for (int l = 0; l < g.n_layers; ++l) {
    WindowRing& ring = st.windows[static_cast<size_t>(l)];
    DSX_CHECK(ring.cap == cap && ring.dim == hd, "DeviceKVCache::download: window geometry of layer ", l);
    const Layer& L = layers_[static_cast<size_t>(l)];
    std::vector<uint8_t> codes(static_cast<size_t>(cap) * hd), scales(static_cast<size_t>(cap) * hd / 32);
    d2h(codes.data(), L.win_codes.get(), codes.size(), stream);
    d2h(scales.data(), L.win_scales.get(), scales.size(), stream);
    CompressedCache& c = st.caches[static_cast<size_t>(l)];
    const int r = g.source_ratio[static_cast<size_t>(l)];
    DSX_CHECK(c.ratio == r, "DeviceKVCache::download: KV-source layout of layer ", l, " differs");
    std::vector<uint8_t> cp, cs, kp, ks;
    int64_t n = 0;
    if (r > 0) {
      DSX_CHECK(c.dim == hd && c.idx_dim == id && c.proj_cap == g.proj_cap(l),
                "DeviceKVCache::download: cache geometry of layer ", l);
      n = pos / r;
      cp.resize(static_cast<size_t>(n) * hd / 2);
      cs.resize(static_cast<size_t>(n) * hd / 16);
      kp.resize(static_cast<size_t>(n) * id / 2);
      ks.resize(static_cast<size_t>(n) * id / 32);
      d2h(cp.data(), L.cmp_packed.get(), cp.size(), stream);
      d2h(cs.data(), L.cmp_scales.get(), cs.size(), stream);
      d2h(kp.data(), L.key_packed.get(), kp.size(), stream);
      d2h(ks.data(), L.key_scales.get(), ks.size(), stream);
      if (c.proj_cap > 0) {
        c.proj_kv.resize(static_cast<size_t>(c.proj_cap) * hd);
        c.proj_gate.resize(static_cast<size_t>(c.proj_cap) * hd);
        d2h(c.proj_kv.data(), L.proj_kv.get(), c.proj_kv.size() * 4, stream);
        d2h(c.proj_gate.data(), L.proj_gate.get(), c.proj_gate.size() * 4, stream);
      }
    }
    DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
    ring.rows.resize(static_cast<size_t>(cap) * hd);
    unpack_fq8_rows(codes.data(), scales.data(), cap, hd, ring.rows.data());
    if (r > 0) {
      c.n = n;
      c.rows.resize(static_cast<size_t>(n) * hd);
      c.keys.resize(static_cast<size_t>(n) * id);
      unpack_fq4e4_rows(cp.data(), cs.data(), n, hd, c.rows.data());
      unpack_fq4e8_rows(kp.data(), ks.data(), n, id, c.keys.data());
    }
  }
  st.pos = pos;
}

// ---------------------------------------------------------------------------------
// Kernels
namespace {

__global__ void window_store_kernel(const uint8_t* __restrict__ src_codes, const uint8_t* __restrict__ src_scales,
                                    uint8_t* __restrict__ dst_codes, uint8_t* __restrict__ dst_scales, int dim,
                                    int T, int first, int cap, const int64_t* __restrict__ d_pos) {
  const int i = first + static_cast<int>(blockIdx.x);  // chunk row
  const int64_t slot = (*d_pos + i) % cap;
  const uint8_t* sc = src_codes + static_cast<int64_t>(i) * dim;
  uint8_t* dc = dst_codes + slot * dim;
  if (dim % 16 == 0) {
    for (int k = threadIdx.x; k < dim / 16; k += blockDim.x)
      reinterpret_cast<uint4*>(dc)[k] = reinterpret_cast<const uint4*>(sc)[k];
  } else {
    for (int k = threadIdx.x; k < dim; k += blockDim.x) dc[k] = sc[k];
  }
  for (int k = threadIdx.x; k < dim / 32; k += blockDim.x)
    dst_scales[slot * (dim / 32) + k] = src_scales[static_cast<int64_t>(i) * (dim / 32) + k];
}

__global__ void proj_store_kernel(const float* __restrict__ kv, const float* __restrict__ gate, int dim, int first,
                                  float* __restrict__ ring_kv, float* __restrict__ ring_gate, int cap,
                                  const int64_t* __restrict__ d_pos) {
  dev::trace_mark(73);
  const int i = first + static_cast<int>(blockIdx.x);
  const int64_t slot = (*d_pos + i) % cap;
  for (int k = threadIdx.x; k < dim; k += blockDim.x) {
    ring_kv[slot * dim + k] = kv[static_cast<int64_t>(i) * dim + k];
    ring_gate[slot * dim + k] = gate[static_cast<int64_t>(i) * dim + k];
  }
}

__global__ void advance_kernel(int64_t* d_pos, int64_t delta) { *d_pos += delta; }

// Block b copies span b (a few hundred bytes to a few KB: byte-wise is enough).
struct ByteCopy {
  const uint8_t* src;
  uint8_t* dst;
  int64_t n;
};
constexpr int kMaxSpans = 16;
struct ByteSpans {
  ByteCopy c[kMaxSpans];
};
__global__ void copy_spans_kernel(ByteSpans s) {
  const ByteCopy c = s.c[blockIdx.x];
  for (int64_t k = threadIdx.x; k < c.n; k += blockDim.x) c.dst[k] = c.src[k];
}

// The listed copies, kMaxSpans per launch.
void copy_spans(const std::vector<ByteCopy>& copies, cudaStream_t stream) {
  for (size_t i0 = 0; i0 < copies.size(); i0 += kMaxSpans) {
    ByteSpans s{};
    const size_t m = std::min<size_t>(kMaxSpans, copies.size() - i0);
    for (size_t i = 0; i < m; ++i) s.c[i] = copies[i0 + i];
    copy_spans_kernel<<<static_cast<unsigned>(m), 256, 0, stream>>>(s);
    check_launch("copy_spans");
  }
}

}  // namespace

std::vector<std::pair<uint8_t*, int64_t>> DeviceKVCache::step_slots(int l1, int64_t p) const {
  DSX_CHECK(l1 >= 0 && l1 <= g_.n_layers && p >= 0, "DeviceKVCache: bad step slots (layers ", l1, ", position ", p, ")");
  std::vector<std::pair<uint8_t*, int64_t>> v;
  const int hd = g_.head_dim;
  const int64_t w = p % g_.window_cap();
  for (int l = 0; l < l1; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    v.emplace_back(L.win_codes.as<uint8_t>() + w * hd, hd);
    v.emplace_back(L.win_scales.as<uint8_t>() + w * (hd / 32), hd / 32);
    if (const int pc = g_.proj_cap(l); pc > 0) {
      const int64_t s = (p % pc) * hd * 4;
      v.emplace_back(L.proj_kv.as<uint8_t>() + s, hd * 4);
      v.emplace_back(L.proj_gate.as<uint8_t>() + s, hd * 4);
    }
  }
  return v;
}

int64_t DeviceKVCache::slot_stash_bytes(int l1) const {
  int64_t n = 0;
  for (const auto& [ptr, bytes] : step_slots(l1, 0)) n += bytes;
  return n;
}

void DeviceKVCache::stash_slots(int l1, int64_t p, uint8_t* stash, cudaStream_t stream) const {
  std::vector<ByteCopy> c;
  for (const auto& [ring, bytes] : step_slots(l1, p)) c.push_back({ring, stash, bytes}), stash += bytes;
  copy_spans(c, stream);
}

void DeviceKVCache::unstash_slots(int l1, int64_t p, const uint8_t* stash, cudaStream_t stream) {
  std::vector<ByteCopy> c;
  for (const auto& [ring, bytes] : step_slots(l1, p)) c.push_back({stash, ring, bytes}), stash += bytes;
  copy_spans(c, stream);
}

void advance_position(int64_t* d_pos, int64_t delta, cudaStream_t stream) {
  advance_kernel<<<1, 1, 0, stream>>>(d_pos, delta);
  check_launch("advance_position");
}

void window_store(const Fq8Rows& chunk, int T, const Fq8Rows& ring, int cap, const int64_t* d_pos,
                  cudaStream_t stream) {
  if (T <= 0) return;
  DSX_CHECK(chunk.dim == ring.dim && chunk.dim % 32 == 0, "window_store: row widths differ");
  const int n = std::min(T, cap);
  window_store_kernel<<<n, 128, 0, stream>>>(chunk.codes, chunk.scales, ring.codes, ring.scales, chunk.dim, T, T - n,
                                              cap, d_pos);
  check_launch("window_store");
}

void proj_store(const float* kv, const float* gate, int T, int dim, float* ring_kv, float* ring_gate, int proj_cap,
                const int64_t* d_pos, cudaStream_t stream) {
  if (T <= 0 || proj_cap <= 0) return;
  const int n = std::min(T, proj_cap);
  proj_store_kernel<<<n, 256, 0, stream>>>(kv, gate, dim, T - n, ring_kv, ring_gate, proj_cap, d_pos);
  check_launch("proj_store");
}

}  // namespace dsx::cuda
