"""Check train/model.py against the V4.1 golden case (golden README §4-§6, §8).

    /usr/bin/python3 train/check_golden.py [../shared/golden/deepseek_v41_tiny]
        [--cmap ../shared/golden/tokenizer/engram-cmap-v41.safetensors]
        [--dspark ../shared/golden/deepseek_v41_dspark_tiny]

Comparison rule (README §6, the engine's `dsx golden`): per-row relative L2
||a - b|| / ||b|| of the logits; a faithful fp32 implementation agrees on the leading rows
up to its first flipped QA8 rounding (then the rows diverge: the tiny random model is
chaotic). Reported per row group: the number of leading rows within 1e-3 (35 % of the rows
are required, as the engine's check requires), the largest error among them, and at the
first divergent row which discrete decision (experts, top-k set, candidate blocks) or
which layer's normalised input first differs.

Row groups: prefill (one forward over the T prompt tokens), incremental (the golden's
prefill of T0 tokens then single-token decodes; the model's full-sequence forward
computes the same function), greedy (the N greedy-continuation rows: the forward over the
prompt followed by the golden's greedy tokens, rows T-1 .. T+N-2), and for the DSpark case
the taps.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import model as M  # noqa: E402
import st  # noqa: E402

_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN = os.path.join(_GOLDEN_ROOT, "deepseek_v41_tiny")
GOLDEN_CMAP = os.path.join(_GOLDEN_ROOT, "tokenizer/engram-cmap-v41.safetensors")
GOLDEN_DSPARK = os.path.join(_GOLDEN_ROOT, "deepseek_v41_dspark_tiny")


def row_rel_l2(a, b):
    a = a.double()
    b = b.double()
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-300))


def leading(err, tol=1e-3):
    n = 0
    for v in err.tolist():
        if not (v <= tol):
            break
        n += 1
    return n


def group(got, want, required, tol=1e-3):
    e = row_rel_l2(got, want)
    n = leading(e, tol)
    return {"rows": int(e.numel()), "leading": n, "required": int(required),
            "max_rel_l2_leading": float(e[:n].max()) if n else None,
            "median_rel_l2_all": float(e.median()), "ok": n >= required}


def load_cmap(path):
    t, _ = st.read_safetensors(path)
    return t["cmap"]


def explain_row(dbg, g, row, n_layers):
    notes = []
    for l in range(n_layers):
        k = "debug.router_experts.layer%d" % l
        if k in g:
            a = dbg["router_experts.layer%d" % l][0, row].sort()[0]
            b = g[k][row].sort()[0]
            if not torch.equal(a, b):
                notes.append("experts of layer %d differ" % l)
        k = "debug.sparse_topk.layer%d" % l
        if k in g:
            if not torch.equal(dbg["sparse_topk.layer%d" % l][0, row], g[k][row]):
                notes.append("top-k of layer %d differs" % l)
        k = "debug.candidate_mask.layer%d" % l
        if k in g:
            a = dbg["candidate_mask.layer%d" % l][0, row]
            if not torch.equal(a, g[k][row, :a.shape[0]]):
                notes.append("candidate blocks of layer %d differ" % l)
    for l in range(n_layers):
        ea = float(row_rel_l2(dbg["attn_norm_out"][l][0, row], g["hidden.attn_norm_out"][l, row]))
        ef = float(row_rel_l2(dbg["ffn_norm_out"][l][0, row], g["hidden.ffn_norm_out"][l, row]))
        if ea > 1e-5 or ef > 1e-5:
            notes.append("first hidden difference at layer %d (%s input, rel-L2 %.3g)" %
                         (l, "attention" if ea > 1e-5 else "FFN", max(ea, ef)))
            break
    return notes or ["no decision changed at this row"]


def decisions_agree(dbg, g, rows, n_layers):
    """Fraction of (row, layer) decisions equal to the golden's on the given rows."""
    tot = same = 0
    for l in range(n_layers):
        for key, mine in (("debug.router_experts.layer%d" % l, "router_experts.layer%d" % l),
                          ("debug.sparse_topk.layer%d" % l, "sparse_topk.layer%d" % l)):
            if key not in g:
                continue
            a, b = dbg[mine][0, :rows], g[key][:rows]
            if "router" in key:
                a, b = a.sort(-1)[0], b.sort(-1)[0]
            same += int((a == b).all(-1).sum())
            tot += rows
    return same, tot


