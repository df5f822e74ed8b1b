#include "kernels/cuda/hc.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "kernels/cuda/pdl_device.cuh"
#include "kernels/cuda/signal_device.cuh"
#include "kernels/cuda/gemv.h"         // staged_act_words
#include "kernels/cuda/gemv_device.cuh"  // stage_block_lanes
#include "kernels/cuda/gemv_launch.h"  // pdl_enabled
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

constexpr int kM = kHcStreams;
constexpr int kWide = 128;                          // columns per block of the wide pass (T >= kWideT), one per thread
constexpr int kWideT = 32;                          // token count from which the wide pass is used
constexpr int kNarrow = 32;                         // columns per block of the narrow pass (T < kWideT), one per lane
constexpr int kNarrowWarps = 2;                     // warps per narrow block (with Φ)
constexpr int kOutPerWarp = kHcMix / kNarrowWarps;  // Φ rows per warp of a narrow block
constexpr int kFinishThreads = 128;                 // hc_finish block; norm blocks cover 128 columns
constexpr int kFinishWarps = kFinishThreads / 32;
constexpr int kZPerWarp = kHcMix / (kFinishWarps - 1);  // z sums per warp of the mix block (the last: Σx²)
static_assert(kHcMix % kNarrowWarps == 0 && kHcMix % (kFinishWarps - 1) == 0, "hc work split");

// Workspace: z partials [T][24][ns] f32, then the Σx² / Σc² partials [T][2][ns] f64
// (partial i comes from column chunk i; rows are contiguous so that hc_finish reads
// them coalesced).
size_t z_bytes(int T, int ns) { return ((static_cast<size_t>(T) * ns * kHcMix * sizeof(float)) + 15) & ~size_t{15}; }
size_t work_bytes(int T, int ns) { return z_bytes(T, ns) + static_cast<size_t>(T) * ns * 2 * sizeof(double); }

struct PassParams {
  int T;
  int64_t D;
  int ns;
  void* X;
  const void* y;
  const float* post;
  const float* comb;
  const float* fn;
  const float* pre;
  void* collapsed;
  float* wz;
  double* wss;
  unsigned* sig;  // HcPassArgs::wait_signal
  bool inputs_ready;  // HcPassArgs::inputs_ready
};

// Narrow pass (T < kWideT, decode): block (chunk of 32 columns, token t); warp g holds
// the 12 Φ rows [12g, 12g + 12) of its 32 columns in registers (48 loads per lane,
// issued before the grid-dependency wait). Both warps compute the expand (warp 0
// stores it) so that each owns its 12 dot products; warp 0 does Σx², the collapse and Σc².
template <typename T>
__global__ void __launch_bounds__(32 * kNarrowWarps) hc_pass_narrow_kernel(const PassParams p) {
  const int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
  const int chunk = blockIdx.x, t = blockIdx.y;
  const int64_t D = p.D, F = kM * D;
  const int64_t d = static_cast<int64_t>(chunk) * kNarrow + lane;
  const float* __restrict__ fn = p.fn;
  float ph[kOutPerWarp][kM];
  if (fn) {  // weights: independent of the previous kernels
    const float* f = fn + static_cast<int64_t>(g) * kOutPerWarp * F + d;
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o)
#pragma unroll
      for (int m = 0; m < kM; ++m) ph[o][m] = f[o * F + m * D];
  }
  // post / comb / pre from a kernel on another stream (its mix blocks signal, one per token)
  if (p.sig) signal_wait_block(p.sig, static_cast<unsigned>(p.T));
  T* Xt = static_cast<T*>(p.X) + static_cast<int64_t>(t) * F;
  float x[kM], pr[kM], cm[kM * kM], pm[kM];
  auto load_state = [&]() {
#pragma unroll
    for (int m = 0; m < kM; ++m) x[m] = ld(Xt, m * D + d);
    if (p.pre) {
#pragma unroll
      for (int m = 0; m < kM; ++m) pr[m] = p.pre[t * kM + m];
    }
    if (p.y) {
#pragma unroll
      for (int i = 0; i < kM * kM; ++i) cm[i] = p.comb[t * kM * kM + i];
#pragma unroll
      for (int m = 0; m < kM; ++m) pm[m] = p.post[t * kM + m];
    }
  };
  // (HcPassArgs::inputs_ready: X, post, comb and pre are complete; only y is the
  // previous kernel's, so the rest loads before the wait)
  const bool early = p.inputs_ready && p.y;
  if (early) load_state();
  // (dependents launch early: this kernel reads no weights after the wait and they
  // wait for all of it; their weights may stream meanwhile)
  pdl_launch_dependents();
  pdl_wait();  // y, and unless early X, post, comb, pre, come from the previous kernels
  if (!early) load_state();
  if (p.y) {
    const float yv = ld(static_cast<const T*>(p.y), static_cast<int64_t>(t) * D + d);
    float nx[kM];
#pragma unroll
    for (int k = 0; k < kM; ++k) {
      float mixed = 0.0f;
#pragma unroll
      for (int j = 0; j < kM; ++j) mixed = fmaf(cm[j * kM + k], x[j], mixed);
      nx[k] = rnd<T>(fmaf(pm[k], yv, mixed));
    }
    // every warp has read (and used) its X values before warp 0 overwrites them
    if (blockDim.x > 32) __syncthreads();
#pragma unroll
    for (int k = 0; k < kM; ++k) {
      if (g == 0) st(Xt, k * D + d, nx[k]);
      x[k] = nx[k];
    }
  }
  if (fn) {
    float acc[kOutPerWarp];
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) {
      float a = 0.0f;
#pragma unroll
      for (int m = 0; m < kM; ++m) a = fmaf(ph[o][m], x[m], a);
      acc[o] = a;
    }
