"""The DSpark draft stages of DeepSeek V4.1 in PyTorch: inference (golden-exact) and training.

Specification: ../shared/spec/dspark.md (section numbers below), with the corrections the
official DeepSeek-V4.1-Flash inference code makes and the golden case
../shared/golden/deepseek_v41_dspark_tiny follows (case.json: spec_corrections; the engine's
src/model/dspark.{h,cpp} follows them too):
  C1 (§5.1 step 4, §5.4 step 2) the window-KV FP8 round trip (fq8) covers the WHOLE head_dim
     vector, RoPE dims included, in blocks of 32 with ue8m0 scales;
  C2 (§5.4 step 1) no per-head weightless RMS of q (only the q-LoRA RMSNorm);
  C3 (§5.2) drafting starts at anchor position n >= 2;
  C4 (§5.7) the confidence head returns a logit (sigmoid applied by its consumer);
  C5 (§4) taps are concatenated in ascending layer order;
  C6 (Appendix A) the hc mixer scales the projection by rsqrt(mean(v^2) + eps) AFTER the
     product ((fn . v) * rsqrt), not before.
Facts the engine found where spec and golden disagree, followed here: the stages' MoE sizes
fall back to the target's when dspark_n_routed_experts / dspark_num_experts_per_tok are
absent or 0 (the official config spells the top-k `dspark_n_activated_experts`); taps are
kept in f32 (not rounded to bf16); the router's (sum + 1e-20) normalisation of the selected
scores is applied only when top-k > 1.

Numerics (like the goldens and the engine's CPU path): f32 activations; weights as stored
(FP8 e4m3 with 32x32 e8m0 tile scales, MXFP4 experts, BF16, F32) dequantized to f32; QA8
(quant.qa8: e4m3 values, power-of-two scales per 1x32 block along K) on every activation
entering an FP8 / FP4 matrix except wo_a (the reference runs wo_a as a bf16 matrix), none
on the router gate, the heads, the Markov and confidence heads; fq8 on every K=V row.

API
    cfg = DSparkConfig.from_json(config_dict)          composite (text_config) or flat
    d = DSparkDrafter(cfg)                             f32 master weights (random init)
    d = load_drafter(model_dir)                        mtp.* stages + the target's embed/head
    d.set_target_tables(embed [V, D], head [V, D])     the target's tied tables (frozen buffers)
    u = d.fuse(taps [N, n_taps * D])                   §5.1 step 1
    rows = d.ring_rows(u [N, D], pos [N])              §5.1 steps 2-4: list over stages of [N, hd]
    out = d.block(ctx, ctx_mask, anchors [A], n [A])   §5.2-§5.5 for A anchors at once:
          ctx = list over stages of [A, Wc, hd] ring rows visible to each anchor, ctx_mask
          [A, Wc] bool; returns dict z [A, B, D], base_logits [A, B, V] (+ debug tensors)
    mk = d.markov(base, z, prev [A, B])                §5.6-§5.7 with given previous tokens
    g = d.greedy(base, z, anchors)                     §5.6-§5.7 greedy walk (prev_j = d_j)
    d.draft_at(taps, anchors, n)                       everything from per-position taps
    st = DSparkState(d); st.observe(taps, p0)          the incremental form (§5.1 rings):
    st.draft(anchor, n) / st.truncate(p)               observe committed rows, draft, roll back
    export_tensors(d) / export_config(d)               the mtp.* tensors (release names and
                                                       storage) and the config keys
    write_model_with_stages(target_dir, out_dir, d)    a checkpoint dir = target + stages

Training mode (d.fake_quant_weights = True): weights go through the straight-through
fake-quantizers of their storage (FP8 block / MXFP4 / BF16), QA8 and fq8 through their STE
variants, so what is exported is what was trained. The router's selection bias
(ffn.gate.bias) is a buffer updated by the aux-loss-free balancing rule
(update_router_bias).
"""
import json
import math
import os
import shutil
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import quant as Q  # noqa: E402
import st as ST  # noqa: E402

_F32 = torch.float32


# ---------------------------------------------------------------------------------------
# configuration (§2)

def text_config(cfg):
    """The text config of a composite (text_config) or flat config.json dict."""
    t = cfg.get("text_config")
    return t if isinstance(t, dict) else cfg


