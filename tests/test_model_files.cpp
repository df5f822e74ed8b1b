// Loading a model directory: shards, and clear errors naming the file and tensor
// for missing / truncated / mis-typed / mis-shaped / unexpected tensors and bad
// configuration files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "model/make_tiny.h"
#include "model/weights.h"
#include "test_util.h"
#include "util/error.h"
#include "util/mmap_file.h"

using namespace dsx;
namespace fs = std::filesystem;

namespace {

const std::string& base_model() {
  static std::string dir = [] {
    std::string d = dsx_test::temp_dir("files_base");
    TinySpec s;
    s.vocab = 256;
    s.layers = 6;
    s.ratios = {0, 0, 2, 2, 1, 1};
    s.kv_sources = {2, 4};
    s.index_sources = {2, 4, 5};
    s.candidate_source = 4;
    s.engram_layers = {1};
    s.engram_compressed_vocab = 256;
    write_tiny_model(d, s, "");
    return d;
  }();
  return dir;
}

std::string copy_model(const std::string& name) {
  std::string d = dsx_test::temp_dir(name);
  for (const auto& e : fs::directory_iterator(base_model())) fs::copy(e.path(), d + "/" + e.path().filename().string());
  return d;
}

void load(const std::string& dir) {
  ModelConfig cfg = load_model_config(dir);
  bind_weights(cfg, std::make_shared<ModelFiles>(dir));
}

void expect_error(const std::string& dir, std::vector<std::string> needles) {
  try {
    load(dir);
    FAIL() << "loading " << dir << " succeeded";
  } catch (const Error& e) {
    for (const auto& n : needles) EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << "  (wanted: " << n << ")";
  }
}

// Rewrites model.safetensors through `edit` (name -> replacement or drop).
void rewrite(const std::string& dir, const std::function<void(SafetensorsWriter&, const TensorView&)>& edit) {
  std::string path = dir + "/model.safetensors";
  SafetensorsWriter w;
  {
    SafetensorsFile f(path);
    for (const auto& [name, t] : f.tensors()) edit(w, t);
  }
  w.write(path);
}

void keep(SafetensorsWriter& w, const TensorView& t) { w.add(t.name, t.dtype, t.shape, t.data, t.nbytes); }

}  // namespace

TEST(ModelFiles, TinyModelLoads) { EXPECT_NO_THROW(load(base_model())); }

TEST(ModelFiles, ConfigErrors) {
  std::string d = copy_model("cfg_missing");
  fs::remove(d + "/config.json");
  expect_error(d, {"config.json", "missing"});
  d = copy_model("cfg_json");
  std::ofstream(d + "/config.json") << "{ \"model_type\": ";
  expect_error(d, {"config.json", "JSON"});
  d = copy_model("cfg_type");
  std::ofstream(d + "/config.json") << R"({"model_type": "llama"})";
  expect_error(d, {"config.json", "unsupported model_type 'llama'"});
  d = copy_model("cfg_field");
  auto j = nlohmann::json::parse(read_text_file(base_model() + "/config.json"));
  j["text_config"]["hidden_size"] = "wide";
  std::ofstream(d + "/config.json") << j.dump();
  expect_error(d, {"config.json", "hidden_size", "integer"});
  d = copy_model("cfg_topology");
  j = nlohmann::json::parse(read_text_file(base_model() + "/config.json"));
  j["text_config"]["compress_ratios"] = {0, 0, 2, 1, 1, 1};  // layer 3 ratio differs from its source 2
  std::ofstream(d + "/config.json") << j.dump();
  expect_error(d, {"config.json", "layer 3"});
}

TEST(ModelFiles, TruncatedFile) {
  std::string d = copy_model("trunc");
  auto size = fs::file_size(d + "/model.safetensors");
  fs::resize_file(d + "/model.safetensors", size - 1000);
  expect_error(d, {"model.safetensors", "truncated"});
  d = copy_model("trunc_header");
  fs::resize_file(d + "/model.safetensors", 100);
  expect_error(d, {"model.safetensors", "header"});
}

TEST(ModelFiles, WrongDtypeShapeMissingUnexpected) {
  std::string d = copy_model("dtype");
  rewrite(d, [](SafetensorsWriter& w, const TensorView& t) {
    if (t.name == "layers.3.attn.wq_b.weight") {
      std::vector<uint8_t> v(t.nbytes);
      w.add(t.name, DType::I8, t.shape, v);
    } else {
      keep(w, t);
    }
  });
  expect_error(d, {"model.safetensors", "layers.3.attn.wq_b.weight", "dtype I8", "F8_E4M3"});

  d = copy_model("shape");
  rewrite(d, [](SafetensorsWriter& w, const TensorView& t) {
    if (t.name == "layers.2.ffn.experts.5.w2.scale") {
      std::vector<uint8_t> v(t.nbytes);
      w.add(t.name, t.dtype, {t.shape[1], t.shape[0]}, v);
    } else {
      keep(w, t);
    }
  });
  expect_error(d, {"model.safetensors", "layers.2.ffn.experts.5.w2.scale", "shape"});

  d = copy_model("missing");
  rewrite(d, [](SafetensorsWriter& w, const TensorView& t) {
    if (t.name != "layers.4.attn.indexer.wk.weight") keep(w, t);
  });
  expect_error(d, {"layers.4.attn.indexer.wk.weight", "missing"});

  d = copy_model("unexpected");
  rewrite(d, [](SafetensorsWriter& w, const TensorView& t) {
    keep(w, t);
    if (t.name == "norm.weight") w.add("layers.3.attn.compressor.wkv.weight", t.dtype, t.shape, t.data, t.nbytes);
  });
  expect_error(d, {"model.safetensors", "unexpected tensor 'layers.3.attn.compressor.wkv.weight'"});
}

TEST(ModelFiles, ShardedCheckpoint) {
  std::string d = copy_model("shards");
  nlohmann::json index;
  index["metadata"] = {{"total_size", 0}};
  {
    SafetensorsFile f(d + "/model.safetensors");
    SafetensorsWriter a, b;
    int i = 0;
    for (const auto& [name, t] : f.tensors()) {
      const bool first = (i++ % 2) == 0;
      (first ? a : b).add(name, t.dtype, t.shape, t.data, t.nbytes);
      index["weight_map"][name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
    }
    a.write(d + "/model-00001-of-00002.safetensors");
    b.write(d + "/model-00002-of-00002.safetensors");
  }
  fs::remove(d + "/model.safetensors");
  std::ofstream(d + "/model.safetensors.index.json") << index.dump();
  EXPECT_NO_THROW(load(d));
  fs::remove(d + "/model-00002-of-00002.safetensors");
  expect_error(d, {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "missing"});
}
