// MoE prefill (moe_prefill, moe.h): tokens grouped by expert on the device, then the
// grouped tensor-core GEMMs (moe_grouped.h) or, with DSX_MOE_PREFILL=cublas, the
// dequantize + cuBLAS / per-expert GEMV path with one host synchronisation.
#include <algorithm>
#include <climits>
#include <vector>

#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemm_internal.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/moe_grouped.h"
#include "kernels/cuda/moe_internal.cuh"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

using namespace moe_detail;

namespace {

__global__ void count_kernel(const int32_t* __restrict__ ids, int n, int E, int* __restrict__ counts) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const int e = ids[i];
    if (e >= 0 && e < E) atomicAdd(counts + e, 1);
  }
}

__global__ void scan_kernel(const int* __restrict__ counts, int E, int* __restrict__ offs) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int s = 0;
    for (int e = 0; e < E; ++e) {
      offs[e] = s;
      s += counts[e];
    }
    offs[E] = s;
  }
}

// Block e lists, in ascending entry order, the entries i (= t * topk + j) routed to
// expert e: perm[offs[e] + rank] = i, inv[i] = offs[e] + rank. Deterministic.
__global__ void __launch_bounds__(kThreads) compact_kernel(const int32_t* __restrict__ ids, int n,
                                                           const int* __restrict__ offs, int* __restrict__ perm,
                                                           int* __restrict__ inv) {
  __shared__ int wsum[kWarps];
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int base = offs[e];
  for (int s0 = 0; s0 < n; s0 += kThreads) {
    const int i = s0 + threadIdx.x;
    const bool f = i < n && ids[i] == e;
    const unsigned bal = __ballot_sync(dev::kFull, f);
    if (lane == 0) wsum[warp] = __popc(bal);
    __syncthreads();
    int woff = 0, tot = 0;
    for (int w = 0; w < kWarps; ++w) {
      if (w < warp) woff += wsum[w];
      tot += wsum[w];
    }
    if (f) {
      const int pos = base + woff + __popc(bal & ((1u << lane) - 1u));
      perm[pos] = i;
      inv[i] = pos;
    }
    base += tot;
    __syncthreads();
  }
}

// dst[p, :] = src[perm[p] / topk, :] (rows of `row_bytes` bytes, multiple of 16).
__global__ void gather_rows_kernel(const uint8_t* __restrict__ src, const int* __restrict__ perm, int rows, int topk,
                                   int64_t row_bytes, uint8_t* __restrict__ dst) {
  const int64_t q = row_bytes / 16;
  const int64_t total = static_cast<int64_t>(rows) * q;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = i / q, c = i % q;
    const int64_t s = perm[p] / topk;
    reinterpret_cast<uint4*>(dst + p * row_bytes)[c] = reinterpret_cast<const uint4*>(src + s * row_bytes)[c];
  }
}

// h[p, i] from gu[p] = [g(I) | u(I)]; rows p < n_routed use weights[perm[p]], the
// others (shared expert) weight 1.
__global__ void swiglu_rows_kernel(const float* __restrict__ gu, int rows, int n_routed, int I,
                                   const int* __restrict__ perm, const float* __restrict__ weights, float lim,
                                   int bf16, float* __restrict__ h) {
  const int64_t total = static_cast<int64_t>(rows) * I;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t p = k / I, i = k % I;
    const float w = p < n_routed ? weights[perm[p]] : 1.0f;
    const float* r = gu + p * 2 * I;
    h[k] = dev::swiglu_h(r[i], r[I + i], w, lim, bf16);
  }
}

// out[t, :] = sum over slots in ascending expert id of y[inv[t*topk + j]] (+ y[n_routed + t]).
__global__ void combine_kernel(const float* __restrict__ yp, const int* __restrict__ inv,
                               const int32_t* __restrict__ ids, int topk, int n_routed, int has_shared, int D,
                               int bf16, void* y, int yt, int64_t ldy) {
  __shared__ int rows[kMaxSlots];
  const int t = blockIdx.x;
  if (threadIdx.x == 0) {
    int ord[kMaxSlots];
    for (int j = 0; j < topk; ++j) ord[j] = j;
    for (int a = 1; a < topk; ++a) {
      const int v = ord[a];
      int b = a - 1;
      while (b >= 0 && ids[t * topk + ord[b]] > ids[t * topk + v]) {
        ord[b + 1] = ord[b];
        --b;
      }
      ord[b + 1] = v;
    }
    for (int j = 0; j < topk; ++j) rows[j] = inv[t * topk + ord[j]];
    rows[topk] = n_routed + t;
  }
  __syncthreads();
  const int S = topk + has_shared;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float tot = 0.0f;
    for (int s = 0; s < S; ++s) {
      float v = yp[static_cast<int64_t>(rows[s]) * D + d];
      if (bf16) v = round_bf16(v);
      tot += v;
    }
    dev::store_act(y, yt, static_cast<int64_t>(t) * ldy + d, tot);
  }
}

