#!/usr/bin/env bash
# Copies the peers' wheels and their benchmark helper (../shared/peers, see its README) into the
# git-ignored .deps/peers, so that a device call can carry them: scripts/gpu-bench.sh and
# scripts/gpu-check.sh install SonicMoE from .deps/peers/wheels into a private folder for the
# benchmark step (scripts/sonic-env.sh). Carry `.deps` (with .deps/googletest from
# scripts/fetch-gtest.sh) to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
source_dir="${1:-../shared/peers}"
if ! ls "$source_dir"/wheels/*.whl >/dev/null 2>&1; then
  echo "fetch-peers: no wheels under $source_dir/wheels (the peers folder: ../shared/peers)" >&2
  exit 1
fi
rm -rf .deps/peers
mkdir -p .deps/peers
cp -r "$source_dir"/wheels .deps/peers/wheels
cp "$source_dir"/sonic_bench.py .deps/peers/
echo "fetch-peers: copied $source_dir's wheels and sonic_bench.py to .deps/peers ($(du -sh .deps/peers | cut -f1))"
