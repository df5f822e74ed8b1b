#include "kernels/cuda/moe.h"

#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_internal.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_ring_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/moe_grouped.h"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr size_t kSmemBudget = 100 * 1024;
constexpr int kMaxSlots = 16;
constexpr int kDownRPW = 2;  // rows per warp unit of the down projection

size_t align256(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }

// The view of a routed expert's MXFP4 matrix with K inputs (K / 2 data bytes and K / 32
// scales per row; tiled: MoeLayer::tiled).
__device__ __forceinline__ dev::WView expert_view(const uint8_t* w, const uint8_t* s, int K, int tiled) {
  dev::WView v;
  v.w = w;
  v.s = s;
  v.row_bytes = K / 2;
  v.sc_cols = K / 32;
  v.tiled = tiled;
  return v;
}

// ---------------------------------------------------------------------------------
// Up projection: w1 / w3 of every (token, slot) + SwiGLU + routing weight + QA8 -> hq.
struct UpParams {
  int etiled;  // routed experts in the 16-row tile layout (MoeLayer::tiled)
  const uint8_t* const* w1;
  const uint8_t* const* w1s;
  const uint8_t* const* w3;
  const uint8_t* const* w3s;
  dev::WView sw1, sw3;
  int D, I, topk, S;
  const int32_t* ids;
  const float* wts;
  const void* x;
  int xt;
  int64_t ldx;
  int T, Tp;  // tokens, tokens staged per pass
  int UR;     // rows per unit (max(32, qblock))
  float lim;
  int qblock;
  int bf16;
  float* hq;  // [T][S][I]
};

__global__ void __launch_bounds__(kThreads) moe_up_kernel(const UpParams p) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ float eta[128];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nrg = p.I / p.UR;
  const int rpw = p.UR / kWarps;  // 4 or 16
  const int xq = p.D / 4;
  for (int t0 = 0; t0 < p.T; t0 += p.Tp) {
    const int nt = min(p.Tp, p.T - t0);
    __syncthreads();
    dev::stage_rows(xs, nt, p.D, p.x, p.xt, p.ldx, static_cast<int64_t>(t0) * p.ldx, nt, 1, p.qblock,
                    dev::kTrickPrescale);
    __syncthreads();
    const int units = nt * p.S * nrg;
    for (int un = blockIdx.x; un < units; un += gridDim.x) {
      const int tl = un / (p.S * nrg), rem = un % (p.S * nrg);
      const int j = rem / nrg, rg = rem % nrg;
      const int t = t0 + tl;
      const bool routed = j < p.topk;
      float wj = 1.0f;
      dev::WView v1, v3;
      if (routed) {
        const int e = p.ids[t * p.topk + j];
        wj = p.wts[t * p.topk + j];
        v1 = expert_view(p.w1[e], p.w1s[e], p.D, p.etiled);
        v3 = expert_view(p.w3[e], p.w3s[e], p.D, p.etiled);
      } else {
        v1 = p.sw1;
        v3 = p.sw3;
      }
      const float4* xs_t = smem4 + static_cast<int64_t>(tl) * xq;
      for (int sub = 0; sub < rpw / 4; ++sub) {
        const int lr = warp * rpw + sub * 4;  // row within the unit
        const int64_t r0 = static_cast<int64_t>(rg) * p.UR + lr;
        float ag[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}}, au[4][1] = {{0.f}, {0.f}, {0.f}, {0.f}};
        if (routed) {
          dev::warp_dot<WFormat::MXFP4, 4, 1, 2>(v1, r0, p.I - 1, 0, p.D / 32, 0, xs_t, xq, ag, lane);
          dev::warp_dot<WFormat::MXFP4, 4, 1, 2>(v3, r0, p.I - 1, 0, p.D / 32, 0, xs_t, xq, au, lane);
        } else {
          dev::warp_dot<WFormat::FP8_BLOCK, 4, 1, 2>(v1, r0, p.I - 1, 0, p.D / 16, 0, xs_t, xq, ag, lane);
          dev::warp_dot<WFormat::FP8_BLOCK, 4, 1, 2>(v3, r0, p.I - 1, 0, p.D / 16, 0, xs_t, xq, au, lane);
        }
        dev::warp_reduce<4, 1>(ag);
        dev::warp_reduce<4, 1>(au);
#pragma unroll
        for (int r = 0; r < 4; ++r)
          if (lane == r) eta[lr + r] = dev::swiglu_h(ag[r][0], au[r][0], wj, p.lim, p.bf16);
      }
      __syncthreads();
      const int nqb = p.UR / p.qblock;
      if (warp < nqb) {
        float* out = p.hq + (static_cast<int64_t>(t) * p.S + j) * p.I + static_cast<int64_t>(rg) * p.UR + warp * p.qblock;
        const float* src = eta + warp * p.qblock;
        if (p.qblock == 32) {
          float v[1] = {src[lane]};
          uint8_t c[1];
          const float s = dev::qa8_warp_block<1>(v, c);
          out[lane] = e4m3_to_f32(c[0]) * s;
        } else if (p.qblock == 64) {
          float v[2] = {src[lane], src[lane + 32]};
          uint8_t c[2];
          const float s = dev::qa8_warp_block<2>(v, c);
#pragma unroll
          for (int q = 0; q < 2; ++q) out[lane + 32 * q] = e4m3_to_f32(c[q]) * s;
        } else {
          float v[4] = {src[lane], src[lane + 32], src[lane + 64], src[lane + 96]};
          uint8_t c[4];
          const float s = dev::qa8_warp_block<4>(v, c);
#pragma unroll
          for (int q = 0; q < 4; ++q) out[lane + 32 * q] = e4m3_to_f32(c[q]) * s;
        }
      }
      __syncthreads();
    }
  }
}

// ---------------------------------------------------------------------------------
// Down projection: one warp unit = (token, kDownRPW rows, slot); partial results go to
// part[t][slot][n]; the last unit of a (token, row pair) to finish adds the S partials
// in the reference order (ascending expert id, shared expert last) and writes y.
struct DownParams {
  int etiled;  // routed experts in the 16-row tile layout (MoeLayer::tiled)
  const uint8_t* const* w2;
  const uint8_t* const* w2s;
  dev::WView sw2;
  int D, I, topk, S;
  const int32_t* ids;
  const float* hq;  // [T][S][I]
  float* part;      // [T][S][D]
  unsigned* cnt;    // [T][D / kDownRPW], zero on entry
  int T;
  int bf16;
  void* y;
  int yt;
  int64_t ldy;
};

__global__ void __launch_bounds__(kThreads) moe_down_kernel(const DownParams p) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  __shared__ int order[kMaxSlots];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int xq = p.I / 4;
  const int npair = p.D / kDownRPW;
  const int units = npair * p.S;
  for (int t = 0; t < p.T; ++t) {
    __syncthreads();
    if (threadIdx.x == 0) {
      // slots sorted by ascending expert id (insertion sort; topk is small), shared last
      for (int j = 0; j < p.S; ++j) order[j] = j;
      for (int a = 1; a < p.topk; ++a) {
        const int v = order[a];
        const int ev = p.ids[t * p.topk + v];
        int b = a - 1;
        while (b >= 0 && p.ids[t * p.topk + order[b]] > ev) {
          order[b + 1] = order[b];
          --b;
        }
        order[b + 1] = v;
      }
    }
    dev::stage_copy(xs, p.S, p.I, p.hq + static_cast<int64_t>(t) * p.S * p.I, p.I, dev::kTrickPrescale);
    __syncthreads();
    for (int un = blockIdx.x * kWarps + warp; un < units; un += gridDim.x * kWarps) {
      const int j = un / npair, pr = un % npair;
      const int64_t n0 = static_cast<int64_t>(pr) * kDownRPW;
      const float4* xs_j = smem4 + static_cast<int64_t>(j) * xq;
      float a[kDownRPW][1];
#pragma unroll
      for (int r = 0; r < kDownRPW; ++r) a[r][0] = 0.0f;
      if (j < p.topk) {
        const int e = p.ids[t * p.topk + j];
        const dev::WView v = expert_view(p.w2[e], p.w2s[e], p.I, p.etiled);
        dev::warp_dot<WFormat::MXFP4, kDownRPW, 1, 4>(v, n0, p.D - 1, 0, p.I / 32, 0, xs_j, xq, a, lane);
      } else {
        dev::warp_dot<WFormat::FP8_BLOCK, kDownRPW, 1, 4>(p.sw2, n0, p.D - 1, 0, p.I / 16, 0, xs_j, xq, a, lane);
      }
      dev::warp_reduce<kDownRPW, 1>(a);
      float* prow = p.part + (static_cast<int64_t>(t) * p.S + j) * p.D;
#pragma unroll
      for (int r = 0; r < kDownRPW; ++r)
        if (lane == r && n0 + r < p.D) prow[n0 + r] = a[r][0];
      __threadfence();
      __syncwarp();
      unsigned old = 0;
      if (lane == 0) old = atomicAdd(p.cnt + static_cast<int64_t>(t) * npair + pr, 1u);
      old = __shfl_sync(dev::kFull, old, 0);
      if (old == static_cast<unsigned>(p.S - 1)) {
        __threadfence();
        if (lane < kDownRPW && n0 + lane < p.D) {
          const int64_t n = n0 + lane;
          float tot = 0.0f;
          for (int s = 0; s < p.S; ++s) {
            float v = __ldcg(p.part + (static_cast<int64_t>(t) * p.S + order[s]) * p.D + n);
            if (p.bf16) v = round_bf16(v);
            tot += v;
          }
          dev::store_act(p.y, p.yt, static_cast<int64_t>(t) * p.ldy + n, tot);
        }
      }
    }
  }
}


