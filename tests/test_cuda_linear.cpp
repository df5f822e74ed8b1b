// CUDA weight-streaming kernels (quant_act, gemv, gemm, router) against their CPU twins
// (src/kernels/cpu/{quant,linear,twin_linear}) on fresh random inputs.
//
// Tolerances:
//  * QA8 codes / scales, dequantization: bit-exact (same math, exact operations).
//  * Products, F32 mode: |gpu - cpu| <= 2e-5 * sum_k |x'_k W_nk|. Both sides multiply the
//    same exact values (dequantized weights and QA8'd activations are exact in f32); only
//    the f32 summation order differs, whose error is a few 1e-7 of that sum (the worst-case
//    bound for these depths is ~1e-5, its statistical size ~sqrt(depth) * 6e-8).
//  * Products, BF16 mode: the same plus 2^-7 * |ref| (the two f32 sums may straddle a
//    bf16 rounding boundary: results differ by at most one bf16 ulp <= 2^-7 |v|).
#ifdef DSX_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "model/cpu/linear.h"
#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "cuda_test_util.h"
#include "kernels/cpu/twin_attn.h"
#include "kernels/cpu/twin_linear.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/quant_act.h"
#include "kernels/cuda/router.h"
#include "runtime/sampler.h"
#include "util/numerics.h"
#include "util/switches.h"

using namespace dsx;
using dsx::cuda::DeviceBuffer;
using dsx::cuda::DType;
namespace twin = dsx::cpu::twin;

namespace {

using dsx_test::count_bit_diff;
using dsx_test::DevMatrix;
using dsx_test::download_act;
using dsx_test::upload_act;
using dsx_test::upload_matrix;

// |got - ref| <= ka * abs + kr * |ref| (+ 1e-30) everywhere.
void expect_close(const std::vector<float>& got, const std::vector<float>& ref, const std::vector<float>& abs, double ka,
                  double kr, const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  int bad = 0;
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double tol = ka * abs[i] + kr * std::fabs(ref[i]) + 1e-30;
    worst = std::max(worst, d / tol);
    if (!(d <= tol)) {
      if (++bad <= 5)
        ADD_FAILURE() << what << ": element " << i << " gpu " << got[i] << " cpu " << ref[i] << " |x'W| " << abs[i]
                      << " tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << got.size() << " outside tolerance (worst ratio " << worst << ")";
}

constexpr double kSumTol = 2e-5;            // summation-order tolerance, times sum |x'W|
constexpr double kBf16Ulp = 1.0 / 128.0;    // one bf16 ulp, relative bound

struct Shape {
  int64_t N, K;
};

// A random weight on the host and its device copy.
struct Weight {
  twin::OwnedMatrix h;
  DevMatrix d;
};
Weight make_weight(WFormat fmt, int64_t N, int64_t K, std::mt19937_64& rng, int block = 32) {
  Weight w;
  w.h = twin::random_matrix(fmt, N, K, block, rng);
  w.d = upload_matrix(w.h.q);
  return w;
}

// One GEMV case: T rows of activations x ([T, groups * K]; xt == BF16: bf16-exact values)
// against W, compared with the twin. mode selects the output type and the rounding; xt the
// activation type. Returns the kernel gemv ran (cuda::gemv_last_path).
std::string check_gemv_x(const Weight& W, int T, DType mode, DType xt, const std::vector<float>& x,
                         const cuda::GemvOpts& opts = {}) {
  const int64_t N = W.h.q.rows, K = W.h.q.cols;
  const WFormat fmt = W.h.q.fmt;
  SCOPED_TRACE(testing::Message() << "fmt " << static_cast<int>(fmt) << " block " << W.h.q.block << " N " << N
                                  << " K " << K << " T " << T << " mode " << (mode == DType::BF16 ? "bf16" : "f32")
                                  << " xt " << (xt == DType::BF16 ? "bf16" : "f32") << " groups " << opts.groups
                                  << " qa8 " << opts.qa8);
  const DType yt = mode;
  const int G = opts.groups;
  const int64_t ldx = G * K;
  EXPECT_EQ(x.size(), static_cast<size_t>(T * ldx));
  const bool qa8 = opts.qa8 && (fmt == WFormat::FP8_BLOCK || fmt == WFormat::MXFP4);
  std::vector<float> ref(static_cast<size_t>(T * N)), abs(static_cast<size_t>(T * N));
  twin::linear(x.data(), T, ldx, W.h.q, qa8, opts.qblock, G, mode == DType::BF16, ref.data(), N, abs.data());
  DeviceBuffer dx = upload_act(x, xt);
  DeviceBuffer dy(static_cast<size_t>(T * N) * cuda::dtype_size(yt));
  cuda::gemv(W.d.q, xt, dx.get(), ldx, T, yt, dy.get(), N, opts, nullptr);
  const std::string path = cuda::gemv_last_path();
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got = download_act(dy, static_cast<size_t>(T * N), yt);
  expect_close(got, ref, abs, kSumTol, mode == DType::BF16 ? kBf16Ulp : 0.0, "gemv (" + path + ")");
  return path;
}

// The same on fresh random activations.
std::string check_gemv(const Weight& W, int T, DType mode, DType xt, std::mt19937_64& rng,
                       const cuda::GemvOpts& opts = {}) {
  return check_gemv_x(W, T, mode, xt, twin::random_acts(T, opts.groups * W.h.q.cols, rng, xt == DType::BF16), opts);
}

void run_gemv_cases(WFormat fmt, int64_t N, int64_t K, std::initializer_list<int> Ts, std::mt19937_64& rng,
                    int block = 32, const cuda::GemvOpts& opts = {}) {
  Weight W = make_weight(fmt, N, K, rng, block);
  for (DType mode : {DType::F32, DType::BF16})
    for (int T : Ts) check_gemv(W, T, mode, mode, rng, opts);
}

}  // namespace

// ---------------------------------------------------------------------------------
TEST(CudaQuant, Qa8CodesBitExact) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(101);
  for (int block : {32, 128})
    for (int64_t K : {128LL, 256LL, 1280LL, 5120LL})
      for (int64_t rows : {1LL, 3LL, 17LL})
        for (DType xt : {DType::F32, DType::BF16}) {
          SCOPED_TRACE(testing::Message() << "block " << block << " K " << K << " rows " << rows);
          std::vector<float> x = twin::random_acts(rows, K, rng, xt == DType::BF16, -30, 20);
          // crafted values in the first row: e4m3 midpoints, power-of-two amax, tiny block
          if (K >= 128) {
            const float s = 1.0f / 64.0f;  // amax 7 -> s = 2^-6
            float* r = x.data();
            r[0] = 7.0f;
            for (int i = 1; i < 31; ++i) r[i] = (1.0f + (2 * i + 1) / 16.0f) * s * (i % 2 ? 1.0f : -1.0f);  // ties
            r[31] = 0.5f * 0.001953125f * s;  // half the smallest subnormal code
            for (int i = 32; i < 64; ++i) r[i] = (i == 40) ? 448.0f * 0.25f : 0.001f * (i - 48);  // amax = 448 * 2^-2
            for (int i = 64; i < 96; ++i) r[i] = 1e-6f * (i - 80);                               // below the 1e-4 floor
            if (xt == DType::BF16)
              for (int i = 0; i < 128; ++i) r[i] = round_bf16(r[i]);
          }
          std::vector<uint8_t> ref_c(static_cast<size_t>(rows * K));
          std::vector<float> ref_s(static_cast<size_t>(rows * K / block));
          for (int64_t r = 0; r < rows; ++r)
            cpu::qa8_codes(x.data() + r * K, K, block, ref_c.data() + r * K, ref_s.data() + r * (K / block));
          DeviceBuffer dx = upload_act(x, xt);
          DeviceBuffer dc(ref_c.size()), ds(ref_s.size() * 4);
          cuda::qa8_codes(xt, dx.get(), K, rows, K, block, dc.as<uint8_t>(), ds.as<float>(), nullptr);
          std::vector<uint8_t> got_c(ref_c.size());
          std::vector<float> got_s(ref_s.size());
          dc.download(got_c.data(), got_c.size());
          ds.download(got_s.data(), got_s.size() * 4);
          for (size_t i = 0; i < ref_s.size(); ++i) ASSERT_EQ(got_s[i], ref_s[i]) << "scale " << i;
          for (size_t i = 0; i < ref_c.size(); ++i) ASSERT_EQ(got_c[i], ref_c[i]) << "code " << i << " x " << x[i];
          // fake-quantized values in both output types
          std::vector<float> ref_v = x;
          for (int64_t r = 0; r < rows; ++r) cpu::qa8_inplace(ref_v.data() + r * K, K, block);
          for (DType yt : {DType::F32, DType::BF16}) {
            DeviceBuffer dy(static_cast<size_t>(rows * K) * cuda::dtype_size(yt));
            cuda::qa8_fake(xt, dx.get(), K, rows, K, block, yt, dy.get(), K, nullptr);
            std::vector<float> got = download_act(dy, static_cast<size_t>(rows * K), yt);
            for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], ref_v[i]) << "fake " << i;
          }
        }
}

