#!/usr/bin/env bash
# Here (PyPI reachable; torch installed, which DeepSpeed's setup imports): DeepSpeed, torchao,
# pytest and the packages they need beyond what the GPU machine's Python 3.12 has, unpacked into
# .whl/site (git-ignored). Carry .whl with .deps; the tools/gpu/*-run.sh scripts put it on
# PYTHONPATH (bench/adam_vs_torch.py and bench/finetune_7b.py measure DeepSpeed and torchao there;
# DeepSpeed's cpu_adam op compiles on first use).
#   tools/gpu/prepare-wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download -q --no-deps --no-binary=:all: -d "$tmp" deepspeed==0.19.8
pip wheel -q --no-deps --no-build-isolation -w "$tmp/wheels" "$tmp"/deepspeed-0.19.8.tar.gz
pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$tmp/wheels" \
  einops==0.8.2 hjson==3.1.0 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2 py-cpuinfo==9.0.0 \
  pydantic==2.14.4 pydantic-core==2.50.5 typing-extensions==4.16.0 annotated-types==0.8.0 \
  typing-inspection==0.4.5 tqdm==4.70.1 torchao==0.17.0 \
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==25.0 accelerate==1.16.0
rm -rf .whl/site
mkdir -p .whl/site
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" .whl/site; done
echo "wrote .whl/site ($(du -sh .whl/site | cut -f1)); carry .whl to the GPU machine"