// ---------------------------------------------------------------------------------
// Tensor-core decode path (BF16 mode, qblock 32; gemv_device.cuh). Two launches:
//  up:   one block per (token, slot, 16-row tile of I) for the routed experts and one per
//        16-row tile for the shared expert (all tokens); its 8 warps stream w1 and w3
//        (4 quarters of D each) against QA8(x) and add the quarters in a fixed order,
//        then SwiGLU and the routing weight (bf16-rounded in BF16 mode): h, f32 [T][S][I].
//  down: one block per (token, 16-row tile of D); its warps stream w2 of every slot
//        (shared expert: two warps, halves of I) against QA8(h) staged in shared
//        memory, and the block adds the slot outputs in the reference order.
template <WFormat F, int P, int U>
__device__ __forceinline__ void stream_tile(const dev::WView& W, int64_t row0, int64_t row_last, int s_lo, int s_hi,
                                            int NB, const uint32_t* bs, const float* sas, int tstride, int nt,
                                            float (&acc)[P][2], int lane, const uint32_t* bzero) {
  // spans padded to a multiple of U with empty ones: branch-free unrolled groups
  dev::MmaSlot<F> ring[U];
  const int n = s_hi - s_lo;
  const int Pn = (n + U - 1) / U * U;
#pragma unroll
  for (int u = 0; u < U; ++u) dev::mma_slot_load<F>(ring[u], W, row0, row_last, s_lo + u, NB, lane, u < n);
  for (int k0 = 0; k0 < Pn; k0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dev::mma_slot_consume<F, false, P>(ring[u], acc, bs, sas, tstride, nt, s_lo + k0 + u, NB, lane, W, row0, row_last,
                                         bzero);
      dev::mma_slot_load<F>(ring[u], W, row0, row_last, s_lo + k0 + u + U, NB, lane, k0 + u + U < n);
    }
  }
  dev::mma_acc_finish<F, P>(acc);
}

struct UpMmaParams {
  int etiled;  // routed experts in the 16-row tile layout (MoeLayer::tiled)
  const uint8_t* const* w1;
  const uint8_t* const* w1s;
  const uint8_t* const* w3;
  const uint8_t* const* w3s;
  dev::WView sw1, sw3;
  int D, I, topk, S, T;
  const int32_t* ids;
  const float* wts;
  const void* x;
  int xt;
  int64_t ldx;
  float lim;
  int bf16;
  float* h;  // [T][S][I]
  int NTI, NB;
  int n_sblocks;
  int max_units;  // one-token ring kernel: most units a block walks (sizes its partial sums)
  // one-token ring kernel: QA8(h) in the down kernel's staged layout (DownStage) and as
  // fake-quantized values ([S][I])
  uint32_t* hst;
  float* hq;
  const uint32_t* xst;  // one-token ring kernel: x staged by its producer (moe_decode's x_staged) or null
  int E;                // experts (the pointer tables' length)
};

template <int P>
__global__ void __launch_bounds__(kThreads, 2) moe_up_mma_kernel(const UpMmaParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  __shared__ uint4 s_zero[4];
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const uint32_t* bzero = reinterpret_cast<const uint32_t*>(s_zero);
  uint32_t* bs = reinterpret_cast<uint32_t*>(smem_mma);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int m = warp >> 2, kq = warp & 3;  // matrix (0: w1, 1: w3), quarter of D
  dev::pdl_wait();
  const bool shared = static_cast<int>(blockIdx.x) < p.n_sblocks;
  int t = 0, j = p.topk, tile;
  float wj = 1.0f;
  int ntok;
  dev::WView v;
  if (shared) {
    tile = blockIdx.x;
    ntok = p.T;
    v = m == 0 ? p.sw1 : p.sw3;
  } else {
    const int u = blockIdx.x - p.n_sblocks;
    t = u / (p.topk * p.NTI);
    j = (u / p.NTI) % p.topk;
    tile = u % p.NTI;
    ntok = 1;
    const int e = p.ids[t * p.topk + j];
    wj = p.wts[t * p.topk + j];
    v = m == 0 ? expert_view(p.w1[e], p.w1s[e], p.D, p.etiled) : expert_view(p.w3[e], p.w3s[e], p.D, p.etiled);
  }
  float* sas = reinterpret_cast<float*>(bs + static_cast<int64_t>(ntok) * p.NB * 16);
  float* red = sas + static_cast<int64_t>(ntok) * p.NB;  // [8 warps][16 rows][8 tokens]
  const int nsp = static_cast<int>((v.row_bytes + 63) / 64);
  const int s_lo = nsp * kq / 4, s_hi = nsp * (kq + 1) / 4;
  const int64_t row0 = static_cast<int64_t>(tile) * 16;
  const int g = lane >> 2;
  if (shared) {
    dev::stage_b_mma<WFormat::FP8_BLOCK, false>(bs, sas, p.NB, ntok, p.NB, p.x, p.xt, p.ldx, 0,
                                                dev::fp8_mma_prescale<false>());
    __syncthreads();
    dev::pdl_launch_dependents();
    float a[P][2];
#pragma unroll
    for (int q = 0; q < P; ++q) a[q][0] = a[q][1] = 0.f;
    stream_tile<WFormat::FP8_BLOCK, P, 4>(v, row0, p.I - 1, s_lo, s_hi, p.NB, bs, sas, p.NB, ntok, a, lane, bzero);
#pragma unroll
    for (int q = 0; q < P; ++q) {
      const int tt = dev::mma_acc_token<WFormat::FP8_BLOCK>(q, lane);
      if (tt < ntok) {
        red[(warp * 16 + g) * 8 + tt] = a[q][0];
        red[(warp * 16 + g + 8) * 8 + tt] = a[q][1];
      }
    }
  } else {
    dev::stage_b_mma<WFormat::MXFP4, false>(bs, sas, p.NB, 1, p.NB, p.x, p.xt, p.ldx, static_cast<int64_t>(t) * p.ldx,
                                            dev::kMx4MmaPrescale);
    __syncthreads();
    dev::pdl_launch_dependents();
    float a[1][2] = {{0.f, 0.f}};
    stream_tile<WFormat::MXFP4, 1, 4>(v, row0, p.I - 1, s_lo, s_hi, p.NB, bs, sas, p.NB, 1, a, lane, bzero);
    if ((lane & 3) == 0) {
      red[(warp * 16 + g) * 8] = a[0][0];
      red[(warp * 16 + g + 8) * 8] = a[0][1];
    }
  }
  __syncthreads();
  if (static_cast<int>(threadIdx.x) < 16 * ntok) {
    const int rl = threadIdx.x % 16, tt = threadIdx.x / 16;
    const int row = tile * 16 + rl;
    if (row < p.I) {
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        gs += red[(q * 16 + rl) * 8 + tt];
        us += red[((4 + q) * 16 + rl) * 8 + tt];
      }
      const int tok = shared ? tt : t;
      p.h[(static_cast<int64_t>(tok) * p.S + j) * p.I + row] = dev::swiglu_h(gs, us, wj, p.lim, p.bf16);
    }
  }
}

constexpr int kDownU = 4;
// One 16-row tile of one down-projection slot (kept out of line: one register budget
// per weight format).
template <WFormat F>
__device__ __forceinline__ float2 down_tile(dev::WView W, int64_t row0, int64_t row_last, int s_lo, int s_hi, int NB,
                                            const uint32_t* bs, const float* sas, int lane, const uint32_t* bzero) {
  float a[1][2] = {{0.f, 0.f}};
  stream_tile<F, 1, kDownU>(W, row0, row_last, s_lo, s_hi, NB, bs, sas, NB, 1, a, lane, bzero);
  return make_float2(a[0][0], a[0][1]);
}

struct DownMmaParams {
  int etiled;  // routed experts in the 16-row tile layout (MoeLayer::tiled)
  const uint8_t* const* w2;
  const uint8_t* const* w2s;
  dev::WView sw2;
  int D, I, topk, S, T, has_shared;
  const int32_t* ids;
  const float* h;  // [T][S][I]
  float* hq;       // [T][S][I]
  int NTD, NBI;
  int bf16;
  void* y;
  int yt;
  int64_t ldy;
  int max_tiles;  // one-token ring kernel: most tiles a block walks (sizes its partial sums)
  const uint32_t* hst;  // one-token ring kernel: QA8(h) staged by the up kernel (DownStage)
};

// Shared memory of a down block: QA8(h) of the token's routed slots (MXFP4 B order)
// and of the shared expert (FP8 B order), the slot partial sums and the slot order.
struct DownSmem {
  uint32_t* bs_r;
  float* sas_r;
  uint32_t* bs_s;
  float* sas_s;
  float (*part)[16];
  int* order;
  const uint32_t* bzero;
};

// The slot order of token t (ascending expert id, ties by slot; the shared expert last)
// into order[0 .. S). Warp 0 (all its lanes); readers synchronise with it first.
__device__ __forceinline__ void down_order(const DownMmaParams& p, int t, int* order) {
  if (threadIdx.x < 32) {  // warp 0: slot j goes to its rank (expert id, then slot: a stable sort)
    const int j = static_cast<int>(threadIdx.x);
    const int key = j < p.topk ? p.ids[t * p.topk + j] : INT_MAX;  // (the shared expert: last)
    int rank = 0;
    for (int i = 0; i < p.S; ++i) {
      const int ki = __shfl_sync(0xffffffffu, key, i);
      rank += (ki < key || (ki == key && i < j)) ? 1 : 0;
    }
    if (j < p.S) order[rank] = j;
  }
}

