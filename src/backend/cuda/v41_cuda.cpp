// DeepSeek V4.1 forward on the GPU. The structure follows V41Cpu::forward (spec
// model-v41.md §3.7); section numbers refer to the spec.
#include "backend/cuda/v41_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <random>
#include <string>

#include "backend/cuda/step_kernels.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/compressor.h"
#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/engram_gate.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/hc.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/kv_cache.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/router.h"
#include "kernels/cuda/topk.h"
#include "model/engram.h"
#include "model/rope.h"
#include "model/weights.h"
#include "model/kv_state.h"
#include "util/error.h"

namespace dsx {

using namespace dsx::cuda;

namespace {

constexpr int kGemvMaxT = 16;  // up to this many rows use the weight-streaming GEMV

// DSX_HC_BRANCH=0 keeps the hc_mix coefficients on the session stream
bool hc_off_branch() {
  static const bool v = env_int("DSX_HC_BRANCH", 1) == 0;
  return v;
}

// DSX_STAGED_X=0: the one-token consumers quantize their inputs themselves instead of
// copying the QA8 codes their producers stage for them (hc_finish for wq_a, wkv and the
// MoE up projection, wq_b for idx_wq_b, wo_a for wo_b)
bool staged_x_enabled() {
  static const bool v = env_int("DSX_STAGED_X", 1) != 0;
  return v;
}

// DSX_JOINT_Q=0: one-token decode of index layers launches idx_wq_b after wq_b (default:
// one launch over both matrices, DevLayer::wq_b_idx)
bool joint_q_enabled() {
  static const bool v = env_int("DSX_JOINT_Q", 1) != 0;
  return v;
}

// DSX_JOINT_QKV=0: one-token decode launches wkv on its side stream beside wq_a (default:
// one launch over both matrices, DevLayer::wq_a_kv, then kv_finish on the side stream)
bool joint_qkv_enabled() {
  static const bool v = env_int("DSX_JOINT_QKV", 1) != 0;
  return v;
}

// DSX_SIDE_BPS=n: one-wave streaming products on side streams (the compressor's BF16
// comp_kv_gate, the indexer weights) take at most n blocks per SM (0: as many as fit).
// s17 timelines: the compressor's 396 blocks filled every SM at the side streams' high
// priority, and the joint wq_b / idx_wq_b launched after them waited ~5 us for SMs.
int side_blocks_per_sm() {
  static const int v = env_int("DSX_SIDE_BPS", 1);
  return v;
}

// DSX_BRANCHES=0: decode on the session stream only (no side-stream graph branches)
bool branches_enabled() {
  static const bool v = env_int("DSX_BRANCHES", 1) != 0;
  return v;
}

// DSX_SIDE_PRIO=0: the decode graph's side streams (window KV, compressor and indexer
// weights, Sinkhorn) at the default priority instead of the highest (the graphs are
// instantiated with per-node priorities, so that the side kernels' blocks are scheduled
// before pending blocks of the main stream's kernels)
bool side_prio_enabled() {
  static const bool v = env_int("DSX_SIDE_PRIO", 1) != 0;
  return v;
}

// DSX_RUN_AHEAD=0: greedy decode waits for the host between steps (no run-ahead)
bool run_ahead_enabled() {
  static const bool v = env_int("DSX_RUN_AHEAD", 1) != 0;
  return v;
}

// DSX_ENGRAM_OVERLAP=0: decode gathers the host Engram rows before the step's graph
// (default: while the layers before the first Engram layer run)
bool engram_overlap_enabled() {
  static const bool v = env_int("DSX_ENGRAM_OVERLAP", 1) != 0;
  return v;
}

// DSX_SIGNALS=0: the session stream waits for the Sinkhorn branch by a graph edge (event
// join) before the next hc pass instead of the pass waiting for its signal in the kernel
bool signals_enabled() {
  static const bool v = env_int("DSX_SIGNALS", 1) != 0;
  return v;
}

// DSX_TILED=0: the FP8 / MXFP4 weights uploaded row-major instead of in the 16-row tile
// layout (qmatrix.h: each 1 KB span the weight kernels read is one contiguous block)
bool tiled_weights_enabled() {
  static const bool v = env_int("DSX_TILED", 1) != 0;
  return v;
}

// DSX_ATTN_MMA=0: CUDA-core attention in BF16 mode
bool attn_mma_enabled() {
  static const bool v = env_int("DSX_ATTN_MMA", 1) != 0;
  return v;
}

// ---------------------------------------------------------------------------
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

size_t aligned(size_t b) { return (b + 255) & ~size_t{255}; }

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

  static std::unique_ptr<DeviceModel> from_weights(const ModelConfig& cfg, const ModelWeights& w, Act act,
                                                   std::vector<int32_t> cmap);
  static std::unique_ptr<DeviceModel> synthetic(const ModelConfig& cfg, Act act, uint64_t seed);

 private:
  Arena arena_;
  std::vector<DeviceBuffer> ptr_arrays_;

  friend struct Uploader;
};

// Places host tensors (or random ones) into the arena.
struct Uploader {
  DeviceModel& m;
  bool synthetic = false;
  uint64_t seed = 1;
  uint64_t counter = 0;
  bool sizing = true;  // first pass counts bytes, second pass copies
  size_t bytes = 0;

  void* place(const void* host, size_t n, int kind = 0, float std = 0.02f, float mean = 0.0f, int center = 120) {
    if (sizing) {
      bytes += aligned(n);
      return nullptr;
    }
    void* d = m.arena_.take(n);
    if (host) {
      DSX_CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    } else {
      fill_random(d, static_cast<int64_t>(n), kind, seed * 1000003ull + (++counter), std, mean, center, 1, nullptr);
    }
    return d;
  }
  // The e8m0 scales of FP8 matrix h (synthetic: codes have std ~64, scales
  // 2^-(6 + log2 sqrt K) give weights of std ~K^-1/2).
  const uint8_t* fp8_scales(const QMatrix& h) {
    const int center = 127 - 6 - static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(h.cols))));
    return static_cast<const uint8_t*>(place(h.scale, static_cast<size_t>(h.scale_bytes()), 2, 0, 0, center));
  }
  // The data of FP8 / MXFP4 matrix h, in the tile layout when `tiled` (random when
  // synthetic: any layout of random codes is the same random matrix).
  const uint8_t* quant_data(const QMatrix& h, bool tiled, int kind) {
    const size_t n = static_cast<size_t>(h.data_bytes());
    if (!tiled || !h.data || sizing) return static_cast<const uint8_t*>(place(h.data, n, kind));
    std::vector<uint8_t> t(n);
    tile16_pack(h.data, h.rows, h.row_bytes(), t.data());
    return static_cast<const uint8_t*>(place(t.data(), n, kind));
  }
  // tile: the matrix may take the tile layout (when it fits and DSX_TILED is not 0).
  QMatrix matrix(const QMatrix& h, bool tile = true) {
    QMatrix d = h;
    const int64_t K = h.cols;
    d.tiled = tile && tiled_weights_enabled() && tile16_fits(h);
    switch (h.fmt) {
      case WFormat::F32:
        d.data = static_cast<const uint8_t*>(place(h.data, static_cast<size_t>(h.data_bytes()), 4, 0.02f));
        break;
      case WFormat::BF16:
        d.data = static_cast<const uint8_t*>(place(h.data, static_cast<size_t>(h.data_bytes()), 3, 1.0f / std::sqrt(float(K))));
        break;
      case WFormat::FP8_BLOCK:
        d.data = quant_data(h, d.tiled, 0);
        d.scale = fp8_scales(h);
        break;
      case WFormat::MXFP4: {
        const int center = 127 - 1 - static_cast<int>(std::lround(0.5 * std::log2(static_cast<double>(K))));
        d.data = quant_data(h, d.tiled, 1);
        d.scale = static_cast<const uint8_t*>(place(h.scale, static_cast<size_t>(h.scale_bytes()), 2, 0, 0, center));
        break;
      }
    }
    if (!sizing) m.weight_bytes += h.bytes();
    return d;
  }
  // Two matrices placed as a pair: FP8 matrices of one width and scale block go codes,
  // codes, scales, scales, and the joint view [n1 + n2, K] is returned when the second
  // follows the first in both (rows of the first a multiple of the scale block); BF16 / F32
  // matrices of one format and width, one after the other; else a view with rows == 0.
  QMatrix pair(const QMatrix& h1, const QMatrix& h2, QMatrix& d1, QMatrix& d2) {
    QMatrix j;
    if (!(h1.fmt == WFormat::FP8_BLOCK && h2.fmt == WFormat::FP8_BLOCK && h1.cols == h2.cols && h1.block == h2.block)) {
      d1 = matrix(h1);
      d2 = matrix(h2);
      const bool plain = h1.fmt == h2.fmt && (h1.fmt == WFormat::BF16 || h1.fmt == WFormat::F32) && h1.cols == h2.cols;
      if (plain && !sizing && d1.data + h1.data_bytes() == d2.data) {
        j = d1;
        j.rows = h1.rows + h2.rows;
        j.name = h1.name + "+" + h2.name;
      }
      return j;
    }
    d1 = h1, d2 = h2;
    // both in the tile layout or neither (the joint view has one layout)
    d1.tiled = d2.tiled = tiled_weights_enabled() && tile16_fits(h1) && tile16_fits(h2);
    d1.data = quant_data(h1, d1.tiled, 0);
    d2.data = quant_data(h2, d2.tiled, 0);
    d1.scale = fp8_scales(h1);
    d2.scale = fp8_scales(h2);
    if (sizing) return j;
    m.weight_bytes += h1.bytes() + h2.bytes();
    if (h1.rows % h1.block == 0 && d1.data + h1.data_bytes() == d2.data && d1.scale + h1.scale_bytes() == d2.scale) {
      j = d1;
      j.rows = h1.rows + h2.rows;
      j.name = h1.name + "+" + h2.name;
    }
    return j;
  }
  float* vec(const std::vector<float>& v, size_t n, float mean = 1.0f, float std = 0.0f) {
    return static_cast<float*>(place(v.empty() ? nullptr : v.data(), n * 4, 4, std, mean));
  }
};

QMatrix host_shape(WFormat f, int64_t n, int64_t k, int block, const std::string& name) {
  QMatrix q;
  q.fmt = f;
  q.rows = n;
  q.cols = k;
  q.block = f == WFormat::MXFP4 ? 32 : block;
  q.name = name;
  return q;
}

