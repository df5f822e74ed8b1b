"""Weight-space interpolation of two exported checkpoints of one architecture (WiSE-FT:
Wortsman et al. 2022, "Robust fine-tuning of zero-shot models"): every weight becomes
(1 - alpha) * A + alpha * B, stored again in its official format.

    /usr/bin/python3 train/interpolate.py A_DIR B_DIR --alpha 0.5 --out DIR [--config a|b]

Typical use: A = the model before a fine-tune, B = after it; an alpha below 1 keeps more
of what A knew (e.g. answering without tools) while keeping part of what B learned.
Both checkpoints must hold the same tensors (names, dtypes, shapes: every mtp.* DSpark
stage included). Quantized weights are dequantized to f32 (model.load_checkpoint_tensors:
FP8 e4m3 32x32 tiles with ue8m0 scales, the Engram tables' e4m3 rows, MXFP4 experts),
mixed, and quantized again with the exporter's export.tensor_entries, so alpha = 0 gives
A's weight values back and alpha = 1 B's (the bytes can differ where a tile's largest code
was half the grid's largest: the same values at half the scale); BF16 and F32 tensors mix
in f32 and round to their dtype. config.json, tokenizer.json and engram_cmap.safetensors
come from the checkpoint --config names (default b: a fine-tune may have changed e.g.
sliding_window, on which no weight depends); the tokenizers and Engram maps must be equal.
"""
import argparse
import hashlib
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import export as EX  # noqa: E402
import model as M  # noqa: E402
import st as ST  # noqa: E402

# storage dtype -> export.tensor_entries format (F8_E4M3: FP8 tiles, or the Engram tables' rows)
_FORMATS = {"I8": "FP4", "BF16": "BF16", "F32": "F32"}


def _headers(model_dir):
    """name -> (dtype, shape) of every tensor of a checkpoint dir."""
    out = {}
    for fn in ST.checkpoint_files(model_dir):
        h = ST.read_header(os.path.join(model_dir, fn))
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in h.items() if k != "__metadata__"})
    return out


def _format(name, hdr):
    dt, shape = hdr[name]
    if dt == "F8_E4M3":
        if ".engram.embed." not in name:
            return "FP8"
        block = shape[1] // hdr[name[:-len(".weight")] + ".scale"][1][1]
        if block != 32:
            raise ValueError("%s: Engram rows in blocks of %d, the exporter writes 32" % (name, block))
        return "ROWS8"
    if dt not in _FORMATS:
        raise ValueError("%s: storage dtype %s is not one this script mixes" % (name, dt))
    return _FORMATS[dt]


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
    ha, hb = _headers(a_dir), _headers(b_dir)
    if set(ha) != set(hb):
        only = sorted(set(ha) ^ set(hb))
        raise ValueError("the checkpoints hold different tensors, e.g. %s" % only[:5])
    for name in sorted(ha):
        if ha[name] != hb[name]:
            raise ValueError("%s: %s %s in A, %s %s in B" % (name, *ha[name], *hb[name]))
    va, vb = M.load_checkpoint_tensors(a_dir), M.load_checkpoint_tensors(b_dir)  # f32 values, scales folded
    out = {}
    for name in sorted(va):
        fa, fb = va[name], vb[name]
        w = fa if alpha == 0.0 else fb if alpha == 1.0 else (1.0 - alpha) * fa + alpha * fb
        out.update(EX.tensor_entries(name, w, _format(name, ha)))
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
