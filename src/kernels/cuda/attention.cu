#include "kernels/cuda/attention.h"

#include <type_traits>

#include "kernels/cuda/cp_async_device.cuh"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/pdl_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

constexpr int kC = 32;  // rows per chunk (one per lane in the logit phase)

struct AttnParams {
  int H, W, ring_cap, n_pairs;
  const void* q;
  const uint8_t *ring_codes, *ring_scales, *chunk_codes, *chunk_scales, *cmp_packed, *cmp_scales;
  const int32_t* sel;
  int64_t sel_ld;
  const int32_t* sel_count;
  bool sel_early;  // AttnArgs::sel_early
  const float* sink;
  float scale;
  const float* inv_freq;
  const float* q_inv_freq;  // non-null: RoPE the queries in the kernel (mma kernel only)
  void* out;
  const int64_t* d_pos;
  float* work;
};

template <int HD, int HB>
constexpr size_t attn_smem_bytes() {
  return static_cast<size_t>(4) * HB * HD + static_cast<size_t>(2) * kC * (HD + 8) + static_cast<size_t>(4) * HB * kC;
}

template <int V>
__device__ __forceinline__ void load_bf16(const bf16* p, float* out) {
  if constexpr (V == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else if constexpr (V == 4) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = __uint_as_float(u.x << 16);
    out[1] = __uint_as_float(u.x & 0xffff0000u);
    out[2] = __uint_as_float(u.y << 16);
    out[3] = __uint_as_float(u.y & 0xffff0000u);
  } else {
    static_assert(V == 2, "vector width");
    const uint32_t u = *reinterpret_cast<const uint32_t*>(p);
    out[0] = __uint_as_float(u << 16);
    out[1] = __uint_as_float(u & 0xffff0000u);
  }
}

__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  // a, b are exactly representable in bf16 (cache values): truncation is exact
  return (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
}

// The codes and scales of window row li of a query (position lo_w + li): this call's
// chunk holds positions from p0 on, the ring the older ones.
template <int HD>
__device__ __forceinline__ void window_row(const AttnParams& p, int64_t lo_w, int li, int64_t p0, const uint8_t*& codes,
                                           const uint8_t*& scales) {
  const int64_t wp = lo_w + li;
  const bool in_chunk = wp >= p0;
  const int64_t slot = in_chunk ? wp - p0 : wp % p.ring_cap;
  codes = (in_chunk ? p.chunk_codes : p.ring_codes) + slot * HD;
  scales = (in_chunk ? p.chunk_scales : p.ring_scales) + slot * (HD / 32);
}

// Eight elements of a row as bf16 (exact): a window row's FP8 codes (raw) with their e8m0
// scale byte, or a selected row's FP4 codes (raw.x) with their e4m3 scale byte.
__device__ __forceinline__ uint4 decode_item(bool window, uint2 raw, uint32_t sbyte) {
  float v[8];
  if (window) {
    const float s = e8m0_dev(sbyte);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[i] = e4m3_dev((raw.x >> (8 * i)) & 255u) * s;
      v[4 + i] = e4m3_dev((raw.y >> (8 * i)) & 255u) * s;
    }
  } else {
    const float s = e4m3_dev(sbyte);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = e2m1_dev((raw.x >> (4 * i)) & 15u) * s;
  }
  return make_uint4(pack_bf16x2(v[0], v[1]), pack_bf16x2(v[2], v[3]), pack_bf16x2(v[4], v[5]),
                    pack_bf16x2(v[6], v[7]));
}

// Decodes list entries c0 .. c0+nr-1 of query t (window rows, then selected compressed
// rows) into kv_s (bf16, exact; row stride ks elements). With zero_tail, rows nr .. kC-1
// are zero-filled (the tensor-core kernel multiplies them by zero probabilities).
// In batches of up to 8 items per thread: every thread first issues the loads of all
// the batch's items (the selected row ids, then the codes and scales; branch-free, so the
// compiler keeps them in flight together), then decodes them. (One item at a time paid a
// dependent L2 round trip per item: ncu of the decode attention showed long-scoreboard
// stalls at 0.15 issued warps per scheduler.)
template <int HD, int NT>
__device__ __forceinline__ void decode_rows(const AttnParams& p, int t, int c0, int nr, int nw, int64_t lo_w,
                                            int64_t p0, bf16* kv_s, int ks, bool zero_tail) {
  constexpr int OCT = HD / 8;  // 8-element items per row
  constexpr int IT = (kC * OCT + NT - 1) / NT;
  constexpr int B = IT < 8 ? IT : 8;  // items per batch
#pragma unroll 1
  for (int i0 = 0; i0 < IT; i0 += B) {
    int32_t sel[B];
#pragma unroll
    for (int it = 0; it < B; ++it) {  // ids of the selected rows of this batch
      const int g = threadIdx.x + (i0 + it) * NT, r = g / OCT, li = c0 + r;
      const bool cmp_row = i0 + it < IT && g < kC * OCT && r < nr && li >= nw;
      sel[it] = cmp_row ? p.sel[static_cast<int64_t>(t) * p.sel_ld + (li - nw)] : 0;
    }
    uint2 raw[B];
    uint32_t sc[B];
#pragma unroll
    for (int it = 0; it < B; ++it) {  // codes and scales
      const int g = threadIdx.x + (i0 + it) * NT, r = g / OCT, e8 = g - r * OCT, li = c0 + r;
      const bool live = i0 + it < IT && g < kC * OCT && r < nr;
      raw[it] = make_uint2(0u, 0u);
      sc[it] = 0u;
      if (live && li < nw) {
        const uint8_t *codes, *scales;
        window_row<HD>(p, lo_w, li, p0, codes, scales);
        raw[it] = *reinterpret_cast<const uint2*>(codes + e8 * 8);
        sc[it] = scales[e8 / 4];
      } else if (live) {
        const int64_t j = sel[it];
        raw[it].x = *reinterpret_cast<const uint32_t*>(p.cmp_packed + j * (HD / 2) + e8 * 4);
        sc[it] = p.cmp_scales[j * (HD / 16) + e8 / 2];
      }
    }
#pragma unroll
    for (int it = 0; it < B; ++it) {
      const int g = threadIdx.x + (i0 + it) * NT, r = g / OCT, e8 = g - r * OCT;
      if (i0 + it >= IT || g >= kC * OCT || (r >= nr && !zero_tail)) continue;
      const uint4 u = r < nr ? decode_item(c0 + r < nw, raw[it], sc[it]) : make_uint4(0u, 0u, 0u, 0u);
      *reinterpret_cast<uint4*>(kv_s + r * ks + e8 * 8) = u;
    }
  }
}

