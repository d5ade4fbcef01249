set -u
export PATH=$PATH:/usr/local/cuda/bin NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$OUT/s.log
t0=$(date +%s)
cmake -S . -B /tmp/b -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOK_GTEST_SOURCE_DIR=$PWD/.deps/googletest >/tmp/cfg.log 2>&1 || { tail -30 /tmp/cfg.log >> $S; exit 1; }
cmake --build /tmp/b -j16 --target mok_gpu_tests mok > /tmp/build.log 2>&1 || { grep -E "error" /tmp/build.log | head -30 >> $S; tail -30 /tmp/build.log >> $S; exit 1; }
echo "build $(( $(date +%s) - t0 )) s" >> $S
/tmp/b/mok_gpu_tests --gtest_filter='Fp8GemmGpu.MatchesTheBlockScaledProduct:Fp8GemmGpu.WeightGradient*:Fp8LayerGpu.*' > $OUT/check.log 2>&1
grep -E "^\[  (PASSED|FAILED)|FAILED|Failure|tests? from .* ran" $OUT/check.log | head -30 >> $S
echo "checks done $(( $(date +%s) - t0 )) s" >> $S
timeout 120 compute-sanitizer --tool memcheck /tmp/b/mok_gpu_tests --gtest_filter='Fp8GemmGpu.MatchesTheBlockScaledProduct' > /tmp/mc.log 2>&1; echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' /tmp/mc.log | tail -3 | tr '\n' ' ')" >> $S
timeout 120 compute-sanitizer --tool synccheck /tmp/b/mok_gpu_tests --gtest_filter='Fp8GemmGpu.MatchesTheBlockScaledProduct' > /tmp/sc.log 2>&1; echo "synccheck rc=$? $(grep -E 'ERROR SUMMARY|PASSED|FAILED' /tmp/sc.log | tail -3 | tr '\n' ' ')" >> $S
for r in 1 2; do
  echo "== rates round $r" >> $S
  /tmp/b/mok_gpu_tests --gtest_filter='Fp8GemmGpu.Throughput:Fp8GemmGpu.EveryFormsRateAtDsv3Shapes' 2>&1 | grep -E "random|OK|FAILED|Failure" >> $S
done
echo "rates done $(( $(date +%s) - t0 )) s" >> $S
for p in "" "--cta-pairs" "" "--cta-pairs"; do
  echo "== mok run fp8 dsv3_local $p" >> $S
  timeout 150 /tmp/b/mok run --shape dsv3_local --precision fp8_block $p > /tmp/run.log 2>&1; echo "rc=$?" >> $S
  grep -E "forward|FP8 .*GEMM|PASS|FAIL|bitwise" /tmp/run.log | head -20 >> $S
done
echo "all done $(( $(date +%s) - t0 )) s" >> $S
