# Sourced by gpu-check.sh and gpu-bench.sh: `sonic_bench_env SITE LOG` installs SonicMoE's carried
# wheels (.deps/peers/wheels, see ../shared/peers/README.md) into the private folder SITE for one
# benchmark step, and sets the array `bench_env` to the `env ...` prefix that makes
# `python -m mok.bench` import them and precompile QuACK's candidates in the peers' pool. Without
# the wheels, or if the install fails (logged to LOG), `bench_env` stays empty: the benchmark then
# reports SonicMoE as not importable.
#
# QuACK's autotuning results persist across device calls. QuACK times every candidate config of
# every GEMM on first use (~4 minutes at `dsv3_e128` on a fresh machine, docs/perf.md session 14)
# unless it finds its own result for the same shapes, candidates and QuACK version on disk
# (QUACK_CACHE_AUTOTUNING=1, *.autotune.json under QUACK_CACHE_DIR). `sonic_bench_env` seeds that
# folder from the results kept in the repository (scripts/quack-autotune/, KEY/NAME.autotune.json
# as QuACK writes them) and from .deps/quack-autotune/quack-autotune.tgz when it was carried.
# `sonic_save_autotune DIR` packs the results after a run into DIR/quack-autotune.tgz;
# `scripts/keep-quack-autotune.sh ARCHIVE` merges a returned archive into scripts/quack-autotune/
# (commit it: .deps does not outlive the checkout). The choice is QuACK's own autotuning's, made
# on the same kind of card; only the re-timing is skipped.
#
# QuACK's compiled kernels persist the same way, outside the repository (object code). With every
# autotuning result found, SonicMoE's first step still took 189 s at `sonic_e128` (docs/perf.md,
# session 46, call 7): QuACK compiles each chosen GEMM with CuTe DSL on first use, then keeps it
# as QUACK_CACHE_DIR/FINGERPRINT/KEY.o (the fingerprint hashes QuACK's sources, CUTLASS's and
# Python's versions: the same wheels give the same folder on every machine). `sonic_save_autotune`
# also packs those objects into DIR/quack-objects.tgz; `scripts/keep-quack-autotune.sh` merges a
# returned one into .deps/quack-autotune/quack-objects.tgz, and `sonic_bench_env` seeds the cache
# from it when .deps/quack-autotune was carried.
sonic_bench_env() {
  local site="$1" log="$2" root archive
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bench_env=()
  sonic_cache_dir=""
  ls "$root"/.deps/peers/wheels/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$root"/.deps/peers/wheels/*.whl >>"$log" 2>&1 || return 0
  sonic_cache_dir="$site/quack-cache"
  mkdir -p "$sonic_cache_dir"
  if [ -d "$root/scripts/quack-autotune" ]; then
    cp -r "$root/scripts/quack-autotune/." "$sonic_cache_dir/" &&
      echo "QuACK autotuning results seeded from scripts/quack-autotune" >>"$log"
  fi
  for archive in "$root/.deps/quack-autotune/quack-autotune.tgz" \
    "$root/.deps/quack-autotune/quack-objects.tgz"; do
    [ -f "$archive" ] || continue
    tar -xzf "$archive" -C "$sonic_cache_dir" >>"$log" 2>&1 &&
      echo "QuACK cache seeded from $archive" >>"$log"
  done
  bench_env=(env "PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
    TRITON_CACHE_AUTOTUNING=1 QUACK_CACHE_AUTOTUNING=1 "QUACK_CACHE_DIR=$sonic_cache_dir"
    "MOK_BENCH_SONIC_PRECOMPILE=$root/.deps/peers/sonic_bench.py")
}

# After the benchmark: QuACK's autotuning results (a few KB) into DIR/quack-autotune.tgz, and its
# compiled kernels (FINGERPRINT/KEY.o) into DIR/quack-objects.tgz when there are any.
sonic_save_autotune() {
  local dir="$1"
  [ -n "${sonic_cache_dir:-}" ] && [ -d "$sonic_cache_dir" ] || return 0
  (cd "$sonic_cache_dir" && find . -name '*.autotune.json' | tar -czf "$dir/quack-autotune.tgz" -T -) ||
    true
  if [ -n "$(cd "$sonic_cache_dir" && find . -mindepth 2 -maxdepth 2 -name '*.o' | head -1)" ]; then
    (cd "$sonic_cache_dir" && find . -mindepth 2 -maxdepth 2 -name '*.o' |
      tar -czf "$dir/quack-objects.tgz" -T -) || true
  fi
}

# Merges the *.autotune.json results of ARCHIVE (a quack-autotune.tgz) into DIR (default
# scripts/quack-autotune/), as KEY/NAME.autotune.json; anything else in the archive is ignored.
sonic_keep_autotune() {
  local archive="$1" dir="${2:-}" root work kept=0 path
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  [ -n "$dir" ] || dir="$root/scripts/quack-autotune"
  work="$(mktemp -d)"
  tar -xzf "$archive" -C "$work" || { rm -rf "$work"; return 1; }
  while IFS= read -r path; do
    path="${path#./}"
    [[ "$path" =~ ^[A-Za-z0-9]+/[A-Za-z0-9_]+\.autotune\.json$ ]] || continue
    mkdir -p "$dir/${path%/*}"
    cp "$work/$path" "$dir/$path"
    kept=$((kept + 1))
  done < <(cd "$work" && find . -type f)
  rm -rf "$work"
  echo "kept $kept QuACK autotuning results in $dir"
}

# Merges the compiled kernels of ARCHIVE (a quack-objects.tgz: FINGERPRINT/KEY.o) into the archive
# OBJECTS (default .deps/quack-autotune/quack-objects.tgz), which sonic_bench_env seeds from;
# anything else in ARCHIVE is ignored. Prints how many objects it holds and its size.
sonic_keep_objects() {
  local archive="$1" objects="${2:-}" root work kept=0 path
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  [ -n "$objects" ] || objects="$root/.deps/quack-autotune/quack-objects.tgz"
  work="$(mktemp -d)"
  mkdir -p "$work/new" "$work/kept"
  tar -xzf "$archive" -C "$work/new" || { rm -rf "$work"; return 1; }
  if [ -f "$objects" ]; then
    tar -xzf "$objects" -C "$work/kept" || { rm -rf "$work"; return 1; }
  fi
  while IFS= read -r path; do
    path="${path#./}"
    [[ "$path" =~ ^[A-Za-z0-9]+/[A-Za-z0-9_]+\.o$ ]] || continue
    mkdir -p "$work/kept/${path%/*}"
    cp "$work/new/$path" "$work/kept/$path"
  done < <(cd "$work/new" && find . -type f)
  mkdir -p "$(dirname "$objects")"
  (cd "$work/kept" && find . -type f -name '*.o' | sort | tar -czf "$work/merged.tgz" -T -) &&
    mv "$work/merged.tgz" "$objects"
  kept=$(tar -tzf "$objects" | grep -c '\.o$' || true)
  rm -rf "$work"
  echo "kept $kept QuACK compiled kernels in $objects ($(du -h "$objects" | cut -f1))"
}
