// GPU sessions (CUDA backend, fp32 mode) on the V4.1 golden model: save/restore
// gives identical continuations, rollback replays exactly, and a snapshot taken on
// the GPU restores on the CPU engine (the snapshot format is shared) and continues
// like a CPU session that computed the prefix itself.
#include <gtest/gtest.h>

#ifdef DSX_HAVE_CUDA
#include <cmath>

#include "cli/golden_check.h"
#include "kernels/cuda/cuda_util.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "test_util.h"
#include "util/safetensors.h"

using namespace dsx;

namespace {

struct Case {
  std::string dir;
  std::vector<int32_t> ids;
  int64_t V = 0;
};

Case golden_case(const std::string& gdir) {
  Case c;
  c.dir = gdir + "/deepseek_v41_tiny";
  SafetensorsFile g(c.dir + "/golden.safetensors");
  const auto& t = g.get("input_ids");
  c.ids.assign(t.as<int32_t>(), t.as<int32_t>() + t.numel());
  return c;
}

// The golden model on the CUDA backend, sessions of up to 512 tokens.
std::unique_ptr<Engine> cuda_engine(const Case& c, const char* precision) {
  EngineOptions o;
  o.backend = "cuda";
  o.precision = precision;
  o.max_context = 512;
  return load_engine(c.dir, o);
}

std::vector<float> feed_rows(Session& s, const int32_t* ids, int64_t n, int64_t V) {
  std::vector<float> l(static_cast<size_t>(n * V));
  s.feed(ids, n, l.data(), true);
  return l;
}

std::vector<float> feed_one_by_one(Session& s, const int32_t* ids, int64_t n, int64_t V) {
  std::vector<float> l(static_cast<size_t>(n * V));
  for (int64_t i = 0; i < n; ++i) s.feed(ids + i, 1, l.data() + i * V, false);
  return l;
}

}  // namespace

TEST(CudaSession, SaveRestoreRollbackAndCrossBackend) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DSX_REQUIRE_GOLDEN(gdir);
  Case c = golden_case(gdir);
  auto gpu = cuda_engine(c, "fp32");
  const int64_t V = gpu->config().vocab_size;
  c.V = V;

  // save at an odd position (a ratio-2 group is pending), continue, restore, continue
  auto a = gpu->new_session();
  feed_rows(*a, c.ids.data(), 77, V);
  const auto snap = a->save();
  const auto la = feed_one_by_one(*a, c.ids.data() + 77, 12, V);
  auto b = gpu->new_session();
  b->restore(snap);
  EXPECT_EQ(b->position(), 77);
  const auto lb = feed_one_by_one(*b, c.ids.data() + 77, 12, V);
  EXPECT_EQ(la, lb) << "restore(save(s)) continues identically";
  EXPECT_EQ(b->save(), a->save());

  // rollback: dirty the state with other tokens, roll back, replay
  auto r = gpu->new_session();
  feed_rows(*r, c.ids.data(), 77, V);
  std::vector<int32_t> junk(9, 5);
  feed_one_by_one(*r, junk.data(), 9, V);
  r->rollback(77);
  const auto lr = feed_one_by_one(*r, c.ids.data() + 77, 12, V);
  EXPECT_EQ(la, lr) << "rollback then replay equals the uninterrupted run";
  // (the backend rolls back within the depth; Session::rollback goes further through a
  // checkpoint or a replay, see tests/test_runtime.cpp)
  EXPECT_THROW(r->backend().rollback(r->position() - 17), Error);
  EXPECT_THROW(r->rollback(r->position() + 1), Error);

  // the GPU snapshot restores on the CPU and continues like a CPU session
  auto cpu = load_engine(c.dir, EngineOptions{});
  auto s_cpu = cpu->new_session();
  s_cpu->restore(snap);
  const auto lc = feed_one_by_one(*s_cpu, c.ids.data() + 77, 12, V);
  auto ref = cpu->new_session();
  feed_rows(*ref, c.ids.data(), 77, V);
  const auto lref = feed_one_by_one(*ref, c.ids.data() + 77, 12, V);
  for (int64_t t = 0; t < 12; ++t) {
    EXPECT_LE(row_rel_l2(lc.data() + t * V, lref.data() + t * V, V), 1e-4) << "row " << 77 + t;
    EXPECT_LE(row_rel_l2(la.data() + t * V, lref.data() + t * V, V), 1e-4) << "GPU vs CPU row " << 77 + t;
  }
}

