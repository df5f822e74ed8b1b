// Shared pieces of the CPU forwards (see cpu_common.h, also for the arithmetic).
#include "model/cpu_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "model/cpu/ops.h"
#include "model/v41_cpu.h"  // ForwardDebug
#include "util/error.h"

// No contraction in this file: a fused multiply-add is written as std::fma (Arith).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsx::fwd {

namespace {

// a * b + c in the model's rounding.
inline float mul_add(Arith arith, float a, float b, float c) {
  return arith == Arith::kFusedF32 ? std::fma(a, b, c) : a * b + c;
}

}  // namespace

// ---- the chunk -------------------------------------------------------------------------
void begin_step(StepBase& s, const ModelConfig& cfg, const RopeTable& main_rope, const RopeTable& compress_rope,
                const KVState& st, const int32_t* ids, int64_t T, ForwardDebug* dbg) {
  DSX_CHECK(T > 0, "forward: no tokens");
  for (int64_t t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= cfg.vocab_size)
      fail("token id ", ids[t], " at position ", st.pos + t, " is outside the vocabulary (", cfg.vocab_size, ")");
  const int64_t NL = cfg.n_layers;
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
  const int np = cfg.rope_dim / 2;
  for (auto* v : {&s.cos_main, &s.sin_main, &s.cos_comp, &s.sin_comp}) v->resize(static_cast<size_t>(T * np));
  for (int64_t t = 0; t < T; ++t) {
    main_rope.angles(s.p0 + t, s.cos_main.data() + t * np, s.sin_main.data() + t * np);
    compress_rope.angles(s.p0 + t, s.cos_comp.data() + t * np, s.sin_comp.data() + t * np);
  }
}

Vec embed_streams(const QMatrix& embed, const int32_t* ids, int64_t T, int64_t M, int64_t D) {
  Vec X(static_cast<size_t>(T * M * D));
  for (int64_t t = 0; t < T; ++t) {
    embed.dequant_rows(ids[t], ids[t] + 1, X.data() + t * M * D);
    for (int64_t m = 1; m < M; ++m)
      std::memcpy(X.data() + (t * M + m) * D, X.data() + t * M * D, static_cast<size_t>(D) * 4);
  }
  return X;
}

void end_step(KVState& st, const int32_t* ids, int64_t T, const Vec& h, int64_t D, const QMatrix& head, bool all_rows,
              float* logits, ForwardDebug* dbg, MatmulFn matmul) {
  if (dbg) dbg->final_norm_out = h;
  if (logits && all_rows) {
    matmul(h.data(), T, head, logits);
  } else if (logits) {
    matmul(h.data() + (T - 1) * D, 1, head, logits);
  }
  st.tokens.insert(st.tokens.end(), ids, ids + T);
  st.pos += T;
}

// ---- hyper-connections ----------------------------------------------------------------
void hc_coefficients(const ModelConfig& cfg, const Vec& z, const Vec& base, const Vec& scale, int64_t T, Arith arith,
                     Vec& pre, Vec& post, Vec& comb) {
  const int64_t M = cfg.hc_mult, mix = cfg.hc_mix_dim();
  pre.resize(static_cast<size_t>(T * M));
  post.resize(static_cast<size_t>(T * M));
  comb.resize(static_cast<size_t>(T * M * M));
  const float eps = cfg.hc_eps;
  for (int64_t t = 0; t < T; ++t) {
    const float* zt = z.data() + t * mix;
    for (int64_t m = 0; m < M; ++m) {
      pre[t * M + m] = cpu::sigmoid(mul_add(arith, zt[m], scale[0], base[m])) + eps;
      post[t * M + m] = 2.0f * cpu::sigmoid(mul_add(arith, zt[M + m], scale[1], base[M + m]));
    }
    float* C = comb.data() + t * M * M;
    for (int64_t i = 0; i < M * M; ++i) C[i] = mul_add(arith, zt[2 * M + i], scale[2], base[2 * M + i]);
    sinkhorn(C, M, eps, cfg.hc_sinkhorn_iters);
  }
}

void sinkhorn(float* C, int64_t M, float eps, int iters) {
  for (int64_t j = 0; j < M; ++j) {
    float mx = kNegInf;
    for (int64_t k = 0; k < M; ++k) mx = std::max(mx, C[j * M + k]);
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
  for (int it = 1; it < iters; ++it) {
    row_norm();
    col_norm();
  }
}

void stream_mean(const Vec& X, int64_t T, int64_t M, int64_t D, float* out, int64_t ld, int64_t off) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float s = 0;
      for (int64_t m = 0; m < M; ++m) s += X[static_cast<size_t>((t * M + m) * D + d)];
      out[t * ld + off + d] = s / static_cast<float>(M);
    }
}

