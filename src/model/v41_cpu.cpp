// DeepSeek V4.1 forward on the CPU (f32 + the model's quantization points).
// Section numbers refer to spec model-v41.md.
#include "model/v41_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "kernels/cpu/linear.h"
#include "kernels/cpu/ops.h"
#include "kernels/cpu/quant.h"
#include "util/error.h"
#include "util/threadpool.h"

namespace dsx {

using cpu::matmul;
using cpu::rmsnorm;
using Vec = std::vector<float>;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// QA8 of every row of x [rows, k] (a copy: the caller keeps the unquantized input).
Vec qa8_rows(const Vec& x, int64_t k, int block) {
  Vec q = x;
  const int64_t rows = static_cast<int64_t>(x.size()) / k;
  for (int64_t r = 0; r < rows; ++r) cpu::qa8_inplace(q.data() + r * k, k, block);
  return q;
}

// Lin8 / Lin4: activation quantization then the product with the stored weight.
Vec linear_q(const Vec& x, int64_t T, const QMatrix& W, int block) {
  Vec xq = qa8_rows(x, W.cols, block);
  Vec y(static_cast<size_t>(T * W.rows));
  matmul(xq.data(), T, W, y.data());
  return y;
}

// Plain product, no activation quantization (LinBF / LinF32 in f32).
Vec linear(const Vec& x, int64_t T, const QMatrix& W) {
  Vec y(static_cast<size_t>(T * W.rows));
  matmul(x.data(), T, W, y.data());
  return y;
}

void rmsnorm_rows(Vec& x, int64_t n, const Vec& w, float eps) {
  const int64_t rows = static_cast<int64_t>(x.size()) / n;
  for (int64_t r = 0; r < rows; ++r) rmsnorm(x.data() + r * n, w.data(), n, eps, x.data() + r * n);
}

// The reference skips a block fake-quantizer when the width is not divisible.
void fq8_vec(float* x, int64_t n) {
  if (n % 32 == 0) cpu::qa8_inplace(x, n, 32);
}
void fq4e8_vec(float* x, int64_t n) {
  if (n % 32 == 0) cpu::fq4_e8_inplace(x, n, 32);
}
void fq4e4_vec(float* x, int64_t n) {
  if (n % 16 == 0) cpu::fq4_e4_inplace(x, n, 16);
}

// Indices of the k largest finite scores, ties broken by the lower index;
// returned in ascending index order.
std::vector<int32_t> topk_finite(const float* s, int64_t n, int64_t k) {
  std::vector<int32_t> idx;
  for (int64_t j = 0; j < n; ++j)
    if (s[j] > kNegInf) idx.push_back(static_cast<int32_t>(j));
  auto better = [&](int32_t a, int32_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
  if (static_cast<int64_t>(idx.size()) > k) {
    std::nth_element(idx.begin(), idx.begin() + k, idx.end(), better);
    idx.resize(static_cast<size_t>(k));
  }
  std::sort(idx.begin(), idx.end());
  return idx;
}

}  // namespace

struct V41Cpu::Step {
  int64_t T = 0, p0 = 0;
  const int32_t* ids = nullptr;
  ForwardDebug* dbg = nullptr;
  // RoPE angles of the chunk's positions, [T, n_pairs]
  Vec cos_main, sin_main, cos_comp, sin_comp;
  // Engram row ids [T, n_engram_layers, n_cols]
  std::vector<int64_t> engram_ids;
  // Published by index sources for the rest of the step (spec §3.4.6).
  bool have_sel = false;
  int sel_source = -1;
  std::vector<std::vector<int32_t>> sel;
  // Candidate blocks published by the candidate source.
  bool have_cand = false;
  int64_t cand_cols = 0;
  std::vector<uint8_t> cand;

