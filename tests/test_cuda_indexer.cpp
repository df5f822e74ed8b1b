// Non-GEMM CUDA kernels, part 2: compressor (chunked, with the pending half-group
// carried in device state), indexer scores (plain and candidate-restricted), candidate
// blocks and the radix top-k — each against its CPU twin (twin_attn.h, mirroring
// V41Cpu) — plus a timed micro-benchmark at 300k compressed rows.
//
// Tolerances: top-k / block scores are compared bit-exactly given identical input
// scores (each stage is fed the GPU's previous output). Scores: the dot products of
// FQ4e8 values are exact in f32 whatever the order (products and partial sums have few
// significant bits), so F32 and BF16 scores are expected bit-identical; we allow rare
// one-ulp differences. Compressed rows / keys: reduction order of the norms and of the
// wk product can move a fake-quantized element by one code step in rare cases.
#ifdef DSX_HAVE_CUDA
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "model/cpu/quant.h"
#include "model/kv_formats.h"
#include "kernels/cpu/twin_attn.h"
#include "kernels/cuda/compressor.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/kv_cache.h"
#include "kernels/cuda/topk.h"
#include "cuda_test_util.h"
#include "util/numerics.h"

using namespace dsx;
using namespace dsx_test;  // also Act, DeviceBuffer
namespace twin = dsx::cpu::twin;

namespace {

void set_pos(DeviceBuffer& b, int64_t p) { b.upload(&p, 8); }

// Random FQ4e8 key rows, as values and packed.
struct Keys {
  std::vector<float> vals;
  std::vector<uint8_t> packed, scales;
  DeviceBuffer dp, ds;
  cuda::Fq4e8Rows view(int dim) { return {dp.as<uint8_t>(), ds.as<uint8_t>(), dim}; }
};
Keys make_keys(int64_t n, int dim, Rng& rng) {
  Keys k;
  k.vals = randn(static_cast<size_t>(n) * dim, rng, 0.5f);
  for (int64_t r = 0; r < n; ++r) cpu::fq4_e8_inplace(k.vals.data() + r * dim, dim, 32);
  k.packed.resize(static_cast<size_t>(n) * dim / 2);
  k.scales.resize(static_cast<size_t>(n) * dim / 32);
  pack_fq4e8_rows(k.vals.data(), n, dim, k.packed.data(), k.scales.data());
  k.dp = upload_vec(k.packed);
  k.ds = upload_vec(k.scales);
  return k;
}
std::vector<float> make_queries(int T, int H, int hd, Rng& rng) {
  std::vector<float> q = randn(static_cast<size_t>(T) * H * hd, rng);
  for (int64_t v = 0; v < static_cast<int64_t>(T) * H; ++v) cpu::fq4_e8_inplace(q.data() + v * hd, hd, 32);
  return q;
}

}  // namespace

