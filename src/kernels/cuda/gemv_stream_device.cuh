// Device building blocks of the one-wave streaming GEMV (gemv_stream.cu): a weight row
// is read in warp "steps" of CPS x 32 consecutive 16-byte chunks (each warp load one
// coalesced 512 bytes; see Step below), decoded exactly as in gemv_device.cuh and
// multiplied with activations staged (swizzled f32) in shared memory; f32 products and
// sums.
#pragma once
#include "kernels/cuda/gemv_device.cuh"

namespace dsx::cuda::dev {

struct Chunk {
  uint4 raw;
  uint32_t sb;
};

// A position in the block's step sequence: row r (absolute) and step cs of the row.
struct Cursor {
  int64_t r;
  int cs;
  __device__ __forceinline__ void next(int spr) {
    if (++cs == spr) {
      cs = 0;
      ++r;
    }
  }
};

// acc[t] += chunk . x[t] (x staged as float4 with the swizzle of gemv_device.cuh;
// q0 = float4 index of the chunk's first element within the staged row).
template <WFormat F, int TT>
__device__ __forceinline__ void consume(const Chunk& ch, const float4* __restrict__ xs4, int xq, int q0,
                                        float (&acc)[TT]) {
  constexpr int Q = Fmt<F>::EPC / 4;
  float p[TT];
#pragma unroll
  for (int t = 0; t < TT; ++t) p[t] = 0.0f;
#pragma unroll
  for (int q = 0; q < Q; ++q) {
    float w[4];
    if constexpr (F == WFormat::FP8_BLOCK) {
      const uint32_t v = word(ch.raw, q);
      w[0] = fp8_trick<0>(v);
      w[1] = fp8_trick<1>(v);
      w[2] = fp8_trick<2>(v);
      w[3] = fp8_trick<3>(v);
    } else if constexpr (F == WFormat::MXFP4) {
      const uint32_t v = word(ch.raw, q >> 1);
      if (q & 1) {
        w[0] = fp4_trick<4>(v);
        w[1] = fp4_trick<5>(v);
        w[2] = fp4_trick<6>(v);
        w[3] = fp4_trick<7>(v);
      } else {
        w[0] = fp4_trick<0>(v);
        w[1] = fp4_trick<1>(v);
        w[2] = fp4_trick<2>(v);
        w[3] = fp4_trick<3>(v);
      }
    } else if constexpr (F == WFormat::BF16) {
      const uint32_t v0 = word(ch.raw, 2 * q), v1 = word(ch.raw, 2 * q + 1);
      w[0] = __uint_as_float(v0 << 16);
      w[1] = __uint_as_float(v0 & 0xffff0000u);
      w[2] = __uint_as_float(v1 << 16);
      w[3] = __uint_as_float(v1 & 0xffff0000u);
    } else {
      w[0] = __uint_as_float(ch.raw.x);
      w[1] = __uint_as_float(ch.raw.y);
      w[2] = __uint_as_float(ch.raw.z);
      w[3] = __uint_as_float(ch.raw.w);
    }
    const int qi = swz(q0 + q);
#pragma unroll
    for (int t = 0; t < TT; ++t) {
      const float4 xv = xs4[t * xq + qi];
      float a = p[t];
      a = fmaf(w[0], xv.x, a);
      a = fmaf(w[1], xv.y, a);
      a = fmaf(w[2], xv.z, a);
      a = fmaf(w[3], xv.w, a);
      p[t] = a;
    }
  }
  if constexpr (F == WFormat::FP8_BLOCK || F == WFormat::MXFP4) {
    const float f = F == WFormat::FP8_BLOCK ? fp8_factor(ch.sb) : fp4_factor(ch.sb);
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] = fmaf(p[t], f, acc[t]);
  } else {
#pragma unroll
    for (int t = 0; t < TT; ++t) acc[t] += p[t];
  }
}


// ---- multi-chunk steps: a lane holds CPS chunks of one row per step (chunks
// c0 + 32 j, j < CPS, c0 = 32 CPS cs + lane), so the per-step address and bookkeeping
// work is shared by CPS 16-byte loads; each warp load stays one coalesced 512 bytes.
template <int CPS>
struct Step {
  uint4 raw[CPS];
  uint32_t sb[CPS];
};

template <WFormat F, int CPS>
__device__ __forceinline__ void load_steps(Step<CPS>& st, const WView& W, int cpr, int64_t row, int cs, int lane) {
  const int c0 = cs * (32 * CPS) + lane;
  // chunk c0 + 32 j is 8 spans after chunk c0 + 32 (j - 1)
  const uint8_t* base = W.row_at(row) + W.byte_off(static_cast<int64_t>(c0) * 16);
  const int jstep = 8 * W.span_step();
  const uint8_t* sbase = nullptr;
  if constexpr (F == WFormat::FP8_BLOCK) sbase = W.s + (row >> W.wshift) * W.sc_cols;
  if constexpr (F == WFormat::MXFP4) sbase = W.s + row * W.sc_cols + c0;
#pragma unroll
  for (int j = 0; j < CPS; ++j) {
    const bool ok = c0 + 32 * j < cpr;
    st.raw[j] = ok ? ldg_stream(base + jstep * j) : make_uint4(0, 0, 0, 0);
    st.sb[j] = 0;
    if constexpr (F == WFormat::FP8_BLOCK) {
      if (ok) st.sb[j] = __ldg(sbase + (((c0 + 32 * j) * 16) >> W.wshift));
    } else if constexpr (F == WFormat::MXFP4) {
      if (ok) st.sb[j] = __ldg(sbase + 32 * j);
    }
  }
}

// acc[t] += step . x[t]; q0 = float4 index (within the staged row) of chunk c0's first
// element. Chunks past the row end hold zeros and are skipped.
template <WFormat F, int TT, int CPS>
__device__ __forceinline__ void consume_steps(const Step<CPS>& st, const float4* __restrict__ xs4, int xq, int q0,
                                              int c0, int cpr, float (&acc)[TT]) {
  constexpr int QC = Fmt<F>::EPC / 4;  // float4 of x per chunk
#pragma unroll
  for (int j = 0; j < CPS; ++j) {
    if (c0 + 32 * j < cpr) {
      Chunk ch;
      ch.raw = st.raw[j];
      ch.sb = st.sb[j];
      consume<F, TT>(ch, xs4, xq, q0 + 32 * QC * j, acc);
    }
  }
}

}  // namespace dsx::cuda::dev
