// DeepSeek V4 Flash forward on the CPU (f32 + QA8). Section numbers refer to spec
// model-v41.md (Part I for the shared machinery, Part II §6.3 for the V4 deltas);
// where the spec and the golden's reference (transformers' DeepseekV4ForCausalLM +
// QA8) differ, this follows the golden — see the notes at each site.
//
// Arithmetic. The golden is an f32 run whose GEMM accumulation order is unknown
// (MKL). With QA8 the model is chaotic: an activation within f32 noise of an e4m3
// rounding boundary decides which grid point it takes (golden README §6). To sit
// as close as possible to any f32 implementation, every dot product and every
// long reduction here is accumulated in f64 (a product of two f32 is exact in
// f64) and rounded once to f32, i.e. it is the correctly rounded value the
// reference's own f32 sums approximate. Element-wise operations are done in f32,
// in the reference's order, without fused multiply-adds (the pragma below; torch
// evaluates `a * b + c` as two rounded operations). The helpers shared with V41Cpu
// (cpu_common.h) are told so with Arith::kUnfusedF64 and get this file's products.
#include "model/v4_cpu.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "model/cpu_common.h"
#include "util/error.h"
#include "util/threadpool.h"

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace dsx {

using Vec = std::vector<float>;

namespace {

using fwd::kNegInf;
constexpr fwd::Arith kArith = fwd::Arith::kUnfusedF64;

// Σ a[i]·b[i] accumulated in f64 (products exact), not rounded.
double dot_f64(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  double s = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd(), acc2 = _mm256_setzero_pd(),
          acc3 = _mm256_setzero_pd();
  for (; i + 16 <= n; i += 16) {
    const __m256 a0 = _mm256_loadu_ps(a + i), b0 = _mm256_loadu_ps(b + i);
    const __m256 a1 = _mm256_loadu_ps(a + i + 8), b1 = _mm256_loadu_ps(b + i + 8);
    acc0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a0)), _mm256_cvtps_pd(_mm256_castps256_ps128(b0)), acc0);
    acc1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a0, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(b0, 1)), acc1);
    acc2 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a1)), _mm256_cvtps_pd(_mm256_castps256_ps128(b1)), acc2);
    acc3 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(a1, 1)), _mm256_cvtps_pd(_mm256_extractf128_ps(b1, 1)), acc3);
  }
  const __m256d acc = _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3));
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, acc);
  s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
  for (; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

float dot(const float* a, const float* b, int64_t n) { return static_cast<float>(dot_f64(a, b, n)); }

// y[t, n - r0] = Σ_k x[t, k] W[n, k] for weight rows [r0, r1) (dequantized on the
// fly, exact), f64 accumulation; threaded over tiles of weight rows.
void matmul_rows(const float* x, int64_t T, const QMatrix& W, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  const int64_t K = W.cols, n = r1 - r0;
  constexpr int64_t kTile = 16;
  const int64_t tiles = (n + kTile - 1) / kTile;
  const bool small = n * K * std::max<int64_t>(T, 4) < (int64_t{1} << 17);  // not worth waking the pool
  parallel_for(small ? 1 : tiles, 1, [&](int64_t b, int64_t e) {
    if (small) e = tiles;
    Vec buf(W.fmt == WFormat::F32 ? 0 : static_cast<size_t>(kTile * K));
    for (int64_t tile = b; tile < e; ++tile) {
      const int64_t a0 = r0 + tile * kTile, a1 = std::min(r1, a0 + kTile);
      const float* rows = buf.data();
      if (W.fmt == WFormat::F32) {
        rows = reinterpret_cast<const float*>(W.data) + a0 * K;
      } else {
        W.dequant_rows(a0, a1, buf.data());
      }
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < a1 - a0; ++j) y[t * ldy + (a0 - r0) + j] = dot(x + t * K, rows + j * K, K);
    }
  });
}

void matmul(const float* x, int64_t T, const QMatrix& W, float* y) { matmul_rows(x, T, W, 0, W.rows, y, W.rows); }

// Plain f32 product, no activation quantization.
Vec linear(const Vec& x, int64_t T, const QMatrix& W) {
  Vec y(static_cast<size_t>(T * W.rows));
  matmul(x.data(), T, W, y.data());
  return y;
}

