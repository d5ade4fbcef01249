#!/usr/bin/env bash
# A profiling call on a GPU device machine, lighter than gpu-check.sh: builds only the `mok` CLI
# (Release), runs `mok run` on each shape of MOK_PROFILE_SHAPES (stage breakdowns, variants, the
# ring; default "sonic_e128 dsv3_e128 dsv3"; MOK_PROFILE_RUN_ARGS adds `mok run` arguments, e.g.
# "--quick --compare four-stages"), then ncu on the expert GEMM kernels of the first
# MOK_NCU_LAUNCHES launches (default 6: a forward's two GEMMs and a backward's four) at
# MOK_NCU_SHAPE (default qwen3; empty: no ncu), clocks left alone. MOK_PROFILE_TESTS (a
# GoogleTest filter, e.g. "Fp8*:BackwardGpu.CtaPairs*") also builds the GPU tests and runs those
# first (gpu_tests.log). Outputs under $OUT (default ./out): build.log, run_<shape>.log,
# ncu_<shape>.txt. MOK_NCU_KERNEL (a regex, default expert_gemm_kernel) and MOK_NCU_RUN_ARGS (more
# `mok run` arguments, e.g. "--precision fp8_block") pick what ncu profiles; MOK_NCU_ARGS adds
# ncu arguments (e.g. "--section ComputeWorkloadAnalysis"). MOK_WALK_SHAPES (e.g. "dsv3_e128
# qwen3"; default none) runs `mok walk-bench` on each (walk_<shape>.log), then ncu's L2 fabric
# and SM read sectors of each walk's one run (`--once`; ncu_walk_<shape>.txt); MOK_WALK_ARGS adds
# walk-bench arguments (e.g. --pace-sweep; then no ncu of the walks). MOK_FABRIC_PROBE=1 runs the
# L2 fabric probe (below). Instead of ncu's default sections: MOK_NCU_SOURCE=1 samples the warps'
# stalls per SASS instruction (stalls_<shape>.txt: the top stall sites of each kernel);
# MOK_NCU_ENVS (entries VAR=value) times the GEMM launches with each set
# (ncu_<shape>_<entry>.txt); MOK_NCU_L2_VARIANTS (e.g. "plain,--cta-pairs") breaks down their L2
# throughput under each `mok run` variant (ncu_l2_<n>.txt; each with MOK_NCU_VARIANT_ARGS, default
# --quick, which FP8 runs must set empty). MOK_NCU_METRICS replaces the metrics
# of both (e.g. "breakdown:l1tex__throughput.avg.pct_of_peak_sustained_elapsed": the shared
# memory's units).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
build_dir="${MOK_GPU_BUILD_DIR:-build-gpu}"
. scripts/gpu-env.sh
nvidia-smi -L || { echo "no GPU visible"; exit 1; }
generator=(-G "Unix Makefiles")
command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
gtest=()
[ -d .deps/googletest ] && gtest=("-DMOK_GTEST_SOURCE_DIR=$PWD/.deps/googletest")
if ! { cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "${generator[@]}" "${gtest[@]}" &&
  cmake --build "$build_dir" -j "$(nproc)" --target mok \
    $([ -n "${MOK_PROFILE_TESTS:-}" ] && echo mok_gpu_tests); } >"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi
status=0
if [ -n "${MOK_PROFILE_TESTS:-}" ]; then
  echo "== GPU tests: $MOK_PROFILE_TESTS"
  timeout "${MOK_PROFILE_TESTS_TIMEOUT:-300}" "./$build_dir/mok_gpu_tests" \
    --gtest_filter="$MOK_PROFILE_TESTS" >"$OUT/gpu_tests.log" 2>&1 || status=1
  grep -E "^\[  (PASSED|FAILED) |^\[       OK|^\[  FAILED|Failure|fp8|TFLOP|error" "$OUT/gpu_tests.log" | head -60
fi
# An entry SHAPE:fp8 runs the layer in FP8 (mok run --precision fp8_block, beside bf16).
for entry in ${MOK_PROFILE_SHAPES-sonic_e128 dsv3_e128 dsv3}; do
  shape="${entry%%:*}"
  precision_args=()
  [ "$entry" != "$shape" ] && precision_args=(--precision fp8_block)
  echo "== mok run --shape $shape ${precision_args[*]}"
  # dsv3 (22.5 GB of weights): the CPU check of a token slice holds the weights several times
  # over in host memory; it is skipped there (MOK_PROFILE_CHECK_TOKENS sets it for the others).
  check_tokens="${MOK_PROFILE_CHECK_TOKENS:-64}"
  [ "$shape" = dsv3 ] && check_tokens=0
  log="$OUT/run_${entry/:/_}.log"
  # shellcheck disable=SC2086 # MOK_PROFILE_RUN_ARGS is a list of arguments
  timeout "${MOK_PROFILE_RUN_TIMEOUT:-200}" "./$build_dir/mok" run --shape "$shape" \
    --check-tokens "$check_tokens" "${precision_args[@]}" ${MOK_PROFILE_RUN_ARGS:-} >"$log" 2>&1 ||
    status=1
  grep -E "ring|forward |backward |forward\+backward|stages|^    |^  [a-z_]+ +max|PASS|FAIL|rror" \
    "$log" | head -60
