// Engram hashing against the spec's test vectors (model-v41.md §3.2.2, §7.2) and
// the multipliers recorded in the golden case.json.
#include <gtest/gtest.h>

#include "model/config.h"
#include "model/engram.h"

using namespace dsx;

TEST(EngramHash, NumpyMultipliersRelease) {
  const int64_t bound = (INT64_MAX / 99092) / 2;
  EXPECT_EQ(bound, 46539438283891);
  auto m1 = numpy_default_rng_integers(10007ull * 1, bound, 4);
  std::vector<int64_t> want1 = {76632096046245, 4839876093313, 35959672319349, 73987337458391};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(2 * m1[i] + 1, want1[i]) << i;
  auto m14 = numpy_default_rng_integers(10007ull * 14, bound, 4);
  std::vector<int64_t> want14 = {67716810739261, 51510806800915, 30921347202721, 82619226485591};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(2 * m14[i] + 1, want14[i]) << i;
  // golden deepseek_v41_tiny case.json: engram layer 5
  auto m5 = numpy_default_rng_integers(10007ull * 5, bound, 4);
  std::vector<int64_t> want5 = {36401653271009, 30950899899463, 20366576194259, 65906527672909};
  for (int i = 0; i < 4; ++i) EXPECT_EQ(2 * m5[i] + 1, want5[i]) << i;
}

static ModelConfig tiny_spec_config() {
  ModelConfig c;
  c.engram_layers = {1, 4};
  c.engram_num_embeddings = {6126, 6332};
  c.engram_max_ngram = 4;
  c.engram_vocab_size = 1000;
  c.engram_n_heads = 2;
  c.engram_head_dim = 32;
  c.engram_compressed_vocab = 512;
  return c;
}

TEST(EngramHash, TinySpecVectors) {
  auto L = EngramLayout::build(tiny_spec_config(), 2);
  EXPECT_EQ(L.multipliers[0], (std::vector<int64_t>{14831304026200453, 936705081716061, 6959601268494069, 14319439928568407}));
  EXPECT_EQ(L.multipliers[1], (std::vector<int64_t>{15920565596405625, 975009545214551, 14254820516660309, 3668506406680991}));
  EXPECT_EQ(L.primes[0], (std::vector<int64_t>{1009, 1013, 1019, 1021, 1031, 1033}));
  EXPECT_EQ(L.offsets[1], (std::vector<int64_t>{0, 1039, 2088, 3139, 4200, 5263}));
  const int32_t hist[4] = {5, 17, 42, 99};
  int64_t r[6];
  auto check = [&](int layer, int t, std::vector<int64_t> want) {
    L.row_ids(layer, hist, 0, t, r);
    EXPECT_EQ(std::vector<int64_t>(r, r + 6), want) << "layer " << layer << " t " << t;
  };
  check(0, 0, {149, 1158, 2160, 3333, 4528, 5904});
  check(0, 1, {743, 1062, 2303, 3703, 4076, 5814});
  check(0, 3, {919, 1048, 2159, 3627, 4523, 5434});
  check(1, 0, {359, 1451, 2321, 3645, 4240, 5824});
  check(1, 1, {324, 1546, 2185, 3797, 4496, 5479});
  check(1, 3, {538, 1718, 2779, 3749, 4981, 5449});
}

TEST(EngramHash, ReleaseVectors) {
  ModelConfig c;
  c.engram_layers = {1, 14};
  c.engram_num_embeddings = {384006168, 384016682};
  c.engram_max_ngram = 4;
  c.engram_vocab_size = 16000000;
  c.engram_n_heads = 8;
  c.engram_head_dim = 256;
  c.engram_compressed_vocab = 99092;
  auto L = EngramLayout::build(c, 7);  // the spec's placeholder pad_c
  const int32_t hist[4] = {1000, 2000, 3000, 4000};
  int64_t r[24];
  L.row_ids(0, hist, 0, 0, r);
  EXPECT_EQ(std::vector<int64_t>(r, r + 24),
            (std::vector<int64_t>{4551967, 30678283, 47613307, 55179107, 66815303, 86770828, 104763035, 114472427,
                                  142068703, 150463205, 175466452, 190576665, 197400306, 208941805, 234416144,
                                  250808253, 261625816, 275278555, 299946076, 304312112, 328568696, 348971217,
                                  356020045, 373563906}));
  L.row_ids(0, hist, 0, 3, r);
  EXPECT_EQ(std::vector<int64_t>(r, r + 24),
            (std::vector<int64_t>{15465977, 28790835, 32971381, 50776212, 70685234, 88308810, 97180690, 115458442,
                                  130437439, 147954272, 164404239, 187601822, 193743686, 213368287, 235496802,
                                  240837074, 261497777, 281534125, 295127654, 310093209, 325466156, 340619041,
                                  353861828, 370049875}));
  L.row_ids(1, hist, 0, 3, r);
  EXPECT_EQ(std::vector<int64_t>(r, r + 24),
            (std::vector<int64_t>{531236, 19249339, 45052628, 57007057, 71010245, 82245460, 99433893, 116549208,
                                  136118722, 154953410, 173178409, 178921715, 199111094, 209268856, 237367362,
                                  252206497, 257108840, 284056046, 289026701, 314018640, 331002487, 337033192,
                                  356038043, 371061263}));
}

TEST(EngramHash, PrimeSumMismatchIsAnError) {
  auto c = tiny_spec_config();
  c.engram_num_embeddings[1] = 6333;
  EXPECT_THROW(EngramLayout::build(c, 2), std::exception);
}
