#include "text/bpe.h"

#include <algorithm>
#include <array>
#include <climits>
#include <cstring>
#include <functional>

#include "text/unicode.h"

namespace dsx::text {

namespace byte_level {
namespace {

struct Tables {
  std::array<char32_t, 256> to_char{};
  std::array<int16_t, 0x144> to_byte{};  // indexed by code point < 0x144
  Tables() {
    to_byte.fill(-1);
    char32_t next = 0x100;
    for (int b = 0; b < 256; ++b) {
      const bool identity = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[b] = identity ? static_cast<char32_t>(b) : next++;
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

}  // namespace

char32_t byte_to_char(uint8_t b) { return tables().to_char[b]; }

int char_to_byte(char32_t c) { return c < 0x144 ? tables().to_byte[c] : -1; }

std::string encode(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) utf8::append(out, byte_to_char(b));
  return out;
}

bool decode(std::string_view s, std::string* out) {
  out->clear();
  size_t i = 0;
  while (i < s.size()) {
    const utf8::Decoded d = utf8::decode(s, i);
    if (d.status != utf8::Decoded::kValid) return false;
    const int b = char_to_byte(d.cp);
    if (b < 0) return false;
    out->push_back(static_cast<char>(b));
    i += d.len;
  }
  return true;
}

}  // namespace byte_level

// ---- merge table ------------------------------------------------------------

void MergeTable::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  if (cap <= slots_.size()) return;
  std::vector<Entry> old = std::move(slots_);
  slots_.assign(cap, Entry{});
  mask_ = cap - 1;
  count_ = 0;
  for (const Entry& e : old)
    if (e.key != kEmpty) set(static_cast<int32_t>(e.key >> 32), static_cast<int32_t>(e.key & 0xFFFFFFFFu), e.rank, e.merged);
}

void MergeTable::grow() { reserve(std::max<size_t>(16, count_ * 2 + 2)); }

void MergeTable::set(int32_t a, int32_t b, int32_t rank, int32_t merged) {
  if (slots_.empty() || (count_ + 1) * 2 > slots_.size()) grow();
  const uint64_t key = pack(a, b);
  size_t i = hash(key) & mask_;
  for (;;) {
    Entry& e = slots_[i];
    if (e.key == key) {
      e.rank = rank;
      e.merged = merged;
      return;
    }
    if (e.key == kEmpty) {
      e = Entry{key, rank, merged};
      ++count_;
      return;
    }
    i = (i + 1) & mask_;
  }
}

// ---- merging ------------------------------------------------------------------

namespace {
constexpr size_t kScanMax = 64;  // longest sequence handled by the linear scan
}

void bpe_merge_scan(const MergeTable& merges, std::vector<int32_t>& syms) {
  size_t n = syms.size();
  if (n < 2) return;
  if (n > kScanMax) {
    bpe_merge_heap(merges, syms);
    return;
  }
  // rank[i] / merged[i] describe the pair (syms[i], syms[i+1]).
  std::array<int32_t, kScanMax> rank, merged;
  auto look = [&](size_t i) {
    const MergeTable::Entry* e = merges.find(syms[i], syms[i + 1]);
    rank[i] = e ? e->rank : INT_MAX;
    merged[i] = e ? e->merged : -1;
  };
  for (size_t i = 0; i + 1 < n; ++i) look(i);
  for (;;) {
    size_t best = 0;
    int32_t best_rank = INT_MAX;
    for (size_t i = 0; i + 1 < n; ++i)
      if (rank[i] < best_rank) {
        best_rank = rank[i];
        best = i;
      }
    if (best_rank == INT_MAX) break;
    syms[best] = merged[best];
    // Remove symbol best+1 and the pair entry that started at it.
    for (size_t i = best + 1; i + 1 < n; ++i) {
      syms[i] = syms[i + 1];
      rank[i] = rank[i + 1];
      merged[i] = merged[i + 1];
    }
    --n;
    if (best > 0) look(best - 1);
    if (best + 1 < n) look(best);
  }
  syms.resize(n);
}

void bpe_merge_heap(const MergeTable& merges, std::vector<int32_t>& syms) {
  const size_t n = syms.size();
  if (n < 2) return;
  // A candidate merge: the pair (left, right) starting at `pos` when it was pushed.
  struct Item {
    int32_t rank, pos, left, right, merged;
    // Min-heap order: lowest rank first, leftmost on ties.
    bool operator>(const Item& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  // Per-thread work space: pieces come one after the other and can be long.
  struct Work {
    std::vector<int32_t> prev, next;
    std::vector<Item> heap;
  };
  thread_local Work w;
  auto& prev = w.prev;
  auto& next = w.next;
  auto& heap = w.heap;
  prev.resize(n);
  next.resize(n);
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    prev[i] = static_cast<int32_t>(i) - 1;
    next[i] = i + 1 < n ? static_cast<int32_t>(i + 1) : -1;
  }
  constexpr int32_t kDead = -2;  // prev[] of a symbol merged into its left neighbour
  auto push = [&](int32_t pos) {
    const int32_t nx = next[pos];
    if (nx < 0) return;
    if (const MergeTable::Entry* e = merges.find(syms[pos], syms[nx])) {
      heap.push_back(Item{e->rank, pos, syms[pos], syms[nx], e->merged});
      std::push_heap(heap.begin(), heap.end(), std::greater<Item>());
    }
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<Item>());
    const Item it = heap.back();
    heap.pop_back();
    const int32_t pos = it.pos;
    if (prev[pos] == kDead) continue;
    const int32_t nx = next[pos];
    // Stale entry: the pair at `pos` has changed since it was pushed.
    if (nx < 0 || syms[pos] != it.left || syms[nx] != it.right) continue;
    syms[pos] = it.merged;
    prev[nx] = kDead;
    next[pos] = next[nx];
    if (next[nx] >= 0) prev[next[nx]] = pos;
    if (prev[pos] >= 0) push(prev[pos]);
    push(pos);
  }
  size_t out = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) syms[out++] = syms[i];
  syms.resize(out);
}

void bpe_merge(const MergeTable& merges, std::vector<int32_t>& syms) {
  if (syms.size() <= kScanMax)
    bpe_merge_scan(merges, syms);
  else
    bpe_merge_heap(merges, syms);
}

// ---- piece cache ------------------------------------------------------------------

PieceCache::PieceCache(size_t max_entries) : max_entries_(std::max<size_t>(max_entries, 16)) {}

uint64_t PieceCache::hash(std::string_view piece) {
  const auto* p = reinterpret_cast<const unsigned char*>(piece.data());
  size_t n = piece.size();
  uint64_t h = 0x243F6A8885A308D3ULL ^ (n * 0x9E3779B97F4A7C15ULL);
  auto mix = [&](uint64_t w) {
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  };
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    mix(w);
  }
  if (n) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    mix(w);
  }
  h *= 0x94D049BB133111EBULL;
  return h ^ (h >> 29);
}

