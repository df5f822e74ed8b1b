#include "kernels/cuda/moe_grouped.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "kernels/cuda/cp_async_device.cuh"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/quant_act_device.cuh"
#include "util/error.h"

// Block tile: 256 weight rows (16 m-tiles of 16 rows, two per warp) x up to 64 grouped
// rows (8 n-tiles of 8), K in stages of 128 elements ("super-spans"), cp.async
// multi-buffered (MXFP4: 3 stages, FP8: 2). Up: warp w holds the w1 and the w3 rows of
// the same 16 features (f0 + 16 w ..), so the SwiGLU is computed from its own
// accumulators; the block's 128 features cover whole QA8 blocks of h. Down: warp w holds
// 32 consecutive rows of w2 (f0 + 32 w ..).
//
// Fragments (mma.sync m16n8k16, lane = 4 g + c): in a super-span lane c of a weight row
// holds K block c (elements 32 c .. 32 c + 31: MXFP4 its 16 bytes of the 64-byte span,
// FP8 32 bytes); its 8-element group w (w = 0..3) gives the four bf16 pairs (0,4) (1,5)
// (2,6) (3,7) of the group, which feed two k-steps: (0,4) and (1,5) as the A pairs
// k = 2c, 2c+1 and 2c+8, 2c+9 of the first, (2,6) and (3,7) of the second. The mma
// sums over k in any order, so the B fragment of lane (g, c) takes the same elements of
// row g of the n-tile: the B order (moe_grouped.h) makes them one 16-byte shared load.
// Each lane scales its own weight block before the product (MXFP4 per row and block,
// FP8 per 32-row and 32-column tile), so the f32 accumulators sum whole K.
//
// Cost (H200, release shapes, 2048-row chunks, ncu): issue-bound, not memory-bound: per
// stage and warp the MXFP4 decode is ~17 integer / bf16 operations per 8 weights against
// 2 * (rows / 8) mma, so tiles of few rows spend most issue slots decoding. The main loop
// is instantiated per n-tile count (1..8) so that no n-tile is predicated and only the
// accumulators in use take registers.

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kBT = kGroupedTileRows;  // grouped rows per tile
constexpr int kNT = kBT / 8;           // n-tiles
constexpr int kMT = 2 * kWarps;        // m-tiles of 16 weight rows per block
constexpr int kUpF = 16 * kWarps;      // up: features per block (their w1 and w3 rows)
constexpr int kDnF = 32 * kWarps;      // down: features (w2 rows) per block
constexpr int kKS = 128;               // K elements per stage
constexpr int kBRow = 2 * kKS + 32;    // staged B row: 256 bytes, rows 32 bytes apart modulo 128
constexpr int kBBytes = kBT * kBRow;
constexpr int kMx4A = kMT * 16 * 64;   // MXFP4: 64 bytes per row and stage
constexpr int kFp8A = kMT * 16 * 128;  // FP8: 128 bytes
constexpr int kScBytes = kMT * 16 * 4;  // MXFP4 scales: 4 per row and stage
constexpr int kMx4Stage = kMx4A + kBBytes + kScBytes;
constexpr int kFp8Stage = kFp8A + kBBytes;
constexpr int kMx4Stages = 3;
constexpr int kFp8Stages = 2;
constexpr int kFp8Tab = 4096;  // FP8 scales of the block's m-tiles: kMT rows of K / B bytes
constexpr int kHsStride = kUpF + 4;  // up epilogue: h of the tile [kBT][kHsStride] f32
constexpr int kSmem = kMx4Stages * kMx4Stage > kFp8Stages * kFp8Stage + kFp8Tab ? kMx4Stages * kMx4Stage
                                                                                 : kFp8Stages * kFp8Stage + kFp8Tab;
static_assert(kBT * kHsStride * 4 <= kSmem, "epilogue does not fit");
static_assert(kThreads == 256 && kMT == 16, "the copy loops assume 256 threads and 16 m-tiles");

// ---- device helpers ---------------------------------------------------------------

__device__ __forceinline__ void cp_async8_zfill(uint32_t dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(ok ? 8 : 0) : "memory");
#endif
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// a * b on bf16 pairs (exact here: b is a power of two, the results normal)
__device__ __forceinline__ uint32_t bmul2(uint32_t a, uint32_t b) {
  uint32_t d;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
#else
  d = 0;
#endif
  return d;
}

