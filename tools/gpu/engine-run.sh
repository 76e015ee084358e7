#!/usr/bin/env bash
# On the GPU machine, after tools/gpu/run-gpu-tests.sh has built build-gpu, any of:
#   memcheck  the GPU tests of the engine, the tensor store and the copy engine under
#             compute-sanitizer, and the engine's GPU tests 5 times over;
#   python    tests/python (CUDA cases included) and examples/finetune.py (GPT-2 small shape,
#             50 steps) with zoffload and with the torch fp32-master reference;
#   1g, 7b    zoffload-bench engine at 1G params and at a 7B model's size (6.74B params,
#             291 tensors, backward stand-in of 670 ms), 16 threads;
#   finetune  bench/finetune_7b.py: the systems in $SYSTEMS (default: all), 24 GiB cap,
#             $LAYERS layers (default 32), $ACCUM micro-batches (default 1), $BATCH x $SEQ
#             tokens (default 4 x 2048), GPU cap $CAP (default 24GiB; none: uncapped), JSON, table
#             and plots into OUTDIR/ft7b; TRACE=1: each zoffload system's timeline too, and
#             its summary (tools/trace_overlap.py).
#   scale     the largest model each $SYSTEMS (default zoffload:none:int8:params, the
#             parameters offloaded) trains under the 24 GiB cap: bench/finetune_7b.py at each
#             of $SCALE_LAYERS (default 40 48 56 60) layers, 4 steps, up to the first failure;
#             JSON into OUTDIR/scale_L<layers>. Systems with pnvme or nvmeR (NVMe) keep their
#             files under $NVME_DIR (default: .nvme here, off OUTDIR).
#   fetch     bench/param_fetch_bench on this disk ($NVME_DIR): the share of stage 3's NVMe
#             parameter reads the read-ahead hides (32 layers of 64 MiB, cache of 4 layers).
# Output and JSON into OUTDIR.
#   tools/gpu/run-gpu-tests.sh tools/gpu/engine-run.sh OUTDIR [memcheck] [python] [1g] [7b] [finetune] [scale] [fetch]
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:?output directory}
shift
parts=${*:-memcheck python 1g 7b}
mkdir -p "$out"
bench=$PWD/build-gpu/tools/zoffload-bench
cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
memcheck() {  # name binary filter
  timeout 400 "$cs" --tool memcheck --report-api-errors no --error-exitcode 9 \
    "build-gpu/tests/$2" --gtest_filter="$3" --gtest_brief=1 > "$out/memcheck_$1.txt" 2>&1
  echo "memcheck $1: exit $?"; tail -3 "$out/memcheck_$1.txt"
}
if [[ $parts == *memcheck* ]]; then
  echo "== compute-sanitizer memcheck"
  memcheck engine engine_test '*EngineGpu*'
  memcheck tiers tiers_test 'TensorStoreGpu.*:*/gpu'
  memcheck copies gpu_test 'CopyEngine*'
  echo "== the engine's GPU tests, 5 times over (timing-dependent faults)"
  build-gpu/tests/engine_test --gtest_filter='*EngineGpu*' --gtest_repeat=5 --gtest_brief=1 2>&1 | tail -3
