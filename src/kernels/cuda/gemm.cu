#include "kernels/cuda/gemm.h"

#include <cublas_v2.h>

#include <algorithm>
#include <mutex>

#include "kernels/cuda/gemm_internal.h"
#include "kernels/cuda/gemv_device.cuh"  // WView
#include "kernels/cuda/quant_act_device.cuh"
#include "util/error.h"

namespace dsx::cuda {

namespace {

#define DSX_CUBLAS_CHECK(expr)                                                                 \
  do {                                                                                         \
    cublasStatus_t st_ = (expr);                                                               \
    if (st_ != CUBLAS_STATUS_SUCCESS)                                                          \
      ::dsx::fail("cuBLAS error ", static_cast<int>(st_), " at ", __FILE__, ":", __LINE__, " (", #expr, ")"); \
  } while (0)

std::mutex g_cublas_mu;
cublasHandle_t g_handles[64] = {};

// Caller holds g_cublas_mu.
cublasHandle_t handle_locked() {
  int dev = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  if (dev < 0 || dev >= 64) dev = 0;
  if (!g_handles[dev]) DSX_CUBLAS_CHECK(cublasCreate(&g_handles[dev]));
  return g_handles[dev];
}

constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t pack_bf16(float a, float b) {
  return static_cast<uint32_t>(f32_to_bf16(a)) | (static_cast<uint32_t>(f32_to_bf16(b)) << 16);
}

// Writes 4 consecutive values (16-byte aligned for f32, 8-byte for bf16).
__device__ __forceinline__ void store4(void* dst, int ob, int64_t idx, float a, float b, float c, float d) {
  if (ob)
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(dst) + idx) = make_uint2(pack_bf16(a, b), pack_bf16(c, d));
  else
    *reinterpret_cast<float4*>(static_cast<float*>(dst) + idx) = make_float4(a, b, c, d);
}

// One thread per 16-byte chunk of the stored weight.
template <WFormat F>
__global__ void __launch_bounds__(kThreads)
    dequant_kernel(const uint8_t* __restrict__ w, const uint8_t* __restrict__ s, int64_t N, int64_t K, int sc_cols,
                   int wshift, int tiled, int ob, void* __restrict__ dst) {
  constexpr int EPC = F == WFormat::FP8_BLOCK ? 16 : F == WFormat::MXFP4 ? 32 : F == WFormat::BF16 ? 8 : 4;
  const int64_t C = K / EPC;
  const int64_t total = N * C;
  dev::WView W;  // (the data's addressing only: row-major or the tile layout)
  W.w = w;
  W.row_bytes = C * 16;
  W.tiled = tiled;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t n = i / C, c = i % C;
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(W.row_at(n) + W.byte_off(c * 16)));  // chunk c of row n
    const int64_t o = n * K + c * EPC;
    if constexpr (F == WFormat::FP8_BLOCK) {
      const float f = e8m0_to_f32(s[(n >> wshift) * sc_cols + ((c * 16) >> wshift)]);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t v = dev::word(raw, q);
        store4(dst, ob, o + 4 * q, e4m3_to_f32(v & 0xff) * f, e4m3_to_f32((v >> 8) & 0xff) * f,
               e4m3_to_f32((v >> 16) & 0xff) * f, e4m3_to_f32(v >> 24) * f);
      }
    } else if constexpr (F == WFormat::MXFP4) {
      const float f = e8m0_to_f32(s[n * sc_cols + c]);
      const float k126 = 8.507059173023462e37f;  // 2^126
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const uint32_t v = dev::word(raw, q);
        store4(dst, ob, o + 8 * q, dev::fp4_trick<0>(v) * k126 * f, dev::fp4_trick<1>(v) * k126 * f,
               dev::fp4_trick<2>(v) * k126 * f, dev::fp4_trick<3>(v) * k126 * f);
        store4(dst, ob, o + 8 * q + 4, dev::fp4_trick<4>(v) * k126 * f, dev::fp4_trick<5>(v) * k126 * f,
               dev::fp4_trick<6>(v) * k126 * f, dev::fp4_trick<7>(v) * k126 * f);
      }
    } else if constexpr (F == WFormat::BF16) {
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const uint32_t v0 = dev::word(raw, 2 * q), v1 = dev::word(raw, 2 * q + 1);
        store4(dst, ob, o + 4 * q, __uint_as_float(v0 << 16), __uint_as_float(v0 & 0xffff0000u),
               __uint_as_float(v1 << 16), __uint_as_float(v1 & 0xffff0000u));
      }
    } else {
      store4(dst, ob, o, __uint_as_float(raw.x), __uint_as_float(raw.y), __uint_as_float(raw.z),
             __uint_as_float(raw.w));
    }
  }
}

