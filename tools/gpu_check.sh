#!/usr/bin/env bash
# The whole GPU suite (pytest -m gpu) plus the key benchmarks, in one command on a CUDA machine.
#   bash tools/gpu_check.sh                                             # everything: all gpu tests + all benches
#   GPU_TESTS="tests/nn tests/train" BENCHES="linear" bash tools/gpu_check.sh    # a subset
# Knobs (this script's own, not library switches):
#   GPU_TESTS     test paths for pytest (default: tests)
#   PYTEST_ARGS   extra pytest arguments, e.g. "-x -k gemm"
#   TEST_TIMEOUT  seconds for the test run (default 1800)
#   GPU_WORKERS   pytest-xdist workers where xdist is installed (default 8: a fresh machine spends most of the suite
#                 compiling kernels, which parallel workers spread over the CPU cores; 0 for one process)
#   BENCHES       benches to run, of: quant gemm linear attention attention_bwd optim (default all; "" for none)
#   OUT           log directory (default /tmp/lowbit-gpu)
# Wheels in .whl/ (peers: torchao, sageattention; pytest-xdist) are installed first when present. Exits 1 if any
# step failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lowbit-gpu}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name())"
python3 -m lowbit info | tee "$OUT/info.txt"
rc=0
WORKERS=""
if [ "${GPU_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then WORKERS="-n ${GPU_WORKERS:-8}"; fi
# Tests run each kernel's first launch config: autotuning every test shape would spend minutes compiling.
# shellcheck disable=SC2086  # (GPU_TESTS / PYTEST_ARGS are word lists)
LOWBIT_AUTOTUNE=0 timeout "${TEST_TIMEOUT:-1800}" \
  python3 -m pytest -q -p no:cacheprovider $WORKERS -m gpu ${GPU_TESTS:-tests} ${PYTEST_ARGS:-} 2>&1 \
  | tee "$OUT/gpu_tests.log" || rc=1
for b in ${BENCHES-quant gemm linear attention attention_bwd optim}; do
  case $b in
    attention_bwd) python3 -m lowbit bench attention --backward 2>&1 | tee "$OUT/bench_$b.log" || rc=1 ;;
    *) python3 -m lowbit bench "$b" 2>&1 | tee "$OUT/bench_$b.log" || rc=1 ;;
  esac
done
exit $rc
