#include "model/engram.h"

#include <limits>
#include <set>

#include "util/error.h"

namespace dsx {

namespace {

// ---- NumPy SeedSequence (pool size 4, 32-bit words) ----
constexpr uint32_t kInitA = 0x43b0d7e5u, kMultA = 0x931e8875u, kInitB = 0x8b51f9ddu, kMultB = 0x58f38dedu;
constexpr uint32_t kMixMultL = 0xca01f9ddu, kMixMultR = 0x4973f715u;
constexpr int kXShift = 16, kPool = 4;

uint32_t hashmix(uint32_t value, uint32_t& hash_const) {
  value ^= hash_const;
  hash_const *= kMultA;
  value *= hash_const;
  value ^= value >> kXShift;
  return value;
}
uint32_t mix(uint32_t x, uint32_t y) {
  uint32_t r = kMixMultL * x - kMixMultR * y;
  r ^= r >> kXShift;
  return r;
}

std::vector<uint64_t> seed_sequence_state64(uint64_t seed, int n_words64) {
  std::vector<uint32_t> entropy;
  if (seed == 0) entropy.push_back(0);
  for (uint64_t s = seed; s > 0; s >>= 32) entropy.push_back(static_cast<uint32_t>(s & 0xffffffffu));
  uint32_t pool[kPool];
  uint32_t hc = kInitA;
  for (int i = 0; i < kPool; ++i) pool[i] = hashmix(i < static_cast<int>(entropy.size()) ? entropy[i] : 0u, hc);
  for (int s = 0; s < kPool; ++s)
    for (int d = 0; d < kPool; ++d)
      if (s != d) pool[d] = mix(pool[d], hashmix(pool[s], hc));
  for (size_t s = kPool; s < entropy.size(); ++s)
    for (int d = 0; d < kPool; ++d) pool[d] = mix(pool[d], hashmix(entropy[s], hc));
  // generate_state(n, uint64): 2n 32-bit words, little-endian pairs
  std::vector<uint32_t> out(static_cast<size_t>(2 * n_words64));
  uint32_t hb = kInitB;
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t v = pool[i % kPool];
    v ^= hb;
    hb *= kMultB;
    v *= hb;
    v ^= v >> kXShift;
    out[i] = v;
  }
  std::vector<uint64_t> r(static_cast<size_t>(n_words64));
  for (int i = 0; i < n_words64; ++i) r[i] = static_cast<uint64_t>(out[2 * i]) | (static_cast<uint64_t>(out[2 * i + 1]) << 32);
  return r;
}

// ---- PCG64 (XSL-RR 128/64) ----
using u128 = unsigned __int128;
struct Pcg64 {
  u128 state = 0, inc = 0;
  static constexpr u128 kMult = (static_cast<u128>(0x2360ed051fc65da4ull) << 64) | 0x4385df649fccf645ull;
  void step() { state = state * kMult + inc; }
  void seed(u128 initstate, u128 initseq) {
    state = 0;
    inc = (initseq << 1) | 1;
    step();
    state += initstate;
    step();
  }
  uint64_t next64() {
    step();
    const uint64_t hi = static_cast<uint64_t>(state >> 64), lo = static_cast<uint64_t>(state);
    const unsigned rot = static_cast<unsigned>(state >> 122);
    const uint64_t x = hi ^ lo;
    return (x >> rot) | (x << ((64 - rot) & 63));
  }
};

bool is_prime(int64_t n) {
  if (n < 2) return false;
  if (n % 2 == 0) return n == 2;
  for (int64_t d = 3; d * d <= n; d += 2)
    if (n % d == 0) return false;
  return true;
}

}  // namespace

