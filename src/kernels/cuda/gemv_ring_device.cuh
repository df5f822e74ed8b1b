// Lean per-span code of the shared-ring tensor-core kernels (gemv.cu, moe.cu, moe_rows.cu): the same
// arithmetic as mma_slot_consume (gemv_device.cuh: f16 operands, one mma chain per
// 32-element scale block per output column, f32 accumulation), one token pass (P = 1:
// FP8 T <= 4, MXFP4 T <= 2), with every per-row and per-lane address computed once per
// piece (16 rows x a span range) instead of once per span. The generic code recomputed
// the clamped rows, scale rows and B addresses for every 1 KB span, about 200
// instructions per span (SASS of the first ring kernel); here a span costs its loads,
// conversions, mma and a few predicates.
#pragma once
#include <type_traits>

#include "kernels/cuda/gemv_device.cuh"

namespace dsx::cuda::dev {

// A warp's ring: U + 1 slots of kRingSlot bytes, addressed by byte offsets from the
// lane's address in slot 0 (no slot-index arithmetic per span); the offset after o.
constexpr uint32_t kRingSlot = 1024;
template <int U>
__device__ __forceinline__ uint32_t next_ring_slot(uint32_t o) {
  return o + kRingSlot == (U + 1) * kRingSlot ? 0u : o + kRingSlot;
}

// Copy cursor of a lane over one piece: rows g and g+8 (clamped to row_last), spans
// [s_lo, s_hi) of 64 bytes per row, this lane's 16 bytes at 16 c.
struct RingLoad {
  const uint8_t* pa = nullptr;  // row g at the next span
  int64_t d8 = 0;               // row g+8 minus row g, bytes (the same at every span)
  int off = 0, rb = 0;          // this lane's offset in the row at the next span; row bytes
  int left = 0;                 // spans left in the piece
  int step = 64;                // address step per span (WView::span_step)

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, int s_lo, int s_hi, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
    const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
    off = s_lo * 64 + 16 * c;
    rb = static_cast<int>(W.row_bytes);
    pa = W.row_at(rg) + W.byte_off(off);
    d8 = W.row_at(rg8) - W.row_at(rg);
    step = W.span_step();
    left = s_hi > s_lo ? s_hi - s_lo : 0;
  }
  // Copies the next span into the slot at this lane's shared address dst (rows g at + 0,
  // g + 8 at + 512; zeros past the row end or the piece) and commits.
  __device__ __forceinline__ void issue_at(uint32_t dst) {
    const bool ok = left > 0 && off + 16 <= rb;
    cp_async16_zfill(dst, pa, ok);
    cp_async16_zfill(dst + 512, pa + d8, ok);
    cp_async_commit();
    pa += step;
    off += 64;
    left -= left > 0 ? 1 : 0;
  }
};

// Where a lane reads its B fragment words and activation scales, fixed for the piece:
// the per-span choice is one compare and one pointer step (the generic version tested
// the pointers for null and recomputed 64-bit offsets, ~50 instructions per span in the
// SASS). Plain loads through pointers derived from the kernel's shared arrays (the
// compiler emits LDS and may schedule them ahead of the ring wait).
struct BAddr {
  const uint4* b = nullptr;  // B words of block 0 (B-role lanes), else the zero words
  const uint4* z = nullptr;  // the zero words (blocks past the end of K)
  int step = 0;              // uint4 per scale block of B (4 for B-role lanes, 0 otherwise)
  int lim = 0;               // B words valid while kb0 < lim
  const float* sa = nullptr;  // activation scale of block 0 of this lane's C token
  int sa_step = 0;            // 1, or 0 for lanes without a C token (sa: the zero words)

  __device__ __forceinline__ void set(const uint32_t* bB, int lim_, const float* saP, const uint4* bzero) {
    z = bzero;
    b = bB ? reinterpret_cast<const uint4*>(bB) : bzero;
    step = bB ? 4 : 0;
    lim = bB ? lim_ : 0x7fffffff;  // a lane without a B role reads the zeros everywhere
    sa = saP ? saP : reinterpret_cast<const float*>(bzero);
    sa_step = saP ? 1 : 0;
  }
  __device__ __forceinline__ const uint4* words(int kb0) const { return kb0 < lim ? b + kb0 * step : z; }
  __device__ __forceinline__ float scale(int kb, bool valid) const { return valid ? sa[kb * sa_step] : 0.f; }
  // Full spans (every block of the span inside K): no bound tests, lanes without a role
  // read the zero words through a zero step.
  __device__ __forceinline__ const uint4* words_full(int kb0) const { return b + kb0 * step; }
  __device__ __forceinline__ float scale_full(int kb) const { return sa[kb * sa_step]; }
  // the scales of blocks kb, kb + 1 in one 8-byte load (kb even; the staged scales and a
  // token's row of them start 8-byte aligned when NB is even)
  __device__ __forceinline__ float2 scales2_full(int kb) const {
    return *reinterpret_cast<const float2*>(sa + kb * sa_step);
  }
};

