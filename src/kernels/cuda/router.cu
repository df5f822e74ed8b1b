#include "kernels/cuda/router.h"

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/pdl_device.cuh"
#include "kernels/cuda/signal_device.cuh"
#include "kernels/cuda/quant_act_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxE = 1024;
constexpr int kMaxK = 16;

__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

// s = sqrt(softplus(z / gate_temp)) (PyTorch softplus, threshold 20). One expression for
// both kernels, so that the fused and the two-launch router agree bit for bit.
__device__ __forceinline__ float route_score(float z, float gate_temp) {
  const float v = z / gate_temp;
  const float sp = v > 20.0f ? v : log1pf(expf(v));
  return sqrtf(sp);
}

// One block per token.
__global__ void __launch_bounds__(kThreads)
    router_select_kernel(const float* __restrict__ z, int64_t ldz, int E, const float* __restrict__ bias, int topk,
                         float gate_temp, int norm, float route_scale, int32_t* __restrict__ ids,
                         float* __restrict__ weights) {
  __shared__ float sc[kMaxE], biased[kMaxE];
  __shared__ unsigned char taken[kMaxE];
  __shared__ float wv[kThreads / 32];
  __shared__ int wi[kThreads / 32];
  __shared__ int chosen[kMaxK];
  const int t = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int e = threadIdx.x; e < E; e += kThreads) {
    const float s = route_score(z[t * ldz + e], gate_temp);
    sc[e] = s;
    biased[e] = bias ? s + bias[e] : s;
    taken[e] = 0;
  }
  __syncthreads();
  for (int k = 0; k < topk; ++k) {
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int e = threadIdx.x; e < E; e += kThreads)
      if (!taken[e] && (bi == 0x7fffffff || better(biased[e], e, bv, bi))) {
        bv = biased[e];
        bi = e;
      }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(dev::kFull, bv, o);
      const int oi = __shfl_xor_sync(dev::kFull, bi, o);
      if (oi != 0x7fffffff && (bi == 0x7fffffff || better(ov, oi, bv, bi))) {
        bv = ov;
        bi = oi;
      }
    }
    if (lane == 0) {
      wv[warp] = bv;
      wi[warp] = bi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float v = wv[0];
      int i = wi[0];
      for (int w = 1; w < kThreads / 32; ++w)
        if (wi[w] != 0x7fffffff && (i == 0x7fffffff || better(wv[w], wi[w], v, i))) {
          v = wv[w];
          i = wi[w];
        }
      chosen[k] = i;
      taken[i] = 1;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int k = 0; k < topk; ++k) sum += sc[chosen[k]];
    for (int k = 0; k < topk; ++k) {
      float w = sc[chosen[k]];
      if (norm && topk > 1) w = w / (sum + 1e-20f);
      ids[t * topk + k] = chosen[k];
      weights[t * topk + k] = w * route_scale;
    }
  }
}

// ---- fused decode router (T <= 8): gate product and selection in one launch ----------
//
// Gate product: block b owns gate rows [R b, R b + R); its 256 threads split the row into
// 8-element chunks (thread i: chunks i, i + 256, ...), each thread keeps the chunks of
// all R rows for up to NI iterations in flight (issued before the grid-dependency wait:
// the weights do not depend on the previous kernel), f32 FMAs for all T tokens; the
// per-thread sums are reduced in a fixed order (warp butterfly, then warps 0..7), so
// identical gate rows give bit-identical logits.
//
// Selection: the last block to finish its logits ("last block done": fence, then one
// atomic ticket per block on a counter in device memory that the last block resets to 0
// for the next launch / graph replay) ranks the experts of every token; a token gets
// W = 8 / TT warps ("group"). Ranking key: (biased score as ordered bits, ~expert id),
// so the key order is the order of router_select_kernel (descending score, ties -> lower
// id) and all keys are distinct. Exact top-k without a serial k loop:
//   1. thread j of the group holds the keys of experts j, j + 32 W, ... and their max m;
//   2. per warp theta_w = the topk-th largest m of its 32 lanes (0 if fewer than topk
//      lanes hold an expert); theta = max over the group's warps. At least topk keys are
//      >= theta, so every top-k expert has key >= theta, and so does every expert better
//      than a candidate: ranking the candidates (key >= theta) among themselves gives
//      their global ranks. Per warp at most topk lanes have m >= theta, so there are at
//      most topk * W * ceil(E / (32 W)) <= 16 * 32 = kCandCap candidates (random logits,
//      E = 384, topk = 6: ~23 for one token (W = 8), ~7 per token for 5..8 tokens);
//   3. a candidate's rank = #candidates with a larger key (counted by the thread holding
//      it, which also has its s for the weights); rank < topk -> slot rank.
constexpr int kFusedMaxT = 8;
constexpr int kCandCap = 512;

