// A small persistent thread pool with a blocking parallel_for.
#pragma once
#include <cstdint>
#include <functional>

namespace dsx {

// Number of worker threads used by parallel_for (defaults to the hardware
// concurrency; DSX_THREADS overrides; set_num_threads changes it at runtime).
int num_threads();
void set_num_threads(int n);

// Calls fn(begin, end) on disjoint sub-ranges of [0, n) covering it, in parallel;
// returns when all are done. `grain` is the smallest range worth a task. Nested
// calls from inside a worker run serially.
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

}  // namespace dsx
