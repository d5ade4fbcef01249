#!/usr/bin/env bash
# Sets up (scripts/setup.sh), configures and builds mok into ${MOK_BUILD_DIR:-build}.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/local/cuda/bin"
scripts/setup.sh
build_dir="${MOK_BUILD_DIR:-build}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release ${MOK_CMAKE_ARGS:-} >/dev/null
cmake --build "$build_dir" -j "$(nproc)"