// out = w ⊙ (x · (mean(x²) + eps)^-½) (w == nullptr: unweighted); the mean in f64.
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out) {
  const float var = static_cast<float>(dot_f64(x, x, n) / static_cast<double>(n));
  const float r = 1.0f / std::sqrt(var + eps);
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * r;
    out[i] = w ? w[i] * v : v;
  }
}

// RMSNorm of every n-wide row.
void rmsnorm_rows(Vec& x, int64_t n, const float* w, float eps) {
  const int64_t rows = static_cast<int64_t>(x.size()) / n;
  for (int64_t r = 0; r < rows; ++r) rmsnorm(x.data() + r * n, w, n, eps, x.data() + r * n);
}

// Interleaved-pair RoPE on the trailing 2·n_pairs entries of x[0..len) (§3.0.6),
// as the reference evaluates it: (a·cos − b·sin, b·cos + a·sin); the inverse uses
// −sin.
void rope(float* x, int64_t len, int n_pairs, const float* cos, const float* sin, bool inverse) {
  float* p = x + (len - 2 * n_pairs);
  for (int i = 0; i < n_pairs; ++i) {
    const float c = cos[i], sn = inverse ? -sin[i] : sin[i];
    const float a = p[2 * i], b = p[2 * i + 1];
    const float ac = a * c, bs = b * sn, bc = b * c, as = a * sn;
    p[2 * i] = ac - bs;
    p[2 * i + 1] = bc + as;
  }
}

}  // namespace

struct V4Cpu::Step : fwd::StepBase {};

V4Cpu::V4Cpu(ModelConfig cfg, ModelWeightsV4 weights) : cfg_(std::move(cfg)), w_(std::move(weights)) {
  if (cfg_.family != Family::V4) fail("V4Cpu: model_type '", cfg_.model_type, "' is not deepseek_v4");
  DSX_CHECK(static_cast<int>(w_.layers.size()) == cfg_.n_layers, "V4Cpu: weights bound for another layer count");
  // §6.3.12: main table θ = rope_theta without scaling; compress table θ =
  // compress_rope_theta with YaRN (always applied, as the golden's reference does).
  main_rope_ = make_main_rope(cfg_);
  compress_rope_ = make_compress_rope(cfg_);
}

Vec V4Cpu::linear_q(const Vec& x, int64_t T, const QMatrix& W, int layer, const char* site, int64_t pos0,
                    const int64_t* tok) const {
  Vec xq = x;
  const int64_t k = W.cols;
  for (int64_t r = 0; r < T; ++r) {
    if (probe_) probe_(layer, site, pos0 + (tok ? tok[r] : r), xq.data() + r * k, k);
    cpu::qa8_inplace(xq.data() + r * k, k, cfg_.quant_block);
  }
  Vec y(static_cast<size_t>(T * W.rows));
  matmul(xq.data(), T, W, y.data());
  return y;
}

int64_t V4Cpu::proj_width(int layer) const {
  const LayerWeightsV4& L = w_.layers[static_cast<size_t>(layer)];
  if (L.kind == V4LayerKind::Sliding) return 0;
  return L.comp.width() + (L.kind == V4LayerKind::CSA ? L.idx_comp.width() : 0);
}

KVState V4Cpu::new_state(int rollback_depth) const {
  DSX_CHECK(rollback_depth >= 0, "rollback depth must be >= 0");
  KVState st;
  st.rollback_depth = rollback_depth;
  st.compact = false;  // (V4's compressed caches are not fake-quantized: f32 sections)
  st.windows.resize(static_cast<size_t>(cfg_.n_layers));
  st.caches.resize(static_cast<size_t>(cfg_.n_layers));
  for (int l = 0; l < cfg_.n_layers; ++l) {
    auto& r = st.windows[static_cast<size_t>(l)];
    r.cap = cfg_.window + rollback_depth;
    r.dim = cfg_.head_dim;
    r.rows.assign(static_cast<size_t>(r.cap) * r.dim, 0.0f);
    const LayerWeightsV4& L = w_.layers[static_cast<size_t>(l)];
    if (L.kind == V4LayerKind::Sliding) continue;
    auto& c = st.caches[static_cast<size_t>(l)];
    c.ratio = L.comp.ratio;
    c.dim = cfg_.head_dim;
    c.idx_dim = L.kind == V4LayerKind::CSA ? cfg_.index_head_dim : 0;
    // A pooled row needs the projections of its own group and, when overlapping,
    // of the previous one; rollback_depth more slots keep them across a rollback.
    c.proj_cap = L.comp.coff * L.comp.ratio + rollback_depth;
    c.proj_kv.assign(static_cast<size_t>(c.proj_cap * proj_width(l)), 0.0f);
    c.proj_gate.assign(c.proj_kv.size(), 0.0f);
  }
  return st;
}

