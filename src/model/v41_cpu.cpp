// DeepSeek V4.1 forward on the CPU (f32 + the model's quantization points).
// Section numbers refer to spec model-v41.md. Arithmetic: f32, with the multiply-adds
// fused (the compiler contracts `a * b + c` here; the shared helpers of
// cpu_common.h are told so with Arith::kFusedF32).
#include "model/v41_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "model/cpu/expert_shards.h"
#include "model/cpu/linear.h"
#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "model/cpu_common.h"
#include "model/layer_plan.h"
#include "model/placement.h"
#include "util/error.h"
#include "util/threadpool.h"

namespace dsx {

using cpu::matmul;
using cpu::rmsnorm;
using Vec = std::vector<float>;

namespace {

using fwd::kNegInf;
constexpr fwd::Arith kArith = fwd::Arith::kFusedF32;

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

}  // namespace

struct V41Cpu::Step : fwd::StepBase {
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
  fingerprint_ = w_.files ? w_.files->fingerprint() : "";
}

KVState V41Cpu::new_state(int rollback_depth) const { return make_kv_state(cfg_, rollback_depth); }

// ---------------------------------------------------------------------------
// §3.2 Engram: gated n-gram memory added to every stream.
void V41Cpu::engram(int layer, Step& s, Vec& X) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int li = layer_plan(cfg_, layer).engram;
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
  const int64_t F = cfg_.hc_dim();
  Vec flat = X;
  for (int64_t t = 0; t < T; ++t) rmsnorm(flat.data() + t * F, nullptr, F, cfg_.rms_eps, flat.data() + t * F);
  Vec z = linear(flat, T, fn);  // [T, mix]
  fwd::hc_coefficients(cfg_, z, base, scale, T, kArith, pre, post, comb);
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
  const LayerPlan plan = layer_plan(cfg_, layer);
  const int src = plan.source;
  CompressedCache& c = st.caches[static_cast<size_t>(src)];
  const int64_t T = s.T, hd = cfg_.head_dim, ih = cfg_.index_n_heads, ihd = cfg_.index_head_dim;
  const int64_t r = plan.ratio;
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