TEST(CudaQuant, Qa8StridedAndConvert) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(7);
  const int64_t rows = 5, K = 256, ld = 320;
  std::vector<float> x = twin::random_acts(rows, ld, rng, false);
  DeviceBuffer dx = upload_act(x, DType::F32);
  DeviceBuffer dy(static_cast<size_t>(rows * ld) * 4);
  dy.zero();
  cuda::qa8_fake(DType::F32, dx.get(), ld, rows, K, 32, DType::F32, dy.get(), ld, nullptr);
  std::vector<float> got = download_act(dy, static_cast<size_t>(rows * ld), DType::F32);
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<float> ref(x.begin() + r * ld, x.begin() + r * ld + K);
    cpu::qa8_inplace(ref.data(), K, 32);
    for (int64_t k = 0; k < ld; ++k) ASSERT_EQ(got[r * ld + k], k < K ? ref[k] : 0.0f) << r << "," << k;
  }
  // f32 -> bf16 -> f32
  DeviceBuffer db(static_cast<size_t>(rows * ld) * 2), dz(static_cast<size_t>(rows * ld) * 4);
  cuda::convert(DType::F32, dx.get(), DType::BF16, db.get(), rows * ld, nullptr);
  cuda::convert(DType::BF16, db.get(), DType::F32, dz.get(), rows * ld, nullptr);
  std::vector<float> z = download_act(dz, static_cast<size_t>(rows * ld), DType::F32);
  for (size_t i = 0; i < z.size(); ++i) ASSERT_EQ(z[i], round_bf16(x[i])) << i;
}

// ---------------------------------------------------------------------------------
TEST(CudaGemv, Fp8TinyShapes) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1);
  const Shape shapes[] = {{64, 256}, {512, 64}, {128, 256}, {256, 128}, {1280, 192}, {96, 256}, {40, 64}};
  for (const Shape& s : shapes) run_gemv_cases(WFormat::FP8_BLOCK, s.N, s.K, {1, 2, 3, 5, 8, 13, 16, 21}, rng);
}

TEST(CudaGemv, Fp8ReleaseShapes) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(2);
  const Shape shapes[] = {{32768, 1280}, {5120, 8192}, {1280, 5120}, {512, 5120}, {2304, 5120}, {5120, 2304}};
  for (const Shape& s : shapes) run_gemv_cases(WFormat::FP8_BLOCK, s.N, s.K, {1, 4}, rng);
  Weight W = make_weight(WFormat::FP8_BLOCK, 1280, 5120, rng);
  for (int T : {2, 7, 16}) check_gemv(W, T, DType::BF16, DType::BF16, rng);
  // one and two tokens with K = 2304 (36 spans of 64 bytes, not a power of two) and a
  // partial last 16-row tile (N % 16 != 0)
  Weight W2 = make_weight(WFormat::FP8_BLOCK, 4104, 2304, rng);
  for (int T : {1, 2}) {
    check_gemv(W2, T, DType::BF16, DType::BF16, rng);
    check_gemv(W2, T, DType::F32, DType::F32, rng);
  }
}

TEST(CudaGemv, Fp8Tile128AndQBlock128) {
  SKIP_WITHOUT_GPU();  // V4 layout: 128x128 weight tiles, QA8 blocks of 128
  std::mt19937_64 rng(3);
  cuda::GemvOpts o;
  o.qblock = 128;
  run_gemv_cases(WFormat::FP8_BLOCK, 512, 1024, {1, 3, 9}, rng, 128, o);
  run_gemv_cases(WFormat::FP8_BLOCK, 300, 4096, {1, 3, 9}, rng, 128, o);
}

TEST(CudaGemv, Mxfp4) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4);
  const Shape shapes[] = {{64, 256}, {256, 64}, {2304, 5120}, {5120, 2304}, {100, 1024}};
  for (const Shape& s : shapes) run_gemv_cases(WFormat::MXFP4, s.N, s.K, {1, 2, 6, 16}, rng);
}

// The 16-row tile layout (qmatrix.h, as the engine uploads FP8 / MXFP4 weights) gives
// bit-identical results to the row-major layout on every GEMV path: the one-token ring
// kernel, the register kernel of a few tokens, the CUDA-core kernel (f32), grouped wo_a.
TEST(CudaGemv, TiledLayoutMatchesRowMajor) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(41);
  struct C {
    WFormat f;
    int64_t N, K;
    int block, groups;
  } cases[] = {{WFormat::FP8_BLOCK, 1024, 2048, 32, 1}, {WFormat::FP8_BLOCK, 4096, 512, 128, 1},
               {WFormat::MXFP4, 512, 2048, 32, 1},     {WFormat::FP8_BLOCK, 1024, 512, 32, 4},
               {WFormat::FP8_BLOCK, 16, 64, 32, 1},     {WFormat::MXFP4, 2304, 5120, 32, 1}};
  for (const C& c : cases) {
    const twin::OwnedMatrix W = twin::random_matrix(c.f, c.N, c.K, c.block, rng);
    const DevMatrix rowm = upload_matrix(W.q, false), tile = upload_matrix(W.q, true);
    ASSERT_TRUE(tile.q.tiled && !rowm.q.tiled);
    cuda::GemvOpts o;
    o.groups = c.groups;
    o.qa8 = c.groups == 1;  // grouped: wo_a, bf16 without QA8
    for (DType mode : {DType::F32, DType::BF16})
      for (int T : {1, 2, 4, 8, 16}) {
        SCOPED_TRACE(testing::Message() << "fmt " << static_cast<int>(c.f) << " N " << c.N << " K " << c.K << " groups "
                                        << c.groups << " T " << T << " mode " << (mode == DType::BF16 ? "bf16" : "f32"));
        const std::vector<float> x = twin::random_acts(T, c.groups * c.K, rng, mode == DType::BF16);
        DeviceBuffer dx = upload_act(x, mode);
        std::vector<float> y[2];
        std::string path[2];
        for (int i = 0; i < 2; ++i) {
          DeviceBuffer dy(static_cast<size_t>(T * c.N) * cuda::dtype_size(mode));
          cuda::gemv(i ? tile.q : rowm.q, mode, dx.get(), c.groups * c.K, T, mode, dy.get(), c.N, o, nullptr);
          path[i] = cuda::gemv_last_path();
          DSX_CUDA_CHECK(cudaDeviceSynchronize());
          y[i] = download_act(dy, static_cast<size_t>(T * c.N), mode);
        }
        EXPECT_EQ(path[1], path[0]);
        EXPECT_EQ(count_bit_diff(y[1], y[0]), 0u) << "path " << path[1];
        EXPECT_GT(count_bit_diff(y[0], std::vector<float>(y[0].size(), 0.0f)), 0u);
      }
    // the prefill's dequantized copy
    for (DType out : {DType::F32, DType::BF16}) {
      const size_t n = static_cast<size_t>(c.N * c.K);
      DeviceBuffer a(n * cuda::dtype_size(out)), b(n * cuda::dtype_size(out));
      cuda::dequant(rowm.q, out, a.get(), nullptr);
      cuda::dequant(tile.q, out, b.get(), nullptr);
      EXPECT_EQ(count_bit_diff(download_act(b, n, out), download_act(a, n, out)), 0u) << "dequant";
    }
  }
}

TEST(CudaGemv, Bf16Weights) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  // router gate, indexer weights_proj, compressor, a tall head-like matrix, tiny shapes
  const Shape shapes[] = {{384, 5120}, {32, 5120}, {512, 5120}, {8192, 5120}, {8, 256}, {4, 256}, {128, 256}};
  for (const Shape& s : shapes) {
    Weight W = make_weight(WFormat::BF16, s.N, s.K, rng);
    for (int T : {1, 3}) {
      check_gemv(W, T, DType::F32, DType::BF16, rng);   // LinF32 on bf16 inputs (router, head)
      check_gemv(W, T, DType::F32, DType::F32, rng);    // f32 inputs (compressor in F32 mode)
      check_gemv(W, T, DType::BF16, DType::BF16, rng);  // LinBF
    }
  }
}

TEST(CudaGemv, F32Weights) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(6);
  const Shape shapes[] = {{24, 20480}, {24, 1024}, {512, 5120}, {128, 256}};
  for (const Shape& s : shapes) {
    Weight W = make_weight(WFormat::F32, s.N, s.K, rng);
    for (int T : {1, 2, 5}) check_gemv(W, T, DType::F32, DType::F32, rng);
  }
}

TEST(CudaGemv, GroupedWoA) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(8);
  cuda::GemvOpts o;
  o.qa8 = false;  // wo_a: no activation quantization (spec §3.4.8)
  o.groups = 8;
  run_gemv_cases(WFormat::FP8_BLOCK, 8192, 4096, {1, 3}, rng, 32, o);  // stored FP8, used as bf16 values
  run_gemv_cases(WFormat::BF16, 8192, 4096, {1, 3}, rng, 32, o);       // dequantized at load
  o.groups = 2;  // tiny: wo_a [128, 256], 2 groups
  run_gemv_cases(WFormat::FP8_BLOCK, 128, 256, {1, 4, 17}, rng, 32, o);
  run_gemv_cases(WFormat::BF16, 128, 256, {1, 4, 17}, rng, 32, o);
}

namespace {
// bf16 activations [T, K] (K % 32 == 0) with a wide range inside every 32-element block:
// magnitudes 2^-20 .. 2^11 of both signs, one element in 8 zero, one block in 16 all zero;
// row 0 starts with crafted blocks (K >= 128).
std::vector<float> wide_range_acts(int64_t T, int64_t K, std::mt19937_64& rng) {
  std::vector<float> x(static_cast<size_t>(T * K), 0.0f);
  std::uniform_int_distribution<int> ex(-20, 10), pick(0, 7), zero_block(0, 15);
  std::uniform_real_distribution<float> frac(1.0f, 2.0f);
  for (size_t b = 0; b < x.size(); b += 32) {
    if (zero_block(rng) == 0) continue;
    for (size_t i = b; i < b + 32; ++i)
      if (pick(rng) != 0) x[i] = round_bf16(std::ldexp(frac(rng), ex(rng)) * (pick(rng) < 4 ? -1.0f : 1.0f));
  }
  if (K >= 128) {
    float* r = x.data();
    // both ends of the range in one block
    r[0] = 1024.0f, r[1] = std::ldexp(1.0f, -20), r[2] = -std::ldexp(1.5f, -20), r[3] = -1024.0f;
    // a lone tiny value
    for (int i = 32; i < 64; ++i) r[i] = 0.0f;
    r[40] = -std::ldexp(1.0f, -20);
    // the largest bf16 below 2^16 next to 2^-16 (2^32 apart: still staged exactly), and -0
    r[64] = 65280.0f, r[65] = std::ldexp(1.0f, -16), r[66] = -0.0f;
    // a bf16 subnormal block maximum
    for (int i = 96; i < 128; ++i) r[i] = 0.0f;
    r[100] = std::ldexp(1.0f, -130), r[101] = -std::ldexp(1.0f, -132);
  }
  return x;
}

// The default kernel choice is in force (tests that name the kernel a call must take):
// no switch that picks another GEMV kernel is set (environment or sw::set).
bool default_gemv_switches() {
  for (sw::Id id : {sw::Id::GEMV_MMA, sw::Id::GEMV_STREAM})
    if (sw::is_set(id)) return false;
  return true;
}
}  // namespace