  const float* cos(bool comp, int64_t t, int np) const { return (comp ? cos_comp : cos_main).data() + t * np; }
  const float* sin(bool comp, int64_t t, int np) const { return (comp ? sin_comp : sin_main).data() + t * np; }
};

V41Cpu::V41Cpu(ModelConfig cfg, ModelWeights weights, std::vector<int32_t> engram_token_map)
    : cfg_(std::move(cfg)), w_(std::move(weights)), cmap_(std::move(engram_token_map)) {
  if (!cfg_.engram_layers.empty()) {
    if (static_cast<int64_t>(cmap_.size()) < cfg_.vocab_size)
      fail("engram token map covers ", cmap_.size(), " ids but the vocabulary has ", cfg_.vocab_size);
    if (cfg_.engram_pad_id < 0 || cfg_.engram_pad_id >= static_cast<int>(cmap_.size()))
      fail("engram pad id ", cfg_.engram_pad_id, " outside the token map");
    engram_ = EngramLayout::build(cfg_, cmap_[static_cast<size_t>(cfg_.engram_pad_id)]);
  }
  main_rope_ = make_main_rope(cfg_);
  compress_rope_ = make_compress_rope(cfg_);
}

KVState V41Cpu::new_state(int rollback_depth) const {
  return make_kv_state(cfg_, rollback_depth, w_.files ? w_.files->fingerprint() : "");
}

// ---------------------------------------------------------------------------
// §3.2 Engram: gated n-gram memory added to every stream.
void V41Cpu::engram(int layer, Step& s, Vec& X) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int li = cfg_.engram_index(layer);
  const int64_t T = s.T, D = cfg_.hidden, M = cfg_.hc_mult, ed = cfg_.engram_head_dim;
  const int nc = engram_.n_cols, nl = engram_.n_layers;
  Vec u(static_cast<size_t>(T * nc * ed));
  for (int64_t t = 0; t < T; ++t)
    for (int c = 0; c < nc; ++c)
      L.engram_table.gather_row(s.engram_ids[static_cast<size_t>((t * nl + li) * nc + c)], u.data() + (t * nc + c) * ed);
  Vec y = linear_q(u, T, L.engram_wkv, cfg_.quant_block);  // [T, (M+1) * D]
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const float eps = cfg_.rms_eps;
  for (int64_t t = 0; t < T; ++t) {
    const float* yt = y.data() + t * (M + 1) * D;
    const float* value = yt + M * D;
    for (int64_t m = 0; m < M; ++m) {
      float* h = X.data() + (t * M + m) * D;
      const float* key = yt + m * D;
      const float* w = L.engram_w.data() + m * D;
      double hh = 0, kk = 0;
      float dot = 0;
      for (int64_t i = 0; i < D; ++i) {
        hh += static_cast<double>(h[i]) * h[i];
        kk += static_cast<double>(key[i]) * key[i];
        dot += h[i] * w[i] * key[i];
      }
      const float rstd = (1.0f / std::sqrt(static_cast<float>(hh / D) + eps)) *
                         (1.0f / std::sqrt(static_cast<float>(kk / D) + eps));
      const float d = dot * rstd * inv_sqrt_d;
      const float g = cpu::sigmoid(std::copysign(std::sqrt(std::max(std::fabs(d), 1e-6f)), d));
      for (int64_t i = 0; i < D; ++i) h[i] = h[i] + g * value[i];
    }
  }
}

