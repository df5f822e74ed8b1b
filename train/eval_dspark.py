"""DSpark acceptance at temperature 0 on held-out text (issue 24's bar: >= 2.5 tokens per cycle
of a block of 5 on held-out code).

Protocol. N prompts of P tokens are cut from the held-out tokens; the target continues each
greedily for G tokens (the target's greedy chain). The speculative loop is then replayed on
that chain: at an anchor n (the chain token at n, not yet processed by the target; positions
< n committed, their taps in the drafter's rings, §5.1) the drafter proposes its greedy block
d_1 .. d_B (§5.6); accepted = the longest prefix with d_i = chain[n + i] (the target's greedy
picks), capped so that no draft lies past the chain's end; the cycle emits accepted + 1
tokens and the next anchor is n + accepted + 1. Reported: mean tokens per cycle (accepted + 1),
the histogram of accepted drafts, the conditional acceptance per block position, and the same
figures over every anchor of the chain (not only the ones the walk visits).

Backends (--target / --drafter):
  torch   the PyTorch target (train/model.py) and drafter (train/dspark.py)
  engine  build-cpu/dsx: the chain from `dsx generate --dspark off`, the taps and drafts
          from `dsx draft` (every anchor of the chain in one call)
  --target engine --drafter torch  feeds the engine's taps to the PyTorch drafter;
  --engine-live  also runs `dsx generate --dspark static B --stats` on every prompt (the
          engine's own speculative decoder) and reports its cycles.
  --compare  runs both drafters on the same taps and reports token agreement and logit error
          (the export check: the engine loads the exported stages and agrees with PyTorch).

Input text: --ids FILE (uint16 token ids, e.g. val.bin), --text FILE (tokenized with the
model's tokenizer.json by `dsx tokenize`), --heldout DIR (every file, tokenized; prompts
taken from the files in name order), or --random (uniform random ids: the code path on
random models).

Examples
  python3 train/eval_dspark.py --model train/out/dspark/model --text train/out/data/heldout_code.txt \\
      --device cuda --prompts 64 --prompt-len 256 --gen-len 128
  /usr/bin/python3 train/eval_dspark.py --model DIR --random --target engine --drafter torch --compare
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)

import dspark as DS  # noqa: E402
import st as ST  # noqa: E402

DSX = os.path.normpath(os.path.join(_HERE, "..", "build-cpu", "dsx"))


def log(msg):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------
# prompts

def tokenize_file(dsx, tokenizer, path):
    """Token ids of a text file: `dsx tokenize` when the binary exists, else the project's
    Python encoder (train/data/bpe.py, checked identical to dsx by its tests)."""
    if os.path.exists(dsx):
        out = subprocess.run([dsx, "tokenize", "--tokenizer", tokenizer, "-f", path, "--json"], check=True,
                             capture_output=True, text=True).stdout
        return json.loads(out)["ids"]
    sys.path.insert(0, os.path.join(_HERE, "data"))
    import bpe
    key = ("tok", tokenizer)
    if key not in _TOK:
        _TOK[key] = bpe.Tokenizer(tokenizer)
    with open(path, encoding="utf-8") as f:
        return _TOK[key].encode(f.read())


_TOK = {}


def make_prompts(args, vocab):
    """[N, P] prompts, deterministic (seeded)."""
    gen = np.random.default_rng(args.seed)
    P, N = args.prompt_len, args.prompts
    if args.random:
        return torch.from_numpy(gen.integers(3, vocab - 1, size=(N, P)).astype(np.int64))
    if args.ids:
        toks = np.fromfile(args.ids, dtype=np.uint16).astype(np.int64)
        docs = [toks]
    else:
        tok = os.path.join(args.model, "tokenizer.json")
        files = [args.text] if args.text else sorted(
            os.path.join(args.heldout, f) for f in os.listdir(args.heldout)
            if os.path.isfile(os.path.join(args.heldout, f)))
        docs = [np.asarray(tokenize_file(args.dsx, tok, f), dtype=np.int64) for f in files]
    need = P + args.gen_len  # room so the held-out text could have continued
    docs = [t for t in docs if len(t) >= P]
    if not docs:
        raise SystemExit("no held-out text of at least %d tokens" % P)
    if len(docs) == 1:
        t = docs[0]
        hi = max(1, len(t) - need)
        starts = np.linspace(0, hi - 1, N).astype(np.int64) if hi > N else gen.integers(0, hi, size=N)
        out = [t[s:s + P] for s in starts]
    else:
        out = [d[:P] for d in docs[:N]]
        i = 0
        while len(out) < N:  # more prompts than files: later windows of the files
            d = docs[i % len(docs)]
            k = 1 + i // len(docs)
            if len(d) >= (k + 1) * P:
                out.append(d[k * P:(k + 1) * P])
            i += 1
            if i > 100 * N:
                break
    p = torch.from_numpy(np.stack(out))
    if int(p.max()) >= vocab:
        raise SystemExit("token id %d outside the model's vocabulary %d" % (int(p.max()), vocab))
    return p


# ---------------------------------------------------------------------------------------
# targets: the greedy chain and the taps

class TorchTarget:
    def __init__(self, model_dir, device):
        import train_dspark as TD
        self.model = TD.load_target_model(model_dir, device)
        self.device = device

    def forward(self, ids):
        with torch.no_grad():
            logits, taps = self.model(ids.to(self.device), want_taps=True)
        B, T = ids.shape
        return logits.float(), taps.float().reshape(B, T, -1)

    def chain(self, prompts, G, batch=16):
        """prompts [N, P] -> sequences [N, P + G] (greedy, full recompute per token) and their taps."""
        seqs, taps = [], []
        for i in range(0, prompts.shape[0], batch):
            x = prompts[i:i + batch].to(self.device)
            with torch.no_grad():
                for _ in range(G):
                    lg, _ = self.model(x, want_taps=True)
                    x = torch.cat([x, lg[:, -1].float().argmax(-1, keepdim=True)], dim=1)
            _, tp = self.forward(x)
            seqs.append(x.cpu())
            taps.append(tp.cpu())
        return torch.cat(seqs), torch.cat(taps)


def write_ids(path, ids, extra=None):
    t = {"input_ids": torch.as_tensor(ids, dtype=torch.int32).clone()}
    t.update(extra or {})
    ST.write_safetensors(path, t)


class EngineTarget:
    def __init__(self, model_dir, dsx, threads=0):
        self.dir, self.dsx, self.threads = model_dir, dsx, threads

    def _cmd(self, *a):
        c = [self.dsx] + list(a)
        if self.threads:
            c += ["--threads", str(self.threads)]
        return c

    def generate(self, prompt, G, dspark="off", stats=False):
        with tempfile.TemporaryDirectory() as td:
            f = os.path.join(td, "p.safetensors")
            write_ids(f, prompt)
            cmd = self._cmd("generate", "-m", self.dir, "--ids", f, "-n", str(G), "--greedy", "--dspark", dspark)
            if stats:
                cmd.append("--stats")
            r = subprocess.run(cmd, check=True, capture_output=True, text=True)
        return [int(x) for x in r.stdout.split()], r.stderr

    def draft(self, seq, anchors, forced_prev):
        """`dsx draft` on the sequence seq [T] at anchors [A] (tokens seq[n]): taps [T, W] and the
        engine's drafter outputs."""
        with tempfile.TemporaryDirectory() as td:
            f, o = os.path.join(td, "g.safetensors"), os.path.join(td, "o.safetensors")
            anchors = torch.as_tensor(anchors, dtype=torch.int64)
            write_ids(f, seq, {
                "anchor_positions": anchors.to(torch.int32),
                "anchor_tokens": torch.as_tensor(seq, dtype=torch.int64)[anchors].to(torch.int32),
                "dspark.forced_prev_tokens": torch.as_tensor(forced_prev, dtype=torch.int32)})
            subprocess.run(self._cmd("draft", "-m", self.dir, "--golden", f, "-o", o, "--quiet"), check=True,
                           capture_output=True, text=True)
            out, _ = ST.read_safetensors(o)
        return out

    def chain(self, prompts, G):
        seqs = []
        for p in prompts:
            ids, _ = self.generate(p.tolist(), G)
            seqs.append(torch.cat([p, torch.tensor(ids[:G], dtype=torch.int64)]))
        return torch.stack(seqs)