struct FusedParams {
  const uint8_t* w;  // gate [E, D] (BF16 or F32), rows 16-byte aligned
  int64_t row_bytes;
  int E;
  int cpr;  // 8-element chunks per row (D / 8)
  const void* x;
  int xt;  // 0: f32, 1: bf16
  int64_t ldx;
  int T;
  float* z;  // logits [T, E]
  const float* bias;
  int topk;
  float gate_temp;
  int norm;
  float route_scale;
  int32_t* ids;
  float* weights;
  unsigned* counter;  // zero between launches
};

constexpr int ilog2(int n) { return n <= 1 ? 0 : 1 + ilog2(n / 2); }

// Warp sums of N values at once (N a power of two <= 32) in N - 1 + 5 - log2(N) shuffles:
// butterfly halving (step S: lanes differing in bit 4 - S swap halves, each keeps one),
// then plain butterfly sums. Lane l ends with the warp total of v[l >> (5 - log2 N)];
// every total is summed over the same tree (pairs of lanes differing in bit 4, then 3, ...).
template <int N, int S = 0>
__device__ __forceinline__ float warp_sum_scatter(float (&v)[N], int lane) {
  static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "N must be a power of two <= 32");
  if constexpr ((N >> S) > 1) {
    constexpr int o = 16 >> S, h = N >> (S + 1);
    const bool up = (lane & o) != 0;
#pragma unroll
    for (int j = 0; j < h; ++j) {
      const float send = up ? v[j] : v[j + h];
      const float keep = up ? v[j + h] : v[j];
      v[j] = keep + __shfl_xor_sync(dev::kFull, send, o);
    }
    return warp_sum_scatter<N, S + 1>(v, lane);
  } else {
    float r = v[0];
#pragma unroll
    for (int o = 16 >> S; o > 0; o >>= 1) r += __shfl_xor_sync(dev::kFull, r, o);
    return r;
  }
}

// Ranking key of expert e with biased score b: a larger key is a better expert (higher
// score, ties -> lower id); distinct for distinct e and never 0. -0 ranks as +0 (they
// compare equal as floats) and NaN as -inf.
__device__ __forceinline__ unsigned long long rank_key(float b, int e) {
  uint32_t u = __float_as_uint(b);
  if ((u & 0x7fffffffu) > 0x7f800000u) u = 0xff800000u;  // NaN -> -inf
  if (u == 0x80000000u) u = 0u;                          // -0 -> +0
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);        // float order -> unsigned order
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - static_cast<uint32_t>(e));
}

// Barrier of the nthreads threads (whole warps) of group g; ids 1..8 (0 is __syncthreads).
__device__ __forceinline__ void group_sync(int g, int nthreads) {
  if (nthreads == 32) {
    __syncwarp();
  } else {
    asm volatile("bar.sync %0, %1;" ::"r"(g + 1), "r"(nthreads) : "memory");
  }
}

