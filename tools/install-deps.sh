#!/usr/bin/env bash
# Installs every Debian package zoffload builds, tests and benchmarks with.
# Idempotent: installs only what is missing. Runs as root (or through sudo) on Debian 12.
# The CUDA toolkit (nvcc, NCCL) is optional and not a Debian package here: when
# /usr/local/cuda is present the build uses it, otherwise the library is CPU-only.
#   tools/install-deps.sh [--python]
# --python also makes .venv/ (git-ignored) with what the Python module and its tests need from
# PyPI (nanobind, scikit-build-core, numpy, pytest, torch, transformers, accelerate,
# safetensors, matplotlib); the build then finds it there.
set -euo pipefail
cd "$(dirname "$0")/.."

python=false
for arg in "$@"; do
  case "$arg" in
    --python) python=true ;;
    *) echo "usage: tools/install-deps.sh [--python]" >&2; exit 2 ;;
  esac
done

packages=(
  build-essential cmake ninja-build pkg-config git
  liburing-dev libhwloc-dev libboost-dev nlohmann-json3-dev libhwy-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  fio
  clang  # libFuzzer, for tools/fuzz.sh
)
$python && packages+=(python3-dev python3-venv)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
else
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
fi

if $python; then
  wanted=(nanobind scikit-build-core numpy pytest "torch>=2.1" transformers accelerate safetensors
          matplotlib)
  if [ -x .venv/bin/python ] && .venv/bin/python -c "import nanobind, numpy, pytest, torch, transformers, accelerate, safetensors, matplotlib" 2>/dev/null; then
    echo "install-deps: .venv has the Python packages"
  else
    echo "install-deps: making .venv with ${wanted[*]} (torch from PyPI: a few GB, a few minutes)"
    python3 -m venv .venv
    .venv/bin/pip install -q --disable-pip-version-check "${wanted[@]}"
    echo "install-deps: .venv ready"
  fi
fi
