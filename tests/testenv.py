"""Test-environment helpers: whether Triton's interpreter runs here, the environment of a child process that runs
lowbit from another working directory, and the process-group wrapper of the multi-process tests."""
import functools
import os
import subprocess
import sys
import tempfile

_HERE = os.path.dirname(os.path.abspath(__file__))

_PROBE = """
import torch, triton, triton.language as tl

@triton.jit
def _probe(x_ptr, n):
    acc = 0.0
    for i in range(0, n, 1):  # a run-time loop bound, as most kernels here have
        acc += tl.load(x_ptr + i)
    tl.store(x_ptr, acc)

x = torch.ones(4)
_probe[(1,)](x, 4)
assert x[0].item() == 4.0, x
"""


@functools.lru_cache(maxsize=None)
def interpreter_problem() -> str | None:
    """None where Triton's interpreter (``TRITON_INTERPRET=1``) runs a kernel with a run-time loop bound here, else
    why not. (Triton 3.6's interpreter takes int() of a 1-element array there, which NumPy >= 2.3 refuses: the
    GPU machine's Triton 3.6 with NumPy 2.4 fails every interpreter test that way, while Triton 3.9 and NumPy 2.2
    are fine.) Probed once, in a child process: the interpreter must be chosen before triton is imported."""
    try:
        import numpy
        import triton
    except ImportError as e:
        return f"no interpreter: {e}"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "interp_probe.py")
        with open(path, "w") as f:
            f.write(_PROBE)
        r = subprocess.run([sys.executable, path], env=dict(os.environ, TRITON_INTERPRET="1"), capture_output=True,
                           text=True, timeout=300)
    if r.returncode == 0:
        return None
    return (f"Triton {triton.__version__}'s interpreter cannot run a kernel with a run-time loop bound under NumPy "
            f"{numpy.__version__} here: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}")


def child_env(**extra) -> dict:
    """os.environ for a child ``python -m lowbit ...`` run from another working directory: this checkout's ``src``
    first on PYTHONPATH and every other entry made absolute (a relative ``PYTHONPATH=src`` would not resolve from
    the child's cwd), plus ``extra``."""
    src = os.path.join(os.path.dirname(_HERE), "src")
    paths = [src] + [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)), **extra}


def gloo_process(rank: int, tmp: str, world: int, body, *args) -> None:
    """An ``mp.spawn`` target: rank ``rank`` of a ``world``-process gloo group (initialized through a file in ``tmp``)
    runs ``body(rank, tmp, *args)``: :func:`group_process` on the CPU."""
    group_process(rank, tmp, world, "cpu", body, *args)


def group_process(rank: int, tmp: str, world: int, device: str, body, *args) -> None:
    """An ``mp.spawn`` target: rank ``rank`` of a ``world``-process group (gloo on ``device`` "cpu", NCCL on "cuda"
    with the rank's GPU current; initialized through a file in ``tmp``) runs ``body(rank, tmp, *args)``. What the
    body made is freed, and the ranks meet, before the group is destroyed: FSDP2's modules hold the group through
    reference cycles, and left to the interpreter's exit a rank can abort after a good run ("terminate called
    without an active exception", seen under load)."""
    import gc

    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    try:
        body(rank, tmp, *args)
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
