# Sourced by gpu-check.sh and gpu-bench.sh: `sonic_bench_env SITE LOG` installs SonicMoE's carried
# wheels (.deps/peers/wheels, see ../shared/peers/README.md) into the private folder SITE for one
# benchmark step, and sets the array `bench_env` to the `env ...` prefix that makes
# `python -m mok.bench` import them and precompile QuACK's candidates in the peers' pool. Without
# the wheels, or if the install fails (logged to LOG), `bench_env` stays empty: the benchmark then
# reports SonicMoE as not importable.
sonic_bench_env() {
  local site="$1" log="$2" root
  root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
  bench_env=()
  ls "$root"/.deps/peers/wheels/*.whl >/dev/null 2>&1 || return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$root"/.deps/peers/wheels/*.whl >>"$log" 2>&1 || return 0
  bench_env=(env "PYTHONPATH=$site:$site/nvidia_cutlass_dsl/python_packages${PYTHONPATH:+:$PYTHONPATH}"
    TRITON_CACHE_AUTOTUNING=1 "MOK_BENCH_SONIC_PRECOMPILE=$root/.deps/peers/sonic_bench.py")
}
