// Grouped expert GEMMs of the MoE prefill (kernels/cuda/moe_grouped.h) against a float64
// CPU twin, and moe_prefill's grouped path against its dequant + cuBLAS path.
//
// How results are compared:
//  * The tile plan: every group's rows covered once, in order, by tiles of at most
//    kGroupedTileRows rows (a property of the plan).
//  * xb (QA8 of the gathered rows): bit-identical to the CPU's QA8 (dsx::cpu::qa8_codes),
//    un-permuted from the B order.
//  * gu (raw f32 sums of the gate / up products) and yp (down products): against sums in
//    double of the exactly dequantized weights and the exact QA8 inputs. Every product is
//    exact in f32 (bf16 x bf16 operands), so only the f32 accumulation differs: the
//    tensor cores add their products to the f32 accumulator once per mma step of 16
//    (internally in groups of 8, aligned to the largest term and truncated), so after K
//    inputs each of the <= K / 8 additions is off by at most 2 ulp (2^-22) of a partial
//    sum bounded by S = sum_k |w_k x_k|: |got - ref| <= (K / 8 + 1) * 2^-22 * S (kSumBound).
//    That bound is loose for single wrong terms at large K, so the root mean square of
//    the errors in units of S must also stay below 2^-18: random-walk accumulation of
//    K / 8 roundings gives ~sqrt(K / 8) * 2^-24 (~1.5e-6 at K = 5120), one wrong term
//    per output ~1 / K (~2e-4).
//  * hq (SwiGLU + QA8 fused in the up kernel): the CPU recomputes h from the GPU's own
//    gu with the spec's SwiGLU (clamp, routing weight, BF16-mode rounding points) and
//    QA8s it: only expf may differ in the last bit (CUDA vs host), so nearly all codes are
//    equal and the others one e4m3 step away (as CudaMoe's stage-1 check).
//  * Rows do not depend on the other rows of the chunk: the same (token, expert) rows of
//    two chunks in different orders are bit-identical; the two weight layouts too.
//  * moe_prefill grouped vs cuBLAS: inputs with exact gate / up sums (integer activations,
//    unit scales, restricted e4m3 codes: both paths see the same h bit for bit), so the
//    outputs differ by the down products' summation order only: |a - b| <= 2 kSumBound(I)
//    * sum |h W2| (plus in BF16 mode one bf16 ulp of every rounded expert output and of
//    the sum, as CudaMoe.PrefillMatchesDecode).
#ifdef DSX_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "cuda_test_util.h"
#include "kernels/cpu/twin_linear.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_grouped.h"
#include "model/cpu/quant.h"
#include "util/numerics.h"
#include "util/switches.h"

using namespace dsx;
using dsx::cuda::DeviceBuffer;
using dsx::cuda::DType;
namespace twin = dsx::cpu::twin;