// One upload / synthesis pass over every tensor, in a fixed order. `hw` may be null
// (synthetic model: shapes from the config, random device data).
void upload_pass(Uploader& u, const ModelConfig& c, const ModelWeights* hw) {
  DeviceModel& m = u.m;
  const int64_t D = c.hidden, M = c.hc_mult, mix = c.hc_mix_dim(), H = c.n_heads, hd = c.head_dim;
  const int64_t ql = c.q_lora_rank, G = c.o_groups, ol = c.o_lora_rank, E = c.n_routed_experts, I = c.moe_inter;
  const int B = c.quant_block;
  auto mat = [&](const QMatrix* h, WFormat f, int64_t n, int64_t k, const char* name, bool tile = true) {
    return u.matrix(h ? *h : host_shape(f, n, k, B, name), tile);
  };
  const std::vector<float> none;
  m.embed = mat(hw ? &hw->embed : nullptr, WFormat::BF16, c.vocab_size, D, "embed");
  m.head = mat(hw ? &hw->head : nullptr, WFormat::BF16, c.vocab_size, D, "head");
  m.norm = u.vec(hw ? hw->norm : none, static_cast<size_t>(D));
  m.layers.resize(static_cast<size_t>(c.n_layers));
  for (int l = 0; l < c.n_layers; ++l) {
    DevLayer& L = m.layers[static_cast<size_t>(l)];
    const LayerWeights* h = hw ? &hw->layers[static_cast<size_t>(l)] : nullptr;
    L.attn_norm = u.vec(h ? h->attn_norm : none, static_cast<size_t>(D));
    L.ffn_norm = u.vec(h ? h->ffn_norm : none, static_cast<size_t>(D));
    L.hc_attn_fn = mat(h ? &h->hc_attn_fn : nullptr, WFormat::F32, mix, M * D, "hc_attn_fn");
    L.hc_ffn_fn = mat(h ? &h->hc_ffn_fn : nullptr, WFormat::F32, mix, M * D, "hc_ffn_fn");
    L.hc_attn_base = u.vec(h ? h->hc_attn_base : none, static_cast<size_t>(mix), 0.0f, 0.1f);
    L.hc_attn_scale = u.vec(h ? h->hc_attn_scale : none, 3);
    L.hc_ffn_base = u.vec(h ? h->hc_ffn_base : none, static_cast<size_t>(mix), 0.0f, 0.1f);
    L.hc_ffn_scale = u.vec(h ? h->hc_ffn_scale : none, 3);
    L.wq_a_kv = u.pair(h ? h->wq_a : host_shape(WFormat::FP8_BLOCK, ql, D, B, "wq_a"),
                       h ? h->wkv : host_shape(WFormat::FP8_BLOCK, hd, D, B, "wkv"), L.wq_a, L.wkv);
    L.q_norm = u.vec(h ? h->q_norm : none, static_cast<size_t>(ql));
    if (c.is_index_source(l)) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      const QMatrix hq = h ? h->wq_b : host_shape(WFormat::FP8_BLOCK, H * hd, ql, B, "wq_b");
      const QMatrix hi = h ? h->idx_wq_b : host_shape(WFormat::FP8_BLOCK, ih * ihd, ql, B, "idx_wq_b");
      L.wq_b_idx = u.pair(hq, hi, L.wq_b, L.idx_wq_b);
    } else {
      L.wq_b = mat(h ? &h->wq_b : nullptr, WFormat::FP8_BLOCK, H * hd, ql, "wq_b");
    }
    L.kv_norm = u.vec(h ? h->kv_norm : none, static_cast<size_t>(hd));
    L.wo_a = mat(h ? &h->wo_a : nullptr, WFormat::FP8_BLOCK, G * ol, H * hd / G, "wo_a");
    L.wo_b = mat(h ? &h->wo_b : nullptr, WFormat::FP8_BLOCK, D, G * ol, "wo_b");
    L.attn_sink = u.vec(h ? h->attn_sink : none, static_cast<size_t>(H), 0.0f, 0.5f);
    if (c.is_kv_source(l)) {
      const QMatrix hk = h ? h->comp_wkv : host_shape(WFormat::BF16, hd, D, B, "comp_wkv");
      if (c.ratio(l) > 1)
        L.comp_kv_gate = u.pair(hk, h ? h->comp_wgate : host_shape(WFormat::BF16, hd, D, B, "comp_wgate"), L.comp_wkv,
                                L.comp_wgate);
      else
        L.comp_wkv = u.matrix(hk);
      L.comp_norm = u.vec(h ? h->comp_norm : none, static_cast<size_t>(hd));
    }
    if (c.is_index_source(l)) {
      const int64_t ih = c.index_n_heads, ihd = c.index_head_dim;
      L.idx_weights_proj = mat(h ? &h->idx_weights_proj : nullptr, WFormat::BF16, ih, D, "weights_proj");
      if (c.is_kv_source(l)) {
        L.idx_wk = mat(h ? &h->idx_wk : nullptr, WFormat::BF16, ihd, hd, "idx_wk");
        L.idx_k_norm = u.vec(h ? h->idx_k_norm : none, static_cast<size_t>(ihd));
      }
    }
    L.gate = mat(h ? &h->gate : nullptr, WFormat::BF16, E, D, "gate");
    L.gate_bias = u.vec(h ? h->gate_bias : none, static_cast<size_t>(E), 0.0f, 0.05f);
    std::vector<const uint8_t*> p1(E), s1(E), p2(E), s2(E), p3(E), s3(E);
    // the routed experts take the tile layout all together or not at all (MoeLayer::tiled)
    const bool etile = moe_experts_tile16(D, I);
    L.moe.tiled = etile && tiled_weights_enabled();
    for (int64_t e = 0; e < E; ++e) {
      QMatrix d1 = mat(h ? &h->w1[e] : nullptr, WFormat::MXFP4, I, D, "w1", etile);
      QMatrix d3 = mat(h ? &h->w3[e] : nullptr, WFormat::MXFP4, I, D, "w3", etile);
      QMatrix d2 = mat(h ? &h->w2[e] : nullptr, WFormat::MXFP4, D, I, "w2", etile);
      DSX_CHECK(d1.tiled == L.moe.tiled && d3.tiled == L.moe.tiled && d2.tiled == L.moe.tiled,
                "expert ", e, " of layer ", l, ": MXFP4 experts of unexpected format");
      p1[e] = d1.data, s1[e] = d1.scale, p3[e] = d3.data, s3[e] = d3.scale, p2[e] = d2.data, s2[e] = d2.scale;
    }
    L.moe.n_experts = static_cast<int>(E);
    L.moe.hidden = D;
    L.moe.inter = I;
    L.moe.shared_w1 = mat(h ? &h->sw1 : nullptr, WFormat::FP8_BLOCK, I, D, "sw1");
    L.moe.shared_w3 = mat(h ? &h->sw3 : nullptr, WFormat::FP8_BLOCK, I, D, "sw3");
    L.moe.shared_w2 = mat(h ? &h->sw2 : nullptr, WFormat::FP8_BLOCK, D, I, "sw2");
    L.moe.swiglu_limit = c.swiglu_limit;
    L.moe.qblock = B;
    auto ptrs = [&](const std::vector<const uint8_t*>& v) -> const uint8_t* const* {
      return static_cast<const uint8_t* const*>(u.place(v.data(), v.size() * sizeof(void*)));
    };
    L.moe.w1 = ptrs(p1), L.moe.w1_scale = ptrs(s1), L.moe.w3 = ptrs(p3), L.moe.w3_scale = ptrs(s3);
    L.moe.w2 = ptrs(p2), L.moe.w2_scale = ptrs(s2);
    const int ei = c.engram_index(l);
    if (ei >= 0) {
      L.has_engram = true;
      const int64_t ncols = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads, ed = c.engram_head_dim;
      L.engram_wkv = mat(h ? &h->engram_wkv : nullptr, WFormat::FP8_BLOCK, (M + 1) * D, ncols * ed, "engram_wkv");
      L.engram_w = u.vec(h ? h->engram_w : none, static_cast<size_t>(M * D));
      L.engram_rows = c.engram_num_embeddings[static_cast<size_t>(ei)];
      const int64_t table_bytes = L.engram_rows * (ed + ed / 32);
      if (h && table_bytes <= (int64_t{4} << 30)) {
        // small enough: keep the table on the device
        L.engram_table = static_cast<const uint8_t*>(u.place(h->engram_table.data, static_cast<size_t>(L.engram_rows * ed)));
        L.engram_table_scale =
            static_cast<const uint8_t*>(u.place(h->engram_table.scale, static_cast<size_t>(L.engram_rows * ed / 32)));
      } else if (h) {
        L.engram_host_table = h->engram_table.data;
        L.engram_host_scale = h->engram_table.scale;
      }
    }
  }
  const auto mr = make_main_rope(c), cr = make_compress_rope(c);
  m.main_inv_freq = u.vec(mr.inv_freq, mr.inv_freq.size());
  m.comp_inv_freq = u.vec(cr.inv_freq, cr.inv_freq.size());
}

std::unique_ptr<DeviceModel> DeviceModel::from_weights(const ModelConfig& cfg, const ModelWeights& w, Act act,
                                                       std::vector<int32_t> cmap) {
  auto m = std::make_unique<DeviceModel>();
  m->cfg = cfg;
  m->act = act;
  m->files = w.files;
  m->fingerprint = w.files ? w.files->fingerprint() : "";
  m->cmap = std::move(cmap);
  if (!cfg.engram_layers.empty())
    m->engram = EngramLayout::build(cfg, m->cmap[static_cast<size_t>(cfg.engram_pad_id)]);
  Uploader sz{*m};
  upload_pass(sz, cfg, &w);
  m->arena_.reserve(sz.bytes);
  Uploader up{*m};
  up.sizing = false;
  upload_pass(up, cfg, &w);
  m->decode_weight_bytes = v41_decode_weight_bytes(cfg);
  return m;
}

std::unique_ptr<DeviceModel> DeviceModel::synthetic(const ModelConfig& cfg, Act act, uint64_t seed) {
  auto m = std::make_unique<DeviceModel>();
  m->cfg = cfg;
  m->act = act;
  m->fingerprint = "synthetic-" + std::to_string(seed);
  if (!cfg.engram_layers.empty()) {
    m->cmap.assign(static_cast<size_t>(cfg.vocab_size), 0);
    for (int64_t i = 0; i < cfg.vocab_size; ++i) m->cmap[static_cast<size_t>(i)] = static_cast<int32_t>(i % cfg.engram_compressed_vocab);
    m->engram = EngramLayout::build(cfg, m->cmap[static_cast<size_t>(cfg.engram_pad_id)]);
  }
  Uploader sz{*m, true, seed};
  upload_pass(sz, cfg, nullptr);
  m->arena_.reserve(sz.bytes);
  Uploader up{*m, true, seed};
  up.sizing = false;
  upload_pass(up, cfg, nullptr);
  DSX_CUDA_CHECK(cudaDeviceSynchronize());
  // Engram tables of the release are ~100 GB each: the synthetic model gathers rows
  // on the host from a small random table (row id modulo its size).
  const int64_t ed = cfg.engram_head_dim;
  m->synthetic_engram.resize(static_cast<size_t>((int64_t{1} << 16) * (ed + ed / 32)));
  uint64_t x = seed;
  for (auto& b : m->synthetic_engram) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    b = static_cast<uint8_t>(x >> 56);
  }
  for (int64_t r = 0; r < (int64_t{1} << 16); ++r)
    for (int64_t j = 0; j < ed / 32; ++j) m->synthetic_engram[static_cast<size_t>((int64_t{1} << 16) * ed + r * (ed / 32) + j)] = 120;
  for (int64_t i = 0; i < (int64_t{1} << 16) * ed; ++i)
    if ((m->synthetic_engram[static_cast<size_t>(i)] & 0x7f) == 0x7f) m->synthetic_engram[static_cast<size_t>(i)] = 0x7e;
  for (auto& L : m->layers)
    if (L.has_engram) {
      L.engram_host_table = m->synthetic_engram.data();
      L.engram_host_scale = m->synthetic_engram.data() + (int64_t{1} << 16) * ed;
      L.engram_rows = int64_t{1} << 16;
    }
  m->decode_weight_bytes = v41_decode_weight_bytes(cfg);
  return m;
}

// ---------------------------------------------------------------------------
// Optional per-stage timing of a forward step (DSX_PROFILE=1: decode steps, which then
// run eagerly, without the graph; DSX_PROFILE=prefill: prefill chunks): events between
// stages, summed per stage name.
class StageTimer {
 public:
  StageTimer() {
    const char* e = std::getenv("DSX_PROFILE");
    on_ = e != nullptr;
    prefill_ = on_ && std::string(e) == "prefill";
  }
  bool on() const { return on_; }
  void set_active(int T) {
    active_ = prefill_ ? T > 1 : T == 1;
    if (active_) tokens_ += T;
  }
  void mark(const char* name, cudaStream_t s) {
    if (!on_ || !active_) return;
    cudaEvent_t e;
    DSX_CUDA_CHECK(cudaEventCreate(&e));
    DSX_CUDA_CHECK(cudaEventRecord(e, s));
    marks_.push_back({name, e});
  }
  // Accumulates the recorded stages (synchronising) and clears them.
  void collect() {
    if (!on_ || marks_.empty()) return;
    DSX_CUDA_CHECK(cudaEventSynchronize(marks_.back().second));
    for (size_t i = 1; i < marks_.size(); ++i) {
      float ms = 0;
      DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, marks_[i - 1].second, marks_[i].second));
      auto& t = totals_[marks_[i].first];
      t.first += ms;
      t.second += 1;
    }
    for (auto& m : marks_) cudaEventDestroy(m.second);
    marks_.clear();
    ++steps_;
  }
  ~StageTimer() {
    if (!on_ || steps_ == 0) return;
    double total = 0;
    for (const auto& [k, v] : totals_) total += v.first;
    std::fprintf(stderr, "# DSX_PROFILE (%s): %d steps of %.1f tokens, %.3f ms per step\n", prefill_ ? "prefill" : "decode",
                 steps_, static_cast<double>(tokens_) / steps_, total / steps_);
    std::vector<std::pair<double, std::string>> rows;
    for (const auto& [k, v] : totals_) rows.push_back({v.first, k});
    std::sort(rows.rbegin(), rows.rend());
    for (const auto& [ms, k] : rows)
      std::fprintf(stderr, "#   %-22s %9.1f us/step %6.1f%%  (%d launches/step)\n", k.c_str(), 1000 * ms / steps_,
                   100 * ms / total, totals_[k].second / steps_);
  }

 private:
  bool on_ = false, prefill_ = false;
  bool active_ = false;
  int64_t tokens_ = 0;
  int steps_ = 0;
  std::vector<std::pair<const char*, cudaEvent_t>> marks_;
  std::map<std::string, std::pair<double, int>> totals_;
};

