// Device building blocks of the weight-streaming GEMV kernels (gemv.cu, moe.cu,
// router.cu): activation staging into shared memory (optionally with QA8) and the
// per-warp dot product of RPW weight rows with TT staged activation rows.
//
// Scheme: a weight row is cut into 16-byte chunks (FP8: 16 elements, BF16: 8, F32: 4,
// MXFP4: 32 elements = one scale strip). Lane l of a warp handles chunks l, l+32, ...
// of its chunk range for RPW consecutive rows, with U chunks per row loaded before
// any is used (U*RPW independent 16-byte loads in flight per lane). Activations are
// staged in shared memory as f32 (fake-quantized values when QA8 applies, times 2^34
// for FP8/MXFP4 weights, see quant_act_device.cuh), swizzled so that the 16-byte
// reads of a quarter-warp hit distinct banks. Products and sums are f32 FMAs.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cp_async_device.cuh"
#include "kernels/cuda/pdl_device.cuh"
#include "kernels/cuda/quant_act_device.cuh"
#include "model/qmatrix.h"

namespace dsx::cuda::dev {

template <WFormat F>
struct Fmt;
template <>
struct Fmt<WFormat::FP8_BLOCK> {
  static constexpr int EPC = 16;  // elements per 16-byte chunk
  static constexpr bool kTrick = true;
};
template <>
struct Fmt<WFormat::MXFP4> {
  static constexpr int EPC = 32;
  static constexpr bool kTrick = true;
};
template <>
struct Fmt<WFormat::BF16> {
  static constexpr int EPC = 8;
  static constexpr bool kTrick = false;
};
template <>
struct Fmt<WFormat::F32> {
  static constexpr int EPC = 4;
  static constexpr bool kTrick = false;
};

// A weight matrix as the kernels see it (device pointers).
struct WView {
  const uint8_t* w = nullptr;  // rows of row_bytes bytes, row-major or tiled
  const uint8_t* s = nullptr;  // FP8: [ceil(N/B), sc_cols]; MXFP4: [N, sc_cols]
  int64_t row_bytes = 0;
  int sc_cols = 0;
  int wshift = 5;  // FP8: log2 of the tile size B
  int tiled = 0;   // 1: the data in the 16-row tile layout (qmatrix.h, QMatrix::tiled)

  // Address of byte 0 of row n; byte b of the row is at row_at(n) + byte_off(b).
  __device__ __forceinline__ const uint8_t* row_at(int64_t n) const {
    return tiled ? w + (n >> 4) * (row_bytes << 4) + ((n & 15) << 6) : w + n * row_bytes;
  }
  __device__ __forceinline__ int64_t byte_off(int64_t b) const { return tiled ? ((b >> 6) << 10) + (b & 63) : b; }
  // The address step from one 64-byte span of a row to the next.
  __device__ __forceinline__ int span_step() const { return tiled ? 1024 : 64; }
};

// Stage activation rows x[t, xoff .. xoff+Ks) (t < nt; rows nt..TT-1 are zeroed) into
// xs (TT rows of Ks floats, Ks % 32 == 0), swizzled, optionally QA8'd with blocks of
// qblock (the slice must start on a block boundary), times `prescale`.
// Must be called by all threads of the block (blockDim.x threads).
__device__ __forceinline__ void stage_rows(float* xs, int TT, int Ks, const void* x, int xt, int64_t ldx,
                                           int64_t xoff, int nt, int qa8, int qblock, float prescale) {
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int lane = tid & 31, warp = tid >> 5, nwarps = nthr >> 5;
  for (int t = 0; t < TT; ++t) {
    float* row = xs + static_cast<int64_t>(t) * Ks;
    if (t >= nt) {
      for (int k = tid; k < Ks; k += nthr) row[k] = 0.0f;  // zero is swizzle-invariant
      continue;
    }
    const int64_t base = static_cast<int64_t>(t) * ldx + xoff;
    if (!qa8) {
      for (int k = tid; k < Ks; k += nthr) row[swz(k >> 2) * 4 + (k & 3)] = load_act(x, xt, base + k) * prescale;
      continue;
    }
    const int nb = Ks / qblock;
    if (qblock == 32) {
      for (int b = warp; b < nb; b += nwarps) {
        const int k = b * 32 + lane;
        float v[1] = {load_act(x, xt, base + k)};
        uint8_t c[1];
        const float s = qa8_warp_block<1>(v, c);
        row[swz(k >> 2) * 4 + (k & 3)] = e4m3_to_f32(c[0]) * s * prescale;
      }
    } else if (qblock == 64) {
      for (int b = warp; b < nb; b += nwarps) {
        float v[2];
        uint8_t c[2];
#pragma unroll
        for (int j = 0; j < 2; ++j) v[j] = load_act(x, xt, base + b * 64 + lane + 32 * j);
        const float s = qa8_warp_block<2>(v, c);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int k = b * 64 + lane + 32 * j;
          row[swz(k >> 2) * 4 + (k & 3)] = e4m3_to_f32(c[j]) * s * prescale;
        }
      }
    } else {  // 128
      for (int b = warp; b < nb; b += nwarps) {
        float v[4];
        uint8_t c[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = load_act(x, xt, base + b * 128 + lane + 32 * j);
        const float s = qa8_warp_block<4>(v, c);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int k = b * 128 + lane + 32 * j;
          row[swz(k >> 2) * 4 + (k & 3)] = e4m3_to_f32(c[j]) * s * prescale;
        }
      }
    }
  }
}

