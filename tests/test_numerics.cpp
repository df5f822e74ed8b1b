// Dequantizers and fake-quantizers, bit-exact against hand-computed values and an
// independent double-precision formulation.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "model/cpu/quant.h"
#include "model/qmatrix.h"
#include "util/numerics.h"

using namespace dsx;

// Independent e4m3 value table from the format definition (double arithmetic).
static double e4m3_ref(int b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  double v = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return s ? -v : v;
}

TEST(Numerics, E4M3Decode) {
  EXPECT_EQ(e4m3_to_f32(0x00), 0.0f);
  EXPECT_EQ(e4m3_to_f32(0x01), 0.001953125f);  // 2^-9
  EXPECT_EQ(e4m3_to_f32(0x08), 0.015625f);     // 2^-6
  EXPECT_EQ(e4m3_to_f32(0x38), 1.0f);
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_f32(0xfe), -448.0f);
  EXPECT_EQ(e4m3_to_f32(0x3c), 1.5f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    EXPECT_EQ(static_cast<double>(e4m3_to_f32(static_cast<uint8_t>(b))), e4m3_ref(b)) << b;
  }
}

// Reference RNE onto the e4m3 grid by exhaustive nearest search (ties to even code).
static double e4m3_rne_ref(double v) {
  double best = 0;
  int best_code = -1;
  double best_d = 1e300;
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    double g = e4m3_ref(b);
    if ((g < 0) != (v < 0) && g != 0) continue;
    double d = std::fabs(g - v);
    if (d < best_d || (d == best_d && (b & 1) == 0 && (best_code & 1) == 1)) {
      best_d = d;
      best = g;
      best_code = b;
    }
  }
  return best;
}

TEST(Numerics, E4M3EncodeRNE) {
  // every grid point, every midpoint, and nearby values
  for (int b = 0; b < 127; ++b) {
    double g = e4m3_ref(b);
    EXPECT_EQ(round_e4m3(static_cast<float>(g)), static_cast<float>(g));
    EXPECT_EQ(round_e4m3(static_cast<float>(-g)), static_cast<float>(-g));
    if (b + 1 < 127) {
      double mid = (g + e4m3_ref(b + 1)) / 2;
      EXPECT_EQ(static_cast<double>(round_e4m3(static_cast<float>(mid))), e4m3_rne_ref(mid)) << "mid " << mid;
      EXPECT_EQ(static_cast<double>(round_e4m3(std::nextafter(static_cast<float>(mid), 0.f))),
                e4m3_rne_ref(std::nextafter(static_cast<float>(mid), 0.f)));
      EXPECT_EQ(static_cast<double>(round_e4m3(std::nextafter(static_cast<float>(mid), 1000.f))),
                e4m3_rne_ref(std::nextafter(static_cast<float>(mid), 1000.f)));
    }
  }
  EXPECT_EQ(round_e4m3(0.0009765625f), 0.0f);        // 2^-10: tie between 0 and 2^-9 -> even (0)
  EXPECT_EQ(round_e4m3(0.0029296875f), 0.00390625f);  // 1.5 * 2^-9 -> 2 * 2^-9 (even)
  EXPECT_EQ(round_e4m3(1.0625f), 1.0f);               // tie 1 / 1.125 -> 1
  EXPECT_EQ(round_e4m3(1.1875f), 1.25f);              // tie 1.125 / 1.25 -> 1.25
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  for (int i = 0; i < 20000; ++i) {
    float v = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 20) - 12);
    if (std::fabs(v) > 448) continue;
    EXPECT_EQ(static_cast<double>(round_e4m3(v)), e4m3_rne_ref(v)) << v;
  }
}