// ---------------------------------------------------------------------------
// §3.3.1 hyper-connection mixing coefficients for every token.
void V41Cpu::hc_mix(const QMatrix& fn, const Vec& base, const Vec& scale, const Vec& X, int64_t T, Vec& pre,
                    Vec& post, Vec& comb) const {
  const int64_t M = cfg_.hc_mult, F = cfg_.hc_dim(), mix = cfg_.hc_mix_dim();
  Vec flat = X;
  for (int64_t t = 0; t < T; ++t) rmsnorm(flat.data() + t * F, nullptr, F, cfg_.rms_eps, flat.data() + t * F);
  Vec z = linear(flat, T, fn);  // [T, mix]
  pre.resize(static_cast<size_t>(T * M));
  post.resize(static_cast<size_t>(T * M));
  comb.resize(static_cast<size_t>(T * M * M));
  const float eps = cfg_.hc_eps;
  for (int64_t t = 0; t < T; ++t) {
    const float* zt = z.data() + t * mix;
    for (int64_t m = 0; m < M; ++m) {
      pre[t * M + m] = cpu::sigmoid(zt[m] * scale[0] + base[m]) + eps;
      post[t * M + m] = 2.0f * cpu::sigmoid(zt[M + m] * scale[1] + base[M + m]);
    }
    float* C = comb.data() + t * M * M;  // C[j * M + k], j = source stream
    for (int64_t j = 0; j < M; ++j) {
      float mx = kNegInf;
      for (int64_t k = 0; k < M; ++k) {
        C[j * M + k] = zt[2 * M + j * M + k] * scale[2] + base[2 * M + j * M + k];
        mx = std::max(mx, C[j * M + k]);
      }
      float sum = 0;
      for (int64_t k = 0; k < M; ++k) sum += (C[j * M + k] = std::exp(C[j * M + k] - mx));
      for (int64_t k = 0; k < M; ++k) C[j * M + k] = C[j * M + k] / sum + eps;
    }
    auto col_norm = [&] {
      for (int64_t k = 0; k < M; ++k) {
        float s = 0;
        for (int64_t j = 0; j < M; ++j) s += C[j * M + k];
        for (int64_t j = 0; j < M; ++j) C[j * M + k] /= (s + eps);
      }
    };
    auto row_norm = [&] {
      for (int64_t j = 0; j < M; ++j) {
        float s = 0;
        for (int64_t k = 0; k < M; ++k) s += C[j * M + k];
        for (int64_t k = 0; k < M; ++k) C[j * M + k] /= (s + eps);
      }
    };
    col_norm();
    for (int it = 1; it < cfg_.hc_sinkhorn_iters; ++it) {
      row_norm();
      col_norm();
    }
  }
}

// ---------------------------------------------------------------------------
// §3.4.3 compressor of a KV-source layer: latents (pre-RoPE) of the groups that
// complete in this step; first_group = index of the first of them.
void V41Cpu::compressor(int layer, Step& s, KVState& st, const Vec& a, Vec& latents, int64_t& first_group) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  CompressedCache& c = st.caches[static_cast<size_t>(layer)];
  const int64_t T = s.T, hd = cfg_.head_dim, r = c.ratio, p0 = s.p0;
  first_group = c.n;
  if (r == 1) {
    latents = linear(a, T, L.comp_wkv);
    rmsnorm_rows(latents, hd, L.comp_norm, cfg_.rms_eps);
    return;
  }
  Vec kv = linear(a, T, L.comp_wkv), gate = linear(a, T, L.comp_wgate);  // f32 projections
  auto proj = [&](int64_t pos, bool is_gate) -> const float* {
    if (pos >= p0) return (is_gate ? gate : kv).data() + (pos - p0) * hd;
    return (is_gate ? c.proj_gate : c.proj_kv).data() + (pos % c.proj_cap) * hd;
  };
  latents.clear();
  for (int64_t j = c.n; (j + 1) * r <= p0 + T; ++j) {
    Vec z(static_cast<size_t>(hd));
    for (int64_t i = 0; i < hd; ++i) {
      float mx = kNegInf;
      for (int64_t m = 0; m < r; ++m) mx = std::max(mx, proj(j * r + m, true)[i]);
      float den = 0;
      for (int64_t m = 0; m < r; ++m) den += std::exp(proj(j * r + m, true)[i] - mx);
      float acc = 0;
      for (int64_t m = 0; m < r; ++m) acc += proj(j * r + m, false)[i] * (std::exp(proj(j * r + m, true)[i] - mx) / den);
      z[static_cast<size_t>(i)] = acc;
    }
    rmsnorm(z.data(), L.comp_norm.data(), hd, cfg_.rms_eps, z.data());
    latents.insert(latents.end(), z.begin(), z.end());
  }
  // keep the most recent projections for later steps (pending half groups, rollback)
  for (int64_t pos = std::max(p0, p0 + T - c.proj_cap); pos < p0 + T; ++pos) {
    std::memcpy(c.proj_kv.data() + (pos % c.proj_cap) * hd, kv.data() + (pos - p0) * hd, hd * 4);
    std::memcpy(c.proj_gate.data() + (pos % c.proj_cap) * hd, gate.data() + (pos - p0) * hd, hd * 4);
  }
}

