// Session properties of the V4 CPU engine on a tiny random V4 model written by
// this test (official V4 layout: flat config.json, FP8 128x128 blocks, MXFP4
// experts, compressor ape, hash-routed layers): chunked prefill with odd chunk
// sizes crossing ratio-4 / ratio-8 / ratio-16 group boundaries and the window
// equals one-shot prefill; save/restore and rollback give identical
// continuations; malformed model directories and snapshots give clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "cli/golden_check.h"
#include "model/make_tiny_quant.h"
#include "model/v4_cpu.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "util/error.h"
#include "util/mmap_file.h"
#include "util/numerics.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

// What to vary in the generated directory (for the loader tests).
struct TinyV4Options {
  bool ape_bf16 = false;        // store compressor ape as BF16 instead of F32
  bool tid2eid_i32 = false;     // store tid2eid as I32 instead of I64
  std::string drop;             // leave this tensor out
  std::string bad_dtype;        // store this (F32) tensor as F64
  bool bad_tid2eid = false;     // an expert id out of range
  uint64_t seed = 11;
};

constexpr int kVocab = 512, kHidden = 256, kLayers = 5, kHeads = 2, kHeadDim = 128, kRope = 32, kQLora = 128;
constexpr int kOGroups = 2, kOLora = 64, kWindow = 8, kExperts = 8, kTopK = 2, kInter = 128;
constexpr int kIdxHeads = 4, kIdxDim = 64, kIdxTopK = 4, kHashLayers = 2, kBlock = 128;
const std::vector<int> kRatios = {0, 4, 8, 4, 16};  // 8 and 16 stand in for 128 (non-overlapping path)

class Gen {
 public:
  explicit Gen(uint64_t seed) : rng_(seed) {}
  float normal(float std) { return std::normal_distribution<float>(0.0f, std)(rng_); }
  int64_t below(int64_t n) { return std::uniform_int_distribution<int64_t>(0, n - 1)(rng_); }
  std::mt19937_64& rng() { return rng_; }

 private:
  std::mt19937_64 rng_;
};

struct Writer {
  SafetensorsWriter w;
  Gen g;
  const TinyV4Options& o;
  Writer(const TinyV4Options& opts) : g(opts.seed), o(opts) {}

  bool skip(const std::string& n) const { return n == o.drop; }
  // values rounded to bf16 so that F32 and BF16 storage hold the same numbers
  std::vector<float> values(int64_t n, float std, float mean) {
    std::vector<float> v(static_cast<size_t>(n));
    for (auto& x : v) x = round_bf16(mean + (std > 0 ? g.normal(std) : 0.0f));
    return v;
  }
  static int64_t numel(const std::vector<int64_t>& s) {
    int64_t n = 1;
    for (auto d : s) n *= d;
    return n;
  }
  void bf16(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f) {
    auto v = values(numel(shape), std, mean);
    std::vector<uint16_t> h(v.size());
    for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
    if (!skip(name)) w.add(name, DType::BF16, std::move(shape), h);
  }
  void f32(const std::string& name, std::vector<int64_t> shape, float std, float mean = 0.0f, bool as_bf16 = false) {
    auto v = values(numel(shape), std, mean);
    if (skip(name)) return;
    if (name == o.bad_dtype) {
      std::vector<double> d(v.begin(), v.end());
      w.add(name, DType::F64, std::move(shape), d);
    } else if (as_bf16) {
      std::vector<uint16_t> h(v.size());
      for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
      w.add(name, DType::BF16, std::move(shape), h);
    } else {
      w.add(name, DType::F32, std::move(shape), v);
    }
  }
  void quantized(const std::string& base, const QuantizedWeight& q) {
    if (!skip(base + ".weight")) w.add(base + ".weight", q.codes_dtype, q.codes_shape, q.codes);
    if (!skip(base + ".scale")) w.add(base + ".scale", DType::F8_E8M0, q.scales_shape, q.scales);
  }
  void fp8(const std::string& base, int64_t n, int64_t k, float std) {
    quantized(base, random_fp8(g.rng(), std, n, k, kBlock));
  }
  void mxfp4(const std::string& base, int64_t n, int64_t k, float std) {
    quantized(base, random_mxfp4(g.rng(), std, n, k));
  }
  void tid2eid(const std::string& name) {
    std::vector<int64_t> v(static_cast<size_t>(kVocab * kTopK));
    for (int64_t t = 0; t < kVocab; ++t) {
      const int64_t a = g.below(kExperts);
      v[t * kTopK] = a;
      v[t * kTopK + 1] = (a + 1 + g.below(kExperts - 1)) % kExperts;  // two distinct experts
    }
    if (o.bad_tid2eid) v[7 * kTopK + 1] = kExperts;
    if (skip(name)) return;
    if (o.tid2eid_i32) {
      std::vector<int32_t> v32(v.begin(), v.end());
      w.add(name, DType::I32, {kVocab, kTopK}, v32);
    } else {
      w.add(name, DType::I64, {kVocab, kTopK}, v);
    }
  }
};