#pragma unroll
    for (int o = 0; o < kOutPerWarp; ++o) acc[o] = warp_sum(acc[o]);
    if (lane == 0) {
      float* wz = p.wz + (static_cast<int64_t>(t) * kHcMix + g * kOutPerWarp) * p.ns + chunk;
#pragma unroll
      for (int o = 0; o < kOutPerWarp; ++o) wz[o * p.ns] = acc[o];
    }
  }
  if (g == 0) {
    double ssx = 0.0, ssc = 0.0;
    if (fn) {
#pragma unroll
      for (int m = 0; m < kM; ++m) ssx += static_cast<double>(x[m]) * static_cast<double>(x[m]);
    }
    if (p.pre) {
      float c = 0.0f;
#pragma unroll
      for (int m = 0; m < kM; ++m) c = fmaf(pr[m], x[m], c);
      c = rnd<T>(c);
      st(static_cast<T*>(p.collapsed), static_cast<int64_t>(t) * D + d, c);
      ssc = static_cast<double>(c) * static_cast<double>(c);
    }
    ssx = warp_sum(ssx);
    ssc = warp_sum(ssc);
    if (lane == 0) {
      double* wss = p.wss + static_cast<int64_t>(t) * 2 * p.ns + chunk;
      wss[0] = ssx;
      wss[p.ns] = ssc;
    }
  }
}

// Warp sums of the 24 mix values in 24 shuffles (12 + 6 + 3 + 2 + 1: at each step the
// lanes of one half keep one half of their values and receive the other half's partner
// sums; 3 values are padded to 4 before the fourth step). Lane l ends with the warp
// total of value mix24_index(l), valid when l % 4 < 3 (24 lanes). The separate butterfly
// of each value took 120 shuffles per token and warp, most of the prefill pass's issue
// slots (one shuffle per clock per SM against four FMAs).
__device__ __forceinline__ int mix24_index(int lane) {
  return ((lane >> 4) & 1) * 12 + ((lane >> 3) & 1) * 6 + ((lane >> 2) & 1) * 3 + (lane & 3);
}
__device__ __forceinline__ float warp_sum24_scatter(const float (&v)[kHcMix], int lane) {
  static_assert(kHcMix == 24, "the halving steps are for 24 values");
  float a[12], b[6], c[4], d[2];
  bool up = (lane & 16) != 0;
#pragma unroll
  for (int j = 0; j < 12; ++j) a[j] = (up ? v[j + 12] : v[j]) + __shfl_xor_sync(kFull, up ? v[j] : v[j + 12], 16);
  up = (lane & 8) != 0;
#pragma unroll
  for (int j = 0; j < 6; ++j) b[j] = (up ? a[j + 6] : a[j]) + __shfl_xor_sync(kFull, up ? a[j] : a[j + 6], 8);
  up = (lane & 4) != 0;
#pragma unroll
  for (int j = 0; j < 3; ++j) c[j] = (up ? b[j + 3] : b[j]) + __shfl_xor_sync(kFull, up ? b[j] : b[j + 3], 4);
  c[3] = 0.0f;
  up = (lane & 2) != 0;
#pragma unroll
  for (int j = 0; j < 2; ++j) d[j] = (up ? c[j + 2] : c[j]) + __shfl_xor_sync(kFull, up ? c[j] : c[j + 2], 2);
  up = (lane & 1) != 0;
  return (up ? d[1] : d[0]) + __shfl_xor_sync(kFull, up ? d[0] : d[1], 1);
}