// The e8m0 scales of two consecutive blocks, read as one aligned 16-bit word (the low
// byte first), as e8m0_f32_nb: one load instead of two, and no per-byte address.
__device__ __forceinline__ void e8m0_pair_f32(const uint8_t* p, float& lo, float& hi) {
  const uint32_t w = __ldg(reinterpret_cast<const unsigned short*>(p));
  lo = e8m0_f32_nb(w & 0xffu);
  hi = e8m0_f32_nb(w >> 8);
}

// FP8_BLOCK consumer of a lane (hardware e4m3 -> f16; B staged by stage_b_mma<FP8, true>).
// Full: K is a multiple of 64 (every span holds 2 whole scale blocks): no bound tests.
template <bool Full = false>
struct Fp8Cons {
  const uint8_t* srow;  // e8m0 tile row of the piece
  BAddr ba;
  int wshift, NB;

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const uint32_t* bs,
                                      const float* sas, int tstride, int nt, int NBk, const uint4* bzero, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t r0c = row0 < row_last ? row0 : row_last;
    srow = W.s + (r0c >> W.wshift) * W.sc_cols;
    wshift = W.wshift;
    NB = NBk;
    const int tb = g >> 1;  // B role: column g = 2 tb + blk, blk = g & 1 == c >> 1
    const uint32_t* bB = (((g & 1) == (c >> 1)) && tb < nt)
                             ? bs + (static_cast<int64_t>(tb) * tstride + (c >> 1)) * 16 + (c & 1) * 8
                             : nullptr;
    const float* saP = c < nt ? sas + static_cast<int64_t>(c) * tstride : nullptr;  // C role: token c
    ba.set(bB, NBk - (c >> 1), saP, bzero);
  }
  // span s from this lane's shared address in its slot (rows g at + 0, g + 8 at + 512)
  __device__ __forceinline__ void span_at(uint32_t at, int s, float (&acc)[2], int) const {
    const uint4 a = lds128_at(at), a8 = lds128_at(at + 512);
    const int kb0 = 2 * s;
    const bool v0 = Full || kb0 < NB, v1 = Full || kb0 + 1 < NB;
    float w0, w1;  // weight scales of blocks kb0, kb0 + 1
    if constexpr (Full) {  // (32 x 32 scale tiles: the span's two scales are adjacent)
      e8m0_pair_f32(srow + kb0, w0, w1);
    } else {
      w0 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(srow + ((kb0 * 32) >> wshift))) : 0u);
      w1 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(srow + (((kb0 + 1) * 32) >> wshift))) : 0u);
    }
    const uint4* bw = Full ? ba.words_full(kb0) : ba.words(kb0);
    const uint4 b01 = bw[0], b23 = bw[1];
    uint32_t Pg[4], Qg[4], P8[4], Q8[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      fp8_to_f16x2<true>(word_of(a, i), Pg[i], Qg[i]);
      fp8_to_f16x2<true>(word_of(a8, i), P8[i], Q8[i]);
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
    mma_f16_16816(d, Pg[0], P8[0], Qg[0], Q8[0], b01.x, b01.y);
    mma_f16_16816(d, Pg[1], P8[1], Qg[1], Q8[1], b01.z, b01.w);
    mma_f16_16816(d, Pg[2], P8[2], Qg[2], Q8[2], b23.x, b23.y);
    mma_f16_16816(d, Pg[3], P8[3], Qg[3], Q8[3], b23.z, b23.w);
    float f0, f1;
    if constexpr (Full) {
      const float2 sa = ba.scales2_full(kb0);
      f0 = w0 * sa.x, f1 = w1 * sa.y;
    } else {
      f0 = w0 * ba.scale(kb0, v0), f1 = w1 * ba.scale(kb0 + 1, v1);
    }
    acc[0] = fmaf(d[0], f0, acc[0]);
    acc[0] = fmaf(d[1], f1, acc[0]);
    acc[1] = fmaf(d[2], f0, acc[1]);
    acc[1] = fmaf(d[3], f1, acc[1]);
  }
};

