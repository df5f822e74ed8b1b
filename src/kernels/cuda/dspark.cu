// The DSpark drafter's own kernels (dspark.h).
#include <cmath>

#include "kernels/cuda/dspark.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "util/error.h"

namespace dsx::cuda {

namespace {

using dev::bf16;

// ---- attention ------------------------------------------------------------------------

constexpr int kAttnThreads = 128;

template <typename T>
__global__ void __launch_bounds__(kAttnThreads) dspark_attention_kernel(DSparkAttnArgs a) {
  extern __shared__ float sm[];
  const int h = blockIdx.x, j = blockIdx.y, hd = a.head_dim;
  float* q = sm;                 // [hd]
  float* p = sm + hd;            // [W + B] logits, then probabilities
  __shared__ int valid_n;
  __shared__ float s_den;
  const int64_t n = *a.d_n;
  const float pos = static_cast<float>(n + j);
  const int off = hd - 2 * a.n_pairs;
  const T* qin = static_cast<const T*>(a.q) + (static_cast<int64_t>(j) * a.n_heads + h) * hd;
  // q with RoPE at n + j (rounded to act)
  for (int i = threadIdx.x; i < hd / 2; i += kAttnThreads) {
    float x0 = dev::ld(qin, 2 * i), x1 = dev::ld(qin, 2 * i + 1);
    if (2 * i >= off) {
      float c, s;
      dev::rope_cs(pos, a.inv_freq[(2 * i - off) >> 1], c, s);
      float r0, r1;
      dev::rope_pair(x0, x1, c, s, false, r0, r1);
      x0 = dev::rnd<T>(r0), x1 = dev::rnd<T>(r1);
    }
    q[2 * i] = x0, q[2 * i + 1] = x1;
  }
  if (threadIdx.x == 0) valid_n = 0;
  __syncthreads();
  // keys: ring positions n - nr .. n - 1 (held ones), then the B block rows
  const int64_t nr = n < a.window ? n : a.window;
  const int nk = static_cast<int>(nr) + a.B;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  auto row_of = [&](int k, const uint8_t*& codes, const uint8_t*& scales) -> bool {
    if (k < nr) {
      const int64_t pp = n - nr + k;
      const int64_t slot = pp % a.ring_cap;
      if (a.held[slot] != pp) return false;
      codes = a.ring.codes + slot * hd;
      scales = a.ring.scales + slot * (hd / 32);
    } else {
      const int64_t r = k - nr;
      codes = a.block.codes + r * hd;
      scales = a.block.scales + r * (hd / 32);
    }
    return true;
  };
  for (int k = warp; k < nk; k += kAttnThreads / 32) {
    const uint8_t *codes, *scales;
    if (!row_of(k, codes, scales)) {
      if (lane == 0) p[k] = -INFINITY;
      continue;
    }
    float acc = 0.0f;
    for (int i = 0; i < hd / 32; ++i) {
      const int d = lane + 32 * i;
      acc += q[d] * (dev::e4m3_dev(codes[d]) * dev::e8m0_dev(scales[i]));
    }
    acc = dev::warp_sum(acc);
    if (lane == 0) p[k] = acc * a.scale;
  }
  __syncthreads();
  // softmax with the sink in the denominator (warp 0), probabilities in place
  if (warp == 0) {
    const float sink = a.sink[h];
    float mx = sink;
    for (int k = lane; k < nk; k += 32) mx = fmaxf(mx, p[k]);
    mx = dev::warp_max(mx);
    float den = 0.0f;
    for (int k = lane; k < nk; k += 32) {
      const float e = p[k] == -INFINITY ? 0.0f : expf(p[k] - mx);
      p[k] = e;
      den += e;
    }
    den = dev::warp_sum(den);
    if (lane == 0) s_den = den + expf(sink - mx);
  }
  __syncthreads();
  const float den = s_den;
  for (int k = threadIdx.x; k < nk; k += kAttnThreads) p[k] = p[k] / den;
  __syncthreads();
  // output pairs, inverse RoPE at n + j
  T* out = static_cast<T*>(a.out) + (static_cast<int64_t>(j) * a.n_heads + h) * hd;
  for (int i = threadIdx.x; i < hd / 2; i += kAttnThreads) {
    const int d = 2 * i;
    float o0 = 0.0f, o1 = 0.0f;
    for (int k = 0; k < nk; ++k) {
      const float pk = p[k];
      if (pk == 0.0f) continue;
      const uint8_t *codes, *scales;
      row_of(k, codes, scales);
      const float sc = dev::e8m0_dev(scales[d / 32]);
      o0 += pk * (dev::e4m3_dev(codes[d]) * sc);
      o1 += pk * (dev::e4m3_dev(codes[d + 1]) * sc);
    }
    o0 = dev::rnd<T>(o0), o1 = dev::rnd<T>(o1);
    if (d >= off) {
      float c, s;
      dev::rope_cs(pos, a.inv_freq[(d - off) >> 1], c, s);
      float r0, r1;
      dev::rope_pair(o0, o1, c, s, true, r0, r1);
      o0 = r0, o1 = r1;
    }
    dev::st(out, d, o0);
    dev::st(out, d + 1, o1);
  }
}

// ---- Markov row -----------------------------------------------------------------------

constexpr int kMarkovThreads = 256;
constexpr int kMarkovMaxBlocks = 512;
constexpr int kMarkovMaxR = 2048;

struct MarkovWs {
  float v[kMarkovMaxBlocks];
  int64_t i[kMarkovMaxBlocks];
  unsigned counter;
};

__device__ __forceinline__ bool better(float va, int64_t ia, float vb, int64_t ib) {
  if (ia < 0) return false;
  if (ib < 0) return true;
  return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ float bf16_bits(uint32_t u16) { return __uint_as_float(u16 << 16); }

// G lanes per vocabulary row (each 8 bf16 = 16 bytes of the row at a time).
template <typename T, int G>
__global__ void __launch_bounds__(kMarkovThreads) dspark_markov_kernel(DSparkMarkovArgs a) {
  __shared__ float e[kMarkovMaxR];
  __shared__ float red[32];
  const int R = a.R;
  const int32_t prev = *a.prev;
  for (int k = threadIdx.x; k < R; k += kMarkovThreads) {
    const float v = bf16_bits(a.embed[static_cast<int64_t>(prev) * R + k]);
    e[k] = v;
    if (a.embed_out && blockIdx.x == 0) a.embed_out[k] = v;
  }
  __syncthreads();
  // block 0: the confidence logit
  if (blockIdx.x == 0) {
    const T* z = static_cast<const T*>(a.z);
    float s = 0.0f;
    for (int64_t d = threadIdx.x; d < a.D; d += kMarkovThreads) s += a.conf_w[d] * dev::ld(z, d);
    for (int k = threadIdx.x; k < R; k += kMarkovThreads) s += a.conf_w[a.D + k] * e[k];
    s = dev::block_sum(s, red);
    if (threadIdx.x == 0) {
      *a.conf = s;
      if (a.conf_copy) *a.conf_copy = s;
    }
  }
  // rows: G lanes each, rows_per_warp rows per step
  constexpr int rows_per_warp = 32 / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = lane / G, gl = lane % G;
  const int64_t per_iter = static_cast<int64_t>(gridDim.x) * (kMarkovThreads / 32) * rows_per_warp;
  float bv = -INFINITY;
  int64_t bi = -1;
  const int chunks = R / 8;
  for (int64_t v0 = (static_cast<int64_t>(blockIdx.x) * (kMarkovThreads / 32) + warp) * rows_per_warp; v0 < a.V;
       v0 += per_iter) {
    const int64_t v = v0 + sub;
    float acc = 0.0f;
    if (v < a.V) {
      const uint4* row = reinterpret_cast<const uint4*>(a.head + v * R);
      for (int c = gl; c < chunks; c += G) {
        const uint4 w = __ldg(row + c);
        const float* ec = e + c * 8;
        acc += bf16_bits(w.x & 0xffffu) * ec[0];
        acc += bf16_bits(w.x >> 16) * ec[1];
        acc += bf16_bits(w.y & 0xffffu) * ec[2];
        acc += bf16_bits(w.y >> 16) * ec[3];
        acc += bf16_bits(w.z & 0xffffu) * ec[4];
        acc += bf16_bits(w.z >> 16) * ec[5];
        acc += bf16_bits(w.w & 0xffffu) * ec[6];
        acc += bf16_bits(w.w >> 16) * ec[7];
      }
    }
#pragma unroll
    for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (v < a.V && gl == 0) {
      const float l = a.base[v] + acc;
      a.logits[v] = l;
      if (l > bv) bv = l, bi = v;  // (rows visited in increasing order by this lane)
    }
  }
  // the block's best, then the last block combines
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
    const int64_t oi = __shfl_xor_sync(0xffffffffu, bi, o);
    if (better(ov, oi, bv, bi)) bv = ov, bi = oi;
  }
  __shared__ float sv[kMarkovThreads / 32];
  __shared__ int64_t si[kMarkovThreads / 32];
  __shared__ bool last;
  if (lane == 0) sv[warp] = bv, si[warp] = bi;
  __syncthreads();
  MarkovWs* ws = static_cast<MarkovWs*>(a.ws);
  if (threadIdx.x == 0) {
    for (int w = 1; w < kMarkovThreads / 32; ++w)
      if (better(sv[w], si[w], bv, bi)) bv = sv[w], bi = si[w];
    ws->v[blockIdx.x] = bv;
    ws->i[blockIdx.x] = bi;
    __threadfence();
    last = atomicAdd(&ws->counter, 1u) == gridDim.x - 1;
    if (last) {
      ws->counter = 0u;
      __threadfence();
    }
  }
  __syncthreads();
  if (!last || threadIdx.x != 0) return;
  bv = __ldcg(&ws->v[0]);
  bi = __ldcg(&ws->i[0]);
  for (unsigned b = 1; b < gridDim.x; ++b) {
    const float v = __ldcg(&ws->v[b]);
    const int64_t i = __ldcg(&ws->i[b]);
    if (better(v, i, bv, bi)) bv = v, bi = i;
  }
  const int32_t t = (isnan(__ldcg(a.logits)) || bi < 0) ? 0 : static_cast<int32_t>(bi);
  *a.token = t;
  if (a.token_copy) *a.token_copy = t;
}

}  // namespace

void dspark_attention(Act act, const DSparkAttnArgs& a, cudaStream_t stream) {
  DSX_CHECK(a.B > 0 && a.n_heads > 0 && a.head_dim % 32 == 0 && a.head_dim <= 1024 && a.window > 0 && a.ring_cap >= a.window,
            "dspark_attention: bad shape");
  const size_t smem = static_cast<size_t>(a.head_dim + a.window + a.B) * 4;
  const dim3 grid(static_cast<unsigned>(a.n_heads), static_cast<unsigned>(a.B));
  DSX_DISPATCH_ACT(act, T, dspark_attention_kernel<T><<<grid, kAttnThreads, smem, stream>>>(a));
  check_launch("dspark_attention");
}

size_t dspark_markov_ws_bytes() { return sizeof(MarkovWs); }

void dspark_markov_row(Act act, const DSparkMarkovArgs& a, cudaStream_t stream) {
  DSX_CHECK(a.R >= 8 && a.R % 8 == 0 && a.R <= kMarkovMaxR && a.V > 0 && a.ws, "dspark_markov_row: bad shape");
  DSX_CHECK((reinterpret_cast<uintptr_t>(a.head) & 15) == 0, "dspark_markov_row: markov head not 16-byte aligned");
  const int chunks = a.R / 8;
  const int G = chunks >= 32 ? 32 : chunks >= 16 ? 16 : chunks >= 8 ? 8 : chunks >= 4 ? 4 : chunks >= 2 ? 2 : 1;
  const int64_t rows_per_block = static_cast<int64_t>(kMarkovThreads / 32) * (32 / G);
  // about 4 rows per lane group, at most kMarkovMaxBlocks blocks
  int64_t blocks = (a.V + rows_per_block * 4 - 1) / (rows_per_block * 4);
  blocks = blocks < 1 ? 1 : blocks > kMarkovMaxBlocks ? kMarkovMaxBlocks : blocks;
  const unsigned g = static_cast<unsigned>(blocks);
  DSX_DISPATCH_ACT(act, T, {
    switch (G) {
      case 32: dspark_markov_kernel<T, 32><<<g, kMarkovThreads, 0, stream>>>(a); break;
      case 16: dspark_markov_kernel<T, 16><<<g, kMarkovThreads, 0, stream>>>(a); break;
      case 8: dspark_markov_kernel<T, 8><<<g, kMarkovThreads, 0, stream>>>(a); break;
      case 4: dspark_markov_kernel<T, 4><<<g, kMarkovThreads, 0, stream>>>(a); break;
      case 2: dspark_markov_kernel<T, 2><<<g, kMarkovThreads, 0, stream>>>(a); break;
      default: dspark_markov_kernel<T, 1><<<g, kMarkovThreads, 0, stream>>>(a); break;
    }
  });
  check_launch("dspark_markov_row");
}

}  // namespace dsx::cuda