// Stages QA8(h) of token t (fq: also written there, unscaled) and the slot order. All threads.
__device__ __forceinline__ void down_stage(const DownMmaParams& p, int t, float* fq, const DownSmem& sm) {
  down_order(p, t, sm.order);
  const int64_t hrow = static_cast<int64_t>(t) * p.S * p.I;
  dev::stage_b_mma<WFormat::MXFP4, false>(sm.bs_r, sm.sas_r, p.NBI, p.topk, p.NBI, p.h, 0, p.I, hrow,
                                          dev::kMx4MmaPrescale, fq, p.I);
  if (p.has_shared)
    dev::stage_b_mma<WFormat::FP8_BLOCK, false>(sm.bs_s, sm.sas_s, p.NBI, 1, p.NBI, p.h, 0, p.I,
                                                hrow + static_cast<int64_t>(p.topk) * p.I,
                                                dev::fp8_mma_prescale<false>(),
                                                fq ? fq + static_cast<int64_t>(p.topk) * p.I : nullptr, p.I);
}

// Output rows [16 tile, 16 tile + 16) of token t: each warp streams w2 of one slot (the
// shared expert: two warps, halves of I); the slot outputs are added in sm.order. All
// threads; ends with the partial sums consumed (the caller syncs before reusing them).
__device__ __forceinline__ void down_tile_out(const DownMmaParams& p, int t, int tile, const DownSmem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  const int64_t row0 = static_cast<int64_t>(tile) * 16;
  const int items = p.topk + 2 * p.has_shared;
  for (int it = warp; it < items; it += kWarps) {
    float2 r;
    if (it < p.topk) {
      const int e = p.ids[t * p.topk + it];
      const dev::WView v = expert_view(p.w2[e], p.w2s[e], p.I, p.etiled);
      r = down_tile<WFormat::MXFP4>(v, row0, p.D - 1, 0, (p.I / 2 + 63) / 64, p.NBI,
                                    sm.bs_r + static_cast<int64_t>(it) * p.NBI * 16,
                                    sm.sas_r + static_cast<int64_t>(it) * p.NBI, lane, sm.bzero);
    } else {
      const int hh = it - p.topk;
      const int nsp = (p.I + 63) / 64;
      r = down_tile<WFormat::FP8_BLOCK>(p.sw2, row0, p.D - 1, hh * nsp / 2, (hh + 1) * nsp / 2, p.NBI, sm.bs_s,
                                        sm.sas_s, lane, sm.bzero);
    }
    if (c == 0) {
      sm.part[it][g] = r.x;
      sm.part[it][g + 8] = r.y;
    }
  }
  __syncthreads();
  if (threadIdx.x < 16) {
    const int rl = threadIdx.x;
    const int64_t row = row0 + rl;
    if (row < p.D) {
      float tot = 0.0f;
      for (int s = 0; s < p.S; ++s) {
        const int j = sm.order[s];
        float v = j < p.topk ? sm.part[j][rl] : sm.part[p.topk][rl] + sm.part[p.topk + 1][rl];
        if (p.bf16) v = round_bf16(v);
        tot += v;
      }
      dev::store_act(p.y, p.yt, static_cast<int64_t>(t) * p.ldy + row, tot);
    }
  }
}

// The block's shared memory as DownSmem (shared variables of a device function are
// allocated once per block).
__device__ __forceinline__ DownSmem down_smem(const DownMmaParams& p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  __shared__ uint4 s_zero[4];
  __shared__ float part[kMaxSlots + 2][16];
  __shared__ int order[kMaxSlots];
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  DownSmem sm;
  sm.bs_r = reinterpret_cast<uint32_t*>(smem_mma);
  sm.sas_r = reinterpret_cast<float*>(sm.bs_r + static_cast<int64_t>(p.topk) * p.NBI * 16);
  sm.bs_s = reinterpret_cast<uint32_t*>(smem_mma) + ((static_cast<int64_t>(p.topk) * p.NBI * 17 + 3) & ~int64_t{3});
  sm.sas_s = reinterpret_cast<float*>(sm.bs_s + static_cast<int64_t>(p.NBI) * 16);
  sm.part = part;
  sm.order = order;
  sm.bzero = reinterpret_cast<const uint32_t*>(s_zero);
  return sm;
}

// One block per (token, 16-row tile of D).
__global__ void __launch_bounds__(kThreads, 2) moe_down_mma_kernel(const DownMmaParams p) {
  const DownSmem sm = down_smem(p);
  const int t = blockIdx.x / p.NTD, tile = blockIdx.x % p.NTD;
  dev::pdl_wait();
  down_stage(p, t, tile == 0 ? p.hq + static_cast<int64_t>(t) * p.S * p.I : nullptr, sm);
  __syncthreads();
  dev::pdl_launch_dependents();
  down_tile_out(p, t, tile, sm);
}

// ---------------------------------------------------------------------------------
// One-token kernels on the shared-memory span ring (gemv_device.cuh): each warp walks a
// sequence of pieces (16 rows x a span range of one weight matrix) and its copies run
// U spans ahead across piece boundaries, so a warp's stream never drains between
// units. Same arithmetic per piece as stream_tile. T > 1 (or where these do not fit):
// the per-tile register-ring kernels above, which also measured slower at T = 1.
// U: spans in flight per warp (ring of U + 1 slots of 1 KB). U = 4 is a bit faster on the
// H200 than U = 8: MoE 69.2 -> 67.6 us, decode step 2.000 -> 1.978 ms; U = 8 measured
// slower again in later sessions (docs/experiments.md). (Forcing 3 up blocks per SM with
// U = 4, 75 registers, measured slower: 72.7 us.)
template <int U>
constexpr size_t ring_bytes(int warps) {
  return static_cast<size_t>(warps) * (U + 1) * 1024;
}
constexpr int kRingU = 4;  // the one-token kernels' spans in flight per warp

struct Piece {
  dev::WView v;
  int64_t row0 = 0, row_last = 0;
  int s_lo = 0, s_hi = 0;
  bool fp4 = false;
};

// The copy cursor of a warp over its pieces (piece_at(i), i < count) and its ring.
template <int U, typename PieceAt>
struct SpanStream {
  uint4* ring;
  int lane, NB, count;
  PieceAt piece_at;
  int li = 0;
  dev::RingLoad ld;
  // this lane's shared address in slot 0; byte offsets of the slots to fill / read next
  uint32_t ring_lane = 0, off_in = 0, off_out = 0;

  // points the copy cursor at piece li, or the next non-empty one (none: ld.left == 0)
  __device__ void load_piece() {
    for (; li < count; ++li) {
      const Piece q = piece_at(li);
      ld.set(q.v, q.row0, q.row_last, q.s_lo, q.s_hi, lane);
      if (ld.left > 0) return;
    }
  }
  __device__ void issue_one() {
    ld.issue_at(ring_lane + off_in);
    off_in = dev::next_ring_slot<U>(off_in);
    if (ld.left == 0 && li < count) {
      ++li;
      load_piece();
    }
  }
  __device__ void start() {
    load_piece();
#pragma unroll 1
    for (int u = 0; u < U; ++u) issue_one();
  }
  // acc += the next piece (q, which must be piece_at of the consumer's position); bs /
  // sas: staged B (stage_b_mma) of its one token.
  template <WFormat F>
  __device__ void consume_piece(const Piece& q, float (&acc)[1][2], const uint32_t* bs, const float* sas,
                                const uint4* bzero) {
    dev::with_ring_cons<F>(NB, q.v, [&](auto& cons) {
      cons.set(q.v, q.row0, q.row_last, bs, sas, NB, 1, NB, bzero, lane);
      // (not unrolled: the up kernel's code 98 -> 59 KB, the down kernel's 73 -> 40 KB;
      // a warp's FP8 and MXFP4 loops and the two kernels share the SMs' instruction
      // caches: 1.482 -> 1.466 ms per step, s17 run9; the ring GEMV's loop at unroll 1:
      // no change)
#pragma unroll 1
      for (int s = q.s_lo; s < q.s_hi; ++s) {
        dev::cp_async_wait<U - 1>();
        cons.span_at(ring_lane + off_out, s, acc[0], lane);
        issue_one();
        off_out = dev::next_ring_slot<U>(off_out);
      }
    });
    dev::mma_acc_finish<F, 1>(acc);
  }
  __device__ void finish() { dev::cp_async_wait<0>(); }
};
template <int U, typename PieceAt>
__device__ SpanStream<U, PieceAt> make_stream(uint4* ring, int lane, int NB, int count, PieceAt at) {
  SpanStream<U, PieceAt> st{ring, lane, NB, count, at};
  st.ring_lane = dev::smem_u32(ring + lane);
  return st;
}

// True in every lane of the last of `n` warps to arrive at *cnt (after each wrote its
// partial sums to shared memory; the last one may then read them all).
__device__ __forceinline__ bool last_warp_in(unsigned* cnt, unsigned n, int lane) {
  __syncwarp();
  unsigned old = 0;
  if (lane == 0) {
    __threadfence_block();
    old = atomicAdd(cnt, 1u);
  }
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != n - 1) return false;
  __threadfence_block();
  return true;
}