// MXFP4 consumer of a lane (B staged by stage_b_mma<MXFP4, false>, scales x 2^14).
// Full: K is a multiple of 128 (every span holds 4 whole scale blocks), so the span code
// has no bound tests (the MoE shapes; the integer pipe is what limits those kernels).
template <bool Full = false>
struct Fp4Cons {
  const uint8_t* s0;  // e8m0 scales of row g at this lane's first block (2 (c & 1))
  const uint8_t* s8;  // row g+8
  BAddr ba;
  int NB;

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const uint32_t* bs,
                                      const float* sas, int tstride, int nt, int NBk, const uint4* bzero, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
    const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
    s0 = W.s + rg * W.sc_cols + 2 * (c & 1);
    s8 = W.s + rg8 * W.sc_cols + 2 * (c & 1);
    NB = NBk;
    const int tb = g >> 2;  // B role: column g = 4 tb + blk, blk = g & 3 == c
    const uint32_t* bB = (((g & 3) == c) && tb < nt) ? bs + (static_cast<int64_t>(tb) * tstride + c) * 16 : nullptr;
    const int t = c >> 1;  // C role
    const float* saP = t < nt ? sas + static_cast<int64_t>(t) * tstride + 2 * (c & 1) : nullptr;
    ba.set(bB, NBk - c, saP, bzero);
  }
  // span s from this lane's shared address in its slot (rows g at + 0, g + 8 at + 512)
  __device__ __forceinline__ void span_at(uint32_t at, int s, float (&acc)[2], int lane) const {
    const uint4 a = lds128_at(at), a8 = lds128_at(at + 512);
    const int kb0 = 4 * s;
    const int b0 = kb0 + 2 * (lane & 1);
    const bool v0 = Full || b0 < NB, v1 = Full || b0 + 1 < NB;
    const uint8_t* p0 = s0 + static_cast<uint32_t>(kb0);  // one address per row, offsets 0 / 1
    const uint8_t* p8 = s8 + static_cast<uint32_t>(kb0);
    float wg0, wg1, w80, w81;  // weight scales of rows g, g + 8, blocks b0, b0 + 1
    if constexpr (Full) {  // (one aligned 16-bit word per row)
      e8m0_pair_f32(p0, wg0, wg1);
      e8m0_pair_f32(p8, w80, w81);
    } else {
      wg0 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(p0)) : 0u);
      wg1 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(p0 + 1)) : 0u);
      w80 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(p8)) : 0u);
      w81 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(p8 + 1)) : 0u);
    }
    const uint4* bw = Full ? ba.words_full(kb0) : ba.words(kb0);
    uint4 bq[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) bq[j] = bw[j];
    uint32_t R[4][4], R8[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      fp4_to_f16x2(word_of(a, j), R[j][0], R[j][1], R[j][2], R[j][3]);
      fp4_to_f16x2(word_of(a8, j), R8[j][0], R8[j][1], R8[j][2], R8[j][3]);
    }
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      mma_f16_16816(d, R[j][0], R8[j][0], R[j][2], R8[j][2], bq[j].x, bq[j].y);
      mma_f16_16816(d, R[j][1], R8[j][1], R[j][3], R8[j][3], bq[j].z, bq[j].w);
    }
    float sa0, sa1;
    if constexpr (Full) {
      const float2 sa = ba.scales2_full(kb0);
      sa0 = sa.x, sa1 = sa.y;
    } else {
      sa0 = ba.scale(kb0, v0), sa1 = ba.scale(kb0 + 1, v1);
    }
    acc[0] = fmaf(d[0], wg0 * sa0, acc[0]);
    acc[0] = fmaf(d[1], wg1 * sa1, acc[0]);
    acc[1] = fmaf(d[2], w80 * sa0, acc[1]);
    acc[1] = fmaf(d[3], w81 * sa1, acc[1]);
  }
};

