#include "kernels/cuda/elementwise.h"

#include <algorithm>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/pdl_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

void check_launch(const char* what) {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("CUDA launch of ", what, " failed: ", cudaGetErrorString(e));
}

namespace {

// ---- RMSNorm (+ QA8) ------------------------------------------------------------
template <typename T>
__global__ void rmsnorm_kernel(const T* x, T* y, const float* __restrict__ w, int n, float eps, uint8_t* qc,
                               float* qs) {
  extern __shared__ float sm[];  // n floats
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  const T* xr = x + row * n;
  // launched with programmatic dependent launch: x may come from the previous kernel
  pdl_wait();
  pdl_launch_dependents();
  double ss = 0.0;
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = ld(xr, i);
    sm[i] = v;
    ss += static_cast<double>(v) * static_cast<double>(v);
  }
  ss = block_sum(ss, red);
  const float r = 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(n)) + eps);
  T* yr = y + row * n;
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float v = sm[i] * r;
    if (w) v = w[i] * v;
    v = rnd<T>(v);
    sm[i] = v;
    st(yr, i, v);
  }
  if (qc) {
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int b = wid; b < n / 32; b += nw) {
      const QCode q = fq8_group(sm[b * 32 + lane]);
      qc[row * n + b * 32 + lane] = q.code;
      if (lane == 0) qs[row * (n / 32) + b] = q.scale;
    }
  }
}

template <typename T>
__global__ void qa8_rows_kernel(const T* __restrict__ x, int n, uint8_t* qc, float* qs) {
  const int64_t row = blockIdx.x;
  const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
  for (int b = wid; b < n / 32; b += nw) {
    const QCode q = fq8_group(ld(x + row * n, b * 32 + lane));
    qc[row * n + b * 32 + lane] = q.code;
    if (lane == 0) qs[row * (n / 32) + b] = q.scale;
  }
}

// ---- RoPE -----------------------------------------------------------------------
template <typename T>
__global__ void rope_kernel(T* x, int heads, int hd, int np, const float* __restrict__ inv_freq,
                            const int64_t* __restrict__ d_pos, bool inverse) {
  extern __shared__ float cs[];  // [2 * np]
  const int64_t row = blockIdx.x;
  const float pos = static_cast<float>(*d_pos + row);
  for (int i = threadIdx.x; i < np; i += blockDim.x) rope_cs(pos, inv_freq[i], cs[i], cs[np + i]);
  __syncthreads();
  const int off = hd - 2 * np;
  for (int idx = blockIdx.y * blockDim.x + threadIdx.x; idx < heads * np; idx += gridDim.y * blockDim.x) {
    const int h = idx / np, i = idx - h * np;
    T* p = x + (row * heads + h) * static_cast<int64_t>(hd) + off + 2 * i;
    float ra, rb;
    rope_pair(ld(p, 0), ld(p, 1), cs[i], cs[np + i], inverse, ra, rb);
    st(p, 0, ra);
    st(p, 1, rb);
  }
}

template <typename T>
__global__ void rope_fq4e8_kernel(const T* __restrict__ in, float* __restrict__ out, int heads, int hd, int np,
                                  const float* __restrict__ inv_freq, const int64_t* __restrict__ d_pos) {
  const int64_t vec = blockIdx.x;  // row * heads + head
  const int d = threadIdx.x;
  pdl_launch_dependents();  // (the indexer's blocks launch meanwhile; they wait for all of this)
  // the rotation needs only the position (advanced by the previous step): before the wait
  float c, s;
  rope_lane_cs(d, hd, np, static_cast<float>(*d_pos + vec / heads), inv_freq, c, s);
  pdl_wait();  // `in` comes from the previous kernel (programmatic dependent launch)
  float v = ld(in, vec * hd + d);
  v = rnd<T>(rope_lane_apply(v, d, hd, np, c, s, false));
  out[vec * hd + d] = fq4e8_group(v).value;
}