// The 8 e2m1 nibbles n0..n7 of v (n0 = low nibble of byte 0) times 2^(s-127), as the bf16
// pairs P0 = (n0, n4), P1 = (n1, n5), P2 = (n2, n6), P3 = (n3, n7) (first element in the
// low half). F = the bf16 pair (2^(s-127), 2^(s-127)). The magnitude (3 bits) picks the
// two bytes of the exact bf16 value from 8-byte tables (byte permutes), the sign is
// moved to bit 15 / 31, then one multiply by F (exact for scale bytes 2..252).
__device__ __forceinline__ void mx4_decode(uint32_t v, uint32_t F, uint32_t (&P)[4]) {
  constexpr uint32_t kHi0 = 0x3F3F3F00u, kHi1 = 0x40404040u;  // high bytes of 0 .5 1 1.5 | 2 3 4 6
  constexpr uint32_t kLo0 = 0xC0800000u, kLo1 = 0xC0804000u;  // low bytes
  const uint32_t m = v & 0x77777777u;
  const uint32_t sa = __byte_perm(m, 0u, 0x0020u);  // selectors n0 n1 n4 n5
  const uint32_t sb = __byte_perm(m, 0u, 0x0031u);  // selectors n2 n3 n6 n7
  const uint32_t ha = __byte_perm(kHi0, kHi1, sa), la = __byte_perm(kLo0, kLo1, sa);
  const uint32_t hb = __byte_perm(kHi0, kHi1, sb), lb = __byte_perm(kLo0, kLo1, sb);
  constexpr uint32_t kSign = 0x80008000u;
  P[0] = bmul2(__byte_perm(la, ha, 0x6240u) | ((v << 12) & kSign), F);
  P[1] = bmul2(__byte_perm(la, ha, 0x7351u) | ((v << 8) & kSign), F);
  P[2] = bmul2(__byte_perm(lb, hb, 0x6240u) | ((v << 4) & kSign), F);
  P[3] = bmul2(__byte_perm(lb, hb, 0x7351u) | (v & kSign), F);
}

// The same pairs from the bits themselves: an e2m1 nibble s e1 e0 m is the bf16
// s 0000000 e1 e0 m 000000 times 2^126 (e1 e0 = 0: a bf16 subnormal, exact), so the
// magnitude goes to bits 6..8 and the sign to bit 15 of its half. One bit select per pair
// first puts the sign 9 places above its magnitude bits (taking them from v << 6 or
// v >> 6), then one shift and one mask place both: 13 integer operations per word
// (against 18 above). Then times F = 2^(s-1) (bf16 pair, the multiply takes subnormal
// inputs): exact for scale bytes 2..128, i.e. |w| <= 12; larger scales take mx4_decode.
__device__ __forceinline__ void mx4_decode_fast(uint32_t v, uint32_t F, uint32_t (&P)[4]) {
  constexpr uint32_t kK = 0x81C081C0u;  // sign and magnitude bits of both halves
  const uint32_t vl = v << 6, vr = v >> 6;
  P[0] = bmul2((dev::bit_select(v, vl, 0x00070007u) << 6) & kK, F);
  P[1] = bmul2((dev::bit_select(v, vl, 0x00700070u) << 2) & kK, F);
  P[2] = bmul2((dev::bit_select(vr, v, 0x001C001Cu) << 4) & kK, F);
  P[3] = bmul2(dev::bit_select(vr, v, 0x01C001C0u) & kK, F);
}

// f16 pair (exact e4m3 values) times sf (a power of two) as a bf16 pair (exact).
__device__ __forceinline__ uint32_t f16x2_scaled_bf16x2(uint32_t h, float sf) {
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __floats2bfloat162_rn(f.x * sf, f.y * sf);
  return *reinterpret_cast<const uint32_t*>(&b);
}
// The 8 e4m3 bytes e0..e7 of (lo, hi) times sf, as the pairs (e0,e4) (e1,e5) (e2,e6) (e3,e7).
__device__ __forceinline__ void fp8_decode(uint32_t lo, uint32_t hi, float sf, uint32_t (&P)[4]) {
  const uint32_t q0 = __byte_perm(lo, hi, 0x5140u), q1 = __byte_perm(lo, hi, 0x7362u);
  uint32_t h0, h1, h2, h3;
  dev::fp8_to_f16x2<true>(q0, h0, h1);  // (e0, e4), (e1, e5)
  dev::fp8_to_f16x2<true>(q1, h2, h3);  // (e2, e6), (e3, e7)
  P[0] = f16x2_scaled_bf16x2(h0, sf);
  P[1] = f16x2_scaled_bf16x2(h1, sf);
  P[2] = f16x2_scaled_bf16x2(h2, sf);
  P[3] = f16x2_scaled_bf16x2(h3, sf);
}

