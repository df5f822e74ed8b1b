// Decode GEMV for one token: the weight matrix streamed as one contiguous, evenly
// divided byte range (gemv.h semantics; CUDA-core arithmetic of gemv_device.cuh: exact
// weight decoding, f32 products and sums).
//
//   * the grid is one wave (resident blocks), each block owning a contiguous range of
//     whole rows (flattened over groups), so every SM streams the same number of bytes;
//   * inside a block the rows are cut into warp "steps" (CPS chunks of 16 bytes per lane
//     of one row; each warp load one coalesced 512 bytes) and the steps are divided
//     evenly among the 8 warps, regardless of row boundaries; rows shared by two or more
//     warps are summed through shared memory in warp order (deterministic);
//   * each lane keeps U steps in flight; the first U are issued before the grid
//     dependency wait (programmatic dependent launch), i.e. while the previous kernel
//     finishes, and the activations are staged (with QA8) after that.
//
// Measured on the H200 (bench_cuda_kernels): faster than the default kernels for BF16
// weights of a few MB (router gate, compressor, indexer weights), which use it by
// default; slower for FP8 / MXFP4 (the decoding on CUDA cores makes it issue-bound, ~4
// instructions per weight byte), which use it only with DSX_GEMV_STREAM=1.
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/gemv_stream.h"
#include "kernels/cuda/gemv_stream_device.cuh"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr size_t kSmemCap = 64 * 1024;  // staged activations per block

struct StreamParams {
  dev::WView W;
  int64_t rows;    // G * N flattened weight rows
  int64_t N;       // rows per group
  int K;           // inputs per group
  int cpr;         // 16-byte chunks per row
  int spr;         // warp steps per row (ceil(cpr / 32))
  int64_t blocks;  // gridDim.x
  const void* x;
  int xt;
  int64_t ldx;
  int qa8, qblock;
  float prescale;
  int smem_floats;  // staged floats per token
  void* y;
  int yt;
  int64_t ldy;
  int bps_cap;  // (host) most blocks per SM, 0: no cap (GemvOpts::max_blocks_per_sm)
};