// wo_a in BF16 mode (no QA8, 8 groups, T <= 4) on the shared-ring tensor-core kernel with
// the activations staged as f16 times a power of two per 32-element block (gemv.cu,
// gemv_device.cuh noqa_block_exp): exact for bf16 inputs within 2^31 of their block
// maximum, so the tolerances are those of the QA8 tensor-core path.
TEST(CudaGemv, GroupedWoATensorCore) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(15);
  cuda::GemvOpts o;
  o.qa8 = false;
  o.groups = 8;
  const bool check_path = default_gemv_switches();
  struct C {
    int64_t R, Kg;
    int block;
  } cases[] = {{1024, 4096, 128}, {1024, 4096, 32}, {1024, 256, 128}, {32, 256, 32}, {32, 4096, 32}};
  for (const C& c : cases) {
    SCOPED_TRACE(testing::Message() << "R " << c.R << " Kg " << c.Kg << " block " << c.block);
    Weight W = make_weight(WFormat::FP8_BLOCK, o.groups * c.R, c.Kg, rng, c.block);
    for (int T : {1, 4}) {
      const std::string path =
          check_gemv_x(W, T, DType::BF16, DType::BF16, wide_range_acts(T, o.groups * c.Kg, rng), o);
      if (check_path) EXPECT_EQ(path, "mma-ring") << "T " << T;
    }
  }
  // 5..8 rows: the same kernel with two token passes; 9..16: two calls of at most 8
  Weight W = make_weight(WFormat::FP8_BLOCK, o.groups * 32, 256, rng, 32);
  for (int T : {5, 8, 12}) {
    const std::string path = check_gemv_x(W, T, DType::BF16, DType::BF16, wide_range_acts(T, o.groups * 256, rng), o);
    if (check_path) EXPECT_EQ(path, "mma-ring") << "T " << T;
  }
}

// Special blocks on the same path: a NaN makes exactly its group's outputs NaN, an
// all-zero group gives exact zeros, the other groups are unaffected.
TEST(CudaGemv, GroupedWoATensorCoreNaNAndZeros) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(17);
  const int G = 8;
  const int64_t R = 32, Kg = 256, N = G * R;
  twin::OwnedMatrix W = twin::random_matrix(WFormat::FP8_BLOCK, N, Kg, 32, rng);
  std::vector<float> x = wide_range_acts(1, G * Kg, rng);
  x[static_cast<size_t>(3 * Kg + 77)] = std::numeric_limits<float>::quiet_NaN();
  std::fill(x.begin() + 5 * Kg, x.begin() + 6 * Kg, 0.0f);
  std::vector<float> ref(static_cast<size_t>(N)), abs(ref.size());
  twin::linear(x.data(), 1, G * Kg, W.q, false, 32, G, true, ref.data(), N, abs.data());
  DevMatrix dW = upload_matrix(W.q);
  DeviceBuffer dx = upload_act(x, DType::BF16), dy(ref.size() * 2);
  cuda::GemvOpts o;
  o.qa8 = false;
  o.groups = G;
  cuda::gemv(dW.q, DType::BF16, dx.get(), G * Kg, 1, DType::BF16, dy.get(), N, o, nullptr);
  if (default_gemv_switches()) EXPECT_STREQ(cuda::gemv_last_path(), "mma-ring");
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> got = download_act(dy, ref.size(), DType::BF16);
  std::vector<float> got_f, ref_f, abs_f;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t g = n / R;
    if (g == 3) {
      EXPECT_TRUE(std::isnan(got[n])) << "row " << n << ": " << got[n];
      continue;
    }
    if (g == 5) EXPECT_EQ(got[n], 0.0f) << "row " << n;
    got_f.push_back(got[n]), ref_f.push_back(ref[n]), abs_f.push_back(abs[n]);
  }
  expect_close(got_f, ref_f, abs_f, kSumTol, kBf16Ulp, "finite groups");
}

// engram_wkv [25600, 6144] (FP8 tiles of 32, QA8, one token) takes the shared-ring
// tensor-core kernel. Its K-split plan used to pick a split whose partial sums did not
// fit (8 warps per tile, 7 rounds), and the shape fell back to the CUDA-core kernel.
TEST(CudaGemv, EngramShapeOnTheRing) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(16);
  Weight W = make_weight(WFormat::FP8_BLOCK, 25600, 6144, rng, 32);
  const std::string path = check_gemv(W, 1, DType::BF16, DType::BF16, rng);
  if (default_gemv_switches()) EXPECT_EQ(path, "mma-ring");
}

// The input RMS norm of GemvOpts (q_norm before wq_b): fused into the one-token tensor-core
// kernel's staging (BF16 mode, T = 1), rmsnorm first otherwise. The normalized rows written
// to norm_out match the CPU rmsnorm (a rare element one rounding step off: the squares are
// summed in another order), and the product is that of W with exactly those rows.
TEST(CudaGemv, InputNormFusedAndFallback) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(21);
  // K = 1280 (wq_b): the norm is computed in the staging pass (x read once); K = 4096:
  // more octets than threads, the row is read twice (its rms first)
  for (const int64_t K : {int64_t{1280}, int64_t{4096}}) {
    SCOPED_TRACE(testing::Message() << "K " << K);
    const int64_t N = 2048;
    Weight W = make_weight(WFormat::FP8_BLOCK, N, K, rng, 32);
    std::uniform_real_distribution<float> wd(0.5f, 1.5f);
    std::vector<float> nw(K);
    for (float& v : nw) v = wd(rng);
    DeviceBuffer dnw(K * 4);
    DSX_CUDA_CHECK(cudaMemcpy(dnw.get(), nw.data(), K * 4, cudaMemcpyHostToDevice));
    for (DType mode : {DType::BF16, DType::F32})
      for (int T : {1, 3}) {
        SCOPED_TRACE(testing::Message() << "mode " << (mode == DType::BF16 ? "bf16" : "f32") << " T " << T);
        const bool bf16 = mode == DType::BF16;
        std::vector<float> x = twin::random_acts(T, K, rng, bf16);
        DeviceBuffer dx = upload_act(x, mode), dn(static_cast<size_t>(T * K) * cuda::dtype_size(mode));
        DeviceBuffer dy(static_cast<size_t>(T * N) * cuda::dtype_size(mode));
        cuda::GemvOpts o;
        o.norm_w = dnw.as<float>();
        o.norm_eps = 1e-6f;
        o.norm_out = dn.get();
        cuda::gemv(W.d.q, mode, dx.get(), K, T, mode, dy.get(), N, o, nullptr);
        const std::string path = cuda::gemv_last_path();
        DSX_CUDA_CHECK(cudaDeviceSynchronize());
        if (default_gemv_switches() && bf16 && T == 1) EXPECT_EQ(path, "mma-ring");
        std::vector<float> xn = download_act(dn, static_cast<size_t>(T * K), mode);
        std::vector<float> want(xn.size());
        twin::rmsnorm_rows(bf16, x.data(), want.data(), nw.data(), T, static_cast<int>(K), 1e-6f);
        EXPECT_LE(dsx_test::count_far(xn, want, 0.0, bf16 ? kBf16Ulp : 1e-6, "normalized rows"), 0u);
        EXPECT_LE(dsx_test::count_bit_diff(xn, want), xn.size() / 200 + 2) << "normalized rows: bit differences";
        std::vector<float> ref(static_cast<size_t>(T * N)), abs(ref.size());
        twin::linear(xn.data(), T, K, W.h.q, true, 32, 1, bf16, ref.data(), N, abs.data());
        expect_close(download_act(dy, ref.size(), mode), ref, abs, kSumTol, bf16 ? kBf16Ulp : 0.0,
                     "product of the normalized rows (" + path + ")");
      }
  }
}

// The one-token input staged by its producer (GemvOpts::staged, as hc_finish writes it;
// built here from the CPU QA8 codes, CudaHc.PassAndFinish checks hc_finish against the
// same reference): the shared-ring FP8 kernel copies it instead of quantizing x, so with
// x itself zero it gives exactly the product of x; T = 2 ignores it, and so do the other
// kernels (switches such as DSX_GEMV_STREAM=1 pick them): then x is given.
TEST(CudaGemv, StagedActivations) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(22);
  const bool ring = default_gemv_switches();
  for (const int64_t N : {int64_t{1280}, int64_t{512}}) {
    const int64_t K = 5120;
    Weight W = make_weight(WFormat::FP8_BLOCK, N, K, rng, 128);
    for (int T : {1, 2}) {
      SCOPED_TRACE(testing::Message() << "N " << N << " T " << T);
      std::vector<float> x = twin::random_acts(T, K, rng, true);
      const std::vector<uint32_t> st = dsx_test::staged_act_ref(std::vector<float>(x.begin(), x.begin() + K));
      DeviceBuffer dst(st.size() * 4);
      dst.upload(st.data(), st.size() * 4);
      DeviceBuffer dx = upload_act(x, DType::BF16), dz = upload_act(std::vector<float>(x.size(), 0.0f), DType::BF16);
      DeviceBuffer dy(static_cast<size_t>(T * N) * 2), dy2(static_cast<size_t>(T * N) * 2);
      cuda::GemvOpts o;
      cuda::gemv(W.d.q, DType::BF16, dx.get(), K, T, DType::BF16, dy.get(), N, o, nullptr);
      o.staged = dst.as<uint32_t>();
      cuda::gemv(W.d.q, DType::BF16, T == 1 && ring ? dz.get() : dx.get(), K, T, DType::BF16, dy2.get(), N, o, nullptr);
      if (ring && T == 1) EXPECT_STREQ(cuda::gemv_last_path(), "mma-ring");
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_EQ(dsx_test::count_bit_diff(download_act(dy2, static_cast<size_t>(T * N), DType::BF16),
                                         download_act(dy, static_cast<size_t>(T * N), DType::BF16)),
                0u);
    }
  }
}

