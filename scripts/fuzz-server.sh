#!/usr/bin/env bash
# Fuzzes the server's request handling under ASan/UBSan (tests/test_server_fuzz.cpp):
# DSX_FUZZ_ITERS mutated bodies per endpoint (default 100000) through each adapter's parse,
# the renderer and the tokenizer, and the adapters' Sinks. Exits with the test run's status.
#
#   scripts/fuzz-server.sh                      # configure + build build-asan, then fuzz
#   DSX_FUZZ_SEED=123 DSX_FUZZ_ITERS=20000 scripts/fuzz-server.sh
#   DSX_BUILD_JOBS=8 scripts/fuzz-server.sh     # build parallelism (default: nproc)
#
# A failing body is saved under /tmp (DSX_FUZZ_DIR); a crash or sanitizer report leaves the
# body it was processing in $DSX_FUZZ_DIR/dsx-server-fuzz-crash.json.
set -euo pipefail
cd "$(dirname "$0")/.."

build=build-asan
jobs=${DSX_BUILD_JOBS:-$(nproc)}

cmake -S . -B "$build" -DDSX_CUDA=OFF -DDSX_SANITIZE=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$build" -j"$jobs" --target dsx_tests

export DSX_FUZZ_ITERS=${DSX_FUZZ_ITERS:-100000}
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
echo "fuzz-server: DSX_FUZZ_ITERS=$DSX_FUZZ_ITERS DSX_FUZZ_SEED=${DSX_FUZZ_SEED:-(default)}" \
     "ASAN_OPTIONS=$ASAN_OPTIONS UBSAN_OPTIONS=$UBSAN_OPTIONS"

start=$(date +%s)
rc=0
"$build/dsx_tests" --gtest_filter='ServerFuzz.*' || rc=$?
echo "fuzz-server: exit status $rc after $(( $(date +%s) - start )) s"
exit "$rc"
