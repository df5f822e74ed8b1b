// Non-GEMM CUDA kernels, part 1: fake-quantizers, RMSNorm (+QA8), RoPE, window-KV
// finish, compact cache rows and the device KV state, hyper-connections, Engram —
// each against its CPU twin (src/kernels/cpu/twin_attn.h, mirroring V41Cpu) on fresh
// random inputs, in both activation modes.
//
// Tolerances:
//  * quantizers, QA8 codes of a given input, compact-row conversions, state upload /
//    download: bit-exact;
//  * RMSNorm / RoPE / fused kernels: the twin uses the same formulas; the only source
//    of difference is the f32/f64 reduction order of Σx² (and libm vs CUDA sin/cos in
//    double), so nearly every element is bit-identical; a handful may differ by one
//    f32 / bf16 ulp, which can move a fake-quantized element by one code step;
//  * hc / Engram: reduction order of 4D-long dot products: relative 1e-5 (f32) or one
//    bf16 ulp.
#ifdef DSX_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "model/cpu/ops.h"
#include "model/cpu/quant.h"
#include "model/kv_formats.h"
#include "model/kv_state.h"
#include "util/snapshot_io.h"
#include "backend/cuda/kv_cache.h"
#include "backend/cuda/device_model.h"
#include "kernels/cpu/twin_attn.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/engram_gate.h"
#include "kernels/cuda/hc.h"
#include "kernels/cuda/kv_cache.h"
#include "cuda_test_util.h"
#include "runtime/sampler.h"
#include "util/numerics.h"

using namespace dsx;
using namespace dsx_test;  // also Act, DeviceBuffer
namespace twin = dsx::cpu::twin;

namespace {

DeviceBuffer upload_pos(int64_t p) { return upload_vec(std::vector<int64_t>{p}); }

std::vector<float> fq8_rows(std::vector<float> v, int dim) {
  for (size_t r = 0; r < v.size() / dim; ++r) cpu::qa8_inplace(v.data() + r * dim, dim, 32);
  return v;
}
std::vector<float> fq4e4_rows(std::vector<float> v, int dim) {
  for (size_t r = 0; r < v.size() / dim; ++r) cpu::fq4_e4_inplace(v.data() + r * dim, dim, 16);
  return v;
}
std::vector<float> fq4e8_rows(std::vector<float> v, int dim) {
  for (size_t r = 0; r < v.size() / dim; ++r) cpu::fq4_e8_inplace(v.data() + r * dim, dim, 32);
  return v;
}

// Mixed-magnitude inputs with exact rounding ties for the quantizers.
std::vector<float> quant_inputs(size_t blocks, int block, Rng& rng) {
  std::vector<float> v(blocks * block);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-30, 20), kind(0, 9), code(0, 125);
  for (size_t b = 0; b < blocks; ++b) {
    float* p = v.data() + b * block;
    const int k = kind(rng);
    const float sc = std::ldexp(1.0f, ex(rng));
    for (int i = 0; i < block; ++i) {
      switch (k) {
        case 0: p[i] = 0.0f; break;                                  // all zero
        case 1: p[i] = nd(rng) * 1e-7f; break;                       // below the floors
        case 2: p[i] = (i == 0 ? 448.0f : e4m3_to_f32(static_cast<uint8_t>(code(rng))) + 0.5f * std::ldexp(1.0f, -9)) * sc; break;
        case 3: {  // e2m1 midpoints
          static const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
          p[i] = mids[static_cast<size_t>(code(rng)) % 8] * sc * (i & 1 ? -1.0f : 1.0f);
          break;
        }
        default: p[i] = nd(rng) * sc; break;
      }
    }
  }
  return v;
}

}  // namespace

// ------------------------------------------------------------------------------------------
TEST(CudaElementwise, FakeQuantizersBitExact) {
  SKIP_WITHOUT_GPU();
  Rng rng(11);
  for (auto kind : {cuda::FakeQuant::FQ8, cuda::FakeQuant::FQ4e8, cuda::FakeQuant::FQ4e4}) {
    const int block = kind == cuda::FakeQuant::FQ4e4 ? 16 : 32;
    std::vector<float> x = quant_inputs(4096, block, rng);
    DeviceBuffer d = upload_vec(x);
    cuda::fake_quant_inplace(kind, d.as<float>(), static_cast<int64_t>(x.size()), nullptr);
    std::vector<float> got = download_vec<float>(d, x.size());
    std::vector<float> want = x;
    for (size_t b = 0; b < x.size(); b += static_cast<size_t>(block)) {
      if (kind == cuda::FakeQuant::FQ8) cpu::qa8_inplace(want.data() + b, block, block);
      if (kind == cuda::FakeQuant::FQ4e8) cpu::fq4_e8_inplace(want.data() + b, block, block);
      if (kind == cuda::FakeQuant::FQ4e4) cpu::fq4_e4_inplace(want.data() + b, block, block);
    }
    EXPECT_EQ(count_bit_diff(got, want), 0u) << "quantizer " << static_cast<int>(kind);
  }
}