std::vector<int64_t> numpy_default_rng_integers(uint64_t seed, int64_t high, int n) {
  DSX_CHECK(high > (int64_t{1} << 32), "numpy_default_rng_integers: high must exceed 2^32");
  auto st = seed_sequence_state64(seed, 4);
  Pcg64 g;
  g.seed((static_cast<u128>(st[0]) << 64) | st[1], (static_cast<u128>(st[2]) << 64) | st[3]);
  const uint64_t rng = static_cast<uint64_t>(high) - 1;  // inclusive range
  const uint64_t rng_excl = rng + 1;
  std::vector<int64_t> out;
  for (int i = 0; i < n; ++i) {
    u128 m = static_cast<u128>(g.next64()) * rng_excl;
    uint64_t leftover = static_cast<uint64_t>(m);
    if (leftover < rng_excl) {
      const uint64_t threshold = (std::numeric_limits<uint64_t>::max() - rng) % rng_excl;
      while (leftover < threshold) {
        m = static_cast<u128>(g.next64()) * rng_excl;
        leftover = static_cast<uint64_t>(m);
      }
    }
    out.push_back(static_cast<int64_t>(m >> 64));
  }
  return out;
}

std::vector<std::vector<int64_t>> engram_bucket_primes(int n_layers, int max_ngram, int n_heads, int64_t vocab_size) {
  std::set<int64_t> seen;
  std::vector<std::vector<int64_t>> out;
  for (int li = 0; li < n_layers; ++li) {
    std::vector<int64_t> primes;
    for (int g = 0; g < max_ngram - 1; ++g) {
      int64_t cur = vocab_size - 1;
      for (int h = 0; h < n_heads; ++h) {
        int64_t cand = cur + 1;
        while (!is_prime(cand) || seen.count(cand)) ++cand;
        seen.insert(cand);
        cur = cand;
        primes.push_back(cand);
      }
    }
    out.push_back(std::move(primes));
  }
  return out;
}

EngramLayout EngramLayout::build(const ModelConfig& c, int64_t pad_compressed) {
  EngramLayout L;
  L.n_layers = static_cast<int>(c.engram_layers.size());
  L.max_ngram = c.engram_max_ngram;
  L.n_heads = c.engram_n_heads;
  L.n_cols = (c.engram_max_ngram - 1) * c.engram_n_heads;
  L.pad_compressed = pad_compressed;
  const int64_t bound = std::max<int64_t>(1, (std::numeric_limits<int64_t>::max() / c.engram_compressed_vocab) / 2);
  const auto all_primes = engram_bucket_primes(L.n_layers, c.engram_max_ngram, c.engram_n_heads, c.engram_vocab_size);
  for (int li = 0; li < L.n_layers; ++li) {
    const int layer_id = c.engram_layers[static_cast<size_t>(li)];
    auto v = numpy_default_rng_integers(10007ull * static_cast<uint64_t>(layer_id), bound, c.engram_max_ngram);
    for (auto& x : v) x = 2 * x + 1;
    L.multipliers.push_back(v);
    const auto& primes = all_primes[static_cast<size_t>(li)];
    std::vector<int64_t> offsets;
    int64_t total = 0;
    for (int64_t p : primes) {
      offsets.push_back(total);
      total += p;
    }
    if (total != c.engram_num_embeddings[static_cast<size_t>(li)])
      fail("engram layer ", layer_id, ": the prime buckets sum to ", total, " rows but engram_num_embeddings says ",
           c.engram_num_embeddings[static_cast<size_t>(li)]);
    L.primes.push_back(primes);
    L.offsets.push_back(offsets);
  }
  return L;
}

void EngramLayout::row_ids(int layer, const int32_t* hist, int64_t hist_start, int64_t t, int64_t* out) const {
  const auto& mu = multipliers[static_cast<size_t>(layer)];
  bool blocked = false;
  int64_t rolling = 0;
  for (int s = 0; s < max_ngram; ++s) {
    int64_t src = (t - s >= 0) ? hist[t - s - hist_start] : -1;
    blocked = blocked || (t < s) || (src < 0);
    const int64_t c = blocked ? pad_compressed : src;
    const int64_t x = c * mu[static_cast<size_t>(s)];
    if (s == 0) {
      rolling = x;
      continue;
    }
    rolling ^= x;
    for (int h = 0; h < n_heads; ++h) {
      const int col = (s - 1) * n_heads + h;
      out[col] = rolling % primes[static_cast<size_t>(layer)][static_cast<size_t>(col)] +
                 offsets[static_cast<size_t>(layer)][static_cast<size_t>(col)];
    }
  }
}

}  // namespace dsx