// ------------------------------------------------------------------------------------------
TEST(CudaCompressor, ChunkedMatchesOneShotTwin) {
  SKIP_WITHOUT_GPU();
  Rng rng(51);
  struct Shape {
    int hd, idx, np;
  };
  const std::vector<int> chunks = {7, 1, 1, 13, 1, 14};
  const int P = std::accumulate(chunks.begin(), chunks.end(), 0);
  for (Act act : {Act::F32, Act::BF16})
    for (Shape sh : {Shape{64, 32, 8}, Shape{512, 128, 32}})
      for (int ratio : {2, 1}) {
        const bool bf = act == Act::BF16;
        const int hd = sh.hd, idx = sh.idx, np = sh.np, rollback = 16;
        std::vector<float> kv_all = randn(static_cast<size_t>(P) * hd, rng, 2.0f);
        std::vector<float> gate_all = randn(static_cast<size_t>(P) * hd, rng, 1.5f);
        if (ratio == 1) kv_all = act_values(kv_all, act);
        std::vector<float> norm = randn(static_cast<size_t>(hd), rng, 0.2f), k_norm = randn(static_cast<size_t>(idx), rng, 0.2f);
        for (auto& v : norm) v = round_bf16(1.0f + v);
        for (auto& v : k_norm) v = round_bf16(1.0f + v);
        std::vector<float> wk = randn(static_cast<size_t>(idx) * hd, rng, 0.05f);
        std::vector<uint16_t> wk_bits(wk.size());
        for (size_t i = 0; i < wk.size(); ++i) {
          wk_bits[i] = f32_to_bf16(wk[i]);
          wk[i] = bf16_to_f32(wk_bits[i]);
        }
        std::vector<float> freq = rope_table(np, 160000.0);

        const int64_t nrows = P / ratio;
        const int pcap = ratio + rollback;
        DeviceBuffer drp(static_cast<size_t>(P) * hd / 2), drs(static_cast<size_t>(P) * hd / 16),
            dkp(static_cast<size_t>(P) * idx / 2), dks(static_cast<size_t>(P) * idx / 32),
            dpk(static_cast<size_t>(pcap) * hd * 4), dpg(static_cast<size_t>(pcap) * hd * 4), dpos(8);
        dpk.zero();
        dpg.zero();
        DeviceBuffer dnorm = upload_vec(norm), dknorm = upload_vec(k_norm), dwk = upload_vec(wk_bits),
                     dfreq = upload_vec(freq);
        int64_t p0 = 0;
        for (int T : chunks) {
          set_pos(dpos, p0);
          std::vector<float> kv(kv_all.begin() + p0 * hd, kv_all.begin() + (p0 + T) * hd);
          std::vector<float> gt(gate_all.begin() + p0 * hd, gate_all.begin() + (p0 + T) * hd);
          DeviceBuffer dkv = upload_vec(kv), dgt = upload_vec(gt), dkva = upload_act(kv, act);
          const int maxg = cuda::compressor_max_groups(T, ratio);
          DeviceBuffer dlat(static_cast<size_t>(maxg) * hd * cuda::act_bytes(act));
          cuda::CompressorArgs a;
          a.T = T;
          a.ratio = ratio;
          a.head_dim = hd;
          a.idx_dim = idx;
          a.n_pairs = np;
          a.eps = 1e-20f;
          if (ratio > 1) {
            a.kv = dkv.as<float>();
            a.gate = dgt.as<float>();
            a.proj_kv = dpk.as<float>();
            a.proj_gate = dpg.as<float>();
            a.proj_cap = pcap;
          } else {
            a.kv_act = dkva.get();
          }
          a.norm = dnorm.as<float>();
          a.inv_freq = dfreq.as<float>();
          a.wk = dwk.as<uint16_t>();
          a.k_norm = dknorm.as<float>();
          a.rows = {drp.as<uint8_t>(), drs.as<uint8_t>(), hd};
          a.keys = {dkp.as<uint8_t>(), dks.as<uint8_t>(), idx};
          a.latents = dlat.get();
          a.d_pos = dpos.as<int64_t>();
          cuda::compressor_emit(act, a, nullptr);
          if (ratio > 1)
            cuda::proj_store(dkv.as<float>(), dgt.as<float>(), T, hd, dpk.as<float>(), dpg.as<float>(), pcap,
                             dpos.as<int64_t>(), nullptr);
          // latents of this chunk's groups
          auto w = twin::compressor(
              bf, ratio, hd, idx, np, 1e-20f, p0, T, [&](int64_t pos) { return kv_all.data() + pos * hd; },
              [&](int64_t pos) { return gate_all.data() + pos * hd; }, norm.data(), freq.data(), wk.data(),
              k_norm.data());
          const size_t ng = w.latents.size() / hd;
          EXPECT_EQ(w.first_group, p0 / ratio);
          std::vector<float> lat = download_act(dlat, ng * hd, act);
          EXPECT_LE(count_far(lat, w.latents, 1e-6, bf ? 1.0 / 128 : 1e-5, "compressor latents"), 0u)
              << "chunk at " << p0 << " ratio " << ratio;
          p0 += T;
        }
        // every row / key against a one-shot twin
        auto w = twin::compressor(
            bf, ratio, hd, idx, np, 1e-20f, 0, P, [&](int64_t pos) { return kv_all.data() + pos * hd; },
            [&](int64_t pos) { return gate_all.data() + pos * hd; }, norm.data(), freq.data(), wk.data(),
            k_norm.data());
        ASSERT_EQ(static_cast<int64_t>(w.rows.size()), nrows * hd);
        std::vector<float> rows(static_cast<size_t>(nrows) * hd), keys(static_cast<size_t>(nrows) * idx);
        unpack_fq4e4_rows(download_vec<uint8_t>(drp, rows.size() / 2).data(),
                                download_vec<uint8_t>(drs, rows.size() / 16).data(), nrows, hd, rows.data());
        unpack_fq4e8_rows(download_vec<uint8_t>(dkp, keys.size() / 2).data(),
                                download_vec<uint8_t>(dks, keys.size() / 32).data(), nrows, idx, keys.data());
        expect_quantized_close(rows, w.rows, 16, 5e-3, 0.67, "compressed rows");
        expect_quantized_close(keys, w.keys, 32, 5e-3, 0.67, "index keys");
      }
}

