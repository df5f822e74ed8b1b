// Micro-benchmark of the weight-streaming CUDA kernels (src/kernels/cuda).
//
//   bench_cuda_kernels [--csv FILE] [--reps N] [--quick] [--decode-only] [--chain-only]
//                      [--no-graph] [--only SUBSTR] [--tokens T] [--l2-warm]
//
// Every measurement: warm-up, then N (default 30) timed repetitions, each bracketed by
// CUDA events; the median is reported ("eager": one launch from the host per
// repetition, host launch overhead included). Decode kernels are also timed as the
// engine runs them: kGraphN launches (rotating weight copies) captured in one CUDA graph,
// replayed; "graph" = median replay time / kGraphN (the GPU time per launch including
// the inter-kernel gap, without host overhead). Weights are rotated among several device copies
// whose total is well above the 60 MB L2, so that each repetition streams from HBM
// (--l2-warm: one copy, which stays in L2 when it fits: what the kernels do fed from L2).
// Weight contents are random bytes (the kernels' cost does not depend on the values).
//   GB/s    = weight bytes read (data + scales) / time (GEMV, MoE, router)
//   %copy   = GB/s / device-to-device copy bandwidth (bytes read + written / time)
//   TFLOP/s = 2 * T * N * K / time (GEMM)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <vector>

#ifdef DSX_HAVE_CUDA
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/quant_act.h"
#include "kernels/cuda/router.h"

using namespace dsx;
using dsx::cuda::DeviceBuffer;
using dsx::cuda::DType;

namespace {

struct Row {
  std::string name, shape;
  int T = 0;
  double us = 0, gus = 0, gbs = 0, pct = 0, tflops = 0;
};
std::vector<Row> g_rows;
double g_copy_gbs = 0;
int g_reps = 30;
cudaStream_t g_stream = nullptr;
constexpr int kGraphN = 20;
double g_last_graph_us = 0;  // graph time of the last time_us call (0: not measured)
bool g_graph = true;
std::string g_only;        // --only: run only rows whose "name shape" contains this
int g_only_T = 0;          // --tokens: run only this T (0: all)
bool g_l2_warm = false;    // --l2-warm: one copy of each weight (it stays in L2 when it fits)
bool selected(const std::string& name, const std::string& shape, int T) {
  if (g_only_T > 0 && T != g_only_T) return false;
  return g_only.empty() || (name + " " + shape).find(g_only) != std::string::npos;
}

// Fills a device buffer with pseudo-random bytes (a 16 MB random block replicated).
void fill_random(void* dst, size_t bytes, uint64_t seed) {
  static std::vector<uint8_t> block;
  static DeviceBuffer dblock;
  const size_t B = 16u << 20;
  if (block.empty()) {
    block.resize(B);
    std::mt19937_64 rng(12345);
    for (size_t i = 0; i < B; i += 8) {
      uint64_t r = rng();
      std::memcpy(block.data() + i, &r, 8);
    }
    dblock.alloc(B);
    dblock.upload(block.data(), B);
  }
  const size_t rot = (seed * 7919) % (B / 2);
  for (size_t off = 0; off < bytes; off += B / 2) {
    const size_t n = std::min(B / 2, bytes - off);
    DSX_CUDA_CHECK(cudaMemcpy(static_cast<char*>(dst) + off, dblock.as<char>() + rot, n, cudaMemcpyDeviceToDevice));
  }
}
void fill_byte(void* dst, size_t bytes, int v) { DSX_CUDA_CHECK(cudaMemset(dst, v, bytes)); }

// Median time in microseconds of fn(rep) over g_reps repetitions after 3 warm-ups
// (eager launches on g_stream). With graph = true also the graph time per launch
// (kGraphN calls fn(0..kGraphN-1) captured in one graph), left in g_last_graph_us.
double time_us(const std::function<void(int)>& fn, bool graph = false) {
  cudaEvent_t a, b;
  DSX_CUDA_CHECK(cudaEventCreate(&a));
  DSX_CUDA_CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) fn(i);
  DSX_CUDA_CHECK(cudaStreamSynchronize(g_stream));
  std::vector<double> t;
  for (int r = 0; r < g_reps; ++r) {
    DSX_CUDA_CHECK(cudaEventRecord(a, g_stream));
    fn(r + 3);
    DSX_CUDA_CHECK(cudaEventRecord(b, g_stream));
    DSX_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.0);
  }
  std::sort(t.begin(), t.end());
  g_last_graph_us = 0;
  if (graph && g_graph) {
    cudaGraph_t gr = nullptr;
    cudaGraphExec_t ge = nullptr;
    DSX_CUDA_CHECK(cudaStreamBeginCapture(g_stream, cudaStreamCaptureModeThreadLocal));
    for (int i = 0; i < kGraphN; ++i) fn(i);
    DSX_CUDA_CHECK(cudaStreamEndCapture(g_stream, &gr));
    DSX_CUDA_CHECK(cudaGraphInstantiate(&ge, gr, 0));
    std::vector<double> tg;
    for (int r = 0; r < std::max(5, g_reps / 3) + 2; ++r) {
      DSX_CUDA_CHECK(cudaEventRecord(a, g_stream));
      DSX_CUDA_CHECK(cudaGraphLaunch(ge, g_stream));
      DSX_CUDA_CHECK(cudaEventRecord(b, g_stream));
      DSX_CUDA_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      if (r >= 2) tg.push_back(ms * 1000.0 / kGraphN);
    }
    std::sort(tg.begin(), tg.end());
    g_last_graph_us = tg[tg.size() / 2];
    DSX_CUDA_CHECK(cudaGraphExecDestroy(ge));
    DSX_CUDA_CHECK(cudaGraphDestroy(gr));
  }
  DSX_CUDA_CHECK(cudaEventDestroy(a));
  DSX_CUDA_CHECK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

