// Small f32 CPU primitives used by the forward pass.
#pragma once
#include <cmath>
#include <cstdint>

namespace dsx::cpu {

// out = w * (x * rsqrt(mean(x^2) + eps)); w may be null (unweighted). out may alias x.
void rmsnorm(const float* x, const float* w, int64_t n, float eps, float* out);

// Interleaved-pair RoPE on the last 2*n_pairs entries of x[0..len): pair i is
// (x[off+2i], x[off+2i+1]), off = len - 2*n_pairs. inverse = conjugate rotation.
void rope_apply(float* x, int64_t len, int n_pairs, const float* cos, const float* sin, bool inverse);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline float silu(float x) { return x / (1.0f + std::exp(-x)); }
// PyTorch softplus (beta 1, threshold 20).
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

}  // namespace dsx::cpu
