#!/usr/bin/env bash
# Experiment (docs/perf.md, session 46): the FP8 GEMMs with their promotion instructions set to
# yield (scripts/sass_yield.py) against the build as compiled, in alternating rounds on one GPU:
# the GEMM rate tests, the FP8 GEMM and layer tests (bits), and `mok run` at dsv3_local in FP8.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
. scripts/gpu-env.sh
export PATH="$PATH:$PWD/.deps/sass-tools"
build=build-gpu
gtest=()
[ -d .deps/googletest ] && gtest=("-DMOK_GTEST_SOURCE_DIR=$PWD/.deps/googletest")
{ cmake -S . -B $build -DCMAKE_BUILD_TYPE=Release -G Ninja "${gtest[@]}" &&
  cmake --build $build -j "$(nproc)" --target mok mok_gpu_tests; } >"$OUT/build.log" 2>&1 ||
  { tail -30 "$OUT/build.log"; exit 1; }
object=$build/CMakeFiles/mok_core.dir/src/kernels/gemm/fp8_gemm.cu.o
cp "$object" /tmp/fp8_gemm.orig.o
use() {  # use orig|all|first-half: that object, then relink
  cp /tmp/fp8_gemm.orig.o "$object"
  [ "$1" = orig ] || python3 scripts/sass_yield.py "$object" --mode "$1" >>"$OUT/patch.log" 2>&1 ||
    { cat "$OUT/patch.log"; exit 1; }
  touch "$object"
  cmake --build $build --target mok mok_gpu_tests >>"$OUT/relink.log" 2>&1 || exit 1
}
rates() {  # rates NAME: the rate tests' lines into rates_NAME.log
  ./$build/mok_gpu_tests --gtest_filter='Fp8GemmGpu.Throughput:Fp8GemmGpu.EveryFormsRateAtDsv3Shapes' \
    >"$OUT/rates_$1.log" 2>&1
  grep -E "random codes(, sustained)?:|FAILED" "$OUT/rates_$1.log" | grep -v "expert groups" |
    sed "s/^/$1 /"
}
for variant in ${MOK_SASS_VARIANTS:-orig all first-half orig all}; do
  use "$variant"
  rates "$variant"
done
use all
echo "== bits with every promotion instruction yielding"
./$build/mok_gpu_tests --gtest_filter='Fp8*:EpLayerGpu.Fp8*' >"$OUT/tests_all.log" 2>&1
grep -E "^\[  (PASSED|FAILED)|^\[  FAILED" "$OUT/tests_all.log"
for variant in orig all orig all; do
  use "$variant"
  ./$build/mok run --shape dsv3_local --precision fp8_block --check-tokens 2 \
    >"$OUT/run_$variant.log" 2>&1
  grep -E "^  forward|weight gradients|gate/up GEMM|down GEMM|dgrad|PASS|FAIL" "$OUT/run_$variant.log" |
    sed "s/^/$variant /"
done