// Wide pass (prefill): block (chunk of 128 columns, TT tokens), one column per thread,
// Φ of the column (96 values) in registers for the TT tokens.
template <typename T, int TT>
__global__ void __launch_bounds__(kWide) hc_pass_wide_kernel(const PassParams p) {
  __shared__ float red_z[kWide / 32][kHcMix];
  __shared__ double red_d[kWide / 32][2];
  const int64_t D = p.D, F = kM * D;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kWide + threadIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float* __restrict__ fn = p.fn;
  const float* __restrict__ post = p.post;
  const float* __restrict__ comb = p.comb;
  const float* __restrict__ pre = p.pre;
  float ph[kHcMix][kM];
  if (fn) {
#pragma unroll
    for (int o = 0; o < kHcMix; ++o)
#pragma unroll
      for (int m = 0; m < kM; ++m) ph[o][m] = fn[o * F + m * D + d];
  }
  pdl_launch_dependents();
  pdl_wait();
  for (int tt = 0; tt < TT; ++tt) {
    const int t = blockIdx.y * TT + tt;
    if (t >= p.T) break;  // uniform across the block
    T* Xt = static_cast<T*>(p.X) + static_cast<int64_t>(t) * F;
    float x[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) x[m] = ld(Xt, m * D + d);
    if (p.y) {
      const float yv = ld(static_cast<const T*>(p.y), static_cast<int64_t>(t) * D + d);
      const float* C = comb + t * kM * kM;
      const float* P = post + t * kM;
      float nx[kM];
#pragma unroll
      for (int k = 0; k < kM; ++k) {
        float mixed = 0.0f;
#pragma unroll
        for (int j = 0; j < kM; ++j) mixed = fmaf(C[j * kM + k], x[j], mixed);
        nx[k] = rnd<T>(fmaf(P[k], yv, mixed));
      }
#pragma unroll
      for (int k = 0; k < kM; ++k) {
        st(Xt, k * D + d, nx[k]);
        x[k] = nx[k];
      }
    }
    double ssx = 0.0, ssc = 0.0;
    if (fn) {
#pragma unroll
      for (int m = 0; m < kM; ++m) ssx += static_cast<double>(x[m]) * static_cast<double>(x[m]);
      float acc[kHcMix];
#pragma unroll
      for (int o = 0; o < kHcMix; ++o) {
        float a = 0.0f;
#pragma unroll
        for (int m = 0; m < kM; ++m) a = fmaf(ph[o][m], x[m], a);
        acc[o] = a;
      }
      const float z = warp_sum24_scatter(acc, lane);
      if ((lane & 3) < 3) red_z[warp][mix24_index(lane)] = z;
    }
    if (pre) {
      float c = 0.0f;
#pragma unroll
      for (int m = 0; m < kM; ++m) c = fmaf(pre[t * kM + m], x[m], c);
      c = rnd<T>(c);
      st(static_cast<T*>(p.collapsed), static_cast<int64_t>(t) * D + d, c);
      ssc = static_cast<double>(c) * static_cast<double>(c);
    }
    {  // both sums in one butterfly: lanes 0-15 end with Σx², lanes 16-31 with Σc²
      const bool up = (lane & 16) != 0;
      double s2 = (up ? ssc : ssx) + __shfl_xor_sync(kFull, up ? ssx : ssc, 16);
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) s2 += __shfl_xor_sync(kFull, s2, o);
      if ((lane & 15) == 0) red_d[warp][lane >> 4] = s2;
    }
    __syncthreads();
    if (fn && threadIdx.x < kHcMix) {
      float s = red_z[0][threadIdx.x];
      for (int w = 1; w < kWide / 32; ++w) s += red_z[w][threadIdx.x];
      p.wz[(static_cast<int64_t>(t) * kHcMix + threadIdx.x) * p.ns + blockIdx.x] = s;
    }
    if (threadIdx.x == 0) {
      double a = red_d[0][0], b = red_d[0][1];
      for (int w = 1; w < kWide / 32; ++w) {
        a += red_d[w][0];
        b += red_d[w][1];
      }
      p.wss[static_cast<int64_t>(t) * 2 * p.ns + blockIdx.x] = a;
      p.wss[(static_cast<int64_t>(t) * 2 + 1) * p.ns + blockIdx.x] = b;
    }
    __syncthreads();  // red_* is reused by the next token
  }
}