class DSparkConfig:
    """The target keys the drafter reuses and the dspark_* keys (§2.1), resolved like the
    official get_moe_config (C: MoE sizes fall back to the target's)."""

    def __init__(self, t):
        self.raw = dict(t)
        self.vocab = int(t["vocab_size"])
        self.hidden = int(t["hidden_size"])
        self.n_layers = int(t["num_hidden_layers"])
        self.hc_mult = int(t.get("hc_mult", 4))
        self.hc_iters = int(t.get("hc_sinkhorn_iters", 20))
        self.hc_eps = float(t.get("hc_eps", 1e-6))
        self.n_heads = int(t["num_attention_heads"])
        self.head_dim = int(t["head_dim"])
        self.rope_dim = int(t["qk_rope_head_dim"])
        self.q_lora = int(t["q_lora_rank"])
        self.o_lora = int(t["o_lora_rank"])
        self.o_groups = int(t["o_groups"])
        self.window = int(t["sliding_window"])
        self.rope_theta = float(t.get("rope_theta", 10000.0))
        self.eps = float(t.get("rms_norm_eps", 1e-20))
        self.inter = int(t["moe_intermediate_size"])
        self.n_shared = int(t.get("n_shared_experts", 1))
        self.routed_scaling = float(t.get("routed_scaling_factor", 1.5))
        self.swiglu_limit = float(t.get("swiglu_limit", 10.0))
        self.norm_topk_prob = bool(t.get("norm_topk_prob", True))
        self.gate_temp = float(t.get("gate_temp", 1.0))
        self.quant_block = 32
        ratios = list(t.get("compress_ratios", []))
        self.n_stages = max(0, len(ratios) - self.n_layers)  # §2.2: not num_nextn_predict_layers
        if "dspark_n_stages" in t:  # only for configs made before the stage ratios exist
            self.n_stages = int(t["dspark_n_stages"])
        self.block_size = int(t.get("dspark_block_size", 0))
        self.noise_id = int(t.get("dspark_noise_token_id", -1))
        self.target_layers = sorted(int(x) for x in t.get("dspark_target_layer_ids", []))  # C5
        self.markov_rank = int(t.get("dspark_markov_rank", 0))
        E = int(t.get("dspark_n_routed_experts", 0) or 0)
        K = int(t.get("dspark_num_experts_per_tok", 0) or 0)
        if K <= 0:
            K = int(t.get("dspark_n_activated_experts", 0) or 0)
        self.n_experts = E if E > 0 else int(t["n_routed_experts"])
        self.top_k = K if K > 0 else int(t["num_experts_per_tok"])
        self.validate()

    @classmethod
    def from_json(cls, cfg):
        return cls(text_config(cfg))

    @property
    def n_taps(self):
        return len(self.target_layers)

    @property
    def mix_dim(self):
        return (2 + self.hc_mult) * self.hc_mult

    def validate(self):
        bad = []
        if self.n_stages < 1:
            bad.append("no DSpark stages (len(compress_ratios) - num_hidden_layers = %d)" % self.n_stages)
        if self.block_size < 1:
            bad.append("dspark_block_size missing or < 1")
        if not 0 <= self.noise_id < self.vocab:
            bad.append("dspark_noise_token_id %d outside the vocabulary %d" % (self.noise_id, self.vocab))
        if not self.target_layers:
            bad.append("dspark_target_layer_ids missing")
        for l in self.target_layers:
            if not 1 <= l < self.n_layers:
                bad.append("dspark target layer %d outside [1, %d)" % (l, self.n_layers))
        if self.markov_rank < 1:
            bad.append("dspark_markov_rank missing or < 1")
        if self.top_k > self.n_experts:
            bad.append("top-k %d > experts %d" % (self.top_k, self.n_experts))
        ratios = self.raw.get("compress_ratios", [])
        for i in range(self.n_layers, len(ratios)):
            if ratios[i] != 0:
                bad.append("compress_ratios[%d] = %s: a DSpark stage is window-only" % (i, ratios[i]))
        if bad:
            raise ValueError("cannot enable DSpark: " + "; ".join(bad))


def dspark_config_keys(n_layers, ratios, n_stages, block_size, noise_id, target_layers, markov_rank,
                       n_experts, top_k):
    """The config keys a checkpoint with stages carries (release spelling, §2.1)."""
    ratios = list(ratios)[:n_layers] + [0] * n_stages
    return {
        "num_nextn_predict_layers": n_stages,
        "compress_ratios": ratios,
        "dspark_block_size": block_size,
        "dspark_noise_token_id": noise_id,
        "dspark_target_layer_ids": sorted(target_layers),
        "dspark_markov_rank": markov_rank,
        "dspark_n_routed_experts": n_experts,
        "dspark_num_experts_per_tok": top_k,
    }


# ---------------------------------------------------------------------------------------
# primitives

# Precise products: f32 results of f64-accumulated products (set_precise(True)). The
# goldens' reference computes f32 products with an accurate GEMM; a naive f32 BLAS (this
# machine's torch 1.13 build) loses ~2x against it. Used for the golden / engine checks;
# training leaves it off (speed).
_PRECISE = [False]


def set_precise(on=True):
    _PRECISE[0] = bool(on)


def _lin(x, w):
    if _PRECISE[0]:
        return F.linear(x.double(), w.double()).to(x.dtype)
    return F.linear(x, w)


def _ein(eq, *ops):
    if _PRECISE[0]:
        return torch.einsum(eq, *[o.double() for o in ops]).to(ops[0].dtype)
    return torch.einsum(eq, *ops)


def _qa8(x, block=32):
    """QA8 of an activation entering an FP8 / FP4 matrix (STE when it carries a gradient)."""
    return Q.qa8_ste(x, block) if x.requires_grad else Q.qa8(x, block)


def _fq8(x):
    """The window-KV round trip of a whole head vector (C1); skipped, as by the reference,
    when the width is not a multiple of 32."""
    if x.shape[-1] % 32:
        return x
    return Q.fq8_ste(x) if x.requires_grad else Q.fq8(x)


def _bf16_ste(w):
    return w + (w.detach().to(torch.bfloat16).to(_F32) - w).detach()


def rmsnorm(x, w, eps):
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * r) * w


def rope_inv_freq(rope_dim, theta, device=None):
    e = torch.arange(0, rope_dim, 2, dtype=_F32, device=device) / rope_dim
    return 1.0 / (torch.tensor(theta, dtype=_F32, device=device) ** e)


def rope_cos_sin(pos, inv_freq):
    """cos, sin [..., n_pairs] of the f32 angle pos * inv_freq (evaluated in f64, rounded once,
    as the engine does; the main table: rope_theta, no YaRN, because a stage's ratio is 0)."""
    a = pos.to(_F32)[..., None] * inv_freq
    a = a.double()
    return torch.cos(a).to(_F32), torch.sin(a).to(_F32)


def apply_rope(x, cos, sin, inverse=False):
    """Interleaved pairs on the last 2 * n_pairs dims of x (GPT-J style); cos/sin broadcast
    against x[..., :n_pairs]."""
    n = cos.shape[-1]
    hd = x.shape[-1]
    head, tail = x[..., : hd - 2 * n], x[..., hd - 2 * n:]
    t = tail.reshape(tail.shape[:-1] + (n, 2))
    a, b = t[..., 0], t[..., 1]
    s = -sin if inverse else sin
    out = torch.stack([a * cos - b * s, a * s + b * cos], dim=-1).reshape(tail.shape)
    return torch.cat([head, out], dim=-1)


def sinkhorn(C, iters, eps):
    """C [..., M, M] logits (first index = source stream): row softmax + eps, one column
    normalisation, then iters - 1 rounds of (rows, columns), each x / (sum + eps)."""
    C = torch.softmax(C, dim=-1) + eps
    C = C / (C.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(dim=-1, keepdim=True) + eps)
        C = C / (C.sum(dim=-2, keepdim=True) + eps)
    return C


# ---------------------------------------------------------------------------------------
# the modules