// Copy already-final f32 values src[t, 0..Ks) (row stride lds) into the swizzled
// layout (times prescale). All threads of the block.
__device__ __forceinline__ void stage_copy(float* xs, int rows, int Ks, const float* src, int64_t lds,
                                           float prescale) {
  const int tid = threadIdx.x, nthr = blockDim.x;
  const int q4 = Ks >> 2;
  for (int i = tid; i < rows * q4; i += nthr) {
    const int t = i / q4, qi = i - t * q4;
    const float* s = src + static_cast<int64_t>(t) * lds + qi * 4;
    float4 v = make_float4(s[0] * prescale, s[1] * prescale, s[2] * prescale, s[3] * prescale);
    reinterpret_cast<float4*>(xs + static_cast<int64_t>(t) * Ks)[swz(qi)] = v;
  }
}

// acc[r][t] += sum over chunks c in [c_lo, c_hi) of W[row0 + r, chunk c] . xs[t, chunk c]
// Rows beyond row_last are read as row_last (callers discard them). xs4 points to the
// staged slice whose first chunk is c_base; xq = float4s per staged row.
template <WFormat F, int RPW, int TT, int U>
__device__ __forceinline__ void warp_dot(const WView& W, int64_t row0, int64_t row_last, int c_lo, int c_hi,
                                         int c_base, const float4* __restrict__ xs4, int xq,
                                         float (&acc)[RPW][TT], int lane) {
  constexpr int EPC = Fmt<F>::EPC;
  constexpr int Q = EPC / 4;  // float4 of x per chunk
  const uint8_t* rows[RPW];
#pragma unroll
  for (int r = 0; r < RPW; ++r) {
    const int64_t n = row0 + r < row_last ? row0 + r : row_last;
    rows[r] = W.row_at(n);
  }
  // FP8: all RPW rows share one 32x32 (or BxB) tile row (RPW divides B, row0 % RPW == 0).
  const uint8_t* srow_fp8 = nullptr;
  if constexpr (F == WFormat::FP8_BLOCK) srow_fp8 = W.s + (row0 >> W.wshift) * W.sc_cols;

  for (int c0 = c_lo + lane; c0 < c_hi; c0 += 32 * U) {
    uint4 raw[U][RPW];
    uint32_t sb[U][RPW];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      const bool ok = c < c_hi;
#pragma unroll
      for (int r = 0; r < RPW; ++r) {
        raw[u][r] = ok ? ldg_stream(rows[r] + W.byte_off(static_cast<int64_t>(c) * 16)) : make_uint4(0, 0, 0, 0);
        sb[u][r] = 0;
      }
      if constexpr (F == WFormat::FP8_BLOCK) {
        if (ok) sb[u][0] = __ldg(srow_fp8 + ((c * 16) >> W.wshift));
      } else if constexpr (F == WFormat::MXFP4) {
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const int64_t n = row0 + r < row_last ? row0 + r : row_last;
          if (ok) sb[u][r] = __ldg(W.s + n * W.sc_cols + c);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + 32 * u;
      if (c >= c_hi) continue;
      const int cl = c - c_base;
      if constexpr (F == WFormat::FP8_BLOCK || F == WFormat::MXFP4) {
        float p[RPW][TT];
#pragma unroll
        for (int r = 0; r < RPW; ++r)
#pragma unroll
          for (int t = 0; t < TT; ++t) p[r][t] = 0.0f;
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          // quad q of the chunk: 4 consecutive elements
          float wf[RPW][4];
#pragma unroll
          for (int r = 0; r < RPW; ++r) {
            if constexpr (F == WFormat::FP8_BLOCK) {
              const uint32_t v = word(raw[u][r], q);
              wf[r][0] = fp8_trick<0>(v);
              wf[r][1] = fp8_trick<1>(v);
              wf[r][2] = fp8_trick<2>(v);
              wf[r][3] = fp8_trick<3>(v);
            } else {
              const uint32_t v = word(raw[u][r], q >> 1);
              if (q & 1) {
                wf[r][0] = fp4_trick<4>(v);
                wf[r][1] = fp4_trick<5>(v);
                wf[r][2] = fp4_trick<6>(v);
                wf[r][3] = fp4_trick<7>(v);
              } else {
                wf[r][0] = fp4_trick<0>(v);
                wf[r][1] = fp4_trick<1>(v);
                wf[r][2] = fp4_trick<2>(v);
                wf[r][3] = fp4_trick<3>(v);
              }
            }
          }
          const int qi = swz(cl * Q + q);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            const float4 xv = xs4[t * xq + qi];
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
              float a = p[r][t];
              a = fmaf(wf[r][0], xv.x, a);
              a = fmaf(wf[r][1], xv.y, a);
              a = fmaf(wf[r][2], xv.z, a);
              a = fmaf(wf[r][3], xv.w, a);
              p[r][t] = a;
            }
          }
        }
#pragma unroll
        for (int r = 0; r < RPW; ++r) {
          const float f = F == WFormat::FP8_BLOCK ? fp8_factor(sb[u][0]) : fp4_factor(sb[u][r]);
#pragma unroll
          for (int t = 0; t < TT; ++t) acc[r][t] = fmaf(p[r][t], f, acc[r][t]);
        }
      } else {
#pragma unroll
        for (int q = 0; q < Q; ++q) {
          float wf[RPW][4];
#pragma unroll
          for (int r = 0; r < RPW; ++r) {
            if constexpr (F == WFormat::BF16) {
              const uint32_t v0 = word(raw[u][r], 2 * q), v1 = word(raw[u][r], 2 * q + 1);
              wf[r][0] = __uint_as_float(v0 << 16);
              wf[r][1] = __uint_as_float(v0 & 0xffff0000u);
              wf[r][2] = __uint_as_float(v1 << 16);
              wf[r][3] = __uint_as_float(v1 & 0xffff0000u);
            } else {
              wf[r][0] = __uint_as_float(raw[u][r].x);
              wf[r][1] = __uint_as_float(raw[u][r].y);
              wf[r][2] = __uint_as_float(raw[u][r].z);
              wf[r][3] = __uint_as_float(raw[u][r].w);
            }
          }
          const int qi = swz(cl * Q + q);
#pragma unroll
          for (int t = 0; t < TT; ++t) {
            const float4 xv = xs4[t * xq + qi];
#pragma unroll
            for (int r = 0; r < RPW; ++r) {
              float a = acc[r][t];
              a = fmaf(wf[r][0], xv.x, a);
              a = fmaf(wf[r][1], xv.y, a);
              a = fmaf(wf[r][2], xv.z, a);
              a = fmaf(wf[r][3], xv.w, a);
              acc[r][t] = a;
            }
          }
        }
      }
    }
  }
}

