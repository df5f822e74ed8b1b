#!/usr/bin/env bash
# Runs on a GPU machine: `dsx serve` on the synthetic release-shaped model, measured from
# the outside by tools/serve_bench.py (time to first token and decode tokens/s at several
# client counts, prefix reuse of an 8k-token conversation), plus the server's /metrics.
#   bash scripts/gpu-serve.sh OUT_DIR DSX TOKENIZER_JSON [LAYERS]
# Environment: DSX_SERVE_ARGS (extra `dsx serve` options), DSX_SERVE_BENCH_ARGS (extra
# serve_bench.py options). The dsx given must have the HTTP server (a build without
# DSX_STATIC_DEPS; its shared libraries on LD_LIBRARY_PATH where the machine lacks them).
set -uo pipefail
out=${1:?usage: gpu-serve.sh OUT_DIR DSX TOKENIZER_JSON [LAYERS]}
dsx=${2:?dsx binary}
tokenizer=${3:?tokenizer.json}
layers=${4:-8}
port=${DSX_SERVE_PORT:-8093}
mkdir -p "$out"
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
exit "$rc"