// The one-token down kernel's staged activations (in 32-bit words): QA8(h) of the routed
// slots in the MXFP4 B order ([topk][NBI][16], stage_b_mma's layout) and their scales
// ([topk][NBI]), then, at a 16-byte boundary, the shared expert's in the FP8 B order
// ([NBI][16]) and scales ([NBI]). The up kernel writes it to global memory, the down
// kernel's blocks copy it into shared memory as is.
struct DownStage {
  int64_t sas_r, bs_s, sas_s, words;
  __host__ __device__ DownStage(int topk, int NBI) {
    sas_r = static_cast<int64_t>(topk) * NBI * 16;
    bs_s = (static_cast<int64_t>(topk) * NBI * 17 + 3) & ~int64_t{3};
    sas_s = bs_s + static_cast<int64_t>(NBI) * 16;
    words = (sas_s + NBI + 3) & ~int64_t{3};
  }
};

// Up projection of one token: a persistent grid (resident blocks) walks the units
// (shared-expert tiles first, then (slot, tile) of the routed experts) in pairs, in
// strides of the grid; a block stages the activation (QA8, in the B order of each format
// it meets, or copies what its producer staged) once; its 8 warps stream w1 and w3
// (quarters of D) of each unit, whose sums are added in a fixed order, then SwiGLU and
// the routing weight, and QA8 of h is staged for the down kernel (DownStage). Shared
// memory: [rings | FP8 B | scales | MXFP4 B | scales | partial sums per unit | arrival
// counter per unit].
template <int U>
__global__ void __launch_bounds__(kThreads, 2) moe_up_ring_t1_kernel(const UpMmaParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  dev::trace_block(60);
  __shared__ uint4 s_zero[4];
  __shared__ const uint8_t* tab[kMaxSlots][4];
  __shared__ float twt[kMaxSlots];
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = smem_mma + warp * (U + 1) * 64;
  const int nbp = (p.NB + 3) & ~3;
  uint32_t* bs8 = reinterpret_cast<uint32_t*>(smem_mma + kWarps * (U + 1) * 64);
  float* sas8 = reinterpret_cast<float*>(bs8 + static_cast<int64_t>(p.NB) * 16);
  uint32_t* bs4 = reinterpret_cast<uint32_t*>(sas8 + nbp);
  float* sas4 = reinterpret_cast<float*>(bs4 + static_cast<int64_t>(p.NB) * 16);
  float* red = sas4 + nbp;  // [unit][8 warps][16 rows]
  unsigned* ucnt = reinterpret_cast<unsigned*>(red + p.max_units * kWarps * 16);
  const int m = warp >> 2, kq = warp & 3;  // matrix (0: w1, 1: w3), quarter of D
  const int g = lane >> 2;
  // Units go to the blocks in pairs (tiles 2k and 2k + 1 of one matrix: the rows of one
  // QA8 block of h): block b walks pairs b, b + grid, ... (NTI and n_sblocks are even).
  const int n_pairs = (p.n_sblocks + p.topk * p.NTI) / 2;
  const int my_units = 2 * ((n_pairs - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                            static_cast<int>(gridDim.x));
  auto unit_at = [&](int li) { return 2 * (static_cast<int>(blockIdx.x) + (li >> 1) * static_cast<int>(gridDim.x)) + (li & 1); };
  // which formats this block meets (its shared-expert tiles come first)
  const bool any_sh = my_units > 0 && unit_at(0) < p.n_sblocks;
  const bool any_rt = my_units > 0 && unit_at(my_units - 1) >= p.n_sblocks;
  // A block whose first unit is a shared-expert tile starts streaming it before the grid
  // dependency wait (the weights do not depend on the router, which is still running):
  // start() issues U spans of the first piece only, and it does not reach the second
  // piece (whose view needs the router's ids, in tab) when a quarter row has > U spans.
  const bool early = my_units > 0 && unit_at(0) < p.n_sblocks && ((p.D + 63) / 64) / 4 > U;
  auto piece_at = [&](int li) {
    const int unit = unit_at(li);
    Piece q;
    q.row_last = p.I - 1;
    if (unit < p.n_sblocks) {
      q.v = m == 0 ? p.sw1 : p.sw3;
      q.row0 = static_cast<int64_t>(unit) * 16;
      q.fp4 = false;
    } else {
      const int u = unit - p.n_sblocks, j = u / p.NTI;
      q.v = expert_view(tab[j][2 * m], tab[j][2 * m + 1], p.D, p.etiled);
      q.row0 = static_cast<int64_t>(u % p.NTI) * 16;
      q.fp4 = true;
    }
    const int nsp = static_cast<int>((q.v.row_bytes + 63) / 64);
    q.s_lo = nsp * kq / 4;
    q.s_hi = nsp * (kq + 1) / 4;
    return q;
  };
  auto st = make_stream<U>(ring, lane, p.NB, my_units, piece_at);
  if (early) st.start();
  // The staged activations come from the kernel before the router, which releases this
  // grid only after its own wait (or is no programmatic launch): complete, so they
  // are copied before the wait ([FP8 order | MXFP4 order], staged_act_words each, is
  // the layout of bs8 .. sas4)
  if (p.xst) {
    const int64_t w = staged_act_words(p.D);
    if (any_sh) dev::copy_to_smem(bs8, p.xst, w);
    if (any_rt) dev::copy_to_smem(bs4, p.xst + w, w);
  }
  // the expert pointer tables into L2 (read right after the wait with the router's ids,
  // a dependent load before the routed weights can stream): one 128-byte line a thread
  if (any_rt) {
    const int lines = (p.E * 8 + 127) / 128;
    if (static_cast<int>(threadIdx.x) < 4 * lines) {
      const int ti = threadIdx.x / lines, li = threadIdx.x - ti * lines;
      const uint8_t* const* tbl = ti == 0 ? p.w1 : ti == 1 ? p.w1s : ti == 2 ? p.w3 : p.w3s;
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(tbl) + li * 128));
    }
  }
  dev::pdl_wait();  // ids / wts / x come from the previous kernels
  if (threadIdx.x < p.topk) {
    const int e = p.ids[threadIdx.x];
    tab[threadIdx.x][0] = p.w1[e];
    tab[threadIdx.x][1] = p.w1s[e];
    tab[threadIdx.x][2] = p.w3[e];
    tab[threadIdx.x][3] = p.w3s[e];
    twt[threadIdx.x] = p.wts[threadIdx.x];
  }
  __syncthreads();
  dev::trace_block(61);
  if (!early) st.start();
  for (int i = threadIdx.x; i < p.max_units; i += blockDim.x) ucnt[i] = 0;
  // without a staged x (copied before the wait), the block quantizes x itself
  if (!p.xst && any_sh) {  // (with the MXFP4 order too when the block also meets routed units)
    dev::StageAlso mx;
    mx.bs = bs4;
    mx.sas = sas4;
    mx.prescale = dev::kMx4MmaPrescale;
    dev::stage_b_mma<WFormat::FP8_BLOCK, true>(bs8, sas8, p.NB, 1, p.NB, p.x, p.xt, p.ldx, 0,
                                               dev::fp8_mma_prescale<true>(), nullptr, 0, nullptr,
                                               any_rt ? &mx : nullptr);
  } else if (!p.xst && any_rt) {
    dev::stage_b_mma<WFormat::MXFP4, false>(bs4, sas4, p.NB, 1, p.NB, p.x, p.xt, p.ldx, 0, dev::kMx4MmaPrescale);
  }
  __syncthreads();
  for (int li = 0; li < my_units; ++li) {
    if (li == my_units - 1) dev::pdl_launch_dependents();
    const Piece q = piece_at(li);
    float a[1][2] = {{0.f, 0.f}};
    if (!q.fp4)
      st.template consume_piece<WFormat::FP8_BLOCK>(q, a, bs8, sas8, s_zero);
    else
      st.template consume_piece<WFormat::MXFP4>(q, a, bs4, sas4, s_zero);
    // No barrier per unit: each warp leaves its 16 sums in the unit's own red slot and
    // counts itself in (second units of a pair only); the block's last warp on the
    // pair's second unit adds the 8 sums of both units in a fixed order, applies SwiGLU
    // and the routing weight and writes QA8 of the pair's 32 values (one QA8 block of h)
    // in the down kernel's staged layout, while the others already stream their next
    // unit (a per-unit barrier was ~12 % of the warps' stall cycles in ncu). Every warp
    // finished the first unit before it counted itself in on the second.
    float* ru = red + li * (kWarps * 16);
    if ((lane & 3) == 0) {  // token 0: lanes c == 0 hold it
      ru[warp * 16 + g] = a[0][0];
      ru[warp * 16 + g + 8] = a[0][1];
    }
    if ((li & 1) && last_warp_in(ucnt + li, kWarps, lane)) {
      const int unit = unit_at(li - 1);  // the pair's first (even) tile
      const bool shared = unit < p.n_sblocks;
      const int j = shared ? p.topk : (unit - p.n_sblocks) / p.NTI;
      const int kb = (shared ? unit : (unit - p.n_sblocks) % p.NTI) >> 1;  // QA8 block of h
      const float* rs = ru - (lane < 16 ? kWarps * 16 : 0);  // element lane: row lane & 15 of tile lane / 16
      const int rl = lane & 15;
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int qq = 0; qq < 4; ++qq) {
        gs += rs[qq * 16 + rl];
        us += rs[(4 + qq) * 16 + rl];
      }
      const float hv = dev::swiglu_h(gs, us, shared ? 1.0f : twt[j], p.lim, p.bf16);
      const DownStage ds(p.topk, p.I / 32);
      float* fq = p.hq + static_cast<int64_t>(j) * p.I + kb * 32 + lane;
      if (shared)
        dev::stage_block_lanes<WFormat::FP8_BLOCK>(hv, lane, p.hst + ds.bs_s + kb * 16,
                                                   reinterpret_cast<float*>(p.hst + ds.sas_s) + kb,
                                                   dev::fp8_mma_prescale<true>(), fq);
      else
        dev::stage_block_lanes<WFormat::MXFP4>(hv, lane, p.hst + (static_cast<int64_t>(j) * (p.I / 32) + kb) * 16,
                                               reinterpret_cast<float*>(p.hst + ds.sas_r) + j * (p.I / 32) + kb,
                                               dev::kMx4MmaPrescale, fq);
    }
  }
  st.finish();
  dev::trace_block(62);
}

