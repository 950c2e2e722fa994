"""``x.t().contiguous()`` for a 2-D tensor as one tiled Triton kernel.

Where it is used: :func:`lowbit.gemm.wgrad_mm` may compute a weight gradient in the other operand order, XᵀdY
(K x N) instead of dYᵀX (N x K), because cuBLAS picks a faster kernel for some shapes; the result must then be
transposed into the weight's (N x K) layout. torch's transposing copy runs at about a quarter of copy speed there
(e.g. the 350m GPT's fc2 gradient, 2816 x 1024 FP32), which ate most of what the faster order saves.

The kernel reads a (BLOCK_R, BLOCK_C) tile along x's rows, transposes it in registers / shared memory
(``tl.trans``) and writes it along y's rows, so both the loads and the stores are coalesced. A pure data move:
bit-identical to torch's. Configs from :func:`transpose_configs` (tile sizes and warps, pruned to tiles of at most
16 K elements), tuned per (element size, rows bucket, columns bucket).
"""

from __future__ import annotations

import torch

from .autotune import bucket, tuned_launch
from .device import INTERPRET

__all__ = ["transpose_2d", "transpose_configs"]

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# the integer dtype each element size moves as (the kernel copies bits: floats, ints, bool and FP8 alike)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def transpose_configs(element_size: int) -> list[dict]:
    """Candidate (BLOCK_R, BLOCK_C, num_warps) for a tile of ``element_size``-byte elements: the first is the
    untuned default. Pruned to tiles of 4-16 K elements (a smaller tile leaves the 128-byte rows of the store
    partly used; a larger one spills)."""
    out = []
    for br, bc, w in ((64, 64, 4), (32, 32, 4), (64, 128, 4), (128, 64, 4), (64, 128, 8), (128, 128, 8),
                      (32, 128, 4), (128, 32, 4)):
        tile = br * bc
        # 1-byte elements: at least 64 rows and columns a tile, so each stored row is 64 bytes or more
        if element_size == 1 and min(br, bc) < 64:
            continue
        if 1024 <= tile <= 16384:
            out.append(dict(BLOCK_R=br, BLOCK_C=bc, num_warps=w))
    return out


if triton is not None:

    @triton.jit
    def _transpose_kernel(x_ptr, y_ptr, R, C, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """y (C, R) = x (R, C)ᵀ, both contiguous; program (i, j) moves x's tile at rows i·BLOCK_R, columns
        j·BLOCK_C."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        rm, cm = rows < R, cols < C
        t = tl.load(x_ptr + rows[:, None] * C + cols[None, :], mask=rm[:, None] & cm[None, :])
        tl.store(y_ptr + cols[:, None] * R + rows[None, :], tl.trans(t), mask=cm[:, None] & rm[None, :])


def transpose_2d(x: torch.Tensor) -> torch.Tensor:
    """``x.t().contiguous()``: a new contiguous (C, R) tensor of x's dtype and device.

    Args:
        x: (R, C) contiguous, any dtype of 1, 2, 4 or 8 bytes an element (float, integer, FP8 bytes).

    One Triton kernel on CUDA (and under the interpreter); torch's transposing copy elsewhere (CPU, no Triton,
    empty tensors). Bit-identical either way: it moves bits, no arithmetic."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got {x.dim()}-D of shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"x: expected a contiguous tensor, got strides {tuple(x.stride())} for shape {tuple(x.shape)}")
    if x.element_size() not in _BITS or x.is_complex():
        raise NotImplementedError(f"x: dtype {x.dtype} ({x.element_size()} bytes an element) is not supported; "
                                  f"expected a real dtype of {'/'.join(map(str, _BITS))} bytes")
    if triton is None or not (x.is_cuda or INTERPRET) or x.numel() == 0:
        return x.t().contiguous()
    R, C = x.shape
    y = torch.empty((C, R), dtype=x.dtype, device=x.device)
    xv, yv = x.view(_BITS[x.element_size()]), y.view(_BITS[x.element_size()])

    def launch(c):
        _transpose_kernel[(triton.cdiv(R, c["BLOCK_R"]), triton.cdiv(C, c["BLOCK_C"]))](
            xv, yv, R, C, BLOCK_R=c["BLOCK_R"], BLOCK_C=c["BLOCK_C"], num_warps=c["num_warps"])

    if INTERPRET:
        launch(dict(BLOCK_R=16, BLOCK_C=32, num_warps=4))  # (small tiles: the interpreter is slow)
        return y
    # (wgrad_mm's order tuner times a launch that calls this: untuned inside its capture, tuned_launch takes the
    # first config)
    tuned_launch("transpose_2d", (x.element_size(), bucket(R), bucket(C)),
                 lambda: transpose_configs(x.element_size()),
                 launch)
    return y