// Consumers of several token passes (gemv.cu: 5..8 rows of the shared-ring kernel;
// moe_rows.cu): the arithmetic of Fp8Cons / Fp4Cons above per pass: pass pp holds rows
// 4 pp .. 4 pp + 3 (FP8) or 2 pp, 2 pp + 1 (MXFP4) of the B staged with row stride
// tstride; the weights are converted once per span for all passes. A row's value is the
// same chain of operations as in the one-pass consumer (an mma output element depends
// only on its own B column), so a row gives the same bits in either.
template <bool Full, int P>
struct Fp8ConsRows {
  const uint8_t* srow;
  BAddr ba[P];
  int wshift, NB;

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const uint32_t* bs,
                                      const float* sas, int tstride, int nt, int NBk, const uint4* bzero, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t r0c = row0 < row_last ? row0 : row_last;
    srow = W.s + (r0c >> W.wshift) * W.sc_cols;
    wshift = W.wshift;
    NB = NBk;
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const int tb = 4 * pp + (g >> 1);
      const uint32_t* bB = (((g & 1) == (c >> 1)) && tb < nt)
                               ? bs + (static_cast<int64_t>(tb) * tstride + (c >> 1)) * 16 + (c & 1) * 8
                               : nullptr;
      const int tc = 4 * pp + c;
      const float* saP = tc < nt ? sas + static_cast<int64_t>(tc) * tstride : nullptr;
      ba[pp].set(bB, NBk - (c >> 1), saP, bzero);
    }
  }
  __device__ __forceinline__ void span_at(uint32_t at, int s, float (&acc)[P][2], int) const {
    const uint4 a = lds128_at(at), a8 = lds128_at(at + 512);
    const int kb0 = 2 * s;
    const bool v0 = Full || kb0 < NB, v1 = Full || kb0 + 1 < NB;
    float w0, w1;
    if constexpr (Full) {
      e8m0_pair_f32(srow + kb0, w0, w1);
    } else {
      w0 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(srow + ((kb0 * 32) >> wshift))) : 0u);
      w1 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(srow + (((kb0 + 1) * 32) >> wshift))) : 0u);
    }
    uint32_t Pg[4], Qg[4], P8[4], Q8[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      fp8_to_f16x2<true>(word_of(a, i), Pg[i], Qg[i]);
      fp8_to_f16x2<true>(word_of(a8, i), P8[i], Q8[i]);
    }
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const uint4* bw = Full ? ba[pp].words_full(kb0) : ba[pp].words(kb0);
      const uint4 b01 = bw[0], b23 = bw[1];
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_f16_16816(d, Pg[0], P8[0], Qg[0], Q8[0], b01.x, b01.y);
      mma_f16_16816(d, Pg[1], P8[1], Qg[1], Q8[1], b01.z, b01.w);
      mma_f16_16816(d, Pg[2], P8[2], Qg[2], Q8[2], b23.x, b23.y);
      mma_f16_16816(d, Pg[3], P8[3], Qg[3], Q8[3], b23.z, b23.w);
      float f0, f1;
      if constexpr (Full) {
        const float2 sa = ba[pp].scales2_full(kb0);
        f0 = w0 * sa.x, f1 = w1 * sa.y;
      } else {
        f0 = w0 * ba[pp].scale(kb0, v0), f1 = w1 * ba[pp].scale(kb0 + 1, v1);
      }
      acc[pp][0] = fmaf(d[0], f0, acc[pp][0]);
      acc[pp][0] = fmaf(d[1], f1, acc[pp][0]);
      acc[pp][1] = fmaf(d[2], f0, acc[pp][1]);
      acc[pp][1] = fmaf(d[3], f1, acc[pp][1]);
    }
  }
};

