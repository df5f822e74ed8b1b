// One layer's role in the V4.1 schedule (spec model-v41.md §1.4), derived once from the
// configuration and read by every consumer (both forwards, the cost model, the DSpark
// taps): which compressed cache it reads, whether it owns the compressor, whether it
// scores its own top-k, and the candidate-block rule.
#pragma once
#include <string>

#include "model/config.h"

namespace dsx {

struct LayerPlan {
  int layer = 0;
  int ratio = 0;              // compress ratio: 0 = window only (main RoPE table)
  bool kv_source = false;     // owns a compressor, the compressed rows and the index keys
  bool index_source = false;  // scores its own top-k set (else reuses the last one published)
  int source = -1;            // the KV source whose compressed cache it reads (nearest <= layer)
  // §3.4.6 the candidate rule: the candidate source publishes, per query, the blocks of
  // candidate_block_size rows with the best block scores (the newest block pinned);
  // index sources after it score only rows of those blocks.
  bool candidate_source = false;
  bool uses_candidates = false;
  int engram = -1;            // position among the Engram layers (Engram applied before it), -1 none
  int tap = -1;               // position among the DSpark targets (its input is tapped), -1 none

  bool compressed() const { return ratio > 0; }
  bool comp_rope() const { return ratio > 0; }  // compress RoPE table (else main)
};

LayerPlan layer_plan(const ModelConfig& c, int layer);

// One line per layer ("0 window | 2 r2 kv-source index ..."), for `dsx inspect`-like output.
std::string describe_layer_plan(const ModelConfig& c);

}  // namespace dsx