// ---- window KV: RMSNorm -> RoPE -> FQ8 -> compact row --------------------------------
template <typename T>
__global__ void kv_finish_kernel(const T* __restrict__ kv, const float* __restrict__ w, float eps, int hd, int np,
                                 const float* __restrict__ inv_freq, const int64_t* __restrict__ d_pos,
                                 uint8_t* __restrict__ codes, uint8_t* __restrict__ scales,
                                 uint8_t* __restrict__ ring_codes, uint8_t* __restrict__ ring_scales, int ring_cap) {
  dev::trace_block(70);
  __shared__ double red[32];
  const int64_t row = blockIdx.x;
  const int d = threadIdx.x;
  const float x = ld(kv, row * hd + d);
  const double ss = block_sum(static_cast<double>(x) * static_cast<double>(x), red);
  const float r = 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(hd)) + eps);
  float y = rnd<T>(w[d] * (x * r));
  const float pos = static_cast<float>(*d_pos + row);
  y = rnd<T>(rope_lane(y, d, hd, np, pos, inv_freq, false));
  const QCode q = fq8_group(y);
  codes[row * hd + d] = q.code;
  if ((d & 31) == 0) scales[row * (hd / 32) + d / 32] = ue8m0_byte(q.scale);
  if (ring_codes) {  // the window ring's slot of this position too (kv_finish's contract)
    const int64_t slot = (*d_pos + row) % ring_cap;
    ring_codes[slot * hd + d] = q.code;
    if ((d & 31) == 0) ring_scales[slot * (hd / 32) + d / 32] = ue8m0_byte(q.scale);
  }
  dev::trace_mark(71);
}

// ---- standalone fake-quantizers ----------------------------------------------------
__global__ void fake_quant_kernel(float* x, int64_t n, int kind) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const float v = i < n ? x[i] : 0.0f;
  QCode q;
  if (kind == 0) q = fq8_group(v);
  else if (kind == 1) q = fq4e8_group(v);
  else q = fq4e4_group(v);
  if (i < n) x[i] = q.value;
}

__global__ void quantize_fq8_kernel(const float* __restrict__ x, int dim, uint8_t* codes, uint8_t* scales) {
  const int64_t row = blockIdx.x;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    const QCode q = fq8_group(x[row * dim + d]);
    codes[row * dim + d] = q.code;
    if ((d & 31) == 0) scales[row * (dim / 32) + d / 32] = ue8m0_byte(q.scale);
  }
}
__global__ void quantize_fq4e8_kernel(const float* __restrict__ x, int dim, uint8_t* packed, uint8_t* scales) {
  const int64_t row = blockIdx.x;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    const QCode q = fq4e8_group(x[row * dim + d]);
    const uint8_t b = pack_nibbles(q.code);
    if ((d & 1) == 0) packed[(row * dim + d) / 2] = b;
    if ((d & 31) == 0) scales[row * (dim / 32) + d / 32] = ue8m0_byte(q.scale);
  }
}
__global__ void quantize_fq4e4_kernel(const float* __restrict__ x, int dim, uint8_t* packed, uint8_t* scales) {
  const int64_t row = blockIdx.x;
  for (int d = threadIdx.x; d < dim; d += blockDim.x) {
    const QCode q = fq4e4_group(x[row * dim + d]);
    const uint8_t b = pack_nibbles(q.code);
    if ((d & 1) == 0) packed[(row * dim + d) / 2] = b;
    if ((d & 15) == 0) scales[row * (dim / 16) + d / 16] = f32_to_e4m3(q.scale);
  }
}