Vec hc_collapse(const Vec& X, const Vec& pre, int64_t T, int64_t M, int64_t D, Arith arith) {
  Vec y(static_cast<size_t>(T * D));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      const float* p = pre.data() + t * M;
      const float* x = X.data() + t * M * D + d;
      if (arith == Arith::kFusedF32) {
        float acc = 0;
        for (int64_t m = 0; m < M; ++m) acc = std::fma(p[m], x[m * D], acc);
        y[t * D + d] = acc;
      } else {
        double acc = 0;
        for (int64_t m = 0; m < M; ++m) acc += p[m] * x[m * D];
        y[t * D + d] = static_cast<float>(acc);
      }
    }
  return y;
}

void hc_expand(Vec& X, const Vec& y, const Vec& post, const Vec& comb, int64_t T, int64_t M, int64_t D, Arith arith) {
  Vec nx(X.size());
  for (int64_t t = 0; t < T; ++t) {
    const float* C = comb.data() + t * M * M;
    for (int64_t k = 0; k < M; ++k) {
      float* o = nx.data() + (t * M + k) * D;
      for (int64_t d = 0; d < D; ++d) {
        float mixed;
        if (arith == Arith::kFusedF32) {
          mixed = 0;
          for (int64_t j = 0; j < M; ++j) mixed = std::fma(C[j * M + k], X[(t * M + j) * D + d], mixed);
        } else {
          double acc = 0;
          for (int64_t j = 0; j < M; ++j) acc += static_cast<double>(C[j * M + k]) * X[(t * M + j) * D + d];
          mixed = static_cast<float>(acc);
        }
        o[d] = mul_add(arith, post[t * M + k], y[t * D + d], mixed);
      }
    }
  }
  X.swap(nx);
}

// ---- attention --------------------------------------------------------------------------
void window_keys(int64_t p, int64_t p0, int64_t W, const float* kv, int64_t hd, const WindowRing& ring,
                 std::vector<const float*>& keys) {
  keys.clear();
  for (int64_t w = std::max<int64_t>(0, p - W + 1); w <= p; ++w)
    keys.push_back(w >= p0 ? kv + (w - p0) * hd : ring.row(w));
}

void push_window(WindowRing& ring, const Vec& kv, int64_t p0, int64_t T, int64_t hd) {
  for (int64_t t = std::max<int64_t>(0, T - ring.cap); t < T; ++t)
    std::memcpy(ring.row(p0 + t), kv.data() + t * hd, static_cast<size_t>(hd) * 4);
}

Vec grouped_output(const Vec& o, int64_t T, int64_t H, int64_t hd, int64_t G, int64_t ol, const QMatrix& wo_a,
                   MatmulRowsFn matmul_rows) {
  const int64_t gw = H / G * hd;
  Vec zeta(static_cast<size_t>(T * G * ol));
  Vec og(static_cast<size_t>(T * gw));
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(og.data() + t * gw, o.data() + t * H * hd + g * gw, static_cast<size_t>(gw) * 4);
    matmul_rows(og.data(), T, wo_a, g * ol, (g + 1) * ol, zeta.data() + g * ol, G * ol);
  }
  return zeta;
}

void index_scores(const float* q, const float* w, const float* keys, int64_t n_comp, int64_t n_vis, int64_t ih,
                  int64_t ihd, float scale, Arith arith, DotFn dot, float* score) {
  for (int64_t j = 0; j < n_comp; ++j) {
    if (j >= n_vis) {
      score[j] = kNegInf;
      continue;
    }
    const float* kj = keys + j * ihd;
    if (arith == Arith::kFusedF32) {
      float acc = 0;
      for (int64_t h = 0; h < ih; ++h) acc = std::fma(std::max(dot(q + h * ihd, kj, ihd), 0.0f) * scale, w[h], acc);
      score[j] = acc;
    } else {
      double acc = 0;
      for (int64_t h = 0; h < ih; ++h) acc += (std::max(dot(q + h * ihd, kj, ihd), 0.0f) * scale) * w[h];
      score[j] = static_cast<float>(acc);
    }
  }
}

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

void record_selection(std::vector<int32_t>& out, const std::vector<std::vector<int32_t>>& sel, int64_t T,
                      int64_t topk) {
  out.assign(static_cast<size_t>(T * topk), -1);
  for (int64_t t = 0; t < T; ++t) std::copy(sel[t].begin(), sel[t].end(), out.begin() + t * topk);
}