def _param(*shape):
    return nn.Parameter(torch.zeros(*shape, dtype=_F32))


# storage kinds of every tensor of a stage (release names relative to mtp.<s>.)
STAGE_TENSORS = [
    # (attribute, official name, storage)
    ("hc_attn_fn", "hc_attn_fn", "f32"),
    ("hc_attn_base", "hc_attn_base", "f32"),
    ("hc_attn_scale", "hc_attn_scale", "f32"),
    ("hc_ffn_fn", "hc_ffn_fn", "f32"),
    ("hc_ffn_base", "hc_ffn_base", "f32"),
    ("hc_ffn_scale", "hc_ffn_scale", "f32"),
    ("attn_norm", "attn_norm.weight", "bf16"),
    ("ffn_norm", "ffn_norm.weight", "bf16"),
    ("wq_a", "attn.wq_a", "fp8"),
    ("q_norm", "attn.q_norm.weight", "bf16"),
    ("wq_b", "attn.wq_b", "fp8"),
    ("wkv", "attn.wkv", "fp8"),
    ("kv_norm", "attn.kv_norm.weight", "bf16"),
    ("attn_sink", "attn.attn_sink", "f32"),
    ("wo_a", "attn.wo_a", "fp8"),
    ("wo_b", "attn.wo_b", "fp8"),
    ("gate", "ffn.gate.weight", "bf16"),
    ("sw1", "ffn.shared_experts.w1", "fp8"),
    ("sw2", "ffn.shared_experts.w2", "fp8"),
    ("sw3", "ffn.shared_experts.w3", "fp8"),
]