TEST(CudaElementwise, CompactRowsExact) {
  SKIP_WITHOUT_GPU();
  Rng rng(12);
  for (int dim : {64, 128, 512}) {
    const int64_t rows = 37;
    std::vector<float> x = quant_inputs(static_cast<size_t>(rows * dim / 32), 32, rng);
    // FQ8
    {
      std::vector<float> want = fq8_rows(x, dim);
      std::vector<uint8_t> hc(static_cast<size_t>(rows * dim)), hs(static_cast<size_t>(rows * dim / 32));
      pack_fq8_rows(want.data(), rows, dim, hc.data(), hs.data());
      std::vector<float> back(want.size());
      unpack_fq8_rows(hc.data(), hs.data(), rows, dim, back.data());
      EXPECT_EQ(count_bit_diff(back, want), 0u) << "pack/unpack fq8 " << dim;
      DeviceBuffer dx = upload_vec(x), dc(hc.size()), ds(hs.size()), dy(want.size() * 4);
      cuda::Fq8Rows r{dc.as<uint8_t>(), ds.as<uint8_t>(), dim};
      cuda::quantize_fq8_rows(dx.as<float>(), rows, dim, r, nullptr);
      cuda::dequant_fq8_rows(r, rows, dy.as<float>(), nullptr);
      EXPECT_EQ(count_bit_diff(download_vec<float>(dy, want.size()), want), 0u) << "device fq8 " << dim;
    }
    // FQ4e4
    {
      std::vector<float> want = fq4e4_rows(x, dim);
      std::vector<uint8_t> hp(static_cast<size_t>(rows * dim / 2)), hs(static_cast<size_t>(rows * dim / 16));
      pack_fq4e4_rows(want.data(), rows, dim, hp.data(), hs.data());
      std::vector<float> back(want.size());
      unpack_fq4e4_rows(hp.data(), hs.data(), rows, dim, back.data());
      EXPECT_EQ(count_bit_diff(back, want), 0u) << "pack/unpack fq4e4 " << dim;
      DeviceBuffer dx = upload_vec(x), dp(hp.size()), ds(hs.size()), dy(want.size() * 4);
      cuda::Fq4e4Rows r{dp.as<uint8_t>(), ds.as<uint8_t>(), dim};
      cuda::quantize_fq4e4_rows(dx.as<float>(), rows, dim, r, nullptr);
      cuda::dequant_fq4e4_rows(r, rows, dy.as<float>(), nullptr);
      EXPECT_EQ(count_bit_diff(download_vec<float>(dy, want.size()), want), 0u) << "device fq4e4 " << dim;
    }
    // FQ4e8
    {
      std::vector<float> want = fq4e8_rows(x, dim);
      std::vector<uint8_t> hp(static_cast<size_t>(rows * dim / 2)), hs(static_cast<size_t>(rows * dim / 32));
      pack_fq4e8_rows(want.data(), rows, dim, hp.data(), hs.data());
      std::vector<float> back(want.size());
      unpack_fq4e8_rows(hp.data(), hs.data(), rows, dim, back.data());
      EXPECT_EQ(count_bit_diff(back, want), 0u) << "pack/unpack fq4e8 " << dim;
      DeviceBuffer dx = upload_vec(x), dp(hp.size()), ds(hs.size()), dy(want.size() * 4);
      cuda::Fq4e8Rows r{dp.as<uint8_t>(), ds.as<uint8_t>(), dim};
      cuda::quantize_fq4e8_rows(dx.as<float>(), rows, dim, r, nullptr);
      cuda::dequant_fq4e8_rows(r, rows, dy.as<float>(), nullptr);
      EXPECT_EQ(count_bit_diff(download_vec<float>(dy, want.size()), want), 0u) << "device fq4e8 " << dim;
    }
  }
  // a value that is no quantizer output must be rejected
  std::vector<float> bad(32, 0.0f);
  bad[0] = 1.0f;
  bad[1] = 1.0f + 1.0f / 64.0f;  // not on the e4m3 grid of any scale that also holds 1.0 in range
  bad[2] = 1e-3f;
  std::vector<uint8_t> c(32), s(1);
  EXPECT_THROW(pack_fq8_rows(bad.data(), 1, 32, c.data(), s.data()), dsx::Error);
}

TEST(CudaElementwise, RmsNormAndQa8) {
  SKIP_WITHOUT_GPU();
  Rng rng(13);
  for (Act act : {Act::F32, Act::BF16})
    for (int n : {256, 1280, 5120}) {
      const int rows = 7;
      std::vector<float> x = act_values(randn(static_cast<size_t>(rows) * n, rng, 3.0f), act);
      std::vector<float> w = randn(static_cast<size_t>(n), rng, 0.2f);
      for (auto& v : w) v = round_bf16(1.0f + v);
      DeviceBuffer dx = upload_act(x, act), dw = upload_vec(w), dy(x.size() * cuda::act_bytes(act));
      DeviceBuffer dc(x.size()), ds(x.size() / 32 * 4);
      cuda::rmsnorm(act, dx.get(), dy.get(), dw.as<float>(), rows, n, 1e-20f, dc.as<uint8_t>(), ds.as<float>(),
                    nullptr);
      std::vector<float> y = download_act(dy, x.size(), act);
      std::vector<float> want(x.size());
      twin::rmsnorm_rows(act == Act::BF16, x.data(), want.data(), w.data(), rows, n, 1e-20f);
      const double ulp = act == Act::BF16 ? 1.0 / 128 : 1.2e-7;
      EXPECT_LE(count_far(y, want, 0.0, ulp, "rmsnorm"), 0u);
      EXPECT_LE(count_bit_diff(y, want), x.size() / 200 + 2) << "rmsnorm bit differences";
      // QA8 of what the kernel stored: bit-exact
      std::vector<uint8_t> codes(x.size());
      std::vector<float> scales(x.size() / 32);
      cpu::qa8_codes(y.data(), static_cast<int64_t>(y.size()), 32, codes.data(), scales.data());
      EXPECT_EQ(download_vec<uint8_t>(dc, x.size()), codes) << "QA8 codes";
      EXPECT_EQ(count_bit_diff(download_vec<float>(ds, scales.size()), scales), 0u) << "QA8 scales";
      // in place, unweighted
      cuda::rmsnorm(act, dx.get(), dx.get(), nullptr, rows, n, 1e-20f, nullptr, nullptr, nullptr);
      std::vector<float> y2 = download_act(dx, x.size(), act);
      twin::rmsnorm_rows(act == Act::BF16, x.data(), want.data(), nullptr, rows, n, 1e-20f);
      EXPECT_LE(count_far(y2, want, 0.0, ulp, "rmsnorm unweighted"), 0u);
    }
}