struct PrefillLayout {
  size_t xq, counts, offs, perm, inv, xg, gu, h, hq, yp, wd, total;
};
PrefillLayout prefill_layout(const MoeLayer& m, int T, int topk, size_t cs) {
  const size_t D = static_cast<size_t>(m.hidden), I = static_cast<size_t>(m.inter);
  const size_t Tk = static_cast<size_t>(T) * topk;
  const size_t rows_all = Tk + (m.shared_w1.data ? T : 0);
  PrefillLayout L{};
  size_t off = 0;
  auto take = [&](size_t& at, size_t bytes) {
    at = off;
    off = align256(off + bytes);
  };
  take(L.xq, T * D * cs);
  take(L.counts, m.n_experts * 4);
  take(L.offs, (m.n_experts + 1) * 4);
  take(L.perm, Tk * 4);
  take(L.inv, Tk * 4);
  take(L.xg, Tk * D * cs);
  take(L.gu, rows_all * 2 * I * 4);
  take(L.h, rows_all * I * 4);
  take(L.hq, rows_all * I * cs);
  take(L.yp, rows_all * D * 4);
  take(L.wd, 2 * I * D * cs);
  L.total = off;
  return L;
}

unsigned grid_for(int64_t n, int per_block = 256) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>((n + per_block - 1) / per_block,
                                                                       static_cast<int64_t>(sm_count()) * 16)));
}

// The grouped path (moe_grouped.h): grouping and tile plan on the device, one launch for
// the gate / up products (SwiGLU and QA8 fused), one for the down products, the combine.
struct GroupedLayout {
  size_t counts, offs, perm, inv, tiles, ntiles, xb, hq, yp, total;
};
GroupedLayout grouped_layout(const MoeLayer& m, int T, int topk) {
  const size_t D = static_cast<size_t>(m.hidden), I = static_cast<size_t>(m.inter);
  const size_t Tk = static_cast<size_t>(T) * topk;
  const size_t rows_all = Tk + (m.shared_w1.data ? T : 0);
  GroupedLayout L{};
  size_t off = 0;
  auto take = [&](size_t& at, size_t bytes) {
    at = off;
    off = align256(off + bytes);
  };
  take(L.counts, m.n_experts * 4);
  take(L.offs, (m.n_experts + 1) * 4);
  take(L.perm, Tk * 4);
  take(L.inv, Tk * 4);
  take(L.tiles, static_cast<size_t>(grouped_max_tiles(m, T, topk)) * sizeof(int4));
  take(L.ntiles, 4);
  take(L.xb, rows_all * D * 2);
  take(L.hq, rows_all * I * 2);
  take(L.yp, rows_all * D * 4);
  L.total = off;
  return L;
}

bool prefill_grouped() { return sw::get_str(sw::Id::MOE_PREFILL) != "cublas"; }