// Sums of K rows of n partials (row k at rows + k * stride), the same value in every
// lane of the warp. Fixed order: lane l adds elements l, l + 32, l + 64, ... of a row in
// sequence, then the warp butterfly. kU loads per row and lane are issued before any is
// added (all of a row's loads at once for n <= 32 kU).
template <int K, typename V>
__device__ __forceinline__ void sum_partials(const V* __restrict__ rows, int64_t stride, int n, V (&s)[K]) {
  constexpr int kU = 8;
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = V(0);
  for (int b = 0; b < n; b += 32 * kU) {
    V v[K][kU];
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int i = b + u * 32 + lane;
        const V r = rows[k * stride + (i < n ? i : 0)];  // unconditional: no branch between the loads
        v[k][u] = i < n ? r : V(0);
      }
#pragma unroll
    for (int k = 0; k < K; ++k)
#pragma unroll
      for (int u = 0; u < kU; ++u) s[k] += v[k][u];
  }
#pragma unroll
  for (int k = 0; k < K; ++k) s[k] = warp_sum(s[k]);
}

struct FinishParams {
  int64_t D;
  int ns;
  int mix_blocks;  // 1 when the pass had Φ (block 0 of each token computes the mix), else 0
  const float* wz;
  const double* wss;
  const float* base;
  const float* scale;
  float eps;
  float hc_eps;
  int iters;
  float* pre_out;
  float* post_out;
  float* comb_out;
  const void* collapsed;
  const float* w;
  void* out;
  uint8_t* qc;
  float* qs;
  uint32_t* staged;  // T = 1 (HcFinishArgs::staged)
  unsigned* signal;  // HcFinishArgs::signal (mix block)
};

