#!/usr/bin/env bash
# scripts/cuda-compile-guard.sh against stand-in compilers: it fails a compile whose ptxas
# reports serialized wgmma (and removes the object), lets the allowed kernel through, and keeps
# the compiler's own exit status and messages.
set -u
guard="$(dirname "$0")/../../scripts/cuda-compile-guard.sh"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
expect() {  # expect NAME STATUS COMMAND...
  local name=$1 want=$2
  shift 2
  "$guard" "$@" >"$work/stdout" 2>"$work/stderr"
  local got=$?
  if [ "$got" -ne "$want" ]; then
    echo "FAIL $name: exit $got, expected $want; stderr:"
    cat "$work/stderr"
    failures=$((failures + 1))
  else
    echo "ok   $name"
  fi
}
advisory='ptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP in divergent path in the function'

expect "clean compile" 0 sh -c 'echo "ptxas info : Used 168 registers" >&2; touch "$1"' sh "$work/a.o"
[ -f "$work/a.o" ] || { echo "FAIL clean compile: the object is gone"; failures=$((failures + 1)); }

expect "serialized wgmma" 1 sh -c "echo \"$advisory '_Z6kernelv'\" >&2; touch \"\$2\"" sh -o "$work/b.o"
[ -f "$work/b.o" ] && { echo "FAIL serialized wgmma: the object was kept"; failures=$((failures + 1)); }
grep -q "C7518" "$work/stderr" || { echo "FAIL serialized wgmma: ptxas's message not passed on"; failures=$((failures + 1)); }

allowed_kernel='_ZN3mok7kernels47_GLOBAL__N__x_14expert_gemm_cu_y18expert_gemm_kernelILNS0_14ExpertGemmFormE5ELb1ELb0EEEv'
expect "allowed kernel" 0 sh -c "echo \"$advisory '$allowed_kernel'\" >&2" sh

not_allowed_kernel='_ZN3mok7kernels47_GLOBAL__N__x_14expert_gemm_cu_y18expert_gemm_kernelILNS0_14ExpertGemmFormE5ELb0ELb0EEEv'
expect "same kernel, not resuming" 1 sh -c "echo \"$advisory '$not_allowed_kernel'\" >&2" sh

expect "compiler error" 3 sh -c 'echo "error: something" >&2; exit 3' sh
grep -q "error: something" "$work/stderr" || { echo "FAIL compiler error: message lost"; failures=$((failures + 1)); }

[ "$failures" -eq 0 ] && echo "all passed"
exit "$failures"