def check_case(case_dir=GOLDEN, cmap_path=GOLDEN_CMAP, dspark_dir=GOLDEN_DSPARK, threads=None):
    if threads:
        torch.set_num_threads(threads)
    g, _ = st.read_safetensors(os.path.join(case_dir, "golden.safetensors"))
    with open(os.path.join(case_dir, "case.json")) as f:
        cj = json.load(f)
    cmap = load_cmap(cmap_path) if cmap_path and os.path.exists(cmap_path) else g["engram_token_map"]
    m = M.V41Model.from_pretrained(case_dir, cmap=cmap).eval()
    cfg = m.cfg
    ids = g["input_ids"].long()
    T, T0 = ids.numel(), int(cj["T0"])
    rep = {"case": cj.get("case", case_dir), "T": T, "T0": T0}
    rep["engram_token_map_equal"] = bool(torch.equal(m.cmap[:cfg.vocab_size].int(), g["engram_token_map"]))
    dbg = {}
    with torch.no_grad():
        logits, taps = m(ids[None], want_taps=True, debug=dbg)
    logits = logits[0]
    req = (T * 35 + 99) // 100
    rep["prefill"] = group(logits, g["logits_prefill"], req)
    rep["incremental"] = group(logits, g["logits_incremental"], min(T, max(T0 + 8, req)))
    rep["engram_ids_equal"] = bool(torch.equal(dbg["engram_hash_ids"][0], g["debug.engram_hash_ids"]))
    lead = rep["prefill"]["leading"]
    same, tot = decisions_agree(dbg, g, T, cfg.n_layers)
    rep["decisions_equal_all_rows"] = "%d/%d" % (same, tot)
    if lead < T:
        rep["first_divergent_row"] = lead
        rep["at_first_divergent_row"] = explain_row(dbg, g, lead, cfg.n_layers)
    # greedy rows: the prompt followed by the golden's greedy tokens (teacher forced)
    gt = g["greedy_tokens"].long()
    N = gt.numel()
    with torch.no_grad():
        lg2 = m(torch.cat([ids, gt[:-1]])[None])[0]
    rows = lg2[T - 1:T - 1 + N]
    e = row_rel_l2(rows, g["greedy_logits"])
    rep["greedy"] = {"rows": N, "leading": leading(e), "argmax_equal": int((rows.argmax(-1) == gt).sum()),
                     "max_rel_l2_leading": float(e[:leading(e)].max()) if leading(e) else None,
                     "note": "valid only if the prefill agrees on every row (else the golden's own later "
                             "rows come from a diverged state)"}
    rep["argmax_prefill_equal"] = int((logits.argmax(-1) == g["logits_prefill"].argmax(-1)).sum())
    if dspark_dir and os.path.exists(os.path.join(dspark_dir, "dspark_golden.safetensors")):
        dg, _ = st.read_safetensors(os.path.join(dspark_dir, "dspark_golden.safetensors"))
        if "taps" in dg and torch.equal(dg["input_ids"], g["input_ids"]):
            with open(os.path.join(dspark_dir, "config.json")) as f:
                dcfg = M.Config(json.load(f))
            if dcfg.dspark_target_layers == cfg.dspark_target_layers:
                mine = taps[0].reshape(T, -1)
                e = row_rel_l2(mine, dg["taps"])
                n = leading(e, 1e-5)
                rep["taps"] = {"rows": T, "leading_within_1e-5": n, "max_rel_l2_leading": float(e[:n].max()) if n else None,
                               "shape": list(taps.shape)}
    return rep


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("case", nargs="?", default=GOLDEN)
    ap.add_argument("--cmap", default=GOLDEN_CMAP)
    ap.add_argument("--dspark", default=GOLDEN_DSPARK)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    rep = check_case(a.case, a.cmap, a.dspark, a.threads)
    print(json.dumps(rep, indent=1))
    ok = rep["prefill"]["ok"] and rep["incremental"]["ok"]
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