// F: gate format (BF16 / F32); TT: token tile (T <= TT); R: gate rows per block. XS:
// the T rows of x staged in shared memory as f32 after the grid-dependency wait (dynamic
// shared memory, [T][2][cpr] float4: a thread's chunk is two conflict-free loads), one
// round trip for all rows; without it every (chunk, row) loads its 8 values from global
// memory where it is used, a chain of T dependent round trips per chunk for T rows
// (the same values either way: the logits do not change).
template <WFormat F, int TT, int R, bool XS>
__global__ void __launch_bounds__(kThreads, 1) router_fused_kernel(const FusedParams p) {
  constexpr int LPC = F == WFormat::BF16 ? 1 : 2;  // 16-byte loads per 8-element chunk
  constexpr int NI = (F == WFormat::BF16 ? 4 : 2) / (TT >= 8 ? 2 : 1);  // iterations in flight
  constexpr int N = R * TT;
  constexpr int SH = 5 - ilog2(N);    // warp_sum_scatter: lane l holds value l >> SH
  constexpr int W = kWarps / TT;      // selection: warps per token
  constexpr int G = 32 * W;           // threads per token
  // SM: the selection reads the scores from shared memory, staged there by the whole
  // block (TT >= 2; with keys in registers, the unrolled code for kMaxE / G experts per
  // thread made kernels of 110 - 210 KB whose instructions were all cold fetches: 27 us
  // at TT = 8 for 6 tokens of 8 experts under ncu, against 5 us at TT = 1)
  constexpr bool SM = TT >= 2;
  constexpr int PMAX = SM ? 1 : kMaxE / G;  // experts per thread (registers)
  __shared__ float red[kWarps][N];
  __shared__ unsigned long long cand[TT][kCandCap];
  __shared__ unsigned long long th[kWarps];
  __shared__ int ncand[TT];
  __shared__ int sel[TT][kMaxK];
  __shared__ float ssel[TT][kMaxK];
  __shared__ int is_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row0 = static_cast<int>(blockIdx.x) * R;
  const int nit = (p.cpr + kThreads - 1) / kThreads;

  // ---- logits of rows row0 .. row0 + R - 1
  uint4 wv[NI][R][LPC];
  auto load = [&](int i0) {
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = tid + (i0 + i) * kThreads;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const bool ok = c < p.cpr && row0 + r < p.E;
        const uint8_t* src = p.w + (ok ? (row0 + r) * p.row_bytes + static_cast<int64_t>(c) * (16 * LPC) : 0);
#pragma unroll
        for (int l = 0; l < LPC; ++l) wv[i][r][l] = dev::ldg_stream_pred(src + 16 * l, ok);
      }
    }
  };
  load(0);  // before the wait: the gate does not depend on the previous kernel
  // (and the bias of the experts this thread ranks if its block is the last)
  const int g = warp / W, j = tid - g * G;
  float bias_pre[PMAX];
