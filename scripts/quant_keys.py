"""Which blockwise quantize launches a `lowbit train` run makes (diagnostic): wraps the Triton backend's blockwise
entry point, counts calls per (shape, dtype, 2D, rowwise, columnwise, caller), and prints the table at exit.

    PYTHONPATH=src python scripts/quant_keys.py train --model 1.3b --recipe fp8-block --steps 3 ...
"""
import atexit
import collections
import sys
import traceback

import lowbit.quant.triton_backend as tb

_counts = collections.Counter()
_orig = tb._blockwise


def _wrapped(qt, x2, sch, rowwise, columnwise):
    st = traceback.extract_stack(limit=8)[:-1]
    caller = " < ".join(f"{f.name}:{f.lineno}" for f in reversed(st[-4:]))
    _counts[(tuple(x2.shape), str(x2.dtype), sch.block_dim == 2, rowwise, columnwise, x2.is_contiguous(), caller)] += 1
    return _orig(qt, x2, sch, rowwise, columnwise)


tb._blockwise = _wrapped


@atexit.register
def _report():
    for k, n in sorted(_counts.items(), key=lambda kv: -kv[1]):
        print(f"{n:6d}  {k}")


if __name__ == "__main__":
    from lowbit.cli import main

    sys.exit(main(sys.argv[1:]))
