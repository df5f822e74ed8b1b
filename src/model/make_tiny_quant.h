// The quantized random weights make-tiny writes (model/make_tiny.cpp), for other
// writers of random test models: w [n, k] drawn from normal(0, std) (row-major, one
// std::normal_distribution<float> draw from rng per value), stored as
//  * FP8: e4m3 codes with one power-of-two ue8m0 scale per B x B tile (amax / 448
//    rounded up);
//  * MXFP4: e2m1 codes packed two per byte (low nibble first) with one power-of-two
//    ue8m0 scale per 32 inputs of a row (amax / 6 rounded up).
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "util/safetensors.h"

namespace dsx {

// The two tensors <base>.weight (codes) and <base>.scale (ue8m0 scales).
struct QuantizedWeight {
  DType codes_dtype = DType::F8_E4M3;  // F8_E4M3 (FP8) or I8 (MXFP4, packed)
  std::vector<int64_t> codes_shape;    // FP8: [n, k]; MXFP4: [n, k / 2]
  std::vector<int64_t> scales_shape;   // FP8: [ceil(n / B), ceil(k / B)]; MXFP4: [n, k / 32]
  std::vector<uint8_t> codes, scales;
};

QuantizedWeight random_fp8(std::mt19937_64& rng, float std, int64_t n, int64_t k, int64_t block);
QuantizedWeight random_mxfp4(std::mt19937_64& rng, float std, int64_t n, int64_t k);

}  // namespace dsx
