// util/threadpool: parallel_for covers every index exactly once, region after region,
// when consecutive regions split into different numbers of chunks (a worker still leaving
// one region must not take part in the next one's chunks), and nested calls run serially.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "test_watchdog.h"
#include "util/threadpool.h"

namespace {

struct ThreadsScope {  // more workers than cores: preemption inside a region gets likely
  int old;
  explicit ThreadsScope(int n) : old(dsx::num_threads()) { dsx::set_num_threads(n); }
  ~ThreadsScope() { dsx::set_num_threads(old); }
};

}  // namespace

TEST(ThreadPool, RegionsOfChangingSizesCoverEachIndexOnce) {
  ThreadsScope threads(std::max(4, 2 * static_cast<int>(std::thread::hardware_concurrency())));
  dsx_test::Watchdog dog(240, [] { return std::string("ThreadPool: a parallel_for region never ended"); });
  constexpr int kMax = 64;
  std::vector<std::atomic<int>> hits(kMax);
  std::atomic<uint64_t> sink{0};
  int64_t bad = 0, first_bad = -1, regions = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; bad == 0 && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(8); ++it, ++regions) {
    const int64_t n = 1 + (it * 7 + it / 5) % kMax;  // 1 .. 4 x threads chunks, varying
    for (auto& h : hits) h.store(0, std::memory_order_relaxed);
    dsx::parallel_for(n, 1, [&](int64_t b, int64_t e) {
      uint64_t x = static_cast<uint64_t>(b) + 1;
      for (int k = 0; k < 200 * static_cast<int>(e - b); ++k) x = x * 6364136223846793005ull + 1442695040888963407ull;
      sink.fetch_add(x, std::memory_order_relaxed);  // a chunk of work long enough for the workers to join
      for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1, std::memory_order_relaxed);
    });
    for (int64_t i = 0; i < kMax; ++i) {
      const int want = i < n ? 1 : 0;
      if (hits[i].load() != want) {
        ++bad;
        if (first_bad < 0) first_bad = it;
      }
    }
  }
  EXPECT_EQ(bad, 0) << "first wrong region: " << first_bad << " of " << regions;
  std::printf("%lld regions\n", static_cast<long long>(regions));
}

TEST(ThreadPool, NestedCallsRunSerially) {
  ThreadsScope threads(4);
  std::atomic<int64_t> sum{0};
  dsx::parallel_for(16, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      dsx::parallel_for(10, 1, [&](int64_t b2, int64_t e2) {
        for (int64_t j = b2; j < e2; ++j) sum.fetch_add(i * 10 + j);
      });
  });
  EXPECT_EQ(sum.load(), 160 * 159 / 2);
}