// Staged outputs for the next one-token consumer (GemvOpts::norm_staged / out_staged):
// when gemv_last_staged() says they were written they hold exactly QA8 of the normalized
// row / of the output row in the staged layout (the FP8 order of staged_act_ref, built
// from the CPU QA8 codes of the rows the call wrote). The release shapes of wq_b (norm) and
// wo_a (8 groups, no QA8, K-split epilogue) must stage with the default switches.
TEST(CudaGemv, StagedOutputs) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(23);
  struct C {
    int64_t N, K;
    int groups;
    bool norm, must;
  } cases[] = {{32768, 1280, 1, true, true}, {8192, 4096, 8, false, true}, {1280, 5120, 1, false, false},
               {256, 256, 1, false, false}};
  for (const C& c : cases) {
    SCOPED_TRACE(testing::Message() << "N " << c.N << " K " << c.K << " groups " << c.groups);
    Weight W = make_weight(WFormat::FP8_BLOCK, c.N, c.K, rng, c.groups > 1 ? 128 : 32);
    const int64_t kx = c.groups * c.K;
    std::vector<float> x = twin::random_acts(1, kx, rng, true);
    std::vector<float> nw(static_cast<size_t>(c.K), 1.0f);
    for (float& v : nw) v = round_bf16(0.5f + static_cast<float>(rng() % 1000) / 1000.0f);
    DeviceBuffer dx = upload_act(x, DType::BF16), dy(static_cast<size_t>(c.N) * 2), dn(static_cast<size_t>(c.K) * 2),
                 dnw(static_cast<size_t>(c.K) * 4);
    dnw.upload(nw.data(), nw.size() * 4);
    const int64_t rows_staged = c.norm ? c.K : c.N;  // the staged row's length
    const size_t sw = static_cast<size_t>(cuda::staged_act_words(rows_staged));
    DeviceBuffer dst(sw * 4);
    DSX_CUDA_CHECK(cudaMemset(dst.get(), 0, sw * 4));
    cuda::GemvOpts o;
    o.groups = c.groups;
    o.qa8 = c.groups == 1;
    if (c.norm) {
      o.norm_w = dnw.as<float>();
      o.norm_eps = 1e-6f;
      o.norm_out = dn.get();
      o.norm_staged = dst.as<uint32_t>();
    } else {
      o.out_staged = dst.as<uint32_t>();
    }
    cuda::gemv(W.d.q, DType::BF16, dx.get(), kx, 1, DType::BF16, dy.get(), c.N, o, nullptr);
    const bool staged = cuda::gemv_last_staged();
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    if (c.must && default_gemv_switches()) EXPECT_TRUE(staged);
    if (!staged) continue;
    const std::vector<float> row = c.norm ? download_act(dn, static_cast<size_t>(c.K), DType::BF16)
                                          : download_act(dy, static_cast<size_t>(c.N), DType::BF16);
    std::vector<uint32_t> want = dsx_test::staged_act_ref(row);
    want.resize(sw);  // (the FP8 order)
    EXPECT_EQ(dsx_test::download_vec<uint32_t>(dst, sw), want);
  }
}

TEST(CudaGemv, SplitKWorkspace) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  struct C {
    WFormat f;
    int64_t N, K;
  } cases[] = {{WFormat::F32, 24, 20480}, {WFormat::BF16, 32, 5120}, {WFormat::FP8_BLOCK, 64, 8192}};
  for (const C& c : cases)
    for (int T : {1, 3}) {
      SCOPED_TRACE(testing::Message() << "N " << c.N << " K " << c.K << " T " << T);
      twin::OwnedMatrix W = twin::random_matrix(c.f, c.N, c.K, 32, rng);
      std::vector<float> x = twin::random_acts(T, c.K, rng, false);
      std::vector<float> ref(static_cast<size_t>(T * c.N)), abs(ref.size());
      twin::linear(x.data(), T, c.K, W.q, true, 32, 1, false, ref.data(), c.N, abs.data());
      DevMatrix dW = upload_matrix(W.q);
      DeviceBuffer dx = upload_act(x, DType::F32), dy(ref.size() * 4), dy2(ref.size() * 4);
      cuda::GemvOpts o;
      const size_t wsb = cuda::gemv_split_ws_bytes(dW.q, T, o);
      EXPECT_GT(wsb, 0u) << "expected a K split for this shape";
      DeviceBuffer ws(std::max<size_t>(wsb, 4));
      o.split_ws = ws.as<float>();
      o.split_ws_bytes = wsb;
      cuda::gemv(dW.q, DType::F32, dx.get(), c.K, T, DType::F32, dy.get(), c.N, o, nullptr);
      cuda::gemv(dW.q, DType::F32, dx.get(), c.K, T, DType::F32, dy2.get(), c.N, cuda::GemvOpts{}, nullptr);
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      std::vector<float> got = download_act(dy, ref.size(), DType::F32);
      std::vector<float> got2 = download_act(dy2, ref.size(), DType::F32);
      expect_close(got, ref, abs, kSumTol, 0.0, "split-K");
      expect_close(got2, ref, abs, kSumTol, 0.0, "no split");
      // deterministic: the same call again gives identical bits
      cuda::gemv(dW.q, DType::F32, dx.get(), c.K, T, DType::F32, dy2.get(), c.N, o, nullptr);
      std::vector<float> again = download_act(dy2, ref.size(), DType::F32);
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(f32_bits(again[i]), f32_bits(got[i])) << i;
    }
}

TEST(CudaGemv, StridesAndSubnormalCodes) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(10);
  // weights made only of small (incl. subnormal) e4m3 codes; activations with big range
  twin::RandomSpec sp;
  sp.e4m3_exp_lo = 0;
  sp.e4m3_exp_hi = 2;
  const int64_t N = 200, K = 640, ldx = 700, ldy = 211, T = 3;
  twin::OwnedMatrix W = twin::random_matrix(WFormat::FP8_BLOCK, N, K, 32, rng, sp);
  std::vector<float> x = twin::random_acts(T, ldx, rng, false, -20, 12);
  std::vector<float> ref(static_cast<size_t>(T * ldy), 0.0f), abs(ref.size(), 0.0f);
  twin::linear(x.data(), T, ldx, W.q, true, 32, 1, false, ref.data(), ldy, abs.data());
  DevMatrix dW = upload_matrix(W.q);
  DeviceBuffer dx = upload_act(x, DType::F32), dy(ref.size() * 4);
  dy.zero();
  cuda::gemv(dW.q, DType::F32, dx.get(), ldx, T, DType::F32, dy.get(), ldy, cuda::GemvOpts{}, nullptr);
  std::vector<float> got = download_act(dy, ref.size(), DType::F32);
  expect_close(got, ref, abs, kSumTol, 0.0, "strided");  // columns >= N stay 0 on both sides
}

// BF16 mode runs FP8 / MXFP4 products with QA8 on the tensor-core path (gemv.cu): row
// strides, rows not a multiple of the 16-row tile, K not a multiple of the 64-byte span,
// subnormal weight codes, activation blocks of very different magnitudes, T up to 8.
TEST(CudaGemv, TensorCorePathStridesAndRanges) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(14);
  twin::RandomSpec sp;
  sp.e4m3_exp_lo = 0;
  sp.e4m3_exp_hi = 3;
  struct C {
    WFormat f;
    int64_t N, K;
    int T;
  } cases[] = {{WFormat::FP8_BLOCK, 200, 640, 1}, {WFormat::FP8_BLOCK, 200, 640, 3}, {WFormat::FP8_BLOCK, 37, 96, 6},
               {WFormat::FP8_BLOCK, 300, 4128, 8}, {WFormat::MXFP4, 200, 640, 1}, {WFormat::MXFP4, 45, 96, 2},
               {WFormat::MXFP4, 130, 2336, 4}};
  for (const C& c : cases) {
    SCOPED_TRACE(testing::Message() << "fmt " << static_cast<int>(c.f) << " N " << c.N << " K " << c.K << " T " << c.T);
    const int64_t ldx = c.K + 60, ldy = c.N + 11;
    twin::OwnedMatrix W = twin::random_matrix(c.f, c.N, c.K, 32, rng, sp);
    std::vector<float> x = twin::random_acts(c.T, ldx, rng, true, -20, 12);
    std::vector<float> ref(static_cast<size_t>(c.T * ldy), 0.0f), abs(ref.size(), 0.0f);
    twin::linear(x.data(), c.T, ldx, W.q, true, 32, 1, true, ref.data(), ldy, abs.data());
    DevMatrix dW = upload_matrix(W.q);
    DeviceBuffer dx = upload_act(x, DType::BF16), dy(ref.size() * 2);
    dy.zero();
    cuda::gemv(dW.q, DType::BF16, dx.get(), ldx, c.T, DType::BF16, dy.get(), ldy, cuda::GemvOpts{}, nullptr);
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got = download_act(dy, ref.size(), DType::BF16);
    expect_close(got, ref, abs, kSumTol, kBf16Ulp, "tensor-core path");
    // deterministic
    DeviceBuffer dy2(ref.size() * 2);
    dy2.zero();
    cuda::gemv(dW.q, DType::BF16, dx.get(), ldx, c.T, DType::BF16, dy2.get(), ldy, cuda::GemvOpts{}, nullptr);
    std::vector<float> again = download_act(dy2, ref.size(), DType::BF16);
    for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(f32_bits(again[i]), f32_bits(got[i])) << i;
  }
}

