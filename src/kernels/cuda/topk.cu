#include "kernels/cuda/topk.h"

#include <cooperative_groups.h>

#include <algorithm>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/pdl_device.cuh"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

namespace {

namespace cg = cooperative_groups;

constexpr int kCluster = 8;     // CTAs per query (portable cluster size; sm_90 builds)
constexpr int kThreads = 512;
constexpr int kBins = 2048;     // 11-bit digits
constexpr uint32_t kMinValid = 0x00800000u;  // key(-inf) = 0x007fffff; NaN -> 0

// Order-preserving key of an f32 score; -0 == +0; NaN -> 0 (never selected).
__device__ __forceinline__ uint32_t score_key(float f) {
  uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0u;
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ uint32_t warp_sum_u32(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Inclusive scan of v over the lanes of a warp (all lanes call it).
__device__ __forceinline__ uint32_t warp_incl_scan(uint32_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint32_t u = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += u;
  }
  return v;
}

// The caller's bins [top - per, top) hold the entries ranked excl + 1 .. inc from the
// top; when krem is among them, the bin holding rank krem and the rank left inside it.
__device__ __forceinline__ void bucket_of_rank(const uint32_t* hist, int top, int per, uint32_t excl, uint32_t inc,
                                               uint32_t krem, uint32_t* out_bucket, uint32_t* out_krem) {
  if (!(excl < krem && krem <= inc)) return;
  uint32_t cum = excl;
  for (int b = top - 1; b >= top - per; --b) {
    if (cum + hist[b] >= krem) {
      *out_bucket = static_cast<uint32_t>(b);
      *out_krem = krem - cum;
      return;
    }
    cum += hist[b];
  }
}

// Warp 0: the bucket (counted from the top) holding the krem-th largest entry.
__device__ void find_bucket(const uint32_t* hist, int bins, uint32_t krem, uint32_t* out_bucket, uint32_t* out_krem) {
  const int lane = threadIdx.x & 31;
  const int per = bins / 32;
  const int top = bins - lane * per;  // lane covers bins [top - per, top)
  uint32_t sum = 0;
  for (int b = top - per; b < top; ++b) sum += hist[b];
  const uint32_t inc = warp_incl_scan(sum);
  bucket_of_rank(hist, top, per, inc - sum, inc, krem, out_bucket, out_krem);
}

// Output id of entry i of query t: i, or its row through the candidate blocks.
__device__ __forceinline__ int32_t entry_id(const int32_t* id_blocks, int64_t id_ld, int id_bs, int t, int64_t i) {
  if (!id_blocks) return static_cast<int32_t>(i);
  return static_cast<int32_t>(static_cast<int64_t>(id_blocks[static_cast<int64_t>(t) * id_ld + i / id_bs]) * id_bs +
                              i % id_bs);
}

// Block-wide exclusive scan (every thread calls it); total = sum over the block.
__device__ __forceinline__ uint32_t block_excl_scan(uint32_t v, uint32_t* wsum, uint32_t& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t inc = warp_incl_scan(v);
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  uint32_t base = 0, tot = 0;
  for (int w = 0; w < kThreads / 32; ++w) {
    const uint32_t s = wsum[w];
    if (w < warp) base += s;
    tot += s;
  }
  __syncthreads();
  total = tot;
  return base + inc - v;
}

// Cluster primitives; C == 1 is the single-CTA fallback (builds without sm_90 code).
template <int C>
struct ClusterOps {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __device__ static int rank() { return static_cast<int>(cg::this_cluster().block_rank()); }
  __device__ static void sync() { cg::this_cluster().sync(); }
  template <typename V>
  __device__ static V* map(V* p, int r) {
    return cg::this_cluster().map_shared_rank(p, static_cast<unsigned>(r));
  }
#else
  __device__ static int rank() {
    __trap();
    return 0;
  }
  __device__ static void sync() { __trap(); }
  template <typename V>
  __device__ static V* map(V* p, int) {
    __trap();
    return p;
  }
#endif
};
template <>
struct ClusterOps<1> {
  __device__ static int rank() { return 0; }
  __device__ static void sync() { __syncthreads(); }
  template <typename V>
  __device__ static V* map(V* p, int) {
    return p;
  }
};

template <int C>
__global__ void __launch_bounds__(kThreads)
    topk_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ counts, int k,
                const int32_t* __restrict__ id_blocks, int64_t id_ld, int id_bs, int32_t* __restrict__ out,
                int64_t out_ld, int32_t* __restrict__ out_count) {
  using CL = ClusterOps<C>;
  const int rank = CL::rank();
  const int t = blockIdx.y;
  __shared__ uint32_t tot[3 * kBins];  // cluster totals per pass (rank 0's copy is used)
  __shared__ uint32_t loc[kBins];
  __shared__ uint32_t wsum[kThreads / 32];
  __shared__ uint32_t cta_cnt[2];
  __shared__ uint32_t s_bucket, s_krem, s_all, s_base_gt, s_base_eq, s_tot_gt, s_tot_eq;
  __shared__ uint32_t s_low;  // OR of the low 10 key bits of all valid entries (rank 0's copy)

  const int64_t n = counts[t] > 0 ? counts[t] : 0;
  const float* s = scores + static_cast<int64_t>(t) * ld;
  const int64_t per = (n + C - 1) / C;
  const int64_t lo = min(n, static_cast<int64_t>(rank) * per), hi = min(n, lo + per);

  for (int i = threadIdx.x; i < 3 * kBins; i += kThreads) tot[i] = 0u;
  if (threadIdx.x == 0) s_all = 0u, s_low = 0u;
  CL::sync();
  uint32_t* tot0 = CL::map(tot, 0);

  // ---- radix select of the k-th largest key
  uint32_t prefix = 0u, krem = static_cast<uint32_t>(k);
  bool all = false;
  for (int p = 0; p < 3; ++p) {
    const int shift = p == 0 ? 21 : (p == 1 ? 10 : 0);
    const int width = p == 2 ? 10 : 11;
    const int bins = 1 << width;
    for (int i = threadIdx.x; i < bins; i += kThreads) loc[i] = 0u;
    __syncthreads();
    uint32_t low = 0u;
    for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
      const uint32_t key = score_key(s[i]);
      if (key < kMinValid) continue;
      if (p > 0 && (key >> (shift + width)) != prefix) continue;
      low |= key;
      atomicAdd(&loc[(key >> shift) & static_cast<uint32_t>(bins - 1)], 1u);
    }
    if (p == 0) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) low |= __shfl_xor_sync(0xffffffffu, low, o);
      if ((threadIdx.x & 31) == 0 && (low & 0x3ffu)) atomicOr(CL::map(&s_low, 0), low & 0x3ffu);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < bins; i += kThreads)
      if (loc[i]) atomicAdd(tot0 + p * kBins + i, loc[i]);
    CL::sync();
    for (int i = threadIdx.x; i < bins; i += kThreads) loc[i] = tot0[p * kBins + i];
    __syncthreads();
    if (threadIdx.x < 32) {
      if (p == 0) {
        uint32_t sum = 0u;
        for (int i = threadIdx.x; i < bins; i += 32) sum += loc[i];
        sum = warp_sum_u32(sum);
        if (threadIdx.x == 0) s_all = sum <= static_cast<uint32_t>(k) ? 1u : 0u;
        __syncwarp();
      }
      if (!s_all) find_bucket(loc, bins, krem, &s_bucket, &s_krem);
    }
    __syncthreads();
    if (s_all) {
      all = true;
      break;  // uniform across the cluster (same totals everywhere)
    }
    prefix = (prefix << width) | s_bucket;
    krem = s_krem;
    __syncthreads();
    // Scores rounded to bf16 (BF16 mode) leave the low 16 key bits zero: every entry of
    // the 22-bit bucket then has the key prefix << 10, which is what the third pass would
    // find (its bucket 0, krem unchanged). Uniform: the same OR in every CTA.
    if (p == 1 && *CL::map(&s_low, 0) == 0u) {
      prefix <<= 10;
      break;
    }
  }
  const uint32_t tau = all ? kMinValid - 1u : prefix;
  const uint32_t need = all ? 0u : krem;

  // ---- count pass: entries above / equal to the threshold in this CTA's slice
  uint32_t cgt = 0u, ceq = 0u;
  for (int64_t i = lo + threadIdx.x; i < hi; i += kThreads) {
    const uint32_t key = score_key(s[i]);
    cgt += key > tau ? 1u : 0u;
    ceq += key == tau ? 1u : 0u;
  }
  cgt = warp_sum_u32(cgt);
  ceq = warp_sum_u32(ceq);
  if ((threadIdx.x & 31) == 0) wsum[threadIdx.x >> 5] = cgt;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0u;
    for (int w = 0; w < kThreads / 32; ++w) a += wsum[w];
    cta_cnt[0] = a;
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) wsum[threadIdx.x >> 5] = ceq;
  __syncthreads();
  if (threadIdx.x == 0) {
    uint32_t a = 0u;
    for (int w = 0; w < kThreads / 32; ++w) a += wsum[w];
    cta_cnt[1] = a;
  }
  CL::sync();
  if (threadIdx.x == 0) {
    uint32_t bg = 0u, be = 0u, tg = 0u, te = 0u;
    for (int r = 0; r < C; ++r) {
      const uint32_t* c = CL::map(cta_cnt, r);
      const uint32_t g = c[0], e = c[1];
      if (r < rank) {
        bg += g;
        be += e;
      }
      tg += g;
      te += e;
    }
    s_base_gt = bg;
    s_base_eq = be;
    s_tot_gt = tg;
    s_tot_eq = te;
  }
  __syncthreads();

  // ---- write pass: selected entries in position order
  uint32_t run_gt = s_base_gt, run_eq = s_base_eq;
  int32_t* o = out + static_cast<int64_t>(t) * out_ld;
  for (int64_t tile = lo; tile < hi; tile += kThreads) {
    const int64_t i = tile + threadIdx.x;
    const uint32_t key = i < hi ? score_key(s[i]) : 0u;
    const uint32_t g = (i < hi && key > tau) ? 1u : 0u;
    const uint32_t e = (i < hi && key == tau) ? 1u : 0u;
    uint32_t total;
    const uint32_t ex = block_excl_scan(g | (e << 16), wsum, total);
    const uint32_t gb = run_gt + (ex & 0xffffu), eb = run_eq + (ex >> 16);
    if (g || (e && eb < need)) {
      const uint32_t pos = gb + (eb < need ? eb : need);
      o[pos] = entry_id(id_blocks, id_ld, id_bs, t, i);
    }
    run_gt += total & 0xffffu;
    run_eq += total >> 16;
  }
  if (rank == 0 && threadIdx.x == 0)
    out_count[t] = static_cast<int32_t>(s_tot_gt + (s_tot_eq < need ? s_tot_eq : need));
  CL::sync();  // no CTA leaves while others may still read its shared memory
}

