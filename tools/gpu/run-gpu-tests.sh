#!/usr/bin/env bash
# On the GPU machine (no package registry there): unpack the Debian packages carried in .deps/
# (made here by ../shared/gpu-machine/prepare-debs.sh) into a prefix, build, run the gpu-labelled
# tests, then any extra command given as arguments (e.g. a benchmark), with the same environment.
# Exits with the tests' status, or the extra command's when the tests passed.
# ONLY_TARGET=T builds just target T (e.g. _zoffload, the Python module) and runs no tests.
#   tools/gpu/run-gpu-tests.sh [command ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
P=/opt/deps
mkdir -p "$P"
for f in .deps/*.deb; do dpkg -x "$f" "$P"; done
export LD_LIBRARY_PATH="$P/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export PKG_CONFIG_PATH="$P/usr/lib/x86_64-linux-gnu/pkgconfig:$P/usr/share/pkgconfig"
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE=-O3 \
  -DCMAKE_PREFIX_PATH="$P/usr" -DCMAKE_CUDA_ARCHITECTURES=90 > build-gpu.log 2>&1 \
  || { cat build-gpu.log; exit 1; }
cmake --build build-gpu -j16 ${ONLY_TARGET:+--target "$ONLY_TARGET"} >> build-gpu.log 2>&1 \
  || { tail -50 build-gpu.log; exit 1; }
tests=0
[ -n "${ONLY_TARGET:-}" ] || ctest --test-dir build-gpu -L gpu --output-on-failure || tests=$?
extra=0
if [ $# -gt 0 ]; then "$@" || extra=$?; fi
exit $((tests != 0 ? tests : extra))
