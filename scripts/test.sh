#!/usr/bin/env bash
# Builds dsx and runs the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)"
cd build && ctest --output-on-failure -j"$(nproc)"
cd ..
# The training code's PyTorch model and drafter against the goldens and the engine
# (train/tests; Debian's python3-torch, installed by setup-deps.sh).
if /usr/bin/python3 -c "import torch, numpy" 2>/dev/null; then
  DSX="$PWD/build/dsx" /usr/bin/python3 -m unittest discover -s train/tests
else
  echo "train/tests skipped: /usr/bin/python3 has no torch / numpy (apt-get install python3-torch python3-numpy)"
fi
