// Expert-major MoE decode of 2..16 rows (DSpark verify, sessions decoding together):
// every distinct routed expert's weights are streamed once for all the rows routed to
// it, the shared expert's once for all rows, and each row's result is bit for bit the
// one-row moe_decode's (the one-token ring kernels of moe.cu).
//
// Three launches (programmatic dependent launch, no host synchronisation):
//  plan: the distinct experts of the T x topk routing entries in order of first
//        appearance ("sets"; the shared expert is the last set, with all T rows), each
//        set's entries in ascending entry order, the combine order of every row, the
//        work counts; it zeroes the arrival counters of the two other kernels.
//  up:   pieces (set, quarter q of D, pair k of 16-row tiles of I, group of <= 8 of the
//        set's rows, matrix w1 / w3, tile of the pair) on a persistent grid; a block
//        walks a contiguous range of pieces (an equal share of the weight bytes), stages
//        QA8(x) of the set's rows for the quarter once per (set, quarter), and each warp
//        streams its pieces through the span ring (moe_ring_device.cuh) with one mma
//        pass per 4 (FP8) or 2 (MXFP4) rows. The quarter sums go to global memory; the
//        last of the 16 pieces of a (set, pair, all groups) to arrive adds them in the
//        one-token kernel's order (q = 0..3), applies SwiGLU and the routing weight and
//        writes QA8 of the pair's 32 values of h per row (the down kernel's B order).
//  down: pieces (set, 16-row tile of D, group, piece: halves of I for a routed set,
//        quarters for the shared one, as the one-token down kernel splits them) on one
//        block of 16 warps per SM; the last piece of a D tile to arrive adds every row's
//        slot outputs in the reference order (ascending expert id, shared last).
//
// Why the results are bit-identical to one row's: each (row, output) value is the same
// chain of operations as in the one-token kernels. A row's activations sit in their own
// mma B columns (the other columns hold other rows or zeros, and an mma output element
// depends only on its own column), every 32-element block sum is scaled and added in the
// same span order within the same span ranges (the quarters of D, the halves / quarters
// of I), and the quarter / half / slot sums are added in the same order, with the same
// QA8 of x (32-element blocks: a quarter's blocks are whole) and of h.
#include <algorithm>
#include <climits>

#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/gemv_ring_device.cuh"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/moe_internal.cuh"
#include "kernels/cuda/moe_ring_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace moe_detail;