__device__ __forceinline__ dev::WView mx4_view(const uint8_t* w, const uint8_t* s, int K, int tiled) {
  dev::WView v;
  v.w = w;
  v.s = s;
  v.row_bytes = K / 2;
  v.sc_cols = K / 32;
  v.tiled = tiled;
  return v;
}

struct GemmParams {
  int E, K, N;  // experts, inputs, weight rows (up: I, down: D)
  int tiled;    // routed experts in the tile layout
  const uint8_t* const* wa;  // routed: up w1, down w2
  const uint8_t* const* was;
  const uint8_t* const* wb;  // routed: up w3 (down: unused)
  const uint8_t* const* wbs;
  dev::WView sa, sb;  // shared expert (FP8): up w1 / w3, down w2 / w2
  const int4* tiles;
  const int* n_tiles;
  const uint16_t* x;  // B rows [rows, K], B order
  // up
  const float* wts;
  const int* perm;
  float lim;
  int qblock;
  int bf16;
  uint16_t* hq;
  float* gu;
  // down
  float* yp;
};

// First weight row of m-tile mt (warp mt / 2, sub mt % 2) and its matrix (0: a, 1: b).
template <bool UP>
__device__ __forceinline__ int mt_row(int mt, int f0) {
  return UP ? f0 + 16 * (mt >> 1) : f0 + 32 * (mt >> 1) + 16 * (mt & 1);
}

struct Tile {
  int f0, row0, nrows, nnt;
  const dev::WView* v;  // the views of sub 0 / 1 (in shared memory: registers are scarce)
};
template <bool UP, WFormat F>
__device__ __forceinline__ void produce(const GemmParams& p, const Tile& t, int ss, char* st) {
  const int tid = threadIdx.x;
  const int kb0 = ss * kKS;
  const int nvb = min(4, (p.K - kb0) >> 5);  // valid 32-blocks of this stage
  constexpr int AB = F == WFormat::MXFP4 ? kMx4A : kFp8A;
  char* A = st;
  char* B = st + AB;
  if constexpr (F == WFormat::MXFP4) {
    const int r = (tid >> 2) & 15, c = tid & 3;
    const dev::WView v = t.v[(tid >> 6) & 1];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int mt = (tid >> 6) + 4 * q;
      const int rb = mt_row<UP>(mt, t.f0);
      const bool ok = rb < p.N && c < nvb;
      // (m-tiles start on a 16-row tile: its span ss is 1 KB at tile rb / 16 in the tile layout)
      const int64_t off = v.tiled ? static_cast<int64_t>(rb >> 4) * (v.row_bytes << 4) + ss * 1024 + (tid & 63) * 16
                                  : static_cast<int64_t>(rb + r) * v.row_bytes + ss * 64 + 16 * c;
      dev::cp_async16_zfill(dev::smem_u32(A + mt * 1024 + r * 64 + 16 * c), ok ? v.w + off : v.w, ok);
    }
    // scales: thread = (m-tile tid / 16, row tid % 16), 4 bytes (blocks 0..3 of the stage)
    {
      const int mt = tid >> 4, rr = tid & 15;
      const int rb = mt_row<UP>(mt, t.f0);
      const dev::WView vs = t.v[mt & 1];
      char* dst = st + AB + kBBytes + tid * 4;
      if (rb < p.N) {
        const uint8_t* s = vs.s + static_cast<int64_t>(rb + rr) * vs.sc_cols + 4 * ss;
        if ((vs.sc_cols & 3) == 0) {
          dev::cp_async4(dst, s);
        } else {  // (rows not 4-byte aligned: plain loads, small shapes only)
          uint32_t w = 0;
          for (int b = 0; b < nvb; ++b) w |= static_cast<uint32_t>(s[b]) << (8 * b);
          *reinterpret_cast<uint32_t*>(dst) = w;
        }
      }
    }
  } else {
    const int w8 = tid >> 6, r = (tid >> 2) & 15, c = tid & 3;
    const int64_t boff = static_cast<int64_t>(ss) * 128 + 32 * c + 8 * w8;
#pragma unroll 4
    for (int mt = 0; mt < kMT; ++mt) {
      const int rb = mt_row<UP>(mt, t.f0);
      const dev::WView v = t.v[mt & 1];
      const bool ok = rb < p.N && c < nvb;
      const uint8_t* src = ok ? v.row_at(rb + r) + v.byte_off(boff) : v.w;
      cp_async8_zfill(dev::smem_u32(A + mt * 2048 + w8 * 512 + r * 32 + 8 * c), src, ok);
    }
  }
  // B rows (only those of the n-tiles in use; rows past nrows read as zeros)
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int i = tid + kThreads * q;
    const int r = i >> 4, lc = i & 15;
    if (r < 8 * t.nnt) {
      const bool ok = r < t.nrows && (lc >> 2) < nvb;
      const uint16_t* src = ok ? p.x + static_cast<int64_t>(t.row0 + r) * p.K + kb0 + 8 * lc : p.x;
      dev::cp_async16_zfill(dev::smem_u32(B + r * kBRow + ((lc ^ ((lc >> 3) & 1)) << 4)), src, ok);
    }
  }
}

