#include "util/threadpool.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "util/switches.h"

namespace dsx {

namespace {

thread_local bool t_in_worker = false;

class Pool {
 public:
  explicit Pool(int n) { resize(n); }
  ~Pool() { stop(); }

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  void resize(int n) {
    stop();
    stopping_ = false;
    for (int i = 0; i < n - 1; ++i) workers_.emplace_back([this, i] { loop(i); });
  }

  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
    const int nt = size();
    int64_t chunks = std::min<int64_t>(nt * 4, (n + grain - 1) / grain);
    if (chunks <= 1 || nt == 1 || t_in_worker) {
      fn(0, n);
      return;
    }
    std::unique_lock<std::mutex> lk(run_mu_);  // one parallel region at a time
    {
      std::lock_guard<std::mutex> g(mu_);
      fn_ = &fn;
      n_ = n;
      chunks_ = chunks;
      next_.store(0);
      done_ = 0;
      ++generation_;
    }
    cv_.notify_all();
    t_in_worker = true;
    work();
    t_in_worker = false;
    // Every chunk done and every worker that joined this region out of work(): a worker
    // still between its last claim and the end test would otherwise read the next
    // region's counter and chunk count, run a chunk twice and count it twice (seen: a
    // region that never ended, one that ended while a chunk still ran).
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [&] { return done_ == chunks_ && active_ == 0; });
    fn_ = nullptr;  // under the lock: no worker joins this region any more
  }

 private:
  void work() {
    for (;;) {
      int64_t c = next_.fetch_add(1);
      if (c >= chunks_) break;
      int64_t b = n_ * c / chunks_, e = n_ * (c + 1) / chunks_;
      if (b < e) (*fn_)(b, e);
      std::lock_guard<std::mutex> g(mu_);
      if (++done_ == chunks_) done_cv_.notify_all();
    }
  }

  void loop(int) {
    t_in_worker = true;
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stopping_ || (generation_ != seen && fn_ != nullptr); });
        if (stopping_) return;
        seen = generation_;
        ++active_;
      }
      work();
      std::lock_guard<std::mutex> g(mu_);
      if (--active_ == 0 && done_ == chunks_) done_cv_.notify_all();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t n_ = 0, chunks_ = 0, done_ = 0;
  int active_ = 0;  // workers inside work() for the current region
  std::atomic<int64_t> next_{0};
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

int default_threads() {
  if (const int64_t v = sw::get_int(sw::Id::THREADS); v > 0) return static_cast<int>(std::min<int64_t>(v, INT_MAX));
  unsigned hc = std::thread::hardware_concurrency();
  return hc ? static_cast<int>(hc) : 1;
}

Pool& pool() {
  static Pool p(default_threads());
  return p;
}

}  // namespace

int num_threads() { return pool().size(); }
void set_num_threads(int n) { pool().resize(std::max(1, n)); }

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  pool().run(n, std::max<int64_t>(1, grain), fn);
}

}  // namespace dsx
