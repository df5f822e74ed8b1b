// Where the weights and the session state of a V4.1 model live on N GPUs with expert
// parallelism (issue 28; the design in docs/multi-gpu.md), computed from the
// configuration and its tensor inventory (model/inventory.h) alone:
//
//  * routed experts: sharded. Every MoE layer splits its experts 0..E-1 into N contiguous
//    id ranges, the same ranges in every layer; rank r holds floor(E / N) experts, and the
//    first E % N ranks one more (so the ranges differ by at most one expert, and the lower
//    ranks carry the extra ones). N must be in [1, E].
//  * replicated on every GPU: embedding, head and final norm, attention (every projection,
//    norms, sinks), hyper-connections, compressors and indexers, the router, the shared
//    expert, the Engram projections (wkv, q / k weights) and the DSpark stages (with their
//    own routed experts: a draft runs on every rank without a collective).
//  * host memory (memory-mapped files, per-token row gathers): the Engram tables.
//  * session state: replicated. Attention is replicated, so every rank runs the attention
//    of every token of the sequence and holds the whole KV state (window rings, compressed
//    rows, index keys) in the compact forms of model/kv_formats.h. The MoE output is the
//    one collective of a layer: the ranks' partial sums are all-reduced
//    (model/expert_parallel.h).
//
// Bytes are those of the on-disk dtypes (FP8 e4m3 + ue8m0 scales, MXFP4 + scales, BF16,
// F32), i.e. what an uploader that keeps the stored formats places on a GPU.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"

namespace dsx {

// ---- the expert partition ------------------------------------------------------------------
struct ExpertRange {
  int begin = 0, end = 0;  // experts [begin, end)
  int count() const { return end - begin; }
  bool contains(int e) const { return e >= begin && e < end; }
};

// The ranges of `ranks` ranks over n_experts experts (see above). Throws dsx::Error naming
// the problem when ranks < 1, ranks > n_experts or n_experts < 1.
std::vector<ExpertRange> expert_ranges(int n_experts, int ranks);
// The rank that holds expert e (0 <= e < n_experts), consistent with expert_ranges.
int expert_rank(int expert, int n_experts, int ranks);

// ---- the plan -----------------------------------------------------------------------------
enum class WeightGroup : int {
  embed,               // embed.weight
  head,                // head.weight, norm.weight
  attention,           // attn_norm, wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink
  hyper_connections,   // hc_attn_* / hc_ffn_*
  compressor_indexer,  // attn.compressor.*, attn.indexer.*
  router,              // ffn_norm, ffn.gate.weight / bias / bias_vl
  shared_expert,       // ffn.shared_experts.*
  routed_experts,      // ffn.experts.* (sharded)
  engram_projection,   // engram.wkv, engram.q_weight / k_weight
  dspark_stages,       // mtp.* (replicated)
  engram_tables,       // engram.embed (host memory)
  count,
};
constexpr int kWeightGroups = static_cast<int>(WeightGroup::count);
const char* weight_group_name(WeightGroup g);
enum class Residence { replicated, sharded, host };
Residence residence(WeightGroup g);

struct PlacementOptions {
  int64_t gpu_bytes = 141'000'000'000;     // memory of one GPU (H200: 141 GB)
  int64_t reserve_bytes = 6'000'000'000;   // per GPU: CUDA context, workspaces, NCCL buffers, graphs
  int64_t context = 65536;                 // tokens of session state per session, for the fit
  int sessions = 1;                        // resident sessions, for the fit
  int rollback_depth = 16;                 // (the state's ring sizes)
  bool dspark = true;                      // the DSpark stages are resident (when the config has them)
};

struct RankPlacement {
  int rank = 0;
  ExpertRange experts;                        // in every MoE layer
  std::array<int64_t, kWeightGroups> bytes{};  // on this GPU (engram_tables: 0)
  int64_t weight_bytes = 0;                   // sum of bytes
  int64_t state_bytes = 0;                    // options.sessions x (fixed + per token x context)
  int64_t total_bytes = 0;                    // weights + state + reserve
  bool fits = false;                          // total_bytes <= options.gpu_bytes
  // one decoded token with uniform routing: expected routed experts of a layer computed here
  double expected_experts = 0;
};

struct PlacementPlan {
  ModelConfig cfg;
  int ranks = 0;
  int n_layers = 0, n_experts = 0, experts_per_tok = 0;
  PlacementOptions options;
  std::array<int64_t, kWeightGroups> model_bytes{};  // one copy of the model, by group
  int64_t host_bytes = 0;                            // Engram tables (memory-mapped)
  int64_t expert_bytes = 0;                          // one routed expert of one layer (w1 + w3 + w2)
  // session state, on every rank (replicated attention)
  int64_t state_fixed_bytes = 0;                     // window and compressor rings
  double state_bytes_per_token = 0;                  // compressed rows, index keys, token id
  std::vector<RankPlacement> per_rank;

  // ---- one decoded token (the decode step's critical path) --------------------------------
  // Bytes every rank reads for its replicated part (model/inventory.h decode_read_bytes:
  // one embedding row, the head, attention, hc, router, shared expert, Engram wkv; no
  // DSpark stage), the Engram rows gathered from host memory, and the expected number of
  // routed experts of one layer on the busiest rank for one token with uniform routing
  // (the token's K distinct experts drawn uniformly: a multivariate hypergeometric over the
  // ranks' ranges).
  int64_t decode_replicated_bytes = 0;
  int64_t decode_host_gather_bytes = 0;
  double expected_max_experts = 0;
  // Bytes of one decode step on the busiest rank at `context` tokens: the replicated part,
  // expected_max_experts experts in every layer, and the state read (cost_model.h
  // decode_state_bytes).
  double decode_bytes_busiest_rank(int64_t context) const;
  // Bytes of one all-reduce of the MoE output per layer and decoded token (f32 [D]).
  int64_t combine_bytes_per_layer = 0;

  bool fits() const;  // every rank fits
};

// The plan of cfg (a V4.1 config) on `ranks` GPUs. Throws dsx::Error naming the problem for
// a bad rank count (< 1, or more ranks than routed experts) or a non-V4.1 config.
PlacementPlan plan_placement(const ModelConfig& cfg, int ranks, const PlacementOptions& o = {});

// A readable table: per group where it lives and its bytes per GPU, per rank its experts,
// weights, state and whether it fits, the host memory, and the decode figures. `title`
// names the model.
std::string format_placement(const PlacementPlan& p, const std::string& title);

}  // namespace dsx
