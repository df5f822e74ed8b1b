// Upload (or synthesis) of the V4.1 weights into the device arena: one pass over every
// tensor in a fixed order, run twice (sizing, then copying).
#include "backend/cuda/device_model.h"

#include <cmath>
#include <functional>
#include <cstring>

#include "backend/cuda/step_kernels.h"
#include "model/cost_model.h"
#include "model/inventory.h"
#include "model/rope.h"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

// Places host tensors (or random ones) into the arena.
struct Uploader {
  DeviceModel& m;
  bool synthetic = false;
  uint64_t seed = 1;
  uint64_t counter = 0;
  bool sizing = true;  // first pass counts bytes, second pass copies
  size_t bytes = 0;
  // copy pass: bytes placed so far of `total`, reported to `progress` every ~1 %
  size_t placed = 0, total = 0, next_report = 0;
  const std::function<void(double)>* progress = nullptr;

  void* place(const void* host, size_t n, int kind = 0, float std = 0.02f, float mean = 0.0f, int center = 120) {
    if (sizing) {
      bytes += aligned(n);
      return nullptr;
    }
    void* d = m.arena_.take(n);
    placed += aligned(n);
    if (progress && *progress && placed >= next_report && total > 0) {
      (*progress)(static_cast<double>(placed) / static_cast<double>(total));
      next_report = placed + total / 100;
    }
    if (host) {
      DSX_CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    } else {
      fill_random(d, static_cast<int64_t>(n), kind, seed * 1000003ull + (++counter), std, mean, center, 1, nullptr);
    }
    return d;
  }
  // The e8m0 scales of FP8 matrix h (synthetic: codes have std ~64, scales
  // 2^-(6 + log2 sqrt K) give weights of std ~K^-1/2).
  const uint8_t* fp8_scales(const QMatrix& h) {
    const int center = 127 - 6 - static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(h.cols))));
    return static_cast<const uint8_t*>(place(h.scale, static_cast<size_t>(h.scale_bytes()), 2, 0, 0, center));
  }
  // The data of FP8 / MXFP4 matrix h, in the tile layout when `tiled` (random when
  // synthetic: any layout of random codes is the same random matrix).
  const uint8_t* quant_data(const QMatrix& h, bool tiled, int kind) {
    const size_t n = static_cast<size_t>(h.data_bytes());
    if (!tiled || !h.data || sizing) return static_cast<const uint8_t*>(place(h.data, n, kind));
    std::vector<uint8_t> t(n);
    tile16_pack(h.data, h.rows, h.row_bytes(), t.data());
    return static_cast<const uint8_t*>(place(t.data(), n, kind));
  }
  // tile: the matrix may take the tile layout (when it fits and DSX_TILED is not 0).
  QMatrix matrix(const QMatrix& h, bool tile = true) {
    QMatrix d = h;
    const int64_t K = h.cols;
    d.tiled = tile && sw::on(sw::Id::TILED) && tile16_fits(h);
    switch (h.fmt) {
      case WFormat::F32:
        d.data = static_cast<const uint8_t*>(place(h.data, static_cast<size_t>(h.data_bytes()), 4, 0.02f));
        break;
      case WFormat::BF16:
        d.data = static_cast<const uint8_t*>(place(h.data, static_cast<size_t>(h.data_bytes()), 3, 1.0f / std::sqrt(float(K))));
        break;
      case WFormat::FP8_BLOCK:
        d.data = quant_data(h, d.tiled, 0);
        d.scale = fp8_scales(h);
        break;
      case WFormat::MXFP4: {
        const int center = 127 - 1 - static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(K))));
        d.data = quant_data(h, d.tiled, 1);
        d.scale = static_cast<const uint8_t*>(place(h.scale, static_cast<size_t>(h.scale_bytes()), 2, 0, 0, center));
        break;
      }
    }
    if (!sizing) m.weight_bytes += h.bytes();
    return d;
  }
  // Two matrices placed as a pair: FP8 matrices of one width and scale block go codes,
  // codes, scales, scales, and the joint view [n1 + n2, K] is returned when the second
  // follows the first in both (rows of the first a multiple of the scale block); BF16 / F32
  // matrices of one format and width, one after the other; else a view with rows == 0.
  QMatrix pair(const QMatrix& h1, const QMatrix& h2, QMatrix& d1, QMatrix& d2) {
    QMatrix j;
    if (!(h1.fmt == WFormat::FP8_BLOCK && h2.fmt == WFormat::FP8_BLOCK && h1.cols == h2.cols && h1.block == h2.block)) {
      d1 = matrix(h1);
      d2 = matrix(h2);
      const bool plain = h1.fmt == h2.fmt && (h1.fmt == WFormat::BF16 || h1.fmt == WFormat::F32) && h1.cols == h2.cols;
      if (plain && !sizing && d1.data + h1.data_bytes() == d2.data) {
        j = d1;
        j.rows = h1.rows + h2.rows;
        j.name = h1.name + "+" + h2.name;
      }
      return j;
    }
    d1 = h1, d2 = h2;
    // both in the tile layout or neither (the joint view has one layout)
    d1.tiled = d2.tiled = sw::on(sw::Id::TILED) && tile16_fits(h1) && tile16_fits(h2);
    d1.data = quant_data(h1, d1.tiled, 0);
    d2.data = quant_data(h2, d2.tiled, 0);
    d1.scale = fp8_scales(h1);
    d2.scale = fp8_scales(h2);
    if (sizing) return j;
    m.weight_bytes += h1.bytes() + h2.bytes();
    if (h1.rows % h1.block == 0 && d1.data + h1.data_bytes() == d2.data && d1.scale + h1.scale_bytes() == d2.scale) {
      j = d1;
      j.rows = h1.rows + h2.rows;
      j.name = h1.name + "+" + h2.name;
    }
    return j;
  }
  float* vec(const std::vector<float>& v, size_t n, float mean = 1.0f, float std = 0.0f) {
    return static_cast<float*>(place(v.empty() ? nullptr : v.data(), n * 4, 4, std, mean));
  }
};

