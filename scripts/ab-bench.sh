#!/usr/bin/env bash
# A/B timing of `mok run` across source trees, in one device call: builds the `mok` CLI of each
# tree (in parallel) and runs them in turns, so that every version sees the same card and the
# same power state (METHOD.md: side by side, in one run).
#
#   scripts/ab-bench.sh TREE... -- MOK_RUN_ARGS...
#
# A TREE is a directory with mok's sources: `.` for the working tree, or an old commit exported
# on the development machine with `scripts/ab-bench.sh --export REV` (into .ab/REV, with any
# character but letters, digits, '.', '_' and '-' made '-'; git-ignored:
# carry it to the device with the run tool's `carry`). Rounds: MOK_AB_ROUNDS (default 2). A table
# of the lines matching MOK_AB_GREP (default: the forward / backward / weight-gradient lines,
# and the bf16 layer's `--compare KNOB` lines, which start with the knob's name)
# goes to $OUT/ab-<shape>.log; the builds' and runs' whole logs (ab-build-<tree>.log,
# ab-<shape>-<tree>-<round>.log) to ${TMPDIR:-/tmp}/mok-ab, or to $OUT with MOK_AB_KEEP_LOGS=1:
# the device tool returns at most eight files, and three trees' logs crowded the table out
# (session 32).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
if [ "${1:-}" = --export ]; then
  rev="${2:?usage: scripts/ab-bench.sh --export REV}"
  # A folder name the device returns logs for: letters, digits, '.', '_' and '-' only
  # (perf/x~1 -> perf-x-1).
  dir=".ab/$(printf '%s' "$rev" | tr -c 'A-Za-z0-9._-' '-')"
  mkdir -p "$dir"
  git archive "$rev" | tar -x -C "$dir"
  echo "exported $rev into $dir"
  exit 0
fi
. scripts/ab-trees.sh
ab_parse_trees "scripts/ab-bench.sh TREE... -- MOK_RUN_ARGS..." "$@"
set -- "${ab_args[@]}"
OUT="${OUT:-$root/out}"
logs="$OUT"
[ "${MOK_AB_KEEP_LOGS:-0}" = 1 ] || logs="${TMPDIR:-/tmp}/mok-ab"
mkdir -p "$OUT" "$logs"
. scripts/gpu-env.sh
if [ -z "${MOK_NCCL_HOME:-}" ]; then
  nccl_home="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  if [ -n "$nccl_home" ] && [ -f "$nccl_home/include/nccl.h" ]; then export MOK_NCCL_HOME="$nccl_home"; fi
fi
ab_build_trees build-ab "$logs/ab-build-" mok_cli -DMOK_BUILD_TESTS=OFF
pattern="${MOK_AB_GREP:-^  (forward|backward|forward\+backward) |^    [a-z0-9_-]+ +forward |weight gradients  |training step}"
# Logs carry the shape (`--shape NAME` among the run's arguments), so that several calls in one
# device command keep each other's: ab-<shape>.log and ab-<shape>-<tree>-<round>.log.
label=default
args=("$@")
for i in "${!args[@]}"; do
  [ "${args[$i]}" = --shape ] && [ $((i + 1)) -lt ${#args[@]} ] && label="${args[$((i + 1))]}"
done
summary="$OUT/ab-$label.log"
: >"$summary"
# Each round starts at the next tree: the first run after the build finds a cooler card, which
# held a higher clock (session 7: the same forward code 4.9 ms first in its round, 5.1-5.2 later).
for round in $(seq 1 "${MOK_AB_ROUNDS:-2}"); do
  for offset in "${!trees[@]}"; do
    tree="${trees[$(((offset + round - 1) % ${#trees[@]}))]}"
    name="$(ab_tree_name "$tree")"
    log="$logs/ab-$label-$name-$round.log"
    "$tree/build-ab/mok" run "$@" >"$log" 2>&1 || echo "(mok run exited $?)" >>"$log"
    {
      echo "== $name, round $round"
      grep -E "$pattern" "$log" || tail -n 5 "$log"
    } | tee -a "$summary"
  done
done
