#include "backend/cuda/kv_cache.h"

#include <algorithm>

#include "util/error.h"
#include "util/snapshot_io.h"

namespace dsx::cuda {

namespace {
int64_t al(int64_t b) { return (b + 255) & ~int64_t{255}; }
}  // namespace

int64_t device_state_bytes(const KVGeometry& g, int64_t max_context) {
  int64_t b = al(8);
  const int64_t cap = g.window_cap(), hd = g.head_dim, id = g.idx_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    b += al(cap * hd) + al(cap * hd / 32);
    const int r = g.source_ratio[static_cast<size_t>(l)];
    if (r == 0) continue;
    const int64_t rc = std::max<int64_t>(1, max_context / r);
    b += al(rc * hd / 2) + al(rc * hd / 16) + al(rc * id / 2) + al(rc * id / 32);
    b += 2 * al(int64_t{g.proj_cap(l)} * hd * 4);
  }
  return b;
}

DeviceKVCache::DeviceKVCache(const KVGeometry& g, int64_t max_context) : g_(g), max_ctx_(max_context) {
  DSX_CHECK(g.head_dim % 32 == 0 && g.idx_dim % 32 == 0, "DeviceKVCache: head dims must be multiples of 32");
  DSX_CHECK(static_cast<int>(g.source_ratio.size()) == g.n_layers, "DeviceKVCache: source_ratio size");
  buf_.alloc(static_cast<size_t>(device_state_bytes(g, max_context)));
  buf_.zero();
  uint8_t* p = buf_.as<uint8_t>();
  auto take = [&](int64_t n) {
    uint8_t* q = p;
    p += al(n);
    return q;
  };
  pos_ = reinterpret_cast<int64_t*>(take(8));
  layers_.resize(static_cast<size_t>(g.n_layers));
  const int64_t cap = g.window_cap(), hd = g.head_dim, id = g.idx_dim;
  for (int l = 0; l < g.n_layers; ++l) {
    Layer& L = layers_[static_cast<size_t>(l)];
    L.win_codes = take(cap * hd);
    L.win_scales = take(cap * hd / 32);
    const int r = g.source_ratio[static_cast<size_t>(l)];
    if (r == 0) continue;
    const int64_t rc = std::max<int64_t>(1, max_context / r);
    L.cmp_packed = take(rc * hd / 2);
    L.cmp_scales = take(rc * hd / 16);
    L.key_packed = take(rc * id / 2);
    L.key_scales = take(rc * id / 32);
    L.proj_kv = reinterpret_cast<float*>(take(int64_t{g.proj_cap(l)} * hd * 4));
    L.proj_gate = reinterpret_cast<float*>(take(int64_t{g.proj_cap(l)} * hd * 4));
  }
}

int64_t DeviceKVCache::row_capacity(int l) const {
  const int r = g_.source_ratio[static_cast<size_t>(l)];
  return r > 0 ? max_ctx_ / r : 0;
}

Fq8Rows DeviceKVCache::window(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  return {L.win_codes, L.win_scales, g_.head_dim};
}
Fq4e4Rows DeviceKVCache::compressed(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  DSX_CHECK(g_.source_ratio[static_cast<size_t>(l)] > 0, "layer ", l, " is not a KV source");
  return {L.cmp_packed, L.cmp_scales, g_.head_dim};
}
Fq4e8Rows DeviceKVCache::keys(int l) const {
  const Layer& L = layers_.at(static_cast<size_t>(l));
  DSX_CHECK(g_.source_ratio[static_cast<size_t>(l)] > 0, "layer ", l, " is not a KV source");
  return {L.key_packed, L.key_scales, g_.idx_dim};
}
float* DeviceKVCache::proj_kv(int l) const { return layers_.at(static_cast<size_t>(l)).proj_kv; }
float* DeviceKVCache::proj_gate(int l) const { return layers_.at(static_cast<size_t>(l)).proj_gate; }

