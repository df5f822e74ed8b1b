// Session properties on the V4.1 CPU engine: chunked prefill (odd chunk sizes)
// equals one-shot prefill; save/restore and rollback give identical
// continuations; corrupt snapshots are rejected with a clear error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "cli/golden_check.h"
#include "model/make_tiny.h"
#include "model/v41_cpu.h"
#include "runtime/cpu_engine.h"
#include "test_util.h"
#include "util/error.h"

using namespace dsx;

namespace {

// A tiny random model in the official format with Engram over an identity token
// map (compressed vocab = vocab), shared by the tests of this file.
struct Fixture {
  std::string dir;
  std::unique_ptr<V41Cpu> model;
  std::vector<int32_t> prompt;
};

Fixture& fixture() {
  static Fixture f = [] {
    Fixture x;
    x.dir = dsx_test::temp_dir("session_model");
    TinySpec s;
    s.vocab = 512;
    s.engram_compressed_vocab = 512;
    s.seed = 7;
    write_tiny_model(x.dir, s, "");
    ModelConfig cfg = load_model_config(x.dir);
    std::vector<int32_t> cmap(512);
    for (int i = 0; i < 512; ++i) cmap[i] = i;
    x.model = std::make_unique<V41Cpu>(cfg, bind_weights(cfg, std::make_shared<ModelFiles>(x.dir)), cmap);
    uint32_t r = 12345;
    for (int i = 0; i < 150; ++i) {
      r = r * 1664525u + 1013904223u;
      x.prompt.push_back(3 + static_cast<int32_t>((r >> 8) % 509));
    }
    // repeated 4-grams so Engram rows repeat
    for (int i = 0; i < 8; ++i) x.prompt[100 + i] = x.prompt[20 + i];
    return x;
  }();
  return f;
}

double max_row_err(const std::vector<float>& a, const std::vector<float>& b, int64_t V) {
  double m = 0;
  for (size_t t = 0; t * V < a.size(); ++t) m = std::max(m, row_rel_l2(a.data() + t * V, b.data() + t * V, V));
  return m;
}

}  // namespace

TEST(Session, ChunkedPrefillEqualsOneShot) {
  auto& f = fixture();
  const int64_t T = static_cast<int64_t>(f.prompt.size()), V = f.model->config().vocab_size;
  std::vector<float> one(static_cast<size_t>(T * V)), chunked(one.size());
  KVState a = f.model->new_state();
  f.model->forward(a, f.prompt.data(), T, one.data(), true);
  for (std::vector<int64_t> sizes : {std::vector<int64_t>{7, 13, 1, 16, 5, 31, 2, 9}, {1}, {3, 17, 33}}) {
    KVState b = f.model->new_state();
    int64_t p = 0;
    size_t i = 0;
    while (p < T) {
      int64_t n = std::min(sizes[i++ % sizes.size()], T - p);
      f.model->forward(b, f.prompt.data() + p, n, chunked.data() + p * V, true);
      p += n;
    }
    EXPECT_LE(max_row_err(one, chunked, V), 1e-6) << "chunk pattern starting " << sizes[0];
  }
}

// The fixture's model behind the Engine / Session interface (a second copy of the
// weights binding: the engine owns its model).
std::unique_ptr<Engine> fixture_engine(EngineOptions o = {}) {
  auto& f = fixture();
  ModelConfig cfg = load_model_config(f.dir);
  std::vector<int32_t> cmap(512);
  for (int i = 0; i < 512; ++i) cmap[i] = i;
  return make_cpu_engine(std::make_unique<V41Cpu>(cfg, bind_weights(cfg, std::make_shared<ModelFiles>(f.dir)), cmap), o);
}

TEST(Session, SaveRestoreContinuesIdentically) {
  auto& f = fixture();
  auto eng = fixture_engine();
  const int64_t V = eng->config().vocab_size;
  for (int64_t cut : {77, 78, 1, 130}) {
    auto a = eng->new_session();
    std::vector<float> tmp(static_cast<size_t>(cut * V));
    a->feed(f.prompt.data(), cut, tmp.data(), true);
    std::vector<uint8_t> snap = a->save();
    const int64_t rest = 20;
    std::vector<float> la(static_cast<size_t>(rest * V)), lb(la.size());
    a->feed(f.prompt.data() + cut, rest, la.data(), true);
    auto b = eng->new_session();
    b->restore(snap);
    EXPECT_EQ(b->position(), cut);
    b->feed(f.prompt.data() + cut, rest, lb.data(), true);
    EXPECT_EQ(la, lb) << "cut " << cut;
    // restore(save(s)) == s
    EXPECT_EQ(b->save(), a->save());
  }
}