__global__ void convert2d_kernel(const void* __restrict__ x, int xt, int64_t ldx, void* __restrict__ y, int yt,
                                 int64_t ldy, int64_t rows, int64_t cols) {
  const int64_t total = rows * cols;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dev::store_act(y, yt, r * ldy + c, dev::load_act(x, xt, r * ldx + c));
  }
}

int log2i(int v) {
  int s = 0;
  while ((1 << s) < v) ++s;
  return s;
}

size_t align256(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }

bool uses_qa8(const QMatrix& W, const GemmOpts& o) {
  return o.qa8 && (W.fmt == WFormat::FP8_BLOCK || W.fmt == WFormat::MXFP4);
}

}  // namespace

namespace detail {

void convert2d(DType xt, const void* x, int64_t ldx, DType yt, void* y, int64_t ldy, int64_t rows, int64_t cols,
               cudaStream_t stream) {
  const int64_t total = rows * cols;
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, static_cast<int64_t>(sm_count()) * 16);
  convert2d_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(x, static_cast<int>(xt), ldx, y,
                                                                      static_cast<int>(yt), ldy, rows, cols);
  DSX_CUDA_CHECK(cudaGetLastError());
}

}  // namespace detail

void dequant(const QMatrix& W, DType out, void* dst, cudaStream_t stream) {
  const WFormat fmt = W.fmt;
  const uint8_t *w = W.data, *s = W.scale;
  const int64_t N = W.rows, K = W.cols;
  const int block = W.block;
  DSX_CHECK(K % 32 == 0, "dequant: K=", K, " must be a multiple of 32");
  DSX_CHECK(detail::aligned16(w) && detail::aligned16(dst), "dequant: pointers must be 16-byte aligned");
  const int epc = fmt == WFormat::FP8_BLOCK ? 16 : fmt == WFormat::MXFP4 ? 32 : fmt == WFormat::BF16 ? 8 : 4;
  const int64_t total = N * (K / epc);
  if (total <= 0) return;
  const int64_t blocks = std::min<int64_t>((total + kThreads - 1) / kThreads, static_cast<int64_t>(sm_count()) * 16);
  const int ob = out == DType::BF16 ? 1 : 0;
  const int ti = W.tiled ? 1 : 0;
  DSX_CHECK(!W.tiled || tile16_fits(W),
            "dequant: the tile layout needs FP8 / MXFP4 data of whole 16-row tiles and 64-byte spans");
  const unsigned g = static_cast<unsigned>(blocks);
  switch (fmt) {
    case WFormat::FP8_BLOCK:
      DSX_CHECK(s != nullptr && (block == 32 || block == 64 || block == 128), "dequant: bad FP8 scales / tile");
      dequant_kernel<WFormat::FP8_BLOCK><<<g, kThreads, 0, stream>>>(
          w, s, N, K, static_cast<int>((K + block - 1) / block), log2i(block), ti, ob, dst);
      break;
    case WFormat::MXFP4:
      DSX_CHECK(s != nullptr, "dequant: MXFP4 without scales");
      dequant_kernel<WFormat::MXFP4><<<g, kThreads, 0, stream>>>(w, s, N, K, static_cast<int>(K / 32), 0, ti, ob, dst);
      break;
    case WFormat::BF16: dequant_kernel<WFormat::BF16><<<g, kThreads, 0, stream>>>(w, s, N, K, 0, 0, 0, ob, dst); break;
    case WFormat::F32: dequant_kernel<WFormat::F32><<<g, kThreads, 0, stream>>>(w, s, N, K, 0, 0, 0, ob, dst); break;
  }
  DSX_CUDA_CHECK(cudaGetLastError());
}

void gemm_dense(DType ct, const void* a, int64_t lda, int T, const void* wd, int64_t N, int64_t K, DType yt, void* y,
                int64_t ldy, cudaStream_t stream, int batch, int64_t stride_a, int64_t stride_w, int64_t stride_y) {
  if (T <= 0 || N <= 0) return;
  DSX_CHECK(ct == DType::BF16 || yt == DType::F32, "gemm_dense: f32 compute needs an f32 output");
  DSX_CHECK(N <= INT32_MAX && K <= INT32_MAX && lda <= INT32_MAX && ldy <= INT32_MAX, "gemm_dense: size too large");
  const cudaDataType_t at = ct == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  const cudaDataType_t yd = yt == DType::BF16 ? CUDA_R_16BF : CUDA_R_32F;
  const cublasComputeType_t comp = ct == DType::BF16 ? CUBLAS_COMPUTE_32F : CUBLAS_COMPUTE_32F_PEDANTIC;
  const float alpha = 1.0f, beta = 0.0f;
  std::lock_guard<std::mutex> lock(g_cublas_mu);
  cublasHandle_t h = handle_locked();
  DSX_CUBLAS_CHECK(cublasSetStream(h, stream));
  // column-major view: C[N x T] = W^T(op T of [K x N]) * X([K x T])
  if (batch <= 1) {
    DSX_CUBLAS_CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), T, static_cast<int>(K), &alpha, wd,
                                  at, static_cast<int>(K), a, at, static_cast<int>(lda), &beta, y, yd,
                                  static_cast<int>(ldy), comp, CUBLAS_GEMM_DEFAULT));
  } else {
    DSX_CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(N), T, static_cast<int>(K),
                                                &alpha, wd, at, static_cast<int>(K), stride_w, a, at,
                                                static_cast<int>(lda), stride_a, &beta, y, yd, static_cast<int>(ldy),
                                                stride_y, batch, comp, CUBLAS_GEMM_DEFAULT));
  }
}

