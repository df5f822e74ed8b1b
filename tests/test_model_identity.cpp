// The model identity (ModelFiles::fingerprint: snapshots, the disk KV cache and run
// manifests refuse another model's state by it) tells apart two checkpoints of one
// shape: the same directory gives the same identity, a copy with one weight byte
// changed (a fine-tune, a re-export) gives another.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "model/make_tiny.h"
#include "model/weights.h"
#include "test_util.h"

using namespace dsx;
namespace fs = std::filesystem;

TEST(ModelIdentity, WeightsAreInTheFingerprint) {
  const std::string a = dsx_test::temp_dir("identity_a"), b = dsx_test::temp_dir("identity_b");
  TinySpec s;
  s.seed = 5;
  write_tiny_model(a, s, "");
  for (const auto& e : fs::directory_iterator(a)) fs::copy_file(e.path(), b + "/" + e.path().filename().string());
  const std::string fa = ModelFiles(a).fingerprint();
  EXPECT_EQ(fa, ModelFiles(a).fingerprint());
  EXPECT_EQ(fa, ModelFiles(b).fingerprint());
  // one byte of the last tensor data (the file's last byte: always sampled)
  const std::string st = b + "/model.safetensors";
  const auto size = fs::file_size(st);
  {
    std::fstream f(st, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(size - 1));
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x01);
    f.seekp(static_cast<std::streamoff>(size - 1));
    f.write(&c, 1);
  }
  EXPECT_NE(fa, ModelFiles(b).fingerprint()) << "a changed weight byte must change the identity";
  // another seed: same shape, other weights
  const std::string c = dsx_test::temp_dir("identity_c");
  s.seed = 6;
  write_tiny_model(c, s, "");
  EXPECT_NE(fa, ModelFiles(c).fingerprint());
}
