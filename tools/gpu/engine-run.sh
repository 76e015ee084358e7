#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu: the engine's GPU
# tests under compute-sanitizer, then zoffload-bench engine at 1G params and at a 7B model's
# size (6.74B params, 291 tensors, backward stand-in of 670 ms, 16 threads), JSON into $1.
#   tools/gpu/run-gpu-tests.sh tools/gpu/engine-run.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
echo "== compute-sanitizer memcheck over the engine's GPU tests"
timeout 400 "$cs" --tool memcheck --report-api-errors no --error-exitcode 9 \
  build-gpu/tests/engine_test --gtest_filter='*EngineGpu*' --gtest_brief=1 \
  > "$out/engine_memcheck.txt" 2>&1
echo "memcheck exit $?"; tail -4 "$out/engine_memcheck.txt"
echo "== the engine's GPU tests, 5 times over (timing-dependent faults)"
build-gpu/tests/engine_test --gtest_filter='*EngineGpu*' --gtest_repeat=5 --gtest_brief=1 2>&1 | tail -3
echo "== engine, 1G params"
$bench engine --params 1G --tensors 72 --grad-ms 100 --threads 16 \
  --json "$out/engine_1g.json" --trace "$out/engine_1g_trace.json" 2>&1 | tail -9
echo "== engine, 6.74B params (a 7B model)"
$bench engine --params 6738415616 --tensors 291 --grad-ms 670 --threads 16 \
  --json "$out/engine_7b.json" 2>&1 | tail -14
