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
  DSX_DISPATCH_ACT(act, T, launch_scores<T>(a, stream));
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