// ---------------------------------------------------------------------------
// §3.4.4 index keys and §3.4.6 selection of compressed rows (index sources).
void V41Cpu::indexer(int layer, Step& s, KVState& st, const Vec& a, const Vec& q_lat, const Vec& new_latents,
                     int64_t first_group) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int src = cfg_.kv_source_of(layer);
  CompressedCache& c = st.caches[static_cast<size_t>(src)];
  const int64_t T = s.T, hd = cfg_.head_dim, ih = cfg_.index_n_heads, ihd = cfg_.index_head_dim;
  const int64_t r = cfg_.ratio(layer);
  const int np = compress_rope_.n_pairs();
  Vec cs(static_cast<size_t>(np)), sn(static_cast<size_t>(np));
  if (src == layer) {
    // publish index keys of the groups completed in this step
    const int64_t g = static_cast<int64_t>(new_latents.size()) / hd;
    if (g > 0) {
      Vec k = linear(new_latents, g, L.idx_wk);
      rmsnorm_rows(k, ihd, L.idx_k_norm, cfg_.rms_eps);
      for (int64_t i = 0; i < g; ++i) {
        compress_rope_.angles((first_group + i) * r, cs.data(), sn.data());
        cpu::rope_apply(k.data() + i * ihd, ihd, np, cs.data(), sn.data(), false);
        fq4e8_vec(k.data() + i * ihd, ihd);
      }
      c.keys.insert(c.keys.end(), k.begin(), k.end());
    }
  }
  const int64_t n_comp = static_cast<int64_t>(c.keys.size()) / ihd;
  if (n_comp == 0) return;  // nothing to select from yet

  Vec q = linear_q(q_lat, T, L.idx_wq_b, cfg_.quant_block);  // [T, ih * ihd]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < ih; ++h) {
      float* qh = q.data() + (t * ih + h) * ihd;
      cpu::rope_apply(qh, ihd, np, s.cos(true, t, np), s.sin(true, t, np), false);
      fq4e8_vec(qh, ihd);
    }
  Vec wts = linear(a, T, L.idx_weights_proj);  // [T, ih]
  const float heads_scaling = static_cast<float>(std::pow(static_cast<double>(ih), -0.5));
  const float softmax_scale = static_cast<float>(std::pow(static_cast<double>(ihd), -0.5));
  for (auto& v : wts) v *= heads_scaling;

  const bool is_cand_source = layer == cfg_.candidate_source_layer;
  const bool uses_cand = cfg_.candidate_source_layer >= 0 && cfg_.candidate_source_layer < layer && s.have_cand;
  if (is_cand_source) {
    s.have_cand = true;
    s.cand_cols = n_comp;
    s.cand.assign(static_cast<size_t>(T * n_comp), 0);
  }
  s.sel.assign(static_cast<size_t>(T), {});
  parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    Vec score(static_cast<size_t>(n_comp));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n_vis = (s.p0 + t + 1) / r;
      const float* qt = q.data() + t * ih * ihd;
      const float* wt = wts.data() + t * ih;
      for (int64_t j = 0; j < n_comp; ++j) {
        if (j >= n_vis) {
          score[static_cast<size_t>(j)] = kNegInf;
          continue;
        }
        const float* kj = c.keys.data() + j * ihd;
        float acc = 0;
        for (int64_t h = 0; h < ih; ++h) {
          const float d = cpu::dot(qt + h * ihd, kj, ihd);
          acc += (std::max(d, 0.0f) * softmax_scale) * wt[h];
        }
        score[static_cast<size_t>(j)] = acc;
      }
      if (is_cand_source) {
        // two-level top-k: keep the best candidate blocks; the newest block is pinned
        const int64_t bs = cfg_.candidate_block_size;
        const int64_t nb = (n_comp + bs - 1) / bs;
        Vec bscore(static_cast<size_t>(nb), kNegInf);
        for (int64_t j = 0; j < n_comp; ++j)
          bscore[static_cast<size_t>(j / bs)] = std::max(bscore[static_cast<size_t>(j / bs)], score[static_cast<size_t>(j)]);
        if (n_vis >= 1) bscore[static_cast<size_t>((n_vis - 1) / bs)] = std::numeric_limits<float>::infinity();
        auto kept = topk_finite(bscore.data(), nb, std::min<int64_t>(cfg_.candidate_topk_blocks, nb));
        uint8_t* mask = s.cand.data() + t * n_comp;
        for (int32_t b : kept)
          for (int64_t j = b * bs; j < std::min(n_comp, (b + 1) * bs); ++j) mask[j] = 1;
      } else if (uses_cand) {
        const uint8_t* mask = s.cand.data() + t * s.cand_cols;
        for (int64_t j = 0; j < n_comp; ++j)
          if (j >= s.cand_cols || !mask[j]) score[static_cast<size_t>(j)] = kNegInf;
      }
      s.sel[static_cast<size_t>(t)] = topk_finite(score.data(), n_comp, std::min<int64_t>(cfg_.index_topk, n_comp));
    }
  });
  s.have_sel = true;
  s.sel_source = src;
  if (s.dbg) {
    auto& d = s.dbg->sparse_topk[static_cast<size_t>(layer)];
    d.assign(static_cast<size_t>(T * cfg_.index_topk), -1);
    for (int64_t t = 0; t < T; ++t)
      std::copy(s.sel[t].begin(), s.sel[t].end(), d.begin() + t * cfg_.index_topk);
    if (is_cand_source) {
      s.dbg->candidate_mask = s.cand;
      s.dbg->candidate_mask_cols = n_comp;
    }
  }
}