void write_tiny_v4(const std::string& dir, const TinyV4Options& o) {
  std::filesystem::create_directories(dir);
  nlohmann::ordered_json c;
  c["architectures"] = {"DeepseekV4ForCausalLM"};
  c["model_type"] = "deepseek_v4";
  c["vocab_size"] = kVocab;
  c["hidden_size"] = kHidden;
  c["num_hidden_layers"] = kLayers;
  c["num_attention_heads"] = kHeads;
  c["num_key_value_heads"] = 1;
  c["head_dim"] = kHeadDim;
  c["qk_rope_head_dim"] = kRope;
  c["q_lora_rank"] = kQLora;
  c["o_groups"] = kOGroups;
  c["o_lora_rank"] = kOLora;
  c["sliding_window"] = kWindow;
  c["rms_norm_eps"] = 1e-6;
  c["rope_theta"] = 10000;
  c["compress_rope_theta"] = 160000;
  c["rope_scaling"] = {{"type", "yarn"}, {"factor", 16}, {"beta_fast", 32}, {"beta_slow", 1},
                       {"original_max_position_embeddings", 64}};
  c["max_position_embeddings"] = 1048576;
  c["compress_ratios"] = kRatios;
  c["num_hash_layers"] = kHashLayers;
  c["index_n_heads"] = kIdxHeads;
  c["index_head_dim"] = kIdxDim;
  c["index_topk"] = kIdxTopK;
  c["n_routed_experts"] = kExperts;
  c["num_experts_per_tok"] = kTopK;
  c["n_shared_experts"] = 1;
  c["moe_intermediate_size"] = kInter;
  c["scoring_func"] = "sqrtsoftplus";
  c["topk_method"] = "noaux_tc";
  c["norm_topk_prob"] = true;
  c["routed_scaling_factor"] = 1.5;
  c["swiglu_limit"] = 10.0;
  c["hc_mult"] = 4;
  c["hc_sinkhorn_iters"] = 20;
  c["hc_eps"] = 1e-6;
  c["hidden_act"] = "silu";
  c["expert_dtype"] = "fp4";
  c["num_nextn_predict_layers"] = 0;
  c["bos_token_id"] = 0;
  c["eos_token_id"] = 1;
  c["quantization_config"] = {{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                              {"scale_fmt", "ue8m0"}, {"weight_block_size", {kBlock, kBlock}}};
  const std::string text = c.dump(2) + "\n";

  Writer b(o);
  const int64_t D = kHidden, M = 4, mix = (2 + M) * M, H = kHeads, hd = kHeadDim;
  auto lin = [](int64_t k) { return 1.0f / std::sqrt(static_cast<float>(k)); };
  b.bf16("embed.weight", {kVocab, D}, 1.0f);
  b.bf16("head.weight", {kVocab, D}, lin(D));
  b.bf16("norm.weight", {D}, 0.0f, 1.0f);
  b.f32("hc_head_fn", {M, M * D}, 0.02f);
  b.f32("hc_head_base", {M}, 0.1f);
  b.f32("hc_head_scale", {1}, 0.0f, 1.0f);
  for (int l = 0; l < kLayers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const int r = kRatios[static_cast<size_t>(l)];
    b.bf16(p + "attn_norm.weight", {D}, 0.0f, 1.0f);
    b.bf16(p + "ffn_norm.weight", {D}, 0.0f, 1.0f);
    for (const char* site : {"attn", "ffn"}) {
      b.f32(p + "hc_" + site + "_fn", {mix, M * D}, 0.02f);
      b.f32(p + "hc_" + site + "_base", {mix}, 0.1f);
      b.f32(p + "hc_" + site + "_scale", {3}, 0.0f, 1.0f);
    }
    b.fp8(p + "attn.wq_a", kQLora, D, lin(D));
    b.bf16(p + "attn.q_norm.weight", {kQLora}, 0.0f, 1.0f);
    b.fp8(p + "attn.wq_b", H * hd, kQLora, lin(kQLora));
    b.fp8(p + "attn.wkv", hd, D, lin(D));
    b.bf16(p + "attn.kv_norm.weight", {hd}, 0.0f, 1.0f);
    b.fp8(p + "attn.wo_a", kOGroups * kOLora, H * hd / kOGroups, lin(H * hd / kOGroups));
    b.fp8(p + "attn.wo_b", D, kOGroups * kOLora, lin(kOGroups * kOLora));
    b.f32(p + "attn.attn_sink", {H}, 0.5f);
    auto compressor = [&](const std::string& q, int64_t dc, int coff) {
      b.bf16(q + "wkv.weight", {coff * dc, D}, lin(D));
      b.bf16(q + "wgate.weight", {coff * dc, D}, lin(D));
      b.f32(q + "ape", {r, coff * dc}, 0.3f, 0.0f, o.ape_bf16);
      b.bf16(q + "norm.weight", {dc}, 0.0f, 1.0f);
    };
    if (r > 0) compressor(p + "attn.compressor.", hd, r == 4 ? 2 : 1);
    if (r == 4) {
      compressor(p + "attn.indexer.compressor.", kIdxDim, 2);
      b.fp8(p + "attn.indexer.wq_b", kIdxHeads * kIdxDim, kQLora, lin(kQLora));
      b.bf16(p + "attn.indexer.weights_proj.weight", {kIdxHeads, D}, lin(D));
    }
    b.bf16(p + "ffn.gate.weight", {kExperts, D}, lin(D));
    if (l < kHashLayers) {
      b.tid2eid(p + "ffn.gate.tid2eid");
    } else {
      b.f32(p + "ffn.gate.bias", {kExperts}, 0.05f);
    }
    for (int e = 0; e < kExperts; ++e) {
      const std::string q = p + "ffn.experts." + std::to_string(e) + ".";
      b.mxfp4(q + "w1", kInter, D, lin(D));
      b.mxfp4(q + "w3", kInter, D, lin(D));
      b.mxfp4(q + "w2", D, kInter, lin(kInter));
    }
    b.fp8(p + "ffn.shared_experts.w1", kInter, D, lin(D));
    b.fp8(p + "ffn.shared_experts.w3", kInter, D, lin(D));
    b.fp8(p + "ffn.shared_experts.w2", D, kInter, lin(kInter));
  }
  b.w.set_metadata("format", "pt");
  b.w.write(dir + "/model.safetensors");
  write_file_atomic(dir + "/config.json", text.data(), text.size());
}

struct Fixture {
  std::string dir;
  std::unique_ptr<V4Cpu> model;
  std::vector<int32_t> prompt;
  std::vector<float> one_shot;  // logits of the whole prompt in one forward
};

std::unique_ptr<V4Cpu> load(const std::string& dir) {
  ModelConfig cfg = load_model_config(dir);
  return std::make_unique<V4Cpu>(cfg, bind_weights_v4(cfg, std::make_shared<ModelFiles>(dir)));
}

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.dir = dsx_test::temp_dir("session_v4_model");
    write_tiny_v4(x.dir, {});
    x.model = load(x.dir);
    uint32_t r = 4321;
    for (int i = 0; i < 150; ++i) {
      r = r * 1664525u + 1013904223u;
      x.prompt.push_back(3 + static_cast<int32_t>((r >> 8) % (kVocab - 3)));
    }
    KVState st = x.model->new_state();
    x.one_shot.resize(x.prompt.size() * kVocab);
    x.model->forward(st, x.prompt.data(), static_cast<int64_t>(x.prompt.size()), x.one_shot.data(), true);
    return x;
  }();
  return f;
}