# ---------------------------------------------------------------------------------------
# drafts at every anchor and the walk

def torch_drafts(d, seq, taps, anchors, forced_prev=None, chunk=512):
    """Greedy drafts of the PyTorch drafter at anchors [A] of one sequence seq [T] with taps
    [T, W]: dict of tensors [A, B] (tokens, confidence logits) and [A, B, V] logits."""
    dev = d.embed.device
    res = {}
    with torch.no_grad():
        P = int(anchors.max())
        u = d.fuse(taps[:P].to(dev))
        rows = d.ring_rows(u, torch.arange(P, device=dev))
        for i in range(0, anchors.numel(), chunk):
            n = anchors[i:i + chunk].to(dev)
            idx, mask = DS.window_index(n, d.cfg.window, slot_order=True)
            safe = idx.clamp(0, P - 1)
            ctx = [r[safe] * mask[..., None] for r in rows]
            a = seq.to(dev)[n]
            out = d.block(ctx, mask, a, n)
            g = d.greedy(out["base_logits"], out["z"], a)
            part = {"draft_tokens": g["draft_tokens"], "confidence_logits": g["confidence_logits"],
                    "markov_logits": g["markov_logits"], "base_logits": out["base_logits"]}
            if forced_prev is not None:
                f = d.markov(out["base_logits"], out["z"], forced_prev[i:i + chunk].to(dev))
                part["forced_markov_logits"] = f["markov_logits"]
                part["forced_confidence_logits"] = f["confidence_logits"]
            for k, v in part.items():
                res.setdefault(k, []).append(v.cpu())
    return {k: torch.cat(v) for k, v in res.items()}