TEST(Session, CorruptSnapshotsAreRejected) {
  auto& f = fixture();
  auto eng = fixture_engine();
  auto a = eng->new_session();
  std::vector<float> tmp(static_cast<size_t>(10 * eng->config().vocab_size));
  a->feed(f.prompt.data(), 10, tmp.data(), true);
  auto snap = a->save();
  auto expect_error = [&](std::vector<uint8_t> bytes, const std::string& needle) {
    auto b = eng->new_session();
    b->feed(f.prompt.data(), 3, tmp.data(), false);
    try {
      b->restore(bytes);
      FAIL() << "accepted a corrupt snapshot (" << needle << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
    EXPECT_EQ(b->position(), 3);  // the state is untouched
  };
  auto trunc = snap;
  trunc.resize(snap.size() / 2);
  expect_error(trunc, "truncated");
  auto flipped = snap;
  flipped[snap.size() - 40] ^= 0x40;  // (inside the last section's payload)
  expect_error(flipped, "checksum");
  auto tail = snap;
  tail.push_back(0);
  expect_error(tail, "trailing bytes");
  expect_error({1, 2, 3}, "magic");
  std::vector<uint8_t> old = {'D', 'S', 'X', 'K', 'V', 'S', '0', '1', 0, 0, 0, 0};
  expect_error(old, "old dsx snapshot format");
  auto version = snap;
  version[8] = 7;
  expect_error(version, "version 7");
  // another model: the same snapshot with another identity in its header
  const std::string model = eng->state_identity().model_id;
  std::string text(snap.begin(), snap.end());
  const size_t at = text.find(model);
  ASSERT_NE(at, std::string::npos);
  auto foreign = snap;
  foreign[at] = foreign[at] == 'a' ? 'b' : 'a';
  expect_error(foreign, "different model");
  // another geometry (rollback depth 4)
  EngineOptions o4;
  o4.rollback_depth = 4;
  auto eng4 = fixture_engine(o4);
  auto c = eng4->new_session();
  c->feed(f.prompt.data(), 10, tmp.data(), true);
  expect_error(c->save(), "geometry");
}

TEST(Session, RollbackWithinDepth) {
  auto& f = fixture();
  const int64_t V = f.model->config().vocab_size;
  KVState a = f.model->new_state(16);
  std::vector<float> tmp(static_cast<size_t>(150 * V));
  f.model->forward(a, f.prompt.data(), 101, tmp.data(), true);  // odd: ratio-2 group pending
  std::vector<float> ref(static_cast<size_t>(16 * V));
  f.model->forward(a, f.prompt.data() + 101, 16, ref.data(), true);
  for (int64_t back : {16, 15, 1, 2, 9}) {
    const int64_t p = 117 - back;
    // feed different tokens first to dirty the state, then roll back and replay
    KVState b = f.model->new_state(16);
    f.model->forward(b, f.prompt.data(), p, tmp.data(), true);
    std::vector<int32_t> junk(static_cast<size_t>(back), 5);
    f.model->forward(b, junk.data(), back, tmp.data(), true);
    b.rollback(p);
    EXPECT_EQ(b.pos, p);
    std::vector<float> got(static_cast<size_t>((117 - p) * V));
    f.model->forward(b, f.prompt.data() + p, 117 - p, got.data(), true);
    // rows p..116 must equal the uninterrupted run (rows of `ref` start at 101)
    for (int64_t t = std::max<int64_t>(p, 101); t < 117; ++t)
      EXPECT_EQ(0, std::memcmp(got.data() + (t - p) * V, ref.data() + (t - 101) * V, V * 4)) << "back " << back << " row " << t;
  }
  EXPECT_THROW(a.rollback(a.pos - 17), Error);
  EXPECT_THROW(a.rollback(a.pos + 1), Error);
}