double max_row_err(const float* a, const float* b, int64_t rows) {
  double m = 0;
  for (int64_t t = 0; t < rows; ++t) m = std::max(m, row_rel_l2(a + t * kVocab, b + t * kVocab, kVocab));
  return m;
}

}  // namespace

TEST(SessionV4, ModelExercisesEveryPath) {
  auto& f = fixture();
  const ModelConfig& c = f.model->config();
  EXPECT_EQ(v4_layer_kind(c, 0), V4LayerKind::Sliding);
  EXPECT_EQ(v4_layer_kind(c, 1), V4LayerKind::CSA);
  EXPECT_EQ(v4_layer_kind(c, 2), V4LayerKind::HCA);
  // the indexer really selects (more visible rows than top-k) and routing varies
  ForwardDebug dbg;
  KVState st = f.model->new_state();
  std::vector<float> l(f.prompt.size() * kVocab);
  f.model->forward(st, f.prompt.data(), static_cast<int64_t>(f.prompt.size()), l.data(), true, &dbg);
  EXPECT_EQ(l, f.one_shot);  // debug capture does not change the result
  const int64_t T = static_cast<int64_t>(f.prompt.size());
  int full = 0;
  for (int64_t t = 0; t < T; ++t) full += dbg.sparse_topk[1][t * kIdxTopK + kIdxTopK - 1] >= 0;
  EXPECT_GT(full, 100);
  EXPECT_EQ(st.caches[1].n, T / 4);
  EXPECT_EQ(st.caches[2].n, T / 8);
  EXPECT_EQ(st.caches[4].n, T / 16);
  EXPECT_EQ(st.caches[1].keys.size(), static_cast<size_t>(T / 4 * kIdxDim));
  EXPECT_TRUE(st.caches[2].keys.empty());
  for (int64_t t = 0; t < T; ++t)  // hash layers route by token id
    EXPECT_EQ(dbg.router_experts[0][t * kTopK], f.model->weights().layers[0].tid2eid[f.prompt[t] * kTopK]);
}

