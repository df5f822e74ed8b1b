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

rm -rf "$OUT/data" "$OUT/tokenizer.json" "$OUT/tokenizer_info.json" "$OUT/bin" "$OUT/gpu_bundle.tar.xz"
mkdir -p "$OUT/bin"
# A private copy, so that a rebuild of build-cpu/ during the run cannot change or break it.
cp "$SRC_DSX" "$OUT/bin/dsx"
export DSX="$PWD/$OUT/bin/dsx"
"$DSX" render --help > /dev/null
echo "dsx: $SRC_DSX (sha256 $(sha256sum "$DSX" | cut -c1-16))"
step "1/6 corpus"
nice $PY train/data/build_corpus.py
step "2/6 agent conversations as text (tokenizer sample)"
nice $PY train/data/synth_agents.py --sample-text
step "3/6 tokenizer"
nice $PY train/data/train_tokenizer.py
step "4/6 agent conversations rendered to ids, held-out agent prompts"
nice $PY train/data/synth_agents.py
step "5/6 token files"
nice $PY train/data/build_tokens.py

step "6/6 bundle for the GPU machine (what the trainer and the checks read, xz)"
# The device copy carries at most 64 MiB; train.bin alone is about that, so ship this instead
# and unpack there: tar -xJf train/out/gpu_bundle.tar.xz -C train/out
tar -C "$OUT" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - \
    tokenizer.json tokenizer_info.json data/train.bin data/val.bin data/train.offsets.bin data/train.kinds.bin \
    data/val.offsets.bin data/val.kinds.bin data/tokens.json data/heldout_code.txt data/agent_eval.jsonl \
    data/manifest.json | xz -T2 -6 > "$OUT/gpu_bundle.tar.xz"

step "sizes"
ls -l "$OUT/gpu_bundle.tar.xz" "$OUT/tokenizer.json" "$OUT"/data/*.bin "$OUT"/data/*.json "$OUT"/data/*.jsonl "$OUT"/data/heldout_code.txt | awk '{printf "%12d  %s\n", $5, $9}'
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
