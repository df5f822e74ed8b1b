"""Quantizers of DeepSeek V4.1 (spec model-v41.md §2.2, §3.0.2-§3.0.5; golden README §2a).

All functions work on float32 tensors and are bit-exact re-implementations of the
engine's quantizers (src/model/cpu/quant.cpp, src/util/numerics.h) and of the golden's
definitions; they run on torch 1.13 (no float8 dtypes needed) and newer.

Scalar grids
    e4m3_rne(x)            round to nearest even onto the e4m3fn grid (|x| <= 448)
    e2m1_rne(x)            round to nearest even onto {0, .5, 1, 1.5, 2, 3, 4, 6} (|x| <= 6)
    pow2ceil(v)            2^(E-127+[F!=0]) from the f32 bits of positive normal v
    e4m3_encode/decode     float <-> uint8 e4m3fn code
    e2m1_encode/decode     float <-> 4-bit code (sign = bit 3)
    e8m0_encode/decode     power of two <-> ue8m0 byte (2^(u-127); u = 0 -> 2^-127)

Activation / cache fake-quantizers (quantize then dequantize, along the last dim):
    qa8(x, block=32)       QA8: e4m3 values, power-of-two scales, a = max(amax, 1e-4),
                           s = pow2ceil(a * fl32(1/448))
    fq8(x)                 = qa8(x, 32) (window KV, RoPE tail included)
    fq4_e8(x, block=32)    e2m1 values, pow2 scales: a = max(amax, 6*2^-126), s = pow2ceil(a*fl32(1/6))
    fq4_e4(x, block=16)    e2m1 values, e4m3 scales: a = max(amax, 6*2^-9), s = e4m3_rne(a/6)
    *_ste variants         same forward value, identity gradient (straight-through estimator)

Weights (official storage, see model-v41.md §2.2):
    fp8_block_quantize(w, block=32) -> (codes uint8 [N,K], scale bytes uint8 [ceil(N/B), ceil(K/B)])
        per BxB tile: s = pow2ceil(max(amax, 448*2^-120) / 448), codes = e4m3(w / s)
    fp8_block_dequantize(codes, scales, block=32) -> f32 [N, K]
    fp8_block_fake(w, block=32)      dequantize(quantize(w)) (differentiable with STE: fp8_block_fake_ste)
    mxfp4_quantize(w) -> (packed uint8 [N, K/2] low nibble = even k, scale bytes uint8 [N, K/32])
        per 1x32 strip of a row: s = pow2ceil(max(amax, 6*2^-120) / 6), codes = e2m1(w / s)
    mxfp4_dequantize(packed, scales) -> f32 [N, K]
    mxfp4_fake(w) / mxfp4_fake_ste(w)
    e8m0_rows_quantize(w, block=32) / e8m0_rows_dequantize(...)   Engram table format C
        (e4m3 codes, one pow2 scale per row and 32 columns; same scale rule as FP8 tiles)

The weight scale rules are this project's choice (the engine only dequantizes); the
exporter uses exactly these functions, so the exported checkpoint is exactly what the
training forward computed with (fake-quantized weights).
"""
import torch

_F32 = torch.float32
# Python scalars enter f32 tensor arithmetic as f32 (fl32(1/448), fl32(1/6)), on CPU and CUDA
_INV448 = 1.0 / 448.0
_INV6 = 1.0 / 6.0


# ---------------------------------------------------------------------------------------
# scalar grids

def _round_minifloat(x, mbits, emin, vmax):
    """Round-to-nearest-even onto a minifloat grid with `mbits` mantissa bits, smallest
    normal exponent `emin` (subnormal step 2^(emin-mbits)), values clamped to +-vmax
    beforehand by the caller. Exact in f32 (power-of-two scalings only)."""
    x = x.to(_F32)
    a = x.abs()
    # exponent of the binade: floor(log2 a) from frexp (a = m * 2^e, m in [0.5, 1))
    _, e = torch.frexp(a)
    e = (e - 1).clamp(min=emin)
    step = _pow2(e - mbits)
    r = torch.round(a / step) * step  # torch.round: half to even
    r = r.clamp(max=vmax)
    return torch.copysign(r, x)


