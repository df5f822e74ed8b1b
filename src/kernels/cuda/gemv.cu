#include "kernels/cuda/gemv.h"

#include <algorithm>

#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr size_t kSmemBudget = 100 * 1024;  // activation staging per block (2 blocks / SM)

// Rows per warp and chunks per lane loaded ahead, per format and token tile.
constexpr int tune_rpw(WFormat f, int tt) { return f == WFormat::MXFP4 ? 2 : (tt >= 4 ? 4 : 2); }
constexpr int tune_u(int tt) { return tt <= 2 ? 4 : (tt <= 4 ? 2 : 1); }
constexpr int epc(WFormat f) {
  return f == WFormat::FP8_BLOCK ? 16 : f == WFormat::MXFP4 ? 32 : f == WFormat::BF16 ? 8 : 4;
}

struct Params {
  dev::WView W;
  int64_t N;  // rows per group
  int K;      // inputs per group
  int G;
  int gran;   // K-split granularity (elements)
  int KS;     // warps of a block splitting K
  int KB;     // blocks splitting K
  int rows_per_block;
  int64_t row_groups;
  int Ks_max;  // staged slice length (elements)
  const void* x;
  int xt;
  int64_t ldx;
  int T;
  int qa8, qblock;
  float prescale;
  void* y;
  int yt;
  int64_t ldy;
  float* part;  // KB > 1: partial sums [KB][T][G*N]
};

template <WFormat F, int TT>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const Params p) {
  constexpr int RPW = tune_rpw(F, TT);
  constexpr int U = tune_u(TT);
  constexpr int EPC = epc(F);
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ float red[kWarps][RPW * TT];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = blockIdx.y, kb = blockIdx.z;
  const int wr = warp / p.KS, wk = warp % p.KS;

  // this block's K slice
  const int Ku = p.K / p.gran;
  const int u0 = static_cast<int>(static_cast<int64_t>(Ku) * kb / p.KB);
  const int u1 = static_cast<int>(static_cast<int64_t>(Ku) * (kb + 1) / p.KB);
  const int k0 = u0 * p.gran, Ks = (u1 - u0) * p.gran;
  const int c_base = k0 / EPC, nc = Ks / EPC;
  const int c_lo = c_base + static_cast<int>(static_cast<int64_t>(nc) * wk / p.KS);
  const int c_hi = c_base + static_cast<int>(static_cast<int64_t>(nc) * (wk + 1) / p.KS);
  const int xq = Ks / 4;

  const int64_t GN = static_cast<int64_t>(p.G) * p.N;
  const int64_t grow0 = static_cast<int64_t>(g) * p.N;  // first weight row of the group

  for (int t0 = 0; t0 < p.T; t0 += TT) {
    const int nt = min(TT, p.T - t0);
    __syncthreads();
    dev::stage_rows(xs, TT, Ks, p.x, p.xt, p.ldx, static_cast<int64_t>(t0) * p.ldx + static_cast<int64_t>(g) * p.K + k0,
                    nt, p.qa8, p.qblock, p.prescale);
    __syncthreads();
    for (int64_t rg = blockIdx.x; rg < p.row_groups; rg += gridDim.x) {
      const int64_t n0 = rg * p.rows_per_block + static_cast<int64_t>(wr) * RPW;  // within the group
      float acc[RPW][TT];
#pragma unroll
      for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
      if (n0 < p.N)
        dev::warp_dot<F, RPW, TT, U>(p.W, grow0 + n0, grow0 + p.N - 1, c_lo, c_hi, c_base, smem4, xq, acc, lane);
      dev::warp_reduce<RPW, TT>(acc);

      if (p.KS > 1) {
        if (lane == 0) {
#pragma unroll
          for (int r = 0; r < RPW; ++r)
#pragma unroll
            for (int t = 0; t < TT; ++t) red[warp][r * TT + t] = acc[r][t];
        }
        __syncthreads();
        if (wk == 0) {
          for (int i = lane; i < RPW * TT; i += 32) {
            float s = 0.0f;
            for (int j = 0; j < p.KS; ++j) s += red[warp + j][i];
            const int r = i / TT, t = i % TT;
            const int64_t n = n0 + r;
            if (n < p.N && t < nt) {
              const int64_t tt = t0 + t;
              if (p.KB > 1)
                p.part[(static_cast<int64_t>(kb) * p.T + tt) * GN + grow0 + n] = s;
              else
                dev::store_act(p.y, p.yt, tt * p.ldy + grow0 + n, s);
            }
          }
        }
        __syncthreads();
      } else {
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            if (lane == ((r * TT + t) & 31)) {
              const int64_t n = n0 + r;
              if (n < p.N && t < nt) {
                const int64_t tt = t0 + t;
                if (p.KB > 1)
                  p.part[(static_cast<int64_t>(kb) * p.T + tt) * GN + grow0 + n] = acc[r][t];
                else
                  dev::store_act(p.y, p.yt, tt * p.ldy + grow0 + n, acc[r][t]);
              }
            }
          }
      }
    }
  }
}