// Bandwidth row; when a graph time was measured, GB/s and %copy are from it.
void add_bw(const std::string& name, const std::string& shape, int T, double us, double bytes) {
  Row r;
  r.name = name;
  r.shape = shape;
  r.T = T;
  r.us = us;
  r.gus = g_last_graph_us;
  const double tu = r.gus > 0 ? r.gus : us;
  r.gbs = bytes / (tu * 1e-6) / 1e9;
  r.pct = g_copy_gbs > 0 ? 100.0 * r.gbs / g_copy_gbs : 0;
  g_rows.push_back(r);
  std::printf("%-28s %-22s T=%-3d eager %8.2f us  graph %8.2f us %9.1f GB/s %6.1f %%copy\n", name.c_str(),
              shape.c_str(), T, us, r.gus, r.gbs, r.pct);
  std::fflush(stdout);
}
void add_flops(const std::string& name, const std::string& shape, int T, double us, double flops) {
  Row r;
  r.name = name;
  r.shape = shape;
  r.T = T;
  r.us = us;
  r.tflops = flops / (us * 1e-6) / 1e12;
  g_rows.push_back(r);
  std::printf("%-28s %-22s T=%-5d %10.2f us %9.1f TFLOP/s\n", name.c_str(), shape.c_str(), T, us, r.tflops);
  std::fflush(stdout);
}

std::string shp(int64_t N, int64_t K) { return "[" + std::to_string(N) + "," + std::to_string(K) + "]"; }

// Several device copies of a random weight, enough to defeat the L2.
struct Copies {
  std::vector<DeviceBuffer> data, scale;
  std::vector<QMatrix> q;
  int64_t bytes = 0;
  Copies(WFormat f, int64_t N, int64_t K, int B = 32, size_t min_total = 512u << 20) {
    QMatrix shape;
    shape.fmt = f;
    shape.rows = N;
    shape.cols = K;
    shape.block = B;
    shape.name = "bench";
    const int64_t db = shape.data_bytes(), sb = shape.scale_bytes();
    bytes = db + sb;
    const int n = g_l2_warm ? 1 : static_cast<int>(std::max<int64_t>(2, (static_cast<int64_t>(min_total) + bytes - 1) / bytes));
    for (int i = 0; i < n; ++i) {
      data.emplace_back(static_cast<size_t>(db));
      fill_random(data.back().get(), static_cast<size_t>(db), static_cast<uint64_t>(i));
      QMatrix m = shape;
      m.data = data.back().as<uint8_t>();
      if (sb > 0) {
        scale.emplace_back(static_cast<size_t>(sb));
        fill_byte(scale.back().get(), static_cast<size_t>(sb), f == WFormat::FP8_BLOCK ? 116 : 121);
        m.scale = scale.back().as<uint8_t>();
      }
      q.push_back(m);
    }
  }
  const QMatrix& at(int rep) const { return q[static_cast<size_t>(rep) % q.size()]; }
};

