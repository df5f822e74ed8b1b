// Description of a weight matrix in its stored format (spec model-v41.md §2.2).
// Shared by the CPU kernels and the CUDA backend; it never owns memory.
#pragma once
#include <cstdint>
#include <string>

namespace dsx {

enum class WFormat : uint8_t {
  F32,        // plain f32 [N, K]
  BF16,       // plain bf16 [N, K]
  FP8_BLOCK,  // e4m3 [N, K] + e8m0 scale [ceil(N/B), ceil(K/B)]  (format A)
  MXFP4,      // packed e2m1 [N, K/2] (low nibble = even k) + e8m0 scale [N, K/32]  (format B)
};

struct QMatrix {
  WFormat fmt = WFormat::F32;
  int64_t rows = 0;   // N (output features)
  int64_t cols = 0;   // K (logical input features)
  int block = 32;     // FP8_BLOCK tile size; MXFP4 strip length (always 32)
  const uint8_t* data = nullptr;
  const uint8_t* scale = nullptr;
  std::string name;
  // Device copies only (the CUDA backend's weight upload): the data bytes are stored in
  // the 16-row tile layout below instead of row-major. The codes, scales and quantization
  // are the stored ones; only the order of the data bytes differs. Host matrices (files,
  // the CPU engine) are always row-major.
  bool tiled = false;

  bool valid() const { return data != nullptr; }
  int64_t scale_cols() const { return (cols + block - 1) / block; }
  // Stored bytes of the data, of the scales (0 for F32 / BF16), and of both.
  int64_t data_bytes() const;
  int64_t scale_bytes() const;
  int64_t bytes() const { return data_bytes() + scale_bytes(); }
  int64_t row_bytes() const { return rows > 0 ? data_bytes() / rows : 0; }
  // Dequantize rows [r0, r1) into out[(r1 - r0) * cols] (f32, exact).
  void dequant_rows(int64_t r0, int64_t r1, float* out) const;
};

// ---- 16-row tile layout of FP8_BLOCK / MXFP4 data on the device.
// The weight-streaming kernels read a 16-row tile in 1 KB spans of 64 bytes per row; in
// the row-major layout a span is 16 pieces of 64 bytes one row apart, in this layout it
// is 1 KB of consecutive bytes: tile t = rows [16 t, 16 t + 16) holds its spans one after
// the other, span j = the 64-byte pieces [64 j, 64 j + 64) of its 16 rows in row order.
// Byte b of row r lives at
//   (r / 16) * 16 * row_bytes + (b / 64) * 1024 + (r % 16) * 64 + b % 64.
// Only matrices of whole tiles and whole spans take it (rows % 16 == 0,
// row_bytes % 64 == 0); others stay row-major.
constexpr int64_t kTileRows = 16;
constexpr int64_t kTileSpan = 64;
bool tile16_fits(const QMatrix& q);
inline int64_t tile16_offset(int64_t r, int64_t b, int64_t row_bytes) {
  return (r / kTileRows) * kTileRows * row_bytes + (b / kTileSpan) * (kTileRows * kTileSpan) +
         (r % kTileRows) * kTileSpan + b % kTileSpan;
}
// Reorders row-major data ([rows, row_bytes]) into the tile layout (dst: rows * row_bytes
// bytes, not overlapping src); the shape must fit (tile16_fits).
void tile16_pack(const uint8_t* src, int64_t rows, int64_t row_bytes, uint8_t* dst);

}  // namespace dsx