// ---------------------------------------------------------------------------
// §3.4 attention of one layer for the step's tokens.
void V41Cpu::attention(int layer, Step& s, KVState& st, const Vec& a, Vec& out) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t T = s.T, D = cfg_.hidden, H = cfg_.n_heads, hd = cfg_.head_dim, B = cfg_.quant_block;
  const int64_t r = cfg_.ratio(layer);
  const bool comp_rope = r > 0;
  const int np = cfg_.rope_dim / 2;

  // §3.4.1 queries
  Vec q_lat = linear_q(a, T, L.wq_a, B);
  rmsnorm_rows(q_lat, cfg_.q_lora_rank, L.q_norm, cfg_.rms_eps);
  Vec q = linear_q(q_lat, T, L.wq_b, B);  // [T, H * hd]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      cpu::rope_apply(q.data() + (t * H + h) * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), false);

  // §3.4.2 window KV (K = V)
  Vec kv = linear_q(a, T, L.wkv, B);  // [T, hd]
  rmsnorm_rows(kv, hd, L.kv_norm, cfg_.rms_eps);
  for (int64_t t = 0; t < T; ++t) {
    cpu::rope_apply(kv.data() + t * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), false);
    fq8_vec(kv.data() + t * hd, hd);
  }

  // §3.4.3-3.4.6 compressed branch
  const CompressedCache* comp = nullptr;
  if (r > 0) {
    Vec latents;
    int64_t first_group = 0;
    if (cfg_.is_kv_source(layer)) compressor(layer, s, st, a, latents, first_group);
    if (cfg_.is_index_source(layer)) indexer(layer, s, st, a, q_lat, latents, first_group);
    if (cfg_.is_kv_source(layer)) {
      CompressedCache& c = st.caches[static_cast<size_t>(layer)];
      const int64_t g = static_cast<int64_t>(latents.size()) / hd;
      Vec cs(static_cast<size_t>(np)), sn(static_cast<size_t>(np));
      for (int64_t i = 0; i < g; ++i) {
        float* row = latents.data() + i * hd;
        compress_rope_.angles((first_group + i) * r, cs.data(), sn.data());
        cpu::rope_apply(row, hd, np, cs.data(), sn.data(), false);
        fq4e4_vec(row, hd);
      }
      c.rows.insert(c.rows.end(), latents.begin(), latents.end());
      c.n += g;
    }
    comp = &st.caches[static_cast<size_t>(cfg_.kv_source_of(layer))];
    if (s.have_sel && s.sel_source != cfg_.kv_source_of(layer))
      fail("layer ", layer, ": top-k selection belongs to another KV group");
  }

  // §3.4.7 attention over window rows + selected compressed rows, with sink
  const WindowRing& ring = st.windows[static_cast<size_t>(layer)];
  const float scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  const int64_t W = cfg_.window;
  Vec o(static_cast<size_t>(T * H * hd));
  parallel_for(T * H, 1, [&](int64_t b, int64_t e) {
    std::vector<const float*> keys;
    Vec logit;
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / H, h = th % H, p = s.p0 + t;
      keys.clear();
      for (int64_t w = std::max<int64_t>(0, p - W + 1); w <= p; ++w)
        keys.push_back(w >= s.p0 ? kv.data() + (w - s.p0) * hd : ring.row(w));
      if (comp && s.have_sel)
        for (int32_t j : s.sel[static_cast<size_t>(t)]) keys.push_back(comp->rows.data() + static_cast<int64_t>(j) * hd);
      const float* qh = q.data() + (t * H + h) * hd;
      logit.resize(keys.size());
      const float sink = L.attn_sink[static_cast<size_t>(h)];
      float mx = sink;
      for (size_t k = 0; k < keys.size(); ++k) {
        logit[k] = cpu::dot(qh, keys[k], hd) * scale;
        mx = std::max(mx, logit[k]);
      }
      float den = std::exp(sink - mx);
      for (size_t k = 0; k < keys.size(); ++k) den += (logit[k] = std::exp(logit[k] - mx));
      float* oh = o.data() + (t * H + h) * hd;
      std::fill(oh, oh + hd, 0.0f);
      for (size_t k = 0; k < keys.size(); ++k) {
        const float pr = logit[k] / den;
        for (int64_t i = 0; i < hd; ++i) oh[i] += pr * keys[k][i];
      }
    }
  });
  // the chunk's window rows enter the ring (after every query of the chunk read it)
  WindowRing& wring = st.windows[static_cast<size_t>(layer)];
  for (int64_t t = std::max<int64_t>(0, T - wring.cap); t < T; ++t)
    std::memcpy(wring.row(s.p0 + t), kv.data() + t * hd, hd * 4);

  // §3.4.8 inverse RoPE, grouped output projection (wo_a in bf16/f32, no QA8), wo_b
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      cpu::rope_apply(o.data() + (t * H + h) * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), true);
  const int64_t G = cfg_.o_groups, ol = cfg_.o_lora_rank, gw = H / G * hd;
  Vec zeta(static_cast<size_t>(T * G * ol));
  Vec og(static_cast<size_t>(T * gw));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t) std::memcpy(og.data() + t * gw, o.data() + t * H * hd + g * gw, gw * 4);
    cpu::matmul_rows(og.data(), T, L.wo_a, g * ol, (g + 1) * ol, zeta.data() + g * ol, G * ol);
  }
  out = linear_q(zeta, T, L.wo_b, B);
  (void)D;
}

