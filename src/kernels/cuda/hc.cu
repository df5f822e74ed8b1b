#include "kernels/cuda/hc.h"

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

constexpr int kChunk = 128;  // D-chunk per block (one element per thread)
constexpr int kM = kHcStreams;

size_t z_bytes(int T, int ns) { return ((static_cast<size_t>(T) * ns * kHcMix * sizeof(float)) + 15) & ~size_t{15}; }

template <typename T, int TT>
__global__ void __launch_bounds__(kChunk) hc_pass_kernel(int Ttot, int64_t D, int ns, T* X, const T* y,
                                                         const float* __restrict__ post,
                                                         const float* __restrict__ comb,
                                                         const float* __restrict__ fn, const float* __restrict__ pre,
                                                         T* collapsed, float* __restrict__ wz,
                                                         double* __restrict__ wss) {
  __shared__ float red_z[kChunk / 32][kHcMix];
  __shared__ double red_d[kChunk / 32][2];
  const int64_t d = static_cast<int64_t>(blockIdx.x) * kChunk + threadIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t F = kM * D;
  float ph[kHcMix][kM];
  if (fn) {
#pragma unroll
    for (int o = 0; o < kHcMix; ++o)
#pragma unroll
      for (int m = 0; m < kM; ++m) ph[o][m] = fn[o * F + m * D + d];
  }
  for (int tt = 0; tt < TT; ++tt) {
    const int t = blockIdx.y * TT + tt;
    if (t >= Ttot) break;  // uniform across the block
    T* Xt = X + static_cast<int64_t>(t) * F;
    float x[kM];
#pragma unroll
    for (int m = 0; m < kM; ++m) x[m] = ld(Xt, m * D + d);
    if (y) {
      const float yv = ld(y, static_cast<int64_t>(t) * D + d);
      const float* C = comb + t * kM * kM;
      const float* P = post + t * kM;
      float nx[kM];
#pragma unroll
      for (int k = 0; k < kM; ++k) {
        float mixed = 0.0f;
#pragma unroll
        for (int j = 0; j < kM; ++j) mixed = fmaf(C[j * kM + k], x[j], mixed);
        nx[k] = rnd<T>(fmaf(P[k], yv, mixed));
      }
#pragma unroll
      for (int k = 0; k < kM; ++k) {
        st(Xt, k * D + d, nx[k]);
        x[k] = nx[k];
      }
    }
    double ssx = 0.0, ssc = 0.0;
    if (fn) {
#pragma unroll
      for (int m = 0; m < kM; ++m) ssx += static_cast<double>(x[m]) * static_cast<double>(x[m]);
#pragma unroll
      for (int o = 0; o < kHcMix; ++o) {
        float acc = 0.0f;
#pragma unroll
        for (int m = 0; m < kM; ++m) acc = fmaf(ph[o][m], x[m], acc);
        acc = warp_sum(acc);
        if (lane == 0) red_z[warp][o] = acc;
      }
    }
    if (pre) {
      float c = 0.0f;
#pragma unroll
      for (int m = 0; m < kM; ++m) c = fmaf(pre[t * kM + m], x[m], c);
      c = rnd<T>(c);
      st(collapsed, static_cast<int64_t>(t) * D + d, c);
      ssc = static_cast<double>(c) * static_cast<double>(c);
    }
    ssx = warp_sum(ssx);
    ssc = warp_sum(ssc);
    if (lane == 0) {
      red_d[warp][0] = ssx;
      red_d[warp][1] = ssc;
    }
    __syncthreads();
    const int64_t slot = static_cast<int64_t>(t) * ns + blockIdx.x;
    if (fn && threadIdx.x < kHcMix) {
      float s = red_z[0][threadIdx.x];
      for (int w = 1; w < kChunk / 32; ++w) s += red_z[w][threadIdx.x];
      wz[slot * kHcMix + threadIdx.x] = s;
    }
    if (threadIdx.x == 0) {
      double a = red_d[0][0], b = red_d[0][1];
      for (int w = 1; w < kChunk / 32; ++w) {
        a += red_d[w][0];
        b += red_d[w][1];
      }
      wss[slot * 2] = a;
      wss[slot * 2 + 1] = b;
    }
    __syncthreads();  // red_* is reused by the next token
  }
}