namespace {

using namespace moe_dev;

// rows per piece (the B columns of its mma passes: 2 passes of 4 rows for FP8, of 2 rows
// for MXFP4; more passes spilled registers); a set of more rows takes several groups,
// whose pieces stream the same weights again (from L2: they follow one another)
constexpr int kGroupFp8 = 8, kGroupFp4 = 4;
constexpr int kMaxEnt = kRowsMax * 9;       // entries: T topk routed (topk <= 8) + T shared
constexpr int kMaxSets = kRowsMax * 8 + 1;  // distinct routed experts + the shared expert
constexpr int kDnWarps = 16;
constexpr int kDnThreads = kDnWarps * 32;
constexpr int kRU = kRingU;  // spans in flight per warp (as the one-token kernels)

// The routing plan (global memory, written by the plan kernel).
struct RowsPlan {
  int nsets, nrouted;  // sets (routed + shared), routed sets
  int dn_target;       // down pieces per D tile
  int set_cnt[kMaxSets], set_off[kMaxSets], set_expert[kMaxSets];
  int up_ps[kMaxSets + 1], dn_ps[kMaxSets + 1];  // first up / down piece of each set
  int ent[kMaxEnt];                              // by position: the entry (t topk + j; shared: T topk + t)
  int order[kRowsMax * kMaxSlots];               // per row: the slots in the combine order
};

__host__ __device__ inline int group_size(bool shared) { return shared ? kGroupFp8 : kGroupFp4; }
__host__ __device__ inline int groups_of(int c, bool shared) { return (c + group_size(shared) - 1) / group_size(shared); }

struct PlanParams {
  const int32_t* ids;
  int T, topk, S, has_shared, NTP, NTD;
  RowsPlan* plan;
  unsigned* ucnt;
  int n_ucnt;
  unsigned* dcnt;
};

__global__ void __launch_bounds__(256) moe_rows_plan_kernel(const PlanParams p) {
  __shared__ int sid[kMaxEnt], fo[kMaxEnt], rk[kMaxEnt], sidx[kMaxEnt], soff[kMaxEnt], scnt[kMaxEnt];
  __shared__ int s_ng[kMaxSets];
  dev::pdl_launch_dependents();  // (the up kernel waits for this grid to complete)
  dev::pdl_wait();               // ids come from the router
  RowsPlan& P = *p.plan;
  const int n = p.T * p.topk, i = static_cast<int>(threadIdx.x);
  for (int k = i; k < p.n_ucnt; k += blockDim.x) p.ucnt[k] = 0u;
  for (int k = i; k < p.NTD; k += blockDim.x) p.dcnt[k] = 0u;
  if (i < n) sid[i] = p.ids[i];
  __syncthreads();
  if (i < n) {  // first entry with the same expert, and this entry's rank among them
    const int e = sid[i];
    int f = i, r = 0;
    for (int j = 0; j < i; ++j)
      if (sid[j] == e) {
        f = min(f, j);
        ++r;
      }
    fo[i] = f;
    rk[i] = r;
  }
  __syncthreads();
  const bool first = i < n && fo[i] == i;
  if (first) {  // this set's index, first position and size
    int s = 0, off = 0, c = 0;
    for (int j = 0; j < n; ++j) {
      s += (j < i && fo[j] == j) ? 1 : 0;
      off += fo[j] < i ? 1 : 0;
      c += fo[j] == i ? 1 : 0;
    }
    sidx[i] = s;
    soff[i] = off;
    scnt[i] = c;
    if (c > p.T) __trap();  // a row routed twice to one expert (the router's top-k never does)
  }
  const int nd = __syncthreads_count(first);
  if (first) {
    const int s = sidx[i];
    P.set_cnt[s] = scnt[i];
    P.set_off[s] = soff[i];
    P.set_expert[s] = sid[i];
    s_ng[s] = groups_of(scnt[i], false);
  }
  if (i < n) P.ent[soff[fo[i]] + rk[i]] = i;
  const int nsets = nd + (p.has_shared ? 1 : 0);
  if (p.has_shared) {
    if (i == 0) {
      P.set_cnt[nd] = p.T;
      P.set_off[nd] = n;
      P.set_expert[nd] = -1;
      s_ng[nd] = groups_of(p.T, true);
    }
    if (i < p.T) P.ent[n + i] = n + i;
  }
  __syncthreads();
  if (i <= nsets) {  // first pieces of set i
    int up = 0, dn = 0;
    for (int s = 0; s < i; ++s) {
      up += 16 * p.NTP * s_ng[s];
      dn += p.NTD * s_ng[s] * ((p.has_shared && s == nd) ? 4 : 2);
    }
    P.up_ps[i] = up;
    P.dn_ps[i] = dn;
  }
  if (i == 0) {
    int t = 0;
    for (int s = 0; s < nsets; ++s) t += s_ng[s] * ((p.has_shared && s == nd) ? 4 : 2);
    P.dn_target = t;
    P.nsets = nsets;
    P.nrouted = nd;
  }
  if (i < p.T * p.S) {  // row t's slot j goes to its rank (expert id, then slot; the shared expert last)
    const int t = i / p.S, j = i - t * p.S;
    const int key = j < p.topk ? sid[t * p.topk + j] : INT_MAX;
    int rank = 0;
    for (int q = 0; q < p.S; ++q) {
      const int kq = q < p.topk ? sid[t * p.topk + q] : INT_MAX;
      rank += (kq < key || (kq == key && q < j)) ? 1 : 0;
    }
    P.order[t * p.S + rank] = j;
  }
}

// ---- ring consumers of several rows: dev::RowsCons (gemv_ring_device.cuh) ----------
using dev::RowsCons;

// acc[pp] (pp < P) = the next piece q of the stream against nt staged rows; the
// consumer without bound tests where dev::with_ring_cons picks it.
template <WFormat F, int P, typename Stream>
__device__ __forceinline__ void consume_passes(Stream& st, const Piece& q, float (&out)[2][2], const uint32_t* bs,
                                               const float* sas, int tstride, int nt, int NB, const uint4* bzero,
                                               int lane) {
  float acc[P][2];
#pragma unroll
  for (int pp = 0; pp < P; ++pp) acc[pp][0] = acc[pp][1] = 0.f;
  auto run = [&](auto& cons) {
    cons.set(q.v, q.row0, q.row_last, bs, sas, tstride, nt, NB, bzero, lane);
    st.consume_spans(q, [&](uint32_t at, int s) { cons.span_at(at, s, acc, lane); });
  };
  if (NB % (F == WFormat::FP8_BLOCK ? 2 : 4) == 0 && (F != WFormat::FP8_BLOCK || q.v.wshift == 5)) {
    RowsCons<F, true, P> cons;
    run(cons);
  } else {
    RowsCons<F, false, P> cons;
    run(cons);
  }
  dev::mma_acc_finish<F, P>(acc);
#pragma unroll
  for (int pp = 0; pp < 2; ++pp) {
    out[pp][0] = pp < P ? acc[pp < P ? pp : 0][0] : 0.f;
    out[pp][1] = pp < P ? acc[pp < P ? pp : 0][1] : 0.f;
  }
}

// The piece q against nt (<= group_size) rows, with as many passes as they need.
template <typename Stream>
__device__ __forceinline__ void consume_rows(Stream& st, const Piece& q, float (&out)[2][2], const uint32_t* bs,
                                             const float* sas, int tstride, int nt, int NB, const uint4* bzero,
                                             int lane) {
  if (!q.fp4) {
    if (nt <= 4)
      consume_passes<WFormat::FP8_BLOCK, 1>(st, q, out, bs, sas, tstride, nt, NB, bzero, lane);
    else
      consume_passes<WFormat::FP8_BLOCK, 2>(st, q, out, bs, sas, tstride, nt, NB, bzero, lane);
  } else {
    if (nt <= 2)
      consume_passes<WFormat::MXFP4, 1>(st, q, out, bs, sas, tstride, nt, NB, bzero, lane);
    else
      consume_passes<WFormat::MXFP4, 2>(st, q, out, bs, sas, tstride, nt, NB, bzero, lane);
  }
}

// Row of pass pp held by this lane after mma_acc_finish, and whether the lane writes it.
__device__ __forceinline__ int pass_row(bool fp4, int pp, int lane) {
  return fp4 ? 2 * pp + ((lane & 3) >> 1) : 4 * pp + (lane & 3);
}
__device__ __forceinline__ bool pass_writer(bool fp4, int lane) { return !fp4 || (lane & 1) == 0; }

// True in every lane of the warp that arrives last (the target-th) at *cnt, after each
// arriving warp made its global writes visible; that warp may then read them all.
__device__ __forceinline__ bool last_warp_global(unsigned* cnt, unsigned target, int lane) {
  __threadfence();
  __syncwarp();
  unsigned old = 0;
  if (lane == 0) old = atomicAdd(cnt, 1u);
  old = __shfl_sync(dev::kFull, old, 0);
  if (old != target - 1) return false;
  __threadfence();
  return true;
}

// ---- up ----------------------------------------------------------------------------
struct RowsUpParams {
  const RowsPlan* plan;
  int etiled;  // routed experts in the 16-row tile layout (MoeLayer::tiled)
  const uint8_t* const* w1;
  const uint8_t* const* w1s;
  const uint8_t* const* w3;
  const uint8_t* const* w3s;
  dev::WView sw1, sw3;
  int D, I, topk, S, T, has_shared;
  const float* wts;
  const void* x;
  int xt;
  int64_t ldx;
  float lim;
  int bf16;
  int NB, NBI, NTP;
  int nsp4, nsp8;  // spans per row of the routed (MXFP4) and shared (FP8) gate / up matrices
  int tstride;     // staged blocks per row (the largest quarter, even)
  float* upart;    // [position][I][matrix][quarter]
  unsigned* ucnt;  // [set][NTP]
  uint32_t* hstc;  // [position][NBI][16]: QA8(h) in the down kernel's B order of the set's format
  float* hsts;     // [position][NBI]: its scales
  float* hq;       // [T][S][I]: QA8(h) as values (moe_decode's documented workspace head)
};

struct UpPiece {
  int s, q, k, g, m, tt;
};

// The blocks [kb_lo, kb_hi) of quarter q of D in the B order of a format with nsp spans
// of bpsp blocks per row.
__host__ __device__ inline void quarter_blocks(int nsp, int bpsp, int NB, int q, int& kb_lo, int& kb_hi) {
  kb_lo = bpsp * (nsp * q / 4);
  kb_hi = min(NB, bpsp * (nsp * (q + 1) / 4));
}

__global__ void __launch_bounds__(kThreads, 2) moe_rows_up_kernel(const RowsUpParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  __shared__ uint4 s_zero[4];
  __shared__ int s_cnt[kMaxSets], s_off[kMaxSets], s_ps[kMaxSets + 1];
  // the routed sets' matrices (w1, its scales, w3, its scales): a piece's view comes from
  // shared memory, not from a dependent load of the pointer tables at every piece (which
  // held up the warp's next copies and its next piece by a round trip each)
  __shared__ const uint8_t* s_w[4][kMaxSets];
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = smem_mma + warp * (kRU + 1) * 64;
  uint32_t* bs = reinterpret_cast<uint32_t*>(smem_mma + kWarps * (kRU + 1) * 64);
  float* sas = reinterpret_cast<float*>(bs + static_cast<int64_t>(p.T) * p.tstride * 16);
  dev::pdl_wait();  // the plan (and through it the router's ids / weights) and x
  dev::pdl_launch_dependents();
  const RowsPlan& P = *p.plan;
  const int nsets = P.nsets, nd = P.nrouted, n = p.T * p.topk;
  for (int s = threadIdx.x; s < nsets; s += blockDim.x) {
    s_cnt[s] = P.set_cnt[s];
    s_off[s] = P.set_off[s];
  }
  for (int s = threadIdx.x; s < nd; s += blockDim.x) {
    const int e = P.set_expert[s];
    s_w[0][s] = p.w1[e];
    s_w[1][s] = p.w1s[e];
    s_w[2][s] = p.w3[e];
    s_w[3][s] = p.w3s[e];
  }
  for (int s = threadIdx.x; s <= nsets; s += blockDim.x) s_ps[s] = P.up_ps[s];
  __syncthreads();
  // the block's pieces: an equal share of the bytes (a shared-expert piece streams twice
  // those of a routed one); piece_of(w): the first piece whose weight starts at >= w
  const int R = s_ps[nd], total = s_ps[nsets];
  const int64_t W = R + 2ll * (total - R);
  auto piece_of = [&](int64_t w) { return w <= R ? static_cast<int>(w) : R + static_cast<int>((w - R + 1) / 2); };
  const int g0 = piece_of(W * blockIdx.x / gridDim.x), g1 = piece_of(W * (blockIdx.x + 1) / gridDim.x);
  int s_first = 0;
  while (s_first + 1 < nsets && s_ps[s_first + 1] <= g0) ++s_first;
  auto decode = [&](int gp) {
    UpPiece u;
    int s = s_first;
    while (s_ps[s + 1] <= gp) ++s;
    const int ng = groups_of(s_cnt[s], p.has_shared && s == nd);
    int r = gp - s_ps[s];
    const int per_q = 4 * p.NTP * ng;
    u.s = s;
    u.q = r / per_q;
    r -= u.q * per_q;
    u.k = r / (4 * ng);
    r -= u.k * 4 * ng;
    u.g = r >> 2;
    u.m = (r & 3) >> 1;
    u.tt = r & 1;
    return u;
  };
  auto piece_of_unit = [&](const UpPiece& u) {
    Piece q;
    const bool shared = p.has_shared && u.s == nd;
    if (shared) {
      q.v = u.m == 0 ? p.sw1 : p.sw3;
      q.fp4 = false;
    } else {
      q.v = expert_view(s_w[2 * u.m][u.s], s_w[2 * u.m + 1][u.s], p.D, p.etiled);
      q.fp4 = true;
    }
    q.row0 = static_cast<int64_t>(2 * u.k + u.tt) * 16;
    q.row_last = p.I - 1;
    const int nsp = shared ? p.nsp8 : p.nsp4;
    q.s_lo = nsp * u.q / 4;
    q.s_hi = nsp * (u.q + 1) / 4;
    return q;
  };
  auto piece_at = [&](int li) { return piece_of_unit(decode(g0 + warp + kWarps * li)); };
  const int my_n = g1 - g0 > warp ? (g1 - g0 - warp + kWarps - 1) / kWarps : 0;
  auto st = make_stream<kRU>(ring, lane, p.NB, my_n, piece_at);
  st.start();
  int li = 0;
  for (int gp = g0; gp < g1;) {
    const UpPiece u0 = decode(gp);
    const int c = s_cnt[u0.s], off = s_off[u0.s];
    const bool shared = p.has_shared && u0.s == nd;
    const int gsz = group_size(shared);
    const int seg_end = min(g1, s_ps[u0.s] + (u0.q + 1) * 4 * p.NTP * groups_of(c, shared));
    int kb_lo, kb_hi;
    quarter_blocks(shared ? p.nsp8 : p.nsp4, shared ? 2 : 4, p.NB, u0.q, kb_lo, kb_hi);
    __syncthreads();  // (the previous segment's rows are consumed)
    if (kb_hi > kb_lo) {  // QA8(x) of the set's rows, this quarter
      if (shared) {
        dev::stage_b_mma<WFormat::FP8_BLOCK, true>(bs, sas, p.tstride, c, kb_hi - kb_lo, p.x, p.xt, p.ldx, kb_lo * 32,
                                                   dev::fp8_mma_prescale<true>());
      } else {
        for (int i = 0; i < c; ++i) {
          const int t = P.ent[off + i] / p.topk;
          dev::stage_b_mma<WFormat::MXFP4, false>(bs + static_cast<int64_t>(i) * p.tstride * 16,
                                                  sas + static_cast<int64_t>(i) * p.tstride, p.tstride, 1,
                                                  kb_hi - kb_lo, p.x, p.xt, p.ldx,
                                                  static_cast<int64_t>(t) * p.ldx + kb_lo * 32, dev::kMx4MmaPrescale);
        }
      }
    }
    __syncthreads();
    for (; li < my_n && g0 + warp + kWarps * li < seg_end; ++li) {
      const UpPiece u = decode(g0 + warp + kWarps * li);
      const Piece q = piece_of_unit(u);
      const int nt = min(gsz, c - gsz * u.g);
      const int64_t r0 = static_cast<int64_t>(gsz) * u.g * p.tstride - kb_lo;  // (blocks: relative to kb_lo)
      float acc[2][2];
      consume_rows(st, q, acc, bs + r0 * 16, sas + r0, p.tstride, nt, p.NB, s_zero, lane);
      // the quarter sums of rows g, g + 8 of the tile for each of the group's rows
      const int gg = lane >> 2;
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const int tk = pass_row(q.fp4, pp, lane);
        if (tk < nt && pass_writer(q.fp4, lane)) {
          const int64_t pos = off + gsz * u.g + tk;
          float* dst = p.upart + (pos * p.I + q.row0 + gg) * 8 + u.m * 4 + u.q;
          dst[0] = acc[pp][0];
          dst[64] = acc[pp][1];  // (row + 8)
        }
      }
      if (last_warp_global(p.ucnt + u.s * p.NTP + u.k, 16u * groups_of(c, shared), lane)) {
        // every piece of (set, pair k) is in: h of the pair's 32 rows for every row of the set
        const int row = 32 * u.k + lane;
        for (int i = 0; i < c; ++i) {
          const int64_t pos = off + i;
          const int e = P.ent[pos];
          const float4* src = reinterpret_cast<const float4*>(p.upart + (pos * p.I + row) * 8);
          const float4 ga = __ldcg(src), ua = __ldcg(src + 1);
          float gs = 0.f, us = 0.f;
          gs += ga.x;
          gs += ga.y;
          gs += ga.z;
          gs += ga.w;
          us += ua.x;
          us += ua.y;
          us += ua.z;
          us += ua.w;
          const int t = shared ? e - n : e / p.topk;
          const int j = shared ? p.topk : e - t * p.topk;
          const float hv = dev::swiglu_h(gs, us, shared ? 1.0f : p.wts[e], p.lim, p.bf16);
          float* fq = p.hq + (static_cast<int64_t>(t) * p.S + j) * p.I + row;
          uint32_t* wb = p.hstc + (pos * p.NBI + u.k) * 16;
          float* ws = p.hsts + pos * p.NBI + u.k;
          if (shared)
            dev::stage_block_lanes<WFormat::FP8_BLOCK>(hv, lane, wb, ws, dev::fp8_mma_prescale<true>(), fq);
          else
            dev::stage_block_lanes<WFormat::MXFP4>(hv, lane, wb, ws, dev::kMx4MmaPrescale, fq);
        }
      }
    }
    gp = seg_end;
  }
  st.finish();
}