template <bool UP, WFormat F, int NNT>
__device__ __forceinline__ void consume(const GemmParams& p, const Tile& t, int ss, const char* st,
                                        const uint8_t* fp8tab, int nkb, float (&acc)[2][NNT][4]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  constexpr int AB = F == WFormat::MXFP4 ? kMx4A : kFp8A;
  const char* A = st;
  const char* B = st + AB;
  const int kb0 = ss * kKS;
  const bool cv = 32 * c < p.K - kb0;  // this lane's block exists
  bool ok[2];
#pragma unroll
  for (int s = 0; s < 2; ++s) ok[s] = mt_row<UP>(2 * warp + s, t.f0) < p.N;
  // weights of this lane for the stage
  uint4 ra[2], rb[2];
  uint32_t Fa[2], Fb[2];
  float sf[2];
  bool lut = false;
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    const int mt = 2 * warp + s;
    if constexpr (F == WFormat::MXFP4) {
      ra[s] = *reinterpret_cast<const uint4*>(A + mt * 1024 + lane * 16);
      rb[s] = *reinterpret_cast<const uint4*>(A + mt * 1024 + 512 + lane * 16);
      const uint8_t* sc = reinterpret_cast<const uint8_t*>(st + AB + kBBytes) + mt * 64;
      const bool use = cv && ok[s];
      Fa[s] = use ? sc[g * 4 + c] : 0u;  // (scale bytes for now)
      Fb[s] = use ? sc[(g + 8) * 4 + c] : 0u;
      lut |= max(Fa[s], Fb[s]) > 128u;
    } else {
      const int kb = (kb0 + 32 * c) >> t.v[s].wshift;
      sf[s] = cv ? dev::e8m0_f32_nb(fp8tab[mt * nkb + kb]) : 0.0f;
    }
  }
  if constexpr (F == WFormat::MXFP4) {
    // the bit-trick decode unless a scale byte of the warp's stage exceeds 128
    lut = __any_sync(dev::kFull, lut);
    const uint32_t add = lut ? 0u : 126u;  // F = 2^(s-127) (tables) or 2^(s-1) (bit trick)
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      Fa[s] = (Fa[s] + add) * 0x00800080u;
      Fb[s] = (Fb[s] + add) * 0x00800080u;
    }
  }
#pragma unroll
  for (int w4 = 0; w4 < 4; ++w4) {
    uint32_t pa[2][4], pb[2][4];
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      if constexpr (F == WFormat::MXFP4) {
        if (lut) {
          mx4_decode(dev::word(ra[s], w4), Fa[s], pa[s]);
          mx4_decode(dev::word(rb[s], w4), Fb[s], pb[s]);
        } else {
          mx4_decode_fast(dev::word(ra[s], w4), Fa[s], pa[s]);
          mx4_decode_fast(dev::word(rb[s], w4), Fb[s], pb[s]);
        }
      } else {
        const char* a = A + (2 * warp + s) * 2048 + w4 * 512 + g * 32 + 8 * c;
        const uint2 lg = *reinterpret_cast<const uint2*>(a);
        const uint2 l8 = *reinterpret_cast<const uint2*>(a + 256);
        fp8_decode(lg.x, lg.y, sf[s], pa[s]);
        fp8_decode(l8.x, l8.y, sf[s], pb[s]);
      }
    }
    const char* brow = B + g * kBRow + ((((4 * c + w4) ^ (c >> 1))) << 4);
