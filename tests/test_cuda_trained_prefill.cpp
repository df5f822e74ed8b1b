// Production precision on the trained model (assets/dsx-small-v41, issue 29): the chunked
// tensor-core prefill and the one-token decode path compute the same logits. Both run in
// bf16 (the production precision); each row's difference between them is measured
// against bf16's own error (bf16 prefill vs fp32 prefill of the same rows), which is the
// tolerance production precision has: a prefill kernel that computed something else (a
// wrong mask, a dropped expert, a misplaced chunk boundary) differs from the decode by
// far more than rounding does. Prints the figures (the issue asks for them reported).
#include <gtest/gtest.h>

#ifdef DSX_HAVE_CUDA
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "cli/golden_check.h"  // row_rel_l2
#include "kernels/cuda/cuda_util.h"
#include "runtime/engine.h"
#include "test_util.h"
#include "text/tokenizer.h"
#include "util/mmap_file.h"

using namespace dsx;

namespace {

const std::string kModel = dsx_test::source_dir() + "/assets/dsx-small-v41";

std::unique_ptr<Engine> engine(const char* precision, int64_t ctx) {
  EngineOptions o;
  o.backend = "cuda";
  o.precision = precision;
  o.max_context = ctx;
  return load_engine(kModel, o);
}

int64_t argmax(const float* a, int64_t n) { return std::max_element(a, a + n) - a; }

// Mean negative log-likelihood of ids[1..n) under rows 0 .. n-2.
double nll(const std::vector<float>& l, const std::vector<int32_t>& ids, int64_t V) {
  double s = 0;
  const int64_t n = static_cast<int64_t>(ids.size());
  for (int64_t i = 0; i + 1 < n; ++i) {
    const float* r = l.data() + i * V;
    const float m = *std::max_element(r, r + V);
    double z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(static_cast<double>(r[v]) - m);
    s += m + std::log(z) - r[ids[i + 1]];
  }
  return s / static_cast<double>(n - 1);
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

}  // namespace

TEST(CudaTrainedModel, Bf16PrefillMatchesOneTokenDecode) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  // Python the model never trained on (its data are Debian and npm packages): the
  // project's own training code, 1536 tokens past the window (128), the compressed
  // attention and the indexer's top-k (64 candidate rows).
  const text::Tokenizer tok = text::Tokenizer::from_model_dir(kModel);
  std::vector<int32_t> ids = {0};
  tok.encode_into(read_text_file(dsx_test::source_dir() + "/train/model.py"), false, ids);
  const int64_t n = 1536;
  ASSERT_GE(static_cast<int64_t>(ids.size()), n);
  ids.resize(n);

  auto bf16 = engine("bf16", n + 16);
  auto fp32 = engine("fp32", n + 16);
  const int64_t V = bf16->config().vocab_size;
  std::vector<float> pre(n * V), dec(n * V), ref(n * V);
  {
    auto s = bf16->new_session();
    s->feed(ids.data(), n, pre.data(), true);  // chunked prefill, logits of every row
  }
  {
    auto s = bf16->new_session();
    for (int64_t i = 0; i < n; ++i) s->feed(ids.data() + i, 1, dec.data() + i * V, false);
  }
  {
    auto s = fp32->new_session();
    s->feed(ids.data(), n, ref.data(), true);
  }

  std::vector<double> d_pd(n), d_prec(n);
  int64_t same_pd = 0, same_prec = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float* p = pre.data() + i * V;
    const float* d = dec.data() + i * V;
    const float* r = ref.data() + i * V;
    d_pd[i] = row_rel_l2(p, d, V);
    d_prec[i] = row_rel_l2(p, r, V);
    same_pd += argmax(p, V) == argmax(d, V);
    same_prec += argmax(p, V) == argmax(r, V);
  }
  const double nll_pre = nll(pre, ids, V), nll_dec = nll(dec, ids, V), nll_ref = nll(ref, ids, V);
  std::printf(
      "bf16 prefill vs bf16 one-token decode, %lld rows: rel-L2 median %.3g p90 %.3g max %.3g; argmax equal %lld\n"
      "bf16 prefill vs fp32 prefill (bf16's own error):  rel-L2 median %.3g p90 %.3g max %.3g; argmax equal %lld\n"
      "perplexity: bf16 prefill %.5f, bf16 decode %.5f, fp32 prefill %.5f\n",
      static_cast<long long>(n), quantile(d_pd, 0.5), quantile(d_pd, 0.9), quantile(d_pd, 1.0),
      static_cast<long long>(same_pd), quantile(d_prec, 0.5), quantile(d_prec, 0.9), quantile(d_prec, 1.0),
      static_cast<long long>(same_prec), std::exp(nll_pre), std::exp(nll_dec), std::exp(nll_ref));

  // Prefill and decode differ by no more than the production precision's own error.
  EXPECT_LE(quantile(d_pd, 0.5), quantile(d_prec, 0.5));
  EXPECT_LE(quantile(d_pd, 0.9), quantile(d_prec, 0.9));
  // Argmax flips are few and noisy (136 vs 121 of 1536 rows when first measured on the
  // H200): the decode may flip at most half again as many rows as the precision does; a
  // prefill that computed something else flips most of them.
  EXPECT_LE(2 * (n - same_pd), 3 * (n - same_prec));
  // Perplexity: the production bar (bf16 within 1 % of fp32) for prefill vs decode.
  EXPECT_LT(std::fabs(nll_pre - nll_dec), std::log(1.01));
}

#endif  // DSX_HAVE_CUDA
