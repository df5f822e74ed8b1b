// Upload (or synthesis) of the V4.1 weights into the device arena: one pass over every
// tensor in a fixed order, run twice (sizing, then copying).
#include "backend/cuda/device_model.h"

#include <cmath>
#include <cstring>

#include "backend/cuda/step_kernels.h"
#include "model/cost_model.h"
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

  void* place(const void* host, size_t n, int kind = 0, float std = 0.02f, float mean = 0.0f, int center = 120) {
    if (sizing) {
      bytes += aligned(n);
      return nullptr;
    }
    void* d = m.arena_.take(n);
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

QMatrix host_shape(WFormat f, int64_t n, int64_t k, int block, const std::string& name) {
  QMatrix q;
  q.fmt = f;
  q.rows = n;
  q.cols = k;
  q.block = f == WFormat::MXFP4 ? 32 : block;
  q.name = name;
  return q;
}

// One upload / synthesis pass over every tensor, in a fixed order. `hw` may be null
// (synthetic model: shapes from the config, random device data).
void upload_pass(Uploader& u, const ModelConfig& c, const ModelWeights* hw) {
  DeviceModel& m = u.m;
  const int64_t D = c.hidden, M = c.hc_mult, mix = c.hc_mix_dim(), H = c.n_heads, hd = c.head_dim;
  const int64_t ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank, E = c.n_routed_experts, I = c.moe_inter;
  const int B = c.quant_block;
  auto mat = [&](const QMatrix* h, WFormat f, int64_t n, int64_t k, const char* name, bool tile = true) {
    return u.matrix(h ? *h : host_shape(f, n, k, B, name), tile);
  };
  const std::vector<float> none;
  m.embed = mat(hw ? &hw->embed : nullptr, WFormat::BF16, c.vocab_size, D, "embed");
  m.head = mat(hw ? &hw->head : nullptr, WFormat::BF16, c.vocab_size, D, "head");
  m.norm = u.vec(hw ? hw->norm : none, static_cast<size_t>(D));
  m.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    DevLayer& L = m.layers[static_cast<size_t>(l)];
    const LayerWeights* h = hw ? &hw->layers[static_cast<size_t>(l)] : nullptr;
    L.attn_norm = u.vec(h ? h->attn_norm : none, static_cast<size_t>(D));
    L.ffn_norm = u.vec(h ? h->ffn_norm : none, static_cast<size_t>(D));
    L.hc_attn_fn = mat(h ? &h->hc_attn_fn : nullptr, WFormat::F32, mix, M * D, "hc_attn_fn");
    L.hc_ffn_fn = mat(h ? &h->hc_ffn_fn : nullptr, WFormat::F32, mix, M * D, "hc_ffn_fn");
    L.hc_attn_base = u.vec(h ? h->hc_attn_base : none, static_cast<size_t>(mix), 0.0f, 0.1f);
    L.hc_attn_scale = u.vec(h ? h->hc_attn_scale : none, 3);
    L.hc_ffn_base = u.vec(h ? h->hc_ffn_base : none, static_cast<size_t>(mix), 0.0f, 0.1f);
    L.hc_ffn_scale = u.vec(h ? h->hc_ffn_scale : none, 3);
    L.wq_a_kv = u.pair(h ? h->wq_a : host_shape(WFormat::FP8_BLOCK, ql, D, B, "wq_a"),
                       h ? h->wkv : host_shape(WFormat::FP8_BLOCK, hd, D, B, "wkv"), L.wq_a, L.wkv);
    L.q_norm = u.vec(h ? h->q_norm : none, static_cast<size_t>(ql));
    if (c.is_index_source(l)) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      const QMatrix hq = h ? h->wq_b : host_shape(WFormat::FP8_BLOCK, H * hd, ql, B, "wq_b");
      const QMatrix hi = h ? h->idx_wq_b : host_shape(WFormat::FP8_BLOCK, ih * ihd, ql, B, "idx_wq_b");
      L.wq_b_idx = u.pair(hq, hi, L.wq_b, L.idx_wq_b);
    } else {
      L.wq_b = mat(h ? &h->wq_b : nullptr, WFormat::FP8_BLOCK, H * hd, ql, "wq_b");
    }
    L.kv_norm = u.vec(h ? h->kv_norm : none, static_cast<size_t>(hd));
    L.wo_a = mat(h ? &h->wo_a : nullptr, WFormat::FP8_BLOCK, G * ol, H * hd / G, "wo_a");
    L.wo_b = mat(h ? &h->wo_b : nullptr, WFormat::FP8_BLOCK, D, G * ol, "wo_b");
    L.attn_sink = u.vec(h ? h->attn_sink : none, static_cast<size_t>(H), 0.0f, 0.5f);
    if (c.is_kv_source(l)) {
      const QMatrix hk = h ? h->comp_wkv : host_shape(WFormat::BF16, hd, D, B, "comp_wkv");
      if (c.ratio(l) > 1)
        L.comp_kv_gate = u.pair(hk, h ? h->comp_wgate : host_shape(WFormat::BF16, hd, D, B, "comp_wgate"), L.comp_wkv,
                                L.comp_wgate);
      else
        L.comp_wkv = u.matrix(hk);
      L.comp_norm = u.vec(h ? h->comp_norm : none, static_cast<size_t>(hd));
    }
    if (c.is_index_source(l)) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      L.idx_weights_proj = mat(h ? &h->idx_weights_proj : nullptr, WFormat::BF16, ih, D, "weights_proj");
      if (c.is_kv_source(l)) {
        L.idx_wk = mat(h ? &h->idx_wk : nullptr, WFormat::BF16, ihd, hd, "idx_wk");
        L.idx_k_norm = u.vec(h ? h->idx_k_norm : none, static_cast<size_t>(ihd));
      }
    }
    L.gate = mat(h ? &h->gate : nullptr, WFormat::BF16, E, D, "gate");
    L.gate_bias = u.vec(h ? h->gate_bias : none, static_cast<size_t>(E), 0.0f, 0.05f);
    std::vector<const uint8_t*> p1(E), s1(E), p2(E), s2(E), p3(E), s3(E);
    // the routed experts take the tile layout all together or not at all (MoeLayer::tiled)
    const bool etile = moe_experts_tile16(D, I);
    L.moe.tiled = etile && sw::on(sw::Id::TILED);
    for (int64_t e = 0; e < E; ++e) {
      QMatrix d1 = mat(h ? &h->w1[e] : nullptr, WFormat::MXFP4, I, D, "w1", etile);
      QMatrix d3 = mat(h ? &h->w3[e] : nullptr, WFormat::MXFP4, I, D, "w3", etile);
      QMatrix d2 = mat(h ? &h->w2[e] : nullptr, WFormat::MXFP4, D, I, "w2", etile);
      DSX_CHECK(d1.tiled == L.moe.tiled && d3.tiled == L.moe.tiled && d2.tiled == L.moe.tiled,
                "expert ", e, " of layer ", l, ": MXFP4 experts of unexpected format");
      p1[e] = d1.data, s1[e] = d1.scale, p3[e] = d3.data, s3[e] = d3.scale, p2[e] = d2.data, s2[e] = d2.scale;
    }
    L.moe.n_experts = static_cast<int>(E);
    L.moe.hidden = D;
    L.moe.inter = I;
    L.moe.shared_w1 = mat(h ? &h->sw1 : nullptr, WFormat::FP8_BLOCK, I, D, "sw1");
    L.moe.shared_w3 = mat(h ? &h->sw3 : nullptr, WFormat::FP8_BLOCK, I, D, "sw3");
    L.moe.shared_w2 = mat(h ? &h->sw2 : nullptr, WFormat::FP8_BLOCK, D, I, "sw2");
    L.moe.swiglu_limit = c.swiglu_limit;
    L.moe.qblock = B;
    auto ptrs = [&](const std::vector<const uint8_t*>& v) -> const uint8_t* const* {
      return static_cast<const uint8_t* const*>(u.place(v.data(), v.size() * sizeof(void*)));
    };
    L.moe.w1 = ptrs(p1), L.moe.w1_scale = ptrs(s1), L.moe.w3 = ptrs(p3), L.moe.w3_scale = ptrs(s3);
    L.moe.w2 = ptrs(p2), L.moe.w2_scale = ptrs(s2);
    const int ei = c.engram_index(l);
    if (ei >= 0) {
      L.has_engram = true;
      const int64_t ncols = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads, ed = c.engram_head_dim;
      L.engram_wkv = mat(h ? &h->engram_wkv : nullptr, WFormat::FP8_BLOCK, (M + 1) * D, ncols * ed, "engram_wkv");
      L.engram_w = u.vec(h ? h->engram_w : none, static_cast<size_t>(M * D));
      L.engram_rows = c.engram_num_embeddings[static_cast<size_t>(ei)];
      const int64_t table_bytes = L.engram_rows * (ed + ed / 32);
      if (h && table_bytes <= (int64_t{4} << 30)) {
        // small enough: keep the table on the device
        L.engram_table = static_cast<const uint8_t*>(u.place(h->engram_table.data, static_cast<size_t>(L.engram_rows * ed)));
        L.engram_table_scale =
            static_cast<const uint8_t*>(u.place(h->engram_table.scale, static_cast<size_t>(L.engram_rows * ed / 32)));
      } else if (h) {
        L.engram_host_table = h->engram_table.data;
        L.engram_host_scale = h->engram_table.scale;
      }
    }
  }
  const auto mr = make_main_rope(c), cr = make_compress_rope(c);
  m.main_inv_freq = u.vec(mr.inv_freq, mr.inv_freq.size());
  m.comp_inv_freq = u.vec(cr.inv_freq, cr.inv_freq.size());
}

}  // namespace

std::unique_ptr<DeviceModel> DeviceModel::from_weights(const ModelConfig& cfg, const ModelWeights& w, Act act,
                                                       std::vector<int32_t> cmap) {
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
  upload_pass(up, cfg, &w);
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