// The routed experts of one MoE layer as random device bytes (scale bytes set to a
// realistic 121), with the per-expert pointer arrays MoeLayer takes, and copies of the
// shared expert (FP8) totalling at least shared_min_total bytes each.
struct RandomExperts {
  int E;
  int64_t D, I;
  int64_t per_expert;  // bytes of one routed expert: w1, w3, w2 with their scales
  DeviceBuffer experts, parr[6];
  Copies s1, s3, s2;
  RandomExperts(int E_, int64_t D_, int64_t I_, uint64_t seed, size_t shared_min_total)
      : E(E_), D(D_), I(I_), per_expert(2 * (I_ * D_ / 2 + I_ * D_ / 32) + D_ * I_ / 2 + D_ * I_ / 32),
        s1(WFormat::FP8_BLOCK, I_, D_, 32, shared_min_total), s3(WFormat::FP8_BLOCK, I_, D_, 32, shared_min_total),
        s2(WFormat::FP8_BLOCK, D_, I_, 32, shared_min_total) {
    const int64_t b13 = I * D / 2, s13 = I * D / 32, b2 = D * I / 2, sc2 = D * I / 32;
    experts.alloc(static_cast<size_t>(per_expert * E));
    fill_random(experts.get(), experts.size(), seed);
    std::vector<const uint8_t*> p[6];
    for (int e = 0; e < E; ++e) {
      uint8_t* base = experts.as<uint8_t>() + static_cast<int64_t>(e) * per_expert;
      const uint8_t* ptrs[6] = {base, base + b13, base + b13 + s13, base + 2 * b13 + s13, base + 2 * (b13 + s13),
                                base + 2 * (b13 + s13) + b2};
      for (int i = 0; i < 6; ++i) p[i].push_back(ptrs[i]);
      fill_byte(base + b13, static_cast<size_t>(s13), 121);
      fill_byte(base + 2 * b13 + s13, static_cast<size_t>(s13), 121);
      fill_byte(base + 2 * (b13 + s13) + b2, static_cast<size_t>(sc2), 121);
    }
    for (int i = 0; i < 6; ++i) {
      parr[i].alloc(static_cast<size_t>(E) * sizeof(void*));
      parr[i].upload(p[i].data(), parr[i].size());
    }
  }
  // The layer with shared-expert copy `rep`.
  cuda::MoeLayer layer(int rep) const {
    cuda::MoeLayer L;
    L.n_experts = E;
    L.hidden = D;
    L.inter = I;
    L.w1 = parr[0].as<const uint8_t*>();
    L.w1_scale = parr[1].as<const uint8_t*>();
    L.w3 = parr[2].as<const uint8_t*>();
    L.w3_scale = parr[3].as<const uint8_t*>();
    L.w2 = parr[4].as<const uint8_t*>();
    L.w2_scale = parr[5].as<const uint8_t*>();
    L.shared_w1 = s1.at(rep);
    L.shared_w3 = s3.at(rep);
    L.shared_w2 = s2.at(rep);
    return L;
  }
  double shared_bytes() const { return static_cast<double>(s1.bytes + s3.bytes + s2.bytes); }
};

void bench_copy() {
  const size_t n = 1u << 30;
  DeviceBuffer a(n), b(n);
  fill_byte(a.get(), n, 1);
  const double us =
      time_us([&](int) { DSX_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice, g_stream)); });
  g_copy_gbs = 2.0 * n / (us * 1e-6) / 1e9;
  std::printf("%-28s %-22s         %10.2f us %9.1f GB/s (read + write)\n", "memcpy D2D", "1 GiB", us, g_copy_gbs);
  Row r;
  r.name = "memcpy_d2d";
  r.shape = "1GiB";
  r.us = us;
  r.gbs = g_copy_gbs;
  r.pct = 100;
  g_rows.push_back(r);
}

