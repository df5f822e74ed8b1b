// The captured decode-sized passes of an engine, keyed by what a graph bakes in: the
// sessions (their state's device addresses), the rows of each, the context bound of
// each segment's indexer and top-k launches, and what the head does. A key first runs
// eagerly once (every kernel variant it selects sets its launch attributes), then is
// captured (two graphs when the host gathers Engram rows: the layers before the first
// Engram layer, then the rest) and replayed. Least recently used entries are dropped
// beyond a bound; a session's entries go with it.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <vector>

namespace dsx::cuda {

struct GraphKey {
  std::vector<uint64_t> sessions;
  std::vector<int> rows;
  std::vector<int64_t> bounds;
  std::vector<uint8_t> heads;  // per segment: its last row goes through the head
  int head = 0;                // Pass::Head
  bool pick = false, pick_in_head = false, taps = false;
  bool operator<(const GraphKey& o) const;
};

struct GraphEntry {
  cudaGraphExec_t a = nullptr;  // layers [0, split) (with the embedding), when split > 0
  cudaGraphExec_t b = nullptr;  // layers [split, n_layers) (with the head)
  int eager_runs = 0;
  uint64_t last_use = 0;
  bool captured() const { return b != nullptr; }
};

class GraphCache {
 public:
  explicit GraphCache(size_t max_entries = 64) : max_(max_entries) {}
  ~GraphCache() { clear(); }
  GraphCache(const GraphCache&) = delete;
  GraphCache& operator=(const GraphCache&) = delete;
  GraphEntry& at(const GraphKey& k);  // (creates an empty entry; may drop the least recently used)
  GraphEntry* find(const GraphKey& k);
  void drop_session(uint64_t id);
  void clear();
  size_t size() const { return m_.size(); }

 private:
  static void destroy(GraphEntry& e);
  size_t max_;
  uint64_t clock_ = 0;
  std::map<GraphKey, GraphEntry> m_;
};

}  // namespace dsx::cuda