void V4Cpu::check_state(const KVState& st) const {
  auto bad = [](const std::string& what) { fail("session state does not fit this V4 model (", what, ")"); };
  if (st.windows.size() != static_cast<size_t>(cfg_.n_layers) || st.caches.size() != static_cast<size_t>(cfg_.n_layers))
    bad("layer count");
  if (st.pos < 0 || st.tokens.size() != static_cast<size_t>(st.pos)) bad("position");
  if (st.rollback_depth < 0) bad("rollback depth");
  for (int l = 0; l < cfg_.n_layers; ++l) {
    // rings must hold the window (or the pooled groups) plus the rollback depth
    const auto& r = st.windows[static_cast<size_t>(l)];
    if (r.dim != cfg_.head_dim || r.cap < cfg_.window + st.rollback_depth ||
        r.rows.size() != static_cast<size_t>(r.cap) * r.dim)
      bad("window ring of layer " + std::to_string(l));
    const auto& c = st.caches[static_cast<size_t>(l)];
    const int64_t pw = proj_width(l);
    const int ratio = pw ? w_.layers[static_cast<size_t>(l)].comp.ratio : 0;
    if (c.ratio != ratio) bad("compress ratio of layer " + std::to_string(l));
    if (ratio == 0) continue;
    if (c.n != st.pos / ratio || c.rows.size() != static_cast<size_t>(c.n * c.dim) ||
        c.keys.size() != static_cast<size_t>(c.n * c.idx_dim))
      bad("compressed rows of layer " + std::to_string(l));
    if (c.proj_cap < w_.layers[static_cast<size_t>(l)].comp.coff * ratio + st.rollback_depth ||
        c.proj_kv.size() != static_cast<size_t>(c.proj_cap * pw) || c.proj_gate.size() != c.proj_kv.size())
      bad("compressor ring of layer " + std::to_string(l));
  }
}

// ---------------------------------------------------------------------------
// §3.3.1 hyper-connection mixing coefficients for every token (eps = rms_norm_eps
// for the input normalisation, hc_eps for pre / comb / Sinkhorn).
void V4Cpu::hc_mix(const QMatrix& fn, const Vec& base, const Vec& scale, const Vec& X, int64_t T, Vec& pre,
                   Vec& post, Vec& comb) const {
  Vec flat = X;
  rmsnorm_rows(flat, cfg_.hc_dim(), nullptr, cfg_.rms_eps);
  Vec z = linear(flat, T, fn);  // [T, mix]
  fwd::hc_coefficients(cfg_, z, base, scale, T, kArith, pre, post, comb);
}