def accepted_lengths(seq, anchors, drafts, end):
    """accepted[a] = longest prefix i with drafts[a, i] == seq[n + 1 + i], at most end - 1 - n
    drafts (none past the chain's last position end - 1)."""
    B = drafts.shape[1]
    n = anchors[:, None]
    posn = n + 1 + torch.arange(B)[None, :]
    valid = posn <= end - 1
    ref = seq[posn.clamp(max=seq.numel() - 1)]
    hit = (drafts == ref) & valid
    return torch.cumprod(hit.long(), dim=1).sum(1), valid


def walk(acc_by_pos, P, end, B):
    """The cycle walk from anchor P: accepted drafts of each cycle, for the cycles whose whole
    block lies inside the chain (n + B <= end - 1), so that every cycle can accept up to B."""
    out, n = [], P
    while n + B <= end - 1:
        j = int(acc_by_pos[n])
        out.append(j)
        n += j + 1
    return out


def summarize(cycles, all_acc, B, hits_all=None):
    cyc = torch.tensor(cycles, dtype=torch.float64)
    hist = [int((cyc == k).sum()) for k in range(B + 1)]
    s = {"cycles": len(cycles), "tokens_per_cycle": float(cyc.mean() + 1) if len(cycles) else 0.0,
         "accepted_per_cycle": float(cyc.mean()) if len(cycles) else 0.0, "histogram": hist}
    # conditional acceptance per position over the walk: P(accepted > k | accepted >= k)
    s["conditional"] = [int((cyc > k).sum()) / max(1, int((cyc >= k).sum())) for k in range(B)]
    aa = torch.cat(all_acc).double()
    s["all_anchors"] = {"anchors": int(aa.numel()), "tokens_per_cycle": float(aa.mean() + 1),
                        "histogram": [int((aa == k).sum()) for k in range(B + 1)]}
    return s


