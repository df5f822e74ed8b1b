#include "kernels/cuda/indexer.h"

#include <cmath>
#include <type_traits>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/pdl_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

// Scoring blocks: TH threads x RPT rows per thread. Short row lists (decode at a few
// thousand compressed rows) spread the work over the SMs: 128 threads for 32 rows for up
// to kSplitMaxT queries (the heads split over 4 threads per row, see kGroups), else 64 x 1
// (128 x 2 put 8192 rows on 33 SMs: 21 us in the H200 decode graph, 64 x 1: 13 us); long
// ones 128 x 2, which stages q once per 256 rows. Each (row, head) dot product is the same
// sequential chain either way.

// 32 FQ4e8 key values of one scale block: 16 packed bytes + one ue8m0 byte.
__device__ __forceinline__ void decode32(const uint8_t* __restrict__ p, uint32_t sbyte, float* out) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const float s = e8m0_dev(sbyte);
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int n = 0; n < 8; ++n) out[i * 8 + n] = e2m1_dev((w[i] >> (4 * n)) & 15u) * s;
}

// kGroups > 1 (short row lists): the heads of a row are split over kGroups threads (H /
// kGroups heads each; lanes l, l + 32 / kGroups, ... of a warp hold a row's groups, so
// the lanes of a quarter warp read one q address), which puts kGroups times more warps
// on the SMs: with one thread per row the 64-thread blocks issued one instruction per ~3
// cycles per warp with ~2 warps per SM (ncu, 14 us at 8k rows). The per-head dot products are the
// same chains; the head terms are gathered by shuffles and added in head order, as before.
template <typename T, int H, int kThreads, int kRowsPerThread, int kGroups = 1>
__global__ void __launch_bounds__(kThreads) indexer_scores_kernel(
    int hd, int r, const float* __restrict__ q, const T* __restrict__ w, const uint8_t* __restrict__ kp,
    const uint8_t* __restrict__ ks, const int32_t* __restrict__ cand_blocks, int64_t cand_ld,
    const int32_t* __restrict__ cand_count, int cbs, float* __restrict__ scores, int64_t ld_scores,
    int32_t* __restrict__ counts, const int64_t* __restrict__ d_pos, float softmax_scale, float heads_scale,
    float weight_factor) {
  static_assert(kGroups == 1 || kGroups == 2 || kGroups == 4, "head groups: 1, 2 or 4 (lanes l + (32 / kGroups) g)");
  static_assert(H % kGroups == 0, "heads split evenly");
  constexpr int HG = H / kGroups;                      // heads of a thread
  constexpr int kRowThreads = kThreads / kGroups;       // row slots per pass
  extern __shared__ float4 q_s4[];  // [H, hd] f32
  __shared__ float w_s[H];
  constexpr bool kBf16 = !std::is_same<T, float>::value;
  const int t = blockIdx.y;
  pdl_launch_dependents();  // (the top-k launches meanwhile and waits for all of this kernel)
  // Before the wait: the position (advanced by the previous step), the candidate blocks
  // (an earlier layer's top-k), the head weights and the keys (the indexer weights and the
  // compressor, on side branches joined before this kernel) do not come from the previous
  // kernel; this block's key rows are prefetched into L2 meanwhile. q comes from the
  // previous kernel (the queries' RoPE).
  const int64_t p0 = *d_pos;
  const int64_t n_vis = (p0 + t + 1) / r;
  const bool cand = cand_blocks != nullptr;
  const int64_t count = cand ? static_cast<int64_t>(cand_count[t]) * cbs : n_vis;
  if (blockIdx.x == 0 && threadIdx.x == 0) counts[t] = static_cast<int32_t>(count);
  const int64_t base = static_cast<int64_t>(blockIdx.x) * (kRowThreads * kRowsPerThread);
  if (base >= count) return;
  for (int i = threadIdx.x; i < kRowThreads * kRowsPerThread; i += kThreads) {
    const int64_t ix = base + i;
    if (ix >= count) break;
    const int64_t j = cand ? static_cast<int64_t>(cand_blocks[t * cand_ld + ix / cbs]) * cbs + ix % cbs : ix;
    if (j < n_vis) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(kp + j * (hd / 2)));
      if ((j & 31) == 0 || i == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(ks + j * (hd / 32)));
    }
  }
  // the head weights too: the indexer weights' branch is joined before this launch (or
  // ran on this stream before the last weight kernel)
  for (int h = threadIdx.x; h < H; h += kThreads) {
    const float wv = ld(w, static_cast<int64_t>(t) * H + h);
    w_s[h] = kBf16 ? round_bf16_dev(wv * weight_factor) : wv * heads_scale;
  }
  pdl_wait();

  float* q_s = reinterpret_cast<float*>(q_s4);
  const float4* qt = reinterpret_cast<const float4*>(q + static_cast<int64_t>(t) * H * hd);  // H hd % 4 == 0
  for (int i = threadIdx.x; i < H * hd / 4; i += kThreads) q_s4[i] = qt[i];
  __syncthreads();

  // this thread: head group g (heads g HG ..), row slot rs
  constexpr int RW = 32 / kGroups;  // rows of a warp (kGroups > 1): lane = RW g + row
  const int lane = threadIdx.x & 31;
  const int g = kGroups == 1 ? 0 : lane / RW;
  const int rs = kGroups == 1 ? static_cast<int>(threadIdx.x) : (threadIdx.x >> 5) * RW + lane % RW;
  int64_t idx[kRowsPerThread], row[kRowsPerThread];
  bool valid[kRowsPerThread];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    idx[k] = base + k * kRowThreads + rs;
    int64_t j = idx[k];
    if (cand && idx[k] < count) j = static_cast<int64_t>(cand_blocks[t * cand_ld + idx[k] / cbs]) * cbs + idx[k] % cbs;
    valid[k] = idx[k] < count && j < n_vis;
    row[k] = valid[k] ? j : 0;  // invisible rows read row 0 (exists whenever count > 0)
  }

  float acc[kRowsPerThread][HG];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k)