def _pow2(e):
    """exact 2^e as f32 from the bits (int tensor e in [-126, 127])."""
    return ((e.to(torch.int32) + 127) << 23).view(_F32)


def e4m3_rne(x):
    return _round_minifloat(x, 3, -6, 448.0)


def e2m1_rne(x):
    return _round_minifloat(x, 1, 0, 6.0)


def pow2ceil(v):
    """2^ceil(log2 v) from the f32 bits (v positive normal f32)."""
    v = v.to(_F32).contiguous()
    bits = v.view(torch.int32)
    E = (bits >> 23) & 0xFF
    F = bits & 0x7FFFFF
    E2 = E + (F != 0).to(torch.int32)
    return (E2 << 23).view(_F32)


def e8m0_encode(s):
    """power-of-two f32 (2^-127 .. 2^127) -> ue8m0 byte."""
    s = s.to(_F32).contiguous()
    bits = s.view(torch.int32)
    E = (bits >> 23) & 0xFF
    # 2^-127 is the f32 subnormal 0x00400000
    u = torch.where(E == 0, torch.zeros_like(E), E)
    return u.to(torch.uint8)


def e8m0_decode(u):
    u = u.to(torch.int32)
    bits = torch.where(u == 0, torch.full_like(u, 0x00400000), u << 23)
    return bits.view(_F32)


_E4M3_TABLE = None
_E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                            dtype=_F32)


def _e4m3_table():
    global _E4M3_TABLE
    if _E4M3_TABLE is None:
        b = torch.arange(256, dtype=torch.int32)
        sign = torch.where((b >> 7) & 1 == 1, -1.0, 1.0).to(_F32)
        e = (b >> 3) & 15
        m = (b & 7).to(_F32)
        sub = m * 2.0 ** -9
        nor = (1.0 + m / 8.0) * torch.pow(torch.tensor(2.0), (e - 7).to(_F32))
        v = sign * torch.where(e == 0, sub, nor)
        v[0x7F] = float("nan")
        v[0xFF] = float("nan")
        _E4M3_TABLE = v
    return _E4M3_TABLE


def e4m3_decode(codes):
    t = _e4m3_table().to(codes.device)
    return t[codes.long()]


def e4m3_encode(x):
    """f32 values already on the e4m3 grid (|x| <= 448) -> uint8 codes."""
    x = x.to(_F32)
    neg = torch.signbit(x) if hasattr(torch, "signbit") else (x < 0)
    a = x.abs()
    _, e = torch.frexp(a)
    e = e - 1  # a in [2^e, 2^(e+1))
    is_sub = (a < 2.0 ** -6)
    m_sub = (a * 2.0 ** 9).round().to(torch.int32)
    frac = a / _pow2(e.clamp(min=-126)) - 1.0  # in [0, 1) for normal values
    m_nor = (frac * 8.0).round().to(torch.int32)
    code_nor = ((e + 7).clamp(min=0) << 3) | m_nor
    code = torch.where(is_sub, m_sub, code_nor)
    code = code | (neg.to(torch.int32) << 7)
    return code.to(torch.uint8)


def e2m1_encode(x):
    """f32 values on the e2m1 grid -> 4-bit codes (int32 0..15)."""
    x = x.to(_F32)
    a = x.abs()
    idx = torch.zeros_like(a, dtype=torch.int32)
    for i, v in enumerate([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]):
        idx = torch.where(a == v, torch.full_like(idx, i + 1), idx)
    neg = torch.signbit(x) if hasattr(torch, "signbit") else (x < 0)
    return idx | (neg.to(torch.int32) << 3)


def e2m1_decode(codes):
    return _E2M1_VALUES.to(codes.device)[codes.long() & 15]