template <WFormat F, int TT, int U, int CPS>
__global__ void __launch_bounds__(kThreads, 3) gemv_stream_kernel(const StreamParams p) {
  extern __shared__ float4 smem_stream[];
  float* xs = reinterpret_cast<float*>(smem_stream);
  __shared__ float part[kWarps][2][TT];  // partial sums of the first / last row of each warp

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.x;
  const int64_t r0 = b * p.rows / p.blocks, r1 = (b + 1) * p.rows / p.blocks;
  // block-local steps: step s is step s % spr of row r0 + s / spr
  const int S = static_cast<int>(r1 - r0) * p.spr;
  const int s_lo = S * warp / kWarps, s_hi = S * (warp + 1) / kWarps;

  // weights first: they do not depend on the previous kernel
  dev::Step<CPS> ring[U];
  dev::Cursor ld{r0 + s_lo / p.spr, s_lo % p.spr};
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (s_lo + u < s_hi) dev::load_steps<F, CPS>(ring[u], p.W, p.cpr, ld.r, ld.cs, lane);
    ld.next(p.spr);
  }

  dev::pdl_wait();
  // activations of the groups this block's rows belong to
  const int64_t g_lo = r0 / p.N;
  const int64_t g_hi = r1 > r0 ? (r1 - 1) / p.N : g_lo;
  const int Ks = static_cast<int>((g_hi - g_lo + 1) * p.K);
  for (int t = 0; t < TT; ++t)
    dev::stage_rows(xs + static_cast<int64_t>(t) * p.smem_floats, 1, Ks, p.x, p.xt, p.ldx,
                    static_cast<int64_t>(t) * p.ldx + g_lo * p.K, 1, p.qa8, p.qblock, p.prescale);
  __syncthreads();
  dev::pdl_launch_dependents();

  constexpr int EPC = dev::Fmt<F>::EPC;
  const int xq = p.smem_floats / 4;
  float acc[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
  const int64_t first_row = r0 + s_lo / p.spr;
  dev::Cursor cu{first_row, s_lo % p.spr};
  int64_t grp = first_row / p.N;  // group of the cursor's row and its first row
  int64_t grp_end = (grp + 1) * p.N;
  for (int s0 = s_lo; s0 < s_hi; s0 += U) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u;
      if (s < s_hi) {  // warp-uniform
        const int64_t row = cu.r;
        if (row >= grp_end) {
          grp = row / p.N;
          grp_end = (grp + 1) * p.N;
        }
        const int c0 = cu.cs * (32 * CPS) + lane;
        const int q0 = (static_cast<int>(grp - g_lo) * p.K + c0 * EPC) / 4;
        dev::consume_steps<F, TT, CPS>(ring[u], smem_stream, xq, q0, c0, p.cpr, acc);
        if (s + U < s_hi) dev::load_steps<F, CPS>(ring[u], p.W, p.cpr, ld.r, ld.cs, lane);
        ld.next(p.spr);
        const bool row_end = cu.cs + 1 == p.spr;
        cu.next(p.spr);
        // last step of the row, or of this warp's range: the row's sum (or part)
        if (row_end || s + 1 == s_hi) {
#pragma unroll
          for (int t = 0; t < TT; ++t) acc[t] = dev::warp_sum(acc[t]);
          const int row_s0 = static_cast<int>(row - r0) * p.spr;  // block-local first step of the row
          const bool whole = row_s0 >= s_lo && row_s0 + p.spr <= s_hi;
          if (lane == 0) {
            if (whole) {
#pragma unroll
              for (int t = 0; t < TT; ++t) dev::store_act(p.y, p.yt, t * p.ldy + row, acc[t]);
            } else {
              const int slot = row == first_row ? 0 : 1;
#pragma unroll
              for (int t = 0; t < TT; ++t) part[warp][slot][t] = acc[t];
            }
          }
#pragma unroll
          for (int t = 0; t < TT; ++t) acc[t] = 0.0f;
        }
      }
    }
  }
  __syncthreads();
  // rows shared by several warps: the first contributor sums the parts in warp order
  if (s_lo < s_hi && lane < TT) {
    const int lr = (s_hi - 1) / p.spr;  // block-local index of this warp's last row
    const int rs0 = lr * p.spr, rs1 = rs0 + p.spr;
    if (rs0 >= s_lo && rs1 > s_hi) {  // it starts in this warp and continues after it
      const int64_t row = r0 + lr;
      float sum = part[warp][row == first_row ? 0 : 1][lane];
      for (int w = warp + 1; w < kWarps; ++w) {
        const int wlo = S * w / kWarps, whi = S * (w + 1) / kWarps;
        if (wlo >= rs1) break;
        if (whi > wlo) sum += part[w][0][lane];
      }
      dev::store_act(p.y, p.yt, lane * p.ldy + row, sum);
    }
  }
}

template <WFormat F, int TT, int U, int CPS>
bool launch_stream(const StreamParams& base, cudaStream_t stream) {
  auto kern = gemv_stream_kernel<F, TT, U, CPS>;
  StreamParams p = base;
  p.spr = (p.cpr + 32 * CPS - 1) / (32 * CPS);
  // one wave of resident blocks (at most one per row); a block stages the activations
  // of the groups its rows span
  const int sms = sm_count();
  const int cap = p.bps_cap > 0 ? std::min(p.bps_cap, 4) : 4;
  int64_t blocks = std::min<int64_t>(p.rows, static_cast<int64_t>(cap) * sms);
  int64_t span = 1;
  size_t smem = 0;
  auto size_for = [&](int64_t nb) {
    const int64_t rpb = (p.rows + nb - 1) / nb;
    span = p.rows > p.N ? std::min<int64_t>((rpb + p.N - 1) / p.N + 1, p.rows / p.N) : 1;
    smem = static_cast<size_t>(TT) * span * p.K * sizeof(float);
  };
  for (int it = 0; it < 3; ++it) {
    size_for(blocks);
    if (smem > kSmemCap || smem > detail::max_dynamic_smem(kern)) return false;
    const int occ = std::min(cap, detail::occupancy(kern, kThreads, smem));
    const int64_t nb = std::min<int64_t>(p.rows, static_cast<int64_t>(occ) * sms);
    if (nb >= blocks) break;  // fits in one wave
    blocks = nb;
  }
  size_for(blocks);  // (fewer blocks may span more groups)
  if (smem > kSmemCap || smem > detail::max_dynamic_smem(kern)) return false;
  if (static_cast<int64_t>(span) * p.K > (int64_t{1} << 30) / 4) return false;
  // block-local step indices are int
  if (((p.rows + blocks - 1) / blocks + 1) * p.spr > (int64_t{1} << 30)) return false;
  p.blocks = blocks;
  p.smem_floats = static_cast<int>(span * p.K);
  detail::launch_pdl(kern, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, p);
  return true;
}

