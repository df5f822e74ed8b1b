"""Weight-space interpolation of two exported checkpoints of one architecture (WiSE-FT:
Wortsman et al. 2022, "Robust fine-tuning of zero-shot models"): every weight becomes
(1 - alpha) * A + alpha * B, stored again in its official format.

    /usr/bin/python3 train/interpolate.py A_DIR B_DIR --alpha 0.5 --out DIR [--config a|b]

Typical use: A = the model before a fine-tune, B = after it; an alpha below 1 keeps more
of what A knew (e.g. answering without tools) while keeping part of what B learned.
Both checkpoints must hold the same tensors (names, dtypes, shapes: every mtp.* DSpark
stage included). Quantized weights are dequantized to f32 (FP8 e4m3 32x32 tiles with
ue8m0 scales, the Engram tables' e4m3 rows, MXFP4 experts), mixed, and quantized again
with the exporter's functions (train/quant.py), so alpha = 0 gives A's weight values back
and alpha = 1 B's (the bytes can differ where a tile's largest code was half the grid's
largest: the same values at half the scale); BF16 and F32 tensors mix in f32 and round to their dtype. config.json,
tokenizer.json and engram_cmap.safetensors come from the checkpoint --config names
(default b: a fine-tune may have changed e.g. sliding_window, on which no weight depends);
the tokenizers and Engram maps must be equal.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402

import quant as Q  # noqa: E402
import st as ST  # noqa: E402


def _read(model_dir):
    """name -> (dtype, raw storage tensor) of a checkpoint dir."""
    out = {}
    for fn in ST.checkpoint_files(model_dir):
        p = os.path.join(model_dir, fn)
        hdr = ST.read_header(p)
        t, _ = ST.read_safetensors(p)
        for k, v in t.items():
            out[k] = (hdr[k]["dtype"], v)
    return out


def _kind(name, tensors):
    """The storage format of a tensor: fp8 tiles, Engram rows, mxfp4, scale (of one of those), plain."""
    dt = tensors[name][0]
    if name.endswith(".scale") and name[:-6] + ".weight" in tensors and tensors[name[:-6] + ".weight"][0] in (
            "F8_E4M3", "I8"):
        return "scale"
    if dt == "F8_E4M3":
        return "rows8" if ".engram.embed." in name else "fp8"
    if dt == "I8":
        return "fp4"
    if dt in ("BF16", "F32"):
        return "plain"
    raise ValueError("%s: storage dtype %s is not one this script mixes" % (name, dt))


def _dequant(name, kind, tensors):
    w = tensors[name][1]
    if kind == "plain":
        return w.float()
    s = tensors[name[:-len(".weight")] + ".scale"][1]
    if kind == "fp8":
        return Q.fp8_block_dequantize(w, s, 32)
    if kind == "rows8":
        return Q.e8m0_rows_dequantize(w, s, w.shape[1] // s.shape[1])
    return Q.mxfp4_dequantize(w, s)


def _store(name, kind, w, dtype, like_scale):
    """Raw entries of write_safetensors for a mixed f32 weight."""
    def raw(t):
        return t.contiguous().numpy().tobytes()
    if kind == "plain":
        return {name: w.to(torch.bfloat16) if dtype == "BF16" else w.contiguous()}
    sname = name[:-len(".weight")] + ".scale"
    if kind == "fp8":
        c, s = Q.fp8_block_quantize(w, 32)
    elif kind == "rows8":
        c, s = Q.e8m0_rows_quantize(w, w.shape[1] // like_scale.shape[1])
    else:
        c, s = Q.mxfp4_quantize(w)
    return {name: (dtype, list(c.shape), raw(c)), sname: ("F8_E8M0", list(s.shape), raw(s))}


def _sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def interpolate(a_dir, b_dir, alpha, out_dir, config_from="b"):
    if not 0.0 <= alpha <= 1.0:
        raise ValueError("--alpha %g: must lie in [0, 1]" % alpha)
    for f in ("tokenizer.json", "engram_cmap.safetensors"):
        pa, pb = os.path.join(a_dir, f), os.path.join(b_dir, f)
        if os.path.exists(pa) != os.path.exists(pb) or (os.path.exists(pa) and _sha(pa) != _sha(pb)):
            raise ValueError("%s differs between %s and %s" % (f, a_dir, b_dir))
    ta, tb = _read(a_dir), _read(b_dir)
    if set(ta) != set(tb):
        only = sorted(set(ta) ^ set(tb))
        raise ValueError("the checkpoints hold different tensors, e.g. %s" % only[:5])
    out = {}
    for name in sorted(ta):
        (da, wa), (db, wb) = ta[name], tb[name]
        if da != db or tuple(wa.shape) != tuple(wb.shape):
            raise ValueError("%s: %s %s in A, %s %s in B" % (name, da, tuple(wa.shape), db, tuple(wb.shape)))
        kind = _kind(name, ta)
        if kind == "scale":
            continue  # written with its weight
        fa, fb = _dequant(name, kind, ta), _dequant(name, kind, tb)
        w = fa if alpha == 0.0 else fb if alpha == 1.0 else (1.0 - alpha) * fa + alpha * fb
        scale = ta[name[:-len(".weight")] + ".scale"][1] if kind != "plain" else None
        out.update(_store(name, kind, w, da, scale))
    os.makedirs(out_dir, exist_ok=True)
    src = b_dir if config_from == "b" else a_dir
    ST.write_safetensors(os.path.join(out_dir, "model.safetensors"), out,
                         {"format": "pt", "interpolated": json.dumps(
                             {"a": os.path.basename(os.path.normpath(a_dir)),
                              "b": os.path.basename(os.path.normpath(b_dir)), "alpha": alpha})})
    for f in ("config.json", "tokenizer.json", "engram_cmap.safetensors"):
        if os.path.exists(os.path.join(src, f)):
            shutil.copyfile(os.path.join(src, f), os.path.join(out_dir, f))
    return out_dir


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a_dir")
    ap.add_argument("b_dir")
    ap.add_argument("--alpha", type=float, required=True, help="weight of B (0: A, 1: B)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", choices=("a", "b"), default="b", help="whose config.json to keep (default b)")
    args = ap.parse_args(argv)
    interpolate(args.a_dir, args.b_dir, args.alpha, args.out, args.config)
    print("wrote %s (alpha %g)" % (args.out, args.alpha))


if __name__ == "__main__":
    main()
