#!/usr/bin/env bash
# Sets up the Python package for tests and development: a virtual environment (MOK_VENV, default
# .venv) with the pinned build and test dependencies from the Python package index, then
# `pip install --no-build-isolation .` of this tree into it (scikit-build-core builds the
# extension mok._C from the same CMake project). Safe to run again: it installs only what is
# missing, and always reinstalls mok itself. With MOK_PYTHON_SYSTEM=1 (the GPU machine, which has
# no network) it uses the current interpreter and what it already has.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/setup.sh >&2
if [ "${MOK_PYTHON_SYSTEM:-0}" = 1 ]; then
  python=python3
else
  venv="${MOK_VENV:-.venv}"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
  fi
  python="$venv/bin/python"
  # pip unpacks wheels under TMPDIR; keep that on the venv's disk, which may be larger than /tmp,
  # and say how much room there is, so that a full disk is diagnosed in the log.
  export TMPDIR="$(cd "$venv" && pwd)/tmp"
  mkdir -p "$TMPDIR"
  free_mib() { df -Pm "$venv" | awk 'NR == 2 { print $4 }'; }
  echo "setup-python: $(free_mib) MiB free on the disk of $venv (the packages take about 2000)" >&2
  # The versions the GPU machine has (torch's CPU and CUDA builds share these pins). No pip
  # cache: the wheels are installed once per environment, and disk is what CI runs short of.
  pip_install=("$python" -m pip install -q --no-cache-dir)
  if ! "$python" -c "import torch" 2>/dev/null; then
    # PyPI's Linux torch is its CUDA build, whose dependencies are 2.7 GB of NVIDIA libraries
    # and 0.6 GB of triton. The CUDA toolkit on this project's machines has all but three of
    # those libraries, and the tests need no triton; so torch goes in without its dependencies,
    # the three libraries come as wheels and its Python dependencies by name (a third of the
    # disk at the peak). Where torch then does not import, it is installed whole.
    torch_lean=(torch==2.11.0 nvidia-cufile==1.15.1.6 nvidia-cusparselt-cu13==0.8.0
                nvidia-nvshmem-cu13==3.4.5)
    torch_python_deps=(filelock==4.3.1 typing-extensions==4.16.0 sympy==1.14.0 mpmath==1.3.0
                       networkx==3.6.1 jinja2==3.1.6 markupsafe==3.0.4 fsspec==2026.9.0)
    echo "setup-python: installing ${torch_lean[*]} (without torch's CUDA dependencies) into $venv" >&2
    if ! "${pip_install[@]}" --no-deps "${torch_lean[@]}"; then
      echo "setup-python: installing torch failed with $(free_mib) MiB free on the disk of $venv" >&2
      exit 1
    fi
    "${pip_install[@]}" "${torch_python_deps[@]}"
    if ! "$python" -c "import torch" 2>/dev/null; then
      echo "setup-python: torch does not import without its CUDA dependencies here; installing them" >&2
      "${pip_install[@]}" torch==2.11.0
    fi
  fi
  requirements=(nanobind==3.1.0 scikit-build-core==1.1.0 pytest==9.1.1 numpy==2.4.6
                transformers==5.17.0 ruff==0.14.0 matplotlib==3.11.2)
  if ! "$python" -c "import nanobind, scikit_build_core, pytest, numpy, transformers, ruff, matplotlib" 2>/dev/null; then
    echo "setup-python: installing ${requirements[*]} into $venv" >&2
    "${pip_install[@]}" "${requirements[@]}"
  fi
fi
# Build against the NCCL that PyTorch loads (its nvidia-nccl wheel), as scripts/gpu-check.sh does.
if [ -z "${MOK_NCCL_HOME:-}" ]; then
  nccl_home="$("$python" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)"
  if [ -n "$nccl_home" ] && [ -f "$nccl_home/include/nccl.h" ]; then export MOK_NCCL_HOME="$nccl_home"; fi
fi
echo "setup-python: building and installing mok into $("$python" -c 'import sys; print(sys.prefix)')" >&2
"$python" -m pip install -q --no-build-isolation --no-deps .
# The interpreter, as an absolute path, the only line on stdout (scripts/test.sh reads it); the
# messages above go to stderr so that they stay in the log.
resolved="$(command -v "$python")"
echo "$(cd "$(dirname "$resolved")" && pwd)/$(basename "$resolved")"
