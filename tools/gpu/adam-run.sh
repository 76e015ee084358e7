#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu: CPU optimizer
# benchmarks (every precision path, the rules, the anchors: torch's fused AdamW and, when .whl
# was carried (tools/gpu/prepare-wheels.sh), DeepSpeed's cpu_adam), their JSON written to $1.
#   tools/gpu/run-gpu-tests.sh tools/gpu/adam-run.sh OUTDIR
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
echo "== cpu_adam tests"; build-gpu/tests/cpu_adam_test --gtest_brief=1 2>&1 | tail -2
echo "== torch and DeepSpeed anchors"
if [ -d .whl/site ]; then
  # DeepSpeed's CPU accelerator: its cpu_adam op compiles without CUDA.
  export PYTHONPATH="$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cpu
fi
python3 bench/adam_vs_torch.py --params 256M --steps 7 --build build-gpu \
  --json "$out/adam_vs_torch.json" 2>&1 | tail -12
echo "== every path, three processes"
for i in 1 2 3; do
  $bench adam --params 256M --grad-dtype fp32,bf16 --state fp32,bf16,int8 --param-copy none,bf16 \
    --steps 15 --json "$out/adam_paths_round$i.json" 2>/dev/null | tail -14
done
echo "== rules"
$bench adam --params 256M --grad-dtype bf16 --state fp32,bf16 --param-copy bf16 \
  --rule adam,adagrad,lion --steps 7 --json "$out/adam_rules.json" 2>/dev/null | tail -8
