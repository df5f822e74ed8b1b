#include "kernels/cpu/twin_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "model/cpu/linear.h"
#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "util/error.h"
#include "util/numerics.h"

namespace dsx::cpu::twin {

namespace {
bool quantized(const QMatrix& W) { return W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4; }

void round_all(float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) v[i] = ::dsx::round_bf16(v[i]);
}
}  // namespace

QMatrix abs_matrix(const QMatrix& W, std::vector<uint8_t>& storage) {
  const int64_t n = W.data_bytes();
  storage.assign(W.data, W.data + n);
  switch (W.fmt) {
    case WFormat::F32:
      for (int64_t i = 3; i < n; i += 4) storage[static_cast<size_t>(i)] &= 0x7f;
      break;
    case WFormat::BF16:
      for (int64_t i = 1; i < n; i += 2) storage[static_cast<size_t>(i)] &= 0x7f;
      break;
    case WFormat::FP8_BLOCK:
      for (auto& b : storage) b &= 0x7f;
      break;
    case WFormat::MXFP4:
      for (auto& b : storage) b &= 0x77;
      break;
  }
  QMatrix a = W;
  a.data = storage.data();
  return a;
}

void linear(const float* x, int64_t T, int64_t ldx, const QMatrix& W, bool qa8, int qblock, int groups,
            bool round_bf16, float* y, int64_t ldy, float* abs) {
  DSX_CHECK(groups >= 1 && W.rows % groups == 0, "twin::linear: bad groups");
  const int64_t Kg = W.cols, R = W.rows / groups;
  const bool q = qa8 && quantized(W);
  std::vector<uint8_t> abs_store;
  QMatrix Wa;
  if (abs) Wa = abs_matrix(W, abs_store);
  std::vector<float> xs(static_cast<size_t>(T * Kg));
  for (int g = 0; g < groups; ++g) {
    for (int64_t t = 0; t < T; ++t) {
      float* r = xs.data() + t * Kg;
      std::memcpy(r, x + t * ldx + g * Kg, static_cast<size_t>(Kg) * 4);
      if (q) qa8_inplace(r, Kg, qblock);
    }
    matmul_rows(xs.data(), T, W, g * R, (g + 1) * R, y + g * R, ldy);
    if (abs) {
      for (auto& v : xs) v = std::fabs(v);
      matmul_rows(xs.data(), T, Wa, g * R, (g + 1) * R, abs + g * R, ldy);
    }
  }
  if (round_bf16)
    for (int64_t t = 0; t < T; ++t) round_all(y + t * ldy, W.rows);
}

void router(const float* z, int64_t T, int64_t E, const float* bias, int topk, float gate_temp, bool norm_topk_prob,
            float route_scale, int32_t* ids, float* weights) {
  const int64_t K = topk;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> sc(static_cast<size_t>(E)), biased(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      sc[e] = std::sqrt(softplus(z[t * E + e] / gate_temp));
      biased[e] = sc[e] + (bias ? bias[e] : 0.0f);
    }
    std::vector<int32_t> idx(static_cast<size_t>(E));
    std::iota(idx.begin(), idx.end(), 0);
    std::partial_sort(idx.begin(), idx.begin() + K, idx.end(),
                      [&](int32_t a, int32_t b) { return biased[a] > biased[b] || (biased[a] == biased[b] && a < b); });
    float sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += sc[idx[k]];
    for (int64_t k = 0; k < K; ++k) {
      ids[t * K + k] = idx[k];
      float wk = sc[idx[k]];
      if (norm_topk_prob && K > 1) wk = wk / (sum + 1e-20f);
      weights[t * K + k] = wk * route_scale;
    }
  }
}

namespace {
float swiglu(float g, float u, float lim) {
  if (lim > 0) {
    u = std::clamp(u, -lim, lim);
    g = std::min(g, lim);
  }
  return silu(g) * u;
}
}  // namespace