TEST(CudaElementwise, Qa8Rows) {
  SKIP_WITHOUT_GPU();
  Rng rng(14);
  for (Act act : {Act::F32, Act::BF16}) {
    std::vector<float> x = act_values(quant_inputs(5 * 1280 / 32, 32, rng), act);
    DeviceBuffer dx = upload_act(x, act), dc(x.size()), ds(x.size() / 32 * 4);
    cuda::qa8_rows(act, dx.get(), 5, 1280, dc.as<uint8_t>(), ds.as<float>(), nullptr);
    std::vector<uint8_t> codes(x.size());
    std::vector<float> scales(x.size() / 32);
    cpu::qa8_codes(x.data(), static_cast<int64_t>(x.size()), 32, codes.data(), scales.data());
    EXPECT_EQ(download_vec<uint8_t>(dc, x.size()), codes);
    EXPECT_EQ(count_bit_diff(download_vec<float>(ds, scales.size()), scales), 0u);
  }
}

TEST(CudaElementwise, RopeForwardInverse) {
  SKIP_WITHOUT_GPU();
  Rng rng(15);
  struct Shape {
    int heads, hd, np;
  };
  for (Act act : {Act::F32, Act::BF16})
    for (Shape sh : {Shape{4, 64, 8}, Shape{64, 512, 32}, Shape{32, 128, 32}})
      for (int64_t p0 : {int64_t{0}, int64_t{77}, int64_t{299990}})
        for (bool inverse : {false, true}) {
          const int rows = 5;
          std::vector<float> x = act_values(randn(static_cast<size_t>(rows) * sh.heads * sh.hd, rng), act);
          std::vector<float> f = rope_table(sh.np, 160000.0);
          DeviceBuffer dx = upload_act(x, act), df = upload_vec(f), dp = upload_pos(p0);
          cuda::rope(act, dx.get(), rows, sh.heads, sh.hd, sh.np, df.as<float>(), dp.as<int64_t>(), inverse, nullptr);
          std::vector<float> got = download_act(dx, x.size(), act);
          twin::rope_rows(act == Act::BF16, x.data(), rows, sh.heads, sh.hd, sh.np, f.data(), p0, inverse);
          const double ulp = act == Act::BF16 ? 1.0 / 128 : 2.4e-7;
          EXPECT_LE(count_far(got, x, 1e-6, ulp, "rope"), 0u);
          EXPECT_LE(count_bit_diff(got, x), x.size() / 1000 + 2) << "rope bit differences";
        }
}

TEST(CudaElementwise, RopeFq4e8IndexQueries) {
  SKIP_WITHOUT_GPU();
  Rng rng(16);
  struct Shape {
    int heads, hd, np;
  };
  for (Act act : {Act::F32, Act::BF16})
    for (Shape sh : {Shape{8, 32, 8}, Shape{32, 128, 32}}) {
      const int rows = 6;
      const int64_t p0 = 1234;
      std::vector<float> x = act_values(randn(static_cast<size_t>(rows) * sh.heads * sh.hd, rng, 2.0f), act);
      std::vector<float> f = rope_table(sh.np, 160000.0);
      DeviceBuffer dx = upload_act(x, act), df = upload_vec(f), dp = upload_pos(p0), dy(x.size() * 4);
      cuda::rope_fq4e8(act, dx.get(), dy.as<float>(), rows, sh.heads, sh.hd, sh.np, df.as<float>(), dp.as<int64_t>(),
                       nullptr);
      std::vector<float> want(x.size());
      twin::rope_fq4e8(act == Act::BF16, x.data(), want.data(), rows, sh.heads, sh.hd, sh.np, f.data(), p0);
      expect_quantized_close(download_vec<float>(dy, x.size()), want, 32, 1e-3, 0.67, "rope_fq4e8");
    }
}

TEST(CudaElementwise, WindowKvFinish) {
  SKIP_WITHOUT_GPU();
  Rng rng(17);
  for (Act act : {Act::F32, Act::BF16})
    for (int hd : {64, 512}) {
      const int rows = 9, np = hd / 16;
      const int64_t p0 = 4097;
      std::vector<float> kv = act_values(randn(static_cast<size_t>(rows) * hd, rng, 4.0f), act);
      std::vector<float> w = randn(static_cast<size_t>(hd), rng, 0.3f);
      for (auto& v : w) v = round_bf16(1.0f + v);
      std::vector<float> f = rope_table(np, 10000.0);
      DeviceBuffer dkv = upload_act(kv, act), dw = upload_vec(w), df = upload_vec(f), dp = upload_pos(p0);
      DeviceBuffer dc(static_cast<size_t>(rows) * hd), ds(static_cast<size_t>(rows) * hd / 32), dv(kv.size() * 4);
      cuda::Fq8Rows out{dc.as<uint8_t>(), ds.as<uint8_t>(), hd};
      cuda::kv_finish(act, dkv.get(), dw.as<float>(), 1e-20f, rows, hd, np, df.as<float>(), dp.as<int64_t>(), out,
                      nullptr);
      cuda::dequant_fq8_rows(out, rows, dv.as<float>(), nullptr);
      std::vector<float> want(kv.size());
      twin::kv_finish(act == Act::BF16, kv.data(), w.data(), 1e-20f, rows, hd, np, f.data(), p0, want.data());
      expect_quantized_close(download_vec<float>(dv, kv.size()), want, 32, 2e-3, 0.15, "kv_finish");
    }
}