__global__ void dequant_fq8_kernel(const uint8_t* __restrict__ codes, const uint8_t* __restrict__ scales, int dim,
                                   int64_t n, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = i / dim, d = i - row * dim;
  out[i] = e4m3_dev(codes[i]) * e8m0_dev(scales[row * (dim / 32) + d / 32]);
}
__global__ void dequant_fq4_kernel(const uint8_t* __restrict__ packed, const uint8_t* __restrict__ scales, int dim,
                                   int block, bool e4m3_scale, int64_t n, float* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int64_t row = i / dim, d = i - row * dim;
  const uint32_t byte = packed[i / 2];
  const uint32_t code = (i & 1) ? (byte >> 4) : (byte & 15u);
  const uint32_t sb = scales[row * (dim / block) + d / block];
  out[i] = e2m1_dev(code) * (e4m3_scale ? e4m3_dev(sb) : e8m0_dev(sb));
}

inline unsigned blocks_for(int64_t n, int threads) { return static_cast<unsigned>((n + threads - 1) / threads); }

int row_threads(int dim) {
  DSX_CHECK(dim % 32 == 0 && dim > 0, "row width must be a positive multiple of 32");
  return dim <= 1024 ? dim : 1024;
}

}  // namespace

void rmsnorm(Act act, const void* x, void* y, const float* w, int rows, int n, float eps, uint8_t* q_codes,
             float* q_scales, cudaStream_t stream) {
  if (rows <= 0) return;
  DSX_CHECK(n % 32 == 0, "rmsnorm: n must be a multiple of 32");
  DSX_CHECK((q_codes == nullptr) == (q_scales == nullptr), "rmsnorm: give both QA8 outputs or neither");
  const size_t smem = static_cast<size_t>(n) * sizeof(float);
  DSX_CHECK(smem <= 48 * 1024, "rmsnorm: row too wide");
  DSX_DISPATCH_ACT(act, T,
                   detail::launch_pdl(rmsnorm_kernel<T>, dim3(static_cast<unsigned>(rows)),
                                      dim3(static_cast<unsigned>(std::min(n, 1024))), smem, stream,
                                      static_cast<const T*>(x), static_cast<T*>(y), w, n, eps, q_codes, q_scales));
  check_launch("rmsnorm");
}

void qa8_rows(Act act, const void* x, int rows, int n, uint8_t* q_codes, float* q_scales, cudaStream_t stream) {
  if (rows <= 0) return;
  DSX_CHECK(n % 32 == 0, "qa8_rows: n must be a multiple of 32");
  DSX_DISPATCH_ACT(act, T, qa8_rows_kernel<T><<<rows, 256, 0, stream>>>(static_cast<const T*>(x), n, q_codes, q_scales));
  check_launch("qa8_rows");
}

void rope(Act act, void* x, int rows, int heads, int head_dim, int n_pairs, const float* inv_freq,
          const int64_t* d_pos, bool inverse, cudaStream_t stream) {
  if (rows <= 0 || n_pairs <= 0) return;
  DSX_CHECK(2 * n_pairs <= head_dim && head_dim % 2 == 0, "rope: bad geometry");
  const size_t smem = 2 * static_cast<size_t>(n_pairs) * sizeof(float);
  DSX_DISPATCH_ACT(act, T,
                   rope_kernel<T><<<dim3(rows, (heads * n_pairs + 255) / 256), 256, smem, stream>>>(static_cast<T*>(x), heads, head_dim, n_pairs, inv_freq,
                                                               d_pos, inverse));
  check_launch("rope");
}

void rope_fq4e8(Act act, const void* in, float* out, int rows, int heads, int head_dim, int n_pairs,
                const float* inv_freq, const int64_t* d_pos, cudaStream_t stream) {
  if (rows <= 0) return;
  DSX_CHECK(head_dim % 32 == 0 && head_dim <= 1024 && 2 * n_pairs <= head_dim, "rope_fq4e8: bad geometry");
  DSX_DISPATCH_ACT(act, T,
                   detail::launch_pdl(rope_fq4e8_kernel<T>, dim3(static_cast<unsigned>(rows * heads)),
                                      dim3(static_cast<unsigned>(head_dim)), 0, stream, static_cast<const T*>(in), out,
                                      heads, head_dim, n_pairs, inv_freq, d_pos));
  check_launch("rope_fq4e8");
}