bool PieceCache::lookup(std::string_view piece, uint64_t h, std::vector<int32_t>& out) const {
  if (slots_.empty()) return false;
  for (size_t i = h & mask_;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.key_len == 0) return false;
    if (s.hash == h && s.key_len == piece.size() && std::memcmp(keys_.data() + s.key_off, piece.data(), piece.size()) == 0) {
      out.insert(out.end(), vals_.begin() + s.val_off, vals_.begin() + s.val_off + s.val_len);
      return true;
    }
  }
}

void PieceCache::insert(std::string_view piece, uint64_t h, const int32_t* ids, size_t n) {
  if (piece.empty()) return;
  if (slots_.empty()) {
    size_t cap = 16;
    while (cap < max_entries_ * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
    mask_ = cap - 1;
  }
  if (count_ >= max_entries_ || keys_.size() + piece.size() > UINT32_MAX || vals_.size() + n > UINT32_MAX) clear();
  size_t i = h & mask_;
  for (;; i = (i + 1) & mask_) {
    const Slot& s = slots_[i];
    if (s.key_len == 0) break;
    if (s.hash == h && s.key_len == piece.size() && std::memcmp(keys_.data() + s.key_off, piece.data(), piece.size()) == 0)
      return;  // already there
  }
  Slot& s = slots_[i];
  s.hash = h;
  s.key_off = static_cast<uint32_t>(keys_.size());
  s.key_len = static_cast<uint32_t>(piece.size());
  s.val_off = static_cast<uint32_t>(vals_.size());
  s.val_len = static_cast<uint32_t>(n);
  keys_.append(piece);
  vals_.insert(vals_.end(), ids, ids + n);
  ++count_;
}

void PieceCache::clear() {
  std::fill(slots_.begin(), slots_.end(), Slot{});
  keys_.clear();
  vals_.clear();
  count_ = 0;
}

}  // namespace dsx::text
