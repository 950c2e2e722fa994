#!/usr/bin/env bash
# FSDP2 on 2 GPUs against one GPU on the same global batch (issue 7), on a 2-GPU machine:
#   bash tools/fsdp_check.sh [recipe] [steps]        # defaults: fp8-block, 30 steps
# MODEL / SEQ override the preset (125m) and sequence length (1024), e.g. MODEL=tiny SEQ=64 for a quick run.
# Writes $OUT/{fsdp,one}/summary.json (OUT default /tmp/lowbit-fsdp) and prints the per-step train losses side by
# side, their largest relative difference, the final validation losses and the throughputs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/lowbit-fsdp}; mkdir -p "$OUT"
RECIPE=${1:-fp8-block}; STEPS=${2:-30}
COMMON=(--model "${MODEL:-125m}" --recipe "$RECIPE" --steps "$STEPS" --seq-len "${SEQ:-1024}" --eval-every "$STEPS"
        --eval-windows 32 --no-progress --overwrite)
python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m lowbit.train.cli "${COMMON[@]}" \
  --batch-size 8 --fsdp --out-dir "$OUT/fsdp" 2>&1 | grep -v "^\s*$" | tail -6
# one GPU, the same global batch of 16 (graphs off: the FSDP run is eager too)
python3 -m lowbit.train.cli "${COMMON[@]}" --batch-size 16 --cuda-graph off --out-dir "$OUT/one" 2>&1 | tail -4
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
f, o = (json.load(open(f"{out}/{n}/summary.json")) for n in ("fsdp", "one"))
print(f"world {f['world_size']} fsdp={f['fsdp']} global batch {f['global_batch']} "
      f"vs world {o['world_size']} global batch {o['global_batch']}")
a = [l for _, l in f["history"]["train"]]; b = [l for _, l in o["history"]["train"]]
for i, (x, y) in enumerate(zip(a, b), 1):
    print(f"step {i:3d}  fsdp {x:.5f}  one {y:.5f}  diff {x - y:+.2e}")
rel = max(abs(x - y) / abs(y) for x, y in zip(a, b))
print(f"max relative train-loss difference {rel:.2e}; final val fsdp {f['final_val_loss']:.5f} "
      f"one {o['final_val_loss']:.5f}; tokens/s fsdp {f['tokens_per_s']:.0f} one {o['tokens_per_s']:.0f}")
PY
