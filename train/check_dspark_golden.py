"""Check the PyTorch DSpark drafter (train/dspark.py) against the golden DSpark case.

    /usr/bin/python3 train/check_dspark_golden.py [--case DIR] [--taps taps|taps_incremental]

Loads the case's checkpoint (mtp.* stages dequantized with train/quant.py, the target's
embed / head), feeds the golden's target taps of the committed positions (README §8: "drafter
alone from the given taps") and drafts at every anchor, then compares with
dspark_golden.safetensors: the context rows (main_x, ring_kv), the block K=V rows, the streams
after each stage, the pre mixes, the router's choices, z, the base logits, the greedy Markov
logits and draft tokens, the confidence logits, and the forced variant (given previous
tokens). Errors: the largest relative L2 per row (a row = one vector of the tensor's last
dim), and max |difference| for the confidence logits. Tolerances follow README §8: base,
confidence and forced Markov logits to ~1e-5 per row; every draft token whose greedy margin
is well above the logit error.
"""
import argparse
import json
import os
import sys

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import dspark as DS  # noqa: E402
import st as ST  # noqa: E402

DEFAULT_CASE = os.path.join(os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(_HERE, "..", "..", "shared", "golden")), "deepseek_v41_dspark_tiny")

ROW_TOL = 1e-5  # README §8


def row_rel_l2(a, b):
    """max over rows of |a - b| / |b| along the last dim (rows where |b| = 0: |a - b|)."""
    a = a.double().reshape(-1, a.shape[-1])
    b = b.double().reshape(-1, b.shape[-1])
    num = (a - b).norm(dim=-1)
    den = b.norm(dim=-1)
    r = torch.where(den > 0, num / den.clamp(min=1e-300), num)
    return float(r.max())


def run(case=DEFAULT_CASE, taps_name="taps", verbose=True, precise=True):
    DS.set_precise(precise)
    d = DS.load_drafter(case)
    d.eval()
    g, _ = ST.read_safetensors(os.path.join(case, "dspark_golden.safetensors"))
    n = g["anchor_positions"].long()
    anchors = g["anchor_tokens"].long()
    forced = g["dspark.forced_prev_tokens"].long()
    with torch.no_grad():
        out = d.draft_at(g[taps_name], anchors, n, forced_prev=forced, debug=True)
    res = {}
    wp = g["dspark.window_positions"].long()
    res["window_positions_equal"] = bool(torch.equal(out["window_positions"], wp))
    listed = (wp >= 0)[..., None]
    cmp_rows = [
        ("main_x", out["main_x"] * listed, g["dspark.main_x"]),
        ("ring_kv", out["ring_kv"] * listed[:, None], g["dspark.ring_kv"]),
        ("block_kv", out["block_kv"], g["dspark.block_kv"]),
        ("stage_out", out["stage_out"], g["dspark.stage_out"]),
        ("stage_pre_mix", out["stage_pre_mix"], g["dspark.stage_pre_mix"]),
        ("z", out["z"], g["dspark.z"]),
        ("base_logits", out["base_logits"], g["dspark.base_logits"]),
        ("markov_logits", out["markov_logits"], g["dspark.markov_logits"]),
        ("forced_markov_logits", out["forced_markov_logits"], g["dspark.forced_markov_logits"]),
        ("markov_embed", out["markov_embed"], g["dspark.markov_embed"]),
    ]
    for name, a, b in cmp_rows:
        res[name] = row_rel_l2(a, b)
    res["confidence_logits_abs"] = float((out["confidence_logits"] - g["dspark.confidence_logits"]).abs().max())
    res["forced_confidence_logits_abs"] = float(
        (out["forced_confidence_logits"] - g["dspark.forced_confidence_logits"]).abs().max())
    gt = g["dspark.draft_tokens"].long()
    res["draft_tokens_equal"] = int((out["draft_tokens"] == gt).sum())
    res["draft_tokens_total"] = int(gt.numel())
    res["markov_prev_equal"] = bool(torch.equal(out["prev"], g["dspark.markov_prev_tokens"].long()))
    res["block_ids_equal"] = bool(torch.equal(out["block_ids"], g["dspark.block_ids"].long()))
    res["block_positions_equal"] = bool(torch.equal(out["block_positions"], g["dspark.block_positions"].long()))
    # router choices: golden sorted by score, best first, as ours
    re_g = g["dspark.router_experts"].long()
    res["router_experts_equal"] = int((out["router_experts"] == re_g).all(-1).sum())
    res["router_rows"] = int(re_g.shape[0] * re_g.shape[1] * re_g.shape[2])
    # the smallest greedy margin against the largest logit error of the Markov rows
    mg = g["dspark.greedy_margin"]
    err = (out["markov_logits"] - g["dspark.markov_logits"]).abs().amax(-1)
    res["min_margin_over_error"] = float((mg / err.clamp(min=1e-30)).min())
    ok = (res["base_logits"] <= ROW_TOL and res["forced_markov_logits"] <= ROW_TOL and
          res["confidence_logits_abs"] <= ROW_TOL * 10 and res["forced_confidence_logits_abs"] <= ROW_TOL * 10 and
          res["draft_tokens_equal"] == res["draft_tokens_total"] and res["window_positions_equal"] and
          res["markov_prev_equal"] and res["block_ids_equal"] and res["block_positions_equal"])
    res["ok"] = bool(ok)
    if verbose:
        print("DSpark golden %s (taps from %s), %d anchors x %d rows" % (case, taps_name, n.numel(), gt.shape[1]))
        for name, _, _ in cmp_rows:
            print("  %-22s max row rel-L2 %.3g" % (name, res[name]))
        print("  %-22s max |d| %.3g (forced %.3g)" % ("confidence_logits", res["confidence_logits_abs"],
                                                     res["forced_confidence_logits_abs"]))
        print("  draft tokens %d/%d equal; router rows %d/%d equal; smallest greedy margin / logit error %.3g" % (
            res["draft_tokens_equal"], res["draft_tokens_total"], res["router_experts_equal"], res["router_rows"],
            res["min_margin_over_error"]))
        print("  window positions %s, prev tokens %s, block ids %s, positions %s" % (
            res["window_positions_equal"], res["markov_prev_equal"], res["block_ids_equal"],
            res["block_positions_equal"]))
        print("OK" if ok else "FAIL")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default=DEFAULT_CASE)
    ap.add_argument("--taps", default="taps", choices=["taps", "taps_incremental"])
    ap.add_argument("--json", help="write the figures to this file")
    ap.add_argument("--fast", action="store_true", help="plain f32 products (as in training) instead of precise ones")
    a = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    res = run(a.case, a.taps, precise=not a.fast)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
