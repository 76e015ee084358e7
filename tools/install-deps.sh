#!/usr/bin/env bash
# Installs every Debian package zoffload builds, tests and benchmarks with.
# Idempotent: installs only what is missing. Runs as root (or through sudo) on Debian 12.
# The CUDA toolkit (nvcc, NCCL) is optional and not a Debian package here: when
# /usr/local/cuda is present the build uses it, otherwise the library is CPU-only.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libhwloc-dev libboost-dev nlohmann-json3-dev libhwy-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fio
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "install-deps: need root or sudo to install: ${missing[*]}" >&2; exit 1; }
  sudo=sudo
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install-deps: done"