// ---------------------------------------------------------------------------------
TEST(CudaGemm, DequantExact) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  struct C {
    WFormat f;
    int64_t N, K;
    int block;
  } cases[] = {{WFormat::FP8_BLOCK, 300, 640, 32},
               {WFormat::FP8_BLOCK, 256, 512, 128},
               {WFormat::MXFP4, 130, 256, 32},
               {WFormat::MXFP4, 64, 512, 32},  // tiled (the others but 256 x 512 stay row-major)
               {WFormat::BF16, 70, 96, 32},
               {WFormat::F32, 33, 64, 32}};
  for (const C& c : cases) {
    twin::OwnedMatrix W = twin::random_matrix(c.f, c.N, c.K, c.block, rng);
    std::vector<float> ref(static_cast<size_t>(c.N * c.K));
    W.q.dequant_rows(0, c.N, ref.data());
    DevMatrix dW = upload_matrix(W.q);
    for (DType out : {DType::F32, DType::BF16}) {
      DeviceBuffer d(ref.size() * cuda::dtype_size(out));
      cuda::dequant(dW.q, out, d.get(), nullptr);
      std::vector<float> got = download_act(d, ref.size(), out);
      for (size_t i = 0; i < ref.size(); ++i) {
        const float r = (out == DType::BF16) ? round_bf16(ref[i]) : ref[i];
        if (out == DType::BF16 && c.f != WFormat::F32) ASSERT_EQ(r, ref[i]) << "not bf16-exact?";
        ASSERT_EQ(got[i], r) << "fmt " << static_cast<int>(c.f) << " element " << i;
      }
    }
  }
}

TEST(CudaGemm, LinearMatchesTwin) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  struct C {
    WFormat f;
    int64_t N, K;
  } cases[] = {{WFormat::FP8_BLOCK, 1280, 5120}, {WFormat::FP8_BLOCK, 512, 64},  {WFormat::MXFP4, 2304, 5120},
               {WFormat::MXFP4, 256, 64},        {WFormat::BF16, 384, 5120},    {WFormat::F32, 24, 1024}};
  for (const C& c : cases)
    for (int T : {1, 37, 300})
      for (DType mode : {DType::F32, DType::BF16}) {
        if (c.f == WFormat::F32 && mode == DType::BF16) continue;
        SCOPED_TRACE(testing::Message() << "fmt " << static_cast<int>(c.f) << " N " << c.N << " K " << c.K << " T "
                                        << T << " mode " << static_cast<int>(mode));
        twin::OwnedMatrix W = twin::random_matrix(c.f, c.N, c.K, 32, rng);
        std::vector<float> x = twin::random_acts(T, c.K, rng, mode == DType::BF16);
        std::vector<float> ref(static_cast<size_t>(T * c.N)), abs(ref.size());
        twin::linear(x.data(), T, c.K, W.q, true, 32, 1, mode == DType::BF16, ref.data(), c.N, abs.data());
        DevMatrix dW = upload_matrix(W.q);
        DeviceBuffer dx = upload_act(x, mode), dy(ref.size() * cuda::dtype_size(mode));
        cuda::GemmOpts o;
        o.compute = mode;
        DeviceBuffer ws(cuda::gemm_ws_bytes(dW.q, T, o));
        cuda::gemm(dW.q, mode, dx.get(), c.K, T, mode, dy.get(), c.N, o, ws.get(), ws.size(), nullptr);
        DSX_CUDA_CHECK(cudaDeviceSynchronize());
        std::vector<float> got = download_act(dy, ref.size(), mode);
        // tensor-core bf16 products are exact; allow a little more for their f32 accumulation
        expect_close(got, ref, abs, mode == DType::BF16 ? 5e-5 : kSumTol, mode == DType::BF16 ? kBf16Ulp : 0.0,
                     "gemm");
      }
}

TEST(CudaGemm, GroupedAndMixedTypes) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(13);
  // grouped wo_a (no QA8) through the strided-batched path
  for (DType mode : {DType::F32, DType::BF16}) {
    const int G = 8;
    const int64_t N = 8192, K = 4096, T = 20;
    twin::OwnedMatrix W = twin::random_matrix(WFormat::FP8_BLOCK, N, K, 32, rng);
    std::vector<float> x = twin::random_acts(T, G * K, rng, mode == DType::BF16);
    std::vector<float> ref(static_cast<size_t>(T * N)), abs(ref.size());
    twin::linear(x.data(), T, G * K, W.q, false, 32, G, mode == DType::BF16, ref.data(), N, abs.data());
    DevMatrix dW = upload_matrix(W.q);
    DeviceBuffer dx = upload_act(x, mode), dy(ref.size() * cuda::dtype_size(mode));
    cuda::GemmOpts o;
    o.qa8 = false;
    o.groups = G;
    o.compute = mode;
    DeviceBuffer ws(cuda::gemm_ws_bytes(dW.q, static_cast<int>(T), o));
    cuda::gemm(dW.q, mode, dx.get(), G * K, static_cast<int>(T), mode, dy.get(), N, o, ws.get(), ws.size(), nullptr);
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<float> got = download_act(dy, ref.size(), mode);
    expect_close(got, ref, abs, mode == DType::BF16 ? 5e-5 : kSumTol, mode == DType::BF16 ? kBf16Ulp : 0.0,
                 "grouped gemm");
  }
  // f32 activations without QA8 against bf16 weights: falls back to f32 compute; bf16 output
  {
    const int64_t N = 384, K = 5120, T = 9;
    twin::OwnedMatrix W = twin::random_matrix(WFormat::BF16, N, K, 32, rng);
    std::vector<float> x = twin::random_acts(T, K, rng, false);
    std::vector<float> ref(static_cast<size_t>(T * N)), abs(ref.size());
    twin::linear(x.data(), T, K, W.q, false, 32, 1, true, ref.data(), N, abs.data());
    DevMatrix dW = upload_matrix(W.q);
    DeviceBuffer dx = upload_act(x, DType::F32), dy(ref.size() * 2);
    cuda::GemmOpts o;
    EXPECT_EQ(cuda::gemm_compute_type(dW.q, DType::F32, o), DType::F32);
    DeviceBuffer ws(cuda::gemm_ws_bytes(dW.q, static_cast<int>(T), o));
    cuda::gemm(dW.q, DType::F32, dx.get(), K, static_cast<int>(T), DType::BF16, dy.get(), N, o, ws.get(), ws.size(),
               nullptr);
    std::vector<float> got = download_act(dy, ref.size(), DType::BF16);
    expect_close(got, ref, abs, kSumTol, kBf16Ulp, "f32 fallback");
  }
}