#pragma unroll
    for (int j = 0; j < NNT; ++j) {
      const uint4 X = *reinterpret_cast<const uint4*>(brow + j * 8 * kBRow);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        if (ok[s]) {
          mma_bf16(acc[s][j], pa[s][0], pb[s][0], pa[s][1], pb[s][1], X.x, X.y);
          mma_bf16(acc[s][j], pa[s][2], pb[s][2], pa[s][3], pb[s][3], X.z, X.w);
        }
      }
    }
  }
}

template <bool UP, WFormat F, int NNT>
__device__ __forceinline__ void mainloop(const GemmParams& p, const Tile& t, char* smem, float (&acc)[2][NNT][4]) {
  constexpr int NS = F == WFormat::MXFP4 ? kMx4Stages : kFp8Stages;
  constexpr int SB = F == WFormat::MXFP4 ? kMx4Stage : kFp8Stage;
  const int nss = (p.K + kKS - 1) / kKS;
#pragma unroll
  for (int s = 0; s < NS - 1; ++s) {
    if (s < nss) produce<UP, F>(p, t, s, smem + s * SB);
    dev::cp_async_commit();
  }
  // FP8: the scales of the block's m-tiles (one row of K / B bytes per m-tile: its 16 rows
  // lie in one B-row tile); read after the loop's first barrier
  uint8_t* fp8tab = reinterpret_cast<uint8_t*>(smem + NS * SB);
  int nkb = 0;
  if constexpr (F == WFormat::FP8_BLOCK) {
    nkb = t.v[0].sc_cols;
    for (int i = threadIdx.x; i < kMT * nkb; i += kThreads) {
      const int mt = i / nkb, kb = i % nkb;
      const int rb = mt_row<UP>(mt, t.f0);
      const dev::WView v = t.v[mt & 1];
      fp8tab[i] = rb < p.N ? v.s[static_cast<int64_t>(rb >> v.wshift) * v.sc_cols + kb] : 0;
    }
  }
  for (int ss = 0; ss < nss; ++ss) {
    dev::cp_async_wait<NS - 2>();
    __syncthreads();
    const int nx = ss + NS - 1;
    if (nx < nss) produce<UP, F>(p, t, nx, smem + (nx % NS) * SB);
    dev::cp_async_commit();
    consume<UP, F, NNT>(p, t, ss, smem + (ss % NS) * SB, fp8tab, nkb, acc);
  }
  dev::cp_async_wait<0>();
  __syncthreads();
}

// The products of one tile of NNT n-tiles, then (up) h into shared memory / (down) yp.
template <bool UP, int NNT>
__device__ __forceinline__ void run_tile(const GemmParams& p, const Tile& t, bool shared, char* smem,
                                         const float* s_wts) {
  float acc[2][NNT][4];
#pragma unroll
  for (int s = 0; s < 2; ++s)
#pragma unroll
    for (int j = 0; j < NNT; ++j)
#pragma unroll
      for (int h = 0; h < 4; ++h) acc[s][j][h] = 0.0f;
  if (shared)
    mainloop<UP, WFormat::FP8_BLOCK, NNT>(p, t, smem, acc);
  else
    mainloop<UP, WFormat::MXFP4, NNT>(p, t, smem, acc);

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, c = lane & 3;
  if constexpr (UP) {
    const int I = p.N;
    float* hs = reinterpret_cast<float*>(smem);
    if (mt_row<UP>(2 * warp, t.f0) >= I) return;
#pragma unroll
    for (int j = 0; j < NNT; ++j) {
#pragma unroll
      for (int h = 0; h < 4; ++h) {
        const int fl = 16 * warp + g + (h >= 2 ? 8 : 0);
        const int tr = 8 * j + 2 * c + (h & 1);
        if (tr < t.nrows) {
          const float gv = acc[0][j][h], uv = acc[1][j][h];
          if (p.gu) {
            float* r = p.gu + static_cast<int64_t>(t.row0 + tr) * 2 * I + t.f0 + fl;
            r[0] = gv;
            r[I] = uv;
          }
          hs[tr * kHsStride + fl] = dev::swiglu_h(gv, uv, s_wts[tr], p.lim, p.bf16);
        }
      }
    }
  } else {
    const int D = p.N;
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int fb = mt_row<UP>(2 * warp + s, t.f0);
      if (fb >= D) continue;
#pragma unroll
      for (int j = 0; j < NNT; ++j) {
#pragma unroll
        for (int h = 0; h < 4; ++h) {
          const int tr = 8 * j + 2 * c + (h & 1);
          if (tr < t.nrows) p.yp[static_cast<int64_t>(t.row0 + tr) * D + fb + g + (h >= 2 ? 8 : 0)] = acc[s][j][h];
        }
      }
    }
  }
}

