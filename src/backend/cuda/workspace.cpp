#include "backend/cuda/workspace.h"

#include <algorithm>
#include <vector>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/gemv.h"
#include "kernels/cuda/hc.h"
#include "util/error.h"

namespace dsx::cuda {

Workspace::Workspace(const DeviceModel& m, int rows, int64_t ctx, int64_t stash_bytes)
    : max_rows(rows), max_ctx(ctx), ab(act_bytes(m.act)) {
  const ModelConfig& c = m.cfg;
  const Act act = m.act;
  const int64_t D = c.hidden, M = c.hc_mult, H = c.n_heads, hd = c.head_dim, ql = c.q_lora_rank;
  const int64_t G = c.o_groups, ol = c.o_lora_rank, E = c.n_routed_experts, K = c.n_experts_per_tok;
  const int64_t ih = c.index_n_heads, ihd = c.index_head_dim, V = c.vocab_size;
  int min_ratio = 0;
  for (int l = 0; l < c.n_layers; ++l)
    if (c.ratio(l) > 0) min_ratio = min_ratio == 0 ? c.ratio(l) : std::min(min_ratio, c.ratio(l));
  score_ld = std::max<int64_t>(1, min_ratio > 0 ? max_ctx / min_ratio + 1 : 1);
  score_ld = std::max<int64_t>(score_ld, static_cast<int64_t>(c.candidate_topk_blocks) * c.candidate_block_size);
  block_ld = c.candidate_block_size > 0 ? score_ld / c.candidate_block_size + 1 : 1;
  attn_splits = attention_decode_splits(c.window, c.index_topk);
  const int64_t T = max_rows;
  // workspace sizes of the linear kernels
  GemmOpts go;
  go.qblock = c.quant_block;
  go.compute = act;
  GemvOpts gv;
  gv.qblock = c.quant_block;
  auto consider = [&](const QMatrix& W, bool qa8, int groups) {
    if (!W.rows) return;
    GemmOpts g = go;
    g.qa8 = qa8;
    g.groups = groups;
    gemm_ws_bytes = std::max(gemm_ws_bytes, ::dsx::cuda::gemm_ws_bytes(W, max_rows, g));
    GemvOpts v = gv;
    v.qa8 = qa8;
    v.groups = groups;
    for (int t = 1; t <= kGemvMaxT; t *= 2) gemv_ws_bytes = std::max(gemv_ws_bytes, gemv_split_ws_bytes(W, t, v));
  };
  for (const auto& L : m.layers) {
    for (const QMatrix* q : {&L.hc_attn_fn, &L.hc_ffn_fn, &L.wq_a, &L.wq_b, &L.wkv, &L.wo_b, &L.comp_wkv,
                             &L.comp_wgate, &L.idx_wq_b, &L.wq_b_idx, &L.wq_a_kv, &L.idx_weights_proj, &L.gate,
                             &L.engram_wkv})
      consider(*q, true, 1);
    consider(L.wo_a, false, c.o_groups);
  }
  consider(m.head, false, 1);
  moe_ws_bytes = std::max({moe_decode_ws_bytes(m.layers[0].moe, kMoeDecodeRows, static_cast<int>(K)) * 2,
                           moe_decode_ws_bytes(m.layers[0].moe, kGemvMaxT, static_cast<int>(K)),
                           moe_prefill_ws_bytes(m.layers[0].moe, max_rows, static_cast<int>(K))});
  moe_ws_bytes = (moe_ws_bytes + 511) & ~size_t{511};  // (two aligned halves)
  const int nl = m.engram.n_layers, nc = m.engram.n_cols;
  const int64_t ed = c.engram_head_dim, W = c.tap_width();

  auto sizes = [&](Arena* a, size_t& total) {
    auto take = [&](size_t n) -> void* {
      if (!a) {
        total += aligned(n);
        return nullptr;
      }
      return a->take(n);
    };
    d_ids = static_cast<int32_t*>(take(T * 4));
    ahead_stash = static_cast<uint8_t*>(take(static_cast<size_t>(std::max<int64_t>(1, stash_bytes))));
    d_engram_ids = static_cast<int64_t*>(take(std::max<int64_t>(1, T * nl * nc) * 8));
    engram_stage = static_cast<uint8_t*>(take(std::max<int64_t>(1, nl * T * nc * ed)));
    engram_stage_scale = static_cast<uint8_t*>(take(std::max<int64_t>(1, nl * T * nc * ed / 32)));
    d_iota = static_cast<int64_t*>(take(std::max<int64_t>(1, T * nc) * 8));
    X = take(T * M * D * ab);
    this->a = take(T * D * ab);
    f = take(T * D * ab);
    y = take(T * D * ab);
    h = take(T * D * ab);
    sig_hc = static_cast<unsigned*>(take(64));
    pre0 = static_cast<float*>(take(T * M * 4));
    pa = static_cast<float*>(take(T * M * 4));
    qa = static_cast<float*>(take(T * M * 4));
    Ca = static_cast<float*>(take(T * M * M * 4));
    pf = static_cast<float*>(take(T * M * 4));
    qf = static_cast<float*>(take(T * M * 4));
    Cf = static_cast<float*>(take(T * M * M * 4));
    hc_work = take(hc_work_bytes(static_cast<int>(T), D));
    q_lat = take((T * ql + hd) * ab);  // (+ one token's kv row: the joint wq_a / wkv product)
    q_latn = take(T * ql * ab);
    q = take((T * H * hd + ih * ihd) * ab);  // (+ one token's idx_q: the joint wq_b / idx_wq_b product)
    kv_raw = take(T * hd * ab);
    chunk.dim = static_cast<int>(hd);
    chunk.codes = static_cast<uint8_t*>(take(T * hd));
    chunk.scales = static_cast<uint8_t*>(take(T * hd / 32));
    o = take(T * H * hd * ab);
    zeta = take(T * G * ol * ab);
    kappa = static_cast<float*>(take(std::max<int64_t>(T, 2) * hd * 4));  // (one token: kv and gate rows)
    gamma = static_cast<float*>(take(T * hd * 4));
    comp_act = take(T * hd * ab);
    idx_q = take(T * ih * ihd * ab);
    idx_qf = static_cast<float*>(take(T * ih * ihd * 4));
    idx_w = take(T * ih * ab);
    scores = static_cast<float*>(take(T * score_ld * 4));
    counts = static_cast<int32_t*>(take(T * 4));
    bscores = static_cast<float*>(take(T * block_ld * 4));
    bcounts = static_cast<int32_t*>(take(T * 4));
    cand = static_cast<int32_t*>(take(T * std::max(1, c.candidate_topk_blocks) * 4));
    cand_count = static_cast<int32_t*>(take(T * 4));
    sel = static_cast<int32_t*>(take(T * c.index_topk * 4));
    sel_count = static_cast<int32_t*>(take(T * 4));
    // (split decode attention of up to kGemvMaxT rows, each its own work rows)
    attn_work = static_cast<float*>(take(attention_work_floats(1, static_cast<int>(H), static_cast<int>(hd), attn_splits) *
                                         4 * std::min<int64_t>(T, kGemvMaxT)));
    router_logits = static_cast<float*>(take(T * E * 4));
    route_ids = static_cast<int32_t*>(take(T * K * 4));
    route_w = static_cast<float*>(take(T * K * 4));
    moe_ws = take(moe_ws_bytes);
    xst_attn = static_cast<uint32_t*>(take(2 * staged_act_words(D) * 4));
    xst_ffn = static_cast<uint32_t*>(take(2 * staged_act_words(D) * 4));
    xst_q = static_cast<uint32_t*>(take(staged_act_words(c.q_lora_rank) * 4));
    xst_o = static_cast<uint32_t*>(take(staged_act_words(static_cast<int64_t>(c.o_groups) * c.o_lora_rank) * 4));
    u = take(std::max<int64_t>(1, T * nc * ed) * ab);
    yE = take(std::max<int64_t>(1, T * (M + 1) * D) * ab);
    logits = static_cast<float*>(take(std::min<int64_t>(T, kHeadRows) * V * 4));
    d_pick = static_cast<int32_t*>(take(T * 4));
    taps = W > 0 ? static_cast<float*>(take(T * W * 4)) : nullptr;
    gemm_ws = take(std::max<size_t>(gemm_ws_bytes, 256));
    gemv_ws = static_cast<float*>(take(std::max<size_t>(gemv_ws_bytes, 256)));
    for (float*& ws : side_ws) ws = static_cast<float*>(take(std::max<size_t>(gemv_ws_bytes, 256)));
  };
  size_t total = 0;
  sizes(nullptr, total);
  buf.reserve(total + 4096);
  sizes(&buf, total);
  bytes = static_cast<int64_t>(buf.size());
  engram_host_stage.resize(static_cast<size_t>(std::max<int64_t>(1, nl * T * nc * (ed + ed / 32))));
  h_engram_rows.resize(static_cast<size_t>(std::max<int64_t>(1, nl * T * nc)));
  h_ids.resize(static_cast<size_t>(T));
  h_logits.resize(static_cast<size_t>(std::min<int64_t>(T, kGemvMaxT) * V));
  h_pick.resize(static_cast<size_t>(T));
  stage.resize(kStageBytes);
  DSX_CUDA_CHECK(cudaMemset(sig_hc, 0, 64));  // (signal slots are zero at rest)
  if (nl > 0) {
    std::vector<int64_t> iota(static_cast<size_t>(T * nc));
    for (size_t i = 0; i < iota.size(); ++i) iota[i] = static_cast<int64_t>(i);
    DSX_CUDA_CHECK(cudaMemcpy(d_iota, iota.data(), iota.size() * 8, cudaMemcpyHostToDevice));
  }
}

}  // namespace dsx::cuda
