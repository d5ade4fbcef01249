#!/usr/bin/env bash
# scripts/sonic-env.sh's QuACK autotuning round trip without the wheels: sonic_save_autotune
# packs the *.autotune.json files of the cache folder (and nothing else) into
# quack-autotune.tgz, and the archive unpacks into the same relative paths, as sonic_bench_env
# seeds them on the next machine; sonic_keep_autotune merges an archive's results (and nothing
# else) into the folder kept in the repository.
set -u
root="$(cd "$(dirname "$0")/../.." && pwd)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/cache/KEYA" "$work/cache/KEYB" "$work/out" "$work/seed"
echo '{"key": "a"}' >"$work/cache/KEYA/gemm_tuned.autotune.json"
echo '{"key": "b"}' >"$work/cache/KEYB/gemm_gated_tuned.autotune.json"
echo 'object code' >"$work/cache/KEYB/kernel.o"
source "$root/scripts/sonic-env.sh"
sonic_cache_dir="$work/cache"
sonic_save_autotune "$work/out"
[ -f "$work/out/quack-autotune.tgz" ] || { echo "FAIL: no archive"; exit 1; }
tar -xzf "$work/out/quack-autotune.tgz" -C "$work/seed"
got=$(cd "$work/seed" && find . -type f | sort | tr '\n' ' ')
want="./KEYA/gemm_tuned.autotune.json ./KEYB/gemm_gated_tuned.autotune.json "
[ "$got" = "$want" ] || { echo "FAIL: the archive holds '$got', expected '$want'"; exit 1; }
cmp -s "$work/seed/KEYA/gemm_tuned.autotune.json" "$work/cache/KEYA/gemm_tuned.autotune.json" ||
  { echo "FAIL: a result changed in the round trip"; exit 1; }
# sonic_keep_autotune merges the archive's results into a kept folder, and only those: a file of
# another name or depth in the archive is left out.
mkdir -p "$work/extra/KEYC/deeper"
echo '{"key": "c"}' >"$work/extra/KEYC/deeper/gemm_tuned.autotune.json"
echo 'notes' >"$work/extra/KEYC/readme.txt"
cp -r "$work/seed/." "$work/extra/"
(cd "$work/extra" && tar -czf "$work/mixed.tgz" .)
sonic_keep_autotune "$work/mixed.tgz" "$work/kept" >/dev/null ||
  { echo "FAIL: sonic_keep_autotune failed"; exit 1; }
got=$(cd "$work/kept" && find . -type f | sort | tr '\n' ' ')
[ "$got" = "$want" ] || { echo "FAIL: kept '$got', expected '$want'"; exit 1; }
cmp -s "$work/kept/KEYB/gemm_gated_tuned.autotune.json" "$work/cache/KEYB/gemm_gated_tuned.autotune.json" ||
  { echo "FAIL: a kept result differs"; exit 1; }
# The results kept in the repository are in the form sonic_bench_env seeds from.
for kept in "$root"/scripts/quack-autotune/*/*; do
  [[ "${kept#"$root"/scripts/quack-autotune/}" =~ ^[A-Za-z0-9]+/[A-Za-z0-9_]+\.autotune\.json$ ]] ||
    { echo "FAIL: scripts/quack-autotune holds $kept"; exit 1; }
done
sonic_cache_dir=""
rm -f "$work/out/quack-autotune.tgz"
sonic_save_autotune "$work/out"  # without SonicMoE installed: nothing to save, no error
[ ! -e "$work/out/quack-autotune.tgz" ] || { echo "FAIL: an archive without a cache"; exit 1; }
echo "all passed"