done
# The sectors that bind the row-tile GEMMs (docs/perf.md, sessions 17-18).
fabric_metrics=gpu__time_duration.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,lts__ltcfabric2ltc_cycles_active.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum
for shape in ${MOK_WALK_SHAPES:-}; do
  echo "== mok walk-bench --shape $shape"
  timeout 200 "./$build_dir/mok" walk-bench --shape "$shape" ${MOK_WALK_ARGS:-} \
    >"$OUT/walk_$shape.log" 2>&1 || status=1
  cat "$OUT/walk_$shape.log"
  if [ -z "${MOK_WALK_ARGS:-}" ] && command -v ncu >/dev/null 2>&1; then
    timeout "${MOK_NCU_TIMEOUT:-240}" ncu --clock-control none --metrics "$fabric_metrics" \
      -k regex:walk_replay_kernel "./$build_dir/mok" walk-bench --shape "$shape" --once \
      >"$OUT/ncu_walk_$shape.txt" 2>&1 || status=1
    grep -E "walk_replay_kernel|gpu__time|tex_op_read|ltcfabric" "$OUT/ncu_walk_$shape.txt" |
      head -160
  fi
done
# MOK_FABRIC_PROBE=1: `mok walk-bench --fabric-probe` (each L2 partition's SMs reading an 8 MB
# buffer), timed and under ncu's fabric metrics (ncu_fabric_probe.txt): whether a partition
# keeps copies of the lines it reads from the other.
if [ -n "${MOK_FABRIC_PROBE:-}" ]; then
  echo "== mok walk-bench --fabric-probe"
  timeout 120 "./$build_dir/mok" walk-bench --fabric-probe || status=1
  if command -v ncu >/dev/null 2>&1; then
    timeout 180 ncu --clock-control none --metrics "$fabric_metrics" -k regex:fabric_probe_kernel \
      "./$build_dir/mok" walk-bench --fabric-probe --once >"$OUT/ncu_fabric_probe.txt" 2>&1 ||
      status=1
    grep -E "fabric_probe_kernel|gpu__time|tex_op_read|ltcfabric|dram__" \
      "$OUT/ncu_fabric_probe.txt" | sed -E 's/\(.*//' | head -30
  fi
