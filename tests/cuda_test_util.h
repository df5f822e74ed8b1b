// Helpers shared by the tests of the CUDA kernels against their CPU twins
// (test_cuda_elementwise / _indexer / _attention): random inputs, host <-> device
// copies in both activation modes, tolerant comparisons. Header-only; the device
// helpers exist only with the CUDA backend (DSX_HAVE_CUDA).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "util/numerics.h"

#ifdef DSX_HAVE_CUDA
#include <cuda_fp16.h>

#include "model/cpu/quant.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemv.h"  // staged_act_words
#include "kernels/cuda/elementwise_types.h"  // Act
#include "model/qmatrix.h"

#define SKIP_WITHOUT_GPU() \
  if (!dsx::cuda::device_available()) GTEST_SKIP() << "no CUDA device"
#endif

namespace dsx_test {

using Rng = std::mt19937_64;

inline std::vector<float> randn(size_t n, Rng& rng, float scale = 1.0f) {
  std::normal_distribution<float> nd(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Elements with |got - want| > abs + rel |want| (bitwise-equal values always pass).
inline size_t count_far(const std::vector<float>& got, const std::vector<float>& want, double abs_tol, double rel_tol,
                        const char* what, int report = 5) {
  EXPECT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < std::min(got.size(), want.size()); ++i) {
    const double g = got[i], w = want[i];
    if (dsx::f32_bits(got[i]) == dsx::f32_bits(want[i])) continue;
    if (std::isfinite(g) && std::isfinite(w) && std::fabs(g - w) <= abs_tol + rel_tol * std::fabs(w)) continue;
    if (bad++ < static_cast<size_t>(report))
      ADD_FAILURE() << what << ": element " << i << " got " << g << " want " << w;
  }
  return bad;
}

inline size_t count_bit_diff(const std::vector<float>& a, const std::vector<float>& b) {
  size_t n = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) n += dsx::f32_bits(a[i]) != dsx::f32_bits(b[i]);
  return n + (a.size() > b.size() ? a.size() - b.size() : b.size() - a.size());
}

// Fake-quantized outputs of nearly identical inputs: allow a few elements off by one
// quantization step (bounded by `step_frac` of the element's block maximum).
inline void expect_quantized_close(const std::vector<float>& got, const std::vector<float>& want, int block,
                                   double max_frac, double step_frac, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  size_t diff = 0;
  for (size_t b0 = 0; b0 < got.size(); b0 += static_cast<size_t>(block)) {
    float amax = 0;
    for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(want[b0 + i]));
    for (int i = 0; i < block; ++i) {
      const size_t k = b0 + i;
      if (dsx::f32_bits(got[k]) == dsx::f32_bits(want[k])) continue;
      ++diff;
      EXPECT_LE(std::fabs(got[k] - want[k]), step_frac * amax + 1e-30) << what << " element " << k;
    }
  }
  EXPECT_LE(static_cast<double>(diff), max_frac * static_cast<double>(got.size()) + 2.0)
      << what << ": " << diff << " of " << got.size() << " elements differ";
}

// A compress-style RoPE table (YaRN-like blend) of n pairs.
inline std::vector<float> rope_table(int n_pairs, double theta) {
  std::vector<float> f(static_cast<size_t>(n_pairs));
  for (int i = 0; i < n_pairs; ++i) {
    const float e = static_cast<float>(2 * i) / static_cast<float>(2 * n_pairs);
    f[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(theta), e);
    if (i > n_pairs / 2) f[static_cast<size_t>(i)] /= 16.0f;
  }
  return f;
}

#ifdef DSX_HAVE_CUDA
using dsx::cuda::Act;
using dsx::cuda::DeviceBuffer;

