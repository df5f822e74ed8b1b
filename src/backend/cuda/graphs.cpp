#include "backend/cuda/graphs.h"

#include <algorithm>
#include <tuple>

namespace dsx::cuda {

bool GraphKey::operator<(const GraphKey& o) const {
  return std::tie(sessions, rows, bounds, heads, head, pick, pick_in_head, taps) <
         std::tie(o.sessions, o.rows, o.bounds, o.heads, o.head, o.pick, o.pick_in_head, o.taps);
}

void GraphCache::destroy(GraphEntry& e) {
  if (e.a) cudaGraphExecDestroy(e.a);
  if (e.b) cudaGraphExecDestroy(e.b);
  e.a = e.b = nullptr;
}

GraphEntry* GraphCache::find(const GraphKey& k) {
  auto it = m_.find(k);
  if (it == m_.end()) return nullptr;
  it->second.last_use = ++clock_;
  return &it->second;
}

GraphEntry& GraphCache::at(const GraphKey& k) {
  if (GraphEntry* e = find(k)) return *e;
  while (m_.size() >= max_) {
    auto lru = std::min_element(m_.begin(), m_.end(),
                                [](const auto& x, const auto& y) { return x.second.last_use < y.second.last_use; });
    destroy(lru->second);
    m_.erase(lru);
  }
  GraphEntry& e = m_[k];
  e.last_use = ++clock_;
  return e;
}

void GraphCache::drop_session(uint64_t id) {
  for (auto it = m_.begin(); it != m_.end();) {
    if (std::find(it->first.sessions.begin(), it->first.sessions.end(), id) != it->first.sessions.end()) {
      destroy(it->second);
      it = m_.erase(it);
    } else {
      ++it;
    }
  }
}

void GraphCache::clear() {
  for (auto& [k, e] : m_) destroy(e);
  m_.clear();
}

}  // namespace dsx::cuda