template <bool UP>
__global__ void __launch_bounds__(kThreads, 2) grouped_gemm_kernel(const GemmParams p) {
  extern __shared__ __align__(128) char smem[];
  __shared__ float s_wts[kBT];
  __shared__ dev::WView s_view[2];
  const int tix = blockIdx.y;
  if (tix >= *p.n_tiles) return;
  const int4 tl = p.tiles[tix];
  const int grp = tl.x;
  const bool shared = grp >= p.E;
  Tile t;
  t.f0 = blockIdx.x * (UP ? kUpF : kDnF);
  t.row0 = tl.y;
  t.nrows = tl.z;
  t.nnt = (t.nrows + 7) >> 3;
  t.v = s_view;
  if (threadIdx.x < 2) {
    const int s = threadIdx.x;
    s_view[s] = shared ? (s ? p.sb : p.sa)
                       : mx4_view(s && UP ? p.wb[grp] : p.wa[grp], s && UP ? p.wbs[grp] : p.was[grp], p.K, p.tiled);
  }
  if (UP && threadIdx.x < t.nrows) s_wts[threadIdx.x] = shared ? 1.0f : p.wts[p.perm[t.row0 + threadIdx.x]];
  __syncthreads();

  // (one instantiation per n-tile count: no per-n-tile predicates, only the accumulators in use)
  switch (t.nnt) {
    case 1: run_tile<UP, 1>(p, t, shared, smem, s_wts); break;
    case 2: run_tile<UP, 2>(p, t, shared, smem, s_wts); break;
    case 3: run_tile<UP, 3>(p, t, shared, smem, s_wts); break;
    case 4: run_tile<UP, 4>(p, t, shared, smem, s_wts); break;
    case 5: run_tile<UP, 5>(p, t, shared, smem, s_wts); break;
    case 6: run_tile<UP, 6>(p, t, shared, smem, s_wts); break;
    case 7: run_tile<UP, 7>(p, t, shared, smem, s_wts); break;
    default: run_tile<UP, 8>(p, t, shared, smem, s_wts); break;
  }

  if constexpr (UP) {
    // QA8 of h per (row, qblock), one warp each
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int I = p.N;
    const float* hs = reinterpret_cast<const float*>(smem);
    const int nf = min(kUpF, I - t.f0);
    const int nqb = nf / p.qblock;
    for (int u = warp; u < t.nrows * nqb; u += kWarps) {
      const int tr = u / nqb, qb = u % nqb;
      const float* src = hs + tr * kHsStride + qb * p.qblock;
      uint16_t* dst = p.hq + static_cast<int64_t>(t.row0 + tr) * I + t.f0 + qb * p.qblock;
      auto put = [&](int k, uint8_t code, float s) { dst[grouped_b_pos(k)] = f32_to_bf16(e4m3_to_f32(code) * s); };
      if (p.qblock == 32) {
        float v[1] = {src[lane]};
        uint8_t cd[1];
        const float s = dev::qa8_warp_block<1>(v, cd);
        put(lane, cd[0], s);
      } else if (p.qblock == 64) {
        float v[2] = {src[lane], src[lane + 32]};
        uint8_t cd[2];
        const float s = dev::qa8_warp_block<2>(v, cd);
        put(lane, cd[0], s);
        put(lane + 32, cd[1], s);
      } else {
        float v[4] = {src[lane], src[lane + 32], src[lane + 64], src[lane + 96]};
        uint8_t cd[4];
        const float s = dev::qa8_warp_block<4>(v, cd);
#pragma unroll
        for (int q = 0; q < 4; ++q) put(lane + 32 * q, cd[q], s);
      }
    }
  }
}

// ---- plan and gather ---------------------------------------------------------------

