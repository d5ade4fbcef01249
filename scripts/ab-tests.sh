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
. scripts/ab-trees.sh
ab_parse_trees "scripts/ab-tests.sh TREE... -- GTEST_FILTER" "$@"
filter="${ab_args[0]:-}"
if [ -z "$filter" ]; then
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
. scripts/gpu-env.sh
ab_build_trees build-abt "$work/build-" mok_gpu_tests -DMOK_GTEST_SOURCE_DIR="$gtest"
status=0
# run_tests TREE FILTER LOG TITLE PATTERN: TREE's GPU tests of FILTER into LOG, then TITLE and
# LOG's lines matching PATTERN (its tail if none) into the summary.
run_tests() {
  "$1/build-abt/mok_gpu_tests" --gtest_filter="$2" >"$3" 2>&1 || status=1
  {
    echo "== $4"
    grep -E "$5" "$3" || tail -n 5 "$3"
  } | tee -a "$summary"
}
if [ -n "${MOK_AB_CHECK:-}" ]; then
  for tree in "${trees[@]}"; do
    run_tests "$tree" "$MOK_AB_CHECK" "$work/check-$(ab_tree_name "$tree").log" \
      "$(ab_tree_name "$tree"): $MOK_AB_CHECK" '^\[  (PASSED|FAILED) |tests? from .* ran'
  done
fi
pattern="${MOK_AB_GREP:-TFLOP/s| ms|^\[ +(OK|FAILED) +\]}"
# Each round starts at the next tree, so that no tree always runs first on a cooler card.
for round in $(seq 1 "${MOK_AB_ROUNDS:-3}"); do
  for offset in "${!trees[@]}"; do
    tree="${trees[$(((offset + round - 1) % ${#trees[@]}))]}"
    name="$(ab_tree_name "$tree")"
    run_tests "$tree" "$filter" "$work/$name-$round.log" "$name, round $round" "$pattern"
  done
done
exit $status