namespace {

// A matrix of the inventory without data (synthetic model: shapes only).
QMatrix host_shape(const TensorSpec& t, int block) {
  QMatrix q;
  switch (t.storage) {
    case Storage::F32Matrix: q.fmt = WFormat::F32; break;
    case Storage::BF16Matrix: q.fmt = WFormat::BF16; break;
    case Storage::FP8: q.fmt = WFormat::FP8_BLOCK; break;
    case Storage::MXFP4: q.fmt = WFormat::MXFP4; break;
    default: fail("upload: tensor '", t.name, "' (", storage_name(t.storage), ") is not a matrix");
  }
  q.rows = t.rows();
  q.cols = t.cols();
  q.block = q.fmt == WFormat::MXFP4 ? 32 : block;
  q.name = t.name;
  return q;
}

// The inventory tensors of one layer (-1: the global ones) as the upload takes them: each
// once, and every one of them by the end (check).
struct LayerTensors {
  const TensorInventory& inv;
  int layer;
  size_t taken = 0;
  const TensorSpec* find(Role r, int expert = -1) {
    const TensorSpec* t = inv.find(layer, r, expert);
    taken += t != nullptr;
    return t;
  }
  const TensorSpec& at(Role r, int expert = -1) {
    const TensorSpec& t = inv.at(layer, r, expert);
    ++taken;
    return t;
  }
  void check() const {
    DSX_CHECK(taken == inv.count(layer), "upload: layer ", layer, " has ", inv.count(layer) - taken,
              " tensor(s) of the inventory that the device model does not take");
  }
};

// One upload / synthesis pass over every tensor of the inventory, in a fixed order (the
// device order, with the pairs one-token decode reads in one launch side by side). `hw` may
// be null (synthetic model: shapes from the inventory, random device data).
void upload_pass(Uploader& u, const ModelConfig& c, const ModelWeights* hw) {
  using LW = LayerWeights;
  DeviceModel& m = u.m;
  const TensorInventory inv(c);
  const int B = c.quant_block;
  const std::vector<float> none;
  // the host matrix of t: the loaded one, or (synthetic) its shape
  auto host = [&](const TensorSpec& t, const QMatrix* loaded) { return loaded ? *loaded : host_shape(t, B); };
  // a vector: the loaded values, or (synthetic) those of random_init
  auto vec = [&](const TensorSpec& t, const std::vector<float>* loaded) {
    const RandomInit r = random_init(t);
    return u.vec(loaded ? *loaded : none, static_cast<size_t>(t.numel()), r.mean, r.std);
  };
  LayerTensors g{inv, -1};
  m.embed = u.matrix(host(g.at(Role::embed), hw ? &hw->embed : nullptr));
  m.head = u.matrix(host(g.at(Role::head), hw ? &hw->head : nullptr));
  m.norm = vec(g.at(Role::norm), hw ? &hw->norm : nullptr);
  g.check();
  m.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    DevLayer& L = m.layers[static_cast<size_t>(l)];
    const LayerWeights* h = hw ? &hw->layers[static_cast<size_t>(l)] : nullptr;
    LayerTensors t{inv, l};
    auto hmat = [&](const TensorSpec& s, QMatrix LW::*f) { return host(s, h ? &(h->*f) : nullptr); };
    auto mat = [&](Role r, QMatrix LW::*f) { return u.matrix(hmat(t.at(r), f)); };
    auto val = [&](const TensorSpec& s, std::vector<float> LW::*f) { return vec(s, h ? &(h->*f) : nullptr); };
    L.attn_norm = val(t.at(Role::attn_norm), &LW::attn_norm);
    L.ffn_norm = val(t.at(Role::ffn_norm), &LW::ffn_norm);
    L.hc_attn_fn = mat(Role::hc_attn_fn, &LW::hc_attn_fn);
    L.hc_ffn_fn = mat(Role::hc_ffn_fn, &LW::hc_ffn_fn);
    L.hc_attn_base = val(t.at(Role::hc_attn_base), &LW::hc_attn_base);
    L.hc_attn_scale = val(t.at(Role::hc_attn_scale), &LW::hc_attn_scale);
    L.hc_ffn_base = val(t.at(Role::hc_ffn_base), &LW::hc_ffn_base);
    L.hc_ffn_scale = val(t.at(Role::hc_ffn_scale), &LW::hc_ffn_scale);
    L.wq_a_kv = u.pair(hmat(t.at(Role::wq_a), &LW::wq_a), hmat(t.at(Role::wkv), &LW::wkv), L.wq_a, L.wkv);
    L.q_norm = val(t.at(Role::q_norm), &LW::q_norm);
    if (const TensorSpec* iq = t.find(Role::idx_wq_b))  // index sources: wq_b + idx_wq_b
      L.wq_b_idx = u.pair(hmat(t.at(Role::wq_b), &LW::wq_b), hmat(*iq, &LW::idx_wq_b), L.wq_b, L.idx_wq_b);
    else
      L.wq_b = mat(Role::wq_b, &LW::wq_b);
    L.kv_norm = val(t.at(Role::kv_norm), &LW::kv_norm);
    L.wo_a = mat(Role::wo_a, &LW::wo_a);
    L.wo_b = mat(Role::wo_b, &LW::wo_b);
    L.attn_sink = val(t.at(Role::attn_sink), &LW::attn_sink);
    if (const TensorSpec* ck = t.find(Role::comp_wkv)) {  // KV sources: comp_wkv (+ comp_wgate)
      if (const TensorSpec* cg = t.find(Role::comp_wgate))
        L.comp_kv_gate = u.pair(hmat(*ck, &LW::comp_wkv), hmat(*cg, &LW::comp_wgate), L.comp_wkv, L.comp_wgate);
      else
        L.comp_wkv = u.matrix(hmat(*ck, &LW::comp_wkv));
    }
    if (const TensorSpec* s = t.find(Role::comp_norm)) L.comp_norm = val(*s, &LW::comp_norm);
    if (const TensorSpec* s = t.find(Role::idx_weights_proj)) L.idx_weights_proj = u.matrix(hmat(*s, &LW::idx_weights_proj));
    if (const TensorSpec* s = t.find(Role::idx_wk)) L.idx_wk = u.matrix(hmat(*s, &LW::idx_wk));
    if (const TensorSpec* s = t.find(Role::idx_k_norm)) L.idx_k_norm = val(*s, &LW::idx_k_norm);
    L.gate = mat(Role::gate, &LW::gate);
    L.gate_bias = val(t.at(Role::gate_bias), &LW::gate_bias);
    t.find(Role::gate_bias_vl);  // image tokens only: not placed
    const int64_t E = c.n_routed_experts, D = c.hidden, I = c.moe_inter;
    std::vector<const uint8_t*> p1(E), s1(E), p2(E), s2(E), p3(E), s3(E);
    // the routed experts take the tile layout all together or not at all (MoeLayer::tiled)
    const bool etile = moe_experts_tile16(D, I);
    L.moe.tiled = etile && sw::on(sw::Id::TILED);
    for (int64_t e = 0; e < E; ++e) {
      const int x = static_cast<int>(e);
      auto expert = [&](Role r, const std::vector<QMatrix> LW::*f) {
        return u.matrix(host(t.at(r, x), h ? &(h->*f)[static_cast<size_t>(e)] : nullptr), etile);
      };
      QMatrix d1 = expert(Role::expert_w1, &LW::w1);
      QMatrix d3 = expert(Role::expert_w3, &LW::w3);
      QMatrix d2 = expert(Role::expert_w2, &LW::w2);
      DSX_CHECK(d1.tiled == L.moe.tiled && d3.tiled == L.moe.tiled && d2.tiled == L.moe.tiled,
                "expert ", e, " of layer ", l, ": MXFP4 experts of unexpected format");
      p1[e] = d1.data, s1[e] = d1.scale, p3[e] = d3.data, s3[e] = d3.scale, p2[e] = d2.data, s2[e] = d2.scale;
    }
    L.moe.n_experts = static_cast<int>(E);
    L.moe.hidden = D;
    L.moe.inter = I;
    L.moe.shared_w1 = mat(Role::shared_w1, &LW::sw1);
    L.moe.shared_w3 = mat(Role::shared_w3, &LW::sw3);
    L.moe.shared_w2 = mat(Role::shared_w2, &LW::sw2);
    L.moe.swiglu_limit = c.swiglu_limit;
    L.moe.qblock = B;
    auto ptrs = [&](const std::vector<const uint8_t*>& v) -> const uint8_t* const* {
      return static_cast<const uint8_t* const*>(u.place(v.data(), v.size() * sizeof(void*)));
    };
    L.moe.w1 = ptrs(p1), L.moe.w1_scale = ptrs(s1), L.moe.w3 = ptrs(p3), L.moe.w3_scale = ptrs(s3);
    L.moe.w2 = ptrs(p2), L.moe.w2_scale = ptrs(s2);
    if (const TensorSpec* tab = t.find(Role::engram_table)) {
      L.has_engram = true;
      L.engram_wkv = mat(Role::engram_wkv, &LW::engram_wkv);
      // q_weight * k_weight, one vector per stream (the loader multiplies them)
      L.engram_w = val(t.at(Role::engram_q_weight), &LW::engram_w);
      t.at(Role::engram_k_weight);
      L.engram_rows = tab->rows();
      const std::vector<StoredTensor> st = stored_tensors(*tab);  // codes, scales
      if (h && stored_bytes(*tab) <= (int64_t{4} << 30)) {
        // small enough: keep the table on the device
        L.engram_table = static_cast<const uint8_t*>(u.place(h->engram_table.data, static_cast<size_t>(st[0].bytes())));
        L.engram_table_scale = static_cast<const uint8_t*>(u.place(h->engram_table.scale, static_cast<size_t>(st[1].bytes())));
      } else if (h) {
        L.engram_host_table = h->engram_table.data;
        L.engram_host_scale = h->engram_table.scale;
      }
    }
    t.check();
  }
  const auto mr = make_main_rope(c), cr = make_compress_rope(c);
  m.main_inv_freq = u.vec(mr.inv_freq, mr.inv_freq.size());
  m.comp_inv_freq = u.vec(cr.inv_freq, cr.inv_freq.size());
}

}  // namespace