#pragma unroll
    for (int h = 0; h < HG; ++h) acc[k][h] = 0.0f;

  const int nb = hd / 32;
  for (int b = 0; b < nb; ++b) {
    float kv[kRowsPerThread][32];
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k)
      decode32(kp + row[k] * (hd / 2) + b * 16, ks[row[k] * nb + b], kv[k]);
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      const float4* qh = reinterpret_cast<const float4*>(q_s + (g * HG + h) * hd + b * 32);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float4 qv = qh[e];
#pragma unroll
        for (int k = 0; k < kRowsPerThread; ++k) {
          float a = acc[k][h];
          a = fmaf(qv.x, kv[k][4 * e + 0], a);
          a = fmaf(qv.y, kv[k][4 * e + 1], a);
          a = fmaf(qv.z, kv[k][4 * e + 2], a);
          a = fmaf(qv.w, kv[k][4 * e + 3], a);
          acc[k][h] = a;
        }
      }
    }
  }

  float* st_row = scores + static_cast<int64_t>(t) * ld_scores;
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    // head h's value: acc[k][h % HG] of group h / HG (lane lane % RW + RW (h / HG))
    auto head = [&](int h) {
      if constexpr (kGroups == 1) {
        return acc[k][h];
      } else {
        return __shfl_sync(0xffffffffu, acc[k][h % HG], lane % RW + RW * (h / HG));
      }
    };
    float s = 0.0f;
    if (kBf16) {
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const float dd = fmaxf(round_bf16_dev(head(h)), 0.0f);
        s += round_bf16_dev(dd * w_s[h]);
      }
      s = round_bf16_dev(s);
    } else {
#pragma unroll
      for (int h = 0; h < H; ++h) s = fmaf(fmaxf(head(h), 0.0f) * softmax_scale, w_s[h], s);
    }
    if (g == 0 && idx[k] < count) st_row[idx[k]] = valid[k] ? s : -INFINITY;
  }
}

