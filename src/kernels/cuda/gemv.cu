#include "kernels/cuda/gemv.h"

#include <algorithm>
#include <cstdio>

#include "kernels/cuda/argmax.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_ring_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/gemv_rows.h"
#include "kernels/cuda/gemv_stream.h"
#include "kernels/cuda/signal_device.cuh"
#include "util/error.h"
#include "util/switches.h"

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
  // GemvOpts::pick (T = 1, G = 1, KB = 1, f32 y): the best key so far and the blocks' ticket
  unsigned long long* pick_key;
  unsigned* pick_ticket;
  int32_t* pick;
  int32_t* pick_copy;
};

// The greedy pick's order as one 64-bit key: larger values first, then smaller indices
// (the float's bits made monotone, above the complemented index); NaN: 0, below every
// value (-inf included). -0 counts as +0, as the comparisons of argmax do.
__device__ __forceinline__ unsigned long long pick_key_of(float v, int64_t n) {
  if (isnan(v)) return 0ull;
  const uint32_t u = v == 0.0f ? 0u : __float_as_uint(v);
  const uint32_t o = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(o) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(n));
}

// The end of a picking launch (all threads of every block): the block's best key into
// *pick_key; the last block to count in writes the id and resets the workspace.
__device__ __forceinline__ void pick_finish(unsigned long long best, const Params& p) {
  __shared__ unsigned long long wbest[kWarps];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long b = __shfl_xor_sync(0xffffffffu, best, o);
    best = b > best ? b : best;
  }
  if ((threadIdx.x & 31) == 0) wbest[threadIdx.x >> 5] = best;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kWarps; ++w) best = wbest[w] > best ? wbest[w] : best;
    if (best) atomicMax(p.pick_key, best);
    // (the acquire-release ticket orders the atomicMax before it; resets the ticket)
    if (dev::last_block_arrive(p.pick_ticket, gridDim.x * gridDim.y * gridDim.z)) {
      const unsigned long long k = atomicAdd(p.pick_key, 0ull);
      const float y0 = __ldcg(static_cast<const float*>(p.y));
      const int32_t id = (k == 0ull || isnan(y0)) ? 0 : static_cast<int32_t>(0xFFFFFFFFu - static_cast<uint32_t>(k));
      p.pick[0] = id;
      if (p.pick_copy) p.pick_copy[0] = id;
      *p.pick_key = 0ull;  // (every block has counted in)
    }
  }
}

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
  unsigned long long best = 0ull;  // GemvOpts::pick: the best key this thread stored
  // output n (within the group) of token tt: a K split's partial sum, or y (and its key)
  auto emit = [&](int64_t tt, int64_t n, float v) {
    if (p.KB > 1) {
      p.part[(static_cast<int64_t>(kb) * p.T + tt) * GN + grow0 + n] = v;
      return;
    }
    dev::store_act(p.y, p.yt, tt * p.ldy + grow0 + n, v);
    if (p.pick_key) {
      const unsigned long long k = pick_key_of(v, grow0 + n);
      best = k > best ? k : best;
    }
  };

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
            if (n < p.N && t < nt) emit(t0 + t, n, s);
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
              if (n < p.N && t < nt) emit(t0 + t, n, acc[r][t]);
            }
          }
      }
    }
  }
  if (p.pick_key) pick_finish(best, p);
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


// ---------------------------------------------------------------------------------
// Tensor-core path (see gemv_device.cuh): QA8'd activations against FP8_BLOCK / MXFP4
// weights, qblock 32, one group, T <= 8 (FP8) / 4 (MXFP4); and (QA = false, shared ring
// only) FP8_BLOCK against unquantized bf16 activations, grouped (wo_a). A block of 8
// warps stages the activations once (after issuing its first weight loads), then each
// warp streams 16-row tiles; KS warps split K and their partial sums are added in a
// fixed order. Groups: the grid is G equal slices of bpg blocks, slice g streaming only
// the tiles of group g (rows [g N, (g+1) N), N % 16 == 0 when G > 1), so a block stages
// only its group's activations x[t, g K .. (g+1) K).

struct MmaParams {
  dev::WView W;
  int64_t N;  // rows per group
  int G = 1;  // groups
  int64_t bpg = 0;  // blocks per group (gridDim.x = G * bpg)
  int NB, nsp, KS, TPB, tstride;
  int64_t n_tiles, ntg;  // per group
  const void* x;
  int xt;
  int64_t ldx;
  int T;
  void* y;
  int yt;
  int64_t ldy;
  float prescale;
  const float* norm_w;  // optional RMS norm of the (one-token) input, GemvOpts::norm_w
  float norm_eps;
  void* norm_out;
  const uint32_t* staged;  // GemvOpts::staged (one token, the shared-ring FP8 kernel only)
  uint32_t* norm_staged;   // GemvOpts::norm_staged (block 0 copies its staged B)
  uint32_t* out_staged;    // GemvOpts::out_staged (the K-split epilogue, pairs of tiles per block)
  int64_t out_nb;          // 32-element blocks of the output row (all groups)
};