// ---- down --------------------------------------------------------------------------
struct RowsDownParams {
  const RowsPlan* plan;
  int etiled;
  const uint8_t* const* w2;
  const uint8_t* const* w2s;
  dev::WView sw2;
  int D, I, topk, S, T, has_shared;
  int NBI, NTD, nspR, nspI;  // spans per row of a routed w2 (MXFP4) and of the shared one (FP8)
  const uint32_t* hstc;
  const float* hsts;
  float* dpart;    // [T][2 topk + 4][D]: the pieces' outputs (routed slot j: 2 j + half; shared: 2 topk + quarter)
  unsigned* dcnt;  // [NTD]
  int bf16;
  void* y;
  int yt;
  int64_t ldy;
};

struct DnPiece {
  int s, tile, g, pc;
};

__global__ void __launch_bounds__(kDnThreads, 1) moe_rows_down_kernel(const RowsDownParams p) {
  extern __shared__ __align__(128) uint4 smem_mma[];
  __shared__ uint4 s_zero[4];
  __shared__ int s_cnt[kMaxSets], s_off[kMaxSets], s_ps[kMaxSets + 1];
  __shared__ const uint8_t* s_w[2][kMaxSets];  // the routed sets' w2 and its scales (as the up kernel)
  if (threadIdx.x < 4) s_zero[threadIdx.x] = make_uint4(0, 0, 0, 0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = smem_mma + warp * (kRU + 1) * 64;
  uint32_t* bs = reinterpret_cast<uint32_t*>(smem_mma + kDnWarps * (kRU + 1) * 64);
  float* sas = reinterpret_cast<float*>(bs + static_cast<int64_t>(p.T) * p.NBI * 16);
  // The plan comes from the kernel before the up kernel: it completed before the up
  // kernel's blocks passed their grid dependency wait, which precedes this grid's launch,
  // so the weights can stream before this grid's wait (h comes after it).
  const RowsPlan& P = *p.plan;
  const int nsets = P.nsets, nd = P.nrouted, n = p.T * p.topk;
  for (int s = threadIdx.x; s < nsets; s += blockDim.x) {
    s_cnt[s] = P.set_cnt[s];
    s_off[s] = P.set_off[s];
  }
  for (int s = threadIdx.x; s < nd; s += blockDim.x) {
    const int e = P.set_expert[s];
    s_w[0][s] = p.w2[e];
    s_w[1][s] = p.w2s[e];
  }
  for (int s = threadIdx.x; s <= nsets; s += blockDim.x) s_ps[s] = P.dn_ps[s];
  __syncthreads();
  const int total = s_ps[nsets];
  const int g0 = static_cast<int>(static_cast<int64_t>(total) * blockIdx.x / gridDim.x);
  const int g1 = static_cast<int>(static_cast<int64_t>(total) * (blockIdx.x + 1) / gridDim.x);
  int s_first = 0;
  while (s_first + 1 < nsets && s_ps[s_first + 1] <= g0) ++s_first;
  auto decode = [&](int gp) {
    DnPiece u;
    int s = s_first;
    while (s_ps[s + 1] <= gp) ++s;
    const bool shared = p.has_shared && s == nd;
    const int np = shared ? 4 : 2;
    const int per_tile = np * groups_of(s_cnt[s], shared);
    int r = gp - s_ps[s];
    u.s = s;
    u.tile = r / per_tile;
    r -= u.tile * per_tile;
    u.g = r / np;
    u.pc = r - u.g * np;
    return u;
  };
  auto piece_of_unit = [&](const DnPiece& u) {
    Piece q;
    int lo, hi, h;
    if (p.has_shared && u.s == nd) {  // quarters of I: halves hh of the span range, halves h of those
      const int hh = u.pc >> 1;
      h = u.pc & 1;
      q.v = p.sw2;
      q.fp4 = false;
      lo = hh * p.nspI / 2;
      hi = (hh + 1) * p.nspI / 2;
    } else {
      h = u.pc;
      q.v = expert_view(s_w[0][u.s], s_w[1][u.s], p.I, p.etiled);
      q.fp4 = true;
      lo = 0;
      hi = p.nspR;
    }
    q.s_lo = lo + (hi - lo) * h / 2;
    q.s_hi = lo + (hi - lo) * (h + 1) / 2;
    q.row0 = static_cast<int64_t>(u.tile) * 16;
    q.row_last = p.D - 1;
    return q;
  };
  auto piece_at = [&](int li) { return piece_of_unit(decode(g0 + warp + kDnWarps * li)); };
  const int my_n = g1 - g0 > warp ? (g1 - g0 - warp + kDnWarps - 1) / kDnWarps : 0;
  auto st = make_stream<kRU>(ring, lane, p.NBI, my_n, piece_at);
  st.start();
  dev::pdl_wait();  // h comes from the up kernel
  dev::pdl_launch_dependents();
  const int NPT = 2 * p.topk + 4;
  const unsigned target = static_cast<unsigned>(P.dn_target);
  int li = 0;
  for (int gp = g0; gp < g1;) {
    const int s = decode(gp).s;
    const int c = s_cnt[s], off = s_off[s];
    const bool shared = p.has_shared && s == nd;
    const int seg_end = min(g1, s_ps[s + 1]);
    __syncthreads();  // (the previous set's rows are consumed)
    dev::copy_to_smem(bs, p.hstc + static_cast<int64_t>(off) * p.NBI * 16, static_cast<int64_t>(c) * p.NBI * 16);
    for (int i = threadIdx.x; i < c * p.NBI; i += blockDim.x) sas[i] = __ldcg(p.hsts + static_cast<int64_t>(off) * p.NBI + i);
    __syncthreads();
    for (; li < my_n && g0 + warp + kDnWarps * li < seg_end; ++li) {
      const DnPiece u = decode(g0 + warp + kDnWarps * li);
      const Piece q = piece_of_unit(u);
      const int gsz = group_size(shared);
      const int nt = min(gsz, c - gsz * u.g);
      const int64_t r0 = static_cast<int64_t>(gsz) * u.g * p.NBI;
      float acc[2][2];
      consume_rows(st, q, acc, bs + r0 * 16, sas + r0, p.NBI, nt, p.NBI, s_zero, lane);
      const int gg = lane >> 2;
#pragma unroll
      for (int pp = 0; pp < 2; ++pp) {
        const int tk = pass_row(q.fp4, pp, lane);
        if (tk < nt && pass_writer(q.fp4, lane)) {
          const int e = P.ent[off + gsz * u.g + tk];
          const int t = shared ? e - n : e / p.topk;
          const int pidx = shared ? 2 * p.topk + u.pc : 2 * (e - t * p.topk) + u.pc;
          float* dst = p.dpart + (static_cast<int64_t>(t) * NPT + pidx) * p.D + q.row0 + gg;
          if (q.row0 + gg < p.D) dst[0] = acc[pp][0];
          if (q.row0 + gg + 8 < p.D) dst[8] = acc[pp][1];
        }
      }
      if (last_warp_global(p.dcnt + u.tile, target, lane)) {
        // every piece of this D tile is in: each row's slot outputs in the reference order
        for (int idx = lane; idx < p.T * 16; idx += 32) {
          const int t = idx >> 4;
          const int64_t row = q.row0 + (idx & 15);
          if (row >= p.D) continue;
          const float* pt = p.dpart + static_cast<int64_t>(t) * NPT * p.D + row;
          float tot = 0.0f;
          for (int s2 = 0; s2 < p.S; ++s2) {
            const int j = P.order[t * p.S + s2];
            float v;
            if (j < p.topk) {
              v = __ldcg(pt + static_cast<int64_t>(2 * j) * p.D) + __ldcg(pt + static_cast<int64_t>(2 * j + 1) * p.D);
            } else {
              const int64_t b = 2 * p.topk;
              v = (__ldcg(pt + b * p.D) + __ldcg(pt + (b + 1) * p.D)) +
                  (__ldcg(pt + (b + 2) * p.D) + __ldcg(pt + (b + 3) * p.D));
            }
            if (p.bf16) v = round_bf16(v);
            tot += v;
          }
          dev::store_act(p.y, p.yt, static_cast<int64_t>(t) * p.ldy + row, tot);
        }
      }
    }
    gp = seg_end;
  }
  st.finish();
}

// ---- host --------------------------------------------------------------------------
struct RowsLayout {
  size_t hq = 0, plan = 0, ucnt = 0, dcnt = 0, upart = 0, hstc = 0, hsts = 0, dpart = 0, total = 0;
  int n_ucnt = 0;
};
RowsLayout rows_layout(const MoeLayer& m, int T, int topk) {
  const bool has_shared = m.shared_w1.data != nullptr;
  const size_t S = static_cast<size_t>(topk + (has_shared ? 1 : 0));
  const size_t D = static_cast<size_t>(m.hidden), I = static_cast<size_t>(m.inter);
  const size_t NE = static_cast<size_t>(T) * S, NBI = I / 32, NTP = I / 32, NTD = (D + 15) / 16;
  RowsLayout L;
  L.n_ucnt = static_cast<int>((static_cast<size_t>(T) * topk + 1) * NTP);
  size_t off = 0;
  auto take = [&](size_t& at, size_t bytes) {
    at = off;
    off = align256(off + bytes);
  };
  take(L.hq, static_cast<size_t>(T) * S * I * 4);
  take(L.plan, sizeof(RowsPlan));
  take(L.ucnt, static_cast<size_t>(L.n_ucnt) * 4);
  take(L.dcnt, NTD * 4);
  take(L.upart, NE * I * 8 * 4);
  take(L.hstc, NE * NBI * 16 * 4);
  take(L.hsts, NE * NBI * 4);
  take(L.dpart, static_cast<size_t>(T) * (2 * topk + 4) * D * 4);
  L.total = off;
  return L;
}

// Staged blocks per row of the up kernel: the largest quarter of D in either format, even.
int up_tstride(int NB, int nsp4, int nsp8) {
  int mx = 0;
  for (int q = 0; q < 4; ++q) {
    int lo, hi;
    quarter_blocks(nsp4, 4, NB, q, lo, hi);
    mx = std::max(mx, hi - lo);
    quarter_blocks(nsp8, 2, NB, q, lo, hi);
    mx = std::max(mx, hi - lo);
  }
  return (mx + 1) & ~1;
}

}  // namespace