// ---- Short rows (n <= kSmallN, e.g. decode at a few thousand compressed rows or inside
// the candidate blocks): one CTA of 1024 threads per query holds the row's keys in
// registers (up to 16 consecutive entries per thread, loaded once with all loads in
// flight), so the histogram passes (three at most: a pass whose bucket holding the k-th
// largest is selected whole is the last), the count and the write pass touch no global
// memory.
// The general kernel re-reads the scores in load-then-atomic loops that wait one L2
// round trip per iteration (ncu: 23 us per decode top-k at 4-8k rows). Same semantics.
constexpr int kSmallThreads = 1024;
constexpr int kSmallPer = 16;
constexpr int64_t kSmallN = int64_t{kSmallThreads} * kSmallPer;

// Inclusive block scan of v over the 1024 threads in thread order; wsum: 32 words.
__device__ __forceinline__ uint32_t block_incl_scan_1024(uint32_t v, uint32_t* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t inc = warp_incl_scan(v);
  if (lane == 31) wsum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const uint32_t w = wsum[lane];
    wsum[lane] = warp_incl_scan(w) - w;  // exclusive prefix of the warp sums
  }
  __syncthreads();
  const uint32_t r = inc + wsum[warp];
  __syncthreads();  // wsum is reused by the next scan
  return r;
}