template <int RPW, int TT>
__device__ __forceinline__ void warp_reduce(float (&acc)[RPW][TT]) {
#pragma unroll
  for (int r = 0; r < RPW; ++r)
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[r][t] = warp_sum(acc[r][t]);
}


// =====================================================================================
// Tensor-core streaming (BF16 mode, QA8'd activations; gemv.cu and moe.cu).
//
// The weights are decoded with a few integer operations to f16 (exact: FP8 e4m3 codes
// as e4m3 * 2^-8, MXFP4 e2m1 codes as e2m1 * 2^-14) and multiplied with the QA8 codes
// of the activations (f16, exact) by mma.sync m16n8k16 (f32 accumulation). Products are
// exact; each mma chain covers exactly one 32-element scale block of one row, and the
// block sums are scaled (weight scale * activation scale, powers of two) and added in
// f32 on the CUDA cores, as the CUDA-core kernels do.
//
// A warp streams a tile of 16 weight rows (mma rows g and g+8 of lane (g = lane/4,
// c = lane%4)) in "spans" of 64 bytes per row: lane c loads the 16 bytes [16c, 16c+16)
// of the span for rows g and g+8 (row-contiguous 64-byte segments per warp load).
//  FP8:   a span is 64 elements = 2 scale blocks; lanes c = 0,1 hold block 0, c = 2,3
//         block 1. The B operand (n = 8 columns) separates them: column n = 2 t + blk
//         (t = token of the pass, 4 tokens per pass), so C[row][2t + blk] is the sum over
//         one block; lane (g, c) gets token c, blocks 0 and 1 of rows g and g+8.
//  MXFP4: a span is 128 elements = 4 scale blocks (lane c: block c); column
//         n = 4 t + blk (2 tokens per pass); lane (g, c) gets token c/2, blocks 2(c&1) and
//         2(c&1)+1; lanes c and c^1 are summed at the end of the tile.
// The activations are staged once per block in shared memory as f16 code pairs in the
// order the B fragments need (stage_b_mma), with the per-block activation scales.
// Products without QA8 (wo_a) stage the activations themselves as f16 with a power-of-two
// scale per 32-element block instead of codes (exact for bf16 inputs, see noqa_block_exp).

__device__ __forceinline__ void mma_f16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__)
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Predicated loads (no branch: the result is zero when pred is false).
__device__ __forceinline__ uint4 ldg_stream_pred(const void* p, bool pred) {
  uint4 r;
#if defined(__CUDA_ARCH__)
  asm volatile(
      "{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\tmov.u32 %0, 0;\n\tmov.u32 %1, 0;\n\tmov.u32 %2, 0;\n\t"
      "mov.u32 %3, 0;\n\t@q ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
      : "l"(p), "r"(static_cast<int>(pred)));
#else
  r = pred ? *static_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
#endif
  return r;
}
__device__ __forceinline__ uint32_t ldg_u8_pred(const uint8_t* p, bool pred) {
  uint32_t r;
#if defined(__CUDA_ARCH__)
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\tmov.u32 %0, 0;\n\t@q ld.global.nc.u8 %0, [%1];\n\t}"
               : "=r"(r)
               : "l"(p), "r"(static_cast<int>(pred)));
#else
  r = pred ? *p : 0u;
#endif
  return r;
}
// 2^(u-127) without branches (u = 0: 2^-127; u = 255 is not a valid scale here): a shift
// and an unsigned max (u << 23 >= 2^23 exceeds the bits of 2^-127 for every u >= 1). In
// PTX: written in C, the compiler turned the max of a loaded byte into a compare, a mask
// and a select (4 instructions per scale in the ring consumers' SASS).
__device__ __forceinline__ float e8m0_f32_nb(uint32_t u) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("{\n\t.reg .b32 t;\n\tshl.b32 t, %1, 23;\n\tmax.u32 %0, t, 4194304;\n\t}" : "=r"(r) : "r"(u));
  return __uint_as_float(r);
#else
  return __uint_as_float(max(u << 23, 0x00400000u));
#endif
}

__device__ __forceinline__ uint32_t ldg_u8_volatile(const uint8_t* p) {
  uint32_t r;
#if defined(__CUDA_ARCH__)
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(r) : "l"(p));
#else
  r = *p;
#endif
  return r;
}