// ---------------------------------------------------------------------------
// One sequence on the device.
class CudaSession : public Session {
 public:
  CudaSession(const DeviceModel& m, const EngineOptions& o);
  ~CudaSession() override;

  int64_t position() const override { return pos_; }
  const std::vector<int32_t>& tokens() const override { return tokens_; }
  void feed(const int32_t* ids, int64_t n, float* logits, bool all_rows) override;
  int32_t feed_greedy(const int32_t* ids, int64_t n) override;
  std::vector<uint8_t> save() const override;
  void restore(const std::vector<uint8_t>& snapshot) override;
  void rollback(int64_t position) override;
  int64_t state_bytes() const override { return static_cast<int64_t>(cache_.geometry().device_bytes()); }
  bool synthetic_fill(int64_t n, uint64_t seed) override;

 private:
  void step(const int32_t* ids, int T, bool all_rows);  // enqueue inputs, run, advance
  void note_graph_time(std::chrono::steady_clock::time_point wall0);
  // the kernels of one chunk: the embedding (l0 == 0), layers [l0, l1), the final fold
  // and the head (l1 == n_layers)
  void forward(int T, bool all_rows, int l0 = 0, int l1 = -1);
  void attention(int l, int T);
  void moe(int l, int T);
  // Launches on `st` (default: the session stream) with the GEMV split workspace of
  // that stream (concurrent branches must not share one).
  // staged: GemvOpts::staged (one token); out_staged: GemvOpts::out_staged. Returns
  // whether out_staged was written (gemv_last_staged).
  // pick / pick_copy: GemvOpts::pick (one token: the greedy id of y).
  bool lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8,
           int groups = 1, cudaStream_t st = nullptr, const uint32_t* staged = nullptr,
           uint32_t* out_staged = nullptr, int32_t* pick = nullptr, int32_t* pick_copy = nullptr);
  // A staged-activation buffer (producer -> consumer QA8 codes) for a chunk of T tokens:
  // null unless T = 1, QA8 blocks of 32 and DSX_STAGED_X is not 0.
  uint32_t* staged_x(uint32_t* buf, int T) const {
    return T == 1 && c_.quant_block == 32 && staged_x_enabled() ? buf : nullptr;
  }
  GemvOpts gemv_opts(bool qa8, int groups, cudaStream_t st) const;
  void stage_engram(const int32_t* ids, int T, cudaStream_t st);  // (copies on st)

  const DeviceModel& m_;
  const ModelConfig& c_;
  Act act_;
  size_t ab_;  // bytes per activation element
  int tmax_;
  int64_t max_ctx_;
  cudaStream_t stream_ = nullptr;
  DeviceKVCache cache_;
  int64_t pos_ = 0;
  std::vector<int32_t> tokens_;

  // step buffers
  Arena buf_;
  int32_t* d_ids_ = nullptr;
  int64_t* d_engram_ids_ = nullptr;
  int64_t* d_iota_ = nullptr;
  uint8_t *engram_stage_ = nullptr, *engram_stage_scale_ = nullptr;
  Pinned<uint8_t> engram_host_stage_;
  Pinned<int64_t> h_engram_rows_;
  Pinned<int32_t> h_ids_;
  Pinned<float> h_logits_;  // last-row logits of a step
  Pinned<int32_t> h_pick_;  // feed_greedy's id (written by the device pick itself)
  void *X_ = nullptr, *a_ = nullptr, *f_ = nullptr, *y_ = nullptr, *h_ = nullptr;
  float *pre0_ = nullptr, *pa_ = nullptr, *qa_ = nullptr, *Ca_ = nullptr, *pf_ = nullptr, *qf_ = nullptr,
        *Cf_ = nullptr;
  void* hc_work_ = nullptr;
  void *q_lat_ = nullptr, *q_latn_ = nullptr, *q_ = nullptr, *kv_raw_ = nullptr, *o_ = nullptr, *zeta_ = nullptr;
  Fq8Rows chunk_;
  float *kappa_ = nullptr, *gamma_ = nullptr;
  void* comp_act_ = nullptr;
  void *idx_q_ = nullptr, *idx_w_ = nullptr;
  float* idx_qf_ = nullptr;
  int64_t score_ld_ = 0, block_ld_ = 0;
  float *scores_ = nullptr, *bscores_ = nullptr;
  int32_t *counts_ = nullptr, *bcounts_ = nullptr, *cand_ = nullptr, *cand_count_ = nullptr, *sel_ = nullptr,
          *sel_count_ = nullptr;
  float* attn_work_ = nullptr;
  int attn_splits_ = 1;
  float *router_logits_ = nullptr, *route_w_ = nullptr;
  int32_t* route_ids_ = nullptr;
  void* moe_ws_ = nullptr;
  uint32_t* xst_attn_ = nullptr;  // hc_finish's staged attention input (a_, one token)
  uint32_t* xst_ffn_ = nullptr;   // and the MoE's (f_)
  uint32_t* xst_q_ = nullptr;     // wq_b's staged normalized row for idx_wq_b (q_latn_)
  uint32_t* xst_o_ = nullptr;     // wo_a's staged output for wo_b (zeta_)
  size_t moe_ws_bytes_ = 0;
  void *u_ = nullptr, *yE_ = nullptr;
  float* logits_ = nullptr;
  void* gemm_ws_ = nullptr;
  size_t gemm_ws_bytes_ = 0;
  float* gemv_ws_ = nullptr;
  size_t gemv_ws_bytes_ = 0;
  // decode: side streams for the independent chains of the attention (0: window KV,
  // 1: compressor, 2: the indexer weights of index layers; join 3: side 1's projection
  // store)
  cudaStream_t side_[3] = {nullptr, nullptr, nullptr};
  float* side_ws_[3] = {nullptr, nullptr, nullptr};
  cudaEvent_t ev_fork_ = nullptr, ev_join_[4] = {nullptr, nullptr, nullptr, nullptr};
  cudaEvent_t ev_kv_fork_ = nullptr;  // side 0 after the joint wq_a / wkv launch
  // decode: the hc_mix coefficients of a site (needed only by the next site's pass) are
  // computed on a side stream while the main stream normalises and goes on
  cudaStream_t side_hc_ = nullptr;
  cudaEvent_t ev_hc_fork_ = nullptr, ev_hc_join_ = nullptr;
  // The Sinkhorn branch is joined by a signal (signal_device.cuh: the mix kernel signals
  // sig_hc_, the next hc pass waits for it in the kernel, keeping its programmatic early
  // launch) where that pass runs in the same forward pass, else by an event. Every side
  // stream joins the session stream at the end of a forward pass (join_sides).
  unsigned* sig_hc_ = nullptr;  // one signal slot (two words, zero at rest)
  enum class HcPending { none, event, signal };
  HcPending hc_pending_ = HcPending::none;
  cudaEvent_t ev_end_[4] = {nullptr, nullptr, nullptr, nullptr};
  unsigned side_used_ = 0;  // side streams forked since the last join_sides (bit i: side_[i], bit 3: side_hc_)
  void join_sides();
  void hc_site_finish(const HcFinishArgs& fz, bool branch, bool consumer_here);
  void hc_site_pass(const HcPassArgs& p);
  // Decode runs independent chains concurrently on side streams (graph branches);
  // prefill and profiling keep one stream.
  bool branches(int T) const { return T <= kGemvMaxT && !prof_.on() && branches_enabled(); }
  // decode graph
  cudaGraphExec_t graph_ = nullptr;
  // Decode with Engram tables gathered on the host (split_layer_ > 0: the first Engram
  // layer): the step is two graphs, the layers before split_layer_ (graph_a_, with the
  // embedding) and the rest (graph_). graph_a_ runs while the host hashes the token
  // history and gathers the rows; their copies go on copy_stream_, which graph_ waits
  // for (ev_engram_). DSX_ENGRAM_OVERLAP=0: one graph, the gather before it.
  cudaGraphExec_t graph_a_ = nullptr;
  int split_layer_ = 0;
  cudaStream_t copy_stream_ = nullptr;
  cudaEvent_t ev_engram_ = nullptr;
  cudaGraphExec_t capture(int T, int l0, int l1);
  int decode_steps_ = 0;
  // Context bound of the launches being recorded or run (tokens): the indexer, block
  // scores and top-k launches are sized for the rows a layer can have at this context
  // (rows_bound), not for the session's capacity, so that a session sized for 300k
  // tokens decodes an 8k context with the kernels (one-CTA top-k, small grids) of an 8k
  // one. Prefill chunks: the exact context; decode: a power of two (at least
  // DSX_GRAPH_MIN_CTX, default 16384, at most the capacity), graph_ctx_ for the
  // captured graph, which is captured again (after one eager step at the new bound)
  // when the context outgrows it or falls to a quarter of it.
  int64_t ctx_bound_ = 0;
  int64_t graph_ctx_ = 0;
  int64_t warm_ctx_ = 0;  // the bound of the last eager decode step
  int64_t rows_bound(int src) const;
  int64_t decode_graph_ctx(int64_t ctx) const;
  // DSX_GRAPH_TIMING=1: device time of the replayed decode graph vs the wall time
  // of the whole step (host work included), printed when the session ends.
  bool graph_timing_ = std::getenv("DSX_GRAPH_TIMING") != nullptr;
  cudaEvent_t gt0_ = nullptr, gt1_ = nullptr;
  cudaEvent_t gt0_ahead_ = nullptr;  // gt0_ of a step run ahead (swapped in when it goes on)
  // Greedy run-ahead (DSX_RUN_AHEAD, default on; with Engram layers gathered on the host,
  // i.e. graph_a_): feed_greedy's device pick is also the next step's input (d_ids_), and
  // the next step's first part (graph_a_, which needs no host input) is launched on it
  // before the host has read the id, so the device works while the host reads the id,
  // returns it, hashes the Engram history and launches the rest. feed_greedy with that
  // id at that position goes on with it (continue_ahead); anything else drops it first
  // (drop_ahead): the ring slots it wrote are copied back from ahead_stash_ (stashed
  // before it ran), so the state is byte for byte as if it had never run.
  struct Ahead {
    bool on = false;
    int64_t pos = 0;
    int32_t id = -1;
  };
  Ahead ahead_;
  uint8_t* ahead_stash_ = nullptr;
  // the position whose step slots ahead_stash_ holds as they were before any step there
  // (-1: none). A step continued from the run-ahead stashes the next position's slots on
  // copy_stream_, off the session stream, while its first part still runs.
  int64_t stashed_pos_ = -1;
  cudaEvent_t ev_pick_ = nullptr;
  bool graph_serves(int64_t p) const;  // the captured decode graph runs a step at position p
  void enqueue_pick();
  bool picked_ = false;        // the last step ran graph_, whose head picks as enqueue_pick does
  bool pick_in_head_ = false;  // (while capturing graph_: the head's product also picks)
  void run_ahead();
  void continue_ahead(int32_t id);
  void drop_ahead();
  double graph_ms_ = 0, step_wall_ms_ = 0;
  int graph_runs_ = 0;
  StageTimer prof_;
};

