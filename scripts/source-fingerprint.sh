#!/usr/bin/env bash
# Prints a 12-digit fingerprint of the sources that make up a build (CMakeLists.txt, include/,
# src/, tools/, tests/, scripts/). The device machine gets a copy of the working tree whose
# .git may be stale, so `git rev-parse HEAD` there can name an older commit; this names the
# files themselves: run it on the development machine at a commit to match a results.json.
set -euo pipefail
cd "$(dirname "$0")/.."
find CMakeLists.txt include src tools tests scripts -type f \
  \( -name '*.cpp' -o -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.sh' \
  -o -name 'CMakeLists.txt' \) -print0 | LC_ALL=C sort -z | xargs -0 sha256sum |
  sha256sum | cut -c1-12
