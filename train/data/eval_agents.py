#!/usr/bin/python3
"""Greedy tool-call check of a trained model on the held-out agent prompts (issue 24: at
least 90 % of greedy completions contain a DSML tool call that parses and whose arguments
validate against the given schema).

    /usr/bin/python3 train/data/eval_agents.py -m MODEL_DIR [--eval train/out/data/agent_eval.jsonl]
        [--dsx build-cpu/dsx] [--backend cpu|cuda] [-n 384] [--limit N] [--out report.jsonl]

For each prompt: `dsx generate -m MODEL_DIR --ids P.safetensors -n N --stop-eos` (greedy),
the new ids decoded with the model's tokenizer.json, then dsml_lite.check_completion: the
text up to the first DSML block closer (where the server stops generating) must hold at
least one call, each naming one of the prompt's tools with arguments valid against its
schema. Prints the pass fraction (and how often the first call names the expected tool).
Prompts without tools (chat_eval.jsonl, synth_agents.py's held-out plain chats) are judged
the other way: the completion must answer in text (non-empty, after the thinking when
thinking) and hold no DSML call, since none can be valid without tools; printed as
text_answer.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe  # noqa: E402
import dsml_lite  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))


def write_ids(path: str, ids) -> None:
    """A safetensors file with one I32 tensor input_ids [T]."""
    data = struct.pack(f"<{len(ids)}i", *ids)
    header = json.dumps({"input_ids": {"dtype": "I32", "shape": [len(ids)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * ((8 - len(header) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header + data)


def text_answer(text: str, p):
    """(ok, detail) for a prompt without tools: a text answer, no DSML call
    (p: dsml_lite.parse_completion of the text)."""
    if dsml_lite.OPEN in text:
        return False, "a DSML call without tools"
    if p["error"]:
        return False, p["error"]
    return (True, "text") if p["content"].strip() else (False, "empty answer")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", dest="model", required=True)
    ap.add_argument("--eval", default=os.path.join(REPO, "train", "out", "data", "agent_eval.jsonl"))
    ap.add_argument("--dsx", default=os.environ.get("DSX", os.path.join(REPO, "build-cpu", "dsx")))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--precision", default=None)
    ap.add_argument("-n", type=int, default=384, help="new tokens at most")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--out", default=None, help="per-prompt results (JSON lines)")
    ap.add_argument("--shard", default=None, help="K/N: only the prompts with index %% N == K (after --limit)")
    args = ap.parse_args()
    tok = bpe.Tokenizer(os.path.join(args.model, "tokenizer.json"))
    with open(args.eval, encoding="utf-8") as f:
        items = [json.loads(l) for l in f]
    if args.limit:
        items = items[: args.limit]
    index = list(range(len(items)))
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        if not 0 <= k < n:
            raise SystemExit(f"--shard {args.shard}: want K/N with 0 <= K < N")
        index = index[k::n]
        items = items[k::n]
    n_ok = n_tool = 0
    t0 = time.time()
    results = []
    with tempfile.TemporaryDirectory(prefix="dsx-eval-") as td:
        for i, e in enumerate(items):
            p = os.path.join(td, "ids.safetensors")
            write_ids(p, e["prompt_ids"])
            cmd = [args.dsx, "generate", "-m", args.model, "--ids", p, "-n", str(args.n), "--stop-eos", "--backend", args.backend]
            if args.precision:
                cmd += ["--precision", args.precision]
            r = subprocess.run(cmd, capture_output=True)
            if r.returncode != 0:
                raise SystemExit(f"prompt {i}: dsx generate failed: {r.stderr.decode(errors='replace')[:400]}")
            new = [int(x) for x in r.stdout.split()]
            text = tok.decode(new)
            parsed = dsml_lite.parse_completion(text, e["thinking"])
            if e["tools"]:
                ok, detail = dsml_lite.check_completion(text, e["tools"], e["thinking"])
            else:
                ok, detail = text_answer(text, parsed)
            first = parsed["calls"]
            named = bool(first) and first[0]["name"] == e["expected_tool"]
            n_ok += ok
            n_tool += named
            results.append({"index": index[i], "ok": ok, "detail": detail, "expected_tool": e["expected_tool"],
                            "first_tool_matches": named, "scenario": e["scenario"], "thinking": e["thinking"],
                            "new_tokens": len(new), "completion": text})
            if (i + 1) % 20 == 0:
                print(f"[eval] {i + 1}/{len(items)}: {n_ok} ok ({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            for r in results:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    n = len(items)
    if all(not e["tools"] for e in items):
        print(f"text_answer {n_ok}/{n} = {n_ok / n:.3f}")
        return 0
    print(f"tool_call_valid {n_ok}/{n} = {n_ok / n:.3f}")
    print(f"first_call_expected_tool {n_tool}/{n} = {n_tool / n:.3f}")
    for mode in (False, True):
        sub = [r for r in results if r["thinking"] == mode]
        if sub:
            print(f"  thinking={'on' if mode else 'off'}: {sum(r['ok'] for r in sub)}/{len(sub)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