TEST(SessionV4, ChunkedPrefillEqualsOneShot) {
  auto& f = fixture();
  const int64_t T = static_cast<int64_t>(f.prompt.size());
  std::vector<float> chunked(f.one_shot.size());
  for (std::vector<int64_t> sizes : {std::vector<int64_t>{7, 13, 1, 16, 5, 31, 2, 9}, {1}, {3, 17, 33}, {4, 8, 16},
                                     {15, 1, 1, 1, 30}, {64, 65}, {127, 2}}) {
    KVState b = f.model->new_state();
    int64_t p = 0;
    size_t i = 0;
    while (p < T) {
      const int64_t n = std::min(sizes[i++ % sizes.size()], T - p);
      f.model->forward(b, f.prompt.data() + p, n, chunked.data() + p * kVocab, true);
      p += n;
    }
    const double e = max_row_err(chunked.data(), f.one_shot.data(), T);
    std::printf("chunks starting %lld: max row rel-L2 vs one-shot %.3g\n", (long long)sizes[0], e);
    EXPECT_LE(e, 1e-6) << "chunk pattern starting " << sizes[0];
  }
}

TEST(SessionV4, LastRowOnlyEqualsAllRows) {
  auto& f = fixture();
  KVState st = f.model->new_state();
  std::vector<float> last(kVocab);
  f.model->forward(st, f.prompt.data(), 77, last.data(), false);
  EXPECT_LE(row_rel_l2(last.data(), f.one_shot.data() + 76 * kVocab, kVocab), 1e-6);
}