void moe(const float* f, int64_t T, int64_t D, int64_t I, int topk, const int32_t* ids, const float* weights,
         const MoeTwinLayer& m, bool round_bf16, float* out, std::vector<float>* hq_out, std::vector<float>* mag,
         std::vector<float>* abs) {
  const bool shared = m.sw1.data != nullptr;
  const int64_t S = topk + (shared ? 1 : 0);
  std::vector<float> hq(static_cast<size_t>(T * S * I));
  std::vector<float> fq(f, f + T * D);
  for (int64_t t = 0; t < T; ++t) qa8_inplace(fq.data() + t * D, D, m.qblock);
  std::vector<float> g(static_cast<size_t>(I)), u(static_cast<size_t>(I));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < S; ++j) {
      const bool routed = j < topk;
      const QMatrix& W1 = routed ? m.w1[static_cast<size_t>(ids[t * topk + j])] : m.sw1;
      const QMatrix& W3 = routed ? m.w3[static_cast<size_t>(ids[t * topk + j])] : m.sw3;
      matmul(fq.data() + t * D, 1, W1, g.data());
      matmul(fq.data() + t * D, 1, W3, u.data());
      float* h = hq.data() + (t * S + j) * I;
      for (int64_t i = 0; i < I; ++i) {
        float gi = g[i], ui = u[i];
        if (round_bf16) {
          gi = ::dsx::round_bf16(gi);
          ui = ::dsx::round_bf16(ui);
        }
        float v = swiglu(gi, ui, m.swiglu_limit);
        if (routed) v = weights[t * topk + j] * v;
        if (round_bf16) v = ::dsx::round_bf16(v);
        h[i] = v;
      }
      qa8_inplace(h, I, m.qblock);
    }
  }
  moe_down(hq.data(), T, D, I, topk, ids, m, round_bf16, out, mag, abs);
  if (hq_out) *hq_out = std::move(hq);
}

void moe_down(const float* hq, int64_t T, int64_t D, int64_t I, int topk, const int32_t* ids, const MoeTwinLayer& m,
              bool round_bf16, float* out, std::vector<float>* mag, std::vector<float>* abs) {
  const bool shared = m.sw1.data != nullptr;
  const int64_t S = topk + (shared ? 1 : 0);
  if (mag) mag->assign(static_cast<size_t>(T * D), 0.0f);
  if (abs) abs->assign(static_cast<size_t>(T * D), 0.0f);
  std::vector<float> y(static_cast<size_t>(D)), ya(static_cast<size_t>(D)), ha(static_cast<size_t>(I));
  std::vector<uint8_t> store;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> order;
    for (int64_t j = 0; j < topk; ++j) order.push_back(j);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return ids[t * topk + a] < ids[t * topk + b]; });
    if (shared) order.push_back(topk);
    float* o = out + t * D;
    std::fill(o, o + D, 0.0f);
    for (int64_t j : order) {
      const QMatrix& W2 = j < topk ? m.w2[static_cast<size_t>(ids[t * topk + j])] : m.sw2;
      const float* h = hq + (t * S + j) * I;
      matmul(h, 1, W2, y.data());
      if (round_bf16) round_all(y.data(), D);
      for (int64_t d = 0; d < D; ++d) o[d] += y[d];
      if (mag)
        for (int64_t d = 0; d < D; ++d) (*mag)[static_cast<size_t>(t * D + d)] += std::fabs(y[d]);
      if (abs) {
        const QMatrix Wa = abs_matrix(W2, store);
        for (int64_t i = 0; i < I; ++i) ha[i] = std::fabs(h[i]);
        matmul(ha.data(), 1, Wa, ya.data());
        for (int64_t d = 0; d < D; ++d) (*abs)[static_cast<size_t>(t * D + d)] += ya[d];
      }
    }
    if (round_bf16) round_all(o, D);
  }
}

// ---- random test data ----------------------------------------------------------------

OwnedMatrix::OwnedMatrix(OwnedMatrix&& o) noexcept
    : q(std::move(o.q)), data(std::move(o.data)), scale(std::move(o.scale)) {
  q.data = data.empty() ? nullptr : data.data();
  q.scale = scale.empty() ? nullptr : scale.data();
}