// grid (mix_blocks + D / 128, T). Block 0 (with the mix): the 24 z sums (8 per warp on
// warps 0-2) and Σx² (warp 3) from the partials, each warp with all its loads in flight
// at once, then the coefficients and the Sinkhorn on warp 0. The
// other blocks: RMSNorm of 128 columns of the collapsed row (each warp sums the Σc²
// partials itself) and their QA8 codes. The two parts are independent, so the norm runs
// beside the Sinkhorn instead of after it.
template <typename T>
__global__ void __launch_bounds__(kFinishThreads) hc_finish_kernel(const FinishParams p) {
  const int t = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (static_cast<int>(blockIdx.x) < p.mix_blocks) {
    __shared__ float z[kHcMix];
    __shared__ double s_ssx;
    const int e = lane < kM * kM ? lane : 0;  // lanes >= 16 mirror element 0 (results unused)
    const int j = e / kM, k = e % kM;
    // β, α: weights, read before the grid-dependency wait
    const float b_pre = p.base[lane & (kM - 1)], b_post = p.base[kM + (lane & (kM - 1))];
    const float b_comb = p.base[2 * kM + e];
    const float a0 = p.scale[0], a1 = p.scale[1], a2 = p.scale[2];
    pdl_launch_dependents();
    pdl_wait();
    if (warp < kFinishWarps - 1) {  // z rows [8 warp, 8 warp + 8)
      float zs[kZPerWarp];
      sum_partials<kZPerWarp>(p.wz + (static_cast<int64_t>(t) * kHcMix + warp * kZPerWarp) * p.ns, p.ns, p.ns, zs);
      if (lane == 0)
#pragma unroll
        for (int i = 0; i < kZPerWarp; ++i) z[warp * kZPerWarp + i] = zs[i];
    } else {  // Σx²
      double ss[1];
      sum_partials<1>(p.wss + static_cast<int64_t>(t) * 2 * p.ns, 0, p.ns, ss);
      if (lane == 0) s_ssx = ss[0];
    }
    __syncthreads();
    // Warp 0: lane (j, k) = j * kM + k owns comb[j][k]; every sum is formed in the
    // same sequential order as the CPU engine (values gathered by shuffles), so the
    // result is bit-identical to the single-thread form, without its ~1.3k serially
    // dependent divisions.
    if (warp == 0) {
      const float nu = 1.0f / sqrtf(static_cast<float>(s_ssx / static_cast<double>(kM * p.D)) + p.eps);
      if (lane < kM) {
        p.pre_out[t * kM + lane] = sigmoid_dev(fmaf(z[lane] * nu, a0, b_pre)) + p.hc_eps;
        p.post_out[t * kM + lane] = 2.0f * sigmoid_dev(fmaf(z[kM + lane] * nu, a1, b_post));
      }
      const float hc_eps = p.hc_eps;
      float c = fmaf(z[2 * kM + e] * nu, a2, b_comb);
      constexpr unsigned kAll = 0xffffffffu;
      auto row_sum = [&](float v) {  // sum over k of C[j][k], k ascending
        float r = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kM; ++kk) r += __shfl_sync(kAll, v, j * kM + kk);
        return r;
      };
      auto col_sum = [&](float v) {  // sum over j of C[j][k], j ascending
        float r = 0.0f;
#pragma unroll
        for (int jj = 0; jj < kM; ++jj) r += __shfl_sync(kAll, v, jj * kM + k);
        return r;
      };
      float mx = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < kM; ++kk) mx = fmaxf(mx, __shfl_sync(kAll, c, j * kM + kk));
      c = expf(c - mx);
      c = c / row_sum(c) + hc_eps;
      c /= (col_sum(c) + hc_eps);
      for (int it = 1; it < p.iters; ++it) {
        c /= (row_sum(c) + hc_eps);
        c /= (col_sum(c) + hc_eps);
      }
      if (lane < kM * kM) p.comb_out[t * kM * kM + lane] = c;
    }
    if (p.signal) signal_block(p.signal);
    return;
  }
  // RMSNorm block
  const int64_t d = static_cast<int64_t>(blockIdx.x - p.mix_blocks) * kFinishThreads + threadIdx.x;
  const float wv = p.w[d];  // weight, read before the wait
  pdl_launch_dependents();
  pdl_wait();
  const int64_t row = static_cast<int64_t>(t) * p.D;
  const float c = ld(static_cast<const T*>(p.collapsed), row + d);
  double ss[1];
  sum_partials<1>(p.wss + (static_cast<int64_t>(t) * 2 + 1) * p.ns, 0, p.ns, ss);
  const float r = 1.0f / sqrtf(static_cast<float>(ss[0] / static_cast<double>(p.D)) + p.eps);
  const float v = rnd<T>(wv * (c * r));
  st(static_cast<T*>(p.out), row + d, v);
  if (p.qc) {
    const QCode q = fq8_group(v);
    p.qc[row + d] = q.code;
    if (lane == 0) p.qs[t * (p.D / 32) + d / 32] = q.scale;
  }
  if (p.staged) {  // (T = 1) a warp holds one 32-element block: element = lane
    const int64_t kb = d / 32, nb = p.D / 32, w4 = staged_act_words(p.D);
    StageAlso mx;  // (the MXFP4 order, after the FP8 one)
    mx.bs = p.staged + w4 + kb * 16;
    mx.sas = reinterpret_cast<float*>(p.staged + w4 + nb * 16) + kb;
    mx.prescale = kMx4MmaPrescale;
    stage_block_lanes<WFormat::FP8_BLOCK>(v, lane, p.staged + kb * 16, reinterpret_cast<float*>(p.staged + nb * 16) + kb,
                                          fp8_mma_prescale<true>(), nullptr, &mx);
  }
}

template <typename T>
__global__ void hc_mean_kernel(int64_t D, const T* __restrict__ X, T* __restrict__ out) {
  const int t = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const T* Xt = X + static_cast<int64_t>(t) * kM * D;
  float s = 0.0f;
  for (int m = 0; m < kM; ++m) s += ld(Xt, m * D + d);
  st(out, static_cast<int64_t>(t) * D + d, s * (1.0f / kM));
}

// Launch with programmatic stream serialization when `pdl` (the kernels wait on the
// previous grid before touching its outputs).
template <typename P>
void launch(void (*kern)(P), dim3 grid, dim3 block, bool pdl, cudaStream_t stream, const P& p) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = 0;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  DSX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kern, p));
}

}  // namespace

int hc_splits(int T, int64_t D) {
  return T < kWideT ? static_cast<int>(D / kNarrow) : static_cast<int>(D / kWide);
}

size_t hc_work_bytes(int T, int64_t D) {
  return std::max(work_bytes(T, static_cast<int>(D / kWide)),
                  work_bytes(std::min(T, kWideT - 1), static_cast<int>(D / kNarrow)));
}