__global__ void __launch_bounds__(kSmallThreads)
    topk_small_kernel(const float* __restrict__ scores, int64_t ld, const int32_t* __restrict__ counts, int k,
                      const int32_t* __restrict__ id_blocks, int64_t id_ld, int id_bs, int32_t* __restrict__ out,
                      int64_t out_ld, int32_t* __restrict__ out_count) {
  __shared__ uint32_t hist[kBins];
  __shared__ uint32_t wsum[32];
  __shared__ uint32_t s_bucket, s_krem, s_total;
  const int t = blockIdx.x;
  dev::pdl_launch_dependents();  // (the attention's blocks launch meanwhile and wait for the selection)
  dev::pdl_wait();  // scores and counts come from the previous kernel (programmatic dependent launch)
  const int n = static_cast<int>(min(static_cast<int64_t>(counts[t] > 0 ? counts[t] : 0), kSmallN));  // (host bound)
  const float* s = scores + static_cast<int64_t>(t) * ld;
  // this thread's entries [i0, i0 + per): as few per thread as the row allows, so that the
  // histogram atomics spread over all the warps (position order is thread order)
  const int per = min(kSmallPer, max(1, (n + kSmallThreads - 1) / kSmallThreads));
  const int i0 = static_cast<int>(threadIdx.x) * per;
  uint32_t key[kSmallPer];
#pragma unroll
  for (int j = 0; j < kSmallPer; ++j) key[j] = j < per && i0 + j < n ? score_key(__ldg(s + i0 + j)) : 0u;
  dev::trace_mark(61);

  // ---- radix select of the k-th largest key (11 + 11 + 10 bits)
  uint32_t prefix = 0u, krem = static_cast<uint32_t>(k);
  bool all = false, whole = false;
  int low = 0;  // bits below the digits resolved so far
#pragma unroll 1
  for (int p = 0; p < 3; ++p) {
    const int shift = p == 0 ? 21 : (p == 1 ? 10 : 0);
    const int width = p == 2 ? 10 : 11;
    const uint32_t bins = 1u << width;
    for (uint32_t b = threadIdx.x; b < kBins; b += kSmallThreads) hist[b] = 0u;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kSmallPer; ++j) {
      const uint32_t kk = key[j];
      const bool in = kk >= kMinValid && (p == 0 || (kk >> (shift + width)) == prefix);
      if (in) atomicAdd(&hist[(kk >> shift) & (bins - 1u)], 1u);
    }
    __syncthreads();
    // thread j covers bins (from the top) 2j, 2j + 1 (pass 2: 1024 bins, one each)
    const int per = static_cast<int>(bins) / kSmallThreads;  // 2 or 1
    const int top = static_cast<int>(bins) - static_cast<int>(threadIdx.x) * per;
    uint32_t local = 0u;
    for (int b = top - 1; b >= top - per; --b) local += hist[b];
    const uint32_t inc = block_incl_scan_1024(local, wsum);
    if (threadIdx.x == kSmallThreads - 1) s_total = inc;
    bucket_of_rank(hist, top, per, inc - local, inc, krem, &s_bucket, &s_krem);
    __syncthreads();
    if (p == 0 && s_total <= static_cast<uint32_t>(k)) {  // every valid entry is selected
      all = true;
      break;
    }
    prefix = (prefix << width) | s_bucket;
    krem = s_krem;
    low = shift;
    // every entry of the bucket is selected: the digits so far decide (no further pass)
    whole = hist[s_bucket] == krem;
    __syncthreads();  // s_bucket / hist reused
    if (whole) break;
  }
  dev::trace_mark(62);
  // selected: keys > tau, then the first `need` keys equal to tau in position order (a
  // whole bucket: every key >= prefix << low)
  const uint32_t tau = all ? kMinValid - 1u : whole ? (prefix << low) - 1u : prefix;
  const uint32_t need = all || whole ? 0u : krem;

  // ---- write pass: entries above tau, and the first `need` equal to it, in position order
  uint32_t g = 0u, e = 0u;