  const bool is_cand_source = plan.candidate_source;
  const bool uses_cand = plan.uses_candidates && s.have_cand;
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
      fwd::index_scores(q.data() + t * ih * ihd, wts.data() + t * ih, c.keys.data(), n_comp, n_vis, ih, ihd,
                        softmax_scale, kArith, cpu::dot, score.data());
      if (is_cand_source) {
        // two-level top-k: keep the best candidate blocks; the newest block is pinned
        const int64_t bs = cfg_.candidate_block_size;
        const int64_t nb = (n_comp + bs - 1) / bs;
        Vec bscore(static_cast<size_t>(nb), kNegInf);
        for (int64_t j = 0; j < n_comp; ++j)
          bscore[static_cast<size_t>(j / bs)] = std::max(bscore[static_cast<size_t>(j / bs)], score[static_cast<size_t>(j)]);
        if (n_vis >= 1) bscore[static_cast<size_t>((n_vis - 1) / bs)] = std::numeric_limits<float>::infinity();
        auto kept = fwd::topk_finite(bscore.data(), nb, std::min<int64_t>(cfg_.candidate_topk_blocks, nb));
        uint8_t* mask = s.cand.data() + t * n_comp;
        for (int32_t b : kept)
          for (int64_t j = b * bs; j < std::min(n_comp, (b + 1) * bs); ++j) mask[j] = 1;
      } else if (uses_cand) {
        const uint8_t* mask = s.cand.data() + t * s.cand_cols;
        for (int64_t j = 0; j < n_comp; ++j)
          if (j >= s.cand_cols || !mask[j]) score[static_cast<size_t>(j)] = kNegInf;
      }
      s.sel[static_cast<size_t>(t)] =
          fwd::topk_finite(score.data(), n_comp, std::min<int64_t>(cfg_.index_topk, n_comp));
    }
  });
  s.have_sel = true;
  s.sel_source = src;
  if (s.dbg) {
    fwd::record_selection(s.dbg->sparse_topk[static_cast<size_t>(layer)], s.sel, T, cfg_.index_topk);
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
  const LayerPlan plan = layer_plan(cfg_, layer);
  const int64_t T = s.T, H = cfg_.n_heads, hd = cfg_.head_dim, B = cfg_.quant_block;
  const int64_t r = plan.ratio;
  const bool comp_rope = plan.comp_rope();
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
  if (plan.compressed()) {
    Vec latents;
    int64_t first_group = 0;
    if (plan.kv_source) compressor(layer, s, st, a, latents, first_group);
    if (plan.index_source) indexer(layer, s, st, a, q_lat, latents, first_group);
    if (plan.kv_source) {
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
    comp = &st.caches[static_cast<size_t>(plan.source)];
    if (s.have_sel && s.sel_source != plan.source)
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
      fwd::window_keys(p, s.p0, W, kv.data(), hd, ring, keys);
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
  fwd::push_window(st.windows[static_cast<size_t>(layer)], kv, s.p0, T, hd);

  // §3.4.8 inverse RoPE, grouped output projection (wo_a in bf16/f32, no QA8), wo_b
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      cpu::rope_apply(o.data() + (t * H + h) * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), true);
  Vec zeta = fwd::grouped_output(o, T, H, hd, cfg_.o_groups, cfg_.o_lora_rank, L.wo_a, cpu::matmul_rows);
  out = linear_q(zeta, T, L.wo_b, B);
}

// ---------------------------------------------------------------------------
// §3.5 mixture of experts: router, routed experts, shared expert.
void V41Cpu::moe(int layer, Step& s, const Vec& f, Vec& out) const {
  const LayerWeights& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t T = s.T, D = cfg_.hidden, K = cfg_.n_experts_per_tok;
  const int B = cfg_.quant_block;
  Vec logits = linear(f, T, L.gate);  // [T, E] f32
  std::vector<int32_t> chosen;
  Vec weight;
  // top-k of the biased scores; a single expert keeps its raw score
  fwd::route(cfg_, logits, T, L.gate_bias.data(), /*hash=*/nullptr, s.ids, cfg_.norm_topk_prob && K > 1, chosen,
             weight);
  if (s.dbg) s.dbg->router_experts[static_cast<size_t>(layer)] = chosen;

  Vec fq = qa8_rows(f, D, B);  // the w1/w3 input, shared by all experts of a token
  const fwd::DownProj down = [&](const Vec& g, int64_t n, const QMatrix& W, int64_t, const int64_t*) {
    return linear_q(g, n, W, B);
  };
  if (expert_ranks_ == 1) {
    fwd::experts(cfg_, fq, T, chosen, weight, {L.w1, L.w2, L.w3, L.sw1, L.sw2, L.sw3}, matmul, down, out);
  } else {
    // expert parallelism: per rank its experts' partial, combined in rank order
    cpu::expert_parallel_moe(cfg_, fq, T, chosen, weight, {L.w1, L.w2, L.w3, L.sw1, L.sw2, L.sw3}, matmul, down,
                             expert_ranks_, out);
  }
}

void V41Cpu::set_expert_ranks(int ranks) {
  (void)expert_ranges(cfg_.n_routed_experts, ranks);  // (throws naming a bad count)
  expert_ranks_ = ranks;
}

// ---------------------------------------------------------------------------
// §3.7 the whole forward for a chunk of tokens.
void V41Cpu::forward(KVState& st, const int32_t* ids, int64_t T, float* logits, bool all_rows,
                     ForwardDebug* dbg, float* taps) const {
  Step s;
  fwd::begin_step(s, cfg_, main_rope_, compress_rope_, st, ids, T, dbg);
  const int64_t D = cfg_.hidden, M = cfg_.hc_mult, NL = cfg_.n_layers;

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
  Vec X = fwd::embed_streams(w_.embed, ids, T, M, D);
  Vec pre(static_cast<size_t>(T * M), 0.0f);
  for (int64_t t = 0; t < T; ++t) pre[t * M] = 1.0f;

  auto collapse = [&](const Vec& p) { return fwd::hc_collapse(X, p, T, M, D, kArith); };
  auto expand = [&](const Vec& y, const Vec& post, const Vec& comb) {
    fwd::hc_expand(X, y, post, comb, T, M, D, kArith);
  };

  Vec pa, qa, Ca, pf, qf, Cf, y;
  for (int l = 0; l < NL; ++l) {
    const LayerWeights& L = w_.layers[static_cast<size_t>(l)];
    const LayerPlan plan = layer_plan(cfg_, l);
    if (plan.engram >= 0) engram(l, s, X);
    if (taps && plan.tap >= 0) fwd::stream_mean(X, T, M, D, taps, cfg_.tap_width(), plan.tap * D);
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
  fwd::end_step(st, ids, T, h, D, w_.head, all_rows, logits, dbg, matmul);
}

}  // namespace dsx
