#!/usr/bin/env bash
# The measurements left open at the end of session 3, in the order to spend device time on them. Each stage has its
# own time limit so one slow stage cannot eat the rest of a device call (600 s). Run on the device tool with
# carry=[".whl"] (torchao, sageattention, pytest-xdist):
#   bash scripts/gpu_next.sh tests        # ~3 min: the whole GPU suite, 8 workers (TMA bit-identity tests included)
#   bash scripts/gpu_next.sh kernels      # ~6 min: bench gemm (TMA rows), bench attention fwd (TMA rows), bwd (TMA)
#   bash scripts/gpu_next.sh train        # ~8 min: linear bench with torchao, 350m nvfp4 with CUDA graphs, 1.3b
#   bash scripts/gpu_next.sh fsdp         # on nvidia-h200-x2: FSDP2 vs one GPU (scripts/fsdp_check.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/lowbit-next}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
stage() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -60; }
case "${1:-tests}" in
  tests)
    stage 420 env LOWBIT_AUTOTUNE=0 LOWBIT_ATTN_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests -rfE ;;
  kernels)
    stage 200 python3 -m lowbit bench gemm --shapes 16384x4096x4096,16384x4096x14336,8192x8192x8192
    stage 200 python3 -m lowbit bench attention --shapes "4,32,4096,128;2,32,8192,128" --modes bf16/bf16,int8/bf16,int8/fp8 --out "$OUT/attn"
    stage 180 python3 -m lowbit bench attention --backward --shapes "4,32,4096,128" --rep 30 ;;   # with *_tma rows
  train)
    stage 240 python3 -m lowbit bench linear --shapes 16384x4096x4096,16384x4096x14336 --recipes fp8-current,fp8-block
    stage 200 python3 -m lowbit train --model 350m --recipe nvfp4 --steps 40 --batch-size 8 --seq-len 2048 \
      --eval-every 40 --eval-windows 8 --no-progress --out-dir "$OUT/nv350"
    stage 150 python3 -m lowbit train --model 1.3b --recipe fp8-block --steps 20 --batch-size 4 --seq-len 2048 \
      --eval-every 20 --eval-windows 8 --no-progress --compare bf16 --out-dir "$OUT/b13" ;;
  fsdp)
    stage 500 bash scripts/fsdp_check.sh fp8-block 30 ;;
  *) echo "usage: $0 tests|kernels|train|fsdp" >&2; exit 2 ;;
esac