// The values an activation buffer of type `act` holds (bf16-rounded for BF16).
inline std::vector<float> act_values(std::vector<float> v, Act act) {
  if (act == Act::BF16)
    for (auto& x : v) x = dsx::round_bf16(x);
  return v;
}
inline DeviceBuffer upload_act(const std::vector<float>& v, Act act) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * dsx::cuda::act_bytes(act));
  if (act == Act::F32) {
    b.upload(v.data(), v.size() * 4);
  } else {
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = dsx::f32_to_bf16(v[i]);
    b.upload(h.data(), h.size() * 2);
  }
  return b;
}
inline std::vector<float> download_act(const DeviceBuffer& b, size_t n, Act act) {
  std::vector<float> v(n);
  if (act == Act::F32) {
    b.download(v.data(), n * 4);
  } else {
    std::vector<uint16_t> h(n);
    b.download(h.data(), n * 2);
    for (size_t i = 0; i < n; ++i) v[i] = dsx::bf16_to_f32(h[i]);
  }
  return v;
}
// A weight matrix (host pointers) copied to the device; q holds the device pointers.
// tile: FP8 / MXFP4 data of whole 16-row tiles and 64-byte spans goes in the tile layout
// (qmatrix.h), as the engine uploads it; false keeps it row-major.
struct DevMatrix {
  DeviceBuffer data, scale;
  dsx::QMatrix q;
};
inline DevMatrix upload_matrix(const dsx::QMatrix& h, bool tile = true) {
  DevMatrix d;
  d.q = h;
  d.q.tiled = tile && dsx::tile16_fits(h);
  d.data.alloc(static_cast<size_t>(h.data_bytes()));
  if (d.q.tiled) {
    std::vector<uint8_t> t(d.data.size());
    dsx::tile16_pack(h.data, h.rows, h.row_bytes(), t.data());
    d.data.upload(t.data(), t.size());
  } else {
    d.data.upload(h.data, d.data.size());
  }
  d.q.data = d.data.as<uint8_t>();
  d.q.scale = nullptr;
  if (h.scale_bytes() > 0) {
    d.scale.alloc(static_cast<size_t>(h.scale_bytes()));
    d.scale.upload(h.scale, d.scale.size());
    d.q.scale = d.scale.as<uint8_t>();
  }
  return d;
}
template <typename V>
DeviceBuffer upload_vec(const std::vector<V>& v) {
  DeviceBuffer b(std::max<size_t>(v.size(), 1) * sizeof(V));
  b.upload(v.data(), v.size() * sizeof(V));
  return b;
}
template <typename V>
std::vector<V> download_vec(const DeviceBuffer& b, size_t n) {
  std::vector<V> v(n);
  if (n) b.download(v.data(), n * sizeof(V));
  return v;
}

// The one-token staged activations of a row x of K values (GemvOpts::staged, as
// hc_finish writes them), built from the CPU QA8 codes (32-element blocks) and the
// documented B orders: the FP8 order (element e of a block's octet o: word 4 o + e / 2,
// half e % 2; scales times 1), then at staged_act_words(K) the MXFP4 order (word
// 4 o + e % 4, half e / 4; scales times 2^14). Each word holds two codes as f16.
inline std::vector<uint32_t> staged_act_ref(const std::vector<float>& x) {
  const int64_t K = static_cast<int64_t>(x.size()), nb = K / 32, W = dsx::cuda::staged_act_words(K);
  std::vector<uint8_t> codes(x.size());
  std::vector<float> qs(static_cast<size_t>(nb));
  dsx::cpu::qa8_codes(x.data(), K, 32, codes.data(), qs.data());
  std::vector<uint32_t> r(static_cast<size_t>(2 * W), 0u);
  for (int64_t k = 0; k < K; ++k) {
    const int64_t kb = k / 32;
    const int o = static_cast<int>(k % 32) / 8, e = static_cast<int>(k % 8);
    const uint32_t h = __half_as_ushort(__float2half_rn(dsx::e4m3_to_f32(codes[static_cast<size_t>(k)])));
    r[static_cast<size_t>(kb * 16 + 4 * o + e / 2)] |= h << (16 * (e % 2));
    r[static_cast<size_t>(W + kb * 16 + 4 * o + e % 4)] |= h << (16 * (e / 4));
  }
  for (int64_t kb = 0; kb < nb; ++kb) {
    const float s = qs[static_cast<size_t>(kb)], s4 = s * 16384.0f;
    std::memcpy(&r[static_cast<size_t>(nb * 16 + kb)], &s, 4);
    std::memcpy(&r[static_cast<size_t>(W + nb * 16 + kb)], &s4, 4);
  }
  return r;
}
#endif  // DSX_HAVE_CUDA

}  // namespace dsx_test
