// GEMV of 2..16 rows against a large BF16 weight (the head), the weight streamed once
// for all rows (gemv_rows.h).
//
// The one-row CUDA-core kernel (gemv.cu gemv_kernel, no K split) computes output n as
// one warp's sum: lane l takes the 16-byte chunks c = l, l + 32, ... (8 elements each)
// in increasing order, one f32 FMA per element in element order into its running sum
// (starting at 0), and the 32 lane sums are added by the xor butterfly (warp_sum). Its
// multi-row passes hold at most 100 KB of activations as f32 per block, so the head
// (K = 5120: 20 KB a row) streams its 1.3 GB once per 4 rows: twice at 6 rows, four
// times at 16. This kernel keeps each row's arithmetic exactly (so every row's result
// is the one-row call's, bit for bit) and changes only what is shared:
//   * the activations are staged as they are stored (bf16: 10 KB a row at K = 5120;
//     f32 as two float4 planes so that a lane's chunk is two conflict-free loads);
//   * a warp owns RPW = 4 weight rows at a time (one wave of blocks walks the rows) and
//     multiplies each loaded chunk with the TT rows of its token group;
//   * 9..16 rows: two token groups of 8 in one block (16 warps), warp w of group 1
//     taking the same weight rows as warp w of group 0 at the same time, so that the
//     second read of a chunk is served by L2 and the weight crosses DRAM once.
#include "kernels/cuda/gemv_rows.h"

#include <algorithm>

#include "kernels/cuda/gemv_launch.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kRowWarps = 8;  // warps per token group
constexpr int kRpw = 4;       // weight rows per warp at a time
constexpr size_t kSmemCap = 200 * 1024;

struct RowsParams {
  dev::WView W;
  int64_t N;
  int C;  // 16-byte chunks per weight row (K / 8)
  const void* x;
  int64_t ldx;
  int T;  // rows of x in this launch
  void* y;
  int yt;
  int64_t ldy;
};

// Eight f32 values of 8 consecutive bf16 (little-endian pairs: the low half first).
__device__ __forceinline__ void bf16x8_to_f32(const uint4 v, float (&f)[8]) {
  const uint32_t u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    f[2 * q] = __uint_as_float(u[q] << 16);
    f[2 * q + 1] = __uint_as_float(u[q] & 0xffff0000u);
  }
}

// XB: x is bf16 (staged as bf16), else f32. TT: rows per token group; NG: token groups.
template <bool XB, int TT, int NG, int U>
__global__ void __launch_bounds__(kRowWarps * 32 * NG) gemv_rows_kernel(const RowsParams p) {
  extern __shared__ uint4 xs[];  // XB: [NG TT][C] chunks of 8 bf16; else [NG TT][2][C] float4
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tg = warp / kRowWarps, rw = warp % kRowWarps;
  const int C = p.C;

  // stage the rows (rows >= T as zeros)
  for (int i = threadIdx.x; i < NG * TT * C; i += blockDim.x) {
    const int t = i / C, c = i - t * C;
    if constexpr (XB) {
      uint4 v = make_uint4(0, 0, 0, 0);
      if (t < p.T) v = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.x) + t * p.ldx + 8 * c);
      xs[i] = v;
    } else {
      float4 lo = make_float4(0.f, 0.f, 0.f, 0.f), hi = lo;
      if (t < p.T) {
        const float* src = static_cast<const float*>(p.x) + t * p.ldx + 8 * c;
        lo = *reinterpret_cast<const float4*>(src);
        hi = *reinterpret_cast<const float4*>(src + 4);
      }
      float4* xf = reinterpret_cast<float4*>(xs);
      xf[(2 * t) * C + c] = lo;
      xf[(2 * t + 1) * C + c] = hi;
    }
  }
  __syncthreads();

  const int64_t nrg = (p.N + kRpw - 1) / kRpw;
  const int64_t row_last = p.N - 1;
  const int t0 = tg * TT;  // this warp's first row of x
  for (int64_t rg = static_cast<int64_t>(blockIdx.x) * kRowWarps + rw; rg < nrg;
       rg += static_cast<int64_t>(gridDim.x) * kRowWarps) {
    const int64_t n0 = rg * kRpw;
    const uint8_t* rows[kRpw];
#pragma unroll
    for (int r = 0; r < kRpw; ++r) rows[r] = p.W.row_at(n0 + r < row_last ? n0 + r : row_last);
    float acc[kRpw][TT];
#pragma unroll
    for (int r = 0; r < kRpw; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) acc[r][t] = 0.0f;

    for (int c0 = lane; c0 < C; c0 += 32 * U) {
      uint4 raw[U][kRpw];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
#pragma unroll
        for (int r = 0; r < kRpw; ++r)
          raw[u][r] = c < C ? dev::ldg_stream(rows[r] + static_cast<int64_t>(c) * 16) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= C) continue;
        float wf[kRpw][8];
#pragma unroll
        for (int r = 0; r < kRpw; ++r) bf16x8_to_f32(raw[u][r], wf[r]);
#pragma unroll
        for (int t = 0; t < TT; ++t) {
          float xv[8];
          if constexpr (XB) {
            bf16x8_to_f32(xs[(t0 + t) * C + c], xv);
          } else {
            const float4* xf = reinterpret_cast<const float4*>(xs);
            const float4 lo = xf[(2 * (t0 + t)) * C + c], hi = xf[(2 * (t0 + t) + 1) * C + c];
            xv[0] = lo.x, xv[1] = lo.y, xv[2] = lo.z, xv[3] = lo.w;
            xv[4] = hi.x, xv[5] = hi.y, xv[6] = hi.z, xv[7] = hi.w;
          }
#pragma unroll
          for (int r = 0; r < kRpw; ++r) {
            float a = acc[r][t];
#pragma unroll
            for (int e = 0; e < 8; ++e) a = fmaf(wf[r][e], xv[e], a);
            acc[r][t] = a;
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRpw; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t) acc[r][t] = dev::warp_sum(acc[r][t]);
#pragma unroll
    for (int r = 0; r < kRpw; ++r)
#pragma unroll
      for (int t = 0; t < TT; ++t)
        if (lane == ((r * TT + t) & 31) && n0 + r < p.N && t0 + t < p.T)
          dev::store_act(p.y, p.yt, (t0 + t) * p.ldy + n0 + r, acc[r][t]);
  }
}

