#!/usr/bin/env bash
# GPU check for the quantization and GEMM kernels (issue 3): bit-identity / tolerance tests, then
# both benchmarks. Usage: scripts/gpu_check_kernels.sh [OUTDIR]   (default OUTDIR: $OUT or .)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUTDIR="${1:-${OUT:-.}}"
mkdir -p "$OUTDIR"
rc=0
# Tests use the first (default) launch config of each kernel: autotuning every test shape would
# spend minutes compiling; the benchmarks autotune.
LOWBIT_AUTOTUNE=0 python -m pytest -q -s -p no:cacheprovider -m gpu tests/test_quant_kernels.py tests/test_gemm.py \
    2>&1 | tee "$OUTDIR/test_kernels.log" || rc=1
python -m lowbit.bench.quant --markdown "$OUTDIR/bench_quant.md" 2>&1 | tee "$OUTDIR/bench_quant.log" || rc=1
python -m lowbit.bench.gemm --markdown "$OUTDIR/bench_gemm.md" 2>&1 | tee "$OUTDIR/bench_gemm.log" || rc=1
exit $rc
