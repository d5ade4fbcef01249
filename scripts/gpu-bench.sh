#!/usr/bin/env bash
# The Python benchmark alone on a GPU device machine (lighter than gpu-check.sh): installs the
# package with the machine's PyTorch (no network), SonicMoE from the carried wheels in
# .deps/peers/wheels into a private folder (MOK_BENCH_SONIC=0 leaves it out: its autotuning
# takes minutes per shape on a fresh machine, except for the shapes whose results are kept in
# scripts/quack-autotune/: see scripts/sonic-env.sh), then `python -m mok.bench` on
# MOK_PYTHON_BENCH_SHAPES (default "qwen3,dsv3_local"), with --fp8 when MOK_PYTHON_BENCH_FP8=1,
# --systems MOK_PYTHON_BENCH_SYSTEMS when set (e.g. "sonicmoe,hf grouped_mm,torch grouped_mm"),
# --knobs MOK_PYTHON_BENCH_KNOBS when set (MoKConfig switches timed flipped beside mok, e.g.
# "gemm_cta_pairs,weight_grad_pingpong").
# MOK_PYTHON_TESTS=1 runs the Python tests (pytest, CUDA cases included) before the benchmark.
# Outputs under $OUT: setup.log, pytest.log, bench.log, bench.json, bench.png, quack-autotune.tgz
# and quack-objects.tgz (QuACK's compiled kernels; carry .deps/quack-autotune once kept).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
. scripts/gpu-env.sh
nvidia-smi -L || { echo "no GPU visible"; exit 1; }
if ! env MOK_PYTHON_SYSTEM=1 scripts/setup-python.sh >"$OUT/setup.log" 2>&1; then
  tail -30 "$OUT/setup.log"
  exit 1
fi
status=0
if [ "${MOK_PYTHON_TESTS:-0}" = 1 ]; then  # the Python tests first (pytest.log)
  (cd tests/python && timeout "${MOK_PYTHON_TESTS_TIMEOUT:-300}" python3 -m pytest -q -rs \
    -p no:cacheprovider .) >"$OUT/pytest.log" 2>&1 || status=1
  grep -E "passed|failed|FAILED|Error" "$OUT/pytest.log" | tail -15
fi
bench_env=()
site="$(mktemp -d)"
source scripts/sonic-env.sh
[ "${MOK_BENCH_SONIC:-1}" = 1 ] && sonic_bench_env "$site" "$OUT/setup.log"
fp8=()
[ "${MOK_PYTHON_BENCH_FP8:-0}" = 1 ] && fp8=(--fp8)
timeout "${MOK_PYTHON_BENCH_TIMEOUT:-500}" "${bench_env[@]}" python3 -m mok.bench \
  --shapes "${MOK_PYTHON_BENCH_SHAPES:-qwen3,dsv3_local}" --systems "${MOK_PYTHON_BENCH_SYSTEMS:-}" \
  --knobs "${MOK_PYTHON_BENCH_KNOBS:-}" \
  "${fp8[@]}" --json "$OUT/bench.json" \
  --plot "$OUT/bench.png" >"$OUT/bench.log" 2>&1 || status=1
cat "$OUT/bench.log" | grep -v "^\s*$" | tail -80
sonic_save_autotune "$OUT"  # keep both archives with scripts/keep-quack-autotune.sh
rm -rf "$site"
exit "$status"