namespace {

using dsx_test::count_bit_diff;
using dsx_test::DevMatrix;
using dsx_test::download_act;
using dsx_test::upload_act;
using dsx_test::upload_matrix;

double sum_bound(int64_t K) { return (static_cast<double>(K) / 8.0 + 1.0) * std::ldexp(1.0, -22); }
constexpr double kRmsBound = 1.0 / 262144.0;  // 2^-18
constexpr double kBf16Ulp = 1.0 / 128.0;

// E experts over NS distinct weight sets (expert e uses set (5 e + 1) % NS: neighbours
// differ), FP8 shared expert with tile `tile`.
struct Experts {
  int E = 0, NS = 0;
  int64_t D = 0, I = 0;
  std::vector<twin::OwnedMatrix> w1, w3, w2;
  twin::OwnedMatrix sw1, sw3, sw2;
  bool shared = false;
  int set_of(int e) const { return (5 * e + 1) % NS; }
};

// scale_lo / hi (> 0): the range of the experts' e8m0 scale bytes (default per format).
std::unique_ptr<Experts> make_experts(int E, int NS, int64_t D, int64_t I, bool shared, int tile, bool exact,
                                      std::mt19937_64& rng, int scale_lo = -1, int scale_hi = -1) {
  auto x = std::make_unique<Experts>();
  x->E = E;
  x->NS = NS;
  x->D = D;
  x->I = I;
  x->shared = shared;
  twin::RandomSpec up4, up8, dn4;
  if (exact) {
    up4.scale_lo = up4.scale_hi = 127;
    up8.scale_lo = up8.scale_hi = 127;
    up8.e4m3_exp_lo = 6;
    up8.e4m3_exp_hi = 10;
  }
  if (scale_lo > 0) {
    up4.scale_lo = dn4.scale_lo = scale_lo;
    up4.scale_hi = dn4.scale_hi = scale_hi;
  }
  for (int s = 0; s < NS; ++s) {
    x->w1.push_back(twin::random_matrix(WFormat::MXFP4, I, D, 32, rng, up4));
    x->w3.push_back(twin::random_matrix(WFormat::MXFP4, I, D, 32, rng, up4));
    x->w2.push_back(twin::random_matrix(WFormat::MXFP4, D, I, 32, rng, dn4));
  }
  if (shared) {
    x->sw1 = twin::random_matrix(WFormat::FP8_BLOCK, I, D, tile, rng, up8);
    x->sw3 = twin::random_matrix(WFormat::FP8_BLOCK, I, D, tile, rng, up8);
    x->sw2 = twin::random_matrix(WFormat::FP8_BLOCK, D, I, tile, rng);
  }
  return x;
}

// The experts on the device in one layout (tiled: where the shapes fit).
struct DevExperts {
  std::vector<DevMatrix> d1, d3, d2;
  DevMatrix ds1, ds3, ds2;
  DeviceBuffer p[6];
  cuda::MoeLayer layer;
};

std::unique_ptr<DevExperts> upload_experts(const Experts& x, bool tiled, int qblock) {
  auto d = std::make_unique<DevExperts>();
  const bool etiled = tiled && cuda::moe_experts_tile16(x.D, x.I);
  for (int s = 0; s < x.NS; ++s) {
    d->d1.push_back(upload_matrix(x.w1[static_cast<size_t>(s)].q, etiled));
    d->d3.push_back(upload_matrix(x.w3[static_cast<size_t>(s)].q, etiled));
    d->d2.push_back(upload_matrix(x.w2[static_cast<size_t>(s)].q, etiled));
  }
  std::vector<const uint8_t*> ptr[6];
  for (int e = 0; e < x.E; ++e) {
    const size_t s = static_cast<size_t>(x.set_of(e));
    ptr[0].push_back(d->d1[s].q.data);
    ptr[1].push_back(d->d1[s].q.scale);
    ptr[2].push_back(d->d3[s].q.data);
    ptr[3].push_back(d->d3[s].q.scale);
    ptr[4].push_back(d->d2[s].q.data);
    ptr[5].push_back(d->d2[s].q.scale);
  }
  for (int i = 0; i < 6; ++i) {
    d->p[i].alloc(static_cast<size_t>(x.E) * sizeof(void*));
    d->p[i].upload(ptr[i].data(), d->p[i].size());
  }
  cuda::MoeLayer& L = d->layer;
  L.n_experts = x.E;
  L.hidden = x.D;
  L.inter = x.I;
  L.w1 = d->p[0].as<const uint8_t*>();
  L.w1_scale = d->p[1].as<const uint8_t*>();
  L.w3 = d->p[2].as<const uint8_t*>();
  L.w3_scale = d->p[3].as<const uint8_t*>();
  L.w2 = d->p[4].as<const uint8_t*>();
  L.w2_scale = d->p[5].as<const uint8_t*>();
  L.tiled = etiled;
  L.qblock = qblock;
  L.swiglu_limit = 10.0f;
  if (x.shared) {
    d->ds1 = upload_matrix(x.sw1.q, tiled);
    d->ds3 = upload_matrix(x.sw3.q, tiled);
    d->ds2 = upload_matrix(x.sw2.q, tiled);
    L.shared_w1 = d->ds1.q;
    L.shared_w3 = d->ds3.q;
    L.shared_w2 = d->ds2.q;
  }
  return d;
}

twin::MoeTwinLayer twin_layer(const Experts& x, int qblock) {
  twin::MoeTwinLayer tw;
  for (int e = 0; e < x.E; ++e) {
    const size_t s = static_cast<size_t>(x.set_of(e));
    tw.w1.push_back(x.w1[s].q);
    tw.w3.push_back(x.w3[s].q);
    tw.w2.push_back(x.w2[s].q);
  }
  if (x.shared) {
    tw.sw1 = x.sw1.q;
    tw.sw3 = x.sw3.q;
    tw.sw2 = x.sw2.q;
  }
  tw.qblock = qblock;
  tw.swiglu_limit = 10.0f;
  return tw;
}

// Random distinct experts per token from [3, E) and positive weights; with specials,
// expert 0 gets no row, expert 1 exactly one (token 0) and expert 2 slot 1 of tokens
// 1 .. big (more than two tiles when big > 128).
void routing(int T, int E, int topk, bool specials, int big, std::mt19937_64& rng, std::vector<int32_t>& ids,
             std::vector<float>& w) {
  ids.assign(static_cast<size_t>(T) * topk, 0);
  w.assign(ids.size(), 0.0f);
  const int lo = specials ? 3 : 0;
  std::vector<int32_t> pool(static_cast<size_t>(E - lo));
  std::uniform_real_distribution<float> ud(0.05f, 0.6f);
  for (int t = 0; t < T; ++t) {
    std::iota(pool.begin(), pool.end(), lo);
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int k = 0; k < topk; ++k) {
      ids[static_cast<size_t>(t * topk + k)] = pool[static_cast<size_t>(k)];
      w[static_cast<size_t>(t * topk + k)] = ud(rng);
    }
  }
  if (specials) {
    ids[0] = 1;
    for (int t = 1; t <= big && t < T; ++t) ids[static_cast<size_t>(t * topk + 1)] = 2;
  }
}