// Output of one head without row splits: the softmax denominator includes the head's
// sink logit (spec §3.4.7); returns the factor for the accumulated values.
__device__ __forceinline__ float sink_scale(float m, float l, float sink) {
  const float M = fmaxf(m, sink);
  const float f = expf(m - M);
  return f / (l * f + expf(sink - M));
}
// Inverse RoPE of the output pair (v0, v1) at dims d, d + 1 when they are rope dims
// (d >= off; inv_freq null: no rope), rounded as a store into T.
template <typename T>
__device__ __forceinline__ void out_rope_pair(float& v0, float& v1, int d, int off, float fpos,
                                              const float* __restrict__ inv_freq) {
  if (!inv_freq || d < off) return;
  float c, sn, ra, rb;
  rope_cs(fpos, inv_freq[(d - off) >> 1], c, sn);
  rope_pair(v0, v1, c, sn, true, ra, rb);
  v0 = rnd<T>(ra);
  v1 = rnd<T>(rb);
}

template <typename T, int HD, int HB>
__global__ void __launch_bounds__(HB * 16) attn_kernel(AttnParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int NT = HB * 16;
  constexpr int KS = HD + 8;  // shared row stride (elements): 16 B of padding per row
  constexpr int DPL = HD / 32, V = DPL < 8 ? DPL : 8, G = DPL / V;
  constexpr bool kBf16 = !std::is_same<T, float>::value;
  float* q_s = reinterpret_cast<float*>(smem);
  bf16* kv_s = reinterpret_cast<bf16*>(smem + static_cast<size_t>(4) * HB * HD);
  float* p_s = reinterpret_cast<float*>(smem + static_cast<size_t>(4) * HB * HD + static_cast<size_t>(2) * kC * KS);

  const int t = blockIdx.z, hg = blockIdx.y, split = blockIdx.x, S = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t p0 = *p.d_pos, pos = p0 + t;
  const int64_t lo_w = pos - p.W + 1 > 0 ? pos - p.W + 1 : 0;
  const int nw = static_cast<int>(pos - lo_w + 1);
  const int ns = p.sel ? p.sel_count[t] : 0;
  const int N = nw + ns;
  const int R = (N + S - 1) / S;
  const int rb = split * R, re = min(N, rb + R);

  const T* qg = static_cast<const T*>(p.q) + (static_cast<int64_t>(t) * p.H + hg * HB) * HD;
  for (int i = tid; i < HB * HD; i += NT) q_s[i] = ld(qg, i);

  const int ha = 2 * warp, hb = 2 * warp + 1;  // local heads of this warp
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
  float acc_a[DPL], acc_b[DPL];
#pragma unroll
  for (int i = 0; i < DPL; ++i) acc_a[i] = acc_b[i] = 0.0f;

  for (int c0 = rb; c0 < re; c0 += kC) {
    const int nr = min(kC, re - c0);
    __syncthreads();  // q_s written / previous chunk consumed
    decode_rows<HD, NT>(p, t, c0, nr, nw, lo_w, p0, kv_s, KS, false);
    __syncthreads();

    // logits: lane = row of the chunk, two heads per warp
    float la = -INFINITY, lb = -INFINITY;
    if (lane < nr) {
      float sa = 0.0f, sb = 0.0f;
      const bf16* kr = kv_s + lane * KS;
      const float* qa = q_s + ha * HD;
      const float* qb = q_s + hb * HD;
#pragma unroll 4
      for (int d = 0; d < HD; d += 8) {
        float k8[8];
        load_bf16<8>(kr + d, k8);
        const float4 a0 = *reinterpret_cast<const float4*>(qa + d);
        const float4 a1 = *reinterpret_cast<const float4*>(qa + d + 4);
        const float4 b0 = *reinterpret_cast<const float4*>(qb + d);
        const float4 b1 = *reinterpret_cast<const float4*>(qb + d + 4);
        sa = fmaf(a0.x, k8[0], sa);
        sa = fmaf(a0.y, k8[1], sa);
        sa = fmaf(a0.z, k8[2], sa);
        sa = fmaf(a0.w, k8[3], sa);
        sa = fmaf(a1.x, k8[4], sa);
        sa = fmaf(a1.y, k8[5], sa);
        sa = fmaf(a1.z, k8[6], sa);
        sa = fmaf(a1.w, k8[7], sa);
        sb = fmaf(b0.x, k8[0], sb);
        sb = fmaf(b0.y, k8[1], sb);
        sb = fmaf(b0.z, k8[2], sb);
        sb = fmaf(b0.w, k8[3], sb);
        sb = fmaf(b1.x, k8[4], sb);
        sb = fmaf(b1.y, k8[5], sb);
        sb = fmaf(b1.z, k8[6], sb);
        sb = fmaf(b1.w, k8[7], sb);
      }
      la = sa * p.scale;
      lb = sb * p.scale;
    }
    // online softmax (running max over the chunks of this block)
    const float nma = fmaxf(m_a, warp_max(la)), nmb = fmaxf(m_b, warp_max(lb));
    const float pa = lane < nr ? expf(la - nma) : 0.0f;
    const float pb = lane < nr ? expf(lb - nmb) : 0.0f;
    const float alpha_a = expf(m_a - nma), alpha_b = expf(m_b - nmb);
    l_a = l_a * alpha_a + warp_sum(pa);
    l_b = l_b * alpha_b + warp_sum(pb);
    m_a = nma;
    m_b = nmb;
    p_s[ha * kC + lane] = kBf16 ? round_bf16_dev(pa) : pa;
    p_s[hb * kC + lane] = kBf16 ? round_bf16_dev(pb) : pb;
    __syncwarp();
#pragma unroll
    for (int i = 0; i < DPL; ++i) {
      acc_a[i] *= alpha_a;
      acc_b[i] *= alpha_b;
    }
    for (int r = 0; r < nr; ++r) {
      const float wa = p_s[ha * kC + r], wb = p_s[hb * kC + r];
      const bf16* vr = kv_s + r * KS;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float vv[V];
        load_bf16<V>(vr + g * 32 * V + lane * V, vv);
#pragma unroll
        for (int e = 0; e < V; ++e) {
          acc_a[g * V + e] = fmaf(wa, vv[e], acc_a[g * V + e]);
          acc_b[g * V + e] = fmaf(wb, vv[e], acc_b[g * V + e]);
        }
      }
    }
  }

  // ---- output
  auto emit = [&](int hl, float m, float l, const float(&acc)[DPL]) {
    const int h = hg * HB + hl;
    if (S == 1) {
      const float sc = sink_scale(m, l, p.sink[h]);
      T* o = static_cast<T*>(p.out) + (static_cast<int64_t>(t) * p.H + h) * HD;
      const int off = HD - 2 * p.n_pairs;
      const float fpos = static_cast<float>(pos);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float val[V];
#pragma unroll
        for (int e = 0; e < V; ++e) val[e] = rnd<T>(acc[g * V + e] * sc);
        const int d0 = g * 32 * V + lane * V;
#pragma unroll
        for (int e = 0; e < V; e += 2) out_rope_pair<T>(val[e], val[e + 1], d0 + e, off, fpos, p.inv_freq);
#pragma unroll
        for (int e = 0; e < V; ++e) st(o, d0 + e, val[e]);
      }
    } else {
      float* w = p.work + ((static_cast<int64_t>(t) * S + split) * p.H + h) * (HD + 2);
      if (lane == 0) {
        w[0] = m;
        w[1] = l;
      }
#pragma unroll
      for (int g = 0; g < G; ++g)
#pragma unroll
        for (int e = 0; e < V; ++e) w[2 + g * 32 * V + lane * V + e] = acc[g * V + e];
    }
  };
  emit(ha, m_a, l_a, acc_a);
  emit(hb, m_b, l_b, acc_b);
}