// U: spans in flight per lane (U KB per warp). Every warp walks the same number Pw of
// spans per tile (its real spans padded to a multiple of U with empty ones), so the
// unrolled groups of U spans are branch-free and the compiler overlaps their latencies.
// R (ring): the spans in flight live in a shared-memory ring filled by cp.async
// (gemv_device.cuh, U in flight per warp) instead of registers.
// QA = false: the activations are staged without QA8 (stage_b_mma<F, HW, false>).
template <WFormat F, bool HW, int P, int U, bool R = false, bool QA = true>
__global__ void __launch_bounds__(kThreads, R ? 1 : 2) gemv_mma_kernel(const MmaParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  __shared__ uint4 s_zero[4];
  uint4* ring = smem_mma + (threadIdx.x >> 5) * (U + 1) * 64;  // R only: this warp's slots
  uint32_t* bs = reinterpret_cast<uint32_t*>(smem_mma + (R ? kWarps * (U + 1) * 64 : 0));
  float* sas = reinterpret_cast<float*>(bs + static_cast<int64_t>(p.T) * p.tstride * 16);
  float* red = sas + static_cast<int64_t>(p.T) * p.tstride;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int wr = warp / p.KS, wk = warp % p.KS;
  const int s_lo = static_cast<int>(static_cast<int64_t>(p.nsp) * wk / p.KS);
  const int s_hi = static_cast<int>(static_cast<int64_t>(p.nsp) * (wk + 1) / p.KS);
  const int nspw = s_hi - s_lo;
  const int Pw = ((p.nsp + p.KS - 1) / p.KS + U - 1) / U * U;  // padded spans per tile (uniform)
  // this block's group and its place in the group's slice of the grid (groups: shared
  // ring only; the register ring keeps its registers for the spans: grp = 0 folds away)
  const int grp = R ? static_cast<int>(blockIdx.x / p.bpg) : 0;
  const int64_t bx = blockIdx.x - static_cast<int64_t>(grp) * p.bpg;
  const int64_t grow0 = static_cast<int64_t>(grp) * p.N;  // first weight row / output of the group
  const int64_t row_last = grow0 + p.N - 1;                // loads clamp rows to the group
  const int rounds = static_cast<int>((p.ntg - bx + p.bpg - 1) / p.bpg);
  const int64_t tile_step = p.bpg * p.TPB;
  const int64_t tile0 = bx * p.TPB + wr;  // tile index within the group
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);

  // load cursor: (round, k) with k < Pw (register ring); spans k >= nspw and rounds
  // >= rounds are empty. Shared ring: a RingLoad per round (piece).
  int l_r = 0, l_k = 0;
  auto advance = [&]() {
    const bool wrap = ++l_k == Pw;  // branch-free cursor update
    l_k = wrap ? 0 : l_k;
    l_r += wrap ? 1 : 0;
  };
  auto row_of = [&](int r) { return grow0 + (tile0 + static_cast<int64_t>(r) * tile_step) * 16; };  // weight row
  dev::MmaSlot<F> regs[R ? 1 : U];
  dev::RingLoad ld;
  // shared ring: this lane's address in slot 0, and the byte offsets of the slots to
  // fill and to read next (dev::next_ring_slot)
  const uint32_t ring_lane = dev::smem_u32(ring + lane);
  uint32_t off_in = 0, off_out = 0;
  // next span of the shared ring: its copies, then the cursor moves to the next round
  auto ring_issue = [&]() {
    ld.issue_at(ring_lane + off_in);
    off_in = dev::next_ring_slot<U>(off_in);
    if (ld.left == 0 && l_r + 1 < rounds) ld.set(p.W, row_of(++l_r), row_last, s_lo, s_hi, lane);
  };
  if constexpr (R) {
    if (rounds > 0) ld.set(p.W, row_of(0), row_last, s_lo, s_hi, lane);
#pragma unroll 1
    for (int u = 0; u < U; ++u) ring_issue();
  } else {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dev::mma_slot_load<F>(regs[u], p.W, row_of(l_r), row_last, s_lo + l_k, p.NB, lane,
                            l_k < nspw && l_r < rounds);
      advance();
    }
  }

  if (p.norm_w) {  // the input norm's weights into L2 (read by the staging after the wait)
    const int lines = (p.NB * 32 * 4 + 127) / 128;
    for (int i = threadIdx.x; i < lines; i += blockDim.x)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(p.norm_w) + i * 128));
  }
  dev::pdl_wait();
  if (p.staged) {  // (T = 1, one group: try_launch_mma) bs then sas, as staged by the producer
    dev::copy_to_smem(bs, p.staged, static_cast<int64_t>(p.NB) * 17);
  } else if (p.norm_w) {  // (one token, one group: gemv_mma checks)
    dev::StageNorm nrm;
    nrm.w = p.norm_w;
    nrm.in_pass = dev::norm_in_pass(p.NB);  // (else the row is read twice)
    nrm.eps = p.norm_eps;
    if (!nrm.in_pass) nrm.r = dev::block_inv_rms(p.x, p.xt, p.NB * 32, p.norm_eps);
    nrm.out = blockIdx.x == 0 ? p.norm_out : nullptr;  // block 0 also writes the normalized row
    dev::stage_b_mma<F, HW, QA>(bs, sas, p.tstride, p.T, p.NB, p.x, p.xt, p.ldx, 0, p.prescale, nullptr, 0, &nrm);
  } else {
    dev::stage_b_mma<F, HW, QA>(bs, sas, p.tstride, p.T, p.NB, p.x, p.xt, p.ldx, static_cast<int64_t>(grp) * p.NB * 32,
                                p.prescale);
  }
  __syncthreads();
  if (p.norm_staged && blockIdx.x == 0) {  // (T = 1, FP8 with the hardware order: try_launch_mma)
    for (int i = threadIdx.x; i < p.NB * 17; i += blockDim.x) p.norm_staged[i] = bs[i];  // bs, then sas
  }
  dev::pdl_launch_dependents();
  dev::trace_mark(51);
  dev::trace_block(55);
  const uint32_t* bzero = reinterpret_cast<const uint32_t*>(s_zero);

  const int g = lane >> 2;
  for (int r = 0; r < rounds; ++r) {
    const int64_t row0 = row_of(r);
    float acc[P][2];
#pragma unroll
    for (int q = 0; q < P; ++q) acc[q][0] = acc[q][1] = 0.f;
    if constexpr (R) {
      // P = 2 (FP8, 5..8 tokens): the several-pass consumer, the weights converted once
      static_assert(P == 1 || F == WFormat::FP8_BLOCK, "the shared ring streams 2 token passes for FP8 only");
      // (spans without bound tests when K holds whole spans)
      auto body = [&](auto& cons) {
        cons.set(p.W, row0, row_last, bs, sas, p.tstride, p.T, p.NB, s_zero, lane);
#pragma unroll 2
        for (int k = 0; k < nspw; ++k) {
          dev::cp_async_wait<U - 1>();
          if constexpr (P == 1)
            cons.span_at(ring_lane + off_out, s_lo + k, acc[0], lane);
          else
            cons.span_at(ring_lane + off_out, s_lo + k, acc, lane);
          ring_issue();  // refills the slot read one span ago (its data has been consumed)
          off_out = dev::next_ring_slot<U>(off_out);
        }
      };
      if constexpr (P == 1)
        dev::with_ring_cons<F>(p.NB, p.W, body);
      else
        dev::with_rows_cons<F, P>(p.NB, p.W, body);
    } else {
      for (int k0 = 0; k0 < Pw; k0 += U) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
          dev::mma_slot_consume<F, HW, P>(regs[u], acc, bs, sas, p.tstride, p.T, s_lo + k0 + u, p.NB, lane, p.W,
                                          row0, row_last, bzero);
          dev::mma_slot_load<F>(regs[u], p.W, row_of(l_r), row_last, s_lo + l_k, p.NB, lane,
                                l_k < nspw && l_r < rounds);
          advance();
        }
      }
    }
    dev::mma_acc_finish<F, P>(acc);
    if (dev::mma_acc_writer<F>(lane)) {
#pragma unroll
      for (int pp = 0; pp < P; ++pp) {
        const int t = dev::mma_acc_token<F>(pp, lane);
        if (t < p.T) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int rl = g + 8 * h;
            if (p.KS == 1) {
              if (row0 - grow0 + rl < p.N) dev::store_act(p.y, p.yt, t * p.ldy + row0 + rl, acc[pp][h]);
            } else {
              red[((static_cast<int64_t>(r) * kWarps + warp) * 16 + rl) * 8 + t] = acc[pp][h];
            }
          }
        }
      }
    }
  }
  if constexpr (R) dev::cp_async_wait<0>();  // (only empty copies remain)
  dev::trace_mark(52);
  dev::trace_block(56);
  if (p.KS > 1) {
    // out_staged (T = 1, TPB even: a block's tiles of a round come in pairs, one QA8 block
    // each): the rows' values as stored, kept for the pairs' quantization below
    __shared__ float ysum[2 * kWarps * 16];
    __syncthreads();
    const int items = rounds * p.TPB * 16 * p.T;
    for (int i = threadIdx.x; i < items; i += blockDim.x) {
      const int t = i % p.T;
      int rest = i / p.T;
      const int rl = rest % 16;
      rest /= 16;
      const int wr2 = rest % p.TPB;
      const int r = rest / p.TPB;
      const int64_t tile = bx * p.TPB + wr2 + r * tile_step;
      const int64_t row = tile * 16 + rl;  // within the group
      if (tile < p.n_tiles && row < p.N) {
        float sum = 0.f;
        for (int k2 = 0; k2 < p.KS; ++k2) sum += red[((static_cast<int64_t>(r) * kWarps + wr2 * p.KS + k2) * 16 + rl) * 8 + t];
        dev::store_act(p.y, p.yt, t * p.ldy + grow0 + row, sum);
        if (p.out_staged) ysum[(r * p.TPB + wr2) * 16 + rl] = p.yt == 1 ? round_bf16(sum) : sum;
      }
    }
    if (p.out_staged) {  // warp w: pairs w, w + 8, ... of (round, tile pair)
      __syncthreads();
      const int pairs = rounds * (p.TPB / 2);
      for (int pi = warp; pi < pairs; pi += kWarps) {
        const int r = pi / (p.TPB / 2), w0 = 2 * (pi % (p.TPB / 2));
        const int64_t tile = bx * p.TPB + w0 + static_cast<int64_t>(r) * tile_step;  // even
        if (tile >= p.n_tiles) continue;
        const int64_t kb = (grow0 + tile * 16) / 32;
        dev::stage_block_lanes<WFormat::FP8_BLOCK>(ysum[(r * p.TPB + w0) * 16 + lane], lane, p.out_staged + kb * 16,
                                                   reinterpret_cast<float*>(p.out_staged + p.out_nb * 16) + kb,
                                                   dev::fp8_mma_prescale<true>(), nullptr);
      }
    }
  }
}

}  // namespace