// ---------------------------------------------------------------------------
// §6.3.5 compressors of a CSA / HCA layer: the per-token f32 projections of the
// chunk, then every row whose group completes in this chunk (row j is emitted when
// token j*r + r - 1 arrives, whichever chunk that is):
//   gate' = wgate·a + ape[t mod r];
//   HCA (non-overlapping): z = Σ_{t in group j} softmax(gate')·kv over the r tokens;
//   CSA (overlapping, coff = 2): 2r slots — the A halves [0, d_c) of group j-1
//     (slots 0..r-1; gate -inf for j = 0) and the B halves [d_c, 2d_c) of group j —
//     softmax over the 2r gates (f32) weighting the 2r kv values;
//   row = RoPE_{j*r}( RMSNorm(z; norm) ) on its trailing rope dims (compress table).
// The main compressor's rows go to the compressed KV cache, the indexer
// compressor's (CSA, d_c = index_head_dim) to the index keys. No fake-quantization
// and no Hadamard rotation: the golden's reference has none (README §2a).
void V4Cpu::compress(int layer, Step& s, KVState& st, const Vec& a) const {
  const LayerWeightsV4& L = w_.layers[static_cast<size_t>(layer)];
  CompressedCache& c = st.caches[static_cast<size_t>(layer)];
  const int64_t T = s.T, p0 = s.p0, r = c.ratio, pw = proj_width(layer), cap = c.proj_cap;
  const bool csa = L.kind == V4LayerKind::CSA;
  const int np = cfg_.rope_dim / 2;

  // projections of the chunk's tokens, packed [main kv | indexer kv] per token
  Vec kv(static_cast<size_t>(T * pw)), gate(kv.size());
  {
    int64_t off = 0;
    for (const V4CompressorWeights* cw : {&L.comp, csa ? &L.idx_comp : nullptr}) {
      if (!cw) continue;
      const int64_t w = cw->width();
      Vec k = linear(a, T, cw->wkv), g = linear(a, T, cw->wgate);
      for (int64_t t = 0; t < T; ++t) {
        std::memcpy(kv.data() + t * pw + off, k.data() + t * w, static_cast<size_t>(w) * 4);
        std::memcpy(gate.data() + t * pw + off, g.data() + t * w, static_cast<size_t>(w) * 4);
      }
      off += w;
    }
  }
  auto proj = [&](const Vec& chunk, const Vec& ring, int64_t pos) -> const float* {
    if (pos >= p0) return chunk.data() + (pos - p0) * pw;
    DSX_CHECK(p0 - pos <= cap, "compressor ring too small for position ", pos, " at ", p0);
    return ring.data() + (pos % cap) * pw;
  };

  // pools group j of compressor cw whose projections start at column `off`
  Vec cs(static_cast<size_t>(np)), sn(static_cast<size_t>(np));
  auto pool = [&](const V4CompressorWeights& cw, int64_t off, int64_t j, float* out) {
    const int64_t dc = cw.dim, w = cw.width();
    const int64_t slots = cw.coff * r;
    std::vector<const float*> sk(static_cast<size_t>(slots), nullptr), sg(sk.size(), nullptr);
    std::vector<const float*> sa(sk.size(), nullptr);  // ape row, already offset to the half
    for (int64_t m = 0; m < r; ++m) {
      if (cw.coff == 2) {
        if (j > 0) {  // A half of group j-1
          const int64_t pos = (j - 1) * r + m;
          sk[m] = proj(kv, c.proj_kv, pos) + off;
          sg[m] = proj(gate, c.proj_gate, pos) + off;
          sa[m] = cw.ape.data() + m * w;
        }
        const int64_t pos = j * r + m;  // B half of group j
        sk[r + m] = proj(kv, c.proj_kv, pos) + off + dc;
        sg[r + m] = proj(gate, c.proj_gate, pos) + off + dc;
        sa[r + m] = cw.ape.data() + m * w + dc;
      } else {
        const int64_t pos = j * r + m;
        sk[m] = proj(kv, c.proj_kv, pos) + off;
        sg[m] = proj(gate, c.proj_gate, pos) + off;
        sa[m] = cw.ape.data() + m * w;
      }
    }
    Vec g(static_cast<size_t>(slots));
    for (int64_t i = 0; i < dc; ++i) {
      float mx = kNegInf;
      for (int64_t m = 0; m < slots; ++m) {
        g[m] = sg[m] ? sg[m][i] + sa[m][i] : kNegInf;
        mx = std::max(mx, g[m]);
      }
      double den = 0;
      for (int64_t m = 0; m < slots; ++m) den += (g[m] = sg[m] ? std::exp(g[m] - mx) : 0.0f);
      double acc = 0;
      for (int64_t m = 0; m < slots; ++m)
        if (sk[m]) acc += sk[m][i] * (g[m] / static_cast<float>(den));  // f32 products, summed exactly
      out[i] = static_cast<float>(acc);
    }
    rmsnorm(out, cw.norm.data(), dc, cfg_.rms_eps, out);
    compress_rope_.angles(j * r, cs.data(), sn.data());
    rope(out, dc, np, cs.data(), sn.data(), false);
  };

  for (int64_t j = c.n; (j + 1) * r <= p0 + T; ++j) {
    Vec row(static_cast<size_t>(L.comp.dim));
    pool(L.comp, 0, j, row.data());
    c.rows.insert(c.rows.end(), row.begin(), row.end());
    if (csa) {
      Vec key(static_cast<size_t>(L.idx_comp.dim));
      pool(L.idx_comp, L.comp.width(), j, key.data());
      c.keys.insert(c.keys.end(), key.begin(), key.end());
    }
    c.n = j + 1;
  }
  // keep the most recent projections for later chunks (pending groups, the next
  // row's overlap, rollback)
  for (int64_t pos = std::max(p0, p0 + T - cap); pos < p0 + T; ++pos) {
    std::memcpy(c.proj_kv.data() + (pos % cap) * pw, kv.data() + (pos - p0) * pw, static_cast<size_t>(pw) * 4);
    std::memcpy(c.proj_gate.data() + (pos % cap) * pw, gate.data() + (pos - p0) * pw, static_cast<size_t>(pw) * 4);
  }
}