// ------------------------------------------------------------------------------------------
TEST(CudaIndexer, ScoresMatchTwin) {
  SKIP_WITHOUT_GPU();
  Rng rng(52);
  struct Shape {
    int H, hd;
  };
  // n = 70000: more rows than the short-list launch takes (up to 8 x 64 x SMs rows on a
  // 132-SM device), so the 128 x 2 blocks run too; n = 1000 with 5 queries (heads split
  // over 4 threads per row) and 20 (one thread per row); 37 and 64 queries: prefill
  // chunks, in BF16 mode with 16 / 32 heads the tensor-core kernel (4 queries per block:
  // 37 leaves a partial one), n = 5000 its blocks of 1024 rows in chunks of 64
  for (int64_t n : {int64_t{1000}, int64_t{5000}, int64_t{70000}})
  for (Act act : {Act::F32, Act::BF16})
    for (Shape sh : {Shape{8, 32}, Shape{16, 64}, Shape{32, 128}})
      for (int ratio : {1, 2})
      for (int T : {1, 5, 20, 37, 64}) {
        if (n == 70000 && (sh.H != 32 || ratio != 1 || T != 1)) continue;
        if (n == 5000 && (sh.H != 32 || T != 37)) continue;
        if (n == 1000 && T == 1) continue;
        const bool bf = act == Act::BF16;
        const int bs = 4;
        const int64_t p0 = ratio * n - T - 3;
        Keys keys = make_keys(n, sh.hd, rng);
        std::vector<float> q = make_queries(T, sh.H, sh.hd, rng);
        std::vector<float> w = act_values(randn(static_cast<size_t>(T) * sh.H, rng), act);
        DeviceBuffer dq = upload_vec(q), dw = upload_act(w, act), dpos(8);
        set_pos(dpos, p0);
        DeviceBuffer dsc(static_cast<size_t>(T) * n * 4), dcnt(static_cast<size_t>(T) * 4);
        cuda::IndexerScoreArgs a;
        a.T = T;
        a.n_heads = sh.H;
        a.head_dim = sh.hd;
        a.ratio = ratio;
        a.q = dq.as<float>();
        a.w = dw.get();
        a.keys = keys.view(sh.hd);
        a.max_rows = n;
        a.scores = dsc.as<float>();
        a.ld = n;
        a.counts = dcnt.as<int32_t>();
        a.d_pos = dpos.as<int64_t>();
        cuda::indexer_scores(act, a, nullptr);
        std::vector<std::vector<float>> want;
        twin::indexer_scores(bf, T, sh.H, sh.hd, ratio, p0, q.data(), w.data(), keys.vals.data(), nullptr, 1, want);
        std::vector<float> all = download_vec<float>(dsc, static_cast<size_t>(T) * n);
        std::vector<int32_t> cnt = download_vec<int32_t>(dcnt, T);
        for (int t = 0; t < T; ++t) {
          ASSERT_EQ(cnt[static_cast<size_t>(t)], static_cast<int32_t>(want[static_cast<size_t>(t)].size()));
          std::vector<float> got(all.begin() + t * n, all.begin() + t * n + cnt[static_cast<size_t>(t)]);
          EXPECT_LE(count_far(got, want[static_cast<size_t>(t)], 1e-7, bf ? 1.0 / 128 : 1e-6, "scores"), 0u);
          EXPECT_LE(count_bit_diff(got, want[static_cast<size_t>(t)]), got.size() / 500 + 1) << "scores bits";
        }
        // candidate-restricted scoring (ascending block lists incl. the newest block)
        std::vector<std::vector<int32_t>> cand(static_cast<size_t>(T));
        const int max_blocks = 6;
        std::vector<int32_t> flat(static_cast<size_t>(T) * max_blocks, -1), ccount(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) {
          const int64_t nv = (p0 + t + 1) / ratio;
          const int32_t newest = static_cast<int32_t>((nv - 1) / bs);
          std::set<int32_t> s{newest};
          std::uniform_int_distribution<int32_t> bd(0, newest);
          while (static_cast<int>(s.size()) < max_blocks) s.insert(bd(rng));
          cand[static_cast<size_t>(t)].assign(s.begin(), s.end());
          std::copy(s.begin(), s.end(), flat.begin() + t * max_blocks);
          ccount[static_cast<size_t>(t)] = static_cast<int32_t>(s.size());
        }
        DeviceBuffer dcand = upload_vec(flat), dccount = upload_vec(ccount);
        a.cand_blocks = dcand.as<int32_t>();
        a.cand_ld = max_blocks;
        a.cand_count = dccount.as<int32_t>();
        a.cand_block_size = bs;
        a.max_rows = max_blocks * bs;
        a.ld = max_blocks * bs;
        cuda::indexer_scores(act, a, nullptr);
        twin::indexer_scores(bf, T, sh.H, sh.hd, ratio, p0, q.data(), w.data(), keys.vals.data(), &cand, bs, want);
        all = download_vec<float>(dsc, static_cast<size_t>(T) * max_blocks * bs);
        cnt = download_vec<int32_t>(dcnt, T);
        for (int t = 0; t < T; ++t) {
          ASSERT_EQ(cnt[static_cast<size_t>(t)], static_cast<int32_t>(want[static_cast<size_t>(t)].size()));
          std::vector<float> got(all.begin() + t * max_blocks * bs,
                                 all.begin() + t * max_blocks * bs + cnt[static_cast<size_t>(t)]);
          EXPECT_LE(count_far(got, want[static_cast<size_t>(t)], 1e-7, bf ? 1.0 / 128 : 1e-6, "cand scores"), 0u);
        }
      }
}

