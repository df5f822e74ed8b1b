// The tensor inventory (model/inventory.h): it equals the tensors stored in the golden
// checkpoints and the counts and shapes of the release (spec model-v41.md §2.3, dspark.md
// §3), and its consumers (make-tiny, the cost model) give what they gave before they read it.
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "model/cost_model.h"
#include "model/inventory.h"
#include "model/release_config.h"
#include "model/layer_plan.h"
#include "model/make_tiny.h"
#include "test_util.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

using Entry = std::tuple<std::string, std::string, std::vector<int64_t>>;  // name, dtype, shape

std::set<Entry> stored_set(const std::vector<TensorSpec>& specs) {
  std::set<Entry> s;
  for (const TensorSpec& t : specs)
    for (const StoredTensor& st : stored_tensors(t)) EXPECT_TRUE(s.insert({st.name, dtype_name(st.dtype), st.shape}).second) << st.name;
  return s;
}

std::set<Entry> file_set(const std::string& path) {
  SafetensorsFile f(path);
  std::set<Entry> s;
  for (const auto& [name, t] : f.tensors()) s.insert({name, dtype_name(t.dtype), t.shape});
  return s;
}

// The differences of two sets, one line per entry (empty when equal).
std::string diff(const std::set<Entry>& want, const std::set<Entry>& got) {
  std::string d;
  for (const auto& e : want)
    if (!got.count(e)) d += "  only in the file:      " + std::get<0>(e) + " " + std::get<1>(e) + " " + shape_to_string(std::get<2>(e)) + "\n";
  for (const auto& e : got)
    if (!want.count(e)) d += "  only in the inventory: " + std::get<0>(e) + " " + std::get<1>(e) + " " + shape_to_string(std::get<2>(e)) + "\n";
  return d;
}

std::vector<TensorSpec> with_stages(const ModelConfig& c) {
  std::vector<TensorSpec> v = TensorInventory(c).tensors();
  for (TensorSpec& t : dspark_inventory(c)) v.push_back(std::move(t));
  return v;
}

// The release configuration (spec model-v41.md §1.2).
ModelConfig release_config() { return release_v41_flash_config(); }

}  // namespace

TEST(Inventory, GoldenTinyCheckpoint) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string dir = g + "/deepseek_v41_tiny";
  const ModelConfig c = load_model_config(dir);
  const std::set<Entry> inv = stored_set(TensorInventory(c).tensors()), file = file_set(dir + "/model.safetensors");
  EXPECT_EQ(inv.size(), 1170u);
  EXPECT_TRUE(inv == file) << diff(file, inv);
}

TEST(Inventory, GoldenDSparkCheckpoint) {
  DSX_REQUIRE_GOLDEN(g);
  const std::string dir = g + "/deepseek_v41_dspark_tiny";
  const ModelConfig c = load_model_config(dir);
  ASSERT_EQ(c.n_nextn_layers, 3);
  const std::set<Entry> inv = stored_set(with_stages(c)), file = file_set(dir + "/model.safetensors");
  EXPECT_EQ(inv.size(), 1411u);
  EXPECT_TRUE(inv == file) << diff(file, inv);
}

