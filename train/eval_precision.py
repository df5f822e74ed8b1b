"""Greedy agreement between two engine precisions (issue 24: "CUDA bf16 ... greedy
continuations agree on most tokens (report the fraction)").

N prompts of P tokens are cut from a held-out text (tokenized by `dsx tokenize`, plain
text); each is continued greedily for G tokens by `dsx generate` (DSpark off, no stop)
with precision A and with precision B. Reported: the fraction of generated positions
whose tokens are equal, the mean length of the common prefix (the tokens before the
first divergence) over G, and the fraction of continuations that are identical.

    python3 train/eval_precision.py --dsx DSX -m MODEL --text FILE [--backend cuda]
        [--a fp32] [--b bf16] [--prompts 32] [--prompt-len 256] [--gen-len 128]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def tokenize(dsx, model, path):
    out = subprocess.run([dsx, "tokenize", "-m", model, "-f", path], check=True, capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def generate(dsx, model, ids_file, n, backend, precision):
    cmd = [dsx, "generate", "-m", model, "--ids", ids_file, "-n", str(n), "--greedy", "--dspark", "off",
           "--backend", backend, "--precision", precision]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dsx", required=True)
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--text", required=True)
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--a", default="fp32")
    ap.add_argument("--b", default="bf16")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    toks = tokenize(args.dsx, args.model, args.text)
    stride = max(args.prompt_len, (len(toks) - args.prompt_len) // max(args.prompts, 1))
    equal = total = prefix = same = n = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.prompts):
            s = i * stride
            if s + args.prompt_len > len(toks):
                break
            f = os.path.join(tmp, "ids.safetensors")
            st.write_safetensors(f, {"input_ids": torch.tensor(toks[s:s + args.prompt_len], dtype=torch.int32)})
            a = generate(args.dsx, args.model, f, args.gen_len, args.backend, args.a)
            b = generate(args.dsx, args.model, f, args.gen_len, args.backend, args.b)
            m = min(len(a), len(b))
            equal += sum(1 for x, y in zip(a, b) if x == y)
            total += max(len(a), len(b))
            p = 0
            while p < m and a[p] == b[p]:
                p += 1
            prefix += p
            same += int(a == b)
            n += 1
            print("prompt %d: common prefix %d / %d" % (i, p, max(len(a), len(b))), flush=True)
    r = {"prompts": n, "gen_len": args.gen_len, "precisions": [args.a, args.b], "backend": args.backend,
         "equal_position_fraction": equal / max(total, 1), "mean_common_prefix": prefix / max(n, 1),
         "identical_fraction": same / max(n, 1)}
    print(json.dumps(r, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