CudaSession::CudaSession(const DeviceModel& m, const EngineOptions& o)
    : m_(m), c_(m.cfg), act_(m.act), ab_(act_bytes(m.act)) {
  if (std::getenv("DSX_TRACE") && !trace_enable())
    std::fprintf(stderr, "# DSX_TRACE: this build records no kernel timeline (configure with -DDSX_KERNEL_TRACE=ON)\n");
  int prio_lo = 0, prio_hi = 0;
  DSX_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&prio_lo, &prio_hi));
  const int side_prio = side_prio_enabled() ? prio_hi : prio_lo;
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (auto& sd : side_) DSX_CUDA_CHECK(cudaStreamCreateWithPriority(&sd, cudaStreamNonBlocking, side_prio));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_fork_, cudaEventDisableTiming));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_kv_fork_, cudaEventDisableTiming));
  for (auto& e : ev_join_) DSX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  for (auto& e : ev_end_) DSX_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  DSX_CUDA_CHECK(cudaStreamCreateWithPriority(&side_hc_, cudaStreamNonBlocking, side_prio));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_hc_fork_, cudaEventDisableTiming));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_hc_join_, cudaEventDisableTiming));
  DSX_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_engram_, cudaEventDisableTiming));
  DSX_CUDA_CHECK(cudaEventCreateWithFlags(&ev_pick_, cudaEventDisableTiming));
  if (!c_.engram_layers.empty() && engram_overlap_enabled())
    split_layer_ = *std::min_element(c_.engram_layers.begin(), c_.engram_layers.end());
  max_ctx_ = o.max_context > 0 ? o.max_context : 8192;
  // prefill chunk (tokens per forward pass; DSX_PREFILL_CHUNK overrides, 64 .. 4096).
  // 2048: the routed experts' weights are streamed once per chunk, so larger chunks
  // prefill faster (H200, 8 synthetic layers: 1296 / 1938 / 2620 tok/s at 256 / 1024 /
  // 2048); the session's scratch grows with it (logits and index scores per token).
  tmax_ = std::clamp(env_int("DSX_PREFILL_CHUNK", 2048), 64, 4096);
  const int64_t D = c_.hidden, M = c_.hc_mult, H = c_.n_heads, hd = c_.head_dim, ql = c_.q_lora_rank;
  const int64_t G = c_.o_groups, ol = c_.o_lora_rank, E = c_.n_routed_experts, K = c_.n_experts_per_tok;
  const int64_t ih = c_.index_n_heads, ihd = c_.index_head_dim, V = c_.vocab_size;
  cache_.allocate(DeviceKVGeometry::from_config(c_, max_ctx_, o.rollback_depth));

  int min_ratio = 0;
  for (int l = 0; l < c_.n_layers; ++l)
    if (c_.ratio(l) > 0) min_ratio = min_ratio == 0 ? c_.ratio(l) : std::min(min_ratio, c_.ratio(l));
  score_ld_ = std::max<int64_t>(1, min_ratio > 0 ? max_ctx_ / min_ratio + 1 : 1);
  score_ld_ = std::max<int64_t>(score_ld_, static_cast<int64_t>(c_.candidate_topk_blocks) * c_.candidate_block_size);
  block_ld_ = c_.candidate_block_size > 0 ? score_ld_ / c_.candidate_block_size + 1 : 1;
  attn_splits_ = attention_decode_splits(c_.window, c_.index_topk);
  const int64_t T = tmax_;
  // workspace sizes of the linear kernels
  GemmOpts go;
  go.qblock = c_.quant_block;
  go.compute = act_;
  GemvOpts gv;
  gv.qblock = c_.quant_block;
  auto consider = [&](const QMatrix& W, bool qa8, int groups) {
    if (!W.rows) return;
    GemmOpts g = go;
    g.qa8 = qa8;
    g.groups = groups;
    gemm_ws_bytes_ = std::max(gemm_ws_bytes_, gemm_ws_bytes(W, tmax_, g));
    GemvOpts v = gv;
    v.qa8 = qa8;
    v.groups = groups;
    for (int t = 1; t <= kGemvMaxT; t *= 2) gemv_ws_bytes_ = std::max(gemv_ws_bytes_, gemv_split_ws_bytes(W, t, v));
  };
  for (const auto& L : m_.layers) {
    for (const QMatrix* q : {&L.hc_attn_fn, &L.hc_ffn_fn, &L.wq_a, &L.wq_b, &L.wkv, &L.wo_b, &L.comp_wkv,
                             &L.comp_wgate, &L.idx_wq_b, &L.wq_b_idx, &L.wq_a_kv, &L.idx_weights_proj, &L.gate, &L.engram_wkv})
      consider(*q, true, 1);
    consider(L.wo_a, false, c_.o_groups);
  }
  consider(m_.head, false, 1);
  moe_ws_bytes_ = std::max(moe_decode_ws_bytes(m_.layers[0].moe, kGemvMaxT, static_cast<int>(K)),
                           moe_prefill_ws_bytes(m_.layers[0].moe, tmax_, static_cast<int>(K)));
  const int nl = m_.engram.n_layers, nc = m_.engram.n_cols;
  const int64_t ed = c_.engram_head_dim;

  auto sizes = [&](Arena* a, size_t& total) {
    auto take = [&](size_t n) -> void* {
      if (!a) {
        total += aligned(n);
        return nullptr;
      }
      return a->take(n);
    };
    d_ids_ = static_cast<int32_t*>(take(T * 4));
    ahead_stash_ = static_cast<uint8_t*>(take(static_cast<size_t>(std::max<int64_t>(1, cache_.slot_stash_bytes(split_layer_)))));
    d_engram_ids_ = static_cast<int64_t*>(take(std::max<int64_t>(1, T * nl * nc) * 8));
    engram_stage_ = static_cast<uint8_t*>(take(std::max<int64_t>(1, nl * T * nc * ed)));
    engram_stage_scale_ = static_cast<uint8_t*>(take(std::max<int64_t>(1, nl * T * nc * ed / 32)));
    d_iota_ = static_cast<int64_t*>(take(std::max<int64_t>(1, T * nc) * 8));
    X_ = take(T * M * D * ab_);
    a_ = take(T * D * ab_);
    f_ = take(T * D * ab_);
    y_ = take(T * D * ab_);
    h_ = take(T * D * ab_);
    sig_hc_ = static_cast<unsigned*>(take(64));
    pre0_ = static_cast<float*>(take(T * M * 4));
    pa_ = static_cast<float*>(take(T * M * 4));
    qa_ = static_cast<float*>(take(T * M * 4));
    Ca_ = static_cast<float*>(take(T * M * M * 4));
    pf_ = static_cast<float*>(take(T * M * 4));
    qf_ = static_cast<float*>(take(T * M * 4));
    Cf_ = static_cast<float*>(take(T * M * M * 4));
    hc_work_ = take(hc_work_bytes(static_cast<int>(T), D));
    q_lat_ = take((T * ql + hd) * ab_);  // (+ one token's kv row: the joint wq_a / wkv product)
    q_latn_ = take(T * ql * ab_);
    q_ = take((T * H * hd + ih * ihd) * ab_);  // (+ one token's idx_q: the joint wq_b / idx_wq_b product)
    kv_raw_ = take(T * hd * ab_);
    chunk_.dim = static_cast<int>(hd);
    chunk_.codes = static_cast<uint8_t*>(take(T * hd));
    chunk_.scales = static_cast<uint8_t*>(take(T * hd / 32));
    o_ = take(T * H * hd * ab_);
    zeta_ = take(T * G * ol * ab_);
    kappa_ = static_cast<float*>(take(std::max<int64_t>(T, 2) * hd * 4));  // (one token: kv and gate rows)
    gamma_ = static_cast<float*>(take(T * hd * 4));
    comp_act_ = take(T * hd * ab_);
    idx_q_ = take(T * ih * ihd * ab_);
    idx_qf_ = static_cast<float*>(take(T * ih * ihd * 4));
    idx_w_ = take(T * ih * ab_);
    scores_ = static_cast<float*>(take(T * score_ld_ * 4));
    counts_ = static_cast<int32_t*>(take(T * 4));
    bscores_ = static_cast<float*>(take(T * block_ld_ * 4));
    bcounts_ = static_cast<int32_t*>(take(T * 4));
    cand_ = static_cast<int32_t*>(take(T * std::max(1, c_.candidate_topk_blocks) * 4));
    cand_count_ = static_cast<int32_t*>(take(T * 4));
    sel_ = static_cast<int32_t*>(take(T * c_.index_topk * 4));
    sel_count_ = static_cast<int32_t*>(take(T * 4));
    attn_work_ = static_cast<float*>(take(attention_work_floats(1, static_cast<int>(H), static_cast<int>(hd), attn_splits_) * 4));
    router_logits_ = static_cast<float*>(take(T * E * 4));
    route_ids_ = static_cast<int32_t*>(take(T * K * 4));
    route_w_ = static_cast<float*>(take(T * K * 4));
    moe_ws_ = take(moe_ws_bytes_);
    xst_attn_ = static_cast<uint32_t*>(take(2 * staged_act_words(D) * 4));
    xst_ffn_ = static_cast<uint32_t*>(take(2 * staged_act_words(D) * 4));
    xst_q_ = static_cast<uint32_t*>(take(staged_act_words(c_.q_lora_rank) * 4));
    xst_o_ = static_cast<uint32_t*>(take(staged_act_words(static_cast<int64_t>(c_.o_groups) * c_.o_lora_rank) * 4));
    u_ = take(std::max<int64_t>(1, T * nc * ed) * ab_);
    yE_ = take(std::max<int64_t>(1, T * (M + 1) * D) * ab_);
    logits_ = static_cast<float*>(take(T * V * 4));
    gemm_ws_ = take(std::max<size_t>(gemm_ws_bytes_, 256));
    gemv_ws_ = static_cast<float*>(take(std::max<size_t>(gemv_ws_bytes_, 256)));
    for (float*& ws : side_ws_) ws = static_cast<float*>(take(std::max<size_t>(gemv_ws_bytes_, 256)));
  };
  size_t total = 0;
  sizes(nullptr, total);
  buf_.reserve(total + 4096);
  sizes(&buf_, total);
  engram_host_stage_.resize(static_cast<size_t>(std::max<int64_t>(1, nl * T * nc * (ed + ed / 32))));
  h_engram_rows_.resize(static_cast<size_t>(std::max<int64_t>(1, nl * T * nc)));
  h_ids_.resize(static_cast<size_t>(T));
  h_logits_.resize(static_cast<size_t>(V));
  h_pick_.resize(1);
  DSX_CUDA_CHECK(cudaMemset(sig_hc_, 0, 64));  // (signal slots are zero at rest)
  if (nl > 0) {
    std::vector<int64_t> iota(static_cast<size_t>(T * nc));
    for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int64_t>(i);
    DSX_CUDA_CHECK(cudaMemcpy(d_iota_, iota.data(), iota.size() * 8, cudaMemcpyHostToDevice));
  }
}

CudaSession::~CudaSession() {
  if (stream_) cudaStreamSynchronize(stream_);  // (a step run ahead may still be running)
  if (const char* tp = std::getenv("DSX_TRACE")) trace_dump(tp);
  if (graph_timing_ && graph_runs_ > 0)
    std::fprintf(stderr, "# DSX_GRAPH_TIMING: %d decode steps, graph %.3f ms/step on the device, %.3f ms/step wall (feed)\n",
                 graph_runs_, graph_ms_ / graph_runs_, step_wall_ms_ / graph_runs_);
  if (gt0_) cudaEventDestroy(gt0_);
  if (gt1_) cudaEventDestroy(gt1_);
  if (gt0_ahead_) cudaEventDestroy(gt0_ahead_);
  if (ev_pick_) cudaEventDestroy(ev_pick_);
  if (graph_) cudaGraphExecDestroy(graph_);
  if (graph_a_) cudaGraphExecDestroy(graph_a_);
  if (ev_engram_) cudaEventDestroy(ev_engram_);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
  for (auto& sd : side_)
    if (sd) cudaStreamDestroy(sd);
  if (ev_fork_) cudaEventDestroy(ev_fork_);
  if (ev_kv_fork_) cudaEventDestroy(ev_kv_fork_);
  if (ev_hc_fork_) cudaEventDestroy(ev_hc_fork_);
  if (ev_hc_join_) cudaEventDestroy(ev_hc_join_);
  if (side_hc_) cudaStreamDestroy(side_hc_);
  for (auto& e : ev_join_)
    if (e) cudaEventDestroy(e);
  for (auto& e : ev_end_)
    if (e) cudaEventDestroy(e);
  if (stream_) cudaStreamDestroy(stream_);
}

GemvOpts CudaSession::gemv_opts(bool qa8, int groups, cudaStream_t st) const {
  GemvOpts o;
  o.qa8 = qa8;
  o.qblock = c_.quant_block;
  o.groups = groups;
  o.split_ws = gemv_ws_;
  for (size_t i = 0; i < std::size(side_); ++i)
    if (st == side_[i]) {
      o.split_ws = side_ws_[i];
      o.max_blocks_per_sm = side_blocks_per_sm();
    }
  o.split_ws_bytes = gemv_ws_bytes_;
  return o;
}

bool CudaSession::lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8,
                      int groups, cudaStream_t st, const uint32_t* staged, uint32_t* out_staged, int32_t* pick,
                      int32_t* pick_copy) {
  if (!st) st = stream_;
  DSX_CHECK(!pick || T == 1, "lin: a pick needs one token");
  if (T <= kGemvMaxT) {
    GemvOpts o = gemv_opts(qa8, groups, st);
    o.staged = staged;
    o.out_staged = out_staged;
    o.pick = pick;
    o.pick_copy = pick_copy;
    gemv(W, act_, x, ldx, T, yt, y, ldy, o, st);
    return out_staged && gemv_last_staged();
  } else {
    DSX_CHECK(st == stream_, "prefill products run on the session stream");
    GemmOpts o;
    o.qa8 = qa8;
    o.qblock = c_.quant_block;
    o.groups = groups;
    o.compute = act_;
    gemm(W, act_, x, ldx, T, yt, y, ldy, o, gemm_ws_, gemm_ws_bytes_, stream_);
    return false;
  }
}

