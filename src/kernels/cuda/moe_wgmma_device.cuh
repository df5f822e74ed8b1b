// The one-token MoE up projection's consumers on Hopper's FP8 tensor cores (sm_90a
// wgmma.mma_async m64n8k32 .e4m3, A from registers, B from shared memory). A warpgroup's
// 4 warps stream 4 tiles of 16 rows (64 rows) over the same spans through their rings
// (gemv_device.cuh: 1 KB per span, a lane holds 16 bytes of rows g and g+8 at 16 c,
// c = lane & 3); per k32 step each warp passes its tile's bytes as the A fragment (the
// m16n8k32 register layout per warp, verified by the s8 probe:
// bench/results/2026-11-30-h200-s8/wgmma_e4m3_probe.cu) and the staged QA8 codes of the
// activation are B.
//
// Scale blocks through the columns (as the mma.sync consumers do): one k32 step mixes
// the 32-element blocks of the lanes c, so column n of B holds block n's codes in the k
// slots of the lanes that carry block n and zeros elsewhere; after the span's steps, D
// column n is block n's sum over its 32 products, scaled in f32 afterwards.
//  * MXFP4 (a span = 128 values, 4 blocks): lane c carries block c (its 16 bytes); step j
//    (0..3) uses word j: slots 4c + i <- its low nibbles (values 8j + 2i), slots
//    16 + 4c + i <- its high nibbles (8j + 2i + 1). Columns 0..3 = blocks 0..3.
//  * FP8 (the shared expert; a span = 64 values, 2 blocks) on f16 wgmma m64n8k16: the
//    weight bytes and the QA8 codes converted to f16 (exact), so the products are exact
//    and summed in f32 as on the mma.sync path (FP8 wgmma's limited alignment made sums
//    with strong cancellation miss the twin: CudaMoe.DecodeReleaseShapesMatchTwin). Lane c
//    carries values 16c .. 16c + 15 (block c / 2); step j (0..3) uses its word j: slots
//    2c, 2c + 1 <- bytes 0, 1, slots 8 + 2c, 9 + 2c <- bytes 2, 3. Columns 0, 1 = blocks 0, 1.
// e2m1 -> e4m3 is a bit placement: sign to bit 7, the three magnitude bits to bits 2..4
// gives the e4m3 code of the value times 2^-6 (subnormal 0.5 included), so the MXFP4
// activation scales carry 2^6.
//
// B layout (no swizzle, K-major): a step reads two core matrices of 8 columns x 16 bytes
// (e4m3: k slots 0..15 and 16..31; f16: 0..7 and 8..15), the second one LBO further. Only the first 4
// (MXFP4) or 2 (FP8) columns are read back, so consecutive steps overlap: step q starts
// 64 (MXFP4) or 32 (FP8) bytes after step q - 1, whose ignored columns are step q's live
// ones. Each format has two arrays (kc = 0, 1) of NB steps plus a pad for the last
// step's ignored columns.
//
// Precision (MXFP4): FP8 wgmma adds the products of a step (and the running column sum)
// with a limited alignment (DeepSeek-V3 report: ~14 bits), not in f32; each column sums
// one 32-element block only and the blocks are added in f32, as the reference's 32-block
// structure (spec §3.0.4). e2m1 weights span 3.6 binades, so the products of a block are
// as spread as its activation codes.
#pragma once
#include <cstdint>

#include "kernels/cuda/gemv_device.cuh"