fi
if [[ $parts == *python* ]]; then
  export PYTHONPATH=$PWD/build-gpu/python:$PWD/.whl/site
  echo "== the Python module: first calls, without and with torch loaded first"
  probe='import zoffload; print("parse_config:", len(zoffload.load_config({})), "bytes")'
  timeout 60 python3 -X faulthandler -c "$probe" 2>&1 | tail -3
  timeout 60 python3 -X faulthandler -c "import torch; $probe" 2>&1 | tail -3
  # A crash's native stack: a preloaded SIGSEGV/SIGABRT handler prints the frames, and addr2line
  # names those inside our libraries.
  printf '%s\n' '#include <execinfo.h>' '#include <signal.h>' \
    'static void h(int s){void*f[64];backtrace_symbols_fd(f,backtrace(f,64),2);signal(s,SIG_DFL);raise(s);}' \
    '__attribute__((constructor)) static void i(void){signal(SIGSEGV,h);signal(SIGABRT,h);}' \
    > "$out/segv.c"
  cc -shared -fPIC -o "$out/segv.so" "$out/segv.c"
  LD_PRELOAD=$out/segv.so timeout 60 python3 -c "import torch; $probe" > "$out/crash.txt" 2>&1
  echo "with torch first, under the stack printer: exit $?"
  grep -oE "[^ ]*(libzoffload|_zoffload)[^(]*\(\+0x[0-9a-f]+\)" "$out/crash.txt" | head -12 \
    | while IFS='(' read -r lib off; do addr2line -f -C -e "$lib" "${off%)}" | paste -sd' '; done
  grep -E "^\S+\(" "$out/crash.txt" | head -16
  LD_DEBUG=bindings timeout 60 python3 -c "import torch; $probe" 2> "$out/bindings.txt" >/dev/null
  echo "symbols of our libraries bound into torch's: $(grep "binding file .*zoffload" \
    "$out/bindings.txt" | grep -c "to .*torch")"
  echo "== the Python module: tests/python (host mode and CUDA)"
  timeout 300 python3 -X faulthandler -m pytest -v -p no:cacheprovider tests/python \
    > "$out/pytest.txt" 2>&1
  echo "pytest exit $?"; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed|Fatal|Error" "$out/pytest.txt" | head -30
  echo "== examples/finetune.py: GPT-2 small shape, random init, 50 steps; zoffload, then torch"
  for mode in zoffload reference; do
    flag=$([ $mode = reference ] && echo --reference || true)
    timeout 300 python3 -X faulthandler examples/finetune.py $flag > "$out/finetune_$mode.txt" 2>&1
    echo "exit $?"; tail -1 "$out/finetune_$mode.txt"
  done
  unset PYTHONPATH
fi
if [[ $parts == *1g* ]]; then
  echo "== engine, 1G params"
  $bench engine --params 1G --tensors 72 --grad-ms 100 --threads 16 \
    --json "$out/engine_1g.json" --trace "$out/engine_1g_trace.json" 2>&1 | tail -9
fi
if [[ $parts == *7b* ]]; then
  echo "== engine, 6.74B params (a 7B model)"
  $bench engine --params 6738415616 --tensors 291 --grad-ms 670 --threads 16 \
    --json "$out/engine_7b.json" 2>&1 | tail -14
fi
if [[ $parts == *finetune* ]]; then
  echo "== bench/finetune_7b.py (${SYSTEMS:-all systems}, ${LAYERS:-32} layers)"
  PYTHONPATH=$PWD/build-gpu/python:$PWD/.whl/site python3 bench/finetune_7b.py \
    ${SYSTEMS:+--systems "$SYSTEMS"} --layers "${LAYERS:-32}" --steps "${STEPS:-6}" \
    --accumulation "${ACCUM:-1}" --batch "${BATCH:-4}" --seq "${SEQ:-2048}" \
    --gpu-mem-cap "${CAP:-24GiB}" \
    --timeout "${SYSTEM_TIMEOUT:-240}" --out "$out/ft7b" \
    --nvme-dir "${NVME_DIR:-$PWD/.nvme}" \
    ${TRACE:+--trace} 2>&1 | grep -v "^  .* step [3-9]"
  for t in "$out"/ft7b/*_trace.json; do [ -e "$t" ] && python3 tools/trace_overlap.py "$t" | tail -12; done
fi
if [[ $parts == *scale* ]]; then
  for layers in ${SCALE_LAYERS:-40 48 56 60}; do
    echo "== scale: ${layers} layers (${SYSTEMS:-zoffload:none:int8:params})"
    PYTHONPATH=$PWD/build-gpu/python:$PWD/.whl/site python3 bench/finetune_7b.py \
      --systems "${SYSTEMS:-zoffload:none:int8:params}" --layers "$layers" --steps 4 \
      --timeout "${SYSTEM_TIMEOUT:-300}" --out "$out/scale_L$layers" \
      --nvme-dir "${NVME_DIR:-$PWD/.nvme}" 2>&1 | grep -E "^\||FAILED"
    grep -q '"failed": true' "$out/scale_L$layers/finetune_7b.json" 2>/dev/null && break
  done
fi
if [[ $parts == *fetch* ]]; then
  echo "== stage 3 parameters on NVMe: the read-ahead"
  mkdir -p "${NVME_DIR:-$PWD/.nvme}"
  build-gpu/bench/param_fetch_bench "${NVME_DIR:-$PWD/.nvme}" 32 64 20 4 3 2>&1 | tee "$out/param_fetch.txt"
fi