// ------------------------------------------------------------------------------------------
// A CPU state's snapshot (KVState::save packs its f32 values into the compact sections)
// streamed into a DeviceKVCache and back out is the same byte stream, and the CPU state
// restored from the device's stream equals the original bit for bit.
TEST(CudaKvCache, SnapshotStreamsExact) {
  SKIP_WITHOUT_GPU();
  Rng rng(21);
  KVGeometry g;
  g.n_layers = 5;
  g.window = 16;
  g.rollback_depth = 4;
  g.head_dim = 64;
  g.idx_dim = 32;
  g.source_ratio = {0, 0, 2, 0, 1};
  const int64_t max_ctx = 200;
  KVState st;
  st.pos = 77;
  st.rollback_depth = g.rollback_depth;
  st.windows.resize(5);
  st.caches.resize(5);
  for (int64_t i = 0; i < st.pos; ++i) st.tokens.push_back(static_cast<int32_t>(3 + i));
  for (int l = 0; l < 5; ++l) {
    auto& r = st.windows[static_cast<size_t>(l)];
    r.cap = g.window_cap();
    r.dim = g.head_dim;
    r.rows = fq8_rows(randn(static_cast<size_t>(r.cap) * r.dim, rng), r.dim);
    std::fill(r.rows.begin(), r.rows.begin() + r.dim, 0.0f);  // an unwritten slot
    const int ratio = g.source_ratio[static_cast<size_t>(l)];
    if (ratio > 0) {
      auto& c = st.caches[static_cast<size_t>(l)];
      c.ratio = ratio;
      c.dim = g.head_dim;
      c.idx_dim = g.idx_dim;
      c.n = st.pos / ratio;
      c.rows = fq4e4_rows(randn(static_cast<size_t>(c.n) * c.dim, rng, 5.0f), c.dim);
      c.keys = fq4e8_rows(randn(static_cast<size_t>(c.n) * c.idx_dim, rng, 0.1f), c.idx_dim);
      c.proj_cap = g.proj_cap(l);
      c.proj_kv = randn(static_cast<size_t>(c.proj_cap) * c.dim, rng);
      c.proj_gate = randn(static_cast<size_t>(c.proj_cap) * c.dim, rng);
    }
  }
  ASSERT_TRUE(geometry_of(st) == g);
  VectorSink cpu;
  {
    SnapshotWriter w(cpu, "{}");
    st.save(w);
    w.finish();
  }
  cuda::Pinned<uint8_t> stage(1 << 12);  // (small: several pieces per section)
  cuda::DeviceKVCache dev(g, max_ctx);
  std::vector<int32_t> tokens(static_cast<size_t>(st.pos));
  {
    SpanSource src(cpu.bytes);
    SnapshotReader r(src);
    r.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, tokens.size() * 4, "tokens");
    r.read(tokens.data(), tokens.size() * 4);
    dev.restore(r, st.pos, stage.data(), stage.size(), nullptr);
    r.finish();
  }
  int64_t pos = 0;
  DSX_CUDA_CHECK(cudaMemcpy(&pos, dev.d_pos(), 8, cudaMemcpyDeviceToHost));
  EXPECT_EQ(pos, 77);
  VectorSink gpu;
  {
    SnapshotWriter w(gpu, "{}");
    w.begin(static_cast<uint32_t>(SectionTag::kTokens), kNoLayer, tokens.size() * 4);
    w.write(tokens.data(), tokens.size() * 4);
    dev.save(w, st.pos, stage.data(), stage.size(), nullptr);
    w.finish();
  }
  EXPECT_EQ(gpu.bytes, cpu.bytes);
  KVState back = st;
  back.reset();
  {
    SpanSource src(gpu.bytes);
    SnapshotReader r(src);
    back.restore(r, 77);
  }
  EXPECT_EQ(back.pos, 77);
  for (int l = 0; l < 5; ++l) {
    EXPECT_EQ(count_bit_diff(back.windows[l].rows, st.windows[l].rows), 0u) << "window " << l;
    const auto &a = back.caches[l], &b = st.caches[l];
    EXPECT_EQ(a.n, b.n);
    EXPECT_EQ(count_bit_diff(a.rows, b.rows), 0u) << "rows " << l;
    EXPECT_EQ(count_bit_diff(a.keys, b.keys), 0u) << "keys " << l;
    EXPECT_EQ(count_bit_diff(a.proj_kv, b.proj_kv), 0u) << "proj_kv " << l;
    EXPECT_EQ(count_bit_diff(a.proj_gate, b.proj_gate), 0u) << "proj_gate " << l;
  }
}

TEST(CudaKvCache, WindowAndProjectionStore) {
  SKIP_WITHOUT_GPU();
  Rng rng(22);
  const int hd = 64, cap = 20;
  for (int T : {1, 7, 45}) {
    const int64_t p0 = 33;
    std::vector<float> ring = fq8_rows(randn(static_cast<size_t>(cap) * hd, rng), hd);
    std::vector<float> chunk = fq8_rows(randn(static_cast<size_t>(T) * hd, rng), hd);
    std::vector<uint8_t> rc(ring.size()), rs(ring.size() / 32), cc(chunk.size()), cs(chunk.size() / 32);
    pack_fq8_rows(ring.data(), cap, hd, rc.data(), rs.data());
    pack_fq8_rows(chunk.data(), T, hd, cc.data(), cs.data());
    DeviceBuffer drc = upload_vec(rc), drs = upload_vec(rs), dcc = upload_vec(cc), dcs = upload_vec(cs);
    DeviceBuffer dp = upload_pos(p0);
    cuda::window_store({dcc.as<uint8_t>(), dcs.as<uint8_t>(), hd}, T, {drc.as<uint8_t>(), drs.as<uint8_t>(), hd}, cap,
                       dp.as<int64_t>(), nullptr);
    std::vector<float> got(ring.size());
    unpack_fq8_rows(download_vec<uint8_t>(drc, rc.size()).data(), download_vec<uint8_t>(drs, rs.size()).data(),
                          cap, hd, got.data());
    std::vector<float> want = ring;
    for (int i = std::max(0, T - cap); i < T; ++i)
      std::copy(chunk.begin() + static_cast<int64_t>(i) * hd, chunk.begin() + static_cast<int64_t>(i + 1) * hd,
                want.begin() + ((p0 + i) % cap) * hd);
    EXPECT_EQ(count_bit_diff(got, want), 0u) << "window_store T=" << T;

    // projection rings
    const int pcap = 6;
    std::vector<float> pk = randn(static_cast<size_t>(pcap) * hd, rng), pg = randn(static_cast<size_t>(pcap) * hd, rng);
    std::vector<float> kv = randn(static_cast<size_t>(T) * hd, rng), gt = randn(static_cast<size_t>(T) * hd, rng);
    DeviceBuffer dpk = upload_vec(pk), dpg = upload_vec(pg), dkv = upload_vec(kv), dgt = upload_vec(gt);
    cuda::proj_store(dkv.as<float>(), dgt.as<float>(), T, hd, dpk.as<float>(), dpg.as<float>(), pcap,
                     dp.as<int64_t>(), nullptr);
    for (int i = std::max(0, T - pcap); i < T; ++i) {
      std::copy(kv.begin() + static_cast<int64_t>(i) * hd, kv.begin() + static_cast<int64_t>(i + 1) * hd,
                pk.begin() + ((p0 + i) % pcap) * hd);
      std::copy(gt.begin() + static_cast<int64_t>(i) * hd, gt.begin() + static_cast<int64_t>(i + 1) * hd,
                pg.begin() + ((p0 + i) % pcap) * hd);
    }
    EXPECT_EQ(count_bit_diff(download_vec<float>(dpk, pk.size()), pk), 0u) << "proj kv T=" << T;
    EXPECT_EQ(count_bit_diff(download_vec<float>(dpg, pg.size()), pg), 0u) << "proj gate T=" << T;
  }
}