// Two f16x2 words P, Q from the 4 e4m3 bytes of v (the pairs listed in fp8_pair_of).
//  SW (bit trick, values * 2^-8): P = (byte1, byte3), Q = (byte0, byte2)
//  HW (cvt.rn.f16x2.e4m3x2, exact values): P = (byte0, byte1), Q = (byte2, byte3)
__device__ __forceinline__ uint32_t fp8x2_hi_f16(uint32_t v) {
  return (v & 0x80008000u) | ((v >> 1) & 0x3F803F80u);
}
template <bool HW>
__device__ __forceinline__ void fp8_to_f16x2(uint32_t v, uint32_t& P, uint32_t& Q) {
  if constexpr (HW) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm("{\n\t.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t"
        "cvt.rn.f16x2.e4m3x2 %1, hi;\n\t}"
        : "=r"(P), "=r"(Q)
        : "r"(v));
#else
    P = Q = 0;
#endif
  } else {
    P = fp8x2_hi_f16(v);
    Q = fp8x2_hi_f16(v << 8);
  }
}
// For element q (0..3) of a 4-byte word: which register (0 = P, 1 = Q) and half.
template <bool HW>
__device__ __forceinline__ void fp8_pair_of(int q, int& reg, int& half) {
  if constexpr (HW) {
    reg = q >> 1;
    half = q & 1;
  } else {
    reg = (q & 1) ? 0 : 1;
    half = q >> 1;
  }
}
template <bool HW>
constexpr float fp8_mma_prescale() {
  return HW ? 1.0f : 256.0f;  // undoes the weights' 2^-8
}
constexpr float kMx4MmaPrescale = 16384.0f;  // 2^14

// Four f16x2 words from the 8 e2m1 nibbles of v (values * 2^-14):
// R0 = (n0, n4), R1 = (n2, n6), R2 = (n1, n5), R3 = (n3, n7).
// An e2m1 nibble s e1 e0 m is the f16 s 000 e1 e0 m 0..0 (times 2^14): the magnitude
// bits go 9 places up, the sign 12. One bit select per nibble parity (a single lop3)
// first puts each sign 6 places above its magnitude bits (even nibbles: magnitude at
// bits 2..0 of a byte, sign at bit 6; odd nibbles: magnitude at 3..1, sign at 7), so that
// one shift and one mask place both (the bits the masks drop may hold anything): 7
// integer-pipe operations and 4 shifts per word, against 9 and 2 for the byte-permute
// version.
__device__ __forceinline__ uint32_t bit_select(uint32_t a, uint32_t b, uint32_t mask) {  // mask ? a : b
  uint32_t d;
#if defined(__CUDA_ARCH__)
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(d) : "r"(a), "r"(b), "r"(mask));
#else
  d = (a & mask) | (b & ~mask);
#endif
  return d;
}
__device__ __forceinline__ void fp4_to_f16x2(uint32_t v, uint32_t& R0, uint32_t& R1, uint32_t& R2, uint32_t& R3) {
  constexpr uint32_t kHalfMask = 0x8E008E00u;  // sign and the three magnitude bits of both halves
  const uint32_t ve = bit_select(v, v << 3, 0x07070707u);
  const uint32_t vo = bit_select(v >> 3, v, 0x0E0E0E0Eu);
  R0 = (ve << 9) & kHalfMask;
  R1 = (ve << 1) & kHalfMask;
  R2 = (vo << 8) & kHalfMask;
  R3 = vo & kHalfMask;
}

// One span of one 16-row tile as loaded by a lane: rows g and g+8, scale bytes.
// (MXFP4: the scale bytes are prefetched into L1 with the weights and read when the
// span is consumed, which keeps the slot at 8 registers.)
template <WFormat F>
struct MmaSlot {
  uint4 a, a8;
  uint32_t sc[F == WFormat::MXFP4 ? 1 : 2];
};

__device__ __forceinline__ void prefetch_l1(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
#endif
}

// Issue the loads of span s (64 bytes per row) of the tile whose first row is row0
// (rows clamped to row_last). NB: scale blocks per row (K / 32). live = false issues
// nothing (the slot reads as zeros). No branches.
template <WFormat F>
__device__ __forceinline__ void mma_slot_load(MmaSlot<F>& sl, const WView& W, int64_t row0, int64_t row_last, int s,
                                              int NB, int lane, bool live = true) {
  const int g = lane >> 2, c = lane & 3;
  const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
  const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
  const int64_t off = static_cast<int64_t>(s) * 64 + 16 * c;
  const bool ok = live && off + 16 <= W.row_bytes;
  const int64_t offc = ok ? off : 0;
  sl.a = ldg_stream_pred(W.row_at(rg) + W.byte_off(offc), ok);
  sl.a8 = ldg_stream_pred(W.row_at(rg8) + W.byte_off(offc), ok);
  if constexpr (F == WFormat::FP8_BLOCK) {
    const int kb0 = 2 * s;
    const int64_t r0c = row0 < row_last ? row0 : row_last;
    const uint8_t* srow = W.s + (r0c >> W.wshift) * W.sc_cols;
    const bool v0 = live && kb0 < NB, v1 = live && kb0 + 1 < NB;
    sl.sc[0] = ldg_u8_pred(srow + (v0 ? ((kb0 * 32) >> W.wshift) : 0), v0);
    sl.sc[1] = ldg_u8_pred(srow + (v1 ? (((kb0 + 1) * 32) >> W.wshift) : 0), v1);
  } else {
    int b0 = 4 * s + 2 * (c & 1);
    b0 = b0 < NB ? b0 : NB - 1;
    prefetch_l1(W.s + rg * W.sc_cols + b0);
    prefetch_l1(W.s + rg8 * W.sc_cols + b0);
  }
}

// The ring kernels declare their dynamic shared memory __align__(128): its base follows
// the kernel's static shared variables, and an experiment build whose static variables
// grew from 320 to 336 bytes (base no longer 64-byte aligned) ran every ring GEMV
// 10-20 % slower (eighth session); with the alignment the base stays on a 128-byte
// boundary whatever static variables a kernel gains (measured the same as before).
//
// ---- Shared-memory span ring (cp.async): the weight bytes in flight live in shared
// memory instead of registers, so a warp can keep many spans in flight without
// register pressure (the register ring above spills at depth 8). A warp owns U + 1
// slots of 1 KB; slot layout: [rows g: 32 lanes x 16 B][rows g+8: 32 lanes x 16 B]
// (each lane reads back only its own bytes: no synchronisation between lanes). U spans
// are in flight; a slot is refilled one span after it was read (so the read has been
// consumed by the mma chain before the asynchronous copy can overwrite it).
// (the cp.async and shared-address primitives: cp_async_device.cuh)