namespace dsx::cuda::dev {

constexpr int kWgStep4 = 64;  // bytes between MXFP4 steps (4 live columns)
constexpr int kWgStep8 = 32;  // FP8 as f16 (2 live columns); 2 NB steps
__host__ __device__ constexpr uint32_t wg_lbo4(int NB) { return static_cast<uint32_t>(kWgStep4) * NB + 64u; }
__host__ __device__ constexpr uint32_t wg_lbo8(int NB) { return static_cast<uint32_t>(kWgStep8) * 2 * NB + 96u; }
constexpr float kWgMx4Prescale = 64.0f;  // e2m1 placed as e4m3 reads as the value * 2^-6

// Shared-memory matrix descriptor: no swizzle, LBO = lbo (the kc = 1 core matrix), SBO 256 (unused for N = 8).
__device__ __forceinline__ uint64_t wg_desc(const void* smem, uint32_t lbo) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  return static_cast<uint64_t>((a & 0x3FFFF) >> 4) | (static_cast<uint64_t>((lbo >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>(256 >> 4) << 32);
}

// Four e4m3 codes (round to nearest even, saturating: QA8's clamp to +-448) in the bytes of a word.
__device__ __forceinline__ uint32_t e4m3x4(float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  unsigned short lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(b), "f"(a));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(d), "f"(c));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
#else
  auto q = [](float v) { return static_cast<uint32_t>(f32_to_e4m3(fminf(fmaxf(v, -448.f), 448.f))); };
  return q(a) | (q(b) << 8) | (q(c) << 16) | (q(d) << 24);
#endif
}

