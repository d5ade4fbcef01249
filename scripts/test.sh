#!/usr/bin/env bash
# The test command: set up, build, and run the whole suite under ctest. GPU tests skip (with a
# message) on machines without a GPU; scripts/gpu-check.sh runs them on a device machine.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
cd "${MOK_BUILD_DIR:-build}"
# Say up front when the GPU suite cannot run here (ctest then lists it as skipped).
if ! ./mok_gpu_tests --gtest_list_tests >/dev/null 2>&1; then ./mok_gpu_tests --gtest_list_tests | head -n 1 || true; fi
ctest --output-on-failure --timeout 1200 -j "$(nproc)" "$@"
