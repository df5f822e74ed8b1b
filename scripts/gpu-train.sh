#!/usr/bin/env bash
# Trains the embedded default model on a GPU machine (issue 24), in phases that fit
# device calls of at most 10 minutes on one machine kept warm between them:
#   bash scripts/gpu-train.sh target OUT   unpack, start the target training in the
#                                          background (setsid), follow it ~9 minutes
#   bash scripts/gpu-train.sh wait OUT     follow it until it ends (or ~9 minutes)
#   bash scripts/gpu-train.sh dspark OUT   the 3 DSpark stages on the frozen target,
#                                          the final model, CUDA checks, files into OUT
#   bash scripts/gpu-train.sh finetune OUT one call (~9 minutes): the tool-call fine-tune of
#                                          the committed model (train/data/synth_finetune.py
#                                          data), its DSpark stages continued on the new
#                                          target, CUDA checks, the model into OUT
# Inputs (carried): train/out/gpu_bundle.tar.xz (train/data/build_all.sh),
# train/out/engram_cmap.safetensors (dsx engram-cmap), .device/gpubin.tar.xz (the
# CUDA build's dsx). Environment: DSX_TRAIN_MINUTES (target, default 7),
# DSX_DSPARK_MINUTES (default 2.5), DSX_TRAIN_BATCH (default 32). finetune: inputs
# .device/ft_bundle.tar.xz (data/ft/ of synth_finetune.py, data/heldout_code.txt,
# data/agent_eval.jsonl, unpacked under train/out) and .device/gpubin.tar.xz; the start
# model DSX_FT_INIT (default assets/dsx-small-v41); DSX_FT_MINUTES (default 4),
# DSX_FT_LR (default 6e-4), DSX_FT_WEIGHTS (class weights, default 1,1,2,5),
# DSX_DSPARK_MINUTES (default 2 here).
set -uo pipefail
phase=${1:?usage: gpu-train.sh target|wait|dspark|finetune OUT}
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
  finetune)
    mkdir -p "$out" /tmp/g && tar -xJf .device/gpubin.tar.xz -C /tmp/g || exit 1
    export LD_LIBRARY_PATH=/tmp/g/gpubin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    tar -xJf .device/ft_bundle.tar.xz -C $T || exit 1
    init=${DSX_FT_INIT:-assets/dsx-small-v41}
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "== fine-tune from $init"
    python3 -u train/train_target.py --device cuda --init "$init" --cmap "$init/engram_cmap.safetensors" \
      --tokenizer "$init/tokenizer.json" --data-dir $T/data/ft --token-classes $T/data/ft/train.classes.bin \
      --class-weights "${DSX_FT_WEIGHTS:-1,1,2,5}" --lr "${DSX_FT_LR:-6e-4}" --warmup-frac 0.05 --min-lr-frac 0.1 \
      --max-minutes "${DSX_FT_MINUTES:-4}" --steps 1000000 --batch "${DSX_TRAIN_BATCH:-32}" --seq 1024 \
      --engine-windows 0 --out $T/ft_target >"$out/ft_target.log" 2>&1
    grep -v '^{"step"' "$out/ft_target.log" | tail -n 5; grep '^{"step"' "$out/ft_target.log" | awk 'NR % 10 == 1' | cut -c1-200
    cp $T/ft_target/summary.json "$out/ft_target_summary.json"
    [ -f $T/ft_target/model/model.safetensors ] || { echo "no fine-tune export"; exit 1; }
    echo "== greedy tool calls of the fine-tuned target (100 held-out prompts, CUDA bf16), in the background"
    (python3 -u train/data/eval_agents.py -m $T/ft_target/model --dsx /tmp/g/gpubin/dsx --backend cuda \
      --precision bf16 --limit 100 --out "$out/eval_agents_target.jsonl" >"$out/eval_agents_target.txt" 2>&1 &)
    echo "== DSpark stages continued on the fine-tuned target"
    python3 -u train/train_dspark.py --target $T/ft_target/model --init checkpoint --data $T/data/ft \
      --cmap "$init/engram_cmap.safetensors" --device cuda --max-minutes "${DSX_DSPARK_MINUTES:-2}" --lr 7e-4 \
      --warmup 20 --out $T/ft_dspark 2>&1 | tee "$out/dspark.log" | grep -v '^{"step"' | tail -n 12
    m=$T/ft_dspark/model
    [ -f $m/model.safetensors ] || { echo "no DSpark export"; exit 1; }
    for p in fp32 bf16; do
      echo "== perplexity, held-out code, cuda $p"
      /tmp/g/gpubin/dsx perplexity -m "$m" -f $T/data/heldout_code.txt --ctx 1024 --backend cuda --precision $p --quiet 2>&1 | tee "$out/ppl_$p.txt"
    done
    echo "== DSpark acceptance at T = 0, held-out code"
    timeout "${DSX_EVAL_DSPARK_S:-75}" python3 -u train/eval_dspark.py --model "$m" --text $T/data/heldout_code.txt --device cuda \
      --prompts 32 --prompt-len 256 --gen-len 128 --json "$out/eval_dspark.json" 2>&1 | tail -n 12
    for i in $(seq 60); do pgrep -f "eval_agents.py -m $T/ft_target" >/dev/null || break; sleep 2; done
    tail -n 6 "$out/eval_agents_target.txt"
    (cd "$m" && tar -cf - . | xz -T8 -6 | split -b 15m - "$out/model.tar.xz.")
    cp $T/ft_dspark/summary.json "$out/dspark_summary.json" 2>/dev/null
    ls -la "$out"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