// ---------------------------------------------------------------------------
// §6.3.6 the indexer of a CSA layer: per query t (position p) the rows j < (p+1)/r
// are scored against the layer's index keys,
//   S[j] = Σ_h (relu(u_h · K[j]) · ihd^-½) · w_h,   w = (weights_proj · a) · ih^-½,
// with u = RoPE_p(Lin8(q_lat; indexer.wq_b)) per head (compress table), all in f32
// (no Hadamard, no FP4: golden README §2a); the top min(index_topk, rows) of the
// finite scores are selected (ties: lower row index).
void V4Cpu::indexer(int layer, Step& s, const KVState& st, const Vec& a, const Vec& q_lat,
                    std::vector<std::vector<int32_t>>& sel) const {
  const LayerWeightsV4& L = w_.layers[static_cast<size_t>(layer)];
  const CompressedCache& c = st.caches[static_cast<size_t>(layer)];
  const int64_t T = s.T, ih = cfg_.index_n_heads, ihd = cfg_.index_head_dim, r = c.ratio, n_comp = c.n;
  const int np = cfg_.rope_dim / 2;
  Vec u = linear_q(q_lat, T, L.idx_wq_b, layer, "idx_wq_b", s.p0);  // [T, ih * ihd]
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < ih; ++h)
      rope(u.data() + (t * ih + h) * ihd, ihd, np, s.cos(true, t, np), s.sin(true, t, np), false);
  Vec wts = linear(a, T, L.idx_weights_proj);  // [T, ih]
  const float wscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ih)));
  const float sscale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(ihd)));
  for (auto& v : wts) v *= wscale;

  sel.assign(static_cast<size_t>(T), {});
  parallel_for(T, 1, [&](int64_t t0, int64_t t1) {
    Vec score(static_cast<size_t>(n_comp));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n_vis = (s.p0 + t + 1) / r;
      fwd::index_scores(u.data() + t * ih * ihd, wts.data() + t * ih, c.keys.data(), n_comp, n_vis, ih, ihd, sscale,
                        kArith, dot, score.data());
      sel[static_cast<size_t>(t)] = fwd::topk_finite(score.data(), n_comp, std::min<int64_t>(cfg_.index_topk, n_comp));
    }
  });
  if (s.dbg) fwd::record_selection(s.dbg->sparse_topk[static_cast<size_t>(layer)], sel, T, cfg_.index_topk);
}