#pragma unroll
  for (int q = 0; q < PMAX; ++q) {
    const int e = j + q * G;
    bias_pre[q] = !SM && p.bias && e < p.E ? p.bias[e] : 0.0f;
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();  // the MoE kernel waits for all of this kernel anyway
  extern __shared__ float4 xs4[];
  if constexpr (XS) {
    for (int i = tid; i < p.T * p.cpr; i += kThreads) {
      const int t = i / p.cpr, c = i - t * p.cpr;
      float v[8];
      dev::load_act8(p.x, p.xt, static_cast<int64_t>(t) * p.ldx + static_cast<int64_t>(c) * 8, v);
      xs4[(2 * t) * p.cpr + c] = make_float4(v[0], v[1], v[2], v[3]);
      xs4[(2 * t + 1) * p.cpr + c] = make_float4(v[4], v[5], v[6], v[7]);
    }
    __syncthreads();
  }

  float acc[R][TT];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;
  for (int i0 = 0; i0 < nit; i0 += NI) {
    if (i0 > 0) load(i0);
#pragma unroll
    for (int i = 0; i < NI; ++i) {
      const int c = tid + (i0 + i) * kThreads;
      if (c >= p.cpr) continue;
      float wf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if constexpr (F == WFormat::BF16) {
          const uint32_t u[4] = {wv[i][r][0].x, wv[i][r][0].y, wv[i][r][0].z, wv[i][r][0].w};
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            wf[r][2 * q] = __uint_as_float(u[q] << 16);
            wf[r][2 * q + 1] = __uint_as_float(u[q] & 0xffff0000u);
          }
        } else {
#pragma unroll
          for (int l = 0; l < 2; ++l) {
            wf[r][4 * l] = __uint_as_float(wv[i][r][l].x);
            wf[r][4 * l + 1] = __uint_as_float(wv[i][r][l].y);
            wf[r][4 * l + 2] = __uint_as_float(wv[i][r][l].z);
            wf[r][4 * l + 3] = __uint_as_float(wv[i][r][l].w);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < TT; ++t) {
        if (t >= p.T) break;
        float xv[8];  // x[t, 8c .. 8c + 8)
        if constexpr (XS) {
          const float4 lo = xs4[(2 * t) * p.cpr + c], hi = xs4[(2 * t + 1) * p.cpr + c];
          xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w;
          xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z, xv[7] = hi.w;
        } else {
          dev::load_act8(p.x, p.xt, static_cast<int64_t>(t) * p.ldx + static_cast<int64_t>(c) * 8, xv);
        }
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[r][t] = fmaf(wf[r][j], xv[j], acc[r][t]);
      }
    }
  }
  {
    float v[N];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) v[r * TT + t] = acc[r][t];
    const float tot = warp_sum_scatter<N>(v, lane);
    if ((lane & ((1 << SH) - 1)) == 0) red[warp][lane >> SH] = tot;
  }
  // (selection state of the last block, cleared by every block: one barrier less)
  if (tid < TT) ncand[tid] = 0;
  for (int i = tid; i < TT * kMaxK; i += kThreads) {  // (ids stay in range whatever happens)
    sel[i / kMaxK][i % kMaxK] = 0;
    ssel[i / kMaxK][i % kMaxK] = 0.0f;
  }
  __syncthreads();
  if (tid < N) {
    const int r = tid / TT, t = tid % TT;
    if (t < p.T && row0 + r < p.E) {
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[w][tid];
      __stcg(p.z + static_cast<int64_t>(t) * p.E + row0 + r, s);
    }
  }

  dev::trace_mark(41);
  // ---- last block done: every block publishes its logits (barrier, then thread 0's
  // acquire-release ticket, dev::last_block_arrive); the block drawing the last ticket
  // resets the counter and reads the logits of all blocks from L2. The
  // counter is touched only after pdl_wait, i.e. after the previous launch has completed
  // (and reset it), even when router launches follow each other directly.
  __syncthreads();
  if (tid == 0) is_last = dev::last_block_arrive(p.counter, gridDim.x) ? 1 : 0;
  __syncthreads();
  dev::trace_mark(42, is_last != 0);
  if (!is_last) return;

  // ---- selection: group g (warps g W .. g W + W - 1) ranks token g's experts
  // (SM: the biased scores b and the scores s of all T x E logits in shared memory,
  // after the x rows when those are staged)
  float* const bsm = reinterpret_cast<float*>(xs4 + (XS ? 2 * p.T * p.cpr : 0));
  float* const ssm = bsm + p.T * p.E;
  if constexpr (SM) {
    const int n = p.T * p.E;
#pragma unroll 4
    for (int i = tid; i < n; i += kThreads) {
      const int e = i - (i / p.E) * p.E;
      const float sc = route_score(__ldcg(p.z + i), p.gate_temp);
      ssm[i] = sc;
      bsm[i] = p.bias ? sc + __ldg(p.bias + e) : sc;
    }
    __syncthreads();
  }
  if (g >= p.T) return;  // (whole groups: the group barriers below stay consistent)
  if constexpr (SM) {
    const float* bg = bsm + g * p.E;
    unsigned long long m = 0;
    for (int e = j; e < p.E; e += G) {
      const unsigned long long k = rank_key(bg[e], e);
      m = k > m ? k : m;
    }
    // theta_w: the m with exactly topk - 1 larger ones in the warp (the m != 0 are distinct)
    int larger = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) larger += __shfl_sync(dev::kFull, m, l) > m;
    const unsigned hit = __ballot_sync(dev::kFull, larger == p.topk - 1 && m != 0);
    const unsigned long long theta_w = hit ? __shfl_sync(dev::kFull, m, __ffs(hit) - 1) : 0ull;
    if (lane == 0) th[warp] = theta_w;
    group_sync(g, G);
    unsigned long long theta = 0;
