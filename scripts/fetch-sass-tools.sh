#!/usr/bin/env bash
# Installs cuobjdump and nvdisasm (NVIDIA's wheels on the Python package index, pinned) into
# .deps/sass-tools, for reading the kernels' SASS on a machine whose CUDA toolkit lacks them (the
# CPU machines: nvcc and ptxas only). `export PATH="$PATH:$PWD/.deps/sass-tools"`, then e.g.
# `cuobjdump -sass build/CMakeFiles/mok_core.dir/src/kernels/gemm/fp8_gemm.cu.o` or
# scripts/sass_yield.py. The device machines' toolkit has both. .deps is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
version=13.2.51  # the oldest 13.x on the index; it reads nvcc 13.0's sm_90a code
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip install -q --no-cache-dir --no-deps --target "$work" \
  "nvidia-cuda-cuobjdump==$version" "nvidia-cuda-nvdisasm==$version"
mkdir -p .deps/sass-tools
find "$work" -type f \( -name cuobjdump -o -name nvdisasm \) -exec cp {} .deps/sass-tools/ \;
chmod +x .deps/sass-tools/*
for tool in cuobjdump nvdisasm; do
  [ -x ".deps/sass-tools/$tool" ] || { echo "fetch-sass-tools: no $tool in the wheels" >&2; exit 1; }
done
echo "fetch-sass-tools: cuobjdump and nvdisasm $version in .deps/sass-tools"
