#!/usr/bin/python3
"""Writes the token files the trainer reads: train/out/data/{train,val}.bin.

Layout: uint16 little-endian token ids; documents concatenated, each starting with the
tokenizer's BOS id (0). A document is a corpus file (Python / JavaScript / docs) or a piece
of one, or one rendered agent conversation or chat. The kinds are interleaved in a seeded
order (the next document is a conversation when the share of conversation tokens still to
place exceeds that of corpus tokens, with a small random jitter), and packed so that a trainer reading fixed windows at multiples of
1024 (or 2048) tokens sees whole conversations: a conversation of at most 1024 tokens never
crosses a multiple of 1024, one of at most 2048 never crosses a multiple of 2048; the gap
before it is filled with corpus text, cutting a corpus file (after a newline token) where
needed, its remainder becoming a new document that starts with BOS.
{split}.offsets.bin (uint64 LE) is the start of every document, {split}.kinds.bin (uint8)
its kind (KINDS), tokens.json the counts, proportions and packing figures.

Corpus documents are tokenized by dsx (build-cpu/dsx tokenize) on the BOS-separated files
of build_corpus.py; the agent conversations come tokenized from synth_agents.py (dsx
render --ids).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
SETTINGS = {"seed": 24, "blocks": [1024, 2048]}
BOS_ID = 0
KINDS = {"python": 0, "javascript": 1, "docs": 2, "agent": 3, "chat": 4}


def log(msg: str) -> None:
    print(f"[tokens {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def dsx_bin() -> str:
    return os.environ.get("DSX", os.path.join(REPO, "build-cpu", "dsx"))


def tokenize_file(path: str, tokenizer: str) -> np.ndarray:
    r = subprocess.run([dsx_bin(), "tokenize", "--tokenizer", tokenizer, "-f", path], capture_output=True, check=True)
    ids = np.fromstring(r.stdout, dtype=np.int64, sep=" ")
    return ids


def split_docs(ids: np.ndarray):
    starts = np.flatnonzero(ids == BOS_ID)
    if len(ids) and (len(starts) == 0 or starts[0] != 0):
        raise SystemExit("token stream does not start with BOS")
    ends = list(starts[1:]) + [len(ids)]
    return [ids[s:e] for s, e in zip(starts, ends)]


def pack(docs, rng, newline_ids):
    """The packed document sequence (see the module docstring)."""
    conv = [d for d in docs if d[0] in ("agent", "chat")]
    code = [d for d in docs if d[0] not in ("agent", "chat")]
    conv = [conv[i] for i in rng.permutation(len(conv))]
    code = [code[i] for i in rng.permutation(len(code))]
    conv.reverse()  # pop() from the end = next in order
    code.reverse()
    rem_conv = sum(len(d) for _, d in conv)
    rem_code = sum(len(d) for _, d in code)
    parts, offsets, kind_ids = [], [], []
    ntok = {k: 0 for k in KINDS}
    ndoc = {k: 0 for k in KINDS}
    pos = 0
    is_nl = np.zeros(65536, dtype=bool)
    is_nl[newline_ids] = True

    def emit(kind, arr):
        nonlocal pos
        offsets.append(pos)
        kind_ids.append(KINDS[kind])
        parts.append(arr)
        pos += len(arr)
        ntok[kind] += len(arr)
        ndoc[kind] += 1

    def fill(lo, hi):
        """Emits corpus text so that pos ends in [lo, hi]; False if the corpus ran out."""
        nonlocal rem_code
        while pos < lo:
            if not code:
                return False
            kind, c = code.pop()
            if pos + len(c) <= hi:
                emit(kind, c)
                rem_code -= len(c)
                continue
            a, b = lo - pos, hi - pos  # cut after k tokens, a <= k <= b
            nl = np.flatnonzero(is_nl[c[a - 1:b]])
            k = a + int(nl[-1]) if len(nl) else b
            emit(kind, c[:k])
            rest = np.concatenate([[BOS_ID], c[k:]])
            code.append((kind, rest))
            rem_code += 1 - k  # c stays counted, minus what was placed, plus the new BOS
        return True

    tot_conv, tot_code = max(1, rem_conv), max(1, rem_code)
    while conv or code:
        # Keep both kinds used up at the same relative rate (the fills count as corpus use).
        if conv and (not code or rem_conv / tot_conv + 0.01 * (rng.random() - 0.5) > rem_code / tot_code):
            kind, d = conv.pop()
            rem_conv -= len(d)
            L = len(d)
            blk = next((b for b in SETTINGS["blocks"] if L <= b), None)
            if blk and (pos % blk) + L > blk:
                nxt = (pos // blk + 1) * blk
                fill(nxt, nxt + blk - L)
            emit(kind, d)
        else:
            kind, c = code.pop()
            rem_code -= len(c)
            emit(kind, c)
    # packing figures over the conversations
    fig = {}
    for b in SETTINGS["blocks"]:
        whole, fits = 0, 0
        for o, k, p in zip(offsets, kind_ids, parts):
            if k in (KINDS["agent"], KINDS["chat"]) and len(p) <= b:
                fits += 1
                whole += (o // b) == ((o + len(p) - 1) // b)
        fig[f"conversations_within_{b}_windows"] = f"{whole}/{fits} of those <= {b} tokens"
    return parts, offsets, kind_ids, {"tokens": {k: v for k, v in ntok.items() if ndoc[k]},
                                      "documents": {k: v for k, v in ndoc.items() if ndoc[k]}, "packing": fig}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(REPO, "train", "out", "data"))
    ap.add_argument("--tokenizer", default=os.path.join(REPO, "train", "out", "tokenizer.json"))
    args = ap.parse_args()
    t0 = time.time()
    with open(os.path.join(args.data, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    sys.path.insert(0, HERE)
    import bpe  # noqa: E402

    tok = bpe.Tokenizer(args.tokenizer)
    newline_ids = np.array(sorted(i for i, b in tok.id_to_bytes.items() if b"\n" in b and i not in tok.added_ids), dtype=np.int64)
    report = {"settings": SETTINGS, "kind_ids": KINDS, "tokenizer_sha256": hashlib.sha256(open(args.tokenizer, "rb").read()).hexdigest(),
              "layout": "uint16 little-endian ids, documents concatenated, each starting with BOS id 0"}
    for split in ("train", "val"):
        docs = []  # (kind, array)
        kinds = {}
        for kind in ("code", "js", "docs"):
            key = f"{split}_{kind}"
            info = manifest["documents"].get(key)
            if not info:
                continue
            ids = tokenize_file(os.path.join(args.data, info["file"]), args.tokenizer)
            ds = split_docs(ids)
            if len(ds) != info["documents"]:
                raise SystemExit(f"{key}: {len(ds)} BOS-separated documents, the manifest says {info['documents']}")
            label = {"code": "python", "js": "javascript", "docs": "docs"}[kind]
            docs += [(label, d) for d in ds]
            log(f"{key}: {len(ds)} documents, {len(ids)} tokens, {os.path.getsize(os.path.join(args.data, info['file'])) / len(ids):.3f} bytes/token")
        abin = np.fromfile(os.path.join(args.data, "agents", f"{split}.bin"), dtype="<u2").astype(np.int64)
        with open(os.path.join(args.data, "agents", f"{split}.jsonl"), encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                d = abin[r["offset"] : r["offset"] + r["length"]]
                if d[0] != BOS_ID or (d[1:] == BOS_ID).any():
                    raise SystemExit("agent conversation without leading BOS or with an inner BOS")
                docs.append(("agent" if r["kind"] == "agent" else "chat", d))
        rng = np.random.default_rng(SETTINGS["seed"] + (0 if split == "train" else 1))
        parts, offsets, kind_ids, stats = pack(docs, rng, newline_ids)
        for kind, n in stats["tokens"].items():
            kinds[kind] = {"documents": stats["documents"][kind], "tokens": n}
        flat = np.concatenate(parts)
        if flat.max() >= 65536:
            raise SystemExit("id outside uint16")
        out = os.path.join(args.data, f"{split}.bin")
        flat.astype("<u2").tofile(out)
        np.asarray(offsets, dtype="<u8").tofile(os.path.join(args.data, f"{split}.offsets.bin"))
        np.asarray(kind_ids, dtype=np.uint8).tofile(os.path.join(args.data, f"{split}.kinds.bin"))
        total = int(len(flat))
        for k in kinds.values():
            k["fraction"] = round(k["tokens"] / total, 4)
        report[split] = {"tokens": total, "documents": len(offsets), "kinds": kinds, "packing": stats["packing"],
                         "sha256": hashlib.sha256(open(out, "rb").read()).hexdigest()}
        log(f"{split}.bin: {total} tokens, {len(offsets)} documents; " +
            ", ".join(f"{k} {v['fraction'] * 100:.1f}%" for k, v in sorted(kinds.items())) + f"; packing {json.dumps(stats['packing'])}")
    with open(os.path.join(args.data, "tokens.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    log(f"done in {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