// ------------------------------------------------------------------------------------------
TEST(CudaTopk, MatchesCpuTopkFinite) {
  SKIP_WITHOUT_GPU();
  Rng rng(53);
  std::printf("[          ] topk uses %s\n", cuda::topk_uses_clusters() ? "8-CTA clusters" : "one CTA per query");
  // n <= 16384: the one-CTA register kernel; larger: the general (cluster) kernel
  for (int64_t n : {int64_t{1}, int64_t{5}, int64_t{100}, int64_t{3000}, int64_t{8192}, int64_t{16384}, int64_t{40000},
                    int64_t{300000}})
    for (int k : {1, 8, 512, 2048})
      for (int style = 0; style < 4; ++style) {
        const int T = 3;
        std::vector<float> s(static_cast<size_t>(T) * n);
        std::uniform_int_distribution<int> lvl(0, 40), pick(0, 99);
        std::normal_distribution<float> nd(0.0f, 1.0f);
        for (auto& v : s) {
          if (style == 0) v = nd(rng);                                   // distinct
          else if (style == 1) v = round_bf16(static_cast<float>(lvl(rng)) * 0.125f);  // heavy ties
          else if (style == 2) {                                           // ties, -inf, +inf, -0, NaN
            const int p = pick(rng);
            v = p < 20 ? -INFINITY : p < 22 ? INFINITY : p < 30 ? -0.0f : p < 31 ? NAN : round_bf16(nd(rng));
          } else {                                                         // one value, -inf, NaN
            const int p = pick(rng);
            v = p < 10 ? -INFINITY : p < 12 ? NAN : 0.75f;
          }
        }
        std::vector<int32_t> counts(static_cast<size_t>(T));
        for (int t = 0; t < T; ++t) counts[static_cast<size_t>(t)] = static_cast<int32_t>(std::max<int64_t>(0, n - t));
        DeviceBuffer ds = upload_vec(s), dc = upload_vec(counts), dout(static_cast<size_t>(T) * k * 4),
                     dcnt(static_cast<size_t>(T) * 4);
        cuda::topk_select(T, ds.as<float>(), n, dc.as<int32_t>(), k, nullptr, 0, 1, dout.as<int32_t>(), k,
                          dcnt.as<int32_t>(), nullptr);
        std::vector<int32_t> out = download_vec<int32_t>(dout, static_cast<size_t>(T) * k);
        std::vector<int32_t> oc = download_vec<int32_t>(dcnt, T);
        for (int t = 0; t < T; ++t) {
          std::vector<int32_t> want = twin::topk_finite(s.data() + t * n, counts[static_cast<size_t>(t)], k);
          ASSERT_EQ(oc[static_cast<size_t>(t)], static_cast<int32_t>(want.size())) << "n=" << n << " k=" << k;
          std::vector<int32_t> got(out.begin() + t * k, out.begin() + t * k + oc[static_cast<size_t>(t)]);
          EXPECT_EQ(got, want) << "n=" << n << " k=" << k << " style=" << style << " t=" << t;
        }
      }
  // id mapping through candidate blocks
  {
    const int T = 2, bs = 8, nb = 50, k = 16;
    std::vector<float> s(static_cast<size_t>(T) * nb * bs);
    for (auto& v : s) v = round_bf16(static_cast<float>(rng() % 7));
    std::vector<int32_t> blocks(static_cast<size_t>(T) * nb), counts(static_cast<size_t>(T), nb * bs);
    for (int t = 0; t < T; ++t)
      for (int b = 0; b < nb; ++b) blocks[static_cast<size_t>(t * nb + b)] = 3 * b + t;
    DeviceBuffer ds = upload_vec(s), dc = upload_vec(counts), db = upload_vec(blocks),
                 dout(static_cast<size_t>(T) * k * 4), dcnt(static_cast<size_t>(T) * 4);
    cuda::topk_select(T, ds.as<float>(), nb * bs, dc.as<int32_t>(), k, db.as<int32_t>(), nb, bs, dout.as<int32_t>(), k,
                      dcnt.as<int32_t>(), nullptr);
    std::vector<int32_t> out = download_vec<int32_t>(dout, static_cast<size_t>(T) * k);
    for (int t = 0; t < T; ++t) {
      std::vector<int32_t> pos = twin::topk_finite(s.data() + t * nb * bs, nb * bs, k);
      for (size_t i = 0; i < pos.size(); ++i)
        EXPECT_EQ(out[static_cast<size_t>(t) * k + i], blocks[static_cast<size_t>(t * nb + pos[i] / bs)] * bs + pos[i] % bs);
    }
  }
}

