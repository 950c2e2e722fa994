"""Where a graphed training step's wall time goes beyond its GPU work (issue 7 diagnostic).

Runs ``lowbit train`` in this process with the training loop unchanged (lookahead on), records a CUDA event on the
stream right before each step's first graph replay, and prints, per step: the wall time between launches on the
host, the GPU's period (event to event: the step's GPU work plus any idle before the next replay), and the GPU time
of the step's graphs alone (events around them). A GPU period longer than the graphs' time means the GPU waited
for the host; equal periods with graphs slower than a lone profiled step point at clocks. ``nvidia-smi`` samples the
SM clock and power every 100 ms in the background meanwhile (if it is on the PATH).

    python scripts/step_clock.py --model 1.3b --recipe fp8-block --steps 40 --batch-size 4 --seq-len 2048
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from lowbit.train import cli as tcli
from lowbit.train import loop


def main() -> int:
    p = tcli.add_train_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    args = p.parse_args()
    starts, ends, walls = [], [], []
    orig = loop._GraphedStep.replay

    def replay(self, mark=None):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        walls.append(time.perf_counter())
        out = orig(self, mark)
        e.record()
        starts.append(s)
        ends.append(e)
        return out

    loop._GraphedStep.replay = replay
    smi = None
    log = tempfile.NamedTemporaryFile("w+", suffix=".csv")
    if shutil.which("nvidia-smi"):
        smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                                "--format=csv,noheader", "-lms", "100"], stdout=log, stderr=subprocess.DEVNULL)
    try:
        summary = tcli.run_train(args)
    finally:
        if smi is not None:
            smi.terminate()
            smi.wait()
    n = len(starts)
    if not n:
        print("no graph replays (CPU, or graphs off): nothing to time")
        return 1
    torch.cuda.synchronize()
    period = [starts[i].elapsed_time(starts[i + 1]) for i in range(n - 1)]
    graphs = [starts[i].elapsed_time(ends[i]) for i in range(n)]
    wall = [1e3 * (walls[i + 1] - walls[i]) for i in range(n - 1)]
    print(f"{args.recipe}: {n} replays; tokens/s {summary.get('tokens_per_s') or 0:,.0f}")
    print(f"{'replay':>6} {'host launch-to-launch ms':>25} {'GPU period ms':>14} {'graphs ms':>10}")
    for i in range(n - 1):
        print(f"{i:>6} {wall[i]:>25.2f} {period[i]:>14.2f} {graphs[i]:>10.2f}")
    k = slice(2, None)  # steady state: past the first replays
    if len(period) > 3:
        print(f"median (replay 2 on): host {statistics.median(wall[k]):.2f}  GPU period {statistics.median(period[k]):.2f}"
              f"  graphs {statistics.median(graphs[k]):.2f} ms")
    if smi is not None:
        log.seek(0)
        rows = [r.split(", ") for r in log.read().splitlines() if r.count(",") >= 4]
        busy = [r for r in rows if r[2].replace(" W", "").replace(".", "").isdigit() and float(r[2].split()[0]) > 200]
        if busy:
            clocks = [float(r[1].split()[0]) for r in busy]
            power = [float(r[2].split()[0]) for r in busy]
            reasons = sorted({r[4] for r in busy})
            print(f"nvidia-smi over {len(busy)} samples drawing > 200 W: SM clock median {statistics.median(clocks):.0f} MHz "
                  f"(min {min(clocks):.0f}, max {max(clocks):.0f}), power median {statistics.median(power):.0f} W "
                  f"(max {max(power):.0f}), throttle reasons {reasons}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
