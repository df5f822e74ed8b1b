#!/usr/bin/env bash
# Runs on a GPU machine: `dsx serve` on the synthetic release-shaped model, measured from
# the outside by tools/serve_bench.py (time to first token and decode tokens/s at several
# client counts, prefix reuse of an 8k-token conversation), plus the server's /metrics;
# then the disk KV cache across a restart: a server with --kv-cache prefills a long
# conversation's first turn and stops (saving its sessions), a new server answers the
# second turn from the restored state; the disk's sequential read bandwidth beside it.
#   bash scripts/gpu-serve.sh OUT_DIR DSX TOKENIZER_JSON [LAYERS]
# Environment: DSX_SERVE_ARGS (extra `dsx serve` options), DSX_SERVE_BENCH_ARGS (extra
# serve_bench.py options), DSX_SERVE_SKIP_LOAD=1 (only the restart phase). The dsx given must have the HTTP server (a build without
# DSX_STATIC_DEPS; its shared libraries on LD_LIBRARY_PATH where the machine lacks them).
set -uo pipefail
out=${1:?usage: gpu-serve.sh OUT_DIR DSX TOKENIZER_JSON [LAYERS]}
dsx=${2:?dsx binary}
tokenizer=${3:?tokenizer.json}
layers=${4:-8}
port=${DSX_SERVE_PORT:-8093}
mkdir -p "$out"
rc=0
if [ -z "${DSX_SERVE_SKIP_LOAD:-}" ]; then
# shellcheck disable=SC2086
"$dsx" serve --synthetic v41-flash --layers "$layers" --tokenizer "$tokenizer" --precision bf16 \
  --ctx 16384 --sessions 16 --port "$port" --no-kv-cache --thinking off --quiet ${DSX_SERVE_ARGS:-} \
  >"$out/serve.log" 2>&1 &
pid=$!
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.5
done
if ! curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1; then
  echo "the server did not come up:"; tail -20 "$out/serve.log"; kill "$pid" 2>/dev/null; exit 1
fi
# shellcheck disable=SC2086
python3 "$(dirname "$0")/../tools/serve_bench.py" --url "http://127.0.0.1:$port" --json "$out/serve_bench.json" \
  ${DSX_SERVE_BENCH_ARGS:-} 2>&1 | tee "$out/serve_bench.txt"
rc=${PIPESTATUS[0]}
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics.txt"
kill -TERM "$pid"
wait "$pid"
echo "serve_bench exit $rc; server exit $?"
tail -5 "$out/serve.log"
fi

# ---- the disk KV cache across a restart
kv=${DSX_KV_DIR:-$(mktemp -d)/kv}
start_server() {  # $1: log file
  # shellcheck disable=SC2086
  "$dsx" serve --synthetic v41-flash --layers "$layers" --tokenizer "$tokenizer" --precision bf16 \
    --ctx "$restart_ctx" --sessions 4 --port "$port" --kv-cache "$kv" --thinking off --quiet ${DSX_SERVE_ARGS:-} >"$1" 2>&1 &
  pid=$!
  for _ in $(seq 1 240); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  echo "the server did not come up:"; tail -20 "$1"; return 1
}
conv="$out/conversation.json"
tokens=${DSX_RESTART_TOKENS:-32768}
restart_ctx=$(( tokens + 16384 > 65536 ? tokens + 16384 : 65536 ))
start_server "$out/serve_kv1.log" || exit 1
python3 "$(dirname "$0")/../tools/serve_bench.py" --url "http://127.0.0.1:$port" --reuse-tokens "$tokens" \
  --max-tokens 32 --save-conversation "$conv" 2>&1 | tee -a "$out/serve_bench.txt"
kill -TERM "$pid"; wait "$pid"
# the restore reads from the disk, not from the page cache the saves left behind
sync
if ! { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null; then
  find "$kv" -type f -exec dd if={} iflag=nocache count=0 status=none \;
fi
start_server "$out/serve_kv2.log" || exit 1
python3 "$(dirname "$0")/../tools/serve_bench.py" --url "http://127.0.0.1:$port" --max-tokens 32 \
  --continue-conversation "$conv" --json "$out/restart.json" 2>&1 | tee -a "$out/serve_bench.txt"
curl -s "http://127.0.0.1:$port/metrics" >"$out/metrics_kv2.txt"
kill -TERM "$pid"; wait "$pid"
grep -E '^dsx_kv_cache_(restores|restored_bytes|restore_seconds|restored_tokens)_total' "$out/metrics_kv2.txt" \
  | tee -a "$out/serve_bench.txt"
du -sb "$kv" | tee -a "$out/serve_bench.txt"
# the disk under the cache: sequential read of a 2 GiB file, page cache bypassed
f="$kv/../readbw.bin"
dd if=/dev/urandom of="$f" bs=16M count=128 oflag=direct status=none 2>/dev/null || dd if=/dev/urandom of="$f" bs=16M count=128 status=none
sync
echo "disk read: $(dd if="$f" of=/dev/null bs=16M iflag=direct 2>&1 | tail -1)" | tee -a "$out/serve_bench.txt"
rm -f "$f"
exit "$rc"