// ---------------------------------------------------------------------------------
// Router: cuda::router (T <= 8: the fused one-launch kernel, else gemv + router_select)
// against the twin. A case: gate [E, D], bias, activations x [T, D] stored with row
// stride ldx (ldx > D: rows not 16-byte aligned, the scalar activation loads).
namespace {
struct RouterData {
  int64_t E = 0, D = 0, ldx = 0;
  int T = 0;
  DType xt = DType::F32;
  twin::OwnedMatrix G;
  DevMatrix dG;
  std::vector<float> x, bias;
  DeviceBuffer dx, db;
};

// Uploads x [T, D] (compact) into d.dx with row stride d.ldx (into the same device
// buffer once it exists: a captured graph holds its address).
void set_router_x(RouterData& d, std::vector<float> x) {
  d.x = std::move(x);
  std::vector<float> padded(static_cast<size_t>(d.T * d.ldx), 0.0f);
  for (int t = 0; t < d.T; ++t)
    std::copy(d.x.begin() + t * d.D, d.x.begin() + (t + 1) * d.D, padded.begin() + t * d.ldx);
  if (d.dx.size() == 0) {
    d.dx = upload_act(padded, d.xt);
  } else if (d.xt == DType::F32) {
    d.dx.upload(padded.data(), padded.size() * 4);
  } else {
    std::vector<uint16_t> h(padded.size());
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(padded[i]);
    d.dx.upload(h.data(), h.size() * 2);
  }
}

RouterData make_router_data(int64_t E, int64_t D, int T, DType xt, std::mt19937_64& rng,
                            WFormat gfmt = WFormat::BF16, int64_t ldx = 0) {
  RouterData d;
  d.E = E;
  d.D = D;
  d.ldx = ldx > 0 ? ldx : D;
  d.T = T;
  d.xt = xt;
  twin::RandomSpec sp;
  sp.sigma = 0.02f;
  d.G = twin::random_matrix(gfmt, E, D, 32, rng, sp);
  d.dG = upload_matrix(d.G.q);
  set_router_x(d, twin::random_acts(T, D, rng, xt == DType::BF16, -2, 1));
  d.bias.resize(static_cast<size_t>(E));
  std::normal_distribution<float> nd(0.0f, 0.3f);
  for (auto& b : d.bias) b = nd(rng);
  d.db = dsx_test::upload_vec(d.bias);
  return d;
}

// Outputs of the router; the logits start `off` floats into their buffer (off > 0: an
// address no earlier logits buffer had, cudaMalloc bases being 256-byte aligned).
struct RouterOut {
  DeviceBuffer z, ids, w;
  int64_t off = 0;
  RouterOut(int64_t E, int T, int topk, int64_t z_off = 0)
      : z(static_cast<size_t>(T * E + z_off) * 4),
        ids(static_cast<size_t>(T * topk) * 4),
        w(static_cast<size_t>(T * topk) * 4),
        off(z_off) {}
  float* zp() const { return z.as<float>() + off; }
};

void call_router(const RouterData& d, int T, int topk, bool with_bias, const cuda::RouterOpts& ro, RouterOut& o,
                 cudaStream_t st) {
  cuda::router(d.xt, d.dx.get(), d.ldx, T, d.dG.q, with_bias ? d.db.as<float>() : nullptr, topk, ro, o.zp(),
               o.ids.as<int32_t>(), o.w.as<float>(), st);
}

// The outputs of a call on the first T rows of d.x (device synchronized by the caller):
// logits against the twin's product, ids / weights against the twin on the GPU's logits.
void check_router(const RouterData& d, int T, int topk, bool with_bias, const cuda::RouterOpts& ro,
                  const RouterOut& o) {
  const int64_t E = d.E, D = d.D;
  SCOPED_TRACE(testing::Message() << "E " << E << " D " << D << " k " << topk << " T " << T << " bias " << with_bias
                                  << " ldx " << d.ldx);
  // logits on the CPU (LinF32) and their magnitude
  std::vector<float> z(static_cast<size_t>(T * E)), abs(z.size());
  twin::linear(d.x.data(), T, D, d.G.q, false, 32, 1, false, z.data(), E, abs.data());
  std::vector<float> gz(z.size()), gw(static_cast<size_t>(T * topk));
  std::vector<int32_t> gi(static_cast<size_t>(T * topk));
  o.z.download(gz.data(), gz.size() * 4, static_cast<size_t>(o.off) * 4);
  o.ids.download(gi.data(), gi.size() * 4);
  o.w.download(gw.data(), gw.size() * 4);
  expect_close(gz, z, abs, kSumTol, 0.0, "router logits");
  // selection and weights: twin on the GPU's logits (summation order taken out)
  std::vector<int32_t> ri(gi.size());
  std::vector<float> rw(gw.size());
  twin::router(gz.data(), T, E, with_bias ? d.bias.data() : nullptr, topk, ro.gate_temp, ro.norm_topk_prob,
               ro.route_scale, ri.data(), rw.data());
  for (int t = 0; t < T; ++t) {
    std::vector<int32_t> row(gi.begin() + t * topk, gi.begin() + (t + 1) * topk);
    std::sort(row.begin(), row.end());
    EXPECT_TRUE(std::adjacent_find(row.begin(), row.end()) == row.end()) << "token " << t << ": repeated expert";
    for (int k = 0; k < topk; ++k) {
      const size_t i = static_cast<size_t>(t * topk + k);
      ASSERT_TRUE(gi[i] >= 0 && gi[i] < E) << "token " << t << " slot " << k << " expert " << gi[i];
      // softplus / sqrt may differ by an ulp or two between libm and CUDA: only a
      // near-tie (relative gap < 1e-6) could legitimately change the order
      if (gi[i] != ri[i]) {
        auto score = [&](int e) {
          const float v = gz[static_cast<size_t>(t * E + e)] / ro.gate_temp;
          return std::sqrt(cpu::softplus(v)) + (with_bias ? d.bias[static_cast<size_t>(e)] : 0.0f);
        };
        const float a = score(gi[i]), b = score(ri[i]);
        EXPECT_LE(std::fabs(a - b), 1e-6f * std::max(std::fabs(a), std::fabs(b)))
            << "token " << t << " slot " << k << " gpu expert " << gi[i] << " cpu expert " << ri[i];
      } else {
        EXPECT_NEAR(gw[i], rw[i], 2e-6 * std::fabs(rw[i]) + 1e-30) << "token " << t << " slot " << k;
      }
    }
  }
}

void run_router_case(int64_t E, int64_t D, int topk, int T, bool with_bias, DType xt, const cuda::RouterOpts& ro,
                     std::mt19937_64& rng, WFormat gfmt = WFormat::BF16, int64_t ldx = 0) {
  RouterData d = make_router_data(E, D, T, xt, rng, gfmt, ldx);
  RouterOut o(E, T, topk);
  call_router(d, T, topk, with_bias, ro, o, nullptr);
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  check_router(d, T, topk, with_bias, ro, o);
}

// The two-launch reference on the same inputs: gemv into logits, then router_select.
void two_launch_router(const RouterData& d, int T, int topk, bool with_bias, const cuda::RouterOpts& ro,
                       RouterOut& o) {
  cuda::GemvOpts g;
  cuda::gemv(d.dG.q, d.xt, d.dx.get(), d.ldx, T, DType::F32, o.zp(), d.E, g, nullptr);
  cuda::router_select(o.zp(), d.E, T, static_cast<int>(d.E), with_bias ? d.db.as<float>() : nullptr, topk, ro,
                      o.ids.as<int32_t>(), o.w.as<float>(), nullptr);
}
}  // namespace

TEST(CudaRouter, MatchesTwin) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(21);
  cuda::RouterOpts ro;
  for (DType xt : {DType::F32, DType::BF16}) {
    run_router_case(384, 5120, 6, 1, true, xt, ro, rng);
    run_router_case(384, 5120, 6, 1, false, xt, ro, rng);
    run_router_case(384, 5120, 6, 5, true, xt, ro, rng);
    run_router_case(384, 5120, 6, 8, true, xt, ro, rng);
    run_router_case(384, 5120, 6, 8, false, xt, ro, rng);
    run_router_case(8, 256, 2, 3, true, xt, ro, rng);
    run_router_case(128, 5120, 3, 2, false, xt, ro, rng);
    run_router_case(1000, 2048, 16, 1, true, xt, ro, rng);
    run_router_case(1000, 2048, 16, 8, true, xt, ro, rng);
    run_router_case(1024, 512, 16, 4, false, xt, ro, rng);
    // x rows not 16-byte aligned (scalar activation loads)
    const int64_t ldx = 5120 + 4 / static_cast<int64_t>(cuda::dtype_size(xt));
    run_router_case(384, 5120, 6, 2, true, xt, ro, rng, WFormat::BF16, ldx);
    // f32 gate
    run_router_case(384, 1024, 6, 3, true, xt, ro, rng, WFormat::F32);
    // T > 8: the fused kernel for rows 0..7 and for the rest
    run_router_case(384, 1024, 6, 12, true, xt, ro, rng);
  }
  cuda::RouterOpts r2;
  r2.gate_temp = 0.7f;
  r2.norm_topk_prob = false;
  r2.route_scale = 2.5f;
  run_router_case(384, 5120, 8, 4, true, DType::BF16, r2, rng);
  run_router_case(384, 5120, 8, 7, true, DType::BF16, r2, rng);
  run_router_case(64, 256, 1, 4, true, DType::F32, ro, rng);
  run_router_case(1, 64, 1, 2, true, DType::F32, ro, rng);
  run_router_case(17, 64, 16, 8, false, DType::BF16, ro, rng);
}

// The fused kernel against the two-launch path on the same inputs: identical ids and
// bit-identical weights once both see the same logits (the selection reads them back).
TEST(CudaRouter, FusedMatchesTwoLaunchSelection) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(25);
  cuda::RouterOpts ro;
  for (int T : {1, 2, 3, 8}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(testing::Message() << "T " << T << " bias " << with_bias);
      RouterData d = make_router_data(384, 5120, T, DType::BF16, rng);
      const int k = 6;
      RouterOut a(384, T, k), b(384, T, k);
      call_router(d, T, k, with_bias, ro, a, nullptr);
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      // the selection of router_select on the fused kernel's logits
      cuda::router_select(a.zp(), 384, T, 384, with_bias ? d.db.as<float>() : nullptr, k, ro,
                          b.ids.as<int32_t>(), b.w.as<float>(), nullptr);
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      const size_t n = static_cast<size_t>(T * k);
      EXPECT_EQ(dsx_test::download_vec<int32_t>(a.ids, n), dsx_test::download_vec<int32_t>(b.ids, n));
      EXPECT_EQ(dsx_test::count_bit_diff(dsx_test::download_vec<float>(a.w, n), dsx_test::download_vec<float>(b.w, n)),
                0u);
      // and the whole two-launch path: logits within the summation tolerance
      two_launch_router(d, T, k, with_bias, ro, b);
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      check_router(d, T, k, with_bias, ro, b);
    }
  }
}

// Several rows in one call == each row alone, bit for bit: logits, ids and weights
// (the fused kernel with the rows staged in shared memory; 9..16 rows: two launches).
TEST(CudaRouter, RowsEqualOneRowBitwise) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(26);
  cuda::RouterOpts ro;
  struct C {
    int64_t E, D;
    int k;
    WFormat g;
  } cases[] = {{384, 5120, 6, WFormat::BF16}, {1000, 2048, 16, WFormat::BF16}, {384, 1024, 6, WFormat::F32}};
  for (const C& c : cases) {
    for (DType xt : {DType::BF16, DType::F32}) {
      RouterData d = make_router_data(c.E, c.D, 16, xt, rng, c.g);
      const size_t xb = cuda::dtype_size(xt);
      for (int T : {2, 3, 5, 6, 8, 9, 12, 16}) {
        SCOPED_TRACE(testing::Message() << "E " << c.E << " D " << c.D << " k " << c.k << " T " << T << " xt "
                                        << (xt == DType::BF16 ? "bf16" : "f32"));
        RouterOut all(c.E, T, c.k);
        call_router(d, T, c.k, true, ro, all, nullptr);
        std::vector<float> z1, w1;
        std::vector<int32_t> i1;
        for (int t = 0; t < T; ++t) {
          RouterOut one(c.E, 1, c.k);
          cuda::router(xt, static_cast<const uint8_t*>(d.dx.get()) + t * d.ldx * xb, d.ldx, 1, d.dG.q, d.db.as<float>(),
                       c.k, ro, one.zp(), one.ids.as<int32_t>(), one.w.as<float>(), nullptr);
          DSX_CUDA_CHECK(cudaDeviceSynchronize());
          const auto z = dsx_test::download_vec<float>(one.z, static_cast<size_t>(c.E));
          const auto w = dsx_test::download_vec<float>(one.w, static_cast<size_t>(c.k));
          const auto i = dsx_test::download_vec<int32_t>(one.ids, static_cast<size_t>(c.k));
          z1.insert(z1.end(), z.begin(), z.end());
          w1.insert(w1.end(), w.begin(), w.end());
          i1.insert(i1.end(), i.begin(), i.end());
        }
        DSX_CUDA_CHECK(cudaDeviceSynchronize());
        const size_t nk = static_cast<size_t>(T * c.k);
        EXPECT_EQ(dsx_test::count_bit_diff(dsx_test::download_vec<float>(all.z, static_cast<size_t>(T * c.E)), z1), 0u)
            << "logits";
        EXPECT_EQ(dsx_test::download_vec<int32_t>(all.ids, nk), i1) << "ids";
        EXPECT_EQ(dsx_test::count_bit_diff(dsx_test::download_vec<float>(all.w, nk), w1), 0u) << "weights";
        if (T == 6 || T == 12) check_router(d, T, c.k, true, ro, all);
      }
    }
  }
}

