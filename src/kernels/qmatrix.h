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

  bool valid() const { return data != nullptr; }
  int64_t scale_cols() const { return (cols + block - 1) / block; }
  // Stored bytes of the data, of the scales (0 for F32 / BF16), and of both.
  int64_t data_bytes() const;
  int64_t scale_bytes() const;
  int64_t bytes() const { return data_bytes() + scale_bytes(); }
  // Dequantize rows [r0, r1) into out[(r1 - r0) * cols] (f32, exact).
  void dequant_rows(int64_t r0, int64_t r1, float* out) const;
};

}  // namespace dsx