// ---------------------------------------------------------------------------
// §3.4 with §6.3: attention of one layer for the chunk's tokens.
void V4Cpu::attention(int layer, Step& s, KVState& st, const Vec& a, Vec& out) const {
  const LayerWeightsV4& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t T = s.T, H = cfg_.n_heads, hd = cfg_.head_dim;
  const bool comp_rope = L.kind != V4LayerKind::Sliding;
  const int np = cfg_.rope_dim / 2;

  // §3.4.1 + §6.3.2 queries: per-head unweighted RMSNorm before RoPE
  Vec q_lat = linear_q(a, T, L.wq_a, layer, "wq_a", s.p0);
  rmsnorm_rows(q_lat, cfg_.q_lora_rank, L.q_norm.data(), cfg_.rms_eps);
  Vec q = linear_q(q_lat, T, L.wq_b, layer, "wq_b", s.p0);  // [T, H * hd]
  rmsnorm_rows(q, hd, nullptr, cfg_.rms_eps);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      rope(q.data() + (t * H + h) * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), false);

  // §3.4.2 window KV (K = V), post-RoPE; no FP8 fake-quant in the golden (§2a)
  Vec kv = linear_q(a, T, L.wkv, layer, "wkv", s.p0);  // [T, hd]
  rmsnorm_rows(kv, hd, L.kv_norm.data(), cfg_.rms_eps);
  for (int64_t t = 0; t < T; ++t)
    rope(kv.data() + t * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), false);

  // §6.3.4-6.3.7 compressed branch: own compressor(s); CSA selects rows with its
  // indexer, HCA attends every visible row.
  std::vector<std::vector<int32_t>> sel;
  const CompressedCache* comp = nullptr;
  if (L.kind != V4LayerKind::Sliding) {
    compress(layer, s, st, a);
    comp = &st.caches[static_cast<size_t>(layer)];
    if (L.kind == V4LayerKind::CSA) indexer(layer, s, st, a, q_lat, sel);
  }

  // §3.4.7 attention over the window rows + the chosen compressed rows, with sink
  const WindowRing& ring = st.windows[static_cast<size_t>(layer)];
  const float scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  const int64_t W = cfg_.window;
  Vec o(static_cast<size_t>(T * H * hd));
  parallel_for(T * H, 1, [&](int64_t b, int64_t e) {
    std::vector<const float*> keys;
    Vec logit;
    std::vector<double> acc;
    for (int64_t th = b; th < e; ++th) {
      const int64_t t = th / H, h = th % H, p = s.p0 + t;
      fwd::window_keys(p, s.p0, W, kv.data(), hd, ring, keys);
      if (L.kind == V4LayerKind::CSA) {
        for (int32_t j : sel[static_cast<size_t>(t)]) keys.push_back(comp->rows.data() + static_cast<int64_t>(j) * hd);
      } else if (L.kind == V4LayerKind::HCA) {
        const int64_t n_vis = std::min<int64_t>((p + 1) / comp->ratio, comp->n);
        for (int64_t j = 0; j < n_vis; ++j) keys.push_back(comp->rows.data() + j * hd);
      }
      const float* qh = q.data() + (t * H + h) * hd;
      logit.resize(keys.size());
      const float sink = L.attn_sink[static_cast<size_t>(h)];
      // softmax over the logits plus the sink logit (whose probability is dropped)
      float mx = sink;
      for (size_t k = 0; k < keys.size(); ++k) {
        logit[k] = dot(qh, keys[k], hd) * scale;
        mx = std::max(mx, logit[k]);
      }
      double den = std::exp(sink - mx);
      for (size_t k = 0; k < keys.size(); ++k) den += (logit[k] = std::exp(logit[k] - mx));
      const float inv = 1.0f / static_cast<float>(den);
      acc.assign(static_cast<size_t>(hd), 0.0);
      for (size_t k = 0; k < keys.size(); ++k) {
        const double pr = logit[k] * inv;
        for (int64_t i = 0; i < hd; ++i) acc[i] += pr * keys[k][i];
      }
      float* oh = o.data() + (t * H + h) * hd;
      for (int64_t i = 0; i < hd; ++i) oh[i] = static_cast<float>(acc[i]);
    }
  });
  fwd::push_window(st.windows[static_cast<size_t>(layer)], kv, s.p0, T, hd);

  // §3.4.8 inverse RoPE, grouped output projection (wo_a without QA8), wo_b
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h)
      rope(o.data() + (t * H + h) * hd, hd, np, s.cos(comp_rope, t, np), s.sin(comp_rope, t, np), true);
  Vec zeta = fwd::grouped_output(o, T, H, hd, cfg_.o_groups, cfg_.o_lora_rank, L.wo_a, matmul_rows);
  out = linear_q(zeta, T, L.wo_b, layer, "wo_b", s.p0);
}