// ---- BF16 tensor-core variant (mma.sync m16n8k16, f32 accumulation) ------------------
// One block = one query x 16 heads (one m16 tile), 4 warps. Per 32-row chunk:
// S = Q K^T (warp w: key rows 8w..8w+7), online softmax per head (p rounded to bf16 for
// the product, the denominator in f32), O += P V (warp w: dims [w HD/4, (w+1) HD/4)).
// Same numerics as attn_kernel<bf16> up to f32 summation order.
template <typename P>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const P* ptr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}
template <typename P>
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const P* ptr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

// The tensor-core kernel copies a chunk's raw rows into shared memory with cp.async
// (all of them in flight at once, overlapping the queries' load and RoPE), then decodes
// them there: two dependent global round trips per chunk (the selected rows' ids, then
// the rows) instead of two per batch of 8 items per thread (the rows were ~60 % of the
// kernel's time in decode). Needs HD % 128 == 0 (whole 4-byte pieces of scales).
template <int HD>
constexpr bool kAsyncRows = HD % 128 == 0;
template <int HD>
constexpr int kRawRow = HD + HD / 16;  // bytes per row slot: codes, then scales

// Issues the copies of list entries c0 .. c0+nr-1 of query t into raw_s (slot r: the
// codes, then the scales at byte HD; window rows FP8 + e8m0, selected rows FP4 + e4m3);
// ids_s holds the selected rows' ids (read by the caller before its barrier).
template <int HD, int NT>
__device__ __forceinline__ void copy_rows_async(const AttnParams& p, int c0, int nr, int nw, int64_t lo_w, int64_t p0,
                                                const int32_t* ids_s, uint8_t* raw_s) {
  constexpr int PPR = HD / 16 + HD / 128;  // pieces of a window row (16-byte codes, 4-byte scales)
  for (int g = threadIdx.x; g < nr * PPR; g += NT) {
    const int r = g / PPR, k = g - r * PPR, li = c0 + r;
    uint8_t* dst = raw_s + r * kRawRow<HD>;
    if (li < nw) {
      const uint8_t *codes, *scales;
      window_row<HD>(p, lo_w, li, p0, codes, scales);
      if (k < HD / 16) dev::cp_async16(dst + 16 * k, codes + 16 * k);
      else dev::cp_async4(dst + HD + 4 * (k - HD / 16), scales + 4 * (k - HD / 16));
    } else {
      const int64_t j = ids_s[r];
      if (k < HD / 32) dev::cp_async16(dst + 16 * k, p.cmp_packed + j * (HD / 2) + 16 * k);
      else if (k < HD / 32 + HD / 64) dev::cp_async4(dst + HD + 4 * (k - HD / 32), p.cmp_scales + j * (HD / 16) + 4 * (k - HD / 32));
    }
  }
}