template <typename T>
__global__ void hc_finish_kernel(int ns, int64_t D, const float* __restrict__ wz, const double* __restrict__ wss,
                                 bool have_mix, const float* __restrict__ base, const float* __restrict__ scale,
                                 float eps, float hc_eps, int iters, float* __restrict__ pre_out,
                                 float* __restrict__ post_out, float* __restrict__ comb_out, const T* collapsed,
                                 const float* __restrict__ w, T* out, uint8_t* qc, float* qs) {
  const int t = blockIdx.x;
  __shared__ float z[kHcMix];
  if (have_mix) {
    if (threadIdx.x < kHcMix) {
      float s = 0.0f;
      for (int i = 0; i < ns; ++i) s += wz[(static_cast<int64_t>(t) * ns + i) * kHcMix + threadIdx.x];
      z[threadIdx.x] = s;
    }
    __syncthreads();
    // Warp 0: lane (j, k) = j * kM + k owns comb[j][k]; every sum is formed in the
    // same sequential order as the CPU engine (values gathered by shuffles), so the
    // result is bit-identical to the single-thread form, without its ~1.3k serially
    // dependent divisions.
    if (threadIdx.x < 32) {
      const int lane = threadIdx.x;
      double ss = 0.0;
      for (int i = 0; i < ns; ++i) ss += wss[(static_cast<int64_t>(t) * ns + i) * 2];
      const float nu = 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(kM * D)) + eps);
      if (lane < kM) {
        pre_out[t * kM + lane] = sigmoid_dev(fmaf(z[lane] * nu, scale[0], base[lane])) + hc_eps;
        post_out[t * kM + lane] = 2.0f * sigmoid_dev(fmaf(z[kM + lane] * nu, scale[1], base[kM + lane]));
      }
      const int e = lane < kM * kM ? lane : 0;  // lanes >= 16 mirror element 0 (results unused)
      const int j = e / kM, k = e % kM;
      float c = fmaf(z[2 * kM + e] * nu, scale[2], base[2 * kM + e]);
      constexpr unsigned kAll = 0xffffffffu;
      auto row_sum = [&](float v) {  // sum over k of C[j][k], k ascending
        float r = 0.0f;
#pragma unroll
        for (int kk = 0; kk < kM; ++kk) r += __shfl_sync(kAll, v, j * kM + kk);
        return r;
      };
      auto col_sum = [&](float v) {  // sum over j of C[j][k], j ascending
        float r = 0.0f;
#pragma unroll
        for (int jj = 0; jj < kM; ++jj) r += __shfl_sync(kAll, v, jj * kM + k);
        return r;
      };
      float mx = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < kM; ++kk) mx = fmaxf(mx, __shfl_sync(kAll, c, j * kM + kk));
      c = expf(c - mx);
      c = c / row_sum(c) + hc_eps;
      c /= (col_sum(c) + hc_eps);
      for (int it = 1; it < iters; ++it) {
        c /= (row_sum(c) + hc_eps);
        c /= (col_sum(c) + hc_eps);
      }
      if (lane < kM * kM) comb_out[t * kM * kM + lane] = c;
    }
  }
  if (out) {
    double ss = 0.0;
    for (int i = 0; i < ns; ++i) ss += wss[(static_cast<int64_t>(t) * ns + i) * 2 + 1];
    const float r = 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(D)) + eps);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int64_t row = static_cast<int64_t>(t) * D;
    for (int64_t b = warp; b < D / 32; b += nw) {
      const int64_t dd = b * 32 + lane;
      const float c = ld(collapsed, row + dd);
      const float v = rnd<T>(w[dd] * (c * r));
      st(out, row + dd, v);
      if (qc) {
        const QCode q = fq8_group(v);
        qc[row + dd] = q.code;
        if (lane == 0) qs[t * (D / 32) + b] = q.scale;
      }
    }
  }
}

