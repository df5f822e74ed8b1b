#!/usr/bin/env bash
# Runs the official SDKs (tests/sdk/sdk_test.mjs) against `dsx serve` on a tiny model.
#   bash tests/sdk/run.sh BUILD_DIR
# Exits 77 (ctest: skipped) when node or the SDK packages are missing (npm unreachable);
# installs them when npm is there.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${1:?usage: run.sh BUILD_DIR}
command -v node >/dev/null || { echo "skip: node not found"; exit 77; }
if [ ! -d "$here/node_modules/openai" ] || [ ! -d "$here/node_modules/@anthropic-ai/sdk" ]; then
  (cd "$here" && timeout 300 npm install --no-audit --no-fund --silent) >/dev/null 2>&1 ||
    { echo "skip: the SDK packages could not be installed from npm"; exit 77; }
fi
golden=${DSX_GOLDEN_DIR:-$here/../../../shared/golden}
model="$build/test_tmp/sdk_model"
if [ ! -f "$model/model.safetensors" ]; then
  tok="$golden/tokenizer/tokenizer-v41.json"
  [ -f "$tok" ] || { echo "skip: no V4.1 test tokenizer at $tok"; exit 77; }
  "$build/dsx" make-tiny -o "$model" --tokenizer "$tok" >/dev/null || exit 1
fi
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' 2>/dev/null || echo 18089)
"$build/dsx" serve -m "$model" --port "$port" --ctx 8192 --sessions 2 --quiet &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null' EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { echo "dsx serve exited"; exit 1; }
  sleep 0.1
done
DSX_URL="http://127.0.0.1:$port" node "$here/sdk_test.mjs"