class DSparkStage(nn.Module):
    """One draft stage: the target's window-only block (delayed mHC) with DSpark attention
    and the stage's MoE sizes (§5.3, §5.4)."""

    def __init__(self, cfg):
        super().__init__()
        c = cfg
        D, M, H, hd = c.hidden, c.hc_mult, c.n_heads, c.head_dim
        I = c.inter
        self.cfg = c
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _param(c.mix_dim, M * D), _param(c.mix_dim), _param(3)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _param(c.mix_dim, M * D), _param(c.mix_dim), _param(3)
        self.attn_norm, self.ffn_norm = _param(D), _param(D)
        self.wq_a, self.q_norm, self.wq_b = _param(c.q_lora, D), _param(c.q_lora), _param(H * hd, c.q_lora)
        self.wkv, self.kv_norm = _param(hd, D), _param(hd)
        self.attn_sink = _param(H)
        self.wo_a = _param(c.o_groups * c.o_lora, H * hd // c.o_groups)
        self.wo_b = _param(D, c.o_groups * c.o_lora)
        self.gate = _param(c.n_experts, D)
        self.register_buffer("gate_bias", torch.zeros(c.n_experts, dtype=_F32))
        self.register_buffer("gate_bias_vl", torch.zeros(c.n_experts, dtype=_F32))
        self.w1, self.w3 = _param(c.n_experts, I, D), _param(c.n_experts, I, D)
        self.w2 = _param(c.n_experts, D, I)
        self.sw1, self.sw3 = _param(I * c.n_shared, D), _param(I * c.n_shared, D)
        self.sw2 = _param(D, I * c.n_shared)
        self.fake_quant_weights = False

    # weights as the forward sees them
    def w(self, attr):
        kind = _STAGE_KIND[attr]
        t = getattr(self, attr)
        if not self.fake_quant_weights:
            return t
        if kind == "fp8":
            return Q.fp8_block_fake_ste(t, self.cfg.quant_block)
        if kind == "bf16":
            return _bf16_ste(t)
        return t

    def experts_w(self, attr):
        t = getattr(self, attr)
        if not self.fake_quant_weights:
            return t
        E, N, K = t.shape
        return Q.mxfp4_fake_ste(t.reshape(E * N, K)).reshape(E, N, K)

    # §A hc mixer (C6: rsqrt after the product)
    def hc_mix(self, X, site):
        c = self.cfg
        M = c.hc_mult
        fn = getattr(self, "hc_%s_fn" % site)
        base = getattr(self, "hc_%s_base" % site)
        scale = getattr(self, "hc_%s_scale" % site)
        v = X.reshape(X.shape[0], -1)
        z = _lin(v, fn) * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + c.eps)
        pre = torch.sigmoid(z[:, :M] * scale[0] + base[:M]) + c.hc_eps
        post = 2.0 * torch.sigmoid(z[:, M:2 * M] * scale[1] + base[M:2 * M])
        C = z[:, 2 * M:].reshape(-1, M, M) * scale[2] + base[2 * M:].reshape(M, M)
        return pre, post, sinkhorn(C, c.hc_iters, c.hc_eps)

    def forward(self, X, pre_in, ctx, ctx_mask, cos, sin, dbg=None):
        """X [A, B, M, D] streams, pre_in [A, B, M]; ctx [A, Wc, hd] ring rows, ctx_mask
        [A, Wc]; cos/sin [A, B, n_pairs] at n + j. Returns X, the FFN mixer's pre."""
        c = self.cfg
        A, B, M, D = X.shape
        Xf = X.reshape(A * B, M, D)
        pa, qa, Ca = self.hc_mix(Xf, "attn")
        a = collapse(Xf, pre_in.reshape(A * B, M))
        a = rmsnorm(a, self.w("attn_norm"), c.eps)
        y = self.attention(a.reshape(A, B, D), ctx, ctx_mask, cos, sin, dbg).reshape(A * B, D)
        Xf = expand(Xf, y, qa, Ca)
        pf, qf, Cf = self.hc_mix(Xf, "ffn")
        f = collapse(Xf, pa)
        f = rmsnorm(f, self.w("ffn_norm"), c.eps)
        y = self.moe(f, dbg)
        Xf = expand(Xf, y, qf, Cf)
        return Xf.reshape(A, B, M, D), pf.reshape(A, B, M)

    def kv_rows(self, x, cos, sin):
        """K = V rows fq8(rope(kv_norm(wkv . QA8(x)))) of x [..., D] (ring rows and block rows)."""
        c = self.cfg
        kv = _lin(_qa8(x, c.quant_block), self.w("wkv"))
        kv = rmsnorm(kv, self.w("kv_norm"), c.eps)
        kv = apply_rope(kv, cos, sin)
        return _fq8(kv)

    def attention(self, y, ctx, ctx_mask, cos, sin, dbg=None):
        """§5.4 for the block rows y [A, B, D]: every row sees the anchor's ring rows and all
        B block rows (no mask), a per-head sink in the denominator."""
        c = self.cfg
        A, B, D = y.shape
        H, hd, qb = c.n_heads, c.head_dim, c.quant_block
        ql = rmsnorm(_lin(_qa8(y, qb), self.w("wq_a")), self.w("q_norm"), c.eps)  # C2
        q = _lin(_qa8(ql, qb), self.w("wq_b")).reshape(A, B, H, hd)
        q = apply_rope(q, cos[:, :, None, :], sin[:, :, None, :])
        kv = self.kv_rows(y, cos, sin)  # [A, B, hd], never stored
        if dbg is not None:
            dbg.setdefault("block_kv", []).append(kv)
        keys = torch.cat([ctx, kv], dim=1)  # [A, Wc + B, hd]
        mask = torch.cat([ctx_mask, torch.ones(A, B, dtype=torch.bool, device=y.device)], dim=1)
        s = _ein("abhd,akd->abhk", q, keys) * (hd ** -0.5)
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
        sink = self.attn_sink.reshape(1, 1, H, 1).expand(A, B, H, 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
        o = _ein("abhk,akd->abhd", p, keys)
        o = apply_rope(o, cos[:, :, None, :], sin[:, :, None, :], inverse=True)
        G = c.o_groups
        og = o.reshape(A, B, G, H * hd // G)
        wo_a = self.w("wo_a").reshape(G, c.o_lora, H * hd // G)
        zeta = _ein("abgi,goi->abgo", og, wo_a).reshape(A, B, G * c.o_lora)  # no QA8
        return _lin(_qa8(zeta, qb), self.w("wo_b"))

    def route(self, f):
        """sqrtsoftplus router: top-k of score + bias (ties: lower id), weights = the unbiased
        scores, normalised (+1e-20) when norm_topk_prob and k > 1, times routed_scaling."""
        c = self.cfg
        logits = _lin(f, self.w("gate"))
        sc = torch.sqrt(F.softplus(logits / c.gate_temp))
        biased = (sc + self.gate_bias).detach()
        idx = _topk_lowest_id(biased, c.top_k)
        wts = sc.gather(1, idx)
        if c.norm_topk_prob and c.top_k > 1:
            wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
        return idx, wts * c.routed_scaling

    def moe(self, f, dbg=None):
        """Routed experts (ascending id, routing weight before w2's QA8) plus the shared one."""
        c = self.cfg
        N, D = f.shape
        lim, qb = c.swiglu_limit, c.quant_block
        idx, wts = self.route(f)
        if dbg is not None:
            dbg.setdefault("router_experts", []).append(idx)
        self.last_load = torch.bincount(idx.reshape(-1), minlength=c.n_experts).detach()
        fq = _qa8(f, qb)
        w1, w2, w3 = self.experts_w("w1"), self.experts_w("w2"), self.experts_w("w3")
        out = torch.zeros(N, D, dtype=f.dtype, device=f.device)
        present = torch.unique(idx).tolist()
        for e in present:
            tok, slot = (idx == e).nonzero(as_tuple=True)
            x = fq[tok]
            h = _swiglu(_lin(x, w1[e]), _lin(x, w3[e]), lim) * wts[tok, slot][:, None]
            out = out.index_add(0, tok, _lin(_qa8(h, qb), w2[e]))
        h = _swiglu(_lin(fq, self.w("sw1")), _lin(fq, self.w("sw3")), lim)
        return out + _lin(_qa8(h, qb), self.w("sw2"))


_STAGE_KIND = {a: k for a, _, k in STAGE_TENSORS}


def _swiglu(g, u, lim):
    if lim > 0:
        u = torch.clamp(u, -lim, lim)
        g = torch.clamp(g, max=lim)
    return F.silu(g) * u


def _topk_lowest_id(x, k):
    """Indices of the k largest values per row, best first, ties to the lower index."""
    E = x.shape[-1]
    # a stable descending sort keeps equal values in index order
    order = torch.sort(x, dim=-1, descending=True, stable=True)[1] if _HAS_STABLE_SORT else None
    if order is None:
        # torch without stable sort: break ties by a tiny index-dependent key in f64
        key = x.double() - torch.arange(E, device=x.device, dtype=torch.float64) * 1e-300
        order = torch.argsort(key, dim=-1, descending=True)
    return order[..., :k]


try:
    torch.sort(torch.zeros(2), stable=True)
    _HAS_STABLE_SORT = True
except TypeError:  # pragma: no cover
    _HAS_STABLE_SORT = False


def collapse(X, pre):
    """y [N, D] = sum_m pre_m X_m."""
    return (pre[..., None] * X).sum(dim=-2)


def expand(X, y, post, C):
    """X'_k = post_k y + sum_j C[j][k] X_j."""
    return post[..., None] * y[:, None, :] + _ein("njk,njd->nkd", C, X)


class DSparkDrafter(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c = cfg
        self.cfg = c
        D, R, V = c.hidden, c.markov_rank, c.vocab
        self.main_proj = _param(D, c.n_taps * D)
        self.main_norm = _param(D)
        self.stages = nn.ModuleList([DSparkStage(c) for _ in range(c.n_stages)])
        self.norm = _param(D)
        self.markov_embed = _param(V, R)
        self.markov_head = _param(V, R)
        self.confidence = _param(1, D + R)
        self.register_buffer("embed", torch.zeros(V, D, dtype=_F32), persistent=False)
        self.register_buffer("head", torch.zeros(V, D, dtype=_F32), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(c.rope_dim, c.rope_theta), persistent=False)
        self._fake = False

    # -- weights -----------------------------------------------------------------------
    @property
    def fake_quant_weights(self):
        return self._fake

    @fake_quant_weights.setter
    def fake_quant_weights(self, v):
        self._fake = bool(v)
        for s in self.stages:
            s.fake_quant_weights = self._fake

    def wt(self, attr):
        t = getattr(self, attr)
        if not self._fake:
            return t
        if attr == "main_proj":
            return Q.fp8_block_fake_ste(t, self.cfg.quant_block)
        return _bf16_ste(t)  # main_norm, norm, markov tables, confidence (BF16 storage)

    def set_target_tables(self, embed, head):
        """The target's embed.weight / head.weight (values of their BF16 storage, f32)."""
        self.embed = embed.detach().to(_F32).to(self.inv_freq.device).clone()
        self.head = head.detach().to(_F32).to(self.inv_freq.device).clone()

    def init_random(self, seed=0, std=0.02):
        """A trainable starting point (spec §13.1): projections N(0, std) scaled by fan-in, norm
        weights 1, hc bases near the identity mix, Markov head 0 (no bias at first),
        confidence 0 (sigmoid 1/2)."""
        g = torch.Generator().manual_seed(seed)
        c = self.cfg
        M = c.hc_mult

        def nrm(t, s):
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=g) * s)

        with torch.no_grad():
            nrm(self.main_proj, (c.n_taps * c.hidden) ** -0.5)
            self.main_norm.fill_(1.0)
            self.norm.fill_(1.0)
            nrm(self.markov_embed, 1.0)
            self.markov_head.zero_()
            self.confidence.zero_()
            for s in self.stages:
                for site in ("attn", "ffn"):
                    nrm(getattr(s, "hc_%s_fn" % site), 1e-3)
                    base = getattr(s, "hc_%s_base" % site)
                    base.zero_()
                    base[:M] = math.log(1.0 / max(M - 1, 1))  # pre ~ 1 / M
                    comb = torch.full((M, M), 0.0)
                    comb.fill_diagonal_(4.0)
                    base[2 * M:] = comb.reshape(-1)
                    getattr(s, "hc_%s_scale" % site).fill_(1.0)
                for n in ("attn_norm", "ffn_norm", "q_norm", "kv_norm"):
                    getattr(s, n).fill_(1.0)
                s.attn_sink.zero_()
                for n in ("wq_a", "wq_b", "wkv", "wo_a", "gate", "sw1", "sw3"):
                    t = getattr(s, n)
                    nrm(t, t.shape[-1] ** -0.5)
                for n in ("wo_b", "sw2"):
                    t = getattr(s, n)
                    nrm(t, 0.5 * t.shape[-1] ** -0.5 / math.sqrt(2 * c.n_stages))
                nrm(s.w1, c.hidden ** -0.5)
                nrm(s.w3, c.hidden ** -0.5)
                nrm(s.w2, 0.5 * c.inter ** -0.5 / math.sqrt(2 * c.n_stages))
                s.gate_bias.zero_()
                s.gate_bias_vl.zero_()
        return self

    # -- §5.1 context rows ------------------------------------------------------------
    def fuse(self, taps):
        """u [N, D] = RMSNorm_{main_norm}(main_proj . QA8(g)) of taps g [N, n_taps * D]."""
        c = self.cfg
        y = _lin(_qa8(taps, c.quant_block), self.wt("main_proj"))
        return rmsnorm(y, self.wt("main_norm"), c.eps)

    def ring_rows(self, u, pos):
        """Per stage the ring rows fq8(rope_p(kv_norm(wkv . QA8(u_p)))) [N, hd] of u [N, D] at
        positions pos [N]."""
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        return [s.kv_rows(u, cos, sin) for s in self.stages]

    # -- §5.2-§5.5 the block ------------------------------------------------------------
    def block(self, ctx, ctx_mask, anchors, n, debug=False):
        """ctx: list over stages of [A, Wc, hd] ring rows visible to each anchor (ctx_mask [A, Wc]
        says which are real); anchors [A] tokens at positions n [A] (>= 2, C3). Returns dict
        z [A, B, D] (pre-norm collapse, the confidence input), base_logits [A, B, V]."""
        c = self.cfg
        A = anchors.shape[0]
        B, M, D = c.block_size, c.hc_mult, c.hidden
        if bool((n < 2).any()):
            raise ValueError("DSpark: anchor position < 2 (the official drafter drafts from position 2 on)")
        dev = self.embed.device
        ids = torch.full((A, B), c.noise_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors.to(dev).long()
        pos = n.to(dev).long()[:, None] + torch.arange(B, device=dev)[None, :]
        X = self.embed[ids][:, :, None, :].expand(A, B, M, D).contiguous()
        pre = torch.zeros(A, B, M, dtype=_F32, device=dev)
        pre[..., 0] = 1.0
        cos, sin = rope_cos_sin(pos, self.inv_freq)
        dbg = {} if debug else None
        outs, pres = [], []
        for s, stage in enumerate(self.stages):
            X, pre = stage(X, pre, ctx[s], ctx_mask, cos, sin, dbg)
            if debug:
                outs.append(X)
                pres.append(pre)
        z = collapse(X.reshape(A * B, M, D), pre.reshape(A * B, M)).reshape(A, B, D)
        h = rmsnorm(z, self.wt("norm"), c.eps)
        base = _lin(h, self.head)
        out = {"z": z, "base_logits": base, "block_ids": ids, "block_positions": pos}
        if debug:
            out["stage_out"] = torch.stack(outs, 1)
            out["stage_pre_mix"] = torch.stack(pres, 1)
            out["block_kv"] = torch.stack(dbg["block_kv"], 1)
            out["router_experts"] = torch.stack([r.reshape(A, B, -1) for r in dbg["router_experts"]], 1)
        return out

    # -- §5.6-§5.7 Markov head and confidence -----------------------------------------
    def markov_bias(self, prev):
        e = self.wt("markov_embed")[prev]  # [..., R]
        return e, _lin(e, self.wt("markov_head"))

    def confidence_logit(self, z, e):
        return _lin(torch.cat([z, e], dim=-1), self.wt("confidence"))[..., 0]  # C4: a logit

    def markov(self, base, z, prev):
        """Given previous tokens prev [A, B] (prev[:, 0] normally the anchor): Markov logits
        [A, B, V], embeddings [A, B, R], confidence logits [A, B]."""
        e, bias = self.markov_bias(prev.long())
        return {"markov_logits": base + bias, "markov_embed": e, "confidence_logits": self.confidence_logit(z, e),
                "prev": prev}

    def greedy(self, base, z, anchors):
        """The greedy walk (temperature 0): prev_0 = anchor, prev_j = d_j = argmax of row j - 1."""
        A, B, V = base.shape
        prev = anchors.long().reshape(A)
        toks, logits, embs, confs, prevs = [], [], [], [], []
        for j in range(B):
            e, bias = self.markov_bias(prev)
            lj = base[:, j] + bias
            d = _argmax_lowest(lj)
            prevs.append(prev)
            toks.append(d)
            logits.append(lj)
            embs.append(e)
            confs.append(self.confidence_logit(z[:, j], e))
            prev = d
        return {"draft_tokens": torch.stack(toks, 1), "markov_logits": torch.stack(logits, 1),
                "markov_embed": torch.stack(embs, 1), "confidence_logits": torch.stack(confs, 1),
                "prev": torch.stack(prevs, 1)}

    # -- convenience: everything from per-position taps ----------------------------------
    def draft_at(self, taps, anchors, n, forced_prev=None, slot_order=True, debug=False):
        """Drafts at anchors [A] (tokens) at positions n [A] of one sequence whose taps
        taps [T, n_taps * D] (row p = position p) are known for every position < n. The ring
        of anchor n holds positions max(0, n - W) .. n - 1 (§5.1), attended in the official
        slot order (slot = p mod W) when slot_order."""
        c = self.cfg
        n = n.long()
        P = int(n.max())
        pos = torch.arange(P, device=taps.device)
        u = self.fuse(taps[:P])
        rows = self.ring_rows(u, pos)
        idx, mask = window_index(n, c.window, slot_order)
        safe = idx.clamp(0, P - 1)
        ctx = [r[safe] * mask[..., None] for r in rows]
        out = self.block(ctx, mask, anchors, n, debug=debug)
        out["main_x"] = u[safe] * mask[..., None]
        out["ring_kv"] = torch.stack(ctx, 1)
        out["window_positions"] = torch.where(mask, idx, torch.full_like(idx, -1))
        out.update(self.greedy(out["base_logits"], out["z"], anchors))
        if forced_prev is not None:
            f = self.markov(out["base_logits"], out["z"], forced_prev)
            out["forced_markov_logits"] = f["markov_logits"]
            out["forced_confidence_logits"] = f["confidence_logits"]
        return out


class DSparkState:
    """The drafter's state of one sequence (§5.1): per stage a ring of K=V rows, the row of
    position p in slot p mod capacity, written only for committed positions (observe); the
    block rows never enter it, so rejected drafts need no rollback. capacity = W +
    rollback_depth, so that truncate(p) back by up to rollback_depth positions (rows observed
    and then rolled back) keeps every row a later anchor's window needs."""

    def __init__(self, d, rollback_depth=16):
        c = d.cfg
        self.d = d
        self.W = c.window
        self.cap = c.window + max(0, int(rollback_depth))
        dev = d.embed.device
        self.rows = torch.zeros(c.n_stages, self.cap, c.head_dim, dtype=_F32, device=dev)
        self.held = torch.full((self.cap,), -1, dtype=torch.long, device=dev)
        self.end = 0

    def observe(self, taps, p0):
        """Taps [T, n_taps * D] of the committed positions p0 .. p0 + T - 1 (the target's taps of
        those rows) into the rings; positions >= p0 observed before are forgotten first."""
        self.truncate(p0)
        T = taps.shape[0]
        skip = max(0, T - self.cap)  # older rows would be overwritten anyway
        if T - skip > 0:
            pos = torch.arange(p0 + skip, p0 + T, device=self.rows.device)
            with torch.no_grad():
                rows = self.d.ring_rows(self.d.fuse(taps[skip:].to(self.rows.device)), pos)
            slot = pos % self.cap
            for s, r in enumerate(rows):
                self.rows[s, slot] = r
            self.held[slot] = pos
        self.end = p0 + T

    def truncate(self, p):
        self.held[self.held >= p] = -1
        self.end = min(self.end, max(p, 0))

    def context(self, n):
        """The ring rows an anchor at n sees (positions max(0, n - W) .. n - 1; missing ones are
        holes), in slot order."""
        if n > self.end:
            raise ValueError("DSpark: anchor position %d but positions up to %d observed" % (n, self.end - 1))
        want = (self.held >= max(0, n - self.W)) & (self.held < n)
        return [self.rows[s][None] * want[None, :, None] for s in range(self.rows.shape[0])], want[None]

    def draft(self, anchor, n, prev=None):
        """§5.2-§5.7 at the anchor token at position n: greedy drafts (and, with prev [B], the
        forced variant's Markov / confidence logits)."""
        ctx, mask = self.context(n)
        dev = self.rows.device
        a = torch.tensor([int(anchor)], device=dev)
        with torch.no_grad():
            out = self.d.block(ctx, mask, a, torch.tensor([int(n)], device=dev))
            out.update(self.d.greedy(out["base_logits"], out["z"], a))
            if prev is not None:
                f = self.d.markov(out["base_logits"], out["z"], torch.as_tensor(prev, device=dev).reshape(1, -1))
                out["forced_markov_logits"] = f["markov_logits"]
                out["forced_confidence_logits"] = f["confidence_logits"]
        return out


def _argmax_lowest(x):
    """argmax over the last dim, ties to the lowest index (torch.argmax's documented choice
    is the first occurrence on CPU and CUDA in the versions used; made explicit here)."""
    mx = x.max(dim=-1, keepdim=True)[0]
    V = x.shape[-1]
    ar = torch.arange(V, device=x.device).expand_as(x)
    return torch.where(x == mx, ar, torch.full_like(ar, V)).min(dim=-1)[0]


def window_index(n, W, slot_order=True):
    """Positions of the ring rows an anchor at n sees: max(0, n - W) .. n - 1, as [A, W]
    (mask False where there is none). slot_order: column i holds the position p with
    p mod W = i (the official ring layout) once the ring is full, else ascending."""
    n = n.long().reshape(-1, 1)
    ar = torch.arange(W, device=n.device)[None, :]
    if slot_order:
        lo = (n - W).clamp(min=0)
        p = torch.where(n <= W, ar.expand(n.shape[0], W), lo + torch.remainder(ar - lo, W))
    else:
        p = n - W + ar
    mask = (p >= 0) & (p < n)
    return p, mask


# ---------------------------------------------------------------------------------------
# loading an official checkpoint (§3)

def _read_model_tensors(model_dir, want=None):
    """name -> raw storage tensor of every tensor of a model dir (model.safetensors or the
    shards of model.safetensors.index.json); want: a predicate on names."""
    out = {}
    for fn in ST.checkpoint_files(model_dir):
        hdr = ST.read_header(os.path.join(model_dir, fn))
        names = [k for k in hdr if k != "__metadata__" and (want is None or want(k))]
        if not names:
            continue
        t, _ = ST.read_safetensors(os.path.join(model_dir, fn))
        for k in names:
            out[k] = t[k]
    return out


def dequant(tensors, name, kind, block=32):
    """f32 value of an official tensor: fp8 (name.weight + name.scale; BF16 accepted when
    there is no scale), fp4 (packed I8 + scale), bf16 / f32."""
    if kind == "fp8":
        w = tensors[name + ".weight"]
        if name + ".scale" not in tensors:
            return w.to(_F32)
        return Q.fp8_block_dequantize(w, tensors[name + ".scale"], block)
    if kind == "fp4":
        return Q.mxfp4_dequantize(tensors[name + ".weight"], tensors[name + ".scale"])
    t = tensors[name]
    if t.dtype == torch.uint8:
        raise ValueError("%s: quantized storage where %s was expected" % (name, kind))
    return t.to(_F32)


def load_config(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def load_drafter(model_dir, device="cpu"):
    """The drafter of a checkpoint dir with DSpark stages: mtp.* (dequantized) and the
    target's embed.weight / head.weight."""
    cfg = DSparkConfig.from_json(load_config(model_dir))
    t = _read_model_tensors(model_dir, lambda k: k.startswith("mtp.") or k in ("embed.weight", "head.weight"))
    stages = sorted({int(k.split(".")[1]) for k in t if k.startswith("mtp.")})
    if stages != list(range(cfg.n_stages)):
        raise ValueError("%s: config declares %d DSpark stages, tensors hold mtp.%s" % (model_dir, cfg.n_stages, stages))
    d = DSparkDrafter(cfg)
    load_state_from_tensors(d, t)
    d.set_target_tables(dequant(t, "embed.weight", "bf16"), dequant(t, "head.weight", "bf16"))
    return d.to(device)


def load_state_from_tensors(d, t):
    c = d.cfg
    S = c.n_stages
    last = "mtp.%d." % (S - 1)
    with torch.no_grad():
        d.main_proj.copy_(dequant(t, "mtp.0.main_proj", "fp8"))
        d.main_norm.copy_(dequant(t, "mtp.0.main_norm.weight", "bf16"))
        d.norm.copy_(dequant(t, last + "norm.weight", "bf16"))
        d.markov_embed.copy_(dequant(t, last + "markov_head.embed.weight", "bf16"))
        d.markov_head.copy_(dequant(t, last + "markov_head.head.weight", "bf16"))
        d.confidence.copy_(dequant(t, last + "confidence_head.proj.weight", "bf16"))
        for s, stage in enumerate(d.stages):
            p = "mtp.%d." % s
            for attr, name, kind in STAGE_TENSORS:
                getattr(stage, attr).copy_(dequant(t, p + name, kind))
            stage.gate_bias.copy_(dequant(t, p + "ffn.gate.bias", "f32"))
            if p + "ffn.gate.bias_vl" in t:
                stage.gate_bias_vl.copy_(dequant(t, p + "ffn.gate.bias_vl", "f32"))
            for e in range(c.n_experts):
                for wn in ("w1", "w2", "w3"):
                    getattr(stage, wn)[e].copy_(dequant(t, p + "ffn.experts.%d.%s" % (e, wn), "fp4"))


# ---------------------------------------------------------------------------------------
# export (§3: release names and storage)

def _store(name, w, kind, block=32):
    """name -> raw entries for write_safetensors."""
    w = w.detach().to("cpu", _F32).contiguous()
    if kind == "fp8":
        codes, scales = Q.fp8_block_quantize(w, block)
        return {name + ".weight": ("F8_E4M3", list(codes.shape), codes.numpy().tobytes()),
                name + ".scale": ("F8_E8M0", list(scales.shape), scales.numpy().tobytes())}
    if kind == "fp4":
        packed, scales = Q.mxfp4_quantize(w)
        return {name + ".weight": ("I8", list(packed.shape), packed.numpy().tobytes()),
                name + ".scale": ("F8_E8M0", list(scales.shape), scales.numpy().tobytes())}
    if kind == "bf16":
        return {name: w.to(torch.bfloat16)}
    return {name: w.clone()}


def export_tensors(d):
    """The mtp.* tensors of drafter d: release names, dtypes and layouts (the golden DSpark
    case's inventory)."""
    c = d.cfg
    S = c.n_stages
    out = {}
    out.update(_store("mtp.0.main_proj", d.main_proj, "fp8"))
    out.update(_store("mtp.0.main_norm.weight", d.main_norm, "bf16"))
    last = "mtp.%d." % (S - 1)
    out.update(_store(last + "norm.weight", d.norm, "bf16"))
    out.update(_store(last + "markov_head.embed.weight", d.markov_embed, "bf16"))
    out.update(_store(last + "markov_head.head.weight", d.markov_head, "bf16"))
    out.update(_store(last + "confidence_head.proj.weight", d.confidence, "bf16"))
    for s, stage in enumerate(d.stages):
        p = "mtp.%d." % s
        for attr, name, kind in STAGE_TENSORS:
            out.update(_store(p + name, getattr(stage, attr), kind))
        out.update(_store(p + "ffn.gate.bias", stage.gate_bias, "f32"))
        out.update(_store(p + "ffn.gate.bias_vl", stage.gate_bias_vl, "f32"))
        for e in range(c.n_experts):
            for wn in ("w1", "w2", "w3"):
                out.update(_store(p + "ffn.experts.%d.%s" % (e, wn), getattr(stage, wn)[e], "fp4"))
    return out


def export_config(d):
    """The config keys of the stages (into text_config)."""
    c = d.cfg
    return dspark_config_keys(c.n_layers, c.raw.get("compress_ratios", []), c.n_stages, c.block_size, c.noise_id,
                              c.target_layers, c.markov_rank, c.n_experts, c.top_k)


def write_model_with_stages(target_dir, out_dir, d, cmap_file=None):
    """out_dir = the checkpoint of target_dir (config.json, model.safetensors, tokenizer.json
    and any other file) plus the stages of d: mtp.* tensors added to model.safetensors,
    the dspark keys added to text_config. Existing mtp.* tensors of the target are replaced.
    cmap_file: the Engram map to ship as engram_cmap.safetensors when target_dir has none."""
    os.makedirs(out_dir, exist_ok=True)
    cfg = load_config(target_dir)
    t = text_config(cfg)
    t.update(export_config(d))
    weight_files = {"model.safetensors", "model.safetensors.index.json"} | set(ST.checkpoint_files(target_dir))
    for fn in os.listdir(target_dir):  # tokenizer.json, engram_cmap.safetensors, ...
        src = os.path.join(target_dir, fn)
        if fn in weight_files or fn == "config.json" or not os.path.isfile(src):
            continue
        if fn.endswith(".safetensors") and fn != "engram_cmap.safetensors":
            continue  # only the weights are safetensors an engine reads (not goldens, not debug dumps)
        shutil.copyfile(src, os.path.join(out_dir, fn))
    if cmap_file and not os.path.exists(os.path.join(target_dir, "engram_cmap.safetensors")):
        shutil.copyfile(cmap_file, os.path.join(out_dir, "engram_cmap.safetensors"))
    tensors = {k: v for k, v in _read_model_tensors(target_dir).items() if not k.startswith("mtp.")}
    raw = {}
    for k, v in tensors.items():
        raw[k] = v if v.dtype != torch.uint8 else _raw_entry(target_dir, k, v)
    raw.update(export_tensors(d))
    ST.write_safetensors(os.path.join(out_dir, "model.safetensors"), raw, {"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return out_dir


_HDR_CACHE = {}


def _raw_entry(model_dir, name, v):
    """(dtype, shape, bytes) of a uint8-stored tensor, keeping its storage dtype string."""
    if model_dir not in _HDR_CACHE:
        h = {}
        for fn in ST.checkpoint_files(model_dir):
            for k, info in ST.read_header(os.path.join(model_dir, fn)).items():
                if k != "__metadata__":
                    h[k] = info["dtype"]
        _HDR_CACHE[model_dir] = h
    return (_HDR_CACHE[model_dir][name], list(v.shape), v.contiguous().numpy().tobytes())


# ---------------------------------------------------------------------------------------
# training support

def init_from_target(d, model_dir=None, tensors=None, seed=0):
    """Starts the stages from the target's last S layers (stage s <- layer L - S + s): the
    window-attention, hc-mixer, norm, router and shared-expert tensors (every target layer
    has them, whatever its compress ratio), and routed experts 0 .. E - 1 with their gate
    rows when the target has at least E experts of the same width. What the target lacks
    keeps d's current values. main_norm / norm start from the target's final norm.
    Returns the list of tensors copied."""
    c = d.cfg
    if tensors is None:
        tensors = _read_model_tensors(model_dir, lambda k: k.startswith("layers.") or k == "norm.weight")
    copied = []
    with torch.no_grad():
        # u_p starts as the mean of the taps (plus a little noise): the context rows begin
        # as the late residual the copied layers were trained on
        D, nT = c.hidden, c.n_taps
        g = torch.Generator().manual_seed(seed)
        eye = torch.eye(D).repeat(1, nT) / nT
        d.main_proj.copy_(eye + torch.randn(D, nT * D, generator=g) * (0.1 / math.sqrt(nT * D)))
        if "norm.weight" in tensors:
            w = dequant(tensors, "norm.weight", "bf16")
            d.norm.copy_(w)
            d.main_norm.copy_(w)
            copied.append("norm.weight")
        for s, stage in enumerate(d.stages):
            layer = c.n_layers - c.n_stages + s
            if layer < 0:
                continue
            p = "layers.%d." % layer
            for attr, name, kind in STAGE_TENSORS:
                key = p + name + (".weight" if kind == "fp8" else "")
                if key not in tensors:
                    continue
                if attr == "gate":
                    w = dequant(tensors, p + name, kind)
                    if w.shape[0] < c.n_experts or w.shape[1] != c.hidden:
                        continue
                    stage.gate.copy_(w[: c.n_experts])
                else:
                    w = dequant(tensors, p + name, kind)
                    if tuple(w.shape) != tuple(getattr(stage, attr).shape):
                        continue
                    getattr(stage, attr).copy_(w)
                copied.append(p + name)
            if p + "ffn.gate.bias" in tensors:
                b = dequant(tensors, p + "ffn.gate.bias", "f32")
                if b.shape[0] >= c.n_experts:
                    stage.gate_bias.copy_(b[: c.n_experts])
                    stage.gate_bias_vl.copy_(b[: c.n_experts])
            for e in range(c.n_experts):
                for wn in ("w1", "w2", "w3"):
                    key = p + "ffn.experts.%d.%s" % (e, wn)
                    if key + ".weight" not in tensors:
                        continue
                    w = dequant(tensors, key, "fp4")
                    if tuple(w.shape) == tuple(getattr(stage, wn)[e].shape):
                        getattr(stage, wn)[e].copy_(w)
                        copied.append(key)
    return copied


def update_router_bias(d, rate=1e-3):
    """Aux-loss-free balancing: each stage's selection bias moves by rate toward the mean
    load (up for under-loaded experts, down for over-loaded ones)."""
    with torch.no_grad():
        for s in d.stages:
            load = getattr(s, "last_load", None)
            if load is None:
                continue
            load = load.to(_F32)
            s.gate_bias += rate * torch.sign(load.mean() - load)
            s.gate_bias_vl.copy_(s.gate_bias)