// ---------------------------------------------------------------------------
// §3.5 mixture of experts: router, routed experts, shared expert.
void V41Cpu::moe(int layer, Step& s, const Vec& f, Vec& out) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t T = s.T, D = cfg_.hidden, E = cfg_.n_routed_experts, K = cfg_.n_experts_per_tok, I = cfg_.moe_inter;
  const int B = cfg_.quant_block;
  Vec logits = linear(f, T, L.gate);  // [T, E] f32
  std::vector<int32_t> chosen(static_cast<size_t>(T * K));
  Vec weight(static_cast<size_t>(T * K));
  for (int64_t t = 0; t < T; ++t) {
    Vec sc(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      sc[e] = std::sqrt(cpu::softplus(logits[t * E + e] / cfg_.gate_temp));
      biased[e] = sc[e] + L.gate_bias[static_cast<size_t>(e)];
    }
    std::vector<int32_t> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int32_t a, int32_t b) { return biased[a] > biased[b] || (biased[a] == biased[b] && a < b); });
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += sc[idx[k]];
    for (int64_t k = 0; k < K; ++k) {
      chosen[t * K + k] = idx[k];
      float wk = sc[idx[k]];
      if (cfg_.norm_topk_prob && K > 1) wk = wk / (sum + 1e-20f);
      weight[t * K + k] = wk * cfg_.routed_scaling;
    }
  }
  if (s.dbg) s.dbg->router_experts[static_cast<size_t>(layer)] = chosen;

  const float lim = cfg_.swiglu_limit;
  auto swiglu = [&](float g, float u) {
    if (lim > 0) {
      u = std::clamp(u, -lim, lim);
      g = std::min(g, lim);
    }
    return cpu::silu(g) * u;
  };
  Vec fq = qa8_rows(f, D, B);  // the w1/w3 input, shared by all experts of a token
  out.assign(static_cast<size_t>(T * D), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> tok;
    Vec wt;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (chosen[t * K + k] == e) {
          tok.push_back(t);
          wt.push_back(weight[t * K + k]);
        }
    if (tok.empty()) continue;
    const int64_t n = static_cast<int64_t>(tok.size());
    Vec x(static_cast<size_t>(n * D));
    for (int64_t i = 0; i < n; ++i) std::memcpy(x.data() + i * D, fq.data() + tok[i] * D, D * 4);
    Vec g(static_cast<size_t>(n * I)), u(static_cast<size_t>(n * I));
    matmul(x.data(), n, L.w1[static_cast<size_t>(e)], g.data());
    matmul(x.data(), n, L.w3[static_cast<size_t>(e)], u.data());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < I; ++j) g[i * I + j] = wt[i] * swiglu(g[i * I + j], u[i * I + j]);
    Vec y = linear_q(g, n, L.w2[static_cast<size_t>(e)], B);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) out[tok[i] * D + d] += y[i * D + d];
  }
  Vec g(static_cast<size_t>(T * I)), u(static_cast<size_t>(T * I));
  matmul(fq.data(), T, L.sw1, g.data());
  matmul(fq.data(), T, L.sw3, u.data());
  for (int64_t i = 0; i < T * I; ++i) g[i] = swiglu(g[i], u[i]);
  Vec y = linear_q(g, T, L.sw2, B);
  for (int64_t i = 0; i < T * D; ++i) out[i] += y[i];
}

