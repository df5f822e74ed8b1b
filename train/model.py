"""DeepSeek V4.1 (text backbone) in PyTorch: the project's training model.

Follows ../shared/spec/model-v41.md (section numbers below) and the golden README's
numerics: f32 arithmetic with the model's quantization points (QA8 on every activation
entering an FP8 / FP4 matrix, the cache fake-quantizers FQ8 / FQ4e8 / FQ4e4), weights held
as f32 master copies and fake-quantized in the forward to their storage format (FP8 e4m3
with 32x32 ue8m0 tiles, MXFP4 experts, bf16, Engram table rows), so that the exported
checkpoint (export.py) is exactly what the forward computed with. Runs on torch 1.13 and
torch 2.x, CPU or CUDA.

Public API (stable; train/dspark.py builds on it)
-------------------------------------------------
Config(config_dict)                  parsed config.json (composite with text_config, or a
                                     bare text_config); .raw keeps the dict; .plan(l) gives a
                                     layer's role (LayerPlan).
V41Model(cfg, cmap=None)             the model; parameter names ARE the official tensor names
                                     ("embed.weight", "layers.3.attn.wq_a.weight", ...).
  .forward(ids, want_taps=False, debug=None)
        ids [B, T] int64 (positions 0..T-1 of each row) -> logits [B, T, V] f32;
        want_taps: also taps [B, T, n_taps, hidden] f32 = for each layer of
        text_config.dspark_target_layer_ids (ascending) the mean over the hc streams of that
        layer's input (after any Engram injection, before its hc mixing; spec §1.5).
        Returns logits or (logits, taps). debug: a dict to fill with per-layer tensors
        (router choices, top-k sets, candidate mask, norm outputs, Engram ids).
  .embed_tokens(ids) -> [B, T, D]    bf16-valued embedding rows (f32 tensor)
  .final_hidden(X, pre) -> [.., D]   RMSNorm(collapse(X, pre); norm) (§3.6)
  .logits_from_hidden(h) -> [.., V]  f32 head (head.weight, bf16 values)
  .head_weight() -> [V, D]           the head matrix as used (bf16 values, f32 tensor)
  .aux_loss, .index_loss             after a training forward: router balance loss and the
                                     indexer distillation loss (scalars, 0 when disabled)
  .update_router_bias(rate)          aux-free load balancing step (uses the last forward's load)
  V41Model.from_pretrained(dir, cmap=None, device="cpu")   load an official checkpoint dir
Building blocks (also used by the DSpark stages): Layer(cfg, l, n_experts=None, topk=None,
ratio=None) with .attn (Attention: .queries, .kv_from, .output), .ffn (MoE), hc_mix(),
hc_collapse(), hc_expand(), RMSNorm, QLinear, rope tables (RopeTable, main_rope(cfg),
compress_rope(cfg), apply_rope()), sink_attention(), bf16_ste(), set_matmul_bf16().

Training-mode choices (documented in train/README.md)
----------------------------------------------------
* Quantizers use straight-through estimators (quant.py *_ste): forward value exact,
  gradient identity.
* Top-k selection (indexer) and candidate blocks are discrete. The main attention attends
  the selected rows (gradients reach the compressor / queries through them); the indexer
  (indexer.wq_b, weights_proj, wk, k_norm) is trained only by a distillation loss, as
  DeepSeek's sparse attention (DSA) trains its lightning indexer: KL(p || softmax(S)),
  where S are the index scores over the rows the indexer may pick (visible, and inside the
  candidate blocks for layers restricted by them) and p is the main attention's
  distribution over the same compressed rows (softmax of q.c/sqrt(d) per head, averaged
  over heads and over every layer that uses this indexer's selection), computed without
  gradient; the indexer's inputs are detached, so this loss trains only the indexer.
  Optional dense warm-up (model.sparse = False): attention over all visible rows.
* Routers: the selection bias gate.bias (f32, the checkpoint's) is updated by the
  aux-loss-free rule (bias += rate * sign(mean load - load)), plus an optional small
  sequence-level balance loss; the bias never enters the weights (what the engine does).
* set_matmul_bf16(True) (CUDA training): the products of the quantized linears, the
  bf16-stored linears, the attention and the head run on bf16 operands with f32
  accumulation. The operands of the FP8 / FP4 matrices are exact in bf16 (fake-quantized
  activations and weights have <= 4 significant bits), so only the output rounding
  differs from f32. hc mixing, Sinkhorn, norms, router, softmaxes and quantizers stay f32.
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import quant as Q

NEG_INF = float("-inf")

# ---------------------------------------------------------------------------------------
# matmul precision switch


_MATMUL_BF16 = False


def set_matmul_bf16(on):
    global _MATMUL_BF16
    _MATMUL_BF16 = bool(on)


def mm(x, w):
    """x [..., K] @ w[N, K]^T -> [..., N] (f32 result)."""
    if _MATMUL_BF16:
        return F.linear(x.to(torch.bfloat16), w.to(torch.bfloat16)).float()
    return F.linear(x, w)


def einsum(eq, *ops):
    if _MATMUL_BF16:
        return torch.einsum(eq, *[o.to(torch.bfloat16) for o in ops]).float()
    return torch.einsum(eq, *ops)


def bf16_round(w):
    return w.to(torch.bfloat16).to(torch.float32)


def bf16_ste(w):
    """bf16 value of w with an identity gradient (for bf16-stored parameters)."""
    return w + (bf16_round(w.detach()) - w).detach()


# ---------------------------------------------------------------------------------------
# configuration


class LayerPlan:
    __slots__ = ("layer", "ratio", "kv_source", "index_source", "source", "candidate_source", "uses_candidates",
                 "engram", "tap")

    def __repr__(self):
        return "LayerPlan(%s)" % ", ".join("%s=%r" % (k, getattr(self, k)) for k in self.__slots__)


class Config:
    def __init__(self, d):
        self.raw = d
        t = d.get("text_config", d)
        self.text = t
        g = lambda k, dflt=None: t.get(k, dflt)
        self.vocab_size = int(g("vocab_size"))
        self.hidden = int(g("hidden_size"))
        self.n_layers = int(g("num_hidden_layers"))
        self.n_heads = int(g("num_attention_heads"))
        self.head_dim = int(g("head_dim"))
        self.rope_dim = int(g("qk_rope_head_dim"))
        self.q_lora = int(g("q_lora_rank"))
        self.o_lora = int(g("o_lora_rank"))
        self.o_groups = int(g("o_groups"))
        self.window = int(g("sliding_window"))
        self.eps = float(g("rms_norm_eps"))
        self.rope_theta = float(g("rope_theta", 10000.0))
        self.compress_rope_theta = float(g("compress_rope_theta", 160000.0))
        rs = g("rope_scaling") or {}
        typ = rs.get("rope_type", rs.get("type", ""))
        self.yarn = None
        if typ == "yarn":
            self.yarn = dict(factor=float(rs["factor"]), beta_fast=float(rs.get("beta_fast", 32.0)),
                             beta_slow=float(rs.get("beta_slow", 1.0)),
                             original=int(rs["original_max_position_embeddings"]))
        self.n_ratio_entries = len(g("compress_ratios"))
        self.ratios = [int(r) for r in g("compress_ratios")][: self.n_layers]
        self.kv_sources = [int(x) for x in g("kv_source_layer_ids", [])]
        self.index_sources = [int(x) for x in g("index_source_layer_ids", [])]
        self.index_n_heads = int(g("index_n_heads"))
        self.index_head_dim = int(g("index_head_dim"))
        self.index_topk = int(g("index_topk"))
        self.cand_source = int(g("candidate_source_layer_id", -1))
        self.cand_topk_blocks = int(g("candidate_topk_blocks", 0))
        self.cand_block_size = int(g("candidate_block_size", 1))
        self.moe_inter = int(g("moe_intermediate_size"))
        self.n_experts = int(g("n_routed_experts"))
        self.topk = int(g("num_experts_per_tok"))
        self.n_shared = int(g("n_shared_experts", 1))
        self.norm_topk_prob = bool(g("norm_topk_prob", True))
        self.routed_scaling = float(g("routed_scaling_factor", 1.0))
        self.swiglu_limit = float(g("swiglu_limit", 0.0))
        self.gate_temp = float(g("gate_temp", 1.0))
        self.hc_mult = int(g("hc_mult"))
        self.hc_iters = int(g("hc_sinkhorn_iters"))
        self.hc_eps = float(g("hc_eps"))
        self.engram_layers = [int(x) for x in (g("engram_layer_ids") or [])]
        self.engram_num_embeddings = [int(x) for x in (g("engram_num_embeddings") or [])]
        self.engram_max_ngram = int(g("engram_max_ngram_size", 0) or 0)
        self.engram_vocab_size = int(g("engram_vocab_size", 0) or 0)
        self.engram_n_heads = int(g("engram_n_heads", 0) or 0)
        self.engram_head_dim = int(g("engram_head_dim", 0) or 0)
        self.engram_pad_id = int(g("engram_pad_token_id", g("engram_pad_id", 2)))
        self.engram_compressed_vocab = int(g("engram_compressed_vocab_size", 0) or 0)
        self.dspark_target_layers = sorted(int(x) for x in (g("dspark_target_layer_ids") or []))
        self.n_nextn = int(g("num_nextn_predict_layers", 0) or 0)
        q = d.get("quantization_config", {})
        wbs = q.get("weight_block_size", [32, 32])
        self.quant_block = int(wbs[0])
        self.bos_id = int(d.get("bos_token_id", t.get("bos_token_id", 0)))
        self.eos_id = int(d.get("eos_token_id", t.get("eos_token_id", 1)))
        self.validate()

    def ratio(self, l):
        return self.ratios[l]

    def kv_source_of(self, l):
        s = -1
        for k in self.kv_sources:
            if k <= l and k > s:
                s = k
        return s

    def plan(self, l):
        p = LayerPlan()
        p.layer = l
        p.ratio = self.ratios[l] if l < self.n_layers else 0
        p.kv_source = l in self.kv_sources
        p.index_source = p.ratio > 0 and l in self.index_sources
        p.source = self.kv_source_of(l) if p.ratio > 0 else -1
        p.candidate_source = p.index_source and l == self.cand_source
        p.uses_candidates = p.index_source and 0 <= self.cand_source < l
        p.engram = self.engram_layers.index(l) if l in self.engram_layers else -1
        p.tap = self.dspark_target_layers.index(l) if l in self.dspark_target_layers else -1
        return p

    def validate(self):
        def bad(m):
            raise ValueError("invalid V4.1 config: " + m)
        if self.n_heads % self.o_groups:
            bad("num_attention_heads % o_groups")
        for l in range(self.n_layers):
            r = self.ratios[l]
            if r not in (0, 1, 2):
                bad("ratio %d at layer %d" % (r, l))
            if r > 0:
                s = self.kv_source_of(l)
                if s < 0 or self.ratios[s] != r:
                    bad("layer %d: no KV source with the same ratio" % l)
                if not any(s <= i <= l for i in self.index_sources):
                    bad("layer %d has no index source in its group" % l)
        for s in self.kv_sources:
            if self.ratios[s] <= 0 or s not in self.index_sources:
                bad("kv source %d" % s)
        if self.cand_source >= 0:
            if self.cand_source not in self.index_sources:
                bad("candidate source is not an index source")
            if self.cand_topk_blocks * self.cand_block_size - (self.cand_block_size - 1) < self.index_topk:
                bad("candidate blocks too small for index_topk")
        if self.engram_layers and len(self.engram_num_embeddings) != len(self.engram_layers):
            bad("engram_num_embeddings")

    @staticmethod
    def load(model_dir):
        with open(os.path.join(model_dir, "config.json")) as f:
            return Config(json.load(f))


# ---------------------------------------------------------------------------------------
# RoPE (§3.0.6): two tables, interleaved pairs on the last rope_dim dims


def _f32(x):
    return np.float32(x)


def rope_inv_freq(theta, dim, yarn=None):
    """f32 inverse frequencies (numpy float32 arithmetic, as the engine's rope.cpp)."""
    # torch's f32 pow (as the golden's reference computes it; numpy's powf differs by an ulp)
    pf = (torch.tensor(float(theta), dtype=torch.float32) **
          (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).numpy()
    if yarn is None or yarn["original"] <= 0:
        return (np.float32(1.0) / pf).astype(np.float32)
    base = float(theta)

    def corr_dim(rot):
        return (dim * math.log(yarn["original"] / (rot * 2 * math.pi))) / (2 * math.log(base))

    lo = max(math.floor(corr_dim(yarn["beta_fast"])), 0.0)
    hi = min(math.ceil(corr_dim(yarn["beta_slow"])), float(dim - 1))
    if lo == hi:
        hi += 0.001
    factor = np.float32(yarn["factor"])
    out = []
    for i in range(dim // 2):
        extrap = np.float32(1.0) / pf[i]
        interp = np.float32(1.0) / (factor * pf[i])
        ramp = (np.float32(i) - np.float32(lo)) / np.float32(hi - lo)
        ramp = np.float32(min(max(ramp, np.float32(0.0)), np.float32(1.0)))
        ef = np.float32(1.0) - ramp
        out.append(np.float32(interp * (np.float32(1.0) - ef) + extrap * ef))
    return np.array(out, dtype=np.float32)


class RopeTable:
    def __init__(self, inv_freq):
        self.inv_freq = torch.from_numpy(np.asarray(inv_freq, dtype=np.float32))

    def cos_sin(self, pos, device=None):
        """pos: int tensor [...] -> (cos, sin) [..., rope_dim/2] f32 (angle f32, cos/sin in f64)."""
        inv = self.inv_freq.to(pos.device)
        ang = pos.to(torch.float32)[..., None] * inv
        a = ang.double()
        return torch.cos(a).float(), torch.sin(a).float()


def main_rope(cfg):
    return RopeTable(rope_inv_freq(cfg.rope_theta, cfg.rope_dim))


def compress_rope(cfg):
    return RopeTable(rope_inv_freq(cfg.compress_rope_theta, cfg.rope_dim, cfg.yarn))


def apply_rope(x, cos, sin, inverse=False):
    """x [..., d]; cos/sin broadcastable to [..., rope/2]; rotates the last 2*len(cos) dims."""
    n = cos.shape[-1]
    rd = 2 * n
    xr = x[..., -rd:].reshape(x.shape[:-1] + (n, 2))
    a, b = xr[..., 0], xr[..., 1]
    if inverse:
        ra, rb = a * cos + b * sin, b * cos - a * sin
    else:
        ra, rb = a * cos - b * sin, a * sin + b * cos
    r = torch.stack([ra, rb], dim=-1).reshape(x.shape[:-1] + (rd,))
    return torch.cat([x[..., :-rd], r], dim=-1)


# ---------------------------------------------------------------------------------------
# modules with storage formats
#
# Every module keeps `_st` = {local parameter/buffer name: storage format} for the
# exporter: "BF16", "F32", "FP8" (32x32 e4m3 tiles), "FP4" (MXFP4), "ROWS8" (Engram table).


def _param(shape, std=0.02, value=None):
    t = torch.empty(*shape)
    if value is not None:
        t.fill_(value)
    elif std > 0:
        t.normal_(0.0, std)
    else:
        t.zero_()
    return nn.Parameter(t)


class QLinear(nn.Module):
    """y = x W^T with W stored as fmt: "fp8" (QA8 on x), "fp4" (QA8 on x), "fp8w" (FP8-stored
    but used as a bf16 matrix without activation quantization: wo_a), "bf16" (no QA8)."""

    def __init__(self, in_f, out_f, fmt, std=None, block=32):
        super().__init__()
        self.in_f, self.out_f, self.fmt, self.block = in_f, out_f, fmt, block
        self.weight = _param((out_f, in_f), std if std is not None else in_f ** -0.5)
        self._st = {"weight": {"fp8": "FP8", "fp8w": "FP8", "fp4": "FP4", "bf16": "BF16"}[fmt]}

    _cache = None  # set by prepare_quantized_weights() for the duration of one forward

    def qweight(self):
        if self._cache is not None:
            return self._cache
        w = self.weight
        if self.fmt in ("fp8", "fp8w"):
            return Q.fp8_block_fake_ste(w, self.block)
        if self.fmt == "fp4":
            return Q.mxfp4_fake_ste(w)
        return bf16_ste(w)

    def quantize_input(self, x):
        return Q.qa8_ste(x, self.block) if self.fmt in ("fp8", "fp4") else x

    def forward(self, x, pre_quantized=False):
        if not pre_quantized:
            x = self.quantize_input(x)
        return mm(x, self.qweight())


def prepare_quantized_weights(qlinears):
    """Fake-quantize the weights of many QLinear modules in a few batched calls (FP8 tiles,
    MXFP4 strips and bf16 values are quantized independently, so batching changes nothing
    but the number of kernels); each module's qweight() returns its piece until
    release_quantized_weights(). Gradients reach every master weight (STE)."""
    groups = {"FP8": [], "FP4": [], "BF16": []}
    for q in qlinears:
        groups[q._st["weight"]].append(q)
    for kind, mods in groups.items():
        if not mods:
            continue
        pieces = []
        for q in mods:
            w = q.weight
            N, K = w.shape
            if kind == "FP8":
                b = q.block
                pieces.append(w.view(N // b, b, K // b, b).permute(0, 2, 1, 3).reshape(-1, b * b))
            elif kind == "FP4":
                pieces.append(w.reshape(-1, 32))
            else:
                pieces.append(w.reshape(-1, 1))
        flat = torch.cat(pieces, 0)
        with torch.no_grad():
            if kind == "FP8":
                fq = Q.fp8_tiles_fake(flat)
            elif kind == "FP4":
                fq = Q.mxfp4_strips_fake(flat)
            else:
                fq = bf16_round(flat)
        flat = flat + (fq - flat).detach() if flat.requires_grad else fq
        parts = torch.split(flat, [p.shape[0] for p in pieces], 0)
        for q, part in zip(mods, parts):
            N, K = q.weight.shape
            if kind == "FP8":
                b = q.block
                q._cache = part.view(N // b, K // b, b, b).permute(0, 2, 1, 3).reshape(N, K)
            else:
                q._cache = part.view(N, K)


def release_quantized_weights(qlinears):
    for q in qlinears:
        q._cache = None


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = _param((dim,), value=1.0)
        self._st = {"weight": "BF16"}

    def forward(self, x):
        return rms_norm(x, bf16_ste(self.weight), self.eps)


def rms_norm(x, w, eps):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    y = x * r
    return y * w if w is not None else y


# ---------------------------------------------------------------------------------------
# hyper-connections (§3.3)


def hc_mix(X, fn, base, scale, cfg):
    """X [..., M, D] -> pre [..., M], post [..., M], comb [..., M, M] (f32)."""
    M = cfg.hc_mult
    x = X.flatten(-2)
    nu = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.eps)
    z = F.linear(x, fn) * nu
    pre = torch.sigmoid(z[..., :M] * scale[0] + base[:M]) + cfg.hc_eps
    post = 2.0 * torch.sigmoid(z[..., M:2 * M] * scale[1] + base[M:2 * M])
    c = (z[..., 2 * M:] * scale[2] + base[2 * M:]).reshape(z.shape[:-1] + (M, M))
    c = torch.softmax(c, dim=-1) + cfg.hc_eps
    c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + cfg.hc_eps)
        c = c / (c.sum(-2, keepdim=True) + cfg.hc_eps)
    return pre, post, c


def hc_collapse(X, pre):
    return (pre.unsqueeze(-1) * X).sum(-2)


def hc_expand(X, y, post, comb):
    # X'_k = post_k y + sum_j C[j][k] X_j
    return post.unsqueeze(-1) * y.unsqueeze(-2) + torch.einsum("...jk,...jd->...kd", comb, X)


# ---------------------------------------------------------------------------------------
# attention with sink over a window (+ compressed rows)


def sink_attention(q, sink, kv_win=None, win_mask=None, kv_sel=None, sel_mask=None):
    """Generic sink attention for small problems: q [B, T, H, d]; key/value sets
    kv_win [B, S, d] with mask [B or 1, T, S] and/or kv_sel [B, T, k, d] (per-query rows)
    with mask [B, T, k]; sink [H]. Returns [B, T, H, d]. K = V, scale d^-1/2."""
    d = q.shape[-1]
    scale = d ** -0.5
    parts = []
    if kv_win is not None:
        lw = einsum("bthd,bsd->bhts", q, kv_win) * scale
        lw = lw.masked_fill(~win_mask[:, None], NEG_INF)
        parts.append(lw)
    if kv_sel is not None:
        ls = einsum("bthd,btkd->bhtk", q, kv_sel) * scale
        ls = ls.masked_fill(~sel_mask[:, None], NEG_INF)
        parts.append(ls)
    B, T, H, _ = q.shape
    parts.append(sink.view(1, H, 1, 1).expand(B, H, T, 1))
    p = torch.softmax(torch.cat(parts, -1), -1)
    o = 0
    off = 0
    if kv_win is not None:
        S = kv_win.shape[1]
        o = o + einsum("bhts,bsd->bthd", p[..., off:off + S], kv_win)
        off += S
    if kv_sel is not None:
        k = kv_sel.shape[2]
        o = o + einsum("bhtk,btkd->bthd", p[..., off:off + k], kv_sel)
    return o


def _window_chunks(kv, W, Tp):
    """kv [B, T, d] -> chunked window keys [B, NC, 2W, d] (chunk c holds positions (c-1)W .. (c+1)W-1)."""
    B, T, d = kv.shape
    pad = torch.zeros(B, W, d, dtype=kv.dtype, device=kv.device)
    tail = torch.zeros(B, Tp - T, d, dtype=kv.dtype, device=kv.device)
    kvp = torch.cat([pad, kv, tail], 1)  # [B, W + Tp, d]
    NC = Tp // W
    idx = (torch.arange(NC, device=kv.device)[:, None] * W + torch.arange(2 * W, device=kv.device)[None, :])
    return kvp[:, idx]  # [B, NC, 2W, d]


def window_sparse_attention(q, kv, sink, W, comp=None, sel_idx=None, sel_valid=None, dense_mask=None):
    """Attention of §3.4.7 for a whole sequence: q [B, T, H, d] (query t at position t),
    kv [B, T, d] the layer's window rows, own window = positions t-W+1..t; comp [B, Tc, d]
    compressed rows with either a per-query selection sel_idx/sel_valid [B, T, k] or a
    dense mask [B, T, Tc]. Blocked over chunks of W queries (each sees 2W window keys)."""
    B, T, H, d = q.shape
    scale = d ** -0.5
    NC = (T + W - 1) // W
    Tp = NC * W
    kw = _window_chunks(kv, W, Tp)  # [B, NC, 2W, d]
    qp = torch.cat([q, q.new_zeros(B, Tp - T, H, d)], 1) if Tp > T else q
    qc = qp.view(B, NC, W, H, d)
    lw = einsum("bcihd,bcjd->bhcij", qc, kw) * scale  # [B, H, NC, W, 2W]
    i = torch.arange(W, device=q.device)[:, None]
    j = torch.arange(2 * W, device=q.device)[None, :]
    m = (j >= i + 1) & (j <= i + W)  # W + i - j in [0, W-1]
    first = m & (j >= W)  # chunk 0: no keys before position 0
    mask = torch.stack([first] + [m] * (NC - 1), 0) if NC > 1 else first[None]
    lw = lw.masked_fill(~mask[None, None], NEG_INF).reshape(B, H, Tp, 2 * W)
    parts = [lw]
    kvsel = None
    if comp is not None and sel_idx is not None:
        k = sel_idx.shape[-1]
        gi = sel_idx.clamp(min=0)
        kvsel = comp[torch.arange(B, device=q.device)[:, None, None], gi]  # [B, T, k, d]
        ls = einsum("bthd,btkd->bhtk", q, kvsel) * scale
        ls = ls.masked_fill(~sel_valid[:, None], NEG_INF)
        if Tp > T:
            ls = torch.cat([ls, ls.new_full((B, H, Tp - T, k), NEG_INF)], 2)
        parts.append(ls)
    elif comp is not None and dense_mask is not None:
        ls = einsum("bthd,bjd->bhtj", q, comp) * scale
        ls = ls.masked_fill(~dense_mask[:, None], NEG_INF)
        if Tp > T:
            ls = torch.cat([ls, ls.new_full((B, H, Tp - T, comp.shape[1]), NEG_INF)], 2)
        parts.append(ls)
    parts.append(sink.view(1, H, 1, 1).expand(B, H, Tp, 1))
    p = torch.softmax(torch.cat(parts, -1), -1)
    pw = p[..., :2 * W].reshape(B, H, NC, W, 2 * W)
    o = einsum("bhcij,bcjd->bcihd", pw, kw).reshape(B, Tp, H, d)[:, :T]
    if len(parts) == 3:
        pc = p[:, :, :T, 2 * W:-1]
        if kvsel is not None:
            o = o + einsum("bhtk,btkd->bthd", pc, kvsel)
        else:
            o = o + einsum("bhtj,bjd->bthd", pc, comp)
    return o


# ---------------------------------------------------------------------------------------
# attention module (§3.4)


class Compressor(nn.Module):
    def __init__(self, cfg, ratio):
        super().__init__()
        D, hd = cfg.hidden, cfg.head_dim
        self.ratio = ratio
        self.wkv = QLinear(D, hd, "bf16")
        if ratio == 2:
            self.wgate = QLinear(D, hd, "bf16")
        self.norm = RMSNorm(hd, cfg.eps)

    def forward(self, a):
        """a [B, T, D] -> latents [B, T // r, hd] (pre-RoPE), group j = tokens jr .. jr+r-1."""
        B, T, _ = a.shape
        r = self.ratio
        kv = self.wkv(a)
        if r == 1:
            return self.norm(kv)
        Tc = T // r
        g = self.wgate(a)[:, :Tc * r].reshape(B, Tc, r, -1)
        kv = kv[:, :Tc * r].reshape(B, Tc, r, -1)
        lam = torch.softmax(g, dim=2)
        z = (lam * kv).sum(2)
        return self.norm(z)


class Indexer(nn.Module):
    def __init__(self, cfg, owns_keys):
        super().__init__()
        self.cfg = cfg
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = QLinear(cfg.q_lora, ih * ihd, "fp8")
        self.weights_proj = QLinear(cfg.hidden, ih, "bf16")
        if owns_keys:
            self.wk = QLinear(cfg.head_dim, ihd, "bf16")
            self.k_norm = RMSNorm(ihd, cfg.eps)

    def keys(self, latents, cos, sin):
        k = self.k_norm(self.wk(latents))
        k = apply_rope(k, cos, sin)
        return Q.fq4_e8_ste(k, 32)

    def scores(self, q_lat, a, keys, cos, sin, n_vis):
        """q_lat [B,T,R_q], a [B,T,D], keys [B,Tc,ihd] -> S [B, T, Tc] (-inf where j >= n_vis[t])."""
        cfg = self.cfg
        B, T, _ = a.shape
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        u = self.wq_b(q_lat).view(B, T, ih, ihd)
        u = apply_rope(u, cos[:, :, None], sin[:, :, None])
        u = Q.fq4_e8_ste(u, 32)
        w = self.weights_proj(a) * (ih ** -0.5)
        dots = torch.relu(einsum("bthd,bjd->bthj", u, keys)) * (ihd ** -0.5)
        S = einsum("bthj,bth->btj", dots, w)
        Tc = keys.shape[1]
        vis = torch.arange(Tc, device=a.device)[None, :] < n_vis[:, None]  # [T, Tc]
        return S.masked_fill(~vis[None], NEG_INF), vis


class Attention(nn.Module):
    def __init__(self, cfg, plan):
        super().__init__()
        self.cfg, self.plan = cfg, plan
        D, H, hd = cfg.hidden, cfg.n_heads, cfg.head_dim
        G, ol = cfg.o_groups, cfg.o_lora
        self.wq_a = QLinear(D, cfg.q_lora, "fp8")
        self.q_norm = RMSNorm(cfg.q_lora, cfg.eps)
        self.wq_b = QLinear(cfg.q_lora, H * hd, "fp8")
        self.wkv = QLinear(D, hd, "fp8")
        self.kv_norm = RMSNorm(hd, cfg.eps)
        self.wo_a = QLinear(H * hd // G, G * ol, "fp8w")
        self.wo_b = QLinear(G * ol, D, "fp8")
        self.attn_sink = _param((H,), std=0.0)
        self._st = {"attn_sink": "F32"}
        if plan.kv_source:
            self.compressor = Compressor(cfg, plan.ratio)
        if plan.index_source:
            self.indexer = Indexer(cfg, owns_keys=plan.kv_source)

    # pieces reusable by the DSpark stages
    def queries(self, a, cos, sin, aq=None):
        """a [..., D] -> (q_lat [..., R_q], q [..., H, hd] rotated); aq: QA8(a) if already computed."""
        cfg = self.cfg
        q_lat = self.q_norm(self.wq_a(a) if aq is None else self.wq_a(aq, pre_quantized=True))
        q = self.wq_b(q_lat).view(a.shape[:-1] + (cfg.n_heads, cfg.head_dim))
        q = apply_rope(q, cos[..., None, :], sin[..., None, :])
        return q_lat, q

    def kv_from(self, x, cos, sin, xq=None):
        """window K=V row of inputs x [..., D]: RMSNorm(Lin8(x; wkv)) -> RoPE -> FQ8 (xq: QA8(x) if known)."""
        kv = self.kv_norm(self.wkv(x) if xq is None else self.wkv(xq, pre_quantized=True))
        kv = apply_rope(kv, cos, sin)
        return Q.fq8_ste(kv)

    def output(self, o, cos, sin):
        """o [..., H, hd] -> inverse RoPE -> grouped wo_a (bf16 matrix, no QA8) -> wo_b."""
        cfg = self.cfg
        o = apply_rope(o, cos[..., None, :], sin[..., None, :], inverse=True)
        G, ol = cfg.o_groups, cfg.o_lora
        og = o.reshape(o.shape[:-2] + (G, -1))
        A = self.wo_a.qweight().view(G, ol, -1)
        zeta = einsum("...gi,goi->...go", og, A).reshape(o.shape[:-2] + (G * ol,))
        return self.wo_b(zeta)

    def forward(self, a, ctx):
        cfg, plan = self.cfg, self.plan
        B, T, _ = a.shape
        rope = ctx["crope"] if plan.ratio > 0 else ctx["mrope"]
        cos, sin = rope  # [1, T, n]
        aq = Q.qa8_ste(a, cfg.quant_block)
        q_lat, q = self.queries(a, cos, sin, aq)
        kv = self.kv_from(a, cos, sin, aq)
        comp = sel_idx = sel_valid = dense = None
        if plan.ratio > 0:
            r = plan.ratio
            ccos, csin = ctx["comp_rope"][r]
            if plan.kv_source:
                lat = self.compressor(a)  # [B, Tc, hd]
                Tc = lat.shape[1]
                # index keys from the detached latents: trained by the indexer loss only
                ctx["keys"][plan.layer] = self.indexer.keys(lat.detach() if self.training else lat,
                                                            ccos[:, :Tc], csin[:, :Tc])
                rows = Q.fq4_e4_ste(apply_rope(lat, ccos[:, :Tc], csin[:, :Tc]), 16)
                ctx["rows"][plan.layer] = rows
            src = plan.source
            comp = ctx["rows"][src]
            Tc = comp.shape[1]
            n_vis = (torch.arange(T, device=a.device) + 1) // r
            if plan.index_source:
                self._select(a, q_lat, ctx, n_vis, cos, sin)
            sel_idx, sel_valid, allowed = ctx["sel"]
            if not ctx["sparse"]:
                vis = torch.arange(Tc, device=a.device)[None, :] < n_vis[:, None]
                dense = vis[None].expand(B, T, Tc)
                sel_idx = None
            if self.training and ctx["want_index_loss"] and Tc > 0:
                with torch.no_grad():
                    lg = einsum("bthd,bjd->bthj", q, comp) * (cfg.head_dim ** -0.5)
                    lg = lg.masked_fill(~allowed[:, :, None], NEG_INF)
                    p = torch.softmax(lg, -1).nan_to_num(0.0).mean(2)  # [B, T, Tc]
                    tgt = ctx["index_target"]
                    tgt[1] = tgt[1] + p
                    tgt[2] += 1
            if ctx["debug"] is not None and plan.index_source:
                ctx["debug"]["sparse_topk.layer%d" % plan.layer] = _sorted_selection(sel_idx, sel_valid,
                                                                                       cfg.index_topk)
            if sel_idx is not None and sel_idx.shape[-1] == 0:
                comp = None
        o = window_sparse_attention(q, kv, self.attn_sink, cfg.window, comp, sel_idx, sel_valid, dense)
        return self.output(o, cos, sin)

    def _select(self, a, q_lat, ctx, n_vis, cos, sin):
        """§3.4.6: index scores, candidate blocks, top-k; publishes ctx['sel']."""
        cfg, plan = self.cfg, self.plan
        _finish_index_loss(ctx)
        keys = ctx["keys"][plan.source]
        B, T, _ = a.shape
        Tc = keys.shape[1]
        det = self.training
        S, vis = self.indexer.scores(q_lat.detach() if det else q_lat, a.detach() if det else a, keys,
                                     cos, sin, n_vis)
        allowed = vis[None].expand(B, T, Tc)
        Sd = S.detach()
        if plan.candidate_source:
            bs = cfg.cand_block_size
            nb = (Tc + bs - 1) // bs
            Sp = torch.cat([Sd, Sd.new_full((B, T, nb * bs - Tc), NEG_INF)], -1) if nb * bs > Tc else Sd
            bscore = Sp.view(B, T, nb, bs).amax(-1)
            newest = ((n_vis - 1).clamp(min=0) // bs)  # [T]
            pin = (n_vis >= 1)[None, :, None] & (torch.arange(nb, device=a.device)[None, None, :] ==
                                                 newest[None, :, None])
            bscore = bscore.masked_fill(pin, float("inf"))
            kb = min(cfg.cand_topk_blocks, nb)
            order = _stable_topk(bscore, kb)
            kept_scores = torch.gather(bscore, -1, order)
            keep = torch.zeros(B, T, nb, dtype=torch.bool, device=a.device)
            keep.scatter_(-1, order, kept_scores > NEG_INF)
            cand = keep.repeat_interleave(bs, -1)[..., :Tc]
            ctx["cand"] = cand
            if ctx["debug"] is not None:
                ctx["debug"]["candidate_mask.layer%d" % plan.layer] = cand.to(torch.uint8)
        if plan.uses_candidates and ctx.get("cand") is not None:
            cand = ctx["cand"]
            S = S.masked_fill(~cand, NEG_INF)
            Sd = S.detach()
            allowed = allowed & cand
        k = min(cfg.index_topk, Tc)
        idx = _stable_topk(Sd, k)
        valid = torch.gather(Sd, -1, idx) > NEG_INF
        ctx["sel"] = (idx, valid, allowed)
        if self.training and ctx["want_index_loss"]:
            ctx["index_target"] = [S, torch.zeros_like(Sd), 0, allowed]


def _stable_topk(s, k):
    """indices of the k largest entries along the last dim, ties to the lower index."""
    if k == 0:
        return torch.zeros(s.shape[:-1] + (0,), dtype=torch.long, device=s.device)
    try:
        _, order = torch.sort(s, dim=-1, descending=True, stable=True)
    except TypeError:  # very old torch
        _, order = torch.sort(s, dim=-1, descending=True)
    return order[..., :k]


def _sorted_selection(idx, valid, topk):
    B, T, k = idx.shape
    v = torch.where(valid, idx, torch.full_like(idx, 1 << 40))
    v, _ = torch.sort(v, -1)
    v = torch.where(v >= (1 << 40), torch.full_like(v, -1), v)
    if k < topk:
        v = torch.cat([v, torch.full((B, T, topk - k), -1, dtype=v.dtype, device=v.device)], -1)
    return v.to(torch.int32)


def _finish_index_loss(ctx):
    """Close the pending indexer distillation term (KL(p || softmax(S)) over allowed rows)."""
    t = ctx.get("index_target")
    if not t or t[2] == 0:
        ctx["index_target"] = None
        return
    S, psum, n, allowed = t
    p = psum / n
    logq = torch.log_softmax(S.masked_fill(~allowed, NEG_INF), -1)
    rows = allowed.any(-1)
    kl = torch.where(allowed & (p > 0), p * (torch.log(p.clamp(min=1e-30)) - logq), torch.zeros_like(p)).sum(-1)
    kl = (kl * rows).sum() / rows.sum().clamp(min=1)
    ctx["index_losses"].append(kl)
    ctx["index_target"] = None


# ---------------------------------------------------------------------------------------
# MoE (§3.5)


class Gate(nn.Module):
    def __init__(self, cfg, n_experts):
        super().__init__()
        self.weight = _param((n_experts, cfg.hidden), cfg.hidden ** -0.5)
        self.register_buffer("bias", torch.zeros(n_experts))
        self.register_buffer("bias_vl", torch.zeros(n_experts))
        self._st = {"weight": "BF16", "bias": "F32", "bias_vl": "F32"}


class Expert(nn.Module):
    def __init__(self, D, I, fmt):
        super().__init__()
        self.w1 = QLinear(D, I, fmt)
        self.w2 = QLinear(I, D, fmt, std=I ** -0.5 * 0.5)
        self.w3 = QLinear(D, I, fmt)


def swiglu(g, u, lim):
    if lim > 0:
        u = u.clamp(-lim, lim)
        g = g.clamp(max=lim)
    return F.silu(g) * u


class MoE(nn.Module):
    def __init__(self, cfg, n_experts=None, topk=None):
        super().__init__()
        self.cfg = cfg
        self.n_experts = n_experts or cfg.n_experts
        self.k = topk or cfg.topk
        D, I = cfg.hidden, cfg.moe_inter
        self.gate = Gate(cfg, self.n_experts)
        self.experts = nn.ModuleList([Expert(D, I, "fp4") for _ in range(self.n_experts)])
        self.shared_experts = Expert(D, I, "fp8")
        self.last_load = None
        self.aux_loss = None

    def route(self, f):
        """f [N, D] -> (chosen [N, k] long, weights [N, k] f32, scores [N, E])."""
        cfg = self.cfg
        logits = F.linear(f, bf16_ste(self.gate.weight)) / cfg.gate_temp
        s = torch.sqrt(F.softplus(logits))
        biased = (s + self.gate.bias).detach()
        chosen = _stable_topk(biased, self.k)
        w = torch.gather(s, -1, chosen)
        if cfg.norm_topk_prob and self.k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return chosen, w * cfg.routed_scaling, s

    def forward(self, f, debug_key=None, debug=None):
        cfg = self.cfg
        shp = f.shape
        f = f.reshape(-1, shp[-1])
        N = f.shape[0]
        chosen, wts, s = self.route(f)
        if debug is not None and debug_key is not None:
            debug[debug_key] = chosen.view(shp[:-1] + (self.k,)).to(torch.int32)
        fq = Q.qa8_ste(f, 32)
        lim = cfg.swiglu_limit
        flat_e = chosen.reshape(-1)
        flat_w = wts.reshape(-1)
        flat_t = torch.arange(N, device=f.device).repeat_interleave(self.k)
        order = _argsort_stable(flat_e)
        counts = torch.bincount(flat_e, minlength=self.n_experts)
        if self.training:
            self.last_load = counts.detach().float()
            P = (s / (s.sum(-1, keepdim=True) + 1e-20)).mean(0)
            fr = counts.float() / (N * self.k)
            self.aux_loss = self.n_experts * (fr.detach() * P).sum()
        tok = flat_t[order]
        x = fq[tok]  # rows grouped by expert, ascending expert id
        cl = counts.tolist()
        segs = [(e, c) for e, c in enumerate(cl) if c > 0]
        xs = torch.split(x, [c for _, c in segs], 0)
        g = torch.cat([mm(xi, self.experts[e].w1.qweight()) for (e, _), xi in zip(segs, xs)], 0)
        u = torch.cat([mm(xi, self.experts[e].w3.qweight()) for (e, _), xi in zip(segs, xs)], 0)
        h = Q.qa8_ste(swiglu(g, u, lim) * flat_w[order][:, None], 32)  # routing weight before w2's QA8
        hs = torch.split(h, [c for _, c in segs], 0)
        y = torch.cat([mm(hi, self.experts[e].w2.qweight()) for (e, _), hi in zip(segs, hs)], 0)
        out = torch.zeros_like(f).index_add(0, tok, y)
        sh = self.shared_experts
        h = swiglu(sh.w1(fq, pre_quantized=True), sh.w3(fq, pre_quantized=True), lim)
        out = out + sh.w2(h)
        return out.view(shp)


def _argsort_stable(x):
    _, order = torch.sort(x, stable=True)
    return order


# ---------------------------------------------------------------------------------------
# Engram (§3.2)


def _is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_layout(cfg):
    """multipliers [n_layers][max_ngram], primes [n_layers][cols], offsets (spec §3.2.2)."""
    nl = len(cfg.engram_layers)
    bound = max(1, ((2 ** 63 - 1) // cfg.engram_compressed_vocab) // 2)
    seen = set()
    primes, offsets, mults = [], [], []
    for li in range(nl):
        ps = []
        for g in range(cfg.engram_max_ngram - 1):
            cur = cfg.engram_vocab_size - 1
            for h in range(cfg.engram_n_heads):
                c = cur + 1
                while not _is_prime(c) or c in seen:
                    c += 1
                seen.add(c)
                cur = c
                ps.append(c)
        primes.append(ps)
        o, tot = [], 0
        for p in ps:
            o.append(tot)
            tot += p
        offsets.append(o)
        if tot != cfg.engram_num_embeddings[li]:
            raise ValueError("engram layer %d: primes sum to %d rows, config says %d" %
                             (cfg.engram_layers[li], tot, cfg.engram_num_embeddings[li]))
        rng = np.random.default_rng(10007 * cfg.engram_layers[li])
        v = rng.integers(0, bound, size=cfg.engram_max_ngram, dtype=np.int64)
        mults.append([int(2 * x + 1) for x in v])
    return mults, primes, offsets


def engram_num_embeddings(max_ngram, n_heads, vocab_size, n_layers):
    """Row counts of each Engram layer's table for a configuration (what config.json lists)."""
    seen = set()
    out = []
    for li in range(n_layers):
        tot = 0
        for g in range(max_ngram - 1):
            cur = vocab_size - 1
            for h in range(n_heads):
                c = cur + 1
                while not _is_prime(c) or c in seen:
                    c += 1
                seen.add(c)
                cur = c
                tot += c
        out.append(tot)
    return out


class Engram(nn.Module):
    def __init__(self, cfg, rows):
        super().__init__()
        self.cfg = cfg
        M, D = cfg.hc_mult, cfg.hidden
        ncols = (cfg.engram_max_ngram - 1) * cfg.engram_n_heads
        ehd = cfg.engram_head_dim
        self.embed = nn.Module()
        self.embed.weight = _param((rows, ehd), 0.5)
        self.embed._st = {"weight": "ROWS8"}
        self.wkv = QLinear(ncols * ehd, (M + 1) * D, "fp8")
        self.q_weight = _param((M, D), value=1.0)
        self.k_weight = _param((M, D), value=1.0)
        self._st = {"q_weight": "BF16", "k_weight": "BF16"}

    def forward(self, X, row_ids):
        """X [B, T, M, D], row_ids [B, T, ncols] -> X updated (§3.2.3)."""
        cfg = self.cfg
        M, D = cfg.hc_mult, cfg.hidden
        table = Q.e8m0_rows_fake_ste(self.embed.weight, 32)
        u = F.embedding(row_ids, table).flatten(-2)  # [B, T, ncols*ehd]
        y = self.wkv(u)
        keys = y[..., :M * D].reshape(y.shape[:-1] + (M, D))
        v = y[..., M * D:]
        w = bf16_ste(self.q_weight) * bf16_ste(self.k_weight)  # [M, D]
        eps = cfg.eps
        r = torch.rsqrt(X.pow(2).mean(-1) + eps) * torch.rsqrt(keys.pow(2).mean(-1) + eps)
        dlt = (X * w * keys).sum(-1) * r * (D ** -0.5)
        g = torch.sigmoid(torch.sign(dlt) * torch.sqrt(dlt.abs().clamp(min=1e-6)))
        return X + g.unsqueeze(-1) * v.unsqueeze(-2)


# ---------------------------------------------------------------------------------------
# a layer and the model


class Layer(nn.Module):
    def __init__(self, cfg, l, n_experts=None, topk=None, ratio=None, engram_rows=None):
        super().__init__()
        self.cfg = cfg
        plan = cfg.plan(l)
        if ratio is not None:  # DSpark stages: window-only blocks
            plan.ratio, plan.kv_source, plan.index_source, plan.source = ratio, False, False, -1
            plan.candidate_source = plan.uses_candidates = False
            plan.engram, plan.tap = -1, -1
        self.plan = plan
        M, D = cfg.hc_mult, cfg.hidden
        mix = (2 + M) * M
        self.attn_norm = RMSNorm(D, cfg.eps)
        self.ffn_norm = RMSNorm(D, cfg.eps)
        std_fn = 0.5 * (M * D) ** -0.5
        for site in ("attn", "ffn"):
            setattr(self, "hc_%s_fn" % site, _param((mix, M * D), std_fn))
            base = torch.zeros(mix)
            base[2 * M:] = torch.eye(M).flatten() * 4.0  # comb starts near the identity
            setattr(self, "hc_%s_base" % site, nn.Parameter(base))
            setattr(self, "hc_%s_scale" % site, nn.Parameter(torch.ones(3)))
        self._st = {n: "F32" for n in ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
                                        "hc_ffn_scale")}
        self.attn = Attention(cfg, plan)
        self.ffn = MoE(cfg, n_experts, topk)
        if plan.engram >= 0:
            rows = engram_rows if engram_rows is not None else cfg.engram_num_embeddings[plan.engram]
            self.engram = Engram(cfg, rows)

    def mix(self, X, site):
        return hc_mix(X, getattr(self, "hc_%s_fn" % site), getattr(self, "hc_%s_base" % site),
                      getattr(self, "hc_%s_scale" % site), self.cfg)

    def forward(self, X, pre, ctx):
        """X [B, T, M, D], pre [B, T, M] (the previous site's pre) -> (X, pre for the next site)."""
        l = self.plan.layer
        dbg = ctx["debug"]
        pa, qa, Ca = self.mix(X, "attn")
        a = self.attn_norm(hc_collapse(X, pre))
        if dbg is not None:
            dbg.setdefault("attn_norm_out", []).append(a.detach())
        y = self.attn(a, ctx)
        X = hc_expand(X, y, qa, Ca)
        pf, qf, Cf = self.mix(X, "ffn")
        f = self.ffn_norm(hc_collapse(X, pa))
        if dbg is not None:
            dbg.setdefault("ffn_norm_out", []).append(f.detach())
        z = self.ffn(f, "router_experts.layer%d" % l, dbg)
        X = hc_expand(X, z, qf, Cf)
        return X, pf


class V41Model(nn.Module):
    def __init__(self, cfg, cmap=None):
        super().__init__()
        self.cfg = cfg
        D, V = cfg.hidden, cfg.vocab_size
        self.embed = nn.Module()
        self.embed.weight = _param((V, D), 1.0)
        self.embed._st = {"weight": "BF16"}
        self.layers = nn.ModuleList([Layer(cfg, l) for l in range(cfg.n_layers)])
        self.norm = RMSNorm(D, cfg.eps)
        self.head = nn.Module()
        self.head.weight = _param((V, D), D ** -0.5)
        self.head._st = {"weight": "BF16"}
        self.mrope = main_rope(cfg)
        self.crope = compress_rope(cfg)
        self.sparse = True
        self.want_index_loss = True
        self.aux_loss = None
        self.index_loss = None
        if cfg.engram_layers:
            mults, primes, offsets = engram_layout(cfg)
            self.register_buffer("engram_mult", torch.tensor(mults, dtype=torch.int64), persistent=False)
            self.register_buffer("engram_prime", torch.tensor(primes, dtype=torch.int64), persistent=False)
            self.register_buffer("engram_offset", torch.tensor(offsets, dtype=torch.int64), persistent=False)
            if cmap is None:
                cmap = torch.arange(V, dtype=torch.int64) % max(1, cfg.engram_compressed_vocab)
            self.set_cmap(cmap)

    def set_cmap(self, cmap):
        """cmap: compressed Engram id of every raw id (tensor / array); ids beyond it map to cmap[pad]."""
        cfg = self.cfg
        c = torch.as_tensor(np.asarray(cmap), dtype=torch.int64).flatten()
        V = cfg.vocab_size
        if c.numel() < V:
            c = torch.cat([c, torch.full((V - c.numel(),), -1, dtype=torch.int64)])
        c = c[:V].clone()
        c[c < 0] = c[cfg.engram_pad_id]
        dev = self.embed.weight.device
        self.register_buffer("cmap", c.to(dev), persistent=False)

    # -- pieces shared with the DSpark stages
    def embed_tokens(self, ids):
        return F.embedding(ids, bf16_ste(self.embed.weight))

    def head_weight(self):
        return bf16_ste(self.head.weight)

    def final_hidden(self, X, pre):
        return self.norm(hc_collapse(X, pre))

    def logits_from_hidden(self, h):
        return mm(h, self.head_weight())

    # -- Engram row ids (§3.2.2), for every position of every row
    def engram_ids(self, ids):
        cfg = self.cfg
        c = self.cmap[ids]  # [B, T]
        B, T = ids.shape
        pad = self.cmap[cfg.engram_pad_id]
        nh = cfg.engram_n_heads
        out = []
        for li in range(len(cfg.engram_layers)):
            mu = self.engram_mult[li]
            cols = []
            rho = None
            for s in range(cfg.engram_max_ngram):
                if s == 0:
                    cs = c
                else:
                    cs = torch.cat([pad.expand(B, min(s, T)), c[:, :max(T - s, 0)]], 1)
                x = cs * mu[s]
                if s == 0:
                    rho = x
                    continue
                rho = torch.bitwise_xor(rho, x)
                for h in range(nh):
                    col = (s - 1) * nh + h
                    cols.append(torch.remainder(rho, self.engram_prime[li, col]) + self.engram_offset[li, col])
            out.append(torch.stack(cols, -1))
        return out  # per Engram layer [B, T, ncols]

    def forward(self, ids, want_taps=False, debug=None):
        cfg = self.cfg
        B, T = ids.shape
        M, D = cfg.hc_mult, cfg.hidden
        dev = ids.device
        pos = torch.arange(T, device=dev)
        mc, ms = self.mrope.cos_sin(pos)
        cc, cs = self.crope.cos_sin(pos)
        ctx = {"mrope": (mc[None], ms[None]), "crope": (cc[None], cs[None]), "comp_rope": {}, "rows": {}, "keys": {},
               "sel": None, "cand": None, "sparse": self.sparse, "debug": debug,
               "want_index_loss": self.training and self.want_index_loss, "index_target": None, "index_losses": []}
        for r in (1, 2):
            p = torch.arange((T + r - 1) // r, device=dev) * r
            c_, s_ = self.crope.cos_sin(p)
            ctx["comp_rope"][r] = (c_[None], s_[None])
        e_ids = self.engram_ids(ids) if cfg.engram_layers else None
        if debug is not None and e_ids is not None:
            debug["engram_hash_ids"] = torch.stack(e_ids, 2).to(torch.int32)
        qls = self._qlinears()
        prepare_quantized_weights(qls)
        try:
            return self._forward(ids, want_taps, debug, ctx, e_ids)
        finally:
            release_quantized_weights(qls)

    def _qlinears(self):
        if getattr(self, "_ql", None) is None:
            self._ql = [m for m in self.modules() if isinstance(m, QLinear)]
        return self._ql

    def _forward(self, ids, want_taps, debug, ctx, e_ids):
        cfg = self.cfg
        B, T = ids.shape
        M, D = cfg.hc_mult, cfg.hidden
        dev = ids.device
        e = self.embed_tokens(ids)
        X = e.unsqueeze(2).expand(B, T, M, D)
        pre = torch.zeros(B, T, M, device=dev)
        pre[..., 0] = 1.0
        taps = []
        for l, layer in enumerate(self.layers):
            plan = layer.plan
            if plan.engram >= 0:
                X = layer.engram(X, e_ids[plan.engram])
            if want_taps and plan.tap >= 0:
                taps.append(X.mean(2))
            X, pre = layer(X, pre, ctx)
        _finish_index_loss(ctx)
        h = self.final_hidden(X, pre)
        if debug is not None:
            debug["final_norm_out"] = h.detach()
        logits = self.logits_from_hidden(h)
        if self.training:
            aux = [m.ffn.aux_loss for m in self.layers if m.ffn.aux_loss is not None]
            self.aux_loss = torch.stack(aux).mean() if aux else logits.new_zeros(())
            il = ctx["index_losses"]
            self.index_loss = torch.stack(il).mean() if il else logits.new_zeros(())
        if want_taps:
            return logits, torch.stack(taps, 2) if taps else logits.new_zeros(B, T, 0, D)
        return logits

    @torch.no_grad()
    def update_router_bias(self, rate):
        """aux-loss-free balancing: bias_e += rate * sign(mean load - load_e) (last training forward)."""
        for layer in self.layers:
            m = layer.ffn
            if m.last_load is None:
                continue
            load = m.last_load
            m.gate.bias.add_(rate * torch.sign(load.mean() - load))
            m.gate.bias_vl.copy_(m.gate.bias)

    # -- official checkpoint
    def storage_formats(self):
        """{official tensor name: storage format} for every parameter / buffer that the
        checkpoint holds (see `_st` of each module)."""
        out = {}
        for mname, mod in self.named_modules():
            st = getattr(mod, "_st", None)
            if not st:
                continue
            for local, fmt in st.items():
                out[(mname + "." if mname else "") + local] = fmt
        return out

    @staticmethod
    def from_pretrained(model_dir, cmap=None, device="cpu"):
        cfg = Config.load(model_dir)
        cpath = os.path.join(model_dir, "engram_cmap.safetensors")
        if cmap is None and cfg.engram_layers and os.path.exists(cpath):
            import st as ST
            cmap = ST.read_safetensors(cpath)[0]["cmap"]
        if cfg.engram_layers and cmap is None:
            raise ValueError("%s: the model has Engram layers; pass its compressed token map (cmap=) or put "
                             "engram_cmap.safetensors in the directory" % model_dir)
        model = V41Model(cfg, cmap=cmap)
        tensors = load_checkpoint_tensors(model_dir)
        load_official(model, tensors)
        return model.to(device)


def load_checkpoint_tensors(model_dir):
    """Read model.safetensors (or the shards of model.safetensors.index.json) and dequantize
    every quantized pair to f32: {name: f32 tensor} (scales folded)."""
    import st as ST
    raw, dtypes = {}, {}
    for fn in ST.checkpoint_files(model_dir):
        p = os.path.join(model_dir, fn)
        t, _ = ST.read_safetensors(p)
        h = ST.read_header(p)
        raw.update(t)
        dtypes.update({k: v["dtype"] for k, v in h.items() if k != "__metadata__"})
    out = {}
    for name, t in raw.items():
        dt = dtypes[name]
        if name.endswith(".scale") and name[:-6] + ".weight" in raw and dtypes[name[:-6] + ".weight"] in (
                "F8_E4M3", "I8"):
            continue
        if dt == "F8_E4M3":
            s = raw[name[:-7] + ".scale"]
            if ".engram.embed." in name:
                out[name] = Q.e8m0_rows_dequantize(t, s, t.shape[1] // s.shape[1])
            else:
                out[name] = Q.fp8_block_dequantize(t, s, 32)
        elif dt == "I8":
            out[name] = Q.mxfp4_dequantize(t, raw[name[:-7] + ".scale"])
        elif dt in ("BF16", "F16", "F32", "F64"):
            out[name] = t.float()
        else:
            out[name] = t
    return out


def load_official(model, tensors, strict=True):
    """Copy {official name: f32 tensor} into the model (names = parameter / buffer names)."""
    own = dict(model.named_parameters())
    own.update(dict(model.named_buffers()))
    missing = [k for k in model.storage_formats() if k not in tensors]
    unexpected = [k for k in tensors if k not in own and not k.startswith("mtp.")]
    if strict and (missing or unexpected):
        raise ValueError("checkpoint mismatch: missing %s, unexpected %s" % (missing[:10], unexpected[:10]))
    with torch.no_grad():
        for k, v in tensors.items():
            if k in own:
                if tuple(own[k].shape) != tuple(v.shape):
                    raise ValueError("%s: shape %s vs checkpoint %s" % (k, tuple(own[k].shape), tuple(v.shape)))
                own[k].copy_(v.to(own[k].dtype))
