# The source trees of an A/B (sourced by scripts/ab-bench.sh and scripts/ab-tests.sh): the
# command line's trees, their names, and their builds in parallel.

# ab_parse_trees USAGE ARG...: the arguments before `--` into `trees`, those after it into
# `ab_args`; prints USAGE and exits 2 without a tree.
ab_parse_trees() {
  local usage="$1"
  shift
  trees=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    trees+=("$1")
    shift
  done
  [ "${1:-}" = -- ] && shift
  ab_args=("$@")
  if [ ${#trees[@]} -eq 0 ]; then
    echo "usage: $usage" >&2
    exit 2
  fi
}

# ab_tree_name TREE: the name of its logs: `checkout` for the checkout itself, an exported tree's
# folder name otherwise (the device's checkout may be a folder named `main`, as `.ab/main` is:
# session 50's logs named both trees `main`).
ab_tree_name() {
  local dir
  dir="$(cd "$1" && pwd)"
  if [ "$dir" = "$(pwd)" ]; then echo checkout; else basename "$dir"; fi
}

# ab_build_trees BUILD_DIR LOG_PREFIX TARGET CMAKE_ARG...: configures and builds TARGET in
# TREE/BUILD_DIR for every tree at once, the machine's cores shared among them, each build's
# output (the compiler's errors included: ninja prints them to stdout) in LOG_PREFIX<tree>.log;
# on a failure prints the log's error lines and its tail, and exits 1.
ab_build_trees() {
  local build_dir="$1" log_prefix="$2" target="$3"
  shift 3
  local jobs_each=$(($(nproc) / ${#trees[@]}))
  [ "$jobs_each" -ge 1 ] || jobs_each=1
  local pids=() tree i
  for tree in "${trees[@]}"; do
    (
      cd "$tree"
      cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@"
      cmake --build "$build_dir" --target "$target" -j "$jobs_each"
    ) >"$log_prefix$(ab_tree_name "$tree").log" 2>&1 &
    pids+=($!)
  done
  for i in "${!pids[@]}"; do
    if ! wait "${pids[$i]}"; then
      local log="$log_prefix$(ab_tree_name "${trees[$i]}").log"
      echo "build of ${trees[$i]} failed:" >&2
      grep -E -m 20 "error|FAILED" "$log" >&2 || true
      tail -n 30 "$log" >&2
      exit 1
    fi
  done
}
