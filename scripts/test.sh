#!/usr/bin/env bash
# The test command: set up, build, and run the whole suite under ctest. GPU tests skip (with a
# message) on machines without a GPU; scripts/gpu-check.sh runs them on a device machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
cd "${MOK_BUILD_DIR:-build}"
ctest --output-on-failure --timeout 1200 -j "$(nproc)" "$@"