# ---------------------------------------------------------------------------------------
# activation / cache fake-quantizers (last dim, contiguous blocks)

def _blocks(x, block):
    K = x.shape[-1]
    if K % block:
        raise ValueError("last dim %d not a multiple of the block %d" % (K, block))
    return x.reshape(x.shape[:-1] + (K // block, block))


def qa8(x, block=32):
    shp = x.shape
    xb = _blocks(x.to(_F32), block)
    a = xb.abs().amax(dim=-1, keepdim=True).clamp(min=1e-4)
    s = pow2ceil(a * _INV448)
    q = e4m3_rne((xb / s).clamp(-448.0, 448.0)) * s
    return q.reshape(shp)


def fq8(x):
    return qa8(x, 32)


def fq4_e8(x, block=32):
    shp = x.shape
    xb = _blocks(x.to(_F32), block)
    a = xb.abs().amax(dim=-1, keepdim=True).clamp(min=6.0 * 2.0 ** -126)
    s = pow2ceil(a * _INV6)
    q = e2m1_rne((xb / s).clamp(-6.0, 6.0)) * s
    return q.reshape(shp)


def fq4_e4(x, block=16):
    shp = x.shape
    xb = _blocks(x.to(_F32), block)
    a = xb.abs().amax(dim=-1, keepdim=True).clamp(min=6.0 * 2.0 ** -9)
    s = e4m3_rne(a / 6.0)
    q = e2m1_rne((xb / s).clamp(-6.0, 6.0)) * s
    return q.reshape(shp)


def ste(x, fq):
    """Straight-through estimator: forward value fq (a function of x), gradient identity."""
    return x + (fq - x).detach()


def qa8_ste(x, block=32):
    return ste(x, qa8(x.detach(), block))


def fq8_ste(x):
    return ste(x, fq8(x.detach()))


def fq4_e8_ste(x, block=32):
    return ste(x, fq4_e8(x.detach(), block))


def fq4_e4_ste(x, block=16):
    return ste(x, fq4_e4(x.detach(), block))


# ---------------------------------------------------------------------------------------
# weights

_W_FLOOR8 = 448.0 * 2.0 ** -120
_W_FLOOR4 = 6.0 * 2.0 ** -120


def _tile_view(w, block):
    N, K = w.shape
    if N % block or K % block:
        raise ValueError("FP8 block weight [%d, %d] not a multiple of %d" % (N, K, block))
    return w.reshape(N // block, block, K // block, block)


def fp8_block_scales(w, block=32):
    """power-of-two scale per BxB tile, f32 [N/B, K/B]."""
    t = _tile_view(w.to(_F32), block)
    a = t.abs().amax(dim=(1, 3)).clamp(min=_W_FLOOR8)
    return pow2ceil(a / 448.0)


def fp8_block_fake(w, block=32):
    N, K = w.shape
    s = fp8_block_scales(w, block)
    t = _tile_view(w.to(_F32), block)
    sv = s[:, None, :, None]
    q = e4m3_rne((t / sv).clamp(-448.0, 448.0)) * sv
    return q.reshape(N, K)


def fp8_block_quantize(w, block=32, scale_bytes=None):
    """-> (e4m3 codes, ue8m0 scale bytes). scale_bytes: use these tile scales instead of
    the amax rule (re-encoding a checkpoint whose scales were chosen elsewhere)."""
    N, K = w.shape
    s = fp8_block_scales(w, block) if scale_bytes is None else e8m0_decode(scale_bytes)
    t = _tile_view(w.to(_F32), block)
    sv = s[:, None, :, None]
    v = e4m3_rne((t / sv).clamp(-448.0, 448.0)).reshape(N, K)
    return e4m3_encode(v), e8m0_encode(s)


def fp8_block_dequantize(codes, scales, block=32):
    N, K = codes.shape
    v = e4m3_decode(codes)
    s = e8m0_decode(scales)
    s = s.repeat_interleave(block, 0)[:N].repeat_interleave(block, 1)[:, :K]
    return v * s


def fp8_block_fake_ste(w, block=32):
    return ste(w, fp8_block_fake(w.detach(), block))


def fp8_tiles_fake(t):
    """fake-quantize pre-tiled FP8 weights: t [n_tiles, B*B] (one tile per row), the same
    values as fp8_block_fake on the untiled matrix (used to quantize many matrices in one call)."""
    t = t.to(_F32)
    s = pow2ceil(t.abs().amax(dim=-1, keepdim=True).clamp(min=_W_FLOOR8) / 448.0)
    return e4m3_rne((t / s).clamp(-448.0, 448.0)) * s


def mxfp4_strips_fake(t):
    """fake-quantize MXFP4 strips: t [n_strips, 32], the same values as mxfp4_fake."""
    t = t.to(_F32)
    s = pow2ceil(t.abs().amax(dim=-1, keepdim=True).clamp(min=_W_FLOOR4) / 6.0)
    return e2m1_rne((t / s).clamp(-6.0, 6.0)) * s


def _strips(w):
    N, K = w.shape
    if K % 32:
        raise ValueError("MXFP4 weight K=%d not a multiple of 32" % K)
    return w.reshape(N, K // 32, 32)


def mxfp4_scales(w):
    a = _strips(w.to(_F32)).abs().amax(dim=-1).clamp(min=_W_FLOOR4)
    return pow2ceil(a / 6.0)


def mxfp4_fake(w):
    N, K = w.shape
    s = mxfp4_scales(w)[..., None]
    q = e2m1_rne((_strips(w.to(_F32)) / s).clamp(-6.0, 6.0)) * s
    return q.reshape(N, K)


def mxfp4_fake_ste(w):
    return ste(w, mxfp4_fake(w.detach()))


def mxfp4_quantize(w, scale_bytes=None):
    """-> (packed codes [N, K/2], ue8m0 scale bytes [N, K/32]); scale_bytes as above."""
    N, K = w.shape
    s = mxfp4_scales(w) if scale_bytes is None else e8m0_decode(scale_bytes)
    v = e2m1_rne((_strips(w.to(_F32)) / s[..., None]).clamp(-6.0, 6.0)).reshape(N, K)
    c = e2m1_encode(v)
    packed = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)
    return packed, e8m0_encode(s)


def mxfp4_dequantize(packed, scales):
    N, Kh = packed.shape
    p = packed.to(torch.int32)
    lo, hi = p & 15, (p >> 4) & 15
    c = torch.stack([lo, hi], dim=-1).reshape(N, 2 * Kh)
    v = e2m1_decode(c)
    s = e8m0_decode(scales).repeat_interleave(32, 1)
    return v * s


def e8m0_rows_quantize(w, block=32, scale_bytes=None):
    """Engram table (format C): e4m3 codes [R, d], one pow2 scale per row and `block` columns."""
    R, d = w.shape
    b = w.to(_F32).reshape(R, d // block, block)
    if scale_bytes is None:
        s = pow2ceil(b.abs().amax(dim=-1).clamp(min=_W_FLOOR8) / 448.0)
    else:
        s = e8m0_decode(scale_bytes)
    v = e4m3_rne((b / s[..., None]).clamp(-448.0, 448.0)).reshape(R, d)
    return e4m3_encode(v), e8m0_encode(s)


def e8m0_rows_fake(w, block=32):
    R, d = w.shape
    b = w.to(_F32).reshape(R, d // block, block)
    s = pow2ceil(b.abs().amax(dim=-1).clamp(min=_W_FLOOR8) / 448.0)[..., None]
    return (e4m3_rne((b / s).clamp(-448.0, 448.0)) * s).reshape(R, d)


def e8m0_rows_fake_ste(w, block=32):
    return ste(w, e8m0_rows_fake(w.detach(), block))


def e8m0_rows_dequantize(codes, scales, block=32):
    v = e4m3_decode(codes)
    s = e8m0_decode(scales).repeat_interleave(block, 1)
    return v * s