void bench_gemv(const std::string& name, WFormat f, int64_t N, int64_t K, std::initializer_list<int> Ts, DType xt,
                DType yt, cuda::GemvOpts o = {}, bool split = false) {
  Copies W(f, N, K);
  const int G = o.groups;
  const int Tmax = 16;
  DeviceBuffer x(static_cast<size_t>(Tmax * G * K) * 4), y(static_cast<size_t>(Tmax * N) * 4);
  fill_byte(x.get(), x.size(), 0x3c);  // 0x3c3c3c3c: ~0.0115 (f32) / 0.0115 (bf16 pairs)
  DeviceBuffer ws;
  for (int T : Ts) {
    if (!selected(name, shp(N, K), T)) continue;
    cuda::GemvOpts oo = o;
    if (split) {
      const size_t b = cuda::gemv_split_ws_bytes(W.at(0), T, oo);
      if (b) {
        ws.alloc(b);
        oo.split_ws = ws.as<float>();
        oo.split_ws_bytes = b;
      }
    }
    const double us = time_us(
        [&](int r) { cuda::gemv(W.at(r), xt, x.get(), static_cast<int64_t>(G) * K, T, yt, y.get(), N, oo, g_stream); },
        T <= 16);
    add_bw(name, shp(N, K), T, us, static_cast<double>(W.bytes));
  }
}

void bench_router() {
  const int64_t E = 384, D = 5120;
  if (!selected("router (gemv+top6)", shp(E, D), 1)) return;
  Copies W(WFormat::BF16, E, D);
  DeviceBuffer x(static_cast<size_t>(D) * 2), bias(static_cast<size_t>(E) * 4), z(static_cast<size_t>(E) * 16 * 4),
      ids(64 * 4), w(64 * 4);
  fill_byte(x.get(), x.size(), 0x3c);
  fill_byte(bias.get(), bias.size(), 0);
  cuda::RouterOpts ro;
  const double us = time_us(
      [&](int r) {
        cuda::router(DType::BF16, x.get(), D, 1, W.at(r), bias.as<float>(), 6, ro, z.as<float>(), ids.as<int32_t>(),
                     w.as<float>(), g_stream);
      },
      true);
  add_bw("router (gemv+top6)", shp(E, D), 1, us, static_cast<double>(W.bytes));
}