__device__ __forceinline__ uint32_t word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// acc[p][0 / 1] (rows g / g+8) += span s of the slot against the staged activations.
// bs / sas: staged codes / scales of token 0 (token t at bs + t * tstride * 16 words,
// sas + t * tstride); nt tokens; pass p covers tokens 4p.. (FP8) or 2p.. (MXFP4).
// bzero: 64 zero bytes in shared memory (read by lanes without B data). No branches,
// so that the compiler can overlap consecutive spans.
template <WFormat F, bool HW, int P>
__device__ __forceinline__ void mma_slot_consume(const MmaSlot<F>& sl, float (&acc)[P][2],
                                                 const uint32_t* __restrict__ bs, const float* __restrict__ sas,
                                                 int tstride, int nt, int s, int NB, int lane, const WView& W,
                                                 int64_t row0, int64_t row_last, const uint32_t* bzero) {
  const int g = lane >> 2, c = lane & 3;
  if constexpr (F == WFormat::FP8_BLOCK) {
    uint32_t Pg[4], Qg[4], P8[4], Q8[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      fp8_to_f16x2<HW>(word_of(sl.a, i), Pg[i], Qg[i]);
      fp8_to_f16x2<HW>(word_of(sl.a8, i), P8[i], Q8[i]);
    }
    const int kb0 = 2 * s;
    const float w0 = e8m0_f32_nb(sl.sc[0]);
    const float w1 = e8m0_f32_nb(sl.sc[1]);
    const int k0c = kb0 < NB ? kb0 : NB - 1, k1c = kb0 + 1 < NB ? kb0 + 1 : NB - 1;
#pragma unroll
    for (int p = 0; p < P; ++p) {
      // B role: column g = 2 t + blk, blk = g & 1 must match this lane's block c >> 1
      const int tb = 4 * p + (g >> 1);
      const int kbB = kb0 + (c >> 1);
      const bool bact = ((g & 1) == (c >> 1)) && tb < nt && kbB < NB;
      const uint4* src = reinterpret_cast<const uint4*>(
          bact ? bs + (static_cast<int64_t>(tb) * tstride + kbB) * 16 + (c & 1) * 8 : bzero);
      const uint4 b01 = src[0], b23 = src[1];
      float d[4] = {0.f, 0.f, 0.f, 0.f};
      mma_f16_16816(d, Pg[0], P8[0], Qg[0], Q8[0], b01.x, b01.y);
      mma_f16_16816(d, Pg[1], P8[1], Qg[1], Q8[1], b01.z, b01.w);
      mma_f16_16816(d, Pg[2], P8[2], Qg[2], Q8[2], b23.x, b23.y);
      mma_f16_16816(d, Pg[3], P8[3], Qg[3], Q8[3], b23.z, b23.w);
      // C role: token 4p + c, blocks kb0 and kb0 + 1
      const int t = 4 * p + c;
      const bool tv = t < nt;
      const float* sa = sas + static_cast<int64_t>(tv ? t : 0) * tstride;
      const float f0 = (tv && kb0 < NB) ? w0 * sa[k0c] : 0.f;
      const float f1 = (tv && kb0 + 1 < NB) ? w1 * sa[k1c] : 0.f;
      acc[p][0] = fmaf(d[0], f0, acc[p][0]);
      acc[p][0] = fmaf(d[1], f1, acc[p][0]);
      acc[p][1] = fmaf(d[2], f0, acc[p][1]);
      acc[p][1] = fmaf(d[3], f1, acc[p][1]);
    }
  } else {
    const int kb0 = 4 * s;
    const int b0 = kb0 + 2 * (c & 1);
    const int b0c = b0 < NB ? b0 : NB - 1, b1c = b0 + 1 < NB ? b0 + 1 : NB - 1;
    const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
    const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
    const uint8_t* s0 = W.s + rg * W.sc_cols;
    const uint8_t* s8 = W.s + rg8 * W.sc_cols;
    // L1 hits (prefetched when the span was loaded)
    const float wg0 = e8m0_f32_nb(__ldg(s0 + b0c)), wg1 = e8m0_f32_nb(__ldg(s0 + b1c));
    const float w80 = e8m0_f32_nb(__ldg(s8 + b0c)), w81 = e8m0_f32_nb(__ldg(s8 + b1c));
    uint32_t R[4][4], R8[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      fp4_to_f16x2(word_of(sl.a, j), R[j][0], R[j][1], R[j][2], R[j][3]);
      fp4_to_f16x2(word_of(sl.a8, j), R8[j][0], R8[j][1], R8[j][2], R8[j][3]);
    }
#pragma unroll
    for (int p = 0; p < P; ++p) {
      // B role: column g = 4 t + blk, blk = g & 3 must match this lane's block c
      const int tb = 2 * p + (g >> 2);
      const int kbB = kb0 + c;
      const bool bact = ((g & 3) == c) && tb < nt && kbB < NB;
      const uint4* src =
          reinterpret_cast<const uint4*>(bact ? bs + (static_cast<int64_t>(tb) * tstride + kbB) * 16 : bzero);
      uint4 bq[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) bq[j] = src[j];
      float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma_f16_16816(d, R[j][0], R8[j][0], R[j][2], R8[j][2], bq[j].x, bq[j].y);
        mma_f16_16816(d, R[j][1], R8[j][1], R[j][3], R8[j][3], bq[j].z, bq[j].w);
      }
      // C role: token 2p + c/2, blocks b0, b0 + 1
      const int t = 2 * p + (c >> 1);
      const bool tv = t < nt;
      const float* sa = sas + static_cast<int64_t>(tv ? t : 0) * tstride;
      const float sa0 = (tv && b0 < NB) ? sa[b0c] : 0.f;
      const float sa1 = (tv && b0 + 1 < NB) ? sa[b1c] : 0.f;
      acc[p][0] = fmaf(d[0], wg0 * sa0, acc[p][0]);
      acc[p][0] = fmaf(d[1], wg1 * sa1, acc[p][0]);
      acc[p][1] = fmaf(d[2], w80 * sa0, acc[p][1]);
      acc[p][1] = fmaf(d[3], w81 * sa1, acc[p][1]);
    }
  }
}