OwnedMatrix& OwnedMatrix::operator=(OwnedMatrix&& o) noexcept {
  if (this != &o) {
    q = std::move(o.q);
    data = std::move(o.data);
    scale = std::move(o.scale);
    q.data = data.empty() ? nullptr : data.data();
    q.scale = scale.empty() ? nullptr : scale.data();
  }
  return *this;
}

OwnedMatrix random_matrix(WFormat fmt, int64_t N, int64_t K, int block, std::mt19937_64& rng, const RandomSpec& spec) {
  OwnedMatrix m;
  m.q.fmt = fmt;
  m.q.rows = N;
  m.q.cols = K;
  m.q.block = fmt == WFormat::MXFP4 ? 32 : block;
  m.q.name = "random";
  std::normal_distribution<float> nd(0.0f, spec.sigma);
  switch (fmt) {
    case WFormat::FP8_BLOCK: {
      m.data.resize(static_cast<size_t>(N * K));
      const int lo = spec.e4m3_exp_lo, span = spec.e4m3_exp_hi - spec.e4m3_exp_lo + 1;
      size_t i = 0;
      while (i < m.data.size()) {
        uint64_t r = rng();
        for (int j = 0; j < 8 && i < m.data.size(); ++j, r >>= 8) {
          uint8_t b = static_cast<uint8_t>(r & 0xff);
          if (span != 16) b = static_cast<uint8_t>((b & 0x87) | ((lo + ((b >> 3) & 15) % span) << 3));
          if ((b & 0x7f) == 0x7f) continue;  // NaN codes never occur in weights
          m.data[i++] = b;
        }
      }
      const int64_t sr = (N + block - 1) / block, sc = (K + block - 1) / block;
      m.scale.resize(static_cast<size_t>(sr * sc));
      std::uniform_int_distribution<int> s(spec.scale_lo >= 0 ? spec.scale_lo : 112,
                                           spec.scale_hi >= 0 ? spec.scale_hi : 120);
      for (auto& b : m.scale) b = static_cast<uint8_t>(s(rng));
      break;
    }
    case WFormat::MXFP4: {
      m.data.resize(static_cast<size_t>(N * K / 2));
      for (size_t i = 0; i < m.data.size(); i += 8) {
        uint64_t r = rng();
        for (size_t j = i; j < std::min(i + 8, m.data.size()); ++j, r >>= 8) m.data[j] = static_cast<uint8_t>(r & 0xff);
      }
      m.scale.resize(static_cast<size_t>(N * (K / 32)));
      std::uniform_int_distribution<int> s(spec.scale_lo >= 0 ? spec.scale_lo : 118,
                                           spec.scale_hi >= 0 ? spec.scale_hi : 124);
      for (auto& b : m.scale) b = static_cast<uint8_t>(s(rng));
      break;
    }
    case WFormat::BF16: {
      m.data.resize(static_cast<size_t>(N * K * 2));
      for (int64_t i = 0; i < N * K; ++i) {
        const uint16_t h = f32_to_bf16(nd(rng));
        std::memcpy(m.data.data() + 2 * i, &h, 2);
      }
      break;
    }
    case WFormat::F32: {
      m.data.resize(static_cast<size_t>(N * K * 4));
      for (int64_t i = 0; i < N * K; ++i) {
        const float v = nd(rng);
        std::memcpy(m.data.data() + 4 * i, &v, 4);
      }
      break;
    }
  }
  m.q.data = m.data.data();
  m.q.scale = m.scale.empty() ? nullptr : m.scale.data();
  return m;
}

std::vector<float> random_acts(int64_t T, int64_t K, std::mt19937_64& rng, bool bf16_exact, int exp_lo, int exp_hi) {
  std::vector<float> x(static_cast<size_t>(T * K));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(exp_lo, exp_hi), zero(0, 15);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < K; b += 32) {
      const bool z = zero(rng) == 0;
      const float sc = std::ldexp(1.0f, ex(rng));
      for (int64_t k = b; k < std::min(K, b + 32); ++k) {
        float v = z ? 0.0f : nd(rng) * sc;
        if (bf16_exact) v = ::dsx::round_bf16(v);
        x[static_cast<size_t>(t * K + k)] = v;
      }
    }
  return x;
}

}  // namespace dsx::cpu::twin