void bench_moe_decode(bool quick) {
  const int E = quick ? 64 : 384, topk = 6;
  const int64_t D = 5120, I = 2304;
  if (!selected("moe_decode (6 + shared)", "", g_only_T > 0 ? g_only_T : 1)) return;
  const RandomExperts ex(E, D, I, 99, 256u << 20);
  // routing: a fresh random set of experts per repetition
  const int nsets = 64;
  std::vector<int32_t> ids;
  std::vector<float> wts;
  std::mt19937_64 rng(5);
  std::vector<int32_t> all(static_cast<size_t>(E));
  for (int s = 0; s < nsets; ++s) {
    for (int e = 0; e < E; ++e) all[static_cast<size_t>(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int k = 0; k < topk; ++k) {
      ids.push_back(all[static_cast<size_t>(k)]);
      wts.push_back(0.25f);
    }
  }
  DeviceBuffer dids(ids.size() * 4), dw(wts.size() * 4);
  dids.upload(ids.data(), ids.size() * 4);
  dw.upload(wts.data(), wts.size() * 4);
  DeviceBuffer x(static_cast<size_t>(D) * 2 * 8), y(static_cast<size_t>(D) * 4 * 8);
  fill_byte(x.get(), x.size(), 0x3c);
  for (int T : {1, 2, 4}) {
    if (g_only_T > 0 && T != g_only_T) continue;
    cuda::MoeLayer L = ex.layer(0);
    const size_t wsb = cuda::moe_decode_ws_bytes(L, T, topk);
    DeviceBuffer ws(wsb);
    const double us = time_us(
        [&](int r) {
          L = ex.layer(r);
          const int set = (r * T) % (nsets - T);
          cuda::moe_decode(L, DType::BF16, x.get(), D, T, topk, dids.as<int32_t>() + set * topk,
                           dw.as<float>() + set * topk, DType::BF16, y.get(), D, ws.get(), wsb, g_stream);
        },
        true);
    const double bytes = static_cast<double>(T) * topk * ex.per_expert + ex.shared_bytes();
    add_bw("moe_decode (6 + shared)", "E" + std::to_string(E) + " D5120 I2304", T, us, bytes);
  }
}


// The weight-streaming kernels of one V4.1 decode layer back to back (wq_a, wq_b, wkv,
// wo_a, wo_b, router, MoE; attention-side kernels left out), 4 layers per graph with
// alternating weight copies: time per layer against its weight bytes.
void bench_decode_chain() {
  const int E = 384, topk = 6;
  const int64_t D = 5120, I = 2304;
  std::printf("\n-- decode chain: wq_a, wq_b, wkv, wo_a, wo_b, router, moe (one layer, bf16 mode) --\n");
  Copies wq_a(WFormat::FP8_BLOCK, 1280, D, 32, 1), wq_b(WFormat::FP8_BLOCK, 32768, 1280, 32, 1),
      wkv(WFormat::FP8_BLOCK, 512, D, 32, 1), wo_a(WFormat::FP8_BLOCK, 8192, 4096, 32, 1),
      wo_b(WFormat::FP8_BLOCK, D, 8192, 32, 1), gate(WFormat::BF16, 384, D, 32, 1);
  const RandomExperts ex(E, D, I, 77, 1);
  cuda::MoeLayer L = ex.layer(0);
  DeviceBuffer a(static_cast<size_t>(D) * 4), q(32768 * 4), kv(512 * 4), o(32768 * 4), z(8192 * 4), yb(D * 4),
      bias(384 * 4), logits(384 * 4), ids(64 * 4), w(64 * 4), y2(D * 4);
  fill_byte(a.get(), a.size(), 0x3c);
  fill_byte(q.get(), q.size(), 0x3c);
  fill_byte(o.get(), o.size(), 0x3c);
  fill_byte(z.get(), z.size(), 0x3c);
  fill_byte(bias.get(), bias.size(), 0);
  const size_t wsb = cuda::moe_decode_ws_bytes(L, 1, topk);
  DeviceBuffer ws(wsb);
  cuda::RouterOpts ro;
  const DType bf = DType::BF16;
  auto layer = [&](int r) {
    cuda::GemvOpts g;
    cuda::gemv(wq_a.at(r), bf, a.get(), D, 1, bf, q.get(), 1280, g, g_stream);
    cuda::gemv(wq_b.at(r), bf, q.get(), 1280, 1, bf, o.get(), 32768, g, g_stream);
    cuda::gemv(wkv.at(r), bf, a.get(), D, 1, bf, kv.get(), 512, g, g_stream);
    cuda::GemvOpts go;
    go.qa8 = false;
    go.groups = 8;
    cuda::gemv(wo_a.at(r), bf, o.get(), 32768, 1, bf, z.get(), 8192, go, g_stream);
    cuda::gemv(wo_b.at(r), bf, z.get(), 8192, 1, bf, yb.get(), D, g, g_stream);
    cuda::router(bf, yb.get(), D, 1, gate.at(r), bias.as<float>(), topk, ro, logits.as<float>(), ids.as<int32_t>(),
                 w.as<float>(), g_stream);
    L = ex.layer(r);
    cuda::moe_decode(L, bf, yb.get(), D, 1, topk, ids.as<int32_t>(), w.as<float>(), bf, y2.get(), D, ws.get(), wsb,
                     g_stream);
  };
  const double us = time_us(layer, true);
  const double bytes = static_cast<double>(wq_a.bytes + wq_b.bytes + wkv.bytes + wo_a.bytes + wo_b.bytes + gate.bytes) +
                       ex.shared_bytes() + topk * static_cast<double>(ex.per_expert);
  add_bw("decode chain (1 layer)", "7 weight stages", 1, us, bytes);
  std::printf("   weight bytes per layer %.1f MB; roofline at copy bw %.1f us\n", bytes / 1e6,
              g_copy_gbs > 0 ? bytes / (g_copy_gbs * 1e3) : 0.0);
}

void bench_gemm(const std::string& name, WFormat f, int64_t N, int64_t K, int T, DType mode) {
  Copies W(f, N, K, 32, 1u);  // 2 copies (the GEMM is compute-bound)
  DeviceBuffer x(static_cast<size_t>(T * K) * 4), y(static_cast<size_t>(T * N) * 4);
  fill_byte(x.get(), x.size(), 0x3c);
  const double flops = 2.0 * T * N * K;
  // (a) dense product on a pre-dequantized weight (cached dense weights)
  DeviceBuffer wd(static_cast<size_t>(N * K) * cuda::dtype_size(mode));
  cuda::dequant(W.at(0), mode, wd.get(), nullptr);
  double us = time_us([&](int) {
    cuda::gemm_dense(mode, x.get(), K, T, wd.get(), N, K, mode, y.get(), N, g_stream);
  });
  add_flops(name + (mode == DType::BF16 ? " dense bf16" : " dense f32"), shp(N, K), T, us, flops);
  // (b) the whole linear: dequantize + QA8 + product
  cuda::GemmOpts o;
  o.compute = mode;
  const size_t wsb = cuda::gemm_ws_bytes(W.at(0), T, o);
  DeviceBuffer ws(wsb);
  us = time_us([&](int r) {
    cuda::gemm(W.at(r), mode, x.get(), K, T, mode, y.get(), N, o, ws.get(), wsb, g_stream);
  });
  add_flops(name + (mode == DType::BF16 ? " +dequant bf16" : " +dequant f32"), shp(N, K), T, us, flops);
}

void bench_moe_prefill(int T) {
  const int E = 384, topk = 6;
  const int64_t D = 5120, I = 2304;
  const RandomExperts ex(E, D, I, 7, 1);
  const cuda::MoeLayer L = ex.layer(0);
  std::vector<int32_t> ids;
  std::mt19937_64 rng(3);
  std::vector<int32_t> all(static_cast<size_t>(E));
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) all[static_cast<size_t>(e)] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int k = 0; k < topk; ++k) ids.push_back(all[static_cast<size_t>(k)]);
  }
  std::vector<float> wts(ids.size(), 0.25f);
  DeviceBuffer dids(ids.size() * 4), dw(wts.size() * 4);
  dids.upload(ids.data(), ids.size() * 4);
  dw.upload(wts.data(), wts.size() * 4);
  DeviceBuffer x(static_cast<size_t>(T * D) * 2), y(static_cast<size_t>(T * D) * 2);
  fill_byte(x.get(), x.size(), 0x3c);
  const size_t wsb = cuda::moe_prefill_ws_bytes(L, T, topk);
  DeviceBuffer ws(wsb);
  const int saved = g_reps;
  g_reps = std::min(g_reps, 5);
  const double us = time_us([&](int) {
    cuda::moe_prefill(L, DType::BF16, x.get(), D, T, topk, dids.as<int32_t>(), dw.as<float>(), DType::BF16, y.get(), D,
                      ws.get(), wsb, g_stream);
  });
  g_reps = saved;
  const double flops = 2.0 * T * (topk + 1) * 3.0 * D * I;
  add_flops("moe_prefill (6 + shared)", "E384 D5120 I2304", T, us, flops);
}