TEST(SessionV4, SaveRestoreContinuesIdentically) {
  auto& f = fixture();
  auto eng = load_engine(f.dir);
  for (int64_t cut : {77, 78, 1, 15, 16, 31, 32, 128, 130}) {
    auto a = eng->new_session();
    std::vector<float> tmp(static_cast<size_t>(cut * kVocab));
    a->feed(f.prompt.data(), cut, tmp.data(), true);
    const std::vector<uint8_t> snap = a->save();
    const int64_t rest = 20;
    std::vector<float> la(static_cast<size_t>(rest * kVocab)), lb(la.size());
    a->feed(f.prompt.data() + cut, rest, la.data(), true);
    auto b = eng->new_session();
    b->restore(snap);
    EXPECT_EQ(b->position(), cut);
    b->feed(f.prompt.data() + cut, rest, lb.data(), true);
    EXPECT_EQ(la, lb) << "cut " << cut;
    EXPECT_EQ(b->save(), a->save()) << "cut " << cut;  // restore(save(s)) == s
  }
}

TEST(SessionV4, RollbackWithinDepth) {
  auto& f = fixture();
  // uninterrupted reference: 101 tokens, then 31 more one at a time
  const int64_t start = 101, end = 132;
  KVState a = f.model->new_state(16);
  std::vector<float> tmp(static_cast<size_t>(end * kVocab));
  f.model->forward(a, f.prompt.data(), start, tmp.data(), true);
  std::vector<float> ref(static_cast<size_t>((end - start) * kVocab));
  for (int64_t t = start; t < end; ++t) f.model->forward(a, f.prompt.data() + t, 1, ref.data() + (t - start) * kVocab, false);
  // Positions chosen so the rolled-back span crosses ratio-4 / -8 / -16 emissions
  // (rows at 103, 107, ..., 111, 127) and partial groups.
  for (auto [p, back] : std::vector<std::pair<int64_t, int64_t>>{
           {112, 16}, {112, 1}, {113, 15}, {110, 9}, {125, 4}, {127, 2}, {116, 13}, {120, 12}}) {
    KVState b = f.model->new_state(16);
    f.model->forward(b, f.prompt.data(), p, tmp.data(), true);
    std::vector<int32_t> junk(static_cast<size_t>(back));
    for (int64_t i = 0; i < back; ++i) junk[i] = static_cast<int32_t>(5 + 7 * i);
    // dirty the state with other tokens, in two chunks
    const int64_t n1 = std::max<int64_t>(1, back / 2);
    f.model->forward(b, junk.data(), n1, tmp.data(), true);
    if (back > n1) f.model->forward(b, junk.data() + n1, back - n1, tmp.data(), true);
    b.rollback(p);
    EXPECT_EQ(b.pos, p);
    f.model->check_state(b);
    std::vector<float> got(static_cast<size_t>((end - p) * kVocab));
    f.model->forward(b, f.prompt.data() + p, end - p, got.data(), true);
    for (int64_t t = std::max(p, start); t < end; ++t)
      EXPECT_LE(row_rel_l2(got.data() + (t - p) * kVocab, ref.data() + (t - start) * kVocab, kVocab), 1e-6)
          << "rollback to " << p << " from " << p + back << ", row " << t;
  }
  EXPECT_THROW(a.rollback(a.pos - 17), Error);
  EXPECT_THROW(a.rollback(a.pos + 1), Error);
}

