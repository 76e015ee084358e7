#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu: the GPU suite under
# compute-sanitizer, then the benchmarks behind docs/PERF.md, their JSON written to $1.
#   tools/gpu/run-gpu-tests.sh tools/gpu/perf-run.sh OUTDIR [step-params]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
params=${2:-1G}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
echo "== tiers tests"
build-gpu/tests/tiers_test --gtest_brief=1 2>&1 | tail -3
echo "== compute-sanitizer memcheck over the gpu suite (memory errors only; API errors the"
echo "   suite provokes on purpose and NCCL's probing of other architectures are not reported)"
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
timeout 300 "$cs" --tool memcheck --report-api-errors no --error-exitcode 9 \
  build-gpu/tests/gpu_test --gtest_brief=1 > "$out/memcheck.txt" 2>&1
echo "memcheck exit $?"; tail -3 "$out/memcheck.txt"
echo "== kernels"; $bench kernels --json "$out/kernels.json" 2>/dev/null | tail -10
echo "== pcie"; $bench pcie --json "$out/pcie.json" 2>/dev/null | tail -8
echo "== step, host state"
$bench step --params 256M --state-on host --json "$out/step-host.json" 2>/dev/null | tail -4
echo "== step, NVMe state ($params params, 12 B/param) in /tmp"
(cd /tmp && $bench step --params "$params" --path /tmp --json "$out/step-nvme.json" \
   --trace "$out/step-trace.json" 2>&1 | grep -v "^step: writing" | tail -14)