// Exact ties in the logits (duplicated gate rows): the lower expert id first.
TEST(CudaRouter, FusedTiesPreferLowerId) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(23);
  cuda::RouterOpts ro;
  const int64_t E = 384, D = 5120;
  const int k = 6;
  for (int T : {1, 3, 8}) {
    SCOPED_TRACE(testing::Message() << "T " << T);
    RouterData d = make_router_data(E, D, T, DType::BF16, rng);
    // positive activations; rows 3, 5, 17, 200, 299 all 0.5 (huge equal logits)
    std::vector<float> x = d.x;
    for (auto& v : x) v = std::fabs(v);
    set_router_x(d, x);
    const std::vector<int32_t> tied = {3, 5, 17, 200, 299};
    for (int e : {299, 17, 3, 200, 5}) {  // (any order)
      const uint16_t h = f32_to_bf16(0.5f);
      for (int64_t c = 0; c < D; ++c) std::memcpy(d.G.data.data() + (e * D + c) * 2, &h, 2);
    }
    d.dG = upload_matrix(d.G.q);
    RouterOut o(E, T, k);
    call_router(d, T, k, false, ro, o, nullptr);
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> gz = dsx_test::download_vec<float>(o.z, static_cast<size_t>(T * E));
    const std::vector<int32_t> gi = dsx_test::download_vec<int32_t>(o.ids, static_cast<size_t>(T * k));
    for (int t = 0; t < T; ++t) {
      for (int e : tied)
        EXPECT_EQ(f32_bits(gz[static_cast<size_t>(t * E + e)]), f32_bits(gz[static_cast<size_t>(t * E + 3)]))
            << "token " << t << " expert " << e << ": identical rows must give identical logits";
      for (int i = 0; i < 5; ++i) EXPECT_EQ(gi[static_cast<size_t>(t * k + i)], tied[static_cast<size_t>(i)]) << t;
    }
    check_router(d, T, k, false, ro, o);
  }
  // every row the same: all experts tie, ids 0..k-1 (E = 1000, k = 16 too)
  const std::vector<std::tuple<int64_t, int, int>> all_tied = {{384, 6, 8}, {384, 6, 1}, {1000, 16, 8}, {1000, 16, 2}};
  for (auto [E2, k2, T] : all_tied) {
    SCOPED_TRACE(testing::Message() << "all tied E " << E2 << " k " << k2 << " T " << T);
    RouterData d = make_router_data(E2, 256, T, DType::F32, rng);
    for (int64_t e = 1; e < E2; ++e) std::memcpy(d.G.data.data() + e * 256 * 2, d.G.data.data(), 256 * 2);
    d.dG = upload_matrix(d.G.q);
    RouterOut o(E2, T, k2);
    call_router(d, T, k2, false, ro, o, nullptr);
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<int32_t> gi = dsx_test::download_vec<int32_t>(o.ids, static_cast<size_t>(T * k2));
    const std::vector<float> gw = dsx_test::download_vec<float>(o.w, static_cast<size_t>(T * k2));
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < k2; ++i) {
        EXPECT_EQ(gi[static_cast<size_t>(t * k2 + i)], i) << "token " << t;
        EXPECT_EQ(f32_bits(gw[static_cast<size_t>(t * k2 + i)]), f32_bits(gw[static_cast<size_t>(t * k2)]));
      }
  }
}

// Back-to-back calls on the same buffers (the counter is reset by each launch), and the
// router captured in a CUDA graph and replayed (eagerly first, so the counter exists;
// and a logits buffer first seen inside the capture: the two-launch path).
TEST(CudaRouter, RepeatedCallsAndGraphReplay) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(24);
  cuda::RouterOpts ro;
  const int64_t E = 384, D = 5120;
  const int k = 6, T = 4;
  cudaStream_t st;
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  RouterData d1 = make_router_data(E, D, T, DType::BF16, rng), d2 = make_router_data(E, D, T, DType::BF16, rng),
             d3 = make_router_data(E, D, T, DType::BF16, rng);
  {
    RouterOut o(E, T, k);
    call_router(d1, 4, k, true, ro, o, st);
    call_router(d2, 1, k, true, ro, o, st);
    call_router(d3, 4, k, true, ro, o, st);  // must overwrite all of call 1's ids
    DSX_CUDA_CHECK(cudaStreamSynchronize(st));
    check_router(d3, 4, k, true, ro, o);
    for (int rep = 0; rep < 3; ++rep) {
      const RouterData& d = rep == 1 ? d1 : d2;
      const int Tr = rep == 2 ? 1 : 4;
      call_router(d, Tr, k, true, ro, o, st);
      DSX_CUDA_CHECK(cudaStreamSynchronize(st));
      check_router(d, Tr, k, true, ro, o);
    }
  }
  for (bool eager_first : {true, false}) {
    SCOPED_TRACE(testing::Message() << "eager first " << eager_first);
    RouterOut o(E, T, k, eager_first ? 0 : 1);  // (not eager first: a logits address never seen)
    RouterData d = make_router_data(E, D, T, DType::BF16, rng);
    if (eager_first) {
      call_router(d1, T, k, true, ro, o, st);
      DSX_CUDA_CHECK(cudaStreamSynchronize(st));
    } else {
      two_launch_router(d, T, k, true, ro, o);  // (kernel attributes set outside the capture)
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
    }
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    DSX_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    call_router(d, T, k, true, ro, o, st);
    DSX_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    DSX_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      set_router_x(d, twin::random_acts(T, D, rng, true, -2, 1));
      DSX_CUDA_CHECK(cudaDeviceSynchronize());
      DSX_CUDA_CHECK(cudaGraphLaunch(exec, st));
      if (rep == 2) DSX_CUDA_CHECK(cudaGraphLaunch(exec, st));  // two replays back to back
      DSX_CUDA_CHECK(cudaStreamSynchronize(st));
      check_router(d, T, k, true, ro, o);
    }
    // an eager call on the same buffers after the replays
    call_router(d2, T, k, true, ro, o, st);
    DSX_CUDA_CHECK(cudaStreamSynchronize(st));
    check_router(d2, T, k, true, ro, o);
    DSX_CUDA_CHECK(cudaGraphExecDestroy(exec));
    DSX_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  DSX_CUDA_CHECK(cudaStreamDestroy(st));
}