// QA8 of one activation row x[0 .. 32 NB) (type xt) into the B arrays of either format
// (b8 / b4: null to skip; each 2 lbo bytes) and its block scales (sa8[kb] = s, sa4[kb] =
// s * 2^6). All threads of the block; blockDim.x % 32 == 0. Ends with the proxy fence
// that makes the generic stores visible to wgmma (the caller synchronises the block).
__device__ __forceinline__ void stage_b_wg(const void* x, int xt, int NB, float* sa8, float* sa4, uint8_t* b8,
                                           uint8_t* b4) {
  const int total = NB * 4;  // octets; those of a block are in the lanes of one quad
  const uint32_t lbo8 = wg_lbo8(NB), lbo4 = wg_lbo4(NB);
  for (int i0 = 0; i0 < total; i0 += static_cast<int>(blockDim.x)) {
    const int o = i0 + static_cast<int>(threadIdx.x);
    const bool ok = o < total;
    const int kb = o >> 2, sub = o & 3;
    float v[8];
    if (ok) {
      load_act8(x, xt, static_cast<int64_t>(kb) * 32 + sub * 8, v);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.f;
    }
    float m = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) m = fmaxf(m, fabsf(v[e]));
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 1));
    m = fmaxf(m, __shfl_xor_sync(kFull, m, 2));
    if (!ok) continue;
    const float sc = qa8_scale(m), inv = pow2_recip(sc);
    float q[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) q[e] = v[e] * inv;  // == v / sc (exact)
    if (sub == 0) {
      sa8[kb] = sc;
      sa4[kb] = sc * kWgMx4Prescale;
    }
    if (b4) {  // step 4 (kb / 4) + sub, column kb % 4: even values at kc = 0, odd at kc = 1
      const int n = kb & 3, step = 4 * (kb >> 2) + sub;
      const uint32_t w0 = e4m3x4(q[0], q[2], q[4], q[6]), w1 = e4m3x4(q[1], q[3], q[5], q[7]);
      uint4 c0 = make_uint4(0u, 0u, 0u, 0u), c1 = c0;
      (n == 0 ? c0.x : n == 1 ? c0.y : n == 2 ? c0.z : c0.w) = w0;
      (n == 0 ? c1.x : n == 1 ? c1.y : n == 2 ? c1.z : c1.w) = w1;
      uint8_t* col = b4 + static_cast<int64_t>(step) * kWgStep4 + 16 * n;
      *reinterpret_cast<uint4*>(col) = c0;
      *reinterpret_cast<uint4*>(col + lbo4) = c1;
    }
    if (b8) {  // lane c = 2 (kb % 2) + sub / 2, steps 4 (kb / 2) + 2 (sub % 2) + {0, 1}, column kb % 2
      const int b = kb & 1, h = sub >> 1, c = 2 * b + h, step = 4 * (kb >> 1) + 2 * (sub & 1);
      const int cz = 2 * (1 - b) + h;  // a lane of the other block: zeros in this column
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        uint8_t* col = b8 + static_cast<int64_t>(step + u) * kWgStep8 + 16 * b;
        *reinterpret_cast<uint32_t*>(col + 4 * c) = e4m3_pair_f16(q[4 * u], q[4 * u + 1]);
        *reinterpret_cast<uint32_t*>(col + lbo8 + 4 * c) = e4m3_pair_f16(q[4 * u + 2], q[4 * u + 3]);
        *reinterpret_cast<uint32_t*>(col + 4 * cz) = 0u;
        *reinterpret_cast<uint32_t*>(col + lbo8 + 4 * cz) = 0u;
      }
    }
  }
  // pads read by the last steps' ignored columns (kept finite)
  for (int i = static_cast<int>(threadIdx.x); i < 64 / 4; i += static_cast<int>(blockDim.x))
    if (b4) {
      reinterpret_cast<uint32_t*>(b4 + static_cast<int64_t>(NB) * kWgStep4)[i] = 0u;
      reinterpret_cast<uint32_t*>(b4 + lbo4 + static_cast<int64_t>(NB) * kWgStep4)[i] = 0u;
    }
  for (int i = static_cast<int>(threadIdx.x); i < 96 / 4; i += static_cast<int>(blockDim.x))
    if (b8) {
      reinterpret_cast<uint32_t*>(b8 + static_cast<int64_t>(2 * NB) * kWgStep8)[i] = 0u;
      reinterpret_cast<uint32_t*>(b8 + lbo8 + static_cast<int64_t>(2 * NB) * kWgStep8)[i] = 0u;
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSX_WG_E4M3(dst, a, desc, p)                                                                          \
  "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {" dst "}, {" a "}, " desc ", " p ", 1, 1;\n\t"
#endif

// d = the span's column sums: 4 chained steps (MXFP4), A[j] = {a0, a1, a2, a3} of step j,
// B of step j at desc + j * dstep. Issues, commits and waits (the warpgroup converges here).
__device__ __forceinline__ void wg_span4(float (&d)[4], const uint32_t (&A)[4][4], uint64_t desc, uint32_t dstep) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t d1 = desc + dstep, d2 = desc + 2 * dstep, d3 = desc + 3 * dstep;
  asm volatile(
      "{\n\t.reg .pred p0, p1;\n\tsetp.ne.b32 p0, 0, 0;\n\tsetp.eq.b32 p1, 0, 0;\n\t"
      "wgmma.fence.sync.aligned;\n\t" DSX_WG_E4M3("%0, %1, %2, %3", "%4, %5, %6, %7", "%20", "p0")
          DSX_WG_E4M3("%0, %1, %2, %3", "%8, %9, %10, %11", "%21", "p1")
              DSX_WG_E4M3("%0, %1, %2, %3", "%12, %13, %14, %15", "%22", "p1")
                  DSX_WG_E4M3("%0, %1, %2, %3", "%16, %17, %18, %19", "%23", "p1")
      "wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;\n\t}"
      : "=&f"(d[0]), "=&f"(d[1]), "=&f"(d[2]), "=&f"(d[3])
      : "r"(A[0][0]), "r"(A[0][1]), "r"(A[0][2]), "r"(A[0][3]), "r"(A[1][0]), "r"(A[1][1]), "r"(A[1][2]),
        "r"(A[1][3]), "r"(A[2][0]), "r"(A[2][1]), "r"(A[2][2]), "r"(A[2][3]), "r"(A[3][0]), "r"(A[3][1]),
        "r"(A[3][2]), "r"(A[3][3]), "l"(desc), "l"(d1), "l"(d2), "l"(d3)
      : "memory");
#else
  d[0] = d[1] = d[2] = d[3] = 0.f;
  (void)A, (void)desc, (void)dstep;
  __trap();
#endif
}
// Four chained f16 steps (FP8 as f16: m64n8k16, B K-major).
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DSX_WG_F16(dst, a, desc, p)                                                                         \
  "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {" dst "}, {" a "}, " desc ", " p ", 1, 1, 0;\n\t"