#pragma unroll
    for (int w = 0; w < W; ++w) theta = th[g * W + w] > theta ? th[g * W + w] : theta;
    unsigned long long* cg = cand[g];
    for (int e = j; e < p.E; e += G) {
      const unsigned long long k = rank_key(bg[e], e);
      if (k >= theta) {
        const int pos = atomicAdd(&ncand[g], 1);
        if (pos < kCandCap) cg[pos] = k;
      }
    }
    group_sync(g, G);
    // a candidate's rank = #candidates with a larger key; rank < topk -> slot rank
    const int n = min(ncand[g], kCandCap);
    for (int e = j; e < p.E; e += G) {
      const unsigned long long k = rank_key(bg[e], e);
      if (k < theta) continue;
      int rank = 0;
      for (int l0 = 0; l0 < n; l0 += 8) {
        unsigned long long c8[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) c8[u] = cg[l0 + u];  // (within kCandCap; entries >= n masked below)
#pragma unroll
        for (int u = 0; u < 8; ++u) rank += (l0 + u < n && c8[u] > k) ? 1 : 0;
      }
      if (rank < p.topk) {
        sel[g][rank] = e;
        ssel[g][rank] = ssm[g * p.E + e];
      }
    }
  } else {
    const float* zt = p.z + static_cast<int64_t>(g) * p.E;
    unsigned long long key[PMAX];  // 0: no expert
    float sv[PMAX];
    unsigned long long m = 0;
#pragma unroll
    for (int q = 0; q < PMAX; ++q) {
      const int e = j + q * G;
      key[q] = 0;
      sv[q] = 0.0f;
      if (e < p.E) {
        sv[q] = route_score(__ldcg(zt + e), p.gate_temp);
        key[q] = rank_key(p.bias ? sv[q] + bias_pre[q] : sv[q], e);
        m = key[q] > m ? key[q] : m;
      }
    }
    dev::trace_mark(44, g == 0);  // (trace builds: z loaded and scored)
    // theta_w: the m with exactly topk - 1 larger ones in the warp (the m != 0 are distinct)
    int larger = 0;
#pragma unroll
    for (int l = 0; l < 32; ++l) larger += __shfl_sync(dev::kFull, m, l) > m;
    const unsigned hit = __ballot_sync(dev::kFull, larger == p.topk - 1 && m != 0);
    const unsigned long long theta_w = hit ? __shfl_sync(dev::kFull, m, __ffs(hit) - 1) : 0ull;
    if (lane == 0) th[warp] = theta_w;
    group_sync(g, G);
    dev::trace_mark(45, g == 0);  // (theta)
    unsigned long long theta = 0;
#pragma unroll
    for (int w = 0; w < W; ++w) theta = th[g * W + w] > theta ? th[g * W + w] : theta;
    unsigned long long* cg = cand[g];
#pragma unroll
    for (int q = 0; q < PMAX; ++q)
      if (key[q] != 0 && key[q] >= theta) {
        const int pos = atomicAdd(&ncand[g], 1);
        if (pos < kCandCap) cg[pos] = key[q];
      }
    group_sync(g, G);
    dev::trace_mark(46, g == 0);  // (candidates)
    // each candidate's owner ranks it; rank < topk -> slot rank (with its s, for the weights)
    const int n = min(ncand[g], kCandCap);
#pragma unroll
    for (int q = 0; q < PMAX; ++q)
      if (key[q] != 0 && key[q] >= theta) {
        // (8 loads in flight at a time: a loop of dependent shared loads took ~1 us, timeline)
        int rank = 0;
        for (int l0 = 0; l0 < n; l0 += 8) {
          unsigned long long c8[8];
#pragma unroll
          for (int u = 0; u < 8; ++u) c8[u] = cg[l0 + u];  // (within kCandCap; entries >= n masked below)
#pragma unroll
          for (int u = 0; u < 8; ++u) rank += (l0 + u < n && c8[u] > key[q]) ? 1 : 0;
        }
        if (rank < p.topk) {
          sel[g][rank] = j + q * G;
          ssel[g][rank] = sv[q];
        }
      }
  }
  group_sync(g, G);
  dev::trace_mark(43, g == 0);
  // weights as router_select_kernel: the sum in slot order
  if (j < p.topk) {
    float sv8[kMaxK];
#pragma unroll
    for (int k = 0; k < kMaxK; ++k) sv8[k] = ssel[g][k];  // (all loads at once; unused slots hold 0)
    float sum = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxK; ++k)
      if (k < p.topk) sum += sv8[k];
    float w = ssel[g][j];
    if (p.norm && p.topk > 1) w = w / (sum + 1e-20f);
    p.ids[g * p.topk + j] = sel[g][j];
    p.weights[g * p.topk + j] = w * p.route_scale;
  }
}

