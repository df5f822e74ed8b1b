// The forward pass of one pass of rows (forward.h). The structure follows
// V41Cpu::forward (spec model-v41.md §3.7); section numbers refer to the spec. The
// attention of a layer is in attention.cpp.
#include "backend/cuda/forward.h"

#include <iterator>

#include "backend/cuda/step_kernels.h"
#include "kernels/cuda/argmax.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/engram_gate.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/moe.h"
#include "kernels/cuda/router.h"
#include "util/error.h"
#include "util/switches.h"

namespace dsx::cuda {

bool Forward::branches(int T) const { return T <= kGemvMaxT && !prof_.on() && sw::on(sw::Id::BRANCHES); }

uint32_t* Forward::staged_x(uint32_t* buf, int T) const {
  return T == 1 && c_.quant_block == 32 && sw::on(sw::Id::STAGED_X) ? buf : nullptr;
}

GemvOpts Forward::gemv_opts(bool qa8, int groups, cudaStream_t st) const {
  GemvOpts o;
  o.qa8 = qa8;
  o.qblock = c_.quant_block;
  o.groups = groups;
  o.split_ws = w_.gemv_ws;
  for (size_t i = 0; i < std::size(s_.side); ++i)
    if (st == s_.side[i]) {
      o.split_ws = w_.side_ws[i];
      o.max_blocks_per_sm = static_cast<int>(sw::get_int(sw::Id::SIDE_BPS));
    }
  o.split_ws_bytes = w_.gemv_ws_bytes;
  return o;
}

bool Forward::lin(const QMatrix& W, const void* x, int64_t ldx, int T, Act yt, void* y, int64_t ldy, bool qa8,
                  int groups, cudaStream_t st, const uint32_t* staged, uint32_t* out_staged, int32_t* pick,
                  int32_t* pick_copy) {
  if (!st) st = s_.main;
  DSX_CHECK(!pick || T == 1, "lin: a pick needs one row");
  if (T <= kGemvMaxT) {
    GemvOpts o = gemv_opts(qa8, groups, st);
    o.staged = staged;
    o.out_staged = out_staged;
    o.pick = pick;
    o.pick_copy = pick_copy;
    gemv(W, m_.act, x, ldx, T, yt, y, ldy, o, st);
    return out_staged && gemv_last_staged();
  }
  DSX_CHECK(st == s_.main, "prefill products run on the session stream");
  GemmOpts o;
  o.qa8 = qa8;
  o.qblock = c_.quant_block;
  o.groups = groups;
  o.compute = m_.act;
  gemm(W, m_.act, x, ldx, T, yt, y, ldy, o, w_.gemm_ws, w_.gemm_ws_bytes, s_.main);
  return false;
}

// Site transition, second half: the RMSNorm of the collapsed row on the session stream
// and, in decode, the hc_mix coefficients (Sinkhorn) on side_hc, joined before the next
// pass (hc_site_pass), the first reader of pre / post / comb: by the signal when that
// pass is in this forward pass (consumer_here), else by an event.
void Forward::hc_site_finish(const HcFinishArgs& fz, bool branch, bool consumer_here) {
  if (!branch || !fz.have_mix || !fz.norm_out) {
    hc_finish(m_.act, fz, s_.main);
    return;
  }
  DSX_CUDA_CHECK(cudaEventRecord(s_.ev_hc_fork, s_.main));
  DSX_CUDA_CHECK(cudaStreamWaitEvent(s_.side_hc, s_.ev_hc_fork, 0));
  side_used_ |= 8;
  HcFinishArgs mix = fz;
  mix.collapsed = nullptr, mix.norm_w = nullptr, mix.norm_out = nullptr, mix.q_codes = nullptr, mix.q_scales = nullptr;
  mix.staged = nullptr;
  const bool sig = consumer_here && sw::on(sw::Id::SIGNALS);
  mix.signal = sig ? w_.sig_hc : nullptr;
  hc_finish(m_.act, mix, s_.side_hc);
  if (sig) {
    hc_pending_ = HcPending::signal;
  } else {
    DSX_CUDA_CHECK(cudaEventRecord(s_.ev_hc_join, s_.side_hc));
    hc_pending_ = HcPending::event;
  }
  HcFinishArgs norm = fz;
  norm.have_mix = false;
  hc_finish(m_.act, norm, s_.main);
}

void Forward::join_sides() {
  cudaStream_t all[4] = {s_.side[0], s_.side[1], s_.side[2], s_.side_hc};
  for (int i = 0; i < 4; ++i) {
    if (!(side_used_ >> i & 1)) continue;
    DSX_CUDA_CHECK(cudaEventRecord(s_.ev_end[i], all[i]));
    DSX_CUDA_CHECK(cudaStreamWaitEvent(s_.main, s_.ev_end[i], 0));
  }
  hc_pending_ = HcPending::none;
  side_used_ = 0;
}

void Forward::hc_site_pass(const HcPassArgs& p) {
  HcPassArgs a = p;
  // (an expand follows the sublayer's last kernel: attention() ends with wo_b, moe() with
  // the MoE down projection, or the pass is the first launch of a graph)
  a.inputs_ready = p.y != nullptr;
  if (hc_pending_ == HcPending::event) DSX_CUDA_CHECK(cudaStreamWaitEvent(s_.main, s_.ev_hc_join, 0));
  if (hc_pending_ == HcPending::signal) a.wait_signal = w_.sig_hc;
  hc_pending_ = HcPending::none;
  hc_pass(m_.act, a, s_.main);
}

// §3.2 Engram of layer l: the rows of every token's n-gram ids (staged by the runner:
// device-resident tables gathered here, host tables gathered by the host), the wkv
// product and the gate into every stream.
void Forward::engram(const Pass& p, int l) {
  const DevLayer& L = m_.layers[static_cast<size_t>(l)];
  const int T = p.T;
  const int64_t D = c_.hidden, M = c_.hc_mult;
  const int li = c_.engram_index(l), nc = m_.engram.n_cols;
  const int ed = c_.engram_head_dim;
  const int64_t n = static_cast<int64_t>(T) * nc;
  if (L.engram_table) {
    engram_gather(m_.act, L.engram_table, L.engram_table_scale, ed, w_.d_engram_ids + li * n, static_cast<int>(n), w_.u,
                  nullptr, nullptr, s_.main);
  } else {  // rows the host gathered, in order
    engram_gather(m_.act, w_.engram_stage + li * n * ed, w_.engram_stage_scale + li * n * (ed / 32), ed, w_.d_iota,
                  static_cast<int>(n), w_.u, nullptr, nullptr, s_.main);
  }
  lin(L.engram_wkv, w_.u, static_cast<int64_t>(nc) * ed, T, m_.act, w_.yE, (M + 1) * D, true);
  engram_gate(m_.act, T, static_cast<int>(M), D, w_.yE, w_.X, L.engram_w, c_.rms_eps, s_.main);
  prof_.mark("engram", s_.main);
}

void Forward::run(const Pass& p) {
  const int T = p.T;
  const int64_t D = c_.hidden, M = c_.hc_mult;
  const int l0 = p.l0, l1 = p.l1 < 0 ? c_.n_layers : p.l1;
  DSX_CHECK(T > 0 && T <= w_.max_rows, "forward: ", T, " rows (at most ", w_.max_rows, ")");
  prof_.set_active(T);
  prof_.mark("start", s_.main);
  hc_pending_ = HcPending::none;  // (the previous pass joined its side streams at its end)
  side_used_ = 0;
  if (l0 == 0) {
    embed_streams(m_.act, reinterpret_cast<const uint16_t*>(m_.embed.data), w_.d_ids, T, static_cast<int>(M), D, w_.X,
                  s_.main);
    onehot_pre(w_.pre0, T, static_cast<int>(M), s_.main);
    prof_.mark("embed", s_.main);
  }
  const bool hc_branch = branches(T) && sw::on(sw::Id::HC_BRANCH);
  // the collapse weights and the pending expansion of the previous sublayer (spec
  // §3.3.2); after a layer they are the FFN site's (pf, y, qf, Cf)
  const float* pre = l0 == 0 ? w_.pre0 : w_.pf;
  const void* pend_y = l0 == 0 ? nullptr : w_.y;
  const float *pend_post = l0 == 0 ? nullptr : w_.qf, *pend_comb = l0 == 0 ? nullptr : w_.Cf;
  for (int l = l0; l < l1; ++l) {
    const DevLayer& L = m_.layers[static_cast<size_t>(l)];
    // §3.2 Engram before the layer's mixing
    if (L.has_engram) {
      if (pend_y) {
        HcPassArgs e;
        e.T = T, e.D = D, e.X = w_.X, e.y = pend_y, e.post = pend_post, e.comb = pend_comb, e.work = w_.hc_work;
        hc_site_pass(e);
        pend_y = nullptr;
      }
      engram(p, l);
    }
    // site transition into the attention: expand (pending), mix (attn), collapse (pre)
    {
      HcPassArgs a;
      a.T = T, a.D = D, a.X = w_.X, a.y = pend_y, a.post = pend_post, a.comb = pend_comb;
      a.fn = reinterpret_cast<const float*>(L.hc_attn_fn.data);
      a.pre = pre, a.collapsed = w_.a, a.work = w_.hc_work;
      hc_site_pass(a);
      // §1.5 DSpark tap: the streams entering a target layer (after its Engram)
      if (const int ti = c_.tap_index(l); p.taps && ti >= 0)
        stream_mean(m_.act, w_.X, T, static_cast<int>(M), D, w_.taps + ti * D, c_.tap_width(), s_.main);
      HcFinishArgs fz;
      fz.T = T, fz.D = D, fz.work = w_.hc_work, fz.have_mix = true, fz.base = L.hc_attn_base, fz.scale = L.hc_attn_scale;
      fz.norm_eps = c_.rms_eps, fz.hc_eps = c_.hc_eps, fz.sinkhorn_iters = c_.hc_sinkhorn_iters;
      fz.pre = w_.pa, fz.post = w_.qa, fz.comb = w_.Ca;
      fz.collapsed = w_.a, fz.norm_w = L.attn_norm, fz.norm_out = w_.a, fz.staged = staged_x(w_.xst_attn, T);
      hc_site_finish(fz, hc_branch, true);
      prof_.mark("hc", s_.main);
    }
    attention(p, l);  // writes y
    {
      HcPassArgs a;
      a.T = T, a.D = D, a.X = w_.X, a.y = w_.y, a.post = w_.qa, a.comb = w_.Ca;
      a.fn = reinterpret_cast<const float*>(L.hc_ffn_fn.data);
      a.pre = w_.pa, a.collapsed = w_.f, a.work = w_.hc_work;
      hc_site_pass(a);
      HcFinishArgs fz;
      fz.T = T, fz.D = D, fz.work = w_.hc_work, fz.have_mix = true, fz.base = L.hc_ffn_base, fz.scale = L.hc_ffn_scale;
      fz.norm_eps = c_.rms_eps, fz.hc_eps = c_.hc_eps, fz.sinkhorn_iters = c_.hc_sinkhorn_iters;
      fz.pre = w_.pf, fz.post = w_.qf, fz.comb = w_.Cf;
      fz.collapsed = w_.f, fz.norm_w = L.ffn_norm, fz.norm_out = w_.f, fz.staged = staged_x(w_.xst_ffn, T);
      // (the last layer of a partial pass: the next pass runs that site's pass)
      hc_site_finish(fz, hc_branch, l + 1 < l1 || l1 == c_.n_layers);
      prof_.mark("hc", s_.main);
    }
    moe(p, l);  // writes y
    pend_y = w_.y, pend_post = w_.qf, pend_comb = w_.Cf;
    pre = w_.pf;
  }
  if (l1 < c_.n_layers) {  // (a part of the step: the side streams join before it ends)
    join_sides();
    return;
  }
  // §3.6 final fold, norm, head
  {
    HcPassArgs a;
    a.T = T, a.D = D, a.X = w_.X, a.y = pend_y, a.post = pend_post, a.comb = pend_comb;
    a.pre = pre, a.collapsed = w_.h, a.work = w_.hc_work;
    hc_site_pass(a);
    HcFinishArgs fz;
    fz.T = T, fz.D = D, fz.work = w_.hc_work, fz.norm_eps = c_.rms_eps;
    fz.collapsed = w_.h, fz.norm_w = m_.norm, fz.norm_out = w_.h;
    hc_finish(m_.act, fz, s_.main);
  }
  prof_.mark("final hc+norm", s_.main);
  if (p.head == Pass::Head::Last) head_last(p);
  if (p.head == Pass::Head::All && p.T <= kHeadRows) {  // (longer passes: the runner, in blocks)
    head_rows(0, p.T);
    if (p.pick) argmax_rows(w_.logits, c_.vocab_size, p.T, c_.vocab_size, w_.d_pick, s_.main, w_.h_pick.data());
  }
  for (const Segment& sg : p.segs) advance_pos(sg.s->cache->d_pos(), sg.n, s_.main);
  join_sides();
  prof_.mark("head", s_.main);
  prof_.collect();
}

// The head of the last row of every segment that asks for it: one row in place (a
// decode graph's head also picks the greedy id: pick_in_head), several gathered into
// y first (free after the final fold). Logits rows in segment order.
void Forward::head_last(const Pass& p) {
  const int64_t D = c_.hidden, V = c_.vocab_size;
  int n = 0;
  for (const Segment& sg : p.segs) n += sg.head;
  if (n == 0) return;
  DSX_CHECK(n <= kHeadRows, "head: more than ", kHeadRows, " sessions in one pass");
  const void* x = nullptr;
  if (n == 1) {
    for (const Segment& sg : p.segs)
      if (sg.head) x = act_row(w_.h, sg.r0 + sg.n - 1, D);
  } else {
    int k = 0;
    for (const Segment& sg : p.segs)
      if (sg.head)
        DSX_CUDA_CHECK(cudaMemcpyAsync(act_row(w_.y, k++, D), act_row(w_.h, sg.r0 + sg.n - 1, D), D * w_.ab,
                                       cudaMemcpyDeviceToDevice, s_.main));
    x = w_.y;
  }
  lin(m_.head, x, D, n, Act::F32, w_.logits, V, false, 1, nullptr, nullptr, nullptr,
      p.pick_in_head ? w_.d_ids : nullptr, p.pick_in_head ? w_.h_pick.data() : nullptr);
  if (p.pick && !p.pick_in_head) argmax_rows(w_.logits, V, n, V, w_.d_pick, s_.main, w_.h_pick.data());
}

void Forward::head_rows(int r0, int n) {
  const int64_t D = c_.hidden, V = c_.vocab_size;
  DSX_CHECK(n > 0 && n <= kHeadRows, "head_rows: bad row count ", n);
  lin(m_.head, act_row(w_.h, r0, D), D, n, Act::F32, w_.logits, V, false);
}

// §3.5 mixture of experts over all rows of the pass (the experts of all rows unioned).
void Forward::moe(const Pass& p, int l) {
  const DevLayer& L = m_.layers[static_cast<size_t>(l)];
  const int T = p.T;
  const int64_t D = c_.hidden;
  const int K = c_.n_experts_per_tok;
  RouterOpts ro;
  ro.gate_temp = c_.gate_temp;
  ro.norm_topk_prob = c_.norm_topk_prob;
  ro.route_scale = c_.routed_scaling;
  if (T <= kGemvMaxT) {
    router(m_.act, w_.f, D, T, L.gate, L.gate_bias, K, ro, w_.router_logits, w_.route_ids, w_.route_w, s_.main);
  } else {  // prefill: the gate product on the tensor cores (GEMM), then the selection
    lin(L.gate, w_.f, D, T, Act::F32, w_.router_logits, c_.n_routed_experts, false);
    router_select(w_.router_logits, c_.n_routed_experts, T, c_.n_routed_experts, L.gate_bias, K, ro, w_.route_ids,
                  w_.route_w, s_.main);
  }
  prof_.mark("router", s_.main);
  if (T <= kGemvMaxT) {
    // (up to 16 rows in one call: 2..16 rows stream each distinct expert once, moe.h)
    moe_decode(L.moe, m_.act, w_.f, D, T, K, w_.route_ids, w_.route_w, m_.act, w_.y, D, w_.moe_ws, w_.moe_ws_bytes,
               s_.main, staged_x(w_.xst_ffn, T));
  } else {
    moe_prefill(L.moe, m_.act, w_.f, D, T, K, w_.route_ids, w_.route_w, m_.act, w_.y, D, w_.moe_ws, w_.moe_ws_bytes,
                s_.main);
  }
  prof_.mark("moe", s_.main);
}

}  // namespace dsx::cuda