// Decodes the rows copied by copy_rows_async into kv_s (bf16, exact, as decode_rows);
// rows nr .. kC-1 are zero-filled.
template <int HD, int NT>
__device__ __forceinline__ void convert_rows(const uint8_t* raw_s, int c0, int nr, int nw, bf16* kv_s, int ks) {
  constexpr int OCT = HD / 8;
  for (int g = threadIdx.x; g < kC * OCT; g += NT) {
    const int r = g / OCT, e8 = g - r * OCT;
    uint4 u = make_uint4(0u, 0u, 0u, 0u);
    if (r < nr) {
      const uint8_t* src = raw_s + r * kRawRow<HD>;
      if (c0 + r < nw)
        u = decode_item(true, *reinterpret_cast<const uint2*>(src + e8 * 8), src[HD + e8 / 4]);
      else
        u = decode_item(false, make_uint2(*reinterpret_cast<const uint32_t*>(src + e8 * 4), 0u), src[HD + e8 / 2]);
    }
    *reinterpret_cast<uint4*>(kv_s + r * ks + e8 * 8) = u;
  }
}

template <int HD>
constexpr size_t attn_mma_smem_bytes() {
  return static_cast<size_t>(2) * 16 * (HD + 8) + static_cast<size_t>(2) * kC * (HD + 8) +
         static_cast<size_t>(2) * 16 * (kC + 8) + static_cast<size_t>(4) * 16 * kC + static_cast<size_t>(4) * 3 * 16 +
         (kAsyncRows<HD> ? static_cast<size_t>(kC) * kRawRow<HD> + 4 * kC : 0);
}

// Threads of the tensor-core kernel: warps 0-3 run the mma steps (16 heads x 8 rows each
// in S, HD / 4 dims each in O); all 8 warps load, decode the rows and rotate q (the row
// decode is a chain of integer / float steps per element: with one warp per scheduler it
// took ~3 us of the ~9 at 8k).
constexpr int kMmaThreads = 256;