void DeviceKVCache::set_position(int64_t pos, cudaStream_t stream) {
  DSX_CUDA_CHECK(cudaMemcpyAsync(pos_, &pos, 8, cudaMemcpyHostToDevice, stream));
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<std::pair<uint8_t*, int64_t>> DeviceKVCache::section_spans(int64_t pos) const {
  std::vector<std::pair<uint8_t*, int64_t>> v;
  const std::vector<StateSection> secs = state_sections(g_, pos);
  for (const StateSection& s : secs) {
    if (s.tag == SectionTag::kTokens) continue;
    const Layer& L = layers_[s.layer];
    uint8_t* p = nullptr;
    switch (s.tag) {
      case SectionTag::kWindowCodes: p = L.win_codes; break;
      case SectionTag::kWindowScales: p = L.win_scales; break;
      case SectionTag::kCompPacked: p = L.cmp_packed; break;
      case SectionTag::kCompScales: p = L.cmp_scales; break;
      case SectionTag::kKeyPacked: p = L.key_packed; break;
      case SectionTag::kKeyScales: p = L.key_scales; break;
      case SectionTag::kProjKv: p = reinterpret_cast<uint8_t*>(L.proj_kv); break;
      case SectionTag::kProjGate: p = reinterpret_cast<uint8_t*>(L.proj_gate); break;
      default: fail("DeviceKVCache: unexpected state section ", s.name());
    }
    v.emplace_back(p, s.bytes);
  }
  return v;
}

void DeviceKVCache::save(SnapshotWriter& w, int64_t pos, uint8_t* stage, size_t stage_bytes,
                         cudaStream_t stream) const {
  DSX_CHECK(pos <= max_ctx_, "DeviceKVCache::save: position beyond the capacity");
  const std::vector<StateSection> secs = state_sections(g_, pos);
  const auto spans = section_spans(pos);
  for (size_t i = 0; i < spans.size(); ++i) {
    const StateSection& s = secs[i + 1];  // (secs[0]: the token history, written by the caller)
    w.begin(static_cast<uint32_t>(s.tag), s.layer, static_cast<uint64_t>(s.bytes));
    for (int64_t off = 0; off < s.bytes;) {
      const int64_t n = std::min<int64_t>(static_cast<int64_t>(stage_bytes), s.bytes - off);
      DSX_CUDA_CHECK(cudaMemcpyAsync(stage, spans[i].first + off, static_cast<size_t>(n), cudaMemcpyDeviceToHost, stream));
      DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
      w.write(stage, static_cast<size_t>(n));
      off += n;
    }
  }
}

void DeviceKVCache::restore(SnapshotReader& r, int64_t pos, uint8_t* stage, size_t stage_bytes, cudaStream_t stream) {
  DSX_CHECK(pos <= max_ctx_, "snapshot of ", pos, " tokens exceeds this session's capacity of ", max_ctx_);
  const std::vector<StateSection> secs = state_sections(g_, pos);
  const auto spans = section_spans(pos);
  // two halves of the staging buffer: one is read into while the other is copied out
  const size_t half = stage_bytes / 2;
  int k = 0;
  cudaEvent_t done[2];
  for (auto& e : done) DSX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  bool used[2] = {false, false};
  try {
    for (size_t i = 0; i < spans.size(); ++i) {
      const StateSection& s = secs[i + 1];
      r.begin(static_cast<uint32_t>(s.tag), s.layer, static_cast<uint64_t>(s.bytes), s.name());
      for (int64_t off = 0; off < s.bytes;) {
        const int64_t n = std::min<int64_t>(static_cast<int64_t>(half), s.bytes - off);
        uint8_t* h = stage + k * half;
        if (used[k]) DSX_CUDA_CHECK(cudaEventSynchronize(done[k]));
        r.read(h, static_cast<size_t>(n));
        DSX_CUDA_CHECK(cudaMemcpyAsync(spans[i].first + off, h, static_cast<size_t>(n), cudaMemcpyHostToDevice, stream));
        DSX_CUDA_CHECK(cudaEventRecord(done[k], stream));
        used[k] = true;
        k ^= 1;
        off += n;
      }
    }
    DSX_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    cudaStreamSynchronize(stream);
    for (auto& e : done) cudaEventDestroy(e);
    throw;
  }
  for (auto& e : done) cudaEventDestroy(e);
  set_position(pos, stream);
}

std::vector<std::pair<uint8_t*, int64_t>> DeviceKVCache::fixed_spans() const {
  std::vector<std::pair<uint8_t*, int64_t>> v;
  const int64_t cap = g_.window_cap(), hd = g_.head_dim;
  for (int l = 0; l < g_.n_layers; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    v.emplace_back(L.win_codes, cap * hd);
    v.emplace_back(L.win_scales, cap * hd / 32);
    if (const int pc = g_.proj_cap(l); pc > 0) {
      v.emplace_back(reinterpret_cast<uint8_t*>(L.proj_kv), int64_t{pc} * hd * 4);
      v.emplace_back(reinterpret_cast<uint8_t*>(L.proj_gate), int64_t{pc} * hd * 4);
    }
  }
  return v;
}

int64_t DeviceKVCache::fixed_bytes() const {
  int64_t n = 0;
  for (const auto& [p, b] : fixed_spans()) n += b;
  return n;
}

std::vector<std::pair<uint8_t*, int64_t>> DeviceKVCache::step_slots(int l1, int64_t p) const {
  DSX_CHECK(l1 >= 0 && l1 <= g_.n_layers && p >= 0, "DeviceKVCache: bad step slots (layers ", l1, ", position ", p, ")");
  std::vector<std::pair<uint8_t*, int64_t>> v;
  const int hd = g_.head_dim;
  const int64_t w = p % g_.window_cap();
  for (int l = 0; l < l1; ++l) {
    const Layer& L = layers_[static_cast<size_t>(l)];
    v.emplace_back(L.win_codes + w * hd, hd);
    v.emplace_back(L.win_scales + w * (hd / 32), hd / 32);
    if (const int pc = g_.proj_cap(l); pc > 0) {
      const int64_t s = (p % pc) * hd;
      v.emplace_back(reinterpret_cast<uint8_t*>(L.proj_kv + s), hd * 4);
      v.emplace_back(reinterpret_cast<uint8_t*>(L.proj_gate + s), hd * 4);
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

}  // namespace dsx::cuda
