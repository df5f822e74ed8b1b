"""Where the trained model's tool-name copy fails (issue 24): on held-out agent prompts without
thinking whose reference turn opens with a call, feed the prompt + the call opener up to
`invoke name="` and report, at that position,

  dist               tokens back to the expected tool's name in the schema block (the window is
                     128 tokens; older rows are reachable only through the compressed rows the
                     indexers pick, top-k per query)
  p_first            probability of the first token of the expected name
  name_rows_selected per index-source layer: the compressed rows holding the schema's name
                     tokens that the layer's top-k picked at that position / all such rows
  top                the three most likely next tokens

    /usr/bin/python3 train/probe_names.py MODEL_DIR [-n 5] [--eval train/out/data/agent_eval.jsonl]
    /usr/bin/python3 train/probe_names.py --distances-only [--eval ...]   # no model: the distances

PyTorch on the CPU (train/model.py loads the exported dir exactly): ~10-100 s per prompt here.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "data"))

import bpe  # noqa: E402

OPENER = "\n\n<\uff5cDSML\uff5c calls>\n<\uff5cDSML\uff5c invoke name=\""


def name_span(tok, ids, name):
    """Token positions of `name` in the first '{"name": "NAME"' of the rendered ids."""
    raw = b"".join(tok.id_to_bytes[i] for i in ids)
    b = raw.find(('{"name": "%s"' % name).encode())
    if b < 0:
        raise ValueError("expected tool %r not in the schema block" % name)
    b += len('{"name": "')
    e = b + len(name.encode())
    span, acc = [], 0
    for j, i in enumerate(ids):
        n = len(tok.id_to_bytes[i])
        if acc + n > b and acc < e:
            span.append(j)
        acc += n
    return span


def distances(items, tok):
    out = {False: [], True: []}
    for e in items:
        ref = e["reference_completion"]
        k = ref.find('invoke name="') + len('invoke name="')
        T = len(e["prompt_ids"]) + len(tok.encode(ref[:k]))
        out[e["thinking"]].append(T - name_span(tok, e["prompt_ids"], e["expected_tool"])[0])
    for t in (False, True):
        d = sorted(out[t])
        print("thinking %s: %d prompts, median distance %d tokens, within 128: %d, within 256: %d"
              % ("on" if t else "off", len(d), d[len(d) // 2], sum(x <= 128 for x in d), sum(x <= 256 for x in d)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-n", type=int, default=5)
    ap.add_argument("--eval", default=os.path.join(HERE, "out", "data", "agent_eval.jsonl"))
    ap.add_argument("--distances-only", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with open(args.eval, encoding="utf-8") as f:
        items = [json.loads(l) for l in f]
    if args.distances_only:
        distances(items, bpe.Tokenizer(os.path.join(HERE, "..", "assets", "dsx-small-v41", "tokenizer.json")))
        return
    if not args.model:
        ap.error("MODEL_DIR is needed unless --distances-only")
    import torch
    import model as M
    import st
    torch.set_num_threads(args.threads)
    cmap = st.read_safetensors(os.path.join(args.model, "engram_cmap.safetensors"))[0]["cmap"]
    m = M.V41Model.from_pretrained(args.model, cmap=cmap, device="cpu").eval()
    ratios = m.cfg.raw["text_config"]["compress_ratios"]
    tok = bpe.Tokenizer(os.path.join(args.model, "tokenizer.json"))
    items = [e for e in items if not e["thinking"] and e["reference_completion"].startswith(OPENER[:-len(' invoke name="')])]
    for e in items[:args.n]:
        ids = e["prompt_ids"] + tok.encode(OPENER)
        span = name_span(tok, e["prompt_ids"], e["expected_tool"])
        dbg = {}
        with torch.no_grad():
            p = torch.softmax(m(torch.tensor([ids]), debug=dbg)[0, -1].float(), -1)
        T = len(ids)
        sel = {}
        for k, v in sorted(dbg.items()):
            if k.startswith("sparse_topk.layer"):
                L = int(k[len("sparse_topk.layer"):])
                picked = {int(x) for x in v[0, T - 1] if x >= 0}
                rows = {j // ratios[L] for j in span}
                sel[L] = "%d/%d" % (len(rows & picked), len(rows))
        first = tok.encode(e["expected_tool"] + '"')[0]
        top = torch.topk(p, 3)
        print(json.dumps({"expected": e["expected_tool"], "dist": T - span[0], "p_first": round(float(p[first]), 3),
                          "name_rows_selected": sel,
                          "top": [(tok.decode([int(i)]), round(float(v), 3)) for v, i in zip(top.values, top.indices)]}),
              flush=True)


if __name__ == "__main__":
    main()