// Down projection of one token, a persistent grid walking the 16-row tiles of D, 16
// warps per block: the 320-odd tiles do not divide evenly over the resident blocks, so
// the blocks that get one tile more set the time; with two warps per item (halves of
// its span range) a block streams a tile in half the time (8 warps: 41 -> 32 us). The
// slot outputs are added in the reference order (ascending expert id, shared last). Items: routed slot j < topk (w2 of expert ids[j]); topk, topk + 1: the halves of
// the shared expert's I. Piece 2 it + h = half h of item it; warp w streams pieces w,
// w + 16, ... of every tile of its block.
constexpr int kDownRingWarps = 16;
constexpr int kDownRingThreads = kDownRingWarps * 32;

template <int U>
__global__ void __launch_bounds__(kDownRingThreads, 1) moe_down_ring_t1_kernel(const DownMmaParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  dev::trace_block(63);
  __shared__ uint4 s_zero[4];
  __shared__ int order[kMaxSlots];
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  uint4* ring = smem_mma + warp * (U + 1) * 64;
  // QA8(h) in B order of the routed slots (one row per slot) and of the shared expert
  // (DownStage, written by the up kernel)
  uint32_t* base = reinterpret_cast<uint32_t*>(smem_mma + kDownRingWarps * (U + 1) * 64);
  const DownStage ds(p.topk, p.NBI);
  uint32_t* bs_r = base;
  float* sas_r = reinterpret_cast<float*>(base + ds.sas_r);
  uint32_t* bs_s = base + ds.bs_s;
  float* sas_s = reinterpret_cast<float*>(base + ds.sas_s);

  const int items = p.topk + 2 * p.has_shared;
  const int pieces = 2 * items;
  const int n_pc = (pieces - warp + kDownRingWarps - 1) / kDownRingWarps;  // pieces of this warp per tile (0..2)
  const int n_contrib = pieces < kDownRingWarps ? pieces : kDownRingWarps;  // warps with pieces
  const int my_tiles = (p.NTD - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                       static_cast<int>(gridDim.x);
  // per tile of this block: [pieces][16] partial sums, then one arrival counter per tile
  float(*part)[16] = reinterpret_cast<float(*)[16]>(sas_s + p.NBI + 4);
  unsigned* tcnt = reinterpret_cast<unsigned*>(part + static_cast<int64_t>(p.max_tiles) * pieces);
  // The views of this warp's pieces. ids come from the router, two kernels back: it has
  // completed before the up kernel's blocks passed their grid dependency wait, which
  // precedes this grid's launch, so the weights can stream before this grid's wait.
  const int nspI = (p.I + 63) / 64, nspR = (p.I / 2 + 63) / 64;
  auto view_of = [&](int pc, Piece& q) {
    const int it = pc >> 1, h = pc & 1;
    int lo, hi;
    if (it < p.topk) {
      const int e = p.ids[it];
      q.v = expert_view(p.w2[e], p.w2s[e], p.I, p.etiled);
      q.fp4 = true;
      lo = 0;
      hi = nspR;
    } else {
      const int hh = it - p.topk;
      q.v = p.sw2;
      q.fp4 = false;
      lo = hh * nspI / 2;
      hi = (hh + 1) * nspI / 2;
    }
    q.s_lo = lo + (hi - lo) * h / 2;
    q.s_hi = lo + (hi - lo) * (h + 1) / 2;
    q.row_last = p.D - 1;
  };
  Piece v0, v1;
  if (n_pc > 0) view_of(warp, v0);
  if (n_pc > 1) view_of(warp + kDownRingWarps, v1);
  auto piece_at = [&](int li) {
    const int ti = li / n_pc, k = li - ti * n_pc;
    Piece q = k == 0 ? v0 : v1;
    q.row0 = static_cast<int64_t>(static_cast<int>(blockIdx.x) + ti * static_cast<int>(gridDim.x)) * 16;
    return q;
  };
  auto st = make_stream<U>(ring, lane, p.NBI, my_tiles * n_pc, piece_at);
  st.start();
  down_order(p, 0, order);  // (ids: see above; the order is read after the barrier below)
  dev::pdl_wait();  // h comes from the up kernel
  for (int i = threadIdx.x; i < p.max_tiles; i += blockDim.x) tcnt[i] = 0;
  dev::copy_to_smem(base, p.hst, ds.words);
  __syncthreads();
  dev::trace_block(64);
  dev::pdl_launch_dependents();
  for (int ti = 0; ti < my_tiles; ++ti) {
    // No barrier per tile: a warp leaves its pieces' sums in the tile's own slot of
    // `part` and counts itself in; the last of the contributing warps adds the slot
    // outputs in the reference order and writes the rows.
    float(*pt)[16] = part + static_cast<int64_t>(ti) * pieces;
    for (int k = 0; k < n_pc; ++k) {
      const int pc = warp + k * kDownRingWarps, it = pc >> 1;
      const Piece q = piece_at(ti * n_pc + k);
      float a[1][2] = {{0.f, 0.f}};
      if (q.fp4)
        st.template consume_piece<WFormat::MXFP4>(q, a, bs_r + static_cast<int64_t>(it) * p.NBI * 16,
                                                  sas_r + static_cast<int64_t>(it) * p.NBI, s_zero);
      else
        st.template consume_piece<WFormat::FP8_BLOCK>(q, a, bs_s, sas_s, s_zero);
      if (c == 0) {
        pt[pc][g] = a[0][0];
        pt[pc][g + 8] = a[0][1];
      }
    }
    if (n_pc > 0 && last_warp_in(tcnt + ti, n_contrib, lane) && lane < 16) {
      const int rl = lane;
      const int64_t row = static_cast<int64_t>(static_cast<int>(blockIdx.x) + ti * static_cast<int>(gridDim.x)) * 16 + rl;
      if (row < p.D) {
        float tot = 0.0f;
        for (int s2 = 0; s2 < p.S; ++s2) {
          const int j = order[s2];
          const int t0 = 2 * j;  // shared expert (j == topk): pieces 2 topk .. 2 topk + 3
          float v = j < p.topk ? pt[t0][rl] + pt[t0 + 1][rl]
                               : (pt[t0][rl] + pt[t0 + 1][rl]) + (pt[t0 + 2][rl] + pt[t0 + 3][rl]);
          if (p.bf16) v = round_bf16(v);
          tot += v;
        }
        dev::store_act(p.y, p.yt, row, tot);
      }
    }
  }
  st.finish();
  dev::trace_block(65);
}

struct DecodeLayout {
  size_t hq = 0, part = 0, cnt = 0, h = 0, hst = 0, total = 0;
};
DecodeLayout decode_layout(const MoeLayer& m, int T, int topk) {
  const int S = topk + (m.shared_w1.data ? 1 : 0);
  DecodeLayout L;
  size_t off = 0;
  L.hq = off;
  off = align256(off + static_cast<size_t>(T) * S * m.inter * 4);
  L.part = off;
  off = align256(off + static_cast<size_t>(T) * S * m.hidden * 4);
  L.cnt = off;
  off = align256(off + static_cast<size_t>(T) * (m.hidden / kDownRPW) * 4);
  L.h = off;
  off = align256(off + static_cast<size_t>(T) * S * m.inter * 4);
  L.hst = off;  // one token (the ring kernels)
  off = align256(off + static_cast<size_t>(DownStage(topk, static_cast<int>(m.inter / 32)).words) * 4);
  L.total = off;
  return L;
}

dev::WView fp8_view(const QMatrix& W) {
  dev::WView v;
  v.w = W.data;
  v.s = W.scale;
  v.row_bytes = W.cols;
  v.tiled = W.tiled ? 1 : 0;
  v.sc_cols = static_cast<int>((W.cols + W.block - 1) / W.block);
  int s = 0;
  while ((1 << s) < W.block) ++s;
  v.wshift = s;
  return v;
}

void check_layer(const MoeLayer& m, int topk) {
  DSX_CHECK(m.hidden > 0 && m.hidden % 32 == 0 && m.inter > 0 && m.inter % 32 == 0, "moe: D=", m.hidden,
            " and I=", m.inter, " must be multiples of 32");
  DSX_CHECK(m.qblock == 32 || m.qblock == 64 || m.qblock == 128, "moe: bad QA8 block ", m.qblock);
  DSX_CHECK(m.inter % std::max(32, m.qblock) == 0 && m.hidden % m.qblock == 0, "moe: sizes not multiples of qblock");
  DSX_CHECK(topk >= 1 && topk <= 8, "moe: topk must be in 1..8");
  DSX_CHECK(m.w1 && m.w1_scale && m.w3 && m.w3_scale && m.w2 && m.w2_scale, "moe: missing expert pointer arrays");
  DSX_CHECK(m.hidden <= (1 << 24) && m.inter <= (1 << 24), "moe: sizes too large");
  DSX_CHECK(!m.tiled || moe_experts_tile16(m.hidden, m.inter), "moe: the 16-row tile layout of the routed experts ",
            "needs D and I of whole tiles and spans (D=", m.hidden, ", I=", m.inter, ")");
  if (m.shared_w1.data) {
    const QMatrix* sh[3] = {&m.shared_w1, &m.shared_w3, &m.shared_w2};
    for (const QMatrix* q : sh) {
      DSX_CHECK(q->data && q->scale && q->fmt == WFormat::FP8_BLOCK, "moe: shared expert must be FP8_BLOCK");
      DSX_CHECK(q->block == 32 || q->block == 64 || q->block == 128, "moe: shared expert tile must be 32/64/128");
      DSX_CHECK(detail::aligned16(q->data), "moe: shared expert data must be 16-byte aligned");
      DSX_CHECK(!q->tiled || tile16_fits(*q), "moe: shared expert ", q->name, " tiled but not of whole tiles");
    }
    DSX_CHECK(m.shared_w1.rows == m.inter && m.shared_w1.cols == m.hidden && m.shared_w3.rows == m.inter &&
                  m.shared_w3.cols == m.hidden && m.shared_w2.rows == m.hidden && m.shared_w2.cols == m.inter,
              "moe: shared expert shapes do not match D / I");
  }
}


// Partial sums and arrival counters of the up kernel for max_units units per block.
size_t up_red_bytes(int max_units) { return static_cast<size_t>(max_units) * (kWarps * 16 * 4 + 4); }

// The one-token ring kernels with U spans in flight per warp; false when they do not fit.
template <int U>
bool launch_ring_t1(const UpMmaParams& up, const DownMmaParams& dn, int64_t n_up, int NB, int NTD, size_t smem_dn,
                    cudaStream_t stream) {
  auto kdn = moe_down_ring_t1_kernel<U>;
  auto kup = moe_up_ring_t1_kernel<U>;
  const size_t stage = 2 * (static_cast<size_t>(NB) * 64 + static_cast<size_t>((NB + 3) & ~3) * 4);
  // down: one block per SM (16 warps); per tile of a block the pieces' partial sums and a counter
  DownMmaParams dn1 = dn;
  const int64_t gridd = std::min<int64_t>(NTD, sm_count());
  dn1.max_tiles = static_cast<int>((NTD + gridd - 1) / gridd);
  const int pieces = 2 * (dn.topk + 2 * dn.has_shared);
  const size_t smemd = ring_bytes<U>(kDownRingWarps) + smem_dn + 16 +
                       static_cast<size_t>(dn1.max_tiles) * (static_cast<size_t>(pieces) * 64 + 4);
  if (smemd > detail::max_dynamic_smem(kdn) || detail::occupancy(kdn, kDownRingThreads, smemd) < 1) return false;
  // up: resident blocks with room for the partial sums of their units
  const size_t base = ring_bytes<U>(kWarps) + stage;
  if (base > detail::max_dynamic_smem(kup)) return false;
  UpMmaParams up1 = up;
  bool launched = false;
  const int64_t n_pairs = n_up / 2;  // the kernel's units go in pairs (whole QA8 blocks of h)
  for (int occ = detail::occupancy(kup, kThreads, base); occ >= 1 && !launched; --occ) {
    const int64_t grid = std::min<int64_t>(n_pairs, static_cast<int64_t>(occ) * sm_count());
    up1.max_units = static_cast<int>(2 * ((n_pairs + grid - 1) / grid));
    const size_t smem1 = base + up_red_bytes(up1.max_units);
    if (smem1 <= detail::max_dynamic_smem(kup) && detail::occupancy(kup, kThreads, smem1) >= occ) {
      detail::launch_pdl(kup, dim3(static_cast<unsigned>(grid)), dim3(kThreads), smem1, stream, up1);
      launched = true;
    }
  }
  if (!launched) return false;
  detail::launch_pdl(kdn, dim3(static_cast<unsigned>(gridd)), dim3(kDownRingThreads), smemd, stream, dn1);
  return true;
}

// The tensor-core decode path when it applies (false: the CUDA-core kernels).
bool moe_decode_mma(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                    const float* weights, DType yt, void* y, int64_t ldy, char* base, const DecodeLayout& L,
                    cudaStream_t stream, const uint32_t* x_staged) {
  const int mode = gemv_mma_mode();
  if (mode == 0 || (yt != DType::BF16 && mode < 2)) return false;
  const bool has_shared = m.shared_w1.data != nullptr;
  const int S = topk + (has_shared ? 1 : 0);
  if (m.qblock != 32 || T > 8 || m.inter % 32 != 0 || m.hidden % 32 != 0 || S > kMaxSlots) return false;
  if (has_shared && (m.shared_w1.block < 16 || m.shared_w2.block < 16)) return false;
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
  const int NB = D / 32, NBI = I / 32, NTI = (I + 15) / 16, NTD = (D + 15) / 16;
  float* h = reinterpret_cast<float*>(base + L.h);
  float* hq = reinterpret_cast<float*>(base + L.hq);

  UpMmaParams up{};
  up.w1 = m.w1;
  up.etiled = m.tiled ? 1 : 0;
  up.w1s = m.w1_scale;
  up.w3 = m.w3;
  up.w3s = m.w3_scale;
  if (has_shared) {
    up.sw1 = fp8_view(m.shared_w1);
    up.sw3 = fp8_view(m.shared_w3);
  }
  up.D = D;
  up.I = I;
  up.topk = topk;
  up.S = S;
  up.T = T;
  up.ids = ids;
  up.wts = weights;
  up.x = x;
  up.xt = static_cast<int>(xt);
  up.ldx = ldx;
  up.lim = m.swiglu_limit;
  up.bf16 = yt == DType::BF16 ? 1 : 0;
  up.h = h;
  up.NTI = NTI;
  up.NB = NB;
  up.n_sblocks = has_shared ? NTI : 0;
  up.hst = reinterpret_cast<uint32_t*>(base + L.hst);
  up.xst = T == 1 ? x_staged : nullptr;
  up.E = m.n_experts;
  up.hq = hq;
  const int n_up = up.n_sblocks + T * topk * NTI;
  const size_t tok_bytes = static_cast<size_t>(NB) * (64 + 4);
  const size_t smem_up = static_cast<size_t>(has_shared ? T : 1) * tok_bytes + kWarps * 16 * 8 * 4;
  auto kup = T <= 4 ? moe_up_mma_kernel<1> : moe_up_mma_kernel<2>;
  if (smem_up > detail::max_dynamic_smem(kup)) return false;

  DownMmaParams dn{};
  dn.w2 = m.w2;
  dn.etiled = m.tiled ? 1 : 0;
  dn.w2s = m.w2_scale;
  if (has_shared) dn.sw2 = fp8_view(m.shared_w2);
  dn.D = D;
  dn.I = I;
  dn.topk = topk;
  dn.S = S;
  dn.T = T;
  dn.has_shared = has_shared ? 1 : 0;
  dn.ids = ids;
  dn.h = h;
  dn.hq = hq;
  dn.hst = up.hst;
  dn.NTD = NTD;
  dn.NBI = NBI;
  dn.bf16 = up.bf16;
  dn.y = y;
  dn.yt = static_cast<int>(yt);
  dn.ldy = ldy;
  const size_t smem_dn = static_cast<size_t>(topk + 1) * NBI * (64 + 4) + 16;
  if (smem_dn > detail::max_dynamic_smem(moe_down_mma_kernel)) return false;

  if (T == 1 && launch_ring_t1<kRingU>(up, dn, n_up, NB, NTD, smem_dn, stream)) return true;
  detail::launch_pdl(kup, dim3(static_cast<unsigned>(n_up)), dim3(kThreads), smem_up, stream, up);
  detail::launch_pdl(moe_down_mma_kernel, dim3(static_cast<unsigned>(T * NTD)), dim3(kThreads), smem_dn, stream, dn);
  return true;
}

}  // namespace