// ---------------------------------------------------------------------------
// §3.7 the whole forward for a chunk of tokens.
void V41Cpu::forward(KVState& st, const int32_t* ids, int64_t T, float* logits, bool all_rows,
                     ForwardDebug* dbg) const {
  DSX_CHECK(T > 0, "forward: no tokens");
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= cfg_.vocab_size)
      fail("token id ", ids[t], " at position ", st.pos + t, " is outside the vocabulary (", cfg_.vocab_size, ")");
  const int64_t D = cfg_.hidden, M = cfg_.hc_mult, NL = cfg_.n_layers;
  Step s;
  s.T = T;
  s.p0 = st.pos;
  s.ids = ids;
  s.dbg = dbg;
  if (dbg) {
    *dbg = ForwardDebug{};
    dbg->router_experts.resize(static_cast<size_t>(NL));
    dbg->sparse_topk.resize(static_cast<size_t>(NL));
    dbg->attn_norm_out.resize(static_cast<size_t>(NL));
    dbg->ffn_norm_out.resize(static_cast<size_t>(NL));
  }
  const int np = cfg_.rope_dim / 2;
  for (auto* v : {&s.cos_main, &s.sin_main, &s.cos_comp, &s.sin_comp}) v->resize(static_cast<size_t>(T * np));
  for (int64_t t = 0; t < T; ++t) {
    main_rope_.angles(s.p0 + t, s.cos_main.data() + t * np, s.sin_main.data() + t * np);
    compress_rope_.angles(s.p0 + t, s.cos_comp.data() + t * np, s.sin_comp.data() + t * np);
  }
  // §3.2.2 Engram row ids from the absolute-position token history
  if (engram_.n_layers > 0) {
    const int64_t back = engram_.max_ngram - 1;
    const int64_t h0 = std::max<int64_t>(0, s.p0 - back);
    std::vector<int32_t> hist;
    for (int64_t p = h0; p < s.p0 + T; ++p) {
      const int32_t raw = p < s.p0 ? st.tokens[static_cast<size_t>(p)] : ids[p - s.p0];
      hist.push_back(cmap_[static_cast<size_t>(raw)]);
    }
    const int nl = engram_.n_layers, nc = engram_.n_cols;
    s.engram_ids.resize(static_cast<size_t>(T * nl * nc));
    for (int64_t t = 0; t < T; ++t)
      for (int li = 0; li < nl; ++li) engram_.row_ids(li, hist.data(), h0, s.p0 + t, s.engram_ids.data() + (t * nl + li) * nc);
    if (dbg) dbg->engram_hash_ids = s.engram_ids;
  }

  // §3.1 embedding: every stream starts as the token's embedding; pre-mix one-hot
  Vec X(static_cast<size_t>(T * M * D));
  for (int64_t t = 0; t < T; ++t) {
    w_.embed.dequant_rows(ids[t], ids[t] + 1, X.data() + t * M * D);
    for (int64_t m = 1; m < M; ++m) std::memcpy(X.data() + (t * M + m) * D, X.data() + t * M * D, D * 4);
  }
  Vec pre(static_cast<size_t>(T * M), 0.0f);
  for (int64_t t = 0; t < T; ++t) pre[t * M] = 1.0f;

  auto collapse = [&](const Vec& p) {
    Vec y(static_cast<size_t>(T * D), 0.0f);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t m = 0; m < M; ++m) {
        const float pm = p[t * M + m];
        const float* x = X.data() + (t * M + m) * D;
        float* yt = y.data() + t * D;
        for (int64_t d = 0; d < D; ++d) yt[d] += pm * x[d];
      }
    return y;
  };
  auto expand = [&](const Vec& y, const Vec& post, const Vec& comb) {
    Vec nx(X.size());
    for (int64_t t = 0; t < T; ++t) {
      const float* C = comb.data() + t * M * M;
      for (int64_t k = 0; k < M; ++k) {
        float* o = nx.data() + (t * M + k) * D;
        for (int64_t d = 0; d < D; ++d) {
          float mixed = 0;
          for (int64_t j = 0; j < M; ++j) mixed += C[j * M + k] * X[(t * M + j) * D + d];
          o[d] = post[t * M + k] * y[t * D + d] + mixed;
        }
      }
    }
    X.swap(nx);
  };

  Vec pa, qa, Ca, pf, qf, Cf, y;
  for (int l = 0; l < NL; ++l) {
    const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    if (L.has_engram) engram(l, s, X);
    hc_mix(L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, X, T, pa, qa, Ca);
    Vec a = collapse(pre);
    rmsnorm_rows(a, D, L.attn_norm, cfg_.rms_eps);
    if (dbg) dbg->attn_norm_out[static_cast<size_t>(l)] = a;
    attention(l, s, st, a, y);
    expand(y, qa, Ca);
    hc_mix(L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, X, T, pf, qf, Cf);
    Vec f = collapse(pa);
    rmsnorm_rows(f, D, L.ffn_norm, cfg_.rms_eps);
    if (dbg) dbg->ffn_norm_out[static_cast<size_t>(l)] = f;
    moe(l, s, f, y);
    expand(y, qf, Cf);
    pre = pf;
  }
  // §3.6 final fold, norm, head
  Vec h = collapse(pre);
  rmsnorm_rows(h, D, w_.norm, cfg_.rms_eps);
  if (dbg) dbg->final_norm_out = h;
  if (all_rows) {
    matmul(h.data(), T, w_.head, logits);
  } else {
    matmul(h.data() + (T - 1) * D, 1, w_.head, logits);
  }
  st.tokens.insert(st.tokens.end(), ids, ids + T);
  st.pos += T;
}

}  // namespace dsx
