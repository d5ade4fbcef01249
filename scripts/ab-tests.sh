#!/usr/bin/env bash
# A/B of GPU tests across source trees, in one device call: builds each tree's GPU test suite
# (in parallel), runs each tree's MOK_AB_CHECK tests once (a gtest filter, e.g. `Fp8*`: the
# bits), then the timed tests (the filter after `--`) in rounds, the trees taking turns, and
# keeps the lines that carry numbers. For a kernel change that the rate tests time alone (the
# FP8 GEMMs' `Fp8GemmGpu.EveryFormsRateAtDsv3Shapes`), where `scripts/ab-bench.sh` times the
# whole layer.
#
#   scripts/ab-tests.sh TREE... -- GTEST_FILTER
#
# A TREE is `.` or an old commit exported with `scripts/ab-bench.sh --export REV` (.ab/REV,
# carried to the device). GoogleTest comes from this tree's .deps/googletest
# (scripts/fetch-gtest.sh; carry it). Rounds: MOK_AB_ROUNDS (default 3). Lines kept:
# MOK_AB_GREP (default: TFLOP/s, ms and the test results). $OUT/abt.log gets the checks' results
# and every round's lines (the device tool returns few files: the whole logs stay in
# ${TMPDIR:-/tmp}/mok-abt). Exits non-zero if any test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
trees=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  trees+=("$1")
  shift
done
[ "${1:-}" = -- ] && shift
filter="${1:-}"
if [ ${#trees[@]} -eq 0 ] || [ -z "$filter" ]; then
  echo "usage: scripts/ab-tests.sh TREE... -- GTEST_FILTER" >&2
  exit 2
fi
gtest="$root/.deps/googletest"
if [ ! -d "$gtest" ]; then
  echo "GoogleTest sources not found at $gtest: run scripts/fetch-gtest.sh and carry .deps/googletest" >&2
  exit 2
fi
OUT="${OUT:-$root/out}"
work="${TMPDIR:-/tmp}/mok-abt"
mkdir -p "$OUT" "$work"
summary="$OUT/abt.log"
: >"$summary"
export PATH="$PATH:/usr/local/cuda/bin"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
jobs_each=$(($(nproc) / ${#trees[@]}))
[ "$jobs_each" -ge 1 ] || jobs_each=1
name_of() { basename "$(cd "$1" && pwd)"; }
pids=()
for tree in "${trees[@]}"; do
  (
    cd "$tree"
    cmake -S . -B build-abt -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_GTEST_SOURCE_DIR="$gtest" >/dev/null
    cmake --build build-abt --target mok_gpu_tests -j "$jobs_each" >/dev/null
  ) >"$work/build-$(name_of "$tree").log" 2>&1 &
  pids+=($!)
done
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "build of ${trees[$i]} failed:" >&2
    tail -n 30 "$work/build-$(name_of "${trees[$i]}").log" >&2
    exit 1
  fi
done
status=0
if [ -n "${MOK_AB_CHECK:-}" ]; then
  for tree in "${trees[@]}"; do
    log="$work/check-$(name_of "$tree").log"
    "$tree/build-abt/mok_gpu_tests" --gtest_filter="$MOK_AB_CHECK" >"$log" 2>&1 || status=1
    {
      echo "== $(name_of "$tree"): $MOK_AB_CHECK"
      grep -E '^\[  (PASSED|FAILED) |tests? from .* ran|^\[  FAILED  \] ' "$log" || tail -n 5 "$log"
    } | tee -a "$summary"
  done
fi
pattern="${MOK_AB_GREP:-TFLOP/s| ms|^\[ +(OK|FAILED) +\]}"
# Each round starts at the next tree, so that no tree always runs first on a cooler card.
for round in $(seq 1 "${MOK_AB_ROUNDS:-3}"); do
  for offset in "${!trees[@]}"; do
    tree="${trees[$(((offset + round - 1) % ${#trees[@]}))]}"
    log="$work/$(name_of "$tree")-$round.log"
    "$tree/build-abt/mok_gpu_tests" --gtest_filter="$filter" >"$log" 2>&1 || status=1
    {
      echo "== $(name_of "$tree"), round $round"
      grep -E "$pattern" "$log" || tail -n 5 "$log"
    } | tee -a "$summary"
  done
done
exit $status