// Engram row ids (host hashing of the token history, spec §3.2.2) and, for tables
// kept on the host, the gathered rows.
void CudaSession::stage_engram(const int32_t* ids, int T, cudaStream_t st) {
  const EngramLayout& E = m_.engram;
  if (E.n_layers == 0) return;
  const int64_t p0 = pos_, back = E.max_ngram - 1, h0 = std::max<int64_t>(0, p0 - back);
  std::vector<int32_t> hist;
  for (int64_t p = h0; p < p0 + T; ++p) {
    const int32_t raw = p < p0 ? tokens_[static_cast<size_t>(p)] : ids[p - p0];
    hist.push_back(m_.cmap[static_cast<size_t>(raw)]);
  }
  const int nl = E.n_layers, nc = E.n_cols;
  const int64_t n = static_cast<int64_t>(T) * nc, ed = c_.engram_head_dim;
  int64_t* rows = h_engram_rows_.data();  // [layer][t][col]
  for (int li = 0; li < nl; ++li)
    for (int t = 0; t < T; ++t) E.row_ids(li, hist.data(), h0, p0 + t, rows + li * n + static_cast<int64_t>(t) * nc);
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_engram_ids_, rows, static_cast<size_t>(nl * n) * 8, cudaMemcpyHostToDevice, st));
  for (int li = 0; li < nl; ++li) {
    const DevLayer& L = m_.layers[static_cast<size_t>(c_.engram_layers[static_cast<size_t>(li)])];
    if (L.engram_table) continue;
    // gather this layer's rows on the host (the release tables stay memory-mapped)
    uint8_t* codes = engram_host_stage_.data() + li * n * (ed + ed / 32);
    uint8_t* scales = codes + n * ed;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = rows[li * n + i] % L.engram_rows;
      std::memcpy(codes + i * ed, L.engram_host_table + r * ed, static_cast<size_t>(ed));
      std::memcpy(scales + i * (ed / 32), L.engram_host_scale + r * (ed / 32), static_cast<size_t>(ed / 32));
    }
    DSX_CUDA_CHECK(cudaMemcpyAsync(engram_stage_ + li * n * ed, codes, static_cast<size_t>(n * ed), cudaMemcpyHostToDevice, st));
    DSX_CUDA_CHECK(cudaMemcpyAsync(engram_stage_scale_ + li * n * (ed / 32), scales, static_cast<size_t>(n * ed / 32),
                                   cudaMemcpyHostToDevice, st));
  }
  // the pinned staging buffers are rewritten by the next step, which first waits
  // for this one (feed synchronises at its end)
}

// Site transition, second half: the RMSNorm of the collapsed row on the session stream
// and, in decode, the hc_mix coefficients (Sinkhorn) on side_hc_, joined before the
// next pass (hc_site_pass), the first reader of pre / post / comb: by the signal when
// that pass is in this forward pass (consumer_here), else by an event.
void CudaSession::hc_site_finish(const HcFinishArgs& fz, bool branch, bool consumer_here) {
  if (!branch || !fz.have_mix || !fz.norm_out) {
    hc_finish(act_, fz, stream_);
    return;
  }
  DSX_CUDA_CHECK(cudaEventRecord(ev_hc_fork_, stream_));
  DSX_CUDA_CHECK(cudaStreamWaitEvent(side_hc_, ev_hc_fork_, 0));
  side_used_ |= 8;
  HcFinishArgs mix = fz;
  mix.collapsed = nullptr, mix.norm_w = nullptr, mix.norm_out = nullptr, mix.q_codes = nullptr, mix.q_scales = nullptr;
  mix.staged = nullptr;
  const bool sig = consumer_here && signals_enabled();
  mix.signal = sig ? sig_hc_ : nullptr;
  hc_finish(act_, mix, side_hc_);
  if (sig) {
    hc_pending_ = HcPending::signal;
  } else {
    DSX_CUDA_CHECK(cudaEventRecord(ev_hc_join_, side_hc_));
    hc_pending_ = HcPending::event;
  }
  HcFinishArgs norm = fz;
  norm.have_mix = false;
  hc_finish(act_, norm, stream_);
}

void CudaSession::join_sides() {
  cudaStream_t all[4] = {side_[0], side_[1], side_[2], side_hc_};
  for (int i = 0; i < 4; ++i) {
    if (!(side_used_ >> i & 1)) continue;
    DSX_CUDA_CHECK(cudaEventRecord(ev_end_[i], all[i]));
    DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_end_[i], 0));
  }
  hc_pending_ = HcPending::none;
  side_used_ = 0;
}

void CudaSession::hc_site_pass(const HcPassArgs& p) {
  HcPassArgs a = p;
  // (an expand follows the sublayer's last kernel: attention() ends with wo_b, moe() with
  // the MoE down projection, or the pass is the first launch of a graph)
  a.inputs_ready = p.y != nullptr;
  if (hc_pending_ == HcPending::event) DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_hc_join_, 0));
  if (hc_pending_ == HcPending::signal) a.wait_signal = sig_hc_;
  hc_pending_ = HcPending::none;
  hc_pass(act_, a, stream_);
}

void CudaSession::forward(int T, bool all_rows, int l0, int l1) {
  const int64_t D = c_.hidden, M = c_.hc_mult, V = c_.vocab_size;
  if (l1 < 0) l1 = c_.n_layers;
  prof_.set_active(T);
  prof_.mark("start", stream_);
  hc_pending_ = HcPending::none;  // (the previous pass joined its side streams at its end)
  side_used_ = 0;
  if (l0 == 0) {
    embed_streams(act_, reinterpret_cast<const uint16_t*>(m_.embed.data), d_ids_, T, static_cast<int>(M), D, X_, stream_);
    onehot_pre(pre0_, T, static_cast<int>(M), stream_);
    prof_.mark("embed", stream_);
  }
  const bool hc_branch = branches(T) && !hc_off_branch();
  // the collapse weights and the pending expansion of the previous sublayer (spec
  // §3.3.2); after a layer they are the FFN site's (pf_, y_, qf_, Cf_)
  const float* pre = l0 == 0 ? pre0_ : pf_;
  const void* pend_y = l0 == 0 ? nullptr : y_;
  const float *pend_post = l0 == 0 ? nullptr : qf_, *pend_comb = l0 == 0 ? nullptr : Cf_;
  for (int l = l0; l < l1; ++l) {
    const DevLayer& L = m_.layers[static_cast<size_t>(l)];
    // §3.2 Engram before the layer's mixing
    if (L.has_engram) {
      if (pend_y) {
        HcPassArgs e;
        e.T = T, e.D = D, e.X = X_, e.y = pend_y, e.post = pend_post, e.comb = pend_comb, e.work = hc_work_;
        hc_site_pass(e);
        pend_y = nullptr;
      }
      const int li = c_.engram_index(l), nc = m_.engram.n_cols;
      const int ed = c_.engram_head_dim;
      const int64_t n = static_cast<int64_t>(T) * nc;
      if (L.engram_table) {
        engram_gather(act_, L.engram_table, L.engram_table_scale, ed, d_engram_ids_ + li * n, static_cast<int>(n), u_,
                      nullptr, nullptr, stream_);
      } else {  // rows the host gathered (stage_engram), in order
        engram_gather(act_, engram_stage_ + li * n * ed, engram_stage_scale_ + li * n * (ed / 32), ed, d_iota_,
                      static_cast<int>(n), u_, nullptr, nullptr, stream_);
      }
      lin(L.engram_wkv, u_, static_cast<int64_t>(nc) * ed, T, act_, yE_, (M + 1) * D, true);
      engram_gate(act_, T, static_cast<int>(M), D, yE_, X_, L.engram_w, c_.rms_eps, stream_);
      prof_.mark("engram", stream_);
    }
    // site transition into the attention: expand (pending), mix (attn), collapse (pre)
    {
      HcPassArgs p;
      p.T = T, p.D = D, p.X = X_, p.y = pend_y, p.post = pend_post, p.comb = pend_comb;
      p.fn = reinterpret_cast<const float*>(L.hc_attn_fn.data);
      p.pre = pre, p.collapsed = a_, p.work = hc_work_;
      hc_site_pass(p);
      HcFinishArgs fz;
      fz.T = T, fz.D = D, fz.work = hc_work_, fz.have_mix = true, fz.base = L.hc_attn_base, fz.scale = L.hc_attn_scale;
      fz.norm_eps = c_.rms_eps, fz.hc_eps = c_.hc_eps, fz.sinkhorn_iters = c_.hc_sinkhorn_iters;
      fz.pre = pa_, fz.post = qa_, fz.comb = Ca_;
      fz.collapsed = a_, fz.norm_w = L.attn_norm, fz.norm_out = a_, fz.staged = staged_x(xst_attn_, T);
      hc_site_finish(fz, hc_branch, true);
      prof_.mark("hc", stream_);
    }
    attention(l, T);  // writes y_
    {
      HcPassArgs p;
      p.T = T, p.D = D, p.X = X_, p.y = y_, p.post = qa_, p.comb = Ca_;
      p.fn = reinterpret_cast<const float*>(L.hc_ffn_fn.data);
      p.pre = pa_, p.collapsed = f_, p.work = hc_work_;
      hc_site_pass(p);
      HcFinishArgs fz;
      fz.T = T, fz.D = D, fz.work = hc_work_, fz.have_mix = true, fz.base = L.hc_ffn_base, fz.scale = L.hc_ffn_scale;
      fz.norm_eps = c_.rms_eps, fz.hc_eps = c_.hc_eps, fz.sinkhorn_iters = c_.hc_sinkhorn_iters;
      fz.pre = pf_, fz.post = qf_, fz.comb = Cf_;
      fz.collapsed = f_, fz.norm_w = L.ffn_norm, fz.norm_out = f_, fz.staged = staged_x(xst_ffn_, T);
      // (the last layer of a partial pass: the next pass runs that site's pass)
      hc_site_finish(fz, hc_branch, l + 1 < l1 || l1 == c_.n_layers);
      prof_.mark("hc", stream_);
    }
    moe(l, T);  // writes y_
    pend_y = y_, pend_post = qf_, pend_comb = Cf_;
    pre = pf_;
  }
  if (l1 < c_.n_layers) {  // (a part of the step: the side streams join before it ends)
    join_sides();
    return;
  }
  // §3.6 final fold, norm, head
  {
    HcPassArgs p;
    p.T = T, p.D = D, p.X = X_, p.y = pend_y, p.post = pend_post, p.comb = pend_comb;
    p.pre = pre, p.collapsed = h_, p.work = hc_work_;
    hc_site_pass(p);
    HcFinishArgs fz;
    fz.T = T, fz.D = D, fz.work = hc_work_, fz.norm_eps = c_.rms_eps;
    fz.collapsed = h_, fz.norm_w = m_.norm, fz.norm_out = h_;
    hc_finish(act_, fz, stream_);
  }
  prof_.mark("final hc+norm", stream_);
  if (all_rows) {
    lin(m_.head, h_, D, T, Act::F32, logits_, V, false);
  } else {
    // (a decode graph's head also picks the greedy id: enqueue_pick, folded into the product)
    lin(m_.head, static_cast<char*>(h_) + static_cast<int64_t>(T - 1) * D * ab_, D, 1, Act::F32, logits_, V, false, 1,
        nullptr, nullptr, nullptr, pick_in_head_ ? d_ids_ : nullptr, pick_in_head_ ? h_pick_.data() : nullptr);
  }
  advance_pos(cache_.d_pos(), T, stream_);
  join_sides();
  prof_.mark("head", stream_);
  prof_.collect();
}