// Runtime switches (util/switches.def; read at every call, so that tests can set them):
// DSX_GEMV_MMA = 0 (off), 1 (BF16 mode, default), 2 (also F32 mode); DSX_MMA_CVT = 1 uses
// the hardware e4m3 -> f16 conversion on the register ring too (the shared ring always
// does); DSX_PDL = 0 launches without programmatic dependent launch (default: with);
// DSX_MMA_U = 4 / 8 forces the register ring's spans in flight per lane (default: per
// shape).
int gemv_mma_mode() { return static_cast<int>(sw::get_int(sw::Id::GEMV_MMA)); }
bool gemv_mma_hwcvt() { return sw::on(sw::Id::MMA_CVT); }
bool pdl_enabled() { return sw::on(sw::Id::PDL); }
int gemv_mma_depth() { return static_cast<int>(sw::get_int(sw::Id::MMA_U)); }  // 0: chosen per shape

namespace {

// DSX_GEMV_TRACE = 1: every gemv() call prints its shape and the kernel it ran to stderr.
bool gemv_trace() { return sw::on(sw::Id::GEMV_TRACE); }
thread_local const char* t_last_path = "";
thread_local bool t_last_staged = false;

struct MmaPlan {
  bool ok = false;
  int KS = 1, TPB = 8, P = 1, nsp = 0, NB = 0;
  int64_t n_tiles = 0, ntg = 0, bpg = 0, grid = 0, rounds = 0;  // n_tiles, ntg, bpg: per group
  size_t smem = 0;
  const char* why = nullptr;  // !ok: the reason
};

// Launch plan of gemv_mma_kernel for G groups of N rows (row_bytes each) x K inputs.
// force_ks > 0: that K split (the one-token plan's, so that each row of a several-token
// product is summed as in a one-token call); the plan fails where its rounds do not fit.
template <typename Kern>
MmaPlan mma_plan_for(Kern kern, WFormat f, int64_t N, int K, int T, int64_t row_bytes, size_t ring_bytes = 0,
                     int G = 1, int force_ks = 0) {
  MmaPlan pl;
  pl.NB = K / 32;
  pl.nsp = static_cast<int>((row_bytes + 63) / 64);
  pl.n_tiles = (N + 15) / 16;
  pl.P = f == WFormat::FP8_BLOCK ? (T <= 4 ? 1 : 2) : (T <= 2 ? 1 : 2);
  const size_t base = ring_bytes + static_cast<size_t>(T) * pl.NB * (64 + 4);
  const size_t red_round = static_cast<size_t>(kWarps) * 16 * 8 * 4;
  const size_t maxdyn = detail::max_dynamic_smem(kern);
  if (base + 2 * red_round > std::min<size_t>(maxdyn, ring_bytes ? maxdyn : 110 * 1024)) {
    pl.why = "staged activations (+ ring) exceed shared memory";
    return pl;
  }
  const int occ = detail::occupancy(kern, kThreads, base + 2 * red_round);
  // resident blocks per group: each group streams its tiles on an equal slice of the grid
  const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(occ) * sm_count() / G);
  // K split: minimise waves * (bytes per warp item + a fixed cost), larger split on ties,
  // among the splits whose partial sums fit `red` (2 rounds). Checking the rounds only
  // after the choice sent engram_wkv [25600, 6144] to the CUDA-core kernel: there split 8
  // (7 waves of 1/8 rows) ties with split 1 (1 wave of whole rows), wins the tie, and
  // its 7 rounds do not fit, so both tensor-core launches were refused.
  int ks = force_ks > 0 ? force_ks : 1;
  double best = 1e300;
  for (int k = 1; k <= kWarps && force_ks <= 0; k *= 2) {
    if (k > 1 && k * 2 > pl.nsp) break;
    const int64_t ntg = (pl.n_tiles * k + kWarps - 1) / kWarps;
    const int64_t waves = (ntg + resident - 1) / resident;  // == rounds of the balanced grid
    if (k > 1 && waves > 2) continue;
    const double cost = static_cast<double>(waves) * (16.0 * row_bytes / k + 2048.0);
    if (cost <= best) {
      best = cost;
      ks = k;
    }
  }
  pl.KS = ks;
  pl.TPB = kWarps / ks;
  pl.ntg = (pl.n_tiles + pl.TPB - 1) / pl.TPB;
  pl.bpg = detail::balanced_blocks(pl.ntg, resident);
  pl.grid = pl.bpg * G;
  pl.rounds = (pl.ntg + pl.bpg - 1) / pl.bpg;
  if (ks > 1 && pl.rounds > 2) {  // (red sized for 2 rounds; the choice above keeps to them)
    pl.why = "K split over more than 2 rounds";
    return pl;
  }
  pl.smem = base + (ks > 1 ? static_cast<size_t>(pl.rounds) * red_round : 0);
  pl.ok = pl.smem <= maxdyn;
  if (!pl.ok) pl.why = "partial sums exceed shared memory";
  return pl;
}