void hc_pass(Act act, const HcPassArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.D % kWide == 0, "hc_pass: hidden size must be a multiple of ", kWide);
  DSX_CHECK(!a.y || (a.post && a.comb), "hc_pass: expand needs post and comb");
  DSX_CHECK(!a.pre || a.collapsed, "hc_pass: collapse needs an output");
  DSX_CHECK(a.work, "hc_pass: no workspace");
  PassParams p{};
  p.T = a.T;
  p.D = a.D;
  p.ns = hc_splits(a.T, a.D);
  p.X = a.X;
  p.y = a.y;
  p.post = a.post;
  p.comb = a.comb;
  p.fn = a.fn;
  p.pre = a.pre;
  p.collapsed = a.collapsed;
  p.wz = static_cast<float*>(a.work);
  p.wss = reinterpret_cast<double*>(static_cast<char*>(a.work) + z_bytes(a.T, p.ns));
  DSX_CHECK(!a.wait_signal || a.T < kWideT, "hc_pass: a signal wait is for the narrow (decode) pass");
  p.sig = a.wait_signal;
  p.inputs_ready = a.inputs_ready;
  const bool pdl = pdl_enabled();
  DSX_DISPATCH_ACT(act, T, {
    if (a.T < kWideT) {
      const dim3 grid(static_cast<unsigned>(p.ns), static_cast<unsigned>(a.T));
      launch(hc_pass_narrow_kernel<T>, grid, dim3(a.fn ? 32 * kNarrowWarps : 32), pdl, stream, p);
    } else {
      launch(hc_pass_wide_kernel<T, 8>, dim3(static_cast<unsigned>(p.ns), static_cast<unsigned>((a.T + 7) / 8)),
             dim3(kWide), pdl, stream, p);
    }
  });
  check_launch("hc_pass");
}

void hc_finish(Act act, const HcFinishArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.D % kWide == 0, "hc_finish: hidden size must be a multiple of ", kWide);
  DSX_CHECK(!a.have_mix || (a.base && a.scale && a.pre && a.post && a.comb), "hc_finish: mix outputs missing");
  DSX_CHECK(!a.norm_out || (a.collapsed && a.norm_w), "hc_finish: norm inputs missing");
  DSX_CHECK((a.q_codes == nullptr) == (a.q_scales == nullptr), "hc_finish: give both QA8 outputs or neither");
  FinishParams p{};
  p.D = a.D;
  p.ns = hc_splits(a.T, a.D);
  p.mix_blocks = a.have_mix ? 1 : 0;
  p.wz = static_cast<const float*>(a.work);
  p.wss = reinterpret_cast<const double*>(static_cast<const char*>(a.work) + z_bytes(a.T, p.ns));
  p.base = a.base;
  p.scale = a.scale;
  p.eps = a.norm_eps;
  p.hc_eps = a.hc_eps;
  p.iters = a.sinkhorn_iters;
  p.pre_out = a.pre;
  p.post_out = a.post;
  p.comb_out = a.comb;
  p.collapsed = a.collapsed;
  p.w = a.norm_w;
  p.out = a.norm_out;
  p.qc = a.q_codes;
  p.qs = a.q_scales;
  DSX_CHECK(!a.staged || (a.T == 1 && a.norm_out), "hc_finish: staged activations are for one token with the norm");
  p.staged = a.staged;
  DSX_CHECK(!a.signal || (a.have_mix && !a.norm_out), "hc_finish: a signal is for a mix-only launch");
  p.signal = a.signal;
  const int blocks = p.mix_blocks + (a.norm_out ? static_cast<int>(a.D / kFinishThreads) : 0);
  if (blocks == 0) return;
  DSX_DISPATCH_ACT(act, T,
                   launch(hc_finish_kernel<T>, dim3(static_cast<unsigned>(blocks), static_cast<unsigned>(a.T)),
                          dim3(kFinishThreads), pdl_enabled(), stream, p));
  check_launch("hc_finish");
}

void hc_stream_mean(Act act, int T, int64_t D, const void* X, void* out, cudaStream_t stream) {
  if (T <= 0) return;
  dim3 grid(static_cast<unsigned>((D + 255) / 256), T);
  DSX_DISPATCH_ACT(act, T_, hc_mean_kernel<T_><<<grid, 256, 0, stream>>>(D, static_cast<const T_*>(X),
                                                                          static_cast<T_*>(out)));
  check_launch("hc_stream_mean");
}

}  // namespace dsx::cuda