// Chunks per lane per step: the largest of 1..4 that wastes the fewest lane slots at
// the row ends; loads in flight per lane kept near 8.
int pick_cps(int cpr) {
  int best = 1;
  int64_t best_waste = INT64_MAX;
  for (int c = 1; c <= 4; ++c) {
    const int64_t per = 32LL * c, waste = (cpr + per - 1) / per * per - cpr;
    if (waste <= best_waste) {
      best_waste = waste;
      best = c;
    }
  }
  return best;
}

template <WFormat F>
bool launch_fmt(const StreamParams& p, int T, cudaStream_t stream) {
  if (T != 1) return false;
  switch (pick_cps(p.cpr)) {
    case 1: return launch_stream<F, 1, 8, 1>(p, stream);
    case 2: return launch_stream<F, 1, 4, 2>(p, stream);
    case 3: return launch_stream<F, 1, 3, 3>(p, stream);
    default: return launch_stream<F, 1, 2, 4>(p, stream);
  }
}

}  // namespace

// DSX_GEMV_STREAM: unset = auto (BF16 weights up to 32 MB, where this kernel measured
// faster than the default ones: router gate, compressor, indexer weights), 1 = every
// format it supports, 0 = off.
int gemv_stream_mode() {
  const int64_t e = sw::get_int(sw::Id::GEMV_STREAM);
  return e < 0 ? 2 : (e != 0 ? 1 : 0);
}

namespace {
constexpr int64_t kAutoMaxBytes = int64_t{32} << 20;  // auto mode: BF16 weights up to this size
}

bool gemv_stream_may_take(const QMatrix& W) {
  const int mode = gemv_stream_mode();
  if (mode == 0 || W.fmt == WFormat::F32) return false;
  return mode == 1 || (W.fmt == WFormat::BF16 && W.rows * W.cols * 2 <= kAutoMaxBytes);
}

bool gemv_stream(const QMatrix& W, const dev::WView& wv, DType xt, const void* x, int64_t ldx, int T, DType yt,
                 void* y, int64_t ldy, const GemvOpts& o, bool qa8, cudaStream_t stream) {
  const int mode = gemv_stream_mode();
  if (mode == 0 || T != 1) return false;
  if (mode == 2 && (W.fmt != WFormat::BF16 || W.rows * W.cols * 2 > kAutoMaxBytes)) return false;
  if (W.fmt == WFormat::FP8_BLOCK && W.block < 16) return false;
  StreamParams p{};
  p.W = wv;
  p.rows = W.rows;
  p.N = W.rows / o.groups;
  p.K = static_cast<int>(W.cols);
  if (p.K % 4 != 0) return false;
  p.cpr = static_cast<int>(wv.row_bytes / 16);
  if (p.cpr * int64_t{16} != wv.row_bytes) return false;
  p.x = x;
  p.xt = static_cast<int>(xt);
  p.ldx = ldx;
  p.qa8 = qa8 ? 1 : 0;
  p.qblock = o.qblock;
  p.prescale = (W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4) ? dev::kTrickPrescale : 1.0f;
  p.y = y;
  p.yt = static_cast<int>(yt);
  p.ldy = ldy;
  p.bps_cap = o.max_blocks_per_sm;
  switch (W.fmt) {
    case WFormat::FP8_BLOCK: return launch_fmt<WFormat::FP8_BLOCK>(p, T, stream);
    case WFormat::MXFP4: return launch_fmt<WFormat::MXFP4>(p, T, stream);
    case WFormat::BF16: return launch_fmt<WFormat::BF16>(p, T, stream);
    case WFormat::F32: return false;  // (the default kernels)
  }
  return false;
}

}  // namespace dsx::cuda