#pragma unroll
  for (int j = 0; j < kSmallPer; ++j) {
    g += key[j] > tau ? 1u : 0u;
    e += key[j] == tau ? 1u : 0u;
  }
  const uint32_t inc = block_incl_scan_1024(g | (e << 16), wsum);
  uint32_t gb = (inc & 0xffffu) - g, eb = (inc >> 16) - e;
  if (threadIdx.x == kSmallThreads - 1) {
    const uint32_t tg = inc & 0xffffu, te = inc >> 16;
    out_count[t] = static_cast<int32_t>(tg + (te < need ? te : need));
  }
  int32_t* o = out + static_cast<int64_t>(t) * out_ld;
#pragma unroll
  for (int j = 0; j < kSmallPer; ++j) {
    const bool gt = key[j] > tau, eq = key[j] == tau;
    if (gt || (eq && eb < need)) {
      const uint32_t pos = gb + (eb < need ? eb : need);
      o[pos] = entry_id(id_blocks, id_ld, id_bs, t, i0 + j);
    }
    gb += gt ? 1u : 0u;
    eb += eq ? 1u : 0u;
  }
  dev::trace_mark(63);
}

// DSX_TOPK_SMALL=0: rows of at most kSmallN entries also take the general kernel.
bool small_enabled() { return sw::on(sw::Id::TOPK_SMALL); }

