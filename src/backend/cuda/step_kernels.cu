#include "backend/cuda/step_kernels.h"

#include "kernels/cuda/cuda_util.h"
#include "util/numerics.h"

namespace dsx::cuda {

namespace {

template <typename T>
__device__ __forceinline__ void store_act(T* p, float v);
template <>
__device__ __forceinline__ void store_act<float>(float* p, float v) {
  *p = v;
}
template <>
__device__ __forceinline__ void store_act<uint16_t>(uint16_t* p, float v) {
  *p = f32_to_bf16(v);
}

// grid (ceil(D / 256), T): one element of the embedding row per thread, written to the
// M streams (a one-block-per-token loop was latency-bound: 12.7 us for one token)
template <typename T>
__global__ void embed_kernel(const uint16_t* __restrict__ embed, const int32_t* __restrict__ ids, int M, int64_t D,
                             T* __restrict__ X) {
  const int t = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  const float v = bf16_to_f32(embed[static_cast<int64_t>(ids[t]) * D + d]);
  for (int m = 0; m < M; ++m) store_act(X + (static_cast<int64_t>(t) * M + m) * D + d, v);
}

__global__ void onehot_kernel(float* pre, int T, int M) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < T * M) pre[i] = (i % M) == 0 ? 1.0f : 0.0f;
}

__global__ void advance_kernel(int64_t* p, int64_t n) { *p += n; }

__device__ __forceinline__ float load_act(const float* p) { return *p; }
__device__ __forceinline__ float load_act(const uint16_t* p) { return bf16_to_f32(*p); }

// grid (ceil(D / 256), T): the mean over the M streams, summed in stream order in f32;
// rounded to bf16 in bf16 mode (the reference's residual precision)
template <typename T>
__global__ void stream_mean_kernel(const T* __restrict__ X, int M, int64_t D, float* __restrict__ out, int64_t ld) {
  const int t = blockIdx.y;
  const int64_t d = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (d >= D) return;
  float s = 0;
  for (int m = 0; m < M; ++m) s += load_act(X + (static_cast<int64_t>(t) * M + m) * D + d);
  const float v = s / static_cast<float>(M);
  out[static_cast<int64_t>(t) * ld + d] = sizeof(T) == 2 ? round_bf16(v) : v;
}

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

// Approximately normal: sum of four uniforms, centred and scaled to unit variance.
__device__ __forceinline__ float gauss(uint64_t h) {
  float s = 0;
  for (int i = 0; i < 4; ++i) s += static_cast<float>((h >> (16 * i)) & 0xffff) / 65536.0f;
  return (s - 2.0f) * 1.7320508f;
}

__global__ void fill_kernel(uint8_t* dst, int64_t n, int kind, uint64_t seed, float std, float mean, int center,
                            int spread) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const uint64_t h = mix64(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(i));
    switch (kind) {
      case 0: {
        uint8_t c = f32_to_e4m3(gauss(h) * 64.0f);
        if ((c & 0x7f) == 0x7f) c = 0x7e;
        dst[i] = c;
        break;
      }
      case 1: {
        const uint8_t lo = f32_to_e2m1(fminf(fmaxf(gauss(h) * 2.0f, -6.f), 6.f));
        const uint8_t hi = f32_to_e2m1(fminf(fmaxf(gauss(h >> 7) * 2.0f, -6.f), 6.f));
        dst[i] = static_cast<uint8_t>(lo | (hi << 4));
        break;
      }
      case 2:
        dst[i] = static_cast<uint8_t>(center - spread + static_cast<int>(h % (2 * spread + 1)));
        break;
      case 3:
        if ((i & 1) == 0 && i + 1 < n) {
          const uint16_t v = f32_to_bf16(mean + std * gauss(h));
          dst[i] = static_cast<uint8_t>(v & 0xff);
          dst[i + 1] = static_cast<uint8_t>(v >> 8);
        }
        break;
      case 4:
        if ((i & 3) == 0 && i + 3 < n) {
          const float v = mean + std * gauss(h);
          const uint32_t u = __float_as_uint(v);
          for (int b = 0; b < 4; ++b) dst[i + b] = static_cast<uint8_t>(u >> (8 * b));
        }
        break;
    }
  }
}

}  // namespace

void embed_streams(Act act, const uint16_t* embed, const int32_t* ids, int T, int M, int64_t D, void* X,
                   cudaStream_t stream) {
  if (T <= 0) return;
  const dim3 grid(static_cast<unsigned>((D + 255) / 256), static_cast<unsigned>(T));
  if (act == Act::F32)
    embed_kernel<float><<<grid, 256, 0, stream>>>(embed, ids, M, D, static_cast<float*>(X));
  else
    embed_kernel<uint16_t><<<grid, 256, 0, stream>>>(embed, ids, M, D, static_cast<uint16_t*>(X));
  DSX_CUDA_CHECK(cudaGetLastError());
}

void onehot_pre(float* pre, int T, int M, cudaStream_t stream) {
  const int n = T * M;
  onehot_kernel<<<(n + 255) / 256, 256, 0, stream>>>(pre, T, M);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void stream_mean(Act act, const void* X, int T, int M, int64_t D, float* out, int64_t ld, cudaStream_t stream) {
  if (T <= 0) return;
  const dim3 grid(static_cast<unsigned>((D + 255) / 256), static_cast<unsigned>(T));
  if (act == Act::F32)
    stream_mean_kernel<float><<<grid, 256, 0, stream>>>(static_cast<const float*>(X), M, D, out, ld);
  else
    stream_mean_kernel<uint16_t><<<grid, 256, 0, stream>>>(static_cast<const uint16_t*>(X), M, D, out, ld);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void advance_pos(int64_t* d_pos, int64_t n, cudaStream_t stream) {
  advance_kernel<<<1, 1, 0, stream>>>(d_pos, n);
  DSX_CUDA_CHECK(cudaGetLastError());
}

void fill_random(void* dst, int64_t n, int kind, uint64_t seed, float std, float mean, int center, int spread,
                 cudaStream_t stream) {
  if (n <= 0) return;
  fill_kernel<<<2048, 256, 0, stream>>>(static_cast<uint8_t*>(dst), n, kind, seed, std, mean, center, spread);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace dsx::cuda