// The grouping moe_prefill makes on the device: entries of each expert in ascending order.
struct Grouping {
  std::vector<int> counts, offs, perm;
  std::vector<int> expert;  // per grouped row (routed rows), E for the shared rows
  std::vector<int> token;   // per grouped row
  int rows = 0;
};
Grouping group_rows(const std::vector<int32_t>& ids, int T, int topk, int E, bool shared) {
  Grouping g;
  g.counts.assign(static_cast<size_t>(E), 0);
  for (int32_t e : ids) ++g.counts[static_cast<size_t>(e)];
  g.offs.assign(static_cast<size_t>(E) + 1, 0);
  for (int e = 0; e < E; ++e) g.offs[static_cast<size_t>(e) + 1] = g.offs[static_cast<size_t>(e)] + g.counts[static_cast<size_t>(e)];
  for (int e = 0; e < E; ++e)
    for (size_t i = 0; i < ids.size(); ++i)
      if (ids[i] == e) {
        g.perm.push_back(static_cast<int>(i));
        g.expert.push_back(e);
        g.token.push_back(static_cast<int>(i) / topk);
      }
  if (shared)
    for (int t = 0; t < T; ++t) {
      g.expert.push_back(E);
      g.token.push_back(t);
    }
  g.rows = static_cast<int>(g.expert.size());
  return g;
}

struct GroupedOut {
  std::vector<uint16_t> xb, hq;  // B order
  std::vector<float> gu, yp;
  std::vector<int4> tiles;
  int n_tiles = 0;
};

GroupedOut run_grouped(const cuda::MoeLayer& L, const Grouping& gr, const std::vector<float>& x, int T, int topk,
                       const std::vector<float>& w, DType mode) {
  const int64_t D = L.hidden, I = L.inter;
  const size_t rows = static_cast<size_t>(gr.rows);
  DeviceBuffer dc = dsx_test::upload_vec(gr.counts), doff = dsx_test::upload_vec(gr.offs),
               dp = dsx_test::upload_vec(gr.perm), dw = dsx_test::upload_vec(w);
  const int mt = cuda::grouped_max_tiles(L, T, topk);
  DeviceBuffer dt(static_cast<size_t>(mt) * sizeof(int4)), dn(4);
  DeviceBuffer dx = upload_act(x, mode);
  DeviceBuffer xb(rows * D * 2), hq(rows * I * 2), gu(rows * 2 * I * 4), yp(rows * D * 4);
  DSX_CUDA_CHECK(cudaMemset(hq.get(), 0xff, hq.size()));  // (every element must be written)
  DSX_CUDA_CHECK(cudaMemset(yp.get(), 0xff, yp.size()));
  cuda::GroupedMoe g;
  g.T = T;
  g.topk = topk;
  g.counts = dc.as<int>();
  g.offs = doff.as<int>();
  g.perm = dp.as<int>();
  g.weights = dw.as<float>();
  g.tiles = dt.as<int4>();
  g.n_tiles = dn.as<int>();
  cuda::grouped_plan(L, g, nullptr);
  cuda::grouped_gather_qa8(L, g, mode, dx.get(), D, xb.as<uint16_t>(), nullptr);
  cuda::grouped_up(L, g, xb.as<uint16_t>(), mode == DType::BF16, hq.as<uint16_t>(), gu.as<float>(), nullptr);
  cuda::grouped_down(L, g, hq.as<uint16_t>(), yp.as<float>(), nullptr);
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  GroupedOut o;
  o.xb = dsx_test::download_vec<uint16_t>(xb, rows * D);
  o.hq = dsx_test::download_vec<uint16_t>(hq, rows * I);
  o.gu = dsx_test::download_vec<float>(gu, rows * 2 * I);
  o.yp = dsx_test::download_vec<float>(yp, rows * D);
  o.n_tiles = dsx_test::download_vec<int>(dn, 1)[0];
  o.tiles = dsx_test::download_vec<int4>(dt, static_cast<size_t>(mt));
  return o;
}

