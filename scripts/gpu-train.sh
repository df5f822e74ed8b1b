#!/usr/bin/env bash
# Trains the embedded default model on a GPU machine (issue 24), in phases that fit
# device calls of at most 10 minutes on one machine kept warm between them:
#   bash scripts/gpu-train.sh target OUT   unpack, start the target training in the
#                                          background (setsid), follow it ~9 minutes
#   bash scripts/gpu-train.sh wait OUT     follow it until it ends (or ~9 minutes)
#   bash scripts/gpu-train.sh dspark OUT   the 3 DSpark stages on the frozen target,
#                                          the final model, CUDA checks, files into OUT
#   bash scripts/gpu-train.sh finetune OUT the tool-call fine-tune of the committed model
#                                          (train/data/synth_finetune.py data; its DSpark
#                                          stages carried, optionally continued), CUDA checks:
#                                          started in the background, followed ~9 minutes;
#                                          the model (packed before the checks) and the logs
#                                          so far into OUT
#   bash scripts/gpu-train.sh ft-wait OUT  follow it again (~9 minutes), the model into OUT
# Inputs (carried): train/out/gpu_bundle.tar.xz (train/data/build_all.sh),
# train/out/engram_cmap.safetensors (dsx engram-cmap), .device/gpubin.tar.xz (the
# CUDA build's dsx). Environment: DSX_TRAIN_MINUTES (target, default 7),
# DSX_DSPARK_MINUTES (default 2.5), DSX_TRAIN_BATCH (default 32). finetune: inputs
# .device/ft_bundle.tar.xz (data/ft/ of synth_finetune.py, data/heldout_code.txt,
# data/agent_eval.jsonl, data/chat_eval.jsonl, unpacked under train/out) and .device/gpubin.tar.xz; the start
# model DSX_FT_INIT (default assets/dsx-small-v41); DSX_FT_MINUTES (default 4),
# DSX_FT_LR (default 8e-4), DSX_FT_WEIGHTS (class weights, default 1,1,3,12),
# DSX_FT_DENSE (dense compressed attention for this fraction of the fine-tune, default 0.3:
# the copies from the schema need gradients through rows the indexer does not pick yet),
# DSX_FT_WINDOW (a new sliding_window for the fine-tuned model; default the start model's),
# DSX_DSPARK_MINUTES (default 0 here: the carried stages as they are), DSX_EVAL_PROMPTS (200).
set -uo pipefail
phase=${1:?usage: gpu-train.sh target|wait|dspark|finetune|ft-wait OUT}
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
ft_collect() {  # what the fine-tune job has written so far (the model as soon as it is exported), its logs
  cp $T/ft_out/model.tar.xz.* "$1"/ 2>/dev/null
  cp $T/ft_job.log "$1"/
  [ -d $T/ft_logs ] && tar -C $T/ft_logs -cJf "$1/logs.tar.xz" .
  ls -la "$1"
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
  finetune)  # the job below in the background; follow it ~9 minutes, its files into OUT when it ended
    mkdir -p "$out" $T && rm -rf $T/ft_out $T/ft_logs
    setsid nohup bash scripts/gpu-train.sh ft-job $T/ft_out >$T/ft_job.log 2>&1 < /dev/null &
    echo $! >$T/ft_job.pid
    follow $T/ft_job.pid $T/ft_job.log "${DSX_FOLLOW_S:-540}"
    ft_collect "$out"
    ;;
  ft-wait)
    mkdir -p "$out"
    follow $T/ft_job.pid $T/ft_job.log "${DSX_FOLLOW_S:-560}"
    ft_collect "$out"
    ;;
  ft-job)
    mkdir -p "$out" /tmp/g $T && out=$(cd "$out" && pwd) && tar -xJf .device/gpubin.tar.xz -C /tmp/g || exit 1
    export LD_LIBRARY_PATH=/tmp/g/gpubin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    tar -xJf .device/ft_bundle.tar.xz -C $T || exit 1
    init=${DSX_FT_INIT:-assets/dsx-small-v41}
    L=$T/ft_logs; mkdir -p $L
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    echo "== fine-tune from $init"
    python3 -u train/train_target.py --device cuda --init "$init" --cmap "$init/engram_cmap.safetensors" \
      --tokenizer "$init/tokenizer.json" --data-dir $T/data/ft --token-classes $T/data/ft/train.classes.bin \
      --class-weights "${DSX_FT_WEIGHTS:-1,1,3,12}" --lr "${DSX_FT_LR:-8e-4}" --warmup-frac 0.05 --min-lr-frac 0.1 \
      --max-minutes "${DSX_FT_MINUTES:-3}" --steps 1000000 --batch "${DSX_TRAIN_BATCH:-32}" --seq 1024 \
      --dense-warmup-frac "${DSX_FT_DENSE:-0.3}" ${DSX_FT_WINDOW:+--window "$DSX_FT_WINDOW"} --engine-windows 0 \
      --out $T/ft_target >$L/ft_target.log 2>&1
    grep -v '^{"step"' $L/ft_target.log | grep -v Warning | tail -n 3; grep '^{"step"' $L/ft_target.log | awk 'NR % 10 == 1' | cut -c1-120
    cp $T/ft_target/summary.json $L/ft_target_summary.json
    m=$T/ft_target/model
    [ -f $m/model.safetensors ] || { echo "no fine-tune export"; exit 1; }
    if [ "${DSX_DSPARK_MINUTES:-0}" != 0 ]; then  # continue the carried stages on the new target
      python3 -u train/train_dspark.py --target $m --init checkpoint --data $T/data/ft \
        --cmap "$init/engram_cmap.safetensors" --device cuda --max-minutes "$DSX_DSPARK_MINUTES" --lr 7e-4 \
        --warmup 20 --out $T/ft_dspark >$L/dspark.log 2>&1; tail -n 3 $L/dspark.log
      m=$T/ft_dspark/model
    fi
    (cd "$m" && tar -cf - . | xz -T16 -6 | split -b 16m - "$out/model.tar.xz.")  # first, so a cut-off keeps it
    echo "== greedy tool calls (${DSX_EVAL_PROMPTS:-200} held-out prompts, CUDA bf16, 8 shards), DSpark acceptance, perplexity"
    for k in 0 1 2 3 4 5 6 7; do
      python3 -u train/data/eval_agents.py -m $m --dsx /tmp/g/gpubin/dsx --backend cuda --precision bf16 \
        --limit "${DSX_EVAL_PROMPTS:-200}" --shard $k/8 --out $L/eval_agents_$k.jsonl >$L/eval_agents_$k.txt 2>&1 &
    done
    for p in fp32 bf16; do
      /tmp/g/gpubin/dsx perplexity -m "$m" -f $T/data/heldout_code.txt --ctx 1024 --backend cuda --precision $p \
        --quiet >$L/ppl_$p.txt 2>&1; echo "$p: $(tr '\n' ' ' <$L/ppl_$p.txt)"
    done
    /tmp/g/gpubin/dsx perplexity -m "$init" -f $T/data/heldout_code.txt --ctx 1024 --backend cuda --precision fp32 \
      --quiet >$L/ppl_init_fp32.txt 2>&1; echo "init fp32: $(tr '\n' ' ' <$L/ppl_init_fp32.txt)"
    wait  # (eval_dspark.py beside the 8 shards got too little of the GPU to finish in 70 s)
    if [ -f $T/data/chat_eval.jsonl ]; then  # no tools offered: a text answer, no DSML call
      for k in 0 1 2 3; do
        python3 -u train/data/eval_agents.py -m $m --eval $T/data/chat_eval.jsonl --dsx /tmp/g/gpubin/dsx \
          --backend cuda --precision bf16 --shard $k/4 --out $L/eval_chats_$k.jsonl >$L/eval_chats_$k.txt 2>&1 &
      done
      wait
      python3 -c 'import glob, json, sys; r = [json.loads(l) for f in glob.glob(sys.argv[1] + "/eval_chats_*.jsonl") for l in open(f)]; print("held-out chats without tools answered in text: %d/%d" % (sum(x["ok"] for x in r), len(r)))' "$L"
    fi
    echo "== the README demo prompt (CUDA bf16, greedy)"
    /tmp/g/gpubin/dsx run -m "$m" -p "Complete this Python function: def fib(n):" -n 120 --backend cuda --precision bf16 \
      >$L/demo.txt 2>&1; head -n 12 $L/demo.txt
    timeout "${DSX_EVAL_DSPARK_S:-90}" python3 -u train/eval_dspark.py --model "$m" --text $T/data/heldout_code.txt \
      --device cuda --prompts 32 --prompt-len 256 --gen-len 128 --json $L/eval_dspark.json >$L/eval_dspark.txt 2>&1
    tail -n 4 $L/eval_dspark.txt
    python3 - "$L" <<'PY'
import glob, json, sys
r = [json.loads(l) for f in sorted(glob.glob(sys.argv[1] + "/eval_agents_*.jsonl")) for l in open(f)]
n, ok = len(r), sum(x["ok"] for x in r)
print("tool_call_valid %d/%d; first 100: %d/100; first call names the expected tool %d/%d" % (
    ok, n, sum(x["ok"] for x in r if x["index"] < 100), sum(x["first_tool_matches"] for x in r), n))
for t in (False, True):
    s = [x for x in r if x["thinking"] == t]
    print("  thinking=%s: %d/%d" % ("on" if t else "off", sum(x["ok"] for x in s), len(s)))
PY
    echo "== ft-job done"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