// Tiles of kBT rows: groups 0..E-1 (the experts' counts / offsets), then group E (the
// shared expert: Tsh rows from Tk) when Tsh > 0. One block of 1024 threads.
__global__ void __launch_bounds__(1024) plan_kernel(const int* __restrict__ counts, const int* __restrict__ offs,
                                                    int E, int Tk, int Tsh, int4* __restrict__ tiles,
                                                    int* __restrict__ n_tiles) {
  __shared__ int wsum[32];
  __shared__ int carry;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int G = E + (Tsh > 0 ? 1 : 0);
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < G; base += blockDim.x) {
    const int gi = base + threadIdx.x;
    int n = 0, r0 = 0;
    if (gi < E) {
      n = counts[gi];
      r0 = offs[gi];
    } else if (gi < G) {
      n = Tsh;
      r0 = Tk;
    }
    const int nt = (n + kBT - 1) / kBT;
    int v = nt;  // inclusive scan within the warp
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(dev::kFull, v, o);
      if (lane >= o) v += y;
    }
    if (lane == 31) wsum[warp] = v;
    __syncthreads();
    if (warp == 0) {
      int w = lane < nw ? wsum[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(dev::kFull, w, o);
        if (lane >= o) w += y;
      }
      if (lane < nw) wsum[lane] = w;
    }
    __syncthreads();
    const int first = carry + (warp ? wsum[warp - 1] : 0) + v - nt;
    for (int i = 0; i < nt; ++i) tiles[first + i] = make_int4(gi, r0 + i * kBT, min(kBT, n - i * kBT), 0);
    __syncthreads();
    if (threadIdx.x == blockDim.x - 1) carry = first + nt;
    __syncthreads();
  }
  if (threadIdx.x == 0) *n_tiles = carry;
}

// Thread = 8 consecutive elements of one grouped row; the qblock / 8 threads of a QA8
// block are consecutive lanes of a warp (D % qblock == 0).
__global__ void gather_qa8_kernel(const void* __restrict__ x, int xt, int64_t ldx, int vec, int D, int qblock,
                                  const int* __restrict__ perm, int Tk, int topk, int rows, uint16_t* __restrict__ xb) {
  const int gpr = D / 8;
  const int64_t total = static_cast<int64_t>(rows) * gpr;
  const int64_t padded = (total + 31) & ~int64_t{31};
  const int lanes = qblock / 8;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < padded;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const bool ok = i < total;
    const int64_t p = ok ? i / gpr : 0;
    const int grp = ok ? static_cast<int>(i % gpr) : 0;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (ok) {
      const int64_t t = p < Tk ? perm[p] / topk : p - Tk;
      const int64_t e0 = t * ldx + 8 * grp;
      if (vec && xt == 1) {
        const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(x) + e0);
        const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          v[2 * b] = bf16_to_f32(static_cast<uint16_t>(w[b] & 0xffffu));
          v[2 * b + 1] = bf16_to_f32(static_cast<uint16_t>(w[b] >> 16));
        }
      } else if (vec) {
        const float4 a = *reinterpret_cast<const float4*>(static_cast<const float*>(x) + e0);
        const float4 b = *reinterpret_cast<const float4*>(static_cast<const float*>(x) + e0 + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
      } else {
#pragma unroll
        for (int b = 0; b < 8; ++b) v[b] = dev::load_act(x, xt, e0 + b);
      }
    }
    float a = 0.0f;
#pragma unroll
    for (int b = 0; b < 8; ++b) a = fmaxf(a, fabsf(v[b]));
    for (int o = 1; o < lanes; o <<= 1) a = fmaxf(a, __shfl_xor_sync(dev::kFull, a, o));
    const float s = dev::qa8_scale(a);
    uint32_t q[8];
#pragma unroll
    for (int b = 0; b < 8; ++b) q[b] = f32_to_bf16(e4m3_to_f32(dev::qa8_code(v[b], s)) * s);
    if (ok)
      *reinterpret_cast<uint4*>(xb + p * D + 8 * grp) =
          make_uint4(q[0] | (q[4] << 16), q[1] | (q[5] << 16), q[2] | (q[6] << 16), q[3] | (q[7] << 16));
  }
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

int rows_of(const MoeLayer& m, const GroupedMoe& g) { return g.T * g.topk + (m.shared_w1.data ? g.T : 0); }