// Row k of a B-order row as f32.
float b_at(const std::vector<uint16_t>& v, int64_t row, int64_t K, int64_t k) {
  return bf16_to_f32(v[static_cast<size_t>(row * K + cuda::grouped_b_pos(k))]);
}

// The spec's SwiGLU with the V4.1 clamp and the BF16-mode rounding points (moe_device.cuh).
float swiglu_ref(float g, float u, float w, float lim, bool bf16) {
  if (bf16) {
    g = round_bf16(g);
    u = round_bf16(u);
  }
  if (lim > 0.0f) {
    u = std::min(std::max(u, -lim), lim);
    g = std::min(g, lim);
  }
  float h = w * ((g / (1.0f + std::exp(-g))) * u);
  if (bf16) h = round_bf16(h);
  return h;
}

// QA8 values of x (blocks of qblock).
std::vector<float> qa8_values(const std::vector<float>& x, int qblock) {
  std::vector<uint8_t> c(x.size());
  std::vector<float> s(x.size() / static_cast<size_t>(qblock)), v(x.size());
  cpu::qa8_codes(x.data(), static_cast<int64_t>(x.size()), qblock, c.data(), s.data());
  for (size_t i = 0; i < x.size(); ++i) v[i] = e4m3_to_f32(c[i]) * s[i / static_cast<size_t>(qblock)];
  return v;
}

void check_plan(const GroupedOut& o, const Grouping& gr, int E, bool shared) {
  int k = 0;
  for (int grp = 0; grp < E + (shared ? 1 : 0); ++grp) {
    const int n = grp < E ? gr.counts[static_cast<size_t>(grp)] : static_cast<int>(gr.token.size()) - gr.offs[static_cast<size_t>(E)];
    const int r0 = grp < E ? gr.offs[static_cast<size_t>(grp)] : gr.offs[static_cast<size_t>(E)];
    for (int done = 0; done < n; ++k) {
      ASSERT_LT(k, o.n_tiles) << "group " << grp;
      const int4 t = o.tiles[static_cast<size_t>(k)];
      ASSERT_EQ(t.x, grp);
      ASSERT_EQ(t.y, r0 + done);
      ASSERT_EQ(t.z, std::min(cuda::kGroupedTileRows, n - done));
      done += t.z;
    }
  }
  EXPECT_EQ(k, o.n_tiles);
}

// Error statistics of sums against their double reference.
struct SumCheck {
  double worst = 0, sq = 0;
  size_t n = 0;
  int bad = 0;
  void add(double got, double ref, double S, double bound, const char* what, size_t where) {
    const double e = std::fabs(got - ref);
    const double r = S > 0 ? e / S : (e > 0 ? 1e30 : 0);
    worst = std::max(worst, r / bound);
    sq += r * r;
    ++n;
    if (!(e <= bound * S) && ++bad <= 5)
      ADD_FAILURE() << what << " at " << where << ": gpu " << got << " ref " << ref << " S " << S;
  }
  void finish(const char* what) const {
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << n << " outside the bound (worst ratio " << worst << ")";
    const double rms = n ? std::sqrt(sq / static_cast<double>(n)) : 0;
    EXPECT_LE(rms, kRmsBound) << what << ": rms error / S";
    std::printf("  %s: %zu sums, worst %.3g of the bound, rms %.3g S\n", what, n, worst, rms);
  }
};