// ------------------------------------------------------------------------------------------
TEST(CudaHc, PassAndFinish) {
  SKIP_WITHOUT_GPU();
  Rng rng(31);
  for (Act act : {Act::F32, Act::BF16})
    for (int64_t D : {int64_t{256}, int64_t{5120}})
      for (int T : {1, 3, 40}) {
        const bool bf = act == Act::BF16;
        const int64_t F = 4 * D;
        std::vector<float> X = act_values(randn(static_cast<size_t>(T * F), rng), act);
        std::vector<float> y = act_values(randn(static_cast<size_t>(T * D), rng, 0.5f), act);
        std::vector<float> post(static_cast<size_t>(T) * 4), comb(static_cast<size_t>(T) * 16),
            pre(static_cast<size_t>(T) * 4);
        std::uniform_real_distribution<float> ud(0.0f, 1.0f);
        for (auto& v : post) v = 2.0f * ud(rng);
        for (auto& v : comb) v = ud(rng) * 0.5f;
        for (auto& v : pre) v = ud(rng);
        std::vector<float> fn = randn(static_cast<size_t>(24 * F), rng, 0.01f);
        std::vector<float> base = randn(24, rng, 0.5f), scale = {0.7f, 0.9f, 1.3f};
        std::vector<float> nw = randn(static_cast<size_t>(D), rng, 0.2f);
        for (auto& v : nw) v = round_bf16(1.0f + v);

        DeviceBuffer dX = upload_act(X, act), dy = upload_act(y, act), dpost = upload_vec(post),
                     dcomb = upload_vec(comb), dpre = upload_vec(pre), dfn = upload_vec(fn), dbase = upload_vec(base),
                     dscale = upload_vec(scale), dnw = upload_vec(nw);
        DeviceBuffer dcol(static_cast<size_t>(T * D) * cuda::act_bytes(act)), dwork(cuda::hc_work_bytes(T, D));
        DeviceBuffer dpre_o(static_cast<size_t>(T) * 16), dpost_o(static_cast<size_t>(T) * 16),
            dcomb_o(static_cast<size_t>(T) * 64), dnorm(static_cast<size_t>(T * D) * cuda::act_bytes(act)),
            dqc(static_cast<size_t>(T * D)), dqs(static_cast<size_t>(T * D / 32) * 4);
        cuda::HcPassArgs pa;
        pa.T = T;
        pa.D = D;
        pa.X = dX.get();
        pa.y = dy.get();
        pa.post = dpost.as<float>();
        pa.comb = dcomb.as<float>();
        pa.fn = dfn.as<float>();
        pa.pre = dpre.as<float>();
        pa.collapsed = dcol.get();
        pa.work = dwork.get();
        cuda::hc_pass(act, pa, nullptr);
        cuda::HcFinishArgs fa;
        fa.T = T;
        fa.D = D;
        fa.work = dwork.get();
        fa.have_mix = true;
        fa.base = dbase.as<float>();
        fa.scale = dscale.as<float>();
        fa.pre = dpre_o.as<float>();
        fa.post = dpost_o.as<float>();
        fa.comb = dcomb_o.as<float>();
        fa.collapsed = dcol.get();
        fa.norm_w = dnw.as<float>();
        fa.norm_out = dnorm.get();
        fa.q_codes = dqc.as<uint8_t>();
        fa.q_scales = dqs.as<float>();
        const int64_t sw = 2 * cuda::staged_act_words(D);
        DeviceBuffer dst(static_cast<size_t>(sw) * 4);
        DSX_CUDA_CHECK(cudaMemset(dst.get(), 0, static_cast<size_t>(sw) * 4));
        if (T == 1) fa.staged = dst.as<uint32_t>();
        cuda::hc_finish(act, fa, nullptr);

        // twin: expand, hc_mix of the new streams, collapse with pre, RMSNorm
        std::vector<float> Xw = X;
        twin::hc_expand(bf, Xw.data(), y.data(), post.data(), comb.data(), T, D);
        std::vector<float> pre_w(static_cast<size_t>(T) * 4), post_w(static_cast<size_t>(T) * 4),
            comb_w(static_cast<size_t>(T) * 16), col_w(static_cast<size_t>(T * D)), norm_w(static_cast<size_t>(T * D));
        twin::hc_mix(Xw.data(), T, D, fn.data(), base.data(), scale.data(), 1e-20f, 1e-6f, 20, pre_w.data(),
                     post_w.data(), comb_w.data());
        twin::hc_collapse(bf, Xw.data(), pre.data(), T, D, col_w.data());
        twin::rmsnorm_rows(bf, col_w.data(), norm_w.data(), nw.data(), T, static_cast<int>(D), 1e-20f);

        const double ulp = bf ? 1.0 / 128 : 2.4e-7;
        EXPECT_LE(count_far(download_act(dX, Xw.size(), act), Xw, 0.0, ulp, "hc expand"), 0u);
        EXPECT_LE(count_far(download_act(dcol, col_w.size(), act), col_w, 0.0, ulp, "hc collapse"), 0u);
        EXPECT_LE(count_far(download_vec<float>(dpre_o, pre_w.size()), pre_w, 1e-6, 1e-4, "hc pre"), 0u);
        EXPECT_LE(count_far(download_vec<float>(dpost_o, post_w.size()), post_w, 1e-6, 1e-4, "hc post"), 0u);
        EXPECT_LE(count_far(download_vec<float>(dcomb_o, comb_w.size()), comb_w, 1e-6, 1e-4, "hc comb"), 0u);
        std::vector<float> ng = download_act(dnorm, norm_w.size(), act);
        EXPECT_LE(count_far(ng, norm_w, 1e-6, bf ? 1.0 / 64 : 1e-5, "hc norm"), 0u);
        std::vector<uint8_t> codes(ng.size());
        std::vector<float> qs(ng.size() / 32);
        cpu::qa8_codes(ng.data(), static_cast<int64_t>(ng.size()), 32, codes.data(), qs.data());
        EXPECT_EQ(download_vec<uint8_t>(dqc, codes.size()), codes) << "hc norm QA8";
        if (T == 1)  // the QA8 codes staged for the one-token consumers, in their B orders
          EXPECT_EQ(download_vec<uint32_t>(dst, static_cast<size_t>(sw)), staged_act_ref(ng)) << "hc norm staged";

        // the split passes of the engine (Engram layers, final fold): expand only, then
        // collapse only + norm only, in place, without QA8
        {
          DeviceBuffer dX2 = upload_act(X, act), dcol2(static_cast<size_t>(T * D) * cuda::act_bytes(act)),
                       dwork2(cuda::hc_work_bytes(T, D));
          cuda::HcPassArgs e;
          e.T = T;
          e.D = D;
          e.X = dX2.get();
          e.y = dy.get();
          e.post = dpost.as<float>();
          e.comb = dcomb.as<float>();
          e.work = dwork2.get();
          cuda::hc_pass(act, e, nullptr);
          cuda::HcPassArgs c;
          c.T = T;
          c.D = D;
          c.X = dX2.get();
          c.pre = dpre.as<float>();
          c.collapsed = dcol2.get();
          c.work = dwork2.get();
          cuda::hc_pass(act, c, nullptr);
          cuda::HcFinishArgs f;
          f.T = T;
          f.D = D;
          f.work = dwork2.get();
          f.norm_eps = 1e-20f;
          f.collapsed = dcol2.get();
          f.norm_w = dnw.as<float>();
          f.norm_out = dcol2.get();
          cuda::hc_finish(act, f, nullptr);
          EXPECT_LE(count_far(download_act(dX2, Xw.size(), act), Xw, 0.0, ulp, "hc expand only"), 0u);
          EXPECT_LE(count_far(download_act(dcol2, norm_w.size(), act), norm_w, 1e-6, bf ? 1.0 / 64 : 1e-5, "hc norm only"),
                    0u);
        }

        // stream mean
        DeviceBuffer dmean(static_cast<size_t>(T * D) * cuda::act_bytes(act));
        cuda::hc_stream_mean(act, T, D, dX.get(), dmean.get(), nullptr);
        std::vector<float> Xg = download_act(dX, Xw.size(), act), mean_w(static_cast<size_t>(T * D));
        for (int t = 0; t < T; ++t)
          for (int64_t d = 0; d < D; ++d) {
            float s = 0;
            for (int m = 0; m < 4; ++m) s += Xg[static_cast<size_t>((t * 4 + m) * D + d)];
            mean_w[static_cast<size_t>(t * D + d)] = twin::rnd(bf, s * 0.25f);
          }
        EXPECT_EQ(count_bit_diff(download_act(dmean, mean_w.size(), act), mean_w), 0u) << "stream mean";
      }
}

