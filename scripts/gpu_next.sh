#!/usr/bin/env bash
# What sessions 4-5 (2026-11-23) left for the GPU, in the order to spend device time on it. Each stage has its own
# time limit so one slow stage cannot eat the rest of a device call (600 s). Run on the device tool with
# carry=[".whl"] (torchao, sageattention, pytest-xdist), kind nvidia-h200 (earlier numbers are from H200s):
#   bash scripts/gpu_next.sh verify     # ~4 min: the GPU suite. Session 5 ran it at ef98f8d (289 passed, 1 failed:
#                                       #   the prepass with block_k=24, fixed since) and then got no machine; new
#                                       #   GPU tests written in session 5 (more attention modes, FP16 quantize
#                                       #   inputs, exact tensorwise/rowwise GEMMs) have never run.
#   bash scripts/gpu_next.sh kernels    # ~9 min: bench gemm (Gluon now on by default), quant, attention fwd incl.
#                                       #   int8/fp16 (never timed: 6be20d4's kernel changes), attention bwd
#   bash scripts/gpu_next.sh train      # ~9 min: 1.3b and 350m fp8-block vs BF16 (fused SwiGLU quantization), profile
# Then: AUTO_PV_QUANTIZED = "fp16" if int8/fp16 is as fast as int8/bf16 end to end, and record everything in
# BENCHMARKS.md. Untimed since session 5: the quantize / fused-SwiGLU kernels' amax atomics are now relaxed (compare
# `bench quant` with session 4's table). Leads not built: the fused SwiGLU quantizer moves only 1.3-1.7 TB/s;
# RMSNorm fused with the 1x128 quantizer of LayerNormLinear's input; Block on lowbit.nn.MultiheadAttention.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/lowbit-next}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
stage() { local t=$1; shift; echo "== $* (limit ${t}s)"; timeout "$t" "$@" 2>&1 | tee -a "$OUT/log.txt" | tail -60; }
case "${1:-verify}" in
  verify)
    stage 300 env LOWBIT_AUTOTUNE=0 LOWBIT_ATTN_AUTOTUNE=0 python3 -m pytest -q -p no:cacheprovider -m gpu -n 8 tests -rfE
    stage 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gemm.py -k gluon -rfE ;;
  kernels)
    stage 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/attention/test_gpu.py -k rounding_edges -rfE
    stage 170 python3 -m lowbit bench gemm --shapes 16384x4096x4096,16384x4096x14336,8192x8192x8192
    stage 60 python3 -m lowbit bench quant
    stage 150 python3 -m lowbit bench attention --shapes "4,32,4096,128;2,32,8192,128" --causal no \
      --modes bf16/bf16,int8/bf16,int8/fp16,int8/fp8 --out "$OUT/attn"
    stage 120 python3 -m lowbit bench attention --backward --shapes "4,32,4096,128;8,16,2048,64" --json "$OUT/bwd.json" ;;
  train)
    stage 240 python3 -m lowbit train --model 1.3b --recipe fp8-block --steps 20 --batch-size 4 --seq-len 2048 \
      --eval-every 20 --eval-windows 8 --no-progress --compare bf16 --out-dir "$OUT/b13"
    stage 150 python3 scripts/profile_model.py 1.3b 4 2048 bf16,fp8-block
    stage 150 python3 scripts/profile_model.py 350m 8 2048 bf16,fp8-block ;;
  close)  # session 6: the new tests (every backward tile candidate, the two-round tuner) and the tables the issues ask for
    stage 150 python3 -m pytest -q -p no:cacheprovider -m gpu -n 4 tests/attention_bwd tests/test_quant_kernels.py -rfE
    stage 60 python3 -m lowbit bench quant
    stage 300 python3 -m lowbit bench attention --backward --rounds 2 --rep 50 --json "$OUT/bwd.json"
    stage 90 python3 -m lowbit bench attention --shapes "8,16,2048,64" --causal both \
      --modes bf16/bf16,int8/bf16,int8/fp8 --out "$OUT/attn_d64"
    stage 120 python3 -m lowbit bench attention --shapes "4,32,4096,128;2,32,8192,128" --causal yes \
      --modes bf16/bf16,int8/bf16,int8/fp8 --out "$OUT/attn_causal" ;;
  *) echo "usage: $0 verify|kernels|train|close" >&2; exit 2 ;;
esac
