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
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/quant_act_device.cuh"
#include "kernels/qmatrix.h"

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
  const uint8_t* w = nullptr;  // row-major rows of row_bytes bytes
  const uint8_t* s = nullptr;  // FP8: [ceil(N/B), sc_cols]; MXFP4: [N, sc_cols]
  int64_t row_bytes = 0;
  int sc_cols = 0;
  int wshift = 5;  // FP8: log2 of the tile size B
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
    rows[r] = W.w + n * W.row_bytes;
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
        raw[u][r] = ok ? ldg_stream(rows[r] + static_cast<int64_t>(c) * 16) : make_uint4(0, 0, 0, 0);
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

}  // namespace dsx::cuda::dev
