#!/usr/bin/env bash
# Runs on a GPU machine in one call: the GPU tests, the golden cases on the GPU and
# the benchmark, writing a summary and the raw outputs to the folder given.
#   bash scripts/gpu-run.sh OUT_DIR [BUILD_DIR] [GOLDEN_DIR]
# Environment: DSX_BENCH_ARGS (the benchmark; none: no benchmark), DSX_BASE_BUILD (a
# folder with the dsx of another build: the benchmark then runs interleaved, base and
# this build, DSX_AB_ROUNDS times, default 2), DSX_ROWS_ARGS (a `dsx bench` of step
# time by row count, e.g. "--synthetic v41-flash --layers 8 --precision bf16
# --frontiers 8k --rows 1,2,4,6,8,16 --batch").
# The build directory is made on the development machine with
#   cmake -S . -B build-gpu -DDSX_STATIC_DEPS=ON && cmake --build build-gpu
# (third-party libraries and libstdc++ linked statically) and carried along.
set -uo pipefail
out=${1:?usage: gpu-run.sh OUT_DIR [BUILD_DIR] [GOLDEN_DIR]}
build=${2:-build-gpu}
golden=${3:-shared/golden}
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
log() { echo "$*" | tee -a "$summary"; }

log "# dsx GPU run $(date -u +%Y-%m-%dT%H:%M:%SZ)"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader 2>&1 | tee -a "$summary"
export DSX_GOLDEN_DIR="$golden"
export DSX_BUILD_DIR="$build"
export DSX_SOURCE_DIR="${DSX_SOURCE_DIR:-$PWD}"  # the tests' assets in this copy of the tree

log "## GPU kernel tests"
"$build/dsx_tests" --gtest_filter='*Cuda*:*/cuda' >"$out/gpu_tests.log" 2>&1
log "exit $? ; $(grep -E '^\[  (PASSED|FAILED)  \]' "$out/gpu_tests.log" | tr '\n' ' ')"
grep -E '^\[  FAILED  \]' "$out/gpu_tests.log" | head -40 | tee -a "$summary"

if [ -x "$build/bench_cuda_kernels" ]; then
  log "## kernel micro-benchmark"
  "$build/bench_cuda_kernels" ${DSX_KERNEL_BENCH_ARGS:-} --csv "$out/kernels.csv" >"$out/kernels.log" 2>&1
  log "exit $?"
  tail -n 60 "$out/kernels.log" >>"$summary"
fi

for case in "$golden"/deepseek_v41*; do
  [ -f "$case/golden.safetensors" ] || continue
  for prec in fp32 bf16; do
    log "## golden $(basename "$case") on cuda, precision $prec"
    "$build/dsx" golden "$case" --backend cuda --precision "$prec" >>"$summary" 2>&1
    log "exit $?"
  done
done

if [ -n "${DSX_BENCH_ARGS:-}" ]; then
  if [ -n "${DSX_BASE_BUILD:-}" ]; then
    for r in $(seq 1 "${DSX_AB_ROUNDS:-2}"); do
      for b in base new; do
        bin="$build/dsx"; [ "$b" = base ] && bin="$DSX_BASE_BUILD/dsx"
        log "## A/B round $r: $b: dsx bench $DSX_BENCH_ARGS"
        # shellcheck disable=SC2086
        "$bin" bench $DSX_BENCH_ARGS >"$out/ab_${b}_$r.log" 2>&1
        log "exit $?"
        grep -E "^context|copy bandwidth" "$out/ab_${b}_$r.log" | tee -a "$summary"
      done
    done
  else
    log "## dsx bench $DSX_BENCH_ARGS"
    # shellcheck disable=SC2086
    "$build/dsx" bench $DSX_BENCH_ARGS --csv "$out/bench.csv" --svg "$out/bench.svg" >"$out/bench.log" 2>&1
    log "exit $?"
    cat "$out/bench.log" >>"$summary"
  fi
fi
if [ -n "${DSX_ROWS_ARGS:-}" ]; then
  log "## dsx bench $DSX_ROWS_ARGS"
  # shellcheck disable=SC2086
  "$build/dsx" bench $DSX_ROWS_ARGS >"$out/rows.log" 2>&1
  log "exit $?"
  grep -E "^rows|^sessions|^context|copy bandwidth" "$out/rows.log" | tee -a "$summary"
fi
log "# done"