// All checks of one grouped run; `sample`: grouped rows whose products are checked in
// double (all rows when empty).
void check_grouped(const Experts& ex, const cuda::MoeLayer& L, const Grouping& gr, const std::vector<float>& x,
                   const std::vector<float>& w, DType mode, const GroupedOut& o, std::vector<int> sample) {
  const bool bf16 = mode == DType::BF16;
  const int64_t D = ex.D, I = ex.I;
  const int qb = L.qblock;
  const int E = ex.E;
  check_plan(o, gr, E, ex.shared);
  // xb: exact QA8 of the token's row
  const std::vector<float> xv = dsx_test::act_values(x, bf16 ? dsx::cuda::Act::BF16 : dsx::cuda::Act::F32);
  const int T = static_cast<int>(x.size() / static_cast<size_t>(D));
  std::vector<float> xq(x.size());
  for (int t = 0; t < T; ++t) {
    std::vector<float> row(xv.begin() + t * D, xv.begin() + (t + 1) * D);
    const std::vector<float> q = qa8_values(row, qb);
    std::copy(q.begin(), q.end(), xq.begin() + t * D);
  }
  size_t xbad = 0;
  for (int p = 0; p < gr.rows; ++p) {
    const int t = gr.token[static_cast<size_t>(p)];
    for (int64_t k = 0; k < D; ++k)
      if (f32_bits(b_at(o.xb, p, D, k)) != f32_bits(xq[static_cast<size_t>(t * D + k)])) ++xbad;
  }
  EXPECT_EQ(xbad, 0u) << "xb differs from the CPU's QA8";
  // hq from the GPU's own gu
  {
    size_t differ = 0;
    int bad = 0;
    std::vector<float> h(static_cast<size_t>(I));
    for (int p = 0; p < gr.rows; ++p) {
      const int e = gr.expert[static_cast<size_t>(p)];
      const float wt = e < E ? w[static_cast<size_t>(gr.perm[static_cast<size_t>(p)])] : 1.0f;
      const float* r = o.gu.data() + static_cast<size_t>(p) * 2 * I;
      for (int64_t i = 0; i < I; ++i) h[static_cast<size_t>(i)] = swiglu_ref(r[i], r[I + i], wt, L.swiglu_limit, bf16);
      const std::vector<float> q = qa8_values(h, qb);
      for (int64_t i = 0; i < I; ++i) {
        const float got = b_at(o.hq, p, I, i), want = q[static_cast<size_t>(i)];
        if (f32_bits(got) == f32_bits(want)) continue;
        ++differ;
        float amax = 0;
        for (int64_t j = (i / qb) * qb; j < (i / qb + 1) * qb; ++j) amax = std::max(amax, std::fabs(q[static_cast<size_t>(j)]));
        const double tol = 0.13 * std::max(std::fabs(got), std::fabs(want)) + 1e-5 * amax;
        if (!(std::fabs(static_cast<double>(got) - want) <= tol) && ++bad <= 5)
          ADD_FAILURE() << "hq row " << p << " feature " << i << ": gpu " << got << " cpu " << want;
      }
    }
    EXPECT_EQ(bad, 0) << "hq";
    EXPECT_LE(differ, std::max<size_t>(8, static_cast<size_t>(gr.rows) * I / 100)) << "too many hq values differ";
  }
  // gu and yp in double
  if (sample.empty()) {
    sample.resize(static_cast<size_t>(gr.rows));
    std::iota(sample.begin(), sample.end(), 0);
  }
  SumCheck cu, cd;
  const double bu = sum_bound(D), bd = sum_bound(I);
  // by weight set (one dequantized copy at a time); set NS = the shared expert
  for (int set = 0; set <= ex.NS; ++set) {
    std::vector<int> rows;
    for (int p : sample) {
      const int e = gr.expert[static_cast<size_t>(p)];
      if ((e < E && ex.set_of(e) == set) || (e == E && set == ex.NS)) rows.push_back(p);
    }
    if (rows.empty()) continue;
    const QMatrix& q1 = set < ex.NS ? ex.w1[static_cast<size_t>(set)].q : ex.sw1.q;
    const QMatrix& q3 = set < ex.NS ? ex.w3[static_cast<size_t>(set)].q : ex.sw3.q;
    const QMatrix& q2 = set < ex.NS ? ex.w2[static_cast<size_t>(set)].q : ex.sw2.q;
    std::vector<float> W1(static_cast<size_t>(I * D)), W3(W1.size()), W2(static_cast<size_t>(D * I));
    q1.dequant_rows(0, I, W1.data());
    q3.dequant_rows(0, I, W3.data());
    q2.dequant_rows(0, D, W2.data());
    for (int p : rows) {
      const float* xr = xq.data() + static_cast<size_t>(gr.token[static_cast<size_t>(p)]) * D;
      for (int64_t i = 0; i < I; ++i) {
        for (int m = 0; m < 2; ++m) {
          const float* wr = (m ? W3.data() : W1.data()) + i * D;
          double s = 0, S = 0;
          for (int64_t k = 0; k < D; ++k) {
            const double v = static_cast<double>(wr[k]) * xr[k];
            s += v;
            S += std::fabs(v);
          }
          cu.add(o.gu[static_cast<size_t>(p) * 2 * I + m * I + i], s, S, bu, m ? "u" : "g", static_cast<size_t>(p));
        }
      }
      std::vector<float> hr(static_cast<size_t>(I));
      for (int64_t k = 0; k < I; ++k) hr[static_cast<size_t>(k)] = b_at(o.hq, p, I, k);
      for (int64_t n = 0; n < D; ++n) {
        const float* wr = W2.data() + n * I;
        double s = 0, S = 0;
        for (int64_t k = 0; k < I; ++k) {
          const double v = static_cast<double>(wr[k]) * hr[static_cast<size_t>(k)];
          s += v;
          S += std::fabs(v);
        }
        cd.add(o.yp[static_cast<size_t>(p) * D + n], s, S, bd, "y", static_cast<size_t>(p));
      }
    }
  }
  cu.finish("gate/up sums");
  cd.finish("down sums");
}

