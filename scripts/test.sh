#!/usr/bin/env bash
# The test command: set up, build, and run the whole suite under ctest: the C++ suites and the
# Python package's tests (scripts/setup-python.sh installs the package into .venv first). GPU
# tests skip (with a message) on machines without a GPU; scripts/gpu-check.sh runs them on a
# device machine.
set -euo pipefail
cd "$(dirname "$0")/.."
python="$(scripts/setup-python.sh | tail -n 1)"
MOK_CMAKE_ARGS="${MOK_CMAKE_ARGS:-} -DMOK_PYTHON_TEST_EXECUTABLE=$python" scripts/build.sh
cd "${MOK_BUILD_DIR:-build}"
# Say up front when the GPU suite cannot run here (ctest then lists it as skipped).
if ! ./mok_gpu_tests --gtest_list_tests >/dev/null 2>&1; then ./mok_gpu_tests --gtest_list_tests | head -n 1 || true; fi
ctest --output-on-failure --timeout 1800 -j "$(nproc)" "$@"
# The Python suite's summary (ctest shows a test's output only when it fails).
if [ -f Testing/Temporary/LastTest.log ]; then
  echo "python_tests: $(grep -E "[0-9]+ (passed|failed)" Testing/Temporary/LastTest.log | tail -n 1)"
fi