DType gemm_compute_type(const QMatrix& W, DType xt, const GemmOpts& o) {
  if (o.compute != DType::BF16 || W.fmt == WFormat::F32) return DType::F32;
  if (xt == DType::BF16 || uses_qa8(W, o)) return DType::BF16;
  return DType::F32;
}

namespace {
struct GemmLayout {
  size_t wd = 0, xa = 0, yt = 0, total = 0;
  bool need_x = false, need_y = false;
};
GemmLayout gemm_layout(const QMatrix& W, DType xt, int T, const GemmOpts& o, DType yt_out, bool worst) {
  GemmLayout L;
  const DType ct = worst ? o.compute : gemm_compute_type(W, xt, o);
  const size_t cs = dtype_size(ct);
  const int64_t rows_x = T, cols_x = static_cast<int64_t>(o.groups) * W.cols;
  L.need_x = worst || uses_qa8(W, o) || xt != ct;
  L.need_y = worst || (ct == DType::F32 && yt_out == DType::BF16);
  size_t off = 0;
  L.wd = off;
  off = align256(off + static_cast<size_t>(W.rows) * W.cols * cs);
  L.xa = off;
  if (L.need_x) off = align256(off + static_cast<size_t>(rows_x) * cols_x * std::max<size_t>(cs, worst ? 4 : cs));
  L.yt = off;
  if (L.need_y) off = align256(off + static_cast<size_t>(T) * W.rows * 4);
  L.total = off;
  return L;
}
}  // namespace

size_t gemm_ws_bytes(const QMatrix& W, int T, const GemmOpts& o) {
  // worst case over xt / yt: f32 activation copy and an f32 temporary output
  GemmOpts w = o;
  GemmLayout a = gemm_layout(W, DType::F32, T, w, DType::BF16, true);
  w.compute = DType::F32;
  GemmLayout b = gemm_layout(W, DType::F32, T, w, DType::BF16, true);
  return std::max(a.total, b.total);
}

void gemm(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
          const GemmOpts& o, void* ws, size_t ws_bytes, cudaStream_t stream) {
  if (T <= 0 || W.rows <= 0) return;
  DSX_CHECK(o.groups >= 1 && W.rows % o.groups == 0, "gemm ", W.name, ": rows not divisible by groups");
  const DType ct = gemm_compute_type(W, xt, o);
  const GemmLayout L = gemm_layout(W, xt, T, o, yt, false);
  DSX_CHECK(ws != nullptr && ws_bytes >= L.total, "gemm ", W.name, ": workspace too small (", ws_bytes, " < ", L.total,
            ")");
  char* base = static_cast<char*>(ws);
  void* wd = base + L.wd;
  dequant(W, ct, wd, stream);

  const int G = o.groups;
  const int64_t Kg = W.cols, R = W.rows / G, cols_x = G * Kg;
  const void* a = x;
  int64_t lda = ldx;
  if (L.need_x) {
    void* xa = base + L.xa;
    if (uses_qa8(W, o))
      qa8_fake(xt, x, ldx, T, cols_x, o.qblock, ct, xa, cols_x, stream);
    else
      detail::convert2d(xt, x, ldx, ct, xa, cols_x, T, cols_x, stream);
    a = xa;
    lda = cols_x;
  }
  void* yo = y;
  int64_t ldo = ldy;
  DType yo_t = yt;
  if (L.need_y) {
    yo = base + L.yt;
    ldo = W.rows;
    yo_t = DType::F32;
  }
  gemm_dense(ct, a, lda, T, wd, R, Kg, yo_t, yo, ldo, stream, G, Kg, R * Kg, R);
  if (L.need_y) detail::convert2d(DType::F32, yo, ldo, yt, y, ldy, T, W.rows, stream);
}

}  // namespace dsx::cuda