template <bool Full, int P>
struct Fp4ConsRows {
  const uint8_t* s0;
  const uint8_t* s8;
  BAddr ba[P];
  int NB;

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const uint32_t* bs,
                                      const float* sas, int tstride, int nt, int NBk, const uint4* bzero, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
    const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
    s0 = W.s + rg * W.sc_cols + 2 * (c & 1);
    s8 = W.s + rg8 * W.sc_cols + 2 * (c & 1);
    NB = NBk;
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const int tb = 2 * pp + (g >> 2);
      const uint32_t* bB =
          (((g & 3) == c) && tb < nt) ? bs + (static_cast<int64_t>(tb) * tstride + c) * 16 : nullptr;
      const int t = 2 * pp + (c >> 1);
      const float* saP = t < nt ? sas + static_cast<int64_t>(t) * tstride + 2 * (c & 1) : nullptr;
      ba[pp].set(bB, NBk - c, saP, bzero);
    }
  }
  __device__ __forceinline__ void span_at(uint32_t at, int s, float (&acc)[P][2], int lane) const {
    const uint4 a = lds128_at(at), a8 = lds128_at(at + 512);
    const int kb0 = 4 * s;
    const int b0 = kb0 + 2 * (lane & 1);
    const bool v0 = Full || b0 < NB, v1 = Full || b0 + 1 < NB;
    const uint8_t* p0 = s0 + static_cast<uint32_t>(kb0);
    const uint8_t* p8 = s8 + static_cast<uint32_t>(kb0);
    float wg0, wg1, w80, w81;
    if constexpr (Full) {
      e8m0_pair_f32(p0, wg0, wg1);
      e8m0_pair_f32(p8, w80, w81);
    } else {
      wg0 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(p0)) : 0u);
      wg1 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(p0 + 1)) : 0u);
      w80 = e8m0_f32_nb(v0 ? static_cast<uint32_t>(__ldg(p8)) : 0u);
      w81 = e8m0_f32_nb(v1 ? static_cast<uint32_t>(__ldg(p8 + 1)) : 0u);
    }
    uint32_t R[4][4], R8[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      fp4_to_f16x2(word_of(a, j), R[j][0], R[j][1], R[j][2], R[j][3]);
      fp4_to_f16x2(word_of(a8, j), R8[j][0], R8[j][1], R8[j][2], R8[j][3]);
    }
#pragma unroll
    for (int pp = 0; pp < P; ++pp) {
      const uint4* bw = Full ? ba[pp].words_full(kb0) : ba[pp].words(kb0);
      uint4 bq[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) bq[j] = bw[j];
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma_f16_16816(d, R[j][0], R8[j][0], R[j][2], R8[j][2], bq[j].x, bq[j].y);
        mma_f16_16816(d, R[j][1], R8[j][1], R[j][3], R8[j][3], bq[j].z, bq[j].w);
      }
      float sa0, sa1;
      if constexpr (Full) {
        const float2 sa = ba[pp].scales2_full(kb0);
        sa0 = sa.x, sa1 = sa.y;
      } else {
        sa0 = ba[pp].scale(kb0, v0), sa1 = ba[pp].scale(kb0 + 1, v1);
      }
      acc[pp][0] = fmaf(d[0], wg0 * sa0, acc[pp][0]);
      acc[pp][0] = fmaf(d[1], wg1 * sa1, acc[pp][0]);
      acc[pp][1] = fmaf(d[2], w80 * sa0, acc[pp][1]);
      acc[pp][1] = fmaf(d[3], w81 * sa1, acc[pp][1]);
    }
  }
};

template <WFormat F, bool Full, int P>
using RowsCons = std::conditional_t<F == WFormat::FP8_BLOCK, Fp8ConsRows<Full, P>, Fp4ConsRows<Full, P>>;

// The consumer of format F; Full: without bound tests (K % 64 == 0 for FP8, % 128 for MXFP4).
template <WFormat F, bool Full>
using RingCons = std::conditional_t<F == WFormat::FP8_BLOCK, Fp8Cons<Full>, Fp4Cons<Full>>;

// f(cons) with the consumer of format F for K = 32 NB and weights W: the one without
// bound tests when K holds whole spans (64 elements for FP8, 128 for MXFP4) and, for FP8,
// the scale tiles are 32 x 32 (the V4.1 layout).
template <WFormat F, typename Fn>
__device__ __forceinline__ void with_ring_cons(int NB, const WView& W, Fn&& f) {
  if (NB % (F == WFormat::FP8_BLOCK ? 2 : 4) == 0 && (F != WFormat::FP8_BLOCK || W.wshift == 5)) {
    RingCons<F, true> cons;
    f(cons);
  } else {
    RingCons<F, false> cons;
    f(cons);
  }
}

// The same for the several-pass consumers (RowsCons<F, Full, P>).
template <WFormat F, int P, typename Fn>
__device__ __forceinline__ void with_rows_cons(int NB, const WView& W, Fn&& f) {
  if (NB % (F == WFormat::FP8_BLOCK ? 2 : 4) == 0 && (F != WFormat::FP8_BLOCK || W.wshift == 5)) {
    RowsCons<F, true, P> cons;
    f(cons);
  } else {
    RowsCons<F, false, P> cons;
    f(cons);
  }
}

}  // namespace dsx::cuda::dev