// ------------------------------------------------------------------------------------------
// The candidate-source / re-index chain, each stage fed the GPU's previous output.
TEST(CudaIndexer, CandidatePipeline) {
  SKIP_WITHOUT_GPU();
  Rng rng(54);
  for (Act act : {Act::F32, Act::BF16}) {
    const bool bf = act == Act::BF16;
    const int T = 4, H = 8, hd = 32, bs = 4, cand_k = 6, top_k = 8;
    const int64_t n = 160, p0 = n - T;  // ratio 1
    Keys keys = make_keys(n, hd, rng);
    std::vector<float> q = make_queries(T, H, hd, rng);
    std::vector<float> w = act_values(randn(static_cast<size_t>(T) * H, rng), act);
    DeviceBuffer dq = upload_vec(q), dw = upload_act(w, act), dpos(8);
    set_pos(dpos, p0);
    DeviceBuffer dsc(static_cast<size_t>(T) * n * 4), dcnt(static_cast<size_t>(T) * 4);
    cuda::IndexerScoreArgs a;
    a.T = T;
    a.n_heads = H;
    a.head_dim = hd;
    a.ratio = 1;
    a.q = dq.as<float>();
    a.w = dw.get();
    a.keys = keys.view(hd);
    a.max_rows = n;
    a.scores = dsc.as<float>();
    a.ld = n;
    a.counts = dcnt.as<int32_t>();
    a.d_pos = dpos.as<int64_t>();
    cuda::indexer_scores(act, a, nullptr);
    const int64_t nbmax = (n + bs - 1) / bs;
    DeviceBuffer dbs(static_cast<size_t>(T) * nbmax * 4), dbcnt(static_cast<size_t>(T) * 4),
        dcand(static_cast<size_t>(T) * cand_k * 4), dccnt(static_cast<size_t>(T) * 4);
    cuda::block_scores(T, dsc.as<float>(), n, dcnt.as<int32_t>(), bs, dbs.as<float>(), nbmax, dbcnt.as<int32_t>(), nbmax,
                       nullptr);
    cuda::topk_select(T, dbs.as<float>(), nbmax, dbcnt.as<int32_t>(), cand_k, nullptr, 0, 1, dcand.as<int32_t>(), cand_k,
                      dccnt.as<int32_t>(), nullptr);
    // own selection of the candidate source
    DeviceBuffer dsel(static_cast<size_t>(T) * top_k * 4), dscnt(static_cast<size_t>(T) * 4);
    cuda::topk_select(T, dsc.as<float>(), n, dcnt.as<int32_t>(), top_k, nullptr, 0, 1, dsel.as<int32_t>(), top_k,
                      dscnt.as<int32_t>(), nullptr);

    std::vector<float> sc = download_vec<float>(dsc, static_cast<size_t>(T) * n);
    std::vector<int32_t> cnt = download_vec<int32_t>(dcnt, T), bcnt = download_vec<int32_t>(dbcnt, T),
                         ccnt = download_vec<int32_t>(dccnt, T), cand = download_vec<int32_t>(dcand, static_cast<size_t>(T) * cand_k),
                         sel = download_vec<int32_t>(dsel, static_cast<size_t>(T) * top_k),
                         scnt = download_vec<int32_t>(dscnt, T);
    std::vector<float> bsc = download_vec<float>(dbs, static_cast<size_t>(T) * nbmax);
    std::vector<std::vector<int32_t>> cand_lists(static_cast<size_t>(T));
    for (int t = 0; t < T; ++t) {
      std::vector<float> st(sc.begin() + t * n, sc.begin() + t * n + cnt[static_cast<size_t>(t)]);
      std::vector<float> bw = twin::block_scores(st, bs);
      ASSERT_EQ(bcnt[static_cast<size_t>(t)], static_cast<int32_t>(bw.size()));
      std::vector<float> bg(bsc.begin() + t * nbmax, bsc.begin() + t * nbmax + bcnt[static_cast<size_t>(t)]);
      EXPECT_EQ(count_bit_diff(bg, bw), 0u) << "block scores";
      std::vector<int32_t> kept = twin::topk_finite(bw.data(), static_cast<int64_t>(bw.size()), cand_k);
      std::vector<int32_t> gk(cand.begin() + t * cand_k, cand.begin() + t * cand_k + ccnt[static_cast<size_t>(t)]);
      EXPECT_EQ(gk, kept) << "candidate blocks";
      cand_lists[static_cast<size_t>(t)] = gk;
      std::vector<int32_t> sw = twin::topk_finite(st.data(), static_cast<int64_t>(st.size()), top_k);
      std::vector<int32_t> sg(sel.begin() + t * top_k, sel.begin() + t * top_k + scnt[static_cast<size_t>(t)]);
      EXPECT_EQ(sg, sw) << "candidate source selection";
    }
    // re-index layer: other queries / weights, scores restricted to the candidates
    std::vector<float> q2 = make_queries(T, H, hd, rng);
    std::vector<float> w2 = act_values(randn(static_cast<size_t>(T) * H, rng), act);
    DeviceBuffer dq2 = upload_vec(q2), dw2 = upload_act(w2, act);
    DeviceBuffer dcs(static_cast<size_t>(T) * cand_k * bs * 4), dccount2(static_cast<size_t>(T) * 4);
    a.q = dq2.as<float>();
    a.w = dw2.get();
    a.cand_blocks = dcand.as<int32_t>();
    a.cand_ld = cand_k;
    a.cand_count = dccnt.as<int32_t>();
    a.cand_block_size = bs;
    a.max_rows = cand_k * bs;
    a.scores = dcs.as<float>();
    a.ld = cand_k * bs;
    a.counts = dccount2.as<int32_t>();
    cuda::indexer_scores(act, a, nullptr);
    cuda::topk_select(T, dcs.as<float>(), cand_k * bs, dccount2.as<int32_t>(), top_k, dcand.as<int32_t>(), cand_k, bs,
                      dsel.as<int32_t>(), top_k, dscnt.as<int32_t>(), nullptr);
    std::vector<std::vector<float>> want;
    twin::indexer_scores(bf, T, H, hd, 1, p0, q2.data(), w2.data(), keys.vals.data(), &cand_lists, bs, want);
    std::vector<float> cs = download_vec<float>(dcs, static_cast<size_t>(T) * cand_k * bs);
    std::vector<int32_t> c2 = download_vec<int32_t>(dccount2, T);
    sel = download_vec<int32_t>(dsel, static_cast<size_t>(T) * top_k);
    scnt = download_vec<int32_t>(dscnt, T);
    for (int t = 0; t < T; ++t) {
      ASSERT_EQ(c2[static_cast<size_t>(t)], static_cast<int32_t>(want[static_cast<size_t>(t)].size()));
      std::vector<float> got(cs.begin() + t * cand_k * bs, cs.begin() + t * cand_k * bs + c2[static_cast<size_t>(t)]);
      EXPECT_LE(count_far(got, want[static_cast<size_t>(t)], 1e-7, bf ? 1.0 / 128 : 1e-6, "re-index scores"), 0u);
      // selection from the GPU scores, mapped to rows
      std::vector<int32_t> pos = twin::topk_finite(got.data(), static_cast<int64_t>(got.size()), top_k);
      std::vector<int32_t> rows;
      for (int32_t i : pos) rows.push_back(cand_lists[static_cast<size_t>(t)][static_cast<size_t>(i / bs)] * bs + i % bs);
      std::vector<int32_t> sg(sel.begin() + t * top_k, sel.begin() + t * top_k + scnt[static_cast<size_t>(t)]);
      EXPECT_EQ(sg, rows) << "re-index selection";
    }
  }
}

