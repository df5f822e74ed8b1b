#!/usr/bin/python3
"""Trains the project's byte-level BPE tokenizer and writes train/out/tokenizer.json.

The result keeps everything of the V4.1 tokenizer (../shared/golden/tokenizer/
tokenizer-v41.json) except the BPE model: the same normalizer, pre-tokenizer,
post-processor and decoder, and every added token with the same content and flags
(special, normalized, lstrip, rstrip, single_word), so dsx's renderer, DSML parser and
Engram map work unchanged. Ids:
    0, 1, 2            BOS, EOS, pad (in the vocab and added, as in V4.1)
    3 .. 258           the 256 byte symbols (GPT-2 order, as in V4.1)
    259 .. 259+M-1     the M learned merges, in merge order
    259+M ..           the other 1280 added tokens, in the V4.1 id order
M is chosen so that the total is a multiple of 32 (settings: total_size).

Training sample (deterministic): documents of train/out/data/docs/train_*.txt taken in
hash order up to a byte budget per kind, plus rendered agent conversations
(train/out/data/agents/sample_text.txt, written by synth_agents.py --sample-text) with
the added-token strings cut out exactly as encoding cuts them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bpe  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
_GOLDEN_ROOT = os.environ.get("DSX_GOLDEN_DIR") or os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "shared", "golden"))  # DSX_GOLDEN_DIR or ../shared/golden beside the repo
GOLDEN = os.path.join(_GOLDEN_ROOT, "tokenizer/tokenizer-v41.json")
BOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"

SETTINGS = {
    "seed": 24,
    "total_size": 9216,  # vocab entries + added tokens = 288 * 32
    "sample_bytes": {"code": 16_000_000, "js": 1_500_000, "docs": 2_500_000, "agents": 2_000_000},
}


def log(msg: str) -> None:
    print(f"[tokenizer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def docs_of(path: str):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return [d for d in text.split(BOS) if d]


def sample_docs(docs, budget: int, seed: int):
    keyed = sorted(docs, key=lambda d: hashlib.sha256(f"{seed}:".encode() + d.encode("utf-8")).digest())
    out, total = [], 0
    for d in keyed:
        if total >= budget:
            break
        n = len(d.encode("utf-8"))
        if n > budget // 4:  # no single document dominates the sample
            continue
        out.append(d)
        total += n
    return out, total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(REPO, "train", "out", "data"))
    ap.add_argument("--out", default=os.path.join(REPO, "train", "out", "tokenizer.json"))
    args = ap.parse_args()
    t0 = time.time()
    with open(GOLDEN, encoding="utf-8") as f:
        golden = json.load(f)
    gold_tok = bpe.Tokenizer(GOLDEN)  # for cutting added tokens out of the agent text

    texts = []
    stats = {}
    for kind in ("code", "js", "docs"):
        docs = docs_of(os.path.join(args.data, "docs", f"train_{kind}.txt"))
        chosen, total = sample_docs(docs, SETTINGS["sample_bytes"][kind], SETTINGS["seed"])
        texts += chosen
        stats[kind] = {"documents": len(chosen), "bytes": total}
    agent_path = os.path.join(args.data, "agents", "sample_text.txt")
    if os.path.exists(agent_path):
        with open(agent_path, encoding="utf-8") as f:
            atext = f.read()
        convs = [c for c in atext.split(BOS) if c]
        chosen, total = sample_docs(convs, SETTINGS["sample_bytes"]["agents"], SETTINGS["seed"])
        n_added = 0
        for c in chosen:
            for is_added, s in gold_tok.split_added(c):
                if is_added:
                    n_added += 1
                else:
                    texts.append(s)
        stats["agents"] = {"documents": len(chosen), "bytes": total, "added_tokens_cut": n_added}
    else:
        log(f"warning: {agent_path} missing; training without agent text")
    log(f"sample: {json.dumps(stats)}")

    counts = bpe.count_pieces(texts)
    log(f"{len(counts)} distinct pieces, {sum(counts.values())} pieces ({time.time() - t0:.1f} s)")

    added = sorted(golden["added_tokens"], key=lambda a: a["id"])
    lead = [a for a in added if a["id"] in (0, 1, 2)]
    rest = [a for a in added if a["id"] not in (0, 1, 2)]
    assert [a["id"] for a in lead] == [0, 1, 2]
    n_merges = SETTINGS["total_size"] - 3 - 256 - len(rest)
    log(f"training {n_merges} merges")
    merges = bpe.train_bpe(counts, n_merges, progress=lambda n, c: log(f"  merge {n}: count {c}"))
    if len(merges) != n_merges:
        raise SystemExit(f"only {len(merges)} merges could be learned (sample too small)")

    vocab = {}
    for a in lead:
        vocab[a["content"]] = a["id"]
    for i, b in enumerate(bpe.BYTE_ORDER):
        vocab[bpe.BYTE_TO_CHAR[b]] = 3 + i
    merge_strs = []
    for a, b in merges:
        sa, sb = bpe.bytes_to_symbols(a), bpe.bytes_to_symbols(b)
        merged = sa + sb
        if merged in vocab:
            raise SystemExit(f"merge result {merged!r} learned twice")
        vocab[merged] = len(vocab)
        merge_strs.append(f"{sa} {sb}")
    added_out = []
    next_id = len(vocab)
    for a in added:
        b = dict(a)
        if a["id"] not in (0, 1, 2):
            b["id"] = next_id
            next_id += 1
        added_out.append(b)
    assert next_id == SETTINGS["total_size"], next_id
    contents = {a["content"] for a in added_out}
    clash = [s for s in vocab if s in contents and vocab[s] > 2]
    if clash:
        raise SystemExit(f"vocab strings equal to added tokens: {clash[:5]}")

    tj = {
        "version": golden["version"],
        "truncation": golden["truncation"],
        "padding": golden["padding"],
        "added_tokens": added_out,
        "normalizer": golden["normalizer"],
        "pre_tokenizer": golden["pre_tokenizer"],
        "post_processor": golden["post_processor"],
        "decoder": golden["decoder"],
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "vocab": vocab,
            "merges": merge_strs,
        },
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    tmp = args.out + ".tmp.json"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=None, separators=(",", ":"))
    os.replace(tmp, args.out)
    info = {
        "tokenizer": os.path.relpath(args.out, REPO),
        "settings": SETTINGS,
        "sample": stats,
        "vocab_entries": len(vocab),
        "merges": len(merge_strs),
        "added_tokens": len(added_out),
        "size": next_id,
        "ids": {a["content"]: a["id"] for a in added_out if "place\u2581holder" not in a["content"]},
        "sha256": hashlib.sha256(open(args.out, "rb").read()).hexdigest(),
    }
    with open(os.path.join(os.path.dirname(args.out), "tokenizer_info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1, ensure_ascii=False)
        f.write("\n")
    log(f"wrote {args.out}: {len(vocab)} vocab entries, {len(merge_strs)} merges, {len(added_out)} added, "
        f"size {next_id}, {os.path.getsize(args.out) / 1e3:.0f} KB, {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