// PIPE (prefill chunks: one split, T > 8): the next chunk's selected-row ids are loaded
// into registers while the current chunk's rows land and are decoded, and its row copies
// are issued right after the decode, so they stream during the current chunk's products
// instead of after them (the decode-sized launches keep the chunk-at-a-time loop). Same
// operations in the same order: bit-identical output.
template <int HD, bool PIPE = false>
__global__ void __launch_bounds__(kMmaThreads) attn_mma_kernel(AttnParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int QS = HD + 8;  // q_s / kv_s row stride (elements)
  constexpr int PS = kC + 8;  // p_s row stride
  constexpr int NTW = HD / 32;  // 8-dim output tiles per warp (HD / 4 dims)
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* q_s = reinterpret_cast<bf16*>(smem);
  bf16* kv_s = q_s + 16 * QS;
  bf16* p_s = kv_s + kC * QS;
  float* s_s = reinterpret_cast<float*>(p_s + 16 * PS);
  float* m_s = s_s + 16 * kC;
  float* l_s = m_s + 16;
  float* al_s = l_s + 16;
  uint8_t* raw_s = reinterpret_cast<uint8_t*>(al_s + 16);  // (kAsyncRows) raw rows of a chunk
  int32_t* ids_s = reinterpret_cast<int32_t*>(raw_s + kC * kRawRow<HD>);

  const int t = blockIdx.z, hg = blockIdx.y, split = blockIdx.x, S = gridDim.x;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gid = lane >> 2, tig = lane & 3;
  // Programmatic dependent launch: q comes from the previous kernel; the position (advanced
  // by the previous step), the RoPE table and the window rows from kernels that completed
  // before this one launched, and the selection too when p.sel_early (else from the previous
  // kernel, the top-k). What does not depend on the previous kernel is done before the wait.
  const int64_t p0 = *p.d_pos, pos = p0 + t;
  const int64_t lo_w = pos - p.W + 1 > 0 ? pos - p.W + 1 : 0;
  const int nw = static_cast<int>(pos - lo_w + 1);
  if (p.q_inv_freq) {
    // (cos, sin) of each RoPE pair of the queries (one f64 sincos per thread) into s_s,
    // which the chunk loop only uses after its first barrier
    for (int k = tid; k < p.n_pairs; k += kMmaThreads)
      rope_cs(static_cast<float>(pos), p.q_inv_freq[k], s_s[k], s_s[p.n_pairs + k]);
  }
  int ns = 0, rb = 0, re = 0;
  auto rows_of_split = [&]() {
    ns = p.sel ? p.sel_count[t] : 0;
    const int N = nw + ns;
    const int R = (N + S - 1) / S;
    rb = split * R;
    re = min(N, rb + R);
  };

  // the ids of a chunk's selected rows (one load per row), then its rows in flight
  auto issue_chunk = [&](int c0) {
    const int nr = min(kC, re - c0);
    if (tid < nr && c0 + tid >= nw) ids_s[tid] = p.sel[static_cast<int64_t>(t) * p.sel_ld + (c0 + tid - nw)];
    __syncthreads();
    copy_rows_async<HD, kMmaThreads>(p, c0, nr, nw, lo_w, p0, ids_s, raw_s);
  };
  if (p.sel_early) {  // (uniform over the block: issue_chunk has a barrier)
    rows_of_split();
    if constexpr (kAsyncRows<HD>)
      if (rb < re) issue_chunk(rb);
  }
  dev::pdl_wait();
  dev::pdl_launch_dependents();
  if (!p.sel_early) rows_of_split();
  const bf16* qg = static_cast<const bf16*>(p.q) + (static_cast<int64_t>(t) * p.H + hg * 16) * HD;
  {  // all of a thread's loads in flight at once, then the stores
    constexpr int QN = 16 * (HD / 8), QI = (QN + kMmaThreads - 1) / kMmaThreads;
    uint4 v[QI];
#pragma unroll
    for (int u = 0; u < QI; ++u) {
      const int i = tid + u * kMmaThreads, h = i / (HD / 8), c = i - h * (HD / 8);
      if (QN % kMmaThreads == 0 || i < QN) v[u] = *reinterpret_cast<const uint4*>(qg + h * HD + c * 8);
    }
    // (the first chunk's rows load while the queries are stored and rotated)
    if constexpr (kAsyncRows<HD>)
      if (!p.sel_early && rb < re) issue_chunk(rb);
#pragma unroll
    for (int u = 0; u < QI; ++u) {
      const int i = tid + u * kMmaThreads, h = i / (HD / 8), c = i - h * (HD / 8);
      if (QN % kMmaThreads == 0 || i < QN) *reinterpret_cast<uint4*>(q_s + h * QS + c * 8) = v[u];
    }
  }
  if (p.q_inv_freq) {
    // RoPE of the queries at this row's position, rounded to bf16: what rope() would
    // have written to q before the call (same rope_cs / rope_pair), one launch fewer;
    // (cos, sin) of the pairs were computed before the wait
    const int np = p.n_pairs, off = HD - 2 * np;
    __syncthreads();
    for (int i = tid; i < 16 * np; i += kMmaThreads) {
      const int h = i / np, k = i - h * np;
      const float c = s_s[k], s = s_s[np + k];
      uint16_t* qp = reinterpret_cast<uint16_t*>(q_s + h * QS + off + 2 * k);
      float ra, rb;
      rope_pair(bf16_to_f32(qp[0]), bf16_to_f32(qp[1]), c, s, false, ra, rb);
      qp[0] = f32_to_bf16(ra);
      qp[1] = f32_to_bf16(rb);
    }
  }
  const bool mk_last = split == S - 1 && hg == 0 && t == 0;  // (trace marks: block 0 and the last split)
  dev::trace_mark(11);
  dev::trace_mark(21, mk_last);
  if (tid < 16) {
    m_s[tid] = -INFINITY;
    l_s[tid] = 0.0f;
  }
  float acc[NTW][4];
#pragma unroll
  for (int j = 0; j < NTW; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

  for (int c0 = rb; c0 < re; c0 += kC) {
    const int nr = min(kC, re - c0);
    if constexpr (PIPE && kAsyncRows<HD>) {
      const int c1 = c0 + kC, nr1 = c1 < re ? min(kC, re - c1) : 0;
      int32_t nid = 0;  // (the next chunk's selected-row id of this thread: in flight meanwhile)
      if (tid < nr1 && c1 + tid >= nw) nid = p.sel[static_cast<int64_t>(t) * p.sel_ld + (c1 + tid - nw)];
      dev::cp_async_commit();
      dev::cp_async_wait<0>();
      __syncthreads();  // (this chunk's rows have landed; kv_s, s_s, p_s and ids_s are free)
      dev::trace_mark(12);
      dev::trace_mark(22, mk_last);
      convert_rows<HD, kMmaThreads>(raw_s, c0, nr, nw, kv_s, QS);
      if (tid < nr1) ids_s[tid] = nid;
      __syncthreads();
      if (nr1 > 0) copy_rows_async<HD, kMmaThreads>(p, c1, nr1, nw, lo_w, p0, ids_s, raw_s);
    } else {
      __syncthreads();
      if constexpr (kAsyncRows<HD>) {
        if (c0 != rb) issue_chunk(c0);
        dev::cp_async_commit();
        dev::cp_async_wait<0>();
        __syncthreads();
        dev::trace_mark(12);
        dev::trace_mark(22, mk_last);
        convert_rows<HD, kMmaThreads>(raw_s, c0, nr, nw, kv_s, QS);
      } else {
        decode_rows<HD, kMmaThreads>(p, t, c0, nr, nw, lo_w, p0, kv_s, QS, true);
      }
      __syncthreads();
    }
    dev::trace_mark(15);
    if (warp < 4) {  // (mma warps)
      // S tile of this warp: 16 heads x key rows 8w .. 8w+7, as four independent mma
      // chains (k steps 4i .. 4i + 3 of each 64 dims), added at the end: a chain of
      // HD / 64 dependent mma instead of HD / 16
      float sc4[4][4] = {};
#pragma unroll 2
      for (int k0 = 0; k0 < HD; k0 += 64) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int k1 = k0 + 32 * hh;
          uint32_t a[4], a2[4], b[4];
          ldsm_x4(a, q_s + (lane & 15) * QS + k1 + (lane >> 4) * 8);
          ldsm_x4(a2, q_s + (lane & 15) * QS + k1 + 16 + (lane >> 4) * 8);
          ldsm_x4(b, kv_s + (8 * warp + (lane & 7)) * QS + k1 + (lane >> 3) * 8);
          float(&c0)[4] = sc4[2 * hh];
          float(&c1)[4] = sc4[2 * hh + 1];
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(c0[0]), "+f"(c0[1]), "+f"(c0[2]), "+f"(c0[3])
              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(c1[0]), "+f"(c1[1]), "+f"(c1[2]), "+f"(c1[3])
              : "r"(a2[0]), "r"(a2[1]), "r"(a2[2]), "r"(a2[3]), "r"(b[2]), "r"(b[3]));
        }
      }
      float sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) sc[i] = (sc4[0][i] + sc4[1][i]) + (sc4[2][i] + sc4[3][i]);
      {
        const int r0 = 8 * warp + 2 * tig;
        s_s[gid * kC + r0] = r0 < nr ? sc[0] * p.scale : -INFINITY;
        s_s[gid * kC + r0 + 1] = r0 + 1 < nr ? sc[1] * p.scale : -INFINITY;
        s_s[(gid + 8) * kC + r0] = r0 < nr ? sc[2] * p.scale : -INFINITY;
        s_s[(gid + 8) * kC + r0 + 1] = r0 + 1 < nr ? sc[3] * p.scale : -INFINITY;
      }
    }
    __syncthreads();
    dev::trace_mark(13);
    dev::trace_mark(23, mk_last);
    // online softmax: head h = tid / 8, rows 4 * (tid % 8) .. + 3 (warps 0-3)
    if (tid < 128) {
      const int h = tid >> 3, sub = tid & 7;
      float v[4];
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = s_s[h * kC + sub * 4 + i];
        mx = fmaxf(mx, v[i]);
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      const float m_old = m_s[h];
      const float m_new = fmaxf(m_old, mx);
      float ps = 0.0f;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pv = sub * 4 + i < nr ? expf(v[i] - m_new) : 0.0f;
        ps += pv;
        p_s[h * PS + sub * 4 + i] = __float2bfloat16_rn(pv);
      }
      ps += __shfl_xor_sync(0xffffffffu, ps, 1);
      ps += __shfl_xor_sync(0xffffffffu, ps, 2);
      ps += __shfl_xor_sync(0xffffffffu, ps, 4);
      const float alpha = expf(m_old - m_new);
      if (sub == 0) {
        m_s[h] = m_new;
        l_s[h] = l_s[h] * alpha + ps;
        al_s[h] = alpha;
      }
    }
    __syncthreads();
    // O += P V on this warp's dims (mma warps)
    if (warp < 4) {
      const float al0 = al_s[gid], al1 = al_s[gid + 8];
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        acc[j][0] *= al0;
        acc[j][1] *= al0;
        acc[j][2] *= al1;
        acc[j][3] *= al1;
      }
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 16) {
        uint32_t a[4];
        ldsm_x4(a, p_s + (lane & 15) * PS + k0 + (lane >> 4) * 8);
#pragma unroll
        for (int j = 0; j < NTW; j += 2) {
          const int n0 = warp * (HD / 4) + j * 8;
          uint32_t b[4];
          ldsm_x4_trans(b, kv_s + (k0 + (lane & 7) + ((lane >> 3) & 1) * 8) * QS + n0 + (lane >> 4) * 8);
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(acc[j][0]), "+f"(acc[j][1]), "+f"(acc[j][2]), "+f"(acc[j][3])
              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
          asm volatile(
              "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
              "{%0, %1, %2, %3};\n"
              : "+f"(acc[j + 1][0]), "+f"(acc[j + 1][1]), "+f"(acc[j + 1][2]), "+f"(acc[j + 1][3])
              : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[2]), "r"(b[3]));
        }
      }
    }
  }
  __syncthreads();
  dev::trace_mark(14);
  dev::trace_mark(24, mk_last);

  // ---- output: acc[j][0..1] -> head gid, acc[j][2..3] -> head gid + 8; dims n0 + 2 tig + {0, 1}
  if (warp >= 4) return;
