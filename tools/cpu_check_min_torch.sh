#!/usr/bin/env bash
# The CPU test suite under the oldest torch lowbit supports (torch 2.11, the GPU machine's), in its own venv.
# CI runs the CPU suite on torch 2.13 only; Dynamo and AOTAutograd bugs that 2.13 has fixed (e.g. 2.11 zeroing the
# gradient of an autograd.Function whose output is a no-op dtype cast) show up here, not there.
#   bash tools/cpu_check_min_torch.sh                      # the whole CPU suite
#   PYTEST_ARGS="tests/nn/test_compile.py" bash tools/cpu_check_min_torch.sh
# Knobs (this script's own): VENV (default /tmp/lowbit-torch211; about 5 GB: PyPI's torch 2.11 wheel needs its
# CUDA libraries even on a CPU machine), TORCH (default 2.11.0), PYTEST_ARGS (default: tests), WORKERS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/lowbit-torch211}
TORCH=${TORCH:-2.11.0}
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==$TORCH" numpy
  "$VENV/bin/pip" install -q pytest hypothesis ml_dtypes pytest-xdist transformers matplotlib tqdm
fi
PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q -n "${WORKERS:-2}" -p no:cacheprovider \
  -W ignore ${PYTEST_ARGS:-tests}
