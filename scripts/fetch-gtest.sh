#!/usr/bin/env bash
# Copies GoogleTest's sources (Debian's googletest package, /usr/src/googletest) into
# .deps/googletest, so they can be carried to a device machine that has no GoogleTest and no
# network; scripts/gpu-check.sh builds them from there. .deps is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
source_dir="${1:-/usr/src/googletest}"
if [ ! -f "$source_dir/CMakeLists.txt" ]; then
  echo "fetch-gtest: no GoogleTest sources at $source_dir (Debian: apt-get install googletest)" >&2
  exit 1
fi
rm -rf .deps/googletest
mkdir -p .deps
cp -r "$source_dir" .deps/googletest
echo "fetch-gtest: copied $source_dir to .deps/googletest ($(du -sh .deps/googletest | cut -f1))"
