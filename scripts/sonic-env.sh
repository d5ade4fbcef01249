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
  archive="$root/.deps/quack-autotune/quack-autotune.tgz"
  if [ -f "$archive" ]; then
    tar -xzf "$archive" -C "$sonic_cache_dir" >>"$log" 2>&1 &&
      echo "QuACK autotuning results seeded from $archive" >>"$log"
  fi
  bench_env=(env "PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
    TRITON_CACHE_AUTOTUNING=1 QUACK_CACHE_AUTOTUNING=1 "QUACK_CACHE_DIR=$sonic_cache_dir"
    "MOK_BENCH_SONIC_PRECOMPILE=$root/.deps/peers/sonic_bench.py")
}

# After the benchmark: QuACK's autotuning results (a few KB) into DIR/quack-autotune.tgz.
sonic_save_autotune() {
  local dir="$1"
  [ -n "${sonic_cache_dir:-}" ] && [ -d "$sonic_cache_dir" ] || return 0
  (cd "$sonic_cache_dir" && find . -name '*.autotune.json' | tar -czf "$dir/quack-autotune.tgz" -T -) ||
    true
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