void kv_finish(Act act, const void* kv, const float* kv_norm, float eps, int rows, int head_dim, int n_pairs,
               const float* inv_freq, const int64_t* d_pos, const Fq8Rows& out, cudaStream_t stream,
               const Fq8Rows* ring, int ring_cap) {
  if (rows <= 0) return;
  DSX_CHECK(head_dim % 32 == 0 && head_dim <= 1024 && 2 * n_pairs <= head_dim && out.dim == head_dim,
            "kv_finish: bad geometry");
  DSX_CHECK(!ring || (rows == 1 && ring->dim == head_dim && ring_cap >= 1), "kv_finish: the ring copy is for one row");
  DSX_DISPATCH_ACT(act, T,
                   kv_finish_kernel<T><<<rows, head_dim, 0, stream>>>(static_cast<const T*>(kv), kv_norm, eps,
                                                                      head_dim, n_pairs, inv_freq, d_pos, out.codes,
                                                                      out.scales, ring ? ring->codes : nullptr,
                                                                      ring ? ring->scales : nullptr, ring_cap));
  check_launch("kv_finish");
}

void fake_quant_inplace(FakeQuant kind, float* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const int block = kind == FakeQuant::FQ4e4 ? 16 : 32;
  DSX_CHECK(n % block == 0, "fake_quant_inplace: n must be a multiple of the block");
  fake_quant_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(x, n, static_cast<int>(kind));
  check_launch("fake_quant_inplace");
}

void quantize_fq8_rows(const float* x, int64_t rows, int dim, const Fq8Rows& out, cudaStream_t stream) {
  if (rows <= 0) return;
  quantize_fq8_kernel<<<static_cast<unsigned>(rows), row_threads(dim), 0, stream>>>(x, dim, out.codes, out.scales);
  check_launch("quantize_fq8_rows");
}
void quantize_fq4e4_rows(const float* x, int64_t rows, int dim, const Fq4e4Rows& out, cudaStream_t stream) {
  if (rows <= 0) return;
  quantize_fq4e4_kernel<<<static_cast<unsigned>(rows), row_threads(dim), 0, stream>>>(x, dim, out.packed, out.scales);
  check_launch("quantize_fq4e4_rows");
}
void quantize_fq4e8_rows(const float* x, int64_t rows, int dim, const Fq4e8Rows& out, cudaStream_t stream) {
  if (rows <= 0) return;
  quantize_fq4e8_kernel<<<static_cast<unsigned>(rows), row_threads(dim), 0, stream>>>(x, dim, out.packed, out.scales);
  check_launch("quantize_fq4e8_rows");
}

void dequant_fq8_rows(const Fq8Rows& in, int64_t rows, float* out, cudaStream_t stream) {
  const int64_t n = rows * in.dim;
  if (n <= 0) return;
  dequant_fq8_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(in.codes, in.scales, in.dim, n, out);
  check_launch("dequant_fq8_rows");
}
void dequant_fq4e4_rows(const Fq4e4Rows& in, int64_t rows, float* out, cudaStream_t stream) {
  const int64_t n = rows * in.dim;
  if (n <= 0) return;
  dequant_fq4_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(in.packed, in.scales, in.dim, 16, true, n, out);
  check_launch("dequant_fq4e4_rows");
}
void dequant_fq4e8_rows(const Fq4e8Rows& in, int64_t rows, float* out, cudaStream_t stream) {
  const int64_t n = rows * in.dim;
  if (n <= 0) return;
  dequant_fq4_kernel<<<blocks_for(n, 256), 256, 0, stream>>>(in.packed, in.scales, in.dim, 32, false, n, out);
  check_launch("dequant_fq4e8_rows");
}

}  // namespace dsx::cuda