// y[t, n] = sum_kb part[kb][t][n], fixed order.
__global__ void split_reduce_kernel(const float* __restrict__ part, int KB, int T, int64_t GN, void* y, int yt,
                                    int64_t ldy) {
  const int64_t total = static_cast<int64_t>(T) * GN;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    for (int kb = 0; kb < KB; ++kb) s += part[kb * total + i];
    const int64_t t = i / GN, n = i % GN;
    dev::store_act(y, yt, t * ldy + n, s);
  }
}

struct Plan {
  int TT = 1, KS = 1, KB = 1, rows_per_block = 2, gran = 32, Ks_max = 0;
  int64_t row_groups = 0;
  size_t smem = 0;
};

Plan make_plan(WFormat f, int64_t N, int K, int G, int T, bool qa8, int qblock, size_t ws_bytes, int sms) {
  Plan pl;
  const int E = epc(f);
  pl.gran = std::max({32, qa8 ? qblock : 32, E});
  const int C = K / E;
  int tt = T <= 1 ? 1 : T <= 2 ? 2 : T <= 4 ? 4 : T <= 8 ? 8 : 16;
  const int64_t target = 2LL * sms;  // blocks wanted
  for (;; tt /= 2) {
    const int rpw = tune_rpw(f, tt);
    int ks_max = 1;
    while (ks_max < kWarps && C / (ks_max * 2) >= 32) ks_max *= 2;
    int ks = 1;
    int64_t rg = 0;
    for (;; ks *= 2) {
      rg = (N + static_cast<int64_t>(kWarps / ks) * rpw - 1) / (static_cast<int64_t>(kWarps / ks) * rpw);
      if (rg * G >= target || ks >= ks_max) break;
    }
    int kb = 1;
    const int64_t blocks = rg * G;
    if (blocks < target && ws_bytes > 0) {
      const int Ku = K / pl.gran;
      int want = static_cast<int>(std::min<int64_t>((target + blocks - 1) / blocks, Ku));
      // keep >= 16 chunks per warp
      want = std::min(want, std::max(1, C / (ks * 16)));
      while (want > 1 && static_cast<size_t>(want) * T * G * N * sizeof(float) > ws_bytes) --want;
      kb = std::max(1, want);
    }
    const int Ku = K / pl.gran;
    const int Ks_max = ((Ku + kb - 1) / kb) * pl.gran;
    const size_t smem = static_cast<size_t>(tt) * Ks_max * sizeof(float);
    if (smem <= kSmemBudget || tt == 1) {
      pl.TT = tt;
      pl.KS = ks;
      pl.KB = kb;
      pl.rows_per_block = (kWarps / ks) * rpw;
      pl.row_groups = rg;
      pl.Ks_max = Ks_max;
      pl.smem = smem;
      return pl;
    }
  }
}

template <WFormat F, int TT>
void launch_tt(Params p, const Plan& pl, cudaStream_t stream) {
  auto kern = gemv_kernel<F, TT>;
  DSX_CHECK(pl.smem <= detail::max_dynamic_smem(kern), "gemv: K=", p.K,
            " needs more shared memory than a block can have (", pl.smem, " bytes)");
  const int occ = detail::occupancy(kern, kThreads, pl.smem);
  const int64_t resident = static_cast<int64_t>(occ) * sm_count();
  const int64_t planes = static_cast<int64_t>(p.G) * p.KB;
  const int64_t total = detail::balanced_blocks(p.row_groups * planes, resident);
  const int64_t bx = std::max<int64_t>(1, std::min<int64_t>(p.row_groups, (total + planes - 1) / planes));
  DSX_CHECK(p.G <= 65535 && p.KB <= 65535, "gemv: too many groups / splits");
  dim3 grid(static_cast<unsigned>(bx), static_cast<unsigned>(p.G), static_cast<unsigned>(p.KB));
  kern<<<grid, kThreads, pl.smem, stream>>>(p);
  DSX_CUDA_CHECK(cudaGetLastError());
}

template <WFormat F>
void launch_fmt(Params p, const Plan& pl, cudaStream_t stream) {
  switch (pl.TT) {
    case 1: return launch_tt<F, 1>(p, pl, stream);
    case 2: return launch_tt<F, 2>(p, pl, stream);
    case 4: return launch_tt<F, 4>(p, pl, stream);
    case 8: return launch_tt<F, 8>(p, pl, stream);
    default: return launch_tt<F, 16>(p, pl, stream);
  }
}

bool uses_qa8(const QMatrix& W, const GemvOpts& o) {
  return o.qa8 && (W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4);
}