// Token of the accumulators of this lane for pass p (the lane holds rows g, g+8).
template <WFormat F>
__device__ __forceinline__ int mma_acc_token(int p, int lane) {
  return F == WFormat::FP8_BLOCK ? 4 * p + (lane & 3) : 2 * p + ((lane & 3) >> 1);
}
// End of a tile: MXFP4 sums the two lanes holding the halves of each span.
template <WFormat F, int P>
__device__ __forceinline__ void mma_acc_finish(float (&acc)[P][2]) {
  if constexpr (F == WFormat::MXFP4) {
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int r = 0; r < 2; ++r) acc[p][r] += __shfl_xor_sync(kFull, acc[p][r], 1);
  }
}
// Lanes that write after mma_acc_finish (MXFP4: one of each lane pair).
template <WFormat F>
__device__ __forceinline__ bool mma_acc_writer(int lane) {
  return F == WFormat::FP8_BLOCK || (lane & 1) == 0;
}

// f16x2 of the e4m3 codes of (lo, hi) (already divided by the QA8 scale): round to
// nearest even onto the e4m3 grid with saturation at +-448 (= f32_to_e4m3 of the
// clamped value), then the exact f16 of the code.
__device__ __forceinline__ uint32_t e4m3_pair_f16(float lo, float hi) {
  uint32_t h = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short e;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(e) : "f"(hi), "f"(lo));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(e));
#else
  h = __half_as_ushort(__float2half_rn(e4m3_to_f32(f32_to_e4m3(lo)))) |
      (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(e4m3_to_f32(f32_to_e4m3(hi))))) << 16);
#endif
  return h;
}

// 8 consecutive activations x[i .. i+8) of type xt (0 f32, 1 bf16) as f32.
__device__ __forceinline__ void load_act8(const void* x, int xt, int64_t i, float (&v)[8]) {
  if (xt == 1) {
    const uint16_t* p = static_cast<const uint16_t*>(x) + i;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      const uint4 q = *reinterpret_cast<const uint4*>(p);
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = bf16_to_f32(p[e]);
    }
  } else {
    const float* p = static_cast<const float*>(x) + i;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
      const float4 a = *reinterpret_cast<const float4*>(p), b = *reinterpret_cast<const float4*>(p + 4);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = p[e];
    }
  }
}

// f16x2 of (lo, hi), each rounded to nearest even (stage_b_mma without QA8).
__device__ __forceinline__ uint32_t f16_pair(float lo, float hi) {
  return static_cast<uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}

// Activation scale exponent of a 32-element block staged WITHOUT QA8 (wo_a, spec
// §3.4.8: bf16 activations enter the product unquantized). The block is staged as the
// f16 values x * 2^-e with 2^e = 2^(floor(log2 m) - 14) for the block amax m, so the
// amax maps into [2^14, 2^15) (headroom below the f16 maximum 65504: no overflow even
// for f32 inputs), and 2^e is the block's scale in sas, applied in f32 to the block sum
// exactly like a QA8 scale.
// Exactness: a bf16 value has an 8-bit significand, so its scaled value is an f16 exactly
// when it is >= 2^-17 in magnitude (f16 normals >= 2^-14 have 11 bits; subnormals are
// multiples of 2^-24). Hence every element with |x| >= 2^(floor(log2 m) - 31) (i.e. all
// within 2^31 of the block max) is staged exactly, and its products with the (exact)
// weights are exact and summed in f32, as in the QA8 path. Smaller elements are rounded
// to the nearest multiple of 2^(e-24): an absolute error <= 2^(floor(log2 m) - 39) <=
// 2^-39 m per element, 2^15 times below the f32 rounding of m itself. (f32 inputs, which
// gemv.cu does not stage this way: values with more than 11 significant bits are also
// rounded to f16, relative 2^-12.)
// Special blocks: m == 0 (all zeros) -> e = 0, zeros; m infinite -> e = 0 (the infinities
// and out-of-range values become f16 infinities: the sums are inf / NaN as the
// reference's); NaNs (ignored by the amax) stay NaN and propagate to the block's sums.
// Tiny blocks: when weight scale * 2^e falls below the f32 normal range (2^-126), the
// block's contribution (then < 2^-97 in absolute value) is rounded or lost.
__device__ __forceinline__ int noqa_block_exp(float m) { return (m > 0.f && isfinite(m)) ? ilogbf(m) - 14 : 0; }

// Optional RMS norm applied while staging (GemvOpts::norm_w, one token): w the norm
// weights, r the row's 1 / rms (block_inv_rms), out (if not null) receives the normalized
// row in the activation type.
struct StageNorm {
  const float* w = nullptr;
  float r = 1.0f;
  void* out = nullptr;
  // in_pass: r is computed by stage_b_mma from the values it loads (eps: the norm's),
  // when the row fits one pass (norm_in_pass): x is read once instead of twice.
  bool in_pass = false;
  float eps = 0.0f;
};