struct Case {
  int E, NS;
  int64_t D, I;
  int topk, T, qblock, tile;
  bool shared, specials;
  int big;
  int scale_lo = -1, scale_hi = -1;  // experts' scale bytes (default: per format)
};

void run_case(const Case& c, uint64_t seed, int n_sample) {
  std::mt19937_64 rng(seed);
  auto ex = make_experts(c.E, c.NS, c.D, c.I, c.shared, c.tile, false, rng, c.scale_lo, c.scale_hi);
  std::vector<int32_t> ids;
  std::vector<float> w;
  routing(c.T, c.E, c.topk, c.specials, c.big, rng, ids, w);
  const Grouping gr = group_rows(ids, c.T, c.topk, c.E, c.shared);
  std::vector<int> sample;
  if (n_sample > 0) {  // the special experts' rows, the first and last tile rows of some experts, random rows
    std::uniform_int_distribution<int> ud(0, gr.rows - 1);
    if (c.specials) {
      sample.push_back(gr.offs[1]);                        // expert 1's only row
      for (int k : {0, 63, 64, 127, 128, gr.counts[2] - 1})  // expert 2: across its tiles
        if (k >= 0 && k < gr.counts[2]) sample.push_back(gr.offs[2] + k);
    }
    if (c.shared) sample.push_back(gr.offs[static_cast<size_t>(c.E)] + c.T - 1);
    while (static_cast<int>(sample.size()) < n_sample) sample.push_back(ud(rng));
  }
  for (bool tiled : {true, false}) {
    auto dev = upload_experts(*ex, tiled, c.qblock);
    ASSERT_TRUE(cuda::grouped_supported(dev->layer));
    for (DType mode : {DType::F32, DType::BF16}) {
      SCOPED_TRACE(testing::Message() << "E " << c.E << " D " << c.D << " I " << c.I << " T " << c.T << " topk "
                                      << c.topk << (tiled ? " tiled" : " row-major") << " mode "
                                      << (mode == DType::BF16 ? "bf16" : "f32"));
      std::printf("E %d D %ld I %ld T %d %s %s\n", c.E, static_cast<long>(c.D), static_cast<long>(c.I), c.T,
                  tiled ? "tiled" : "row-major", mode == DType::BF16 ? "bf16" : "f32");
      const bool bf16 = mode == DType::BF16;
      const std::vector<float> x = twin::random_acts(c.T, c.D, rng, bf16, -3, 1);
      const GroupedOut o = run_grouped(dev->layer, gr, x, c.T, c.topk, w, mode);
      check_grouped(*ex, dev->layer, gr, x, w, mode, o, sample);
    }
  }
}

}  // namespace

