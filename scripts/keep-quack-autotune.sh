#!/usr/bin/env bash
# Merges the QuACK autotuning results a device call returned (quack-autotune.tgz, from
# gpu-bench.sh or gpu-check.sh with MOK_SAVE_QUACK_AUTOTUNE=1) into scripts/quack-autotune/, which
# seeds SonicMoE's autotuning on the next device machine (scripts/sonic-env.sh). Commit the folder.
set -euo pipefail
[ $# -eq 1 ] && [ -f "$1" ] || { echo "usage: $0 path/to/quack-autotune.tgz" >&2; exit 2; }
source "$(dirname "$0")/sonic-env.sh"
sonic_keep_autotune "$1"