#pragma unroll
  for (int which = 0; which < 2; ++which) {
    const int hl = gid + 8 * which;
    const int h = hg * 16 + hl;
    const float m = m_s[hl], l = l_s[hl];
    if (S == 1) {
      const float scl = sink_scale(m, l, p.sink[h]);
      bf16* o = static_cast<bf16*>(p.out) + (static_cast<int64_t>(t) * p.H + h) * HD;
      const int off = HD - 2 * p.n_pairs;
      const float fpos = static_cast<float>(pos);
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const int d = warp * (HD / 4) + j * 8 + 2 * tig;
        float v0 = round_bf16_dev(acc[j][2 * which] * scl), v1 = round_bf16_dev(acc[j][2 * which + 1] * scl);
        out_rope_pair<bf16>(v0, v1, d, off, fpos, p.inv_freq);
        o[d] = __float2bfloat16_rn(v0);
        o[d + 1] = __float2bfloat16_rn(v1);
      }
    } else {
      float* w = p.work + ((static_cast<int64_t>(t) * S + split) * p.H + h) * (HD + 2);
      if (warp == 0 && tig == 0) {
        w[0] = m;
        w[1] = l;
      }
#pragma unroll
      for (int j = 0; j < NTW; ++j) {  // (w + 2 + d: 8-byte aligned, HD + 2 and d even)
        const int d = warp * (HD / 4) + j * 8 + 2 * tig;
        *reinterpret_cast<float2*>(w + 2 + d) = make_float2(acc[j][2 * which], acc[j][2 * which + 1]);
      }
    }
  }
#else
  __trap();
#endif
}