fi
ncu_shape="${MOK_NCU_SHAPE-qwen3}"
ncu_kernel="${MOK_NCU_KERNEL:-expert_gemm_kernel}"
have_ncu=
[ -n "$ncu_shape" ] && command -v ncu >/dev/null 2>&1 && have_ncu=1
# ncu on the first LAUNCHES launches of the GEMM kernels (MOK_NCU_KERNEL) of `mok run` at
# MOK_NCU_SHAPE, clocks left alone: ncu_gemms LAUNCHES NCU_ARGS... [-- MOK_RUN_ARGS...]
ncu_gemms() {
  local launches=$1
  shift
  local ncu_args=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    ncu_args+=("$1")
    shift
  done
  [ $# -gt 0 ] && shift
  timeout "${MOK_NCU_TIMEOUT:-240}" ncu --clock-control none "${ncu_args[@]}" \
    -k "regex:$ncu_kernel" --launch-count "$launches" \
    "./$build_dir/mok" run --shape "$ncu_shape" --check-tokens 1 "$@"
}
# The L2's throughput by unit (ncu's breakdown: fabric, tags, data banks, crossbar) and the
# sectors by source, for the GEMM launches at MOK_NCU_SHAPE under each `mok run` variant of
# MOK_NCU_L2_VARIANTS (comma-separated argument sets, "plain" for none; e.g.
# "plain,--cta-pairs,--l2-placement"): ncu_l2_<n>.txt.
l2_metrics=gpu__time_duration.sum,breakdown:lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_sectors_srcunit_ltcfabric.sum,dram__bytes_read.sum
n=0
IFS=, read -r -a l2_variants <<<"${MOK_NCU_L2_VARIANTS:-}"
for variant in "${l2_variants[@]}"; do
  [ -n "$have_ncu" ] || break
  n=$((n + 1))
  args=()
  [ "$variant" != plain ] && read -r -a args <<<"$variant"
  echo "== ncu L2 breakdown at $ncu_shape, $variant"
  # shellcheck disable=SC2086 # MOK_NCU_VARIANT_ARGS is a list of arguments
  ncu_gemms "${MOK_NCU_LAUNCHES:-2}" --metrics "${MOK_NCU_METRICS:-$l2_metrics}" -- \
    ${MOK_NCU_VARIANT_ARGS---quick} "${args[@]}" \
    >"$OUT/ncu_l2_$n.txt" 2>&1 || status=1
  grep -E "$ncu_kernel|lts__|l1tex__|dram__|gpu__time|hmma" "$OUT/ncu_l2_$n.txt" |
    sed -E 's/\(CUtensorMap_st.*//' | head -60
done
# Each entry VAR=value of MOK_NCU_ENVS (e.g. "MOK_GEMM_ABLATION=none MOK_GEMM_ABLATION=no-loads")
# under ncu's SpeedOfLight: the GEMM launches' durations, clocks and tensor-pipe activity with
# that variable set.
clock_metrics=sm__cycles_elapsed.avg.per_second,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed
for entry in ${MOK_NCU_ENVS:-}; do
  [ -n "$have_ncu" ] || break
  echo "== ncu at $ncu_shape, $entry"
  log="$OUT/ncu_${ncu_shape}_${entry//[^A-Za-z0-9_-]/_}.txt"
  # (an ablated layer's check fails by design: no status)
  (export "$entry" && ncu_gemms "${MOK_NCU_LAUNCHES:-6}" --section SpeedOfLight \
    --metrics "${MOK_NCU_METRICS:-$clock_metrics}" -- ${MOK_NCU_RUN_ARGS:-}) >"$log" 2>&1
  grep -E "$ncu_kernel|Duration|cycles_elapsed|hmma_cycles|l1tex__|lts__|dram__" "$log" |
    sed -E 's/\(CUtensorMap_st.*//' | head -120
done
if [ -n "$have_ncu" ] && [ -n "${MOK_NCU_SOURCE:-}" ]; then
  # Where the warps stall, per SASS instruction: ncu's warp-state sampling into a report, its
  # details page (ncu_<shape>.txt), its source page (ncu_<shape>_sass.csv.gz) and the stall
  # sites of each kernel (stalls_<shape>.txt, scripts/ncu_stall_sites.py).
  echo "== ncu source counters at $ncu_shape"
  report="$OUT/ncu_$ncu_shape"
  ncu_gemms "${MOK_NCU_LAUNCHES:-6}" --section SpeedOfLight --section WarpStateStats \
    --section SourceCounters --import-source yes ${MOK_NCU_ARGS:-} -f -o "$report" \
    -- ${MOK_NCU_RUN_ARGS:-} >"$OUT/ncu_${ncu_shape}_run.log" 2>&1 || status=1
  ncu -i "$report.ncu-rep" >"$OUT/ncu_$ncu_shape.txt" 2>&1 || status=1
  ncu -i "$report.ncu-rep" --page source --csv --print-source sass \
    >"$OUT/ncu_${ncu_shape}_sass.csv" 2>&1 || status=1
  python3 scripts/ncu_stall_sites.py "$OUT/ncu_${ncu_shape}_sass.csv" --top 40 \
    >"$OUT/stalls_$ncu_shape.txt" 2>&1 || status=1
  cat "$OUT/stalls_$ncu_shape.txt"
  gzip -f "$OUT/ncu_${ncu_shape}_sass.csv"
  rm -f "$report.ncu-rep"
  grep -E "$ncu_kernel|Duration|Compute \(SM\) Throughput|Warp Cycles Per Issued" \
    "$OUT/ncu_$ncu_shape.txt" | head -40
elif [ -n "$have_ncu" ] && [ -z "${MOK_NCU_ENVS:-}${MOK_NCU_L2_VARIANTS:-}" ]; then
  echo "== ncu at $ncu_shape"
  ncu_gemms "${MOK_NCU_LAUNCHES:-6}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section SchedulerStats --section Occupancy ${MOK_NCU_ARGS:-} \
    -- ${MOK_NCU_RUN_ARGS:-} >"$OUT/ncu_$ncu_shape.txt" 2>&1 || status=1
  grep -E "$ncu_kernel|Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
    "$OUT/ncu_$ncu_shape.txt" | head -80
fi
exit "$status"
