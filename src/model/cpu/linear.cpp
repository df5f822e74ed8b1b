#include "model/cpu/linear.h"

#include <algorithm>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "util/numerics.h"
#include "util/threadpool.h"

namespace dsx::cpu {

namespace {

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#endif
inline float scalar(const float* p, int64_t i) { return p[i]; }
inline float scalar(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// One summation order for every weight type, so a bf16 row streamed directly and
// the same row dequantized to f32 give bit-identical products.
template <typename W>
float dot_any(const float* a, const W* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps(),
         acc3 = _mm256_setzero_ps();
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), acc1);
    acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), load8(b + i + 16), acc2);
    acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), load8(b + i + 24), acc3);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc0);
  __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
  __m128 lo = _mm256_castps256_ps128(acc), hi = _mm256_extractf128_ps(acc, 1);
  __m128 v = _mm_add_ps(lo, hi);
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  v = _mm_add_ss(v, _mm_shuffle_ps(v, v, 1));
  s = _mm_cvtss_f32(v);
#endif
  for (; i < n; ++i) s += a[i] * scalar(b, i);
  return s;
}

}  // namespace

float dot(const float* a, const float* b, int64_t n) { return dot_any(a, b, n); }

void matmul_rows(const float* x, int64_t T, const QMatrix& W, int64_t r0, int64_t r1, float* y, int64_t ldy) {
  if (W.fmt == WFormat::BF16 && T <= 2) {
    // few rows (decode): stream the bf16 weight once, no dequantization buffer
    const int64_t K = W.cols, n = r1 - r0;
    const auto* w = reinterpret_cast<const uint16_t*>(W.data);
    const bool small = n * K < (int64_t{1} << 17);
    parallel_for(small ? 1 : n, 64, [&](int64_t b, int64_t e) {
      if (small) e = n;
      for (int64_t j = b; j < e; ++j)
        for (int64_t t = 0; t < T; ++t) y[t * ldy + j] = dot_any(x + t * K, w + (r0 + j) * K, K);
    });
    return;
  }
  const int64_t K = W.cols;
  const int64_t n = r1 - r0;
  constexpr int64_t kTile = 16;
  const int64_t tiles = (n + kTile - 1) / kTile;
  // Each task dequantizes a tile of weight rows once and uses it for all T rows of x.
  // Small products are not worth waking the pool.
  const bool small = n * K * std::max<int64_t>(T, 4) < (int64_t{1} << 17);
  parallel_for(small ? 1 : tiles, 1,
               [&](int64_t b, int64_t e) {
                 if (small) e = tiles;
                 std::vector<float> buf(W.fmt == WFormat::F32 ? 0 : static_cast<size_t>(kTile * K));
                 for (int64_t tile = b; tile < e; ++tile) {
                   const int64_t a0 = r0 + tile * kTile, a1 = std::min(r1, a0 + kTile);
                   const float* rows = buf.data();
                   if (W.fmt == WFormat::F32) {
                     rows = reinterpret_cast<const float*>(W.data) + a0 * K;  // used in place
                   } else {
                     W.dequant_rows(a0, a1, buf.data());
                   }
                   for (int64_t t = 0; t < T; ++t) {
                     const float* xr = x + t * K;
                     float* yr = y + t * ldy + (a0 - r0);
                     for (int64_t j = 0; j < a1 - a0; ++j) yr[j] = dot(xr, rows + j * K, K);
                   }
                 }
               });
}

void matmul(const float* x, int64_t T, const QMatrix& W, float* y) { matmul_rows(x, T, W, 0, W.rows, y, W.rows); }

}  // namespace dsx::cpu