// What gemv_mma did (gemv_last_path, DSX_GEMV_TRACE).
struct MmaTry {
  const char* path = nullptr;  // launched: "mma-ring" / "mma-register"
  const char* why = nullptr;   // declined: the last reason
  const char* ring_why = nullptr;  // the shared ring declined, the register ring was tried
  MmaPlan pl;                  // plan of the last kernel tried (U > 0)
  int U = 0;
  bool ring = false;
  bool no(const char* w) {
    why = w;
    return false;
  }
};

template <WFormat F, bool HW, int P, int U, bool R = false, bool QA = true>
bool try_launch_mma(const MmaParams& base, int K, cudaStream_t stream, MmaTry& tr, int force_ks = 0) {
  auto kern = gemv_mma_kernel<F, HW, P, U, R, QA>;
  const size_t ring = R ? static_cast<size_t>(kWarps) * (U + 1) * 1024 : 0;
  const MmaPlan pl = mma_plan_for(kern, F, base.N, K, base.T, base.W.row_bytes, ring, base.G, force_ks);
  tr.pl = pl;
  tr.U = U;
  tr.ring = R;
  if (!pl.ok) return tr.no(pl.why);
  MmaParams p = base;
  p.NB = pl.NB;
  p.nsp = pl.nsp;
  p.KS = pl.KS;
  p.TPB = pl.TPB;
  p.tstride = pl.NB;
  // staged activations: the one-token shared-ring FP8 kernel (hardware order) only
  const bool fp8_ring1 = R && F == WFormat::FP8_BLOCK && HW && p.T == 1;
  if (!(fp8_ring1 && QA && p.G == 1 && !p.norm_w)) p.staged = nullptr;
  if (!(fp8_ring1 && QA && p.norm_w)) p.norm_staged = nullptr;
  if (!(fp8_ring1 && pl.KS > 1 && pl.TPB % 2 == 0 && pl.rounds <= 2 && p.N % 32 == 0)) p.out_staged = nullptr;
  t_last_staged = (base.norm_staged == nullptr || p.norm_staged) && (base.out_staged == nullptr || p.out_staged);
  p.n_tiles = pl.n_tiles;
  p.ntg = pl.ntg;
  p.bpg = pl.bpg;
  detail::launch_pdl(kern, dim3(static_cast<unsigned>(pl.grid)), dim3(kThreads), pl.smem, stream, p);
  tr.path = R ? "mma-ring" : "mma-register";
  return true;
}

