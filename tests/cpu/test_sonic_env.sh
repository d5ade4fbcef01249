#!/usr/bin/env bash
# scripts/sonic-env.sh's QuACK autotuning round trip without the wheels: sonic_save_autotune
# packs the *.autotune.json files of the cache folder (and nothing else) into
# quack-autotune.tgz, and the archive unpacks into the same relative paths, as sonic_bench_env
# seeds them on the next machine; sonic_keep_autotune merges an archive's results (and nothing
# else) into the folder kept in the repository; the compiled kernels travel in
# quack-objects.tgz, which sonic_keep_objects merges into one kept archive.
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
# The compiled kernels (FINGERPRINT/KEY.o) go into quack-objects.tgz, and only those; a second
# call's archive merges with the kept one, a newer object replacing an older one of its name.
[ -f "$work/out/quack-objects.tgz" ] || { echo "FAIL: no objects archive"; exit 1; }
got=$(tar -tzf "$work/out/quack-objects.tgz" | sort | tr '\n' ' ')
[ "$got" = "./KEYB/kernel.o " ] || { echo "FAIL: the objects archive holds '$got'"; exit 1; }
kept_objects="$work/deps/quack-objects.tgz"
sonic_keep_objects "$work/out/quack-objects.tgz" "$kept_objects" >/dev/null ||
  { echo "FAIL: sonic_keep_objects failed"; exit 1; }
mkdir -p "$work/second/FP2" "$work/second/KEYB"
echo 'other code' >"$work/second/FP2/other.o"
echo 'newer code' >"$work/second/KEYB/kernel.o"
echo 'not an object' >"$work/second/FP2/notes.txt"
(cd "$work/second" && tar -czf "$work/out/second.tgz" .)
message=$(sonic_keep_objects "$work/out/second.tgz" "$kept_objects") ||
  { echo "FAIL: sonic_keep_objects failed on a merge"; exit 1; }
[[ "$message" == "kept 2 QuACK compiled kernels in $kept_objects"* ]] ||
  { echo "FAIL: sonic_keep_objects said '$message'"; exit 1; }
mkdir -p "$work/merged"
tar -xzf "$kept_objects" -C "$work/merged"
got=$(cd "$work/merged" && find . -type f | sort | tr '\n' ' ')
[ "$got" = "./FP2/other.o ./KEYB/kernel.o " ] || { echo "FAIL: merged '$got'"; exit 1; }
[ "$(cat "$work/merged/KEYB/kernel.o")" = "newer code" ] ||
  { echo "FAIL: the newer object did not replace the kept one"; exit 1; }
sonic_cache_dir=""
rm -f "$work/out/quack-autotune.tgz" "$work/out/quack-objects.tgz"
sonic_save_autotune "$work/out"  # without SonicMoE installed: nothing to save, no error
[ ! -e "$work/out/quack-autotune.tgz" ] && [ ! -e "$work/out/quack-objects.tgz" ] ||
  { echo "FAIL: an archive without a cache"; exit 1; }
echo "all passed"