// Small shapes: K not a multiple of the 128-element stage (I = 64: a partial last stage),
// fewer features than a block's tile, every row checked. The fifth case has expert scale
// bytes up to 134 (weights up to 6 * 2^7): the kernels decode those stages with the
// byte tables instead of the bit trick (exact up to 128 only).
TEST(CudaMoeGrouped, TinyMatchesTwin) {
  SKIP_WITHOUT_GPU();
  run_case({8, 8, 256, 64, 2, 37, 32, 32, true, false, 0}, 41, 0);
  run_case({8, 8, 512, 256, 3, 60, 32, 32, true, false, 0, 124, 134}, 48, 0);
  run_case({12, 12, 384, 160, 3, 90, 32, 32, true, true, 70}, 42, 0);
  run_case({6, 6, 512, 256, 3, 50, 128, 128, true, false, 0}, 43, 0);  // V4-style blocks
  run_case({6, 6, 512, 256, 4, 40, 32, 32, false, false, 0}, 44, 0);   // no shared expert
}

// Release shapes: D 5120, I 2304, 384 experts (6 weight sets), top-6, a 2048-row chunk
// with experts of 0, 1 and > 128 rows; products checked on a sample of rows.
TEST(CudaMoeGrouped, ReleaseShapesMatchTwin) {
  SKIP_WITHOUT_GPU();
  run_case({384, 6, 5120, 2304, 6, 2048, 32, 32, true, true, 300}, 45, 24);
}

// A row's results do not depend on the other rows of the chunk (same tokens in reverse
// order: bit-identical rows), nor on the weight layout.
TEST(CudaMoeGrouped, RowsIndependentOfChunk) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(46);
  const int E = 16, topk = 6, T = 300;
  auto ex = make_experts(E, E, 1024, 512, true, 32, false, rng);
  auto dt = upload_experts(*ex, true, 32);
  auto dr = upload_experts(*ex, false, 32);
  std::vector<int32_t> ids;
  std::vector<float> w;
  routing(T, E, topk, false, 0, rng, ids, w);
  std::vector<int32_t> ids2(ids.size());
  std::vector<float> w2(w.size());
  for (DType mode : {DType::F32, DType::BF16}) {
    const std::vector<float> x = twin::random_acts(T, 1024, rng, mode == DType::BF16, -3, 1);
    std::vector<float> x2(x.size());
    for (int t = 0; t < T; ++t) {
      const int s = T - 1 - t;
      std::copy(x.begin() + s * 1024, x.begin() + (s + 1) * 1024, x2.begin() + t * 1024);
      for (int k = 0; k < topk; ++k) {
        ids2[static_cast<size_t>(t * topk + k)] = ids[static_cast<size_t>(s * topk + k)];
        w2[static_cast<size_t>(t * topk + k)] = w[static_cast<size_t>(s * topk + k)];
      }
    }
    const Grouping g1 = group_rows(ids, T, topk, E, true), g2 = group_rows(ids2, T, topk, E, true);
    const GroupedOut a = run_grouped(dt->layer, g1, x, T, topk, w, mode);
    const GroupedOut b = run_grouped(dt->layer, g2, x2, T, topk, w2, mode);
    const GroupedOut r = run_grouped(dr->layer, g1, x, T, topk, w, mode);
    EXPECT_EQ(count_bit_diff(r.yp, a.yp), 0u) << "row-major vs tiled";
    size_t hdiff = 0;
    for (size_t i = 0; i < a.hq.size(); ++i) hdiff += a.hq[i] != r.hq[i];
    EXPECT_EQ(hdiff, 0u) << "row-major vs tiled hidden";
    // row of (token t, expert e) in each grouping
    auto row_of = [&](const Grouping& g, int t, int e) {
      for (int p = 0; p < g.rows; ++p)
        if (g.token[static_cast<size_t>(p)] == t && g.expert[static_cast<size_t>(p)] == e) return p;
      return -1;
    };
    size_t diff = 0;
    for (int p = 0; p < g1.rows; ++p) {
      const int t = g1.token[static_cast<size_t>(p)], e = g1.expert[static_cast<size_t>(p)];
      const int q = row_of(g2, T - 1 - t, e);
      ASSERT_GE(q, 0);
      for (int64_t n = 0; n < 1024; ++n)
        diff += f32_bits(a.yp[static_cast<size_t>(p) * 1024 + n]) != f32_bits(b.yp[static_cast<size_t>(q) * 1024 + n]);
      for (int64_t i = 0; i < 512; ++i)
        diff += a.hq[static_cast<size_t>(p) * 512 + i] != b.hq[static_cast<size_t>(q) * 512 + i];
    }
    EXPECT_EQ(diff, 0u) << "rows depend on the chunk";
  }
}

