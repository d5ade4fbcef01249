#!/usr/bin/env bash
# The CUDA compiler launcher of every mok build (CMake's CUDA_COMPILER_LAUNCHER; the
# MOK_GUARD_WGMMA_SERIALIZATION option): runs the compile command it is given, passes its output
# through, and fails the compile when ptxas reports that it serialized a kernel's wgmma
# instructions ("Potential Performance Loss", C7510-C7520). Such a kernel computes the same bits
# at up to half the speed, and nothing but this message says so: session 13's ping-pong weight
# gradients ran 1.4-2x slower than the kernel they were to beat for that reason alone
# (docs/perf.md, session 14).
#
# Allowed, each with its reason:
#   expert_gemm_kernel<kWeightGrad, kResumes = true, *>: loading an earlier macrobatch's fp32
#   partials into the accumulator is a non-wgmma definition of its registers (C7515); only the
#   launches that resume pay it (expert_gemm.cu).
set -uo pipefail
allowed='expert_gemm_kernelILNS0_14ExpertGemmFormE5ELb1E'

messages=$(mktemp)
trap 'rm -f "$messages"' EXIT
"$@" 2>"$messages"
status=$?
cat "$messages" >&2
[ "$status" -ne 0 ] && exit "$status"

serialized=$(grep "Potential Performance Loss" "$messages" | grep -v -E "$allowed")
[ -z "$serialized" ] && exit 0

output=""
previous=""
for arg in "$@"; do
  [ "$previous" = "-o" ] && output="$arg"
  previous="$arg"
done
[ -n "$output" ] && rm -f "$output"  # so that the next build compiles it again
echo "error: ptxas serialized the wgmma instructions of a kernel (above); find what defines" \
  "the accumulator registers, or what diverges, between wgmma.fence and wgmma.wait, or add the" \
  "kernel to scripts/cuda-compile-guard.sh's allowed list with the reason" >&2
exit 1