// ------------------------------------------------------------------------------------------
// Timed print only: one decode query against 300k compressed rows at the release shape.
TEST(CudaIndexer, Benchmark300k) {
  SKIP_WITHOUT_GPU();
  Rng rng(55);
  const int H = 32, hd = 128, bs = 8, cand_blocks = 2048, top_k = 512;
  const int64_t n = 300000;
  Keys keys = make_keys(n, hd, rng);
  std::vector<float> q = make_queries(1, H, hd, rng);
  std::vector<float> w = act_values(randn(H, rng), Act::BF16);
  DeviceBuffer dq = upload_vec(q), dw = upload_act(w, Act::BF16), dpos(8);
  set_pos(dpos, n - 1);
  const int64_t nb = (n + bs - 1) / bs;
  DeviceBuffer dsc(static_cast<size_t>(n) * 4), dcnt(4), dbs(static_cast<size_t>(nb) * 4), dbcnt(4),
      dcand(cand_blocks * 4), dccnt(4), dsel(top_k * 4), dscnt(4), dcs(static_cast<size_t>(cand_blocks) * bs * 4),
      dc2(4);
  cuda::IndexerScoreArgs a;
  a.T = 1;
  a.n_heads = H;
  a.head_dim = hd;
  a.ratio = 1;
  a.q = dq.as<float>();
  a.w = dw.get();
  a.keys = keys.view(hd);
  a.max_rows = n;
  a.scores = dsc.as<float>();
  a.ld = n;
  a.counts = dcnt.as<int32_t>();
  a.d_pos = dpos.as<int64_t>();
  cuda::IndexerScoreArgs r = a;
  r.cand_blocks = dcand.as<int32_t>();
  r.cand_ld = cand_blocks;
  r.cand_count = dccnt.as<int32_t>();
  r.cand_block_size = bs;
  r.max_rows = static_cast<int64_t>(cand_blocks) * bs;
  r.scores = dcs.as<float>();
  r.ld = static_cast<int64_t>(cand_blocks) * bs;
  r.counts = dc2.as<int32_t>();

  cudaEvent_t e0, e1;
  DSX_CUDA_CHECK(cudaEventCreate(&e0));
  DSX_CUDA_CHECK(cudaEventCreate(&e1));
  auto time_us = [&](auto&& fn) {
    fn();  // warm-up
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    const int iters = 20;
    DSX_CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) fn();
    DSX_CUDA_CHECK(cudaEventRecord(e1));
    DSX_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return 1000.0 * ms / iters;
  };
  for (Act act : {Act::BF16, Act::F32}) {
    if (act == Act::F32) {
      DeviceBuffer tmp = upload_act(w, Act::F32);
      std::swap(dw, tmp);
      a.w = dw.get();
      r.w = dw.get();
    }
    const double t_score = time_us([&] { cuda::indexer_scores(act, a, nullptr); });
    const double t_block = time_us([&] {
      cuda::block_scores(1, dsc.as<float>(), n, dcnt.as<int32_t>(), bs, dbs.as<float>(), nb, dbcnt.as<int32_t>(), nb,
                         nullptr);
    });
    const double t_cand = time_us([&] {
      cuda::topk_select(1, dbs.as<float>(), nb, dbcnt.as<int32_t>(), cand_blocks, nullptr, 0, 1, dcand.as<int32_t>(),
                        cand_blocks, dccnt.as<int32_t>(), nullptr);
    });
    const double t_top = time_us([&] {
      cuda::topk_select(1, dsc.as<float>(), n, dcnt.as<int32_t>(), top_k, nullptr, 0, 1, dsel.as<int32_t>(), top_k,
                        dscnt.as<int32_t>(), nullptr);
    });
    const double t_rescore = time_us([&] { cuda::indexer_scores(act, r, nullptr); });
    const double t_retop = time_us([&] {
      cuda::topk_select(1, dcs.as<float>(), r.ld, dc2.as<int32_t>(), top_k, dcand.as<int32_t>(), cand_blocks, bs,
                        dsel.as<int32_t>(), top_k, dscnt.as<int32_t>(), nullptr);
    });
    std::printf(
        "[          ] indexer %s, 300k rows x %d heads x %d: scores %.1f us, block max %.1f us, top-%d blocks %.1f us, "
        "top-%d rows %.1f us | re-index over %d rows: scores %.1f us, top-%d %.1f us\n",
        cuda::act_name(act), H, hd, t_score, t_block, cand_blocks, t_cand, top_k, t_top, cand_blocks * bs, t_rescore,
        top_k, t_retop);
  }
  std::vector<int32_t> c = download_vec<int32_t>(dscnt, 1);
  EXPECT_EQ(c[0], top_k);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// The decode top-k (n = 8192, k = 512, the one-CTA kernel) on score rows of different
