// Optional per-stage timing of a forward step (DSX_PROFILE=1: decode steps, which then
// run eagerly, without a graph; DSX_PROFILE=prefill: prefill chunks): events between
// stages, summed per stage name, printed when the engine ends. The first profiled step
// of a process pays one-time costs (kernel modules loaded on first use, the cuBLAS
// handle and its heuristics: ~280 ms in the first 2048-token chunk of 8 release
// layers); when later steps follow it is reported on its own line and left out of the
// per-stage figures.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "util/switches.h"

namespace dsx::cuda {

class StageTimer {
 public:
  StageTimer() {
    const std::string e = sw::get_str(sw::Id::PROFILE);
    on_ = !e.empty() && e != "0";
    prefill_ = e == "prefill";
  }
  bool on() const { return on_; }
  void set_active(int T) {
    active_ = prefill_ ? T > 1 : T == 1;
    if (active_) tokens_ += T;
  }
  void mark(const char* name, cudaStream_t s) {
    if (!on_ || !active_) return;
    cudaEvent_t e;
    DSX_CUDA_CHECK(cudaEventCreate(&e));
    DSX_CUDA_CHECK(cudaEventRecord(e, s));
    marks_.push_back({name, e});
  }
  // Accumulates the recorded stages (synchronising) and clears them.
  void collect() {
    if (!on_ || marks_.empty()) return;
    DSX_CUDA_CHECK(cudaEventSynchronize(marks_.back().second));
    for (size_t i = 1; i < marks_.size(); ++i) {
      float ms = 0;
      DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second));
      auto& t = (steps_ == 0 ? first_ : totals_)[marks_[i].first];
      t.first += ms;
      t.second += 1;
    }
    for (auto& m : marks_) cudaEventDestroy(m.second);
    marks_.clear();
    if (steps_ == 0) first_tokens_ = tokens_;
    ++steps_;
  }
  ~StageTimer() {
    if (!on_ || steps_ == 0) return;
    double first = 0;
    for (const auto& [k, v] : first_) first += v.first;
    int n = steps_ - 1;
    int64_t tokens = tokens_ - first_tokens_;
    if (n == 0) {  // (one step: report it)
      totals_.swap(first_);
      n = 1;
      tokens = tokens_;
    } else {
      std::fprintf(stderr, "# DSX_PROFILE (%s): first step %.3f ms (%lld tokens; one-time costs), not counted below\n",
                   prefill_ ? "prefill" : "decode", first, static_cast<long long>(first_tokens_));
    }
    double total = 0;
    for (const auto& [k, v] : totals_) total += v.first;
    std::fprintf(stderr, "# DSX_PROFILE (%s): %d steps of %.1f tokens, %.3f ms per step\n", prefill_ ? "prefill" : "decode",
                 n, static_cast<double>(tokens) / n, total / n);
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [k, v] : totals_) rows.push_back({v.first, k});
    std::sort(rows.rbegin(), rows.rend());
    for (const auto& [ms, k] : rows)
      std::fprintf(stderr, "#   %-22s %9.1f us/step %6.1f%%  (%d launches/step)\n", k.c_str(), 1000 * ms / n,
                   100 * ms / total, totals_[k].second / n);
  }

 private:
  bool on_ = false, prefill_ = false;
  bool active_ = false;
  int64_t tokens_ = 0, first_tokens_ = 0;
  int steps_ = 0;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  std::map<std::string, std::pair<double, int>> totals_, first_;
};

}  // namespace dsx::cuda