// 1 / sqrt(ss / n + eps) from the double sum of squares ss of n elements (the rmsnorm
// kernel's rounding steps).
__device__ __forceinline__ float inv_rms(double ss, int n, float eps) {
  return 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(n)) + eps);
}

// 1 / sqrt(mean(x[0..n)^2) + eps) of one activation row, in every thread (squares summed
// in double, as the rmsnorm kernel does). All threads of the block; blockDim.x % 32 == 0.
__device__ __forceinline__ float block_inv_rms(const void* x, int xt, int n, float eps) {
  __shared__ double part[32];
  double ss = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = load_act(x, xt, i);
    ss += v * v;
  }
  ss = block_sum(ss, part);
  return inv_rms(ss, n, eps);
}

// Whether stage_b_mma can compute the norm of a one-token row of 32 NB elements in its
// single pass (StageNorm::in_pass): one octet per thread.
__device__ __forceinline__ bool norm_in_pass(int NB) { return NB * 4 <= static_cast<int>(blockDim.x); }

// Where element e (0..7) of an octet lands in the octet's 4 staged words (stage_b_mma's
// B orders; FP8 in the order of fp8_pair_of<HW>).
template <WFormat F, bool HW>
__device__ __forceinline__ void staged_pos(int e, int& word, int& half) {
  if constexpr (F == WFormat::MXFP4) {
    word = e & 3;
    half = e >> 2;
  } else {
    int reg;
    fp8_pair_of<HW>(e & 3, reg, half);
    word = (e >> 2) * 2 + reg;
  }
}

// A second destination of stage_b_mma: the MXFP4 B order of the same QA8 codes (the MoE
// up kernel, whose blocks meet both formats: one quantization for both).
struct StageAlso {
  uint32_t* bs = nullptr;
  float* sas = nullptr;
  float prescale = 1.0f;
};

// Stage nt activation rows x[t, xoff .. xoff + 32 NB) (row stride ldx, type xt) in the
// B-fragment order of format F into bs ([nt][tstride][16] words) and the per-32-block
// scales times prescale into sas ([nt][tstride]). QA8: QA8 codes (qblock 32) and their
// scales; !QA8: the activations themselves as f16 with a power-of-two block scale (see
// noqa_block_exp; FP8 only). All threads of the block. If fq != nullptr the staged values
// times their scale (QA8: the fake-quantized values) are also written to fq[t * ldq + k] (f32).
// nrm (one token, xoff 0): the row is RMS-normalized first (StageNorm).
// mx (FP8 with HW only): also the MXFP4 order of the same codes (StageAlso).
template <WFormat F, bool HW, bool QA8 = true>
__device__ __forceinline__ void stage_b_mma(uint32_t* bs, float* sas, int tstride, int nt, int NB, const void* x,
                                            int xt, int64_t ldx, int64_t xoff, float prescale, float* fq = nullptr,
                                            int64_t ldq = 0, const StageNorm* nrm = nullptr,
                                            const StageAlso* mx = nullptr) {
  // One octet per thread and pass; the (token, octet) of a pass advances by additions
  // (no division in the loop: the passes are chains of dependent steps, the index math
  // included). Octets 4m .. 4m+3 (one 32-element block) are in the lanes of one quad
  // (per_tok % 4 == 0, blockDim.x % 32 == 0).
  const int per_tok = NB * 4;  // octets
  const int total = nt * per_tok;
  const int bd = static_cast<int>(blockDim.x), step_t = bd / per_tok, step_o = bd - step_t * per_tok;
  int t_next = static_cast<int>(threadIdx.x) / per_tok, o_next = static_cast<int>(threadIdx.x) - t_next * per_tok;
  for (int i0 = 0; i0 < total; i0 += bd) {
    const bool ok = i0 + static_cast<int>(threadIdx.x) < total;
    const int t = t_next, o = o_next;
    o_next += step_o;
    t_next += step_t;
    if (o_next >= per_tok) o_next -= per_tok, ++t_next;
    const int kb = o >> 2, sub = o & 3;
    float v[8], wn[8];
    if (ok) {
      load_act8(x, xt, static_cast<int64_t>(t) * ldx + xoff + kb * 32 + sub * 8, v);
      if (nrm)
#pragma unroll
        for (int e = 0; e < 8; ++e) wn[e] = nrm->w[kb * 32 + sub * 8 + e];
    }
    float rr = nrm ? nrm->r : 1.0f;
    if (nrm && nrm->in_pass) {  // (one pass: every thread of the block is here once)
      __shared__ double part[32];
      double ss = 0.0;
      if (ok)
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += static_cast<double>(v[e]) * static_cast<double>(v[e]);
      ss = block_sum(ss, part);
      rr = inv_rms(ss, per_tok * 8, nrm->eps);
    }
    if (ok) {
      if (nrm) {  // one token: x' = act(w * (x * r)), as the rmsnorm kernel
        const int k0 = kb * 32 + sub * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          float u = wn[e] * (v[e] * rr);
          if (xt == 1) u = bf16_to_f32(f32_to_bf16(u));
          v[e] = u;
          if (nrm->out) store_act(nrm->out, xt, k0 + e, u);
        }
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.f;
    }
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(v[e]));
    // amax over the 4 octets of the block (lanes 4m .. 4m+3: blockDim.x % 32 == 0)
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 2));
    if (!ok) continue;
    static_assert(QA8 || F == WFormat::FP8_BLOCK, "no-QA8 staging is for FP8 weights");
    float sc, q[8];
    if constexpr (QA8) {
      sc = qa8_scale(m);
      const float inv = pow2_recip(sc);  // == 1 / sc (sc: a power of two in [2^-22, 2^120], or inf)
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = v[e] * inv;  // == v / sc (exact scaling)
    } else {
      const int ex = noqa_block_exp(m);
      sc = ldexpf(1.0f, ex);  // (2^-147 or more for bf16 inputs: exact)
#pragma unroll
      for (int e = 0; e < 8; ++e) q[e] = ldexpf(v[e], -ex);  // exact (2^-ex may not be an f32)
    }
    auto pair = [](float lo, float hi) { return QA8 ? e4m3_pair_f16(lo, hi) : f16_pair(lo, hi); };
    uint4 w;
    if constexpr (F == WFormat::MXFP4) {
      w = make_uint4(pair(q[0], q[4]), pair(q[1], q[5]), pair(q[2], q[6]), pair(q[3], q[7]));
    } else if constexpr (HW) {
      w = make_uint4(pair(q[0], q[1]), pair(q[2], q[3]), pair(q[4], q[5]), pair(q[6], q[7]));
    } else {  // P = (1, 3), Q = (0, 2) per quad
      w = make_uint4(pair(q[1], q[3]), pair(q[0], q[2]), pair(q[5], q[7]), pair(q[4], q[6]));
    }
    reinterpret_cast<uint4*>(bs + (static_cast<int64_t>(t) * tstride + kb) * 16)[sub] = w;
    if (sub == 0) sas[static_cast<int64_t>(t) * tstride + kb] = sc * prescale;
    if constexpr (F == WFormat::FP8_BLOCK && HW && QA8) {
      if (mx) {  // (q0, q4), (q1, q5), (q2, q6), (q3, q7) from (q0, q1), (q2, q3), (q4, q5), (q6, q7)
        const uint4 w4 = make_uint4(__byte_perm(w.x, w.z, 0x5410), __byte_perm(w.x, w.z, 0x7632),
                                    __byte_perm(w.y, w.w, 0x5410), __byte_perm(w.y, w.w, 0x7632));
        reinterpret_cast<uint4*>(mx->bs + (static_cast<int64_t>(t) * tstride + kb) * 16)[sub] = w4;
        if (sub == 0) mx->sas[static_cast<int64_t>(t) * tstride + kb] = sc * mx->prescale;
      }
    }
    if (fq) {
      // code values back from the staged words (element e of the octet)
      const uint32_t ww[4] = {w.x, w.y, w.z, w.w};
      float* out = fq + static_cast<int64_t>(t) * ldq + kb * 32 + sub * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        int word, half;
        staged_pos<F, HW>(e, word, half);
        const uint16_t hb = static_cast<uint16_t>(ww[word] >> (16 * half));
        out[e] = __half2float(__ushort_as_half(hb)) * sc;
      }
    }
  }
}