void check_args(const QMatrix& W, const GemvOpts& o) {
  DSX_CHECK(W.data != nullptr, "gemv ", W.name, ": no weight data");
  DSX_CHECK(detail::aligned16(W.data), "gemv ", W.name, ": weight data must be 16-byte aligned");
  DSX_CHECK(W.cols > 0 && W.cols % 32 == 0, "gemv ", W.name, ": K=", W.cols, " must be a multiple of 32");
  DSX_CHECK(W.cols <= (1 << 30), "gemv ", W.name, ": K too large");
  DSX_CHECK(o.groups >= 1 && W.rows % o.groups == 0, "gemv ", W.name, ": rows ", W.rows, " not divisible by groups ",
            o.groups);
  if (uses_qa8(W, o))
    DSX_CHECK((o.qblock == 32 || o.qblock == 64 || o.qblock == 128) && W.cols % o.qblock == 0, "gemv ", W.name,
              ": bad QA8 block ", o.qblock);
  if (W.fmt == WFormat::FP8_BLOCK) {
    DSX_CHECK(W.scale != nullptr, "gemv ", W.name, ": FP8 weight without scales");
    DSX_CHECK(W.block == 32 || W.block == 64 || W.block == 128, "gemv ", W.name, ": FP8 tile must be 32/64/128");
    DSX_CHECK(o.groups == 1 || (W.rows / o.groups) % W.block == 0, "gemv ", W.name,
              ": grouped FP8 rows per group must be a multiple of the tile");
  }
  if (W.fmt == WFormat::MXFP4) DSX_CHECK(W.scale != nullptr, "gemv ", W.name, ": MXFP4 weight without scales");
}

int log2i(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

}  // namespace

size_t gemv_split_ws_bytes(const QMatrix& W, int T, const GemvOpts& o) {
  const int G = o.groups;
  const Plan pl = make_plan(W.fmt, W.rows / G, static_cast<int>(W.cols), G, T, uses_qa8(W, o), o.qblock,
                            static_cast<size_t>(-1) / 2, sm_count());
  return pl.KB > 1 ? static_cast<size_t>(pl.KB) * T * W.rows * sizeof(float) : 0;
}

void gemv(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
          const GemvOpts& o, cudaStream_t stream) {
  if (T <= 0 || W.rows <= 0) return;
  check_args(W, o);
  const int G = o.groups;
  const bool qa8 = uses_qa8(W, o);
  const int K = static_cast<int>(W.cols);
  const int64_t N = W.rows / G;
  DSX_CHECK(ldx >= static_cast<int64_t>(G) * K && ldy >= W.rows, "gemv ", W.name, ": bad row strides");
  const Plan pl = make_plan(W.fmt, N, K, G, T, qa8, o.qblock, o.split_ws ? o.split_ws_bytes : 0, sm_count());

  Params p{};
  p.W.w = W.data;
  p.W.s = W.scale;
  switch (W.fmt) {
    case WFormat::FP8_BLOCK:
      p.W.row_bytes = W.cols;
      p.W.sc_cols = static_cast<int>((W.cols + W.block - 1) / W.block);
      p.W.wshift = log2i(W.block);
      break;
    case WFormat::MXFP4:
      p.W.row_bytes = W.cols / 2;
      p.W.sc_cols = static_cast<int>(W.cols / 32);
      break;
    case WFormat::BF16: p.W.row_bytes = W.cols * 2; break;
    case WFormat::F32: p.W.row_bytes = W.cols * 4; break;
  }
  p.N = N;
  p.K = K;
  p.G = G;
  p.gran = pl.gran;
  p.KS = pl.KS;
  p.KB = pl.KB;
  p.rows_per_block = pl.rows_per_block;
  p.row_groups = pl.row_groups;
  p.Ks_max = pl.Ks_max;
  p.x = x;
  p.xt = static_cast<int>(xt);
  p.ldx = ldx;
  p.T = T;
  p.qa8 = qa8 ? 1 : 0;
  p.qblock = o.qblock;
  p.prescale = (W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4) ? dev::kTrickPrescale : 1.0f;
  p.y = y;
  p.yt = static_cast<int>(yt);
  p.ldy = ldy;
  p.part = pl.KB > 1 ? o.split_ws : nullptr;

  switch (W.fmt) {
    case WFormat::FP8_BLOCK: launch_fmt<WFormat::FP8_BLOCK>(p, pl, stream); break;
    case WFormat::MXFP4: launch_fmt<WFormat::MXFP4>(p, pl, stream); break;
    case WFormat::BF16: launch_fmt<WFormat::BF16>(p, pl, stream); break;
    case WFormat::F32: launch_fmt<WFormat::F32>(p, pl, stream); break;
  }
  if (pl.KB > 1) {
    const int64_t total = static_cast<int64_t>(T) * W.rows;
    const int64_t blocks = std::min<int64_t>((total + 255) / 256, static_cast<int64_t>(sm_count()) * 8);
    split_reduce_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(o.split_ws, pl.KB, T, W.rows, y,
                                                                           static_cast<int>(yt), ldy);
    DSX_CUDA_CHECK(cudaGetLastError());
  }
}

}  // namespace dsx::cuda