// ------------------------------------------------------------------------------------------
// The Sinkhorn branch's signal (signal_device.cuh): the next pass, launched on another
// stream with no dependency on the mix, must wait in the kernel for the mix's signal.
// The side stream is held by a host function that sleeps, the mix outputs start as NaN,
// and the pass must give bit for bit what it gives ordered on one stream; twice on the
// same slot, which must be back at rest (zero) after each consumer.
namespace {
void CUDART_CB sleep_host(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(150)); }
}  // namespace

TEST(CudaHc, SignalJoinsTheMixAcrossStreams) {
  SKIP_WITHOUT_GPU();
  Rng rng(37);
  cudaStream_t main_st = nullptr, side_st = nullptr;
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&main_st, cudaStreamNonBlocking));
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&side_st, cudaStreamNonBlocking));
  DeviceBuffer slot(64);
  DSX_CUDA_CHECK(cudaMemset(slot.get(), 0, 64));
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  for (Act act : {Act::F32, Act::BF16})
    for (int T : {1, 3}) {
      const int64_t D = 5120, F = 4 * D;
      std::vector<float> X = act_values(randn(static_cast<size_t>(T * F), rng), act);
      std::vector<float> y = act_values(randn(static_cast<size_t>(T * D), rng, 0.5f), act);
      std::vector<float> fn = randn(static_cast<size_t>(24 * F), rng, 0.01f);
      std::vector<float> base = randn(24, rng, 0.5f), scale = {0.7f, 0.9f, 1.3f};
      DeviceBuffer dy = upload_act(y, act), dfn = upload_vec(fn), dbase = upload_vec(base), dscale = upload_vec(scale);
      // run 0: ordered on one stream (reference); runs 1, 2: mix on the side stream behind
      // a sleep, signalled; the pass on the main stream, waiting for the signal
      std::vector<float> ref_X, ref_col;
      for (int run = 0; run < 3; ++run) {
        DeviceBuffer dX = upload_act(X, act), dcol(static_cast<size_t>(T * D) * cuda::act_bytes(act)),
            dwork(cuda::hc_work_bytes(T, D));
        DeviceBuffer dpre(static_cast<size_t>(T) * 16), dpost(static_cast<size_t>(T) * 16), dcomb(static_cast<size_t>(T) * 64);
        for (DeviceBuffer* b : {&dpre, &dpost, &dcomb}) DSX_CUDA_CHECK(cudaMemset(b->get(), 0xff, b->size()));  // NaN
        DSX_CUDA_CHECK(cudaDeviceSynchronize());  // (the memsets ran on the legacy stream)
        cuda::HcPassArgs p1;  // partials of the mix of X
        p1.T = T, p1.D = D, p1.X = dX.get(), p1.fn = dfn.as<float>(), p1.work = dwork.get();
        cuda::hc_pass(act, p1, main_st);
        DSX_CUDA_CHECK(cudaStreamSynchronize(main_st));
        cuda::HcFinishArgs mix;
        mix.T = T, mix.D = D, mix.work = dwork.get(), mix.have_mix = true, mix.base = dbase.as<float>();
        mix.scale = dscale.as<float>(), mix.norm_eps = 1e-20f;
        mix.pre = dpre.as<float>(), mix.post = dpost.as<float>(), mix.comb = dcomb.as<float>();
        cuda::HcPassArgs p2;  // expand with the mix's post / comb, mix partials again, collapse with its pre
        p2.T = T, p2.D = D, p2.X = dX.get(), p2.y = dy.get(), p2.post = dpost.as<float>(), p2.comb = dcomb.as<float>();
        p2.fn = dfn.as<float>(), p2.pre = dpre.as<float>(), p2.collapsed = dcol.get(), p2.work = dwork.get();
        if (run == 0) {
          cuda::hc_finish(act, mix, main_st);
          cuda::hc_pass(act, p2, main_st);
        } else {
          DSX_CUDA_CHECK(cudaLaunchHostFunc(side_st, sleep_host, nullptr));
          mix.signal = slot.as<unsigned>();
          cuda::hc_finish(act, mix, side_st);
          p2.wait_signal = slot.as<unsigned>();
          p2.inputs_ready = true;  // (X: complete; post / comb / pre: behind the signal)
          cuda::hc_pass(act, p2, main_st);
        }
        DSX_CUDA_CHECK(cudaStreamSynchronize(main_st));
        DSX_CUDA_CHECK(cudaStreamSynchronize(side_st));
        std::vector<float> gX = download_act(dX, static_cast<size_t>(T * F), act);
        std::vector<float> gcol = download_act(dcol, static_cast<size_t>(T * D), act);
        for (float v : gcol) ASSERT_TRUE(std::isfinite(v)) << "run " << run << ": the pass read the mix before it was written";
        if (run == 0) {
          ref_X = gX, ref_col = gcol;
        } else {
          EXPECT_EQ(count_bit_diff(gX, ref_X), 0u) << "expand, run " << run;
          EXPECT_EQ(count_bit_diff(gcol, ref_col), 0u) << "collapse, run " << run;
          EXPECT_EQ(download_vec<uint32_t>(slot, 2), (std::vector<uint32_t>{0, 0})) << "slot at rest, run " << run;
        }
      }
    }
  cudaStreamDestroy(main_st);
  cudaStreamDestroy(side_st);
}

