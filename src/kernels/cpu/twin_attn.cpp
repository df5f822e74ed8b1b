#include "kernels/cpu/twin_attn.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "model/cpu/linear.h"
#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "model/cpu_common.h"
#include "util/numerics.h"

namespace dsx::cpu::twin {

namespace {
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
}

float rnd(bool bf16, float v) { return bf16 ? round_bf16(v) : v; }

void rope_angles(const float* inv_freq, int n_pairs, int64_t pos, float* c, float* s) {
  const float p = static_cast<float>(pos);
  for (int i = 0; i < n_pairs; ++i) {
    const float a = p * inv_freq[i];
    c[i] = static_cast<float>(std::cos(static_cast<double>(a)));
    s[i] = static_cast<float>(std::sin(static_cast<double>(a)));
  }
}

void rmsnorm_rows(bool bf16, const float* x, float* y, const float* w, int rows, int n, float eps) {
  for (int r = 0; r < rows; ++r) {
    cpu::rmsnorm(x + static_cast<int64_t>(r) * n, w, n, eps, y + static_cast<int64_t>(r) * n);
    for (int i = 0; i < n; ++i) y[static_cast<int64_t>(r) * n + i] = rnd(bf16, y[static_cast<int64_t>(r) * n + i]);
  }
}

void rope_rows(bool bf16, float* x, int rows, int heads, int hd, int n_pairs, const float* inv_freq, int64_t p0,
               bool inverse) {
  std::vector<float> c(static_cast<size_t>(n_pairs)), s(static_cast<size_t>(n_pairs));
  for (int r = 0; r < rows; ++r) {
    rope_angles(inv_freq, n_pairs, p0 + r, c.data(), s.data());
    for (int h = 0; h < heads; ++h) {
      float* v = x + (static_cast<int64_t>(r) * heads + h) * hd;
      cpu::rope_apply(v, hd, n_pairs, c.data(), s.data(), inverse);
      for (int i = 0; i < hd; ++i) v[i] = rnd(bf16, v[i]);
    }
  }
}

void rope_fq4e8(bool bf16, const float* in, float* out, int rows, int heads, int hd, int n_pairs,
                const float* inv_freq, int64_t p0) {
  const int64_t n = static_cast<int64_t>(rows) * heads * hd;
  if (out != in) std::copy(in, in + n, out);
  rope_rows(bf16, out, rows, heads, hd, n_pairs, inv_freq, p0, false);
  for (int64_t v = 0; v < static_cast<int64_t>(rows) * heads; ++v)
    if (hd % 32 == 0) cpu::fq4_e8_inplace(out + v * hd, hd, 32);
}

void kv_finish(bool bf16, const float* kv, const float* w, float eps, int rows, int hd, int n_pairs,
               const float* inv_freq, int64_t p0, float* out) {
  rmsnorm_rows(bf16, kv, out, w, rows, hd, eps);
  rope_rows(bf16, out, rows, 1, hd, n_pairs, inv_freq, p0, false);
  for (int r = 0; r < rows; ++r)
    if (hd % 32 == 0) cpu::qa8_inplace(out + static_cast<int64_t>(r) * hd, hd, 32);
}

// ---------------------------------------------------------------------------------------
void hc_mix(const float* X, int T, int64_t D, const float* fn, const float* base, const float* scale, float eps,
            float hc_eps, int iters, float* pre, float* post, float* comb) {
  constexpr int M = 4, mix = 24;
  const int64_t F = M * D;
  std::vector<float> flat(static_cast<size_t>(F));
  for (int t = 0; t < T; ++t) {
    cpu::rmsnorm(X + t * F, nullptr, F, eps, flat.data());
    float zt[mix];
    for (int o = 0; o < mix; ++o) zt[o] = cpu::dot(flat.data(), fn + o * F, F);
    for (int m = 0; m < M; ++m) {
      pre[t * M + m] = cpu::sigmoid(std::fma(zt[m], scale[0], base[m])) + hc_eps;
      post[t * M + m] = 2.0f * cpu::sigmoid(std::fma(zt[M + m], scale[1], base[M + m]));
    }
    float* C = comb + t * M * M;
    for (int i = 0; i < M * M; ++i) C[i] = std::fma(zt[2 * M + i], scale[2], base[2 * M + i]);
    fwd::sinkhorn(C, M, hc_eps, iters);  // V41Cpu's own (no multiply-adds)
  }
}

void hc_expand(bool bf16, float* X, const float* y, const float* post, const float* comb, int T, int64_t D) {
  constexpr int M = 4;
  std::vector<float> nx(static_cast<size_t>(M * D));
  for (int t = 0; t < T; ++t) {
    const float* C = comb + t * M * M;
    float* Xt = X + t * M * D;
    for (int k = 0; k < M; ++k)
      for (int64_t d = 0; d < D; ++d) {
        float mixed = 0;
        for (int j = 0; j < M; ++j) mixed = std::fma(C[j * M + k], Xt[j * D + d], mixed);
        nx[static_cast<size_t>(k * D + d)] = rnd(bf16, std::fma(post[t * M + k], y[t * D + d], mixed));
      }
    std::copy(nx.begin(), nx.end(), Xt);
  }
}

void hc_collapse(bool bf16, const float* X, const float* pre, int T, int64_t D, float* out) {
  constexpr int M = 4;
  for (int t = 0; t < T; ++t)
    for (int64_t d = 0; d < D; ++d) {
      float y = 0;
      for (int m = 0; m < M; ++m) y = std::fma(pre[t * M + m], X[(t * M + m) * D + d], y);
      out[t * D + d] = rnd(bf16, y);
    }
}

// ---------------------------------------------------------------------------------------
void engram_gate(bool bf16, int T, int M, int64_t D, const float* yE, float* X, const float* w, float eps) {
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  for (int t = 0; t < T; ++t) {
    const float* yt = yE + static_cast<int64_t>(t) * (M + 1) * D;
    const float* value = yt + static_cast<int64_t>(M) * D;
    for (int m = 0; m < M; ++m) {
      float* h = X + (static_cast<int64_t>(t) * M + m) * D;
      const float* key = yt + static_cast<int64_t>(m) * D;
      const float* wm = w + static_cast<int64_t>(m) * D;
      double hh = 0, kk = 0;
      float dot = 0;
      for (int64_t i = 0; i < D; ++i) {
        hh += static_cast<double>(h[i]) * h[i];
        kk += static_cast<double>(key[i]) * key[i];
        dot = std::fma(h[i] * wm[i], key[i], dot);
      }
      const float rstd = (1.0f / std::sqrt(static_cast<float>(hh / D) + eps)) *
                         (1.0f / std::sqrt(static_cast<float>(kk / D) + eps));
      const float d = dot * rstd * inv_sqrt_d;
      const float g = cpu::sigmoid(std::copysign(std::sqrt(std::max(std::fabs(d), 1e-6f)), d));
      for (int64_t i = 0; i < D; ++i) h[i] = rnd(bf16, std::fma(g, value[i], h[i]));
    }
  }
}

// ---------------------------------------------------------------------------------------
CompressorTwinOut compressor(bool bf16, int ratio, int hd, int idx, int n_pairs, float eps, int64_t p0, int T,
                             const RowAt& kv_at, const RowAt& gate_at, const float* norm, const float* inv_freq,
                             const float* wk, const float* k_norm) {
  CompressorTwinOut out;
  const int64_t r = ratio;
  out.first_group = p0 / r;
  std::vector<float> z(static_cast<size_t>(hd)), k(static_cast<size_t>(idx));
  std::vector<float> cs(static_cast<size_t>(n_pairs)), sn(static_cast<size_t>(n_pairs));
  for (int64_t j = p0 / r; (j + 1) * r <= p0 + T; ++j) {
    if (r == 1) {
      const float* kv = kv_at(j);
      for (int i = 0; i < hd; ++i) z[static_cast<size_t>(i)] = kv[i];
    } else {
      for (int i = 0; i < hd; ++i) {
        float mx = kNegInf;
        for (int64_t m = 0; m < r; ++m) mx = std::max(mx, gate_at(j * r + m)[i]);
        float den = 0;
        for (int64_t m = 0; m < r; ++m) den += std::exp(gate_at(j * r + m)[i] - mx);
        float acc = 0;
        for (int64_t m = 0; m < r; ++m)
          acc = std::fma(kv_at(j * r + m)[i], std::exp(gate_at(j * r + m)[i] - mx) / den, acc);
        z[static_cast<size_t>(i)] = acc;
      }
    }
    for (auto& v : z) v = rnd(bf16, v);
    rmsnorm_rows(bf16, z.data(), z.data(), norm, 1, hd, eps);  // latent
    out.latents.insert(out.latents.end(), z.begin(), z.end());
    // index key (from the un-rotated latent)
    for (int o = 0; o < idx; ++o)
      k[static_cast<size_t>(o)] = rnd(bf16, cpu::dot(z.data(), wk + static_cast<int64_t>(o) * hd, hd));
    rmsnorm_rows(bf16, k.data(), k.data(), k_norm, 1, idx, eps);
    rope_angles(inv_freq, n_pairs, j * r, cs.data(), sn.data());
    cpu::rope_apply(k.data(), idx, n_pairs, cs.data(), sn.data(), false);
    for (auto& v : k) v = rnd(bf16, v);
    if (idx % 32 == 0) cpu::fq4_e8_inplace(k.data(), idx, 32);
    out.keys.insert(out.keys.end(), k.begin(), k.end());
    // compressed row
    cpu::rope_apply(z.data(), hd, n_pairs, cs.data(), sn.data(), false);
    for (auto& v : z) v = rnd(bf16, v);
    if (hd % 16 == 0) cpu::fq4_e4_inplace(z.data(), hd, 16);
    out.rows.insert(out.rows.end(), z.begin(), z.end());
  }
  return out;
}

// ---------------------------------------------------------------------------------------
void indexer_scores(bool bf16, int T, int H, int hd, int ratio, int64_t p0, const float* q, const float* w,
                    const float* keys, const std::vector<std::vector<int32_t>>* cand_blocks, int cand_bs,
                    std::vector<std::vector<float>>& scores) {
  const float heads_scaling = static_cast<float>(std::pow(static_cast<double>(H), -0.5));
  const float softmax_scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  const float weight_factor =
      static_cast<float>(std::pow(static_cast<double>(hd), -0.5) * std::pow(static_cast<double>(H), -0.5));
  scores.assign(static_cast<size_t>(T), {});
  std::vector<float> wt(static_cast<size_t>(H));
  for (int t = 0; t < T; ++t) {
    const int64_t n_vis = (p0 + t + 1) / ratio;
    const float* qt = q + static_cast<int64_t>(t) * H * hd;
    for (int h = 0; h < H; ++h) {
      const float wv = w[static_cast<int64_t>(t) * H + h];
      wt[static_cast<size_t>(h)] = bf16 ? round_bf16(wv * weight_factor) : wv * heads_scaling;
    }
    auto score_row = [&](int64_t j) {
      if (j >= n_vis) return kNegInf;
      const float* kj = keys + j * hd;
      float acc = 0;
      for (int h = 0; h < H; ++h) {
        const float d = cpu::dot(qt + static_cast<int64_t>(h) * hd, kj, hd);
        if (bf16) {
          acc += round_bf16(std::max(round_bf16(d), 0.0f) * wt[static_cast<size_t>(h)]);
        } else {
          acc = std::fma(std::max(d, 0.0f) * softmax_scale, wt[static_cast<size_t>(h)], acc);
        }
      }
      return bf16 ? round_bf16(acc) : acc;
    };
    auto& st = scores[static_cast<size_t>(t)];
    if (!cand_blocks) {
      for (int64_t j = 0; j < n_vis; ++j) st.push_back(score_row(j));
    } else {
      for (int32_t b : (*cand_blocks)[static_cast<size_t>(t)])
        for (int i = 0; i < cand_bs; ++i) st.push_back(score_row(static_cast<int64_t>(b) * cand_bs + i));
    }
  }
}

std::vector<float> block_scores(const std::vector<float>& scores, int bs) {
  const int64_t n = static_cast<int64_t>(scores.size());
  const int64_t nb = (n + bs - 1) / bs;
  std::vector<float> b(static_cast<size_t>(nb), kNegInf);
  for (int64_t j = 0; j < n; ++j) b[static_cast<size_t>(j / bs)] = std::max(b[static_cast<size_t>(j / bs)], scores[static_cast<size_t>(j)]);
  if (n >= 1) b[static_cast<size_t>((n - 1) / bs)] = std::numeric_limits<float>::infinity();
  return b;
}

std::vector<int32_t> topk_finite(const float* s, int64_t n, int64_t k) { return fwd::topk_finite(s, n, k); }

// ---------------------------------------------------------------------------------------
void attention(bool bf16, int T, int H, int hd, int W, int64_t p0, const float* q, const RowAt& window_row,
               const float* cmp_rows, const std::vector<std::vector<int32_t>>* sel, const float* sink, float scale,
               int n_pairs, const float* inv_freq, float* out) {
  std::vector<const float*> keys;
  std::vector<float> logit, cs(static_cast<size_t>(n_pairs)), sn(static_cast<size_t>(n_pairs));
  for (int t = 0; t < T; ++t) {
    const int64_t p = p0 + t;
    keys.clear();
    for (int64_t w = std::max<int64_t>(0, p - W + 1); w <= p; ++w) keys.push_back(window_row(w));
    if (sel && cmp_rows)
      for (int32_t j : (*sel)[static_cast<size_t>(t)]) keys.push_back(cmp_rows + static_cast<int64_t>(j) * hd);
    if (inv_freq) rope_angles(inv_freq, n_pairs, p, cs.data(), sn.data());
    for (int h = 0; h < H; ++h) {
      const float* qh = q + (static_cast<int64_t>(t) * H + h) * hd;
      logit.resize(keys.size());
      float mx = sink[h];
      for (size_t k = 0; k < keys.size(); ++k) {
        logit[k] = cpu::dot(qh, keys[k], hd) * scale;
        mx = std::max(mx, logit[k]);
      }
      float den = std::exp(sink[h] - mx);
      for (size_t k = 0; k < keys.size(); ++k) den += (logit[k] = std::exp(logit[k] - mx));
      float* oh = out + (static_cast<int64_t>(t) * H + h) * hd;
      std::fill(oh, oh + hd, 0.0f);
      for (size_t k = 0; k < keys.size(); ++k) {
        const float pr = logit[k] / den;
        for (int i = 0; i < hd; ++i) oh[i] = std::fma(pr, keys[k][i], oh[i]);
      }
      for (int i = 0; i < hd; ++i) oh[i] = rnd(bf16, oh[i]);
      if (inv_freq) {
        cpu::rope_apply(oh, hd, n_pairs, cs.data(), sn.data(), true);
        for (int i = 0; i < hd; ++i) oh[i] = rnd(bf16, oh[i]);
      }
    }
  }
}

}  // namespace dsx::cpu::twin
