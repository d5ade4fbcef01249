#!/usr/bin/env bash
# Keeps what QuACK saved in a device call (scripts/sonic-env.sh) for the next machine:
#   quack-autotune.tgz  its autotuning results, merged into scripts/quack-autotune/ (commit the
#                       folder), from gpu-bench.sh or gpu-check.sh with MOK_SAVE_QUACK_AUTOTUNE=1;
#   quack-objects.tgz   its compiled kernels, merged into .deps/quack-autotune/quack-objects.tgz
#                       (object code stays out of the repository: carry .deps/quack-autotune
#                       beside .deps/peers, within the device's carry limit).
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: $0 path/to/quack-autotune.tgz [path/to/quack-objects.tgz]" >&2; exit 2; }
source "$(dirname "$0")/sonic-env.sh"
for archive in "$@"; do
  [ -f "$archive" ] || { echo "$0: no file $archive" >&2; exit 2; }
  case "$(basename "$archive")" in
    quack-objects*.tgz) sonic_keep_objects "$archive" ;;
    *) sonic_keep_autotune "$archive" ;;
  esac
done