def run(args):
    cfg = DS.DSparkConfig.from_json(DS.load_config(args.model))
    B, V = cfg.block_size, cfg.vocab
    prompts = make_prompts(args, V)
    N, P = prompts.shape
    G = args.gen_len
    device = torch.device(args.device)
    DS.set_precise(args.precise)
    log("eval: %s, %d prompts x %d tokens, %d greedy tokens each; target %s, drafter %s" % (
        args.model, N, P, G, args.target, args.drafter))
    eng = EngineTarget(args.model, args.dsx, args.threads)
    if args.target == "torch":
        tt = TorchTarget(args.model, device)
        seqs, taps = tt.chain(prompts, G)
    else:
        seqs = eng.chain(prompts, G)
        taps = None
    end = P + G  # positions 0 .. end - 1
    d = DS.load_drafter(args.model, device=device) if (args.drafter == "torch" or args.compare) else None
    cycles, all_acc, cmp = [], [], []
    for i in range(N):
        seq = seqs[i]
        anchors = torch.arange(P, end - 1)
        rp = anchors[:, None] + torch.arange(B)[None, :]
        forced = seq[rp.clamp(max=end - 1)]  # teacher-forced prev tokens (the chain's)
        e_out = None
        if args.target == "engine" or args.drafter == "engine" or args.compare:
            e_out = eng.draft(seq, anchors, forced)
        tp = taps[i] if taps is not None else e_out["taps"]
        if args.drafter == "torch":
            t_out = torch_drafts(d, seq, tp, anchors, forced)
            drafts = t_out["draft_tokens"]
        else:
            drafts = e_out["dspark.draft_tokens"].long()
        if args.compare:
            # the engine's drafter against the PyTorch drafter on the engine's own taps
            t_e = torch_drafts(d, seq, e_out["taps"], anchors, forced) if args.target == "torch" or \
                args.drafter != "torch" else t_out
            cmp.append({
                "tokens_equal": int((t_e["draft_tokens"] == e_out["dspark.draft_tokens"].long()).sum()),
                "tokens": int(e_out["dspark.draft_tokens"].numel()),
                "base_rel_l2": _rel(t_e["base_logits"], e_out["dspark.base_logits"]),
                "markov_rel_l2": _rel(t_e["markov_logits"], e_out["dspark.markov_logits"]),
                "forced_rel_l2": _rel(t_e["forced_markov_logits"], e_out["dspark.forced_markov_logits"]),
                "conf_abs": float((t_e["confidence_logits"] - e_out["dspark.confidence_logits"]).abs().max()),
                "forced_conf_abs": float(
                    (t_e["forced_confidence_logits"] - e_out["dspark.forced_confidence_logits"]).abs().max()),
                "min_margin": float(_margin(e_out["dspark.markov_logits"]).min()),
                "base_rows_over_1e-4": _rows_over(t_e["base_logits"], e_out["dspark.base_logits"], 1e-4),
                "rows": int(t_e["base_logits"].shape[0] * t_e["base_logits"].shape[1]),
            })
            if taps is not None:  # the PyTorch target's taps against the engine's
                cmp[-1]["taps_rel_l2"] = _rel(taps[i][:end], e_out["taps"][:end])
                cmp[-1]["taps_leading_rows"] = _leading_rows(taps[i][:end], e_out["taps"][:end], 1e-4)
        acc, _ = accepted_lengths(seq, anchors, drafts, end)
        acc_by_pos = torch.zeros(end, dtype=torch.long)
        acc_by_pos[anchors] = acc
        cycles += walk(acc_by_pos, P, end, B)
        all_acc.append(acc[anchors + B <= end - 1])
    res = summarize(cycles, all_acc, B)
    res.update({"prompts": N, "prompt_len": P, "gen_len": G, "target": args.target, "drafter": args.drafter,
                "model": args.model})
    log("DSpark acceptance (T = 0, block %d): %.3f tokens per cycle (%.3f accepted drafts), %d cycles" % (
        B, res["tokens_per_cycle"], res["accepted_per_cycle"], res["cycles"]))
    log("  cycles by accepted drafts: " + " ".join("%d:%d" % (k, v) for k, v in enumerate(res["histogram"])))
    log("  conditional acceptance by position: " + " ".join("%.3f" % x for x in res["conditional"]))
    log("  over every anchor: %.3f tokens per cycle (%d anchors)" % (
        res["all_anchors"]["tokens_per_cycle"], res["all_anchors"]["anchors"]))
    if cmp:
        agg = {"tokens_equal": sum(c["tokens_equal"] for c in cmp), "tokens": sum(c["tokens"] for c in cmp)}
        for k in ("base_rel_l2", "markov_rel_l2", "forced_rel_l2", "conf_abs", "forced_conf_abs", "taps_rel_l2"):
            if k in cmp[0]:
                agg[k] = max(c[k] for c in cmp)
        agg["min_margin"] = min(c["min_margin"] for c in cmp)
        agg["base_rows_over_1e-4"] = sum(c["base_rows_over_1e-4"] for c in cmp)
        agg["rows"] = sum(c["rows"] for c in cmp)
        if "taps_leading_rows" in cmp[0]:
            agg["taps_leading_rows_min"] = min(c["taps_leading_rows"] for c in cmp)
            agg["taps_rows"] = end
        res["engine_vs_torch"] = agg
        log("  engine vs PyTorch drafter (engine taps): draft tokens %d/%d equal; max row rel-L2 base %.3g, "
            "markov %.3g, forced %.3g (%d of %d rows over 1e-4); max |d conf logit| %.3g (forced %.3g); "
            "smallest engine greedy margin %.3g%s" % (
                agg["tokens_equal"], agg["tokens"], agg["base_rel_l2"], agg["markov_rel_l2"], agg["forced_rel_l2"],
                agg["base_rows_over_1e-4"], agg["rows"],
                agg["conf_abs"], agg["forced_conf_abs"], agg["min_margin"],
                ("; taps torch vs engine: max row rel-L2 %.3g, rows within 1e-4 before the first one off: >= %d of %d" % (
                    agg["taps_rel_l2"], agg["taps_leading_rows_min"], agg["taps_rows"])) if "taps_rel_l2" in agg else ""))
    if args.engine_live:
        live = []
        for i in range(N):
            _, err = eng.generate(prompts[i].tolist(), G, dspark="static %d" % B, stats=True)
            live.append(_parse_stats(err, B))
        hist = [sum(x["histogram"][k] for x in live) for k in range(B + 1)]
        nc = sum(hist)
        tpc = sum((k + 1) * h for k, h in enumerate(hist)) / max(1, nc)
        res["engine_live"] = {"cycles": nc, "tokens_per_cycle": tpc, "histogram": hist}
        log("  engine speculative decoder (dsx generate --dspark static %d): %.3f tokens per cycle over %d cycles; "
            "%s" % (B, tpc, nc, " ".join("%d:%d" % (k, v) for k, v in enumerate(hist))))
    return res