// ------------------------------------------------------------------------------------------
TEST(CudaEngram, GatherAndGate) {
  SKIP_WITHOUT_GPU();
  Rng rng(41);
  for (Act act : {Act::F32, Act::BF16})
    for (int dim : {32, 256}) {
      const bool bf = act == Act::BF16;
      const int64_t R = 1000;
      std::uniform_int_distribution<int> byte(0, 255), sbyte(110, 135);
      std::vector<uint8_t> table(static_cast<size_t>(R * dim)), tscale(static_cast<size_t>(R * dim / 32));
      for (auto& b : table) {
        b = static_cast<uint8_t>(byte(rng));
        if ((b & 0x7f) == 0x7f) b = 0;  // no NaN codes
      }
      for (auto& b : tscale) b = static_cast<uint8_t>(sbyte(rng));
      const int T = 3, nc = 24, n = T * nc;
      std::vector<int64_t> ids(static_cast<size_t>(n));
      std::uniform_int_distribution<int64_t> rid(0, R - 1);
      for (auto& i : ids) i = rid(rng);
      DeviceBuffer dt = upload_vec(table), dts = upload_vec(tscale), dids = upload_vec(ids);
      DeviceBuffer du(static_cast<size_t>(n) * dim * cuda::act_bytes(act)), dqc(static_cast<size_t>(n) * dim),
          dqs(static_cast<size_t>(n) * dim / 32 * 4);
      cuda::engram_gather(act, dt.as<uint8_t>(), dts.as<uint8_t>(), dim, dids.as<int64_t>(), n, du.get(),
                          dqc.as<uint8_t>(), dqs.as<float>(), nullptr);
      std::vector<float> want(static_cast<size_t>(n) * dim);
      for (int i = 0; i < n; ++i)
        for (int j = 0; j < dim; ++j)
          want[static_cast<size_t>(i) * dim + j] =
              e4m3_to_f32(table[static_cast<size_t>(ids[static_cast<size_t>(i)] * dim + j)]) *
              e8m0_to_f32(tscale[static_cast<size_t>(ids[static_cast<size_t>(i)] * (dim / 32) + j / 32)]);
      EXPECT_EQ(count_bit_diff(download_act(du, want.size(), act), want), 0u) << "engram gather";
      std::vector<uint8_t> codes(want.size());
      std::vector<float> qs(want.size() / 32);
      cpu::qa8_codes(want.data(), static_cast<int64_t>(want.size()), 32, codes.data(), qs.data());
      EXPECT_EQ(download_vec<uint8_t>(dqc, codes.size()), codes) << "engram gather QA8";
      EXPECT_EQ(count_bit_diff(download_vec<float>(dqs, qs.size()), qs), 0u) << "engram gather QA8 scales";
    }
  for (Act act : {Act::F32, Act::BF16})
    for (int64_t D : {int64_t{256}, int64_t{5120}}) {
      const bool bf = act == Act::BF16;
      const int T = 3, M = 4;
      std::vector<float> yE = act_values(randn(static_cast<size_t>(T * (M + 1) * D), rng), act);
      std::vector<float> X = act_values(randn(static_cast<size_t>(T * M * D), rng, 2.0f), act);
      std::vector<float> w = randn(static_cast<size_t>(M * D), rng);
      DeviceBuffer dyE = upload_act(yE, act), dX = upload_act(X, act), dw = upload_vec(w);
      const std::vector<float> X0 = X;
      cuda::engram_gate(act, T, M, D, dyE.get(), dX.get(), dw.as<float>(), 1e-20f, nullptr);
      twin::engram_gate(bf, T, M, D, yE.data(), X.data(), w.data(), 1e-20f);
      const std::vector<float> got = download_act(dX, X.size(), act);
      // The gate g = sigmoid(sign(d) sqrt(|d|)) of the normalised dot d = (sum h w k) r D^-1/2
      // amplifies the f32 summation error of d (bounded by ~sqrt(D) eps sum|h w k|, any
      // order) by dg/dd = sigmoid' / (2 sqrt|d|): each element may differ by that times
      // |v|, plus rounding of the update itself.
      size_t bad = 0;
      for (int t = 0; t < T; ++t)
        for (int m = 0; m < M; ++m) {
          double hh = 0, kk = 0, dot = 0, mag = 0;
          const float* h = X0.data() + (static_cast<int64_t>(t) * M + m) * D;
          const float* k = yE.data() + static_cast<int64_t>(t) * (M + 1) * D + m * D;
          const float* v = yE.data() + static_cast<int64_t>(t) * (M + 1) * D + M * D;
          for (int64_t i = 0; i < D; ++i) {
            const double p = static_cast<double>(h[i]) * w[static_cast<size_t>(m * D + i)] * k[i];
            hh += static_cast<double>(h[i]) * h[i];
            kk += static_cast<double>(k[i]) * k[i];
            dot += p;
            mag += std::fabs(p);
          }
          const double scale = 1.0 / std::sqrt(hh / D) / std::sqrt(kk / D) / std::sqrt(static_cast<double>(D));
          const double d = dot * scale;
          const double dd = 8.0 * std::sqrt(static_cast<double>(D)) * 0x1p-24 * mag * scale;  // f32 sum error bound
          const double z = std::sqrt(std::max(std::fabs(d), 1e-6));
          const double sg = 1.0 / (1.0 + std::exp(-z));
          const double dg = sg * (1 - sg) * dd / (2 * std::max(z, 1e-3)) + 4 * 0x1p-24;
          for (int64_t i = 0; i < D; ++i) {
            const size_t e = static_cast<size_t>((static_cast<int64_t>(t) * M + m) * D + i);
            const double tol = dg * std::fabs(v[i]) + (bf ? 1.0 / 128 : 4 * 0x1p-24) * std::fabs(X[e]) + 1e-7;
            if (f32_bits(got[e]) != f32_bits(X[e]) && !(std::fabs(static_cast<double>(got[e]) - X[e]) <= tol)) {
              if (bad++ < 5) ADD_FAILURE() << "engram gate: element " << e << " got " << got[e] << " want " << X[e] << " tol " << tol;
            }
          }
        }
      EXPECT_EQ(bad, 0u) << "engram gate, D " << D << (bf ? " bf16" : " f32");
    }
}