#endif
__device__ __forceinline__ void wg_span4_f16(float (&d)[4], const uint32_t (&A)[4][4], uint64_t desc, uint32_t dstep) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t d1 = desc + dstep, d2 = desc + 2 * dstep, d3 = desc + 3 * dstep;
  asm volatile(
      "{\n\t.reg .pred p0, p1;\n\tsetp.ne.b32 p0, 0, 0;\n\tsetp.eq.b32 p1, 0, 0;\n\t"
      "wgmma.fence.sync.aligned;\n\t" DSX_WG_F16("%0, %1, %2, %3", "%4, %5, %6, %7", "%20", "p0")
          DSX_WG_F16("%0, %1, %2, %3", "%8, %9, %10, %11", "%21", "p1")
              DSX_WG_F16("%0, %1, %2, %3", "%12, %13, %14, %15", "%22", "p1")
                  DSX_WG_F16("%0, %1, %2, %3", "%16, %17, %18, %19", "%23", "p1")
      "wgmma.commit_group.sync.aligned;\n\twgmma.wait_group.sync.aligned 0;\n\t}"
      : "=&f"(d[0]), "=&f"(d[1]), "=&f"(d[2]), "=&f"(d[3])
      : "r"(A[0][0]), "r"(A[0][1]), "r"(A[0][2]), "r"(A[0][3]), "r"(A[1][0]), "r"(A[1][1]), "r"(A[1][2]),
        "r"(A[1][3]), "r"(A[2][0]), "r"(A[2][1]), "r"(A[2][2]), "r"(A[2][3]), "r"(A[3][0]), "r"(A[3][1]),
        "r"(A[3][2]), "r"(A[3][3]), "l"(desc), "l"(d1), "l"(d2), "l"(d3)
      : "memory");
#else
  d[0] = d[1] = d[2] = d[3] = 0.f;
  (void)A, (void)desc, (void)dstep;
  __trap();
#endif
}

// e4m3 codes (value * 2^-6) of the 4 even (lo) and 4 odd (hi) nibbles of an MXFP4 word.
__device__ __forceinline__ uint32_t e2m1_lo_e4m3(uint32_t w) {
  return ((w << 2) & 0x1C1C1C1Cu) | ((w << 4) & 0x80808080u);
}
__device__ __forceinline__ uint32_t e2m1_hi_e4m3(uint32_t w) { return ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u); }