// ---- prefill: the dot products on the tensor cores (BF16 mode, T >= kMmaMinT) ---------
// FQ4e8 values (e2m1 x a power of two) are exact in bf16 and so are their products in
// f32: an mma.sync m16n8k16 bf16 product with f32 accumulation gives the dot products of
// the CUDA-core kernel up to the f32 summation order, and those sums are exact whatever
// the order (few significant bits; test_cuda_indexer.cpp). Block = TQ queries (A rows:
// query-major, then head; the queries of a plain chunk share their rows, which are
// decoded once for the TQ of them; candidate lists differ per query: TQ = 1) x a range
// of kMmaBlockRows rows, in chunks of kMmaRows: decode the chunk's keys to bf16 in
// shared memory (the next chunk's raw bytes are loaded meanwhile), A x K^T on 8 warps,
// the dot products through shared memory to one thread per (query, row), which forms
// the score over the heads in head order exactly as indexer_scores_kernel does.
constexpr int kMmaMinT = 32;
constexpr int kMmaThreads = 256;
constexpr int kMmaRows = 64;
constexpr int kMmaBlockRows = 1024;

struct MmaParams {
  int T, r;
  const float* q;
  const bf16* w;  // [T, H] (BF16 mode)
  const uint8_t* kp;
  const uint8_t* ks;
  const int32_t* cand_blocks;
  int64_t cand_ld;
  const int32_t* cand_count;
  int cbs;
  float* scores;
  int64_t ld;
  int32_t* counts;
  const int64_t* d_pos;
  float weight_factor;
};

template <int H, int HD, int TQ>
constexpr size_t mma_smem_bytes() {
  return static_cast<size_t>(TQ * H + kMmaRows) * (HD + 8) * 2 + static_cast<size_t>(TQ * H) * (kMmaRows + 8) * 4 +
         static_cast<size_t>(TQ * H) * 4;
}

template <typename P>
__device__ __forceinline__ void idx_ldsm_x4(uint32_t (&r)[4], const P* ptr) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ void idx_mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two values exact in bf16 (truncation is exact), packed low | high.
__device__ __forceinline__ uint32_t idx_pack_bf16x2(float a, float b) {
  return (__float_as_uint(a) >> 16) | (__float_as_uint(b) & 0xffff0000u);
}

template <int H, int HD, int TQ, bool CAND>
__global__ void __launch_bounds__(kMmaThreads) indexer_scores_mma_kernel(const MmaParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int M = TQ * H;              // A rows
  constexpr int QS = HD + 8;             // bf16 row stride of q_s / k_s
  constexpr int DS = kMmaRows + 8;       // f32 row stride of d_s (8 rows of a fragment: distinct banks)
  constexpr int MT = M / 16, NT = kMmaRows / 8;
  constexpr int NPW = MT * NT / (kMmaThreads / 32);  // n-tiles per warp
  constexpr int PPR = HD / 32;           // 32-value pieces per key row
  constexpr int PT = (kMmaRows * PPR + kMmaThreads - 1) / kMmaThreads;  // pieces per thread
  static_assert(H % 16 == 0 && HD % 32 == 0 && (MT * NT) % (kMmaThreads / 32) == 0 && NPW >= 1, "mma tiling");
  static_assert(!CAND || TQ == 1, "candidate lists differ per query");
  extern __shared__ __align__(16) unsigned char smem[];
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem);  // [M][QS]
  uint16_t* k_s = q_s + M * QS;                       // [kMmaRows][QS]
  float* d_s = reinterpret_cast<float*>(k_s + kMmaRows * QS);  // [M][DS]
  float* w_s = d_s + M * DS;                          // [M]
  __shared__ int64_t cnt_s[TQ], nvis_s[TQ];

  const int t0 = blockIdx.y * TQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid < TQ) {
    const int t = t0 + tid;
    int64_t nv = 0, c = 0;
    if (t < p.T) {
      nv = (*p.d_pos + t + 1) / p.r;
      c = CAND ? static_cast<int64_t>(p.cand_count[t]) * p.cbs : nv;
      if (blockIdx.x == 0) p.counts[t] = static_cast<int32_t>(c);
    }
    nvis_s[tid] = nv;
    cnt_s[tid] = c;
  }
  __syncthreads();
  int64_t limit = 0;
