// Optional per-stage timing of a forward step (DSX_PROFILE=1: decode steps, which then
// run eagerly, without a graph; DSX_PROFILE=prefill: prefill chunks): events between
// stages, summed per stage name, printed when the engine ends.
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
      auto& t = totals_[marks_[i].first];
      t.first += ms;
      t.second += 1;
    }
    for (auto& m : marks_) cudaEventDestroy(m.second);
    marks_.clear();
    ++steps_;
  }
  ~StageTimer() {
    if (!on_ || steps_ == 0) return;
    double total = 0;
    for (const auto& [k, v] : totals_) total += v.first;
    std::fprintf(stderr, "# DSX_PROFILE (%s): %d steps of %.1f tokens, %.3f ms per step\n", prefill_ ? "prefill" : "decode",
                 steps_, static_cast<double>(tokens_) / steps_, total / steps_);
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [k, v] : totals_) rows.push_back({v.first, k});
    std::sort(rows.rbegin(), rows.rend());
    for (const auto& [ms, k] : rows)
      std::fprintf(stderr, "#   %-22s %9.1f us/step %6.1f%%  (%d launches/step)\n", k.c_str(), 1000 * ms / steps_,
                   100 * ms / total, totals_[k].second / steps_);
  }

 private:
  bool on_ = false, prefill_ = false;
  bool active_ = false;
  int64_t tokens_ = 0;
  int steps_ = 0;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  std::map<std::string, std::pair<double, int>> totals_;
};

}  // namespace dsx::cuda