size_t moe_decode_ws_bytes(const MoeLayer& m, int T, int topk) { return decode_layout(m, T, topk).total; }

void moe_decode(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                cudaStream_t stream, const uint32_t* x_staged) {
  if (T <= 0) return;
  check_layer(m, topk);
  const DecodeLayout L = decode_layout(m, T, topk);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_decode: workspace too small (", ws_bytes, " < ", L.total, ")");
  const int S = topk + (m.shared_w1.data ? 1 : 0);
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
  char* base = static_cast<char*>(ws);
  const bool bf16 = yt == DType::BF16;  // BF16 mode: the reference rounding points
  if (moe_decode_mma(m, xt, x, ldx, T, topk, ids, weights, yt, y, ldy, base, L, stream, x_staged)) return;

  // ---- up
  UpParams up{};
  up.w1 = m.w1;
  up.etiled = m.tiled ? 1 : 0;
  up.w1s = m.w1_scale;
  up.w3 = m.w3;
  up.w3s = m.w3_scale;
  if (m.shared_w1.data) {
    up.sw1 = fp8_view(m.shared_w1);
    up.sw3 = fp8_view(m.shared_w3);
  }
  up.D = D;
  up.I = I;
  up.topk = topk;
  up.S = S;
  up.ids = ids;
  up.wts = weights;
  up.x = x;
  up.xt = static_cast<int>(xt);
  up.ldx = ldx;
  up.T = T;
  const size_t row_bytes = static_cast<size_t>(D) * 4;
  up.Tp = static_cast<int>(std::max<size_t>(1, std::min<size_t>(T, kSmemBudget / row_bytes)));
  up.UR = std::max(32, m.qblock);
  up.lim = m.swiglu_limit;
  up.qblock = m.qblock;
  up.bf16 = bf16 ? 1 : 0;
  up.hq = reinterpret_cast<float*>(base + L.hq);
  const size_t smem_up = static_cast<size_t>(up.Tp) * row_bytes;
  {
    const int occ = detail::occupancy(moe_up_kernel, kThreads, smem_up);
    const int64_t units = static_cast<int64_t>(std::min(T, up.Tp)) * S * (I / up.UR);
    const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(units, static_cast<int64_t>(occ) * sm_count()));
    moe_up_kernel<<<static_cast<unsigned>(blocks), kThreads, smem_up, stream>>>(up);
    DSX_CUDA_CHECK(cudaGetLastError());
  }

  // ---- down + combine
  DownParams dn{};
  dn.w2 = m.w2;
  dn.etiled = m.tiled ? 1 : 0;
  dn.w2s = m.w2_scale;
  if (m.shared_w2.data) dn.sw2 = fp8_view(m.shared_w2);
  dn.D = D;
  dn.I = I;
  dn.topk = topk;
  dn.S = S;
  dn.ids = ids;
  dn.hq = up.hq;
  dn.part = reinterpret_cast<float*>(base + L.part);
  dn.cnt = reinterpret_cast<unsigned*>(base + L.cnt);
  dn.T = T;
  dn.bf16 = up.bf16;
  dn.y = y;
  dn.yt = static_cast<int>(yt);
  dn.ldy = ldy;
  DSX_CUDA_CHECK(cudaMemsetAsync(dn.cnt, 0, static_cast<size_t>(T) * (D / kDownRPW) * 4, stream));
  const size_t smem_dn = static_cast<size_t>(S) * I * 4;
  {
    const int occ = detail::occupancy(moe_down_kernel, kThreads, smem_dn);
    const int64_t wunits = static_cast<int64_t>(D / kDownRPW) * S;
    const int64_t blocks = std::max<int64_t>(
        1, std::min<int64_t>((wunits + kWarps - 1) / kWarps, static_cast<int64_t>(occ) * sm_count()));
    moe_down_kernel<<<static_cast<unsigned>(blocks), kThreads, smem_dn, stream>>>(dn);
    DSX_CUDA_CHECK(cudaGetLastError());
  }
}


