// The streams and events of an engine's forward passes: the session stream (every
// pass runs on it), three side streams for the attention's independent chains and one
// for the hc mixing coefficients (graph branches of decode), a copy stream for the
// host Engram gathers of the greedy run-ahead, and the events that fork and join them.
#pragma once
#include <cuda_runtime.h>

namespace dsx::cuda {

struct Streams {
  Streams();
  ~Streams();
  Streams(const Streams&) = delete;
  Streams& operator=(const Streams&) = delete;

  cudaStream_t main = nullptr;
  // decode: side streams for the independent chains of the attention (0: window KV,
  // 1: compressor, 2: the indexer weights of index layers; join 3: side 1's projection
  // store)
  cudaStream_t side[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t ev_fork = nullptr, ev_join[4] = {nullptr, nullptr, nullptr, nullptr};
  cudaEvent_t ev_kv_fork = nullptr;  // side 0 after the joint wq_a / wkv launch
  // decode: the hc_mix coefficients of a site (needed only by the next site's pass) are
  // computed on a side stream while the main stream normalises and goes on
  cudaStream_t side_hc = nullptr;
  cudaEvent_t ev_hc_fork = nullptr, ev_hc_join = nullptr;
  cudaEvent_t ev_end[4] = {nullptr, nullptr, nullptr, nullptr};
  // the greedy run-ahead's Engram gathers and ring stashes
  cudaStream_t copy = nullptr;
  cudaEvent_t ev_engram = nullptr, ev_pick = nullptr;
  // DSX_GRAPH_TIMING
  cudaEvent_t gt0 = nullptr, gt1 = nullptr, gt0_ahead = nullptr;
  bool side_prio = true;  // side streams at the highest priority (SIDE_PRIO at creation)
};

}  // namespace dsx::cuda