// Spec §2.3 count reconciliation and shapes of the release.
TEST(Inventory, ReleaseCountsAndShapes) {
  const ModelConfig c = release_config();
  const TensorInventory inv(c);
  std::map<std::string, std::vector<int64_t>> shape;
  std::map<DType, int> by_dtype;
  std::map<Storage, int> by_storage;
  for (const TensorSpec& t : inv.tensors()) {
    ++by_storage[t.storage];
    for (const StoredTensor& s : stored_tensors(t)) shape[s.name] = s.shape, ++by_dtype[s.dtype];
  }
  EXPECT_EQ(shape.size(), 93418u);  // 40 x 2,334 + 11 + 32 + 12 + 3
  EXPECT_EQ(inv.count(-1), 3u);
  EXPECT_EQ(by_storage[Storage::MXFP4], 46080);
  EXPECT_EQ(by_storage[Storage::FP8], 330);  // 40 x 8 attention / shared + 8 indexer wq_b + 2 Engram wkv
  EXPECT_EQ(by_storage[Storage::EngramTable], 2);
  EXPECT_EQ(by_dtype[DType::F8_E8M0], 46410 + 2);
  // spec §1.4: what the checkpoint confirms
  std::map<Role, int> n;
  for (const TensorSpec& t : inv.tensors()) ++n[t.role];
  EXPECT_EQ(n[Role::wq_a], 40);
  EXPECT_EQ(n[Role::comp_wkv], 4);
  EXPECT_EQ(n[Role::comp_wgate], 3);
  EXPECT_EQ(n[Role::idx_wq_b], 8);
  EXPECT_EQ(n[Role::idx_wk], 4);
  EXPECT_EQ(n[Role::engram_table], 2);
  EXPECT_EQ(inv.find(20, Role::comp_wgate), nullptr);
  EXPECT_NE(inv.find(14, Role::comp_wgate), nullptr);
  EXPECT_EQ(inv.find(24, Role::idx_wk), nullptr);
  EXPECT_NE(inv.find(24, Role::idx_weights_proj), nullptr);
  EXPECT_EQ(inv.at(5, Role::expert_w2, 383).name, "layers.5.ffn.experts.383.w2");
  EXPECT_EQ(inv.find(5, Role::expert_w2, 384), nullptr);
  EXPECT_TRUE(inv.at(3, Role::gate_bias_vl).optional);
  using V = std::vector<int64_t>;
  EXPECT_EQ(shape["layers.14.engram.embed.weight"], (V{384016682, 256}));
  EXPECT_EQ(shape["layers.14.engram.embed.scale"], (V{384016682, 8}));
  EXPECT_EQ(shape["layers.1.engram.wkv.weight"], (V{25600, 6144}));
  EXPECT_EQ(shape["layers.1.engram.wkv.scale"], (V{800, 192}));
  EXPECT_EQ(shape["layers.1.engram.q_weight"], (V{4, 5120}));
  EXPECT_EQ(shape["layers.0.attn.wo_a.scale"], (V{256, 128}));
  EXPECT_EQ(shape["layers.0.attn.wq_b.scale"], (V{1024, 40}));
  EXPECT_EQ(shape["layers.0.hc_ffn_fn"], (V{24, 20480}));
  EXPECT_EQ(shape["layers.9.ffn.experts.0.w1.weight"], (V{2304, 2560}));
  EXPECT_EQ(shape["layers.9.ffn.experts.0.w1.scale"], (V{2304, 160}));
  EXPECT_EQ(shape["layers.9.ffn.experts.0.w2.weight"], (V{5120, 1152}));
  EXPECT_EQ(shape["layers.9.ffn.experts.0.w2.scale"], (V{5120, 72}));
  EXPECT_EQ(shape["layers.20.attn.indexer.wq_b.scale"], (V{128, 40}));
  EXPECT_EQ(shape["layers.36.attn.indexer.weights_proj.weight"], (V{32, 5120}));
  // §1.3: bytes per routed expert (MXFP4 + scales)
  EXPECT_EQ(stored_bytes(inv.at(7, Role::expert_w1, 9)) + stored_bytes(inv.at(7, Role::expert_w3, 9)) +
                stored_bytes(inv.at(7, Role::expert_w2, 9)),
            18800640);

  // DSpark stages (dspark.md §3): 3 x (30 + 128 x 6) + 3 + 4
  std::map<std::string, std::vector<int64_t>> st;
  for (const TensorSpec& t : dspark_inventory(c))
    for (const StoredTensor& s : stored_tensors(t)) st[s.name] = s.shape;
  EXPECT_EQ(st.size(), 2401u);
  EXPECT_EQ(st["mtp.0.main_proj.weight"], (V{5120, 15360}));
  EXPECT_EQ(st["mtp.0.main_proj.scale"], (V{160, 480}));
  EXPECT_EQ(st["mtp.1.ffn.gate.weight"], (V{128, 5120}));
  EXPECT_EQ(st["mtp.2.ffn.experts.127.w2.scale"], (V{5120, 72}));
  EXPECT_EQ(st["mtp.2.markov_head.embed.weight"], (V{129280, 256}));
  EXPECT_EQ(st["mtp.2.confidence_head.proj.weight"], (V{1, 5376}));
  EXPECT_EQ(st.count("mtp.1.norm.weight"), 0u);
  EXPECT_EQ(st.count("mtp.1.main_norm.weight"), 0u);
  for (const auto& [name, s] : st) EXPECT_EQ(shape.count(name), 0u) << name;
}