// The K split of the one-token shared-ring FP8 kernel for this product (0: that kernel
// would not run it). The shared ring runs 2..8 tokens with the same split (one or two
// token passes), so that each row is summed exactly as a one-token call sums it:
// occupancy falls with the staged tokens, and the free choice of the split moved with it
// (wo_b: 4 at one token, 2 at four).
template <bool QA>
int one_token_ks(const MmaParams& p, int K) {
  auto k1 = gemv_mma_kernel<WFormat::FP8_BLOCK, true, 1, 8, true, QA>;
  const size_t ring = static_cast<size_t>(kWarps) * 9 * 1024;
  const MmaPlan pl = mma_plan_for(k1, WFormat::FP8_BLOCK, p.N, K, 1, p.W.row_bytes, ring, p.G);
  return pl.ok ? pl.KS : 0;
}

// The tensor-core path when it applies; false: use the CUDA-core kernel. qa8: QA8
// applies to this product (uses_qa8).
bool gemv_mma(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
              const GemvOpts& o, bool qa8, const dev::WView& wv, cudaStream_t stream, MmaTry& tr) {
  const int mode = gemv_mma_mode();
  if (mode == 0) return tr.no("DSX_GEMV_MMA=0");
  const bool fp8 = W.fmt == WFormat::FP8_BLOCK;
  MmaParams p{};
  p.W = wv;
  p.N = W.rows / o.groups;
  p.G = o.groups;
  p.x = x;
  p.xt = static_cast<int>(xt);
  p.ldx = ldx;
  p.T = T;
  p.y = y;
  p.yt = static_cast<int>(yt);
  p.ldy = ldy;
  p.staged = qa8 && o.qblock == 32 && T == 1 ? o.staged : nullptr;
  p.norm_staged = o.qblock == 32 ? o.norm_staged : nullptr;  // (QA8 of the consumer: 32-element blocks)
  p.out_staged = o.qblock == 32 ? o.out_staged : nullptr;
  p.out_nb = W.rows / 32;
  const int K = static_cast<int>(W.cols);
  if (o.norm_w) {  // the fused input norm: one token, QA8, one group (gemv falls back otherwise)
    if (T != 1 || !qa8 || o.groups != 1) return tr.no("input norm: one token with QA8 only");
    p.norm_w = o.norm_w;
    p.norm_eps = o.norm_eps;
    p.norm_out = o.norm_out;
  }
  if (!qa8) {
    // wo_a (spec §3.4.8): FP8 weights against unquantized bf16 activations, grouped, on
    // the shared ring; the activations are staged as f16 with power-of-two block scales
    // (exact for bf16, see noqa_block_exp in gemv_device.cuh), the rest is the QA8 kernel.
    if (!fp8 || xt != DType::BF16) return tr.no("no QA8: tensor cores only for FP8 weights x bf16 activations");
    if (T > 8) return tr.no("no QA8: T > 8");
    if (o.groups > 1 && p.N % 16 != 0) return tr.no("no QA8: rows per group not a multiple of 16");
    p.prescale = dev::fp8_mma_prescale<true>();
    if (T == 1) return try_launch_mma<WFormat::FP8_BLOCK, true, 1, 8, true, false>(p, K, stream, tr);
    const int ks1 = one_token_ks<false>(p, K);
    if (ks1 == 0) return tr.no("no QA8: the one-token kernel declines");
    return T <= 4 ? try_launch_mma<WFormat::FP8_BLOCK, true, 1, 8, true, false>(p, K, stream, tr, ks1)
                  : try_launch_mma<WFormat::FP8_BLOCK, true, 2, 8, true, false>(p, K, stream, tr, ks1);
  }
  // (one group: the register ring does not support groups; the shared ring would)
  if (!(fp8 || W.fmt == WFormat::MXFP4) || o.qblock != 32 || o.groups != 1)
    return tr.no("QA8: needs qblock 32 and one group");
  if (xt != DType::BF16 && mode < 2) return tr.no("F32 mode (DSX_GEMV_MMA=2 enables it)");
  if (T > (fp8 ? 8 : 4)) return tr.no("T too large");
  // MXFP4 at T <= 2: the CUDA-core kernel is as fast (the e2m1 decode makes the
  // tensor-core loop compute-bound); the engine streams MXFP4 only through moe_decode.
  if (!fp8 && T <= 2 && mode < 2) return tr.no("MXFP4 at T <= 2");
  if (fp8 && W.block < 16) return tr.no("FP8 tile < 16");
  if (T <= (fp8 ? 8 : 2)) {
    // shared ring: 8 spans in flight per warp (16 measured slower, docs/experiments.md);
    // FP8 with the hardware e4m3 conversion, one token pass up to 4 tokens, two up to 8,
    // with the one-token K split from 2 tokens on (one_token_ks). Falls through when it
    // does not fit.
    p.prescale = fp8 ? dev::fp8_mma_prescale<true>() : dev::kMx4MmaPrescale;
    bool ok = false;
    if (!fp8) {
      ok = try_launch_mma<WFormat::MXFP4, false, 1, 8, true>(p, K, stream, tr);
    } else if (T == 1) {
      ok = try_launch_mma<WFormat::FP8_BLOCK, true, 1, 8, true>(p, K, stream, tr);
    } else if (const int ks1 = one_token_ks<true>(p, K); ks1 > 0) {
      ok = T <= 4 ? try_launch_mma<WFormat::FP8_BLOCK, true, 1, 8, true>(p, K, stream, tr, ks1)
                  : try_launch_mma<WFormat::FP8_BLOCK, true, 2, 8, true>(p, K, stream, tr, ks1);
    } else {
      tr.no("the one-token kernel declines");
    }
    if (ok) return true;
    tr.ring_why = tr.why;
  }
  // register ring; spans in flight: 8 only pays off when each warp streams >= 32 spans
  // (FP8, long K)
  int depth = gemv_mma_depth();
  if (depth == 0) {
    auto k4 = gemv_mma_kernel<WFormat::FP8_BLOCK, false, 1, 4>;
    const MmaPlan pl = mma_plan_for(k4, W.fmt, W.rows, K, T, wv.row_bytes);
    depth = (fp8 && pl.ok && pl.nsp / pl.KS >= 32) ? 8 : 4;
  }
  const bool deep = depth >= 8;
  if (fp8) {
    if (gemv_mma_hwcvt()) {
      p.prescale = dev::fp8_mma_prescale<true>();
      return T <= 4 ? try_launch_mma<WFormat::FP8_BLOCK, true, 1, 8>(p, K, stream, tr)
                    : try_launch_mma<WFormat::FP8_BLOCK, true, 2, 4>(p, K, stream, tr);
    }
    p.prescale = dev::fp8_mma_prescale<false>();
    if (T <= 4)
      return deep ? try_launch_mma<WFormat::FP8_BLOCK, false, 1, 8>(p, K, stream, tr)
                  : try_launch_mma<WFormat::FP8_BLOCK, false, 1, 4>(p, K, stream, tr);
    return try_launch_mma<WFormat::FP8_BLOCK, false, 2, 4>(p, K, stream, tr);
  }
  p.prescale = dev::kMx4MmaPrescale;
  if (T <= 2)
    return deep ? try_launch_mma<WFormat::MXFP4, false, 1, 8>(p, K, stream, tr)
                : try_launch_mma<WFormat::MXFP4, false, 1, 4>(p, K, stream, tr);
  return try_launch_mma<WFormat::MXFP4, false, 2, 4>(p, K, stream, tr);
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
  DSX_CHECK(!W.tiled || tile16_fits(W), "gemv ", W.name, ": the 16-row tile layout needs FP8 / MXFP4 data of whole ",
            "tiles and spans");
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

// Records the kernel a gemv() call ran (gemv_last_path) and, with DSX_GEMV_TRACE=1,
// prints one line per call: shape, options, path and its plan (the CUDA-core kernel: why
// the tensor-core path declined).
void note_path(const QMatrix& W, DType xt, DType yt, int T, const GemvOpts& o, bool qa8, const char* path,
               const MmaTry* mt, const Plan* pl) {
  t_last_path = path;
  if (!gemv_trace()) return;
  const char* fmt = W.fmt == WFormat::FP8_BLOCK ? "fp8" : W.fmt == WFormat::MXFP4 ? "mxfp4"
                    : W.fmt == WFormat::BF16    ? "bf16"
                                                : "f32";
  auto act = [](DType t) { return t == DType::BF16 ? "bf16" : "f32"; };
  char line[512];
  int n = std::snprintf(line, sizeof line, "dsx gemv: %s %s/%d N=%lld K=%lld groups=%d T=%d qa8=%d xt=%s yt=%s -> %s",
                        W.name.empty() ? "(unnamed)" : W.name.c_str(), fmt, W.block, static_cast<long long>(W.rows),
                        static_cast<long long>(W.cols), o.groups, T, qa8 ? 1 : 0, act(xt), act(yt), path);
  auto add = [&](auto... a) {
    if (n >= 0 && n < static_cast<int>(sizeof line)) n += std::snprintf(line + n, sizeof line - n, a...);
  };
  if (mt && mt->ring_why) add(" [shared ring declined: %s]", mt->ring_why);
  if (mt && mt->U > 0) {
    const MmaPlan& m = mt->pl;
    add(" %s%s U=%d KS=%d TPB=%d grid=%lld (%d x %lld) rounds=%lld smem=%zu", mt->path ? "" : "[declined: ",
        mt->path ? "" : (mt->why ? mt->why : "?"), mt->U, m.KS, m.TPB, static_cast<long long>(m.grid), o.groups,
        static_cast<long long>(m.bpg), static_cast<long long>(m.rounds), m.smem);
    if (!mt->path) add(" (%s ring)]", mt->ring ? "shared" : "register");
  } else if (mt && mt->why) {
    add(" [mma declined: %s]", mt->why);
  }
  if (pl)
    add(" TT=%d KS=%d KB=%d rows/block=%d row_groups=%lld smem=%zu", pl->TT, pl->KS, pl->KB, pl->rows_per_block,
        static_cast<long long>(pl->row_groups), pl->smem);
  std::fprintf(stderr, "%s\n", line);
}

}  // namespace

