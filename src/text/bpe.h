// Byte-level BPE: the GPT-2 byte <-> code point map and the merge engine
// (chat-and-serving.md §1.3 steps 4-5).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace dsx::text {

namespace byte_level {
// Code point that represents byte `b` in vocab strings (0x21..0x7E, 0xA1..0xAC, 0xAE..0xFF
// map to themselves; the other 68 bytes, in increasing order, to U+0100..U+0143).
char32_t byte_to_char(uint8_t b);
// Inverse map; -1 for a code point that stands for no byte.
int char_to_byte(char32_t c);
// UTF-8 text of the byte-level form of `bytes` ("Hello world" -> "HelloĠworld").
std::string encode(std::string_view bytes);
// Bytes spelled by a byte-level string. Returns false (and leaves `out` unspecified)
// when `s` is not valid UTF-8 or contains a code point outside the map.
bool decode(std::string_view s, std::string* out);
}  // namespace byte_level

// The merge table: (left id, right id) -> (rank, merged id), open addressing.
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0;
    int32_t merged = 0;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};

  void reserve(size_t n);
  // Inserts or overwrites (a later line of `merges` wins, as in HF).
  void set(int32_t a, int32_t b, int32_t rank, int32_t merged);
  const Entry* find(int32_t a, int32_t b) const {
    if (slots_.empty()) return nullptr;
    const uint64_t key = pack(a, b);
    size_t i = hash(key) & mask_;
    for (;;) {
      const Entry& e = slots_[i];
      if (e.key == key) return &e;
      if (e.key == kEmpty) return nullptr;
      i = (i + 1) & mask_;
    }
  }
  size_t size() const { return count_; }

 private:
  static uint64_t pack(int32_t a, int32_t b) {
    return (uint64_t{static_cast<uint32_t>(a)} << 32) | static_cast<uint32_t>(b);
  }
  static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ULL) >> 29); }
  void grow();

  std::vector<Entry> slots_;
  size_t mask_ = 0;
  size_t count_ = 0;
};

// Applies the merges to a sequence of symbol ids in place: repeatedly merge the
// adjacent pair of lowest rank, the leftmost one on ties, until no pair has a rank.
// Short sequences use a linear scan, long ones a heap over a linked list
// (O(n log n)); both give identical results.
void bpe_merge(const MergeTable& merges, std::vector<int32_t>& syms);
// The two strategies, exposed for tests.
void bpe_merge_scan(const MergeTable& merges, std::vector<int32_t>& syms);
void bpe_merge_heap(const MergeTable& merges, std::vector<int32_t>& syms);

// Cache of BPE results per piece (piece bytes -> ids): open addressing over hashes,
// keys and ids in two arenas. Emptied when full. Not synchronised: callers lock.
class PieceCache {
 public:
  explicit PieceCache(size_t max_entries = size_t{1} << 18);
  static uint64_t hash(std::string_view piece);
  // Appends the ids cached for `piece` to `out`; false when absent.
  bool lookup(std::string_view piece, uint64_t h, std::vector<int32_t>& out) const;
  void insert(std::string_view piece, uint64_t h, const int32_t* ids, size_t n);
  void clear();
  size_t size() const { return count_; }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, key_len = 0;  // key_len 0: empty slot (keys are never empty)
    uint32_t val_off = 0, val_len = 0;
  };
  size_t max_entries_;
  std::vector<Slot> slots_;
  size_t mask_ = 0, count_ = 0;
  std::string keys_;
  std::vector<int32_t> vals_;
};

}  // namespace dsx::text