template <typename T>
__global__ void hc_mean_kernel(int64_t D, const T* __restrict__ X, T* __restrict__ out) {
  const int t = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const T* Xt = X + static_cast<int64_t>(t) * kM * D;
  float s = 0.0f;
  for (int m = 0; m < kM; ++m) s += ld(Xt, m * D + d);
  st(out, static_cast<int64_t>(t) * D + d, s * (1.0f / kM));
}

}  // namespace

int hc_splits(int64_t D) { return static_cast<int>(D / kChunk); }

size_t hc_work_bytes(int T, int64_t D) {
  const int ns = hc_splits(D);
  return z_bytes(T, ns) + static_cast<size_t>(T) * ns * 2 * sizeof(double);
}

void hc_pass(Act act, const HcPassArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.D % kChunk == 0, "hc_pass: hidden size must be a multiple of ", kChunk);
  DSX_CHECK(!a.y || (a.post && a.comb), "hc_pass: expand needs post and comb");
  DSX_CHECK(!a.pre || a.collapsed, "hc_pass: collapse needs an output");
  DSX_CHECK(a.work, "hc_pass: no workspace");
  const int ns = hc_splits(a.D);
  float* wz = static_cast<float*>(a.work);
  double* wss = reinterpret_cast<double*>(static_cast<char*>(a.work) + z_bytes(a.T, ns));
  const bool big = a.T >= 32;
  const int TT = big ? 8 : 1;
  dim3 grid(ns, (a.T + TT - 1) / TT);
  DSX_DISPATCH_ACT(act, T, {
    if (big)
      hc_pass_kernel<T, 8><<<grid, kChunk, 0, stream>>>(a.T, a.D, ns, static_cast<T*>(a.X),
                                                         static_cast<const T*>(a.y), a.post, a.comb, a.fn, a.pre,
                                                         static_cast<T*>(a.collapsed), wz, wss);
    else
      hc_pass_kernel<T, 1><<<grid, kChunk, 0, stream>>>(a.T, a.D, ns, static_cast<T*>(a.X),
                                                         static_cast<const T*>(a.y), a.post, a.comb, a.fn, a.pre,
                                                         static_cast<T*>(a.collapsed), wz, wss);
  });
  check_launch("hc_pass");
}

void hc_finish(Act act, const HcFinishArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.D % kChunk == 0, "hc_finish: hidden size must be a multiple of ", kChunk);
  DSX_CHECK(!a.have_mix || (a.base && a.scale && a.pre && a.post && a.comb), "hc_finish: mix outputs missing");
  DSX_CHECK(!a.norm_out || (a.collapsed && a.norm_w), "hc_finish: norm inputs missing");
  DSX_CHECK((a.q_codes == nullptr) == (a.q_scales == nullptr), "hc_finish: give both QA8 outputs or neither");
  const int ns = hc_splits(a.D);
  const float* wz = static_cast<const float*>(a.work);
  const double* wss = reinterpret_cast<const double*>(static_cast<const char*>(a.work) + z_bytes(a.T, ns));
  DSX_DISPATCH_ACT(act, T,
                   hc_finish_kernel<T><<<a.T, 256, 0, stream>>>(
                       ns, a.D, wz, wss, a.have_mix, a.base, a.scale, a.norm_eps, a.hc_eps, a.sinkhorn_iters, a.pre,
                       a.post, a.comb, static_cast<const T*>(a.collapsed), a.norm_w, static_cast<T*>(a.norm_out),
                       a.q_codes, a.q_scales));
  check_launch("hc_finish");
}

void hc_stream_mean(Act act, int T, int64_t D, const void* X, void* out, cudaStream_t stream) {
  if (T <= 0) return;
  dim3 grid(static_cast<unsigned>((D + 255) / 256), T);
  DSX_DISPATCH_ACT(act, T_, hc_mean_kernel<T_><<<grid, 256, 0, stream>>>(D, static_cast<const T_*>(X),
                                                                          static_cast<T_*>(out)));
  check_launch("hc_stream_mean");
}

}  // namespace dsx::cuda
