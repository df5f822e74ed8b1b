// The V4.1 model on the device: every weight in its stored format (FP8 e4m3 with e8m0
// block scales, MXFP4 experts, BF16 / F32 vectors), uploaded once per engine into one
// arena, with the pairs that one-token decode reads in one launch placed side by side.
// A synthetic model (release shapes, random weights in the official formats,
// generated on the device) serves the benchmark.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise_types.h"
#include "kernels/cuda/moe.h"
#include "model/config.h"
#include "model/engram.h"
#include "model/qmatrix.h"
#include "model/weights.h"

namespace dsx::cuda {

// Device arena: one allocation holding many tensors (256-byte aligned).
class Arena {
 public:
  void reserve(size_t bytes) { buf_.alloc(bytes); }
  void* take(size_t bytes) {
    const size_t off = (used_ + 255) & ~size_t{255};
    DSX_CHECK(off + bytes <= buf_.size(), "device arena exhausted (", off + bytes, " > ", buf_.size(), ")");
    used_ = off + bytes;
    return static_cast<char*>(buf_.get()) + off;
  }
  size_t used() const { return used_; }
  size_t size() const { return buf_.size(); }

 private:
  DeviceBuffer buf_;
  size_t used_ = 0;
};

inline size_t aligned(size_t b) { return (b + 255) & ~size_t{255}; }

// Page-locked host memory (fast, truly asynchronous copies).
template <typename T>
class Pinned {
 public:
  Pinned() = default;
  explicit Pinned(size_t n) { resize(n); }
  ~Pinned() {
    if (p_) cudaFreeHost(p_);
  }
  Pinned(const Pinned&) = delete;
  Pinned& operator=(const Pinned&) = delete;
  void resize(size_t n) {
    if (p_) cudaFreeHost(p_);
    p_ = nullptr;
    n_ = n;
    if (n) DSX_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&p_), n * sizeof(T)));
  }
  T* data() { return p_; }
  size_t size() const { return n_; }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

struct DevLayer {
  float *attn_norm = nullptr, *ffn_norm = nullptr;
  QMatrix hc_attn_fn, hc_ffn_fn;
  float *hc_attn_base = nullptr, *hc_attn_scale = nullptr, *hc_ffn_base = nullptr, *hc_ffn_scale = nullptr;
  QMatrix wq_a, wq_b, wkv, wo_a, wo_b;
  float *q_norm = nullptr, *kv_norm = nullptr, *attn_sink = nullptr;
  QMatrix comp_wkv, comp_wgate;
  float* comp_norm = nullptr;
  QMatrix idx_wq_b, idx_weights_proj, idx_wk;
  // index layers: wq_b and idx_wq_b as one matrix [H hd + ih ihd, q_lora_rank] (placed
  // codes, codes, scales, scales: Uploader::pair), so that one-token decode takes both
  // products of the normalized q latent in one launch; rows == 0 where they are not
  // adjacent
  QMatrix wq_b_idx;
  // wq_a and wkv as one matrix [q_lora_rank + head_dim, D] (Uploader::pair): one-token
  // decode takes both products of the attention input in one launch on the session
  // stream; rows == 0 where they are not adjacent
  QMatrix wq_a_kv;
  // comp_wkv and comp_wgate (ratio > 1 KV sources) placed as a pair: both products of the
  // attention input in one launch (one token); rows == 0 where they are not adjacent
  QMatrix comp_kv_gate;
  float* idx_k_norm = nullptr;
  QMatrix gate;
  float* gate_bias = nullptr;
  MoeLayer moe;
  // Engram
  bool has_engram = false;
  QMatrix engram_wkv;
  float* engram_w = nullptr;
  const uint8_t* engram_table = nullptr;        // device-resident table (or null: host gather)
  const uint8_t* engram_table_scale = nullptr;
  const uint8_t* engram_host_table = nullptr;   // host table (mmap) for host gathers
  const uint8_t* engram_host_scale = nullptr;
  int64_t engram_rows = 0;
};

// ---------------------------------------------------------------------------
// The model on the device.
class DeviceModel {
 public:
  ModelConfig cfg;
  Act act = Act::F32;
  std::string fingerprint;
  QMatrix embed, head;
  float* norm = nullptr;
  std::vector<DevLayer> layers;
  float *main_inv_freq = nullptr, *comp_inv_freq = nullptr;
  EngramLayout engram;
  std::vector<int32_t> cmap;
  int64_t weight_bytes = 0;
  int64_t decode_weight_bytes = 0;
  std::shared_ptr<ModelFiles> files;  // keeps host mappings alive (host engram gathers)
  std::vector<uint8_t> synthetic_engram;  // synthetic model: small host table

  // progress (optional): the fraction of the weight bytes on the device, every ~1 %.
  static std::unique_ptr<DeviceModel> from_weights(const ModelConfig& cfg, const ModelWeights& w, Act act,
                                                   std::vector<int32_t> cmap,
                                                   const std::function<void(double)>& progress = {});
  static std::unique_ptr<DeviceModel> synthetic(const ModelConfig& cfg, Act act, uint64_t seed);

 private:
  Arena arena_;
  std::vector<DeviceBuffer> ptr_arrays_;

  friend struct Uploader;
};

}  // namespace dsx::cuda
