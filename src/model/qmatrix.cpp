#include "model/qmatrix.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "util/error.h"
#include "util/numerics.h"

namespace dsx {

int64_t QMatrix::data_bytes() const {
  switch (fmt) {
    case WFormat::F32: return rows * cols * 4;
    case WFormat::BF16: return rows * cols * 2;
    case WFormat::FP8_BLOCK: return rows * cols;
    case WFormat::MXFP4: return rows * cols / 2;
  }
  return 0;
}

int64_t QMatrix::scale_bytes() const {
  switch (fmt) {
    case WFormat::F32:
    case WFormat::BF16: return 0;
    case WFormat::FP8_BLOCK: return ((rows + block - 1) / block) * scale_cols();
    case WFormat::MXFP4: return rows * (cols / 32);
  }
  return 0;
}

bool tile16_fits(const QMatrix& q) {
  if (q.fmt != WFormat::FP8_BLOCK && q.fmt != WFormat::MXFP4) return false;
  const int64_t rb = q.row_bytes();
  return q.rows > 0 && q.rows % kTileRows == 0 && rb > 0 && rb % kTileSpan == 0;
}

void tile16_pack(const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst) {
  DSX_CHECK(rows % kTileRows == 0 && row_bytes % kTileSpan == 0, "tile16_pack: shape [", rows, ", ", row_bytes,
            " bytes] is not whole 16-row tiles of 64-byte spans");
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += kTileSpan)
      std::memcpy(dst + tile16_offset(r, b, row_bytes), src + r * row_bytes + b, kTileSpan);
}

namespace {
struct E4M3Table {
  float v[256];
  E4M3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_f32(static_cast<uint8_t>(i));
  }
};
const E4M3Table& e4m3_table() {
  static E4M3Table t;
  return t;
}
}  // namespace

void QMatrix::dequant_rows(int64_t r0, int64_t r1, float* out) const {
  DSX_CHECK(!tiled, "dequant_rows ", name, ": the 16-row tile layout is a device layout (host matrices are row-major)");
  const int64_t K = cols;
  switch (fmt) {
    case WFormat::F32:
      std::memcpy(out, reinterpret_cast<const float*>(data) + r0 * K, static_cast<size_t>((r1 - r0) * K) * 4);
      return;
    case WFormat::BF16: {
      const uint16_t* p = reinterpret_cast<const uint16_t*>(data) + r0 * K;
      const int64_t n = (r1 - r0) * K;
      int64_t i = 0;
#if defined(__AVX2__)
      for (; i + 8 <= n; i += 8) {
        __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i)));
        _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
      }
#endif
      for (; i < n; ++i) out[i] = bf16_to_f32(p[i]);
      return;
    }
    case WFormat::FP8_BLOCK: {
      const float* lut = e4m3_table().v;
      const int64_t sc = scale_cols();
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* w = data + r * K;
        const uint8_t* s = scale + (r / block) * sc;
        float* o = out + (r - r0) * K;
        for (int64_t b = 0; b < sc; ++b) {
          const float f = e8m0_to_f32(s[b]);
          const int64_t k1 = std::min<int64_t>(K, (b + 1) * block);
          for (int64_t k = b * block; k < k1; ++k) o[k] = lut[w[k]] * f;
        }
      }
      return;
    }
    case WFormat::MXFP4: {
      static const float kE2M1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
      const int64_t sc = K / 32;
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* w = data + r * (K / 2);
        const uint8_t* s = scale + r * sc;
        float* o = out + (r - r0) * K;
        for (int64_t b = 0; b < sc; ++b) {
          const float f = e8m0_to_f32(s[b]);
          for (int64_t j = 0; j < 16; ++j) {
            const uint8_t byte = w[b * 16 + j];
            o[b * 32 + 2 * j] = kE2M1[byte & 15] * f;
            o[b * 32 + 2 * j + 1] = kE2M1[byte >> 4] * f;
          }
        }
      }
      return;
    }
  }
}

}  // namespace dsx