// MXFP4 consumer of a lane of a warpgroup warp (K % 128 == 0: whole spans). Lanes c = 0, 1
// hold D columns (2c, 2c + 1) = blocks 2c, 2c + 1 of the span; c = 2, 3 hold ignored columns.
struct Fp4WgCons {
  const uint8_t* s0;  // e8m0 scales of row g at block 2 (c & 1)
  const uint8_t* s8;  // row g + 8
  const float* sa;    // sa4 + 2 (c & 1)
  uint64_t desc0;     // B step 0
  bool live;          // c < 2

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const float* sa4,
                                      const uint8_t* b4, int NB, int lane) {
    const int g = lane >> 2, c = lane & 3;
    const int64_t rg = row0 + g < row_last ? row0 + g : row_last;
    const int64_t rg8 = row0 + g + 8 < row_last ? row0 + g + 8 : row_last;
    s0 = W.s + rg * W.sc_cols + 2 * (c & 1);
    s8 = W.s + rg8 * W.sc_cols + 2 * (c & 1);
    sa = sa4 + 2 * (c & 1);
    desc0 = wg_desc(b4, wg_lbo4(NB));
    live = c < 2;
  }
  __device__ __forceinline__ void span(const uint4* slot, int s, float (&acc)[2], int lane) const {
    const uint4 a = lds128(slot + lane), a8 = lds128(slot + 32 + lane);
    const int kb0 = 4 * s;
    const uint32_t g0 = __ldg(s0 + kb0), g1 = __ldg(s0 + kb0 + 1), h0 = __ldg(s8 + kb0), h1 = __ldg(s8 + kb0 + 1);
    const float sa0 = sa[kb0], sa1 = sa[kb0 + 1];
    uint32_t A[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w = word_of(a, j), w8 = word_of(a8, j);
      A[j][0] = e2m1_lo_e4m3(w);
      A[j][1] = e2m1_lo_e4m3(w8);
      A[j][2] = e2m1_hi_e4m3(w);
      A[j][3] = e2m1_hi_e4m3(w8);
    }
    float d[4];
    wg_span4(d, A, desc0 + static_cast<uint64_t>(s) * (4 * kWgStep4 >> 4), kWgStep4 >> 4);
    if (live) {
      acc[0] = fmaf(d[0], e8m0_f32_nb(g0) * sa0, acc[0]);
      acc[0] = fmaf(d[1], e8m0_f32_nb(g1) * sa1, acc[0]);
      acc[1] = fmaf(d[2], e8m0_f32_nb(h0) * sa0, acc[1]);
      acc[1] = fmaf(d[3], e8m0_f32_nb(h1) * sa1, acc[1]);
    }
  }
  // rows g, g+8 summed into lane c == 0
  __device__ __forceinline__ static void finish(float (&acc)[2]) {
    acc[0] += __shfl_xor_sync(kFull, acc[0], 1);
    acc[1] += __shfl_xor_sync(kFull, acc[1], 1);
  }
};

// FP8 consumer (K % 64 == 0; f16 steps). Lane c == 0 holds D columns 0, 1 = blocks 0, 1 of the span.
struct Fp8WgCons {
  const uint8_t* srow;  // e8m0 tile row of the piece (its 16 rows share it: tile >= 16)
  const float* sa;      // sa8
  uint64_t desc0;
  int wshift;
  bool live;

  __device__ __forceinline__ void set(const WView& W, int64_t row0, int64_t row_last, const float* sa8,
                                      const uint8_t* b8, int NB, int lane) {
    const int64_t r0c = row0 < row_last ? row0 : row_last;
    srow = W.s + (r0c >> W.wshift) * W.sc_cols;
    wshift = W.wshift;
    sa = sa8;
    desc0 = wg_desc(b8, wg_lbo8(NB));
    live = (lane & 3) == 0;
  }
  __device__ __forceinline__ void span(const uint4* slot, int s, float (&acc)[2], int lane) const {
    const uint4 a = lds128(slot + lane), a8 = lds128(slot + 32 + lane);
    const int kb0 = 2 * s;
    const uint32_t sc0 = __ldg(srow + ((kb0 * 32) >> wshift)), sc1 = __ldg(srow + (((kb0 + 1) * 32) >> wshift));
    const float sa0 = sa[kb0], sa1 = sa[kb0 + 1];
    uint32_t A[4][4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      fp8_to_f16x2<true>(word_of(a, j), A[j][0], A[j][2]);
      fp8_to_f16x2<true>(word_of(a8, j), A[j][1], A[j][3]);
    }
    float d[4];
    wg_span4_f16(d, A, desc0 + static_cast<uint64_t>(s) * (4 * kWgStep8 >> 4), kWgStep8 >> 4);
    if (live) {
      const float f0 = e8m0_f32_nb(sc0) * sa0, f1 = e8m0_f32_nb(sc1) * sa1;
      acc[0] = fmaf(d[0], f0, acc[0]);
      acc[0] = fmaf(d[1], f1, acc[0]);
      acc[1] = fmaf(d[2], f0, acc[1]);
      acc[1] = fmaf(d[3], f1, acc[1]);
    }
  }
  __device__ __forceinline__ static void finish(float (&)[2]) {}
};

}  // namespace dsx::cuda::dev