// ---------------------------------------------------------------------------
// §3.5 with §6.3.9-6.3.11: router (hash-routed in the first num_hash_layers
// layers), routed experts (routing weight before w2's QA8), shared expert.
void V4Cpu::moe(int layer, Step& s, const Vec& f, Vec& out) const {
  const LayerWeightsV4& L = w_.layers[static_cast<size_t>(layer)];
  const int64_t T = s.T, D = cfg_.hidden;
  const int B = cfg_.quant_block;
  Vec logits = linear(f, T, L.gate);  // [T, E] f32
  std::vector<int32_t> chosen;
  Vec weight;
  // §6.3.9: in hash-routed layers the experts are tid2eid[token]; the weights still
  // come from the scores (normalised even for a single expert)
  const int32_t* hash = L.tid2eid.empty() ? nullptr : L.tid2eid.data();
  fwd::route(cfg_, logits, T, L.gate_bias.data(), hash, s.ids, cfg_.norm_topk_prob, chosen, weight);
  if (s.dbg) s.dbg->router_experts[static_cast<size_t>(layer)] = chosen;

  // the w1/w3 input, quantized once and shared by all experts of a token (and the shared expert)
  Vec fq = f;
  for (int64_t t = 0; t < T; ++t) {
    if (probe_) probe_(layer, "w1w3", s.p0 + t, fq.data() + t * D, D);
    cpu::qa8_inplace(fq.data() + t * D, D, B);
  }
  // w2's QA8 sees the routing weight; probe sites "w2.<expert id>" and "shared_w2"
  auto down = [&](const Vec& g, int64_t n, const QMatrix& W, int64_t expert, const int64_t* tok) {
    const std::string site = expert < 0 ? "shared_w2" : "w2." + std::to_string(expert);
    return linear_q(g, n, W, layer, site.c_str(), s.p0, tok);
  };
  fwd::experts(cfg_, fq, T, chosen, weight, {L.w1, L.w2, L.w3, L.sw1, L.sw2, L.sw3}, matmul, down, out);
}

// ---------------------------------------------------------------------------
// The whole forward for a chunk of tokens (§3.7 with the V4 hyper-connections of
// §6.3.8: every site collapses with its own pre; the final fold uses hc_head).
void V4Cpu::forward(KVState& st, const int32_t* ids, int64_t T, float* logits, bool all_rows,
                    ForwardDebug* dbg) const {
  Step s;
  fwd::begin_step(s, cfg_, main_rope_, compress_rope_, st, ids, T, dbg);
  const int64_t D = cfg_.hidden, M = cfg_.hc_mult, NL = cfg_.n_layers;

  // §3.1 embedding: every stream starts as the token's embedding
  Vec X = fwd::embed_streams(w_.embed, ids, T, M, D);

  // collapse: Σ_m pre_m · X_m (f32 products, summed exactly); expand: X'_k = post_k · y +
  // Σ_j C[j][k] · X_j (the mix is a product, rounded once)
  auto collapse = [&](const Vec& p) { return fwd::hc_collapse(X, p, T, M, D, kArith); };
  auto expand = [&](const Vec& y, const Vec& post, const Vec& comb) {
    fwd::hc_expand(X, y, post, comb, T, M, D, kArith);
  };

  Vec pre, post, comb, y;
  for (int l = 0; l < NL; ++l) {
    const LayerWeightsV4& L = w_.layers[static_cast<size_t>(l)];
    hc_mix(L.hc_attn_fn, L.hc_attn_base, L.hc_attn_scale, X, T, pre, post, comb);
    Vec a = collapse(pre);
    rmsnorm_rows(a, D, L.attn_norm.data(), cfg_.rms_eps);
    if (dbg) dbg->attn_norm_out[static_cast<size_t>(l)] = a;
    attention(l, s, st, a, y);
    expand(y, post, comb);
    hc_mix(L.hc_ffn_fn, L.hc_ffn_base, L.hc_ffn_scale, X, T, pre, post, comb);
    Vec f = collapse(pre);
    rmsnorm_rows(f, D, L.ffn_norm.data(), cfg_.rms_eps);
    if (dbg) dbg->ffn_norm_out[static_cast<size_t>(l)] = f;
    moe(l, s, f, y);
    expand(y, post, comb);
  }

  // §6.3.8 final fold with hc_head: pre = sigmoid(scale · (hc_head_fn · x̂) + base) + hc_eps
  Vec flat = X;
  rmsnorm_rows(flat, M * D, nullptr, cfg_.rms_eps);
  Vec z = linear(flat, T, w_.hc_head_fn);  // [T, M]
  Vec head_pre(static_cast<size_t>(T * M));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t m = 0; m < M; ++m)
      head_pre[t * M + m] = cpu::sigmoid(z[t * M + m] * w_.hc_head_scale[0] + w_.hc_head_base[m]) + cfg_.hc_eps;
  Vec h = collapse(head_pre);
  rmsnorm_rows(h, D, w_.norm.data(), cfg_.rms_eps);
  fwd::end_step(st, ids, T, h, D, w_.head, all_rows, logits, dbg, matmul);
}

}  // namespace dsx