#pragma unroll
  for (int k = 0; k < TQ; ++k) limit = cnt_s[k] > limit ? cnt_s[k] : limit;
  const int64_t rb = static_cast<int64_t>(blockIdx.x) * kMmaBlockRows;
  if (rb >= limit) return;  // (uniform)
  const int64_t re = limit < rb + kMmaBlockRows ? limit : rb + kMmaBlockRows;

  // the queries as bf16 (exact) and the head weights
  for (int i = tid; i < M * HD / 4; i += kMmaThreads) {
    const int m = i / (HD / 4), c4 = i - m * (HD / 4);
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (t0 + m / H < p.T) v = reinterpret_cast<const float4*>(p.q + (static_cast<int64_t>(t0) * H + m) * HD)[c4];
    *reinterpret_cast<uint2*>(q_s + m * QS + c4 * 4) = make_uint2(idx_pack_bf16x2(v.x, v.y), idx_pack_bf16x2(v.z, v.w));
  }
  for (int m = tid; m < M; m += kMmaThreads) {
    const int t = t0 + m / H;
    w_s[m] = t < p.T ? round_bf16_dev(ld(p.w, static_cast<int64_t>(t) * H + m % H) * p.weight_factor) : 0.0f;
  }

  // the row of list entry i (query tt), or -1 when it is not visible / past the list
  auto row_of = [&](int tt, int64_t i) -> int64_t {
    if constexpr (CAND) {
      if (i >= cnt_s[tt]) return -1;
      const int64_t j = static_cast<int64_t>(p.cand_blocks[(t0 + tt) * p.cand_ld + i / p.cbs]) * p.cbs + i % p.cbs;
      return j < nvis_s[tt] ? j : -1;
    } else {
      return i < limit ? i : -1;
    }
  };
  uint4 raw[PT];
  uint32_t rsc[PT];
  bool rok[PT];
  auto load_chunk = [&](int64_t c0) {
#pragma unroll
    for (int u = 0; u < PT; ++u) {
      const int g = tid + u * kMmaThreads, r = g / PPR, b = g - r * PPR;
      rok[u] = false;
      raw[u] = make_uint4(0u, 0u, 0u, 0u);
      rsc[u] = 0u;
      if (g < kMmaRows * PPR && c0 < re) {
        const int64_t j = row_of(0, c0 + r);
        if (j >= 0) {
          raw[u] = *reinterpret_cast<const uint4*>(p.kp + j * (HD / 2) + b * 16);
          rsc[u] = p.ks[j * PPR + b];
          rok[u] = true;
        }
      }
    }
  };
  load_chunk(rb);
  const int mt = warp % MT, nt0 = (warp / MT) * NPW;
  const int gid = lane >> 2, tig = lane & 3;
  for (int64_t c0 = rb; c0 < re; c0 += kMmaRows) {
    // decode the chunk's keys (bf16, exact; zeros for rows past the list)
#pragma unroll
    for (int u = 0; u < PT; ++u) {
      const int g = tid + u * kMmaThreads, r = g / PPR, b = g - r * PPR;
      if (g >= kMmaRows * PPR) continue;
      const float s = rok[u] ? e8m0_dev(rsc[u]) : 0.0f;
      const uint32_t wv[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      uint4* dst = reinterpret_cast<uint4*>(k_s + r * QS + b * 32);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float v[8];
#pragma unroll
        for (int n = 0; n < 8; ++n) v[n] = e2m1_dev((wv[i] >> (4 * n)) & 15u) * s;
        dst[i] = make_uint4(idx_pack_bf16x2(v[0], v[1]), idx_pack_bf16x2(v[2], v[3]), idx_pack_bf16x2(v[4], v[5]),
                            idx_pack_bf16x2(v[6], v[7]));
      }
    }
    __syncthreads();
    load_chunk(c0 + kMmaRows);  // (in flight during the products)
    float acc[NPW][4];
#pragma unroll
    for (int n = 0; n < NPW; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int k0 = 0; k0 < HD; k0 += 32) {
      uint32_t a[4], a2[4];
      idx_ldsm_x4(a, q_s + (mt * 16 + (lane & 15)) * QS + k0 + (lane >> 4) * 8);
      idx_ldsm_x4(a2, q_s + (mt * 16 + (lane & 15)) * QS + k0 + 16 + (lane >> 4) * 8);
#pragma unroll
      for (int n = 0; n < NPW; ++n) {
        uint32_t b[4];
        idx_ldsm_x4(b, k_s + ((nt0 + n) * 8 + (lane & 7)) * QS + k0 + (lane >> 3) * 8);
        idx_mma(acc[n], a, b[0], b[1]);
        idx_mma(acc[n], a2, b[2], b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < NPW; ++n) {
      const int col = (nt0 + n) * 8 + 2 * tig;
      *reinterpret_cast<float2*>(d_s + (mt * 16 + gid) * DS + col) = make_float2(acc[n][0], acc[n][1]);
      *reinterpret_cast<float2*>(d_s + (mt * 16 + gid + 8) * DS + col) = make_float2(acc[n][2], acc[n][3]);
    }
    __syncthreads();
    // scores: one thread per (query, row), heads in order (indexer_scores_kernel, BF16 mode)
    for (int e = tid; e < TQ * kMmaRows; e += kMmaThreads) {
      const int tt = e / kMmaRows, r = e - tt * kMmaRows;
      const int64_t i = c0 + r;
      if (t0 + tt >= p.T || i >= cnt_s[tt]) continue;
      const bool valid = CAND ? row_of(tt, i) >= 0 : true;
      const float* dd = d_s + tt * H * DS + r;
      const float* wt = w_s + tt * H;
      float sc = 0.0f;
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const float d = fmaxf(round_bf16_dev(dd[h * DS]), 0.0f);
        sc += round_bf16_dev(d * wt[h]);
      }
      sc = round_bf16_dev(sc);
      p.scores[static_cast<int64_t>(t0 + tt) * p.ld + i] = valid ? sc : -INFINITY;
    }
  }
#else
  __trap();
#endif
}