void launch_gemm(bool up, const GemmParams& p, int grid_x, int max_tiles, cudaStream_t stream) {
  if (max_tiles <= 0) return;
  const dim3 grid(static_cast<unsigned>(grid_x), static_cast<unsigned>(max_tiles));
  if (up) {
    DSX_CHECK(static_cast<size_t>(kSmem) <= detail::max_dynamic_smem(grouped_gemm_kernel<true>),
              "grouped_up: not enough shared memory");
    grouped_gemm_kernel<true><<<grid, kThreads, kSmem, stream>>>(p);
  } else {
    DSX_CHECK(static_cast<size_t>(kSmem) <= detail::max_dynamic_smem(grouped_gemm_kernel<false>),
              "grouped_down: not enough shared memory");
    grouped_gemm_kernel<false><<<grid, kThreads, kSmem, stream>>>(p);
  }
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

bool grouped_supported(const MoeLayer& m) {
  if (m.hidden <= 0 || m.hidden % 32 != 0 || m.inter <= 0 || m.inter % 32 != 0) return false;
  if (m.hidden > (1 << 20) || m.inter > (1 << 20)) return false;
  if (m.qblock != 32 && m.qblock != 64 && m.qblock != 128) return false;
  if (m.inter % m.qblock != 0 || m.hidden % m.qblock != 0) return false;
  if (m.shared_w1.data) {
    for (const QMatrix* q : {&m.shared_w1, &m.shared_w3, &m.shared_w2}) {
      if (q->fmt != WFormat::FP8_BLOCK || !q->scale) return false;
      if (q->block != 32 && q->block != 64 && q->block != 128) return false;
      if (kMT * ((q->cols + q->block - 1) / q->block) > kFp8Tab) return false;
    }
    if (m.shared_w1.block != m.shared_w3.block) return false;  // (one scale table layout for the pair)
  }
  return true;
}

int grouped_max_tiles(const MoeLayer& m, int T, int topk) {
  const int64_t rows = static_cast<int64_t>(T) * topk + (m.shared_w1.data ? T : 0);
  return static_cast<int>(rows / kBT + m.n_experts + (m.shared_w1.data ? 1 : 0));
}

void grouped_plan(const MoeLayer& m, const GroupedMoe& g, cudaStream_t stream) {
  plan_kernel<<<1, 1024, 0, stream>>>(g.counts, g.offs, m.n_experts, g.T * g.topk, m.shared_w1.data ? g.T : 0,
                                      g.tiles, g.n_tiles);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void grouped_gather_qa8(const MoeLayer& m, const GroupedMoe& g, DType xt, const void* x, int64_t ldx, uint16_t* xb,
                        cudaStream_t stream) {
  const int rows = rows_of(m, g);
  if (rows <= 0) return;
  const int D = static_cast<int>(m.hidden);
  const size_t es = dtype_size(xt);
  const int vec = detail::aligned16(x) && (static_cast<size_t>(ldx) * es) % 16 == 0 ? 1 : 0;
  const int64_t threads = static_cast<int64_t>(rows) * (D / 8);
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>((threads + 255) / 256, sm_count() * 16));
  gather_qa8_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(x, static_cast<int>(xt), ldx, vec, D, m.qblock,
                                                                      g.perm, g.T * g.topk, g.topk, rows, xb);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void grouped_up(const MoeLayer& m, const GroupedMoe& g, const uint16_t* xb, bool bf16, uint16_t* hq, float* gu,
                cudaStream_t stream) {
  GemmParams p{};
  p.E = m.n_experts;
  p.K = static_cast<int>(m.hidden);
  p.N = static_cast<int>(m.inter);
  p.tiled = m.tiled ? 1 : 0;
  p.wa = m.w1;
  p.was = m.w1_scale;
  p.wb = m.w3;
  p.wbs = m.w3_scale;
  if (m.shared_w1.data) {
    p.sa = fp8_view(m.shared_w1);
    p.sb = fp8_view(m.shared_w3);
  }
  p.tiles = g.tiles;
  p.n_tiles = g.n_tiles;
  p.x = xb;
  p.wts = g.weights;
  p.perm = g.perm;
  p.lim = m.swiglu_limit;
  p.qblock = m.qblock;
  p.bf16 = bf16 ? 1 : 0;
  p.hq = hq;
  p.gu = gu;
  launch_gemm(true, p, static_cast<int>((m.inter + kUpF - 1) / kUpF), grouped_max_tiles(m, g.T, g.topk), stream);
}

void grouped_down(const MoeLayer& m, const GroupedMoe& g, const uint16_t* hq, float* yp, cudaStream_t stream) {
  GemmParams p{};
  p.E = m.n_experts;
  p.K = static_cast<int>(m.inter);
  p.N = static_cast<int>(m.hidden);
  p.tiled = m.tiled ? 1 : 0;
  p.wa = m.w2;
  p.was = m.w2_scale;
  p.wb = m.w2;
  p.wbs = m.w2_scale;
  if (m.shared_w1.data) p.sa = p.sb = fp8_view(m.shared_w2);
  p.tiles = g.tiles;
  p.n_tiles = g.n_tiles;
  p.x = hq;
  p.yp = yp;
  launch_gemm(false, p, static_cast<int>((m.hidden + kDnF - 1) / kDnF), grouped_max_tiles(m, g.T, g.topk), stream);
}

}  // namespace dsx::cuda