// The inventory's conditions are the layer plan's.
TEST(Inventory, FollowsTheLayerPlan) {
  const ModelConfig c = release_config();
  const TensorInventory inv(c);
  for (int l = 0; l < c.n_layers; ++l) {
    const LayerPlan p = layer_plan(c, l);
    EXPECT_EQ(inv.find(l, Role::comp_wkv) != nullptr, p.kv_source) << l;
    EXPECT_EQ(inv.find(l, Role::comp_wgate) != nullptr, p.kv_source && p.ratio > 1) << l;
    EXPECT_EQ(inv.find(l, Role::idx_wq_b) != nullptr, p.index_source) << l;
    EXPECT_EQ(inv.find(l, Role::idx_k_norm) != nullptr, p.index_source && p.kv_source) << l;
    EXPECT_EQ(inv.find(l, Role::engram_wkv) != nullptr, p.engram >= 0) << l;
    size_t n = 0;
    for (const TensorSpec& t : inv.tensors()) n += t.layer == l;
    EXPECT_EQ(inv.count(l), n);
  }
  EXPECT_EQ(inv.at(14, Role::engram_table).rows(), 384016682);
}

// Pre-refactor values: computed by v41_decode_weight_bytes / decode_state_bytes as they
// were before they read the inventory and the layer plan (commit 0887b9f), recorded here.
TEST(Inventory, CostModelKeepsItsFigures) {
  const std::map<int, int64_t> weights = {{1, 1606668800}, {2, 2046946496}, {3, 2345970368}, {5, 2922582720},
                                          {8, 3776652480}, {13, 5207536320}, {40, 12916466880}};
  for (const auto& [layers, bytes] : weights)
    EXPECT_EQ(v41_decode_weight_bytes(synthetic_v41_flash_config(layers)), bytes) << layers << " layers";
  const std::map<std::pair<int, int64_t>, int64_t> state = {
      {{8, 1}, 5512},         {{8, 100}, 583400},       {{8, 4096}, 2121728},    {{8, 65536}, 9224192},
      {{8, 1048576}, 109494272}, {{40, 1}, 32712},      {{40, 100}, 3303400},    {{40, 4096}, 13459456},
      {{40, 65536}, 33931264}, {{40, 1048576}, 134201344}};
  for (const auto& [k, bytes] : state)
    EXPECT_EQ(decode_state_bytes(synthetic_v41_flash_config(k.first), k.second), bytes) << k.first << " layers, ctx " << k.second;
}

// The decode bytes of the release: the head, one embedding row, 6 of 384 experts a layer,
// 24 rows of each Engram table; the DSpark stages are not read by a backbone step.
TEST(Inventory, DecodeReadBytes) {
  const ModelConfig c = release_config();
  const TensorInventory inv(c);
  EXPECT_EQ(decode_read_bytes(c, inv.at(-1, Role::embed)), 5120 * 2);
  EXPECT_EQ(decode_read_bytes(c, inv.at(-1, Role::head)), int64_t{129280} * 5120 * 2);
  EXPECT_EQ(decode_read_bytes(c, inv.at(1, Role::engram_table)), 24 * (256 + 8));
  EXPECT_EQ(decode_read_bytes(c, inv.at(0, Role::expert_w1, 5)), 2304 * (2560 + 160));
  EXPECT_EQ(decode_read_bytes(c, inv.at(0, Role::expert_w1, 6)), 0);
  EXPECT_EQ(decode_read_bytes(c, inv.at(0, Role::wq_a)), 1280 * 5120 + 40 * 160);
  for (const TensorSpec& t : dspark_inventory(c)) EXPECT_EQ(decode_read_bytes(c, t), 0) << t.name;
}

// make-tiny writes exactly the tensors of its config's inventory (names, dtypes, shapes).
TEST(Inventory, MakeTinyWritesTheInventory) {
  const std::string base = dsx_test::temp_dir("inventory_tiny");
  struct Case {
    const char* name;
    TinySpec spec;
  };
  TinySpec engram;
  engram.engram_compressed_vocab = 99092;
  TinySpec odd = engram;
  odd.layers = 4;
  odd.ratios = {0, 2, 2, 1};
  odd.kv_sources = {1, 3};
  odd.index_sources = {1, 3};
  odd.candidate_source = -1;
  odd.engram_layers = {0, 3};
  odd.seed = 3;
  const Case cases[] = {
      {"plain", TinySpec{}},
      {"engram", engram},
      {"odd", odd},
  };
  for (const Case& k : cases) {
    const std::string dir = base + "/" + k.name;
    write_tiny_model(dir, k.spec, "");
    const ModelConfig c = load_model_config(dir);
    const std::set<Entry> inv = stored_set(TensorInventory(c).tensors()), file = file_set(dir + "/model.safetensors");
    EXPECT_TRUE(inv == file) << k.name << "\n" << diff(file, inv);
  }
}