// =================================================================================
// Prefill
namespace {

__global__ void count_kernel(const int32_t* __restrict__ ids, int n, int E, int* __restrict__ counts) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(counts + e, 1);
  }
}

__global__ void scan_kernel(const int* __restrict__ counts, int E, int* __restrict__ offs) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int s = 0;
    for (int e = 0; e < E; ++e) {
      offs[e] = s;
      s += counts[e];
    }
    offs[E] = s;
  }
}

// Block e lists, in ascending entry order, the entries i (= t * topk + j) routed to
// expert e: perm[offs[e] + rank] = i, inv[i] = offs[e] + rank. Deterministic.
__global__ void __launch_bounds__(kThreads) compact_kernel(const int32_t* __restrict__ ids, int n,
                                                           const int* __restrict__ offs, int* __restrict__ perm,
                                                           int* __restrict__ inv) {
  __shared__ int wsum[kWarps];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int base = offs[e];
  for (int s0 = 0; s0 < n; s0 += kThreads) {
    const int i = s0 + threadIdx.x;
    const bool f = i < n && ids[i] == e;
    const unsigned bal = __ballot_sync(dev::kFull, f);
    if (lane == 0) wsum[warp] = __popc(bal);
    __syncthreads();
    int woff = 0, tot = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) woff += wsum[w];
      tot += wsum[w];
    }
    if (f) {
      const int pos = base + woff + __popc(bal & ((1u << lane) - 1u));
      perm[pos] = i;
      inv[i] = pos;
    }
    base += tot;
    __syncthreads();
  }
}

// dst[p, :] = src[perm[p] / topk, :] (rows of `row_bytes` bytes, multiple of 16).
__global__ void gather_rows_kernel(const uint8_t* __restrict__ src, const int* __restrict__ perm, int rows, int topk,
                                   int64_t row_bytes, uint8_t* __restrict__ dst) {
  const int64_t q = row_bytes / 16;
  const int64_t total = static_cast<int64_t>(rows) * q;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i / q, c = i % q;
    const int64_t s = perm[p] / topk;
    reinterpret_cast<uint4*>(dst + p * row_bytes)[c] = reinterpret_cast<const uint4*>(src + s * row_bytes)[c];
  }
}

// h[p, i] from gu[p] = [g(I) | u(I)]; rows p < n_routed use weights[perm[p]], the
// others (shared expert) weight 1.
__global__ void swiglu_rows_kernel(const float* __restrict__ gu, int rows, int n_routed, int I,
                                   const int* __restrict__ perm, const float* __restrict__ weights, float lim,
                                   int bf16, float* __restrict__ h) {
  const int64_t total = static_cast<int64_t>(rows) * I;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = k / I, i = k % I;
    const float w = p < n_routed ? weights[perm[p]] : 1.0f;
    const float* r = gu + p * 2 * I;
    h[k] = dev::swiglu_h(r[i], r[I + i], w, lim, bf16);
  }
}

// out[t, :] = sum over slots in ascending expert id of y[inv[t*topk + j]] (+ y[n_routed + t]).
__global__ void combine_kernel(const float* __restrict__ yp, const int* __restrict__ inv,
                               const int32_t* __restrict__ ids, int topk, int n_routed, int has_shared, int D,
                               int bf16, void* y, int yt, int64_t ldy) {
  __shared__ int rows[kMaxSlots];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int ord[kMaxSlots];
    for (int j = 0; j < topk; ++j) ord[j] = j;
    for (int a = 1; a < topk; ++a) {
      const int v = ord[a];
      int b = a - 1;
      while (b >= 0 && ids[t * topk + ord[b]] > ids[t * topk + v]) {
        ord[b + 1] = ord[b];
        --b;
      }
      ord[b + 1] = v;
    }
    for (int j = 0; j < topk; ++j) rows[j] = inv[t * topk + ord[j]];
    rows[topk] = n_routed + t;
  }
  __syncthreads();
  const int S = topk + has_shared;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float tot = 0.0f;
    for (int s = 0; s < S; ++s) {
      float v = yp[static_cast<int64_t>(rows[s]) * D + d];
      if (bf16) v = round_bf16(v);
      tot += v;
    }
    dev::store_act(y, yt, static_cast<int64_t>(t) * ldy + d, tot);
  }
}

struct PrefillLayout {
  size_t xq, counts, offs, perm, inv, xg, gu, h, hq, yp, wd, total;
};
PrefillLayout prefill_layout(const MoeLayer& m, int T, int topk, size_t cs) {
  const size_t D = static_cast<size_t>(m.hidden), I = static_cast<size_t>(m.inter);
  const size_t Tk = static_cast<size_t>(T) * topk;
  const size_t rows_all = Tk + (m.shared_w1.data ? T : 0);
  PrefillLayout L{};
  size_t off = 0;
  auto take = [&](size_t& at, size_t bytes) {
    at = off;
    off = align256(off + bytes);
  };
  take(L.xq, T * D * cs);
  take(L.counts, m.n_experts * 4);
  take(L.offs, (m.n_experts + 1) * 4);
  take(L.perm, Tk * 4);
  take(L.inv, Tk * 4);
  take(L.xg, Tk * D * cs);
  take(L.gu, rows_all * 2 * I * 4);
  take(L.h, rows_all * I * 4);
  take(L.hq, rows_all * I * cs);
  take(L.yp, rows_all * D * 4);
  take(L.wd, 2 * I * D * cs);
  L.total = off;
  return L;
}

unsigned grid_for(int64_t n, int per_block = 256) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block,
                                                                       static_cast<int64_t>(sm_count()) * 16)));
}

// The grouped path (moe_grouped.h): grouping and tile plan on the device, one launch for
// the gate / up products (SwiGLU and QA8 fused), one for the down products, the combine.
struct GroupedLayout {
  size_t counts, offs, perm, inv, tiles, ntiles, xb, hq, yp, total;
};
GroupedLayout grouped_layout(const MoeLayer& m, int T, int topk) {
  const size_t D = static_cast<size_t>(m.hidden), I = static_cast<size_t>(m.inter);
  const size_t Tk = static_cast<size_t>(T) * topk;
  const size_t rows_all = Tk + (m.shared_w1.data ? T : 0);
  GroupedLayout L{};
  size_t off = 0;
  auto take = [&](size_t& at, size_t bytes) {
    at = off;
    off = align256(off + bytes);
  };
  take(L.counts, m.n_experts * 4);
  take(L.offs, (m.n_experts + 1) * 4);
  take(L.perm, Tk * 4);
  take(L.inv, Tk * 4);
  take(L.tiles, static_cast<size_t>(grouped_max_tiles(m, T, topk)) * sizeof(int4));
  take(L.ntiles, 4);
  take(L.xb, rows_all * D * 2);
  take(L.hq, rows_all * I * 2);
  take(L.yp, rows_all * D * 4);
  L.total = off;
  return L;
}

bool prefill_grouped() { return sw::get_str(sw::Id::MOE_PREFILL) != "cublas"; }

