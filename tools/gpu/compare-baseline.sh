#!/usr/bin/env bash
# On the GPU machine: the 7B bench of this tree against a baseline tree (the same command on
# another commit), in one call, alternating, so both figures come from the same card.
# The baseline's sources are carried in .baseline/ (made here, before the call, by
#   rm -rf .baseline && mkdir .baseline && git archive REV | tar -x -C .baseline
# and passed in `carry` with .deps and .whl). Builds the Python module of both (this tree in
# build-gpu, the baseline in .baseline/build-gpu), then runs bench/finetune_7b.py's $SYSTEMS
# (default: zoffload none and backward, fp32 state; 24 GiB cap, 32 layers, $STEPS steps)
# $ROUNDS times (default 2) for each tree. JSON into OUTDIR/{current,baseline}_<round>.
#   tools/gpu/run-gpu-tests.sh is not needed first:
#   tools/gpu/compare-baseline.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${1:?output directory}")
mkdir -p "$out"
[ -d .baseline ] || { echo "no .baseline/ (see the header)"; exit 2; }
P=/opt/deps
mkdir -p "$P"
for f in .deps/*.deb; do dpkg -x "$f" "$P"; done
export LD_LIBRARY_PATH="$P/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
export PKG_CONFIG_PATH="$P/usr/lib/x86_64-linux-gnu/pkgconfig:$P/usr/share/pkgconfig"
build() {  # source dir
  cmake -S "$1" -B "$1/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE=-O3 -DCMAKE_PREFIX_PATH="$P/usr" -DCMAKE_CUDA_ARCHITECTURES=90 \
    > "$out/build_$2.txt" 2>&1 &&
    cmake --build "$1/build-gpu" -j16 --target _zoffload >> "$out/build_$2.txt" 2>&1 ||
    { tail -30 "$out/build_$2.txt"; return 1; }
}
echo "== build (current, baseline)"
build . current || exit 1
build .baseline baseline || exit 1
systems=${SYSTEMS:-zoffload:none:fp32,zoffload:backward:fp32}
top=$PWD
for round in $(seq 1 "${ROUNDS:-2}"); do
  for tree in current baseline; do
    root=$top
    [ "$tree" = baseline ] && root=$top/.baseline
    echo "== round $round: $tree"
    (cd "$root" && PYTHONPATH=$root/build-gpu/python:$top/.whl/site python3 bench/finetune_7b.py \
      --systems "$systems" --layers 32 --steps "${STEPS:-6}" --timeout 240 \
      --out "$out/${tree}_$round" --nvme-dir "$top/.nvme") 2>&1 | grep -v "^  .* step [3-9]"
  done
done