// feed_greedy picks on the device what argmax picks from feed's logits, step by step
// (prefill chunk, then single tokens), and leaves the same state.
TEST(CudaSession, FeedGreedyMatchesHostArgmax) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DSX_REQUIRE_GOLDEN(gdir);
  Case c = golden_case(gdir);
  for (const char* prec : {"fp32", "bf16"}) {
    auto gpu = cuda_engine(c, prec);
    const int64_t V = gpu->config().vocab_size;
    auto a = gpu->new_session(), b = gpu->new_session();
    std::vector<float> l(static_cast<size_t>(V));
    a->feed(c.ids.data(), 40, l.data(), false);
    EXPECT_EQ(b->feed_greedy(c.ids.data(), 40), argmax(l.data(), V)) << prec;
    for (int64_t t = 40; t < 60; ++t) {  // eager steps, then the captured graph
      a->feed(c.ids.data() + t, 1, l.data(), false);
      EXPECT_EQ(b->feed_greedy(c.ids.data() + t, 1), argmax(l.data(), V)) << prec << " position " << t;
    }
    EXPECT_EQ(a->save(), b->save()) << prec;
  }
}

// Greedy decoding that feeds every pick back continues the step the device started
// ahead of the host on that pick: the picks and the state equal feed + host argmax. A
// step run ahead and not continued (save, rollback, feed, feed_greedy of another id)
// leaves no trace: the ring slots it wrote (the window of 16 + 16 rows wraps here) are
// put back, so the snapshots are byte for byte those of the plain session.
TEST(CudaSession, GreedyRunAheadMatchesFeed) {
  if (!cuda::device_available()) GTEST_SKIP() << "no CUDA device";
  DSX_REQUIRE_GOLDEN(gdir);
  Case c = golden_case(gdir);
  for (const char* prec : {"fp32", "bf16"}) {
    // (two engines: a step of a session of the same engine would drop b's run-ahead)
    auto gpu = cuda_engine(c, prec), gpu_b = cuda_engine(c, prec);
    const int64_t V = gpu->config().vocab_size;
    auto a = gpu->new_session(), b = gpu_b->new_session();
    std::vector<float> l(static_cast<size_t>(V));
    a->feed(c.ids.data(), 40, l.data(), false);
    int32_t next = argmax(l.data(), V);
    ASSERT_EQ(b->feed_greedy(c.ids.data(), 40), next) << prec;
    auto greedy_steps = [&](int n) {
      for (int i = 0; i < n; ++i) {
        a->feed(&next, 1, l.data(), false);
        const int32_t want = argmax(l.data(), V);
        ASSERT_EQ(b->feed_greedy(&next, 1), want) << prec << " position " << a->position();
        next = want;
      }
    };
    greedy_steps(30);  // eager steps, the capture, then steps continued from the run-ahead
    EXPECT_EQ(a->save(), b->save()) << prec << ": save drops the pending step";
    greedy_steps(5);
    // rollback with a step pending, then other ids (feed) and greedy again
    a->rollback(a->position() - 16);
    b->rollback(b->position() - 16);
    EXPECT_EQ(a->save(), b->save()) << prec << ": rollback";
    const auto la = feed_one_by_one(*a, c.ids.data() + 60, 6, V);
    const auto lb = feed_one_by_one(*b, c.ids.data() + 60, 6, V);
    EXPECT_EQ(la, lb) << prec;
    next = argmax(la.data() + 5 * V, V);
    greedy_steps(5);
    // feed_greedy of an id other than the pick (the pending step is dropped)
    a->feed(c.ids.data() + 70, 1, l.data(), false);
    EXPECT_EQ(b->feed_greedy(c.ids.data() + 70, 1), argmax(l.data(), V)) << prec;
    next = argmax(l.data(), V);
    greedy_steps(3);
    EXPECT_EQ(a->save(), b->save()) << prec << ": the end";
    EXPECT_EQ(a->tokens(), b->tokens()) << prec;
  }
}
#endif  // DSX_HAVE_CUDA