TEST(CudaRouter, TiesPreferLowerId) {
  SKIP_WITHOUT_GPU();
  const int E = 300, T = 2, k = 6;
  std::vector<float> z(static_cast<size_t>(T * E), -3.0f);
  for (int e : {5, 17, 200, 299, 3}) z[static_cast<size_t>(e)] = 2.0f;  // token 0: 5 tied winners
  z[100] = 1.0f;
  for (int e = 0; e < E; ++e) z[static_cast<size_t>(E + e)] = 0.5f;  // token 1: all tied
  DeviceBuffer dz(z.size() * 4), di(static_cast<size_t>(T * k) * 4), dw(static_cast<size_t>(T * k) * 4);
  dz.upload(z.data(), z.size() * 4);
  cuda::RouterOpts ro;
  cuda::router_select(dz.as<float>(), E, T, E, nullptr, k, ro, di.as<int32_t>(), dw.as<float>(), nullptr);
  std::vector<int32_t> gi(static_cast<size_t>(T * k));
  di.download(gi.data(), gi.size() * 4);
  const std::vector<int32_t> want0 = {3, 5, 17, 200, 299, 100}, want1 = {0, 1, 2, 3, 4, 5};
  for (int i = 0; i < k; ++i) {
    EXPECT_EQ(gi[static_cast<size_t>(i)], want0[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(gi[static_cast<size_t>(k + i)], want1[static_cast<size_t>(i)]) << i;
  }
}

// GemvOpts::pick: the greedy id of a one-token product, folded into the CUDA-core kernel
// (large bf16 matrices, like the head) or by argmax_rows after the other paths, against the
// host argmax of the same output row: ties (a copy of the largest row placed before it), a
// NaN row, a NaN at index 0, repeated calls (the workspace resets itself), the copy
// destination in pinned host memory.
// ---------------------------------------------------------------------------------
// Several rows in one call == each row alone, bit for bit (DSpark verify and batched
// decode compare a k-row step's rows with one-row steps). The calls below run T rows
// at once and each row alone on the same buffers.

namespace {

// y of gemv for rows [0, T) of x in one call, and for each of them alone (the same opts).
struct RowsRun {
  std::vector<float> together, alone;
  std::string path_together, path_alone;
};
RowsRun run_rows_and_alone(const DevMatrix& W, DType xt, DType yt, const DeviceBuffer& dx, int64_t ldx, int T,
                           const cuda::GemvOpts& o) {
  const int64_t N = W.q.rows;
  const size_t xb = cuda::dtype_size(xt), yb = cuda::dtype_size(yt);
  DeviceBuffer dy(static_cast<size_t>(T * N) * yb), d1(static_cast<size_t>(T * N) * yb);
  RowsRun r;
  cuda::gemv(W.q, xt, dx.get(), ldx, T, yt, dy.get(), N, o, nullptr);
  r.path_together = cuda::gemv_last_path();
  for (int t = 0; t < T; ++t) {
    cuda::gemv(W.q, xt, static_cast<const uint8_t*>(dx.get()) + t * ldx * xb, ldx, 1, yt,
               static_cast<uint8_t*>(d1.get()) + t * N * yb, N, o, nullptr);
    if (t == 0) r.path_alone = cuda::gemv_last_path();
  }
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  r.together = download_act(dy, static_cast<size_t>(T * N), yt);
  r.alone = download_act(d1, static_cast<size_t>(T * N), yt);
  return r;
}

// Float64 reference of a BF16-weight product: |gpu - ref| <= 2e-5 sum_k |x_k W_nk| (+ one
// bf16 ulp for bf16 outputs), the bound of the f32 twin comparisons above.
// w: the weight's values [N, K].
void expect_bf16_product_f64(const std::vector<float>& w, int64_t N, int64_t K, const std::vector<float>& x, int T,
                             const std::vector<float>& got, DType yt, const std::string& what) {
  std::vector<float> ref(static_cast<size_t>(T * N)), abs(ref.size());
  for (int t = 0; t < T; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0, a = 0;
      const float* wr = w.data() + n * K;
      const float* xr = x.data() + t * K;
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(wr[k]) * xr[k];
        s += p;
        a += std::fabs(p);
      }
      ref[static_cast<size_t>(t * N + n)] = static_cast<float>(s);
      abs[static_cast<size_t>(t * N + n)] = static_cast<float>(a);
    }
  expect_close(got, ref, abs, kSumTol, yt == DType::BF16 ? kBf16Ulp : 0.0, what);
}

}  // namespace

// 2..16 rows against a BF16 weight too large for the one-token streaming kernel (the
// head): one weight stream for all rows (gemv_rows.cu), every row bit for bit the
// one-row CUDA-core kernel's; the rows also against a float64 reference.
TEST(CudaGemv, HeadRowsEqualOneRowBitwise) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(21);
  const bool check_path = default_gemv_switches();
  // (> 32 MB, and enough rows that the one-row kernel splits no K: 1024 or more blocks
  // of 16 rows; N = 12289 and 16411 leave partial groups of 4 rows)
  const Shape shapes[] = {{12289, 5120}, {16411, 2048}};
  for (const Shape& s : shapes) {
    twin::OwnedMatrix Wh = twin::random_matrix(WFormat::BF16, s.N, s.K, 32, rng);
    DevMatrix W = upload_matrix(Wh.q);
    std::vector<float> wv(static_cast<size_t>(s.N * s.K));
    Wh.q.dequant_rows(0, s.N, wv.data());
    for (DType xt : {DType::BF16, DType::F32}) {
      const std::vector<float> x = twin::random_acts(16, s.K, rng, xt == DType::BF16);
      DeviceBuffer dx = upload_act(x, xt);
      for (DType yt : {DType::F32, DType::BF16}) {
        for (int T = 2; T <= 16; ++T) {
          SCOPED_TRACE(testing::Message() << "N " << s.N << " K " << s.K << " T " << T << " xt "
                                          << (xt == DType::BF16 ? "bf16" : "f32") << " yt "
                                          << (yt == DType::BF16 ? "bf16" : "f32"));
          const RowsRun r = run_rows_and_alone(W, xt, yt, dx, s.K, T, {});
          if (check_path) {
            EXPECT_EQ(r.path_together, "rows");
            EXPECT_EQ(r.path_alone, "cuda-core");
          }
          EXPECT_EQ(count_bit_diff(r.together, r.alone), 0u) << "rows differ from one-row calls";
          if ((T == 5 || T == 16) && yt == DType::F32)
            expect_bf16_product_f64(wv, s.N, s.K, x, T, r.together, yt, "head rows vs float64");
        }
      }
    }
  }
}

// The shared-ring FP8 kernel (BF16 mode) of 2..16 rows: one or two token passes per
// launch (two launches from 9 rows), the one-token K split, every row bit for bit the
// one-row call's; QA8 products and the grouped wo_a without QA8, the release's shapes
// (the split of wo_b / wo_a changed with the staged rows before), a 128-tile weight
// (the consumer with bound tests) and small odd ones; the rows also against the twin.
TEST(CudaGemv, RingRowsEqualOneRowBitwise) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(22);
  const bool check_path = default_gemv_switches();
  struct C {
    int64_t N, K;
    int block, groups;
    bool qa8;
  } cases[] = {
      {5120, 8192, 32, 1, true},   // wo_b
      {1280, 5120, 32, 1, true},   // wq_a
      {32768, 1280, 32, 1, true},  // wq_b
      {8192, 4096, 32, 8, false},  // wo_a
      {1024, 4096, 128, 1, true},  // V4 tiles
      {48, 256, 32, 1, true},      {256, 96, 32, 8, false},
  };
  for (const C& c : cases) {
    Weight W = make_weight(WFormat::FP8_BLOCK, c.N, c.K, rng, c.block);
    cuda::GemvOpts o;
    o.qa8 = c.qa8;
    o.groups = c.groups;
    const int64_t ldx = c.groups * c.K;
    const std::vector<float> x = wide_range_acts(16, ldx, rng);
    DeviceBuffer dx = upload_act(x, DType::BF16);
    for (DType yt : {DType::BF16, DType::F32}) {
      for (int T : {2, 3, 4, 5, 6, 7, 8, 9, 12, 16}) {
        SCOPED_TRACE(testing::Message() << "N " << c.N << " K " << c.K << " block " << c.block << " groups "
                                        << c.groups << " qa8 " << c.qa8 << " T " << T << " yt "
                                        << (yt == DType::BF16 ? "bf16" : "f32"));
        const RowsRun r = run_rows_and_alone(W.d, DType::BF16, yt, dx, ldx, T, o);
        if (check_path) {
          EXPECT_EQ(r.path_together, "mma-ring");
          EXPECT_EQ(r.path_alone, "mma-ring");
        }
        EXPECT_EQ(count_bit_diff(r.together, r.alone), 0u) << "rows differ from one-row calls";
        if (yt == DType::BF16 && (T == 6 || T == 12))
          check_gemv_x(W, T, DType::BF16, DType::BF16, std::vector<float>(x.begin(), x.begin() + T * ldx), o);
      }
    }
  }
}

TEST(CudaGemv, GreedyPick) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(17);
  int32_t* host = nullptr;
  ASSERT_EQ(cudaMallocHost(&host, 4), cudaSuccess);
  DeviceBuffer dpick(4);
  const Shape shapes[] = {{70000, 256}, {8192, 5120}, {4096, 256}, {300, 256}};
  for (const Shape& s : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      Weight W = make_weight(WFormat::BF16, s.N, s.K, rng);
      const std::vector<float> x = twin::random_acts(1, s.K, rng, true);
      DeviceBuffer dx = upload_act(x, DType::BF16), dy(static_cast<size_t>(s.N) * 4);
      auto run = [&](bool with_pick) {
        cuda::GemvOpts o;
        o.pick = with_pick ? dpick.as<int32_t>() : nullptr;
        o.pick_copy = with_pick ? host : nullptr;
        *host = -5;
        cuda::gemv(W.d.q, DType::BF16, dx.get(), s.K, 1, DType::F32, dy.get(), s.N, o, nullptr);
        DSX_CUDA_CHECK(cudaDeviceSynchronize());
        return download_act(dy, static_cast<size_t>(s.N), DType::F32);
      };
      std::vector<float> y = run(false);
      const int64_t row_bytes = s.K * 2;
      auto set_row = [&](int64_t dst, const uint8_t* src) {
        std::memcpy(W.h.data.data() + dst * row_bytes, src, static_cast<size_t>(row_bytes));
      };
      const int64_t m = dsx::argmax(y.data(), s.N);
      if (variant >= 1 && m > 0) {  // a tie before the largest
        std::vector<uint8_t> row(W.h.data.begin() + m * row_bytes, W.h.data.begin() + (m + 1) * row_bytes);
        set_row(static_cast<int64_t>(rng() % static_cast<uint64_t>(m)), row.data());
      }
      if (variant >= 1) {  // a NaN row (bf16 0x7fc0)
        std::vector<uint8_t> nanrow(static_cast<size_t>(row_bytes));
        for (int64_t k = 0; k < s.K; ++k) nanrow[2 * k] = 0xc0, nanrow[2 * k + 1] = 0x7f;
        set_row(static_cast<int64_t>(rng() % static_cast<uint64_t>(s.N)), nanrow.data());
        if (variant == 2) set_row(0, nanrow.data());
      }
      W.d = upload_matrix(W.h.q);
      for (int rep = 0; rep < 2; ++rep) {
        y = run(true);
        int32_t got = -1;
        dpick.download(&got, 4);
        const int32_t want = dsx::argmax(y.data(), s.N);
        EXPECT_EQ(got, want) << "N " << s.N << " K " << s.K << " variant " << variant << " rep " << rep << " path "
                             << cuda::gemv_last_path();
        EXPECT_EQ(*host, want) << "copy destination";
        if (variant == 2) EXPECT_EQ(want, 0);
      }
    }
  }
  cudaFreeHost(host);
}

#endif  // DSX_HAVE_CUDA
