#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang with ASan + UBSan) and runs each for
# SECONDS (default 60) from its seed corpus; new inputs go to a temporary directory, so the
# repository is not written. A crash, leak or sanitizer report fails it (the input is kept in
# build/fuzz/ as crash-*, leak-* or timeout-*).
#   tools/fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-60}
command -v clang++ >/dev/null || { echo "tools/fuzz.sh: clang++ is needed (apt-get install clang)"; exit 1; }
cmake -S tests/fuzz -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=Debug >/dev/null
cmake --build build/fuzz
for target in config manifest checkpoint plan; do
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  echo "== ${target}_fuzz, ${seconds} s"
  (cd build/fuzz && "./${target}_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=10 \
     -print_final_stats=1 "$work" "../../tests/fuzz/corpus/$target") 2>&1 | tail -12
  rm -rf "$work"
done
