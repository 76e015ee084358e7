#!/usr/bin/env bash
# On the GPU machine, inside one device call: build only what the GPU tests need (the
# gpu-labelled test binaries and the Python module), run `ctest -L gpu`, then the Python tests
# that use CUDA (tests/python/test_torch_gpu.py: the engine on CUDA, clip_grad_norm_, the HF
# Trainer in bf16) and both import orders with the machine's torch. Output into OUTDIR.
#   ONLY_TARGET=_zoffload tools/gpu/run-gpu-tests.sh tools/gpu/quick-check.sh OUTDIR
# (run-gpu-tests.sh unpacks .deps and sets the environment; ONLY_TARGET keeps it from building
# and testing everything itself.)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
mkdir -p "$out"
echo "== build: the gpu-labelled tests"
timeout 300 cmake --build build-gpu -j16 --target engine_test zero_test tiers_test gpu_test \
  > "$out/build.txt" 2>&1 || { tail -30 "$out/build.txt"; exit 1; }
echo "== ctest -L gpu"
timeout 240 ctest --test-dir build-gpu -L gpu --output-on-failure > "$out/ctest.txt" 2>&1
echo "ctest exit $?"
grep -E "tests passed|tests failed|\(Failed\)|\(Timeout\)|\*\*\*" "$out/ctest.txt" | head -30
echo "== tests/python on CUDA"
export PYTHONPATH=$PWD/build-gpu/python:$PWD/.whl/site
(cd tests/python && timeout 200 python3 -m pytest -q -p no:cacheprovider test_torch_gpu.py \
  "test_reliability.py::test_both_import_orders_work" > "$out/pytest.txt" 2>&1)
echo "pytest exit $?"
grep -E "passed|failed|^FAILED|^E " "$out/pytest.txt" | head -20