TEST(Numerics, E8M0AndE2M1) {
  EXPECT_EQ(e8m0_to_f32(127), 1.0f);
  EXPECT_EQ(e8m0_to_f32(130), 8.0f);
  EXPECT_EQ(e8m0_to_f32(120), 1.0f / 128);
  EXPECT_EQ(e8m0_to_f32(0), std::ldexp(1.0f, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_f32(255)));
  const float mags[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(c)), (c & 8) ? -mags[c & 7] : mags[c & 7]);
  // ties to the even code
  struct {
    float in, out;
  } cases[] = {{0.25f, 0}, {0.75f, 1}, {1.25f, 1}, {1.75f, 2}, {2.5f, 2}, {3.5f, 4}, {5.f, 4},
               {0.26f, 0.5f}, {0.74f, 0.5f}, {5.01f, 6}, {6.f, 6}, {-3.5f, -4}, {-0.2f, -0.f}};
  for (auto c : cases) EXPECT_EQ(e2m1_to_f32(f32_to_e2m1(c.in)), c.out) << c.in;
  EXPECT_TRUE(std::signbit(e2m1_to_f32(f32_to_e2m1(-0.1f))));
}

TEST(Numerics, Pow2Ceil) {
  EXPECT_EQ(pow2ceil(1.0f), 1.0f);
  EXPECT_EQ(pow2ceil(1.0000001f), 2.0f);
  EXPECT_EQ(pow2ceil(0.75f), 1.0f);
  EXPECT_EQ(pow2ceil(3.0f / 448), 1.0f / 128);
  EXPECT_EQ(pow2ceil(1e-4f / 448), std::ldexp(1.0f, -22));
}

TEST(Numerics, Bf16) {
  EXPECT_EQ(round_bf16(1.0f), 1.0f);
  EXPECT_EQ(round_bf16(1.00390625f), 1.0f);   // tie -> even
  EXPECT_EQ(round_bf16(1.01171875f), 1.015625f);  // tie -> even (up)
  EXPECT_EQ(f32_to_bf16(-2.0f), 0xc000);
}

// QA8 by hand: block [1, 2, 3, ..., 32] * 0.01
TEST(Quant, QA8HandComputed) {
  std::vector<float> x(32);
  for (int i = 0; i < 32; ++i) x[i] = 0.01f * static_cast<float>(i + 1);
  auto y = x;
  cpu::qa8_inplace(y.data(), 32, 32);
  // amax 0.32 -> 0.32/448 = 7.14e-4 -> s = 2^-10
  const float s = std::ldexp(1.0f, -10);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(y[i], round_e4m3(x[i] / s) * s) << i;
  EXPECT_EQ(y[31], 0.3125f);  // 0.32 * 1024 = 327.68 -> 320 (grid step 32 above 256)
  // floor: an all-zero block stays zero; tiny values use s = pow2ceil(1e-4/448)
  std::vector<float> z(32, 0.0f);
  z[3] = 1e-7f;
  cpu::qa8_inplace(z.data(), 32, 32);
  const float s2 = std::ldexp(1.0f, -22);
  EXPECT_EQ(z[3], round_e4m3(1e-7f / s2) * s2);
  EXPECT_EQ(z[0], 0.0f);
  std::vector<uint8_t> codes(32);
  float sc;
  cpu::qa8_codes(x.data(), 32, 32, codes.data(), &sc);
  EXPECT_EQ(sc, s);
  for (int i = 0; i < 32; ++i) EXPECT_EQ(e4m3_to_f32(codes[i]) * sc, y[i]);
}

TEST(Quant, FQ4HandComputed) {
  // FQ4e8, block 32: amax 3 -> s = pow2ceil(0.5) = 0.5; values/s on the e2m1 grid
  std::vector<float> x(32, 0.0f);
  x[0] = 3.0f;
  x[1] = -1.1f;   // -2.2 -> -2 -> -1.0
  x[2] = 0.13f;   // 0.26 -> 0.5 -> 0.25
  x[3] = 0.124f;  // 0.248 -> 0
  cpu::fq4_e8_inplace(x.data(), 32, 32);
  EXPECT_EQ(x[0], 3.0f);
  EXPECT_EQ(x[1], -1.0f);
  EXPECT_EQ(x[2], 0.25f);
  EXPECT_EQ(x[3], 0.0f);
  // FQ4e4, block 16: amax 7 -> 7/6 = 1.1667 -> e4m3 1.125; 7/1.125 = 6.22 -> clamp 6 -> 6.75
  std::vector<float> y(16, 0.0f);
  y[0] = 7.0f;
  y[1] = 2.0f;  // 1.777 -> 2 -> 2.25
  y[2] = -0.3f;  // -0.2667 -> -0.5 -> -0.5625
  cpu::fq4_e4_inplace(y.data(), 16, 16);
  EXPECT_EQ(y[0], 6.75f);
  EXPECT_EQ(y[1], 2.25f);
  EXPECT_EQ(y[2], -0.5625f);
}