void moe_prefill_grouped(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk,
                         const int32_t* ids, const float* weights, DType yt, void* y, int64_t ldy, void* ws,
                         size_t ws_bytes, cudaStream_t stream) {
  const GroupedLayout L = grouped_layout(m, T, topk);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_prefill: workspace too small (", ws_bytes, " < ", L.total, ")");
  char* base = static_cast<char*>(ws);
  auto at = [&](size_t o) { return static_cast<void*>(base + o); };
  const int E = m.n_experts;
  const int Tk = T * topk;
  const bool has_shared = m.shared_w1.data != nullptr;
  int* counts = static_cast<int*>(at(L.counts));
  int* offs = static_cast<int*>(at(L.offs));
  int* perm = static_cast<int*>(at(L.perm));
  int* inv = static_cast<int*>(at(L.inv));
  uint16_t* xb = static_cast<uint16_t*>(at(L.xb));
  uint16_t* hq = static_cast<uint16_t*>(at(L.hq));
  float* yp = static_cast<float*>(at(L.yp));
  // 1. group the (token, slot) entries by expert (ids outside [0, E) are dropped)
  DSX_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * 4, stream));
  count_kernel<<<grid_for(Tk), 256, 0, stream>>>(ids, Tk, E, counts);
  scan_kernel<<<1, 32, 0, stream>>>(counts, E, offs);
  compact_kernel<<<static_cast<unsigned>(E), kThreads, 0, stream>>>(ids, Tk, offs, perm, inv);
  DSX_CUDA_CHECK(cudaGetLastError());
  GroupedMoe g;
  g.T = T;
  g.topk = topk;
  g.counts = counts;
  g.offs = offs;
  g.perm = perm;
  g.weights = weights;
  g.tiles = static_cast<int4*>(at(L.tiles));
  g.n_tiles = static_cast<int*>(at(L.ntiles));
  // 2. the tiles, the QA8'd rows, the products
  grouped_plan(m, g, stream);
  grouped_gather_qa8(m, g, xt, x, ldx, xb, stream);
  grouped_up(m, g, xb, yt == DType::BF16, hq, nullptr, stream);
  grouped_down(m, g, hq, yp, stream);
  // 3. combine in the reference order
  combine_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(yp, inv, ids, topk, Tk, has_shared ? 1 : 0,
                                                                static_cast<int>(m.hidden), yt == DType::BF16 ? 1 : 0,
                                                                y, static_cast<int>(yt), ldy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

size_t moe_prefill_ws_bytes(const MoeLayer& m, int T, int topk) {
  // (either path: the switch is read per call)
  return std::max(prefill_layout(m, T, topk, 4).total, grouped_layout(m, T, topk).total);
}

void moe_prefill(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                 const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                 cudaStream_t stream, const MoePrefillOpts& opts) {
  if (T <= 0) return;
  check_layer(m, topk);
  if (prefill_grouped() && grouped_supported(m)) {
    moe_prefill_grouped(m, xt, x, ldx, T, topk, ids, weights, yt, y, ldy, ws, ws_bytes, stream);
    return;
  }
  // the dequant + cuBLAS path (DSX_MOE_PREFILL=cublas)
  const bool bf16 = yt == DType::BF16;
  const DType ct = bf16 ? DType::BF16 : DType::F32;
  const size_t cs = dtype_size(ct);
  const PrefillLayout L = prefill_layout(m, T, topk, cs);
  DSX_CHECK(ws && ws_bytes >= L.total, "moe_prefill: workspace too small (", ws_bytes, " < ", L.total, ")");
  char* base = static_cast<char*>(ws);
  const int E = m.n_experts;
  const int64_t D = m.hidden, I = m.inter;
  const int Tk = T * topk;
  const bool has_shared = m.shared_w1.data != nullptr;
  const int rows_all = Tk + (has_shared ? T : 0);
  auto at = [&](size_t o) { return static_cast<void*>(base + o); };
  uint8_t* xq = static_cast<uint8_t*>(at(L.xq));
  int* counts = static_cast<int*>(at(L.counts));
  int* offs = static_cast<int*>(at(L.offs));
  int* perm = static_cast<int*>(at(L.perm));
  int* inv = static_cast<int*>(at(L.inv));
  uint8_t* xg = static_cast<uint8_t*>(at(L.xg));
  float* gu = static_cast<float*>(at(L.gu));
  float* h = static_cast<float*>(at(L.h));
  uint8_t* hq = static_cast<uint8_t*>(at(L.hq));
  float* yp = static_cast<float*>(at(L.yp));
  uint8_t* wd = static_cast<uint8_t*>(at(L.wd));

  // 1. QA8 of the input, once for every expert
  qa8_fake(xt, x, ldx, T, D, m.qblock, ct, xq, D, stream);
  // 2. group the (token, slot) entries by expert
  DSX_CUDA_CHECK(cudaMemsetAsync(counts, 0, static_cast<size_t>(E) * 4, stream));
  count_kernel<<<grid_for(Tk), 256, 0, stream>>>(ids, Tk, E, counts);
  scan_kernel<<<1, 32, 0, stream>>>(counts, E, offs);
  compact_kernel<<<static_cast<unsigned>(E), kThreads, 0, stream>>>(ids, Tk, offs, perm, inv);
  DSX_CUDA_CHECK(cudaGetLastError());
  gather_rows_kernel<<<grid_for(static_cast<int64_t>(Tk) * D * cs / 16), 256, 0, stream>>>(xq, perm, Tk, topk,
                                                                                          D * cs, xg);
  DSX_CUDA_CHECK(cudaGetLastError());
  // 3. counts and expert pointers to the host (the one synchronisation)
  std::vector<int> cnt(static_cast<size_t>(E));
  std::vector<const uint8_t*> p1(E), p1s(E), p3(E), p3s(E), p2(E), p2s(E);
  const size_t pb = static_cast<size_t>(E) * sizeof(void*);
  DSX_CUDA_CHECK(cudaMemcpyAsync(cnt.data(), counts, static_cast<size_t>(E) * 4, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p1.data(), m.w1, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p1s.data(), m.w1_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p3.data(), m.w3, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p3s.data(), m.w3_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p2.data(), m.w2, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaMemcpyAsync(p2s.data(), m.w2_scale, pb, cudaMemcpyDeviceToHost, stream));
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream));

  const int gmin = std::max(1, opts.gemm_min_tokens);
  GemvOpts gv;
  gv.qa8 = false;  // inputs are already QA8'd
  auto mx = [&](const uint8_t* w, const uint8_t* s, int64_t N, int64_t K) {
    QMatrix q;
    q.fmt = WFormat::MXFP4;
    q.rows = N;
    q.cols = K;
    q.block = 32;
    q.data = w;
    q.scale = s;
    q.tiled = m.tiled;
    q.name = "expert";
    return q;
  };
  // gate/up of one expert (or the shared expert): rows n of input a -> gu rows
  auto up = [&](const QMatrix& q1, const QMatrix& q3, const void* a, int n, float* out) {
    if (n >= gmin) {
      dequant(q1, ct, wd, stream);  // (q1, q3: [I, D])
      dequant(q3, ct, wd + I * D * cs, stream);
      gemm_dense(ct, a, D, n, wd, 2 * I, D, DType::F32, out, 2 * I, stream);
    } else {
      gemv(q1, ct, a, D, n, DType::F32, out, 2 * I, gv, stream);
      gemv(q3, ct, a, D, n, DType::F32, out + I, 2 * I, gv, stream);
    }
  };
  auto down = [&](const QMatrix& q2, const void* a, int n, float* out) {
    if (n >= gmin) {
      dequant(q2, ct, wd, stream);  // ([D, I])
      gemm_dense(ct, a, I, n, wd, D, I, DType::F32, out, D, stream);
    } else {
      gemv(q2, ct, a, I, n, DType::F32, out, D, gv, stream);
    }
  };

  // 4. gate/up products
  int off = 0;
  for (int e = 0; e < E; ++e) {
    const int n = cnt[static_cast<size_t>(e)];
    if (n > 0) up(mx(p1[e], p1s[e], I, D), mx(p3[e], p3s[e], I, D), xg + static_cast<int64_t>(off) * D * cs, n,
                  gu + static_cast<int64_t>(off) * 2 * I);
    off += n;
  }
  DSX_CHECK(off == Tk, "moe_prefill: expert ids outside [0, ", E, ")");
  if (has_shared) up(m.shared_w1, m.shared_w3, xq, T, gu + static_cast<int64_t>(Tk) * 2 * I);
  // 5. SwiGLU (+ routing weight) and QA8 of the hidden rows
  swiglu_rows_kernel<<<grid_for(static_cast<int64_t>(rows_all) * I), 256, 0, stream>>>(
      gu, rows_all, Tk, static_cast<int>(I), perm, weights, m.swiglu_limit, bf16 ? 1 : 0, h);
  DSX_CUDA_CHECK(cudaGetLastError());
  qa8_fake(DType::F32, h, I, rows_all, I, m.qblock, ct, hq, I, stream);
  // 6. down products
  off = 0;
  for (int e = 0; e < E; ++e) {
    const int n = cnt[static_cast<size_t>(e)];
    if (n > 0)
      down(mx(p2[e], p2s[e], D, I), hq + static_cast<int64_t>(off) * I * cs, n, yp + static_cast<int64_t>(off) * D);
    off += n;
  }
  if (has_shared) down(m.shared_w2, hq + static_cast<int64_t>(Tk) * I * cs, T, yp + static_cast<int64_t>(Tk) * D);
  // 7. combine in the reference order
  combine_kernel<<<static_cast<unsigned>(T), 256, 0, stream>>>(yp, inv, ids, topk, Tk, has_shared ? 1 : 0,
                                                                static_cast<int>(D), bf16 ? 1 : 0, y,
                                                                static_cast<int>(yt), ldy);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
