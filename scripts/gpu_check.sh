#!/usr/bin/env bash
# The whole GPU suite plus the key benchmarks, in one call on the device machine.
# Usage (device tool): bash scripts/gpu_check.sh   -> logs under ${OUT:-/tmp/lowbit-gpu}
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/lowbit-gpu}; mkdir -p "$OUT"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m lowbit info | tee "$OUT/info.txt"
rc=0
python3 -m pytest -q -m gpu -x tests 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
for b in ${LOWBIT_BENCHES:-quant gemm linear attention}; do
  python3 -m lowbit bench $b 2>&1 | tee "$OUT/bench_$b.log" || rc=1
done
exit $rc