void moe_prefill_grouped(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk,
                         const int32_t* ids, const float* weights, DType yt, void* y, int64_t ldy, void* ws,
                         size_t ws_bytes, cudaStream_t stream) {
  const GroupedLayout L = grouped_layout(m, T, topk);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_prefill: workspace too small (", ws_bytes, " < ", L.total, ")");
  char* base = static_cast<char*>(ws);
  auto at = [&](size_t o) { return static_cast<void*>(base + o); };
  const int E = m.n_experts;
  const int Tk = T * topk;
  const bool has_shared = m.shared_w1.data != nullptr;
  int* counts = static_cast<int*>(at(L.counts));
  int* offs = static_cast<int*>(at(L.offs));
  int* perm = static_cast<int*>(at(L.perm));
  int* inv = static_cast<int*>(at(L.inv));
  uint16_t* xb = static_cast<uint16_t*>(at(L.xb));
  uint16_t* hq = static_cast<uint16_t*>(at(L.hq));
  float* yp = static_cast<float*>(at(L.yp));
  // 1. group the (token, slot) entries by expert (ids outside [0, E) are dropped)
  DSX_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * 4, stream));
  count_kernel<<<grid_for(Tk), 256, 0, stream>>>(ids, Tk, E, counts);
  scan_kernel<<<1, 32, 0, stream>>>(counts, E, offs);
  compact_kernel<<<static_cast<unsigned>(E), kThreads, 0, stream>>>(ids, Tk, offs, perm, inv);
  DSX_CUDA_CHECK(cudaGetLastError());
  GroupedMoe g;
  g.T = T;
  g.topk = topk;
  g.counts = counts;
  g.offs = offs;
  g.perm = perm;
  g.weights = weights;
  g.tiles = static_cast<int4*>(at(L.tiles));
  g.n_tiles = static_cast<int*>(at(L.ntiles));
  // 2. the tiles, the QA8'd rows, the products
  grouped_plan(m, g, stream);
  grouped_gather_qa8(m, g, xt, x, ldx, xb, stream);
  grouped_up(m, g, xb, yt == DType::BF16, hq, nullptr, stream);
  grouped_down(m, g, hq, yp, stream);
  // 3. combine in the reference order
  combine_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(yp, inv, ids, topk, Tk, has_shared ? 1 : 0,
                                                                static_cast<int>(m.hidden), yt == DType::BF16 ? 1 : 0,
                                                                y, static_cast<int>(yt), ldy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t moe_prefill_ws_bytes(const MoeLayer& m, int T, int topk) {
  // (either path: the switch is read per call)
  return std::max(prefill_layout(m, T, topk, 4).total, grouped_layout(m, T, topk).total);
}

void moe_prefill(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                 const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                 cudaStream_t stream, const MoePrefillOpts& opts) {
  if (T <= 0) return;
  check_layer(m, topk);
  if (prefill_grouped() && grouped_supported(m)) {
    moe_prefill_grouped(m, xt, x, ldx, T, topk, ids, weights, yt, y, ldy, ws, ws_bytes, stream);
    return;
  }
  // the dequant + cuBLAS path (DSX_MOE_PREFILL=cublas)
  const bool bf16 = yt == DType::BF16;
  const DType ct = bf16 ? DType::BF16 : DType::F32;
  const size_t cs = dtype_size(ct);
  const PrefillLayout L = prefill_layout(m, T, topk, cs);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_prefill: workspace too small (", ws_bytes, " < ", L.total, ")");
  char* base = static_cast<char*>(ws);
  const int E = m.n_experts;
  const int64_t D = m.hidden, I = m.inter;
  const int Tk = T * topk;
  const bool has_shared = m.shared_w1.data != nullptr;
  const int rows_all = Tk + (has_shared ? T : 0);
  auto at = [&](size_t o) { return static_cast<void*>(base + o); };
  uint8_t* xq = static_cast<uint8_t*>(at(L.xq));
  int* counts = static_cast<int*>(at(L.counts));
  int* offs = static_cast<int*>(at(L.offs));
  int* perm = static_cast<int*>(at(L.perm));
  int* inv = static_cast<int*>(at(L.inv));
  uint8_t* xg = static_cast<uint8_t*>(at(L.xg));
  float* gu = static_cast<float*>(at(L.gu));
  float* h = static_cast<float*>(at(L.h));
  uint8_t* hq = static_cast<uint8_t*>(at(L.hq));
  float* yp = static_cast<float*>(at(L.yp));
  uint8_t* wd = static_cast<uint8_t*>(at(L.wd));

  // 1. QA8 of the input, once for every expert
  qa8_fake(xt, x, ldx, T, D, m.qblock, ct, xq, D, stream);
  // 2. group the (token, slot) entries by expert
  DSX_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * 4, stream));
  count_kernel<<<grid_for(Tk), 256, 0, stream>>>(ids, Tk, E, counts);
  scan_kernel<<<1, 32, 0, stream>>>(counts, E, offs);
  compact_kernel<<<static_cast<unsigned>(E), kThreads, 0, stream>>>(ids, Tk, offs, perm, inv);
  DSX_CUDA_CHECK(cudaGetLastError());
  gather_rows_kernel<<<grid_for(static_cast<int64_t>(Tk) * D * cs / 16), 256, 0, stream>>>(xq, perm, Tk, topk,
                                                                                          D * cs, xg);
  DSX_CUDA_CHECK(cudaGetLastError());
  // 3. counts and expert pointers to the host (the one synchronisation)
  std::vector<int> cnt(static_cast<size_t>(E));
  std::vector<const uint8_t*> p1(E), p1s(E), p3(E), p3s(E), p2(E), p2s(E);
  const size_t pb = static_cast<size_t>(E) * sizeof(void*);
  DSX_CUDA_CHECK(cudaMemcpyAsync(cnt.data(), counts, static_cast<size_t>(E) * 4, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p1.data(), m.w1, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p1s.data(), m.w1_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p3.data(), m.w3, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p3s.data(), m.w3_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p2.data(), m.w2, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p2s.data(), m.w2_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));

  const int gmin = std::max(1, opts.gemm_min_tokens);
  GemvOpts gv;
  gv.qa8 = false;  // inputs are already QA8'd
  auto mx = [&](const uint8_t* w, const uint8_t* s, int64_t N, int64_t K) {
    QMatrix q;
    q.fmt = WFormat::MXFP4;
    q.rows = N;
    q.cols = K;
    q.block = 32;
    q.data = w;
    q.scale = s;
    q.tiled = m.tiled;
    q.name = "expert";
    return q;
  };
  // gate/up of one expert (or the shared expert): rows n of input a -> gu rows
  auto up = [&](const QMatrix& q1, const QMatrix& q3, const void* a, int n, float* out) {
    if (n >= gmin) {
      dequant(q1, ct, wd, stream);  // (q1, q3: [I, D])
      dequant(q3, ct, wd + I * D * cs, stream);
      gemm_dense(ct, a, D, n, wd, 2 * I, D, DType::F32, out, 2 * I, stream);
    } else {
      gemv(q1, ct, a, D, n, DType::F32, out, 2 * I, gv, stream);
      gemv(q3, ct, a, D, n, DType::F32, out + I, 2 * I, gv, stream);
    }
  };
  auto down = [&](const QMatrix& q2, const void* a, int n, float* out) {
    if (n >= gmin) {
      dequant(q2, ct, wd, stream);  // ([D, I])
      gemm_dense(ct, a, I, n, wd, D, I, DType::F32, out, D, stream);
    } else {
      gemv(q2, ct, a, I, n, DType::F32, out, D, gv, stream);
    }
  };

  // 4. gate/up products
  int off = 0;
  for (int e = 0; e < E; ++e) {
    const int n = cnt[static_cast<size_t>(e)];
    if (n > 0) up(mx(p1[e], p1s[e], I, D), mx(p3[e], p3s[e], I, D), xg + static_cast<int64_t>(off) * D * cs, n,
                  gu + static_cast<int64_t>(off) * 2 * I);
    off += n;
  }
  DSX_CHECK(off == Tk, "moe_prefill: expert ids outside [0, ", E, ")");
  if (has_shared) up(m.shared_w1, m.shared_w3, xq, T, gu + static_cast<int64_t>(Tk) * 2 * I);
  // 5. SwiGLU (+ routing weight) and QA8 of the hidden rows
  swiglu_rows_kernel<<<grid_for(static_cast<int64_t>(rows_all) * I), 256, 0, stream>>>(
      gu, rows_all, Tk, static_cast<int>(I), perm, weights, m.swiglu_limit, bf16 ? 1 : 0, h);
  DSX_CUDA_CHECK(cudaGetLastError());
  qa8_fake(DType::F32, h, I, rows_all, I, m.qblock, ct, hq, I, stream);
  // 6. down products
  off = 0;
  for (int e = 0; e < E; ++e) {
    const int n = cnt[static_cast<size_t>(e)];
    if (n > 0)
      down(mx(p2[e], p2s[e], D, I), hq + static_cast<int64_t>(off) * I * cs, n, yp + static_cast<int64_t>(off) * D);
    off += n;
  }
  if (has_shared) down(m.shared_w2, hq + static_cast<int64_t>(Tk) * I * cs, T, yp + static_cast<int64_t>(Tk) * D);
  // 7. combine in the reference order
  combine_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(yp, inv, ids, topk, Tk, has_shared ? 1 : 0,
                                                                static_cast<int>(D), bf16 ? 1 : 0, y,
                                                                static_cast<int>(yt), ldy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
