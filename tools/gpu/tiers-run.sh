#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu: the tiered store's
# GPU cases under compute-sanitizer, then NVMe optimizer steps (bf16 and fp32 state) in /tmp,
# their JSON and traces written to $1.
#   tools/gpu/run-gpu-tests.sh tools/gpu/tiers-run.sh OUTDIR [step-params]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
params=${2:-1G}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
echo "== compute-sanitizer memcheck over the tiered store's GPU cases"
timeout 300 "$cs" --tool memcheck --report-api-errors no --error-exitcode 9 \
  build-gpu/tests/tiers_test --gtest_filter='TensorStoreGpu.*:*/gpu' --gtest_brief=1 \
  > "$out/tiers_memcheck.txt" 2>&1
echo "memcheck exit $?"; tail -3 "$out/tiers_memcheck.txt"
for state in bf16 fp32; do
  echo "== step, NVMe $state state, $params params, in /tmp"
  (cd /tmp && $bench step --params "$params" --state "$state" --path /tmp \
     --json "$out/step-nvme-$state.json" --trace "$out/step-trace-$state.json" 2>&1 \
     | grep -v "^step: writing" | tail -14)
done