// One 32-element QA8 block held one element per lane (element = lane, all 32 lanes of
// the warp): the codes, scale and B order that stage_b_mma<F, F == FP8_BLOCK> writes for
// it (the same amax, scale and e4m3 rounding, element by element), written to global
// memory by a producer so that its consumer copies them instead of staging (the MoE down
// projection's h). bs: the block's 16 words; *sas = scale * prescale (lane 0); fq (if
// not null): this lane's fake-quantized value (stage_b_mma's fq); mx (FP8 only, if not
// null): also the MXFP4 order of the same codes (stage_b_mma's StageAlso; mx->bs and
// mx->sas point at this block's words and scale).
template <WFormat F>
__device__ __forceinline__ void stage_block_lanes(float v, int lane, uint32_t* bs, float* sas, float prescale,
                                                  float* fq, const StageAlso* mx = nullptr) {
  static_assert(F == WFormat::FP8_BLOCK || F == WFormat::MXFP4, "QA8 staging orders");
  const float sc = qa8_scale(warp_max(fmaxf(0.f, fabsf(v))));
  const uint16_t code = static_cast<uint16_t>(e4m3_pair_f16(v * pow2_recip(sc), 0.f));
  const int sub = lane >> 3;
  int word, half;
  staged_pos<F, true>(lane & 7, word, half);
  reinterpret_cast<uint16_t*>(bs + sub * 4 + word)[half] = code;
  if (lane == 0) *sas = sc * prescale;
  if (fq) *fq = __half2float(__ushort_as_half(code)) * sc;
  if (F == WFormat::FP8_BLOCK && mx) {
    staged_pos<WFormat::MXFP4, true>(lane & 7, word, half);
    reinterpret_cast<uint16_t*>(mx->bs + sub * 4 + word)[half] = code;
    if (lane == 0) *mx->sas = sc * mx->prescale;
  }
}

// Copy `words` 32-bit words (both ends 16-byte aligned) from global memory written by the
// previous grid to shared memory, all of a thread's loads (up to 8 per pass, bypassing
// L1) issued before its stores. All threads of the block.
__device__ __forceinline__ void copy_to_smem(uint32_t* dst, const uint32_t* src, int64_t words) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  const uint4* s = reinterpret_cast<const uint4*>(src);
  const int n16 = static_cast<int>(words / 4), bd = static_cast<int>(blockDim.x);
  for (int i0 = static_cast<int>(threadIdx.x); i0 < n16; i0 += 8 * bd) {
    uint4 r[8];
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (i0 + u * bd < n16) r[u] = __ldcg(s + i0 + u * bd);
#pragma unroll
    for (int u = 0; u < 8; ++u)
      if (i0 + u * bd < n16) d[i0 + u * bd] = r[u];
  }
  const int tail = static_cast<int>(words - 4 * static_cast<int64_t>(n16));
  if (static_cast<int>(threadIdx.x) < tail) dst[4 * n16 + threadIdx.x] = __ldcg(src + 4 * n16 + threadIdx.x);
}

}  // namespace dsx::cuda::dev