// ---- mixture of experts -----------------------------------------------------------------
void route(const ModelConfig& cfg, const Vec& logits, int64_t T, const float* bias, const int32_t* hash,
           const int32_t* ids, bool normalize, std::vector<int32_t>& chosen, Vec& weight) {
  const int64_t E = cfg.n_routed_experts, K = cfg.n_experts_per_tok;
  chosen.assign(static_cast<size_t>(T * K), 0);
  weight.assign(static_cast<size_t>(T * K), 0.0f);
  Vec sc(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
  std::vector<int32_t> order(static_cast<size_t>(E));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) sc[e] = std::sqrt(cpu::softplus(logits[t * E + e] / cfg.gate_temp));
    int32_t* idx = chosen.data() + t * K;
    if (hash) {
      std::copy_n(hash + static_cast<int64_t>(ids[t]) * K, K, idx);
    } else {
      for (int64_t e = 0; e < E; ++e) biased[e] = sc[e] + bias[e];
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t b) {
        return biased[a] > biased[b] || (biased[a] == biased[b] && a < b);
      });
      std::copy_n(order.begin(), K, idx);
    }
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += sc[idx[k]];
    for (int64_t k = 0; k < K; ++k) {
      float wk = sc[idx[k]];
      if (normalize) wk = wk / (sum + 1e-20f);
      weight[t * K + k] = wk * cfg.routed_scaling;
    }
  }
}

namespace {

// g = x W1ᵀ, u = x W3ᵀ for n rows x, then the SwiGLU hidden (times wt[i] when given).
Vec swiglu_hidden(const float* x, int64_t n, const QMatrix& w1, const QMatrix& w3, float lim, const float* wt,
                  MatmulFn matmul) {
  const int64_t I = w1.rows;
  auto swiglu = [&](float g, float u) {
    if (lim > 0) {
      u = std::clamp(u, -lim, lim);
      g = std::min(g, lim);
    }
    return cpu::silu(g) * u;
  };
  Vec g(static_cast<size_t>(n * I)), u(static_cast<size_t>(n * I));
  matmul(x, n, w1, g.data());
  matmul(x, n, w3, u.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < I; ++j) {
      const float h = swiglu(g[i * I + j], u[i * I + j]);
      g[i * I + j] = wt ? wt[i] * h : h;
    }
  return g;
}

}  // namespace

void add_routed_expert(const ModelConfig& cfg, const Vec& fq, int64_t e, const std::vector<int64_t>& tok,
                       const Vec& wt, const ExpertWeights& w, MatmulFn matmul, const DownProj& down, Vec& out) {
  if (tok.empty()) return;
  const int64_t D = cfg.hidden;
  const auto n = static_cast<int64_t>(tok.size());
  const auto ue = static_cast<size_t>(e);
  Vec x(static_cast<size_t>(n * D));
  for (int64_t i = 0; i < n; ++i) std::memcpy(x.data() + i * D, fq.data() + tok[i] * D, static_cast<size_t>(D) * 4);
  Vec g = swiglu_hidden(x.data(), n, w.w1[ue], w.w3[ue], cfg.swiglu_limit, wt.data(), matmul);
  Vec y = down(g, n, w.w2[ue], e, tok.data());
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; ++d) out[tok[i] * D + d] += y[i * D + d];
}

Vec shared_expert(const ModelConfig& cfg, const Vec& fq, int64_t T, const ExpertWeights& w, MatmulFn matmul,
                  const DownProj& down) {
  Vec g = swiglu_hidden(fq.data(), T, w.sw1, w.sw3, cfg.swiglu_limit, nullptr, matmul);
  return down(g, T, w.sw2, -1, nullptr);
}

void experts(const ModelConfig& cfg, const Vec& fq, int64_t T, const std::vector<int32_t>& chosen, const Vec& weight,
             const ExpertWeights& w, MatmulFn matmul, const DownProj& down, Vec& out) {
  const int64_t D = cfg.hidden, E = cfg.n_routed_experts, K = cfg.n_experts_per_tok;
  out.assign(static_cast<size_t>(T * D), 0.0f);
  std::vector<int64_t> tok;
  Vec wt;
  for (int64_t e = 0; e < E; ++e) {
    tok.clear();
    wt.clear();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k)
        if (chosen[t * K + k] == e) {
          tok.push_back(t);
          wt.push_back(weight[t * K + k]);
        }
    add_routed_expert(cfg, fq, e, tok, wt, w, matmul, down, out);
  }
  const Vec y = shared_expert(cfg, fq, T, w, matmul, down);
  for (int64_t i = 0; i < T * D; ++i) out[i] += y[i];
}

}  // namespace dsx::fwd