template <WFormat F, int TT, int R>
void launch_fused_r(const FusedParams& p, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((p.E + R - 1) / R);
  // the staged scores of the selection (TT >= 2: router_fused_kernel, SM)
  const size_t sel_bytes = TT >= 2 ? static_cast<size_t>(p.T) * p.E * 8 : 0;
  // several rows: x staged in shared memory when it fits (router_fused_kernel, XS)
  if constexpr (TT > 1) {
    const size_t xs_bytes = static_cast<size_t>(p.T) * p.cpr * 32 + sel_bytes;
    if (xs_bytes <= detail::max_dynamic_smem(router_fused_kernel<F, TT, R, true>)) {
      detail::launch_pdl(router_fused_kernel<F, TT, R, true>, dim3(blocks), dim3(kThreads), xs_bytes, stream, p);
      return;
    }
  }
  if constexpr (TT >= 2)
    DSX_CHECK(sel_bytes <= detail::max_dynamic_smem(router_fused_kernel<F, TT, R, false>), "router: ", p.T, " x ",
              p.E, " scores exceed a block's shared memory");
  detail::launch_pdl(router_fused_kernel<F, TT, R, false>, dim3(blocks), dim3(kThreads), sel_bytes, stream, p);
}

template <WFormat F, int TT>
void launch_fused_tt(const FusedParams& p, cudaStream_t stream) {
  // 4 rows per block from E = 384 (96 blocks: the 3.9 MB gate of V4.1 streams with all of
  // it in flight at once), else 2
  if (p.E >= 384)
    launch_fused_r<F, TT, 4>(p, stream);
  else
    launch_fused_r<F, TT, 2>(p, stream);
}

template <WFormat F>
void launch_fused(const FusedParams& p, cudaStream_t stream) {
  if (p.T <= 1) return launch_fused_tt<F, 1>(p, stream);
  if (p.T <= 2) return launch_fused_tt<F, 2>(p, stream);
  if (p.T <= 4) return launch_fused_tt<F, 4>(p, stream);
  launch_fused_tt<F, 8>(p, stream);
}

// The "blocks done" counter of the fused kernel for one logits buffer: a session owns
// its logits buffer and orders its router calls on its stream, so keying by (device,
// buffer) gives concurrent sessions (streams) separate counters. Allocated and zeroed
// on the first call for a buffer (kept for the life of the process: 4 bytes each); the
// kernel leaves it at 0, so graph replays find it zeroed. nullptr when the buffer is new
// and the stream is being captured (the allocation would break the capture): that call
// takes the two-launch path.
unsigned* fused_counter(const float* logits, cudaStream_t stream) {
  return static_cast<unsigned*>(persistent_scratch(logits, 0, sizeof(unsigned), stream));
}

}  // namespace

