#!/bin/bash
# Rebuilds everything under train/out/ for the small trained model (issue 24, part D):
# the corpus + manifest, the tokenizer, the synthetic agent conversations, the token files.
# Deterministic: the same machine gives the same bytes. Usage: train/data/build_all.sh
# (env DSX=path/to/dsx to use another dsx build; default build-cpu/dsx).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=/usr/bin/python3
OUT=train/out
SRC_DSX=${DSX:-build-cpu/dsx}
[ -x "$SRC_DSX" ] || { echo "build_all.sh: $SRC_DSX not found (build dsx first)" >&2; exit 1; }
start=$(date +%s)
step() { echo; echo "== $* ($(( $(date +%s) - start )) s)"; }

rm -rf "$OUT/data" "$OUT/tokenizer.json" "$OUT/tokenizer_info.json" "$OUT/bin"
mkdir -p "$OUT/bin"
# A private copy, so that a rebuild of build-cpu/ during the run cannot change or break it.
cp "$SRC_DSX" "$OUT/bin/dsx"
export DSX="$PWD/$OUT/bin/dsx"
"$DSX" render --help > /dev/null
echo "dsx: $SRC_DSX (sha256 $(sha256sum "$DSX" | cut -c1-16))"
step "1/5 corpus"
nice $PY train/data/build_corpus.py
step "2/5 agent conversations as text (tokenizer sample)"
nice $PY train/data/synth_agents.py --sample-text
step "3/5 tokenizer"
nice $PY train/data/train_tokenizer.py
step "4/5 agent conversations rendered to ids, held-out agent prompts"
nice $PY train/data/synth_agents.py
step "5/5 token files"
nice $PY train/data/build_tokens.py

step "sizes"
ls -l "$OUT/tokenizer.json" "$OUT"/data/*.bin "$OUT"/data/*.json "$OUT"/data/*.jsonl "$OUT"/data/heldout_code.txt | awk '{printf "%12d  %s\n", $5, $9}'
du -sh "$OUT/data/heldout_code" | awk '{print "heldout_code/: " $1}'
$PY - <<'PY'
import json
t = json.load(open("train/out/data/tokens.json"))
for s in ("train", "val"):
    print(f"{s}.bin: {t[s]['tokens']} tokens, {t[s]['documents']} documents; " +
          ", ".join(f"{k} {v['tokens']} ({v['fraction'] * 100:.1f} %)" for k, v in sorted(t[s]["kinds"].items())))
i = json.load(open("train/out/tokenizer_info.json"))
print(f"tokenizer: size {i['size']}, {i['merges']} merges, BOS {i['ids']['<｜begin▁of▁sentence｜>']}, EOS {i['ids']['<｜end▁of▁sentence｜>']}")
PY
echo "build_all.sh: done in $(( $(date +%s) - start )) s"