// Combine of the row splits: one block per (head, query), one thread per dim.
constexpr int kMaxCombineSplits = 256;
template <typename T, int HD>
__global__ void __launch_bounds__(HD) attn_combine_kernel(int H, int S, const float* __restrict__ work,
                                                          const float* __restrict__ sink_arr, int n_pairs,
                                                          const float* __restrict__ inv_freq, T* __restrict__ out,
                                                          const int64_t* __restrict__ d_pos) {
  __shared__ float fs[kMaxCombineSplits];  // m_s, then exp(m_s - M), per split
  __shared__ float ls[kMaxCombineSplits];  // l_s per split
  __shared__ float cs[2 * (HD / 2)];       // inverse-RoPE cos / sin per pair
  __shared__ float den_s;
  const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
  dev::pdl_launch_dependents();  // (wo_a's blocks launch meanwhile; its weights stream before its wait)
  // before the wait: the sink and the inverse-RoPE table (the position was advanced by the
  // previous step), which do not depend on the attention kernel
  const float sink = d < 32 ? sink_arr[h] : 0.0f;
  if (inv_freq && d >= 32 && d < 32 + n_pairs) {
    const int k = d - 32;
    rope_cs(static_cast<float>(*d_pos + t), inv_freq[k], cs[k], cs[HD / 2 + k]);
  }
  dev::pdl_wait();  // the split results come from the attention kernel
  const float* w0 = work + (static_cast<int64_t>(t) * S * H + h) * (HD + 2);
  const int64_t sstride = static_cast<int64_t>(H) * (HD + 2);
  // The split maxima and denominators are read once (warp 0), not by every thread; then
  // each thread reads its S values with independent loads (one round of L2 latency
  // instead of six).
  if (d < 32) {  // M = max(sink, m_s) and the denominator e^(sink-M) + sum_s l_s e^(m_s-M): lane d
    // holds splits d, d + 32, ...; warp max and sum (a fixed tree order)
    float M = sink, part = 0.0f;
    for (int s = d; s < S; s += 32) {  // m_s, l_s of every split, loaded in parallel
      fs[s] = __ldcg(w0 + s * sstride);
      ls[s] = __ldcg(w0 + s * sstride + 1);
      M = fmaxf(M, fs[s]);
    }
    M = dev::warp_max(M);
    for (int s = d; s < S; s += 32) {
      const float f = expf(fs[s] - M);
      fs[s] = f;
      part = fmaf(ls[s], f, part);
    }
    part = dev::warp_sum(part);
    if (d == 0) den_s = expf(sink - M) + part;
  }
  __syncthreads();
  dev::trace_mark(31);
  float o = 0.0f;
  // (20 loads at once: the decode's 20 splits in one L2 round trip instead of three;
  // 40 registers instead of 32, -4.5 us per 8-layer step, s16 run13)
#pragma unroll 20
  for (int s = 0; s < S; ++s) o = fmaf(__ldcg(w0 + s * sstride + 2 + d), fs[s], o);
  float v = rnd<T>(o / den_s);
  if (inv_freq) {  // the conjugate rotation of pair (d, d ^ 1), as rope_lane(.., inverse = true)
    const float other = __shfl_xor_sync(0xffffffffu, v, 1);
    const int off = HD - 2 * n_pairs;
    if (d >= off) {
      const int k = (d - off) >> 1;
      float ra, rb;
      if ((d & 1) == 0) {
        rope_pair(v, other, cs[k], cs[HD / 2 + k], true, ra, rb);
        v = ra;
      } else {
        rope_pair(other, v, cs[k], cs[HD / 2 + k], true, ra, rb);
        v = rb;
      }
      v = rnd<T>(v);
    }
  }
  st(out, (static_cast<int64_t>(t) * H + h) * HD + d, v);
}