void router_select(const float* z, int64_t ldz, int T, int E, const float* bias, int topk, const RouterOpts& o,
                   int32_t* ids, float* weights, cudaStream_t stream) {
  if (T <= 0) return;
  DSX_CHECK(E >= 1 && E <= kMaxE, "router: E=", E, " outside 1..", kMaxE);
  DSX_CHECK(topk >= 1 && topk <= kMaxK && topk <= E, "router: bad topk ", topk);
  router_select_kernel<<<static_cast<unsigned>(T), kThreads, 0, stream>>>(z, ldz, E, bias, topk, o.gate_temp,
                                                                         o.norm_topk_prob ? 1 : 0, o.route_scale,
                                                                         ids, weights);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void router(DType xt, const void* x, int64_t ldx, int T, const QMatrix& gate, const float* bias, int topk,
            const RouterOpts& o, float* logits, int32_t* ids, float* weights, cudaStream_t stream) {
  DSX_CHECK(gate.fmt == WFormat::BF16 || gate.fmt == WFormat::F32, "router: gate must be BF16 or F32");
  const int64_t E = gate.rows, D = gate.cols;
  // 9..16 rows: the fused kernel twice (rows 0..7, then the rest), each row's logits,
  // ids and weights those of a one-row call (the gate GEMV of the two-launch path sums
  // in another order than the fused kernel)
  if (T > kFusedMaxT && T <= 2 * kFusedMaxT && E <= kMaxE && D % 8 == 0 && detail::aligned16(gate.data) &&
      fused_counter(logits, stream) && fused_counter(logits + kFusedMaxT * E, stream)) {
    const int64_t xo = static_cast<int64_t>(kFusedMaxT) * ldx * static_cast<int64_t>(dtype_size(xt));
    router(xt, x, ldx, kFusedMaxT, gate, bias, topk, o, logits, ids, weights, stream);
    router(xt, static_cast<const uint8_t*>(x) + xo, ldx, T - kFusedMaxT, gate, bias, topk, o,
           logits + kFusedMaxT * E, ids + kFusedMaxT * topk, weights + kFusedMaxT * topk, stream);
    return;
  }
  if (T >= 1 && T <= kFusedMaxT && E >= 1 && E <= kMaxE && D > 0 && D % 8 == 0 &&
      D <= (int64_t{1} << 30) && detail::aligned16(gate.data)) {
    DSX_CHECK(topk >= 1 && topk <= kMaxK && topk <= E, "router: bad topk ", topk);
    DSX_CHECK(ldx >= D, "router: bad row stride ", ldx, " for ", D, " inputs");
    if (unsigned* counter = fused_counter(logits, stream)) {
      FusedParams p{};
      p.w = gate.data;
      p.row_bytes = D * (gate.fmt == WFormat::BF16 ? 2 : 4);
      p.E = static_cast<int>(E);
      p.cpr = static_cast<int>(D / 8);
      p.x = x;
      p.xt = xt == DType::BF16 ? 1 : 0;
      p.ldx = ldx;
      p.T = T;
      p.z = logits;
      p.bias = bias;
      p.topk = topk;
      p.gate_temp = o.gate_temp;
      p.norm = o.norm_topk_prob ? 1 : 0;
      p.route_scale = o.route_scale;
      p.ids = ids;
      p.weights = weights;
      p.counter = counter;
      if (gate.fmt == WFormat::BF16)
        launch_fused<WFormat::BF16>(p, stream);
      else
        launch_fused<WFormat::F32>(p, stream);
      return;
    }
  }
  GemvOpts g;
  gemv(gate, xt, x, ldx, T, DType::F32, logits, gate.rows, g, stream);
  router_select(logits, gate.rows, T, static_cast<int>(gate.rows), bias, topk, o, ids, weights, stream);
}

}  // namespace dsx::cuda