// §3.4 attention of layer l for the chunk.
void CudaSession::attention(int l, int T) {
  const DevLayer& L = m_.layers[static_cast<size_t>(l)];
  const int64_t D = c_.hidden, H = c_.n_heads, hd = c_.head_dim, ql = c_.q_lora_rank;
  const int64_t G = c_.o_groups, ol = c_.o_lora_rank;
  const int r = c_.ratio(l);
  const float* inv_freq = r > 0 ? m_.comp_inv_freq : m_.main_inv_freq;
  const int np = c_.rope_dim / 2;
  // Decode runs independent chains concurrently (graph branches): the queries on the
  // session stream, the window KV on side 0, the compressor on side 1 and the indexer
  // weights on side 2; they join before the indexer scoring (compressor row, indexer
  // weights) and the attention (window KV, projection store). Prefill (and profiling)
  // keeps one stream. One token: wkv with wq_a (§3.4.1) in one launch on the session
  // stream (L.wq_a_kv; the kv row lands after q_lat_'s), side 0 forked after it for
  // kv_finish (wkv launched on side 0 started late, its blocks held SMs the wq_b after
  // wq_a needed, and wq_b ended up to 8 us late in half the layers: s17 kernel timelines).
  const bool branch = branches(T);
  const bool joint_qkv = T == 1 && L.wq_a_kv.rows > 0 && joint_qkv_enabled();
  cudaStream_t s_kv = branch ? side_[0] : stream_, s_cmp = branch ? side_[1] : stream_,
               s_iw = branch ? side_[2] : stream_;
  const bool idx_w = r > 0 && c_.is_index_source(l);  // (the indexer weights: their own branch)
  const bool proj_store_on = r > 1 && c_.is_kv_source(l);  // (side 1 ends with it: ev_join_[3])
  if (branch) {
    DSX_CUDA_CHECK(cudaEventRecord(ev_fork_, stream_));
    for (int i = joint_qkv ? 1 : 0; i < (idx_w ? 3 : 2); ++i)
      DSX_CUDA_CHECK(cudaStreamWaitEvent(side_[i], ev_fork_, 0));
    side_used_ |= idx_w ? 7 : 3;
  }
  if (idx_w) {
    lin(L.idx_weights_proj, a_, D, T, act_, idx_w_, c_.index_n_heads, false, 1, s_iw);
    if (branch) DSX_CUDA_CHECK(cudaEventRecord(ev_join_[2], s_iw));
  }
  // §3.4.2 window KV (one token: with wq_a)
  void* kv_in = kv_raw_;
  if (joint_qkv) {
    lin(L.wq_a_kv, a_, D, T, act_, q_lat_, ql + hd, true, 1, nullptr, staged_x(xst_attn_, T));
    kv_in = static_cast<char*>(q_lat_) + ql * ab_;
    if (branch) {
      DSX_CUDA_CHECK(cudaEventRecord(ev_kv_fork_, stream_));
      DSX_CUDA_CHECK(cudaStreamWaitEvent(s_kv, ev_kv_fork_, 0));
    }
  } else {
    lin(L.wkv, a_, D, T, act_, kv_raw_, hd, true, 1, s_kv, staged_x(xst_attn_, T));
  }
  prof_.mark("wkv", stream_);
  // decode: the row also goes straight into the window ring (no window_store launch
  // after the attention on the critical path)
  const Fq8Rows ring = cache_.window(l);
  kv_finish(act_, kv_in, L.kv_norm, c_.rms_eps, T, static_cast<int>(hd), np, inv_freq, cache_.d_pos(), chunk_, s_kv,
            T == 1 ? &ring : nullptr, cache_.geometry().window_cap());
  if (branch) DSX_CUDA_CHECK(cudaEventRecord(ev_join_[0], s_kv));
  prof_.mark("kv_finish", stream_);
  // §3.4.3 compressor (KV sources) and the indexer weights, which read only `a`
  if (r > 0 && c_.is_kv_source(l)) {
    CompressorArgs ca;
    ca.T = T, ca.ratio = r, ca.head_dim = static_cast<int>(hd), ca.idx_dim = c_.index_head_dim, ca.n_pairs = np;
    ca.eps = c_.rms_eps;
    if (r > 1) {
      if (T == 1 && L.comp_kv_gate.rows > 0) {  // (one launch: kappa_ holds both rows)
        lin(L.comp_kv_gate, a_, D, T, Act::F32, kappa_, 2 * hd, false, 1, s_cmp);
        ca.kv = kappa_, ca.gate = kappa_ + hd;
      } else {
        lin(L.comp_wkv, a_, D, T, Act::F32, kappa_, hd, false, 1, s_cmp);
        lin(L.comp_wgate, a_, D, T, Act::F32, gamma_, hd, false, 1, s_cmp);
        ca.kv = kappa_, ca.gate = gamma_;
      }
      ca.proj_kv = cache_.proj_kv(l), ca.proj_gate = cache_.proj_gate(l), ca.proj_cap = cache_.geometry().proj_cap(l);
    } else {
      lin(L.comp_wkv, a_, D, T, act_, comp_act_, hd, false, 1, s_cmp);
      ca.kv_act = comp_act_;
    }
    ca.norm = L.comp_norm, ca.inv_freq = m_.comp_inv_freq;
    ca.wk = reinterpret_cast<const uint16_t*>(L.idx_wk.data), ca.k_norm = L.idx_k_norm;
    ca.rows = cache_.compressed(l), ca.keys = cache_.keys(l), ca.d_pos = cache_.d_pos();
    compressor_emit(act_, ca, s_cmp);
    // (the indexer and the attention need the emitted row; the projection store after it
    // is for later steps and joins only before the attention)
    if (branch) DSX_CUDA_CHECK(cudaEventRecord(ev_join_[1], s_cmp));
    if (proj_store_on) {
      proj_store(ca.kv, ca.gate, T, static_cast<int>(hd), cache_.proj_kv(l), cache_.proj_gate(l),
                 cache_.geometry().proj_cap(l), cache_.d_pos(), s_cmp);
      if (branch) DSX_CUDA_CHECK(cudaEventRecord(ev_join_[3], s_cmp));
    }
    prof_.mark("compressor", stream_);
  } else if (branch) {
    DSX_CUDA_CHECK(cudaEventRecord(ev_join_[1], s_cmp));
  }
  // §3.4.1 queries (one token: with wkv above)
  if (!joint_qkv) lin(L.wq_a, a_, D, T, act_, q_lat_, ql, true, 1, nullptr, staged_x(xst_attn_, T));
  prof_.mark("wq_a", stream_);
  // q_norm, then wq_b (RoPE: in the attention, aa.q_inv_freq); the normalized rows land in
  // q_latn_ for the indexer. One token: the norm is done by wq_b's kernel while it stages
  // its input (GemvOpts::norm_w), which saves the norm's own launch.
  // Index layers, one token: wq_b and idx_wq_b in one launch (L.wq_b_idx, both read the
  // normalized latent); the indexer's queries land after q_'s row.
  const bool joint_q = T == 1 && r > 0 && c_.is_index_source(l) && L.wq_b_idx.rows > 0 && joint_q_enabled();
  void* idx_q = joint_q ? static_cast<char*>(q_) + H * hd * ab_ : idx_q_;
  bool q_staged = false;
  if (T <= kGemvMaxT) {
    GemvOpts o = gemv_opts(true, 1, stream_);
    o.norm_w = L.q_norm, o.norm_eps = c_.rms_eps, o.norm_out = q_latn_;
    // (for a separate idx_wq_b: the normalized row's QA8, staged by wq_b's block 0)
    if (r > 0 && c_.is_index_source(l) && !joint_q) o.norm_staged = staged_x(xst_q_, T);
    if (joint_q)
      gemv(L.wq_b_idx, act_, q_lat_, ql, T, act_, q_, L.wq_b_idx.rows, o, stream_);
    else
      gemv(L.wq_b, act_, q_lat_, ql, T, act_, q_, H * hd, o, stream_);
    q_staged = o.norm_staged && gemv_last_staged();
  } else {
    rmsnorm(act_, q_lat_, q_latn_, L.q_norm, T, static_cast<int>(ql), c_.rms_eps, nullptr, nullptr, stream_);
    lin(L.wq_b, q_latn_, ql, T, act_, q_, H * hd, true);
  }
  prof_.mark("q_norm+wq_b", stream_);
  // §3.4.4-3.4.6 selection of compressed rows
  Fq4e4Rows cmp{};
  bool have_sel = false;
  if (r > 0) {
    const int src = c_.kv_source_of(l);
    if (c_.is_index_source(l)) {
      const int64_t ih = c_.index_n_heads, ihd = c_.index_head_dim;
      if (!joint_q)
        lin(L.idx_wq_b, q_latn_, ql, T, act_, idx_q, ih * ihd, true, 1, nullptr, q_staged ? xst_q_ : nullptr);
      rope_fq4e8(act_, idx_q, idx_qf_, T, static_cast<int>(ih), static_cast<int>(ihd), np, m_.comp_inv_freq,
                 cache_.d_pos(), stream_);
      prof_.mark("indexer q/w", stream_);
      if (branch) {
        DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_join_[1], 0));
        DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_join_[2], 0));
      }
      const bool is_cand = l == c_.candidate_source_layer;
      const bool uses_cand = c_.candidate_source_layer >= 0 && c_.candidate_source_layer < l;
      IndexerScoreArgs ia;
      ia.T = T, ia.n_heads = static_cast<int>(ih), ia.head_dim = static_cast<int>(ihd), ia.ratio = r;
      ia.q = idx_qf_, ia.w = idx_w_, ia.keys = cache_.keys(src);
      ia.max_rows = rows_bound(src);
      if (uses_cand) {
        ia.cand_blocks = cand_, ia.cand_ld = c_.candidate_topk_blocks, ia.cand_count = cand_count_;
        ia.cand_block_size = c_.candidate_block_size;
        ia.max_rows = std::min<int64_t>(ia.max_rows, static_cast<int64_t>(c_.candidate_topk_blocks) * c_.candidate_block_size);
      }
      ia.scores = scores_, ia.ld = score_ld_, ia.counts = counts_, ia.d_pos = cache_.d_pos();
      indexer_scores(act_, ia, stream_);
      prof_.mark("indexer scores", stream_);
      if (is_cand) {
        const int64_t max_blocks = std::min<int64_t>(block_ld_, ia.max_rows / c_.candidate_block_size + 1);
        block_scores(T, scores_, score_ld_, counts_, c_.candidate_block_size, bscores_, block_ld_, bcounts_,
                     max_blocks, stream_);
        topk_select(T, bscores_, block_ld_, bcounts_, c_.candidate_topk_blocks, nullptr, 0, 1, cand_,
                    c_.candidate_topk_blocks, cand_count_, stream_, max_blocks);
      }
      topk_select(T, scores_, score_ld_, counts_, c_.index_topk, uses_cand ? cand_ : nullptr,
                  uses_cand ? c_.candidate_topk_blocks : 0, uses_cand ? c_.candidate_block_size : 1, sel_,
                  c_.index_topk, sel_count_, stream_, ia.max_rows);
      prof_.mark("top-k", stream_);
    }
    cmp = cache_.compressed(src);
    have_sel = true;
  }
  if (branch) {
    DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_join_[0], 0));
    DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, proj_store_on ? ev_join_[3] : ev_join_[1], 0));
  }
  // §3.4.7 attention, with the inverse RoPE of §3.4.8 fused
  AttnArgs aa;
  aa.T = T, aa.n_heads = static_cast<int>(H), aa.head_dim = static_cast<int>(hd), aa.window = c_.window;
  aa.q = q_, aa.ring = cache_.window(l), aa.ring_cap = cache_.geometry().window_cap(), aa.chunk = chunk_;
  if (have_sel) {
    aa.cmp = cmp;
    aa.sel = sel_, aa.sel_ld = c_.index_topk, aa.sel_count = sel_count_, aa.max_sel = c_.index_topk;
    // (a layer reusing an earlier layer's top-k: its selection is ready before wq_b ends)
    aa.sel_early = !c_.is_index_source(l);
  }
  aa.sink = L.attn_sink;
  aa.scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
  aa.n_pairs = np, aa.inv_freq = inv_freq, aa.q_inv_freq = inv_freq;
  // BF16 mode: the tensor-core attention (same numerics up to f32 summation order);
  // DSX_ATTN_MMA=0 keeps the CUDA-core kernel
  aa.tensor_cores = act_ == Act::BF16 && attn_mma_enabled();
  aa.out = o_, aa.d_pos = cache_.d_pos();
  if (T == 1) {
    aa.n_splits = attn_splits_;
    aa.work = attn_work_;
  }
  sparse_attention(act_, aa, stream_);
  if (T > 1) window_store(chunk_, T, ring, cache_.geometry().window_cap(), cache_.d_pos(), stream_);
  prof_.mark("attention", stream_);
  // §3.4.8 grouped output projection, then wo_b
  // (wo_a's epilogue stages QA8 of its output for wo_b when its plan allows)
  const bool o_staged = lin(L.wo_a, o_, H * hd, T, act_, zeta_, G * ol, false, static_cast<int>(G), nullptr,
                            nullptr, staged_x(xst_o_, T));
  prof_.mark("wo_a", stream_);
  lin(L.wo_b, zeta_, G * ol, T, act_, y_, D, true, 1, nullptr, o_staged ? xst_o_ : nullptr);
  prof_.mark("wo_b", stream_);
}

