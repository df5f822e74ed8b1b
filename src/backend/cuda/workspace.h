// What every forward pass of an engine shares, allocated once per engine (never per
// session): the activations of up to max_rows rows, the linear kernels' workspaces, the
// indexer's score rows for the engine's context capacity, the logits, the pinned host
// staging buffers. A pass of R rows (of one or several sessions) uses rows [0, R).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_model.h"
#include "kernels/cuda/kv_cache.h"

namespace dsx::cuda {

constexpr int kGemvMaxT = 16;   // up to this many rows use the weight-streaming GEMV
constexpr int kHeadRows = 256;
constexpr int kMoeDecodeRows = 8;  // rows per MoE decode launch (the tensor-core kernels' limit)  // rows per head product (all-row logits go out in blocks of this)

struct Workspace {
  Workspace(const DeviceModel& m, int max_rows, int64_t max_ctx, int64_t stash_bytes);
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  int max_rows = 0;
  int64_t max_ctx = 0;
  size_t ab = 4;  // bytes per activation element
  Arena buf;
  int64_t bytes = 0;  // device bytes

  // inputs
  int32_t* d_ids = nullptr;
  int64_t* d_engram_ids = nullptr;
  int64_t* d_iota = nullptr;
  uint8_t *engram_stage = nullptr, *engram_stage_scale = nullptr;
  // streams and mixing
  void *X = nullptr, *a = nullptr, *f = nullptr, *y = nullptr, *h = nullptr;
  float *pre0 = nullptr, *pa = nullptr, *qa = nullptr, *Ca = nullptr, *pf = nullptr, *qf = nullptr, *Cf = nullptr;
  void* hc_work = nullptr;
  unsigned* sig_hc = nullptr;  // one signal slot (two words, zero at rest)
  // attention
  void *q_lat = nullptr, *q_latn = nullptr, *q = nullptr, *kv_raw = nullptr, *o = nullptr, *zeta = nullptr;
  Fq8Rows chunk;
  float *kappa = nullptr, *gamma = nullptr;
  void* comp_act = nullptr;
  void *idx_q = nullptr, *idx_w = nullptr;
  float* idx_qf = nullptr;
  int64_t score_ld = 0, block_ld = 0;
  float *scores = nullptr, *bscores = nullptr;
  int32_t *counts = nullptr, *bcounts = nullptr, *cand = nullptr, *cand_count = nullptr, *sel = nullptr,
          *sel_count = nullptr;
  float* attn_work = nullptr;
  int attn_splits = 1;
  // MoE
  float *router_logits = nullptr, *route_w = nullptr;
  int32_t* route_ids = nullptr;
  void* moe_ws = nullptr;
  size_t moe_ws_bytes = 0;
  // staged QA8 codes between one-token producers and consumers
  uint32_t *xst_attn = nullptr, *xst_ffn = nullptr, *xst_q = nullptr, *xst_o = nullptr;
  // Engram
  void *u = nullptr, *yE = nullptr;
  // head and outputs
  float* logits = nullptr;  // [kHeadRows, vocab]
  int32_t* d_pick = nullptr;  // [max_rows] greedy ids of the head rows
  float* taps = nullptr;    // [max_rows, tap_width] (models with DSpark targets)
  // linear kernels
  void* gemm_ws = nullptr;
  size_t gemm_ws_bytes = 0;
  float* gemv_ws = nullptr;
  float* side_ws[3] = {nullptr, nullptr, nullptr};
  size_t gemv_ws_bytes = 0;
  // the greedy run-ahead's stash of ring slots (DeviceKVCache::stash_slots)
  uint8_t* ahead_stash = nullptr;

  // pinned host memory
  Pinned<uint8_t> engram_host_stage;
  Pinned<int64_t> h_engram_rows;
  Pinned<int32_t> h_ids;
  Pinned<float> h_logits;   // [kGemvMaxT, vocab] (last rows of up to this many feeds)
  Pinned<int32_t> h_pick;   // [max_rows]
  Pinned<uint8_t> stage;    // snapshot staging (kStageBytes)
  static constexpr size_t kStageBytes = size_t{16} << 20;
};

}  // namespace dsx::cuda
