// Engram n-gram hashing (spec model-v41.md §3.2.2): hash multipliers drawn with
// NumPy's default_rng (PCG64 seeded through SeedSequence, bounded integers by
// Lemire's method), prime bucket sizes and per-layer offsets.
#pragma once
#include <cstdint>
#include <vector>

#include "model/config.h"

namespace dsx {

// NumPy `np.random.default_rng(seed).integers(0, high, size=n, dtype=np.int64)`
// for a non-negative integer seed and high > 2^32 (the only case the model uses).
std::vector<int64_t> numpy_default_rng_integers(uint64_t seed, int64_t high, int n);

// Prime bucket sizes of every engram layer, order-major (n-gram order, then head):
// for each order the walk restarts at engram_vocab_size - 1 and takes the next
// prime not handed out before (spec §3.2.2).
std::vector<std::vector<int64_t>> engram_bucket_primes(int n_layers, int max_ngram, int n_heads, int64_t vocab_size);

struct EngramLayout {
  int n_layers = 0;        // engram layers
  int max_ngram = 0;       // N (orders 2..N)
  int n_heads = 0;
  int n_cols = 0;          // (N - 1) * n_heads
  int64_t pad_compressed = 0;
  // per engram layer
  std::vector<std::vector<int64_t>> multipliers;  // [layer][N]
  std::vector<std::vector<int64_t>> primes;       // [layer][n_cols] (order-major)
  std::vector<std::vector<int64_t>> offsets;      // [layer][n_cols]

  // Builds the layout for `cfg`; checks every layer's primes sum to its
  // engram_num_embeddings. pad_compressed = cmap[engram_pad_id].
  static EngramLayout build(const ModelConfig& cfg, int64_t pad_compressed);

  // Row ids of engram layer `layer` for the token at absolute position t. hist[i]
  // is the compressed id of position hist_start + i (< 0 = DEAD) and covers
  // positions max(0, t - max_ngram + 1) .. t.
  void row_ids(int layer, const int32_t* hist, int64_t hist_start, int64_t t, int64_t* out) const;
};

}  // namespace dsx
