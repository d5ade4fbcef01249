#!/usr/bin/env bash
# The main job: set up, build, and run `mok run` with the given arguments (default shape: tiny
# without a GPU). On a machine with a GPU it runs the GPU path; without one, the CPU reference.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh >&2
exec "${MOK_BUILD_DIR:-build}/mok" run "$@"
