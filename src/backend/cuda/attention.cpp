// §3.4 attention of one layer for a pass (forward.h): the weight products over all rows;
// window KV, compressor, indexer scores, top-k, attention and ring stores per segment
// (session), on the segment's rows and state.
#include <cmath>

#include "backend/cuda/forward.h"
#include "kernels/cuda/attention.h"
#include "kernels/cuda/compressor.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/indexer.h"
#include "kernels/cuda/topk.h"
#include "model/layer_plan.h"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

namespace {

Fq8Rows rows_from(const Fq8Rows& b, int r0) {
  return {b.codes + static_cast<int64_t>(r0) * b.dim, b.scales + static_cast<int64_t>(r0) * (b.dim / 32), b.dim};
}

// The rows a layer's indexer / top-k launches can see at the segment's context bound.
int64_t rows_bound(const Segment& sg, int src) {
  const int r = sg.s->cache->geometry().source_ratio[static_cast<size_t>(src)];
  // (the indexer sees (p + 1) / r rows at position p: at most ctx_bound / r)
  return r > 0 ? std::min<int64_t>(sg.s->cache->row_capacity(src), sg.ctx_bound / r) : 0;
}

}  // namespace

void Forward::attention(const Pass& p, int l) {
  const DevLayer& L = m_.layers[static_cast<size_t>(l)];
  const LayerPlan lp = layer_plan(c_, l);
  const int T = p.T;
  const int64_t D = c_.hidden, H = c_.n_heads, hd = c_.head_dim, ql = c_.q_lora_rank;
  const int64_t G = c_.o_groups, ol = c_.o_lora_rank, ih = c_.index_n_heads, ihd = c_.index_head_dim;
  const int r = lp.ratio;
  const float* inv_freq = lp.comp_rope() ? m_.comp_inv_freq : m_.main_inv_freq;
  const int np = c_.rope_dim / 2;
  const size_t ab = w_.ab;
  cudaStream_t main = s_.main;
  // Decode runs independent chains concurrently (graph branches): the queries on the
  // session stream, the window KV on side 0, the compressor on side 1 and the indexer
  // weights on side 2; they join before the indexer scoring (compressor row, indexer
  // weights) and the attention (window KV, projection store). Prefill (and profiling)
  // keeps one stream. One row: wkv with wq_a (§3.4.1) in one launch on the session
  // stream (L.wq_a_kv; the kv row lands after q_lat's), side 0 forked after it for
  // kv_finish (wkv launched on side 0 started late, its blocks held SMs the wq_b after
  // wq_a needed, and wq_b ended up to 8 us late in half the layers: s17 kernel timelines).
  const bool branch = branches(T);
  const bool joint_qkv = T == 1 && L.wq_a_kv.rows > 0 && sw::on(sw::Id::JOINT_QKV);
  cudaStream_t s_kv = branch ? s_.side[0] : main, s_cmp = branch ? s_.side[1] : main, s_iw = branch ? s_.side[2] : main;
  const bool idx_w = lp.index_source;                // (the indexer weights: their own branch)
  const bool proj_store_on = r > 1 && lp.kv_source;  // (side 1 ends with it: ev_join[3])
  if (branch) {
    DSX_CUDA_CHECK(cudaEventRecord(s_.ev_fork, main));
    for (int i = joint_qkv ? 1 : 0; i < (idx_w ? 3 : 2); ++i) DSX_CUDA_CHECK(cudaStreamWaitEvent(s_.side[i], s_.ev_fork, 0));
    side_used_ |= idx_w ? 7 : 3;
  }
  if (idx_w) {
    lin(L.idx_weights_proj, w_.a, D, T, m_.act, w_.idx_w, ih, false, 1, s_iw);
    if (branch) DSX_CUDA_CHECK(cudaEventRecord(s_.ev_join[2], s_iw));
  }
  // §3.4.2 window KV (one row: with wq_a)
  void* kv_in = w_.kv_raw;
  if (joint_qkv) {
    lin(L.wq_a_kv, w_.a, D, T, m_.act, w_.q_lat, ql + hd, true, 1, nullptr, staged_x(w_.xst_attn, T));
    kv_in = static_cast<char*>(w_.q_lat) + ql * ab;
    if (branch) {
      DSX_CUDA_CHECK(cudaEventRecord(s_.ev_kv_fork, main));
      DSX_CUDA_CHECK(cudaStreamWaitEvent(s_kv, s_.ev_kv_fork, 0));
    }
  } else {
    lin(L.wkv, w_.a, D, T, m_.act, w_.kv_raw, hd, true, 1, s_kv, staged_x(w_.xst_attn, T));
  }
  prof_.mark("wkv", main);
  // per segment: its rows' window KV at its positions; a one-row segment also writes its
  // row straight into its window ring (no window_store after the attention)
  for (const Segment& sg : p.segs) {
    const Fq8Rows ring = sg.s->cache->window(l);
    kv_finish(m_.act, act_row(kv_in, sg.r0, hd), L.kv_norm, c_.rms_eps, sg.n, static_cast<int>(hd), np, inv_freq,
              sg.s->cache->d_pos(), rows_from(w_.chunk, sg.r0), s_kv, sg.n == 1 ? &ring : nullptr,
              sg.s->cache->geometry().window_cap());
  }
  if (branch) DSX_CUDA_CHECK(cudaEventRecord(s_.ev_join[0], s_kv));
  prof_.mark("kv_finish", main);
  // §3.4.3 compressor (KV sources) and the indexer weights, which read only `a`
  if (lp.kv_source) {
    const bool joint = T == 1 && r > 1 && L.comp_kv_gate.rows > 0;  // (one launch: kappa holds both rows)
    if (r > 1) {
      if (joint) {
        lin(L.comp_kv_gate, w_.a, D, T, Act::F32, w_.kappa, 2 * hd, false, 1, s_cmp);
      } else {
        lin(L.comp_wkv, w_.a, D, T, Act::F32, w_.kappa, hd, false, 1, s_cmp);
        lin(L.comp_wgate, w_.a, D, T, Act::F32, w_.gamma, hd, false, 1, s_cmp);
      }
    } else {
      lin(L.comp_wkv, w_.a, D, T, m_.act, w_.comp_act, hd, false, 1, s_cmp);
    }
    std::vector<CompressorArgs> cas;
    for (const Segment& sg : p.segs) {
      CompressorArgs ca;
      ca.T = sg.n, ca.ratio = r, ca.head_dim = static_cast<int>(hd), ca.idx_dim = c_.index_head_dim, ca.n_pairs = np;
      ca.eps = c_.rms_eps;
      if (r > 1) {
        ca.kv = joint ? w_.kappa : w_.kappa + sg.r0 * hd;
        ca.gate = joint ? w_.kappa + hd : w_.gamma + sg.r0 * hd;
        ca.proj_kv = sg.s->cache->proj_kv(l), ca.proj_gate = sg.s->cache->proj_gate(l);
        ca.proj_cap = sg.s->cache->geometry().proj_cap(l);
      } else {
        ca.kv_act = act_row(w_.comp_act, sg.r0, hd);
      }
      ca.norm = L.comp_norm, ca.inv_freq = m_.comp_inv_freq;
      ca.wk = reinterpret_cast<const uint16_t*>(L.idx_wk.data), ca.k_norm = L.idx_k_norm;
      ca.rows = sg.s->cache->compressed(l), ca.keys = sg.s->cache->keys(l), ca.d_pos = sg.s->cache->d_pos();
      compressor_emit(m_.act, ca, s_cmp);
      cas.push_back(ca);
    }
    // (the indexer and the attention need the emitted row; the projection store after it
    // is for later steps and joins only before the attention)
    if (branch) DSX_CUDA_CHECK(cudaEventRecord(s_.ev_join[1], s_cmp));
    if (proj_store_on) {
      for (size_t i = 0; i < p.segs.size(); ++i) {
        const Segment& sg = p.segs[i];
        proj_store(cas[i].kv, cas[i].gate, sg.n, static_cast<int>(hd), sg.s->cache->proj_kv(l), sg.s->cache->proj_gate(l),
                   sg.s->cache->geometry().proj_cap(l), sg.s->cache->d_pos(), s_cmp);
      }
      if (branch) DSX_CUDA_CHECK(cudaEventRecord(s_.ev_join[3], s_cmp));
    }
    prof_.mark("compressor", main);
  } else if (branch) {
    DSX_CUDA_CHECK(cudaEventRecord(s_.ev_join[1], s_cmp));
  }
  // §3.4.1 queries (one row: with wkv above)
  if (!joint_qkv) lin(L.wq_a, w_.a, D, T, m_.act, w_.q_lat, ql, true, 1, nullptr, staged_x(w_.xst_attn, T));
  prof_.mark("wq_a", main);
  // q_norm, then wq_b (RoPE: in the attention, aa.q_inv_freq); the normalized rows land in
  // q_latn for the indexer. Up to kGemvMaxT rows the norm is done by wq_b's kernel while it
  // stages its input (GemvOpts::norm_w), which saves the norm's own launch.
  // Index layers, one row: wq_b and idx_wq_b in one launch (L.wq_b_idx, both read the
  // normalized latent); the indexer's queries land after q's row.
  const bool joint_q = T == 1 && lp.index_source && L.wq_b_idx.rows > 0 && sw::on(sw::Id::JOINT_Q);
  void* idx_q = joint_q ? static_cast<char*>(w_.q) + H * hd * ab : w_.idx_q;
  bool q_staged = false;
  if (T <= kGemvMaxT) {
    GemvOpts o = gemv_opts(true, 1, main);
    o.norm_w = L.q_norm, o.norm_eps = c_.rms_eps, o.norm_out = w_.q_latn;
    // (for a separate idx_wq_b: the normalized row's QA8, staged by wq_b's block 0)
    if (lp.index_source && !joint_q) o.norm_staged = staged_x(w_.xst_q, T);
    if (joint_q)
      gemv(L.wq_b_idx, m_.act, w_.q_lat, ql, T, m_.act, w_.q, L.wq_b_idx.rows, o, main);
    else
      gemv(L.wq_b, m_.act, w_.q_lat, ql, T, m_.act, w_.q, H * hd, o, main);
    q_staged = o.norm_staged && gemv_last_staged();
  } else {
    rmsnorm(m_.act, w_.q_lat, w_.q_latn, L.q_norm, T, static_cast<int>(ql), c_.rms_eps, nullptr, nullptr, main);
    lin(L.wq_b, w_.q_latn, ql, T, m_.act, w_.q, H * hd, true);
  }
  prof_.mark("q_norm+wq_b", main);
  // §3.4.4-3.4.6 selection of compressed rows (index sources; the others reuse the last set)
  if (lp.index_source) {
    if (!joint_q) lin(L.idx_wq_b, w_.q_latn, ql, T, m_.act, idx_q, ih * ihd, true, 1, nullptr, q_staged ? w_.xst_q : nullptr);
    for (const Segment& sg : p.segs)
      rope_fq4e8(m_.act, act_row(idx_q, sg.r0, ih * ihd), w_.idx_qf + sg.r0 * ih * ihd, sg.n, static_cast<int>(ih),
                 static_cast<int>(ihd), np, m_.comp_inv_freq, sg.s->cache->d_pos(), main);
    prof_.mark("indexer q/w", main);
    if (branch) {
      DSX_CUDA_CHECK(cudaStreamWaitEvent(main, s_.ev_join[1], 0));
      DSX_CUDA_CHECK(cudaStreamWaitEvent(main, s_.ev_join[2], 0));
    }
    const int cb = c_.candidate_topk_blocks, bs = c_.candidate_block_size;
    for (const Segment& sg : p.segs) {
      const int64_t r0 = sg.r0;
      IndexerScoreArgs ia;
      ia.T = sg.n, ia.n_heads = static_cast<int>(ih), ia.head_dim = static_cast<int>(ihd), ia.ratio = r;
      ia.q = w_.idx_qf + r0 * ih * ihd, ia.w = act_row(w_.idx_w, r0, ih), ia.keys = sg.s->cache->keys(lp.source);
      ia.max_rows = rows_bound(sg, lp.source);
      if (lp.uses_candidates) {
        ia.cand_blocks = w_.cand + r0 * cb, ia.cand_ld = cb, ia.cand_count = w_.cand_count + r0;
        ia.cand_block_size = bs;
        ia.max_rows = std::min<int64_t>(ia.max_rows, static_cast<int64_t>(cb) * bs);
      }
      float* scores = w_.scores + r0 * w_.score_ld;
      ia.scores = scores, ia.ld = w_.score_ld, ia.counts = w_.counts + r0, ia.d_pos = sg.s->cache->d_pos();
      indexer_scores(m_.act, ia, main);
      if (lp.candidate_source) {
        const int64_t max_blocks = std::min<int64_t>(w_.block_ld, ia.max_rows / bs + 1);
        block_scores(sg.n, scores, w_.score_ld, w_.counts + r0, bs, w_.bscores + r0 * w_.block_ld, w_.block_ld,
                     w_.bcounts + r0, max_blocks, main);
        topk_select(sg.n, w_.bscores + r0 * w_.block_ld, w_.block_ld, w_.bcounts + r0, cb, nullptr, 0, 1,
                    w_.cand + r0 * cb, cb, w_.cand_count + r0, main, max_blocks);
      }
      topk_select(sg.n, scores, w_.score_ld, w_.counts + r0, c_.index_topk, lp.uses_candidates ? w_.cand + r0 * cb : nullptr,
                  lp.uses_candidates ? cb : 0, lp.uses_candidates ? bs : 1, w_.sel + r0 * c_.index_topk, c_.index_topk,
                  w_.sel_count + r0, main, ia.max_rows);
    }
    prof_.mark("indexer scores + top-k", main);
  }
  if (branch) {
    DSX_CUDA_CHECK(cudaStreamWaitEvent(main, s_.ev_join[0], 0));
    DSX_CUDA_CHECK(cudaStreamWaitEvent(main, proj_store_on ? s_.ev_join[3] : s_.ev_join[1], 0));
  }
  // §3.4.7 attention, with the inverse RoPE of §3.4.8 fused; per segment
  for (size_t i = 0; i < p.segs.size(); ++i) {
    const Segment& sg = p.segs[i];
    AttnArgs aa;
    aa.T = sg.n, aa.n_heads = static_cast<int>(H), aa.head_dim = static_cast<int>(hd), aa.window = c_.window;
    aa.q = act_row(w_.q, sg.r0, H * hd), aa.ring = sg.s->cache->window(l), aa.ring_cap = sg.s->cache->geometry().window_cap();
    aa.chunk = rows_from(w_.chunk, sg.r0);
    if (lp.compressed()) {
      aa.cmp = sg.s->cache->compressed(lp.source);
      aa.sel = w_.sel + sg.r0 * c_.index_topk, aa.sel_ld = c_.index_topk, aa.sel_count = w_.sel_count + sg.r0;
      aa.max_sel = c_.index_topk;
      // (a layer reusing an earlier layer's top-k: its selection is ready before wq_b ends)
      aa.sel_early = !lp.index_source;
    }
    aa.sink = L.attn_sink;
    aa.scale = static_cast<float>(std::pow(static_cast<double>(hd), -0.5));
    aa.n_pairs = np, aa.inv_freq = inv_freq, aa.q_inv_freq = inv_freq;
    // BF16 mode: the tensor-core attention (same numerics up to f32 summation order)
    aa.tensor_cores = m_.act == Act::BF16 && sw::on(sw::Id::ATTN_MMA);
    aa.out = act_row(w_.o, sg.r0, H * hd), aa.d_pos = sg.s->cache->d_pos();
    if (T <= kGemvMaxT) {  // (decode-sized: every query's rows split over blocks, flash-decoding)
      aa.n_splits = w_.attn_splits;
      aa.work = w_.attn_work + sg.r0 * attention_work_floats(1, static_cast<int>(H), static_cast<int>(hd), w_.attn_splits);
    }
    sparse_attention(m_.act, aa, main);
    if (sg.n > 1)
      window_store(aa.chunk, sg.n, aa.ring, aa.ring_cap, sg.s->cache->d_pos(), main);
  }
  prof_.mark("attention", main);
  // §3.4.8 grouped output projection, then wo_b
  // (wo_a's epilogue stages QA8 of its output for wo_b when its plan allows)
  const bool o_staged =
      lin(L.wo_a, w_.o, H * hd, T, m_.act, w_.zeta, G * ol, false, static_cast<int>(G), nullptr, nullptr, staged_x(w_.xst_o, T));
  prof_.mark("wo_a", main);
  lin(L.wo_b, w_.zeta, G * ol, T, m_.act, w_.y, D, true, 1, nullptr, o_staged ? w_.xst_o : nullptr);
  prof_.mark("wo_b", main);
}

}  // namespace dsx::cuda