// The device argmax against the host one (runtime/sampler.h) on rows with ties, signed
// zeros, infinities and NaNs, strided rows, and a vocabulary-sized row.
TEST(CudaArgmax, MatchesHostArgmax) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(41);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float specials[6] = {nan, inf, -inf, -nan, 0.0f, -0.0f};
  // ld = n + 3: most rows unaligned (scalar loop); ld = n rounded up to 4: every row
  // 16-byte aligned (vector loop plus the scalar tail when n % 4 != 0)
  for (int64_t pad : {int64_t{3}, int64_t{-1}})
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{4099}, int64_t{129280}}) {
    const int rows = 6;
    const int64_t ld = pad >= 0 ? n + pad : (n + 3) / 4 * 4;
    std::vector<float> x(static_cast<size_t>(rows * ld), 0.0f);
    for (int r = 0; r < rows; ++r) {
      const int levels = 1 + r;  // few levels: many ties
      for (int64_t i = 0; i < n; ++i) x[r * ld + i] = static_cast<float>(static_cast<int>(rng() % levels));
      for (int k = 0; k < r; ++k) x[r * ld + static_cast<int64_t>(rng() % n)] = specials[rng() % 6];
    }
    if (n > 1) x[5 * ld + 0] = nan;  // a NaN at index 0
    DeviceBuffer dx(x.size() * 4), dout(rows * 4);
    dx.upload(x.data(), x.size() * 4);
    cuda::argmax_rows(dx.as<float>(), ld, rows, n, dout.as<int32_t>(), nullptr);
    std::vector<int32_t> got(rows);
    dout.download(got.data(), rows * 4);
    for (int r = 0; r < rows; ++r) EXPECT_EQ(got[r], argmax(x.data() + r * ld, n)) << "n " << n << " row " << r;
    // each row alone (one aligned row of >= 8192: the many-block kernel, twice so that
    // the second call finds its counter reset)
    // the second time also into pinned host memory (the copy destination)
    int32_t* host = nullptr;
    ASSERT_EQ(cudaMallocHost(&host, 4), cudaSuccess);
    for (int rep = 0; rep < 2; ++rep)
      for (int r = 0; r < rows; ++r) {
        *host = -7;
        cuda::argmax_rows(dx.as<float>() + r * ld, ld, 1, n, dout.as<int32_t>(), nullptr, rep ? host : nullptr);
        int32_t one = -1;
        dout.download(&one, 4);
        EXPECT_EQ(one, argmax(x.data() + r * ld, n)) << "one row, n " << n << " row " << r;
        EXPECT_EQ(*host, rep ? one : -7) << "copy destination, n " << n << " row " << r;
      }
    cudaFreeHost(host);
  }
}

#endif  // DSX_HAVE_CUDA