template <bool XB, int TT, int NG>
constexpr int depth() {
  return TT <= 4 ? 2 : (NG > 1 ? 1 : 2);  // chunks per row in flight per lane
}

// Shared memory of a launch, 0 when it does not fit.
template <bool XB, int TT, int NG>
size_t smem_for(int C) {
  const size_t smem = static_cast<size_t>(NG) * TT * C * (XB ? 16 : 32);
  return smem <= std::min(kSmemCap, detail::max_dynamic_smem(gemv_rows_kernel<XB, TT, NG, depth<XB, TT, NG>()>)) ? smem
                                                                                                                  : 0;
}

template <bool XB, int TT, int NG>
void launch(const RowsParams& p, size_t smem, cudaStream_t stream) {
  auto kern = gemv_rows_kernel<XB, TT, NG, depth<XB, TT, NG>()>;
  const int threads = kRowWarps * 32 * NG;
  const int occ = detail::occupancy(kern, threads, smem);
  const int64_t nrg = (p.N + kRpw - 1) / kRpw;
  const int64_t want = (nrg + kRowWarps - 1) / kRowWarps;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(want, static_cast<int64_t>(occ) * sm_count()));
  kern<<<static_cast<unsigned>(blocks), threads, smem, stream>>>(p);
  DSX_CUDA_CHECK(cudaGetLastError());
}

// One launch for p.T rows if it fits, else (9 .. 16 rows) two of at most 8.
template <bool XB>
bool launch_rows(const RowsParams& p, cudaStream_t stream) {
  auto one = [&](const RowsParams& q) {
    size_t sm = 0;
    switch (q.T) {
#define DSX_ROWS_CASE(n) \
  case n:                \
    if ((sm = smem_for<XB, n, 1>(q.C)) > 0) launch<XB, n, 1>(q, sm, stream); \
    return sm > 0;
      DSX_ROWS_CASE(1)
      DSX_ROWS_CASE(2)
      DSX_ROWS_CASE(3)
      DSX_ROWS_CASE(4)
      DSX_ROWS_CASE(5)
      DSX_ROWS_CASE(6)
      DSX_ROWS_CASE(7)
      DSX_ROWS_CASE(8)
#undef DSX_ROWS_CASE
      default:
        if ((sm = smem_for<XB, 8, 2>(q.C)) > 0) launch<XB, 8, 2>(q, sm, stream);
        return sm > 0;
    }
  };
  if (p.T <= 8) return one(p);
  if (smem_for<XB, 8, 2>(p.C) > 0) return one(p);
  // two launches: rows 0..7, then the rest (each row's arithmetic is the same)
  if (smem_for<XB, 8, 1>(p.C) == 0) return false;
  RowsParams a = p, b = p;
  a.T = 8;
  b.T = p.T - 8;
  b.x = static_cast<const uint8_t*>(p.x) + 8 * p.ldx * (XB ? 2 : 4);
  b.y = static_cast<uint8_t*>(p.y) + 8 * p.ldy * (p.yt == 1 ? 2 : 4);
  return one(a) && one(b);
}

}  // namespace

bool gemv_rows(const dev::WView& wv, int64_t N, int K, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y,
               int64_t ldy, cudaStream_t stream) {
  if (T < 2 || T > kGemvRowsMax || N <= 0 || K <= 0 || K % 8 != 0 || wv.tiled || wv.row_bytes != 2 * int64_t{K})
    return false;
  if (!detail::aligned16(wv.w) || !detail::aligned16(x) || ldx % (xt == DType::BF16 ? 8 : 4) != 0) return false;
  if (static_cast<int64_t>(K) / 8 * 2 * kGemvRowsMax > (int64_t{1} << 30)) return false;
  RowsParams p{};
  p.W = wv;
  p.N = N;
  p.C = K / 8;
  p.x = x;
  p.ldx = ldx;
  p.T = T;
  p.y = y;
  p.yt = static_cast<int>(yt);
  p.ldy = ldy;
  return xt == DType::BF16 ? launch_rows<true>(p, stream) : launch_rows<false>(p, stream);
}

}  // namespace dsx::cuda