// §3.5 mixture of experts.
void CudaSession::moe(int l, int T) {
  const DevLayer& L = m_.layers[static_cast<size_t>(l)];
  const int64_t D = c_.hidden;
  const int K = c_.n_experts_per_tok;
  RouterOpts ro;
  ro.gate_temp = c_.gate_temp;
  ro.norm_topk_prob = c_.norm_topk_prob;
  ro.route_scale = c_.routed_scaling;
  if (T <= kGemvMaxT) {
    router(act_, f_, D, T, L.gate, L.gate_bias, K, ro, router_logits_, route_ids_, route_w_, stream_);
  } else {  // prefill: the gate product on the tensor cores (GEMM), then the selection
    lin(L.gate, f_, D, T, Act::F32, router_logits_, c_.n_routed_experts, false);
    router_select(router_logits_, c_.n_routed_experts, T, c_.n_routed_experts, L.gate_bias, K, ro, route_ids_, route_w_,
                  stream_);
  }
  prof_.mark("router", stream_);
  if (T <= kGemvMaxT) {
    moe_decode(L.moe, act_, f_, D, T, K, route_ids_, route_w_, act_, y_, D, moe_ws_, moe_ws_bytes_, stream_,
               staged_x(xst_ffn_, T));
  } else {
    moe_prefill(L.moe, act_, f_, D, T, K, route_ids_, route_w_, act_, y_, D, moe_ws_, moe_ws_bytes_, stream_);
  }
  prof_.mark("moe", stream_);
}

int64_t CudaSession::rows_bound(int src) const {
  const DeviceKVGeometry& g = cache_.geometry();
  const int r = g.source_ratio[src];
  // (the indexer sees (p + 1) / r rows at position p: at most ctx_bound_ / r)
  return r > 0 ? std::min<int64_t>(g.row_capacity(src), ctx_bound_ / r) : 0;
}

int64_t CudaSession::decode_graph_ctx(int64_t ctx) const {
  static const int64_t lo = std::max(1, env_int("DSX_GRAPH_MIN_CTX", 16384));
  int64_t b = lo;
  while (b < ctx) b *= 2;
  return std::min(b, max_ctx_);
}

// The decode step's layers [l0, l1) (with the embedding / head at the ends) as a graph.
// A graph that ends with the head also picks the greedy id (enqueue_pick).
cudaGraphExec_t CudaSession::capture(int T, int l0, int l1) {
  cudaGraph_t g = nullptr;
  const bool pick = l1 == c_.n_layers && T == 1;
  if (pick) {
    gemv_pick_reserve(d_ids_, stream_);
    argmax_reserve(d_ids_, stream_);  // (in case the head runs another path)
  }
  DSX_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  try {
    pick_in_head_ = pick;
    forward(T, false, l0, l1);
    pick_in_head_ = false;
  } catch (...) {
    pick_in_head_ = false;
    cudaStreamEndCapture(stream_, &g);
    if (g) cudaGraphDestroy(g);
    throw;
  }
  DSX_CUDA_CHECK(cudaStreamEndCapture(stream_, &g));
  cudaGraphExec_t e = nullptr;
  const cudaError_t err =
      cudaGraphInstantiate(&e, g, side_prio_enabled() ? cudaGraphInstantiateFlagUseNodePriority : 0);
  cudaGraphDestroy(g);
  DSX_CUDA_CHECK(err);
  return e;
}

void CudaSession::step(const int32_t* ids, int T, bool all_rows) {
  for (int t = 0; t < T; ++t)
    if (ids[t] < 0 || ids[t] >= c_.vocab_size)
      fail("token id ", ids[t], " at position ", pos_ + t, " is outside the vocabulary (", c_.vocab_size, ")");
  if (pos_ + T > max_ctx_)
    fail("context of ", pos_ + T, " tokens exceeds this session's capacity of ", max_ctx_, " (EngineOptions::max_context)");
  drop_ahead();
  picked_ = false;
  // the pinned input buffers may still be read by the previous step's copies
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::memcpy(h_ids_.data(), ids, static_cast<size_t>(T) * 4);
  DSX_CUDA_CHECK(cudaMemcpyAsync(d_ids_, h_ids_.data(), static_cast<size_t>(T) * 4, cudaMemcpyHostToDevice, stream_));
  if (T == 1 && !all_rows) {
    // Decode: the first steps run eagerly (kernels set their launch attributes), then
    // the step is captured as a CUDA graph and replayed, per context bound (ctx_bound_).
    // A new bound first runs one step eagerly, so that every kernel variant it selects
    // has been launched (and has set its attributes) before the capture.
    const int64_t want = decode_graph_ctx(pos_ + 1);
    if (graph_ && !graph_serves(pos_)) {
      DSX_CUDA_CHECK(cudaGraphExecDestroy(graph_));
      graph_ = nullptr;
      if (graph_a_) DSX_CUDA_CHECK(cudaGraphExecDestroy(graph_a_));
      graph_a_ = nullptr;
    }
    if (!graph_ && decode_steps_ >= 1 && !prof_.on() && warm_ctx_ == want) {
      graph_ctx_ = ctx_bound_ = want;
      const int split = split_layer_ < c_.n_layers ? split_layer_ : 0;
      if (graph_a_) DSX_CUDA_CHECK(cudaGraphExecDestroy(graph_a_));  // (left by a failed capture)
      graph_a_ = nullptr;
      if (split > 0) graph_a_ = capture(1, 0, split);
      graph_ = capture(1, split, c_.n_layers);
    }
    if (graph_) {
      if (graph_timing_ && !gt0_) {
        DSX_CUDA_CHECK(cudaEventCreate(&gt0_));
        DSX_CUDA_CHECK(cudaEventCreate(&gt1_));
      }
      if (graph_timing_) DSX_CUDA_CHECK(cudaEventRecord(gt0_, stream_));
      if (graph_a_) {
        // the layers before the first Engram layer run while the host gathers its rows
        DSX_CUDA_CHECK(cudaGraphLaunch(graph_a_, stream_));
        stage_engram(ids, T, copy_stream_);
        DSX_CUDA_CHECK(cudaEventRecord(ev_engram_, copy_stream_));
        DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_engram_, 0));
      } else {
        stage_engram(ids, T, stream_);
      }
      DSX_CUDA_CHECK(cudaGraphLaunch(graph_, stream_));
      if (graph_timing_) DSX_CUDA_CHECK(cudaEventRecord(gt1_, stream_));
      picked_ = true;
    } else {
      stage_engram(ids, T, stream_);
      ctx_bound_ = warm_ctx_ = want;
      forward(1, false);
    }
    ++decode_steps_;
  } else {
    stage_engram(ids, T, stream_);
    ctx_bound_ = pos_ + T;
    forward(T, all_rows);
  }
  pos_ += T;
  tokens_.insert(tokens_.end(), ids, ids + T);
}

void CudaSession::feed(const int32_t* ids, int64_t n, float* logits, bool all_rows) {
  DSX_CHECK(n > 0, "feed: no tokens");
  const auto wall0 = std::chrono::steady_clock::now();
  const bool timed = graph_timing_ && graph_ && n == 1 && !all_rows;
  const int64_t V = c_.vocab_size;
  for (int64_t p = 0; p < n; p += tmax_) {
    const int T = static_cast<int>(std::min<int64_t>(tmax_, n - p));
    const bool last = p + T == n;
    step(ids + p, T, all_rows);
    if (all_rows) {
      DSX_CUDA_CHECK(cudaMemcpyAsync(logits + p * V, logits_, static_cast<size_t>(T * V) * 4, cudaMemcpyDeviceToHost, stream_));
    } else if (last) {
      DSX_CUDA_CHECK(cudaMemcpyAsync(h_logits_.data(), logits_, static_cast<size_t>(V) * 4, cudaMemcpyDeviceToHost, stream_));
      DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
      std::memcpy(logits, h_logits_.data(), static_cast<size_t>(V) * 4);
    }
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (timed) note_graph_time(wall0);
}

// DSX_GRAPH_TIMING: the replayed graph's device time and the step's wall time (the
// stream has been synchronised).
void CudaSession::note_graph_time(std::chrono::steady_clock::time_point wall0) {
  float ms = 0;
  DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, gt0_, gt1_));
  graph_ms_ += ms;
  step_wall_ms_ += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall0).count();
  ++graph_runs_;
}

int32_t CudaSession::feed_greedy(const int32_t* ids, int64_t n) {
  DSX_CHECK(n > 0, "feed: no tokens");
  const auto wall0 = std::chrono::steady_clock::now();
  const bool timed = graph_timing_ && graph_ && n == 1;
  if (n == 1 && ahead_.on && ids[0] == ahead_.id && pos_ == ahead_.pos) {
    continue_ahead(ids[0]);
  } else {
    for (int64_t p = 0; p < n; p += tmax_) step(ids + p, static_cast<int>(std::min<int64_t>(tmax_, n - p)), false);
  }
  if (!picked_) enqueue_pick();  // (the decode graph picks itself)
  DSX_CUDA_CHECK(cudaEventRecord(ev_pick_, stream_));
  run_ahead();
  DSX_CUDA_CHECK(cudaEventSynchronize(ev_pick_));
  const int32_t pick = h_pick_.data()[0];
  if (ahead_.on) ahead_.id = pick;
  if (timed) note_graph_time(wall0);
  return pick;
}

// The greedy id from the last step's last-row logits (logits_[0 .. V)): into pinned host
// memory (written by the kernel) and into d_ids_, the next step's input.
void CudaSession::enqueue_pick() {
  argmax_rows(logits_, c_.vocab_size, 1, c_.vocab_size, d_ids_, stream_, h_pick_.data());
}

bool CudaSession::graph_serves(int64_t p) const {
  const int64_t want = decode_graph_ctx(p + 1);
  return graph_ && p + 1 <= graph_ctx_ && want * 4 > graph_ctx_;
}

// After a decode step's pick (enqueued, not yet read): the next step's first graph on
// the pick, when the captured graphs serve that step. The ring slots it is about to
// write are in the stash already (continue_ahead copied them on the copy stream) or are
// stashed now (a tiny copy on the session stream, before it).
void CudaSession::run_ahead() {
  if (!run_ahead_enabled() || !graph_a_ || prof_.on() || pos_ + 1 > max_ctx_ || !graph_serves(pos_)) return;
  if (stashed_pos_ != pos_) cache_.stash_slots(split_layer_, pos_, ahead_stash_, stream_);
  stashed_pos_ = pos_;
  if (graph_timing_) {
    if (!gt0_ahead_) DSX_CUDA_CHECK(cudaEventCreate(&gt0_ahead_));
    DSX_CUDA_CHECK(cudaEventRecord(gt0_ahead_, stream_));
  }
  DSX_CUDA_CHECK(cudaGraphLaunch(graph_a_, stream_));
  ahead_.on = true;
  ahead_.pos = pos_;
  ahead_.id = -1;  // (set once the host has read the pick)
}

// The step at pos_ with id, whose first graph runs already: the Engram rows of the
// history, then the rest of the step (as step() does after graph_a_).
void CudaSession::continue_ahead(int32_t id) {
  ahead_.on = false;
  if (graph_timing_) std::swap(gt0_, gt0_ahead_);
  // the next position's slots (nothing pending writes them: graph_a_ writes this
  // position's, graph_ only layers from split_layer_ on)
  stashed_pos_ = -1;
  if (pos_ + 2 <= max_ctx_ && graph_serves(pos_ + 1)) {
    cache_.stash_slots(split_layer_, pos_ + 1, ahead_stash_, copy_stream_);
    stashed_pos_ = pos_ + 1;
  }
  stage_engram(&id, 1, copy_stream_);
  DSX_CUDA_CHECK(cudaEventRecord(ev_engram_, copy_stream_));
  DSX_CUDA_CHECK(cudaStreamWaitEvent(stream_, ev_engram_, 0));
  DSX_CUDA_CHECK(cudaGraphLaunch(graph_, stream_));
  if (graph_timing_) DSX_CUDA_CHECK(cudaEventRecord(gt1_, stream_));
  picked_ = true;
  ++decode_steps_;
  ++pos_;
  tokens_.push_back(id);
}

