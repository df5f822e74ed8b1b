#include "kernels/cuda/moe.h"

#include <algorithm>
#include <climits>

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_ring_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_ring_device.cuh"
#include "util/error.h"


namespace dsx::cuda {

using namespace moe_detail;

namespace {

using namespace moe_dev;

constexpr size_t kSmemBudget = 100 * 1024;
constexpr int kDownRPW = 2;  // rows per warp unit of the down projection


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


// Up projection of one token: a persistent grid (resident blocks) walks the units
// (shared-expert tiles first, then (slot, tile) of the routed experts) in pairs, in
// strides of the grid; a block stages the activation (QA8, in the B order of each format
// it meets, or copies what its producer staged) once; its 8 warps stream w1 and w3
// (quarters of D) of each unit, whose sums are added in a fixed order, then SwiGLU and
// the routing weight, and QA8 of h is staged for the down kernel (DownStage). Shared
// memory: [rings | FP8 B | scales | MXFP4 B | scales | partial sums per unit | arrival
// counter per unit].
//
// ROWS: row blockIdx.y of several, each the one-token chain of its own row (x, ids,
// weights, hq and hst offset by the row): moe_decode's per-row path for small experts.
template <int U, bool ROWS = false>
__global__ void __launch_bounds__(kThreads, 2) moe_up_ring_t1_kernel(const UpMmaParams p_in) {
  UpMmaParams p_row;
  if constexpr (ROWS) {
    const int t = static_cast<int>(blockIdx.y);
    p_row = p_in;
    p_row.x = static_cast<const uint8_t*>(p_in.x) + t * p_in.ldx * (p_in.xt == static_cast<int>(DType::BF16) ? 2 : 4);
    p_row.ids = p_in.ids + t * p_in.topk;
    p_row.wts = p_in.wts + t * p_in.topk;
    p_row.hq = p_in.hq + static_cast<int64_t>(t) * p_in.S * p_in.I;
    p_row.hst = p_in.hst + t * DownStage(p_in.topk, p_in.I / 32).words;
  }
  const UpMmaParams& p = ROWS ? p_row : p_in;
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

template <int U, bool ROWS = false>
__global__ void __launch_bounds__(kDownRingThreads, 1) moe_down_ring_t1_kernel(const DownMmaParams p_in) {
  DownMmaParams p_row;  // (ROWS: as the up kernel's)
  if constexpr (ROWS) {
    const int t = static_cast<int>(blockIdx.y);
    p_row = p_in;
    p_row.ids = p_in.ids + t * p_in.topk;
    p_row.hst = p_in.hst + t * DownStage(p_in.topk, p_in.NBI).words;
    p_row.y = static_cast<uint8_t*>(p_in.y) + t * p_in.ldy * (p_in.yt == static_cast<int>(DType::BF16) ? 2 : 4);
  }
  const DownMmaParams& p = ROWS ? p_row : p_in;
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
  L.hst = off;  // per token (the ring kernels)
  off = align256(off + static_cast<size_t>(T) * DownStage(topk, static_cast<int>(m.inter / 32)).words * 4);
  L.total = off;
  return L;
}


// Partial sums and arrival counters of the up kernel for max_units units per block.
size_t up_red_bytes(int max_units) { return static_cast<size_t>(max_units) * (kWarps * 16 * 4 + 4); }

// Launch plan of the one-token ring kernels with U spans in flight per warp (ok: they fit).
struct RingT1Plan {
  bool ok = false;
  int64_t grid_up = 0, grid_dn = 0;
  int max_units = 0, max_tiles = 0;
  size_t smem_up = 0, smem_dn = 0;
};
// rows > 1: the grids of `rows` rows side by side (the per-row path), each row's sized
// for its share of the SMs.
template <int U, bool ROWS = false>
RingT1Plan ring_t1_plan(int topk, int has_shared, int64_t n_up, int NB, int NTD, size_t smem_dn, int rows = 1) {
  RingT1Plan pl;
  auto kdn = moe_down_ring_t1_kernel<U, ROWS>;
  auto kup = moe_up_ring_t1_kernel<U, ROWS>;
  const int sms = std::max(1, sm_count() / rows);
  const size_t stage = 2 * (static_cast<size_t>(NB) * 64 + static_cast<size_t>((NB + 3) & ~3) * 4);
  // down: one block per SM (16 warps); per tile of a block the pieces' partial sums and a counter
  pl.grid_dn = std::min<int64_t>(NTD, sms);
  pl.max_tiles = static_cast<int>((NTD + pl.grid_dn - 1) / pl.grid_dn);
  const int pieces = 2 * (topk + 2 * has_shared);
  pl.smem_dn = ring_bytes<U>(kDownRingWarps) + smem_dn + 16 +
               static_cast<size_t>(pl.max_tiles) * (static_cast<size_t>(pieces) * 64 + 4);
  if (pl.smem_dn > detail::max_dynamic_smem(kdn) || detail::occupancy(kdn, kDownRingThreads, pl.smem_dn) < 1)
    return pl;
  // up: resident blocks with room for the partial sums of their units
  const size_t base = ring_bytes<U>(kWarps) + stage;
  if (base > detail::max_dynamic_smem(kup)) return pl;
  const int64_t n_pairs = n_up / 2;  // the kernel's units go in pairs (whole QA8 blocks of h)
  for (int occ = detail::occupancy(kup, kThreads, base); occ >= 1; --occ) {
    const int64_t grid = std::min<int64_t>(n_pairs, static_cast<int64_t>(occ) * sms);
    const int max_units = static_cast<int>(2 * ((n_pairs + grid - 1) / grid));
    const size_t smem1 = base + up_red_bytes(max_units);
    if (smem1 <= detail::max_dynamic_smem(kup) && detail::occupancy(kup, kThreads, smem1) >= occ) {
      pl.grid_up = grid;
      pl.max_units = max_units;
      pl.smem_up = smem1;
      pl.ok = true;
      return pl;
    }
  }
  return pl;
}

// The one-token ring kernels with U spans in flight per warp; false when they do not fit.
// ROWS: up.T rows, each the one-token chain of its row (grids side by side).
template <int U, bool ROWS = false>
bool launch_ring_t1(const UpMmaParams& up, const DownMmaParams& dn, int64_t n_up, int NB, int NTD, size_t smem_dn,
                    cudaStream_t stream) {
  const int rows = ROWS ? up.T : 1;
  const RingT1Plan pl = ring_t1_plan<U, ROWS>(dn.topk, dn.has_shared, n_up, NB, NTD, smem_dn, rows);
  if (!pl.ok) return false;
  UpMmaParams up1 = up;
  up1.max_units = pl.max_units;
  DownMmaParams dn1 = dn;
  dn1.max_tiles = pl.max_tiles;
  detail::launch_pdl(moe_up_ring_t1_kernel<U, ROWS>, dim3(static_cast<unsigned>(pl.grid_up), rows), dim3(kThreads),
                     pl.smem_up, stream, up1);
  detail::launch_pdl(moe_down_ring_t1_kernel<U, ROWS>, dim3(static_cast<unsigned>(pl.grid_dn), rows),
                     dim3(kDownRingThreads), pl.smem_dn, stream, dn1);
  return true;
}

// The tensor-core decode path when it applies (false: the CUDA-core kernels).
// per_row (T = 2..8): each row the one-token ring kernels' chain, side by side, when
// they fit (else false, before anything is launched).
bool moe_decode_mma(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                    const float* weights, DType yt, void* y, int64_t ldy, char* base, const DecodeLayout& L,
                    cudaStream_t stream, const uint32_t* x_staged, bool per_row = false) {
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
  if (per_row) return T > 1 && launch_ring_t1<kRingU, true>(up, dn, up.n_sblocks + topk * NTI, NB, NTD, smem_dn, stream);
  detail::launch_pdl(kup, dim3(static_cast<unsigned>(n_up)), dim3(kThreads), smem_up, stream, up);
  detail::launch_pdl(moe_down_mma_kernel, dim3(static_cast<unsigned>(T * NTD)), dim3(kThreads), smem_dn, stream, dn);
  return true;
}

}  // namespace

namespace moe_detail {

// The conditions under which a one-row moe_decode runs the one-token ring kernels (the
// mode test aside: moe_decode_mma's shape tests and launch plans at T = 1).
bool ring_t1_supported(const MoeLayer& m, int topk) {
  const bool has_shared = m.shared_w1.data != nullptr;
  const int S = topk + (has_shared ? 1 : 0);
  if (m.qblock != 32 || m.inter % 32 != 0 || m.hidden % 32 != 0 || S > kMaxSlots) return false;
  if (has_shared && (m.shared_w1.block < 16 || m.shared_w2.block < 16)) return false;
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
  const int NB = D / 32, NBI = I / 32, NTI = (I + 15) / 16, NTD = (D + 15) / 16;
  const size_t smem_up = static_cast<size_t>(NB) * (64 + 4) + kWarps * 16 * 8 * 4;
  if (smem_up > detail::max_dynamic_smem(moe_up_mma_kernel<1>)) return false;
  const size_t smem_dn = static_cast<size_t>(topk + 1) * NBI * (64 + 4) + 16;
  if (smem_dn > detail::max_dynamic_smem(moe_down_mma_kernel)) return false;
  const int64_t n_up = (has_shared ? NTI : 0) + static_cast<int64_t>(topk) * NTI;
  return ring_t1_plan<kRingU>(topk, has_shared ? 1 : 0, n_up, NB, NTD, smem_dn).ok;
}

// All of a layer's routed experts fit in a third of the L2 (H200: 50 MB): rows that
// stream their experts one by one then re-read shared experts from L2, and the one-token
// kernels side by side beat the expert-major rows kernels' three dependent launches
// (trained model, 8 experts of 0.08 MB, ncu: the rows kernels 40 us a layer for 6 rows,
// the one-row ring kernels 12.5 us; its 9-layer 6-row pass 0.811 -> 0.622 ms). The
// release's experts (13 MB each) take the rows kernels.
bool experts_fit_l2(const MoeLayer& m) {
  const double expert = 3.0 * static_cast<double>(m.hidden) * static_cast<double>(m.inter) * (0.5 + 1.0 / 32.0);
  return static_cast<double>(m.n_experts) * expert <= 16e6;
}

}  // namespace moe_detail

size_t moe_decode_ws_bytes(const MoeLayer& m, int T, int topk) {
  return std::max(decode_layout(m, T, topk).total, rows_ws_bytes(m, T, topk));
}

void moe_decode(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                cudaStream_t stream, const uint32_t* x_staged) {
  if (T <= 0) return;
  check_layer(m, topk);
  const DecodeLayout L = decode_layout(m, T, topk);
  char* base = static_cast<char*>(ws);
  // 2..8 rows of small experts: each row the one-token kernels' chain, the rows side by
  // side in one launch each (bit for bit one-row results: the same kernels)
  if (T >= 2 && T <= 8 && experts_fit_l2(m) && ring_t1_supported(m, topk)) {
    DSX_CHECK(ws && ws_bytes >= L.total, "moe_decode: workspace too small (", ws_bytes, " < ", L.total, ")");
    if (moe_decode_mma(m, xt, x, ldx, T, topk, ids, weights, yt, y, ldy, base, L, stream, nullptr, true)) return;
  }
  // 2..16 rows: each distinct expert streamed once for all its rows (moe_rows.cu)
  if (T >= 2 && moe_decode_rows(m, xt, x, ldx, T, topk, ids, weights, yt, y, ldy, ws, ws_bytes, stream)) return;
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_decode: workspace too small (", ws_bytes, " < ", L.total, ")");
  const int S = topk + (m.shared_w1.data ? 1 : 0);
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
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


// ---- shared by the decode and prefill files (moe_internal.cuh) ------------------
namespace moe_detail {

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


}  // namespace moe_detail

}  // namespace dsx::cuda