std::unique_ptr<DeviceModel> DeviceModel::from_weights(const ModelConfig& cfg, const ModelWeights& w, Act act,
                                                       std::vector<int32_t> cmap,
                                                       const std::function<void(double)>& progress) {
  auto m = std::make_unique<DeviceModel>();
  m->cfg = cfg;
  m->act = act;
  m->files = w.files;
  m->fingerprint = w.files ? w.files->fingerprint() : "";
  m->cmap = std::move(cmap);
  if (!cfg.engram_layers.empty())
    m->engram = EngramLayout::build(cfg, m->cmap[static_cast<size_t>(cfg.engram_pad_id)]);
  Uploader sz{*m};
  upload_pass(sz, cfg, &w);
  m->arena_.reserve(sz.bytes);
  Uploader up{*m};
  up.sizing = false;
  up.total = sz.bytes;
  up.progress = &progress;
  upload_pass(up, cfg, &w);
  if (progress) progress(1.0);
  m->decode_weight_bytes = v41_decode_weight_bytes(cfg);
  return m;
}

std::unique_ptr<DeviceModel> DeviceModel::synthetic(const ModelConfig& cfg, Act act, uint64_t seed) {
  auto m = std::make_unique<DeviceModel>();
  m->cfg = cfg;
  m->act = act;
  m->fingerprint = "synthetic-" + std::to_string(seed);
  if (!cfg.engram_layers.empty()) {
    m->cmap.assign(static_cast<size_t>(cfg.vocab_size), 0);
    for (int64_t i = 0; i < cfg.vocab_size; ++i) m->cmap[static_cast<size_t>(i)] = static_cast<int32_t>(i % cfg.engram_compressed_vocab);
    m->engram = EngramLayout::build(cfg, m->cmap[static_cast<size_t>(cfg.engram_pad_id)]);
  }
  Uploader sz{*m, true, seed};
  upload_pass(sz, cfg, nullptr);
  m->arena_.reserve(sz.bytes);
  Uploader up{*m, true, seed};
  up.sizing = false;
  upload_pass(up, cfg, nullptr);
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  // Engram tables of the release are ~100 GB each: the synthetic model gathers rows
  // on the host from a small random table (row id modulo its size).
  const int64_t ed = cfg.engram_head_dim;
  m->synthetic_engram.resize(static_cast<size_t>((int64_t{1} << 16) * (ed + ed / 32)));
  uint64_t x = seed;
  for (auto& b : m->synthetic_engram) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<uint8_t>(x >> 56);
  }
  for (int64_t r = 0; r < (int64_t{1} << 16); ++r)
    for (int64_t j = 0; j < ed / 32; ++j) m->synthetic_engram[static_cast<size_t>((int64_t{1} << 16) * ed + r * (ed / 32) + j)] = 120;
  for (int64_t i = 0; i < (int64_t{1} << 16) * ed; ++i)
    if ((m->synthetic_engram[static_cast<size_t>(i)] & 0x7f) == 0x7f) m->synthetic_engram[static_cast<size_t>(i)] = 0x7e;
  for (auto& L : m->layers)
    if (L.has_engram) {
      L.engram_host_table = m->synthetic_engram.data();
      L.engram_host_scale = m->synthetic_engram.data() + (int64_t{1} << 16) * ed;
      L.engram_rows = int64_t{1} << 16;
    }
  m->decode_weight_bytes = v41_decode_weight_bytes(cfg);
  return m;
}

}  // namespace dsx::cuda