void write_csv(const std::string& path) {
  std::ofstream f(path);
  f << "name,shape,T,time_us,graph_us,GBps,pct_copy,TFLOPs\n";
  for (const Row& r : g_rows)
    f << '"' << r.name << "\",\"" << r.shape << "\"," << r.T << ',' << r.us << ',' << r.gus << ',' << r.gbs << ','
      << r.pct << ',' << r.tflops << '\n';
  std::printf("wrote %s\n", path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  std::string csv;
  bool quick = false, decode_only = false, chain_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--csv" && i + 1 < argc)
      csv = argv[++i];
    else if (a == "--reps" && i + 1 < argc)
      g_reps = std::max(1, std::atoi(argv[++i]));
    else if (a == "--quick")
      quick = true;
    else if (a == "--decode-only")
      decode_only = true;
    else if (a == "--chain-only")
      chain_only = true;
    else if (a == "--no-graph")
      g_graph = false;
    else if (a == "--only" && i + 1 < argc)
      g_only = argv[++i];
    else if (a == "--tokens" && i + 1 < argc)
      g_only_T = std::atoi(argv[++i]);
    else if (a == "--l2-warm")
      g_l2_warm = true;
    else {
      std::fprintf(stderr, "usage: %s [--csv FILE] [--reps N] [--quick] [--decode-only] [--chain-only] [--no-graph] [--only SUBSTR] [--tokens T] [--l2-warm]\n", argv[0]);
      return 2;
    }
  }
  if (!cuda::device_available()) {
    std::printf("bench_cuda_kernels: no CUDA device\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    DSX_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s, %d SMs, L2 %d MB, reps %d (median)\n", prop.name, prop.multiProcessorCount,
                prop.l2CacheSize >> 20, g_reps);
    DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    const char* env_names[] = {"DSX_GEMV_MMA", "DSX_MOE_MMA", "DSX_MMA_CVT", "DSX_MMA_U", "DSX_PDL"};
    for (const char* e : env_names) std::printf("%s=%s ", e, std::getenv(e) ? std::getenv(e) : "(unset)");
    std::printf("\n");
    bench_copy();
    if (chain_only) {
      bench_decode_chain();
      if (!csv.empty()) write_csv(csv);
      return 0;
    }

    std::printf("\n-- decode GEMV, FP8_BLOCK weights + fused QA8 (bf16 in / bf16 out) --\n");
    const int64_t fp8_shapes[][2] = {{32768, 1280}, {5120, 8192}, {1280, 5120}, {512, 5120}, {2304, 5120}, {5120, 2304}};
    for (auto& s : fp8_shapes)
      bench_gemv("gemv fp8", WFormat::FP8_BLOCK, s[0], s[1], {1, 2, 4, 8, 16}, DType::BF16, DType::BF16);
    bench_gemv("gemv fp8 f32-mode", WFormat::FP8_BLOCK, 5120, 8192, {1}, DType::F32, DType::F32);

    std::printf("\n-- decode GEMV, MXFP4 weights + fused QA8 --\n");
    bench_gemv("gemv mxfp4", WFormat::MXFP4, 2304, 5120, {1, 4}, DType::BF16, DType::BF16);
    bench_gemv("gemv mxfp4", WFormat::MXFP4, 5120, 2304, {1, 4}, DType::BF16, DType::BF16);

    std::printf("\n-- GEMV, BF16 / F32 weights (no QA8) --\n");
    bench_gemv("gemv bf16 gate", WFormat::BF16, 384, 5120, {1}, DType::BF16, DType::F32);
    bench_gemv("gemv bf16 head", WFormat::BF16, 129280, 5120, {1, 4}, DType::BF16, DType::F32);
    bench_gemv("gemv bf16 compressor", WFormat::BF16, 512, 5120, {1}, DType::F32, DType::F32);
    bench_gemv("gemv bf16 weights_proj", WFormat::BF16, 32, 5120, {1}, DType::BF16, DType::BF16);
    bench_gemv("gemv bf16 weights_proj splitK", WFormat::BF16, 32, 5120, {1}, DType::BF16, DType::BF16, {}, true);
    bench_gemv("gemv f32 hc_fn", WFormat::F32, 24, 20480, {1}, DType::F32, DType::F32);
    bench_gemv("gemv f32 hc_fn splitK", WFormat::F32, 24, 20480, {1}, DType::F32, DType::F32, {}, true);

    std::printf("\n-- grouped wo_a (8 groups, no QA8) --\n");
    cuda::GemvOpts g;
    g.qa8 = false;
    g.groups = 8;
    bench_gemv("wo_a fp8 grouped", WFormat::FP8_BLOCK, 8192, 4096, {1, 4}, DType::BF16, DType::BF16, g);
    bench_gemv("wo_a bf16 grouped", WFormat::BF16, 8192, 4096, {1, 4}, DType::BF16, DType::BF16, g);

    std::printf("\n-- router / MoE decode --\n");
    bench_router();
    bench_moe_decode(quick);

    if (g_only.empty()) bench_decode_chain();
    if (decode_only) {
      if (!csv.empty()) write_csv(csv);
      return 0;
    }
    std::printf("\n-- prefill GEMM (T = 2048) --\n");
    const int T = 2048;
    for (auto& s : fp8_shapes) bench_gemm("gemm fp8", WFormat::FP8_BLOCK, s[0], s[1], T, DType::BF16);
    bench_gemm("gemm mxfp4", WFormat::MXFP4, 2304, 5120, T, DType::BF16);
    bench_gemm("gemm fp8", WFormat::FP8_BLOCK, 1280, 5120, T, DType::F32);
    if (!quick) bench_moe_prefill(T);

    if (!csv.empty()) write_csv(csv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_cuda_kernels: %s\n", e.what());
    return 1;
  }
  return 0;
}

#else
int main() {
  std::printf("bench_cuda_kernels: built without CUDA (DSX_HAVE_CUDA undefined)\n");
  return 0;
}
#endif