bool mma_ok() {
  static int cached = -1;
  if (cached < 0) {
    int dev = 0, major = 0;
    cudaFuncAttributes fa{};
    cached = cudaGetDevice(&dev) == cudaSuccess &&
                     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                     major >= 8 &&
                     cudaFuncGetAttributes(&fa, indexer_scores_mma_kernel<32, 128, 4, false>) == cudaSuccess &&
                     fa.ptxVersion >= 80
                 ? 1
                 : 0;
    cudaGetLastError();
  }
  return cached == 1;
}

template <int H, int HD, int TQ, bool CAND>
void launch_mma(const IndexerScoreArgs& a, float weight_factor, cudaStream_t stream) {
  auto* kern = indexer_scores_mma_kernel<H, HD, TQ, CAND>;
  constexpr size_t smem = mma_smem_bytes<H, HD, TQ>();
  static bool configured = false;  // per instantiation
  if (!configured) {
    DSX_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    configured = true;
  }
  MmaParams p{};
  p.T = a.T, p.r = a.ratio, p.q = a.q, p.w = static_cast<const bf16*>(a.w), p.kp = a.keys.packed, p.ks = a.keys.scales;
  p.cand_blocks = a.cand_blocks, p.cand_ld = a.cand_ld, p.cand_count = a.cand_count, p.cbs = a.cand_block_size;
  p.scores = a.scores, p.ld = a.ld, p.counts = a.counts, p.d_pos = a.d_pos, p.weight_factor = weight_factor;
  const int64_t bx = (a.max_rows + kMmaBlockRows - 1) / kMmaBlockRows;
  DSX_CHECK(bx < (int64_t{1} << 31), "indexer_scores: too many rows");
  const dim3 grid(static_cast<unsigned>(bx > 0 ? bx : 1), static_cast<unsigned>((a.T + TQ - 1) / TQ));
  kern<<<grid, kMmaThreads, smem, stream>>>(p);
}

