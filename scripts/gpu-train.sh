#!/usr/bin/env bash
# Trains the embedded default model on a GPU machine (issue 24), in phases that fit
# device calls of at most 10 minutes on one machine kept warm between them:
#   bash scripts/gpu-train.sh target OUT   unpack, start the target training in the
#                                          background (setsid), follow it ~9 minutes
#   bash scripts/gpu-train.sh wait OUT     follow it until it ends (or ~9 minutes)
#   bash scripts/gpu-train.sh dspark OUT   the 3 DSpark stages on the frozen target,
#                                          the final model, CUDA checks, files into OUT
# Inputs (carried): train/out/gpu_bundle.tar.xz (train/data/build_all.sh),
# train/out/engram_cmap.safetensors (dsx engram-cmap), .device/gpubin.tar.xz (the
# CUDA build's dsx). Environment: DSX_TRAIN_MINUTES (target, default 7),
# DSX_DSPARK_MINUTES (default 2.5), DSX_TRAIN_BATCH (default 32).
set -uo pipefail
phase=${1:?usage: gpu-train.sh target|wait|dspark OUT}
out=${2:?usage: gpu-train.sh target|wait|dspark OUT}
export PYTHONUNBUFFERED=1
T=train/out
follow() {  # $1 = pid file, $2 = log, $3 = seconds
  local t0=$SECONDS
  while kill -0 "$(cat "$1")" 2>/dev/null && [ $((SECONDS - t0)) -lt "$3" ]; do
    sleep 15
    tail -n 1 "$2"
  done
  if kill -0 "$(cat "$1")" 2>/dev/null; then echo "== still running"; else echo "== ended"; tail -n 30 "$2"; fi
}
case $phase in
  target)
    mkdir -p /tmp/g && tar -xJf .device/gpubin.tar.xz -C /tmp/g || exit 1
    tar -xJf $T/gpu_bundle.tar.xz -C $T || exit 1
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"
    setsid nohup python3 -u train/train_target.py --device cuda --cmap $T/engram_cmap.safetensors \
      --max-minutes "${DSX_TRAIN_MINUTES:-7}" --steps 1000000 --batch "${DSX_TRAIN_BATCH:-32}" --seq 1024 \
      --out $T/target >$T/target.log 2>&1 < /dev/null &
    echo $! >$T/target.pid
    follow $T/target.pid $T/target.log 540
    ;;
  wait)
    follow $T/target.pid $T/target.log 560
    ;;
  dspark)
    mkdir -p "$out"
    cp $T/target.log "$out/target.log"
    [ -f $T/target/model/model.safetensors ] || { echo "no target export"; exit 1; }
    python3 -u train/train_dspark.py --target $T/target/model --data $T/data --cmap $T/engram_cmap.safetensors \
      --device cuda --max-minutes "${DSX_DSPARK_MINUTES:-2.5}" --out $T/dspark 2>&1 | tee "$out/dspark.log" | grep -v '^{"step"' | tail -n 40
    m=$(find $T/dspark -name config.json -path '*model*' | head -1); m=${m%/config.json}
    [ -n "$m" ] || { echo "no DSpark export"; exit 1; }
    echo "final model: $m"; ls -la "$m"
    for p in fp32 bf16; do
      echo "== perplexity, held-out code, cuda $p"
      /tmp/g/gpubin/dsx perplexity -m "$m" -f $T/data/heldout_code.txt --ctx 1024 --backend cuda --precision $p --quiet 2>&1 | tee "$out/ppl_$p.txt"
    done
    echo "== DSpark acceptance at T = 0, held-out code (PyTorch target and drafter)"
    timeout 150 python3 -u train/eval_dspark.py --model "$m" --text $T/data/heldout_code.txt --device cuda \
      --prompts 32 --prompt-len 256 --gen-len 128 --json "$out/eval_dspark.json" 2>&1 | tail -n 25
    (cd "$m" && tar -cf - . | xz -T8 -6 | split -b 15m - "$out/model.tar.xz.")
    cp $T/target/summary.json "$out/target_summary.json" 2>/dev/null
    ls -la "$out"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