const char* gemv_last_path() { return t_last_path; }
bool gemv_last_staged() { return t_last_staged; }

size_t gemv_split_ws_bytes(const QMatrix& W, int T, const GemvOpts& o) {
  const int G = o.groups;
  const Plan pl = make_plan(W.fmt, W.rows / G, static_cast<int>(W.cols), G, T, uses_qa8(W, o), o.qblock,
                            static_cast<size_t>(-1) / 2, sm_count());
  return pl.KB > 1 ? static_cast<size_t>(pl.KB) * T * W.rows * sizeof(float) : 0;
}

namespace {
struct PickWs {
  unsigned long long key;
  unsigned ticket;
};
// GemvOpts::pick's workspace for `pick` (null during a capture before it exists)
PickWs* pick_ws_of(const int32_t* pick, cudaStream_t stream) {
  return static_cast<PickWs*>(persistent_scratch(pick, 2, sizeof(PickWs), stream));
}
}  // namespace

void gemv_pick_reserve(const int32_t* pick, cudaStream_t stream) {
  DSX_CHECK(pick_ws_of(pick, stream) != nullptr, "gemv_pick_reserve: called during a capture");
}

void gemv(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
          const GemvOpts& o, cudaStream_t stream) {
  t_last_staged = o.norm_staged == nullptr && o.out_staged == nullptr;
  if (T <= 0 || W.rows <= 0) return;
  if (o.pick)
    DSX_CHECK(T == 1 && o.groups == 1 && yt == DType::F32 && ldy >= W.rows, "gemv ", W.name,
              ": a pick needs one token, one group and f32 output");
  // GemvOpts::pick: folded into the CUDA-core kernel (one pass over K, its workspace
  // available), else argmax_rows after the product
  PickWs* pick_ws = o.pick ? pick_ws_of(o.pick, stream) : nullptr;
  auto pick_after = [&]() {
    if (o.pick) argmax_rows(static_cast<const float*>(y), ldy, 1, W.rows, o.pick, stream, o.pick_copy);
  };
  check_args(W, o);
  const int G = o.groups;
  const bool qa8 = uses_qa8(W, o);
  // 9..16 rows of an FP8 weight in BF16 mode: two calls of at most 8 rows on the shared
  // ring (each streams the weight once; the CUDA-core kernel would take 4 passes of 4
  // rows at these K) with each row summed as in a one-row call
  if (T > 8 && T <= 16 && W.fmt == WFormat::FP8_BLOCK && xt == DType::BF16 && gemv_mma_mode() >= 1 &&
      o.qblock == 32 && !o.norm_w && W.block >= 16) {
    const size_t xb = dtype_size(xt), yb = dtype_size(yt);
    GemvOpts a = o;
    gemv(W, xt, x, ldx, 8, yt, y, ldy, a, stream);
    gemv(W, xt, static_cast<const uint8_t*>(x) + 8 * ldx * xb, ldx, T - 8, yt, static_cast<uint8_t*>(y) + 8 * ldy * yb,
         ldy, a, stream);
    return;
  }
  const int K = static_cast<int>(W.cols);
  const int64_t N = W.rows / G;
  DSX_CHECK(ldx >= static_cast<int64_t>(G) * K && ldy >= W.rows, "gemv ", W.name, ": bad row strides");
  Params p{};
  p.W.w = W.data;
  p.W.s = W.scale;
  p.W.tiled = W.tiled ? 1 : 0;
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
  MmaTry mt;
  if (o.norm_w) {
    // the input norm: fused into the tensor-core kernel's staging, else rmsnorm first
    DSX_CHECK(o.norm_out && G == 1, "gemv ", W.name, ": an input norm needs norm_out and one group");
    if (gemv_mma(W, xt, x, ldx, T, yt, y, ldy, o, qa8, p.W, stream, mt)) {
      pick_after();
      return note_path(W, xt, yt, T, o, qa8, mt.path, &mt, nullptr);
    }
    rmsnorm(xt, x, o.norm_out, o.norm_w, T, K, o.norm_eps, nullptr, nullptr, stream);
    GemvOpts plain = o;
    plain.norm_w = nullptr;
    plain.norm_out = nullptr;
    return gemv(W, xt, o.norm_out, K, T, yt, y, ldy, plain, stream);
  }
  if (gemv_stream(W, p.W, xt, x, ldx, T, yt, y, ldy, o, qa8, stream)) {
    pick_after();
    return note_path(W, xt, yt, T, o, qa8, "stream", nullptr, nullptr);
  }
  if (gemv_mma(W, xt, x, ldx, T, yt, y, ldy, o, qa8, p.W, stream, mt)) {
    pick_after();
    return note_path(W, xt, yt, T, o, qa8, mt.path, &mt, nullptr);
  }
  const size_t ws_bytes = o.split_ws ? o.split_ws_bytes : 0;
  // 2..16 rows of a BF16 weight whose one-row product runs the CUDA-core kernel below
  // without a K split (the head): the weight streamed once for all rows, each row's
  // result bit for bit the one-row call's (gemv_rows.h)
  if (W.fmt == WFormat::BF16 && G == 1 && T >= 2 && T <= kGemvRowsMax && !gemv_stream_may_take(W)) {
    const Plan one = make_plan(W.fmt, N, K, G, 1, qa8, o.qblock, ws_bytes, sm_count());
    if (one.KS == 1 && one.KB == 1 && gemv_rows(p.W, N, K, xt, x, ldx, T, yt, y, ldy, stream))
      return note_path(W, xt, yt, T, o, qa8, "rows", &mt, nullptr);
  }
  const Plan pl = make_plan(W.fmt, N, K, G, T, qa8, o.qblock, ws_bytes, sm_count());
  note_path(W, xt, yt, T, o, qa8, "cuda-core", &mt, &pl);
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
  const bool fused_pick = pick_ws && pl.KB == 1;
  if (fused_pick) {
    p.pick_key = &pick_ws->key;
    p.pick_ticket = &pick_ws->ticket;
    p.pick = o.pick;
    p.pick_copy = o.pick_copy;
  }

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
  if (!fused_pick) pick_after();
}

}  // namespace dsx::cuda