TEST(SessionV4, EngineInterfaceAndSnapshots) {
  auto& f = fixture();
  auto eng = load_engine(f.dir);  // no tokenizer.json needed
  EXPECT_EQ(eng->config().family, Family::V4);
  auto s = eng->new_session();
  std::vector<float> l(static_cast<size_t>(90 * kVocab));
  s->feed(f.prompt.data(), 50, l.data(), true);
  for (int64_t t = 50; t < 90; ++t) s->feed(f.prompt.data() + t, 1, l.data() + t * kVocab, false);
  EXPECT_LE(max_row_err(l.data(), f.one_shot.data(), 90), 1e-6);
  auto snap = s->save();
  std::vector<float> a(kVocab), b(kVocab);
  s->feed(f.prompt.data() + 90, 1, a.data(), false);
  auto s2 = eng->new_session();
  s2->restore(snap);
  s2->feed(f.prompt.data() + 90, 1, b.data(), false);
  EXPECT_EQ(a, b);
  // feed_greedy = feed + argmax of the last row, and advances the same way
  auto s3 = eng->new_session();
  s3->restore(snap);
  EXPECT_EQ(s3->feed_greedy(f.prompt.data() + 90, 1), argmax(a.data(), kVocab));
  std::vector<float> c(kVocab);
  s2->rollback(91);
  s2->feed(f.prompt.data() + 91, 2, c.data(), false);
  EXPECT_EQ(s3->feed_greedy(f.prompt.data() + 91, 2), argmax(c.data(), kVocab));
  EXPECT_EQ(s3->save(), s2->save());
  s2->rollback(85);
  EXPECT_EQ(s2->position(), 85);
  EXPECT_GT(s2->state_bytes(), 0);
  // corrupt / foreign snapshots leave the session untouched
  auto bad = snap;
  bad[bad.size() / 2] ^= 1;
  EXPECT_THROW(s2->restore(bad), Error);
  EXPECT_EQ(s2->position(), 85);
  EXPECT_THROW(s2->restore({1, 2, 3}), Error);
  // a snapshot of another geometry (different rollback depth) is refused
  EngineOptions o4;
  o4.rollback_depth = 4;
  auto eng4 = load_engine(f.dir, o4);
  auto other = eng4->new_session();
  std::vector<float> tmp(static_cast<size_t>(10 * kVocab));
  other->feed(f.prompt.data(), 10, tmp.data(), true);
  try {
    s2->restore(other->save());
    FAIL() << "accepted a snapshot of another geometry";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("geometry"), std::string::npos) << e.what();
  }
  EXPECT_EQ(s2->position(), 85);
}

TEST(SessionV4, LoaderAcceptsAlternativeDtypes) {
  // ape stored BF16 and tid2eid stored I32 (spec §6.2) give the same model
  TinyV4Options o;
  o.ape_bf16 = true;
  o.tid2eid_i32 = true;
  const std::string dir = dsx_test::temp_dir("v4_alt_dtypes");
  write_tiny_v4(dir, o);
  auto m = load(dir);
  auto& f = fixture();
  KVState st = m->new_state();
  std::vector<float> l(static_cast<size_t>(40 * kVocab));
  m->forward(st, f.prompt.data(), 40, l.data(), true);
  EXPECT_EQ(0, std::memcmp(l.data(), f.one_shot.data(), l.size() * 4));
}

TEST(SessionV4, LoaderErrorsNameFileAndTensor) {
  auto expect_error = [](const TinyV4Options& o, const std::vector<std::string>& needles) {
    const std::string dir = dsx_test::temp_dir("v4_bad");
    write_tiny_v4(dir, o);
    try {
      load_engine(dir);
      FAIL() << "loaded a malformed model (" << needles[0] << ")";
    } catch (const Error& e) {
      for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what();
    }
  };
  TinyV4Options o;
  o.drop = "layers.1.attn.indexer.compressor.ape";
  expect_error(o, {"layers.1.attn.indexer.compressor.ape", "missing"});
  o = {};
  o.drop = "hc_head_fn";
  expect_error(o, {"hc_head_fn", "missing"});
  o = {};
  o.drop = "layers.0.ffn.gate.tid2eid";
  expect_error(o, {"layers.0.ffn.gate.tid2eid", "missing"});
  o = {};
  o.bad_dtype = "layers.2.attn.compressor.ape";
  expect_error(o, {"model.safetensors", "layers.2.attn.compressor.ape", "dtype"});
  o = {};
  o.bad_tid2eid = true;
  expect_error(o, {"model.safetensors", "layers.0.ffn.gate.tid2eid", "row 7"});
}