// shapes, checked against the twin and timed (print only): rows whose scores crowd a few
// histogram bins (the same shared-memory counters) take as long as spread ones (~12 us
// on the H200).
TEST(CudaTopk, BenchmarkDistributions) {
  SKIP_WITHOUT_GPU();
  Rng rng(57);
  const int k = 512;
  cudaEvent_t e0, e1;
  DSX_CUDA_CHECK(cudaEventCreate(&e0));
  DSX_CUDA_CHECK(cudaEventCreate(&e1));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_real_distribution<float> ud(0.0f, 1.0f);
  for (int64_t n : {int64_t{4096}, int64_t{8192}})
  for (int style = 0; style < 5; ++style) {
    std::vector<float> s(static_cast<size_t>(n));
    const char* name = "";
    for (auto& v : s) {
      switch (style) {
        case 0: v = nd(rng), name = "normal(0, 1)"; break;
        case 1: v = 5.0f + 0.01f * nd(rng), name = "normal(5, 0.01)"; break;
        case 2: v = 1.0f + ud(rng) / 256.0f, name = "1 + U(0, 1/256)"; break;
        case 3: v = static_cast<float>(rng() % 16), name = "16 levels"; break;
        default: v = std::fabs(nd(rng)) * 1e-3f + 100.0f, name = "100 + |N| 1e-3"; break;
      }
    }
    const int64_t nn = static_cast<int64_t>(s.size());
    std::vector<int32_t> cnt{static_cast<int32_t>(nn)};
    DeviceBuffer ds = upload_vec(s), dc = upload_vec(cnt), dout(k * 4), dcnt(4);
    auto run = [&] {
      cuda::topk_select(1, ds.as<float>(), nn, dc.as<int32_t>(), k, nullptr, 0, 1, dout.as<int32_t>(), k,
                        dcnt.as<int32_t>(), nullptr, nn);
    };
    run();
    DSX_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<int32_t> want = twin::topk_finite(s.data(), nn, k);
    std::vector<int32_t> got = download_vec<int32_t>(dout, want.size());
    EXPECT_EQ(got, want) << name;
    const int iters = 50;
    DSX_CUDA_CHECK(cudaEventRecord(e0));
    for (int i = 0; i < iters; ++i) run();
    DSX_CUDA_CHECK(cudaEventRecord(e1));
    DSX_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    std::printf("[          ] topk n=%lld k=%d scores %s: %.1f us\n", static_cast<long long>(nn), k, name,
                1000.0 * ms / iters);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

#endif  // DSX_HAVE_CUDA