// The cluster kernel needs sm_90 device code (a build for an older virtual
// architecture JIT-compiled on the H200 gets the single-CTA kernel). DSX_TOPK_CLUSTER=0:
// the single-CTA kernel on the H200 too.
bool use_clusters() {
  if (!sw::on(sw::Id::TOPK_CLUSTER)) return false;
  static int cached = -1;  // (what the device and the build allow)
  if (cached < 0) {
    int dev = 0, major = 0;
    cudaFuncAttributes fa{};
    cached = cudaGetDevice(&dev) == cudaSuccess &&
                     cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
                     major >= 9 && cudaFuncGetAttributes(&fa, topk_kernel<kCluster>) == cudaSuccess &&
                     fa.ptxVersion >= 90
                 ? 1
                 : 0;
    cudaGetLastError();
  }
  return cached == 1;
}

}  // namespace

bool topk_uses_clusters() { return use_clusters(); }

void topk_select(int T, const float* scores, int64_t ld, const int32_t* counts, int k, const int32_t* id_blocks,
                 int64_t id_ld, int id_block_size, int32_t* out, int64_t out_ld, int32_t* out_count,
                 cudaStream_t stream, int64_t max_n) {
  if (T <= 0) return;
  DSX_CHECK(k >= 1 && k <= out_ld, "topk_select: need 1 <= k <= out_ld");
  DSX_CHECK(id_blocks == nullptr || id_block_size >= 1, "topk_select: id block size");
  const int64_t bound = max_n >= 0 ? std::min(max_n, ld) : ld;
  if (bound <= kSmallN && small_enabled()) {
    detail::launch_pdl(topk_small_kernel, dim3(static_cast<unsigned>(T)), dim3(kSmallThreads), 0, stream, scores, ld,
                       counts, k, id_blocks, id_ld, id_block_size, out, out_ld, out_count);
  } else if (use_clusters()) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kCluster, T);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    DSX_CUDA_CHECK(cudaLaunchKernelEx(&cfg, topk_kernel<kCluster>, scores, ld, counts, k, id_blocks, id_ld,
                                      id_block_size, out, out_ld, out_count));
  } else {
    topk_kernel<1><<<dim3(1, T), kThreads, 0, stream>>>(scores, ld, counts, k, id_blocks, id_ld, id_block_size, out,
                                                         out_ld, out_count);
  }
  check_launch("topk_select");
}

}  // namespace dsx::cuda
