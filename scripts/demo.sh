#!/usr/bin/env bash
# The main job on the embedded default model, on a fresh machine: installs the build
# dependencies, builds dsx and chats with the project's trained V4.1 model
# (assets/dsx-small-v41, official format, DSpark stages: see its README.md).
#   bash scripts/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target dsx_cli
build/dsx run -m assets/dsx-small-v41 -p "${1:-Complete this Python function: def fib(n):}" -n 200 --stats