TEST(Dequant, FormatsHandComputed) {
  // FP8 block: 2x4 matrix with block 2 -> scale [1, 2]
  uint8_t w8[8] = {0x38, 0x40, 0x3c, 0xb8, 0x00, 0x01, 0x7e, 0x30};
  uint8_t s8[2] = {127, 129};  // 1, 4
  QMatrix m{WFormat::FP8_BLOCK, 2, 4, 2, w8, s8, "m"};
  float out[8];
  m.dequant_rows(0, 2, out);
  float want[8] = {1, 2, 1.5f * 4, -1 * 4, 0, 0.001953125f, 448 * 4, 0.5f * 4};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(out[i], want[i]) << i;
  // MXFP4: 1 row x 32, low nibble first
  uint8_t w4[16] = {};
  w4[0] = 0x72;  // k0 = code 2 (1.0), k1 = code 7 (6.0)
  w4[15] = 0x9f;  // k30 = code 15 (-6), k31 = code 9 (-0.5)
  uint8_t s4[1] = {126};  // 0.5
  QMatrix f{WFormat::MXFP4, 1, 32, 32, w4, s4, "f"};
  float o4[32];
  f.dequant_rows(0, 1, o4);
  EXPECT_EQ(o4[0], 0.5f);
  EXPECT_EQ(o4[1], 3.0f);
  EXPECT_EQ(o4[30], -3.0f);
  EXPECT_EQ(o4[31], -0.25f);
  EXPECT_EQ(o4[2], 0.0f);
}

// The device's 16-row tile layout (qmatrix.h): every 1 KB block at (tile t, span j) holds
// the bytes [64 j, 64 j + 64) of rows 16 t .. 16 t + 15, one row after the other; and
// only FP8 / MXFP4 matrices of whole tiles and spans fit it.
TEST(Tile16, PackPlacesEachSpanContiguously) {
  const int64_t rows = 48, rb = 192;  // 3 tiles of 3 spans
  std::vector<uint8_t> src(static_cast<size_t>(rows * rb)), dst(src.size(), 0xee);
  std::mt19937 rng(5);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  tile16_pack(src.data(), rows, rb, dst.data());
  size_t at = 0;
  for (int64_t t = 0; t < rows / 16; ++t)
    for (int64_t j = 0; j < rb / 64; ++j)
      for (int64_t r = 16 * t; r < 16 * t + 16; ++r)
        for (int64_t b = 64 * j; b < 64 * j + 64; ++b, ++at) {
          ASSERT_EQ(dst[at], src[static_cast<size_t>(r * rb + b)]) << "tile " << t << " span " << j << " row " << r;
          ASSERT_EQ(tile16_offset(r, b, rb), static_cast<int64_t>(at));
        }
  EXPECT_EQ(at, dst.size());

  QMatrix q{WFormat::FP8_BLOCK, 32, 128, 32, src.data(), nullptr, "q"};
  EXPECT_TRUE(tile16_fits(q));
  q.cols = 96;  // 96-byte rows: not whole spans
  EXPECT_FALSE(tile16_fits(q));
  q = QMatrix{WFormat::MXFP4, 16, 128, 32, src.data(), nullptr, "q"};  // 64-byte rows
  EXPECT_TRUE(tile16_fits(q));
  q.rows = 40;  // not whole tiles
  EXPECT_FALSE(tile16_fits(q));
  q = QMatrix{WFormat::BF16, 16, 64, 32, src.data(), nullptr, "q"};
  EXPECT_FALSE(tile16_fits(q));
  EXPECT_THROW(tile16_pack(src.data(), 40, 64, dst.data()), std::exception);
  q.tiled = true;
  std::vector<float> out(16 * 64);
  EXPECT_THROW(q.dequant_rows(0, 1, out.data()), std::exception);  // a device layout
}