// The tensor-core path takes prefill chunks in BF16 mode with 16 or 32 heads of 64 or
// 128 dims; true when it launched.
bool try_mma(Act act, const IndexerScoreArgs& a, cudaStream_t stream) {
  if (act != Act::BF16 || a.T < kMmaMinT || !mma_ok()) return false;
  const float wf = static_cast<float>(std::pow(static_cast<double>(a.head_dim), -0.5) *
                                      std::pow(static_cast<double>(a.n_heads), -0.5));
  const bool cand = a.cand_blocks != nullptr;
#define DSX_IDX_MMA(HH, HDD)                                      \
  if (a.n_heads == HH && a.head_dim == HDD) {                     \
    if (cand) launch_mma<HH, HDD, 1, true>(a, wf, stream);        \
    else launch_mma<HH, HDD, 4, false>(a, wf, stream);            \
    return true;                                                  \
  }
  DSX_IDX_MMA(32, 128)
  DSX_IDX_MMA(16, 128)
  DSX_IDX_MMA(32, 64)
  DSX_IDX_MMA(16, 64)
#undef DSX_IDX_MMA
  return false;
}

__global__ void block_scores_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ counts,
                                    int bs, float* __restrict__ out, int64_t ld_out, int32_t* __restrict__ out_counts) {
  const int t = blockIdx.y;
  const int64_t n = counts[t];
  const int64_t nb = (n + bs - 1) / bs;
  if (blockIdx.x == 0 && threadIdx.x == 0) out_counts[t] = static_cast<int32_t>(nb);
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= nb) return;
  const float* s = scores + static_cast<int64_t>(t) * ld;
  float m = -INFINITY;
  const int64_t end = (b + 1) * bs < n ? (b + 1) * bs : n;
  for (int64_t j = b * bs; j < end; ++j) m = fmaxf(m, s[j]);
  if (b == (n - 1) / bs) m = INFINITY;
  out[static_cast<int64_t>(t) * ld_out + b] = m;
}

template <typename T, int HH, int TH, int RPT, int G = 1>
void launch_one(const IndexerScoreArgs& a, dim3 grid, size_t smem, const T* w, float softmax_scale, float heads_scale,
                float weight_factor, cudaStream_t stream) {
  auto* kern = indexer_scores_kernel<T, HH, TH, RPT, G>;
  if (smem > 48 * 1024)
    DSX_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  detail::launch_pdl(kern, grid, dim3(TH), smem, stream, a.head_dim, a.ratio, a.q, w, a.keys.packed, a.keys.scales,
                     a.cand_blocks, a.cand_ld, a.cand_count, a.cand_block_size, a.scores, a.ld, a.counts, a.d_pos,
                     softmax_scale, heads_scale, weight_factor);
}

// Queries (tokens) up to which short row lists split the heads of a row over 4 threads.
constexpr int kSplitMaxT = 16;