def _rel(a, b):
    a = a.double().reshape(-1, a.shape[-1])
    b = b.double().reshape(-1, b.shape[-1])
    den = b.norm(dim=-1)
    r = torch.where(den > 0, (a - b).norm(dim=-1) / den.clamp(min=1e-300), (a - b).norm(dim=-1))
    return float(r.max())


def _leading_rows(a, b, tol):
    a = a.double().reshape(-1, a.shape[-1])
    b = b.double().reshape(-1, b.shape[-1])
    r = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-300)
    off = (r > tol).nonzero()
    return int(off[0, 0]) if off.numel() else int(r.numel())


def _rows_over(a, b, tol):
    a = a.double().reshape(-1, a.shape[-1])
    b = b.double().reshape(-1, b.shape[-1])
    r = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp(min=1e-300)
    return int((r > tol).sum())


def _margin(logits):
    t = logits.topk(2, dim=-1)[0]
    return t[..., 0] - t[..., 1]


def _parse_stats(err, B):
    """'cycles by accepted drafts: 0:40 1:0 ...' of dsx generate --stats."""
    for line in err.splitlines():
        if "cycles by accepted drafts:" in line:
            parts = line.split("cycles by accepted drafts:")[1].split()
            h = [0] * (B + 1)
            for p in parts:
                k, v = p.split(":")
                if int(k) <= B:
                    h[int(k)] = int(v)
            return {"histogram": h}
    raise RuntimeError("dsx generate --stats printed no cycle histogram:\n" + err)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint dir with DSpark stages")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help="uint16 token file")
    src.add_argument("--text", help="a text file (tokenized with the model's tokenizer.json)")
    src.add_argument("--heldout", help="a dir of text files")
    src.add_argument("--random", action="store_true", help="uniform random prompts")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--target", choices=["torch", "engine"], default="torch")
    ap.add_argument("--drafter", choices=["torch", "engine"], default="torch")
    ap.add_argument("--compare", action="store_true", help="engine vs PyTorch drafter on the same taps")
    ap.add_argument("--engine-live", action="store_true", help="also dsx generate --dspark static B --stats")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precise", action="store_true", help="f64-accumulated products in the PyTorch drafter")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dsx", default=DSX)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    res = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
