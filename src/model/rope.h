// RoPE frequency tables (spec model-v41.md §3.0.6): `main` (rope_theta, no scaling)
// and `compress` (compress_rope_theta with YaRN, no magnitude correction), computed
// in f32 as the reference does.
#pragma once
#include <vector>

#include "model/config.h"

namespace dsx {

struct RopeTable {
  std::vector<float> inv_freq;  // one per pair
  int n_pairs() const { return static_cast<int>(inv_freq.size()); }
  // cos/sin of angle fl32(pos * inv_freq[i]) for every pair.
  void angles(int64_t pos, float* cos_out, float* sin_out) const;
};

RopeTable make_main_rope(const ModelConfig& c);
RopeTable make_compress_rope(const ModelConfig& c);

}  // namespace dsx