namespace moe_detail {

size_t rows_ws_bytes(const MoeLayer& m, int T, int topk) {
  if (T < 2 || T > kRowsMax) return 0;
  return rows_layout(m, T, topk).total;
}

bool moe_decode_rows(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                     const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                     cudaStream_t stream) {
  if (T < 2 || T > kRowsMax) return false;
  const int mode = gemv_mma_mode();
  if (mode == 0 || (yt != DType::BF16 && mode < 2)) return false;
  if (!ring_t1_supported(m, topk)) return false;  // (the arithmetic these kernels reproduce)
  const bool has_shared = m.shared_w1.data != nullptr;
  const int S = topk + (has_shared ? 1 : 0);
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
  const int NB = D / 32, NBI = I / 32, NTP = I / 32, NTD = (D + 15) / 16;
  const int nsp4 = (D / 2 + 63) / 64, nsp8 = (D + 63) / 64;
  const int tstride = up_tstride(NB, nsp4, nsp8);
  const size_t smem_up = ring_bytes<kRU>(kWarps) + static_cast<size_t>(T) * tstride * (64 + 4);
  const size_t smem_dn = ring_bytes<kRU>(kDnWarps) + static_cast<size_t>(T) * NBI * (64 + 4);
  if (smem_up > detail::max_dynamic_smem(moe_rows_up_kernel) ||
      smem_dn > detail::max_dynamic_smem(moe_rows_down_kernel))
    return false;
  const int occ_up = detail::occupancy(moe_rows_up_kernel, kThreads, smem_up);
  const int occ_dn = detail::occupancy(moe_rows_down_kernel, kDnThreads, smem_dn);
  if (occ_up < 1 || occ_dn < 1) return false;
  const RowsLayout L = rows_layout(m, T, topk);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_decode: workspace too small (", ws_bytes, " < ", L.total, ")");
  char* base = static_cast<char*>(ws);
  RowsPlan* plan = reinterpret_cast<RowsPlan*>(base + L.plan);

  PlanParams pp{};
  pp.ids = ids;
  pp.T = T;
  pp.topk = topk;
  pp.S = S;
  pp.has_shared = has_shared ? 1 : 0;
  pp.NTP = NTP;
  pp.NTD = NTD;
  pp.plan = plan;
  pp.ucnt = reinterpret_cast<unsigned*>(base + L.ucnt);
  pp.n_ucnt = L.n_ucnt;
  pp.dcnt = reinterpret_cast<unsigned*>(base + L.dcnt);

  RowsUpParams up{};
  up.plan = plan;
  up.etiled = m.tiled ? 1 : 0;
  up.w1 = m.w1;
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
  up.has_shared = has_shared ? 1 : 0;
  up.wts = weights;
  up.x = x;
  up.xt = static_cast<int>(xt);
  up.ldx = ldx;
  up.lim = m.swiglu_limit;
  up.bf16 = yt == DType::BF16 ? 1 : 0;
  up.NB = NB;
  up.NBI = NBI;
  up.NTP = NTP;
  up.nsp4 = nsp4;
  up.nsp8 = nsp8;
  up.tstride = tstride;
  up.upart = reinterpret_cast<float*>(base + L.upart);
  up.ucnt = pp.ucnt;
  up.hstc = reinterpret_cast<uint32_t*>(base + L.hstc);
  up.hsts = reinterpret_cast<float*>(base + L.hsts);
  up.hq = reinterpret_cast<float*>(base + L.hq);

  RowsDownParams dn{};
  dn.plan = plan;
  dn.etiled = up.etiled;
  dn.w2 = m.w2;
  dn.w2s = m.w2_scale;
  if (has_shared) dn.sw2 = fp8_view(m.shared_w2);
  dn.D = D;
  dn.I = I;
  dn.topk = topk;
  dn.S = S;
  dn.T = T;
  dn.has_shared = up.has_shared;
  dn.NBI = NBI;
  dn.NTD = NTD;
  dn.nspR = (I / 2 + 63) / 64;
  dn.nspI = (I + 63) / 64;
  dn.hstc = up.hstc;
  dn.hsts = up.hsts;
  dn.dpart = reinterpret_cast<float*>(base + L.dpart);
  dn.dcnt = pp.dcnt;
  dn.bf16 = up.bf16;
  dn.y = y;
  dn.yt = static_cast<int>(yt);
  dn.ldy = ldy;

  detail::launch_pdl(moe_rows_plan_kernel, dim3(1), dim3(256), 0, stream, pp);
  detail::launch_pdl(moe_rows_up_kernel, dim3(static_cast<unsigned>(occ_up * sm_count())), dim3(kThreads), smem_up,
                     stream, up);
  detail::launch_pdl(moe_rows_down_kernel, dim3(static_cast<unsigned>(occ_dn * sm_count())), dim3(kDnThreads),
                     smem_dn, stream, dn);
  return true;
}

}  // namespace moe_detail

}  // namespace dsx::cuda
