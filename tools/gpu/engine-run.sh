#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu: the GPU tests of
# the engine, the tensor store and the copy engine under compute-sanitizer, then
# zoffload-bench engine at 1G params and/or at a 7B model's size (6.74B params, 291 tensors,
# backward stand-in of 670 ms, 16 threads), JSON into OUTDIR.
#   tools/gpu/run-gpu-tests.sh tools/gpu/engine-run.sh OUTDIR [1g] [7b]   (default: both)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
shift
sizes=${*:-1g 7b}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
memcheck() {  # name binary filter
  timeout 400 "$cs" --tool memcheck --report-api-errors no --error-exitcode 9 \
    "build-gpu/tests/$2" --gtest_filter="$3" --gtest_brief=1 > "$out/memcheck_$1.txt" 2>&1
  echo "memcheck $1: exit $?"; tail -3 "$out/memcheck_$1.txt"
}
if [[ $sizes == *1g* ]]; then
  echo "== compute-sanitizer memcheck"
  memcheck engine engine_test '*EngineGpu*'
  memcheck tiers tiers_test 'TensorStoreGpu.*:*/gpu'
  memcheck copies gpu_test 'CopyEngine*'
  echo "== the engine's GPU tests, 5 times over (timing-dependent faults)"
  build-gpu/tests/engine_test --gtest_filter='*EngineGpu*' --gtest_repeat=5 --gtest_brief=1 2>&1 | tail -3
  echo "== the Python module on CUDA (and host mode)"
  PYTHONPATH=build-gpu/python python3 -m pytest -q -p no:cacheprovider tests/python 2>&1 | tail -4
  echo "== examples/finetune.py: GPT-2 small shape, random init, 50 steps; zoffload, then torch"
  for mode in zoffload reference; do
    flag=$([ $mode = reference ] && echo --reference || true)
    PYTHONPATH=build-gpu/python timeout 300 python3 examples/finetune.py $flag \
      > "$out/finetune_$mode.txt" 2>&1
    tail -1 "$out/finetune_$mode.txt"
  done
  echo "== engine, 1G params"
  $bench engine --params 1G --tensors 72 --grad-ms 100 --threads 16 \
    --json "$out/engine_1g.json" --trace "$out/engine_1g_trace.json" 2>&1 | tail -9
fi
if [[ $sizes == *7b* ]]; then
  echo "== engine, 6.74B params (a 7B model)"
  $bench engine --params 6738415616 --tensors 291 --grad-ms 670 --threads 16 \
    --json "$out/engine_7b.json" 2>&1 | tail -14
fi