// Before anything but a step continued from the run-ahead: a step run ahead will not go
// on, so its ring slots go back as they were (ordered after it on the session stream; the
// device position never moved, graph_a_ does not advance it, and anything else it wrote
// is scratch or lies past the cache's row counts); and the stash is forgotten (what runs
// next may write the slots it holds).
void CudaSession::drop_ahead() {
  if (ahead_.on) {
    ahead_.on = false;
    cache_.unstash_slots(split_layer_, ahead_.pos, ahead_stash_, stream_);
    DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  stashed_pos_ = -1;
}

std::vector<uint8_t> CudaSession::save() const {
  const_cast<CudaSession*>(this)->drop_ahead();  // (restores state bytes; logically const)
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  KVState st = make_kv_state(c_, cache_.geometry().rollback_depth, m_.fingerprint);
  cache_.download(st, stream_);
  st.tokens = tokens_;
  st.pos = pos_;
  return st.save();
}

void CudaSession::restore(const std::vector<uint8_t>& snap) {
  KVState st = make_kv_state(c_, cache_.geometry().rollback_depth, m_.fingerprint);
  st.restore(snap.data(), snap.size());
  if (st.pos > max_ctx_) fail("snapshot of ", st.pos, " tokens exceeds this session's capacity of ", max_ctx_);
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cache_.upload(st, stream_);
  pos_ = st.pos;
  tokens_ = st.tokens;
}

bool CudaSession::synthetic_fill(int64_t n, uint64_t seed) {
  if (pos_ + n > max_ctx_) fail("synthetic_fill: ", pos_ + n, " tokens exceed the capacity of ", max_ctx_);
  drop_ahead();
  const auto& g = cache_.geometry();
  const int64_t hd = g.head_dim, id = g.idx_dim, end = pos_ + n;
  uint64_t k = seed;
  for (int l = 0; l < g.n_layers; ++l) {
    const Fq8Rows w = cache_.window(l);
    fill_random(w.codes, g.window_cap() * hd, 0, ++k, 0, 0, 0, 0, stream_);
    fill_random(w.scales, g.window_cap() * hd / 32, 2, ++k, 0, 0, 120, 1, stream_);
    if (g.source_ratio[static_cast<size_t>(l)] == 0) continue;
    const int64_t rows = end / g.source_ratio[static_cast<size_t>(l)];
    const Fq4e4Rows c = cache_.compressed(l);
    fill_random(c.packed, rows * hd / 2, 1, ++k, 0, 0, 0, 0, stream_);
    fill_random(c.scales, rows * hd / 16, 2, ++k, 0, 0, 0x30, 1, stream_);  // positive e4m3 scales
    const Fq4e8Rows key = cache_.keys(l);
    fill_random(key.packed, rows * id / 2, 1, ++k, 0, 0, 0, 0, stream_);
    fill_random(key.scales, rows * id / 32, 2, ++k, 0, 0, 120, 1, stream_);
  }
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cache_.set_position(end, stream_);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  for (int64_t i = 0; i < n; ++i) tokens_.push_back(3 + static_cast<int32_t>(rng() % 100000));
  pos_ = end;
  return true;
}

void CudaSession::rollback(int64_t p) {
  const int depth = cache_.geometry().rollback_depth;
  if (p > pos_ || p < 0 || pos_ - p > depth)
    fail("cannot roll back from position ", pos_, " to ", p, " (at most ", depth, " tokens)");
  drop_ahead();
  DSX_CUDA_CHECK(cudaStreamSynchronize(stream_));
  cache_.set_position(p, stream_);
  pos_ = p;
  tokens_.resize(static_cast<size_t>(p));
}

// ---------------------------------------------------------------------------
class CudaEngine : public Engine {
 public:
  CudaEngine(std::unique_ptr<DeviceModel> m, EngineOptions o) : m_(std::move(m)), o_(std::move(o)) {}
  const ModelConfig& config() const override { return m_->cfg; }
  std::unique_ptr<Session> new_session() override { return std::make_unique<CudaSession>(*m_, o_); }
  std::string describe() const override {
    cudaDeviceProp p{};
    int dev = 0;
    cudaGetDevice(&dev);
    cudaGetDeviceProperties(&p, dev);
    return cat("cuda ", p.name, ", ", act_name(m_->act), " activations, weights ", m_->weight_bytes / 1e9, " GB");
  }
  const DeviceModel& model() const { return *m_; }
  const EngineOptions& options() const { return o_; }

 private:
  std::unique_ptr<DeviceModel> m_;
  EngineOptions o_;
};

Act parse_precision(const std::string& p) {
  if (p == "fp32") return Act::F32;
  if (p == "bf16") return Act::BF16;
  fail("unknown precision '", p, "' (fp32 or bf16)");
}

struct Registration {
  Registration() {
    register_engine_backend("cuda", [](const std::string& dir, const EngineOptions& o) { return load_cuda_engine(dir, o); });
  }
} registration;

}  // namespace

std::unique_ptr<Engine> load_cuda_engine(const std::string& dir, const EngineOptions& o) {
  if (!device_available()) fail("backend cuda: no CUDA device is available");
  const Act act = parse_precision(o.precision);
  ModelConfig cfg = load_model_config(dir);
  if (cfg.family != Family::V41) fail(dir, ": the CUDA backend runs V4.1 models only");
  auto files = std::make_shared<ModelFiles>(dir);
  ModelWeights w = bind_weights(cfg, files);
  auto cmap = load_engram_token_map(dir, cfg);
  return std::make_unique<CudaEngine>(DeviceModel::from_weights(cfg, w, act, std::move(cmap)), o);
}

std::unique_ptr<Engine> make_synthetic_cuda_engine(const ModelConfig& cfg, const EngineOptions& o, uint64_t seed) {
  if (!device_available()) fail("backend cuda: no CUDA device is available");
  return std::make_unique<CudaEngine>(DeviceModel::synthetic(cfg, parse_precision(o.precision), seed), o);
}

ModelConfig synthetic_v41_flash_config(int layers) {
  DSX_CHECK(layers >= 1 && layers <= 40, "--layers must be in [1, 40]");
  ModelConfig c;
  c.family = Family::V41;
  c.model_type = "deepseek_v41";
  c.vocab_size = 129280;
  c.hidden = 5120;
  c.n_layers = layers;
  c.n_heads = 64;
  c.head_dim = 512;
  c.rope_dim = 64;
  c.q_lora_rank = 1280;
  c.o_lora_rank = 1024;
  c.o_groups = 8;
  c.window = 128;
  c.rms_eps = 1e-20f;
  c.rope_theta = 10000;
  c.compress_rope_theta = 160000;
  c.yarn = {true, 16, 32, 1, 65536};
  c.index_n_heads = 32;
  c.index_head_dim = 128;
  c.index_topk = 512;
  c.candidate_topk_blocks = 2048;
  c.candidate_block_size = 8;
  c.moe_inter = 2304;
  c.n_routed_experts = 384;
  c.n_experts_per_tok = 6;
  c.scoring_func = "sqrtsoftplus";
  c.routed_scaling = 1.5f;
  c.swiglu_limit = 10.0f;
  c.hc_mult = 4;
  c.hc_sinkhorn_iters = 20;
  c.hc_eps = 1e-6f;
  c.quant_block = 32;
  // The release schedule in miniature: 0 window, 1 window + Engram, 2 ratio-2 KV
  // source, 3 ratio-2 reuse, 4 ratio-1 KV + candidate source, 5 reuse, 6 re-index, 7..
  // alternate reuse / re-index.
  const int pattern[8] = {0, 0, 2, 2, 1, 1, 1, 1};
  for (int l = 0; l < layers; ++l) c.compress_ratios.push_back(l < 8 ? pattern[l] : 1);
  if (layers > 2) c.kv_source_layers.push_back(2), c.index_source_layers.push_back(2);
  if (layers > 4) c.kv_source_layers.push_back(4), c.index_source_layers.push_back(4), c.candidate_source_layer = 4;
  for (int l = 6; l < layers; l += 2) c.index_source_layers.push_back(l);
  if (layers > 1) {
    c.engram_layers = {1};
    c.engram_num_embeddings = {384006168};
    c.engram_max_ngram = 4;
    c.engram_vocab_size = 16000000;
    c.engram_n_heads = 8;
    c.engram_head_dim = 256;
    c.engram_pad_id = 2;
    c.engram_compressed_vocab = 99092;
  }
  return c;
}

CudaEngineStats cuda_engine_stats(Engine& e) {
  auto* ce = dynamic_cast<CudaEngine*>(&e);
  DSX_CHECK(ce, "cuda_engine_stats: not a CUDA engine");
  CudaEngineStats s;
  s.weight_bytes = ce->model().weight_bytes;
  s.decode_weight_bytes = ce->model().decode_weight_bytes;
  // device-to-device copy bandwidth (read + write counted once each)
  const size_t n = size_t{1} << 30;
  DeviceBuffer a(n), b(n);
  cudaEvent_t e0, e1;
  DSX_CUDA_CHECK(cudaEventCreate(&e0));
  DSX_CUDA_CHECK(cudaEventCreate(&e1));
  DSX_CUDA_CHECK(cudaMemcpy(b.get(), a.get(), n, cudaMemcpyDeviceToDevice));
  float best = 1e30f;
  for (int i = 0; i < 10; ++i) {
    DSX_CUDA_CHECK(cudaEventRecord(e0));
    DSX_CUDA_CHECK(cudaMemcpyAsync(b.get(), a.get(), n, cudaMemcpyDeviceToDevice));
    DSX_CUDA_CHECK(cudaEventRecord(e1));
    DSX_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    DSX_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    best = std::min(best, ms);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  s.copy_bandwidth_gb_s = 2.0 * n / (best * 1e-3) / 1e9;
  return s;
}

int64_t v41_decode_weight_bytes(const ModelConfig& c) {
  const int64_t D = c.hidden, M = c.hc_mult, H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank;
  const int64_t G = c.o_groups, ol = c.o_lora_rank, I = c.moe_inter, B = c.quant_block;
  auto fp8 = [&](int64_t n, int64_t k) { return n * k + ((n + B - 1) / B) * ((k + B - 1) / B); };
  auto fp4 = [&](int64_t n, int64_t k) { return n * k / 2 + n * (k / 32); };
  int64_t b = c.vocab_size * D * 2 + D * 2;  // head (bf16) + one embedding row
  for (int l = 0; l < c.n_layers; ++l) {
    b += 2 * static_cast<int64_t>(c.hc_mix_dim()) * M * D * 4;
    b += fp8(ql, D) + fp8(H * hd, ql) + fp8(hd, D) + fp8(G * ol, H * hd / G) + fp8(D, G * ol);
    if (c.is_kv_source(l)) b += (c.ratio(l) > 1 ? 2 : 1) * hd * D * 2 + c.index_head_dim * hd * 2;
    if (c.is_index_source(l)) b += fp8(static_cast<int64_t>(c.index_n_heads) * c.index_head_dim, ql) + c.index_n_heads * D * 2;
    b += c.n_routed_experts * D * 2;                              // router gate (bf16)
    b += 2 * fp8(I, D) + fp8(D, I);                               // shared expert
    b += c.n_experts_per_tok * (2 * fp4(I, D) + fp4(D, I));       // routed experts
    if (c.is_engram_layer(l)) {
      const int64_t nc = static_cast<int64_t>(c.engram_max_ngram - 1) * c.engram_n_heads, ed = c.engram_head_dim;
      b += fp8((M + 1) * D, nc * ed) + nc * (ed + ed / 32);
    }
  }
  return b;
}

int64_t cuda_decode_state_bytes(const ModelConfig& c, int64_t ctx) {
  int64_t b = 0;
  const int64_t hd = c.head_dim, ihd = c.index_head_dim;
  const int64_t win_row = hd + hd / 32, cmp_row = hd / 2 + hd / 16, key_row = ihd / 2 + ihd / 32;
  for (int l = 0; l < c.n_layers; ++l) {
    b += std::min<int64_t>(ctx, c.window) * win_row;
    const int r = c.ratio(l);
    if (r == 0) continue;
    const int64_t n = ctx / r;
    b += std::min<int64_t>(n, c.index_topk) * cmp_row;
    if (c.is_index_source(l)) {
      const bool restricted = c.candidate_source_layer >= 0 && c.candidate_source_layer < l;
      b += (restricted ? std::min<int64_t>(n, static_cast<int64_t>(c.candidate_topk_blocks) * c.candidate_block_size) : n) * key_row;
    }
  }
  return b;
}

}  // namespace dsx