// moe_prefill: grouped path vs the dequant + cuBLAS path (DSX_MOE_PREFILL=cublas).
TEST(CudaMoeGrouped, PrefillMatchesCublasPath) {
  SKIP_WITHOUT_GPU();
  struct C {
    int E;
    int64_t D, I;
    int topk, T;
  } cases[] = {{8, 256, 64, 2, 37}, {16, 1024, 512, 6, 200}};
  std::mt19937_64 rng(47);
  for (const C& c : cases) {
    auto ex = make_experts(c.E, c.E, c.D, c.I, true, 32, true, rng);
    const twin::MoeTwinLayer tw = twin_layer(*ex, 32);
    auto dev_t = upload_experts(*ex, true, 32);
    auto dev_r = upload_experts(*ex, false, 32);
    for (DType mode : {DType::F32, DType::BF16}) {
      const bool bf16 = mode == DType::BF16;
      std::vector<float> x(static_cast<size_t>(c.T * c.D));
      std::uniform_int_distribution<int> di(-7, 7);
      for (auto& v : x) v = static_cast<float>(di(rng));
      std::vector<int32_t> ids;
      std::vector<float> w;
      routing(c.T, c.E, c.topk, false, 0, rng, ids, w);
      // (the twin only sizes the tolerance: sum |h W2| and the expert outputs' magnitudes)
      std::vector<float> ref(x.size() / static_cast<size_t>(c.D) * c.D), hq, mag, abs;
      twin::moe(x.data(), c.T, c.D, c.I, c.topk, ids.data(), w.data(), tw, bf16, ref.data(), &hq, &mag, &abs);
      DeviceBuffer dx = upload_act(x, mode), di_ = dsx_test::upload_vec(ids), dw = dsx_test::upload_vec(w);
      for (const DevExperts* dev : {dev_t.get(), dev_r.get()}) {
        SCOPED_TRACE(testing::Message() << "E " << c.E << " D " << c.D << (dev->layer.tiled ? " tiled" : " row-major")
                                        << (bf16 ? " bf16" : " f32"));
        const size_t wsb = cuda::moe_prefill_ws_bytes(dev->layer, c.T, c.topk);
        DeviceBuffer ws(wsb);
        std::vector<float> y[2];
        for (int path = 0; path < 2; ++path) {
          sw::Scoped s(sw::Id::MOE_PREFILL, path ? "cublas" : "grouped");
          DeviceBuffer dy(static_cast<size_t>(c.T * c.D) * cuda::dtype_size(mode));
          cuda::moe_prefill(dev->layer, mode, dx.get(), c.D, c.T, c.topk, di_.as<int32_t>(), dw.as<float>(), mode,
                            dy.get(), c.D, ws.get(), wsb, nullptr);
          DSX_CUDA_CHECK(cudaDeviceSynchronize());
          y[path] = download_act(dy, static_cast<size_t>(c.T * c.D), mode);
        }
        int bad = 0;
        double worst = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          const double d = std::fabs(static_cast<double>(y[0][i]) - y[1][i]);
          const double tol =
              2 * sum_bound(c.I) * abs[i] + (bf16 ? kBf16Ulp * (mag[i] + std::fabs(y[1][i])) : 0.0) + 1e-30;
          worst = std::max(worst, d / tol);
          if (!(d <= tol) && ++bad <= 5)
            ADD_FAILURE() << "element " << i << " grouped " << y[0][i] << " cublas " << y[1][i] << " tol " << tol;
        }
        EXPECT_EQ(bad, 0) << "worst ratio " << worst;
        EXPECT_GT(count_bit_diff(y[0], std::vector<float>(y[0].size(), 0.0f)), y[0].size() / 2);
        std::printf("  prefill grouped vs cublas: worst %.3g of the tolerance\n", worst);
      }
    }
  }
}

#endif  // DSX_HAVE_CUDA