template <typename T, int HD, int HB>
void launch_attn(const AttnArgs& a, const AttnParams& prm, cudaStream_t stream) {
  constexpr size_t smem = attn_smem_bytes<HD, HB>();
  static bool configured = false;  // per instantiation
  if (!configured) {
    DSX_CUDA_CHECK(cudaFuncSetAttribute(attn_kernel<T, HD, HB>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    configured = true;
  }
  dim3 grid(a.n_splits, a.n_heads / HB, a.T);
  attn_kernel<T, HD, HB><<<grid, HB * 16, smem, stream>>>(prm);
  check_launch("sparse_attention");
  if (a.n_splits > 1) {
    attn_combine_kernel<T, HD><<<dim3(a.n_heads, a.T), HD, 0, stream>>>(
        a.n_heads, a.n_splits, a.work, a.sink, a.n_pairs, a.inv_freq, static_cast<T*>(a.out), a.d_pos);
    check_launch("sparse_attention combine");
  }
}

// The tensor-core kernel needs sm_80+ device code in the build.
bool mma_available() {
  static int cached = -1;
  if (cached < 0) {
    int dev = 0, major = 0;
    cudaFuncAttributes fa{};
    cached = cudaGetDevice(&dev) == cudaSuccess &&
                     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                     major >= 8 && cudaFuncGetAttributes(&fa, attn_mma_kernel<512>) == cudaSuccess &&
                     fa.ptxVersion >= 80
                 ? 1
                 : 0;
    cudaGetLastError();
  }
  return cached == 1;
}

template <int HD, bool PIPE>
void launch_mma_kernel(const AttnArgs& a, const AttnParams& prm, cudaStream_t stream) {
  constexpr size_t smem = attn_mma_smem_bytes<HD>();
  static bool configured = false;  // per instantiation
  if (!configured) {
    DSX_CUDA_CHECK(cudaFuncSetAttribute(attn_mma_kernel<HD, PIPE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    configured = true;
  }
  dim3 grid(a.n_splits, a.n_heads / 16, a.T);
  detail::launch_pdl(attn_mma_kernel<HD, PIPE>, grid, dim3(kMmaThreads), smem, stream, prm);
}

template <int HD>
void launch_mma(const AttnArgs& a, const AttnParams& prm, cudaStream_t stream) {
  if (a.n_splits == 1 && a.T > 8)
    launch_mma_kernel<HD, true>(a, prm, stream);
  else
    launch_mma_kernel<HD, false>(a, prm, stream);
  if (a.n_splits > 1)
    detail::launch_pdl(attn_combine_kernel<bf16, HD>, dim3(a.n_heads, a.T), dim3(HD), 0, stream, a.n_heads,
                       a.n_splits, static_cast<const float*>(a.work), static_cast<const float*>(a.sink), a.n_pairs,
                       static_cast<const float*>(a.inv_freq), static_cast<bf16*>(a.out),
                       static_cast<const int64_t*>(a.d_pos));
}

template <typename T, int HD>
void dispatch_hb(const AttnArgs& a, const AttnParams& prm, cudaStream_t stream) {
  if constexpr (std::is_same<T, bf16>::value && HD % 64 == 0) {
    if (a.tensor_cores && a.n_heads % 16 == 0 && mma_available()) {
      launch_mma<HD>(a, prm, stream);
      return;
    }
  }
  if (a.n_heads % 16 == 0) launch_attn<T, HD, 16>(a, prm, stream);
  else if (a.n_heads == 8) launch_attn<T, HD, 8>(a, prm, stream);
  else if (a.n_heads == 4) launch_attn<T, HD, 4>(a, prm, stream);
  else if (a.n_heads == 2) launch_attn<T, HD, 2>(a, prm, stream);
  else fail("sparse_attention: unsupported head count ", a.n_heads);
}

template <typename T>
void dispatch_hd(const AttnArgs& a, const AttnParams& prm, cudaStream_t stream) {
  switch (a.head_dim) {
    case 64: dispatch_hb<T, 64>(a, prm, stream); break;
    case 128: dispatch_hb<T, 128>(a, prm, stream); break;
    case 256: dispatch_hb<T, 256>(a, prm, stream); break;
    case 512: dispatch_hb<T, 512>(a, prm, stream); break;
    default: fail("sparse_attention: unsupported head dim ", a.head_dim, " (64, 128, 256, 512)");
  }
}

}  // namespace

bool attention_tensor_cores_available() { return mma_available(); }

size_t attention_work_floats(int T, int n_heads, int head_dim, int n_splits) {
  return n_splits > 1 ? static_cast<size_t>(T) * n_splits * n_heads * (head_dim + 2) : 0;
}

int attention_decode_splits(int window, int max_sel) {
  const int s = (window + max_sel + kC - 1) / kC;
  return s < 1 ? 1 : s > kMaxCombineSplits ? kMaxCombineSplits : s;
}

void sparse_attention(Act act, const AttnArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.n_splits >= 1 && (a.n_splits == 1 || a.work), "sparse_attention: splitting needs a workspace");
  DSX_CHECK(a.n_splits <= kMaxCombineSplits, "sparse_attention: at most ", kMaxCombineSplits, " splits");
  DSX_CHECK(!a.q_inv_freq || (a.n_pairs > 0 && 2 * a.n_pairs <= a.head_dim), "sparse_attention: query rope pairs");
  DSX_CHECK(a.ring.dim == a.head_dim && a.chunk.dim == a.head_dim, "sparse_attention: window row width");
  DSX_CHECK(!a.sel || (a.cmp.packed && a.cmp.dim == a.head_dim && a.sel_count), "sparse_attention: compressed rows");
  DSX_CHECK(a.window >= 1 && a.ring_cap >= a.window, "sparse_attention: window");
  DSX_CHECK(!a.inv_freq || (a.n_pairs > 0 && 2 * a.n_pairs <= a.head_dim), "sparse_attention: rope pairs");
  AttnParams prm{};
  prm.H = a.n_heads;
  prm.W = a.window;
  prm.ring_cap = a.ring_cap;
  prm.n_pairs = a.n_pairs;
  prm.q = a.q;
  prm.ring_codes = a.ring.codes;
  prm.ring_scales = a.ring.scales;
  prm.chunk_codes = a.chunk.codes;
  prm.chunk_scales = a.chunk.scales;
  prm.cmp_packed = a.cmp.packed;
  prm.cmp_scales = a.cmp.scales;
  prm.sel = a.sel;
  prm.sel_ld = a.sel_ld;
  prm.sel_count = a.sel_count;
  prm.sel_early = a.sel_early || !a.sel;
  prm.sink = a.sink;
  prm.scale = a.scale;
  prm.inv_freq = a.inv_freq;
  prm.out = a.out;
  if (a.q_inv_freq) {
    // the tensor-core kernel rotates the queries itself; the others get them rotated
    // in place first (rope(), as the caller would have done)
    if (act == Act::BF16 && a.tensor_cores && a.n_heads % 16 == 0 && a.head_dim % 64 == 0 && mma_available())
      prm.q_inv_freq = a.q_inv_freq;
    else
      rope(act, const_cast<void*>(a.q), a.T, a.n_heads, a.head_dim, a.n_pairs, a.q_inv_freq, a.d_pos, false, stream);
  }
  prm.d_pos = a.d_pos;
  prm.work = a.work;
  DSX_DISPATCH_ACT(act, T, dispatch_hd<T>(a, prm, stream));
}

}  // namespace dsx::cuda