template <typename T>
void launch_scores(const IndexerScoreArgs& a, cudaStream_t stream) {
  const float softmax_scale = static_cast<float>(std::pow(static_cast<double>(a.head_dim), -0.5));
  const float heads_scale = static_cast<float>(std::pow(static_cast<double>(a.n_heads), -0.5));
  const float weight_factor =
      static_cast<float>(std::pow(static_cast<double>(a.head_dim), -0.5) * std::pow(static_cast<double>(a.n_heads), -0.5));
  const bool small = (a.max_rows + 63) / 64 <= static_cast<int64_t>(8) * sm_count();
  // heads split over 4 threads per row for a few queries (decode, speculative verify:
  // latency-bound; one thread per row there measured 13.2-15.1 us per decode launch
  // against 8.9-11.8); prefill chunks keep one thread per row (the split repeats the key
  // decode per thread and stages q twice as often: prefill 6 % slower at 32k-128k)
  const bool split = small && a.T <= kSplitMaxT;
  const int rows_per_block = split ? 32 : small ? 64 : 256;
  const int64_t blocks = (a.max_rows + rows_per_block - 1) / rows_per_block;
  DSX_CHECK(blocks < (int64_t{1} << 31), "indexer_scores: too many rows");
  dim3 grid(static_cast<unsigned>(blocks > 0 ? blocks : 1), a.T);
  const size_t smem = static_cast<size_t>(a.n_heads) * a.head_dim * sizeof(float);
  const T* w = static_cast<const T*>(a.w);
#define DSX_IDX_LAUNCH(HH)                                                                                     \
  do {                                                                                                         \
    if (split)                                                                                                 \
      launch_one<T, HH, 128, 1, 4>(a, grid, smem, w, softmax_scale, heads_scale, weight_factor, stream);       \
    else if (small) launch_one<T, HH, 64, 1>(a, grid, smem, w, softmax_scale, heads_scale, weight_factor, stream); \
    else launch_one<T, HH, 128, 2>(a, grid, smem, w, softmax_scale, heads_scale, weight_factor, stream);       \
  } while (0)
  switch (a.n_heads) {
    case 4: DSX_IDX_LAUNCH(4); break;
    case 8: DSX_IDX_LAUNCH(8); break;
    case 16: DSX_IDX_LAUNCH(16); break;
    case 32: DSX_IDX_LAUNCH(32); break;
    default: fail("indexer_scores: unsupported number of index heads ", a.n_heads, " (4, 8, 16 or 32)");
  }
#undef DSX_IDX_LAUNCH
}

}  // namespace

void indexer_scores(Act act, const IndexerScoreArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.head_dim % 32 == 0 && a.head_dim <= 256 && a.keys.dim == a.head_dim, "indexer_scores: bad head dim");
  DSX_CHECK(a.ratio >= 1, "indexer_scores: ratio must be >= 1");
  DSX_CHECK(a.cand_blocks == nullptr || (a.cand_count && a.cand_block_size >= 1), "indexer_scores: candidate list");
  DSX_CHECK(a.ld >= a.max_rows, "indexer_scores: score row stride smaller than max_rows");
  if (!try_mma(act, a, stream)) DSX_DISPATCH_ACT(act, T, launch_scores<T>(a, stream));
  check_launch("indexer_scores");
}

void block_scores(int T, const float* scores, int64_t ld, const int32_t* counts, int block_size, float* out,
                  int64_t ld_out, int32_t* out_counts, int64_t max_blocks, cudaStream_t stream) {
  if (T <= 0) return;
  DSX_CHECK(block_size >= 1 && ld_out >= max_blocks, "block_scores: bad geometry");
  const int64_t blocks = (max_blocks + 255) / 256;
  dim3 grid(static_cast<unsigned>(blocks > 0 ? blocks : 1), T);
  block_scores_kernel<<<grid, 256, 0, stream>>>(scores, ld, counts, block_size, out, ld_out, out_counts);
  check_launch("block_scores");
}

}  // namespace dsx::cuda
