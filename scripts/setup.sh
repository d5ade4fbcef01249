#!/usr/bin/env bash
# Installs what building mok needs, where it is missing: CMake, Ninja, a C++20 compiler and
# GoogleTest from Debian's packages. The CUDA 13 toolkit (nvcc) must already be installed;
# this script says so if it is not. Safe to run again: it installs nothing that is present.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -d "${MOK_GTEST_SOURCE_DIR:-/nonexistent}" ]; then
  missing+=(libgtest-dev)
fi

if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing ${missing[*]} from Debian's packages"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "setup: missing ${missing[*]}; install them (Debian/Ubuntu: apt-get install ${missing[*]})" >&2
    exit 1
  fi
fi

if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "setup: nvcc is not on PATH; add /usr/local/cuda/bin to PATH (scripts do it for you)"
  else
    echo "setup: the CUDA 13 toolkit (nvcc) is required to build mok; install it from NVIDIA" >&2
    exit 1
  fi
fi
